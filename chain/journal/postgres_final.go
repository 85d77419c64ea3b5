package journal

import (
	"context"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// An engine ends a settled payment's funds hold (HoldMined) before it writes the payment's final answer: a final
// record is never looked at again, so a hold whose end was lost behind it would leave the payer's funds looking
// spent until the payment's deadline. Written in one statement, the two are one atomic write, which keeps that
// order's guarantee (no final record with its hold not ended) without its second commit: an outage or a crash
// leaves both written or neither, and neither leaves the record broadcast for reconciliation, which ends both.

// UpdateKnownHoldMined is c.HoldMined of prev's payment at block and then UpdateKnown of prev with fn: in one
// statement where c can (the PostgreSQL store) and the stored record is still prev; else the hold's end first and
// the update only once it is written. An error may leave the hold ended and the record as it was, never the
// record changed with the hold not ended.
func UpdateKnownHoldMined(ctx context.Context, c Cluster, prev Record, block uint64, fn func(*Record) error) (Record, error) {
	if k, ok := c.(interface {
		updateKnownHoldMined(ctx context.Context, prev Record, block uint64, fn func(*Record) error) (Record, bool, error)
	}); ok {
		rec, done, err := k.updateKnownHoldMined(ctx, prev, block, fn)
		if done || err != nil {
			return rec, err
		}
	}
	if err := c.HoldMined(ctx, prev.ID, block); err != nil {
		return Record{}, err
	}
	return UpdateKnown(ctx, c, prev, fn)
}

// updateKnownHoldMined writes the hold's end and fn's change of prev in one statement, the record only where it is
// still prev (byte for byte, not served); the hold's end is written either way, and a record changed since goes
// through Update after it. done false, with no error, leaves the caller to write the two apart (a record
// updateKnown would not write in one statement, or one fn refuses).
func (s *PostgresStore) updateKnownHoldMined(ctx context.Context, prev Record, block uint64, fn func(*Record) error) (Record, bool, error) {
	if prev.Served || prev.ID.IsZero() {
		return Record{}, false, nil
	}
	was, err := encodeRecord(&prev)
	if err != nil {
		return Record{}, false, err
	}
	next, err := updateIn(&pgKnownTxn{prev: prev}, prev.ID, fn, s.opts.now())
	if err != nil {
		return Record{}, false, nil // refused: the hold's end alone, then Update's refusal, as apart
	}
	row, err := rowOf(&next)
	if err != nil {
		return Record{}, false, err
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Record{}, false, err
	}
	defer cancel()
	var written bool
	err = s.grouped(wctx, func(b *pgx.Batch) {
		b.Queue(`WITH mined AS (
	UPDATE x402_holds SET mined = $9::numeric, mined_at = now() WHERE id = $1 AND mined = 0
), written AS (
	UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5, served_ns = $6, data = $7
	WHERE id = $1 AND data = $8 AND served_ns IS NULL RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM written)`,
			next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was,
			strconv.FormatUint(block, 10))
	}, func(br pgx.BatchResults) error { return br.QueryRow().Scan(&written) })
	if err != nil {
		return Record{}, false, s.fail(ctx, "hold mined", err)
	}
	if !written {
		// Changed since (by reconciliation, another instance): the hold's end is written, and the record is read
		// and judged as it stands.
		rec, err := s.Update(ctx, prev.ID, fn)
		return rec, true, err
	}
	return next, true, nil
}
