package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"testing"
	"time"
)

// TestPostgresAClaimWithItsHoldAndSignedTransactionIsOneRoundTripAndWritesNothingItMayNotSend: HoldClaimAndSign
// writes the claim with its hold and makes it broadcast with the signed transaction in one batch, the gate's record
// riding in front. A payment another recorded is neither held nor claimed; a payer whose funds fall short and a
// wallet lease not held at the fence leave the claim (the caller's to release) and no record of the transaction,
// which the settlement may not send; a gate's record that rode in front is written.
func TestPostgresAClaimWithItsHoldAndSignedTransactionIsOneRoundTripAndWritesNothingItMayNotSend(t *testing.T) {
	throughEitherWay(t, testPostgresAClaimWithItsHoldAndSignedTransactionIsOneRoundTripAndWritesNothingItMayNotSend)
}

func testPostgresAClaimWithItsHoldAndSignedTransactionIsOneRoundTripAndWritesNothingItMayNotSend(t *testing.T, dsn string, n int) {
	bg := context.Background()
	rt := &batchCount{}
	s := openPostgres(t, dsn, Options{Tracer: rt})
	other := openPostgres(t, dsn, Options{})
	base := 33000 + 10*n
	key := fmt.Sprintf("claim-hold-sign:%d", n)
	lease := fmt.Sprintf("wallet-cs%d", n)
	l, err := s.Lease(bg, lease, time.Minute)
	if err != nil || !l.Held {
		t.Fatalf("Lease = %+v, %v", l, err)
	}
	sign := func(r *Record) error {
		r.State, r.Wallet, r.TxNonce, r.TxHash, r.RawTx = StateBroadcast, "0x0000000000000000000000000000000000000001", 7, "0xabc", []byte{1, 2, 3}
		r.Attempts++
		return nil
	}
	found := func(k int) (Record, bool) {
		t.Helper()
		r, ok, err := other.Get(bg, claimOf(k).ID)
		if err != nil {
			t.Fatal(err)
		}
		return r, ok
	}
	claimedOnly := func(what string, k int, held bool) {
		t.Helper()
		if r, ok := found(k); !ok || r.State != StateClaimed || r.TxHash != "" {
			t.Errorf("%s: the record is %+v (found %v); want the claim, no transaction recorded", what, r, ok)
		}
		if got := holdRows(t, other, key, claimOf(k).ID); (len(got) == 1) != held {
			t.Errorf("%s: the holds are %v; want held %v", what, got, held)
		}
	}

	// Written and held, the gate's record riding in front: one round trip.
	ctx := Defer(bg, s)
	_, _, later, err := ClaimBehind(ctx, s, claimOf(base))
	if err != nil {
		t.Fatal(err)
	}
	rt.take()
	out, err := HoldClaimAndSign(ctx, s, holdOf(base+1, key, 60), big.NewInt(100), 1, 1, claimOf(base+1), lease, l.Fence, sign)
	if err != nil || !out.Claimed || !out.Held || !out.Signed || out.Broadcast.State != StateBroadcast || out.Broadcast.TxHash != "0xabc" ||
		out.Broadcast.Attempts != 1 || out.Rec.State != StateClaimed || out.Rec.ClaimedAt.IsZero() || !out.Broadcast.SameClaim(&out.Rec) {
		t.Fatalf("HoldClaimAndSign of a new payment = %+v, %v; want it claimed, held and made broadcast, its claim stamped", out, err)
	}
	if sent := rt.take(); len(sent) != 1 {
		t.Errorf("HoldClaimAndSign carrying a gate's record cost %d round trips, want 1: %q", len(sent), sent)
	}
	if err := later.Land(); err != nil {
		t.Fatalf("the gate's record riding with the claim landed %v", err)
	}
	if _, ok := found(base); !ok {
		t.Fatal("the gate's record that rode with the claim was not written")
	}
	if r, ok := found(base + 1); !ok || r.State != StateBroadcast || string(r.RawTx) != "\x01\x02\x03" || !r.SameClaim(&out.Rec) {
		t.Fatalf("the record = %+v (found %v); want the broadcast record HoldClaimAndSign answered", r, ok)
	}
	if got := holdRows(t, other, key, claimOf(base+1).ID); len(got) != 1 || got[0] != "60" {
		t.Fatalf("the hold = %v; want one of 60", got)
	}

	// Another's claim and hold there: nothing of the loser's is written, and the other's hold stays.
	theirs := claimOf(base + 2)
	theirs.Owner = "process-b"
	if _, claimed, err := other.Claim(bg, theirs); err != nil || !claimed {
		t.Fatal(claimed, err)
	}
	if ok, _, err := other.Hold(bg, holdOf(base+2, key, 30), big.NewInt(100), 1, 1, true); err != nil || !ok {
		t.Fatal(ok, err)
	}
	out, err = HoldClaimAndSign(bg, s, holdOf(base+2, key, 30), big.NewInt(100), 1, 1, claimOf(base+2), lease, l.Fence, sign)
	if err != nil || out.Claimed || out.Signed || out.Rec.Owner != "process-b" || out.Rec.State != StateClaimed {
		t.Fatalf("HoldClaimAndSign of a payment another claimed = %+v, %v; want it found, the other's record answered", out, err)
	}
	if got := holdRows(t, other, key, claimOf(base+2).ID); len(got) != 1 || got[0] != "30" {
		t.Fatalf("the other's hold after the loser's HoldClaimAndSign = %v; want it as it was, 30", got)
	}

	// Past the funds (60 and 30 held of 100): the claim written, not held, not made broadcast.
	out, err = HoldClaimAndSign(bg, s, holdOf(base+3, key, 11), big.NewInt(100), 1, 1, claimOf(base+3), lease, l.Fence, sign)
	if err != nil || !out.Claimed || out.Held || out.Signed || out.Left.Int64() != 10 {
		t.Fatalf("HoldClaimAndSign past the funds = %+v, %v; want it claimed, not held, not signed, 10 left", out, err)
	}
	claimedOnly("a hold refused for want of funds", base+3, false)

	// The lease not held at the fence, or never taken: ErrFenced; the claim and the hold written, not made
	// broadcast; the gate's record that rode in front written.
	for i, try := range []struct {
		name  string
		lease string
		fence uint64
	}{
		{"at an older fence", lease, l.Fence - 1},
		{"of a lease nobody ever took", lease + "-none", 1},
	} {
		ctx := Defer(bg, s)
		_, _, later, err := ClaimBehind(ctx, s, claimOf(base+4+2*i))
		if err != nil {
			t.Fatal(err)
		}
		k := base + 5 + 2*i
		out, err := HoldClaimAndSign(ctx, s, holdOf(k, key, 1), big.NewInt(100), 1, 1, claimOf(k), try.lease, try.fence, sign)
		if !errors.Is(err, ErrFenced) || !out.Claimed || !out.Held || out.Signed {
			t.Fatalf("HoldClaimAndSign %s = %+v, %v; want ErrFenced, claimed and held, not signed", try.name, out, err)
		}
		claimedOnly("HoldClaimAndSign "+try.name, k, true)
		if err := later.Land(); err != nil {
			t.Fatalf("the gate's record that rode with a write %s landed %v", try.name, err)
		}
		if _, ok := found(base + 4 + 2*i); !ok {
			t.Fatalf("the gate's record that rode with a write %s was not written", try.name)
		}
	}
}
