package e2e

import (
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// The public TypeScript client with @x402/extensions' sign-in-with-x against our gate granting access, on the dev
// chain: the client answers the first 402's challenge, is refused (it has not paid), pays once, and then, fetching
// again, is served on its wallet's signature alone: one Transfer of exactly the price for all the fetches.
func TestThePublicTypeScriptClientPaysOnceAndThenSignsInWithX(t *testing.T) {
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
		access 1h {
			requests 100
		}
	}
	respond "content for a while"
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain and a gate granting access", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)

	key := devchain.PayerKeyN(3)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	dev.fundPayer(key)

	const fetches = 6
	payerBefore, sellerBefore, from := dev.balance(payer), dev.balance(seller), dev.head()+1
	env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
		"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		"X402_METHOD=permit2", "X402_SIWX=1", fmt.Sprintf("X402_REPEAT=%d", fetches))
	r := runCommand(t, 3*time.Minute, sdk, env, node, "pay.mjs", gateURL+"/")
	var got paidByTypeScript
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
		t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
	}
	if r.code != 0 || len(got.Runs) != fetches {
		t.Fatalf("the TypeScript client exited %d after %d of %d fetches: %+v (error %q)", r.code, len(got.Runs), fetches, got.Runs, got.Error)
	}
	for i, run := range got.Runs {
		if run.Status != 200 || run.Body != "content for a while" || run.Paid != (i == 0) {
			t.Errorf("fetch %d: status %d, body %q, paid %v; want 200 with the content, paid only the first time", i, run.Status, run.Body, run.Paid)
		}
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000: one payment", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payer, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}
}

// Our payer signs in with x to an @x402/hono server that declares sign-in-with-x, settling through our
// x402_facilitator on the dev chain: `caddy x402 pay --sign-in` is refused at first (the SDK's storage has no
// payment of it), pays, and then signs in and is served without paying, its SIWE message and signature taken by
// the SDK's own checks (viem's verifyMessage). One Transfer in all.
func TestOurPayerPaysOnceAndThenSignsInToAnHonoServerDeclaringSignInWithX(t *testing.T) {
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
	hono := startProgram(t, "the @x402/hono server declaring sign-in-with-x", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+gateURL+"/facilitator", fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		"X402_ASSET="+devchain.TokenAddress.Hex(), "X402_PAY_TO="+seller.Hex(), "X402_AMOUNT=10000",
		"X402_SIWX=1", "X402_LIFETIME_SECONDS=300"),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))

	key := devchain.PayerKeyN(4)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	dev.fundPayer(key)
	payerBefore, sellerBefore, from := dev.balance(payer), dev.balance(seller), dev.head()+1

	pay := func() string {
		t.Helper()
		env := childEnv(t, "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)))
		r := runCommand(t, 2*time.Minute, dir, env, caddyBin, "x402", "pay", "--rpc", chainURL, "--sign-in", honoURL+"/paid")
		if r.code != 0 || !strings.HasPrefix(r.stdout, "HTTP/1.1 200 OK\n") || !strings.Contains(r.stdout, "paid content from the hono server") {
			t.Fatalf("caddy x402 pay --sign-in exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		return r.stderr
	}
	if stderr := pay(); !strings.Contains(stderr, "was refused") || !strings.Contains(stderr, "paying") {
		t.Fatalf("the first pay --sign-in said %q; want the sign-in refused and a payment", stderr)
	}
	for i := 0; i < 3; i++ {
		if stderr := pay(); !strings.Contains(stderr, "signed in as "+payer.Hex()) || strings.Contains(stderr, "was refused") {
			t.Fatalf("pay --sign-in %d after paying said %q; want it signed in without paying", i, stderr)
		}
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000: one payment", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payer, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}
}
