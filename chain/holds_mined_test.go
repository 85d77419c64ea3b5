package chain_test

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment held on one instance and mined stays counted for every instance whose funds read is older than its
// block, however many holds of the payer newer reads take meanwhile. The payer can pay two payments. A reads the
// payer's funds and holds X; X settles. B, reading after X's block (one payment left), holds Y. A, still
// answering from its read before X's block (a read answers for FundsCacheTTL), must count X: Z is refused for
// insufficient funds, not served beside Y with the payer's last payment already spent.
func TestAMinedHoldCountsForAnotherInstancesOlderReadAfterANewerHold(t *testing.T) {
	fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 2, 2*time.Second, fixtureOpts{
		wallets: 4, chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(2 * price))},
		tune: func(_ *fixture, c *chain.NetworkConfig) { c.FundsCacheTTL = time.Minute },
	})
	a, b := engines[0], engines[1]
	waitLeases(t, fx, engines, 2, 2)
	ctx := context.Background()
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	x, y, z := fx.permit2(payer, rq, chain.Permit2Options{}), fx.permit2(payer, rq, chain.Permit2Options{}), fx.permit2(payer, rq, chain.Permit2Options{})
	if v, err := a.VerifyAndHold(ctx, x); err != nil || !v.IsValid {
		t.Fatalf("X on A: %+v, %v", v, err)
	}
	if s, err := a.Settle(ctx, x); err != nil || !s.Success {
		t.Fatalf("X's settlement: %+v, %v", s, err)
	}
	if v, err := b.VerifyAndHold(ctx, y); err != nil || !v.IsValid {
		t.Fatalf("Y on B, the payer's last payment: %+v, %v", v, err)
	}
	if v, err := a.VerifyAndHold(ctx, z); err != nil || v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
		t.Fatalf("Z on A, after X spent one of the payer's two payments and Y holds the other: %+v, %v; want refused for insufficient_funds "+
			"(served, it would be a response nobody can pay: balance %s, one payment is %d)", v, err, fx.c.TokenBalance(payer.Address), price)
	}
}
