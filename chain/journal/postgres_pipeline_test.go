package journal

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// throughEitherWay runs test against PostgreSQL directly and through PgBouncer in transaction mode, where the
// statements of one pipelined batch (and a transaction's two) must reach the one server connection.
// Each run has records (and leases) of its own: n is added to the numbers of its payments.
func throughEitherWay(t *testing.T, test func(t *testing.T, dsn string, n int)) {
	dsn := pgtest.Shared(t)
	t.Run("direct", func(t *testing.T) { test(t, dsn, 0) })
	t.Run("through PgBouncer", func(t *testing.T) { test(t, pgtest.StartPgBouncer(t, dsn).DSN(), 50) })
}

// TestPostgresUpdateKnownWritesInOneStatementOnlyWhatItKnows: UpdateKnown of the record a Claim returned writes the
// change; of a record changed since (by another store), it judges the change against the record as stored (an
// update function that refuses a served record refuses), and never unmarks, re-dates or moves a record backwards.
func TestPostgresUpdateKnownWritesInOneStatementOnlyWhatItKnows(t *testing.T) {
	throughEitherWay(t, testPostgresUpdateKnownWritesInOneStatementOnlyWhatItKnows)
}

func testPostgresUpdateKnownWritesInOneStatementOnlyWhatItKnows(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	known, claimed, err := a.Claim(ctx, claimOf(9101+n))
	if err != nil || !claimed {
		t.Fatalf("Claim = %v, %v", claimed, err)
	}
	at := time.Unix(1_800_000_000, 0).UTC()
	served := func(r *Record) error {
		if r.Served {
			return errors.New("served already")
		}
		r.Served, r.ServedAt, r.State = true, at, StateFinal
		r.Response = &x402.SettleResponse{Success: true, Transaction: "0x01", Network: testNetwork, Payer: testPayer}
		return nil
	}
	got, err := UpdateKnown(ctx, a, known, served)
	if err != nil || !got.Served || got.State != StateFinal {
		t.Fatalf("UpdateKnown of the record as claimed = %+v, %v; want it final and served", got, err)
	}
	if r, _, err := b.Get(ctx, known.ID); err != nil || !r.Served || !r.ServedAt.Equal(at) || r.State != StateFinal {
		t.Fatalf("the record as another store reads it = %+v, %v; want final, served at %s", r, err, at)
	}
	// known is stale now: the write goes through Update, which sees the served record and refuses.
	if _, err := UpdateKnown(ctx, a, known, served); err == nil {
		t.Fatalf("UpdateKnown of a record served since wrote it again")
	}
	// A record another store changed: its change is not overwritten.
	known2, _, _ := a.Claim(ctx, claimOf(9102+n))
	sent, err := b.Update(ctx, known2.ID, toBroadcast("0xabc"))
	if err != nil {
		t.Fatal(err)
	}
	got, err = UpdateKnown(ctx, a, known2, func(r *Record) error { r.Attempts++; return nil })
	if err != nil || got.State != StateBroadcast || got.TxHash != "0xabc" || got.Attempts != sent.Attempts+1 {
		t.Fatalf("UpdateKnown of a record broadcast since = %+v, %v; want the broadcast record with the change", got, err)
	}
	// Backwards: refused before anything is written.
	if _, err := UpdateKnown(ctx, a, got, func(r *Record) error { r.State = StateClaimed; return nil }); !errors.Is(err, ErrInvalidUpdate) {
		t.Fatalf("UpdateKnown moving a record backwards = %v; want ErrInvalidUpdate", err)
	}
}

// TestPostgresMarkAndGetIsBusyAndGet: MarkAndGet marks a payment for one store of several at once, and only the
// store that holds the mark reads the record.
func TestPostgresMarkAndGetIsBusyAndGet(t *testing.T) {
	throughEitherWay(t, testPostgresMarkAndGetIsBusyAndGet)
}

func testPostgresMarkAndGetIsBusyAndGet(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	r := claimOf(9201 + n)
	if _, _, err := stores[0].Claim(ctx, r); err != nil {
		t.Fatal(err)
	}
	var marked atomic.Int32
	var wg sync.WaitGroup
	for _, s := range stores {
		wg.Go(func() {
			mine, rec, found, err := MarkAndGet(ctx, s, r.ID)
			switch {
			case err != nil:
				t.Errorf("MarkAndGet: %v", err)
			case mine && (!found || rec.ID != r.ID || rec.Owner != r.Owner):
				t.Errorf("MarkAndGet by the marking store read %+v, found %v; want the claimed record", rec, found)
			case !mine && found:
				t.Errorf("MarkAndGet by a store without the mark read the record")
			case mine:
				marked.Add(1)
			}
		})
	}
	wg.Wait()
	if n := marked.Load(); n != 1 {
		t.Fatalf("%d stores hold the mark of one payment; want exactly one", n)
	}
	if mine, _, found, err := MarkAndGet(ctx, stores[0], claimOf(9202+n).ID); !mine || found || err != nil {
		t.Fatalf("MarkAndGet of a payment with no record = %v, found %v, %v; want marked, not found", mine, found, err)
	}
}

// TestPostgresATransactionInTwoBatchesWritesNothingWhenRefused: an Update whose function refuses, and a fenced
// Update without the lease, write nothing and leave no transaction open (the store goes on working on all of its
// connections).
func TestPostgresATransactionInTwoBatchesWritesNothingWhenRefused(t *testing.T) {
	throughEitherWay(t, testPostgresATransactionInTwoBatchesWritesNothingWhenRefused)
}

func testPostgresATransactionInTwoBatchesWritesNothingWhenRefused(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	s := openPostgres(t, dsn, Options{})
	r, _, err := s.Claim(ctx, claimOf(9301+n))
	if err != nil {
		t.Fatal(err)
	}
	for range 40 { // more than the pool's connections
		if _, err := s.Update(ctx, r.ID, func(*Record) error { return errors.New("no") }); err == nil {
			t.Fatal("an Update whose function refused succeeded")
		}
		if _, err := s.UpdateFenced(ctx, r.ID, "no-such-lease", 1, toBroadcast("0xdef")); !errors.Is(err, ErrFenced) {
			t.Fatalf("UpdateFenced without the lease = %v; want ErrFenced", err)
		}
	}
	if got, _, err := s.Get(ctx, r.ID); err != nil || got.State != StateClaimed || got.TxHash != "" {
		t.Fatalf("the record after refused updates = %+v, %v; want it as claimed", got, err)
	}
	if _, err := s.Update(ctx, r.ID, toBroadcast("0x123")); err != nil {
		t.Fatalf("an Update after the refused ones: %v", err)
	}
}

// TestPostgresUpdateFencedKnownWritesOnlyUnderTheLeaseAtItsFence: UpdateFencedKnown, the one-statement write of a
// record its caller knows, writes only while its instance holds the lease at the fence, unexpired (ErrFenced
// otherwise, nothing written), and a record changed since is judged as stored, through UpdateFenced.
func TestPostgresUpdateFencedKnownWritesOnlyUnderTheLeaseAtItsFence(t *testing.T) {
	throughEitherWay(t, testPostgresUpdateFencedKnownWritesOnlyUnderTheLeaseAtItsFence)
}

func testPostgresUpdateFencedKnownWritesOnlyUnderTheLeaseAtItsFence(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	known, _, err := a.Claim(ctx, claimOf(9401+n))
	if err != nil {
		t.Fatal(err)
	}
	lease := fmt.Sprintf("wallet-k%d", n)
	la, err := a.Lease(ctx, lease, 500*time.Millisecond)
	if err != nil || !la.Held {
		t.Fatalf("Lease = %+v, %v", la, err)
	}
	bump := func(r *Record) error { r.Attempts++; return nil }
	for name, try := range map[string]func() error{
		"by the holder at an older fence":  func() error { _, err := UpdateFencedKnown(ctx, a, known, lease, la.Fence-1, bump); return err },
		"by another instance at the fence": func() error { _, err := UpdateFencedKnown(ctx, b, known, lease, la.Fence, bump); return err },
		"of a lease nobody ever took":      func() error { _, err := UpdateFencedKnown(ctx, a, known, lease+"-none", 1, bump); return err },
	} {
		if err := try(); !errors.Is(err, ErrFenced) {
			t.Errorf("UpdateFencedKnown %s = %v; want ErrFenced", name, err)
		}
	}
	got, err := UpdateFencedKnown(ctx, a, known, lease, la.Fence, bump)
	if err != nil || got.Attempts != 1 {
		t.Fatalf("UpdateFencedKnown by the holder = %+v, %v; want one attempt", got, err)
	}
	// known is stale now (one attempt recorded): the write reads the record and adds to it.
	if got, err = UpdateFencedKnown(ctx, a, known, lease, la.Fence, bump); err != nil || got.Attempts != 2 {
		t.Fatalf("UpdateFencedKnown of a record changed since = %+v, %v; want two attempts", got, err)
	}
	time.Sleep(700 * time.Millisecond) // the lease expires
	if _, err := UpdateFencedKnown(ctx, a, got, lease, la.Fence, bump); !errors.Is(err, ErrFenced) {
		t.Errorf("UpdateFencedKnown under an expired lease = %v; want ErrFenced", err)
	}
	if r, _, err := b.Get(ctx, known.ID); err != nil || r.Attempts != 2 {
		t.Fatalf("the record took %d of the writes (%v); want 2, the holder's under its lease", r.Attempts, err)
	}
}
