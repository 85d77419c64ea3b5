package gate_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
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

// workingUpstream names the charge of the work a request asks for (X-Work: expensive costs 9000, anything else
// 100) and answers it with a body of four times the gate's max_buffer; while breakOff is set, it breaks off halfway,
// after the answer began to stream.
type workingUpstream struct {
	breakOff atomic.Bool
	calls    atomic.Int64
}

func (u *workingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	u.calls.Add(1)
	work := 100
	if r.Header.Get("X-Work") == "expensive" {
		work = 9000
	}
	w.Header().Set(x402.HeaderSettlementOverrides, fmt.Sprintf(`{"amount":"%d"}`, work))
	if u.breakOff.Load() {
		if _, err := w.Write(bytes.Repeat([]byte("x"), brokenBodySize/2)); err != nil {
			return err
		}
		return errors.New("the upstream broke off")
	}
	_, err := w.Write(bytes.Repeat([]byte("x"), brokenBodySize))
	return err
}

// An upto payment's charge is decided by the response it was first presented for (100 here), and presented again
// (that response broke off) it is settled for that charge. Presented again with a request that asks for more work
// at the same URL, its response names 9000: the gate does not send it, and answers 409 naming both charges, with
// the payment's settlement in PAYMENT-RESPONSE (never 402: the payment is charged). The payment stays good for a
// response that costs no more, which it gets whole, once, and the payer is charged 100 in all.
func TestAnUptoPaymentPresentedAgainIsNotSentAResponseThatNamesMoreThanItWasCharged(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			var up workingUpstream
			e := newEnv(t, setup{settle: settle, scheme: x402.SchemeUpto, upstream: up.ServeHTTP,
				config: func(c *gate.Config) { c.MaxBuffer = 1 << 10 }})
			payer := e.c.Payers[0]
			header := e.permit2(payer)
			before := e.balances(payer)

			up.breakOff.Store(true)
			if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || len(a.body) >= brokenBodySize {
				t.Fatalf("the paid request while the upstream breaks off = %d with %d bytes, want 200 and part of the body", a.status, len(a.body))
			}
			up.breakOff.Store(false)
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				if _, gained := e.paid(payer, before); gained.Int64() >= 100 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the payment whose response broke off was not charged in time")
				}
			}

			a := e.get(x402.HeaderPaymentSignature, header, "X-Work", "expensive")
			var body struct {
				Reason, Outcome, Charged, Named, Transaction string
			}
			if err := json.Unmarshal([]byte(a.body), &body); a.status != http.StatusConflict || err != nil || strings.Contains(a.body, "xxx") {
				t.Fatalf("the payment charged 100 presented again for work the upstream names 9000 for = %d with %d bytes %.80q, want 409 and not the response",
					a.status, len(a.body), a.body)
			}
			if body.Reason != "charge_above_charged" || body.Charged != "100" || body.Named != "9000" {
				t.Errorf("the 409 says %+v; want reason charge_above_charged, charged 100, named 9000", body)
			}
			if v := a.header.Values(x402.HeaderSettlementOverrides); len(v) != 0 {
				t.Errorf("the client got the upstream's Settlement-Overrides %q", v)
			}
			resp := mustSettleResponse(t, a)
			if settle == gate.SettleAfter && (!resp.Success || resp.Amount != "100" || body.Transaction != resp.Transaction) {
				t.Errorf("PAYMENT-RESPONSE %+v, transaction in the body %q; want the settlement of 100, named in both", resp, body.Transaction)
			}
			if settle == gate.SettleAsync && !resp.Success && !resp.Pending() {
				t.Errorf("PAYMENT-RESPONSE %+v, want the payment settled or settling", resp)
			}

			if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != strings.Repeat("x", brokenBodySize) {
				t.Fatalf("the payment presented again for the work it was charged for = %d with %d bytes, want 200 and the whole body", a.status, len(a.body))
			}
			refusedWith(t, e.get(x402.HeaderPaymentSignature, header, "X-Work", "expensive"), x402.ReasonPaymentAlreadyUsed,
				"the payment presented once more, after it bought its response")
			time.Sleep(100 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
			if lost, gained := e.paid(payer, before); lost.Int64() != 100 || gained.Int64() != 100 {
				t.Errorf("the payer lost %s and the seller gained %s, want 100 once", lost, gained)
			}
			if n := e.c.CountTokenTransfers(payer.Address, e.payTo); n != 1 {
				t.Errorf("%d token transfers from the payer to the seller, want 1", n)
			}
		})
	}
}
