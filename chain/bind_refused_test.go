package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment refused binds nothing to the wallet it names: payments anyone can sign (here, a payer without the
// Permit2 approval) naming each wallet, each refused, do not keep the wallets an engine gives up to an engine that
// joins from going (bindingGrace, 30 s, runs from the last payment found valid against the wallet), nor pin them
// unused meanwhile. TestAWalletBeingGivenUpStillSettlesThePaymentsVerifiedAgainstIt holds the valid ones' grace.
func TestRefusedPaymentsNamingAWalletDoNotKeepItFromBeingGivenUp(t *testing.T) {
	fx, join := clusterOn(t, pgtest.Shared(t), 3*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute})
	first, _ := join()
	waitEven(t, fx, []*chain.Facilitator{first}, 2)
	for _, w := range fx.c.Wallets[:2] {
		req := fx.permit2(fx.c.Payers[0], fx.uptoRequirements(w.Address), chain.Permit2Options{})
		v, err := first.Verify(context.Background(), req)
		if err != nil || v.IsValid || v.InvalidReason == x402.ReasonUptoFacilitatorMismatch {
			t.Fatalf("an upto payment bound to %s, its payer without the approval = %+v, %v; want refused for that", w.Address.Hex(), v, err)
		}
	}
	second, _ := join()
	deadline := time.Now().Add(15 * time.Second)
	for len(second.LeasedWallets(fx.net)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the engine that joined holds %v after 15 s, the first %v: refused payments kept the first's wallets from going",
				second.LeasedWallets(fx.net), first.LeasedWallets(fx.net))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
