package gate_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAnUptoPaymentChargedNothingGrantsNoAccess: an upto payment the upstream charged nothing for moves nothing
// on chain; it buys its response, and no grant (before: the payer signed in for 100 requests, having paid 0).
func TestAnUptoPaymentChargedNothingGrantsNoAccess(t *testing.T) {
	e := newEnv(t, setup{settle: gate.SettleAfter, scheme: x402.SchemeUpto, override: func(*http.Request) string { return `{"amount":"0"}` },
		config: func(cfg *gate.Config) { cfg.Access = &gate.Access{For: time.Hour, Requests: 100} }})
	payer := e.c.Payers[0]
	before := e.balances(payer)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	lost, gained := e.paid(payer, before)
	a := e.signIn(payer)
	if lost.Sign() != 0 || gained.Sign() != 0 {
		t.Fatalf("the payer lost %s and the seller gained %s for a payment charged nothing", lost, gained)
	}
	if a.status != http.StatusPaymentRequired {
		t.Errorf("a sign-in after a payment that moved nothing = %d %q; want 402 (no grant)", a.status, a.body)
	}
}
