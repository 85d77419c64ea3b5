package chain

import (
	"context"
	"errors"
	"math/big"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// Claim with hold. A settlement claims its payment in the journal and holds it against the payer's funds before
// it signs anything. With the journal and the shared holds one PostgreSQL store, the two go in one transaction,
// one round trip (journal.HoldAndClaim), where they were two: the claim is not written when the settlement
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
// One round trip fewer again: the claim and the hold wait for the settlement's signed transaction, and go with its
// write-ahead record, the payment's record written once, already broadcast (journal.HoldClaimAndSign, under the
// wallet's lease). Signing sends nothing: a write that is not won (another's record, the lease lost, the funds
// short) leaves nothing written and the wallet's nonce unused, so no record is ever written of a transaction that
// may not be sent, and no claim or hold of this settlement is left to end. The funds short, the checks run again
// as above, holding and claiming before signing, where the funds are read afresh.

// pendingClaim is a settlement's claim of its payment, to be written with the payment's funds hold.
type pendingClaim struct {
	rec journal.Record // the claim as it is to be written
	// sent says its write was tried; then won says it was written, and the payment is this settlement's, found
	// is the record that was there when it was not, and err the failure of a write that may have committed.
	sent  bool
	won   bool
	found journal.Record
	err   error
	// withSigned says the claim and its hold wait for the settlement's signed transaction, to be written with its
	// record in one transaction (HoldClaimAndSign): the checks then leave hold set to what they would have held.
	// Cleared when that write found the payer's funds short: the checks then hold and claim as before.
	withSigned bool
	hold       *deferredHold
}

// deferredHold is the funds hold with take the checks of a settlement decided on, to be written with its claim and
// its signed transaction's record (see signedWithHold).
type deferredHold struct {
	holds                journal.Cluster
	h                    journal.Hold
	avail                *big.Int
	readBlock, chainTime uint64
}

// errHoldRefusedSigned: the claim written with the signed transaction's record found the payer's funds short,
// and wrote nothing; the signed transaction is dropped, its nonce unused, and the checks run again as before.
var errHoldRefusedSigned = errors.New("the payer's funds fell short of the hold written with the signed transaction; nothing was written or sent")

// errClaimNotWon: the claim, written with the hold, found another settlement's record of the payment: nothing was
// written, and nothing was sent.
var errClaimNotWon = errors.New("another settlement claimed the payment first; nothing was held or sent here")

// unsent reports whether c is a claim not written yet.
func (c *pendingClaim) unsent() bool { return c != nil && !c.sent }

// withHold writes c with the shared hold h of p (journal.HoldAndClaim) and answers as the hold: whether it is
// held, and what is left. A claim another won is errClaimNotWon; a write that failed, its error.
func (c *pendingClaim) withHold(ctx context.Context, p *payment, holds journal.Cluster, h journal.Hold, avail *big.Int, readBlock, chainTime uint64) (bool, *big.Int, error) {
	c.sent = true
	out, err := journal.HoldAndClaim(ctx, holds, h, avail, readBlock, chainTime, c.rec)
	switch {
	case err != nil:
		c.err = err
		return false, nil, err
	case !out.Claimed:
		c.found = out.Rec
		return false, nil, errClaimNotWon
	}
	c.won, p.claim = true, out.Rec
	return out.Held, out.Left, nil
}

// waitsForSigned reports whether c is a claim whose hold the checks deferred to its signed transaction's record.
func (c *pendingClaim) waitsForSigned() bool { return c.unsent() && c.hold != nil }

// signedWithHold writes c, its deferred hold and the record of the signed transaction (sign's change of the claim)
// in one transaction, under w's lease at fence (journal.HoldClaimAndSign). Written: the payment is this
// settlement's (p.claim), and the record as written is returned. Another's record: errClaimNotWon. The funds
// short: errHoldRefusedSigned, c unsent again and no longer waiting, for the checks to run again. Any error: as
// recordSigned's, and c.err (the write may have committed: the claim is left to reconciliation).
func (f *Facilitator) signedWithHold(ctx context.Context, p *payment, w *wallet, fence uint64, sign func(*journal.Record) error) (journal.Record, error) {
	c, d, n := p.pending, p.pending.hold, p.net
	c.sent, c.hold = true, nil
	out, err := journal.HoldClaimAndSign(ctx, d.holds, d.h, d.avail, d.readBlock, d.chainTime, c.rec, leaseName(n.caip2, w.Address), fence, sign)
	switch {
	case err != nil:
		f.leaseLost(n, w, fence, err)
		c.err = err
		return journal.Record{}, err
	case out.Found:
		c.found = out.Rec
		return journal.Record{}, errClaimNotWon
	case out.Refused:
		c.sent, c.withSigned = false, false
		return journal.Record{}, errHoldRefusedSigned
	}
	c.won, p.claim = true, out.Claim
	return out.Rec, nil
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
