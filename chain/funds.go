package chain

import (
	"context"
	"errors"
	"math/big"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// funds is what each payer can still pay as this engine sees it: the token balance and the allowance to Permit2,
// read from the chain at one block, less the payments this engine has taken on (settling, or served by a gate
// that settles afterwards) that the chain did not show at that block. Every transfer method is counted and held
// the same way (see payment.fundsLimit): all of them spend the balance, and a permit2 payment spends the Permit2
// allowance too. A payment whose settlement applies the payer's gas-sponsoring permit is held like any other;
// the allowance it counts against is the one the permit grants, since an EIP-2612 permit sets the allowance
// rather than adding to it.
//
// A hold lasts as long as someone still means to settle its payment: until its settlement is seen mined, is
// refused for good (or reverts), or its deadline passes. A hold taken for a payment a gate served before
// settling it (served) outlives a settlement attempt that failed for now (a node that could not be reached, a
// busy wallet pool): the gate tries again, and the payer's funds are spent meanwhile. Only the gate's Release
// lets it go earlier, when the gate will not settle it after all.
//
// It serves two purposes. Payments held against a payer are counted before anything is sent, so a payer whose
// balance covers three payments is not sent a fourth settlement that would revert and burn gas while the first
// three wait in the node's pool, and a gate that serves before settling does not serve more than the payer can
// pay. And a fresh read (younger than ttl) answers the balance and allowance checks of later payments of the
// same payer without asking the chain: a verification then needs no chain call at all. Only positive answers
// come from the cache; a payment it does not cover is checked against the chain afresh.
//
// With a journal several processes share (a journal.Cluster), the holds are the journal's, so that what one
// process holds against a payer every process counts (see check): two gates cannot together serve a payer more
// than the payer can pay. Reads stay each process's own.
type funds struct {
	ttl time.Duration // how long a read answers for; 0: every verification reads the chain
	now func() time.Time

	// shared keeps the holds when several processes share the journal; network names this engine's network in
	// the holds' keys.
	shared  journal.Cluster
	network string

	mu     sync.Mutex
	payers map[fundsKey]*payerFunds
	byID   map[journal.ID]fundsKey
}

type fundsKey struct{ token, payer common.Address }

type payerFunds struct {
	read   fundsRead
	readAt time.Time
	seenAt time.Time            // the payer's last payment checked against the chain
	holds  map[journal.ID]*hold // what the read does not reflect
	held   *big.Int             // the sum of holds, so that a check costs the same however many there are
}

// fundsRead is a payer's balance and Permit2 allowance at one block.
type fundsRead struct {
	block     uint64 // 0: never read
	balance   *big.Int
	allowance *big.Int
}

// hold is a payment taken on and not yet seen settled on chain.
type hold struct {
	amount      *big.Int
	deadline    uint64   // chain time after which the payment can no longer be mined
	mined       uint64   // block its settlement was mined in; 0 until known
	permitNonce *big.Int // the token nonce of the EIP-2612 permit its settlement applies; nil when it applies none
	served      bool     // taken for a payment served before it settles (see funds)
}

// fundsSweepAt is the number of payers tracked past which idle entries are dropped.
const fundsSweepAt = 4096

func newFunds(ttl time.Duration, now func() time.Time) *funds {
	return &funds{ttl: ttl, now: now, payers: map[fundsKey]*payerFunds{}, byID: map[journal.ID]fundsKey{}}
}

// cover reports whether the payer's funds cover p beside every other payment held against them: from r, a read
// just made, or from the last read when r is nil and that read is fresh (known is false when there is none).
// Unless use is fundsVerify, a covered payment is held until its settlement is seen mined (mined), is let go
// (drop), or its deadline passes; with fundsHold, as a served payment's. A payment already held is covered by its
// own hold; one whose permit nonce another held payment carries is not, whatever the funds (coverOrClash). avail is
// what the payer can still pay beside the holds (see payment.fundsLimit).
func (fs *funds) cover(p *payment, chainTime uint64, r *fundsRead, use fundsUse) (ok, known bool, avail *big.Int) {
	ok, known, _, avail = fs.coverOrClash(p, chainTime, r, use)
	return ok, known, avail
}

// coverOrClash is cover, saying too whether p was refused for its permit nonce (clash), which another held payment
// carries: the chain takes it once, so whatever the funds, p is not held beside it (see pgHoldSQL).
func (fs *funds) coverOrClash(p *payment, chainTime uint64, r *fundsRead, use fundsUse) (ok, known, clash bool, avail *big.Int) {
	key := fundsKey{p.asset.Address, p.payer}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	pf := fs.readLocked(key, r)
	if pf == nil {
		return false, false, false, nil
	}
	if r != nil && r.block == pf.read.block {
		pf.settle(chainTime, fs.byID)
	}
	if h, held := pf.holds[p.id]; held {
		h.served = h.served || use == fundsHold
		return true, true, false, nil
	}
	avail = new(big.Int).Sub(p.fundsLimit(pf.read), pf.held)
	if pf.permitClash(p) {
		return false, true, true, avail
	}
	if avail.Cmp(p.amount) < 0 {
		return false, true, false, avail
	}
	if use != fundsVerify {
		fs.hold(pf, key, p, use == fundsHold)
	}
	return true, true, false, avail
}

// fundsLimit is what p's settlement can move at most as r shows the payer's funds, before any hold: the balance
// for every transfer method, and for permit2 the Permit2 allowance too (the one a gas-sponsoring permit sets,
// when the settlement applies one). Holds count against the whole of it, whatever their method: the limit errs
// on refusing a payer whose Permit2 allowance is low while other kinds of payment are held, never on sending a
// settlement that would revert.
func (p *payment) fundsLimit(r fundsRead) *big.Int {
	limit := r.balance
	if p.method == x402.TransferPermit2 {
		allowance := r.allowance
		if p.sponsor != nil {
			allowance = p.sponsor.permit.Value
		}
		if p.approval != nil {
			allowance = p.approval.amount // approve sets the allowance, as a permit does
		}
		if allowance.Cmp(limit) < 0 {
			limit = allowance
		}
	}
	return limit
}

// permitNonce is the token nonce of the EIP-2612 permit p's settlement applies: an erc2612 payment's own permit
// (unless it mined already), or a permit2 payment's gas-sponsoring permit. nil when it applies none. The token
// takes each nonce once, so two payments held with the same one cannot both settle.
func (p *payment) permitNonce() *big.Int {
	switch {
	case p.method == x402.TransferERC2612 && !p.permitApplied:
		return p.permit.Nonce
	case p.sponsor != nil && p.sponsor.err == nil:
		return p.sponsor.permit.Nonce
	case p.approval != nil && p.approval.err == nil:
		// The approval's account nonce, marked by bit 255 so that it never equals a token nonce of a permit: the
		// payer's account takes each nonce once, as the token takes a permit's.
		return new(big.Int).SetBit(new(big.Int).SetUint64(p.approval.tx.Nonce()), 255, 1)
	}
	return nil
}

// readLocked takes in r, a read just made (when it is not older than the one kept), and returns the payer's entry
// when its read answers: r's, or, with r nil, a fresh one. nil when there is no read to answer from. Called with
// mu held.
func (fs *funds) readLocked(key fundsKey, r *fundsRead) *payerFunds {
	pf := fs.payers[key]
	if r != nil {
		pf = fs.payer(key)
		if r.block >= pf.read.block {
			pf.read, pf.readAt = *r, fs.now()
		}
	}
	if pf == nil || pf.read.block == 0 || (r == nil && fs.now().Sub(pf.readAt) >= fs.ttl) {
		return nil
	}
	return pf
}

// forgetRead makes the payer's funds read, if any, answer no more: what it shows is known to have changed (the
// payer's allowance, set by an approval since), and the next check reads afresh.
func (fs *funds) forgetRead(p *payment) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if pf := fs.payers[fundsKey{p.asset.Address, p.payer}]; pf != nil {
		pf.readAt = time.Time{}
	}
}

// permitHeld reports whether another payment held against p's payer applies an EIP-2612 permit with the token
// nonce of the one p's settlement applies: that nonce can be spent once, and the first settlement to land spends
// it.
func (fs *funds) permitHeld(p *payment) bool {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	pf := fs.payers[fundsKey{p.asset.Address, p.payer}]
	return pf != nil && pf.permitClash(p)
}

// permitClash reports whether another payment held in pf carries p's permit nonce. Called with mu held.
func (pf *payerFunds) permitClash(p *payment) bool {
	nonce := p.permitNonce()
	if nonce == nil {
		return false
	}
	for id, h := range pf.holds {
		if id != p.id && h.permitNonce != nil && h.permitNonce.Cmp(nonce) == 0 && holdCountsAt(h.mined, h.deadline, h.permitNonce, p.head) {
			return true
		}
	}
	return false
}

// simulationSuffices reports whether the simulation of p's settlement, which just succeeded, answers for the
// payer's funds alone: nothing else is held against the payer, and the payer paid nothing within the TTL (a read
// of a one-off payer's funds would cost three chain calls and never answer for a later payment). p is then held
// (unless use is fundsVerify) without a read. A repeat payer is worth the read, which answers the payer's next
// payments.
func (fs *funds) simulationSuffices(p *payment, use fundsUse) bool {
	if fs.shared != nil {
		return false // whether other processes hold anything against the payer, only a read and the journal say
	}
	key := fundsKey{p.asset.Address, p.payer}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	now := fs.now()
	pf := fs.payer(key)
	others := len(pf.holds)
	if _, self := pf.holds[p.id]; self {
		others--
	}
	repeat := fs.ttl > 0 && !pf.seenAt.IsZero() && now.Sub(pf.seenAt) < fs.ttl
	pf.seenAt = now
	if others > 0 || repeat {
		return false
	}
	if use != fundsVerify {
		fs.hold(pf, key, p, use == fundsHold)
	}
	return true
}

// payer returns the entry of key, made (after sweeping idle entries, when there are many) if there is none.
// Called with mu held.
func (fs *funds) payer(key fundsKey) *payerFunds {
	pf := fs.payers[key]
	if pf == nil {
		if len(fs.payers) >= fundsSweepAt {
			fs.sweep()
		}
		pf = &payerFunds{holds: map[journal.ID]*hold{}, held: new(big.Int)}
		fs.payers[key] = pf
	}
	return pf
}

// hold holds p against pf; served marks it as a served payment's (see funds). Called with mu held.
func (fs *funds) hold(pf *payerFunds, key fundsKey, p *payment, served bool) {
	if h, held := pf.holds[p.id]; held {
		h.served = h.served || served
		return
	}
	h := &hold{amount: new(big.Int).Set(p.amount), deadline: deadlineUint(p), permitNonce: p.permitNonce(), served: served}
	pf.holds[p.id] = h
	pf.held.Add(pf.held, p.amount)
	fs.byID[p.id] = key
}

// settle drops, after a new read, the holds the chain has caught up with (mined at or before the read) and those
// that can no longer be mined (past their deadline, never seen mined). A hold stays counted until a read shows
// it gone, which errs on the side of refusing: a refusal from the holds is always checked with a new read.
func (pf *payerFunds) settle(chainTime uint64, byID map[journal.ID]fundsKey) {
	for id, h := range pf.holds {
		if (h.mined != 0 && h.mined <= pf.read.block) || (h.mined == 0 && h.deadline < chainTime) {
			pf.remove(id, byID)
		}
	}
}

func (pf *payerFunds) remove(id journal.ID, byID map[journal.ID]fundsKey) {
	if h := pf.holds[id]; h != nil {
		pf.held.Sub(pf.held, h.amount)
		delete(pf.holds, id)
	}
	delete(byID, id)
}

// shrink lowers the hold of p, placed at an upto payment's maximum when it was verified, to p.amount, what its
// settlement moves: the rest of the maximum is the payer's again as soon as the settlement is under way, not only
// once a read shows it mined. A payment not held, or held at no more, is left alone.
//
// With shared holds the journal offers no way to lower a hold in place, and letting it go to hold it again would
// leave a moment in which another payment could take the room: the hold stays at the maximum until the
// settlement is seen mined, which errs on refusing (another payment of the payer meanwhile may be refused for
// funds it has).
func (fs *funds) shrink(p *payment) {
	if fs.shared != nil {
		return
	}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	key, ok := fs.byID[p.id]
	if !ok {
		return
	}
	pf := fs.payers[key]
	if h := pf.holds[p.id]; h != nil && h.amount.Cmp(p.amount) > 0 {
		pf.held.Sub(pf.held, new(big.Int).Sub(h.amount, p.amount))
		h.amount = new(big.Int).Set(p.amount)
	}
}

// mined records that a held payment's settlement was mined in block: reads from that block on reflect it.
func (fs *funds) mined(id journal.ID, block uint64) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if key, ok := fs.byID[id]; ok {
		if h := fs.payers[key].holds[id]; h != nil && h.mined == 0 {
			h.mined = block
		}
	}
}

// drop lets go of a hold whose payment will not move tokens (refused for good, reverted, or not to be settled);
// with unlessServed, a served payment's hold stays (see funds).
func (fs *funds) drop(id journal.ID, unlessServed bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if key, ok := fs.byID[id]; ok {
		pf := fs.payers[key]
		if h := pf.holds[id]; h != nil && h.served && unlessServed {
			return
		}
		pf.remove(id, fs.byID)
	}
}

// holdServed holds p, a payment a gate served before settling it, without checking the payer's funds: it was
// checked when it was served, and until it settles it is what the payer owes, whatever the funds are now (a
// settlement they no longer cover is refused, and lets the hold go). Only for holds of this process's own:
// shared holds live in the journal.
func (fs *funds) holdServed(p *payment) {
	key := fundsKey{p.asset.Address, p.payer}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.hold(fs.payer(key), key, p, true)
}

// sweep drops payers with nothing held whose read is stale. Called with mu held.
func (fs *funds) sweep() {
	now := fs.now()
	for key, pf := range fs.payers {
		if len(pf.holds) == 0 && now.Sub(pf.readAt) >= fs.ttl && now.Sub(pf.seenAt) >= fs.ttl {
			delete(fs.payers, key)
		}
	}
}

// sharedHoldTimeout bounds a write of the shared holds made outside a caller's context (mined, drop).
const sharedHoldTimeout = 5 * time.Second

// holdKey names whose funds a payment is held against in the shared holds.
func (fs *funds) holdKey(p *payment) string {
	return fs.keyPrefix() + p.asset.Address.Hex() + ":" + p.payer.Hex()
}

// keyPrefix starts the key of every shared hold of this engine's network.
func (fs *funds) keyPrefix() string { return fs.network + ":" }

// check is coverOrClash for every kind of journal: with shared holds, the journal answers what the other payments
// of the payer hold (and holds p, unless use is fundsVerify); an error says the journal could not be asked. clash:
// p was refused for its permit nonce, which another held payment carries (for shared holds, only with take).
func (fs *funds) check(ctx context.Context, p *payment, chainTime uint64, r *fundsRead, use fundsUse) (ok, clash bool, avail *big.Int, err error) {
	if fs.shared == nil {
		ok, _, clash, avail = fs.coverOrClash(p, chainTime, r, use)
		return ok, clash, avail, nil
	}
	fs.mu.Lock()
	pf := fs.readLocked(fundsKey{p.asset.Address, p.payer}, r)
	if pf == nil {
		fs.mu.Unlock()
		return false, false, nil, nil
	}
	read := pf.read
	fs.mu.Unlock()
	h := journal.Hold{ID: p.id, Key: fs.holdKey(p), Amount: p.amount, Deadline: deadlineUint(p), PermitNonce: p.permitNonce(), Served: use == fundsHold}
	if use == fundsSettle && p.pending.unsent() {
		// The hold goes with the claim and the signed transaction's record, which decide it (see signedWithHold):
		// taken as held here, for the checks after this one.
		p.pending.hold = &deferredHold{holds: fs.shared, h: h, avail: p.fundsLimit(read), readBlock: read.block, chainTime: chainTime}
		return true, false, nil, nil
	}
	ok, avail, err = fs.shared.Hold(ctx, h, p.fundsLimit(read), read.block, chainTime, use != fundsVerify)
	if errors.Is(err, journal.ErrPermitNonceHeld) {
		return false, true, avail, nil
	}
	return ok, false, avail, err
}

// checkUnrecorded is check, for shared holds, of a payment the journal holds no record of: the journal's read of
// the record goes with its read of the holds (journal.UnrecordedAndCovered), or into the hold's transaction
// unless use is fundsVerify (journal.UnrecordedAndHeld), one round trip fewer. ok false when the journal holds a
// record of p (it was presented before, and the chain answers for it; nothing is held), or the payer has no fresh
// read (the journal is not asked: the chain answers).
func (fs *funds) checkUnrecorded(ctx context.Context, p *payment, chainTime uint64, use fundsUse) (ok bool, err error) {
	fs.mu.Lock()
	pf := fs.readLocked(fundsKey{p.asset.Address, p.payer}, nil)
	if pf == nil {
		fs.mu.Unlock()
		return false, nil
	}
	read := pf.read
	fs.mu.Unlock()
	h := journal.Hold{ID: p.id, Key: fs.holdKey(p), Amount: p.amount, Deadline: deadlineUint(p), PermitNonce: p.permitNonce(), Served: use == fundsHold}
	readHolds := journal.UnrecordedAndCovered
	if use != fundsVerify {
		readHolds = journal.UnrecordedAndHeld
	}
	unrecorded, ok, _, err := readHolds(ctx, fs.shared, h, p.fundsLimit(read), read.block, chainTime)
	return unrecorded && ok, err
}

// deadlineUint is p's deadline as chain time, the largest one when it does not fit.
func deadlineUint(p *payment) uint64 {
	d := p.deadlineValue()
	if !d.IsUint64() {
		return ^uint64(0)
	}
	return d.Uint64()
}

// permitInUse is permitHeld for every kind of journal.
func (fs *funds) permitInUse(ctx context.Context, p *payment) (bool, error) {
	nonce := p.permitNonce()
	if fs.shared == nil || nonce == nil {
		return fs.permitHeld(p), nil
	}
	holds, err := fs.shared.HoldsOf(ctx, fs.holdKey(p))
	if err != nil {
		return false, err
	}
	for _, h := range holds {
		if h.ID != p.id && h.PermitNonce != nil && h.PermitNonce.Cmp(nonce) == 0 && holdCountsAt(h.Mined, h.Deadline, h.PermitNonce, p.head) {
			return true, nil
		}
	}
	return false, nil
}

// holdCountsAt reports whether a hold of permit nonce permitNonce (see permitNonce) seen mined in block mined (0: not
// seen mined), whose payment's deadline is deadline, still holds its permit nonce at head: not mined at or before
// it, nor, for a token permit, past its deadline unmined, as the hold statement's live holds (pgHoldSQL) and
// payerFunds.settle judge. Stored holds that no longer count stay until pruned: one of another payment of the same
// permit nonce, past its deadline, must not refuse the payer's new payment of that nonce (its permit never applied,
// the payer signed it again). A sponsored approval's hold (an account nonce) counts past its deadline: the gas
// money and the approval it sends have none, and may still be on their way (a second payment funding the payer
// again). Every hold counts when there is no head.
func holdCountsAt(mined, deadline uint64, permitNonce *big.Int, head *types.Header) bool {
	if head == nil || head.Number == nil {
		return true
	}
	if mined != 0 && mined <= head.Number.Uint64() {
		return false
	}
	return mined != 0 || deadline >= head.Time || permitNonce != nil && permitNonce.Bit(255) == 1
}

// sawMined is mined for every kind of journal. An error says the shared holds' database did not take it: the hold
// stays counted, which errs on refusing, never on serving unpaid; a caller that can write it again later must,
// for until then nothing else ends the hold before its deadline (see Facilitator.finalise).
func (fs *funds) sawMined(id journal.ID, block uint64) error {
	if fs.shared == nil {
		fs.mined(id, block)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), sharedHoldTimeout)
	defer cancel()
	return fs.shared.HoldMined(ctx, id, block)
}

// let is drop for every kind of journal: the payment will not move tokens. An error is as sawMined's.
func (fs *funds) let(id journal.ID) error { return fs.unhold(id, false) }

// failedForNow lets go of the hold of a payment whose settlement sent nothing and will be tried again, unless it
// is a served payment's (see funds). An error is as sawMined's.
func (fs *funds) failedForNow(id journal.ID) error { return fs.unhold(id, true) }

func (fs *funds) unhold(id journal.ID, unlessServed bool) error {
	if fs.shared == nil {
		fs.drop(id, unlessServed)
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), sharedHoldTimeout)
	defer cancel()
	return fs.shared.Unhold(ctx, id, unlessServed)
}
