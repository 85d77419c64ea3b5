package journal

import (
	"context"
	"errors"
	"math/big"
	"strconv"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestPostgresUpdateKnownHoldMinedEndsTheHoldWithTheRecord: UpdateKnownHoldMined ends a payment's funds hold and
// writes its record's final answer together; a record changed since it was known gets the change judged against
// it as stored, after the hold's end; a change refused writes the hold's end alone, never the record without it.
func TestPostgresUpdateKnownHoldMinedEndsTheHoldWithTheRecord(t *testing.T) {
	throughEitherWay(t, testPostgresUpdateKnownHoldMinedEndsTheHoldWithTheRecord)
}

func testPostgresUpdateKnownHoldMinedEndsTheHoldWithTheRecord(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	key := "hold-mined:" + strconv.Itoa(n)
	broadcastHeld := func(k int) Record {
		t.Helper()
		r, _, err := a.Claim(ctx, claimOf(k+n))
		if err != nil {
			t.Fatal(err)
		}
		if ok, _, err := a.Hold(ctx, Hold{ID: r.ID, Key: key, Amount: big.NewInt(10), Deadline: 2000}, big.NewInt(1000), 1, 1, true); !ok || err != nil {
			t.Fatalf("Hold = %v, %v", ok, err)
		}
		sent, err := a.Update(ctx, r.ID, toBroadcast("0x0"+strconv.Itoa(k)))
		if err != nil {
			t.Fatal(err)
		}
		return sent
	}
	mined := func(id ID) uint64 {
		t.Helper()
		holds, err := b.HoldsOf(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range holds {
			if h.ID == id {
				return h.Mined
			}
		}
		t.Fatalf("no hold of %s", id)
		return 0
	}
	final := func(r *Record) error {
		if r.State == StateFinal {
			return nil
		}
		r.State, r.Response = StateFinal, &x402.SettleResponse{Success: true, Transaction: r.TxHash, Network: testNetwork, Payer: testPayer}
		return nil
	}

	r := broadcastHeld(9601)
	got, err := UpdateKnownHoldMined(ctx, a, r, 42, final)
	if err != nil || got.State != StateFinal {
		t.Fatalf("UpdateKnownHoldMined of the record as broadcast = %+v, %v; want it final", got, err)
	}
	if rec, _, err := b.Get(ctx, r.ID); err != nil || rec.State != StateFinal || mined(r.ID) != 42 {
		t.Fatalf("as another store reads them: the record %s (%v), the hold mined at %d; want final, mined at 42", rec.State, err, mined(r.ID))
	}
	if !markedMinedAt(t, b, r.ID) {
		t.Fatal("the hold was marked mined without the time of its mark")
	}

	// Changed since (another transaction of the payment recorded by another store): written through Update.
	r = broadcastHeld(9602)
	again, err := b.Update(ctx, r.ID, func(r *Record) error { r.Attempts++; return nil })
	if err != nil {
		t.Fatal(err)
	}
	got, err = UpdateKnownHoldMined(ctx, a, r, 43, final)
	if err != nil || got.State != StateFinal || got.Attempts != again.Attempts || mined(r.ID) != 43 {
		t.Fatalf("UpdateKnownHoldMined of a record changed since = %+v, %v, hold mined at %d; want the stored record made final, mined at 43",
			got, err, mined(r.ID))
	}

	// Refused: the hold's end alone.
	r = broadcastHeld(9603)
	if _, err := UpdateKnownHoldMined(ctx, a, r, 44, func(*Record) error { return errors.New("no") }); err == nil {
		t.Fatalf("UpdateKnownHoldMined refused by its function wrote")
	}
	if rec, _, err := b.Get(ctx, r.ID); err != nil || rec.State != StateBroadcast || mined(r.ID) != 44 {
		t.Fatalf("after a refused UpdateKnownHoldMined: the record %s (%v), the hold mined at %d; want broadcast, mined at 44", rec.State, err, mined(r.ID))
	}
}
