package journal

import (
	"context"
	"errors"
	"math/big"
	"strconv"
	"testing"
)

// TestPostgresAGatesDeferredMarkRidesInTheEnginesBatchAndGuardsItsHold: a gate's in-flight mark and read of its
// record, deferred (MarkAndGetBehind), ride in the engine's next batch under the verification's context, in front
// of its statements: its hold with take (UnrecordedAndHeld), its read of the holds (UnrecordedAndCovered), or its
// Hold without take; one round trip in all, and Land then tells what they found without sending anything. A hold
// with take under the mark's guard is taken only for a payment whose mark is this instance's and of which the
// gate holds no record: another instance's mark in flight, or a gate record of the payment (presented again, its
// engine record not written yet), hold nothing (ErrNotMarked), and leave the hold already there as it is; a guard
// that refused refuses every later hold of its verification without sending it. With nothing carrying them, Land
// sends the mark and the read alone.
func TestPostgresAGatesDeferredMarkRidesInTheEnginesBatchAndGuardsItsHold(t *testing.T) {
	throughEitherWay(t, testPostgresAGatesDeferredMarkRidesInTheEnginesBatchAndGuardsItsHold)
}

func testPostgresAGatesDeferredMarkRidesInTheEnginesBatchAndGuardsItsHold(t *testing.T, dsn string, n int) {
	bg := context.Background()
	rt := &batchCount{}
	s := openPostgres(t, dsn, Options{Tracer: rt})
	other := openPostgres(t, dsn, Options{})
	key := "guard:" + strconv.Itoa(n)
	base := 31000 + 10*n
	gateID := func(k int) ID {
		return PaymentID(testNetwork, "gate/permit2", testAsset, testPayer, strconv.Itoa(base+k))
	}
	hold := func(k int) Hold {
		return Hold{ID: claimOf(base + k).ID, Key: key, Amount: big.NewInt(10), Deadline: 2000, Served: true}
	}
	held := func() []ID {
		t.Helper()
		holds, err := s.HoldsOf(bg, key)
		if err != nil {
			t.Fatal(err)
		}
		var ids []ID
		for _, h := range holds {
			ids = append(ids, h.ID)
		}
		return ids
	}
	land := func(what string, m *Marked, wantMarked, wantFound bool) {
		t.Helper()
		rt.take()
		marked, rec, found, err := m.Land()
		if err != nil || marked != wantMarked || found != wantFound || (found && rec.ID != m.id) {
			t.Fatalf("%s: Land = marked %v, found %v (%s), %v; want marked %v, found %v", what, marked, found, rec.ID, err, wantMarked, wantFound)
		}
		if sent := rt.take(); len(sent) != 0 {
			t.Fatalf("%s: Land sent %q once the engine's batch carried the mark; want nothing", what, sent)
		}
	}

	// Neither marked elsewhere nor recorded: held, in one round trip with the mark and the read.
	vctx, m := MarkAndGetBehind(Defer(bg, s), s, gateID(1))
	noted := false
	WhenMarked(vctx, func() { noted = true })
	if noted || NotMarked(vctx) {
		t.Fatalf("before its mark landed: WhenMarked ran %v, NotMarked %v; want neither", noted, NotMarked(vctx))
	}
	rt.take()
	if unrecorded, ok, _, err := UnrecordedAndHeld(vctx, s, hold(1), big.NewInt(100), 1, 1); err != nil || !unrecorded || !ok {
		t.Fatalf("a hold under a mark of its own = unrecorded %v, ok %v, %v; want held", unrecorded, ok, err)
	}
	if sent := rt.take(); len(sent) != 1 {
		t.Fatalf("the hold carrying the mark cost %d round trips, want 1: %q", len(sent), sent)
	}
	land("a payment of its own", m, true, false)
	if !noted || NotMarked(vctx) {
		t.Fatalf("once its own mark landed: WhenMarked ran %v, NotMarked %v; want it run, and marked", noted, NotMarked(vctx))
	}
	if ids := held(); len(ids) != 1 || ids[0] != hold(1).ID {
		t.Fatalf("holds = %v; want the payment's", ids)
	}

	// Another instance's mark in flight: nothing held, whichever hold asks; the guard refuses the next one unsent.
	if marked, err := other.Busy(bg, gateID(2)); err != nil || !marked {
		t.Fatalf("the other instance's mark = %v, %v", marked, err)
	}
	vctx, m = MarkAndGetBehind(Defer(bg, s), s, gateID(2))
	if _, ok, _, err := UnrecordedAndHeld(vctx, s, hold(2), big.NewInt(100), 1, 1); !errors.Is(err, ErrNotMarked) || ok {
		t.Fatalf("a hold of a payment another instance has in flight = %v, %v; want ErrNotMarked", ok, err)
	}
	land("another instance's payment", m, false, false)
	if !NotMarked(vctx) {
		t.Fatal("NotMarked of a verification whose guard landed refusing = false")
	}
	noted = false
	WhenMarked(vctx, func() { noted = true })
	if noted {
		t.Fatal("WhenMarked ran its function for a payment another instance has in flight")
	}
	if ok, _, err := s.Hold(vctx, hold(2), big.NewInt(100), 1, 1, true); !errors.Is(err, ErrNotMarked) || ok {
		t.Fatalf("Hold with take after the guard refused = %v, %v; want ErrNotMarked", ok, err)
	}
	if sent := rt.take(); len(sent) != 0 {
		t.Fatalf("a hold its guard refused sent %q; want nothing", sent)
	}
	// The same with the hold already there (the other instance's request held it): left as it is.
	if ok, _, err := other.Hold(bg, hold(3), big.NewInt(100), 1, 1, true); err != nil || !ok {
		t.Fatalf("the other instance's hold = %v, %v", ok, err)
	}
	if marked, err := other.Busy(bg, gateID(3)); err != nil || !marked {
		t.Fatalf("the other instance's mark = %v, %v", marked, err)
	}
	vctx, m = MarkAndGetBehind(Defer(bg, s), s, gateID(3))
	if ok, _, err := s.Hold(vctx, hold(3), big.NewInt(100), 1, 1, true); !errors.Is(err, ErrNotMarked) || ok {
		t.Fatalf("Hold with take of a payment another instance has in flight = %v, %v; want ErrNotMarked", ok, err)
	}
	land("another instance's held payment", m, false, false)

	// The gate holds a record of the payment, the engine none yet (an async payment served, not settled): nothing
	// held; read with the holds (sync), the record is found all the same.
	if _, _, err := other.Claim(bg, Record{ID: gateID(4), State: StateClaimed, Async: true, Network: testNetwork, Payer: testPayer,
		Amount: "10", Request: []byte(`{"x402Version":2}`), Owner: "process-b"}); err != nil {
		t.Fatal(err)
	}
	vctx, m = MarkAndGetBehind(Defer(bg, s), s, gateID(4))
	if _, ok, _, err := UnrecordedAndHeld(vctx, s, hold(4), big.NewInt(100), 1, 1); !errors.Is(err, ErrNotMarked) || ok {
		t.Fatalf("a hold of a payment the gate recorded = %v, %v; want ErrNotMarked", ok, err)
	}
	land("a payment presented again", m, true, true)
	vctx, m = MarkAndGetBehind(Defer(bg, s), s, gateID(4))
	rt.take()
	if unrecorded, ok, _, err := UnrecordedAndCovered(vctx, s, hold(4), big.NewInt(100), 1, 1); err != nil || !unrecorded || !ok {
		t.Fatalf("the holds read with the mark = unrecorded %v, ok %v, %v", unrecorded, ok, err)
	}
	if ok, _, err := s.Hold(vctx, hold(5), big.NewInt(100), 1, 1, false); err != nil || !ok {
		t.Fatalf("Hold without take = %v, %v", ok, err)
	}
	if sent := rt.take(); len(sent) != 2 {
		t.Fatalf("two reads of the holds, the first carrying the mark, cost %d round trips, want 2: %q", len(sent), sent)
	}
	land("a payment presented again, read with the holds", m, true, true)
	if ids := held(); len(ids) != 2 || ids[0] != hold(1).ID || ids[1] != hold(3).ID {
		t.Fatalf("holds = %v; want only the first payment's and the other instance's", ids)
	}

	// Nothing carried it: Land sends the mark and the read, alone.
	_, m = MarkAndGetBehind(Defer(bg, s), s, gateID(6))
	rt.take()
	if marked, _, found, err := m.Land(); err != nil || !marked || found {
		t.Fatalf("Land of a mark nothing carried = %v, %v, %v", marked, found, err)
	}
	if sent := rt.take(); len(sent) != 1 {
		t.Fatalf("Land of a mark nothing carried cost %d round trips, want 1: %q", len(sent), sent)
	}

	// No queue, or another store: nothing deferred.
	if _, m := MarkAndGetBehind(bg, s, gateID(7)); m != nil {
		t.Fatal("MarkAndGetBehind without a queue deferred something")
	}
}
