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
