package journal

import (
	"context"
	"errors"
	"math/big"
	"strconv"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestPostgresADeferredWriteRidesWithTheNextStatementAndNothingOvertakesIt: a claim deferred in a request's context
// is not written until the store sends something for that context; then it goes first, whatever the call (a read
// sees it); another context does not send it. A deferred claim that finds a record there fails the batch it rides
// in: the claim carrying it is not written either, its outcome says ErrExists, and nothing the context sends after
// it runs. Left alone, a deferred write
// goes by itself after maxBehind.
func TestPostgresADeferredWriteRidesWithTheNextStatementAndNothingOvertakesIt(t *testing.T) {
	throughEitherWay(t, testPostgresADeferredWriteRidesWithTheNextStatementAndNothingOvertakesIt)
}

func testPostgresADeferredWriteRidesWithTheNextStatementAndNothingOvertakesIt(t *testing.T, dsn string, n int) {
	s := openPostgres(t, dsn, Options{})
	other := openPostgres(t, dsn, Options{})
	bg := context.Background()
	base := 9000 + 10*n
	found := func(st Store, ctx context.Context, k int) bool {
		t.Helper()
		_, ok, err := st.Get(ctx, claimOf(k).ID)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// Queued, then sent by the context's next call, a read.
	ctx := Defer(bg, s)
	if Defer(ctx, s) != ctx {
		t.Fatal("Defer of a context that carries a queue made another")
	}
	if _, claimed, later, err := ClaimBehind(ctx, s, claimOf(base)); err != nil || !claimed || later == nil {
		t.Fatalf("ClaimBehind = %v, %v, %v; want it queued", claimed, later, err)
	}
	if found(other, bg, base) || found(s, bg, base) {
		t.Fatal("a deferred claim was written before its context sent anything")
	}
	if !found(s, ctx, base) {
		t.Fatal("a read of the deferring context did not see its deferred claim: it was overtaken")
	}

	// Carried in the batch of the next Claim: both written.
	ctx = Defer(bg, s)
	_, _, later, err := ClaimBehind(ctx, s, claimOf(base+1))
	if err != nil {
		t.Fatal(err)
	}
	if _, claimed, err := s.Claim(ctx, claimOf(base+2)); err != nil || !claimed {
		t.Fatalf("the Claim carrying a deferred claim = %v, %v", claimed, err)
	}
	if err := later.Land(); err != nil || !found(other, bg, base+1) || !found(other, bg, base+2) {
		t.Fatalf("the deferred claim landed %v; want both claims written", err)
	}

	// A deferred claim of a record there fails the batch: the carrying claim is not written.
	if _, _, err := other.Claim(bg, claimOf(base+3)); err != nil {
		t.Fatal(err)
	}
	ctx = Defer(bg, s)
	_, claimed, later, err := ClaimBehind(ctx, s, claimOf(base+3))
	if err != nil || !claimed {
		t.Fatalf("ClaimBehind = %v, %v", claimed, err)
	}
	if _, claimed, err := s.Claim(ctx, claimOf(base+4)); err == nil || claimed {
		t.Fatalf("the Claim carrying a deferred claim that conflicts = %v, %v; want an error, nothing claimed", claimed, err)
	}
	if err := later.Land(); !errors.Is(err, ErrExists) {
		t.Fatalf("the conflicting deferred claim landed %v; want ErrExists", err)
	}
	if found(other, bg, base+4) {
		t.Fatal("the claim that carried a deferred claim that failed was written")
	}
	// Nothing the context sends after it runs, whatever the call; the end of its request's flush has nothing to say.
	if _, _, err := s.Get(ctx, claimOf(base+4).ID); err == nil {
		t.Fatal("a read of a context whose deferred claim failed ran")
	}
	if _, claimed, err := s.Claim(ctx, claimOf(base+4)); err == nil || claimed || found(other, bg, base+4) {
		t.Fatalf("a Claim of a context whose deferred claim failed = %v, %v; want an error, nothing claimed", claimed, err)
	}
	if err := Flush(ctx); err != nil {
		t.Fatalf("Flush of a context whose deferred claim failed, with nothing queued = %v", err)
	}

	// Left alone, it goes after maxBehind.
	ctx = Defer(bg, s)
	if _, _, _, err := ClaimBehind(ctx, s, claimOf(base+5)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(defaultMaxBehind + 5*time.Second)
	for !found(other, bg, base+5) {
		if time.Now().After(deadline) {
			t.Fatalf("a deferred claim left alone was not written %s after", defaultMaxBehind+5*time.Second)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// Any other store: written at once.
	m := NewMemory(Options{})
	if Defer(bg, m) != bg {
		t.Fatal("Defer of a memory store made a queue")
	}
	if _, claimed, later, err := ClaimBehind(bg, m, claimOf(base+6)); err != nil || !claimed || later != nil || !found(m, bg, base+6) {
		t.Fatalf("ClaimBehind of a memory store = %v, %v, %v; want it written at once", claimed, later, err)
	}
}

// TestPostgresADeferredFinalAnswerRidesWithTheGatesAndFallsBackWhenTheRecordChanged: the engine's final answer and
// its hold's end, deferred, ride in the batch of the gate's UpdateKnownIdle; a record changed before it lands (by
// reconciliation) gets the change judged as it stands, and the hold's end is written all the same.
func TestPostgresADeferredFinalAnswerRidesWithTheGatesAndFallsBackWhenTheRecordChanged(t *testing.T) {
	throughEitherWay(t, testPostgresADeferredFinalAnswerRidesWithTheGatesAndFallsBackWhenTheRecordChanged)
}

func testPostgresADeferredFinalAnswerRidesWithTheGatesAndFallsBackWhenTheRecordChanged(t *testing.T, dsn string, n int) {
	s, other := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	bg := context.Background()
	key := "behind:" + strconv.Itoa(n)
	for i, changed := range []bool{false, true} {
		k := 9500 + 10*n + 2*i
		engine, _, err := s.Claim(bg, claimOf(k))
		if err != nil {
			t.Fatal(err)
		}
		if ok, _, err := s.Hold(bg, Hold{ID: engine.ID, Key: key, Amount: big.NewInt(10), Deadline: 2000}, big.NewInt(1000), 1, 1, true); !ok || err != nil {
			t.Fatalf("Hold = %v, %v", ok, err)
		}
		if engine, err = s.Update(bg, engine.ID, toBroadcast("0x0"+strconv.Itoa(k))); err != nil {
			t.Fatal(err)
		}
		gateRec, _, err := s.Claim(bg, claimOf(k+1))
		if err != nil {
			t.Fatal(err)
		}
		ctx := Defer(bg, s)
		landed := make(chan error, 1)
		final := func(r *Record) error {
			if r.State == StateFinal {
				return nil
			}
			r.State, r.Response = StateFinal, &x402.SettleResponse{Success: true, Transaction: r.TxHash, Network: testNetwork, Payer: testPayer}
			return nil
		}
		if _, deferred := UpdateKnownHoldMinedBehind(ctx, s, engine, 7, final, func(err error) { landed <- err }); !deferred {
			t.Fatal("the final answer was not deferred")
		}
		if changed {
			// Reconciliation records it first, with an answer of its own.
			if _, err := other.Update(bg, engine.ID, func(r *Record) error {
				r.State, r.Response = StateFinal, &x402.SettleResponse{Success: true, Transaction: "0xreconciled", Network: testNetwork, Payer: testPayer}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
		} else if r, _, _ := other.Get(bg, engine.ID); r.State != StateBroadcast {
			t.Fatalf("before the gate's write the engine's record is %s; want broadcast, its final answer deferred", r.State)
		}
		if _, idled, err := UpdateKnownIdle(ctx, s, gateRec, toFinal(true)); err != nil || !idled {
			t.Fatalf("the gate's final write = %v, %v", idled, err)
		}
		if err := <-landed; err != nil {
			t.Fatalf("the deferred final answer landed %v", err)
		}
		r, _, err := other.Get(bg, engine.ID)
		want := "0x0" + strconv.Itoa(k)
		if changed {
			want = "0xreconciled"
		}
		if err != nil || r.State != StateFinal || r.Response.Transaction != want {
			t.Fatalf("the engine's record = %s answering %+v (%v); want final answering %s", r.State, r.Response, err, want)
		}
		holds, err := other.HoldsOf(bg, key)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range holds {
			if h.ID == engine.ID && h.Mined != 7 {
				t.Fatalf("the hold's end = %d; want block 7, written with the final answer", h.Mined)
			}
			if h.ID == engine.ID && !markedMinedAt(t, other, h.ID) {
				t.Fatal("the deferred final write marked the hold mined without the time of its mark")
			}
		}
	}
}
