package gate_test

import (
	"context"
	"math/big"
	"net/http"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// uptoCase is one answer of an upstream behind an upto gate and what the payer must be charged for it.
type uptoCase struct {
	name     string
	override string // the upstream's Settlement-Overrides header; "" for none
	charged  int64
}

// payUpto pays the upto gate of e once, with the upstream answering override, and checks the answer and the
// chain against the charge: the response, PAYMENT-RESPONSE and {http.x402.amount} name it, exactly it moved (by
// one transfer, or none for zero), and the header did not reach the client.
func payUpto(t *testing.T, e *env, tc uptoCase) {
	t.Helper()
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	transfers := e.c.CountTokenTransfers(payer.Address, e.payTo)

	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("%s: paid request = %d %q, want 200 with the upstream's content", tc.name, a.status, a.body)
	}
	if v := a.header.Values(x402.HeaderSettlementOverrides); len(v) != 0 {
		t.Errorf("%s: the client got the upstream's Settlement-Overrides %q", tc.name, v)
	}
	resp, err := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
	if err != nil || !resp.Success || resp.Amount != big.NewInt(tc.charged).String() {
		t.Fatalf("%s: PAYMENT-RESPONSE = %+v (%v), want a success naming amount %d", tc.name, resp, err, tc.charged)
	}
	if (tc.charged == 0) != (resp.Transaction == "") {
		t.Errorf("%s: PAYMENT-RESPONSE transaction %q for a charge of %d: want one exactly when something moved", tc.name, resp.Transaction, tc.charged)
	}
	lost, gained := e.paid(payer, before)
	if lost.Int64() != tc.charged || gained.Int64() != tc.charged {
		t.Errorf("%s: the payer lost %s and the seller gained %s, want exactly %d each", tc.name, lost, gained, tc.charged)
	}
	wantTransfers := 1
	if tc.charged == 0 {
		wantTransfers = 0
	}
	if n := e.c.CountTokenTransfers(payer.Address, e.payTo) - transfers; n != wantTransfers {
		t.Errorf("%s: %d token transfers, want %d", tc.name, n, wantTransfers)
	}
	if got := e.vars.get(gate.VarAmount); got != big.NewInt(tc.charged).String() {
		t.Errorf("%s: {http.x402.amount} = %q, want %d", tc.name, got, tc.charged)
	}
	if again := e.get(x402.HeaderPaymentSignature, header); again.status != http.StatusPaymentRequired {
		t.Errorf("%s: the same payment presented again = %d %q, want 402: it bought its one response", tc.name, again.status, again.body)
	}
}

func TestAnUptoPaymentIsChargedWhatTheUpstreamNamesAndNoMoreThanItsMaximum(t *testing.T) {
	var override string
	e := newEnv(t, setup{scheme: x402.SchemeUpto, override: func(*http.Request) string { return override }})
	pr := e.offer()
	if pr.Scheme != x402.SchemeUpto || pr.Amount != "10000" || !x402.IsHexAddress(pr.Extra.FacilitatorAddress) {
		t.Fatalf("offer = %+v, want upto of at most 10000 naming a facilitator address", pr)
	}
	for _, tc := range []uptoCase{
		{"raw units below the maximum", `{"amount":"2500"}`, 2500},
		{"dollars", `{"amount":"$0.004"}`, 4000},
		{"a percentage", `{"amount":"12.5%"}`, 1250},
		{"exactly the maximum", `{"amount":"10000"}`, 10000},
		{"above the maximum: the maximum", `{"amount":"20000"}`, 10000},
		{"zero: nothing is sent", `{"amount":"0"}`, 0},
		{"no override: the maximum (default_amount max)", "", 10000},
		{"a number, not a string: the default", `{"amount":2500}`, 10000},
		{"not JSON: the default", `$0.002`, 10000},
	} {
		override = tc.override
		payUpto(t, e, tc)
	}
}

func TestWithDefaultAmountZeroAnUptoPaymentTheUpstreamNamesNoAmountForIsFree(t *testing.T) {
	var override string
	e := newEnv(t, setup{scheme: x402.SchemeUpto, defaultAmount: gate.DefaultAmountZero, override: func(*http.Request) string { return override }})
	for _, tc := range []uptoCase{
		{"no override", "", 0},
		{"a malformed override", `{"amount":"lots"}`, 0},
		{"an amount", `{"amount":"3000"}`, 3000},
	} {
		override = tc.override
		payUpto(t, e, tc)
	}
}

func TestAnUpstreamErrorChargesAnUptoPaymentNothingAndHidesItsOverride(t *testing.T) {
	e := newEnv(t, setup{scheme: x402.SchemeUpto, override: func(*http.Request) string { return `{"amount":"5000"}` }})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	e.failing.Store(true)
	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusServiceUnavailable || a.header.Get(x402.HeaderSettlementOverrides) != "" {
		t.Fatalf("failing upstream = %d, Settlement-Overrides %q; want its 503 without the header", a.status, a.header.Get(x402.HeaderSettlementOverrides))
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Fatalf("the payer lost %s and the seller gained %s for an error, want nothing", lost, gained)
	}
	e.failing.Store(false)
	payUpto(t, e, uptoCase{"the same payment once the upstream works", `{"amount":"5000"}`, 5000})
}

func TestASettleAsyncUptoPaymentIsSettledInTheBackgroundForTheAmountTheUpstreamNamed(t *testing.T) {
	e := newEnv(t, setup{settle: gate.SettleAsync, scheme: x402.SchemeUpto,
		override: func(*http.Request) string { return `{"amount":"$0.0035"}` }})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK || a.header.Get(x402.HeaderSettlementOverrides) != "" {
		t.Fatalf("async paid request = %d %q (Settlement-Overrides %q), want 200 without the header", a.status, a.body, a.header.Get(x402.HeaderSettlementOverrides))
	}
	if got := e.vars.get(gate.VarAmount); got != "3500" {
		t.Errorf("{http.x402.amount} = %q, want the charge 3500", got)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		lost, gained := e.paid(payer, before)
		if lost.Int64() == 3500 && gained.Int64() == 3500 {
			break
		}
		if lost.Sign() != 0 || time.Now().After(deadline) {
			t.Fatalf("the payer lost %s and the seller gained %s, want exactly 3500 each once settled", lost, gained)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for time.Now().Before(deadline) && e.gate.Ledger().Backlog() != 0 {
		time.Sleep(20 * time.Millisecond)
	}
	if n := e.gate.Ledger().Backlog(); n != 0 {
		t.Errorf("backlog %d after the settlement, want 0", n)
	}
	p, err := x402.DecodePaymentPayload(header)
	if err != nil {
		t.Fatal(err)
	}
	from, nonce := p.Payload.PayerAndNonce()
	r, ok, err := e.store.Get(context.Background(), journal.PaymentID(e.net, "gate/"+x402.TransferPermit2, p.Accepted.Asset, from, nonce))
	if err != nil || !ok || !r.Async || r.Amount != "3500" || r.State != journal.StateFinal || r.Response == nil || !r.Response.Success || r.Response.Amount != "3500" {
		t.Errorf("the gate's record = %v %v: async %v, amount %q, state %v, response %+v; want async, 3500, final and settled for 3500", ok, err, r.Async, r.Amount, r.State, r.Response)
	}
	if n := e.c.CountTokenTransfers(payer.Address, e.payTo); n != 1 {
		t.Errorf("%d transfers, want 1", n)
	}
}
