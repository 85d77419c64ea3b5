package caddymodule_test

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// One test per PaymentOutcome status (spec 2.7 and 7.1), each run with the embedded engine and with a remote
// facilitator over HTTP. Each checks the HTTP status, the payment headers and the balances afterwards.

func TestAnUnpaidRequestGets402WithThePaymentRequiredInHeaderAndBody(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: k.remote})
			payer := env.c.Payers[0]
			before := env.balances(payer)
			a := env.get("/article?id=7")
			if a.status != http.StatusPaymentRequired {
				t.Fatalf("status = %d %q, want 402", a.status, a.body)
			}
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if err != nil {
				t.Fatalf("PAYMENT-REQUIRED does not decode: %v", err)
			}
			var body x402.PaymentRequired
			if err := json.Unmarshal([]byte(a.body), &body); err != nil || !reflect.DeepEqual(body, pr) {
				t.Fatalf("the body %q is not the PaymentRequired of the header %+v (%v)", a.body, pr, err)
			}
			if pr.X402Version != 2 || pr.Resource.URL != env.srv.URL+"/article?id=7" || !strings.Contains(pr.Error, "PAYMENT-SIGNATURE") {
				t.Fatalf("PaymentRequired = %+v, want version 2 for %s/article?id=7 asking for PAYMENT-SIGNATURE", pr, env.srv.URL)
			}
			if len(pr.Accepts) != 2 || pr.Accepts[0].Extra.AssetTransferMethod != x402.TransferPermit2 ||
				pr.Accepts[1].Extra.AssetTransferMethod != x402.TransferERC2612 {
				t.Fatalf("accepts = %+v, want permit2 then erc2612", pr.Accepts)
			}
			for _, rq := range pr.Accepts {
				if rq.Scheme != "exact" || rq.Network != env.net || rq.Amount != "10000" || !x402.SameAddress(rq.Asset, env.c.Token.Hex()) ||
					!x402.SameAddress(rq.PayTo, env.payTo.Hex()) || rq.Extra.Name != "Stable Coin" || rq.Extra.Version != "1" || rq.MaxTimeoutSeconds != 300 {
					t.Errorf("requirement %+v does not say what the gate is configured with", rq)
				}
			}
			if spender := pr.Accepts[1].Extra.Spender; spender != env.c.Wallets[0].Address.Hex() && spender != env.c.Wallets[1].Address.Hex() {
				t.Errorf("erc2612 extra.spender = %q, want one of the settlement wallets", spender)
			}
			if _, ok := pr.Extensions[x402.ExtensionEIP2612GasSponsoring]; !ok {
				t.Errorf("extensions %v do not declare %s", pr.Extensions, x402.ExtensionEIP2612GasSponsoring)
			}
			if got := a.header.Get("Access-Control-Expose-Headers"); !strings.Contains(got, "PAYMENT-REQUIRED") || !strings.Contains(got, "PAYMENT-RESPONSE") {
				t.Errorf("Access-Control-Expose-Headers = %q, want the payment headers exposed", got)
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" {
				t.Error("an unpaid request got a PAYMENT-RESPONSE")
			}
			env.assertPaid(payer, before, 0)
		})
	}
}

func TestAPaymentHeaderThatDoesNotDecodeGets400AndChargesNothing(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: k.remote})
			payer := env.c.Payers[0]
			before := env.balances(payer)
			a := env.get("/", x402.HeaderPaymentSignature, "this is not base64!")
			if a.status != http.StatusBadRequest {
				t.Fatalf("status = %d %q, want 400", a.status, a.body)
			}
			if msg := requiredError(t, a); !strings.Contains(msg, "not-base64") {
				t.Errorf("the error %q does not say the header is not Base64", msg)
			}
			if k.remote && env.remote.verifies.Load()+env.remote.settles.Load() != 0 {
				t.Errorf("the facilitator was asked %d verify and %d settle for an undecodable header", env.remote.verifies.Load(), env.remote.settles.Load())
			}
			env.assertPaid(payer, before, 0)
		})
	}
}

func TestAPaymentTheFacilitatorRefusesGets402WithAFreshOfferNamingTheReason(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: k.remote})
			payer := env.c.Payers[1] // never approved Permit2, and sends no gas-sponsoring permit
			before := env.balances(payer)
			a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
			if a.status != http.StatusPaymentRequired {
				t.Fatalf("status = %d %q, want 402", a.status, a.body)
			}
			if msg := requiredError(t, a); !strings.HasPrefix(msg, x402.ReasonPermit2AllowanceRequired) {
				t.Errorf("the fresh offer's error %q does not name %s", msg, x402.ReasonPermit2AllowanceRequired)
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" || a.body == "paid content" {
				t.Errorf("a refused payment was served or settled: %q", a.body)
			}
			if k.remote && env.remote.settles.Load() != 0 {
				t.Errorf("/settle was called %d times for a refused payment", env.remote.settles.Load())
			}
			env.assertPaid(payer, before, 0)
		})
	}
}

func TestAnUnreachableFacilitatorAtVerifyGives502AndChargesNothing(t *testing.T) {
	t.Run("embedded with its node failing", func(t *testing.T) {
		c := chaintest.New(t, chaintest.WithHTTP())
		proxy := chaintest.NewFaultProxy(t, c.RPCURL)
		env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
		t.Cleanup(commitPending(t, c))
		env.srv = startCaddy(t, env.caddyfile(gateSetup{rpc: proxy.URL}))
		payer := c.Payers[0]
		env.approvePermit2(payer)
		before := env.balances(payer)
		header := env.permit2Header("/", payer)
		proxy.SetDecide(func(string) chaintest.Fault { return chaintest.ErrorStatus })
		a := env.get("/", x402.HeaderPaymentSignature, header)
		proxy.SetDecide(nil)
		assertVerifyUnreachable(t, a)
		env.assertPaid(payer, before, 0)
		// Nothing was charged, so the same payment goes through once the node is back.
		if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
			t.Fatalf("the same payment after the node came back = %d %q, want 200", a.status, a.body)
		}
		env.assertPaid(payer, before, 1)
	})
	t.Run("remote facilitator down", func(t *testing.T) {
		env := newGateEnv(t, gateSetup{remote: true, facURL: "http://" + freeAddr(t), gate: "\t\tasset_transfer_method permit2\n"})
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		before := env.balances(payer)
		// Caddy started with the facilitator down, and offers what is configured explicitly.
		rq := env.requirement("/", x402.TransferPermit2)
		a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, env.signPermit2(payer, rq)))
		assertVerifyUnreachable(t, a)
		env.assertPaid(payer, before, 0)
	})
}

func assertVerifyUnreachable(t *testing.T, a gateAnswer) {
	t.Helper()
	if a.status != http.StatusBadGateway {
		t.Fatalf("status = %d %q, want 502", a.status, a.body)
	}
	var body struct{ Error, Outcome, Retry string }
	if err := json.Unmarshal([]byte(a.body), &body); err != nil || body.Outcome != "verify-unreachable" || !strings.Contains(body.Retry, "not settled") {
		t.Fatalf("body = %q (%v), want a verify-unreachable gateAnswer saying the payment was not settled", a.body, err)
	}
	if a.header.Get(x402.HeaderPaymentResponse) != "" {
		t.Error("a 502 at verify carries a PAYMENT-RESPONSE")
	}
}

func TestASettlementTheChainRefusesGets402WithTheSettleResponseAndMovesNothing(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			up := newTestUpstream(t)
			env := newGateEnv(t, gateSetup{remote: k.remote, site: "reverse_proxy " + up.Addr})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			header := env.permit2Header("/", payer)
			entered, release := up.hold()
			defer release()
			pending := env.getAsync("/", x402.HeaderPaymentSignature, header)
			gateWait(t, entered, "the upstream call")
			// Verified; while the upstream works, the payer's tokens go elsewhere.
			env.c.TransferToken(payer, common.HexToAddress("0x000000000000000000000000000000000000dEaD"), env.c.TokenBalance(payer.Address))
			before := env.balances(payer)
			release()
			a := gateWait(t, pending, "the gated gateAnswer")
			if a.status != http.StatusPaymentRequired {
				t.Fatalf("status = %d %q, want 402", a.status, a.body)
			}
			resp := settleResponse(t, a)
			if resp.Success || resp.ErrorReason == "" || resp.Network != env.net {
				t.Fatalf("PAYMENT-RESPONSE = %+v, want a failed settlement with its reason", resp)
			}
			if msg := requiredError(t, a); !strings.Contains(msg, resp.ErrorReason) {
				t.Errorf("the fresh offer's error %q does not name %s", msg, resp.ErrorReason)
			}
			if a.header.Get("X-Upstream") != "" || strings.Contains(a.body, "upstream says") {
				t.Errorf("the unpaid upstream response leaked into the 402: %q", a.body)
			}
			env.assertPaid(payer, before, 0)
		})
	}
}

func TestAnUnreachableFacilitatorAtSettleGives502ThenTheSamePaymentIsServedOnceWithoutPayingTwice(t *testing.T) {
	// check502 checks a 502 settle-unreachable that offers nothing to pay: one whose settlement may have reached the
	// facilitator says the payment may have settled; one the facilitator surely sent nothing of (sentNothing) says so.
	check502 := func(t *testing.T, a gateAnswer, sentNothing bool) {
		t.Helper()
		if a.status != http.StatusBadGateway {
			t.Fatalf("status = %d %q, want 502", a.status, a.body)
		}
		var body struct{ Error, Outcome, Retry string }
		err := json.Unmarshal([]byte(a.body), &body)
		if sentNothing {
			if err != nil || body.Outcome != "settle-unreachable" || !strings.Contains(body.Retry, "nothing of the payment was sent") ||
				!strings.Contains(body.Error, "nothing was sent") || strings.Contains(a.body, "may have") {
				t.Fatalf("body = %q (%v), want settle-unreachable saying nothing was sent", a.body, err)
			}
		} else if err != nil || body.Outcome != "settle-unreachable" ||
			!strings.Contains(body.Retry, "may have settled") || !strings.Contains(body.Retry, "check before paying again") {
			t.Fatalf("body = %q (%v), want settle-unreachable saying the payment may have settled", a.body, err)
		}
		if a.header.Get(x402.HeaderPaymentRequired) != "" {
			t.Error("a payment that may have settled was answered with an offer to pay again")
		}
	}
	for _, fault := range []string{"down", "lose-gateAnswer"} {
		t.Run("remote "+fault, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: true})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/", payer)
			env.remote.setSettleFault(fault)
			check502(t, env.get("/", x402.HeaderPaymentSignature, header), false)
			env.remote.setSettleFault("")
			a := env.get("/", x402.HeaderPaymentSignature, header)
			if a.status != http.StatusOK || a.body != "paid content" {
				t.Fatalf("the same payment presented again = %d %q, want it served", a.status, a.body)
			}
			if resp := settleResponse(t, a); !resp.Success {
				t.Fatalf("PAYMENT-RESPONSE = %+v, want success", resp)
			}
			env.assertPaid(payer, before, 1)
			if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
				t.Fatalf("the payment presented a third time = %d, want 402 (already used)", a.status)
			}
			env.assertPaid(payer, before, 1)
		})
	}
	t.Run("embedded with its node failing at settle", func(t *testing.T) {
		c := chaintest.New(t, chaintest.WithHTTP())
		proxy := chaintest.NewFaultProxy(t, c.RPCURL)
		up := newTestUpstream(t)
		env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
		t.Cleanup(commitPending(t, c))
		env.srv = startCaddy(t, env.caddyfile(gateSetup{rpc: proxy.URL, site: "reverse_proxy " + up.Addr}))
		payer := c.Payers[0]
		env.approvePermit2(payer)
		before := env.balances(payer)
		header := env.permit2Header("/", payer)
		entered, release := up.hold()
		pending := env.getAsync("/", x402.HeaderPaymentSignature, header)
		gateWait(t, entered, "the upstream call")
		proxy.SetDecide(func(string) chaintest.Fault { return chaintest.ErrorStatus })
		release()
		// Every call to the node fails: the settlement stops at its first read (the head), before anything is signed.
		check502(t, gateWait(t, pending, "the gated gateAnswer"), true)
		proxy.SetDecide(nil)
		up.unhold()
		a := env.get("/", x402.HeaderPaymentSignature, header)
		if a.status != http.StatusOK || !strings.Contains(a.body, "upstream says 200") {
			t.Fatalf("the same payment presented again = %d %q, want it served", a.status, a.body)
		}
		env.assertPaid(payer, before, 1)
	})
}

func TestASettledPaymentServesTheResourceWithPaymentResponseAndMovesTheAmountOnce(t *testing.T) {
	for _, k := range facilitatorKinds {
		for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
			t.Run(k.name+" "+method, func(t *testing.T) {
				env := newGateEnv(t, gateSetup{remote: k.remote})
				payer := env.c.Payers[0]
				rq := env.requirement("/", method)
				var p x402.PaymentPayload
				if method == x402.TransferPermit2 {
					env.approvePermit2(payer)
					p = env.signPermit2(payer, rq)
				} else {
					p = env.signERC2612(payer, rq)
				}
				before := env.balances(payer)
				a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p))
				if a.status != http.StatusOK || a.body != "paid content" {
					t.Fatalf("paid request = %d %q, want 200 with the content", a.status, a.body)
				}
				resp := settleResponse(t, a)
				if !resp.Success || !strings.HasPrefix(resp.Transaction, "0x") || len(resp.Transaction) != 66 ||
					resp.Network != env.net || !x402.SameAddress(resp.Payer, payer.Address.Hex()) {
					t.Fatalf("PAYMENT-RESPONSE = %+v, want success with the transaction, network and payer", resp)
				}
				if n := len(env.c.TransfersInTx(common.HexToHash(resp.Transaction))); n != 1 {
					t.Errorf("the settlement transaction holds %d token transfers, want 1", n)
				}
				env.assertPaid(payer, before, 1)
			})
		}
	}
}

func TestAnAsyncGateServesAtOnceWithSettlePendingAndSettlesInTheBackground(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: k.remote, gate: "\t\tsettle async\n"})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
			if a.status != http.StatusOK || a.body != "paid content" {
				t.Fatalf("paid request = %d %q, want 200 with the content", a.status, a.body)
			}
			resp := settleResponse(t, a)
			if resp.Success || resp.ErrorReason != x402.ReasonSettlementPending || resp.Network != env.net || !x402.SameAddress(resp.Payer, payer.Address.Hex()) {
				t.Fatalf("PAYMENT-RESPONSE = %+v, want settlement_pending for the payer", resp)
			}
			env.waitPaid(payer, before, 1)
			if k.remote && env.remote.settles.Load() != 1 {
				t.Errorf("/settle was called %d times, want 1", env.remote.settles.Load())
			}
		})
	}
}
