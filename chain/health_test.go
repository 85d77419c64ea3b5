package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestHealthShowsASettlementInFlightAndPendingUntilItIsMined: while a settlement waits for its block, /health's
// engine says its wallet carries it (inFlight 1) and the journal holds it as a pending settlement; once mined,
// both are back to 0. A settlement is no refusal.
func TestHealthShowsASettlementInFlightAndPendingUntilItIsMined(t *testing.T) {
	fx := newFixture(t, fixtureOpts{wallets: 1, autoCommit: -1, receiptTimeout: time.Minute})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)

	done := make(chan x402.SettleResponse, 1)
	go func() {
		resp, err := fx.f.Settle(context.Background(), req)
		if err != nil {
			t.Errorf("settle: %v", err)
		}
		done <- resp
	}()
	var h x402.NetworkHealth
	for deadline := time.Now().Add(30 * time.Second); ; {
		h = health(t, fx).Networks[0]
		if h.PendingSettlements == 1 && len(h.Wallets) == 1 && h.Wallets[0].InFlight == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the settlement waiting for its block never showed: network health %+v", h)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if h.JournalBacklog != 1 {
		t.Errorf("journal backlog %d while one settlement waits, want 1", h.JournalBacklog)
	}
	if h.OldestPendingSeconds < 0 || h.OldestPendingSeconds > 30 {
		t.Errorf("the oldest pending settlement was claimed %v s ago, want between 0 and the 30 s the test waited", h.OldestPendingSeconds)
	}

	var resp x402.SettleResponse
	for settled := false; !settled; {
		fx.c.Commit()
		select {
		case resp = <-done:
			settled = true
		case <-time.After(20 * time.Millisecond):
		}
	}
	if !resp.Success {
		t.Fatalf("the settlement = %+v, want success", resp)
	}
	after := health(t, fx)
	if n := after.Networks[0]; n.PendingSettlements != 0 || n.Wallets[0].InFlight != 0 || n.JournalBacklog != 0 {
		t.Errorf("after the settlement was mined: pending %d, in flight %d, backlog %d; want 0, 0, 0", n.PendingSettlements, n.Wallets[0].InFlight, n.JournalBacklog)
	}
	if r := after.Refusals; r == nil || r.Total != 0 || len(r.Recent) != 0 {
		t.Errorf("refusals after one good settlement = %+v, want none", r)
	}
}

// TestHealthCountsRefusalsByReasonAndListsTheLatestFirst: a payment the payer cannot fund is refused by /verify
// and by /settle; /health counts both under the network and reason, and lists the settle first (the latest),
// naming the payer. A good payment adds nothing.
func TestHealthCountsRefusalsByReasonAndListsTheLatestFirst(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	good := fx.c.Payers[0]
	fx.approvePermit2(good)
	if resp := fx.settle(fx.payment(x402.TransferPermit2, good)); !resp.Success {
		t.Fatalf("a good payment = %+v, want settled", resp)
	}
	broke := chaintest.DeriveAccount("health-refusals-broke-payer", 0)
	req := fx.permit2(broke, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	v := fx.verify(req)
	if v.IsValid || v.InvalidReason == "" {
		t.Fatalf("verify of an unfunded payer's payment = %+v, want refused with a reason", v)
	}
	s := fx.settle(req)
	if s.Success || s.ErrorReason == "" {
		t.Fatalf("settle of an unfunded payer's payment = %+v, want refused with a reason", s)
	}

	r := health(t, fx).Refusals
	if r == nil {
		t.Fatal("health has no refusals")
	}
	if r.Total != 2 {
		t.Errorf("refusals total %d, want 2", r.Total)
	}
	want := map[string]int{v.InvalidReason: 1}
	want[s.ErrorReason]++
	got := map[string]int{}
	for _, c := range r.Counts {
		if c.Network != fx.net {
			t.Errorf("a refusal counted on %q, want %q", c.Network, fx.net)
		}
		got[c.Reason] += c.Count
	}
	if len(got) != len(want) || got[v.InvalidReason] != want[v.InvalidReason] || got[s.ErrorReason] != want[s.ErrorReason] {
		t.Errorf("refusal counts %+v, want %v", r.Counts, want)
	}
	if len(r.Recent) != 2 {
		t.Fatalf("recent refusals %+v, want 2", r.Recent)
	}
	if r.Recent[0].Op != "settle" || r.Recent[0].Reason != s.ErrorReason || r.Recent[1].Op != "verify" || r.Recent[1].Reason != v.InvalidReason {
		t.Errorf("recent refusals %+v, want the settle then the verify", r.Recent)
	}
	for _, one := range r.Recent {
		if one.Payer != broke.Address.Hex() || one.Network != fx.net || one.At.IsZero() {
			t.Errorf("recent refusal %+v, want payer %s on %s, with its time", one, broke.Address.Hex(), fx.net)
		}
	}
}

func health(t *testing.T, fx *fixture) x402.HealthResponse {
	t.Helper()
	h, err := fx.f.Health(context.Background())
	if err != nil {
		t.Fatalf("health: %v", err)
	}
	if len(h.Networks) != 1 {
		t.Fatalf("health has %d networks, want 1: %+v", len(h.Networks), h)
	}
	return h
}
