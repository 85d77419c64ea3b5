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

// feeQuoteDown answers 503 to what only a settlement asks the node (its transactions' priority fee); a
// verification gets through.
func feeQuoteDown(method string) chaintest.Fault {
	if method == "eth_maxPriorityFeePerGas" {
		return chaintest.ErrorStatus
	}
	return chaintest.Pass
}

// holdsFixture is an engine behind a fault proxy, with one payer whose funds cover one payment and who approved
// Permit2, and two payments of that payer.
func holdsFixture(t *testing.T) (fx *fixture, proxy *chaintest.FaultProxy, first, second x402.VerifyRequest) {
	fx = newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithTokenBalance(big.NewInt(price))},
		tune:      behindFaultProxy(t, &proxy, false, 0),
	})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	return fx, proxy, fx.permit2(payer, rq, chain.Permit2Options{}), fx.permit2(payer, rq, chain.Permit2Options{})
}

// A settlement that could not ask the node for its transaction's fee sent nothing and is not refused: it is
// answered as a facilitator that could not be reached, which a gate tries again (or tells the payer to present
// the payment again), never unexpected_settle_error, which a gate that served the payment retries only a few
// times before it gives the payment up unpaid. Once the node answers, the same payment settles, once.
func TestASettlementThatCouldNotAskTheNodeForItsFeeIsUnreachableNotRefused(t *testing.T) {
	fx, proxy, first, _ := holdsFixture(t)
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	proxy.SetDecide(feeQuoteDown)
	resp, err := fx.f.Settle(context.Background(), first)
	if !x402.IsUnreachable(err) {
		t.Fatalf("a settlement whose fee could not be read answered %+v, %v; want an unreachable error", resp, err)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(sellerBefore) != 0 {
		t.Fatalf("the seller's balance moved from %s to %s: something was sent", sellerBefore, got)
	}
	proxy.SetDecide(nil)
	if s := fx.settle(first); !s.Success {
		t.Fatalf("the same payment once the node answered: %+v, want it settled", s)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != price {
		t.Errorf("the seller received %s, want %d", got, price)
	}
}

// A payment held for a gate that served it before settling (VerifyAndHold) stays held while its settlement fails
// for now: the payer's next payment, which its funds do not cover beside it, is refused, and the served one
// settles once the node answers. A payment held only by its own settlement (nobody served it) is let go when
// that settlement fails, and a served payment whose gate gives it up (Release) is let go too: the payer's next
// payment is then valid.
func TestAServedPaymentStaysHeldWhileItsSettlementFailsForNow(t *testing.T) {
	ctx := context.Background()
	t.Run("served", func(t *testing.T) {
		fx, proxy, first, second := holdsFixture(t)
		if v, err := fx.f.VerifyAndHold(ctx, first); err != nil || !v.IsValid {
			t.Fatalf("the first payment: %+v, %v", v, err)
		}
		proxy.SetDecide(feeQuoteDown)
		if resp, err := fx.f.Settle(ctx, first); err == nil && (resp.Success || resp.Pending()) {
			t.Fatalf("the first payment's settlement with the node down answered %+v", resp)
		}
		proxy.SetDecide(nil)
		if v, err := fx.f.VerifyAndHold(ctx, second); err != nil || v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
			t.Fatalf("the second payment while the first is unsettled: %+v, %v; want refused for insufficient_funds", v, err)
		}
		if s := fx.settle(first); !s.Success {
			t.Fatalf("the first payment once the node answered: %+v", s)
		}
		if got := fx.c.CountTokenTransfers(fx.c.Payers[0].Address, fx.payTo); got != 1 {
			t.Errorf("%d transfers from the payer, want 1", got)
		}
	})
	t.Run("settling only", func(t *testing.T) {
		fx, proxy, first, second := holdsFixture(t)
		proxy.SetDecide(feeQuoteDown)
		if resp, err := fx.f.Settle(ctx, first); err == nil && (resp.Success || resp.Pending()) {
			t.Fatalf("the first payment's settlement with the node down answered %+v", resp)
		}
		proxy.SetDecide(nil)
		if v := fx.verify(second); !v.IsValid {
			t.Fatalf("the second payment after the first one's settlement failed, nobody having served it: %+v; want valid", v)
		}
	})
	t.Run("released", func(t *testing.T) {
		fx, proxy, first, second := holdsFixture(t)
		if v, err := fx.f.VerifyAndHold(ctx, first); err != nil || !v.IsValid {
			t.Fatalf("the first payment: %+v, %v", v, err)
		}
		proxy.SetDecide(feeQuoteDown)
		_, _ = fx.f.Settle(ctx, first)
		proxy.SetDecide(nil)
		fx.f.Release(first)
		if v := fx.verify(second); !v.IsValid {
			t.Fatalf("the second payment after the first was released: %+v; want valid", v)
		}
	})
}

// The holds of a cluster live in its journal: a payment one instance served and held stays held while another
// instance's settlement of it fails for now, and every instance counts it: the payer's next payment is refused
// on either. The payment then settles once.
func TestAServedPaymentsSharedHoldOutlivesAnotherInstancesFailedSettlement(t *testing.T) {
	var proxy *chaintest.FaultProxy
	fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 2, 2*time.Second, fixtureOpts{
		wallets: 4, chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithTokenBalance(big.NewInt(price))},
		tune: behindFaultProxy(t, &proxy, false, 0),
	})
	a, b := engines[0], engines[1]
	waitLeases(t, fx, engines, 2, 2)
	ctx := context.Background()
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	first, second := fx.permit2(payer, rq, chain.Permit2Options{}), fx.permit2(payer, rq, chain.Permit2Options{})
	if v, err := a.VerifyAndHold(ctx, first); err != nil || !v.IsValid {
		t.Fatalf("the first payment on A: %+v, %v", v, err)
	}
	proxy.SetDecide(feeQuoteDown)
	if resp, err := b.Settle(ctx, first); err == nil && (resp.Success || resp.Pending()) {
		t.Fatalf("B's settlement of the first payment with the node down answered %+v", resp)
	}
	proxy.SetDecide(nil)
	for name, e := range map[string]*chain.Facilitator{"A": a, "B": b} {
		if v, err := e.VerifyAndHold(ctx, second); err != nil || v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
			t.Errorf("the second payment on %s while the first is unsettled: %+v, %v; want refused for insufficient_funds", name, v, err)
		}
	}
	if s, err := b.Settle(ctx, first); err != nil || !s.Success {
		t.Fatalf("the first payment once the node answered: %+v, %v", s, err)
	}
	if got := fx.c.CountTokenTransfers(payer.Address, fx.payTo); got != 1 {
		t.Errorf("%d transfers from the payer, want 1", got)
	}
}
