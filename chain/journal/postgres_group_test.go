package journal

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// commitCounter is a pgx tracer that counts the COMMITs the store sends, alone or in a batch, and keeps the
// connection the last group (a batch that begins with BEGIN) went on.
type commitCounter struct {
	commits, batches atomic.Int64
	group            atomic.Pointer[pgx.Conn]
}

func (c *commitCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (c *commitCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *commitCounter) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	c.batches.Add(1)
	if d.Batch != nil && len(d.Batch.QueuedQueries) > 0 && d.Batch.QueuedQueries[0].SQL == "BEGIN" {
		c.group.Store(conn)
	}
	return ctx
}
func (c *commitCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if d.SQL == "COMMIT" && d.Err == nil {
		c.commits.Add(1)
	}
}
func (c *commitCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

// groupWrite is a write for grouped: sql's statements queued, each result read with Exec; fail, when set, is what
// reading the first returns instead of its error (a write whose caller refuses what it read).
type groupWrite struct {
	sqls []string
	args []any // the first statement's
	fail error
}

func (w groupWrite) queue(b *pgx.Batch) {
	for i, q := range w.sqls {
		if i == 0 {
			b.Queue(q, w.args...)
			continue
		}
		b.Queue(q)
	}
}

func (w groupWrite) read(br pgx.BatchResults) error {
	for i := range w.sqls {
		if _, err := br.Exec(); err != nil {
			return err
		}
		if i == 0 && w.fail != nil {
			return w.fail
		}
	}
	return nil
}

// inOneGroup runs writes through s.grouped so that they go in one group: every sender's slot is taken while they
// queue, then one is freed. It returns each write's error.
func inOneGroup(t *testing.T, s *PostgresStore, timeout time.Duration, writes []groupWrite) []error {
	t.Helper()
	for range pgGroupSenders {
		s.group.slots <- struct{}{}
	}
	errs := make([]error, len(writes))
	var wg sync.WaitGroup
	for i, w := range writes {
		wg.Go(func() {
			wctx, cancel := context.WithTimeout(context.Background(), timeout)
			defer cancel()
			errs[i] = s.grouped(wctx, w.queue, w.read)
		})
	}
	waitPending(t, s, len(writes))
	<-s.group.slots
	wg.Wait()
	for range pgGroupSenders - 1 {
		<-s.group.slots
	}
	return errs
}

// bothOnce reports whether got holds the two inserts of the refused and terminated cases once each: the
// first (nextval * 10) and the third (nextval * 10 + 1), whatever the sequence gave them (the group may have run
// the first before it was rolled back, or not, and the two go alone at once, in either order).
func bothOnce(got []int64) bool {
	if len(got) != 2 {
		return false
	}
	var first, third int
	for _, v := range got {
		switch {
		case v%10 == 0:
			first++
		case v%10 == 1:
			third++
		}
	}
	return first == 1 && third == 1
}

// waitPending waits until n writes are queued in s's group.
func waitPending(t *testing.T, s *PostgresStore, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		s.group.mu.Lock()
		got := len(s.group.pending)
		s.group.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d writes queued, want %d", got, n)
		}
	}
}

// rows reads the values of table, in order (group_t when table is empty).
func rows(t *testing.T, s *PostgresStore, table ...string) []int64 {
	t.Helper()
	name := "group_t"
	if len(table) > 0 {
		name = table[0]
	}
	r, err := s.pool.Query(context.Background(), `SELECT v FROM `+name+` ORDER BY v`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(r, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// TestPostgresGroupedWritesCommitTogetherAndGoAloneWhenOneFails: writes of concurrent requests queued behind the
// groups in flight go in one transaction, one commit; a statement of one that the database refuses rolls the group
// back whole, and each write goes again alone, so the others are written once and the refused one gets the
// database's error; a write whose caller refuses what it read is written and gets its own error, as alone; and a
// connection that breaks under a group leaves each write's outcome unknown to it: an error to each, none sent again.
func TestPostgresGroupedWritesCommitTogetherAndGoAloneWhenOneFails(t *testing.T) {
	ctx := context.Background()
	tr := &commitCounter{}
	s, err := OpenPostgres(ctx, pgtest.Shared(t), Options{Tracer: tr})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.pool.Exec(ctx, `CREATE TABLE group_t (v bigint PRIMARY KEY); CREATE SEQUENCE group_seq`); err != nil {
		t.Fatal(err)
	}
	reset := func() {
		t.Helper()
		if _, err := s.pool.Exec(ctx, `TRUNCATE group_t; ALTER SEQUENCE group_seq RESTART`); err != nil {
			t.Fatal(err)
		}
	}
	insert := func(v string) groupWrite { return groupWrite{sqls: []string{`INSERT INTO group_t VALUES (` + v + `)`}} }

	t.Run("committed together", func(t *testing.T) {
		reset()
		c0, b0 := tr.commits.Load(), tr.batches.Load()
		errs := inOneGroup(t, s, 20*time.Second, []groupWrite{insert("1"), insert("2"), {sqls: []string{`INSERT INTO group_t VALUES (3)`, `INSERT INTO group_t VALUES (4)`}}})
		for i, err := range errs {
			if err != nil {
				t.Errorf("write %d: %v", i, err)
			}
		}
		if got := rows(t, s); len(got) != 4 {
			t.Errorf("rows %v, want 1 2 3 4", got)
		}
		if c, b := tr.commits.Load()-c0, tr.batches.Load()-b0; c != 1 || b != 1 {
			t.Errorf("%d commits in %d batches for three writes, want one in one", c, b)
		}
	})

	t.Run("refused statement", func(t *testing.T) {
		reset()
		aborted := s.group.aborted.Load()
		errs := inOneGroup(t, s, 20*time.Second, []groupWrite{insert("nextval('group_seq') * 10"), {sqls: []string{`SELECT 1/0`}}, insert("nextval('group_seq') * 10 + 1")})
		if n := s.group.aborted.Load() - aborted; n != 1 {
			t.Errorf("%d groups rolled back; want the one the refused statement was in", n)
		}
		var pe *pgconn.PgError
		if !errors.As(errs[1], &pe) || pe.Code != "22012" {
			t.Errorf("the refused write's error = %v, want division_by_zero", errs[1])
		}
		if errors.Is(errs[1], errGroupAborted) {
			t.Errorf("the refused write got the group's error %v, not its own", errs[1])
		}
		if errs[0] != nil || errs[2] != nil {
			t.Errorf("the other writes: %v, %v; want both written", errs[0], errs[2])
		}
		// The group was rolled back, and both went alone: each is there once.
		got := rows(t, s)
		if !bothOnce(got) {
			t.Errorf("rows %v: want the two writes once each, each written alone after the group's rollback", got)
		}
		// The group's connection was given back out of the failed transaction, open: not closed by the pool. It is
		// looked for among the pool's idle connections, taken (the store's heartbeat may be using it a moment).
		group, found := tr.group.Load(), false
		for deadline := time.Now().Add(3 * time.Second); !found && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			for _, c := range s.pool.AcquireAllIdle(ctx) {
				if c.Conn() == group {
					found = true
					if st := c.Conn().PgConn().TxStatus(); st != 'I' {
						t.Errorf("the rolled-back group's connection is in transaction status %q; want idle", st)
					}
				}
				c.Release()
			}
		}
		if !found {
			t.Error("the rolled-back group's connection is not in the pool: closed, not given back")
		}
	})

	t.Run("refused by its caller", func(t *testing.T) {
		reset()
		mine := errors.New("not the record known")
		errs := inOneGroup(t, s, 20*time.Second, []groupWrite{insert("1"), {sqls: []string{`INSERT INTO group_t VALUES (2)`, `INSERT INTO group_t VALUES (3)`}, fail: mine}, insert("4")})
		if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], mine) {
			t.Errorf("errors %v; want nil, its own, nil", errs)
		}
		if got := rows(t, s); len(got) != 4 {
			t.Errorf("rows %v: want every statement written, as a batch alone is (its reading skipped, not rolled back)", got)
		}
	})

	t.Run("backend terminated", func(t *testing.T) {
		reset()
		killer := make(chan error, 1)
		go func() {
			for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
				var p int32
				// The group's connection, asleep in its second write.
				err := s.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(1)' AND pid <> pg_backend_pid()`).Scan(&p)
				if err == nil {
					_, err = s.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, p)
					killer <- err
					return
				}
			}
			killer <- errors.New("the group's connection was never seen asleep")
		}()
		errs := inOneGroup(t, s, 20*time.Second, []groupWrite{insert("nextval('group_seq') * 10"), {sqls: []string{`SELECT pg_sleep(1)`}}, insert("nextval('group_seq') * 10 + 1")})
		if err := <-killer; err != nil {
			t.Fatal(err)
		}
		// The server's FATAL came before any COMMIT: nothing of the group was written, and each went again alone.
		for i, err := range errs {
			if err != nil {
				t.Errorf("write %d: %v; want it written alone after the group's connection was terminated", i, err)
			}
		}
		if got := rows(t, s); !bothOnce(got) {
			t.Errorf("rows %v: want the two inserts once each, each written alone after the group", got)
		}
	})

	t.Run("cut off", func(t *testing.T) {
		reset()
		// The group's context ends while it runs: pgx closes the connection, and what the database did is unknown to
		// each write (here: nothing, the transaction never committed). None may be sent again on its own.
		s.group.timeout = 500 * time.Millisecond
		defer func() { s.group.timeout = 0 }()
		errs := inOneGroup(t, s, 20*time.Second, []groupWrite{insert("1"), {sqls: []string{`SELECT pg_sleep(3)`}}, insert("3")})
		for i, err := range errs {
			if err == nil || isPgError(err) || errors.Is(err, errGroupAborted) {
				t.Errorf("write %d: %v; want the cut-off connection's error", i, err)
			}
		}
		if got := rows(t, s); len(got) != 0 {
			t.Errorf("rows %v: want none (the group never committed, and none went again alone)", got)
		}
	})
}

// TestPostgresGroupsOfTwoStoresLockTheRowsTheyShareInOneOrder: two gateways given the same payments at once queue
// their in-flight marks in different orders; each store sends its group in the order of the rows' ids, so the two
// groups lock the rows they share in one order: one waits for the other's commit, and neither is rolled back as a
// deadlock (which would cost the deadlock timeout, a second, and every write of the group sent again).
func TestPostgresGroupsOfTwoStoresLockTheRowsTheyShareInOneOrder(t *testing.T) {
	ctx := context.Background()
	dsn := pgtest.Shared(t)
	var stores []*PostgresStore
	for range 2 {
		s, err := OpenPostgres(ctx, dsn, Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		stores = append(stores, s)
	}
	if _, err := stores[0].pool.Exec(ctx, `CREATE TABLE group_k (id bytea PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	// Each write takes its row and then holds its group a moment, so that the two groups run side by side.
	mark := func(id string) groupWrite {
		return groupWrite{sqls: []string{`INSERT INTO group_k VALUES ($1) ON CONFLICT (id) DO NOTHING`, `SELECT pg_sleep(0.3)`}, args: []any{[]byte(id)}}
	}
	var wg sync.WaitGroup
	errs := make([][]error, 2)
	for i, writes := range [][]groupWrite{{mark("a"), mark("b")}, {mark("b"), mark("a")}} {
		wg.Go(func() { errs[i] = inOneGroup(t, stores[i], 20*time.Second, writes) })
	}
	wg.Wait()
	for i, es := range errs {
		for j, err := range es {
			if err != nil {
				t.Errorf("store %d, write %d: %v", i, j, err)
			}
		}
		if n := stores[i].group.aborted.Load(); n != 0 {
			t.Errorf("store %d: %d groups rolled back; want none (a deadlock between the two groups)", i, n)
		}
	}
}
