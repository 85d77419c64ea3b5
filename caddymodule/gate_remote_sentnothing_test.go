package caddymodule_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A gate settling through a remote x402_facilitator (here one of the same Caddy, on its own site) whose node refuses
// the settlement transaction is told that nothing was sent, and believes it: the facilitator answers /settle 503
// with Retry-After and `"sent": false`, never "the payment may have settled", and the gate answers its payer 502
// "nothing was sent: present the same payment again". Presented again, the payment is settled afresh, and a
// refusal of it then is final: a 402 that says why. Before, the facilitator's answer was the 502 of an unknown
// outcome, so the gate kept the payment as "may have settled" for good: a payment refused when presented again (its
// payer's funds gone, or its deadline passed while the node refused) was answered 502 "check the chain" forever, for
// a payment of which nothing was ever sent.
func TestARemoteSettlementThatSentNothingIsAnsweredSoAndTheNextRefusalIsFinal(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	proxy := chaintest.NewFaultProxy(t, c.RPCURL)
	side := freeAddr(t)
	network := fmt.Sprintf(`		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s,%s
			receipt_poll 2ms
			rpc_timeout 500ms
			receipt_timeout 2s
		}
`, x402.EIP155(c.ChainID.Uint64()), proxy.URL, c.Token.Hex(), hexKey(c.Wallets[0]), hexKey(c.Wallets[1]))
	env := startGateOn(t, c, gateSetup{facURL: "http://" + side + "/facilitator", global: network,
		sites: "http://" + side + " {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\topen\n\t\t}\n\t}\n}\n"})
	refuse := func() {
		proxy.SetDecide(func(method string) chaintest.Fault {
			if method == "eth_sendRawTransaction" {
				return chaintest.Refuse
			}
			return chaintest.Pass
		})
	}

	// The facilitator's own answer, asked directly.
	other := c.Payers[1]
	env.approvePermit2(other)
	rq := env.requirement("/", x402.TransferPermit2)
	body, err := json.Marshal(x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: env.signPermit2(other, rq), PaymentRequirements: rq})
	if err != nil {
		t.Fatal(err)
	}
	sentBefore := env.sent()
	refuse()
	resp, err := http.Post("http://"+side+"/facilitator/settle", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	var answer struct {
		Error string
		Sent  *bool
	}
	err = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	if proxy.Count(chaintest.Refuse) == 0 {
		t.Fatal("no broadcast met the refusal: the test proves nothing")
	}
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		answer.Sent == nil || *answer.Sent || strings.Contains(answer.Error, "may have settled") {
		t.Fatalf("/settle with the node refusing the transaction = %d (Retry-After %q) %+v (%v); want 503 with Retry-After, \"sent\": false and no \"may have settled\"",
			resp.StatusCode, resp.Header.Get("Retry-After"), answer, err)
	}

	// Through the gate.
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)
	refused := proxy.Count(chaintest.Refuse)
	a := env.get("/", x402.HeaderPaymentSignature, header)
	if proxy.Count(chaintest.Refuse) == refused {
		t.Fatal("the gate's settlement met no refusal: the test proves nothing")
	}
	var unreachable struct{ Outcome, Retry, Error string }
	if a.status != http.StatusBadGateway || json.Unmarshal([]byte(a.body), &unreachable) != nil ||
		unreachable.Outcome != string(x402.OutcomeSettleUnreachable) || !strings.Contains(a.body, "nothing was sent") ||
		!strings.Contains(a.body, "present the same payment again") || strings.Contains(a.body, "may have") {
		t.Fatalf("a payment whose settlement the facilitator's node refused = %d %q; want 502 settle-unreachable saying nothing was sent, to present the same payment again",
			a.status, a.body)
	}
	if a.header.Get(x402.HeaderPaymentRequired) != "" {
		t.Error("a good payment's 502 carries an offer to pay again (PAYMENT-REQUIRED)")
	}
	proxy.SetDecide(nil)
	// Longer than the engine's reconciliation pass (2 s) and its grace for a claim's owner: nothing sends them later.
	time.Sleep(3500 * time.Millisecond)
	if sent := env.sent() - sentBefore; sent != 0 {
		t.Fatalf("the settlement wallets sent %d transactions for payments answered not sent", sent)
	}

	// The payer's funds go before the payment is presented again: its refusal now is the final answer.
	c.TransferToken(payer, common.HexToAddress("0x00000000000000000000000000000000000000aa"), c.TokenBalance(payer.Address))
	a = env.get("/", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(requiredError(t, a), "settlement failed: "+x402.ReasonInsufficientFunds) {
		t.Fatalf("the payment presented again with its payer's funds gone = %d %q; want 402 %s (nothing of it was ever sent)",
			a.status, a.body, x402.ReasonInsufficientFunds)
	}
	if got := env.c.TokenBalance(env.payTo); got.Cmp(before.seller) != 0 {
		t.Errorf("the seller's balance moved from %s to %s", before.seller, got)
	}
	if sent := env.sent() - sentBefore; sent != 0 {
		t.Errorf("the settlement wallets sent %d transactions, want none", sent)
	}
}
