package journal

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestPostgresServedAndIdleAreOneWrite: MarkServedIdle and UpdateKnownIdle write a payment's served mark and clear
// the writer's in-flight mark of it together: another store can take the mark only once the record reads served.
// A mark another instance holds stays; a record changed since it was known is written through Update, and its
// mark is left for Idle.
func TestPostgresServedAndIdleAreOneWrite(t *testing.T) {
	throughEitherWay(t, testPostgresServedAndIdleAreOneWrite)
}

func testPostgresServedAndIdleAreOneWrite(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	at := time.Unix(1_800_000_000, 0).UTC()
	claimMarked := func(s *PostgresStore, k int) Record {
		t.Helper()
		r, claimed, err := a.Claim(ctx, claimOf(k+n))
		if err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		if mine, err := s.Busy(ctx, r.ID); !mine || err != nil {
			t.Fatalf("Busy = %v, %v; want the mark", mine, err)
		}
		return r
	}
	servedAndFree := func(id ID) {
		t.Helper()
		if r, _, err := b.Get(ctx, id); err != nil || !r.Served || !r.ServedAt.Equal(at) {
			t.Fatalf("the record as another store reads it = %+v, %v; want served at %s", r, err, at)
		}
		if mine, err := b.Busy(ctx, id); !mine || err != nil {
			t.Fatalf("another store's Busy after the served mark = %v, %v; want the in-flight mark cleared", mine, err)
		}
	}

	// An async payment's served mark.
	r := claimMarked(a, 9701)
	if idled, err := MarkServedIdle(ctx, a, r.ID, at); !idled || err != nil {
		t.Fatalf("MarkServedIdle = %v, %v; want written and idled", idled, err)
	}
	servedAndFree(r.ID)
	// Served already: ErrServed, as MarkServed says; the mark is cleared all the same.
	if mine, _ := a.Busy(ctx, r.ID); mine {
		t.Fatalf("a took the mark b holds")
	}
	if err := b.Idle(ctx, r.ID); err != nil {
		t.Fatal(err)
	}
	if mine, err := a.Busy(ctx, r.ID); !mine || err != nil {
		t.Fatalf("Busy = %v, %v", mine, err)
	}
	if idled, err := MarkServedIdle(ctx, a, r.ID, at); !idled || !errors.Is(err, ErrServed) {
		t.Fatalf("MarkServedIdle of a served payment = %v, %v; want idled, ErrServed", idled, err)
	}
	if mine, err := b.Busy(ctx, r.ID); !mine || err != nil {
		t.Fatalf("Busy after MarkServedIdle of a served payment = %v, %v; want the mark cleared", mine, err)
	}

	// Another instance's mark is not this store's to clear.
	r = claimMarked(b, 9702)
	if _, err := MarkServedIdle(ctx, a, r.ID, at); err != nil {
		t.Fatal(err)
	}
	if mine, err := a.Busy(ctx, r.ID); mine || err != nil {
		t.Fatalf("Busy of a payment another live store marked = %v, %v; want its mark kept", mine, err)
	}

	// A settled payment's final answer and served mark, over the record as claimed.
	served := func(r *Record) error {
		if r.Served {
			return errors.New("served already")
		}
		r.Served, r.ServedAt, r.State = true, at, StateFinal
		r.Response = &x402.SettleResponse{Success: true, Transaction: "0x01", Network: testNetwork, Payer: testPayer}
		return nil
	}
	r = claimMarked(a, 9703)
	got, idled, err := UpdateKnownIdle(ctx, a, r, served)
	if err != nil || !idled || !got.Served || got.State != StateFinal {
		t.Fatalf("UpdateKnownIdle of the record as claimed = %+v, %v, %v; want it final, served and idled", got, idled, err)
	}
	servedAndFree(r.ID)

	// Changed since: written through Update, and the mark stays until Idle.
	r = claimMarked(a, 9704)
	if _, err := b.Update(ctx, r.ID, toBroadcast("0xabc")); err != nil {
		t.Fatal(err)
	}
	got, idled, err = UpdateKnownIdle(ctx, a, r, served)
	if err != nil || idled || !got.Served || got.TxHash != "0xabc" {
		t.Fatalf("UpdateKnownIdle of a record changed since = %+v, %v, %v; want it served through Update, not idled", got, idled, err)
	}
	if mine, err := b.Busy(ctx, r.ID); mine || err != nil {
		t.Fatalf("another store's Busy after UpdateKnownIdle through Update = %v, %v; want the mark kept for Idle", mine, err)
	}
	// Refused: nothing written, the mark kept.
	r = claimMarked(a, 9705)
	if _, idled, err := UpdateKnownIdle(ctx, a, r, func(*Record) error { return errors.New("no") }); err == nil || idled {
		t.Fatalf("UpdateKnownIdle refused by its function = %v, %v; want an error, not idled", idled, err)
	}
	if mine, err := b.Busy(ctx, r.ID); mine || err != nil {
		t.Fatalf("another store's Busy after a refused UpdateKnownIdle = %v, %v; want the mark kept", mine, err)
	}
}
