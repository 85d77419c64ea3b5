package journal

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// What a group must not do that its writes alone did not (found by review of the grouping; each failed before its
// fix): send again writes whose commit may have been applied, fail a write under another caller's ended context,
// deadlock two groups of one store on the rows they share.

func openReviewStore(t *testing.T) *PostgresStore {
	t.Helper()
	ctx := context.Background()
	s, err := OpenPostgres(ctx, pgtest.Shared(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestPostgresGroupReviewACommitWhoseCompletionIsUnknownIsNotSentAgain: SQLSTATE 40003 (statement_completion_unknown) is what
// CockroachDB answers a COMMIT whose outcome it does not know ("result is ambiguous": it may have committed). The
// store says it runs on CockroachDB, and txOnce treats every COMMIT error but 40001/40P01 as unknown
// (commitError): a group's writes after such an answer get an error each, and none is sent again alone.
func TestPostgresGroupReviewACommitWhoseCompletionIsUnknownIsNotSentAgain(t *testing.T) {
	if commitRefused(&pgconn.PgError{Code: "40003"}) {
		t.Errorf("commitRefused(40003 statement_completion_unknown) = true: a COMMIT that may have committed is taken for a rollback")
	}

	// The same end to end: a deferred constraint trigger makes the group's COMMIT answer 40003 once (on
	// PostgreSQL that really rolls back; on CockroachDB the same answer may follow a commit that was applied).
	ctx := context.Background()
	s := openReviewStore(t)
	if _, err := s.pool.Exec(ctx, `
CREATE TABLE review_amb (v bigint PRIMARY KEY);
CREATE SEQUENCE review_amb_once;
CREATE FUNCTION review_amb_f() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF nextval('review_amb_once') = 1 THEN
		RAISE EXCEPTION 'result is ambiguous' USING ERRCODE = '40003';
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER review_amb_t AFTER INSERT ON review_amb DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION review_amb_f();`); err != nil {
		t.Fatal(err)
	}
	ins := func(v string) groupWrite {
		return groupWrite{sqls: []string{`INSERT INTO review_amb VALUES (` + v + `)`}}
	}
	errs := inOneGroup(t, s, 20*time.Second, []groupWrite{ins("1"), ins("2")})
	for i, err := range errs {
		if err == nil {
			t.Errorf("write %d: nil after its group's COMMIT answered 40003 (completion unknown): it was sent again alone", i)
		}
	}
}

// TestPostgresGroupReviewAGroupRunsUnderItsSendersContextNotEachWritesOwn: a write whose context has ended may win a
// slot and send the others' writes; the group runs under a context of its own, so a write with 20 s left is not
// failed by the sender's ended one.
func TestPostgresGroupReviewAGroupRunsUnderItsSendersContextNotEachWritesOwn(t *testing.T) {
	ctx := context.Background()
	s := openReviewStore(t)
	if _, err := s.pool.Exec(ctx, `CREATE TABLE review_ctx (v bigint)`); err != nil {
		t.Fatal(err)
	}
	w := groupWrite{sqls: []string{`INSERT INTO review_ctx VALUES (1)`}}
	for try := 0; try < 30; try++ {
		for range pgGroupSenders {
			s.group.slots <- struct{}{}
		}
		var wg sync.WaitGroup
		var stale, live error
		wg.Go(func() {
			ended, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
			defer cancel()
			stale = s.grouped(ended, w.queue, w.read)
		})
		waitPending(t, s, 1)
		lctx, lcancel := context.WithTimeout(context.Background(), 20*time.Second)
		wg.Go(func() { live = s.grouped(lctx, w.queue, w.read) })
		waitPending(t, s, 2)
		<-s.group.slots
		wg.Wait()
		for range pgGroupSenders - 1 {
			<-s.group.slots
		}
		alive := lctx.Err() == nil
		lcancel()
		if live != nil && alive {
			t.Fatalf("try %d: a write with its own context alive failed with %v (the write with an ended context sent the group; its own error: %v)", try, live, stale)
		}
	}
}

// TestPostgresGroupReviewTwoGroupsMarkingTheSamePaymentsDoNotDeadlock: two groups in flight (two requests each of payments X
// and Y, as a client's retries spread over gateways or one gateway's two senders give them) take their in-flight
// marks (pgBusy) in opposite orders: sent in the order of their ids, one group waits for the other's commit, and
// none is rolled back as a deadlock (which would send every write of it again alone after the deadlock timeout).
func TestPostgresGroupReviewTwoGroupsMarkingTheSamePaymentsDoNotDeadlock(t *testing.T) {
	s := openReviewStore(t)
	x, y := []byte("review-payment-x"), []byte("review-payment-y")
	mark := func(id []byte, owner string, sleep bool) (func(*pgx.Batch), func(pgx.BatchResults) error) {
		return func(b *pgx.Batch) {
				b.Queue(pgBusy, id, owner)
				if sleep {
					b.Queue(`SELECT pg_sleep(0.4)`)
				}
			}, func(br pgx.BatchResults) error {
				var marked bool
				if err := br.QueryRow().Scan(&marked); err != nil && !errors.Is(err, pgx.ErrNoRows) {
					return err
				}
				if sleep {
					_, err := br.Exec()
					return err
				}
				return nil
			}
	}
	for range pgGroupSenders {
		s.group.slots <- struct{}{}
	}
	errs := make([]error, 4)
	var wg sync.WaitGroup
	queue := func(i int, q func(*pgx.Batch), r func(pgx.BatchResults) error, pending int) {
		wg.Go(func() {
			wctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			errs[i] = s.grouped(wctx, q, r)
		})
		waitPending(t, s, pending)
	}
	q, r := mark(x, "a", true)
	queue(0, q, r, 1)
	q, r = mark(y, "a", false)
	queue(1, q, r, 2)
	<-s.group.slots // the first group: X, then (after 0.4 s) Y
	waitPending(t, s, 0)
	time.Sleep(100 * time.Millisecond)
	q, r = mark(y, "b", false)
	queue(2, q, r, 1)
	q, r = mark(x, "b", false)
	queue(3, q, r, 2)
	<-s.group.slots // the second group: Y, then X
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("write %d: %v", i, err)
		}
	}
	if n := s.group.aborted.Load(); n != 0 {
		t.Errorf("two groups marking X and Y in opposite orders: %d rolled back (a deadlock), want none", n)
	}
}
