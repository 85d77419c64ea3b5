package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A read-modify-write transaction of the PostgreSQL store costs two round trips, whatever its size: BEGIN goes
// in one pipelined batch with its reads and row locks, its writes in another with COMMIT. Sent one statement at a
// time, the same transaction cost a round trip per statement plus BEGIN and COMMIT (four for an update, five
// fenced, seven for a funds hold), each waiting for the last, and a paid request makes several of them.
// Pipelining changes nothing the database sees but the waits between statements: the statements, their order and
// the transaction are the same, and a statement that fails makes the server skip the rest of its batch, so
// nothing after it runs, and the transaction is rolled back.

// txInTwo runs a transaction in two round trips: BEGIN and what first queues, then what then queues and COMMIT.
// first's queued callbacks read what then decides on; an error from them or from then rolls the transaction back
// and is returned. It is retried as inTx retries (a serialization failure, a deadlock, a connection that broke
// before COMMIT was sent), so first and then may run more than once.
func (s *PostgresStore) txInTwo(ctx context.Context, first func(*pgx.Batch), then func(*pgx.Batch) error) error {
	return retryTx(ctx, func() error { return s.txInTwoOnce(ctx, first, then) })
}

func (s *PostgresStore) txInTwoOnce(ctx context.Context, first func(*pgx.Batch), then func(*pgx.Batch) error) error {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A connection left inside the transaction (a batch that failed, a rollback that did not get through) is
	// closed by the pool rather than reused.
	defer c.Release()
	rollback := func() {
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c.Exec(rctx, "rollback")
		cancel()
	}
	b := &pgx.Batch{}
	b.Queue("begin")
	first(b)
	if err := c.SendBatch(ctx, b).Close(); err != nil {
		rollback()
		return err
	}
	b = &pgx.Batch{}
	if err := then(b); err != nil {
		rollback()
		return err
	}
	b.Queue("commit")
	if err := c.SendBatch(ctx, b).Close(); err != nil {
		if unavailable(err) {
			// The batch may have reached the server and committed before the connection broke.
			return commitError{err}
		}
		// The database refused a write or the COMMIT itself: nothing was committed (a failed COMMIT rolls back).
		rollback()
		return err
	}
	return nil
}

// pgQueuedTxn is a txn over a record read by the first batch of txInTwo (locked FOR UPDATE), whose writes are
// queued in the second.
type pgQueuedTxn struct {
	id    ID
	rec   Record
	found bool
	b     *pgx.Batch
}

// queueGet queues the read of the record of id, locked until the transaction ends, into b.
func (t *pgQueuedTxn) queueGet(b *pgx.Batch) {
	t.found = false
	b.Queue(pgGetRecord+` FOR UPDATE`, t.id[:]).QueryRow(func(row pgx.Row) (err error) {
		// A record that does not decode fails the first batch: nothing is written.
		t.rec, t.found, err = scanRecord(row, t.id)
		return err
	})
}

func (t *pgQueuedTxn) get(id ID) (Record, bool, error) {
	if id != t.id {
		return Record{}, false, fmt.Errorf("journal: a transaction of %s read %s", t.id, id)
	}
	return t.rec, t.found, nil
}

func (t *pgQueuedTxn) put(prev, next *Record) error {
	if prev == nil {
		return fmt.Errorf("journal: a transaction of %s inserts nothing", t.id)
	}
	row, err := rowOf(next)
	if err != nil {
		return err
	}
	// As pgTxn.put: claimed_ns stays, and a served mark, once there, stays as it is.
	t.b.Queue(`UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5,
	served_ns = COALESCE(served_ns, $6), data = $7 WHERE id = $1`,
		next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data)
	return nil
}

func (t *pgQueuedTxn) del(prev *Record) error {
	t.b.Queue(`DELETE FROM x402_records WHERE id = $1`, prev.ID[:])
	return nil
}

// updateInTwo is Update in two round trips (see txInTwo), with check, when given, queued before the record's
// read: it reads what then decides on, and then's error (from check's findings) writes nothing.
func (s *PostgresStore) updateInTwo(ctx context.Context, id ID, fn func(*Record) error, check func(*pgx.Batch) func() error) (Record, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Record{}, err
	}
	defer cancel()
	now := s.opts.now()
	var rec Record
	var checked func() error
	t := &pgQueuedTxn{id: id}
	err = s.txInTwo(wctx, func(b *pgx.Batch) {
		if check != nil {
			checked = check(b)
		}
		t.queueGet(b)
	}, func(b *pgx.Batch) (err error) {
		if checked != nil {
			if err := checked(); err != nil {
				return err
			}
		}
		t.b = b
		rec, err = updateIn(t, id, fn, now)
		return err
	})
	if err != nil {
		return Record{}, s.fail(ctx, "update", err)
	}
	return rec, nil
}

// fenceCheck queues the check of UpdateFenced: this instance holds lease at fence, unexpired, under a share lock
// of the lease's row (a takeover waits for the write, or the write sees the takeover).
func (s *PostgresStore) fenceCheck(lease string, fence uint64) func(*pgx.Batch) func() error {
	return func(b *pgx.Batch) func() error {
		var held bool
		b.Queue(`SELECT owner = $2 AND fence = $3 AND expires_at > now() FROM x402_leases WHERE name = $1 FOR SHARE`,
			lease, s.instance, int64(fence)).QueryRow(func(row pgx.Row) error {
			held = false
			err := row.Scan(&held)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			return err
		})
		return func() error {
			if !held {
				return fmt.Errorf("%w: %s at fence %d", ErrFenced, lease, fence)
			}
			return nil
		}
	}
}

const pgSelectHolds = `SELECT id, amount::text, deadline::text, mined::text, permit_nonce::text, served
FROM x402_holds WHERE hold_key = $1 ORDER BY held_at, id`

// pgCoveredSQL is what a hold without take needs of the holds of key $1 that count for a read at block $2 and chain
// time $3 (pgHoldSQL's rule): the sum of those that are not hold $4's, and whether $4's is among them, in one row.
// A busy payer's key keeps the holds mined since the longest read that could miss them (see
// Options.MinedHoldsKept), the holds past their deadline until the next hold with take, and, while a funds read
// answers, every hold mined since that read: hundreds of rows a verification needs only the sum of.
const pgCoveredSQL = `SELECT coalesce(sum(amount) FILTER (WHERE id <> $4::bytea), 0)::text, coalesce(bool_or(id = $4::bytea), false)
FROM x402_holds WHERE hold_key = $1 AND (mined > $2::numeric OR (mined = 0 AND deadline >= $3::numeric))`

// coveredArgs are pgCoveredSQL's arguments for h, read at readBlock and chainTime.
func coveredArgs(h Hold, readBlock, chainTime uint64) []any {
	return []any{h.Key, strconv.FormatUint(readBlock, 10), strconv.FormatUint(chainTime, 10), h.ID[:]}
}

// holdsSum reads a sum of the holds of key, as the database wrote it.
func holdsSum(key, text string) (*big.Int, error) {
	sum, ok := new(big.Int).SetString(text, 10)
	if !ok || sum.Sign() < 0 {
		return nil, fmt.Errorf("%w: the holds of %q sum to %q", ErrCorrupt, key, text)
	}
	return sum, nil
}

// covers is what Hold decides for h from what the other holds that count sum to and whether h's is among them:
// h is held or covered (ok), and what the key's funds cover beside the others (left).
func covers(h Hold, avail, others *big.Int, held bool) (ok bool, left *big.Int) {
	left = new(big.Int).Sub(avail, others)
	return held || left.Cmp(h.Amount) >= 0, left
}

const pgInsertHold = `INSERT INTO x402_holds (id, hold_key, amount, deadline, mined, permit_nonce, served)
VALUES ($1, $2, $3::numeric, $4::numeric, $5::numeric, $6::numeric, $7) ON CONFLICT (id) DO NOTHING`

// holdArgs are the arguments of pgInsertHold for h.
func holdArgs(h Hold) []any {
	var nonce *string
	if h.PermitNonce != nil {
		n := h.PermitNonce.String()
		nonce = &n
	}
	return []any{h.ID[:], h.Key, h.Amount.String(), strconv.FormatUint(h.Deadline, 10), strconv.FormatUint(h.Mined, 10), nonce, h.Served}
}

// UpdateKnown is s.Update of a record its caller knows as it stands: prev, as a write of it returned it (Claim,
// Update). A store that can (the PostgreSQL store) writes fn's change in one statement, conditional on the stored
// record still being prev, and falls back to Update when it is not; any other store runs Update. Either way fn
// sees the record as stored, and the result is Update's.
func UpdateKnown(ctx context.Context, s Store, prev Record, fn func(*Record) error) (Record, error) {
	if k, ok := s.(interface {
		updateKnown(ctx context.Context, prev Record, fn func(*Record) error) (Record, error)
	}); ok {
		return k.updateKnown(ctx, prev, fn)
	}
	return s.Update(ctx, prev.ID, fn)
}

// updateKnown writes fn's change of prev where the stored record is still prev, byte for byte and not marked
// served, which stands in for the read and row lock of Update: a record changed since (by anyone) is not
// written, and goes through Update.
func (s *PostgresStore) updateKnown(ctx context.Context, prev Record, fn func(*Record) error) (Record, error) {
	if prev.Served || prev.ID.IsZero() {
		return s.Update(ctx, prev.ID, fn)
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Record{}, err
	}
	defer cancel()
	was, err := encodeRecord(&prev)
	if err != nil {
		return Record{}, err
	}
	t := &pgKnownTxn{prev: prev}
	next, err := updateIn(t, prev.ID, fn, s.opts.now())
	if err != nil {
		return Record{}, err
	}
	row, err := rowOf(&next)
	if err != nil {
		return Record{}, err
	}
	var tag pgconn.CommandTag
	err = retrySafe(func() (err error) {
		tag, err = s.pool.Exec(wctx, `UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5,
	served_ns = $6, data = $7 WHERE id = $1 AND data = $8 AND served_ns IS NULL`,
			next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was)
		return err
	})
	if err != nil {
		return Record{}, s.fail(ctx, "update", err)
	}
	if tag.RowsAffected() == 1 {
		return next, nil
	}
	return s.Update(ctx, prev.ID, fn)
}

// pgKnownTxn is the txn of updateKnown: it reads the record the caller knows, and writes nothing itself.
type pgKnownTxn struct{ prev Record }

func (t *pgKnownTxn) get(ID) (Record, bool, error) { return t.prev, true, nil }
func (t *pgKnownTxn) put(_, _ *Record) error       { return nil }
func (t *pgKnownTxn) del(*Record) error {
	return errors.New("journal: an update of a known record deletes nothing")
}

// MarkAndGet is, for a store several processes share, c.Busy of id and, when the mark is this instance's, Get of
// its record: in one round trip where the store can (the PostgreSQL store pipelines the two statements), else in
// two. A store that cannot mark (no Cluster) only reads, and says marked. An error with marked true leaves the
// mark this instance's, to clear with Idle.
func MarkAndGet(ctx context.Context, s Store, id ID) (marked bool, rec Record, found bool, err error) {
	if m, ok := s.(interface {
		markAndGet(ctx context.Context, id ID) (bool, Record, bool, error)
	}); ok {
		return m.markAndGet(ctx, id)
	}
	if c, ok := s.(Cluster); ok {
		if marked, err = c.Busy(ctx, id); err != nil || !marked {
			return marked, Record{}, false, err
		}
	}
	rec, found, err = s.Get(ctx, id)
	return true, rec, found, err
}

// markAndGet sends Busy's statement and Get's in one batch: the read runs after the mark, in the same implicit
// transaction, and is used only when the mark is this instance's.
func (s *PostgresStore) markAndGet(ctx context.Context, id ID) (marked bool, rec Record, found bool, err error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return false, Record{}, false, err
	}
	defer cancel()
	err = s.groupedBatch(wctx, func(b *pgx.Batch) {
		marked, found = false, false
		b.Queue(pgBusy, id[:], s.instance).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&marked)
			if errors.Is(err, pgx.ErrNoRows) {
				marked, err = false, nil // another live instance's mark
			}
			return err
		})
		b.Queue(pgGetRecord, id[:]).QueryRow(func(row pgx.Row) (err error) {
			rec, found, err = scanRecord(row, id)
			return err
		})
	})
	switch {
	case err != nil:
		// A mark taken with a read that failed is still this instance's, for the caller to clear.
		return marked, Record{}, false, s.fail(ctx, "busy", err)
	case !marked:
		return false, Record{}, false, nil
	}
	return true, rec, found, nil
}

// UpdateFencedKnown is c.UpdateFenced of a record its caller knows as it stands (prev, as a write of it returned
// it), as UpdateKnown is Update: the PostgreSQL store writes it in one statement, the lease checked in it under
// the same share lock, where the stored record is still prev, and goes through UpdateFenced otherwise.
func UpdateFencedKnown(ctx context.Context, c Cluster, prev Record, lease string, fence uint64, fn func(*Record) error) (Record, error) {
	if k, ok := c.(interface {
		updateFencedKnown(ctx context.Context, prev Record, lease string, fence uint64, fn func(*Record) error) (Record, error)
	}); ok {
		return k.updateFencedKnown(ctx, prev, lease, fence, fn)
	}
	return c.UpdateFenced(ctx, prev.ID, lease, fence, fn)
}

// updateFencedKnown writes fn's change of prev in one statement: the lease's row is read under a share lock (as
// UpdateFenced's check reads it), and the record is written only when this instance holds the lease at fence,
// unexpired, and the stored record is still prev, byte for byte and not marked served. Not held: ErrFenced,
// nothing written. Held, the record changed since: UpdateFenced, which reads it.
func (s *PostgresStore) updateFencedKnown(ctx context.Context, prev Record, lease string, fence uint64, fn func(*Record) error) (Record, error) {
	if prev.Served || prev.ID.IsZero() {
		return s.UpdateFenced(ctx, prev.ID, lease, fence, fn)
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Record{}, err
	}
	defer cancel()
	was, err := encodeRecord(&prev)
	if err != nil {
		return Record{}, err
	}
	next, err := updateIn(&pgKnownTxn{prev: prev}, prev.ID, fn, s.opts.now())
	if err != nil {
		return Record{}, err
	}
	row, err := rowOf(&next)
	if err != nil {
		return Record{}, err
	}
	var held, written bool
	err = retrySafe(func() error {
		return s.pool.QueryRow(wctx, `WITH lease AS (
	SELECT 1 FROM x402_leases WHERE name = $9 AND owner = $10 AND fence = $11 AND expires_at > now() FOR SHARE
), written AS (
	UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5, served_ns = $6, data = $7
	WHERE id = $1 AND data = $8 AND served_ns IS NULL AND EXISTS (SELECT 1 FROM lease) RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM lease), EXISTS (SELECT 1 FROM written)`,
			next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was,
			lease, s.instance, int64(fence)).Scan(&held, &written)
	})
	switch {
	case err != nil:
		return Record{}, s.fail(ctx, "update", err)
	case !held:
		return Record{}, fmt.Errorf("%w: %s at fence %d", ErrFenced, lease, fence)
	case written:
		return next, nil
	}
	return s.UpdateFenced(ctx, prev.ID, lease, fence, fn)
}
