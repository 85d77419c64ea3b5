package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The public TypeScript client with @x402/extensions' payment-identifier pays our gate declaring it, on the dev
// chain: the payment names the client's id and is settled once, for exactly the price; the client paying again
// under the same id signs another payment, which the gate answers 409 with nothing moved on chain; and `caddy x402
// pay --payment-id` names its payment the same way.
func TestThePublicTypeScriptClientNamesItsPaymentAndAnotherPaymentOfTheIdIs409(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
		}
	}
}

%s {
	bind 127.0.0.1
	x402 {
		price $0.01
		pay_to %s
		payment_identifier
	}
	respond "named content"
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain and a gate declaring payment-identifier", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)

	key := devchain.PayerKeyN(2)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	dev.fundPayer(key)

	const id = "pay_from_the_typescript_sdk_0001"
	pay := func() (paidByTypeScript, int) {
		t.Helper()
		env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
			"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
			"X402_METHOD=permit2", "X402_PAYMENT_ID="+id)
		r := runCommand(t, 2*time.Minute, sdk, env, node, "pay.mjs", gateURL+"/")
		var got paidByTypeScript
		if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
			t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
		}
		return got, r.code
	}

	payerBefore, sellerBefore, from := dev.balance(payer), dev.balance(seller), dev.head()+1
	got, code := pay()
	if code != 0 || got.Status != 200 || got.Body != "named content" || got.PaymentResponse == nil || !got.PaymentResponse.Success {
		t.Fatalf("the TypeScript client naming its payment got exit %d, status %d, body %q, error %q, payment response %+v",
			code, got.Status, got.Body, got.Error, got.PaymentResponse)
	}
	if got.Sent == nil || got.Sent.PaymentIdentifier != id {
		t.Fatalf("the client sent %+v, want its payment named %s", got.Sent, id)
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payer, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}

	// Paying again under the same id, the client signs a new payment: the gate refuses it (409), nothing moves.
	payerBefore, sellerBefore, from = dev.balance(payer), dev.balance(seller), dev.head()+1
	got, code = pay()
	if code == 0 || got.Status != 409 || !strings.Contains(got.Body, id) {
		t.Fatalf("another payment under the same id got exit %d, status %d, body %q, error %q; want 409 naming the id", code, got.Status, got.Body, got.Error)
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Sign() != 0 {
		t.Errorf("the payer's balance moved by %s for a refused payment", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Sign() != 0 {
		t.Errorf("the seller's balance moved by %s for a refused payment", d)
	}
	if dev.head() >= from && len(dev.transfers(payer, seller, from)) != 0 {
		t.Error("a Transfer went from the payer to the seller for a refused payment")
	}
}

// Our payer names its payments to an @x402/hono server that declares payment-identifier (required), settling
// through our x402_facilitator on the dev chain: `caddy x402 pay --payment-id` sends the id it was given, `caddy
// x402 pay` without one a fresh id as the SDK's clients make them, and payer.Transport the id of the request's
// context; the SDK's own validators accept each (the server echoes what it extracted and validated), and each
// payment is settled once, for exactly the price.
func TestOurPayerNamesItsPaymentsToAnHonoServerDeclaringPaymentIdentifier(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
		}
	}
}

%s {
	bind 127.0.0.1
	handle_path /facilitator/* {
		x402_facilitator
	}
	handle {
		x402 $0.01 {
			pay_to %s
		}
		respond "paid"
	}
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain and our facilitator", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)
	hono := startProgram(t, "the @x402/hono server declaring payment-identifier", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+gateURL+"/facilitator", fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		"X402_ASSET="+devchain.TokenAddress.Hex(), "X402_PAY_TO="+seller.Hex(), "X402_AMOUNT=10000",
		"X402_PAYMENT_IDENTIFIER=required", "X402_LIFETIME_SECONDS=300"),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))
	a, err := get(honoURL + "/paid")
	if err != nil {
		t.Fatal(err)
	}
	required, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := required.Extensions[x402.ExtensionPaymentIdentifier]; !ok {
		t.Fatalf("the hono server's 402 declares %v; want payment-identifier", required.Extensions)
	}

	key := devchain.PayerKeyN(2)
	payerAddr := crypto.PubkeyToAddress(key.PublicKey)
	dev.fundPayer(key)
	payerBefore, sellerBefore, from := dev.balance(payerAddr), dev.balance(seller), dev.head()+1

	echoed := func(stdout string) string {
		for _, line := range strings.Split(stdout, "\n") {
			if v, ok := strings.CutPrefix(line, "payment identifier: "); ok {
				return strings.TrimSpace(v)
			}
		}
		return ""
	}
	pay := func(args ...string) string {
		t.Helper()
		env := childEnv(t, "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)))
		r := runCommand(t, 2*time.Minute, dir, env, caddyBin, append(append([]string{"x402", "pay", "--rpc", chainURL}, args...), honoURL+"/paid")...)
		if r.code != 0 || !strings.HasPrefix(r.stdout, "HTTP/1.1 200 OK\n") {
			t.Fatalf("caddy x402 pay %v exited %d\nstdout:\n%s\nstderr:\n%s", args, r.code, r.stdout, r.stderr)
		}
		return echoed(r.stdout)
	}
	const named = "pay_named_by_caddy_x402_pay_0001"
	if got := pay("--payment-id", named); got != named {
		t.Errorf("caddy x402 pay --payment-id %s: the hono server validated %q; want the id", named, got)
	}
	if got := pay(); !regexp.MustCompile(`^pay_[0-9a-f]{32}$`).MatchString(got) {
		t.Errorf("caddy x402 pay without an id: the hono server validated %q; want a fresh pay_ id", got)
	}

	p, err := payer.New(key, payer.Options{RPC: chainURL})
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: fmt.Sprintf("eip155:%d", devchain.DefaultChainID),
		Asset: devchain.TokenAddress.Hex(), PerRequest: big.NewInt(10_000), Total: big.NewInt(10_000)}}}}
	const transported = "pay_named_by_payer_transport_0001"
	req, _ := http.NewRequestWithContext(payer.WithPaymentIdentifier(context.Background(), transported), http.MethodGet, honoURL+"/paid", nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("X-Payment-Identifier") != transported {
		t.Errorf("payer.Transport: %d, the hono server validated %q; want 200 and %s", resp.StatusCode, resp.Header.Get("X-Payment-Identifier"), transported)
	}

	if d := delta(payerBefore, dev.balance(payerAddr)); d.Cmp(big.NewInt(-30_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -30000 (three payments)", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(30_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +30000", d)
	}
	if n := len(dev.transfers(payerAddr, seller, from)); n != 3 {
		t.Errorf("%d Transfers from the payer to the seller, want 3", n)
	}
	hono.stop()
	caddy.stop()
}
