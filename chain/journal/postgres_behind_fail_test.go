package journal

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestPostgresADeferredWriteThatFailsStopsNoLaterWriteButAClaims: a deferred write that is no claim (the engine's
// final answer, which reconciliation records should it never be written) fails. The calls of its context after it
// must still write their own: sent alone ahead of a served mark (begin), or carried in the batch of the gate's
// final write (UpdateKnownIdle), its failure must not take the served mark with it, or the payment, served and not
// marked so, is served again when presented again. A deferred claim that fails still stops them (see
// TestPostgresADeferredWriteRidesWithTheNextStatementAndNothingOvertakesIt).
func TestPostgresADeferredWriteThatFailsStopsNoLaterWriteButAClaims(t *testing.T) {
	throughEitherWay(t, testPostgresADeferredWriteThatFailsStopsNoLaterWriteButAClaims)
}

func testPostgresADeferredWriteThatFailsStopsNoLaterWriteButAClaims(t *testing.T, dsn string, n int) {
	s := openPostgres(t, dsn, Options{})
	bg := context.Background()
	base := 9400 + 10*n
	failing := func(ctx context.Context) *error {
		var told error
		s.behindOf(ctx).add(&behindWrite{sql: `SELECT 1 / 0`, landed: func(_ pgconn.CommandTag, err error) func() {
			told = err
			return nil
		}})
		return &told
	}

	// Sent alone ahead of another call (begin).
	rec, claimed, err := s.Claim(bg, claimOf(base))
	if err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	ctx := Defer(bg, s)
	told := failing(ctx)
	if err := s.MarkServed(ctx, rec.ID, time.Unix(1_800_000_000, 0)); err != nil {
		t.Fatalf("a served mark after a deferred write that failed = %v; want it written", err)
	}
	if *told == nil {
		t.Fatal("the deferred write that failed was not told so")
	}
	if got, _, err := s.Get(bg, rec.ID); err != nil || !got.Served {
		t.Fatalf("the record after its served mark = served %v (%v); want served", got.Served, err)
	}

	// Carried in the batch of the gate's final write.
	rec, claimed, err = s.Claim(bg, claimOf(base+1))
	if err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	ctx = Defer(bg, s)
	told = failing(ctx)
	_, _, err = UpdateKnownIdle(ctx, s, rec, func(r *Record) error {
		r.Served, r.ServedAt = true, time.Unix(1_800_000_000, 0).UTC()
		return nil
	})
	if err != nil {
		t.Fatalf("UpdateKnownIdle carrying a deferred write that fails = %v; want its own write written", err)
	}
	if *told == nil {
		t.Fatal("the deferred write that failed was not told so")
	}
	if got, _, err := s.Get(bg, rec.ID); err != nil || !got.Served {
		t.Fatalf("the record after UpdateKnownIdle = served %v (%v); want served", got.Served, err)
	}
}
