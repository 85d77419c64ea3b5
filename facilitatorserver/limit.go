package facilitatorserver

import (
	"container/list"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// RateLimit caps how often /settle is called, per client IP and per payer, so that nobody can make a facilitator
// send settlement after settlement (each paying gas) as fast as they can sign them. A call over a limit is
// answered 429 with Retry-After and never reaches the facilitator behind. Limits are per minute, as token
// buckets: up to the limit at once, then one more each 60s/limit. They are kept in memory by the Server, or in
// Options.SharedCounts when several servers enforce them together.
type RateLimit struct {
	// PerIP is the number of /settle calls a client may make per minute; 0: no limit. Every call counts,
	// malformed or refused ones too; calls refused for their API key or method do not. A client is an IPv4
	// address, or an IPv6 network of IPv6Prefix bits.
	PerIP int
	// IPv6Prefix is how many leading bits of an IPv6 address name one client for PerIP; 0: DefaultIPv6Prefix.
	IPv6Prefix int
	// PerPayer is the number of settlements per minute of the payer a payment names; 0: no limit. It counts the
	// /settle calls whose answer carries a transaction hash, and those that got no answer from the facilitator
	// behind; a call refused before anything was sent does not count, so that a payload that merely names
	// someone else as payer cannot use up that payer's budget.
	PerPayer int
}

// VerifyRateLimit caps, per client, the /verify calls the facilitator behind answers with anything but a valid
// payment: a refusal or a failure. Such a call costs the facilitator its work and often a chain read (a forged
// signature costs an eth_getCode, an ERC-6492 wrapper a simulation), and asks nothing of the caller: nothing is
// signed by anyone who holds funds. A valid payment costs nothing against the limit, so that a resource server
// passing on its clients' payments is held back only by the bad ones; refusals the Server makes itself (kind,
// network, terms, a malformed body) cost no chain read and do not count either. Over the limit, every /verify
// of the client is answered 429 with Retry-After, before the facilitator behind is asked, until the bucket
// refills (the limit per minute, as for RateLimit).
type VerifyRateLimit struct {
	// PerIP is the number of refused or failed /verify calls a client may have per minute; 0: no limit.
	PerIP int
	// IPv6Prefix is how many leading bits of an IPv6 address name one client; 0: DefaultIPv6Prefix.
	IPv6Prefix int
}

// MaxPerMinute is the highest rate a RateLimit takes: a thousand settlements a second.
const MaxPerMinute = 60_000

// DefaultIPv6Prefix is the IPv6 prefix length counted as one client: a /64 is the smallest network a
// subscriber is given, and holds 2^64 addresses any one of which its owner may send from.
const DefaultIPv6Prefix = 64

// checkIPv6Prefix checks a configured IPv6 prefix length (0 for the default); name is what to call it.
func checkIPv6Prefix(name string, bits int) error {
	if bits < 0 || bits > 128 {
		return fmt.Errorf("%s is %d bits; want 1 to 128 (0 for the default, %d)", name, bits, DefaultIPv6Prefix)
	}
	return nil
}

// clientLimit is a per-client limit: one token bucket per IPv4 address or IPv6 network.
type clientLimit struct {
	buckets    *rateBuckets
	ipv6Prefix int
}

func newClientLimit(perMinute, ipv6Prefix int, now func() time.Time) *clientLimit {
	if perMinute == 0 {
		return nil
	}
	if ipv6Prefix == 0 {
		ipv6Prefix = DefaultIPv6Prefix
	}
	return &clientLimit{buckets: newRateBuckets(perMinute, rateBucketsMax, now), ipv6Prefix: ipv6Prefix}
}

// client names the client of address ip as a limit counts it, and in words for an answer: an IPv4 address
// (an IPv4-mapped IPv6 one too) is itself, an IPv6 address its network of l.ipv6Prefix bits, anything else
// (not an address) is counted as it is.
func (l *clientLimit) client(ip string) (key, words string) {
	addr, err := netip.ParseAddr(ip)
	if err != nil {
		return ip, "client " + ip
	}
	addr = addr.Unmap().WithZone("")
	if addr.Is4() || l.ipv6Prefix >= 128 {
		return addr.String(), "client IP " + addr.String()
	}
	p, err := addr.Prefix(l.ipv6Prefix)
	if err != nil { // not reached: the prefix length was checked
		return addr.String(), "client IP " + addr.String()
	}
	return p.String(), "client network " + p.String()
}

// take counts a call of the client at ip. Refused, it says who was refused and how long to wait.
func (l *clientLimit) take(ip string) (ok bool, words string, wait time.Duration) {
	key, words := l.client(ip)
	ok, wait = l.buckets.take(key)
	return ok, words, wait
}

// refund gives the client at ip back a call it was counted for.
func (l *clientLimit) refund(ip string) {
	key, _ := l.client(ip)
	l.buckets.refund(key)
}

// SharedCounts keeps token buckets where several servers take from them at once, so that a cluster of servers
// enforces one /settle rate limit rather than one per server (the journal's PostgreSQL store is one). Buckets
// are named by key and hold perMinute tokens at most, refilled at perMinute a minute, as the in-memory ones.
type SharedCounts interface {
	// TakeToken takes a token of key's bucket; without one it takes nothing and says how long until the next.
	// An error takes nothing.
	TakeToken(ctx context.Context, key string, perMinute int) (ok bool, wait time.Duration, err error)
	// GiveToken gives key's bucket back a token TakeToken took.
	GiveToken(ctx context.Context, key string, perMinute int) error
}

// When the shared counts do not answer within sharedTakeTimeout (the database slow or down), the limits count
// in memory for sharedDownFor before they ask again. Chosen over refusing (a database outage would then refuse
// every payer, for a limit whose only purpose is to stop abuse) and over letting calls through uncounted (an
// attacker who can slow the database would lift the limit): meanwhile each server enforces the limit on its own,
// so a cluster of N allows at most N times it, and says so in its log. Asking again only after a while keeps a
// slow database from adding its delay to every /settle and from being asked more while it struggles.
const (
	sharedTakeTimeout = time.Second
	sharedDownFor     = 5 * time.Second
	// sharedWarnEvery bounds how often counting in memory is logged.
	sharedWarnEvery = 10 * time.Second
)

// settleLimiter enforces a RateLimit.
type settleLimiter struct {
	ip    *clientLimit // nil: no limit per client
	payer *rateBuckets // nil: no limit per payer

	shared    func() SharedCounts // nil, or nil returned: in memory only
	logger    *zap.Logger
	now       func() time.Time
	downUntil atomic.Int64 // unix nanoseconds until which the shared counts are not asked
	warned    atomic.Int64 // unix nanoseconds of the last warning
}

// newSettleLimiter returns the limiter of l, or nil when l limits nothing.
func newSettleLimiter(l RateLimit, shared func() SharedCounts, logger *zap.Logger, now func() time.Time) *settleLimiter {
	if l.PerIP == 0 && l.PerPayer == 0 {
		return nil
	}
	if now == nil {
		now = time.Now
	}
	s := &settleLimiter{ip: newClientLimit(l.PerIP, l.IPv6Prefix, now), shared: shared, logger: logger, now: now}
	if l.PerPayer > 0 {
		s.payer = newRateBuckets(l.PerPayer, rateBucketsMax, now)
	}
	return s
}

// takeIP counts a /settle call of the client IP; a refusal is the 429 to answer.
func (s *settleLimiter) takeIP(ctx context.Context, ip string) (reply, bool) {
	if s == nil || s.ip == nil {
		return reply{}, true
	}
	key, who := s.ip.client(ip)
	if ok, wait, _ := s.take(ctx, "settle_rate_limit per_ip", s.ip.buckets, key); !ok {
		return tooManySettlements(wait, "%s has made more than %d /settle calls in the last minute (settle_rate_limit per_ip)", who, s.ip.buckets.perMinute)
	}
	return reply{}, true
}

// takePayer counts a settlement of payer ("" when the payload names none: not limited here, and refused behind).
// shared says where the count was taken, for refundPayer.
func (s *settleLimiter) takePayer(ctx context.Context, payer string) (res reply, ok, shared bool) {
	if s == nil || s.payer == nil || payer == "" {
		return reply{}, true, false
	}
	ok, wait, shared := s.take(ctx, "settle_rate_limit per_payer", s.payer, payer)
	if !ok {
		res, _ = tooManySettlements(wait, "payer %s has had more than %d settlements in the last minute (settle_rate_limit per_payer)", payer, s.payer.perMinute)
	}
	return res, ok, shared
}

// refundPayer gives back the count of a settlement that sent nothing, where takePayer took it.
func (s *settleLimiter) refundPayer(ctx context.Context, payer string, shared bool) {
	if s == nil || s.payer == nil || payer == "" {
		return
	}
	if !shared {
		s.payer.refund(payer)
		return
	}
	if sc := s.sharedCounts(); sc != nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sharedTakeTimeout)
		defer cancel()
		if err := sc.GiveToken(ctx, s.sharedKey("settle_rate_limit per_payer", s.payer, payer), s.payer.perMinute); err != nil {
			// The payer keeps the count of a call that sent nothing, until its bucket refills.
			s.logger.Debug("giving back a payer's settlement count failed", zap.Error(err))
		}
	}
}

// take takes a token of key in the limit called limit: from the shared counts when there are some and they
// answer, else from local; shared says which.
func (s *settleLimiter) take(ctx context.Context, limit string, local *rateBuckets, key string) (ok bool, wait time.Duration, shared bool) {
	if sc := s.sharedCounts(); sc != nil {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), sharedTakeTimeout)
		ok, wait, err := sc.TakeToken(tctx, s.sharedKey(limit, local, key), local.perMinute)
		cancel()
		if err == nil {
			return ok, wait, true
		}
		now := s.now()
		s.downUntil.Store(now.Add(sharedDownFor).UnixNano())
		if last := s.warned.Load(); now.UnixNano()-last >= int64(sharedWarnEvery) && s.warned.CompareAndSwap(last, now.UnixNano()) {
			s.logger.Warn("the settle rate limits shared by the cluster did not answer: each instance counts in memory meanwhile, "+
				"so that the cluster allows up to the limit once per instance", zap.String("limit", limit), zap.Error(err))
		}
	}
	ok, wait = local.take(key)
	return ok, wait, false
}

// sharedCounts is where the limits count now: the shared counts, unless there are none or they were down lately.
func (s *settleLimiter) sharedCounts() SharedCounts {
	if s.shared == nil || s.now().UnixNano() < s.downUntil.Load() {
		return nil
	}
	return s.shared()
}

// sharedKey names key's bucket in the shared counts: the limit and its rate too, so that servers configured with
// different rates (a reload that changes it) do not share a bucket. A key that is long or not printable ASCII (what
// a ClientIP of the embedder's may return) is named by its hash: the database would refuse some such keys, and a
// refusal would send every limit to memory for a while.
func (s *settleLimiter) sharedKey(limit string, local *rateBuckets, key string) string {
	if len(key) > 100 || strings.ContainsFunc(key, func(r rune) bool { return r < ' ' || r > '~' }) {
		sum := sha256.Sum256([]byte(key))
		key = "sha256:" + hex.EncodeToString(sum[:])
	}
	return fmt.Sprintf("%s %d/min %s", limit, local.perMinute, key)
}

// tooManySettlements is the 429 answer of /settle: what was exceeded, and when to come back. Its body is an
// error, not a SettleResponse: a caller that read a refusal in it might tell a payer whose payment settled on
// an earlier call to pay again.
func tooManySettlements(wait time.Duration, format string, args ...any) (reply, bool) {
	secs := retryAfter(wait)
	// No "sent": false (see errorBody.Sent): this call reached nothing, but an earlier one for the same payment may
	// have, and may be settling it now; a caller told nothing was sent would take the payment elsewhere.
	res := errorReply(http.StatusTooManyRequests, "%s; nothing was sent: retry after %d s", fmt.Sprintf(format, args...), secs)
	res.retryAfter = secs
	return res, false
}

// tooManyVerifications is the 429 answer of /verify: a VerifyResponse that refuses nothing for good
// (unexpected_verify_error, as a facilitator in trouble answers), with what was exceeded and when to come back,
// also as the error every other non-200 answer of the Server carries. A verification refused is harmless to
// misread: nothing was charged.
func tooManyVerifications(l *clientLimit, who string, wait time.Duration, payer string) reply {
	secs := retryAfter(wait)
	msg := fmt.Sprintf("%s has had more than %d /verify calls refused or failed in the last minute (verify_rate_limit per_ip); the payment was not verified: retry after %d s",
		who, l.buckets.perMinute, secs)
	return reply{status: http.StatusTooManyRequests, retryAfter: secs, body: rateLimitedVerify{
		VerifyResponse: x402.VerifyResponse{Payer: payer, InvalidReason: x402.ReasonUnexpectedVerifyError, InvalidMessage: msg},
		Error:          msg,
	}}
}

// rateLimitedVerify is the body of a 429 /verify answer.
type rateLimitedVerify struct {
	x402.VerifyResponse
	Error string `json:"error"`
}

// retryAfter is a wait in whole seconds, at least one.
func retryAfter(wait time.Duration) int {
	return max(1, int(math.Ceil(wait.Seconds())))
}

// rateBucketsMax bounds the keys one limit remembers.
const rateBucketsMax = 65536

// rateBuckets is a token bucket per key: perMinute tokens at most, refilled at perMinute a minute. It remembers
// at most max keys, the most recently used ones: a key not used for a minute has a full bucket again and is
// forgotten, and when max keys are remembered a new key takes the place of the least recently used one.
//
// Evicting the least recently used key is chosen over refusing newcomers (a full table would turn every new
// client away for as long as someone keeps max keys busy, which a /48 of IPv6 networks does easily) and over a
// bucket that every newcomer shares (the same someone would drain it and starve the newcomers just as well). The
// price is that a key can lose its count, but only after max other keys have called since its last call: a
// client gains a fresh bucket that way only by being one of more than max clients calling in turn, at which
// rate the limit per client was not what held it back.
type rateBuckets struct {
	perMinute int
	max       int
	now       func() time.Time

	mu      sync.Mutex
	buckets map[string]*list.Element // of *rateBucket, in recent
	recent  list.List                // most recently used first
}

type rateBucket struct {
	key    string
	tokens float64
	at     time.Time // when tokens was last brought up to date
}

func newRateBuckets(perMinute, max int, now func() time.Time) *rateBuckets {
	if now == nil {
		now = time.Now
	}
	return &rateBuckets{perMinute: perMinute, max: max, now: now, buckets: map[string]*list.Element{}}
}

// refill brings b up to date at now.
func (rb *rateBuckets) refill(b *rateBucket, now time.Time) {
	if elapsed := now.Sub(b.at); elapsed > 0 {
		b.tokens = min(float64(rb.perMinute), b.tokens+elapsed.Minutes()*float64(rb.perMinute))
		b.at = now
	}
}

// take takes a token of key. Without one, it says how long until the next.
func (rb *rateBuckets) take(key string) (bool, time.Duration) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	now := rb.now()
	rb.forgetIdle(now)
	var b *rateBucket
	if e := rb.buckets[key]; e != nil {
		rb.recent.MoveToFront(e)
		b = e.Value.(*rateBucket)
		rb.refill(b, now)
	} else {
		if len(rb.buckets) >= rb.max {
			oldest := rb.recent.Back()
			delete(rb.buckets, oldest.Value.(*rateBucket).key)
			rb.recent.Remove(oldest)
		}
		b = &rateBucket{key: key, tokens: float64(rb.perMinute), at: now}
		rb.buckets[key] = rb.recent.PushFront(b)
	}
	if b.tokens < 1 {
		return false, time.Duration((1 - b.tokens) * float64(time.Minute) / float64(rb.perMinute))
	}
	b.tokens--
	return true, 0
}

// forgetIdle forgets the keys not used for a minute: their buckets have refilled, so they are as good as new.
// The least recently used come last, so this reads only what it forgets, and one more.
func (rb *rateBuckets) forgetIdle(now time.Time) {
	for e := rb.recent.Back(); e != nil; e = rb.recent.Back() {
		b := e.Value.(*rateBucket)
		if now.Sub(b.at) < time.Minute {
			return
		}
		delete(rb.buckets, b.key)
		rb.recent.Remove(e)
	}
}

// refund gives key back a token it took.
func (rb *rateBuckets) refund(key string) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if e := rb.buckets[key]; e != nil {
		b := e.Value.(*rateBucket)
		b.tokens = min(float64(rb.perMinute), b.tokens+1)
	}
}

// size is the number of keys remembered.
func (rb *rateBuckets) size() int {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return len(rb.buckets)
}
