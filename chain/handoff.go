package chain

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Settlement hand-off. With a journal several processes share, the wallets are shared out by leases (lease.go),
// so one process may hold no free wallet when a payment it claimed must settle: it holds none (more gateways than
// wallets, or the leases still being shared out), the ones it holds are busy or being given up, or the payment is
// bound to a wallet another process holds (an upto witness names its facilitator, an erc2612 permit its
// spender). Wallets are the cluster's, not the process's: the claimant hands the settlement to the others
// through the journal and waits for its answer, and the payer is told no_available_wallets only when no process
// took it within the pool's wait (every wallet of the cluster stayed busy that long).
//
// The hand-off is the payment's claim itself, moved by conditional updates of its record (journal.Handoff):
//   - the claimant marks its claim handed off (Handoff.From is itself) and waits;
//   - a process with a free wallet (the bound one, when the payment is bound) takes it: it makes the record its
//     own (Owner, Handoff.Taker) only while the claim is still the claimant's and on offer, and settles it through
//     the normal path (simulation, the fenced write-ahead record, broadcast, receipt), as its own claim;
//   - the claimant takes it back when nobody took it within the wait, on the same condition: exactly one of
//     taker and claimant wins, so the payment is settled by one process or refused by the other, never both;
//   - a taker that sent nothing gives the claim back to the claimant with its answer (a refusal, an error), and
//     the claimant ends the claim as it ends its own (its funds hold, the release); one whose wallet was gone by
//     then offers it again.
//
// Once taken, the claimant answers with the record's outcome: final, or the receipt of its broadcast
// transaction, waited for as long as its own settlement would wait, else settlement_pending: the payment is the
// taker's to finish (or, the taker dying, reconciliation's, which takes over a dead process's records), never
// settled a second time. A claimant that dies while its payment is on offer leaves a claim of a dead process,
// which reconciliation releases (or the taker gives back to it, and reconciliation releases then).
//
// Takers look for payments on offer every handoffLook, every handoffLookHot for a while after they saw one they
// could take. A claimant reads its record every handoffPoll while it changes, less often while it does not.

const (
	// handoffLook is how often a process with a free wallet looks for settlements handed off when none was lately.
	handoffLook = 200 * time.Millisecond
	// handoffLookHot is how often it looks for handoffHot after it last saw one it could take: scarcity comes in
	// spells.
	handoffLookHot = 25 * time.Millisecond
	handoffHot     = 5 * time.Second
	// handoffPoll is how soon a claimant waiting on its hand-off reads the record again after it changed (taken,
	// sent): a take comes within tens of milliseconds when another instance has a free wallet. Each read that
	// finds it unchanged doubles the rest, up to handoffPollMax: a hand-off nobody takes for the pool's wait costs
	// a read every handoffPollMax, not every handoffPoll.
	handoffPoll    = 15 * time.Millisecond
	handoffPollMax = 200 * time.Millisecond
)

// handOff hands the settlement of p, which this process claimed and cannot send from a wallet of its own (refused
// says why), to the other processes sharing the journal, and waits for its answer. The results are
// broadcastAndWait's: keep says the claim must stay (another process took it and may have sent something).
func (f *Facilitator) handOff(ctx context.Context, p *payment, refused x402.SettleResponse) (x402.SettleResponse, bool, error) {
	n := p.net
	h := journal.Handoff{From: f.owner}
	if named := p.namedSender(); named != nil {
		h.Wallet = named.Hex()
	}
	_, err := f.journal.Update(ctx, p.id, func(r *journal.Record) error {
		if err := checkClaim(p, r); err != nil {
			return err
		}
		if r.State != journal.StateClaimed {
			return fmt.Errorf("the payment's record is %s, not claimed", r.State)
		}
		handoff := h
		r.Handoff = &handoff
		return nil
	})
	if lost := asClaimLost(err); lost != nil {
		return x402.SettleResponse{}, false, lost
	} else if err != nil {
		// Not handed off: the claim is as it was, this process's, and nothing was sent.
		return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("handing the settlement to an instance with a free wallet: %w", err)}
	}
	f.log.Debug("handed a settlement to the instances sharing the journal", zap.String("payment", p.id.String()), zap.String("wallet", h.Wallet))
	offerUntil := time.Now().Add(n.pool.Wait)
	var answerUntil time.Time // once taken
	vouched := p.claim        // the last claim of the record found to be of this very payment
	rest := handoffPoll
	var last journal.Record // the record as last read
	t := time.NewTimer(rest)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return f.endHandoff(p, refused, ctx.Err())
		case <-t.C:
		}
		// A read lasts no longer than what is left of the wait it serves (and a rest): a database that hangs
		// rather than refuses must not hold the payer's answer past it.
		until := offerUntil
		if !answerUntil.IsZero() {
			until = answerUntil
		}
		if now := time.Now(); until.Before(now) {
			until = now
		}
		rctx, cancel := context.WithDeadline(ctx, until.Add(handoffPollMax))
		cur, ok, err := f.journal.Get(rctx, p.id)
		cancel()
		if err == nil && ok && (!cur.UpdatedAt.Equal(last.UpdatedAt) || cur.Owner != last.Owner) {
			rest, last = handoffPoll, cur
		} else {
			rest = min(2*rest, handoffPollMax)
		}
		t.Reset(rest)
		switch {
		case err != nil:
			if time.Now().After(offerUntil) && answerUntil.IsZero() {
				return f.endHandoff(p, refused, err)
			}
			if !answerUntil.IsZero() && time.Now().After(answerUntil) {
				// Taken, and its outcome not to be read for as long as this process's own settlement would have
				// waited for its receipt: no final answer (presented again, the payment is answered from the
				// journal), and the claim is the taker's.
				return x402.SettleResponse{}, true, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
					Err: fmt.Errorf("reading the outcome of the settlement another instance sharing the journal took: %w", err)}
			}
			continue // the database a moment out of reach: the hand-off stands
		case !ok:
			// Released by reconciliation (this process looked dead to another a while), by a taker's process gone
			// and reconciled, or by a taker whose transaction the node refused: nothing was sent.
			return claimWent(p, "the payment's claim went while its settlement was handed off")
		case !cur.SameClaim(&p.claim) || cur.Handoff != nil && cur.Handoff.Taker != "" && !givenBack(&cur):
			// Taken: by a taker, or by reconciliation of a process that looked dead, this one's too (a taker that
			// died, taken over here, makes the record this process's claim again, not given back: it may have
			// sent the settlement's transaction, which reconciliation finishes). Its outcome is the answer, when
			// the claim is still of this very payment: released meanwhile (this process looked dead a while), the
			// payment's id may have been claimed by another payment of its payer and nonce, whose outcome says
			// nothing of this one's (a success would buy this payment's response with a payment to someone else).
			if !cur.SameClaim(&vouched) {
				if !f.recordedSame(p, cur) {
					// Its nonce is another payment's now, for good; the claim and its hold are that payment's.
					return failed(n.caip2, p.payer.Hex(), "", reused(p)), true, nil
				}
				vouched = cur
			}
			if answerUntil.IsZero() {
				answerUntil = time.Now().Add(n.timeout)
			}
			switch cur.State {
			case journal.StateFinal:
				return *cur.Response, true, nil
			case journal.StateBroadcast:
				// Its transaction is out, or on its way: wait for the receipt as a settlement of this payment would,
				// reading the record again meanwhile (the taker forgets it if the node refuses the transaction).
				resp, moved, turn := f.awaitRecorded(ctx, p, cur, answerUntil)
				switch turn {
				case recordAnswered:
					return resp, true, nil
				case recordGone:
					return claimWent(p, "the instance that took the settlement handed off released its claim without settling it (the node refused its transaction)")
				}
				last, rest = moved, handoffPoll // changed: read again at once
				t.Reset(0)
				continue
			}
			if time.Now().After(answerUntil) {
				return x402.SettleResponse{Success: false, Network: n.caip2, Payer: p.payer.Hex(), ErrorReason: x402.ReasonSettlementPending,
					ErrorMessage: "another instance sharing the journal took this payment's settlement and has not sent it yet; do not pay again, present the same payment again to learn the outcome"}, true, nil
			}
		case cur.Handoff == nil:
			return refused, false, nil // not handed off after all (nothing else clears it)
		case cur.Handoff.Taker != "":
			// Given back by a taker that sent nothing (givenBack): its answer is the settlement's.
			f.log.Debug("a settlement handed off was given back", zap.String("payment", p.id.String()), zap.String("taker", cur.Handoff.Taker))
			if cur.Handoff.Answer != nil {
				return *cur.Handoff.Answer, false, nil
			}
			return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
				Err: fmt.Errorf("%w: the instance that took the settlement could not send it: %s", errNotSent, cur.Handoff.Failure)}
		case n.pool.canTake(p.namedSender()):
			// A wallet of this process's came free meanwhile (a lease taken, a settlement done): settled here.
			if took, err := f.takeBack(p); err != nil || !took {
				continue // taken meanwhile, or not known: the next read says
			}
			return f.broadcastAndWait(ctx, p)
		case time.Now().After(offerUntil):
			took, err := f.takeBack(p)
			if err != nil {
				continue
			}
			if took {
				f.log.Info("no instance sharing the journal took a settlement handed off within the wait; the payer is told to retry",
					zap.String("payment", p.id.String()), zap.Duration("wait", n.pool.Wait), zap.String("wallet", h.Wallet))
				ref := refuse(x402.ReasonNoAvailableWallets, "%s: no instance sharing the journal had a free settlement wallet for %v; nothing was sent, retry in 1 to 2 seconds",
					x402.MessageNoAvailableWallets, n.pool.Wait)
				if h.Wallet != "" {
					ref = refuse(x402.ReasonNoAvailableWallets, "%s: the payment can only be settled from %s, and no instance sharing the journal could send from it for %v; nothing was sent, retry in 1 to 2 seconds",
						x402.MessageNoAvailableWallets, h.Wallet, n.pool.Wait)
				}
				return failed(n.caip2, p.payer.Hex(), "", ref), false, nil
			}
		}
	}
}

// claimWent ends a hand-off whose claim is gone from the journal: released with its funds hold (a taker's
// releaseUnsent, reconciliation's releaseClaim), nothing sent. Neither is this settlement's to end any more (see
// unsentReleased): ended again by the payment's id, they could be another settlement's of the payment, claimed since.
// The payer is told to present the payment again.
func claimWent(p *payment, why string) (x402.SettleResponse, bool, error) {
	p.unsentReleased = true
	return x402.SettleResponse{}, false, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
		Err: fmt.Errorf("%w: %s; nothing was sent, present the payment again", errNotSent, why)}
}

// givenBack reports whether r, a claim handed off and taken, was given back to its claimant by the taker, having
// sent nothing: the give-back always carries the taker's answer or failure (see settleHandedOff). A record the
// claimant's own reconciliation took over from a taker that died is its claim too, but carries neither.
func givenBack(r *journal.Record) bool {
	h := r.Handoff
	return r.State == journal.StateClaimed && h != nil && h.Taker != "" && r.Owner == h.From && (h.Answer != nil || h.Failure != "")
}

// endHandoff ends a claimant's wait that cannot go on (its caller gone, the journal out of reach): it takes the
// settlement back when it is still on offer, and otherwise keeps the claim, which another process took.
func (f *Facilitator) endHandoff(p *payment, refused x402.SettleResponse, cause error) (x402.SettleResponse, bool, error) {
	took, err := f.takeBack(p)
	switch {
	case err == nil && took:
		return refused, false, nil
	case err == nil:
		// Taken (or given back, which the claim's record keeps for reconciliation to end).
		return x402.SettleResponse{}, true, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("waiting for the instance that took the settlement: %w", cause)}
	}
	return x402.SettleResponse{}, true, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable,
		Err: fmt.Errorf("taking back a settlement handed off (%w): %w", cause, err)}
}

// takeBack makes p's claim, handed off, this process's to settle again, while no other process took it.
func (f *Facilitator) takeBack(p *payment) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), p.net.pool.Wait+5*time.Second)
	defer cancel()
	_, err := f.journal.Update(ctx, p.id, func(r *journal.Record) error {
		if !r.SameClaim(&p.claim) || !r.OnOffer() {
			return errTakenOver
		}
		r.Handoff = nil
		return nil
	})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, errTakenOver), errors.Is(err, journal.ErrNotFound):
		return false, nil
	}
	return false, err
}

// canTake reports whether a settlement may take a wallet of this process at once: want when it is given (and
// this process holds it), else any it may hand out.
func (p *walletPool) canTake(want *common.Address) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pickLocked(want, p.now()) != nil
}

// holdsFree reports whether this process holds a wallet with room for another settlement, being given up or not.
func (p *walletPool) holdsFree() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	for _, w := range p.wallets {
		if w.busy < p.MaxInFlight && p.holds(w, now) {
			return true
		}
	}
	return false
}

// holdsUsable reports whether this process has a wallet a new settlement may take, busy or not: always without
// leases; with them, one whose lease it holds and is not giving up.
func (p *walletPool) holdsUsable() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	for _, w := range p.wallets {
		if p.usable(w, now) {
			return true
		}
	}
	return false
}

// holdsNoFreeWallet reports whether a settlement would find no wallet of this process to take now: with leases,
// a settlement that would only wait for one hands off at once instead.
func (p *walletPool) holdsNoFreeWallet(want *common.Address) bool {
	return p.leasing && !p.canTake(want)
}

// handoffLoop takes the settlements other processes handed off, while this process has a free wallet for them,
// until the facilitator closes.
func (f *Facilitator) handoffLoop() {
	defer f.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-f.stop
		cancel()
	}()
	var lastSeen time.Time
	for {
		every := handoffLook
		if time.Since(lastSeen) < handoffHot {
			every = handoffLookHot
		}
		select {
		case <-f.stop:
			return
		case <-time.After(every):
		}
		if f.leases.stalled.Load() {
			continue
		}
		if f.takeHandoffs(ctx) {
			lastSeen = time.Now()
		}
	}
}

// takeHandoffs takes every settlement on offer this process has a free wallet for, and settles each in the
// background. It reports whether it saw any on offer.
func (f *Facilitator) takeHandoffs(ctx context.Context) (seen bool) {
	free := false
	for _, id := range f.order {
		if f.networks[id].pool.holdsFree() {
			free = true
		}
	}
	if !free {
		// A payment bound to a wallet this process holds busy waits for it like any: looked at next time.
		return false
	}
	rctx, cancel := context.WithTimeout(ctx, handoffLook*5)
	recs, err := f.journal.PendingOf(rctx, false)
	cancel()
	if err != nil {
		return false
	}
	for _, rec := range recs {
		if !rec.OnOffer() || rec.Owner == f.owner {
			continue
		}
		n := f.networks[rec.Network]
		if n == nil {
			continue
		}
		p, ref, err := f.parseRecorded(rec.Request)
		if err != nil || ref != nil || p.id != rec.ID {
			continue
		}
		named := p.namedSender()
		if (named == nil) != (rec.Handoff.Wallet == "") || (named != nil && named.Hex() != rec.Handoff.Wallet) {
			continue // a record at odds with its own request: not this engine's to guess at
		}
		if !n.pool.canTake(named) {
			continue
		}
		// Only an offer this process could take starts a spell of quick looks: one bound to a wallet another
		// process holds is that one's to take, however often it is looked at here.
		seen = true
		f.markClaiming(p.id, 1)
		taken, err := f.journal.Update(ctx, p.id, func(r *journal.Record) error {
			if !r.SameClaim(&rec) || !r.OnOffer() {
				return errTakenOver
			}
			h := *r.Handoff
			h.Taker = f.owner
			r.Owner, r.Handoff = f.owner, &h
			return nil
		})
		if err != nil {
			f.markClaiming(p.id, -1)
			continue
		}
		p.claim = taken
		f.log.Info("took a settlement another instance handed off", zap.String("payment", p.id.String()), zap.String("from", rec.Owner))
		f.wg.Add(1)
		go f.settleHandedOff(ctx, p)
	}
	return seen
}

// settleHandedOff settles a payment this process took from another's hand-off, whose claim it now holds (counted
// in claiming by takeHandoffs). Broadcast, the settlement is this process's like any of its own; sent nothing,
// the claim goes back to the claimant with the answer, or on offer again when the wallet was gone by now.
func (f *Facilitator) settleHandedOff(ctx context.Context, p *payment) {
	defer f.wg.Done()
	defer f.markClaiming(p.id, -1)
	resp, keep, err := f.broadcastAndWait(ctx, p)
	if keep || errors.Is(err, errClaimLost) {
		return
	}
	// Offered again when this process's wallet was gone by the time it settled, or it is closing: another may
	// take it within the claimant's wait.
	again := ctx.Err() != nil || err == nil && resp.ErrorReason == x402.ReasonNoAvailableWallets
	_, uerr := f.journal.Update(context.WithoutCancel(ctx), p.id, func(r *journal.Record) error {
		if err := checkClaim(p, r); err != nil {
			return err
		}
		if r.State != journal.StateClaimed || r.Handoff == nil {
			return fmt.Errorf("the payment's record is %s, not a claim handed off", r.State)
		}
		h := *r.Handoff
		switch {
		case again:
			h.Taker = ""
		case err != nil:
			h.Failure = err.Error()
			if h.Failure == "" {
				h.Failure = "an error without a message" // never empty: it marks the give-back (see givenBack)
			}
		default:
			h.Answer = &resp
		}
		r.Owner, r.Handoff = h.From, &h
		return nil
	})
	if uerr != nil {
		// Kept as this process's claim: reconciliation releases it (a claim none of its settlements holds), and
		// the claimant, finding it gone, tells its payer to present the payment again.
		f.log.Warn("giving a settlement handed off back to its claimant", zap.String("payment", p.id.String()), zap.Error(uerr))
	}
}
