package journal

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// testClock is a clock the test moves by hand.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func newTestClock() *testClock {
	return &testClock{now: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)}
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// harness adapts one Store implementation to the shared conformance suite.
type harness struct {
	name string
	// open returns a new, empty store.
	open func(t *testing.T, clock func() time.Time) Store
	// reopen closes s and returns a store over the same data; durable stores must keep everything.
	reopen func(t *testing.T, s Store) Store
	// plant writes raw bytes under id behind the store's back, as disk damage would, and returns the store
	// to carry on with.
	plant func(t *testing.T, s Store, id ID, raw []byte) Store
}

var harnesses = []harness{
	{
		name: "memory",
		open: func(t *testing.T, clock func() time.Time) Store {
			return NewMemory(Options{Clock: clock})
		},
		reopen: func(t *testing.T, s Store) Store { return s },
		plant: func(t *testing.T, s Store, id ID, raw []byte) Store {
			m := s.(*MemoryStore)
			m.mu.Lock()
			defer m.mu.Unlock()
			m.records[id] = raw
			m.pending[id] = false
			return s
		},
	},
	{
		name: "bolt",
		open: func(t *testing.T, clock func() time.Time) Store {
			s, err := OpenBolt(filepath.Join(t.TempDir(), "journal.db"), Options{Clock: clock})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		},
		reopen: func(t *testing.T, s Store) Store {
			b := s.(*BoltStore)
			if err := b.Close(); err != nil {
				t.Fatal(err)
			}
			again, err := OpenBolt(b.Path(), b.opts)
			if err != nil {
				t.Fatalf("reopen %s: %v", b.Path(), err)
			}
			t.Cleanup(func() { again.Close() })
			return again
		},
		plant: func(t *testing.T, s Store, id ID, raw []byte) Store {
			b := s.(*BoltStore)
			b.Close()
			db, err := bolt.Open(b.Path(), 0o600, &bolt.Options{Timeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			err = db.Update(func(tx *bolt.Tx) error {
				if err := tx.Bucket(bucketRecords).Put(id[:], raw); err != nil {
					return err
				}
				return tx.Bucket(bucketPending).Put(id[:], []byte{})
			})
			if cerr := db.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
			again, err := OpenBolt(b.Path(), b.opts)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { again.Close() })
			return again
		},
	},
	{
		// A fresh database of the shared test server (pgtest) for every test.
		name: "postgres",
		open: func(t *testing.T, clock func() time.Time) Store {
			return openPostgres(t, pgtest.Shared(t), Options{Clock: clock})
		},
		reopen: func(t *testing.T, s Store) Store {
			p := s.(*PostgresStore)
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			return openPostgres(t, pgDSN(p), p.opts)
		},
		plant: func(t *testing.T, s Store, id ID, raw []byte) Store {
			p := s.(*PostgresStore)
			pgExec(t, pgDSN(p), `INSERT INTO x402_records (id, state, pending, claimed_ns, data) VALUES ($1, 'claimed', true, 0, $2)
ON CONFLICT (id) DO UPDATE SET data = EXCLUDED.data`, id[:], raw)
			return s
		},
	},
}

// forEachStore runs test against every Store implementation.
func forEachStore(t *testing.T, test func(t *testing.T, h harness)) {
	for _, h := range harnesses {
		t.Run(h.name, func(t *testing.T) { test(t, h) })
	}
}

// claimOf returns a claim for the payment with nonce n of the test payer.
func claimOf(n int) Record {
	return Record{
		ID:      PaymentID(testNetwork, x402.TransferPermit2, testAsset, testPayer, strconv.Itoa(n)),
		Network: testNetwork,
		Payer:   testPayer,
		Asset:   testAsset,
		Amount:  "10000",
		PayTo:   "0x209693Bc6afc0C5328bA36FaF03C514EF312287C",
		Request: []byte(`{"x402Version":2}`),
		Owner:   "process-a",
	}
}

func toBroadcast(hash string) func(*Record) error {
	return func(r *Record) error {
		r.State, r.TxHash, r.Wallet, r.TxNonce, r.RawTx = StateBroadcast, hash, "0xwallet", 42, []byte{0x02, 0xf8}
		r.Attempts++
		return nil
	}
}

func toFinal(success bool) func(*Record) error {
	return func(r *Record) error {
		r.State = StateFinal
		r.Response = &x402.SettleResponse{Success: success, Transaction: r.TxHash, Network: r.Network, Payer: r.Payer}
		return nil
	}
}

func mustClaim(t *testing.T, s Store, r Record) Record {
	t.Helper()
	got, claimed, err := s.Claim(context.Background(), r)
	if err != nil || !claimed {
		t.Fatalf("Claim(%s) = claimed %v, %v; want a new claim", r.ID, claimed, err)
	}
	return got
}

func mustUpdate(t *testing.T, s Store, id ID, fn func(*Record) error) Record {
	t.Helper()
	got, err := s.Update(context.Background(), id, fn)
	if err != nil {
		t.Fatalf("Update(%s): %v", id, err)
	}
	return got
}

func TestStoreClaimInsertsOnceAndShowsLaterCallersTheFirstClaim(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		first := mustClaim(t, s, claimOf(1))
		if first.State != StateClaimed || !first.ClaimedAt.Equal(clock.Now()) || !first.UpdatedAt.Equal(clock.Now()) {
			t.Fatalf("claimed record = state %q claimedAt %v updatedAt %v; want claimed at %v",
				first.State, first.ClaimedAt, first.UpdatedAt, clock.Now())
		}
		mustUpdate(t, s, first.ID, toBroadcast("0xabc"))

		clock.Advance(time.Minute)
		second := claimOf(1)
		second.Owner = "process-b"
		got, claimed, err := s.Claim(ctx, second)
		if err != nil || claimed {
			t.Fatalf("second Claim = claimed %v, %v; want the existing record", claimed, err)
		}
		if got.Owner != "process-a" || got.TxHash != "0xabc" || got.State != StateBroadcast || !got.ClaimedAt.Equal(first.ClaimedAt) {
			t.Fatalf("second Claim saw owner %q hash %q state %q; want process-a's broadcast 0xabc", got.Owner, got.TxHash, got.State)
		}
	})
}

func TestStoreClaimRefusesARecordThatIsNotAFreshClaim(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		for _, tc := range []struct {
			name string
			edit func(*Record)
		}{
			{"no id", func(r *Record) { r.ID = ID{} }},
			{"already broadcast", func(r *Record) { r.State, r.TxHash = StateBroadcast, "0x1" }},
			{"unknown state", func(r *Record) { r.State = "settled" }},
			{"final without its answer", func(r *Record) { r.State = StateFinal }},
		} {
			r := claimOf(2)
			tc.edit(&r)
			if _, _, err := s.Claim(context.Background(), r); !errors.Is(err, ErrInvalidUpdate) {
				t.Errorf("%s: Claim error = %v, want ErrInvalidUpdate", tc.name, err)
			}
		}
		if n, _ := s.Count(context.Background()); n != 0 {
			t.Fatalf("Count after refused claims = %d, want 0", n)
		}
	})
}

// TestStoreClaimOfAFinalRecordWritesItFinalInOneGo: a record decided as it is written (a gate's record of a
// payment it settles at once) is claimed final: later claims see it, it is in no backlog, and it is pruned like
// any final record, once both its finality and its deadline are past.
func TestStoreClaimOfAFinalRecordWritesItFinalInOneGo(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		r := claimOf(30)
		r.State, r.Response = StateFinal, &x402.SettleResponse{Network: testNetwork, ErrorReason: x402.ReasonSettlementPending}
		r.Deadline = clock.Now().Add(2 * time.Hour)
		got, claimed, err := s.Claim(ctx, r)
		if err != nil || !claimed || got.State != StateFinal || !got.FinalAt.Equal(clock.Now()) {
			t.Fatalf("Claim of a final record = %+v, %v, %v; want it claimed, final at %s", got, claimed, err, clock.Now())
		}
		if again, claimed, err := s.Claim(ctx, claimOf(30)); err != nil || claimed || again.State != StateFinal ||
			again.Response == nil || again.Response.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("a later Claim = %+v, %v, %v; want the final record, not claimed", again, claimed, err)
		}
		if n, _ := s.Backlog(ctx); n != 0 {
			t.Fatalf("Backlog = %d, want 0: a final record is no one's work", n)
		}
		if recs, _ := s.Pending(ctx); len(recs) != 0 {
			t.Fatalf("Pending lists %d records, want none", len(recs))
		}
		clock.Advance(time.Hour)
		if n, err := s.Prune(ctx, clock.Now()); err != nil || n != 0 {
			t.Fatalf("Prune before the deadline = %d, %v; want nothing pruned", n, err)
		}
		clock.Advance(2 * time.Hour)
		if n, err := s.Prune(ctx, clock.Now()); err != nil || n != 1 {
			t.Fatalf("Prune past the deadline = %d, %v; want the record pruned", n, err)
		}
	})
}

func TestStoreConcurrentClaimsOfOnePaymentHaveExactlyOneWinner(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		const callers = 64
		type answer struct {
			rec     Record
			claimed bool
			err     error
		}
		answers := make([]answer, callers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range callers {
			wg.Go(func() {
				r := claimOf(3)
				r.Owner = fmt.Sprintf("caller-%d", i)
				<-start
				rec, claimed, err := s.Claim(context.Background(), r)
				answers[i] = answer{rec, claimed, err}
			})
		}
		close(start)
		wg.Wait()
		winner := ""
		for i, a := range answers {
			if a.err != nil {
				t.Fatalf("caller %d: %v", i, a.err)
			}
			if a.claimed {
				if winner != "" {
					t.Fatalf("both %s and caller-%d claimed the payment", winner, i)
				}
				winner = a.rec.Owner
			}
		}
		if winner == "" {
			t.Fatal("no caller claimed the payment")
		}
		for i, a := range answers {
			if a.rec.Owner != winner {
				t.Fatalf("caller %d saw owner %q, want the winner %q", i, a.rec.Owner, winner)
			}
		}
		if n, _ := s.Count(context.Background()); n != 1 {
			t.Fatalf("Count = %d, want 1", n)
		}
	})
}

func TestStoreUpdatesPersistThroughBroadcastToFinal(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		claimed := mustClaim(t, s, claimOf(4))

		clock.Advance(time.Second)
		b := mustUpdate(t, s, claimed.ID, toBroadcast("0xfeed"))
		if b.State != StateBroadcast || b.TxHash != "0xfeed" || b.Attempts != 1 || !b.UpdatedAt.Equal(clock.Now()) || !b.FinalAt.IsZero() {
			t.Fatalf("after broadcast: %+v", b)
		}

		clock.Advance(time.Second)
		f := mustUpdate(t, s, claimed.ID, toFinal(true))
		if !f.FinalAt.Equal(clock.Now()) {
			t.Fatalf("FinalAt = %v, want %v", f.FinalAt, clock.Now())
		}

		clock.Advance(time.Second)
		served := mustUpdate(t, s, claimed.ID, func(r *Record) error {
			r.Served, r.ServedAt = true, clock.Now()
			r.ClaimedAt, r.FinalAt = time.Time{}, time.Time{} // the store keeps its own stamps
			return nil
		})
		if !served.FinalAt.Equal(f.FinalAt) || !served.ClaimedAt.Equal(claimed.ClaimedAt) {
			t.Fatalf("marking served moved FinalAt to %v / ClaimedAt to %v", served.FinalAt, served.ClaimedAt)
		}

		s = h.reopen(t, s)
		got, ok, err := s.Get(ctx, claimed.ID)
		if err != nil || !ok {
			t.Fatalf("Get after reopen = %v, %v", ok, err)
		}
		want := served
		if got.State != StateFinal || got.TxHash != "0xfeed" || string(got.RawTx) != string(want.RawTx) ||
			got.Response == nil || !got.Response.Success || got.Response.Transaction != "0xfeed" ||
			!got.Served || !got.ServedAt.Equal(want.ServedAt) || string(got.Request) != string(want.Request) ||
			got.TxNonce != 42 || got.Wallet != "0xwallet" || got.Amount != "10000" {
			t.Fatalf("Get after reopen = %+v\nwant %+v", got, want)
		}
	})
}

func TestStoreUpdateRefusesChangesThatCouldLoseATransaction(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		broadcast := mustClaim(t, s, claimOf(5)).ID
		mustUpdate(t, s, broadcast, toBroadcast("0x1"))
		final := mustClaim(t, s, claimOf(6)).ID
		mustUpdate(t, s, final, toFinal(false))
		claimed := mustClaim(t, s, claimOf(7)).ID

		for _, tc := range []struct {
			name string
			id   ID
			fn   func(*Record) error
		}{
			{"broadcast back to claimed", broadcast, func(r *Record) error { r.State = StateClaimed; return nil }},
			{"final back to broadcast", final, func(r *Record) error { r.State, r.TxHash = StateBroadcast, "0x2"; return nil }},
			{"broadcast without a hash", claimed, func(r *Record) error { r.State = StateBroadcast; return nil }},
			{"final without an answer", claimed, func(r *Record) error { r.State = StateFinal; return nil }},
			{"changed id", claimed, func(r *Record) error { r.ID = claimOf(8).ID; return nil }},
			{"unknown state", claimed, func(r *Record) error { r.State = "done"; return nil }},
		} {
			before, _, _ := s.Get(ctx, tc.id)
			if _, err := s.Update(ctx, tc.id, tc.fn); !errors.Is(err, ErrInvalidUpdate) {
				t.Errorf("%s: Update error = %v, want ErrInvalidUpdate", tc.name, err)
			}
			after, _, _ := s.Get(ctx, tc.id)
			if after.State != before.State || after.TxHash != before.TxHash {
				t.Errorf("%s: refused update still changed the record to %q %q", tc.name, after.State, after.TxHash)
			}
		}
	})
}

func TestStoreUpdateWritesNothingWhenTheFunctionFails(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		id := mustClaim(t, s, claimOf(9)).ID
		refusal := errors.New("not my claim")
		_, err := s.Update(ctx, id, func(r *Record) error {
			r.State, r.TxHash = StateBroadcast, "0x9"
			return refusal
		})
		if !errors.Is(err, refusal) || !strings.Contains(err.Error(), id.String()) {
			t.Fatalf("Update error = %v, want the function's error naming %s", err, id)
		}
		if got, _, _ := s.Get(ctx, id); got.State != StateClaimed || got.TxHash != "" {
			t.Fatalf("record after a failed update = %q %q, want it unchanged", got.State, got.TxHash)
		}
		if _, err := s.Update(ctx, claimOf(10).ID, toFinal(true)); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Update of an absent id: %v, want ErrNotFound", err)
		}
	})
}

func TestStoreReleaseDeletesOnlyClaimsThatNeverBroadcast(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		claimed := mustClaim(t, s, claimOf(11))
		broadcast := mustClaim(t, s, claimOf(12))
		mustUpdate(t, s, broadcast.ID, toBroadcast("0x12"))
		final := mustClaim(t, s, claimOf(13))
		mustUpdate(t, s, final.ID, toFinal(true))

		if err := s.Release(ctx, claimed); err != nil {
			t.Fatalf("Release of a claim: %v", err)
		}
		if _, ok, _ := s.Get(ctx, claimed.ID); ok {
			t.Fatal("released claim is still there")
		}
		clock.Advance(time.Second)
		again := mustClaim(t, s, claimOf(11)) // the payer may try again
		for name, r := range map[string]Record{"broadcast": broadcast, "final": final} {
			if err := s.Release(ctx, r); !errors.Is(err, ErrNotReleasable) {
				t.Errorf("Release of a %s record: %v, want ErrNotReleasable", name, err)
			}
			if _, ok, _ := s.Get(ctx, r.ID); !ok {
				t.Errorf("refused Release deleted the %s record", name)
			}
		}
		// A claim made since the one released, and a claim of another process, are not the caller's to release:
		// the first claimant of a payment that was taken over and claimed again must not delete the new claim.
		taken := mustClaim(t, s, claimOf(20))
		mustUpdate(t, s, taken.ID, func(r *Record) error { r.Owner = "process-b"; return nil })
		for name, r := range map[string]Record{"released and claimed again since": claimed, "taken over by another process": taken} {
			if err := s.Release(ctx, r); !errors.Is(err, ErrNotReleasable) {
				t.Errorf("Release of a claim %s: %v, want ErrNotReleasable", name, err)
			}
			if got, ok, _ := s.Get(ctx, r.ID); !ok || got.State != StateClaimed {
				t.Errorf("Release of a claim %s deleted the claim there now: %+v, %v", name, got, ok)
			}
		}
		if err := s.Release(ctx, again); err != nil {
			t.Fatalf("Release of the claim made again: %v", err)
		}
		if err := s.Release(ctx, claimOf(14)); err != nil {
			t.Fatalf("Release of an absent id: %v, want nil", err)
		}
	})
}

// TestStoreReleaseUnsentDeletesOnlyTheRefusedTransactionsRecord: a broadcast record goes when its claimant says
// its very transaction was refused; a record of another transaction (a later attempt), a final one, a claim, or
// a record another process took over since (it may have sent the transaction again), stays.
func TestStoreReleaseUnsentDeletesOnlyTheRefusedTransactionsRecord(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		refused := mustClaim(t, s, claimOf(15))
		mustUpdate(t, s, refused.ID, toBroadcast("0x15"))
		other := mustClaim(t, s, claimOf(16))
		mustUpdate(t, s, other.ID, toBroadcast("0x16"))
		final := mustClaim(t, s, claimOf(17))
		mustUpdate(t, s, final.ID, toBroadcast("0x17"))
		mustUpdate(t, s, final.ID, toFinal(true))
		claimed := mustClaim(t, s, claimOf(18))
		taken := mustClaim(t, s, claimOf(20))
		mustUpdate(t, s, taken.ID, toBroadcast("0x20"))
		mustUpdate(t, s, taken.ID, func(r *Record) error { r.Owner = "process-b"; return nil })

		for name, c := range map[string]struct {
			claim Record
			hash  string
		}{"another transaction's": {other, "0x15"}, "final": {final, "0x17"}, "claimed": {claimed, "0x99"},
			"taken over by another process": {taken, "0x20"}} {
			if err := s.ReleaseUnsent(ctx, c.claim, c.hash); !errors.Is(err, ErrNotReleasable) {
				t.Errorf("ReleaseUnsent of the %s record: %v, want ErrNotReleasable", name, err)
			}
			if _, ok, _ := s.Get(ctx, c.claim.ID); !ok {
				t.Errorf("a refused ReleaseUnsent deleted the %s record", name)
			}
		}
		if err := s.ReleaseUnsent(ctx, refused, "0x15"); err != nil {
			t.Fatalf("ReleaseUnsent of the refused broadcast record: %v", err)
		}
		if _, ok, _ := s.Get(ctx, refused.ID); ok {
			t.Fatal("the refused broadcast record is still there after ReleaseUnsent")
		}
		mustClaim(t, s, claimOf(15)) // the payer may present it again
		if n, _ := s.Backlog(ctx); n != 4 {
			t.Fatalf("Backlog = %d, want 4 (the other broadcast, the claim, the taken over broadcast and the claim again)", n)
		}
		if err := s.ReleaseUnsent(ctx, claimOf(19), "0x19"); err != nil {
			t.Fatalf("ReleaseUnsent of an absent id: %v, want nil", err)
		}
	})
}

func TestStorePendingListsEveryRecordNotFinalOldestFirst(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		var want, wantAsync []ID
		for n := 20; n < 26; n++ {
			r := claimOf(n)
			r.Async = n == 25 || n == 23
			id := mustClaim(t, s, r).ID
			if r.Async && n%3 != 2 {
				wantAsync = append(wantAsync, id)
			}
			clock.Advance(time.Second)
			switch n % 3 {
			case 0:
				want = append(want, id) // stays claimed
			case 1:
				mustUpdate(t, s, id, toBroadcast("0x"+strconv.Itoa(n)))
				want = append(want, id)
			case 2:
				mustUpdate(t, s, id, toBroadcast("0x"+strconv.Itoa(n)))
				mustUpdate(t, s, id, toFinal(true))
			}
		}
		s = h.reopen(t, s)
		got, err := s.Pending(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(want) {
			t.Fatalf("Pending listed %d records, want %d", len(got), len(want))
		}
		for i := range want {
			if got[i].ID != want[i] {
				t.Fatalf("Pending[%d] = %s, want %s (oldest claim first)", i, got[i].ID, want[i])
			}
		}
		if n, _ := s.Backlog(ctx); n != len(want) {
			t.Fatalf("Backlog = %d, want %d", n, len(want))
		}
		for _, async := range []bool{true, false} {
			got, err := s.PendingOf(ctx, async)
			if err != nil {
				t.Fatal(err)
			}
			var ids []ID
			for _, r := range got {
				if r.Async != async {
					t.Fatalf("PendingOf(async %v) listed %s, whose Async is %v", async, r.ID, r.Async)
				}
				ids = append(ids, r.ID)
			}
			var wantOf []ID
			for _, id := range want {
				if slices.Contains(wantAsync, id) == async {
					wantOf = append(wantOf, id)
				}
			}
			if !slices.Equal(ids, wantOf) {
				t.Fatalf("PendingOf(async %v) = %v, want %v (oldest claim first)", async, ids, wantOf)
			}
		}
		if n, _ := s.Count(ctx); n != 6 {
			t.Fatalf("Count = %d, want 6", n)
		}
	})
}

func TestStorePruneDeletesOnlyFinalRecordsOlderThanTheCutoff(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		oldFinal := mustClaim(t, s, claimOf(30)).ID
		mustUpdate(t, s, oldFinal, toFinal(false))
		oldClaim := mustClaim(t, s, claimOf(31)).ID
		clock.Advance(time.Hour)
		cutoff := clock.Now()
		newFinal := mustClaim(t, s, claimOf(32)).ID
		mustUpdate(t, s, newFinal, toFinal(true))

		n, err := s.Prune(ctx, cutoff)
		if err != nil || n != 1 {
			t.Fatalf("Prune = %d, %v; want 1 record deleted", n, err)
		}
		for id, want := range map[ID]bool{oldFinal: false, oldClaim: true, newFinal: true} {
			if _, ok, _ := s.Get(ctx, id); ok != want {
				t.Errorf("after Prune, %s present = %v, want %v", id, ok, want)
			}
		}
		if n, err := s.Prune(ctx, cutoff); err != nil || n != 0 {
			t.Fatalf("second Prune = %d, %v; want nothing left to delete", n, err)
		}
	})
}

func TestStorePruneKeepsAFinalRecordUntilItsDeadlineHasPassed(t *testing.T) {
	const none = time.Duration(-1 << 63) // no Deadline
	t0 := newTestClock().Now()
	cutoff, later := t0.Add(time.Hour), t0.Add(3*time.Hour)
	for _, tc := range []struct {
		name            string
		final           bool
		finalAt         time.Duration // after t0
		deadline        time.Duration // after t0, or none
		movedTo         time.Duration // the Deadline an update sets once the record is final, or none
		keptAtCutoff    bool
		keptLater       bool // at the second, later cutoff
		unrepresentable bool // deadline in the year 9999, past what nanoseconds hold
	}{
		{name: "final before the cutoff, no deadline", final: true, deadline: none, movedTo: none},
		{name: "final and past its deadline before the cutoff", final: true, deadline: 30 * time.Minute, movedTo: none},
		{name: "final before the cutoff, deadline after it", final: true, deadline: 2 * time.Hour, movedTo: none, keptAtCutoff: true},
		{name: "final before the cutoff, deadline at it", final: true, deadline: time.Hour, movedTo: none, keptAtCutoff: true},
		{name: "final after the cutoff, deadline before it", final: true, finalAt: 2 * time.Hour, deadline: 10 * time.Minute, movedTo: none, keptAtCutoff: true},
		{name: "final after the cutoff, no deadline", final: true, finalAt: 2 * time.Hour, deadline: none, movedTo: none, keptAtCutoff: true},
		{name: "not final, deadline long past", deadline: -time.Hour, movedTo: none, keptAtCutoff: true, keptLater: true},
		{name: "final, deadline in the year 9999", final: true, unrepresentable: true, movedTo: none, keptAtCutoff: true, keptLater: true},
		{name: "final, deadline moved past the cutoff", final: true, deadline: 10 * time.Minute, movedTo: 2 * time.Hour, keptAtCutoff: true},
		{name: "final, deadline moved before the cutoff", final: true, deadline: 2 * time.Hour, movedTo: 10 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forEachStore(t, func(t *testing.T, h harness) {
				clock := newTestClock()
				s := h.open(t, clock.Now)
				ctx := context.Background()
				r := claimOf(50)
				switch {
				case tc.unrepresentable:
					r.Deadline = time.Date(9999, time.December, 31, 23, 59, 59, 0, time.UTC)
				case tc.deadline != none:
					r.Deadline = t0.Add(tc.deadline)
				}
				// Another final record, gone by any rule at either cutoff, shows Prune deletes beside what it keeps.
				other := claimOf(51)
				other.Deadline = t0.Add(-time.Hour)
				mustUpdate(t, s, mustClaim(t, s, other).ID, toFinal(false))
				clock.Advance(tc.finalAt)
				id := mustClaim(t, s, r).ID
				if tc.final {
					mustUpdate(t, s, id, toFinal(true))
				}
				if tc.movedTo != none {
					mustUpdate(t, s, id, func(r *Record) error { r.Deadline = t0.Add(tc.movedTo); return nil })
				}
				s = h.reopen(t, s)

				for _, step := range []struct {
					cutoff time.Time
					kept   bool
				}{{cutoff, tc.keptAtCutoff}, {later, tc.keptLater}} {
					if _, err := s.Prune(ctx, step.cutoff); err != nil {
						t.Fatalf("Prune(%s): %v", step.cutoff, err)
					}
					if _, ok, err := s.Get(ctx, id); err != nil || ok != step.kept {
						t.Fatalf("after Prune(%s), the record is present = %v (%v), want %v", step.cutoff, ok, err, step.kept)
					}
					if _, ok, _ := s.Get(ctx, other.ID); ok {
						t.Fatalf("after Prune(%s), the final record past its deadline an hour before t0 is still there", step.cutoff)
					}
					want := 0
					if step.kept {
						want = 1
					}
					if n, err := s.Count(ctx); err != nil || n != want {
						t.Fatalf("Count after Prune(%s) = %d, %v; want %d", step.cutoff, n, err, want)
					}
				}
			})
		})
	}
}

func TestStoreReportsACorruptRecordByItsID(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		mustClaim(t, s, claimOf(40))
		bad := claimOf(41).ID
		s = h.plant(t, s, bad, []byte{recordFormat, '{', 'x'})

		_, _, err := s.Get(ctx, bad)
		checkCorrupt(t, "Get", err, bad)
		_, err = s.Update(ctx, bad, toFinal(true))
		checkCorrupt(t, "Update", err, bad)
		_, _, err = s.Claim(ctx, claimOf(41))
		checkCorrupt(t, "Claim", err, bad)
		_, err = s.Pending(ctx)
		checkCorrupt(t, "Pending", err, bad)
		// The healthy record is untouched.
		if _, ok, err := s.Get(ctx, claimOf(40).ID); !ok || err != nil {
			t.Fatalf("healthy record: %v, %v", ok, err)
		}
	})
}

func checkCorrupt(t *testing.T, op string, err error, id ID) {
	t.Helper()
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), id.String()) {
		t.Errorf("%s of a corrupt record: %v; want ErrCorrupt naming %s", op, err, id)
	}
}

func TestStoreReturnsRecordsThatShareNoMemoryWithIt(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		r := claimOf(50)
		got := mustClaim(t, s, r)
		r.Request[0], got.Request[0] = 'X', 'Y'
		again, _, _ := s.Get(ctx, r.ID)
		if string(again.Request) != `{"x402Version":2}` {
			t.Fatalf("stored Request changed to %q through a caller's slice", again.Request)
		}
	})
}

// TestStoreMarkServedRecordsTheResponseOnceAndNothingElse: the gate's cheap mark sets Served and ServedAt and
// leaves every other field (state, times) alone; a second mark, by MarkServed or after an Update that served,
// is refused; an Update can neither unmark nor re-date it; it survives a reopen, and a pruned or released
// payment claimed again starts unserved.
func TestStoreMarkServedRecordsTheResponseOnceAndNothingElse(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		at := time.Date(2026, 3, 1, 12, 0, 7, 123456789, time.FixedZone("CET", 3600))

		if err := s.MarkServed(ctx, claimOf(70).ID, at); !errors.Is(err, ErrNotFound) {
			t.Fatalf("MarkServed of an absent payment: %v, want ErrNotFound", err)
		}
		r := claimOf(70)
		r.Async = true
		before := mustClaim(t, s, r)
		clock.Advance(time.Second)
		if err := s.MarkServed(ctx, r.ID, at); err != nil {
			t.Fatalf("MarkServed: %v", err)
		}
		got, _, err := s.Get(ctx, r.ID)
		if err != nil || !got.Served || !got.ServedAt.Equal(at) || got.ServedAt.Location() != time.UTC {
			t.Fatalf("after MarkServed: served %v at %v, %v; want served at %s in UTC", got.Served, got.ServedAt, err, at.UTC())
		}
		if got.State != StateClaimed || !got.UpdatedAt.Equal(before.UpdatedAt) || !got.Async || string(got.Request) != string(r.Request) {
			t.Fatalf("MarkServed changed more than the mark: %+v, was %+v", got, before)
		}
		if err := s.MarkServed(ctx, r.ID, at.Add(time.Second)); !errors.Is(err, ErrServed) {
			t.Fatalf("a second MarkServed: %v, want ErrServed", err)
		}
		if _, err := s.Update(ctx, r.ID, func(r *Record) error { r.Served = false; return nil }); !errors.Is(err, ErrInvalidUpdate) {
			t.Fatalf("an Update unmarking the payment: %v, want ErrInvalidUpdate", err)
		}
		if _, err := s.Update(ctx, r.ID, func(r *Record) error { r.ServedAt = r.ServedAt.Add(-time.Hour); return nil }); !errors.Is(err, ErrInvalidUpdate) {
			t.Fatalf("an Update re-dating the mark: %v, want ErrInvalidUpdate", err)
		}
		final := mustUpdate(t, s, r.ID, toFinal(true))
		if !final.Served || !final.ServedAt.Equal(at) {
			t.Fatalf("an Update after the mark returned served %v at %s", final.Served, final.ServedAt)
		}
		s = h.reopen(t, s)
		if got, _, err := s.Get(ctx, r.ID); err != nil || !got.Served || !got.ServedAt.Equal(at) || got.State != StateFinal {
			t.Fatalf("after reopening: %s served %v at %s, %v", got.State, got.Served, got.ServedAt, err)
		}

		// Served by an Update (the gate's settled path): the mark is there for MarkServed too.
		u := mustClaim(t, s, claimOf(71))
		mustUpdate(t, s, u.ID, func(r *Record) error {
			r.Served, r.ServedAt = true, at
			return toFinal(true)(r)
		})
		if err := s.MarkServed(ctx, u.ID, at); !errors.Is(err, ErrServed) {
			t.Fatalf("MarkServed of a payment an Update served: %v, want ErrServed", err)
		}

		// A released claim, and a pruned record, claimed again: unserved.
		v := mustClaim(t, s, claimOf(72))
		if err := s.MarkServed(ctx, v.ID, at); err != nil {
			t.Fatal(err)
		}
		if err := s.Release(ctx, v); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Hour)
		if n, err := s.Prune(ctx, clock.Now()); err != nil || n != 2 {
			t.Fatalf("Prune = %d, %v; want the two final records", n, err)
		}
		for _, c := range []Record{claimOf(70), claimOf(72)} {
			again := mustClaim(t, s, c)
			if again.Served {
				t.Fatalf("%s claimed again after it was released or pruned is served", c.ID)
			}
			if err := s.MarkServed(ctx, c.ID, at); err != nil {
				t.Fatalf("MarkServed of %s claimed again: %v", c.ID, err)
			}
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := s.MarkServed(ctx, claimOf(70).ID, at); !errors.Is(err, ErrClosed) {
			t.Fatalf("MarkServed after Close: %v, want ErrClosed", err)
		}
	})
}

// TestStoreKeepsTheResourceAPaymentBuysAndNeverBindsItToAnother: the resource a gate's record names, and the
// route it was taken at, survive every write (an Update, the served mark, a reopen) and an Update that changes
// either is refused; a record without a resource (written before it was kept) may be given one.
func TestStoreKeepsTheResourceAPaymentBuysAndNeverBindsItToAnother(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, newTestClock().Now)
		ctx := context.Background()
		r := claimOf(90)
		r.Resource, r.Route = "GET example.com/big.bin?part=1", "3f2a9c"
		mustClaim(t, s, r)
		mustUpdate(t, s, r.ID, toFinal(true))
		if err := s.MarkServed(ctx, r.ID, time.Now()); err != nil {
			t.Fatal(err)
		}
		s = h.reopen(t, s)
		if got, _, err := s.Get(ctx, r.ID); err != nil || got.Resource != r.Resource || got.Route != r.Route {
			t.Fatalf("after an update, the served mark and a reopen the record buys %q at route %q (%v), want %q at %q",
				got.Resource, got.Route, err, r.Resource, r.Route)
		}
		for _, other := range []string{"GET example.com/small.txt", ""} {
			if _, err := s.Update(ctx, r.ID, func(rec *Record) error { rec.Resource = other; return nil }); !errors.Is(err, ErrInvalidUpdate) {
				t.Fatalf("an Update binding the payment to %q: %v, want ErrInvalidUpdate", other, err)
			}
			if _, err := s.Update(ctx, r.ID, func(rec *Record) error { rec.Route = other; return nil }); !errors.Is(err, ErrInvalidUpdate) {
				t.Fatalf("an Update moving the payment to route %q: %v, want ErrInvalidUpdate", other, err)
			}
		}
		old := mustClaim(t, s, claimOf(91))
		if got := mustUpdate(t, s, old.ID, func(rec *Record) error { rec.Resource = "GET example.com/a"; return nil }); got.Resource != "GET example.com/a" {
			t.Fatalf("a record without a resource given one: %q", got.Resource)
		}
	})
}

func TestStoreRefusesWorkAfterCloseOrWithADoneContext(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		if _, _, err := s.Claim(cancelled, claimOf(60)); !errors.Is(err, context.Canceled) {
			t.Fatalf("Claim with a cancelled context: %v", err)
		}
		if n, _ := s.Count(context.Background()); n != 0 {
			t.Fatalf("a cancelled Claim wrote %d records", n)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		ctx := context.Background()
		_, _, err := s.Claim(ctx, claimOf(61))
		_, _, gerr := s.Get(ctx, claimOf(61).ID)
		_, perr := s.Pending(ctx)
		for _, e := range []error{err, gerr, perr} {
			if !errors.Is(e, ErrClosed) {
				t.Fatalf("call after Close: %v, want ErrClosed", e)
			}
		}
	})
}

func TestStoreSurvivesAPanickingUpdateAmongConcurrentWriters(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		victim := mustClaim(t, s, claimOf(70)).ID
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for i := range 32 {
			wg.Go(func() {
				_, _, err := s.Claim(ctx, claimOf(100+i))
				errs <- err
			})
		}
		func() {
			defer func() {
				if v := recover(); v != "boom" {
					t.Errorf("recovered %v, want the update function's panic", v)
				}
			}()
			s.Update(ctx, victim, func(r *Record) error {
				r.State, r.TxHash = StateBroadcast, "0x70"
				panic("boom")
			})
		}()
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("concurrent claim failed beside a panicking update: %v", err)
			}
		}
		if got, _, _ := s.Get(ctx, victim); got.State != StateClaimed {
			t.Fatalf("panicking update left state %q, want claimed", got.State)
		}
		if n, _ := s.Count(ctx); n != 33 {
			t.Fatalf("Count = %d, want 33", n)
		}
	})
}

func TestStoreKeepsEveryPaymentOfManyConcurrentSettlements(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := h.open(t, nil)
		ctx := context.Background()
		const workers, each = 16, 24
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range each {
					n := 1000 + w*each + i
					r, claimed, err := s.Claim(ctx, claimOf(n))
					if err == nil && !claimed {
						err = fmt.Errorf("payment %d was already claimed", n)
					}
					if err == nil {
						_, err = s.Update(ctx, r.ID, toBroadcast(fmt.Sprintf("0x%x", n)))
					}
					if err == nil && i%2 == 0 {
						_, err = s.Update(ctx, r.ID, toFinal(true))
					}
					if err != nil {
						t.Errorf("worker %d: %v", w, err)
						return
					}
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			return
		}
		s = h.reopen(t, s)
		if n, _ := s.Count(ctx); n != workers*each {
			t.Fatalf("Count = %d, want %d", n, workers*each)
		}
		pending, err := s.Pending(ctx)
		if err != nil || len(pending) != workers*each/2 {
			t.Fatalf("Pending = %d records, %v; want %d", len(pending), err, workers*each/2)
		}
		for _, r := range pending {
			if r.State != StateBroadcast || r.TxHash == "" {
				t.Fatalf("pending record %s = %q %q, want broadcast with a hash", r.ID, r.State, r.TxHash)
			}
		}
	})
}
