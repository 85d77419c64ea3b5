package journal

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Write-behind within one paid request. A gate and its embedded engine share one PostgreSQL store, and a paid
// request settled in it writes the journal from both, each write a round trip of its own. Two of them need not
// be: the gate's record of the payment has only to be durable before the engine signs anything, and the engine
// writes its claim before that; the engine's final answer (with its funds hold's end) has only to be durable
// before the gate's served mark, which comes last. So a request's context may carry a queue of deferred writes
// bound to its store (Defer), a deferrable write is queued there instead of sent (ClaimBehind,
// UpdateKnownHoldMinedBehind), and the store sends the queue in front of the next statement it sends for that
// context, in the same batch: the engine's claim carries the gate's record, the gate's final write carries the
// engine's. A batch is one implicit transaction: a deferred write that fails stops everything after it, so a
// gate's record that finds another request's there (a plain INSERT, whose unique violation aborts the batch)
// leaves no engine claim either, and the engine sends nothing. Every other call of the store sends what is queued
// first, alone (begin), so no later write of the context overtakes a deferred one, and a queued write waits at
// most MaxBehind (Options): then it is sent on its own. Only a deferred claim's failure stops what comes after it: a
// deferred final answer that fails (reconciliation records it from the chain's receipt) is told so, and the write
// it rode with or went ahead of, a gate's served mark, is still written (alone, when they shared a batch).

// defaultMaxBehind is how long a deferred write may wait for a statement to ride with before it is sent alone. It bounds
// how long a settled payment's funds hold still counts (a payer's next payment is judged with it) and its record
// reads broadcast (which reconciliation resolves from the chain's receipt, should the process die meanwhile).
const defaultMaxBehind = time.Second

// ErrExists: a deferred claim found a record of the payment there (another request recorded it first).
var ErrExists = errors.New("journal: a record of the payment is there already")

// errBehindNotSent: a deferred write was not written because a write before it in its batch failed, or the batch
// did not reach the database.
var errBehindNotSent = errors.New("journal: a deferred write was not sent")

// behindKey is the context key of a request's queue.
type behindKey struct{}

// behind is a request's queue of deferred writes to one store.
type behind struct {
	s *PostgresStore
	// base carries the queue, without its request's cancellation: what a write sent on its own runs under.
	base context.Context
	// mu is held while the queue changes and while writes taken from it are on their way, so that a later call of
	// the context waits for them.
	mu    sync.Mutex
	items []*behindWrite
	timer *time.Timer
	// broken is the failure of a deferred claim: what the context sends after it must not run (a batch that
	// carried it stopped there), so every later call of the store under the context fails with it.
	broken error
}

// behindWrite is one deferred statement and who learns its outcome.
type behindWrite struct {
	sql  string
	args []any
	tag  pgconn.CommandTag
	err  error
	sent bool
	// fence: a failure of this write breaks its queue (see behind.broken).
	fence bool
	// lossless says the write may commit without waiting for its WAL flush (pgHoldCommitsAsync): losing it in a
	// crash loses nothing anyone relied on. Only the gate's in-flight mark and its read of the record are.
	lossless bool
	// read, when set, makes the statement a read of one row, which read scans (a deferred MarkAndGetBehind).
	read func(pgx.Row) error
	// landed is told the write's outcome (under the queue's lock); what it returns runs once the lock is let go
	// (a fallback that sends statements of its own).
	landed func(tag pgconn.CommandTag, err error) func()
}

// Defer returns ctx carrying a queue of deferred writes bound to s, when s is a PostgreSQL store; ctx as it is for
// any other store (whose writes are sent as they come), or when ctx carries a queue already. What is queued is sent
// by the next call of s under the returned context (or one derived from it), by Flush, or after MaxBehind (Options).
func Defer(ctx context.Context, s Store) context.Context {
	ps, ok := s.(*PostgresStore)
	if !ok || ctx.Value(behindKey{}) != nil {
		return ctx
	}
	q := &behind{s: ps}
	ctx = context.WithValue(ctx, behindKey{}, q)
	q.base = context.WithoutCancel(ctx)
	return ctx
}

// Flush sends what ctx's queue holds, if anything, and reports its failure.
func Flush(ctx context.Context) error {
	q, _ := ctx.Value(behindKey{}).(*behind)
	if q == nil {
		return nil
	}
	return q.s.fail(ctx, "deferred write", q.flush())
}

// behindOf is ctx's queue when it is bound to s.
func (s *PostgresStore) behindOf(ctx context.Context) *behind {
	q, _ := ctx.Value(behindKey{}).(*behind)
	if q == nil || q.s != s {
		return nil
	}
	return q
}

// add queues w, and starts the clock of MaxBehind (Options).
func (q *behind) add(w *behindWrite) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.items = append(q.items, w)
	q.arm()
}

// arm starts the clock of MaxBehind (Options) for what q holds, unless it runs; q is locked.
func (q *behind) arm() {
	if q.timer == nil && len(q.items) > 0 {
		wait := q.s.opts.MaxBehind
		if wait <= 0 {
			wait = defaultMaxBehind
		}
		q.timer = time.AfterFunc(wait, func() { q.flush() })
	}
}

// takeUnbroken is take, unless a deferred claim of q failed: then q stays as it is, unlocked, and the error says
// so.
func (q *behind) takeUnbroken() ([]*behindWrite, error) {
	items := q.take()
	if q.broken == nil {
		return items, nil
	}
	err := fmt.Errorf("journal: a claim deferred ahead of this call was not written: %w", q.broken)
	q.items = append(items, q.items...)
	q.arm()
	q.mu.Unlock()
	return nil, err
}

// flush sends what q holds, alone, in one batch.
func (q *behind) flush() error {
	items := q.take()
	if len(items) == 0 {
		q.mu.Unlock()
		return nil
	}
	err := q.s.sendItems(q.base, items)
	q.land(items, err)
	return err
}

// take locks q and takes what it holds; the caller sends it and gives it back to land, which unlocks q.
func (q *behind) take() []*behindWrite {
	q.mu.Lock()
	items := q.items
	q.items = nil
	if q.timer != nil {
		q.timer.Stop()
		q.timer = nil
	}
	return items
}

// land tells each write taken its outcome (err for those the batch did not reach), lets go of q, and runs what
// they asked to run then.
func (q *behind) land(items []*behindWrite, err error) {
	var then []func()
	for _, w := range items {
		switch {
		case w.sent:
			w.err = nil
		case w.err != nil:
			// The write that failed.
		case err != nil:
			w.err = fmt.Errorf("%w: %w", errBehindNotSent, err)
		default:
			w.err = errBehindNotSent
		}
		if w.fence && w.err != nil && q.broken == nil {
			q.broken = w.err
		}
		if w.landed != nil {
			if f := w.landed(w.tag, w.err); f != nil {
				then = append(then, f)
			}
		}
	}
	q.mu.Unlock()
	for _, f := range then {
		f()
	}
}

// queueBehind queues items into b, in front of what the caller queues next.
func queueBehind(b *pgx.Batch, items []*behindWrite) {
	for _, w := range items {
		w.tag, w.err, w.sent = pgconn.CommandTag{}, nil, false
		b.Queue(w.sql, w.args...)
	}
}

// readBehind reads the results of items, queued first into the batch br returns, and the first failure. None is
// written until the whole batch is (markSent): a later statement of it that fails rolls them back.
func readBehind(br pgx.BatchResults, items []*behindWrite) error {
	for _, w := range items {
		if w.read != nil {
			w.err = w.read(br.QueryRow())
		} else {
			w.tag, w.err = br.Exec()
		}
		if w.err != nil {
			return behindFailed{w.err}
		}
	}
	return nil
}

// markSent marks items written: their batch committed.
func markSent(items []*behindWrite) {
	for _, w := range items {
		w.sent = true
	}
}

// behindFailed is the failure of a deferred write carried in front of a statement, which was then not run.
type behindFailed struct{ err error }

func (e behindFailed) Error() string {
	return "a write deferred ahead of this one failed, and this one was not written: " + e.err.Error()
}
func (e behindFailed) Unwrap() error { return e.err }

// sendBehind sends what ctx's queue for s holds, alone, in one batch. Every call of the store does this first
// (begin): nothing it writes overtakes a deferred write of the same context, and nothing runs after a deferred
// claim that failed.
func (s *PostgresStore) sendBehind(ctx context.Context) error {
	q := s.behindOf(ctx)
	if q == nil {
		return nil
	}
	items, err := q.takeUnbroken()
	if err != nil {
		return err
	}
	if len(items) == 0 {
		q.mu.Unlock()
		return nil
	}
	err = s.sendItems(q.base, items)
	q.land(items, err)
	if err != nil && fenceFailed(items) {
		return s.fail(ctx, "deferred write", err)
	}
	// A deferred write that is no claim and failed was told so (landed): nothing the caller writes depends on it
	// (the engine's final answer, which reconciliation records should it never be written), and the caller's own
	// write, a gate's served mark say, must not fail with it.
	return nil
}

// fenceFailed reports whether a deferred claim among items, landed, failed: what the context sends after it must
// not run.
func fenceFailed(items []*behindWrite) bool {
	for _, w := range items {
		if w.fence && w.err != nil {
			return true
		}
	}
	return false
}

// sendItems sends items in one batch.
func (s *PostgresStore) sendItems(ctx context.Context, items []*behindWrite) error {
	if s.closed.Load() {
		return ErrClosed
	}
	wctx, cancel := context.WithTimeout(ctx, pgWriteTimeout)
	defer cancel()
	return retrySafe(func() error {
		b := &pgx.Batch{}
		queueBehind(b, items)
		br := s.pool.SendBatch(wctx, b)
		err := readBehind(br, items)
		if err = errors.Join(err, closeErr(br.Close(), err)); err == nil {
			markSent(items)
		}
		return err
	})
}

// rowCarrying sends items and then sql in one batch, and scans sql's row into dest; with no items, sql alone.
func (s *PostgresStore) rowCarrying(ctx context.Context, items []*behindWrite, sql string, args []any, dest ...any) error {
	// In a group with other requests' (postgres_group.go): its batch is one implicit transaction alone, and a
	// group's writes are atomic together.
	err := s.grouped(ctx, func(b *pgx.Batch) {
		queueBehind(b, items)
		b.Queue(sql, args...)
	}, func(br pgx.BatchResults) error {
		if err := readBehind(br, items); err != nil {
			return err
		}
		return br.QueryRow().Scan(dest...)
	})
	if err == nil {
		markSent(items)
	}
	return err
}

// claimCarrying is Claim with items, taken from ctx's queue (carry), in the batch of its insert.
func (s *PostgresStore) claimCarrying(ctx context.Context, r Record, items []*behindWrite, done func(error)) (Record, bool, error) {
	wctx, cancel, err := s.start(ctx, true)
	if err != nil {
		done(err)
		return Record{}, false, err
	}
	defer cancel()
	t := &carryingClaimTxn{s: s, ctx: wctx, items: items}
	rec, claimed, err := claimIn(t, r, s.opts.now())
	if !t.tried {
		// Refused before its insert: what it carried goes alone.
		done(s.sendItems(wctx, items))
	} else {
		done(t.err)
	}
	switch {
	case errors.Is(err, errClaimTaken):
		return s.Claim(ctx, r) // someone's claim is there: Claim reads it
	case err != nil:
		return Record{}, false, s.fail(ctx, "claim", err)
	}
	return rec, claimed, nil
}

// carryingClaimTxn is the txn of claimCarrying: pgClaimTxn's, its insert sent after the deferred writes.
type carryingClaimTxn struct {
	s     *PostgresStore
	ctx   context.Context
	items []*behindWrite
	tried bool
	err   error // the batch's
}

func (t *carryingClaimTxn) get(ID) (Record, bool, error) { return Record{}, false, nil }

func (t *carryingClaimTxn) put(_, next *Record) error {
	row, err := rowOf(next)
	if err != nil {
		return err
	}
	t.tried = true
	var tag pgconn.CommandTag
	t.err = retrySafe(func() error {
		b := &pgx.Batch{}
		queueBehind(b, t.items)
		b.Queue(pgInsertRecord, next.ID[:], string(next.State), next.Async, row.pending, row.claimedNS, row.keptNS, row.servedNS, row.data)
		br := t.s.pool.SendBatch(t.ctx, b)
		if err := readBehind(br, t.items); err != nil {
			br.Close()
			return err
		}
		var err error
		tag, err = br.Exec()
		if err = errors.Join(err, closeErr(br.Close(), err)); err == nil {
			markSent(t.items)
		}
		return err
	})
	if t.err == nil && tag.RowsAffected() == 0 {
		return errClaimTaken
	}
	return t.err
}

func (t *carryingClaimTxn) del(*Record) error { return errors.New("journal: a claim deletes nothing") }

// closeErr is a batch's Close error when reading it went well (a failure read already comes back from Close too).
func closeErr(cerr, readErr error) error {
	if readErr != nil {
		return nil
	}
	return cerr
}

// carry takes what ctx's queue for s holds, for the caller to send in front of its own statement, in the same
// batch; done must then be called once, with the batch's error. Nothing queued: items is empty, done does nothing.
// A deferred claim of the context that failed: an error, and the caller sends nothing.
func (s *PostgresStore) carry(ctx context.Context) (items []*behindWrite, done func(error), err error) {
	nothing := func(error) {}
	q := s.behindOf(ctx)
	if q == nil {
		return nil, nothing, nil
	}
	if items, err = q.takeUnbroken(); err != nil {
		return nil, nothing, err
	}
	if len(items) == 0 {
		q.mu.Unlock()
		return nil, nothing, nil
	}
	return items, func(err error) { q.land(items, err) }, nil
}

// Later is the outcome of a deferred write, known once it is sent.
type Later struct {
	q    *behind
	err  error // guarded by q.mu
	done bool  // guarded by q.mu
}

// Land sends the write if it is still queued (and what is queued before it), and returns its outcome: nil once
// written; an error wrapping ErrExists for a claim that found a record there; the database's error otherwise.
func (l *Later) Land() error {
	l.q.mu.Lock()
	done := l.done
	l.q.mu.Unlock()
	if !done {
		l.q.flush()
	}
	l.q.mu.Lock()
	defer l.q.mu.Unlock()
	if !l.done {
		return errBehindNotSent
	}
	return l.err
}

// ClaimBehind is s.Claim of r, deferred when ctx carries a queue bound to s: the record is queued as it will be
// written (a plain insert), and claimed is true, and later tells, once it is sent, whether it was written: an
// error wrapping ErrExists when another request recorded the payment first. It is sent in the batch of the
// next statement s sends for ctx. Any other store or context: s.Claim, and later is nil.
func ClaimBehind(ctx context.Context, s Store, r Record) (rec Record, claimed bool, later *Later, err error) {
	ps, ok := s.(*PostgresStore)
	var q *behind
	if ok {
		q = ps.behindOf(ctx)
	}
	if q == nil {
		rec, claimed, err = s.Claim(ctx, r)
		return rec, claimed, nil, err
	}
	if err := ctx.Err(); err != nil {
		return Record{}, false, nil, err
	}
	t := &behindClaimTxn{}
	rec, claimed, err = claimIn(t, r, ps.opts.now())
	if err != nil {
		return Record{}, false, nil, err
	}
	l := &Later{q: q}
	t.w.fence = true
	t.w.landed = func(_ pgconn.CommandTag, err error) func() {
		if hasCode(err, "23505") {
			err = fmt.Errorf("%w: %s", ErrExists, rec.ID)
		} else if err != nil {
			err = ps.fail(ctx, "claim", err)
		}
		l.err, l.done = err, true
		return nil
	}
	q.add(t.w)
	return rec, claimed, l, nil
}

// behindClaimTxn is the txn of ClaimBehind: it reads nothing, and makes the insert a deferred write.
type behindClaimTxn struct{ w *behindWrite }

func (t *behindClaimTxn) get(ID) (Record, bool, error) { return Record{}, false, nil }

func (t *behindClaimTxn) put(_, next *Record) error {
	row, err := rowOf(next)
	if err != nil {
		return err
	}
	// No ON CONFLICT: a record there fails the batch, and what rides after it (the engine's claim) with it.
	t.w = &behindWrite{sql: `INSERT INTO x402_records (id, state, async, pending, claimed_ns, kept_until_ns, served_ns, data)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`, args: []any{next.ID[:], string(next.State), next.Async, row.pending, row.claimedNS,
		row.keptNS, row.servedNS, row.data}}
	return nil
}

func (t *behindClaimTxn) del(*Record) error { return errors.New("journal: a claim deletes nothing") }

// UpdateKnownHoldMinedBehind is UpdateKnownHoldMined, deferred when ctx carries a queue bound to c: the hold's end
// and fn's change of prev are queued as one statement (the record written only where it is still prev), and rec
// is fn's change of prev, as UpdateKnownHoldMined would return it written. When the statement is sent, a record
// that changed since goes through Update with fn (so fn may run again then, on the goroutine that sends the
// queue: it must not write what its caller reads), and landed, when given, learns the outcome. deferred false:
// nothing was queued (no queue of c, or fn refuses prev), and the caller writes as it would without.
func UpdateKnownHoldMinedBehind(ctx context.Context, c Cluster, prev Record, block uint64, fn func(*Record) error, landed func(error)) (rec Record, deferred bool) {
	ps, ok := c.(*PostgresStore)
	if !ok || prev.Served || prev.ID.IsZero() {
		return Record{}, false
	}
	q := ps.behindOf(ctx)
	if q == nil {
		return Record{}, false
	}
	was, err := encodeRecord(&prev)
	if err != nil {
		return Record{}, false
	}
	next, err := updateIn(&pgKnownTxn{prev: prev}, prev.ID, fn, ps.opts.now())
	if err != nil {
		return Record{}, false
	}
	row, err := rowOf(&next)
	if err != nil {
		return Record{}, false
	}
	tell := func(err error) {
		if landed != nil {
			landed(err)
		}
	}
	q.add(&behindWrite{
		// updateKnownHoldMined's statement, with the record's update at the top, so that its command tag says
		// whether the record was written.
		sql: `WITH mined AS (
	UPDATE x402_holds SET mined = $9::numeric, mined_at = now() WHERE id = $1 AND mined = 0
)
UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5, served_ns = $6, data = $7
WHERE id = $1 AND data = $8 AND served_ns IS NULL`,
		args: []any{next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was,
			strconv.FormatUint(block, 10)},
		landed: func(tag pgconn.CommandTag, err error) func() {
			switch {
			case err != nil:
				err = ps.fail(q.base, "hold mined", err)
				return func() { tell(err) }
			case tag.RowsAffected() == 1:
				return func() { tell(nil) }
			}
			// Changed since (by reconciliation, another instance): the hold's end is written, and the record is
			// read and judged as it stands.
			return func() {
				_, err := ps.Update(q.base, prev.ID, fn)
				tell(err)
			}
		},
	})
	return next, true
}
