package journal

import (
	"context"
	"math/big"

	"github.com/jackc/pgx/v5"
)

// UnrecordedAndCovered is, for an engine answering a verification from the payer's funds, whether c holds no
// record of h.ID (a payment presented before is left to the chain) and c.Hold of h without take (whether the
// key's funds cover h beside its other holds): the read of the record and the read of the holds in one round
// trip where the store can (the PostgreSQL store pipelines them), else in two. Nothing is written. unrecorded
// false (a record, even one that does not decode) leaves ok and left unset.
func UnrecordedAndCovered(ctx context.Context, c Cluster, h Hold, avail *big.Int, readBlock, chainTime uint64) (unrecorded, ok bool, left *big.Int, err error) {
	if u, is := c.(interface {
		unrecordedAndCovered(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64) (bool, bool, *big.Int, error)
	}); is {
		return u.unrecordedAndCovered(ctx, h, avail, readBlock, chainTime)
	}
	if _, known, err := c.Get(ctx, h.ID); err != nil || known {
		return false, false, nil, err
	}
	ok, left, err = c.Hold(ctx, h, avail, readBlock, chainTime, false)
	return err == nil, ok, left, err
}

// unrecordedAndCovered sends the record's read and Hold's read of the holds' sum (without take) in one batch.
func (s *PostgresStore) unrecordedAndCovered(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64) (bool, bool, *big.Int, error) {
	if err := checkHold(h, avail); err != nil {
		return false, false, nil, err
	}
	var (
		known bool
		sum   string
		held  bool
	)
	err := s.readCarrying(ctx, func(b *pgx.Batch) {
		queueRecorded(b, h.ID, &known)
		b.Queue(pgCoveredSQL, coveredArgs(h, readBlock, chainTime)...).QueryRow(func(row pgx.Row) error {
			return row.Scan(&sum, &held)
		})
	})
	if err != nil {
		return false, false, nil, s.fail(ctx, "hold", err)
	}
	if known {
		return false, false, nil, nil
	}
	others, err := holdsSum(h.Key, sum)
	if err != nil {
		return false, false, nil, s.fail(ctx, "hold", err)
	}
	ok, left := covers(h, avail, others, held)
	return true, ok, left, nil
}

// UnrecordedAndHeld is UnrecordedAndCovered with take: h is held (as c.Hold with take holds it) only when c holds
// no record of h.ID, the record's read going in the statement of the hold's transaction that decides it, where the
// store can (the PostgreSQL store: one round trip in all); else the record is read first. A recorded payment holds
// nothing.
func UnrecordedAndHeld(ctx context.Context, c Cluster, h Hold, avail *big.Int, readBlock, chainTime uint64) (unrecorded, ok bool, left *big.Int, err error) {
	if u, is := c.(interface {
		unrecordedAndHeld(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64) (bool, bool, *big.Int, error)
	}); is {
		return u.unrecordedAndHeld(ctx, h, avail, readBlock, chainTime)
	}
	if _, known, err := c.Get(ctx, h.ID); err != nil || known {
		return false, false, nil, err
	}
	ok, left, err = c.Hold(ctx, h, avail, readBlock, chainTime, true)
	return err == nil, ok, left, err
}

// unrecordedAndHeld is Hold with take whose deciding statement reads whether the record exists, and holds
// nothing when it does (holdInOne).
func (s *PostgresStore) unrecordedAndHeld(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64) (bool, bool, *big.Int, error) {
	if err := checkHold(h, avail); err != nil {
		return false, false, nil, err
	}
	recorded, ok, left, err := s.holdCarrying(ctx, h, avail, readBlock, chainTime, true)
	switch {
	case err != nil:
		return false, false, nil, s.fail(ctx, "hold", err)
	case recorded:
		return false, false, nil, nil
	}
	return true, ok, left, nil
}

// queueRecorded queues into b the read of whether the journal holds a record of id, into known.
func queueRecorded(b *pgx.Batch, id ID, known *bool) {
	b.Queue(`SELECT EXISTS (SELECT 1 FROM x402_records WHERE id = $1)`, id[:]).QueryRow(func(row pgx.Row) error {
		return row.Scan(known)
	})
}
