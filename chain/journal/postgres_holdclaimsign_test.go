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
// writes the payment's record, broadcast with the signed transaction, and its hold in one batch, the gate's record
// riding in front; a payment another recorded, a payer whose funds fall short and a wallet lease not held at the
// fence each leave nothing of the settlement's written (no record of a transaction it may not send, no hold), and
// a gate's record that rode with a transaction the lease refused is written alone all the same.
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
	nothing := func(what string, k int) {
		t.Helper()
		if r, ok := found(k); ok {
			t.Errorf("%s: a record was written: %+v", what, r)
		}
		if got := holdRows(t, other, key, claimOf(k).ID); len(got) != 0 {
			t.Errorf("%s: a hold was written: %v", what, got)
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
	if err != nil || !out.Written || out.Rec.State != StateBroadcast || out.Rec.TxHash != "0xabc" || out.Rec.Attempts != 1 ||
		out.Claim.State != StateClaimed || out.Claim.ClaimedAt.IsZero() || !out.Rec.SameClaim(&out.Claim) {
		t.Fatalf("HoldClaimAndSign of a new payment = %+v, %v; want it written broadcast, its claim stamped", out, err)
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
	if r, ok := found(base + 1); !ok || r.State != StateBroadcast || string(r.RawTx) != "\x01\x02\x03" || !r.SameClaim(&out.Claim) {
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
	if err != nil || out.Written || !out.Found || out.Rec.Owner != "process-b" || out.Rec.State != StateClaimed {
		t.Fatalf("HoldClaimAndSign of a payment another claimed = %+v, %v; want it found, the other's record answered", out, err)
	}
	if got := holdRows(t, other, key, claimOf(base+2).ID); len(got) != 1 || got[0] != "30" {
		t.Fatalf("the other's hold after the loser's HoldClaimAndSign = %v; want it as it was, 30", got)
	}

	// Past the funds (60 and 30 held of 100): nothing written, the claim included.
	out, err = HoldClaimAndSign(bg, s, holdOf(base+3, key, 11), big.NewInt(100), 1, 1, claimOf(base+3), lease, l.Fence, sign)
	if err != nil || out.Written || out.Found || !out.Refused || out.Left.Int64() != 10 {
		t.Fatalf("HoldClaimAndSign past the funds = %+v, %v; want it refused, 10 left", out, err)
	}
	nothing("a hold refused for want of funds", base+3)

	// The lease not held at the fence, or never taken: ErrFenced, nothing written; the gate's record that rode in
	// front is written alone.
	for name, try := range map[string]struct {
		lease string
		fence uint64
	}{
		"at an older fence":           {lease, l.Fence - 1},
		"of a lease nobody ever took": {lease + "-none", 1},
	} {
		ctx := Defer(bg, s)
		_, _, later, err := ClaimBehind(ctx, s, claimOf(base+4))
		if err != nil {
			t.Fatal(err)
		}
		out, err := HoldClaimAndSign(ctx, s, holdOf(base+5, key, 1), big.NewInt(100), 1, 1, claimOf(base+5), try.lease, try.fence, sign)
		if !errors.Is(err, ErrFenced) || out.Written {
			t.Fatalf("HoldClaimAndSign %s = %+v, %v; want ErrFenced", name, out, err)
		}
		nothing("HoldClaimAndSign "+name, base+5)
		if err := later.Land(); err != nil && !errors.Is(err, ErrExists) {
			t.Fatalf("the gate's record that rode with a fenced write landed %v", err)
		}
		if _, ok := found(base + 4); !ok {
			t.Fatalf("the gate's record that rode with a write %s was not written", name)
		}
	}
}
