package gate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Ledgers holds the gates' side of each open settlement journal, keyed by the store, for whoever owns the
// journals (the Caddy app): requests of the old and the new config must see the same payments in flight, and
// background settlements must outlive a reload, so the gates of every config share one Ledgers (Config.Ledgers).
// It also counts the requests at work on each journal (WaitIdle), and can hold background settlements back
// (PauseBackgroundSettlement).
type Ledgers struct {
	mu sync.Mutex
	m  map[journal.Store]*Ledger
	// users counts, per journal store, the gate requests at work on a payment (see Ledger.acquire).
	users map[journal.Store]*storeUsers
	// pause, when set, holds background settlements before they start until it is closed (see
	// PauseBackgroundSettlement).
	pause atomic.Pointer[chan struct{}]
}

// NewLedgers returns an empty set of ledgers, for the gates of every journal its owner opens.
func NewLedgers() *Ledgers {
	return &Ledgers{m: map[journal.Store]*Ledger{}, users: map[journal.Store]*storeUsers{}}
}

// Ledger is what the gates of one journal share: the payments a request is working on right now, and
// the async payments being settled in the background.
//
// The journal makes each payment buy one response: a payment is served only after its gate record says so,
// and a record that says so is never served again. The in-flight set covers the time before that record
// exists. A journal file is locked to one process, so an in-memory set is enough for it; a journal several
// processes share (a journal.Cluster) keeps the in-flight marks itself, beside this set (see acquire).
type Ledger struct {
	store journal.Store
	owner string
	log   *zap.Logger
	now   func() time.Time

	// slots bounds the background settlements talking to the facilitator at once: thousands of async
	// payments queued behind a busy wallet pool would otherwise all wake on every released wallet.
	slots chan struct{}

	// users counts the requests at work here for the journal, which waits for them before it closes.
	users *storeUsers
	// refs counts the gates that joined (see join); pool is the Ledgers it belongs to.
	refs int
	pool *Ledgers

	mu sync.Mutex
	// inflight holds the payments requests are working on, each with the journal's Continuity when its request
	// marked it (with a journal.Cluster; 0 otherwise), see holds.
	inflight map[journal.ID]uint64
	settling map[journal.ID]struct{}
	gates    []*Gate
	// debts are the served async payments not settled yet, by payer (lowercase), and owedBy the payer of each.
	// A gate whose facilitator cannot hold payments against the payer's funds serves a payer one such payment
	// at a time (see serveFirst).
	debts  map[string]*payerDebt
	owedBy map[journal.ID]string
	// leftovers are what requests could not clear in a shared journal for an outage (see leaveBehind); the
	// leftover loop runs while there are any.
	leftovers map[journal.ID]*leftover
	// pruning: the prune loop runs (see pruneLoop); adopting: the adopt loop does (see adoptLoop); tidying:
	// the leftover loop does (see leftoverLoop).
	pruning, adopting, tidying bool

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// Retry pacing of background settlement.
const (
	asyncRetryMin = 100 * time.Millisecond
	asyncRetryMax = 10 * time.Second
	// asyncUnexpectedLimit bounds retries of a settlement the facilitator keeps failing with
	// unexpected_settle_error: past it the failure is taken as final. The embedded engine never answers it (a
	// transaction its node refused is an error, retried until the payment settles or expires); a remote
	// facilitator may.
	asyncUnexpectedLimit = 10
	// asyncConcurrency is how many background settlements run at once per journal.
	asyncConcurrency = 64
	// asyncExpiryMargin is how long past its deadline, by this machine's clock, a served async payment that no
	// facilitator can settle is given up: chain time follows wall time within a block or two, so by then no
	// facilitator could settle it either.
	asyncExpiryMargin = 15 * time.Second
)

// Pruning of a journal no embedded engine prunes.
const (
	gatePruneEvery = 10 * time.Minute
	// gatePruneAfter is how long a final gate record is kept past its deadline. A payment presented again once
	// its record is gone looks new to the gate, so it must by then be refused for its expired authorization
	// (else a facilitator answering a repeated settlement from its own journal could have it served twice):
	// the margin covers clocks, the gate's and the chain's, that disagree.
	gatePruneAfter = 10 * time.Minute
)

// join takes a reference on the ledger of store, creating it for the first gate of the journal.
func (ls *Ledgers) join(store journal.Store, owner string, log *zap.Logger) *Ledger {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l := ls.m[store]; l != nil {
		l.refs++
		return l
	}
	if c, ok := store.(journal.Cluster); ok {
		// Records carry the instance token the store keeps alive, so other processes can tell whether the
		// process that served an async payment is still there to settle it.
		owner = c.Instance()
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Ledger{
		store: store, owner: owner, log: log, now: time.Now, users: ls.usersOfLocked(store), pool: ls,
		inflight: map[journal.ID]uint64{}, settling: map[journal.ID]struct{}{}, leftovers: map[journal.ID]*leftover{},
		debts: map[string]*payerDebt{}, owedBy: map[journal.ID]string{},
		slots: make(chan struct{}, asyncConcurrency), ctx: ctx, cancel: cancel, refs: 1,
	}
	ls.m[store] = l
	return l
}

// leave lets go of a reference; the last one stops the background settlements.
func (ls *Ledgers) leave(l *Ledger) {
	ls.mu.Lock()
	l.refs--
	last := l.refs == 0
	if last {
		delete(ls.m, l.store)
	}
	ls.mu.Unlock()
	if last {
		l.stop()
	}
}

// stop stops background settlements and the prune loop, and waits for them. Payments they did not finish
// stay pending in the journal and are settled after the next start.
func (l *Ledger) stop() {
	l.mu.Lock()
	l.cancel()
	l.mu.Unlock()
	l.wg.Wait()
}

// PruneJournals runs the gates' periodic journal prune now, as if the clock read now, on every journal a
// started gate of ls uses, and returns how many records it deleted: the real prune runs every ten minutes. For tests.
func (ls *Ledgers) PruneJournals(now time.Time) (int, error) {
	ls.mu.Lock()
	list := make([]*Ledger, 0, len(ls.m))
	for _, l := range ls.m {
		list = append(list, l)
	}
	ls.mu.Unlock()
	total := 0
	var errs []error
	for _, l := range list {
		n, err := l.prune(now)
		total += n
		errs = append(errs, err)
	}
	return total, errors.Join(errs...)
}

// PauseBackgroundSettlement holds the background settlements of the settle-async gates of ls until resume is
// called, so a benchmark can measure what serving paid requests costs apart from settling them on the same cores.
func (ls *Ledgers) PauseBackgroundSettlement() (resume func()) {
	ch := make(chan struct{})
	ls.pause.Store(&ch)
	return func() {
		ls.pause.Store(nil)
		close(ch)
	}
}

// register adds a gate that can settle payments, settles the async payments waiting in the journal (left
// by a previous process, or waiting for a facilitator of their network), and starts the prune loop.
// An error says the journal could not be read: its async payments would be forgotten (never settled, their
// payers not counted), so the gate must not start.
func (l *Ledger) register(g *Gate) error {
	l.mu.Lock()
	l.gates = append(l.gates, g)
	if !l.pruning && l.ctx.Err() == nil {
		l.pruning = true
		l.wg.Add(1)
		go l.pruneLoop()
	}
	l.mu.Unlock()
	return l.replay()
}

func (l *Ledger) unregister(g *Gate) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gates = slices.DeleteFunc(l.gates, func(x *Gate) bool { return x == g })
}

// acquire marks a payment as being worked on by a request; false means another request has it. With a journal
// several processes share (a journal.Cluster), the mark is the journal's too, so that a request of another
// process presenting the same payment is turned away as one of this process would be; an error says the journal
// could not be asked, and nothing is marked.
func (l *Ledger) acquire(ctx context.Context, id journal.ID) (bool, error) {
	mine, _, _, err := l.acquireMarking(id, func(c journal.Cluster) (bool, journal.Record, bool, error) {
		mine, err := c.Busy(ctx, id)
		return mine, journal.Record{}, false, err
	})
	return mine, err
}

// acquireRecord is acquire, and reads the payment's journal record once it is this request's: with a shared
// journal, the mark and the read go to the database together (journal.MarkAndGet).
func (l *Ledger) acquireRecord(ctx context.Context, id journal.ID) (mine bool, rec journal.Record, found bool, err error) {
	mine, rec, found, err = l.acquireMarking(id, func(journal.Cluster) (bool, journal.Record, bool, error) {
		return journal.MarkAndGet(ctx, l.store, id)
	})
	if err == nil && mine {
		if _, ok := l.store.(journal.Cluster); !ok {
			rec, found, err = l.store.Get(ctx, id)
		}
	}
	if err != nil && mine {
		l.release(id)
		return false, journal.Record{}, false, err
	}
	return mine, rec, found, err
}

// acquireMarking is acquire with the journal's mark (and what else it reads with it) made by mark.
func (l *Ledger) acquireMarking(id journal.ID, mark func(journal.Cluster) (bool, journal.Record, bool, error)) (bool, journal.Record, bool, error) {
	if !l.markHere(id) {
		return false, journal.Record{}, false, nil
	}
	if c, ok := l.store.(journal.Cluster); ok {
		return l.markedThere(id, c, c.Continuity(), mark)
	}
	return true, journal.Record{}, false, nil
}

// markHere takes this process's own mark of payment id: false when a request here has it.
func (l *Ledger) markHere(id journal.ID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, busy := l.inflight[id]; busy {
		return false
	}
	l.inflight[id] = 0
	l.users.add(1)
	return true
}

// markedThere takes the journal's mark of payment id, marked here already, with mark, and what mark reads with it;
// life is the journal's Continuity from before the mark was asked for. Not this request's, or failed: the mark
// here is let go of.
func (l *Ledger) markedThere(id journal.ID, c journal.Cluster, life uint64, mark func(journal.Cluster) (bool, journal.Record, bool, error)) (bool, journal.Record, bool, error) {
	mine, rec, found, err := mark(c)
	if err != nil && mine {
		// Marked, and what was read with the mark failed: the journal is likely out of reach, and clearing the mark
		// now would hold the request's answer back by another of its timeouts. The leftover loop clears it.
		l.releaseLater(id)
		return false, journal.Record{}, false, err
	}
	if err != nil || !mine {
		l.forget(id)
		return false, journal.Record{}, false, err
	}
	if c.Continuity() != life {
		// This process may look dead to the others right now (its heartbeat is behind): the mark may not
		// hold, and nothing would be served on it.
		l.release(id)
		return false, journal.Record{}, false, errMayLookDead
	}
	l.mu.Lock()
	l.inflight[id] = life
	l.mu.Unlock()
	return true, rec, found, nil
}

// errMayLookDead: this process's heartbeat is too far behind for its in-flight marks to hold.
var errMayLookDead = errors.New("this gateway's heartbeat in the shared journal is behind: it may look dead to the others")

// holds reports whether the request that marked payment id still holds it surely: with a journal several
// processes share, this process has not looked dead to the others since the mark was taken (a database out of
// reach for most of the heartbeat's TTL), when another process may have taken the mark over and be serving the
// payment itself. Such a request serves nothing: the payer presents the payment again, and it is served once.
func (l *Ledger) holds(id journal.ID) bool {
	c, ok := l.store.(journal.Cluster)
	if !ok {
		return true
	}
	l.mu.Lock()
	life, marked := l.inflight[id]
	l.mu.Unlock()
	return marked && life == c.Continuity()
}

// release lets go of a payment acquire marked.
func (l *Ledger) release(id journal.ID) {
	if c, ok := l.store.(journal.Cluster); ok {
		// A mark left behind (the journal could not be reached) is another process's to take over once this
		// one is gone; until then, a request elsewhere presenting the payment is told to wait.
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := c.Idle(ctx, id); err != nil {
			l.log.Warn("clearing the journal's in-flight mark of a payment; trying again once the journal is back",
				zap.String("payment", id.String()), zap.Error(err))
			l.leaveBehind(id, nil, time.Time{})
		}
		cancel()
	}
	l.forget(id)
}

// releaseLater is release with a short wait on the journal: the mark is cleared now if the journal answers at
// once (the read failed, the database did not: another gateway the payer turns to must not find the payment
// marked), else by the leftover loop, not before the caller goes on.
func (l *Ledger) releaseLater(id journal.ID) {
	if c, ok := l.store.(journal.Cluster); ok {
		ctx, cancel := context.WithTimeout(context.Background(), releaseLaterWait)
		if err := c.Idle(ctx, id); err != nil {
			l.leaveBehind(id, nil, time.Time{})
		}
		cancel()
	}
	l.forget(id)
}

// releaseLaterWait bounds releaseLater's own try at clearing a mark.
const releaseLaterWait = 250 * time.Millisecond

// releaseIdled is release of a payment whose journal mark was cleared already when idled (journal.MarkServedIdle,
// journal.UpdateKnownIdle, written with its served mark): only this process's own mark is left to let go of.
func (l *Ledger) releaseIdled(id journal.ID, idled bool) {
	if idled {
		l.forget(id)
		return
	}
	l.release(id)
}

// tunnelOpened notes that the request holding payment id's mark here opened its tunnel, which its journal need
// not wait for (see storeUsers.tunnels), and reports whether it did: false when id is not marked here. Each true
// is followed by one tunnelEnded once the tunnel ends, before the request writes anything more.
func (l *Ledger) tunnelOpened(id journal.ID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.inflight[id]; !ok {
		return false
	}
	l.users.tunnel(1)
	return true
}

// tunnelEnded ends tunnelOpened: the request is at work on the journal again.
func (l *Ledger) tunnelEnded() { l.users.tunnel(-1) }

func (l *Ledger) forget(id journal.ID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.inflight[id]; ok {
		delete(l.inflight, id)
		l.users.add(-1)
	}
}

// replay settles every async payment the journal holds unsettled. Those not marked served count too: a process
// that died between writing a response and recording it as delivered leaves them so, and their responses may
// have reached the payer.
func (l *Ledger) replay() error {
	served, err := l.store.PendingOf(l.ctx, true)
	if err != nil {
		return fmt.Errorf("reading the async payments the settlement journal holds unsettled: %w; not starting with them forgotten", err)
	}
	if c, ok := l.store.(journal.Cluster); ok {
		if served, err = l.adoptable(c, served); err != nil {
			return fmt.Errorf("taking over the async payments of instances that are gone: %w", err)
		}
		l.mu.Lock()
		if !l.adopting && l.ctx.Err() == nil {
			l.adopting = true
			l.wg.Add(1)
			go l.adoptLoop(c)
		}
		l.mu.Unlock()
	}
	l.settleAll(served)
	return nil
}

// settleAll settles recs in the background, counting each against its payer until it is settled. With a
// facilitator that holds payments against their payers' funds (the embedded engine), each is held first, as
// serving it did before the restart: until it settles, a new payment of the same payer must count it, from the
// first request served.
func (l *Ledger) settleAll(recs []journal.Record) {
	for _, rec := range recs {
		l.holdServed(rec)
	}
	for _, rec := range recs {
		l.owe(rec.ID, rec.Payer)
		l.settleLater(rec.ID)
	}
}

// adoptEvery is how often a gate of a journal several processes share looks for served async payments whose
// process is gone, to settle them itself.
const adoptEvery = 3 * time.Second

// adoptable keeps of recs the async payments this process is to settle: its own, those of instances that are
// gone, and those bound to a settlement wallet this process sends from (an upto witness naming it, an erc2612
// permit to it), which only the holder of the wallet's lease can settle: their owner may be alive and unable to,
// say after the wallet's lease moved to this process, or after it took over the payments of a gone instance
// whose wallets went to others. It takes them over (their Owner becomes this instance, and their owner's
// background settlement stops) unless another process took them first.
func (l *Ledger) adoptable(c journal.Cluster, recs []journal.Record) ([]journal.Record, error) {
	var out []journal.Record
	isAlive := journal.AliveOnce(c)
	for _, rec := range recs {
		if rec.Owner == l.owner {
			out = append(out, rec)
			continue
		}
		alive, err := isAlive(l.ctx, rec.Owner)
		if err != nil {
			return out, err
		}
		why := "took over a served async payment of an instance that is gone; settling it"
		if alive {
			// Its own process settles it, unless only this one can: left a moment to its owner first, which
			// may hold the wallet right now and be settling it.
			if l.now().Sub(rec.UpdatedAt) < adoptEvery || !l.sendsFromWalletOf(rec) {
				continue
			}
			why = "took over a served async payment bound to a settlement wallet whose lease this instance holds; settling it"
		}
		prev := rec.Owner
		rec, err = l.store.Update(l.ctx, rec.ID, func(r *journal.Record) error {
			if r.Owner != prev || r.State == journal.StateFinal {
				return errAdopted
			}
			r.Owner = l.owner
			return nil
		})
		switch {
		case err == nil:
			l.log.Info(why, zap.String("payment", rec.ID.String()), zap.String("payer", rec.Payer), zap.String("amount", rec.Amount),
				zap.String("previous_owner", prev))
			out = append(out, rec)
		case errors.Is(err, errAdopted), errors.Is(err, journal.ErrNotFound):
		default:
			return out, err
		}
	}
	return out, nil
}

// walletSender is a facilitator that sends settlements only from the wallets whose leases it holds (the embedded
// engine sharing its journal with other processes).
type walletSender interface {
	SendsFrom(network string, wallet common.Address) bool
}

// sendsFromWalletOf reports whether the async payment rec is bound to a settlement wallet (see x402.BoundWallet)
// that the facilitator of one of this ledger's gates sends from now.
func (l *Ledger) sendsFromWalletOf(rec journal.Record) bool {
	var req x402.SettleRequest
	if err := json.Unmarshal(rec.Request, &req); err != nil {
		return false
	}
	w := x402.BoundWallet(req.PaymentRequirements, req.PaymentPayload.Payload)
	if !x402.IsHexAddress(w) {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, g := range l.gates {
		if s, ok := g.fac.(walletSender); ok && g.settlesOn(rec.Network) && s.SendsFrom(rec.Network, common.HexToAddress(w)) {
			return true
		}
	}
	return false
}

// errAdopted: another process took the async payment over first (or it became final meanwhile).
var errAdopted = errors.New("another instance took the payment over")

// adoptLoop takes over, every adoptEvery, the served async payments of instances that are gone. It settles too
// this instance's own that no background settlement of it is working on: one whose takeover was written while the
// call that wrote it failed (a connection lost as it committed), whose owner, now this instance, would otherwise
// leave it to an instance that is gone.
func (l *Ledger) adoptLoop(c journal.Cluster) {
	defer l.wg.Done()
	t := time.NewTicker(adoptEvery)
	defer t.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
		recs, err := l.store.PendingOf(l.ctx, true)
		if err == nil {
			recs = slices.DeleteFunc(recs, func(r journal.Record) bool {
				// (One whose request does not read was reported once by the settlement that gave it up.)
				return r.Owner == l.owner && (l.isSettling(r.ID) || json.Unmarshal(r.Request, new(x402.SettleRequest)) != nil)
			})
			recs, err = l.adoptable(c, recs)
		}
		if err != nil && l.ctx.Err() == nil {
			l.log.Warn("looking for served async payments of instances that are gone", zap.Error(err))
		}
		l.settleAll(recs)
	}
}

// holdServed holds rec, a served async payment not settled yet, against its payer's funds, when a gate's
// facilitator can hold (see fundsHolder.HoldServed: it asks nothing of the chain). A record whose request does
// not read is left to settleInBackground, which reports it.
func (l *Ledger) holdServed(rec journal.Record) {
	req, h := l.holderFor(rec)
	if h == nil {
		return
	}
	if err := h.HoldServed(l.ctx, req); err != nil && l.ctx.Err() == nil {
		l.log.Warn("holding a served async payment against its payer's funds; until it settles, the payer's new payments may not count it",
			zap.String("payment", rec.ID.String()), zap.Error(err))
	}
}

// holderFor is the request to settle rec with (an upto payment at the amount charged) and the facilitator that
// holds it against its payer's funds; nil when no gate's facilitator does.
func (l *Ledger) holderFor(rec journal.Record) (x402.SettleRequest, fundsHolder) {
	var req x402.SettleRequest
	if err := json.Unmarshal(rec.Request, &req); err != nil {
		return req, nil
	}
	g, _ := l.gateFor(req.PaymentRequirements)
	if g == nil {
		return req, nil
	}
	h, _ := g.fac.(fundsHolder)
	if req.PaymentRequirements.Scheme == x402.SchemeUpto && rec.Amount != "" {
		req.PaymentRequirements.Amount = rec.Amount
	}
	return req, h
}

// settleLater settles a served async payment in the background, retrying until the outcome is final.
func (l *Ledger) settleLater(id journal.ID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx.Err() != nil {
		return // shutting down: the payment stays pending and is settled after the next start
	}
	if _, running := l.settling[id]; running {
		return
	}
	l.settling[id] = struct{}{}
	l.wg.Add(1)
	go l.settleInBackground(id)
}

// isSettling reports whether a background settlement of payment id runs here.
func (l *Ledger) isSettling(id journal.ID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, running := l.settling[id]
	return running
}

// Backlog is how many served async payments are waiting for their settlement.
func (l *Ledger) Backlog() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.settling)
}

// payerDebt counts a payer's served async payments not settled yet; done is closed when none is left.
type payerDebt struct {
	n    int
	done chan struct{}
	// waiters counts the payer's requests waiting for these payments to settle (see reserveWaiter).
	waiters int
}

// maxWaitersPerPayer bounds the requests of one payer that wait, each holding a connection, for the payer's
// earlier served payments to settle (settle async with a remote facilitator).
const maxWaitersPerPayer = 4

// reserveWaiter takes one of the payer's waiting places when the payer owes an unsettled served payment: full
// says all are taken (the request is refused before anything is verified), and release gives the place back.
// A payer who owes nothing needs no place.
func (l *Ledger) reserveWaiter(payer string) (release func(), full bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	d := l.debts[strings.ToLower(payer)]
	if d == nil {
		return func() {}, false
	}
	if d.waiters >= maxWaitersPerPayer {
		return nil, true
	}
	d.waiters++
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		d.waiters--
	}, false
}

// serveFirst decides whether a payer may be served payment id before it settles, for a gate whose facilitator
// checks the payer's funds as the chain shows them, unaware of what this gate served and has not settled yet
// (a remote facilitator). A payer who owes nothing may: id is counted against the payer until its settlement
// is final, and serveFirst returns nil. Otherwise it returns a channel that is closed once the payer's earlier
// payments have settled; the caller waits for it and settles this payment before serving it, so its
// settlement sees what the earlier ones spent and a payer is never served more than the payer can pay.
func (l *Ledger) serveFirst(id journal.ID, payer string) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	if d := l.debts[strings.ToLower(payer)]; d != nil {
		return d.done
	}
	l.oweLocked(id, payer)
	return nil
}

// owe counts a replayed async payment against its payer until its settlement is final.
func (l *Ledger) owe(id journal.ID, payer string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, counted := l.owedBy[id]; !counted {
		l.oweLocked(id, payer)
	}
}

func (l *Ledger) oweLocked(id journal.ID, payer string) {
	k := strings.ToLower(payer)
	d := l.debts[k]
	if d == nil {
		d = &payerDebt{done: make(chan struct{})}
		l.debts[k] = d
	}
	d.n++
	l.owedBy[id] = k
}

// forgive stops counting a payment that will not be settled in the background after all (its upstream
// failed, or the journal did not take it). A payment being settled stays counted until its settlement is final.
func (l *Ledger) forgive(id journal.ID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, running := l.settling[id]; !running {
		l.clearDebtLocked(id)
	}
}

func (l *Ledger) clearDebtLocked(id journal.ID) {
	k, ok := l.owedBy[id]
	if !ok {
		return
	}
	delete(l.owedBy, id)
	d := l.debts[k]
	d.n--
	if d.n == 0 {
		close(d.done)
		delete(l.debts, k)
	}
}

// gateFor finds a registered gate to settle a journalled payment of requirement rq with its facilitator: one
// whose terms include rq, else (a reload changed the price or the recipient since the payment was served) one
// whose facilitator settles on rq's network. The payment is settled with rq either way, the requirement it
// was served under and its payer signed for. nil when no gate's facilitator settles on the network.
func (l *Ledger) gateFor(rq x402.PaymentRequirements) (g *Gate, sameTerms bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, g := range l.gates {
		for _, s := range g.cfg.Offers {
			if s.sameTerms(rq) {
				return g, true
			}
		}
	}
	for _, g := range l.gates {
		if g.settlesOn(rq.Network) {
			return g, false
		}
	}
	return nil, false
}

// settleState is what the attempts of one background settlement carry from one to the next.
type settleState struct {
	unexpected  int  // unexpected_settle_error answers so far
	warnedNoFac bool // the wait for a facilitator of the payment's network was logged
	notedTerms  bool // settling under terms no gate offers any more was logged
	// noWallet is the last no_available_wallets answer: for a payment bound to a settlement wallet, another
	// instance sharing the journal holds its lease (it moved since the payment was served).
	noWallet string
}

// settleInBackground settles one async payment. An unreachable facilitator, a settlement still pending and a
// busy wallet pool are retried with a growing pause; any other answer is final and recorded.
func (l *Ledger) settleInBackground(id journal.ID) {
	defer l.wg.Done()
	defer func() {
		l.mu.Lock()
		delete(l.settling, id)
		l.clearDebtLocked(id)
		l.mu.Unlock()
	}()
	log := l.log.With(zap.String("payment", id.String()))
	pause := asyncRetryMin
	var st settleState
	if held := l.pool.pause.Load(); held != nil {
		select {
		case <-*held:
		case <-l.ctx.Done():
			return
		}
	}
	for {
		select {
		case l.slots <- struct{}{}:
		case <-l.ctx.Done():
			return
		}
		again := l.settleAttempt(log, id, &st)
		<-l.slots
		if !again {
			return
		}
		select {
		case <-l.ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, asyncRetryMax)
	}
}

// settleAttempt makes one attempt and reports whether another is needed.
func (l *Ledger) settleAttempt(log *zap.Logger, id journal.ID, st *settleState) bool {
	rec, ok, err := l.store.Get(l.ctx, id)
	if err != nil {
		if l.ctx.Err() == nil {
			log.Warn("reading an async payment from the journal", zap.Error(err))
		}
		return true
	}
	if !ok || rec.State == journal.StateFinal || !rec.Async {
		return false
	}
	if _, shared := l.store.(journal.Cluster); shared && rec.Owner != l.owner {
		// Another instance took the payment over: the holder of the settlement wallet it is bound to, or a
		// process that found this one dead. It settles it; settling here too would only race it.
		log.Info("a served async payment was taken over by another instance, which settles it; leaving it to that instance",
			zap.String("owner", rec.Owner))
		return false
	}
	var req x402.SettleRequest
	if err := json.Unmarshal(rec.Request, &req); err != nil {
		log.Error("an async payment cannot be settled: its journal record holds no readable request; settle it by hand",
			zap.String("payer", rec.Payer), zap.String("amount", rec.Amount), zap.Error(err))
		return false
	}
	rq := req.PaymentRequirements
	g, sameTerms := l.gateFor(rq)
	if g == nil {
		deadline := req.PaymentPayload.Payload.Deadline()
		if !deadline.IsZero() && l.now().After(deadline.Add(asyncExpiryMargin)) {
			l.expire(log, id, rec, req, deadline)
			return false
		}
		if !st.warnedNoFac {
			log.Warn("no configured gate's facilitator settles on the network of a served async payment; it waits for one until its authorization expires",
				zap.String("network", rq.Network), zap.String("pay_to", rq.PayTo), zap.String("amount", rq.Amount),
				zap.Time("deadline", deadline))
			st.warnedNoFac = true
		}
		return true
	}
	if !sameTerms && !st.notedTerms {
		log.Info("no configured gate offers the terms a served async payment was served under any more; settling it under those terms",
			zap.String("facilitator", g.cfg.FacilitatorName), zap.String("network", rq.Network), zap.String("pay_to", rq.PayTo),
			zap.String("amount", rq.Amount))
		st.notedTerms = true
	}
	charge := req // what is settled; req stays the payment as served (and held)
	if rq.Scheme == x402.SchemeUpto && rec.Amount != "" {
		// Served under the offer's maximum (req); charged what the upstream named then, kept in the record.
		charge.PaymentRequirements.Amount = rec.Amount
	}
	// resend: an earlier attempt may have reached a remote facilitator and settled the payment, its answer lost; a
	// refusal now is then no proof that nothing settled (see fail).
	resend := mayHaveSettled(rec)
	if !g.cfg.Embedded && !resend {
		// Written before the request goes, so that whoever settles the payment next (this process, or another
		// after a restart or a takeover) knows this one may have reached the facilitator if its answer is lost.
		// The engine knows what it sent, and answers from its own journal.
		if err := l.noteAttempt(id, requestedSettlement(rq.Network, rec.Payer)); err != nil {
			if l.ctx.Err() == nil && !errors.Is(err, errAdopted) {
				log.Warn("recording that an async payment's settlement is requested, before requesting it; trying again", zap.Error(err))
			}
			return true
		}
	}
	// nothingReached: this attempt surely reached no facilitator, or its answer says nothing was sent; the
	// record no longer says it may have settled, so that a refusal of the next attempt is final.
	nothingReached := func() {
		if g.cfg.Embedded || resend {
			return
		}
		if err := l.noteAttempt(id, nil); err != nil && l.ctx.Err() == nil && !errors.Is(err, errAdopted) {
			log.Warn("recording that an async payment's settlement reached no facilitator; a refusal of it will be taken as of unknown outcome",
				zap.Error(err))
		}
	}
	ctx, cancel := context.WithTimeout(l.ctx, settleTimeout)
	resp, err := g.fac.Settle(ctx, charge)
	cancel()
	log = log.With(zap.String("facilitator", g.cfg.FacilitatorName), zap.String("payer", rec.Payer), zap.String("amount", rec.Amount))
	switch {
	case err != nil:
		if errors.Is(err, x402.ErrNotSent) {
			nothingReached()
		}
		if l.ctx.Err() == nil {
			log.Warn("background settlement: facilitator unreachable; retrying", zap.String("error", g.describe(err)))
		}
		return true
	case resp.Success && x402.SettlementProblem(charge, resp) != "":
		// Not proof that this payment settled: looked at again later, as an unknown outcome.
		log.Error("background settlement: the facilitator answered success for a settlement it does not show; retrying",
			zap.String("problem", x402.SettlementProblem(charge, resp)))
		return true
	case resp.Success:
		l.finalise(log, id, resp)
		log.Info("async payment settled", zap.String("network", resp.Network), zap.String("tx", resp.Transaction))
		return false
	case resp.ErrorReason == x402.ReasonNoAvailableWallets:
		deadline := req.PaymentPayload.Payload.Deadline()
		if !deadline.IsZero() && l.now().After(deadline.Add(asyncExpiryMargin)) {
			// No wallet was had for it, so this attempt sent nothing, and past its deadline none can.
			resp.ErrorMessage += fmt.Sprintf("; the authorization expired at %s before a settlement wallet could settle it", deadline.UTC().Format(time.RFC3339))
			l.fail(log, g, id, rec, req, resp, "an async payment was served but never settled: no settlement wallet could send it before its authorization expired; the resource went unpaid")
			return false
		}
		nothingReached()
		if st.noWallet == "" {
			log.Warn("background settlement: no settlement wallet here can send it; retrying until its authorization expires (a payment bound to a wallet another instance holds is taken over by that instance)",
				zap.String("message", resp.ErrorMessage), zap.String("bound_wallet", x402.BoundWallet(rq, req.PaymentPayload.Payload)),
				zap.Time("deadline", deadline))
		}
		st.noWallet = resp.ErrorMessage
		return true
	case resp.Pending(), !g.cfg.Embedded && resp.OutcomeUnknown():
		// Sent and not final yet; a remote facilitator's failure after its broadcast too (see settleThenServe).
		return true
	case resp.ErrorReason == x402.ReasonUnexpectedSettleError && st.unexpected < asyncUnexpectedLimit:
		nothingReached() // a failure naming no transaction: nothing was sent (see x402.SettleResponse.OutcomeUnknown)
		st.unexpected++
		log.Warn("background settlement failed unexpectedly; retrying", zap.String("reason", resp.ErrorMessage))
		return true
	}
	what := "an async payment was served but its settlement was refused; the resource went unpaid"
	if st.noWallet != "" {
		what = "an async payment was served but never settled: no settlement wallet could send it before its settlement was refused; the resource went unpaid"
	}
	l.fail(log, g, id, rec, req, resp, what)
	return false
}

// fail records the final failure of a served async payment (settlement refused, or never possible before its
// deadline): its record becomes final with resp, which says why, so that it leaves the backlog and no longer
// counts against its payer; the failure is logged at error level with what, and reported as payment_failed. req
// is the payment as it was served (an upto one at its maximum, as it was held); rec, its record as this attempt
// found it.
//
// A record that says an earlier attempt may have reached a remote facilitator (mayHaveSettled) makes the failure
// no proof that nothing settled: a facilitator that keeps no journal of the settlement it made refuses the
// payment then, its nonce spent ("nonce already used"), and an expired authorization may have been settled in
// time. The payment's outcome is then not known, and said so: its record becomes final as settlement requested
// and not answered (the payment presented again gets the response it may have paid for, never a 402 asking to
// pay again), the operator is told at error level to check the chain, and it is reported as settle-unreachable
// (payment_pending), never as a resource that went unpaid.
func (l *Ledger) fail(log *zap.Logger, g *Gate, id journal.ID, rec journal.Record, req x402.SettleRequest, resp x402.SettleResponse, what string) {
	rq := req.PaymentRequirements
	final, outcome := resp, x402.OutcomeSettleFailed
	if mayHaveSettled(rec) {
		final = *requestedSettlement(rq.Network, rec.Payer)
		final.ErrorMessage = fmt.Sprintf("outcome not known: an earlier request to settle the payment may have reached the facilitator and settled it, its answer lost; then %s: %s",
			resp.ErrorReason, resp.ErrorMessage)
		outcome = x402.OutcomeSettleUnreachable
		what = "an async payment was served and the outcome of its settlement is not known: an earlier request to settle it may have reached the facilitator and settled it, its answer lost, " +
			"and the payment is now refused, as a payment that settled already is; check the chain for its transfer before taking the resource as unpaid"
	}
	l.finalise(log, id, final)
	log.Error(what, zap.String("reason", resp.ErrorReason), zap.String("message", resp.ErrorMessage), zap.String("tx", resp.Transaction))
	if g == nil {
		return
	}
	if h, ok := g.fac.(fundsHolder); ok {
		// Given up: what it held against the payer's funds is the payer's again (the facilitator let go already
		// of a refusal it knows to be final, not of one it would retry).
		if err := h.Release(req); err != nil {
			// Its record is final: the hold ends at the payment's deadline (the engine prunes it).
			log.Warn("letting go of a failed payment's funds hold", zap.Error(err))
		}
	}
	if g.cfg.Event == nil {
		return
	}
	g.cfg.Event(nil, outcomeEvents[outcome], func() map[string]any {
		return map[string]any{
			"network": rq.Network, "asset": rq.Asset, "amount": rec.Amount, "pay_to": rq.PayTo,
			"method": x402.TransferMethod(rq, req.PaymentPayload.Payload), "payer": rec.Payer, "async": true,
			"outcome": string(outcome), "reason": resp.ErrorReason, "payment": id.String(),
		}
	})
}

// mayHaveSettled reports whether the record of an async payment not settled yet says an earlier attempt of its
// settlement may have reached a remote facilitator, and no answer of it was had: it may have settled.
func mayHaveSettled(rec journal.Record) bool {
	return rec.Response != nil && rec.Response.OutcomeUnknown()
}

// noteAttempt writes into the record of an async payment what an attempt of its settlement leaves known: resp,
// the settlement requested (written before a request to a remote facilitator goes), or nil, nothing reached a
// facilitator. A record final, or taken over by another instance, is left as it is: errAdopted.
func (l *Ledger) noteAttempt(id journal.ID, resp *x402.SettleResponse) error {
	_, shared := l.store.(journal.Cluster)
	_, err := l.store.Update(l.ctx, id, func(r *journal.Record) error {
		if r.State == journal.StateFinal || (shared && r.Owner != l.owner) {
			return errAdopted
		}
		r.Response = resp
		return nil
	})
	return err
}

// expire finishes a served async payment that no facilitator can settle any more: no configured gate's
// facilitator settled on its network before its authorization expired (see fail).
func (l *Ledger) expire(log *zap.Logger, id journal.ID, rec journal.Record, req x402.SettleRequest, deadline time.Time) {
	rq := req.PaymentRequirements
	reason := x402.ReasonValidBefore
	if x402.TransferMethod(rq, req.PaymentPayload.Payload) == x402.TransferPermit2 {
		reason = x402.ReasonPermit2DeadlineExpired
	}
	resp := x402.SettleResponse{Success: false, Network: rq.Network, Payer: rec.Payer, ErrorReason: reason,
		ErrorMessage: fmt.Sprintf("%s: the authorization expired at %s while no configured facilitator settled on %s",
			x402.MessagePermitExpired, deadline.UTC().Format(time.RFC3339), rq.Network)}
	// Reported through a gate of this journal: none settles on the network, but its hooks are the server's.
	l.mu.Lock()
	var g *Gate
	if len(l.gates) > 0 {
		g = l.gates[0]
	}
	l.mu.Unlock()
	l.fail(log.With(zap.String("network", rq.Network), zap.String("payer", rec.Payer), zap.String("pay_to", rq.PayTo),
		zap.String("amount", rq.Amount), zap.Time("deadline", deadline)), g, id, rec, req, resp,
		"an async payment was served but never settled: no configured gate's facilitator settles on its network, and its authorization has expired; the resource went unpaid")
}

// finalise records the final answer of an async payment, trying again with a growing pause until the journal
// takes it or the ledger stops. Nothing else would: the payment's settlement is over, so no attempt of it is left to
// write it, and a record left unfinal while its owner lives is nobody else's to settle, so it would stay in the
// backlog for ever (the journal's database down as the settlement ended, say). Stopped first, the record stays as it
// is, and the next start settles it again: the facilitator answers from its own journal.
func (l *Ledger) finalise(log *zap.Logger, id journal.ID, resp x402.SettleResponse) {
	for pause := asyncRetryMin; ; pause = min(2*pause, asyncRetryMax) {
		_, err := l.store.Update(context.Background(), id, func(r *journal.Record) error {
			if r.State != journal.StateFinal {
				r.State, r.Response = journal.StateFinal, &resp
			}
			return nil
		})
		switch {
		case err == nil, errors.Is(err, journal.ErrNotFound):
			return
		case errors.Is(err, journal.ErrCorrupt), errors.Is(err, journal.ErrInvalidUpdate):
			// Never written, however often it is tried: the settlement stands, and the record is left to a person.
			log.Error("recording the outcome of an async payment; the journal's record of it cannot take it", zap.String("tx", resp.Transaction),
				zap.Bool("success", resp.Success), zap.Error(err))
			return
		}
		log.Warn("recording the outcome of an async payment; trying again", zap.String("tx", resp.Transaction),
			zap.Bool("success", resp.Success), zap.Duration("retry_in", pause), zap.Error(err))
		select {
		case <-l.ctx.Done():
			return
		case <-time.After(pause):
		}
	}
}

// pruneLoop deletes the journal's final records gatePruneAfter past their deadline, once at start and then
// every gatePruneEvery, while no embedded engine prunes the journal (its own pruning keeps them longer).
func (l *Ledger) pruneLoop() {
	defer l.wg.Done()
	t := time.NewTicker(gatePruneEvery)
	defer t.Stop()
	for {
		if !l.enginePrunes() {
			if n, err := l.prune(l.now()); err != nil {
				if l.ctx.Err() == nil {
					l.log.Warn("pruning the settlement journal", zap.Error(err))
				}
			} else if n > 0 {
				l.log.Info("pruned final payments past their deadline from the journal", zap.Int("records", n),
					zap.Duration("past_deadline", gatePruneAfter))
			}
		}
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
	}
}

// enginePrunes reports whether an embedded engine prunes the journal: a gate of a config with one is registered.
func (l *Ledger) enginePrunes() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.gates, func(g *Gate) bool { return g.cfg.EnginePrunes })
}

// prune deletes the final records gatePruneAfter past their deadline at now, and returns how many.
func (l *Ledger) prune(now time.Time) (int, error) {
	return l.store.Prune(l.ctx, now.Add(-gatePruneAfter))
}
