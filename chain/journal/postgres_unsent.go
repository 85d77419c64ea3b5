package journal

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// A settlement whose signed transaction every node refused forgets it (ReleaseUnsent: the write-ahead record goes,
// so that no later pass sends those bytes) and lets go of the payment's funds hold (Unhold). Of the two leftovers a
// failure or a crash between the two writes can leave, only one is safe: a hold without its record is nobody's to
// end before the payment's deadline (reconciliation looks only at records, a gate only at the holds it took itself),
// so the payer's funds look spent until then, which errs on refusing; a record without its hold is sent again by
// reconciliation against funds counted free meanwhile, which errs on serving unpaid. A batch-settlement deposit,
// which no gate holds, kept such a hold to the end of the money-invariant run. ReleaseUnsentUnhold writes the two in
// one transaction where it can, and else the record first.

// ReleaseUnsentUnhold is s.ReleaseUnsent of claim with txHash and c.Unhold of claim's payment: in one transaction
// where s and c are one PostgreSQL store, else the record first and the hold only once the record is gone. An error
// may leave the record gone and the hold as it was, never the hold gone with the record left. With c nil (no shared
// holds) it is s.ReleaseUnsent.
//
// A record no longer there (another's pass forgot it first) lets go of no hold: the payment's hold may by then be
// another settlement's, or a verification's of the payment presented again, and letting go of it would count that
// payer's funds free while it is served. A hold of this claim's own left so (the other pass forgot the record
// alone) only makes the payer's funds look spent until the payment's deadline. Apart from one PostgreSQL store, the
// record is looked for first, and one forgotten by another in the moment between is still not told apart.
func ReleaseUnsentUnhold(ctx context.Context, s Store, c Cluster, claim Record, txHash string, unlessServed bool) error {
	if c == nil {
		return s.ReleaseUnsent(ctx, claim, txHash)
	}
	if ps, ok := s.(*PostgresStore); ok && ClaimsWithHold(s, c) {
		return ps.releaseUnsentUnhold(ctx, claim, txHash, unlessServed)
	}
	if _, found, err := s.Get(ctx, claim.ID); err != nil || !found {
		return err
	}
	if err := s.ReleaseUnsent(ctx, claim, txHash); err != nil {
		return err
	}
	return c.Unhold(ctx, claim.ID, unlessServed)
}

// releaseUnsentUnhold is ReleaseUnsent and Unhold in one transaction: the hold goes with the record, or neither.
// A record that is not releasable (ErrNotReleasable), or no longer there, leaves the hold as it is: it may be
// another claim's.
func (s *PostgresStore) releaseUnsentUnhold(ctx context.Context, claim Record, txHash string, unlessServed bool) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	return s.fail(ctx, "release unsent", s.inTx(wctx, func(tx pgx.Tx) error {
		if found, err := releaseUnsentFound(pgTxn{wctx, tx}, claim, txHash); err != nil || !found {
			return err
		}
		_, err := tx.Exec(wctx, `DELETE FROM x402_holds WHERE id = $1 AND NOT (served AND $2)`, claim.ID[:], unlessServed)
		return err
	}))
}
