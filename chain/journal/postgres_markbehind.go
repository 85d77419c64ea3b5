package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A gate's in-flight mark of a payment and its read of the payment's record, deferred into the embedded engine's
// verification. Both need only be done before the gate decides what to do with the payment, which it does once the
// engine answered: so they ride in the engine's first batch of the verification (its read of the payer's holds,
// or its hold with take), in front of the engine's statements, or go alone when the engine sent nothing.
//
// The engine's hold with take must not be taken for a payment the gate then finds is not its request's: another
// request holds the mark (the winner's hold is the same row, and must be neither counted twice nor let go by the
// loser), or the gate holds a record of it (presented again: the first presentation's hold is the one that
// counts). So the verification's context carries a guard (MarkAndGetBehind's), and a hold with take under it is
// decided, in its deciding statement, only where the mark is this instance's and the gate holds no record of the
// payment; otherwise nothing is held (ErrNotMarked). The mark and the read go in the same transaction, before it,
// so the guard sees them; a guard whose mark and read failed refuses every hold. The guard is the verification's
// alone: the gate's later writes go under a context without it (the settlement's hold comes after the gate's
// record, which the guard would refuse).

// ErrNotMarked: a hold with take under a gate's guard (MarkAndGetBehind) was not taken, because the payment is not
// the gate's request's to hold: another request marked it, the gate holds a record of it, or the mark could not be
// written.
var ErrNotMarked = errors.New("journal: the payment is not this request's to hold: another request has it in flight, it was presented before, or its in-flight mark failed")

// guardKey is the context key of a verification's guard.
type guardKey struct{}

// Marked is the outcome of a deferred in-flight mark and read of a payment's record (MarkAndGetBehind), known once
// they are sent.
type Marked struct {
	q  *behind
	id ID

	mu     sync.Mutex
	done   bool
	marked bool
	found  bool
	data   []byte
	served *int64
	err    error
	// then is what WhenMarked runs once the mark lands as the request's.
	then []func()
}

// MarkAndGetBehind is MarkAndGet of id deferred, when ctx carries a queue bound to s (Defer): the mark and the
// read are queued, to ride in front of the next statement s sends for ctx, and m.Land tells their outcome. vctx is
// ctx carrying the guard of holds taken under it (see above): the context to verify the payment under. Any other
// store or context: ctx and nil, and the caller marks with MarkAndGet.
func MarkAndGetBehind(ctx context.Context, s Store, id ID) (vctx context.Context, m *Marked) {
	ps, ok := s.(*PostgresStore)
	if !ok {
		return ctx, nil
	}
	q := ps.behindOf(ctx)
	if q == nil {
		return ctx, nil
	}
	m = &Marked{q: q, id: id}
	var markErr error
	q.add(&behindWrite{sql: pgBusy, args: []any{id[:], ps.instance}, lossless: true, landed: func(tag pgconn.CommandTag, err error) func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		markErr, m.marked = err, err == nil && tag.RowsAffected() == 1
		return nil
	}})
	var data []byte
	var served *int64
	q.add(&behindWrite{sql: pgGetRecord, args: []any{id[:]}, lossless: true,
		read: func(row pgx.Row) error {
			// Decoded once landed: a record that does not decode fails this read, not the engine's batch.
			data, served = nil, nil
			if err := row.Scan(&data, &served); err != nil && !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
			return nil
		},
		landed: func(_ pgconn.CommandTag, err error) func() {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.err = errors.Join(markErr, err)
			if m.err != nil {
				m.err = ps.fail(q.base, "busy", m.err)
			}
			m.found, m.data, m.served, m.done = data != nil, data, served, true
			then := m.then
			m.then = nil
			if m.refusesLocked() || len(then) == 0 {
				return nil
			}
			return func() {
				for _, fn := range then {
					fn()
				}
			}
		}})
	return context.WithValue(ctx, guardKey{}, m), m
}

// Land sends the mark and the read if they are still queued (and what is queued before them), and returns their
// outcome as MarkAndGet's: marked false, another live instance's mark; found, the record read after the mark. An
// error may leave the mark this instance's (its write's outcome is not known): the caller clears it with Idle.
func (m *Marked) Land() (marked bool, rec Record, found bool, err error) {
	if !m.landed() {
		m.q.flush()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case !m.done:
		return false, Record{}, false, m.q.s.fail(m.q.base, "busy", errBehindNotSent)
	case m.err != nil:
		return true, Record{}, false, m.err
	case !m.marked || !m.found:
		return m.marked, Record{}, false, nil
	}
	if rec, err = decodeRow(m.id[:], m.data, m.served); err != nil {
		return true, Record{}, false, err
	}
	return true, rec, true, nil
}

func (m *Marked) landed() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.done
}

// refuses reports whether m, landed, refuses a hold of its verification: the mark is not this instance's, the
// record is there, or they failed. Not landed yet: the hold's statement decides (guardArgs).
func (m *Marked) refuses() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.refusesLocked()
}

func (m *Marked) refusesLocked() bool { return m.done && (m.err != nil || !m.marked || m.found) }

// WhenMarked runs fn once ctx's guard (MarkAndGetBehind) landed with the payment the gate request's own (marked
// here, not recorded): at once when ctx carries no guard, or it landed so; never when it refuses. For what a
// verification reports of the payment it judged (a refusal on the operator's page): a payment presented again, or
// in use by another request, is answered by the gate from its mark and record, whatever the verification said.
func WhenMarked(ctx context.Context, fn func()) {
	m, _ := ctx.Value(guardKey{}).(*Marked)
	if m == nil {
		fn()
		return
	}
	m.mu.Lock()
	if !m.done {
		m.then = append(m.then, fn)
		m.mu.Unlock()
		return
	}
	refuses := m.refusesLocked()
	m.mu.Unlock()
	if !refuses {
		fn()
	}
}

// guardOf is the guard ctx carries for s, nil when none.
func (s *PostgresStore) guardOf(ctx context.Context) *Marked {
	m, _ := ctx.Value(guardKey{}).(*Marked)
	if m == nil || m.q.s != s {
		return nil
	}
	return m
}

// guardArgs are the arguments $12 and $13 of pgHoldSQL: the guarded payment's id and this instance, or NULLs for
// a hold under no guard.
func (s *PostgresStore) guardArgs(m *Marked) []any {
	if m == nil {
		return []any{nil, nil}
	}
	return []any{m.id[:], s.instance}
}

// queueCarried queues items, carried in front of the caller's statements (carry), into b with callbacks, for a
// batch read through its callbacks (Close) rather than in order.
func queueCarried(b *pgx.Batch, items []*behindWrite) {
	for _, w := range items {
		w.tag, w.err, w.sent = pgconn.CommandTag{}, nil, false
		qq := b.Queue(w.sql, w.args...)
		if w.read != nil {
			qq.QueryRow(w.read)
			continue
		}
		qq.Exec(func(tag pgconn.CommandTag) error {
			w.tag = tag
			return nil
		})
	}
}

// errGuarded is the error of a hold refused by its guard, naming the payment.
func errGuarded(m *Marked) error { return fmt.Errorf("%w (%s)", ErrNotMarked, m.id) }

// holdCarrying is holdInOne under ctx: with what ctx's queue holds in its transaction, and under ctx's guard. A
// guard that refuses the hold (landed, or in the deciding statement) gives ErrNotMarked; recorded is then false.
func (s *PostgresStore) holdCarrying(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, unrecordedOnly bool) (recorded, ok bool, left *big.Int, err error) {
	if err := s.unstartable(ctx); err != nil {
		return false, false, nil, err
	}
	guard := s.guardOf(ctx)
	items, done, err := s.carry(ctx)
	if err != nil {
		return false, false, nil, err
	}
	wctx, cancel, err := s.start(ctx, true)
	if err != nil {
		done(err)
		return false, false, nil, err
	}
	defer cancel()
	if guard != nil && guard.refuses() {
		// What was queued goes all the same, alone.
		done(s.sendItems(wctx, items))
		return false, false, nil, errGuarded(guard)
	}
	recorded, ok, left, err = s.holdInOne(wctx, h, avail, readBlock, chainTime, unrecordedOnly, guard, items)
	done(err)
	if err == nil && recorded && guard != nil && (!unrecordedOnly || guard.refuses()) {
		return false, false, nil, errGuarded(guard)
	}
	return recorded, ok, left, err
}

// readCarrying sends the reads queue queues in one batch, behind what ctx's queue holds (a gate's deferred mark):
// a read alone is retried once when its connection broke, a batch that carries writes only when it surely did not
// reach the database.
func (s *PostgresStore) readCarrying(ctx context.Context, queue func(*pgx.Batch)) error {
	if err := s.unstartable(ctx); err != nil {
		return err
	}
	items, done, err := s.carry(ctx)
	if err != nil {
		return err
	}
	rctx, cancel, err := s.start(ctx, len(items) > 0)
	if err != nil {
		done(err)
		return err
	}
	defer cancel()
	if len(items) == 0 {
		return s.read(rctx, func() error {
			b := &pgx.Batch{}
			queue(b)
			return s.pool.SendBatch(rctx, b).Close()
		})
	}
	// A write: in a group with other requests' (postgres_group.go).
	err = s.groupedBatch(rctx, func(b *pgx.Batch) {
		queueCarried(b, items)
		queue(b)
	})
	if err == nil {
		markSent(items)
	}
	done(err)
	return err
}

// NotMarked reports whether ctx carries a gate's guard (MarkAndGetBehind) whose mark and read were sent and say
// the payment is not the gate's request's: another request has it in flight, the gate holds a record of it, or
// they failed. The gate answers such a payment from the mark and the record, whatever its verification answers: a
// verification that learns it can stop there, and ask the chain nothing.
func NotMarked(ctx context.Context) bool {
	m, _ := ctx.Value(guardKey{}).(*Marked)
	return m != nil && m.refuses()
}

// unstartable is the error of a call under ctx that cannot start (ctx ended, the store closed), once what ctx's
// queue holds was sent, as begin sends it for every call: a call that would have carried it does not drop it.
func (s *PostgresStore) unstartable(ctx context.Context) error {
	if ctx.Err() == nil && !s.closed.Load() {
		return nil
	}
	_, cancel, err := s.begin(ctx, false)
	if err == nil {
		cancel() // it could start after all: the call goes on
	}
	return err
}
