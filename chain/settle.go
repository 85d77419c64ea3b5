package chain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// errNotSent marks a settlement that sent nothing for a reason of the settlement's, not the payment's: the node
// refused the transaction (its settlement wallet short of gas money, its fee or nonce refused), or it could not be
// recorded before anything left the process. Nothing is on its way and nothing is wrong with the payment, so it is
// answered as an error (the facilitator could not settle it now), never as a refusal: a gate then tells the payer
// to present the same payment again (502), not to pay again (402), and a gate that served it settles it later.
var errNotSent = errors.New("the settlement transaction could not be sent")

// errRecordUnknown marks a settlement that sent nothing because the write recording its signed transaction was cut
// off by the journal's database going out of reach: the write may have committed (a connection lost after the
// commit, before its answer), and then the journal holds the transaction as broadcast, which reconciliation sends.
// Its claim and funds hold stay for reconciliation, which sends that transaction or releases both.
var errRecordUnknown = errors.New("whether the journal recorded the signed settlement transaction is unknown")

// errClaimLost marks a settlement whose claim of the payment is no longer the journal's record of it: another
// instance took the payment over while this one looked dead to it (its heartbeat lapsed, say while the
// journal's database was down), and released or settled it. Nothing was sent by this settlement: the write that
// makes a record broadcast checks the claim in the same transaction, before any transaction leaves.
var errClaimLost = errors.New("the payment's claim was taken over by another instance")

// checkClaim refuses, with errClaimLost, a write to the record r of payment p that is no longer p's claim.
func checkClaim(p *payment, r *journal.Record) error {
	if !r.SameClaim(&p.claim) {
		return fmt.Errorf("%w (the record is %s's, claimed at %s)", errClaimLost, r.Owner, r.ClaimedAt.Format(time.RFC3339Nano))
	}
	return nil
}

// asClaimLost is err as errClaimLost when a write to the payment's claim found it another's or gone (taken over
// and released); nil for any other err.
func asClaimLost(err error) error {
	switch {
	case errors.Is(err, errClaimLost):
		return err
	case errors.Is(err, journal.ErrNotFound):
		return fmt.Errorf("%w: %w", errClaimLost, err)
	}
	return nil
}

// markSending flags a payment whose transactions are being signed and sent, which reconciliation must not touch.
func (f *Facilitator) markSending(id journal.ID, on bool) {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	if on {
		f.sending[id] = true
	} else {
		delete(f.sending, id)
	}
}

// flight is one settlement under way in this process; later callers of the same payment wait for its answer.
type flight struct {
	p    *payment
	done chan struct{}
	resp x402.SettleResponse
	err  error
}

// Settle settles a payment exactly once. The payment is claimed in the journal before anything is sent, so
// concurrent and repeated calls for one payment lead to one transaction and share its answer. A receipt not seen
// within the network's receipt timeout gives the non-final settlement_pending answer with the transaction hash;
// asking again later answers from the journal.
//
// An upto payment settles paymentRequirements.amount, from zero up to the maximum the payer permitted, from the
// settlement wallet its witness names. Zero sends nothing: the payment is recorded as settled, for nothing.
func (f *Facilitator) Settle(ctx context.Context, req x402.SettleRequest) (resp x402.SettleResponse, err error) {
	defer func() { f.noteSettle(req, resp, err) }()
	p, ref := f.parse(req, true)
	if ref == nil {
		var err error
		if ref, err = f.admitSettlement(ctx, p); err != nil {
			return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
		}
	}
	if ref != nil {
		return failed(req.PaymentRequirements.Network, x402.ClaimedPayer(req), "", ref), nil
	}
	return f.settleParsed(ctx, p, req)
}

// settleParsed settles a parsed and admitted payment exactly once (see Settle): one settlement of it in this
// process at a time, the later callers waiting for its answer.
func (f *Facilitator) settleParsed(ctx context.Context, p *payment, req x402.SettleRequest) (x402.SettleResponse, error) {
	f.flightMu.Lock()
	if fl, ok := f.flights[p.id]; ok {
		f.flightMu.Unlock()
		if !fl.p.same(p) {
			return failed(p.net.caip2, p.payer.Hex(), "", reused(p)), nil
		}
		select {
		case <-fl.done:
			return fl.resp, fl.err
		case <-ctx.Done():
			return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: ctx.Err()}
		}
	}
	fl := &flight{p: p, done: make(chan struct{})}
	f.flights[p.id] = fl
	f.flightMu.Unlock()
	defer func() {
		f.flightMu.Lock()
		delete(f.flights, p.id)
		f.flightMu.Unlock()
		close(fl.done)
	}()
	fl.resp, fl.err = f.settleOnce(ctx, p, req)
	return fl.resp, fl.err
}

// markClaiming counts a settlement of this process claiming payment id or holding its claim (add 1), or one that
// stopped (add -1).
func (f *Facilitator) markClaiming(id journal.ID, add int) {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	if f.claiming[id] += add; f.claiming[id] <= 0 {
		delete(f.claiming, id)
	}
}

func (f *Facilitator) settleOnce(ctx context.Context, p *payment, req x402.SettleRequest) (x402.SettleResponse, error) {
	body := p.request
	if body == nil {
		body, _ = json.Marshal(req)
	}
	// Counted from before the claim is written to after its settlement let it go (or handed it on, broadcast): a
	// write that commits while its call fails leaves a claim that no settlement holds, which reconciliation
	// releases, and it must never take this one for such a claim.
	f.markClaiming(p.id, 1)
	counted := true
	uncount := func() {
		if counted {
			counted = false
			f.markClaiming(p.id, -1)
		}
	}
	defer uncount()
	claim := journal.Record{
		ID: p.id, State: journal.StateClaimed, Network: p.net.caip2, Payer: p.payer.Hex(), Asset: p.asset.Address.Hex(),
		Amount: p.amount.String(), PayTo: p.payTo.Hex(), Request: body, Owner: f.owner,
		// Kept until the payment can no longer be settled, however soon retention would prune it: pruned
		// earlier, a presentation of it would be new to the journal.
		Deadline: p.deadline(),
	}
	unclaimed := func(err error, found journal.Record) (x402.SettleResponse, error) {
		uncount()
		if err != nil {
			return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: fmt.Errorf("settlement journal: %w", err)}
		}
		if !f.recordedSame(p, found) {
			return failed(p.net.caip2, p.payer.Hex(), "", reused(p)), nil
		}
		return f.answerFromJournal(ctx, p, req, found)
	}
	var (
		resp x402.SettleResponse
		keep bool
		err  error
	)
	p.pending = nil
	if f.claimWithHold(p) {
		// Claimed with its funds hold and the record of its signed transaction, or with its hold (claimhold.go).
		// A settlement that ended before it held claims now, alone, and ends as its claim's owner below; one whose
		// claim is not its own touches nothing.
		p.pending = &pendingClaim{rec: claim}
		resp, keep, err = f.broadcastAndWait(ctx, p)
		if !keep {
			// A hold the checks decided on and nothing wrote was not taken: the claim goes alone.
			p.pending.hold = nil
			f.claimAlone(context.WithoutCancel(ctx), p) // to end what the settlement began, as its owner
		}
		if c := p.pending; !c.won {
			return unclaimed(c.err, c.found)
		}
	} else {
		rec, claimed, cerr := f.journal.Claim(ctx, claim)
		if cerr != nil || !claimed {
			return unclaimed(cerr, rec)
		}
		p.claim = rec
		if p.upto() && p.amount.Sign() == 0 {
			resp, keep, err = f.settleNothing(ctx, p)
		} else {
			resp, keep, err = f.broadcastAndWait(ctx, p)
		}
	}
	if f.cluster != nil && !keep && err == nil && resp.ErrorReason == x402.ReasonNoAvailableWallets {
		// No free wallet here: another instance sharing the journal may have one (see handoff.go).
		resp, keep, err = f.handOff(ctx, p, resp)
	}
	if !keep && p.unsentReleased {
		// Its record went with its shared hold (releaseUnsent), or alone where the holds are this process's own:
		// ending them again by the payment's id would end what another settlement of the payment (a concurrent
		// one of another gateway's, an adopting gateway's, a gate's) took since, its claim or its funds counted
		// free while it settles. The process's own hold, which nothing but this settlement ends, goes now.
		if p.net.funds.shared == nil {
			p.net.funds.drop(p.id, !refusedForGood(resp, err)) // as let and failedForNow
		}
	} else if !keep {
		var holdErr error
		if refusedForGood(resp, err) {
			holdErr = p.net.funds.let(p.id)
		} else {
			// Tried again later (a gate that served the payment before settling it means to): a served
			// payment's hold stays, and the payer's funds stay spent meanwhile.
			holdErr = p.net.funds.failedForNow(p.id)
		}
		if holdErr != nil {
			// The hold goes before the claim: a claim left is reconciliation's to release, and it lets the hold go
			// first (releaseClaim), where a hold left alone would be nobody's until its deadline.
			f.log.Warn("letting go of the funds hold of a settlement that sent nothing; its claim stays until reconciliation releases both",
				zap.String("payment", p.id.String()), zap.Error(holdErr))
		} else {
			// Nothing left the process: the payer may try again (after topping up, say). A claim that is not this
			// settlement's any more stays: another instance took it over while this one looked dead, and may have
			// settled the payment (which a refusal here, "nonce already used", would deny). The journal's record of
			// the payment then says what became of it.
			relErr := f.journal.Release(context.WithoutCancel(ctx), p.claim)
			if errors.Is(relErr, journal.ErrNotReleasable) {
				err = fmt.Errorf("%w: %w", errClaimLost, relErr)
			} else if relErr != nil {
				f.log.Error("releasing a settlement claim that sent nothing", zap.String("payment", p.id.String()), zap.Error(relErr))
			}
		}
		if errors.Is(err, errClaimLost) {
			return f.answerAfterLostClaim(ctx, p, req, err)
		}
	}
	if !keep {
		markSentNothing(p, err)
	}
	return resp, err
}

// markSentNothing marks the error of a settlement that kept nothing in the journal (no transaction recorded to be
// sent) as x402.ErrSentNothing when it surely sent nothing: the node refused the transaction before anything went
// out (errNotSent), or could not be asked what it needs (errNodeNotAsked). A facilitator server answers it so (a
// remote gate then takes a refusal of the payment presented again as final, and a failover set may ask another
// member), where any other error leaves the payment's outcome unknown to whoever asked over HTTP. Not marked: a
// record that may have been written (errRecordUnknown), a claim another instance took (errClaimLost), and a payment
// with a sponsored approval, whose earlier approval may be on its way.
func markSentNothing(p *payment, err error) {
	var fe *x402.FacilitatorError
	if err == nil || !errors.As(err, &fe) || fe.Err == nil || p.approval != nil ||
		errors.Is(err, errRecordUnknown) || errors.Is(err, errClaimLost) ||
		!(errors.Is(err, errNotSent) || errors.Is(err, errNodeNotAsked)) {
		return
	}
	fe.Err = sentNothing{fe.Err}
}

// sentNothing wraps a settlement's error as x402.ErrSentNothing too, its text unchanged.
type sentNothing struct{ error }

func (e sentNothing) Unwrap() []error { return []error{e.error, x402.ErrSentNothing} }

// refusedForGood reports whether a settlement that sent nothing was refused in a way a later attempt would be
// too: the payment will not move tokens. A busy wallet pool (no_available_wallets), a transaction the node would
// not take, a chain or journal that could not be asked (the last two are errors) are not: a gate that served the
// payment tries again (see gate's Ledger.settleAttempt).
func refusedForGood(resp x402.SettleResponse, err error) bool {
	return err == nil && !resp.Success && !resp.Pending() && resp.ErrorReason != x402.ReasonNoAvailableWallets
}

// answerAfterLostClaim answers a settlement whose claim was taken over before it sent anything (lost, which
// says so) from the journal's record of the payment as it is now: another settlement's claim, broadcast or
// final answer. With no record left (taken over and released), nothing was sent by anyone: the payer is told to
// present the payment again, never that it failed.
func (f *Facilitator) answerAfterLostClaim(ctx context.Context, p *payment, req x402.SettleRequest, lost error) (x402.SettleResponse, error) {
	f.log.Warn("a settlement's claim was taken over by another instance before it sent anything; answering from the journal",
		zap.String("payment", p.id.String()), zap.Error(lost))
	rec, ok, err := f.journal.Get(ctx, p.id)
	switch {
	case err != nil:
		return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: fmt.Errorf("settlement journal: %w", err)}
	case !ok:
		return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("nothing was sent: %w, which released it; present the payment again", lost)}
	case !f.recordedSame(p, rec):
		return failed(p.net.caip2, p.payer.Hex(), "", reused(p)), nil
	}
	return f.answerFromJournal(ctx, p, req, rec)
}

// broadcastAndWait re-checks the payment, sends its settlement and waits for the receipt. keep says whether
// the journal must keep the claim (something may have been broadcast).
func (f *Facilitator) broadcastAndWait(ctx context.Context, p *payment) (x402.SettleResponse, bool, error) {
	hash, ref, err := f.broadcast(ctx, p)
	switch {
	case errors.Is(err, errClaimLost):
		return x402.SettleResponse{}, false, err
	case errors.Is(err, errRecordUnknown):
		// Kept: the journal may hold the transaction as broadcast. Presented again, the payment is answered from
		// the journal once reconciliation has sent the transaction or released the claim.
		return x402.SettleResponse{}, true, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	case err != nil:
		// This settlement sent nothing (errNotSent, errNodeNotAsked, the journal out of reach), or an earlier
		// transaction of the payment is still watched: whatever the cause, not the payment's. Presented again, it
		// settles once.
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	case ref != nil:
		return failed(p.net.caip2, p.payer.Hex(), "", ref), false, nil
	}
	// Ahead of the settlements sent after it until its receipt is seen or waited for no longer (see mineTime).
	p.net.unmined.Add(1)
	defer p.net.unmined.Add(-1)
	return f.awaitReceipt(ctx, p.net, p.id, p.payer.Hex(), p.amount.String(), p.upto(), true, hash), true, nil
}

// settleNothing settles an upto payment for zero, which the journal has just claimed: the payment is checked as
// a settlement would check it before sending (its time window, a contract wallet's signature, its Permit2 nonce
// unspent), then recorded as final and successful with no transaction. Nothing goes on chain, so the payer's
// Permit2 nonce stays unspent there: the record is what makes the payment settled once (see parsePermit2). Its
// hold, if a verification placed one, is let go. keep is as broadcastAndWait's.
func (f *Facilitator) settleNothing(ctx context.Context, p *payment) (x402.SettleResponse, bool, error) {
	n := p.net
	if ref, err := p.checkTime(ctx); err != nil {
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	} else if ref != nil {
		return failed(n.caip2, p.payer.Hex(), "", ref), false, nil
	}
	if ref, err := p.checkWallet(ctx); err != nil {
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	} else if ref != nil {
		return failed(n.caip2, p.payer.Hex(), "", ref), false, nil
	}
	used, err := p.permit2NonceUsed(ctx)
	if err != nil {
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	}
	if used {
		return failed(n.caip2, p.payer.Hex(), "", refuse(x402.ReasonPermit2InvalidNonce, "Permit2 nonce %s of %s was already used", p.nonce, p.payer.Hex())), false, nil
	}
	// Its hold goes before its record is final (see finalise).
	if err := n.funds.let(p.id); err != nil {
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: fmt.Errorf("funds holds: %w", err)}
	}
	resp := x402.SettleResponse{Success: true, Network: n.caip2, Payer: p.payer.Hex(), Amount: "0"}
	if _, err := f.journal.Update(context.WithoutCancel(ctx), p.id, func(r *journal.Record) error {
		if err := checkClaim(p, r); err != nil {
			return err
		}
		r.State, r.Response = journal.StateFinal, &resp
		return nil
	}); asClaimLost(err) != nil {
		return x402.SettleResponse{}, false, asClaimLost(err)
	} else if err != nil {
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: fmt.Errorf("settlement journal: %w", err)}
	}
	f.log.Info("settlement final", zap.String("network", n.caip2), zap.String("payer", p.payer.Hex()), zap.String("amount", "0"),
		zap.String("tx", ""), zap.Bool("success", true))
	return resp, true, nil
}

// broadcast re-checks the payment against the chain and sends its settlement from a pool wallet, recording the
// signed transactions in the journal before they leave. It returns the hash of the transaction that moves the
// tokens; a refusal when the payment must not be sent (nothing was); an error when the chain could not be asked
// (nothing was sent either).
//
// The wallet is taken and the fees quoted before the chain checks: the contract wallet's signature and the
// settlement call are simulated from that wallet, with those fees and the gas limits the transactions carry, in
// the next block (see execution), and the transactions are sent exactly so.
func (f *Facilitator) broadcast(ctx context.Context, p *payment) (common.Hash, *refusal, error) {
	n := p.net
	if ref := n.penalties.refuse(p); ref != nil {
		return common.Hash{}, ref, nil
	}
	if ref, err := p.checkTime(ctx); err != nil {
		return common.Hash{}, nil, fmt.Errorf("nothing was sent: %w: %w", errNodeNotAsked, err)
	} else if ref != nil {
		return common.Hash{}, ref, nil
	}
	// The erc2612 permit's spender and the upto witness's facilitator are the only wallets that can send theirs.
	named := p.namedSender()
	var w *wallet
	var err error
	if n.pool.holdsNoFreeWallet(named) {
		// Nothing to wait for here: the settlement is handed to an instance that has one (see handoff.go).
		err = errNoAvailableWallets
		if named != nil {
			err = errWalletNotHeld
		}
	} else {
		w, err = n.pool.Acquire(ctx, named)
	}
	switch {
	case errors.Is(err, errWalletNotHeld):
		// Another process sharing the journal holds the wallet's lease (it moved since the payment was verified
		// here): it is the one that can settle the payment. Nothing was sent; a served async payment is taken
		// over by the wallet's holder (see the gate's ledger).
		return common.Hash{}, refuse(x402.ReasonNoAvailableWallets, "%s: the payment can only be settled from %s, whose lease another instance sharing the journal holds now; nothing was sent",
			x402.MessageNoAvailableWallets, named.Hex()), nil
	case errors.Is(err, errNoAvailableWallets):
		return common.Hash{}, refuse(x402.ReasonNoAvailableWallets, "%s; retry in 1 to 2 seconds", x402.MessageNoAvailableWallets), nil
	case err != nil:
		return common.Hash{}, nil, err
	}
	defer n.pool.Release(w)
	quote, err := n.sender.feeQuote(ctx)
	if err != nil {
		return common.Hash{}, nil, fmt.Errorf("nothing was sent: %w: %w", errNodeNotAsked, err)
	}
	p.exec = newExecution(w.Address, quote, p.head, p.mineAt)
	if ref, err := p.checkWallet(ctx); err != nil || ref != nil {
		return common.Hash{}, ref, err
	}
	if p.upto() {
		// A verification may have held the payment at its maximum: what this settlement moves is what stays held.
		n.funds.shrink(p)
	}
	for again := 0; ; {
		hash, ref, err := f.checkAndSend(ctx, p, w, quote)
		if errors.Is(err, errChecksAgain) {
			// The payer's allowance pays the payment now without the approval it carries: the checks run again,
			// which read it and drop the approval (checkApprovalBeforeSending).
			if again++; again > 2 {
				// The node's answers disagree from one read to the next (endpoints at different heads).
				return common.Hash{}, nil, fmt.Errorf("nothing was sent: %w: the payer's Permit2 allowance read as paying the payment, then not, %d times", errNodeNotAsked, again)
			}
			continue
		}
		if errors.Is(err, errHoldRefusedSigned) {
			// The checks held at a funds read the shared holds no longer leave room at: they run again, holding
			// and claiming before anything is signed (claimhold.go), reading the funds again where that falls short.
			continue
		}
		return hash, ref, err
	}
}

// checkAndSend is broadcast's checks against the chain, the payment's claim and hold, and the send from w.
func (f *Facilitator) checkAndSend(ctx context.Context, p *payment, w *wallet, quote *feeQuote) (common.Hash, *refusal, error) {
	n := p.net
	if ref, err := p.checkChain(ctx, fundsSettle); err != nil || ref != nil {
		return common.Hash{}, ref, err
	}
	// Nothing is sent before the payment's claim is written and this settlement's: with the record of the signed
	// transaction and its hold, written with the hold, or now, alone, when the checks held nothing (claimhold.go).
	// A claim another won lets the wallet go unused, its nonce with it.
	f.claimAlone(ctx, p)
	if c := p.pending; c != nil && !c.won && !c.waitsForSigned() {
		if c.err != nil {
			return common.Hash{}, nil, fmt.Errorf("nothing was sent: settlement journal: %w", c.err)
		}
		return common.Hash{}, nil, errClaimNotWon
	}
	// The claim and the hold are durable, or go with the signed transaction's record: the deadline is judged
	// again, from the freshest head, at the last moment before anything is signed. Counted in sending from then until sent, as ahead of those that follow.
	if ref, err := p.checkDeadlineBeforeSending(ctx); err != nil || ref != nil {
		return common.Hash{}, ref, err
	}
	n.sending.Add(1)
	defer n.sending.Add(-1)
	calls, err := p.settlementCalls()
	if err != nil {
		return common.Hash{}, nil, err
	}
	if p.approval != nil {
		// The payer's gas money and its approval go first; the settlement only once the approval mined. Both are
		// simulated with the settlement on the freshest head first: what goes first is spent whatever follows.
		if ref, err := p.checkApprovalBeforeSending(ctx, calls[0]); err != nil || ref != nil {
			return common.Hash{}, ref, err
		}
		calls = append(p.approvalCalls(), calls...)
	}

	f.markSending(p.id, true)
	defer f.markSending(p.id, false)
	// The send goes on when the caller leaves (what it signs must be recorded and sent), but no longer than the
	// receipt timeout: a node that never answers must not hold the wallet, and this settlement, forever.
	sendCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), n.timeout)
	defer cancel()
	var recorded string // the hash the journal holds as broadcast, once it does
	// sentBefore: the record was broadcast before this send (reconciliation settling again a payment whose
	// transaction's nonce went to another): that transaction stays among the record's hashes, and a refusal now
	// does not release the record, for that transaction may be the one that mined.
	var sentBefore, seen bool
	// recordUnknown: the write recording the transaction was cut off by the database going out of reach, and may
	// have committed all the same (see errRecordUnknown).
	var recordUnknown bool
	known := p.claim // the record as this settlement last wrote it
	txs, err := n.sender.send(sendCtx, w, calls, quote, func(txs []*types.Transaction) error {
		var raws [][]byte // the wallet's own, in nonce order
		var sponsored []byte
		var own []*types.Transaction
		for i, tx := range txs {
			raw, err := tx.MarshalBinary()
			if err != nil {
				return err
			}
			if calls[i].Signed != nil {
				sponsored = raw
				continue
			}
			raws, own = append(raws, raw), append(own, tx)
		}
		last := txs[len(txs)-1]
		first := !seen
		seen = true
		sign := func(r *journal.Record) error {
			if first && r.State == journal.StateBroadcast && r.TxHash != "" {
				sentBefore = true
				if !slices.Contains(r.ReplacedTxHashes, r.TxHash) {
					r.ReplacedTxHashes = append(append([]string(nil), r.ReplacedTxHashes...), r.TxHash)
				}
			}
			r.State, r.Wallet, r.TxNonce, r.TxHash = journal.StateBroadcast, w.Address.Hex(), last.Nonce(), last.Hash().Hex()
			r.RawTx, r.PriorRawTxs, r.SponsoredRawTx = raws[len(raws)-1], raws[:len(raws)-1], sponsored
			for _, tx := range own[:len(own)-1] {
				if h := tx.Hash().Hex(); !slices.Contains(r.PriorTxHashes, h) {
					r.PriorTxHashes = append(slices.Clip(r.PriorTxHashes), h)
				}
			}
			r.Attempts++
			return nil
		}
		var rec journal.Record
		var err error
		if first && p.pending.waitsForSigned() {
			n.pool.mu.Lock()
			fence := w.fence
			n.pool.mu.Unlock()
			rec, err = f.signedWithHold(context.WithoutCancel(ctx), p, w, fence, sign)
		} else {
			rec, err = f.recordSigned(context.WithoutCancel(ctx), n, w, p.id, known, func(r *journal.Record) error {
				if err := checkClaim(p, r); err != nil {
					return err
				}
				return sign(r)
			})
		}
		recordUnknown = errors.Is(err, journal.ErrUnavailable)
		if err == nil {
			known = rec
			f.rememberSigned(rec)
			recorded = last.Hash().Hex()
			f.log.Debug("settlement transaction signed and recorded", zap.String("payment", p.id.String()),
				zap.String("wallet", w.Address.Hex()), zap.Uint64("nonce", last.Nonce()), zap.String("tx", recorded), zap.Bool("sent_before", sentBefore))
		}
		return err
	})
	if c := p.pending; len(txs) == 0 && c != nil && c.sent && !c.won {
		// The claim written with the signed transaction's record was not won (another's record was there) or
		// may have been (its write failed): nothing was sent here, and nothing of this settlement's is to end.
		if c.err != nil {
			return common.Hash{}, nil, fmt.Errorf("nothing was sent: settlement journal: %w", c.err)
		}
		return common.Hash{}, nil, errClaimNotWon
	}
	if errors.Is(err, errHoldRefusedSigned) && len(txs) == 0 {
		return common.Hash{}, nil, errHoldRefusedSigned
	}
	if n.approval != nil {
		n.approval.counted(calls, txs)
	}
	if errors.Is(err, errSignedRefused) {
		// The payer's approval was refused by the node or failed on chain: the settlement after it was not sent,
		// and its record goes (the gas money sent before it, if any, is the payer's: counted, and bounded).
		f.log.Warn("sponsored approval not mined; settlement not sent", zap.String("network", n.caip2), zap.String("payer", p.payer.Hex()), zap.Error(err))
		if recorded != "" {
			if rerr := f.releaseUnsent(ctx, p, recorded, false); rerr != nil {
				return common.Hash{}, nil, fmt.Errorf("%w: the payer's approval failed (%v) and the journal could not forget the settlement after it: %w", errRecordUnknown, err, rerr)
			}
		}
		reason := x402.ReasonERC20ApprovalBroadcastFailed
		if errors.Is(err, errSignedFailed) {
			reason = x402.ReasonERC20ApprovalTxFailed
		}
		return common.Hash{}, refuse(reason, "%v; nothing else was sent", err), nil
	}
	if errors.Is(err, errSettlementWouldRevert) {
		// The payer's approval mined (with its gas money, if any, sent first) but the settlement, simulated again
		// then, would revert: the payer revoked the approval or moved its tokens in between. Nothing more is sent;
		// what the approval and its funding cost is spent (counted above), and the record goes as above.
		funded := fundingIn(calls, txs)
		f.log.Warn("sponsored approval mined but the settlement would now revert; settlement not sent, the approval's gas and its funding are spent",
			zap.String("network", n.caip2), zap.String("payer", p.payer.Hex()), zap.String("approval", p.approval.tx.Hash().Hex()),
			zap.String("funded_wei", funded.String()), zap.Error(err))
		if recorded != "" {
			if rerr := f.releaseUnsent(ctx, p, recorded, false); rerr != nil {
				return common.Hash{}, nil, fmt.Errorf("%w: the settlement would revert after the payer's approval (%v) and the journal could not forget it: %w", errRecordUnknown, err, rerr)
			}
		}
		return common.Hash{}, refuse(x402.ReasonPermit2SimulationFailed, "%v; the payer's approval %s mined (its gas, and the %s wei of gas money sent to the payer for it, are spent) but the payer's allowance or balance no longer covers the payment: the settlement was not sent",
			err, p.approval.tx.Hash().Hex(), funded), nil
	}
	if len(txs) == 0 {
		// Refused by every node it reached before anything went out, or the journal write failed: nothing is
		// on its way. The record written ahead of the refused send goes too, so that no later pass sends
		// those bytes after the payer was told nothing was sent.
		f.log.Warn("settlement not broadcast", zap.String("network", n.caip2), zap.String("payer", p.payer.Hex()), zap.Error(err))
		if recorded != "" && sentBefore {
			// An earlier transaction of the payment may still be the one that mines: kept, reconciliation
			// looks for its receipt and tries again.
			return common.Hash{}, nil, fmt.Errorf("the node refused the settlement transaction sent again (%v); the payment's earlier transaction is still watched", err)
		}
		if recorded != "" {
			if rerr := f.releaseUnsent(ctx, p, recorded, true); rerr != nil {
				// Kept, it would be sent by reconciliation: the payer must not be told it was not sent, and its hold
				// stays with it (errRecordUnknown keeps both: a hold let go while the record stays would have the
				// recorded bytes sent later against funds counted free).
				return common.Hash{}, nil, fmt.Errorf("%w: the node refused the settlement transaction (%v) and the journal could not forget it: %w", errRecordUnknown, err, rerr)
			}
		} else if lost := asClaimLost(err); lost != nil {
			// Taken over by another instance, which released the claim or claimed the payment again: this
			// settlement sent nothing, and must not release what is now another's.
			return common.Hash{}, nil, lost
		} else if recordUnknown {
			return common.Hash{}, nil, fmt.Errorf("%w: %w: %w", errRecordUnknown, errNotSent, err)
		}
		// The node refused the transaction (and no endpoint may hold it: see Failover.SendTransaction), the
		// journal's database could not be reached to record it, the wallet's lease was lost, or the node could not
		// be asked for the transaction's fee or nonce: nothing was sent, and nothing is wrong with the payment. An
		// error, not a refusal (see errNotSent): the payer is told to present it again, not that it failed (a gate
		// would answer 402 and the payer sign another), and a gate that served it settles it once the node takes
		// it, however long that takes, not only as often as it retries a refusal.
		return common.Hash{}, nil, fmt.Errorf("%w: %w", errNotSent, err)
	}
	hash := txs[len(txs)-1].Hash()
	f.log.Info("settlement broadcast", zap.String("payment", p.id.String()), zap.String("network", n.caip2), zap.String("payer", p.payer.Hex()),
		zap.String("amount", p.amount.String()), zap.String("wallet", w.Address.Hex()), zap.String("tx", hash.Hex()))
	if err != nil {
		// Recorded but perhaps not delivered: reconciliation re-broadcasts the same bytes.
		f.log.Warn("settlement broadcast may not have reached a node", zap.String("tx", hash.Hex()), zap.Error(err))
	}
	return hash, nil, nil
}

// releaseUnsent forgets the signed transaction recorded (hash) for p, which was not sent, and lets go of p's funds
// hold with it (journal.ReleaseUnsentUnhold; unlessServed as funds.unhold's): the hold never outlives the record,
// which is the only thing that leads reconciliation to it. Done, p says so (unsentReleased): the settlement's end
// lets go of a process's own hold only, never again of the shared hold or the claim, which may be another's by
// then.
func (f *Facilitator) releaseUnsent(ctx context.Context, p *payment, hash string, unlessServed bool) error {
	err := journal.ReleaseUnsentUnhold(context.WithoutCancel(ctx), f.journal, p.net.funds.shared, p.claim, hash, unlessServed)
	p.unsentReleased = err == nil
	return err
}

// awaitReceipt waits up to the network's receipt timeout and finalises the journal record when a receipt comes.
// upto says the payment is an upto one (see finalise); justSent that the transaction was broadcast just now (see
// receiptWatcher.wait).
func (f *Facilitator) awaitReceipt(ctx context.Context, n *network, id journal.ID, payer, amount string, upto, justSent bool, hashes ...common.Hash) x402.SettleResponse {
	if resp, ok := f.awaitReceiptFor(ctx, n, n.timeout, id, payer, amount, upto, justSent, hashes...); ok {
		return resp
	}
	return receiptNotSeen(n, payer, amount, hashes[0])
}

// awaitReceiptFor is awaitReceipt waiting at most d: ok says a receipt came, and resp is the payment's outcome.
func (f *Facilitator) awaitReceiptFor(ctx context.Context, n *network, d time.Duration, id journal.ID, payer, amount string, upto, justSent bool, hashes ...common.Hash) (_ x402.SettleResponse, ok bool) {
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for len(hashes) > 0 {
		receipt, err := n.watcher.wait(wctx, justSent, hashes...)
		if err != nil {
			break
		}
		if final, ok := f.outcome(wctx, n, id, receipt); ok {
			return f.finalise(ctx, n, id, final, payer, amount, upto), true
		}
		// An earlier transaction of the payment reverted: the latest may still settle it.
		hashes = slices.DeleteFunc(slices.Clone(hashes), func(h common.Hash) bool { return h == receipt.TxHash })
	}
	return x402.SettleResponse{}, false
}

// receiptNotSeen is the answer of a settlement whose transaction (first) was broadcast and whose receipt did not come
// within the wait.
func receiptNotSeen(n *network, payer, amount string, first common.Hash) x402.SettleResponse {
	return x402.SettleResponse{Success: false, Transaction: first.Hex(), Network: n.caip2, Payer: payer, Amount: amount,
		ErrorReason:  x402.ReasonSettlementPending,
		ErrorMessage: "the settlement transaction was broadcast but its receipt was not seen yet; it may still settle: do not pay again, present the same payment again to learn the outcome"}
}

// recordedTurn is what became of a broadcast record awaitRecorded waited on.
type recordedTurn int

const (
	recordAnswered recordedTurn = iota // a receipt came, or none within the wait: the answer is the payment's
	recordGone                         // the record went: its transaction was never sent (see awaitRecorded)
	recordMoved                        // the record is no longer that broadcast: final, or claimed again
)

// Between two reads of a broadcast record awaitRecorded waits for its receipt at first recordedRecheck, doubling up
// to recordedRecheckMax: a record its sender forgets does so within the send's round trip, a few milliseconds.
const (
	recordedRecheck    = 100 * time.Millisecond
	recordedRecheckMax = 2 * time.Second
)

// awaitRecorded waits, until the time given, for the outcome of payment p's settlement that rec, read from the
// journal in state broadcast, records: another process's (an instance that took it over or took its hand-off, a
// concurrent presentation's), or an earlier one of this process's. Its receipt finalises the record as
// awaitReceipt's does. Its sender records the transaction before it sends it and forgets the record when the
// node refuses it: a wait on the receipt alone would last the whole receipt timeout for a transaction that never
// left (and hold a gateway's graceful stop as long). So the record is read again between spells of waiting:
// gone, nothing was sent (recordGone); final or claimed again, the caller carries on from cur (recordMoved); a fee
// replacement recorded since is waited for too. A read that fails changes nothing: the wait goes on.
func (f *Facilitator) awaitRecorded(ctx context.Context, p *payment, rec journal.Record, until time.Time) (x402.SettleResponse, journal.Record, recordedTurn) {
	n := p.net
	hashes := recordHashes(rec)
	payer, amount := p.payer.Hex(), p.amount.String()
	for step := recordedRecheck; ; step = min(2*step, recordedRecheckMax) {
		left := time.Until(until)
		if left <= 0 || ctx.Err() != nil {
			return receiptNotSeen(n, payer, amount, hashes[0]), rec, recordAnswered
		}
		spell := time.Now()
		if resp, ok := f.awaitReceiptFor(ctx, n, min(step, left), p.id, payer, amount, p.upto(), false, hashes...); ok {
			return resp, rec, recordAnswered
		}
		// A spell cut short (every receipt seen judged not final while a later transaction may still mine) is
		// waited out, not spun through.
		if rest := min(step, left) - time.Since(spell); rest > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(rest):
			}
		}
		if ctx.Err() != nil || !time.Now().Before(until) {
			continue
		}
		rctx, cancel := context.WithDeadline(ctx, until)
		cur, found, err := f.journal.Get(rctx, p.id)
		cancel()
		switch {
		case err != nil:
		case !found:
			return x402.SettleResponse{}, journal.Record{}, recordGone
		case cur.State != journal.StateBroadcast || !cur.SameClaim(&rec):
			return x402.SettleResponse{}, cur, recordMoved
		default:
			rec, hashes = cur, recordHashes(cur) // a fee replacement since is waited for too
		}
	}
}

// outcome decides whether receipt, of one of the transactions journalled for payment id, is the payment's final
// outcome, and which receipt that is. A success is. A revert is final only for the record's latest transaction,
// and only when no earlier one succeeded: a payment settled again after its transaction lost its wallet nonce
// has several, and the earlier may have mined (it spent the payer's nonce, and the later reverted), or may have
// reverted where the later settles (an erc2612 transfer whose permit was lost).
func (f *Facilitator) outcome(ctx context.Context, n *network, id journal.ID, receipt *types.Receipt) (*types.Receipt, bool) {
	if receipt.Status == types.ReceiptStatusSuccessful {
		return receipt, true
	}
	rec, ok, err := f.journal.Get(ctx, id)
	if err != nil || !ok || rec.State != journal.StateBroadcast {
		return receipt, true
	}
	if common.HexToHash(rec.TxHash) != receipt.TxHash {
		return nil, false
	}
	for _, h := range recordHashes(rec)[1:] {
		r, err := n.backend.TransactionReceipt(ctx, h)
		switch {
		case err == nil && r != nil && r.Status == types.ReceiptStatusSuccessful:
			return r, true
		case err != nil && !errors.Is(err, ethereum.NotFound):
			return nil, false // unknown: a later look decides
		}
	}
	return receipt, true
}

// finalise turns a receipt into the final answer and records it. An upto payment's revert has the upto reason
// code, as the public facilitators give it.
func (f *Facilitator) finalise(ctx context.Context, n *network, id journal.ID, receipt *types.Receipt, payer, amount string, upto bool) x402.SettleResponse {
	resp := x402.SettleResponse{Success: true, Transaction: receipt.TxHash.Hex(), Network: n.caip2, Payer: payer, Amount: amount}
	if receipt.Status != types.ReceiptStatusSuccessful {
		reason := x402.ReasonTransactionFailed
		if upto {
			reason = x402.ReasonUptoTransactionFailed
		}
		resp = x402.SettleResponse{Success: false, Transaction: receipt.TxHash.Hex(), Network: n.caip2, Payer: payer,
			ErrorReason: reason, ErrorMessage: "the settlement transaction was mined but reverted; no tokens moved"}
	}
	// The payment's funds hold ends before its record does. A final record is never looked at again, so an end of
	// the hold that the shared holds' database did not take (down as the settlement ended) would leave the payer's
	// funds looking spent until the payment's deadline: until it is taken, the record stays broadcast, and
	// reconciliation ends both once the database answers (finaliseFromReceipts). The answer stands meanwhile.
	// With shared holds and the record this process signed at hand, a success's hold ends in the same write as the
	// record's final answer (journal.UpdateKnownHoldMined): both or neither, so the order's guarantee holds with one
	// commit fewer.
	known, haveKnown := f.takeSigned(id)
	together := resp.Success && haveKnown && n.funds.shared != nil
	var holdErr error
	switch {
	case together:
		// Its hold ends with the final answer, below.
	case resp.Success:
		holdErr = n.funds.sawMined(id, receipt.BlockNumber.Uint64())
	default:
		rec, _, err := f.journal.Get(context.WithoutCancel(ctx), id)
		switch {
		case err != nil:
			holdErr = err
		case rec.State != journal.StateFinal || rec.Response == nil || !rec.Response.Success:
			// (Recorded settled already, by another of its transactions: that answer stays, and its hold is mined.)
			holdErr = n.funds.let(id)
		}
	}
	if holdErr != nil {
		f.log.Warn("recording the end of a settled payment's funds hold; its record stays broadcast until reconciliation records both",
			zap.String("payment", id.String()), zap.String("tx", receipt.TxHash.Hex()), zap.Bool("success", resp.Success), zap.Error(holdErr))
		return resp
	}
	if together {
		// Within a paid request a gate serves on the same journal (journal.Defer), the final answer and the hold's
		// end ride with the gate's own final write, in its batch: the record stays broadcast until then (at most
		// a second), which reconciliation resolves from the receipt should this process die meanwhile. The record
		// this settlement signed is broadcast, not decided: the answer is this receipt's.
		hash, settled := receipt.TxHash.Hex(), resp
		// It may run again, where the write lands (see journal.UpdateKnownHoldMinedBehind): it reads only its own.
		final := func(r *journal.Record) error {
			if r.State == journal.StateFinal {
				return nil // decided before: that answer stays
			}
			answer := settled
			r.State, r.Response, r.TxHash = journal.StateFinal, &answer, hash
			return nil
		}
		if _, deferred := journal.UpdateKnownHoldMinedBehind(context.WithoutCancel(ctx), n.funds.shared, known, receipt.BlockNumber.Uint64(), final, func(err error) {
			if err != nil {
				f.log.Warn("recording a settled payment's final answer with the end of its funds hold; its record stays broadcast until reconciliation records both",
					zap.String("payment", id.String()), zap.String("tx", hash), zap.Error(err))
			}
		}); deferred {
			f.log.Info("settlement final", zap.String("network", n.caip2), zap.String("payer", payer), zap.String("amount", amount),
				zap.String("tx", hash), zap.Bool("success", true), zap.Uint64("block", receipt.BlockNumber.Uint64()))
			return resp
		}
	}
	decidedBefore := false
	update := func(ctx context.Context, id journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
		return f.journal.Update(ctx, id, fn)
	}
	switch {
	case together:
		update = func(ctx context.Context, _ journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
			return journal.UpdateKnownHoldMined(ctx, n.funds.shared, known, receipt.BlockNumber.Uint64(), fn)
		}
	case haveKnown:
		update = func(ctx context.Context, _ journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
			return journal.UpdateKnown(ctx, f.journal, known, fn)
		}
	}
	if _, err := update(context.WithoutCancel(ctx), id, func(r *journal.Record) error {
		decidedBefore = r.State == journal.StateFinal
		if decidedBefore {
			if r.Response != nil {
				resp = *r.Response // decided before: the answer given then stays the answer
			}
			return nil
		}
		r.State, r.Response, r.TxHash = journal.StateFinal, &resp, receipt.TxHash.Hex()
		return nil
	}); err != nil && together {
		f.log.Warn("recording a settled payment's final answer with the end of its funds hold; its record stays broadcast until reconciliation records both",
			zap.String("payment", id.String()), zap.String("tx", receipt.TxHash.Hex()), zap.Error(err))
	} else if err != nil {
		f.log.Error("recording a final settlement", zap.String("tx", receipt.TxHash.Hex()), zap.Error(err))
	}
	if receipt.Status == types.ReceiptStatusSuccessful || decidedBefore {
		f.log.Info("settlement final", zap.String("network", n.caip2), zap.String("payer", payer), zap.String("amount", amount),
			zap.String("tx", receipt.TxHash.Hex()), zap.Bool("success", resp.Success), zap.Uint64("block", receipt.BlockNumber.Uint64()))
		return resp
	}
	if deadline, minedAt, ok := f.expiredInFlight(ctx, n, id, receipt); ok {
		// Not the payer's doing: the chain's time ran past a deadline this engine judged far enough, while the
		// transaction waited to be mined. The payer is not refused for it.
		f.log.Error("settlement transaction reverted: its payment's deadline passed while it waited to be mined; the settlement wallet paid its gas and no tokens moved",
			zap.String("network", n.caip2), zap.String("payer", payer), zap.String("amount", amount), zap.String("tx", receipt.TxHash.Hex()),
			zap.Uint64("block", receipt.BlockNumber.Uint64()), zap.Uint64("block_time", minedAt), zap.Int64("deadline", deadline),
			zap.Uint64("gas_used", receipt.GasUsed))
		return resp
	}
	// The settlement passed its simulation, run as the transaction ran, and reverted on chain: the settlement
	// wallet paid the gas and no token moved. The payer's state changed in between (see penalties): its
	// payments are refused for a while.
	pen := n.penalties.note(common.HexToAddress(payer), receipt.TxHash, receipt.BlockNumber.Uint64())
	f.log.Error("settlement transaction reverted: the settlement wallet paid its gas and no tokens moved; the payer's payments are refused for a while",
		zap.String("network", n.caip2), zap.String("payer", payer), zap.String("amount", amount), zap.String("tx", receipt.TxHash.Hex()),
		zap.Uint64("block", receipt.BlockNumber.Uint64()), zap.Uint64("gas_used", receipt.GasUsed), zap.Time("refused_until", pen.until),
		zap.Int("reverts", pen.reverts))
	return resp
}

// expiredInFlight reports whether the reverted settlement of payment id was mined in a block stamped past the
// payment's deadline: the transaction waited while the chain's time ran past it (a chain that seals a block per
// batch of transactions runs ahead of the clock under load, a second a block), which is no doing of the payer's,
// whatever else may also have made it revert. It reports false when the record or the block cannot be read.
func (f *Facilitator) expiredInFlight(ctx context.Context, n *network, id journal.ID, receipt *types.Receipt) (deadline int64, minedAt uint64, ok bool) {
	rec, found, err := f.journal.Get(context.WithoutCancel(ctx), id)
	if err != nil || !found {
		return 0, 0, false
	}
	d := recordedDeadline(rec)
	if d.IsZero() {
		return 0, 0, false
	}
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), n.timeout)
	defer cancel()
	head, err := n.backend.HeaderByNumber(hctx, receipt.BlockNumber)
	if err != nil || head == nil {
		return 0, 0, false
	}
	return d.Unix(), head.Time, head.Time > uint64(max(d.Unix(), 0))
}

// recordedDeadline is the deadline of the payment rec records, zero when it has none or its request does not read.
func recordedDeadline(rec journal.Record) time.Time {
	var req x402.SettleRequest
	if err := json.Unmarshal(rec.Request, &req); err != nil {
		return time.Time{}
	}
	return req.PaymentPayload.Payload.Deadline()
}

// answerFromJournal answers a payment someone already claimed: the recorded final answer, or the outcome of the
// recorded transaction, waited for as long as a fresh settlement would be.
func (f *Facilitator) answerFromJournal(ctx context.Context, p *payment, req x402.SettleRequest, rec journal.Record) (x402.SettleResponse, error) {
	switch rec.State {
	case journal.StateFinal:
		return *rec.Response, nil
	case journal.StateBroadcast:
		resp, cur, turn := f.awaitRecorded(ctx, p, rec, time.Now().Add(p.net.timeout))
		switch turn {
		case recordGone:
			// Its sender forgot it, the node having refused its transaction: nothing was sent, settle afresh.
			return f.settleOnce(ctx, p, req)
		case recordMoved:
			if !cur.SameClaim(&rec) && !f.recordedSame(p, cur) {
				return failed(p.net.caip2, p.payer.Hex(), "", reused(p)), nil // as a claim made again below
			}
			return f.answerFromJournal(ctx, p, req, cur)
		}
		return resp, nil
	default:
		// Claimed by another process that has not broadcast yet: wait for it to move.
		deadline := time.Now().Add(p.net.timeout)
		for time.Now().Before(deadline) {
			select {
			case <-ctx.Done():
				return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: ctx.Err()}
			case <-time.After(20 * time.Millisecond):
			}
			r, ok, err := f.journal.Get(ctx, p.id)
			if err != nil {
				return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
			}
			if !ok {
				// The other claimant released it (its settlement was refused): settle afresh.
				return f.settleOnce(ctx, p, req)
			}
			if !r.SameClaim(&rec) {
				// Released and claimed again between two reads: perhaps by another payment of the same payer and
				// nonce, whose outcome says nothing of this one's (a success would buy this payment's response with
				// a payment to someone else).
				if !f.recordedSame(p, r) {
					return failed(p.net.caip2, p.payer.Hex(), "", reused(p)), nil
				}
				rec = r
			}
			if r.State != journal.StateClaimed {
				return f.answerFromJournal(ctx, p, req, r)
			}
		}
		return x402.SettleResponse{Success: false, Network: p.net.caip2, Payer: p.payer.Hex(), ErrorReason: x402.ReasonSettlementPending,
			ErrorMessage: "another settlement of this payment is under way; do not pay again, present the same payment again to learn the outcome"}, nil
	}
}

// recordedSame reports whether the journal record is of this very payment, not merely of its payer and nonce.
func (f *Facilitator) recordedSame(p *payment, rec journal.Record) bool {
	q, ref, err := f.parseRecorded(rec.Request)
	return err == nil && ref == nil && q.same(p)
}

// reused is the refusal of a payment whose nonce belongs to another, already claimed, payment.
func reused(p *payment) *refusal {
	reason := x402.ReasonNonceAlreadyUsed
	if p.method == x402.TransferPermit2 {
		reason = x402.ReasonPermit2InvalidNonce
	}
	return refuse(reason, "nonce %s of %s belongs to another payment that was already presented; sign a new payment", p.nonce, p.payer.Hex())
}

func failed(network, payer, tx string, r *refusal) x402.SettleResponse {
	return x402.SettleResponse{Success: false, Transaction: tx, Network: network, Payer: payer, ErrorReason: r.reason, ErrorMessage: r.message}
}

// maxSigned bounds the records rememberSigned keeps: those whose settlement this process never finalises (another
// instance took it over) would otherwise pile up. They are only a shortcut: one forgotten costs finalise a read.
const maxSigned = 4096

// rememberSigned keeps rec, the write-ahead record of a settlement just signed, for its finalise.
func (f *Facilitator) rememberSigned(rec journal.Record) {
	f.signedMu.Lock()
	defer f.signedMu.Unlock()
	if _, ok := f.signed[rec.ID]; !ok && len(f.signed) >= maxSigned {
		clear(f.signed)
	}
	f.signed[rec.ID] = rec
}

// takeSigned returns and forgets what rememberSigned kept of payment id.
func (f *Facilitator) takeSigned(id journal.ID) (journal.Record, bool) {
	f.signedMu.Lock()
	defer f.signedMu.Unlock()
	rec, ok := f.signed[id]
	delete(f.signed, id)
	return rec, ok
}
