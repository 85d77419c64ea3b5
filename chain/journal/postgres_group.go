package journal

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Writes of concurrent requests that hold no lock across a round trip and need no answer before their last
// statement (each is one batch, an implicit transaction: a gate's final write with the engine's final answer
// carried in front of it) go to the database together: one transaction, one round trip and one commit, with its
// one WAL flush, for all of them, as bbolt's batch does for its writes. On a database that every statement and
// every commit costs as much as the work they carry (a context switch on each side, a flush a commit), the
// journal's cost a payment is mostly that, not the rows.
//
// Nothing waits to gather a group: a write goes at once unless pgGroupSenders groups are in flight, and what
// queued behind them goes in one group when one comes back. A group's writes are atomic together, as each one's
// batch was alone:
//   - it commits: each write is written, and its caller reads its own results, as alone;
//   - a statement of it fails in the database (a write refused, a deadlock), or the commit does: the transaction
//     is rolled back whole, nothing of any write is written, and each goes again alone, as it would have without
//     the group (errGroupAborted);
//   - the connection breaks, or the commit's answer is lost: what happened is unknown to each, as to a batch
//     alone, and each caller gets that error.

// pgGroupSenders is how many groups may be in flight at once; pgGroupMax, the most writes a group takes.
const (
	pgGroupSenders = 2
	pgGroupMax     = 64
)

// pgGroup is the store's queue of grouped writes.
type pgGroup struct {
	mu      sync.Mutex
	pending []*pgGroupItem
	slots   chan struct{} // one a group in flight
	off     bool          // each write alone (tests measuring what the group saves)
	timeout time.Duration // a group's write context; pgWriteTimeout when 0 (tests cut a group off sooner)
	aborted atomic.Int64  // groups rolled back (their writes went again alone)
}

// pgGroupItem is one write of a group: queue adds its statements to the batch; read reads their results, in order,
// as the batch's alone would (it may read fewer than it queued: the rest are skipped).
type pgGroupItem struct {
	queue func(*pgx.Batch)
	read  func(pgx.BatchResults) error
	err   error // its outcome, once done is closed
	taken bool  // in a group under way (under pgGroup.mu)
	done  chan struct{}
}

// errGroupAborted is a group's outcome when its transaction was rolled back: nothing of it was written.
var errGroupAborted = errors.New("journal: the grouped writes were rolled back together")

// grouped runs a write of queue's statements and read's reading of their results in a group with the writes of
// other requests (see above); alone, when it is the only one: its batch, an implicit transaction, as before.
func (s *PostgresStore) grouped(ctx context.Context, queue func(*pgx.Batch), read func(pgx.BatchResults) error) error {
	g := &s.group
	if g.off {
		return retrySafe(func() error { return s.alone(ctx, queue, read) })
	}
	it := &pgGroupItem{queue: queue, read: read, done: make(chan struct{})}
	g.mu.Lock()
	g.pending = append(g.pending, it)
	g.mu.Unlock()
	for {
		select {
		case <-it.done:
		case g.slots <- struct{}{}:
			g.mu.Lock()
			n := min(len(g.pending), pgGroupMax)
			items := g.pending[:n:n]
			g.pending = append([]*pgGroupItem(nil), g.pending[n:]...)
			for _, x := range items {
				x.taken = true
			}
			g.mu.Unlock()
			if len(items) > 0 {
				s.sendGroupReleasing(items)
			} else {
				<-g.slots
			}
			g.mu.Lock()
			taken := it.taken
			g.mu.Unlock()
			if !taken {
				continue // more were queued than one group takes: this one goes with the next
			}
			<-it.done
		}
		if errors.Is(it.err, errGroupAborted) {
			return retrySafe(func() error { return s.alone(ctx, queue, read) })
		}
		return it.err
	}
}

// alone sends one write's batch by itself and reads it: an implicit transaction, committed at its end.
func (s *PostgresStore) alone(ctx context.Context, queue func(*pgx.Batch), read func(pgx.BatchResults) error) error {
	b := &pgx.Batch{}
	queue(b)
	br := s.pool.SendBatch(ctx, b)
	err := read(br)
	return errors.Join(err, closeErr(br.Close(), err))
}

// sendGroupReleasing sends items under a write context of the group's own (pgWriteTimeout: not the sending caller's,
// which may be near its end), then gives the sender's slot back, whatever happens.
func (s *PostgresStore) sendGroupReleasing(items []*pgGroupItem) {
	defer func() { <-s.group.slots }()
	timeout := s.group.timeout
	if timeout <= 0 {
		timeout = pgWriteTimeout
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	s.sendGroup(ctx, items)
}

// sendGroup sends items, each waiting in grouped, and ends each with its outcome. One item goes alone. A panic
// (another request's callback) ends each item with an error, not with nothing.
func (s *PostgresStore) sendGroup(ctx context.Context, items []*pgGroupItem) {
	defer func() {
		if p := recover(); p != nil {
			for _, it := range items {
				it.err = fmt.Errorf("journal: grouped write: %v", p)
			}
		}
		for _, it := range items {
			close(it.done)
		}
	}()
	if len(items) == 1 {
		it := items[0]
		it.err = retrySafe(func() error { return s.alone(ctx, it.queue, it.read) })
		return
	}
	err := retrySafe(func() error { return s.sendTogether(ctx, items) })
	if errors.Is(err, errGroupAborted) {
		s.group.aborted.Add(1)
	}
	if err != nil {
		for _, it := range items {
			it.err = err
		}
	}
}

// sendTogether is one try of a group: BEGIN, each item's statements, COMMIT, in one batch. It returns
// errGroupAborted when the transaction was rolled back, the error that left the outcome unknown, or nil: the
// group committed, and each item's err is its read's.
func (s *PostgresStore) sendTogether(ctx context.Context, items []*pgGroupItem) error {
	// In the order of the row each write names first (its first statement's first argument, an id), so that two
	// groups (of two gateways given the same payments at once: their in-flight marks) lock the rows they share in
	// one order, and one waits for the other's commit rather than both for each other until the deadlock timeout.
	queued := make([][]*pgx.QueuedQuery, len(items))
	for i, it := range items {
		one := &pgx.Batch{}
		it.queue(one)
		queued[i] = one.QueuedQueries
	}
	order := make([]int, len(items))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return bytes.Compare(firstID(queued[order[a]]), firstID(queued[order[b]])) < 0 })
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	for _, i := range order {
		b.QueuedQueries = append(b.QueuedQueries, queued[i]...)
	}
	b.Queue("COMMIT")
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	err = readTogether(c.SendBatch(ctx, b), items, order, queued)
	if errors.Is(err, errGroupAborted) && c.Conn().PgConn().TxStatus() != 'I' {
		// A statement failed: the database skipped the rest of the batch, COMMIT too, and the connection waits
		// inside the failed transaction. Ended here, the connection goes back to the pool, not closed by it.
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _ = c.Exec(rctx, "ROLLBACK")
		cancel()
	}
	return err
}

// readTogether reads a group's batch (see sendTogether): BEGIN's answer, each item's results in order, then
// COMMIT's.
func readTogether(br pgx.BatchResults, items []*pgGroupItem, order []int, queued [][]*pgx.QueuedQuery) error {
	if _, err := br.Exec(); err != nil {
		br.Close()
		if isPgError(err) {
			return errGroupAborted
		}
		return err
	}
	aborted := false
	for _, i := range order {
		it := items[i]
		cr := &countedResults{BatchResults: br}
		it.err = it.read(cr)
		aborted = aborted || isPgError(it.err)
		for ; cr.read < len(queued[i]); cr.read++ {
			if _, err := br.Exec(); isPgError(err) {
				aborted = true
			}
		}
	}
	tag, err := br.Exec()
	cerr := br.Close()
	switch {
	case aborted:
		// A statement's error came before the commit's answer: the database ran no COMMIT after it (the
		// transaction failed, or the connection ended with it), and nothing of the group is written.
		return errGroupAborted
	case err == nil && tag.String() == "COMMIT":
		return nil // the commit's answer came: written (a close error after it changes nothing)
	case err == nil || commitRefused(err):
		// Rolled back: COMMIT answered ROLLBACK, or refused the transaction. Nothing written.
		return errGroupAborted
	}
	return errors.Join(err, cerr)
}

// commitRefused reports whether err, COMMIT's, is the database refusing the transaction (a serialization failure,
// a deadlock), which rolls it back. Any other answer (the server shutting down, out of resources, the
// connection ended) leaves the outcome unknown.
func commitRefused(err error) bool {
	// As retryTx's: a serialization failure or a deadlock. Any other class 40 answer may not be a rollback
	// (CockroachDB's 40003, statement_completion_unknown: the commit may have been applied).
	return hasCode(err, "40001", "40P01")
}

// firstID is the first argument of the first of qs when it is bytes (a row's id); nil else.
func firstID(qs []*pgx.QueuedQuery) []byte {
	if len(qs) == 0 || len(qs[0].Arguments) == 0 {
		return nil
	}
	id, _ := qs[0].Arguments[0].([]byte)
	return id
}

// isPgError reports whether err is the database's answer to a statement (which leaves the connection sound).
func isPgError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe)
}

// countedResults counts the results read through it.
type countedResults struct {
	pgx.BatchResults
	read int
}

func (c *countedResults) Exec() (pgconn.CommandTag, error) {
	c.read++
	return c.BatchResults.Exec()
}

func (c *countedResults) Query() (pgx.Rows, error) {
	c.read++
	return c.BatchResults.Query()
}

func (c *countedResults) QueryRow() pgx.Row {
	c.read++
	return c.BatchResults.QueryRow()
}

// groupedBatch is grouped for a batch whose results its queued queries' callbacks read (QueuedQuery.Exec,
// QueryRow), in order, as the batch's Close reads them alone; the first callback that fails ends the reading.
func (s *PostgresStore) groupedBatch(ctx context.Context, queue func(*pgx.Batch)) error {
	var qs []*pgx.QueuedQuery
	return s.grouped(ctx, func(b *pgx.Batch) {
		from := len(b.QueuedQueries)
		queue(b)
		qs = b.QueuedQueries[from:]
	}, func(br pgx.BatchResults) error {
		for _, qq := range qs {
			var err error
			if qq.Fn != nil {
				err = qq.Fn(br)
			} else {
				_, err = br.Exec()
			}
			if err != nil {
				return err
			}
		}
		return nil
	})
}
