package gate

import (
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// storeUsers is the number of requests at work on one journal.
type storeUsers struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n drops to zero while someone waits
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

func (u *storeUsers) add(d int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.n += d
	if u.n == 0 && u.idle != nil {
		close(u.idle)
		u.idle = nil
	}
}

// waitIdle waits until no request is at work, or max has passed.
func (u *storeUsers) waitIdle(max time.Duration) {
	u.mu.Lock()
	if u.n == 0 {
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
