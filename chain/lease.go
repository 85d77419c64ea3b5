package chain

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// Wallet leases. With a journal several processes share (a journal.Cluster), every process may be configured
// with the same settlement keys, but a wallet's nonce sequence belongs to one process at a time: the one holding
// the wallet's lease. Only the holder hands the wallet to a settlement, signs and sends with it; a process that
// takes a lease over first reads the wallet's nonce afresh, from the chain and from the journal (the highest nonce
// any record of the wallet holds), so it never signs over a transaction of the previous holder. A process that
// dies keeps its leases until they expire; the living then take them over, and reconciliation finishes the dead
// one's broadcast settlements from their recorded transactions.
//
// The wallets are shared out evenly, every process being configured with the same ones: of W wallets and L live
// processes, the process of rank r (its place among the live ones, by instance token) holds W/L, one more when
// r < W mod L, so that the shares add up to W and every process holds one as long as W >= L (a share rounded up
// for everyone left one process with none: 4 wallets, 3 processes, 2+2+0). A process past its share gives up
// the wallets it prefers least (by a hash of its instance and the wallet, so processes prefer different wallets)
// once they have no settlement in flight and no payment bound to them was verified for bindingGrace; until
// then offers no longer name them.
//
// Offers name only wallets a process can send from (walletPool.publish): an upto payment names the one wallet
// that may settle it, an erc2612 permit the one that may spend it, so a payment bound to another process's
// wallet could not be settled here.

// defaultWalletLeaseTTL is how long a wallet lease lasts unless renewed; renewals come every third of it.
const defaultWalletLeaseTTL = 15 * time.Second

// leaseLook is how often the lease loop looks at the wallets' sharing at most.
const leaseLook = time.Second

// bindingGrace is how long a process keeps the lease of a wallet it is giving up after it last verified a
// payment bound to that wallet: a gate verifies a payment, runs the upstream, then settles, and the payment can
// only be settled from that wallet. An upstream slower than this may find the wallet gone, and the payment is
// refused uncharged (no_available_wallets); offers stop naming the wallet as soon as it is being given up.
const bindingGrace = 30 * time.Second

// leaseName is the name of a wallet's lease in the journal.
func leaseName(network string, addr common.Address) string {
	return "wallet:" + network + ":" + addr.Hex()
}

// leaser keeps the wallet leases of one facilitator.
type leaser struct {
	cluster journal.Cluster
	ttl     time.Duration
	now     func() time.Time
	// stalled stops the loop's passes, as a process paused past its leases would be (tests only).
	stalled atomic.Bool
}

// look is how often the lease loop looks at the leases: every third of a short lease, at least every leaseLook.
func (l *leaser) look() time.Duration { return min(l.ttl/3, leaseLook) }

// leasePass renews the leases n's pool holds, gives up those past its share, and takes free ones up to its share.
// It reports the first error; a failure on one wallet does not stop the others.
// Whatever happens, it publishes the wallets offers may name afterwards.
func (f *Facilitator) leasePass(ctx context.Context, n *network) error {
	defer n.pool.publish()
	l := f.leases
	live, rank, err := l.cluster.Instances(ctx)
	if err != nil {
		return err
	}
	wallets := n.pool.Wallets()
	share := leaseShare(len(wallets), live, rank)
	ordered := slices.Clone(wallets)
	slices.SortFunc(ordered, func(a, b *wallet) int {
		return slices.Compare(preference(l.cluster.Instance(), a.Address), preference(l.cluster.Instance(), b.Address))
	})

	var firstErr error
	note := func(err error) {
		if firstErr == nil {
			firstErr = err
		}
	}
	held := 0
	for _, w := range ordered {
		n.pool.mu.Lock()
		leased, draining, busy, boundAt := w.leased, w.draining, w.busy, w.boundAt
		n.pool.mu.Unlock()
		if !leased {
			continue
		}
		if held >= share {
			// Past this process's share: stop handing it out and offering it, and give it up once nothing of it
			// is in flight and no payment verified against it may still come to settle.
			n.pool.mu.Lock()
			w.draining = true
			n.pool.mu.Unlock()
			if busy == 0 && l.now().Sub(boundAt) >= bindingGrace {
				f.giveUp(ctx, n, w)
				continue
			}
		} else if draining {
			// Within its share again (an instance went, or the ranks moved back): kept and handed out again
			// rather than given up and taken again, which would resync its nonce and leave it unused meanwhile.
			n.pool.mu.Lock()
			w.draining = false
			n.pool.changedLocked()
			n.pool.mu.Unlock()
			f.log.Info("kept the lease of a settlement wallet it was giving up: it is within this instance's share again",
				zap.String("network", n.caip2), zap.String("wallet", w.Address.Hex()))
		}
		n.pool.mu.Lock()
		due := l.due(w)
		n.pool.mu.Unlock()
		if due {
			if err := f.renew(ctx, n, w); err != nil {
				note(err)
			}
		}
		n.pool.mu.Lock()
		if w.leased && !w.draining {
			held++
		}
		n.pool.mu.Unlock()
	}
	for _, w := range ordered {
		if held >= share {
			break
		}
		n.pool.mu.Lock()
		leased := w.leased
		n.pool.mu.Unlock()
		if leased {
			continue
		}
		if err := f.renew(ctx, n, w); err != nil {
			note(err)
			continue
		}
		n.pool.mu.Lock()
		if w.leased {
			held++
		}
		n.pool.mu.Unlock()
	}
	return firstErr
}

// leaseShare is how many of wallets the live instance of rank rank holds: an even share, the first wallets mod
// live instances holding one more.
func leaseShare(wallets, live, rank int) int {
	live = max(live, 1)
	share := wallets / live
	if rank < wallets%live {
		share++
	}
	return share
}

// preference orders the wallets for one instance: lower is preferred.
func preference(instance string, addr common.Address) []byte {
	h := sha256.Sum256(append([]byte(instance), addr.Bytes()...))
	return h[:]
}

// renew takes or renews w's lease. Taking it (over) resyncs the wallet's nonce before it is handed out.
func (f *Facilitator) renew(ctx context.Context, n *network, w *wallet) error {
	l := f.leases
	if l.stalled.Load() {
		return nil // (a test's stalled process: a pass under way when it stalled renews nothing either)
	}
	start := l.now()
	lease, err := l.cluster.Lease(ctx, leaseName(n.caip2, w.Address), l.ttl)
	if err != nil {
		return fmt.Errorf("lease of settlement wallet %s: %w", w.Address.Hex(), err)
	}
	n.pool.mu.Lock()
	was := w.leased
	n.pool.mu.Unlock()
	if !lease.Held {
		if was {
			f.log.Warn("lost the lease of a settlement wallet to another instance; it settles with it from now on",
				zap.String("network", n.caip2), zap.String("wallet", w.Address.Hex()), zap.String("holder", lease.Owner))
			f.dropLease(n, w)
		}
		return nil
	}
	if !was || lease.Took {
		if err := f.resyncFromJournal(ctx, n, w); err != nil {
			// Not handed out until its nonce is known: the lease is kept, and the next pass tries again.
			return err
		}
		f.log.Info("took the lease of a settlement wallet", zap.String("network", n.caip2),
			zap.String("wallet", w.Address.Hex()), zap.Uint64("fence", lease.Fence), zap.String("instance", l.cluster.Instance()))
	}
	n.pool.mu.Lock()
	// Valid for the lease's time less a third, measured from before the call: a renewal that comes late, or a
	// database that cannot be reached, stops this process signing well before another may take the wallet.
	w.leased, w.validUntil, w.fence = true, start.Add(l.ttl*2/3), lease.Fence
	n.pool.changedLocked()
	n.pool.mu.Unlock()
	return nil
}

// resyncFromJournal makes w's next send read its nonce afresh from the node, and never below one past the highest
// nonce a journalled transaction of w holds.
func (f *Facilitator) resyncFromJournal(ctx context.Context, n *network, w *wallet) error {
	recs, err := f.journal.PendingOf(ctx, false)
	if err != nil {
		return fmt.Errorf("reading the journal's transactions of wallet %s: %w", w.Address.Hex(), err)
	}
	var floor uint64
	for _, r := range recs {
		if r.State == journal.StateBroadcast && r.Network == n.caip2 && common.HexToAddress(r.Wallet) == w.Address && r.TxNonce+1 > floor {
			floor = r.TxNonce + 1
		}
	}
	w.mu.Lock()
	w.synced, w.floor = false, floor
	w.mu.Unlock()
	return nil
}

// dropLease stops handing w out and offering it, and forgets its nonce: whoever holds it now may have moved it on.
func (f *Facilitator) dropLease(n *network, w *wallet) {
	n.pool.mu.Lock()
	w.leased, w.draining = false, false
	n.pool.mu.Unlock()
	n.pool.publish()
	w.mu.Lock()
	w.synced = false
	w.mu.Unlock()
}

// giveUp gives w's lease back so another instance can take it at once.
func (f *Facilitator) giveUp(ctx context.Context, n *network, w *wallet) {
	f.dropLease(n, w)
	if err := f.leases.cluster.Unlease(ctx, leaseName(n.caip2, w.Address)); err != nil {
		f.log.Warn("giving up the lease of a settlement wallet; it passes to another instance when it expires",
			zap.String("wallet", w.Address.Hex()), zap.Error(err))
		return
	}
	f.log.Info("gave up the lease of a settlement wallet to share the wallets with other instances",
		zap.String("network", n.caip2), zap.String("wallet", w.Address.Hex()))
}

// leaseLoop keeps the wallet leases of every network until the facilitator closes, then gives them up. It looks
// every second (or every third of the lease, when shorter) whether the wallets need sharing out anew, so that an
// instance that starts beside others gets its share within a second or two of the others giving theirs up; a
// lease itself is renewed once a third of it has passed, a look early (leaser.due). At the close it keeps renewing
// the leases it holds until the batch-settlement claim loop's last pass is done.
func (f *Facilitator) leaseLoop() {
	defer f.wg.Done()
	every := f.leases.look()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-f.stop:
			// The claim loop's last pass sends from these wallets: they are given up after it, not under it, and
			// kept meanwhile (a pass that starts late, behind a timed one, would find them lapsed and claim nothing).
			f.keepLeasesUntil(t.C, f.claimsDone())
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			for _, id := range f.order {
				n := f.networks[id]
				for _, w := range n.pool.Wallets() {
					n.pool.mu.Lock()
					leased := w.leased
					n.pool.mu.Unlock()
					if leased {
						f.giveUp(ctx, n, w)
					}
				}
			}
			cancel()
			return
		case <-t.C:
			if f.leases.stalled.Load() {
				continue
			}
			for _, id := range f.order {
				ctx, cancel := context.WithTimeout(context.Background(), every)
				if err := f.leasePass(ctx, f.networks[id]); err != nil {
					f.log.Warn("keeping the settlement wallet leases", zap.String("network", id), zap.Error(err))
				}
				cancel()
			}
		}
	}
}

// due says whether w's lease is to be renewed at this look: once a third of the lease has gone by, and a look
// early (the looks come every third of a short lease, and the one just short of the third would leave the renewal
// to the next, as the lease runs out here: the wallet unusable for the renewal's round trip). The caller holds the
// pool's lock.
func (l *leaser) due(w *wallet) bool {
	return l.now().After(w.validUntil.Add(-l.ttl/3 - l.look()))
}

// claimsDone is closed once the batch-settlement claim loop has returned (after its last pass at the stop).
func (f *Facilitator) claimsDone() <-chan struct{} {
	done := make(chan struct{})
	go func() {
		f.batchClaims.Wait()
		close(done)
	}()
	return done
}

// keepLeasesUntil renews, at each tick, the wallet leases this process holds that are due, until done is closed:
// it takes no new wallet and gives none up (a stopping process keeps what it sends from, nothing more).
func (f *Facilitator) keepLeasesUntil(tick <-chan time.Time, done <-chan struct{}) {
	for {
		select {
		case <-done:
			return
		case <-tick:
			if f.leases.stalled.Load() {
				continue
			}
			for _, id := range f.order {
				n := f.networks[id]
				ctx, cancel := context.WithTimeout(context.Background(), f.leases.look())
				for _, w := range n.pool.Wallets() {
					n.pool.mu.Lock()
					due := w.leased && f.leases.due(w)
					n.pool.mu.Unlock()
					if !due {
						continue
					}
					if err := f.renew(ctx, n, w); err != nil {
						f.log.Warn("keeping a settlement wallet's lease for the last batch-settlement claims", zap.String("network", id),
							zap.String("wallet", w.Address.Hex()), zap.Error(err))
					}
				}
				cancel()
				n.pool.publish()
			}
		}
	}
}

// SendsFrom reports whether this process may send settlements from wallet on the network now: it is one of the
// network's settlement wallets and, with a journal several processes share, this process holds its lease. A
// payment bound to the wallet (an upto witness naming it, an erc2612 permit to it) is settled only by the
// process that does.
func (f *Facilitator) SendsFrom(networkID string, wallet common.Address) bool {
	n := f.networks[networkID]
	return n != nil && n.pool.maySign(n.pool.byAddr[wallet])
}

// SupportedVersion changes whenever what Supported answers may have changed: the settlement wallets this process
// sends from (with a journal several processes share, a wallet lease taken, lost or being given up). A gate of
// the embedded facilitator builds its offers anew when it does, and compares it on every request: one atomic read.
func (f *Facilitator) SupportedVersion() uint64 { return f.walletsVersion.Load() }

// LeasedWallets lists the settlement wallets of the network this process may settle with: every wallet with a
// journal of one process, only those whose lease it holds with a shared one. nil for an unknown network.
func (f *Facilitator) LeasedWallets(networkID string) []common.Address {
	n := f.networks[networkID]
	if n == nil {
		return nil
	}
	n.pool.mu.Lock()
	defer n.pool.mu.Unlock()
	var out []common.Address
	now := n.pool.now()
	for _, w := range n.pool.wallets {
		if n.pool.usable(w, now) {
			out = append(out, w.Address)
		}
	}
	return out
}

// recordSigned writes the journal record of transactions just signed with w, before they are sent. With a shared
// journal the write is fenced by w's lease (journal.Cluster.UpdateFenced): should this process have lost the
// lease without knowing it (paused past its expiry, its clock stalled), the write fails, so nothing is sent, and
// the wallet is taken out of use until the lease loop looks again. The caller holds w.mu (it is sending).
//
// known is the record as this settlement last wrote it (its claim, or its previous recordSigned), which a shared
// journal then need not read first (journal.UpdateFencedKnown); the zero Record when not known.
func (f *Facilitator) recordSigned(ctx context.Context, n *network, w *wallet, id journal.ID, known journal.Record, fn func(*journal.Record) error) (journal.Record, error) {
	if f.cluster == nil {
		return f.journal.Update(ctx, id, fn)
	}
	n.pool.mu.Lock()
	fence := w.fence
	n.pool.mu.Unlock()
	var rec journal.Record
	var err error
	if known.ID == id {
		rec, err = journal.UpdateFencedKnown(ctx, f.cluster, known, leaseName(n.caip2, w.Address), fence, fn)
	} else {
		rec, err = f.cluster.UpdateFenced(ctx, id, leaseName(n.caip2, w.Address), fence, fn)
	}
	f.leaseLost(n, w, fence, err)
	return rec, err
}

// leaseLost lets go of w, whose record of a signed transaction err, when it is ErrFenced, refused: another
// instance holds its lease now. The caller, sending, holds w.mu.
func (f *Facilitator) leaseLost(n *network, w *wallet, fence uint64, err error) {
	if !errors.Is(err, journal.ErrFenced) {
		return
	}
	f.log.Warn("a settlement wallet's lease was lost before this process knew; nothing was sent with it",
		zap.String("network", n.caip2), zap.String("wallet", w.Address.Hex()), zap.Uint64("fence", fence))
	n.pool.mu.Lock()
	w.leased, w.draining = false, false
	n.pool.mu.Unlock()
	n.pool.publish()
	w.synced = false
}
