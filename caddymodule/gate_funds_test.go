package caddymodule_test

import (
	"math/big"
	"net/http"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A gate that serves before it settles holds each payment against the payer's funds: a payer who can pay for
// three responses and presents five distinct payments before any settles is served three, and the other two are
// refused with a 402 that says why, before the upstream runs. The three then settle, exactly.
func TestSettleAsyncServesAPayerNoMoreThanThePayerCanPay(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{
		gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr, noCommit: true,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(3 * gatePrice))},
	})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)

	var served, refused int
	for i := range 5 {
		a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
		switch a.status {
		case http.StatusOK:
			served++
			if resp := settleResponse(t, a); resp.ErrorReason != x402.ReasonSettlementPending {
				t.Errorf("payment %d served with PAYMENT-RESPONSE %+v; want settlement_pending", i, resp)
			}
		case http.StatusPaymentRequired:
			refused++
			if msg := requiredError(t, a); !strings.Contains(msg, x402.ReasonInsufficientFunds) {
				t.Errorf("payment %d refused saying %q; want it to name insufficient_funds", i, msg)
			}
		default:
			t.Fatalf("payment %d answered %d %q", i, a.status, a.body)
		}
	}
	if served != 3 || refused != 2 {
		t.Fatalf("%d served and %d refused, want 3 and 2", served, refused)
	}
	if got := up.calls.Load(); got != 3 {
		t.Errorf("the upstream ran %d times, want 3", got)
	}
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(payer, before, 3)
}
