package chain

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
)

// errNoAvailableWallets is returned when every settlement wallet stayed busy for the pool's whole wait.
var errNoAvailableWallets = errors.New("No available wallets in pool")

// wallet is one settlement account. Its mutex serialises nonce assignment and sending, so transactions of one
// wallet are signed and broadcast in nonce order while many are in flight (pipelining without waiting for receipts).
type wallet struct {
	key     *ecdsa.PrivateKey
	Address common.Address

	mu     sync.Mutex // guards nonce, synced and floor; held while signing and sending
	nonce  uint64
	synced bool
	// floor is the lowest nonce the next send may use whatever the node says: one past the highest nonce the
	// journal records for the wallet when this process took the wallet over (see leases), so a node that lost
	// an earlier holder's transactions cannot have them signed over.
	floor uint64

	busy int // settlements holding this wallet; guarded by the pool's mutex
	// With a shared journal (see leases), whether this process holds the wallet's lease, until when (by this
	// process's clock) it may sign with it, and draining: the lease is being given up, so the wallet takes no
	// new settlement. Guarded by the pool's mutex.
	leased     bool
	validUntil time.Time
	draining   bool
	fence      uint64 // the lease's fence when this process last took or renewed it
	// boundAt is when this process last verified a payment bound to the wallet (an upto witness naming it, an
	// erc2612 permit to it): a lease being given up is kept a while after it (see bindingGrace), so that a
	// payment verified before the giving up can still be settled. Guarded by the pool's mutex.
	boundAt time.Time
}

// newWallet wraps a private key. The key never leaves the wallet, and the wallet's String shows only the address.
func newWallet(key *ecdsa.PrivateKey) *wallet {
	return &wallet{key: key, Address: crypto.PubkeyToAddress(key.PublicKey)}
}

func (w *wallet) String() string { return w.Address.Hex() }

// walletPool hands out the settlement wallets of one network. A wallet carries at most MaxInFlight settlements at
// once; a caller waits at most Wait for one to free up before getting errNoAvailableWallets.
type walletPool struct {
	wallets []*wallet
	byAddr  map[common.Address]*wallet

	// MaxInFlight is how many settlements one wallet pipelines at once.
	MaxInFlight int
	// Wait bounds how long Acquire waits for a wallet to free up.
	Wait time.Duration

	// leasing: wallets are shared with other processes through leases, and only a wallet this process holds
	// the lease of (see usable) is handed out.
	leasing bool
	now     func() time.Time

	mu      sync.Mutex
	changed chan struct{} // closed and replaced whenever a wallet is released

	// offered are the wallets an offer may name now (see offerable), as publish last found them. Read without a
	// lock on every 402; replaced, never changed.
	offered atomic.Pointer[[]common.Address]
	// versions is bumped whenever offered changes (the facilitator's, shared by its networks' pools).
	versions *atomic.Uint64
}

// newWalletPool returns a pool over keys; duplicate keys are refused.
func newWalletPool(keys []*ecdsa.PrivateKey) (*walletPool, error) {
	if len(keys) == 0 {
		return nil, errors.New("a wallet pool needs at least one settlement key")
	}
	p := &walletPool{byAddr: map[common.Address]*wallet{}, MaxInFlight: 64, Wait: 2 * time.Second, changed: make(chan struct{}), now: time.Now,
		versions: new(atomic.Uint64)}
	for _, k := range keys {
		w := newWallet(k)
		if _, dup := p.byAddr[w.Address]; dup {
			return nil, fmt.Errorf("settlement wallet %s is listed twice", w.Address.Hex())
		}
		p.wallets = append(p.wallets, w)
		p.byAddr[w.Address] = w
	}
	return p, nil
}

// Addresses lists the wallets' addresses in configuration order.
func (p *walletPool) Addresses() []common.Address {
	out := make([]common.Address, len(p.wallets))
	for i, w := range p.wallets {
		out[i] = w.Address
	}
	return out
}

// Wallets lists the wallets in configuration order.
func (p *walletPool) Wallets() []*wallet { return p.wallets }

// Has reports whether addr is one of the pool's wallets.
func (p *walletPool) Has(addr common.Address) bool {
	_, ok := p.byAddr[addr]
	return ok
}

// InUse is how many settlements hold wallets right now.
func (p *walletPool) InUse() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, w := range p.wallets {
		n += w.busy
	}
	return n
}

// Acquire takes a wallet for one settlement: the wallet want when it is given (an erc2612 permit can only be
// spent by the spender it names), else the least busy one. Release it when the settlement no longer needs it.
func (p *walletPool) Acquire(ctx context.Context, want *common.Address) (*wallet, error) {
	if want != nil && !p.Has(*want) {
		return nil, fmt.Errorf("%s is not a settlement wallet of this facilitator", want.Hex())
	}
	timer := time.NewTimer(p.Wait)
	defer timer.Stop()
	for {
		p.mu.Lock()
		if want != nil && p.leasing && !p.byAddr[*want].leased {
			// Another process holds the wallet (or nobody does): waiting here would not bring it back. A lease
			// this process holds and has not renewed in time may be renewed within the wait.
			p.mu.Unlock()
			return nil, errWalletNotHeld
		}
		if pick := p.pickLocked(want, p.now()); pick != nil {
			pick.busy++
			p.mu.Unlock()
			return pick, nil
		}
		changed := p.changed
		p.mu.Unlock()
		select {
		case <-changed:
		case <-timer.C:
			return nil, errNoAvailableWallets
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for a settlement wallet: %w", ctx.Err())
		}
	}
}

// pickLocked is the wallet a settlement would take now: want when given, held and with room for another
// settlement (one being given up counts: its lease is kept for the payments bound to it, see bindingGrace); else
// the least busy usable wallet with room. nil when there is none. Called with mu held.
func (p *walletPool) pickLocked(want *common.Address, now time.Time) *wallet {
	if want != nil {
		if w := p.byAddr[*want]; w != nil && w.busy < p.MaxInFlight && p.holds(w, now) {
			return w
		}
		return nil
	}
	var pick *wallet
	for _, w := range p.wallets {
		if w.busy < p.MaxInFlight && p.usable(w, now) && (pick == nil || w.busy < pick.busy) {
			pick = w
		}
	}
	return pick
}

// Peek is the wallet Acquire would hand out now to a settlement any wallet may send, without taking it: the
// sender a verification simulates the settlement from. With none usable, the first wallet.
func (p *walletPool) Peek() common.Address {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	var pick *wallet
	for _, w := range p.wallets {
		if p.usable(w, now) && (pick == nil || w.busy < pick.busy) {
			pick = w
		}
	}
	if pick == nil {
		return p.wallets[0].Address
	}
	return pick.Address
}

// Release gives back a wallet taken with Acquire.
func (p *walletPool) Release(w *wallet) {
	p.mu.Lock()
	w.busy--
	p.changedLocked()
	p.mu.Unlock()
}

// changedLocked wakes the callers waiting in Acquire. Called with mu held.
func (p *walletPool) changedLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

// usable reports whether a new settlement may take w: always without leasing; with it, only while this process
// holds w's lease and is not giving it up. Called with mu held.
func (p *walletPool) usable(w *wallet, now time.Time) bool {
	return !p.leasing || (w.leased && !w.draining && p.holds(w, now))
}

// holds reports whether this process may send from w now: always without leasing; with it, while it holds w's
// lease, giving it up or not. A payment bound to w (an upto witness, an erc2612 permit) is settled from w
// while it is held: giving a lease up waits for those (see bindingGrace). Called with mu held.
func (p *walletPool) holds(w *wallet, now time.Time) bool {
	return !p.leasing || (w.leased && now.Before(w.validUntil))
}

// offerable reports whether an offer may name w: this process holds its lease and is not giving it up. A lease
// whose renewal is late (the database slow or out of reach a moment) still counts: the renewal brings it back,
// and a settlement waits for it (see Acquire); a lease found lost is dropped at once. Called with mu held.
func (p *walletPool) offerable(w *wallet) bool {
	return !p.leasing || (w.leased && !w.draining)
}

// errWalletNotHeld: the settlement wallet a payment is bound to is one whose lease this process does not hold.
var errWalletNotHeld = errors.New("the settlement wallet the payment names is not one this instance sends from")

// leasedHere reports whether this process holds the lease of addr, giving it up or not, its renewal late or not.
func (p *walletPool) leasedHere(addr common.Address) bool { return p.leased(addr, false) }

// bind reports whether this process holds the lease of addr (see leasedHere) and, when it does, notes that a
// payment bound to it was just verified, so that the lease is not given up under that payment (see
// bindingGrace). Only a payment found valid is bound: one refused binds nothing, or payments anyone can sign and
// have refused (a throwaway key's, naming the wallet) would keep a wallet being given up from ever going, and
// from being used meanwhile (a wallet being given up takes no new settlement, and no batch-settlement claim).
func (p *walletPool) bind(addr common.Address) bool { return p.leased(addr, true) }

// leased is leasedHere, noting the binding (bind) when bound says so and the lease is held.
func (p *walletPool) leased(addr common.Address, bound bool) bool {
	w := p.byAddr[addr]
	if w == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.leasing && !w.leased {
		return false
	}
	if bound {
		w.boundAt = p.now()
	}
	return true
}

// publish finds the wallets an offer may name now (see offerable) and, when they changed, makes them the offered
// ones and bumps the version. The lease keeper calls it after every look at the leases and whenever one is
// taken, lost or given up.
func (p *walletPool) publish() {
	p.mu.Lock()
	defer p.mu.Unlock() // two publishers never store what they found out of order
	var list []common.Address
	for _, w := range p.wallets {
		if p.offerable(w) {
			list = append(list, w.Address)
		}
	}
	if cur := p.offered.Load(); cur != nil && slices.Equal(*cur, list) {
		return
	}
	p.offered.Store(&list)
	p.versions.Add(1)
}

// offers lists the wallets an offer may name, as publish last found them.
func (p *walletPool) offers() []common.Address {
	if l := p.offered.Load(); l != nil {
		return *l
	}
	return nil
}

// maySign reports whether this process may sign with w outside a settlement (a nonce hole, a fee bump): it is one
// of the pool's wallets and, with leasing, this process holds its lease.
func (p *walletPool) maySign(w *wallet) bool {
	if w == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holds(w, p.now())
}

// ParsePrivateKeys reads settlement keys from a comma, space or newline separated list of hex keys (0x optional).
// Errors name the position of a bad key, never the key.
func ParsePrivateKeys(list string) ([]*ecdsa.PrivateKey, error) {
	fields := strings.FieldsFunc(list, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\r' || r == '\t' })
	var keys []*ecdsa.PrivateKey
	for i, f := range fields {
		k, err := crypto.HexToECDSA(strings.TrimPrefix(strings.TrimPrefix(f, "0x"), "0X"))
		if err != nil {
			// Never the key nor any part of it: a key mistyped by one character is still nearly a secret.
			return nil, fmt.Errorf("key %d of %d is not 32 bytes of hex (a private key of 64 hex digits, 0x optional)", i+1, len(fields))
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, errors.New("no settlement keys given")
	}
	return keys, nil
}

// ReadPrivateKeyFile reads settlement keys from a file holding one hex key per line ('#' starts a comment).
func ReadPrivateKeyFile(path string) ([]*ecdsa.PrivateKey, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading settlement key file: %w", err)
	}
	var b strings.Builder
	for _, line := range strings.Split(string(data), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		b.WriteString(line)
		b.WriteByte('\n')
	}
	keys, err := ParsePrivateKeys(b.String())
	if err != nil {
		return nil, fmt.Errorf("settlement key file %s: %w", path, err)
	}
	return keys, nil
}
