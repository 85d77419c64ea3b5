package gate

import (
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// storeUsers is the number of requests at work on one journal.
type storeUsers struct {
	mu sync.Mutex
	n  int
	// tunnels counts those of the n whose tunnel is open (the upstream hijacked the connection): the journal does
	// not wait for them before it closes. A shutdown closes their connections only after it closed the journal
	// (reverse_proxy's cleanup comes after the x402 app's), so waiting would only hold the shutdown up for
	// journalDrainWait; a tunnel that ends with the journal closed leaves its payment unserved, presented again
	// after the restart it opens another tunnel, as a tunnel the unload cut does (Config.Unloaded).
	tunnels int
	idle    chan struct{} // closed when n-tunnels drops to zero while someone waits
}

// usersOfLocked is the count of requests at work on st, made at its first use; ls.mu is held.
func (ls *Ledgers) usersOfLocked(st journal.Store) *storeUsers {
	u := ls.users[st]
	if u == nil {
		u = &storeUsers{}
		ls.users[st] = u
	}
	return u
}

func (u *storeUsers) add(d int) { u.change(d, 0) }

// tunnel counts a request at work whose tunnel opened (d 1) or ended (d -1).
func (u *storeUsers) tunnel(d int) { u.change(0, d) }

func (u *storeUsers) change(users, tunnels int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.n += users
	u.tunnels += tunnels
	if u.n-u.tunnels == 0 && u.idle != nil {
		close(u.idle)
		u.idle = nil
	}
}

// waitIdle waits until no request is at work, or max has passed.
func (u *storeUsers) waitIdle(max time.Duration) {
	u.mu.Lock()
	if u.n-u.tunnels == 0 {
		u.mu.Unlock()
		return
	}
	if u.idle == nil {
		u.idle = make(chan struct{})
	}
	idle := u.idle
	u.mu.Unlock()
	select {
	case <-idle:
	case <-time.After(max):
	}
}

// WaitIdle waits until no gate request of ls is at work on a payment of store, or max has passed, and then
// forgets the store. Call it before closing a journal: a request writes its payment's served mark after its
// response is out, and a journal closed under it would lose the mark, so the payment would buy its response again.
func (ls *Ledgers) WaitIdle(store journal.Store, max time.Duration) {
	ls.mu.Lock()
	u := ls.usersOfLocked(store)
	ls.mu.Unlock()
	u.waitIdle(max)
	ls.mu.Lock()
	if ls.users[store] == u {
		delete(ls.users, store)
	}
	ls.mu.Unlock()
}
