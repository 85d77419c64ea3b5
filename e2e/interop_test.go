package e2e

import (
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/x402"
)

// interopPrice is the interop gate's price in raw units of the dev token ($0.01).
const interopPrice = 10000

// paidByTypeScript is what pay.mjs prints: the final answer and what the client signed.
type paidByTypeScript struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
	Error  string `json:"error"`
	Payer  string `json:"payer"`
	Sent   *struct {
		Scheme      string   `json:"scheme"`
		Method      string   `json:"method"`
		Amount      string   `json:"amount"`      // the amount signed: the price, or the upto maximum
		Facilitator string   `json:"facilitator"` // upto: the witness's facilitator address
		Extensions  []string `json:"extensions"`
		Sponsored   bool     `json:"sponsored"`
		// PaymentIdentifier is the id the payment named in its payment-identifier extension, "" when none.
		PaymentIdentifier string `json:"paymentIdentifier"`
	} `json:"sent"`
	PaymentResponse *x402.SettleResponse `json:"paymentResponse"`
	// SettlementOverrides is the Settlement-Overrides header of the final answer, nil if none reached the client.
	SettlementOverrides *string `json:"settlementOverrides"`
	// Runs are the fetches of X402_REPEAT, in order: each one's status, body and whether it paid.
	Runs []struct {
		Status int    `json:"status"`
		Body   string `json:"body"`
		Paid   bool   `json:"paid"`
	} `json:"runs"`
}

// interop is one dev chain with the servers of the interop matrix around it: our gate with the embedded
// facilitator, an @x402/hono server settling through our facilitator handler, and our gate settling through
// the public TypeScript reference facilitator; the payers are `caddy x402 pay` and @x402/fetch.
type interop struct {
	t        *testing.T
	node     string
	sdk      string // the folder with the pinned SDK installed and the scripts
	chainURL string
	dev      *devChain
	// The payers: the demo payer never approves Permit2 (it pays by EIP-3009); approved has approved Permit2
	// for both tokens. Both hold both tokens and gas money. Each gas-sponsored cell has a payer of its own.
	unapproved, approved *ecdsa.PrivateKey
}

// interopCell is one payment of the matrix: who pays what where, and which token must move.
type interopCell struct {
	server, payer, method string
	url                   string
	token                 common.Address
	key                   *ecdsa.PrivateKey
	// sponsored: the payment must carry the eip2612GasSponsoring permit. key is then a fresh payer holding
	// the token and nothing else: no Permit2 allowance and no gas money to approve with.
	sponsored bool
}

// TestThePublicTypeScriptSDKAndOursPayEachOtherOnTheDevChain is the interop matrix of the public TypeScript
// x402 SDK (@x402/* pinned in e2e/interop/package-lock.json, installed with npm ci) and ours, every cell a
// payment settled on the dev chain with the balances checked:
//
//	payer \ server   | our gate + embedded facilitator | @x402/hono + our facilitator | our gate + TS reference facilitator
//	caddy x402 pay   | permit2, erc2612, eip3009       | permit2 + gas sponsoring     | permit2, eip3009
//	@x402/fetch      | permit2, + gas sponsoring, eip3009 | permit2 + gas sponsoring  | permit2, eip3009
//
// The reference facilitator is configured with no transfer method: it lists the standard kind, and our gate
// offers permit2 and eip3009 in front of it, never erc2612.
func TestThePublicTypeScriptSDKAndOursPayEachOtherOnTheDevChain(t *testing.T) {
	needBinary(t)
	// The public TypeScript x402 SDK is installed from npm and run with node.
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	in := &interop{t: t, node: node, sdk: installTypeScriptClient(t, npm)}

	dir := t.TempDir()
	in.chainURL = fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	tsGateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	tsFacURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	network := fmt.Sprintf("eip155:%d", devchain.DefaultChainID)
	usdc, stable := devchain.EIP3009TokenAddress, devchain.TokenAddress

	// The reference facilitator settles from a key of its own, funded below; it needs the chain only then.
	tsFacKey := devchain.PayerKeyN(9)
	tsFac := startProgram(t, "the TypeScript reference facilitator", in.sdk, append(os.Environ(),
		"X402_FACILITATOR_KEY="+hexutil.Encode(crypto.FromECDSA(tsFacKey)), "X402_RPC_URL="+in.chainURL, "X402_NETWORK="+network),
		node, "facilitator.mjs", portOf(t, tsFacURL))
	started := time.Now()
	tsFac.waitUntil("its /supported", 60*time.Second, answersWith(tsFacURL+"/supported", 200))
	t.Logf("the TypeScript reference facilitator served after %s", time.Since(started).Round(time.Millisecond))

	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %[1]s
			block_time 0
		}
	}
}

%[2]s {
	bind 127.0.0.1
	handle_path /facilitator/* {
		x402_facilitator
	}
	handle /usdc/* {
		x402 $0.01 {
			pay_to %[4]s
			asset %[5]s
		}
		respond "paid in USD Coin"
	}
	handle {
		x402 $0.01 {
			pay_to %[4]s
			description "Content for the interop matrix"
		}
		respond "paid content for the interop matrix"
	}
}

%[3]s {
	bind 127.0.0.1
	handle {
		x402 $0.01 {
			pay_to %[4]s
			asset %[5]s
			token_name "USD Coin"
			token_version 2
			token_eip3009
			facilitator %[6]s
		}
		respond "paid through the TypeScript facilitator"
	}
}
`, strings.TrimPrefix(in.chainURL, "http://"), gateURL, tsGateURL, seller.Hex(), usdc.Hex(), tsFacURL))
	caddy := startProcess(t, "Caddy with the dev chain, the gates and the facilitator", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	started = time.Now()
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	t.Logf("Caddy with the dev chain served after %s", time.Since(started).Round(time.Millisecond))
	in.dev = dialChain(t, in.chainURL)

	hono := startProgram(t, "the @x402/hono server", in.sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+gateURL+"/facilitator", "X402_NETWORK="+network, "X402_ASSET="+stable.Hex(),
		"X402_PAY_TO="+seller.Hex(), fmt.Sprintf("X402_AMOUNT=%d", interopPrice)),
		node, "server.mjs", portOf(t, honoURL))
	started = time.Now()
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))
	t.Logf("the @x402/hono server served after %s", time.Since(started).Round(time.Millisecond))

	// Payer #1 starts with nothing: the demo payer gives it gas money and both tokens, and it approves
	// Permit2 for both. Payers #2 to #4, one per gas-sponsored cell, get the StableCoin only. The reference
	// facilitator gets gas money.
	in.unapproved, in.approved = devchain.PayerKey(), devchain.PayerKeyN(1)
	sponsoredKeys := []*ecdsa.PrivateKey{devchain.PayerKeyN(2), devchain.PayerKeyN(3), devchain.PayerKeyN(4)}
	approvedAddr := crypto.PubkeyToAddress(in.approved.PublicKey)
	in.dev.send(in.unapproved, approvedAddr, big.NewInt(1e18), nil)
	in.dev.send(in.unapproved, crypto.PubkeyToAddress(tsFacKey.PublicKey), big.NewInt(1e18), nil)
	for _, token := range []common.Address{stable, usdc} {
		in.dev.send(in.unapproved, token, nil, callToken(t, "transfer", approvedAddr, big.NewInt(1_000_000_000)))
		in.dev.approvePermit2(in.approved, token)
	}
	for _, key := range sponsoredKeys {
		in.dev.send(in.unapproved, stable, nil, callToken(t, "transfer", crypto.PubkeyToAddress(key.PublicKey), big.NewInt(1_000_000)))
	}

	// In front of the reference facilitator our gate offers the standard kind's methods, never erc2612.
	if got := offeredMethods(t, tsGateURL+"/"); got != "permit2 eip3009" {
		t.Fatalf("our gate in front of the reference facilitator offers %q, want \"permit2 eip3009\"", got)
	}

	cells := []interopCell{
		{server: "our gate + embedded", payer: "caddy x402 pay", method: "permit2", url: gateURL + "/", token: stable, key: in.approved},
		{server: "our gate + embedded", payer: "caddy x402 pay", method: "erc2612", url: gateURL + "/", token: stable, key: in.approved},
		{server: "our gate + embedded", payer: "caddy x402 pay", method: "eip3009", url: gateURL + "/usdc/", token: usdc, key: in.unapproved},
		{server: "our gate + embedded", payer: "@x402/fetch", method: "permit2", url: gateURL + "/", token: stable, key: in.approved},
		{server: "our gate + embedded", payer: "@x402/fetch", method: "permit2", url: gateURL + "/", token: stable, key: sponsoredKeys[0], sponsored: true},
		{server: "our gate + embedded", payer: "@x402/fetch", method: "eip3009", url: gateURL + "/usdc/", token: usdc, key: in.unapproved},
		{server: "@x402/hono + our facilitator", payer: "caddy x402 pay", method: "permit2", url: honoURL + "/paid", token: stable, key: sponsoredKeys[1], sponsored: true},
		{server: "@x402/hono + our facilitator", payer: "@x402/fetch", method: "permit2", url: honoURL + "/paid", token: stable, key: sponsoredKeys[2], sponsored: true},
		{server: "our gate + TS facilitator", payer: "caddy x402 pay", method: "permit2", url: tsGateURL + "/", token: usdc, key: in.approved},
		{server: "our gate + TS facilitator", payer: "caddy x402 pay", method: "eip3009", url: tsGateURL + "/", token: usdc, key: in.unapproved},
		{server: "our gate + TS facilitator", payer: "@x402/fetch", method: "permit2", url: tsGateURL + "/", token: usdc, key: in.approved},
		{server: "our gate + TS facilitator", payer: "@x402/fetch", method: "eip3009", url: tsGateURL + "/", token: usdc, key: in.unapproved},
	}
	// What each column's payments took, for the report of the matrix's cost.
	perColumn := map[string]time.Duration{}
	for _, c := range cells {
		name := fmt.Sprintf("%s pays %s by %s", c.payer, c.server, c.method)
		if c.sponsored {
			name += " with gas sponsoring"
		}
		t.Run(name, func(t *testing.T) {
			start := time.Now()
			in.pay(t, c)
			perColumn[c.server] += time.Since(start)
			t.Logf("%s took %s", name, time.Since(start).Round(time.Millisecond))
		})
	}
	for server, took := range perColumn {
		t.Logf("the payments to %s took %s", server, took.Round(time.Millisecond))
	}
	hono.stop()
	tsFac.stop()
	caddy.stop()
}

// pay makes the payment of one cell and checks it settled: 2xx, a successful PAYMENT-RESPONSE naming a
// transaction that moved exactly the price of the token from the payer to the seller, and the balances.
func (in *interop) pay(t *testing.T, c interopCell) {
	t.Helper()
	payer := crypto.PubkeyToAddress(c.key.PublicKey)
	price := big.NewInt(interopPrice)
	if c.sponsored {
		if allowance, gas := permit2Allowance(t, in.dev, c.token, payer), in.dev.ether(payer); allowance.Sign() != 0 || gas.Sign() != 0 {
			t.Fatalf("the payer of a gas-sponsored cell has a Permit2 allowance of %s and %s wei; want a fresh payer with neither", allowance, gas)
		}
	}
	payerBefore, sellerBefore := in.dev.balanceOf(c.token, payer), in.dev.balanceOf(c.token, seller)
	var settled *x402.SettleResponse
	if c.payer == "@x402/fetch" {
		env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(c.key)), "X402_RPC_URL="+in.chainURL,
			"X402_ASSET="+c.token.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID), "X402_MAX_AMOUNT="+price.String(),
			"X402_METHOD="+c.method)
		r := runCommand(t, 2*time.Minute, in.sdk, env, in.node, "pay.mjs", c.url)
		var got paidByTypeScript
		if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
			t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
		}
		if r.code != 0 || got.Status != 200 || got.Error != "" {
			t.Fatalf("the TypeScript client did not get the content: exit %d, status %d, error %q, body %q, payment response %+v\nstderr:\n%s",
				r.code, got.Status, got.Error, got.Body, got.PaymentResponse, r.stderr)
		}
		if got.Sent == nil || got.Sent.Method != c.method || got.Sent.Sponsored != c.sponsored {
			t.Errorf("the client signed %+v; want method %s with eip2612GasSponsoring %v", got.Sent, c.method, c.sponsored)
		}
		settled = got.PaymentResponse
	} else {
		env := childEnv(t, "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(c.key)))
		r := runCommand(t, 2*time.Minute, in.sdk, env, caddyBin, "x402", "pay", "--rpc", in.chainURL, "--method", c.method, c.url)
		if r.code != 0 || !strings.HasPrefix(r.stdout, "HTTP/1.1 200 OK\n") {
			t.Fatalf("caddy x402 pay --method %s %s exited %d\nstdout:\n%s\nstderr:\n%s", c.method, c.url, r.code, r.stdout, r.stderr)
		}
		if sponsored := strings.Contains(r.stderr, "gas sponsored"); sponsored != c.sponsored {
			t.Errorf("caddy x402 pay added gas sponsoring: %v, want %v\nstderr:\n%s", sponsored, c.sponsored, r.stderr)
		}
		s := printedSettlement(t, r.stdout)
		settled = &s
	}
	if settled == nil || !settled.Success || !txHashPattern.MatchString(settled.Transaction) || !strings.EqualFold(settled.Payer, payer.Hex()) {
		t.Fatalf("PAYMENT-RESPONSE %+v; want success with a transaction, payer %s", settled, payer.Hex())
	}
	if !receiptTransfersOf(in.dev, c.token, common.HexToHash(settled.Transaction), payer, seller, price) {
		t.Errorf("transaction %s holds no Transfer of %s of %s from the payer to the seller", settled.Transaction, price, c.token.Hex())
	}
	if d := delta(payerBefore, in.dev.balanceOf(c.token, payer)); d.Cmp(new(big.Int).Neg(price)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -%s", d, price)
	}
	if d := delta(sellerBefore, in.dev.balanceOf(c.token, seller)); d.Cmp(price) != 0 {
		t.Errorf("the seller's balance moved by %s, want +%s", d, price)
	}
}

// offeredMethods lists the transfer methods a URL's 402 offers, in order.
func offeredMethods(t *testing.T, url string) string {
	t.Helper()
	a, err := get(url)
	if err != nil || a.status != 402 {
		t.Fatalf("GET %s = %v, %v; want 402", url, a.status, err)
	}
	required, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatalf("GET %s: the %s header does not decode: %v", url, x402.HeaderPaymentRequired, err)
	}
	var methods []string
	for _, rq := range required.Accepts {
		methods = append(methods, rq.Extra.AssetTransferMethod)
	}
	return strings.Join(methods, " ")
}

// portOf is the port of a loopback URL, as the scripts take it.
func portOf(t *testing.T, url string) string {
	t.Helper()
	i := strings.LastIndex(url, ":")
	if i < 0 {
		t.Fatalf("no port in %s", url)
	}
	return url[i+1:]
}

// typeScriptSDK is the pinned SDK installed once for the test run: npm ci takes 15 s or more, and the tests
// only read the folder. TestMain removes it after the last test.
var typeScriptSDK struct {
	once sync.Once
	dir  string
	err  error
}

// installTypeScriptClient copies e2e/interop to a temporary folder and installs the pinned client there with
// npm ci, once for the test run, and returns the folder.
func installTypeScriptClient(t *testing.T, npm string) string {
	t.Helper()
	typeScriptSDK.once.Do(func() {
		dir, err := os.MkdirTemp("", "caddy-x402-interop-")
		if err != nil {
			typeScriptSDK.err = err
			return
		}
		afterAll = append(afterAll, func() { os.RemoveAll(dir) })
		for _, name := range []string{"package.json", "package-lock.json", "pay.mjs", "pay-batch.mjs", "server.mjs", "facilitator.mjs", "batch-vectors.mjs", "mcp-server.mjs", "mcp-client.mjs", "discover.mjs"} {
			b, err := os.ReadFile(filepath.Join(repoRoot, "e2e", "interop", name))
			if err == nil {
				err = os.WriteFile(filepath.Join(dir, name), b, 0o600)
			}
			if err != nil {
				typeScriptSDK.err = err
				return
			}
		}
		start := time.Now()
		r := runCommand(t, 5*time.Minute, dir, os.Environ(), npm, "ci", "--no-audit", "--no-fund", "--prefer-offline")
		if r.code != 0 {
			typeScriptSDK.err = fmt.Errorf("npm ci of the TypeScript x402 client exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			return
		}
		t.Logf("npm ci of the TypeScript x402 client took %s", time.Since(start).Round(time.Millisecond))
		typeScriptSDK.dir = dir
	})
	if typeScriptSDK.err != nil {
		t.Fatal(typeScriptSDK.err)
	}
	if typeScriptSDK.dir == "" {
		t.Fatal("an earlier test's install of the TypeScript x402 client did not finish")
	}
	return typeScriptSDK.dir
}

// permit2Allowance reads token's allowance(owner, Permit2).
func permit2Allowance(t *testing.T, dev *devChain, token, owner common.Address) *big.Int {
	t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	out, err := dev.client.CallContract(ctx, ethereum.CallMsg{To: &token, Data: callToken(t, "allowance", owner, contracts.Permit2Address)}, nil)
	if err != nil {
		t.Fatalf("reading allowance(%s, Permit2): %v", owner, err)
	}
	return new(big.Int).SetBytes(out)
}
