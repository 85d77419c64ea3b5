package caddymodule_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// signIn answers the sign-in-with-x challenge of path's 402 as payer, as the SDK's client does, and asks again.
func (env *gateEnv) signIn(path string, payer *chaintest.Account) gateAnswer {
	env.t.Helper()
	pr := env.offer(path)
	var decl x402.SignInWithXDeclaration
	if err := json.Unmarshal(pr.Extensions[x402.ExtensionSignInWithX], &decl); err != nil || len(decl.SupportedChains) == 0 {
		env.t.Fatalf("the 402 declares sign-in-with-x as %s (%v), want a challenge", pr.Extensions[x402.ExtensionSignInWithX], err)
	}
	info := decl.Info
	s := x402.SignInWithX{Domain: info.Domain, Address: payer.Address.Hex(), URI: info.URI, Version: info.Version,
		ChainID: decl.SupportedChains[0].ChainID, Type: decl.SupportedChains[0].Type, Nonce: info.Nonce,
		IssuedAt: info.IssuedAt, ExpirationTime: info.ExpirationTime, Resources: info.Resources}
	msg, err := s.Message(s.Address)
	if err != nil {
		env.t.Fatal(err)
	}
	sig, err := crypto.Sign(accounts.TextHash([]byte(msg)), payer.Key)
	if err != nil {
		env.t.Fatal(err)
	}
	sig[64] += 27
	s.Signature = hexutil.Encode(sig)
	h, err := x402.EncodeSignInWithX(s)
	if err != nil {
		env.t.Fatal(err)
	}
	return env.get(path, x402.HeaderSignInWithX, h)
}

// A Caddyfile gate with access: one payment, then sign-ins served by signature alone with no transaction, through a
// reload that lengthens the grant and a restart on the same bolt journal, until the grant's requests are used;
// then 402 naming why, and a payer that never paid is refused from the start.
func TestAGateWithAccessKeepsAPayersGrantAcrossReloadsAndRestarts(t *testing.T) {
	s := gateSetup{gate: "\t\taccess 1h {\n\t\t\trequests 4\n\t\t}\n"}
	env := newGateEnv(t, s)
	payer, stranger := env.c.Payers[0], env.c.Payers[1]
	env.approvePermit2(payer)
	before := env.balances(payer)

	if a := env.signIn("/", payer); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.SignInWithXNoGrant) {
		t.Fatalf("a sign-in before paying = %d %q, want 402 naming %s", a.status, a.body, x402.SignInWithXNoGrant)
	}
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	signedIn := func(when string) {
		t.Helper()
		if a := env.signIn("/", payer); a.status != http.StatusOK || a.body != "paid content" {
			t.Fatalf("%s: the sign-in = %d %q, want the resource", when, a.status, a.body)
		}
	}
	signedIn("at once")
	s.gate = "\t\taccess 2h {\n\t\t\trequests 9\n\t\t}\n"
	env.reload(s)
	signedIn("after a reload that changed access")
	if err := caddy.Stop(); err != nil {
		t.Fatalf("stopping the gateway: %v", err)
	}
	env.srv.load(env.caddyfile(s))
	signedIn("after a restart")
	signedIn("the grant's fourth request")
	if a := env.signIn("/", payer); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.SignInWithXGrantUsedUp) {
		t.Fatalf("a fifth sign-in = %d %q, want 402 naming %s: the grant was bought with 4 requests", a.status, a.body, x402.SignInWithXGrantUsedUp)
	}
	if a := env.signIn("/", stranger); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.SignInWithXNoGrant) {
		t.Fatalf("a payer that never paid = %d %q, want 402 naming %s", a.status, a.body, x402.SignInWithXNoGrant)
	}
	env.assertPaid(payer, before, 1)
}
