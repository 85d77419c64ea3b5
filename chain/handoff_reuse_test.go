package chain_test

import (
	"context"
	"encoding/json"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAPaymentWaitedForIsNeverAnsweredWithTheSettlementOfAnotherPaymentOfItsNonce: a payer signs two permit2
// payments with one nonce, P1 to the seller and P2 to an address of its own. P1 is claimed on an engine that holds
// no wallet, which hands its settlement off and waits (the engine holding the wallet takes nothing), and P1 is
// presented again on a third engine, which waits for that claim to move. Meanwhile the claim goes and P2 is
// claimed and settled in its stead (the claimant's claim released, as after its no_available_wallets answer or
// when it looked dead to a reconciler, and P2, presented again and again by the payer, claimed by the next
// gateway at once: here both in one write, between two reads of the waiters). Neither waiter may answer P1 with
// P2's settlement, which paid the payer itself: a gate would serve P1's resource unpaid. Each must refuse P1,
// whose nonce is spent.
func TestAPaymentWaitedForIsNeverAnsweredWithTheSettlementOfAnotherPaymentOfItsNonce(t *testing.T) {
	// A lease of 12 s: the stalled holder's lease must outlast the whole test on a loaded machine; with 3 s it
	// lapsed under CI's load, a waiter took the wallet and settled P1, and P2 reverted on its spent nonce.
	fx, engines, stores := sharedEnginesOn(t, pgtest.Shared(t), 3, 12*time.Second, fixtureOpts{wallets: 1, receiptTimeout: time.Minute,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.WalletWait = 20 * time.Second }})
	held := waitEven(t, fx, engines, 1)
	holder := 0
	for i := range held {
		if len(held[i]) > 0 {
			holder = i
		}
	}
	engines[holder].StallLeasesForTest() // takes no hand-off: the one waiting goes on waiting
	var waiters []*chain.Facilitator
	for i, e := range engines {
		if i != holder {
			waiters = append(waiters, e)
		}
	}
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	nonce := big.NewInt(4_020_402)
	p1 := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{Nonce: nonce})
	own := fx.requirements(x402.TransferPermit2)
	own.PayTo = payer.Address.Hex()
	p2 := fx.permit2(payer, own, chain.Permit2Options{Nonce: nonce})
	sellerBefore := fx.c.TokenBalance(fx.payTo)

	type answer struct {
		s   x402.SettleResponse
		err error
	}
	answers := make(chan answer, 2)
	go func() { s, err := waiters[0].Settle(context.Background(), p1); answers <- answer{s, err} }()
	var rec journal.Record
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs, err := stores[holder].PendingOf(context.Background(), false)
		if err == nil && len(recs) == 1 && recs[0].Handoff != nil {
			rec = recs[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("P1 was never handed off: pending %v, %v", recs, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	go func() { s, err := waiters[1].Settle(context.Background(), p1); answers <- answer{s, err} }()
	time.Sleep(300 * time.Millisecond) // the third engine waits for the claim to move

	// P2 settles (through an engine of its own journal, on the same chain: the gateway that claimed it).
	s2 := fx.settle(p2)
	if !s2.Success {
		t.Fatalf("P2 settled as %+v; want settled", s2)
	}
	body, _ := json.Marshal(p2)
	if _, err := stores[holder].Update(context.Background(), rec.ID, func(r *journal.Record) error {
		r.Owner, r.Handoff = stores[holder].Instance(), nil
		r.Request, r.PayTo = body, payer.Address.Hex()
		r.State, r.Response, r.TxHash = journal.StateFinal, &s2, s2.Transaction
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	for range 2 {
		select {
		case a := <-answers:
			if a.err == nil && a.s.Success {
				t.Errorf("P1 answered settled, with transaction %s, which settled P2 (paid to the payer itself); want P1 refused, its nonce spent", a.s.Transaction)
			} else if a.err != nil || a.s.ErrorReason != x402.ReasonPermit2InvalidNonce {
				t.Errorf("P1 answered %+v, %v; want %s (its nonce spent by another payment)", a.s, a.err, x402.ReasonPermit2InvalidNonce)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("a settlement of P1 waiting on the journal never answered")
		}
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Sign() != 0 {
		t.Errorf("the seller received %s", got)
	}
}
