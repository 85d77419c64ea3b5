package caddymodule_test

import (
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	payerpkg "github.com/x402-gateway/caddy-x402/payer"
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

// Our payer signs in too: `caddy x402 pay --sign-in` pays where it has no grant and signs in where it has one, and
// a payer.Transport with SignIn does the same for every request it sends; one payment for all of it.
func TestOurPayerPaysOnceAndThenSignsIn(t *testing.T) {
	s := gateSetup{gate: "\t\taccess 1h\n"}
	env := newGateEnv(t, s)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	key := hexKey(payer)
	pay := func() (string, string) {
		t.Helper()
		stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", env.c.RPCURL, "--sign-in", env.srv.URL+"/")
		if err != nil || !strings.Contains(stdout, "paid content") {
			t.Fatalf("pay --sign-in = %v\nstdout: %s\nstderr: %s", err, stdout, stderr)
		}
		return stdout, stderr
	}
	if _, stderr := pay(); !strings.Contains(stderr, "was refused") || !strings.Contains(stderr, x402.SignInWithXNoGrant) || !strings.Contains(stderr, "paying") {
		t.Fatalf("the first pay --sign-in says %q, want the sign-in refused (%s) and a payment", stderr, x402.SignInWithXNoGrant)
	}
	env.assertPaid(payer, before, 1)
	if _, stderr := pay(); !strings.Contains(stderr, "signed in as "+payer.Address.Hex()) || strings.Contains(stderr, "was refused") {
		t.Fatalf("the second pay --sign-in says %q, want it signed in, not paying", stderr)
	}

	p, err := payerpkg.New(payer.Key, payerpkg.Options{RPC: env.c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tr := &payerpkg.Transport{Payer: p, SignIn: true,
		Limits: []payerpkg.Limit{{Network: env.net, Asset: env.c.Token.Hex(), PerRequest: big.NewInt(gatePrice), Total: big.NewInt(gatePrice)}}}
	client := &http.Client{Transport: tr}
	for i := 0; i < 5; i++ {
		resp, err := client.Get(env.srv.URL + "/")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != "paid content" {
			t.Fatalf("the Transport's request %d = %d %q, want the resource", i, resp.StatusCode, body)
		}
	}
	if n := tr.Signed(env.net, env.c.Token.Hex()); n.Sign() != 0 {
		t.Errorf("the Transport signed payments of %s, want none: it signed in", n)
	}
	env.assertPaid(payer, before, 1)
}

// A Caddyfile sign_in_only route sells nothing: its 402 offers no way to pay and carries the challenge, a payer
// without the grant is refused, and one that bought the named grant on the paid route of the same pay_to signs in
// with no transaction.
func TestASignInOnlyRouteOfACaddyfileSignsInTheGrantBoughtOnThePaidRoute(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	s := gateSetup{gate: "\t\taccess 1h {\n\t\t\tgrant members\n\t\t}\n",
		site: "handle /members {\n\t\tx402 {\n\t\t\tsign_in_only\n\t\t\tpay_to " + env.payTo.Hex() + "\n\t\t\taccess 1h {\n\t\t\t\tgrant members\n\t\t\t}\n\t\t}\n\t\trespond \"members\"\n\t}\n\trespond \"paid content\""}
	caddyfile := strings.Replace(env.caddyfile(s), "\tx402 {\n\t\tpay_to", "\tx402 /paid {\n\t\tpay_to", 1)
	env.srv.load(caddyfile)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)

	pr := env.offer("/members")
	if pr.Accepts == nil || len(pr.Accepts) != 0 || pr.Extensions[x402.ExtensionSignInWithX] == nil {
		t.Fatalf("the sign-in-only route's 402 offers %v with extensions %s, want accepts [] and the challenge", pr.Accepts, pr.Extensions)
	}
	if a := env.signIn("/members", payer); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.SignInWithXNoGrant) || !strings.Contains(a.body, `"accepts":[]`) {
		t.Fatalf("a sign-in before paying = %d %q, want 402 naming %s with accepts []", a.status, a.body, x402.SignInWithXNoGrant)
	}
	if a := env.get("/paid", x402.HeaderPaymentSignature, env.permit2Header("/paid", payer)); a.status != http.StatusOK {
		t.Fatalf("the payment on the paid route = %d %q, want 200", a.status, a.body)
	}
	if a := env.signIn("/members", payer); a.status != http.StatusOK || a.body != "members" {
		t.Fatalf("a sign-in on the sign-in-only route = %d %q, want the members' resource", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// A grant bought on one route opens no other after a reload that removed an mcp gate before them: a payer who paid
// /basic/* for access signs in there, not at /premium/*, before and after (review of s49: an mcp block made a term
// by 0190009 put the mcp gate among the gates configured alike, and its removal gave the /premium/* gate the route
// the /basic/* gate had, whose path grants, keyed by the route alone, it then honoured).
func TestAGrantBoughtOnOneRouteOpensNoOtherAfterAReloadRemovedAnMCPGateBeforeThem(t *testing.T) {
	grantAfterRemoval(t, func(gate func(path, pricing, access string) string) string {
		return gate("/mcp", "mcp {\n\t\t\t\ttool search $0.01\n\t\t\t}", "")
	})
}

// The same with a paid gate removed: a grant of access's paths is keyed by the route alone, and a route is a
// place among the gates configured alike, so a reload that removes any gate before two access gates hands the
// first's grants to the second (review of s49: this holds before 0190009 too).
func TestAGrantBoughtOnOneRouteOpensNoOtherAfterAReloadRemovedAPaidGateBeforeThem(t *testing.T) {
	grantAfterRemoval(t, func(gate func(path, pricing, access string) string) string {
		return gate("/report", fmt.Sprintf("amount %d", gatePrice), "")
	})
}

// grantAfterRemoval pays /basic/* for access, with the gate removed before the two access gates, and signs in at
// /premium/* and /basic/* after a reload without it.
func grantAfterRemoval(t *testing.T, removed func(gate func(path, pricing, access string) string) string) {
	t.Helper()
	env := newGateEnv(t, gateSetup{})
	global, _, _ := strings.Cut(env.caddyfile(gateSetup{}), "\n{{ADDR}} {")
	gate := func(path, pricing, access string) string {
		return "\t\tx402 " + path + " {\n\t\t\tpay_to " + env.payTo.Hex() + "\n\t\t\tasset " + env.c.Token.Hex() + "\n\t\t\tnetwork " + env.net +
			"\n\t\t\t" + pricing + "\n" + access + "\t\t}\n"
	}
	sells := func(path string, amount int) string {
		return gate(path, fmt.Sprintf("amount %d", amount), "\t\t\taccess 1h {\n\t\t\t\tpaths "+path+"\n\t\t\t}\n")
	}
	site := func(gates string) string {
		return global + "\n{{ADDR}} {\n\troute {\n" + gates + "\t\trespond \"content\"\n\t}\n}\n"
	}
	env.srv.load(site(removed(gate) + sells("/basic/*", gatePrice) + sells("/premium/*", 100*gatePrice)))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/basic/a", x402.HeaderPaymentSignature, env.permit2Header("/basic/a", payer)); a.status != http.StatusOK {
		t.Fatalf("the payment at /basic/a = %d %q, want 200", a.status, a.body)
	}
	if a := env.signIn("/basic/b", payer); a.status != http.StatusOK {
		t.Fatalf("a sign-in at /basic/b = %d %q, want the resource", a.status, a.body)
	}
	if a := env.signIn("/premium/a", payer); a.status != http.StatusPaymentRequired {
		t.Fatalf("a sign-in at /premium/a = %d %q, want 402: nothing was paid there", a.status, a.body)
	}

	env.srv.load(site(sells("/basic/*", gatePrice) + sells("/premium/*", 100*gatePrice)))
	if a := env.signIn("/premium/a", payer); a.status != http.StatusPaymentRequired {
		t.Errorf("after a reload that removed the gate before, a sign-in at /premium/a = %d %q, want 402: the grant was bought at /basic/*", a.status, a.body)
	}
	if a := env.signIn("/basic/c", payer); a.status != http.StatusOK {
		t.Errorf("after a reload that removed the gate before, a sign-in at /basic/c = %d %.160q, want the resource: the grant bought there stands", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}
