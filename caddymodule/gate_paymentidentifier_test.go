package caddymodule_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// namedPermit2Header is a signed permit2 payment for path naming its payment with id, as the SDK's client echoes
// the gate's declaration with the id.
func (env *gateEnv) namedPermit2Header(path string, payer *chaintest.Account, id string) string {
	env.t.Helper()
	pr := env.offer(path)
	var rq x402.PaymentRequirements
	for _, r := range pr.Accepts {
		if r.Extra.AssetTransferMethod == x402.TransferPermit2 {
			rq = r
		}
	}
	p := env.signPermit2(payer, rq)
	named, err := x402.MergeExtension(pr.Extensions[x402.ExtensionPaymentIdentifier], json.RawMessage(`{"info":{"id":"`+id+`"}}`))
	if err != nil {
		env.t.Fatal(err)
	}
	p.Extensions = map[string]json.RawMessage{x402.ExtensionPaymentIdentifier: named}
	return gateEncode(env.t, p)
}

// A Caddyfile gate with payment_identifier: a payment naming an id is served and settled once; the same payment
// again is presented again (it bought its response); another payment of the id is 409 with no transaction, also
// after a reload and after a restart on the same journal; `caddy x402 pay --payment-id` names its payment, and
// is answered 409 when it pays again under the same id.
func TestAGatePaymentIdentifierKeepsAnIdToOnePaymentAcrossReloadsAndRestarts(t *testing.T) {
	s := gateSetup{gate: "\t\tpayment_identifier\n"}
	env := newGateEnv(t, s)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	const id = "pay_7d5d747be160e280504c099d984bcfe0"

	first := env.namedPermit2Header("/", payer, id)
	if a := env.get("/", x402.HeaderPaymentSignature, first); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("a payment naming an id = %d %q, want 200", a.status, a.body)
	}
	if a := env.get("/", x402.HeaderPaymentSignature, first); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the same payment again = %d %q, want 402 (it bought its response)", a.status, a.body)
	}
	conflict := func(when string) {
		t.Helper()
		a := env.get("/", x402.HeaderPaymentSignature, env.namedPermit2Header("/", payer, id))
		if a.status != http.StatusConflict || !strings.Contains(a.body, id) {
			t.Fatalf("%s: another payment of the id = %d %q, want 409 naming it", when, a.status, a.body)
		}
	}
	conflict("at once")
	env.reload(s)
	conflict("after a reload")
	if err := caddy.Stop(); err != nil {
		t.Fatalf("stopping the gateway: %v", err)
	}
	env.srv.load(env.caddyfile(s))
	conflict("after a restart")
	env.assertPaid(payer, before, 1)

	// caddy x402 pay names its payment; paying again under the id signs another payment, which the gate refuses.
	key := hexKey(payer)
	const payID = "pay_from_the_command_line_0001"
	stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", env.c.RPCURL, "--payment-id", payID, env.srv.URL+"/")
	if err != nil || !strings.Contains(stdout, "paid content") || !strings.Contains(stderr, payID) {
		t.Fatalf("pay --payment-id = %v\nstdout: %s\nstderr: %s", err, stdout, stderr)
	}
	stdout, stderr, err = caddymodule.RunX402("", "pay", "--key", key, "--rpc", env.c.RPCURL, "--payment-id", payID, env.srv.URL+"/")
	if err == nil || !strings.Contains(stdout+stderr+err.Error(), "409") {
		t.Fatalf("pay again under the same --payment-id = %v, want a 409\nstdout: %s\nstderr: %s", err, stdout, stderr)
	}
	env.assertPaid(payer, before, 2)
}
