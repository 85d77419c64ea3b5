package journal

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// A gate's last two writes of a payment it served are its served mark and the clearing of its in-flight mark
// (Cluster.Idle), in that order: cleared first, another gateway of the cluster could take the mark, read the
// record not yet served, and serve the payment a second time. Written in one statement, they are one atomic
// write: the served mark is never seen without the in-flight mark cleared or the other way round, and a crash or
// a database outage leaves both written or neither (the mark is then cleared as before, by Idle or by a takeover
// once this instance is gone). One commit, and one round trip, fewer a payment.

// MarkServedIdle is s.MarkServed of id and, when s is a Cluster that can write both in one go (the PostgreSQL
// store), the clearing of this instance's in-flight mark of id with it. idled says the mark was cleared (or was
// not this instance's); false leaves the mark to the caller to clear with Idle, whatever err says.
func MarkServedIdle(ctx context.Context, s Store, id ID, at time.Time) (idled bool, err error) {
	if m, ok := s.(interface {
		markServedIdle(ctx context.Context, id ID, at time.Time) (bool, error)
	}); ok {
		return m.markServedIdle(ctx, id, at)
	}
	return false, s.MarkServed(ctx, id, at)
}

// markServedIdle writes MarkServed's statement and Idle's in one: the mark is cleared whether or not the served
// mark was written, as the caller clears it after a MarkServed that failed. A served mark not written (the record
// served already, or gone) is told apart by MarkServed, which then writes nothing.
func (s *PostgresStore) markServedIdle(ctx context.Context, id ID, at time.Time) (bool, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return false, err
	}
	defer cancel()
	var written bool
	err = s.grouped(wctx, func(b *pgx.Batch) {
		b.Queue(`WITH served AS (
	UPDATE x402_records SET served_ns = $2 WHERE id = $1 AND served_ns IS NULL RETURNING 1
), idle AS (
	DELETE FROM x402_busy WHERE id = $1 AND owner = $3
)
SELECT EXISTS (SELECT 1 FROM served)`, id[:], at.UnixNano(), s.instance)
	}, func(br pgx.BatchResults) error { return br.QueryRow().Scan(&written) })
	if err != nil {
		return false, s.fail(ctx, "mark served", err)
	}
	if written {
		return true, nil
	}
	return true, s.MarkServed(ctx, id, at)
}

// UpdateKnownIdle is UpdateKnown and, when s is a Cluster that can write both in one go (the PostgreSQL store)
// and fn's change of prev is written in one statement, the clearing of this instance's in-flight mark of prev's
// payment with it. idled false leaves the mark to the caller to clear with Idle, whatever err says: a record
// changed since prev goes through Update, and the mark is not touched.
func UpdateKnownIdle(ctx context.Context, s Store, prev Record, fn func(*Record) error) (rec Record, idled bool, err error) {
	if k, ok := s.(interface {
		updateKnownIdle(ctx context.Context, prev Record, fn func(*Record) error) (Record, bool, error)
	}); ok {
		return k.updateKnownIdle(ctx, prev, fn)
	}
	rec, err = UpdateKnown(ctx, s, prev, fn)
	return rec, false, err
}

// updateKnownIdle is updateKnown with Idle's statement in the same one, run only when the record was written.
func (s *PostgresStore) updateKnownIdle(ctx context.Context, prev Record, fn func(*Record) error) (Record, bool, error) {
	if prev.Served || prev.ID.IsZero() {
		rec, err := s.Update(ctx, prev.ID, fn)
		return rec, false, err
	}
	// Deferred writes of ctx (postgres_behind.go: the engine's final answer) ride in its batch, below.
	wctx, cancel, err := s.start(ctx, true)
	if err != nil {
		return Record{}, false, err
	}
	defer cancel()
	was, err := encodeRecord(&prev)
	if err != nil {
		return Record{}, false, err
	}
	next, err := updateIn(&pgKnownTxn{prev: prev}, prev.ID, fn, s.opts.now())
	if err != nil {
		return Record{}, false, err
	}
	row, err := rowOf(&next)
	if err != nil {
		return Record{}, false, err
	}
	var written bool
	items, done, err := s.carry(ctx)
	if err != nil {
		return Record{}, false, err
	}
	args := []any{next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was, s.instance}
	err = retrySafe(func() error { return s.rowCarrying(wctx, items, pgUpdateKnownIdle, args, &written) })
	done(err)
	if err != nil && len(items) > 0 && !fenceFailed(items) && errors.As(err, new(behindFailed)) {
		// A deferred write that is no claim (the engine's final answer, which reconciliation records should it
		// never be written) failed ahead of this one, and took it with it: this one goes alone. A payment served
		// and not marked served would be served again.
		ectx, ecancel, eerr := s.start(ctx, true)
		if eerr != nil {
			return Record{}, false, eerr
		}
		defer ecancel()
		err = retrySafe(func() error { return s.rowCarrying(ectx, nil, pgUpdateKnownIdle, args, &written) })
	}
	if err != nil {
		return Record{}, false, s.fail(ctx, "update", err)
	}
	if written {
		return next, true, nil
	}
	rec, err := s.Update(ctx, prev.ID, fn)
	return rec, false, err
}

// pgUpdateKnownIdle is updateKnownIdle's statement: the record's change where it is still the one known, and the
// clearing of this instance's in-flight mark when it was written.
const pgUpdateKnownIdle = `WITH written AS (
	UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5, served_ns = $6, data = $7
	WHERE id = $1 AND data = $8 AND served_ns IS NULL RETURNING 1
), idle AS (
	DELETE FROM x402_busy WHERE id = $1 AND owner = $9 AND EXISTS (SELECT 1 FROM written)
)
SELECT EXISTS (SELECT 1 FROM written)`
