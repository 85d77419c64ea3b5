package journal

import (
	"context"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAVoucherStepAndItsRecordAreOneCommit is VoucherRecords on every store (on PostgreSQL one statement, where
// it took AcceptVoucher and Claim apart, and a database stopped between them left an accepted voucher with no
// record, lost once the channel's next voucher was accepted): the step and the voucher's record are written
// together, in one bbolt commit; a refused step writes no record; a record already there is answered and kept;
// a record Claim would refuse fails the call before anything is written; a reopen keeps both.
func TestAVoucherStepAndItsRecordAreOneCommit(t *testing.T) {
	implemented := map[string]bool{"memory": true, "bolt": true, "postgres": true, "postgres-pgbouncer": true}
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		vr, ok := s.(VoucherRecords)
		if want, known := implemented[h.name]; !known || ok != want {
			t.Fatalf("%T keeps VoucherRecords: %v; this test expects %v", s, ok, want)
		}
		if !ok {
			return
		}
		ctx := context.Background()
		key := chanKey(7)
		mustObserve(t, channelsOf(t, s), depositRead(key, 100, 3))
		recOf := func(to int64, route string) Record {
			r := claimOf(int(to))
			r.ID = BatchVoucherID(testNetwork, key.ID, big.NewInt(to).String())
			r.State, r.Route = StateFinal, route
			r.Response = &x402.SettleResponse{Success: true, Network: testNetwork, Payer: testPayer, Amount: "10"}
			return r
		}
		commits := func() int64 {
			if b, ok := s.(*BoltStore); ok {
				return b.commits.Load()
			}
			return 0
		}
		wantRecord := func(what string, id ID, want bool, route string) {
			t.Helper()
			got, found, err := s.Get(ctx, id)
			if err != nil || found != want || (want && (got.Route != route || got.State != StateFinal)) {
				t.Fatalf("%s: the record %s found %v (%v), route %q, state %s; want found %v, route %q, final", what, id, found, err, got.Route, got.State, want, route)
			}
		}

		before := commits()
		row, got, err := vr.AcceptVoucherRecord(ctx, key, big.NewInt(0), big.NewInt(10), voucherOf(10), recOf(10, "mine"))
		if err != nil || row.Charged.Int64() != 10 || got.ID != recOf(10, "").ID || got.Route != "mine" || !got.ClaimedAt.Equal(clock.Now()) {
			t.Fatalf("the first step: row at %v, record %s route %q claimed at %v, %v; want 10, its record, now", row.Charged, got.ID, got.Route, got.ClaimedAt, err)
		}
		if _, isBolt := s.(*BoltStore); isBolt && commits()-before != 1 {
			t.Fatalf("the step and its record took %d bbolt commits, want 1", commits()-before)
		}
		wantRow(t, channelsOf(t, s), key, 10, 1, 0, "")
		wantRecord("the first step", got.ID, true, "mine")

		for _, refused := range []struct {
			name     string
			from, to int64
			want     error
		}{
			{"a replay", 0, 10, ErrChannelMoved},
			{"a step from an amount passed", 0, 20, ErrChannelMoved},
			{"a step above the deposit", 10, 101, ErrAboveDeposit},
		} {
			rec := recOf(refused.to, "replayed")
			if refused.to == 10 {
				rec.ID = recOf(11, "").ID // not the record of the step taken, which stays as it is
			}
			_, got, err := vr.AcceptVoucherRecord(ctx, key, big.NewInt(refused.from), big.NewInt(refused.to), voucherOf(refused.to), rec)
			if !errors.Is(err, refused.want) || got.ID != (ID{}) {
				t.Fatalf("%s: %v, record %s; want %v and no record", refused.name, err, got.ID, refused.want)
			}
			wantRow(t, channelsOf(t, s), key, 10, 1, 0, "")
			wantRecord(refused.name, rec.ID, false, "")
		}
		wantRecord("after the refusals", recOf(10, "").ID, true, "mine")

		// A record Claim refuses (not claimed or final) fails the call and the step is not taken.
		bad := recOf(20, "mine")
		bad.State = StateBroadcast
		if _, _, err := vr.AcceptVoucherRecord(ctx, key, big.NewInt(10), big.NewInt(20), voucherOf(20), bad); !errors.Is(err, ErrInvalidUpdate) {
			t.Fatalf("a step with a record Claim refuses: %v, want ErrInvalidUpdate", err)
		}
		wantRow(t, channelsOf(t, s), key, 10, 1, 0, "")
		wantRecord("a refused record", bad.ID, false, "")
		// A record that cannot be encoded (a time past year 9999) fails it too, with nothing written: bbolt's group
		// commit keeps whatever an operation wrote unless it failed writing, so the encoding comes first.
		unencodable := recOf(20, "mine")
		unencodable.Deadline = time.Date(10001, 1, 1, 0, 0, 0, 0, time.UTC)
		if _, _, err := vr.AcceptVoucherRecord(ctx, key, big.NewInt(10), big.NewInt(20), voucherOf(20), unencodable); err == nil {
			t.Fatal("a step with a record that cannot be encoded was taken")
		}
		wantRow(t, channelsOf(t, s), key, 10, 1, 0, "")
		wantRecord("an unencodable record", unencodable.ID, false, "")

		// A record already there (written by a voucher that crashed before, say) is answered, and kept.
		clock.Advance(time.Second)
		mustClaim(t, s, recOf(20, "other"))
		row, got, err = vr.AcceptVoucherRecord(ctx, key, big.NewInt(10), big.NewInt(20), voucherOf(20), recOf(20, "mine"))
		if err != nil || row.Charged.Int64() != 20 || got.Route != "other" {
			t.Fatalf("a step whose record is there: row at %v, record route %q, %v; want 20 and the record there (other)", row.Charged, got.Route, err)
		}
		wantRecord("a record there", got.ID, true, "other")

		if h.reopen != nil {
			s = h.reopen(t, s)
			wantRow(t, channelsOf(t, s), key, 20, 2, 0, "")
			wantRecord("after a reopen", recOf(10, "").ID, true, "mine")
		}
	})
}

func TestARecordNoteBuysTheResourceAtItsRouteOrAtTheSamePrice(t *testing.T) {
	rec := Record{Route: "r#0", Resource: "GET example.com/a", Described: "d", Amount: "1000"}
	for _, c := range []struct {
		name string
		note RecordNote
		buys bool
	}{
		{"its route, matching the offer", RecordNote{Route: "r#0", Resource: "GET example.com/a", Described: "d", Amount: "1000"}, true},
		{"its route, judged by its record (the offer changed)", RecordNote{Route: "r#0", Resource: "GET example.com/a", Described: "d"}, true},
		{"a renumbered route at its price", RecordNote{Route: "r#1", Resource: "GET example.com/a", Described: "d", Amount: "1000"}, true},
		{"another route at another price", RecordNote{Route: "r#1", Resource: "GET example.com/a", Described: "d", Amount: "1500"}, false},
		{"another route matching no offer", RecordNote{Route: "r#1", Resource: "GET example.com/a", Described: "d"}, false},
		{"another resource at its route", RecordNote{Route: "r#0", Resource: "GET example.com/b", Described: "d", Amount: "1000"}, false},
		{"another method", RecordNote{Route: "r#0", Resource: "HEAD example.com/a", Described: "d", Amount: "1000"}, false},
		{"described otherwise at its route, judged by its record", RecordNote{Route: "r#0", Resource: "GET example.com/a", Described: "e"}, false},
		{"described otherwise at its route at its price", RecordNote{Route: "r#0", Resource: "GET example.com/a", Described: "e", Amount: "1000"}, true},
		{"described otherwise at another route at its price", RecordNote{Route: "r#1", Resource: "GET example.com/a", Described: "e", Amount: "1000"}, true},
		{"described otherwise at another route at another price", RecordNote{Route: "r#1", Resource: "GET example.com/a", Described: "e", Amount: "1500"}, false},
		{"no resource noted", RecordNote{Route: "r#0", Described: "d", Amount: "1000"}, false},
	} {
		if got := c.note.Buys(rec); got != c.buys {
			t.Errorf("%s: Buys = %v; want %v", c.name, got, c.buys)
		}
	}
}
