package chain_test

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// heldFees is a node whose fee suggestion waits until held is closed: a settlement stops there, after it took its
// wallet and before it records anything.
type heldFees struct {
	chain.Backend
	held chan struct{}
}

func (b heldFees) SuggestGasTipCap(ctx context.Context) (*big.Int, error) {
	select {
	case <-b.held:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return b.Backend.SuggestGasTipCap(ctx)
}

// TestAClaimantWhoseHandedOffSettlementWasTakenAnswersWithinTheReceiptTimeoutWhenTheJournalGoes: an engine holding
// no wallet hands a settlement off, the engine holding the wallet takes it (and is slow to send it), and the
// journal's database goes down. The claimant cannot learn the outcome; it must answer as its own settlement
// would, once the receipt timeout has passed (not final: the payer presents the payment again), not wait on a
// database that is gone for as long as its caller lets it. Nothing is sent: the taker cannot record its
// transaction.
func TestAClaimantWhoseHandedOffSettlementWasTakenAnswersWithinTheReceiptTimeoutWhenTheJournalGoes(t *testing.T) {
	const receiptTimeout = 2 * time.Second
	srv := pgtest.Start(t)
	held := make(chan struct{})
	fx, engines, stores := sharedEnginesOn(t, srv.DSN(), 2, 3*time.Second, fixtureOpts{wallets: 1, receiptTimeout: receiptTimeout,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.Backend = heldFees{Backend: nc.Backend, held: held} }})
	leases := waitEven(t, fx, engines, 1)
	taker, claimant := 0, 1
	if len(leases[0]) == 0 {
		taker, claimant = 1, 0
	}
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	before := fx.walletTxs()

	type answer struct {
		s   x402.SettleResponse
		err error
	}
	answers := make(chan answer, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	go func() { s, err := engines[claimant].Settle(ctx, req); answers <- answer{s, err} }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs, err := stores[taker].PendingOf(context.Background(), false)
		if err == nil && len(recs) == 1 && recs[0].Handoff != nil && recs[0].Handoff.Taker == stores[taker].Instance() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hand-off was never taken: pending %+v, %v", recs, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the claimant reads the record taken
	srv.Stop(t)
	down := time.Now()
	defer srv.Restart(t) // for the engines' and stores' cleanup
	select {
	case a := <-answers:
		took := time.Since(down)
		if took > receiptTimeout+3*time.Second {
			t.Errorf("the claimant answered %v after the journal went; want within the receipt timeout (%v) and a little", took.Round(time.Second), receiptTimeout)
		}
		if a.err == nil && (a.s.Success || !a.s.Pending()) {
			t.Errorf("the claimant answered %+v; want no final answer (an error, or settlement_pending)", a.s)
		}
		t.Logf("answered %v after the journal went: %+v, %v", took.Round(10*time.Millisecond), a.s, a.err)
	case <-time.After(45 * time.Second):
		t.Fatal("the claimant never answered")
	}
	close(held)
	time.Sleep(500 * time.Millisecond)
	if n, _ := fx.sentSince(before); n != 0 {
		t.Errorf("%d transactions sent while the journal was down; want none", n)
	}
}
