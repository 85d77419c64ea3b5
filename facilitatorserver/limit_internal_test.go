package facilitatorserver

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
)

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// A bucket holds a minute's calls, refills at that rate, says how long until the next call, and takes back a
// refunded call.
func TestARateBucketAllowsItsRatePerMinuteAndSaysWhenToComeBack(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	rb := newRateBuckets(6, 100, clock.now) // one call every 10 s
	for i := 0; i < 6; i++ {
		if ok, _ := rb.take("a"); !ok {
			t.Fatalf("call %d refused, want the first 6 allowed at once", i+1)
		}
	}
	ok, wait := rb.take("a")
	if ok || wait != 10*time.Second {
		t.Fatalf("7th call = %v, wait %v; want refused, 10s until the next", ok, wait)
	}
	if ok, _ := rb.take("b"); !ok {
		t.Fatal("another key was refused: the limit is per key")
	}
	clock.advance(4 * time.Second)
	if ok, wait := rb.take("a"); ok || wait != 6*time.Second {
		t.Fatalf("after 4s = %v, wait %v; want refused, 6s to go", ok, wait)
	}
	clock.advance(6 * time.Second)
	if ok, _ := rb.take("a"); !ok {
		t.Fatal("refused after 10s, want one call allowed")
	}
	if ok, _ := rb.take("a"); ok {
		t.Fatal("a second call allowed after 10s, want one")
	}
	rb.refund("a")
	if ok, _ := rb.take("a"); !ok {
		t.Fatal("refused after a refund, want the refunded call allowed")
	}
}

// The keys a limit remembers are bounded, and a full table never turns a new key away: the newcomer takes the
// place of the least recently used key, whose count is forgotten; a key that called since keeps its count. Keys
// not used for a minute are forgotten without waiting for the table to fill.
func TestRateBucketsNeverTurnANewKeyAwayAndForgetTheLeastRecentlyUsed(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	rb := newRateBuckets(2, 10, clock.now)
	for i := 0; i < 10; i++ {
		rb.take(strconv.Itoa(i))
		rb.take(strconv.Itoa(i)) // every key's bucket empty
		clock.advance(time.Second)
	}
	rb.take("0") // key 0 is now the most recently used (and refused: empty)
	for i := range 3 {
		if ok, wait := rb.take("new" + strconv.Itoa(i)); !ok {
			t.Fatalf("new key %d with the table full = refused, wait %v; want taken", i, wait)
		}
		if n := rb.size(); n != 10 {
			t.Fatalf("%d keys remembered, want the bound 10", n)
		}
	}
	// Keys 1, 2 and 3 were the least recently used: forgotten, they start afresh.
	if ok, _ := rb.take("1"); !ok {
		t.Error("key 1, forgotten to make room, is refused; want a fresh bucket")
	}
	// Key 0 called after them, and keys 5 to 9 were not evicted: they keep their empty buckets.
	for _, k := range []string{"0", "5", "9"} {
		if ok, _ := rb.take(k); ok {
			t.Errorf("key %s was allowed a call: its count was dropped though others were used less recently", k)
		}
	}
	// A minute later every key has refilled and is forgotten by the next call.
	clock.advance(time.Minute)
	rb.take("other")
	if n := rb.size(); n != 1 {
		t.Fatalf("%d keys remembered a minute after their last call, want 1", n)
	}
}

// An attacker who keeps a full table's worth of keys busy does not lock out anyone: a newcomer gets its calls,
// and the busy keys still have their counts, as long as they were used more recently than max others.
func TestAFullTableOfBusyKeysLocksNobodyOut(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	rb := newRateBuckets(3, 100, clock.now)
	for round := range 5 {
		for i := range 100 {
			rb.take("attacker" + strconv.Itoa(i))
		}
		if ok, _ := rb.take("newcomer" + strconv.Itoa(round)); !ok {
			t.Fatalf("round %d: a newcomer refused while the table is full of busy keys", round)
		}
		clock.advance(time.Second)
	}
	if n := rb.size(); n != 100 {
		t.Fatalf("%d keys remembered, want the bound 100", n)
	}
}

// A client IP is an IPv4 address, or an IPv6 network of the configured prefix: the addresses of one network
// share a bucket, an IPv4-mapped IPv6 address is its IPv4 address, a zone is no other client, and what is no
// address is counted as it is.
func TestAClientLimitCountsIPv6ByPrefixAndIPv4ByAddress(t *testing.T) {
	for _, tc := range []struct {
		prefix    int
		ip        string
		key, word string
	}{
		{0, "203.0.113.7", "203.0.113.7", "client IP 203.0.113.7"},
		{0, "::ffff:203.0.113.7", "203.0.113.7", "client IP 203.0.113.7"},
		{0, "2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64", "client network 2001:db8:1:2::/64"},
		{0, "2001:db8:1:2::1", "2001:db8:1:2::/64", "client network 2001:db8:1:2::/64"},
		{0, "fe80::1%eth0", "fe80::/64", "client network fe80::/64"},
		{56, "2001:db8:1:2ff::1", "2001:db8:1:200::/56", "client network 2001:db8:1:200::/56"},
		{48, "2001:db8:1:ffff::1", "2001:db8:1::/48", "client network 2001:db8:1::/48"},
		{128, "2001:db8::1", "2001:db8::1", "client IP 2001:db8::1"},
		{56, "198.51.100.1", "198.51.100.1", "client IP 198.51.100.1"},
		{0, "@", "@", "client @"},
	} {
		l := newClientLimit(1, tc.prefix, nil)
		key, word := l.client(tc.ip)
		if key != tc.key || word != tc.word {
			t.Errorf("/%d: client(%q) = %q, %q; want %q, %q", tc.prefix, tc.ip, key, word, tc.key, tc.word)
		}
	}
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	l := newClientLimit(2, 0, clock.now)
	for _, ip := range []string{"2001:db8:5:6::1", "2001:db8:5:6:ffff::2"} {
		if ok, _, _ := l.take(ip); !ok {
			t.Fatalf("call from %s refused; want the /64's two calls allowed", ip)
		}
	}
	if ok, who, wait := l.take("2001:db8:5:6::abcd"); ok || who != "client network 2001:db8:5:6::/64" || wait != 30*time.Second {
		t.Fatalf("third call of the /64 = %v, %q, wait %v; want refused, naming the /64, 30s to wait", ok, who, wait)
	}
	if ok, _, _ := l.take("2001:db8:5:7::1"); !ok {
		t.Fatal("another /64 refused; want a limit of its own")
	}
}

// Concurrent takers of one key get exactly the bucket's tokens between them.
func TestRateBucketsCountExactlyUnderConcurrency(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	rb := newRateBuckets(50, 1000, clock.now)
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 100; i++ {
				if ok, _ := rb.take("k"); ok {
					allowed.Add(1)
				}
				rb.take(strconv.Itoa(i)) // other keys, to race the map too
			}
		}()
	}
	wg.Wait()
	if n := allowed.Load(); n != 50 {
		t.Fatalf("%d of 800 concurrent calls allowed, want 50", n)
	}
}

// hangingCounts are shared counts that never answer: a database that hangs.
type hangingCounts struct{ asked atomic.Int32 }

func (h *hangingCounts) TakeToken(ctx context.Context, _ string, _ int) (bool, time.Duration, error) {
	h.asked.Add(1)
	<-ctx.Done()
	return false, 0, ctx.Err()
}

func (h *hangingCounts) GiveToken(ctx context.Context, _ string, _ int) error {
	<-ctx.Done()
	return ctx.Err()
}

// Shared counts that hang cost a call at most sharedTakeTimeout, after which the limit counts in memory, and are
// not asked again for sharedDownFor: a slow database neither refuses every call, nor lifts the limit, nor adds its
// delay to every call.
func TestSharedCountsThatHangAreGivenUpAndTheLimitHoldsInMemory(t *testing.T) {
	clock := &fakeClock{t: time.Now()}
	hang := &hangingCounts{}
	l := newSettleLimiter(RateLimit{PerIP: 2}, func() SharedCounts { return hang }, zap.NewNop(), clock.now)
	start := time.Now()
	if _, ok := l.takeIP(context.Background(), "198.51.100.1"); !ok {
		t.Fatal("the first call was refused while the shared counts hang; want it counted in memory")
	}
	if took := time.Since(start); took < sharedTakeTimeout || took > sharedTakeTimeout+time.Second {
		t.Fatalf("the first call took %v; want the shared counts given up after %v", took, sharedTakeTimeout)
	}
	start = time.Now()
	if _, ok := l.takeIP(context.Background(), "198.51.100.1"); !ok {
		t.Fatal("the second call was refused; want the limit's 2")
	}
	if res, ok := l.takeIP(context.Background(), "198.51.100.1"); ok || res.status != http.StatusTooManyRequests || res.retryAfter < 1 {
		t.Fatalf("the third call = %v, %+v; want 429 with Retry-After: the limit holds in memory", ok, res)
	}
	if took, n := time.Since(start), hang.asked.Load(); took > 100*time.Millisecond || n != 1 {
		t.Fatalf("the calls after the first took %v and asked the shared counts %d times in all; want them not asked again within %v",
			took, n, sharedDownFor)
	}
	clock.advance(sharedDownFor)
	l.takeIP(context.Background(), "198.51.100.2")
	if n := hang.asked.Load(); n != 2 {
		t.Fatalf("the shared counts were asked %d times after %v; want asked again", n, sharedDownFor)
	}
}

// A key the database might refuse (long, or not printable ASCII) is named by its hash in the shared counts.
func TestSharedKeysAreHashedWhenLongOrNotPrintable(t *testing.T) {
	l := newSettleLimiter(RateLimit{PerIP: 2}, nil, zap.NewNop(), nil)
	if k := l.sharedKey("settle_rate_limit per_ip", l.ip.buckets, "203.0.113.7"); k != "settle_rate_limit per_ip 2/min 203.0.113.7" {
		t.Errorf("sharedKey of an IP = %q", k)
	}
	for _, key := range []string{strings.Repeat("a", 101), "a\x00b", "\xff"} {
		k := l.sharedKey("settle_rate_limit per_ip", l.ip.buckets, key)
		if !strings.HasPrefix(k, "settle_rate_limit per_ip 2/min sha256:") || len(k) != len("settle_rate_limit per_ip 2/min sha256:")+64 {
			t.Errorf("sharedKey(%q) = %q; want its hash", key, k)
		}
	}
}
