package facilitatorserver

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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

// The keys a limit remembers are bounded: keys whose buckets have refilled are forgotten, and when the bound is
// reached by keys that all called within the minute, a new key is refused rather than the map growing or a busy
// key's count being dropped.
func TestRateBucketsForgetRefilledKeysAndNeverGrowPastTheirBound(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	rb := newRateBuckets(2, 10, clock.now)
	for i := 0; i < 10; i++ {
		if ok, _ := rb.take(strconv.Itoa(i)); !ok {
			t.Fatalf("key %d refused", i)
		}
	}
	rb.take("0") // key 0 is now empty
	if ok, wait := rb.take("new"); ok || wait <= 0 {
		t.Fatalf("a new key with the map full of active keys = %v, wait %v; want refused", ok, wait)
	}
	if n := rb.size(); n != 10 {
		t.Fatalf("%d keys remembered, want the bound 10", n)
	}
	// After 30s every key but 0 has refilled (one call taken, one refilled): they are forgotten to make room.
	clock.advance(30 * time.Second)
	if ok, _ := rb.take("new"); !ok {
		t.Fatal("a new key refused once the others refilled")
	}
	if n := rb.size(); n != 2 {
		t.Fatalf("%d keys remembered, want 2 (key 0, still short, and the new one)", n)
	}
	if ok, _ := rb.take("0"); !ok {
		t.Fatal("key 0 refused after 30s, want the call refilled meanwhile")
	}
	if ok, _ := rb.take("0"); ok {
		t.Fatal("key 0 allowed twice: its count was dropped")
	}
	// The periodic sweep forgets refilled keys without waiting for the map to fill.
	clock.advance(2 * time.Minute)
	rb.take("other")
	if n := rb.size(); n != 1 {
		t.Fatalf("%d keys remembered after the sweep, want 1", n)
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
