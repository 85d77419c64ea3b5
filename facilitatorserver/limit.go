package facilitatorserver

import (
	"fmt"
	"math"
	"net/http"
	"sync"
	"time"
)

// RateLimit caps how often /settle is called, per client IP and per payer, so that nobody can make a facilitator
// send settlement after settlement (each paying gas) as fast as they can sign them. A call over a limit is
// answered 429 with Retry-After and never reaches the facilitator behind. Limits are per minute, as token
// buckets: up to the limit at once, then one more each 60s/limit. They are kept in memory by the Server.
type RateLimit struct {
	// PerIP is the number of /settle calls a client IP may make per minute; 0: no limit. Every call counts,
	// malformed or refused ones too; calls refused for their API key or method do not.
	PerIP int
	// PerPayer is the number of settlements per minute of the payer a payment names; 0: no limit. It counts the
	// /settle calls whose answer carries a transaction hash, and those that got no answer from the facilitator
	// behind; a call refused before anything was sent does not count, so that a payload that merely names
	// someone else as payer cannot use up that payer's budget.
	PerPayer int
}

// MaxPerMinute is the highest rate a RateLimit takes: a thousand settlements a second.
const MaxPerMinute = 60_000

// settleLimiter enforces a RateLimit.
type settleLimiter struct {
	ip, payer *rateBuckets // nil: no limit of that kind
}

// newSettleLimiter returns the limiter of l, or nil when l limits nothing.
func newSettleLimiter(l RateLimit, now func() time.Time) *settleLimiter {
	if l.PerIP == 0 && l.PerPayer == 0 {
		return nil
	}
	s := &settleLimiter{}
	if l.PerIP > 0 {
		s.ip = newRateBuckets(l.PerIP, rateBucketsMax, now)
	}
	if l.PerPayer > 0 {
		s.payer = newRateBuckets(l.PerPayer, rateBucketsMax, now)
	}
	return s
}

// takeIP counts a /settle call of the client IP; a refusal is the 429 to answer.
func (s *settleLimiter) takeIP(ip string) (reply, bool) {
	if s == nil || s.ip == nil {
		return reply{}, true
	}
	if ok, wait := s.ip.take(ip); !ok {
		return tooManySettlements(wait, "client IP %s has made more than %d /settle calls in the last minute (settle_rate_limit per_ip)", ip, s.ip.perMinute)
	}
	return reply{}, true
}

// takePayer counts a settlement of payer ("" when the payload names none: not limited here, and refused behind).
func (s *settleLimiter) takePayer(payer string) (reply, bool) {
	if s == nil || s.payer == nil || payer == "" {
		return reply{}, true
	}
	if ok, wait := s.payer.take(payer); !ok {
		return tooManySettlements(wait, "payer %s has had more than %d settlements in the last minute (settle_rate_limit per_payer)", payer, s.payer.perMinute)
	}
	return reply{}, true
}

// refundPayer gives back the count of a settlement that sent nothing.
func (s *settleLimiter) refundPayer(payer string) {
	if s == nil || s.payer == nil || payer == "" {
		return
	}
	s.payer.refund(payer)
}

// tooManySettlements is the 429 answer: what was exceeded, and when to come back.
func tooManySettlements(wait time.Duration, format string, args ...any) (reply, bool) {
	secs := max(1, int(math.Ceil(wait.Seconds())))
	res := errorReply(http.StatusTooManyRequests, "%s; nothing was sent: retry after %d s", fmt.Sprintf(format, args...), secs)
	res.retryAfter = secs
	return res, false
}

// rateBucketsMax bounds the keys one limit remembers. A key whose bucket has filled up again (a minute after
// its last call at most) is forgotten; when this many keys have called within the last minute, a new key is
// refused until some are forgotten, rather than the memory growing or a busy key's count being dropped.
const rateBucketsMax = 65536

// rateBuckets is a token bucket per key: perMinute tokens at most, refilled at perMinute a minute.
type rateBuckets struct {
	perMinute int
	max       int
	now       func() time.Time

	mu        sync.Mutex
	buckets   map[string]*rateBucket
	lastSweep time.Time
}

type rateBucket struct {
	tokens float64
	at     time.Time // when tokens was last brought up to date
}

func newRateBuckets(perMinute, max int, now func() time.Time) *rateBuckets {
	if now == nil {
		now = time.Now
	}
	return &rateBuckets{perMinute: perMinute, max: max, now: now, buckets: map[string]*rateBucket{}, lastSweep: now()}
}

// refill brings b up to date at now and reports whether it is full (then it is as good as forgotten).
func (rb *rateBuckets) refill(b *rateBucket, now time.Time) bool {
	if elapsed := now.Sub(b.at); elapsed > 0 {
		b.tokens = min(float64(rb.perMinute), b.tokens+elapsed.Minutes()*float64(rb.perMinute))
		b.at = now
	}
	return b.tokens >= float64(rb.perMinute)
}

// take takes a token of key. Without one, it says how long until the next.
func (rb *rateBuckets) take(key string) (bool, time.Duration) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	now := rb.now()
	if now.Sub(rb.lastSweep) >= time.Minute {
		rb.sweep(now)
	}
	b := rb.buckets[key]
	if b == nil {
		if len(rb.buckets) >= rb.max && (now.Sub(rb.lastSweep) < time.Second || rb.sweep(now) == 0) {
			// Full of keys that all called within the last minute: refuse the newcomer (see rateBucketsMax).
			return false, time.Minute / time.Duration(rb.perMinute)
		}
		b = &rateBucket{tokens: float64(rb.perMinute), at: now}
		rb.buckets[key] = b
	}
	rb.refill(b, now)
	if b.tokens < 1 {
		return false, time.Duration((1 - b.tokens) * float64(time.Minute) / float64(rb.perMinute))
	}
	b.tokens--
	return true, 0
}

// refund gives key back a token it took.
func (rb *rateBuckets) refund(key string) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if b := rb.buckets[key]; b != nil {
		b.tokens = min(float64(rb.perMinute), b.tokens+1)
	}
}

// sweep forgets the keys whose buckets are full again, and says how many.
func (rb *rateBuckets) sweep(now time.Time) int {
	rb.lastSweep = now
	n := 0
	for k, b := range rb.buckets {
		if rb.refill(b, now) {
			delete(rb.buckets, k)
			n++
		}
	}
	return n
}

// size is the number of keys remembered.
func (rb *rateBuckets) size() int {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return len(rb.buckets)
}
