package caddymodule_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// lyingVerifier forwards to a facilitator and, while lie is set, answers a valid /verify naming another payer.
type lyingVerifier struct {
	*scriptedFacilitator
	lie atomic.Value // string: the payer a valid /verify answer names; "" tells the truth
}

func (f *lyingVerifier) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	lie, _ := f.lie.Load().(string)
	if r.URL.Path != "/verify" || lie == "" {
		f.scriptedFacilitator.ServeHTTP(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	status, answer, err := forwardTo(f.engine, r, body)
	if err != nil || status != http.StatusOK {
		http.Error(w, "engine unreachable", http.StatusBadGateway)
		return
	}
	var resp x402.VerifyResponse
	_ = json.Unmarshal(answer, &resp)
	resp.Payer = lie
	gateWriteJSON(w, http.StatusOK, resp)
}

// An x402_facilitator in middleware mode passes on only answers about the payment asked of. Its upstream, a
// hostile facilitator that settles each payment but answers success naming another network, payer or amount, or
// no transaction, is not believed: the caller gets 502 saying the outcome is unknown and the payment may have
// settled, never the lie; presented again (the upstream truthful now), the payment's real settlement. A valid
// /verify naming someone else than the signer is no answer either.
func TestAMiddlewareFacilitatorPassesOnNoUpstreamAnswerAboutAnotherPayment(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(6))
	t.Cleanup(commitPending(t, c))
	engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	upstream := &lyingVerifier{scriptedFacilitator: &scriptedFacilitator{engine: engine.URL}}
	e := &facilitatorEnv{
		t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(c.ChainID.Uint64()),
	}
	e.srv = startCaddy(t, `{{ADDR}} {
	handle_path /mw/* {
		x402_facilitator {
			upstream `+serveTest(t, upstream)+`
		}
	}
}
`)
	stranger := c.Payers[5].Address.Hex()
	for i, row := range []struct {
		name string
		edit func(*x402.SettleResponse)
	}{
		{"another network", func(r *x402.SettleResponse) { r.Network = "eip155:1" }},
		{"another payer", func(r *x402.SettleResponse) { r.Payer = stranger }},
		{"no transaction", func(r *x402.SettleResponse) { r.Transaction = "" }},
		{"another amount", func(r *x402.SettleResponse) { r.Amount = "1" }},
	} {
		t.Run("success naming "+row.name, func(t *testing.T) {
			e.t = t
			payer := c.Payers[i]
			req := e.permit2(payer)
			payerBefore, sellerBefore := e.balances(payer.Address)
			upstream.next(rewritten(row.edit))
			a := e.do(http.MethodPost, "/mw/settle", "", mustJSON(t, req))
			msg, _ := a.json(t)["error"].(string)
			if a.status != http.StatusBadGateway || !strings.Contains(msg, "claimed success for another payment") || !strings.Contains(msg, "may have settled") {
				t.Fatalf("settle through the middleware = %d %s; want 502 saying the answer was about another payment and the payment may have settled", a.status, a.body)
			}
			e.assertPaidOnce(payer.Address, payerBefore, sellerBefore) // the upstream did settle it

			again := e.do(http.MethodPost, "/mw/settle", "", mustJSON(t, req))
			var s x402.SettleResponse
			if again.status != http.StatusOK || json.Unmarshal(again.body, &s) != nil || !s.Success || s.Payer != payer.Address.Hex() || s.Network != e.network || !x402.IsTxHash(s.Transaction) {
				t.Fatalf("the same payment presented again, the upstream truthful = %d %s; want its settlement", again.status, again.body)
			}
			e.assertPaidOnce(payer.Address, payerBefore, sellerBefore)
		})
	}

	t.Run("valid naming another payer", func(t *testing.T) {
		e.t = t
		req := e.permit2(c.Payers[4])
		upstream.lie.Store(stranger)
		a := e.do(http.MethodPost, "/mw/verify", "", mustJSON(t, req))
		upstream.lie.Store("")
		msg, _ := a.json(t)["error"].(string)
		if a.status != http.StatusBadGateway || !strings.Contains(msg, "claimed success for another payment") {
			t.Fatalf("verify through the middleware = %d %s; want 502 saying the answer was about another payment", a.status, a.body)
		}
		if v := e.do(http.MethodPost, "/mw/verify", "", mustJSON(t, req)); v.status != http.StatusOK || v.json(t)["isValid"] != true {
			t.Errorf("verify, the upstream truthful = %d %s; want valid", v.status, v.body)
		}
	})
}
