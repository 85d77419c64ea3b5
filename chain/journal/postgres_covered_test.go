package journal

import (
	"context"
	"math/big"
	"strconv"
	"testing"
)

// TestPostgresUnrecordedAndCoveredReadsTheRecordAndTheHoldsAtOnce: a payment the journal holds a record of is not
// answered from the holds; one it holds none of is covered as Hold without take says, and nothing is written.
func TestPostgresUnrecordedAndCoveredReadsTheRecordAndTheHoldsAtOnce(t *testing.T) {
	throughEitherWay(t, testPostgresUnrecordedAndCoveredReadsTheRecordAndTheHoldsAtOnce)
}

func testPostgresUnrecordedAndCoveredReadsTheRecordAndTheHoldsAtOnce(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	key := "covered:" + strconv.Itoa(n)
	other := Hold{ID: claimOf(9501 + n).ID, Key: key, Amount: big.NewInt(60), Deadline: 2000}
	if ok, _, err := b.Hold(ctx, other, big.NewInt(100), 1, 1, true); !ok || err != nil {
		t.Fatalf("Hold = %v, %v", ok, err)
	}
	h := Hold{ID: claimOf(9502 + n).ID, Key: key, Amount: big.NewInt(40), Deadline: 2000}
	for _, tc := range []struct {
		avail  int64
		wantOK bool
	}{{100, true}, {99, false}} {
		unrecorded, ok, left, err := UnrecordedAndCovered(ctx, a, h, big.NewInt(tc.avail), 1, 1)
		if err != nil || !unrecorded || ok != tc.wantOK || left.Int64() != tc.avail-60 {
			t.Fatalf("UnrecordedAndCovered with %d available = unrecorded %v, ok %v, left %v, %v; want unrecorded, ok %v, left %d",
				tc.avail, unrecorded, ok, left, err, tc.wantOK, tc.avail-60)
		}
	}
	if holds, err := a.HoldsOf(ctx, key); err != nil || len(holds) != 1 {
		t.Fatalf("holds after UnrecordedAndCovered = %v, %v; want the other payment's alone", holds, err)
	}
	if _, _, err := b.Claim(ctx, claimOf(9502+n)); err != nil {
		t.Fatal(err)
	}
	if unrecorded, ok, _, err := UnrecordedAndCovered(ctx, a, h, big.NewInt(1000), 1, 1); err != nil || unrecorded || ok {
		t.Fatalf("UnrecordedAndCovered of a recorded payment = unrecorded %v, ok %v, %v; want recorded, not answered", unrecorded, ok, err)
	}
}

// TestPostgresUnrecordedAndHeldHoldsOnlyAPaymentWithoutARecord: the hold is taken, in the transaction that reads
// whether the payment has a record, only when it has none; a recorded payment's transaction holds nothing.
func TestPostgresUnrecordedAndHeldHoldsOnlyAPaymentWithoutARecord(t *testing.T) {
	throughEitherWay(t, testPostgresUnrecordedAndHeldHoldsOnlyAPaymentWithoutARecord)
}

func testPostgresUnrecordedAndHeldHoldsOnlyAPaymentWithoutARecord(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	key := "held:" + strconv.Itoa(n)
	recorded := Hold{ID: claimOf(9511 + n).ID, Key: key, Amount: big.NewInt(40), Deadline: 2000, Served: true}
	if _, _, err := b.Claim(ctx, claimOf(9511+n)); err != nil {
		t.Fatal(err)
	}
	if unrecorded, ok, _, err := UnrecordedAndHeld(ctx, a, recorded, big.NewInt(100), 1, 1); err != nil || unrecorded || ok {
		t.Fatalf("UnrecordedAndHeld of a recorded payment = unrecorded %v, ok %v, %v; want recorded, not held", unrecorded, ok, err)
	}
	if holds, err := b.HoldsOf(ctx, key); err != nil || len(holds) != 0 {
		t.Fatalf("holds after UnrecordedAndHeld of a recorded payment = %v, %v; want none", holds, err)
	}
	h := Hold{ID: claimOf(9512 + n).ID, Key: key, Amount: big.NewInt(40), Deadline: 2000, Served: true}
	if unrecorded, ok, left, err := UnrecordedAndHeld(ctx, a, h, big.NewInt(100), 1, 1); err != nil || !unrecorded || !ok || left.Int64() != 100 {
		t.Fatalf("UnrecordedAndHeld of a payment without a record = unrecorded %v, ok %v, left %v, %v; want held, 100 left beside it", unrecorded, ok, left, err)
	}
	if holds, err := b.HoldsOf(ctx, key); err != nil || len(holds) != 1 || holds[0].ID != h.ID || !holds[0].Served {
		t.Fatalf("holds after UnrecordedAndHeld = %+v, %v; want h's, served", holds, err)
	}
	// Beside it, 60 is left: a payment of 70 is not covered, and not held.
	over := Hold{ID: claimOf(9513 + n).ID, Key: key, Amount: big.NewInt(70), Deadline: 2000}
	if unrecorded, ok, _, err := UnrecordedAndHeld(ctx, a, over, big.NewInt(100), 1, 1); err != nil || !unrecorded || ok {
		t.Fatalf("UnrecordedAndHeld past the funds = unrecorded %v, ok %v, %v; want unrecorded, not covered", unrecorded, ok, err)
	}
}
