package gate

import (
	"testing"
	"time"
)

// TestAJournalClosingWaitsForRequestsAtWorkButNotForOpenTunnels is storeUsers' wait, which a journal's close runs
// first: a request at work holds it up to its bound, one whose tunnel is open does not, and one whose tunnel opens
// or ends while the close waits wakes it or holds it again.
func TestAJournalClosingWaitsForRequestsAtWorkButNotForOpenTunnels(t *testing.T) {
	waited := func(u *storeUsers, max time.Duration) time.Duration {
		began := time.Now()
		u.waitIdle(max)
		return time.Since(began)
	}
	u := &storeUsers{}
	if d := waited(u, 5*time.Second); d > time.Second {
		t.Fatalf("with no request at work the close waited %v", d)
	}
	u.add(1)
	if d := waited(u, 200*time.Millisecond); d < 200*time.Millisecond {
		t.Fatalf("a request at work: the close waited %v, want its bound (200ms)", d)
	}
	u.tunnel(1)
	if d := waited(u, 5*time.Second); d > time.Second {
		t.Fatalf("a request whose tunnel is open: the close waited %v, want no wait", d)
	}
	go func() { time.Sleep(50 * time.Millisecond); u.tunnel(-1); time.Sleep(100 * time.Millisecond); u.add(-1) }()
	time.Sleep(20 * time.Millisecond)
	if d := waited(u, 5*time.Second); d > time.Second {
		t.Fatalf("a tunnel open as the close began: it waited %v, want no wait", d)
	}
	time.Sleep(80 * time.Millisecond) // the tunnel ended: its request is at work again, until it ends too
	if d := waited(u, 5*time.Second); d < 30*time.Millisecond || d > 3*time.Second {
		t.Fatalf("a request at work again after its tunnel: the close waited %v, want until it ended (about 50ms)", d)
	}
	u.add(1)
	go func() { time.Sleep(50 * time.Millisecond); u.tunnel(1) }()
	if d := waited(u, 5*time.Second); d > 3*time.Second {
		t.Fatalf("a tunnel that opened while the close waited did not wake it: waited %v", d)
	}
}
