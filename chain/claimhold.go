package chain

import (
	"context"
	"errors"
	"math/big"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// Claim with hold. A settlement claims its payment in the journal and holds it against the payer's funds before
// it signs anything. With the journal and the shared holds one PostgreSQL store, the two go in one transaction,
// one round trip (journal.HoldClaimAndSign), where they were two: the claim is not written when the settlement
// starts, but carried (payment.pending) through the checks broadcast makes before it holds (penalties, time, a
// wallet, the fee quote, the contract wallet's signature, the chain's checks), and written with the hold. So:
//   - nothing is signed or sent before the claim is written and won: broadcast writes it alone when the checks
//     took no hold (a payment whose funds are not tracked), and stops, the wallet let go with its nonce unused,
//     when another settlement's record was there;
//   - a claim another settlement won is never acted on: nothing of this one was written (the hold goes first
//     in the transaction, refused by any record of the payment), so no hold is ended and no claim released;
//   - a settlement that ends before its hold (refused by a check, the pool out of wallets, the chain out of
//     reach) writes its claim alone first, and then ends as one that claimed first does: the funds hold a
//     verification placed goes or stays, the claim is released or handed off, all as the claim's owner;
//   - a claim whose write failed may have committed: it is left to reconciliation, which releases a claim no
//     settlement holds (markClaiming keeps it off this one's while it runs), its hold first.
//
// Payments whose settlement holds nothing in the shared holds claim first, alone, as before: an upto payment of
// zero (settleNothing), and any journal that is not the shared holds' PostgreSQL store.
//
// One round trip fewer again: the claim and the hold wait for the settlement's signed transaction, and go in the
// batch of its write-ahead record (journal.HoldClaimAndSign: the claim with its hold, then the claim made broadcast
// under the wallet's lease). Signing sends nothing: a record that is not written leaves the wallet's nonce unused.
// Another's record there: nothing written, nothing sent. The claim written but not made broadcast (the funds
// short, the lease lost) ends as a claim that sent nothing does, above; the funds short, the checks run again first
// as for a claim written first, reading the funds afresh. A batch that broke is left to reconciliation, as a claim
// with hold whose answer was lost, or as a broadcast record.

// pendingClaim is a settlement's claim of its payment, to be written with the payment's funds hold.
type pendingClaim struct {
	rec journal.Record // the claim as it is to be written
	// sent says its write was tried; then won says it was written, and the payment is this settlement's, found
	// is the record that was there when it was not, and err the failure of a write that may have committed.
	sent  bool
	won   bool
	found journal.Record
	err   error
	// hold is the funds hold the checks decided on, left to be written with the claim and the settlement's signed
	// transaction in one batch (HoldClaimAndSign).
	hold *deferredHold
}

// deferredHold is the funds hold with take the checks of a settlement decided on, to be written with its claim and
// its signed transaction's record (see signedWithHold).
type deferredHold struct {
	holds                journal.Cluster
	h                    journal.Hold
	avail                *big.Int
	readBlock, chainTime uint64
}

// errHoldRefusedSigned: the hold written with the claim and the signed transaction found the payer's funds short:
// the claim is written, the transaction not recorded (dropped, its nonce unused), and the checks run again as for
// a claim written first, reading the funds afresh.
var errHoldRefusedSigned = errors.New("the payer's funds fell short of the hold written with the signed transaction; nothing was sent")

// errClaimNotWon: the claim, written with the hold, found another settlement's record of the payment: nothing was
// written, and nothing was sent.
var errClaimNotWon = errors.New("another settlement claimed the payment first; nothing was held or sent here")

// unsent reports whether c is a claim not written yet.
func (c *pendingClaim) unsent() bool { return c != nil && !c.sent }

// waitsForSigned reports whether c is a claim whose hold the checks deferred to its signed transaction's record.
func (c *pendingClaim) waitsForSigned() bool { return c.unsent() && c.hold != nil }

// signedWithHold writes c with its deferred hold, and makes it broadcast with the signed transaction (sign's change
// of the claim), under w's lease at fence, in one batch (journal.HoldClaimAndSign). Written: the payment is this
// settlement's (p.claim), and the record as written is returned. Another's record: errClaimNotWon, nothing written.
// Claimed but not made broadcast, the claim is this settlement's to end as any that sent nothing: the funds short,
// errHoldRefusedSigned (the checks run again, as for a claim written first); the lease lost, its error, as
// recordSigned's. Any other error: c.err (the batch may have committed: reconciliation releases the claim, or sends
// the recorded transaction).
func (f *Facilitator) signedWithHold(ctx context.Context, p *payment, w *wallet, fence uint64, sign func(*journal.Record) error) (journal.Record, error) {
	c, d, n := p.pending, p.pending.hold, p.net
	c.sent, c.hold = true, nil
	out, err := journal.HoldClaimAndSign(ctx, d.holds, d.h, d.avail, d.readBlock, d.chainTime, c.rec, leaseName(n.caip2, w.Address), fence, sign)
	if out.Claimed {
		c.won, p.claim = true, out.Rec
	}
	switch {
	case err != nil && out.Claimed:
		f.leaseLost(n, w, fence, err)
		return journal.Record{}, err
	case err != nil:
		c.err = err
		return journal.Record{}, err
	case !out.Claimed:
		c.found = out.Rec
		return journal.Record{}, errClaimNotWon
	case !out.Held:
		return journal.Record{}, errHoldRefusedSigned
	case !out.Signed:
		// Held, and the record changed between the claim and its broadcast write: written as without.
		return f.recordSigned(ctx, n, w, p.id, out.Rec, func(r *journal.Record) error {
			if err := checkClaim(p, r); err != nil {
				return err
			}
			return sign(r)
		})
	}
	return out.Broadcast, nil
}

// claimWithHold reports whether p's settlement claims the payment in the batch of its funds hold (see above).
func (f *Facilitator) claimWithHold(p *payment) bool {
	return !(p.upto() && p.amount.Sign() == 0) && journal.ClaimsWithHold(f.journal, p.net.funds.shared)
}

// claimAlone writes p's pending claim by itself, when it was not written with a hold; nothing otherwise.
func (f *Facilitator) claimAlone(ctx context.Context, p *payment) {
	c := p.pending
	if !c.unsent() || c.waitsForSigned() {
		return
	}
	c.sent = true
	rec, claimed, err := f.journal.Claim(ctx, c.rec)
	switch {
	case err != nil:
		c.err = err
	case !claimed:
		c.found = rec
	default:
		c.won, p.claim = true, rec
	}
}
