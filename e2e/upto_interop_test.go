package e2e

import (
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/x402"
)

// uptoMaximum is the most an upto payment of these tests may charge: $0.01 of the dev token, in raw units.
const uptoMaximum = 10000

// uptoInterop is one dev chain with one Caddy around it: at /facilitator/ the x402_facilitator handler over the
// embedded engine, at /used/ an upto gate in front of an upstream in the test process, and at /unmetered/ the
// same gate with default_amount zero; with the reference facilitator, at /through-ts/ the /used/ gate settling
// through it. The payer has approved Permit2 for the dev token.
type uptoInterop struct {
	t                 *testing.T
	node, sdk         string
	chainURL, gateURL string
	caddy             *process
	dev               *devChain
	payer             *ecdsa.PrivateKey
	upstream          *meteredUpstream
	// tsFacilitator is the process of the TypeScript reference facilitator (facilitator.mjs), nil without one;
	// tsFacilitatorKey is the key it settles from, funded with gas money.
	tsFacilitator    *process
	tsFacilitatorKey *ecdsa.PrivateKey
}

// meteredUpstream is the resource server behind the upto gate: a handler that says what a request used in a
// Settlement-Overrides header, the value chosen by the path's last segment (see overrides), and records what
// it was asked.
type meteredUpstream struct {
	mu   sync.Mutex
	seen []string
}

// overrides is what the upstream answers in Settlement-Overrides, by the last path segment; a segment not
// listed answers without the header.
var overrides = map[string]string{
	"below":     `{"amount":"4321"}`,
	"above":     `{"amount":"20000"}`,
	"zero":      `{"amount":"0"}`,
	"malformed": `4321 units, roughly`,
	"dollars":   `{"amount":"$0.0025009"}`, // truncated to the token's 6 decimals: 2500
	"percent":   `{"amount":"12.5%"}`,      // of the maximum: 1250
}

func (u *meteredUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.seen = append(u.seen, r.URL.Path)
	u.mu.Unlock()
	use := r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:]
	if v, ok := overrides[use]; ok {
		w.Header().Set(x402.HeaderSettlementOverrides, v)
	}
	w.Header().Set("Content-Type", "text/plain")
	fmt.Fprintf(w, "the upstream's answer to %s", r.URL.Path)
}

func (u *meteredUpstream) asked(path string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return slices.Contains(u.seen, path)
}

// startUptoInterop installs the pinned TypeScript SDK, starts the upstream, with withTSFacilitator the
// TypeScript reference facilitator, Caddy with its dev chain, and funds and approves the payer.
func startUptoInterop(t *testing.T, withTSFacilitator bool) *uptoInterop {
	t.Helper()
	needBinary(t)
	// The public TypeScript x402 SDK is installed from npm and run with node.
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	u := &uptoInterop{t: t, node: node, sdk: installTypeScriptClient(t, npm), upstream: new(meteredUpstream)}

	upstream := httptest.NewServer(u.upstream) // on 127.0.0.1
	t.Cleanup(upstream.Close)

	u.chainURL = fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	u.gateURL = fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	var throughTS string
	if withTSFacilitator {
		tsFacURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
		u.tsFacilitatorKey = devchain.PayerKeyN(9)
		u.tsFacilitator = startProgram(t, "the TypeScript reference facilitator", u.sdk, append(os.Environ(),
			"X402_FACILITATOR_KEY="+hexutil.Encode(crypto.FromECDSA(u.tsFacilitatorKey)), "X402_RPC_URL="+u.chainURL,
			fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID), "X402_LIFETIME_SECONDS=300"),
			node, "facilitator.mjs", portOf(t, tsFacURL))
		u.tsFacilitator.waitUntil("its /supported", 60*time.Second, answersWith(tsFacURL+"/supported", 200))
		throughTS = fmt.Sprintf(`
	handle /through-ts/* {
		x402 {
			scheme upto
			price $0.01
			pay_to %s
			asset %s
			token_name "Stable Coin"
			token_version 1
			facilitator %s
		}
		reverse_proxy %s
	}`, seller.Hex(), devchain.TokenAddress.Hex(), tsFacURL, upstream.URL)
	}
	dir := t.TempDir()
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
	handle /used/* {
		x402 {
			scheme upto
			price $0.01
			pay_to %[3]s
			description "Metered content: pay for what you use, up to $0.01"
		}
		reverse_proxy %[4]s
	}
	handle /unmetered/* {
		x402 {
			scheme upto
			price $0.01
			default_amount zero
			pay_to %[3]s
		}
		reverse_proxy %[4]s
	}%[5]s
}
`, strings.TrimPrefix(u.chainURL, "http://"), u.gateURL, seller.Hex(), upstream.URL, throughTS))
	u.caddy = startProcess(t, "Caddy with the dev chain, the upto gate and the facilitator", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	started := time.Now()
	u.caddy.waitUntil("a 402 from the upto gate", 60*time.Second, answersWith(u.gateURL+"/used/none", 402))
	t.Logf("Caddy with the dev chain served after %s", time.Since(started).Round(time.Millisecond))
	u.dev = dialChain(t, u.chainURL)

	// The payer gets gas money and tokens from the demo payer, and approves Permit2 (the upto proxy pulls
	// through it).
	u.payer = devchain.PayerKeyN(1)
	payer := crypto.PubkeyToAddress(u.payer.PublicKey)
	u.dev.send(devchain.PayerKey(), payer, big.NewInt(1e18), nil)
	u.dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", payer, big.NewInt(1_000_000)))
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	u.dev.send(u.payer, devchain.TokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))
	if u.tsFacilitatorKey != nil {
		u.dev.send(devchain.PayerKey(), crypto.PubkeyToAddress(u.tsFacilitatorKey.PublicKey), big.NewInt(1e18), nil)
	}
	return u
}

// payWithTypeScript pays url with pay.mjs, choosing the upto offer, and returns what it printed; the test fails
// unless the script printed its line.
func (u *uptoInterop) payWithTypeScript(t *testing.T, url string) paidByTypeScript {
	t.Helper()
	env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(u.payer)), "X402_RPC_URL="+u.chainURL,
		"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		fmt.Sprintf("X402_MAX_AMOUNT=%d", uptoMaximum), "X402_SCHEME=upto")
	r := runCommand(t, 2*time.Minute, u.sdk, env, u.node, "pay.mjs", url)
	var got paidByTypeScript
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
		t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
	}
	if got.Error != "" || got.Status != 200 {
		t.Fatalf("the TypeScript client did not get the content of %s: exit %d, status %d, error %q, body %q, payment response %+v\nstderr:\n%s",
			url, r.code, got.Status, got.Error, got.Body, got.PaymentResponse, r.stderr)
	}
	if got.Sent == nil || got.Sent.Scheme != x402.SchemeUpto || got.Sent.Method != x402.TransferPermit2 || got.Sent.Amount != fmt.Sprint(uptoMaximum) {
		t.Errorf("the client signed %+v; want an upto permit2 authorization of at most %d", got.Sent, uptoMaximum)
	}
	return got
}

// charged checks what one payment of want raw units did on chain since block from: the payer's and the seller's
// balances moved by exactly want, in exactly one Transfer from the payer to the seller, in the transaction the
// PAYMENT-RESPONSE names; for want 0, nothing moved, no Transfer, and the PAYMENT-RESPONSE names no transaction.
// It checks the PAYMENT-RESPONSE says success, the payer and the amount.
func (u *uptoInterop) charged(t *testing.T, settled *x402.SettleResponse, from uint64, payerBefore, sellerBefore *big.Int, want int64) {
	t.Helper()
	dev := u.chain(t)
	payer := crypto.PubkeyToAddress(u.payer.PublicKey)
	amount := big.NewInt(want)
	if settled == nil || !settled.Success || settled.Amount != amount.String() || !strings.EqualFold(settled.Payer, payer.Hex()) {
		t.Errorf("PAYMENT-RESPONSE %+v; want success, amount %q, payer %s", settled, amount, payer.Hex())
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(new(big.Int).Neg(amount)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -%s", d, amount)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(amount) != 0 {
		t.Errorf("the seller's balance moved by %s, want +%s", d, amount)
	}
	var transfers []types.Log
	if dev.head() >= from { // no block since: nothing was sent at all
		transfers = dev.transfers(payer, seller, from)
	}
	if want == 0 {
		if len(transfers) != 0 {
			t.Errorf("nothing was to be charged, yet %d Transfers went from the payer to the seller", len(transfers))
		}
		if settled != nil && settled.Transaction != "" {
			t.Errorf("nothing was to be charged, yet PAYMENT-RESPONSE names transaction %q", settled.Transaction)
		}
		return
	}
	if len(transfers) != 1 || transferAmount(transfers[0]).Cmp(amount) != 0 {
		var amounts []string
		for _, l := range transfers {
			amounts = append(amounts, transferAmount(l).String())
		}
		t.Errorf("Transfers from the payer to the seller since block %d: %v; want exactly one of %s", from, amounts, amount)
		return
	}
	if settled != nil && (!txHashPattern.MatchString(settled.Transaction) || common.HexToHash(settled.Transaction) != transfers[0].TxHash) {
		t.Errorf("PAYMENT-RESPONSE names transaction %q; the Transfer was in %s", settled.Transaction, transfers[0].TxHash)
	}
}

// chain is the dev chain read on behalf of t (a subtest): a failed read fails t, not the test that started it.
func (u *uptoInterop) chain(t *testing.T) *devChain {
	dev := *u.dev
	dev.t = t
	return &dev
}

// TestTheTypeScriptUptoClientPaysOurGateWhatTheUpstreamSaysItUsed has the public TypeScript client (@x402/fetch
// with UptoEvmScheme of @x402/evm) pay our upto gate, $0.01 at most, in front of a reverse-proxied upstream that
// says in Settlement-Overrides what each request used. On the dev chain exactly that moves, in one settlement
// transaction (none for zero); the client gets 200, a PAYMENT-RESPONSE naming the amount and the transaction,
// and never the Settlement-Overrides header.
func TestTheTypeScriptUptoClientPaysOurGateWhatTheUpstreamSaysItUsed(t *testing.T) {
	u := startUptoInterop(t, false)
	cases := []struct {
		name, path string
		charged    int64
	}{
		{"an override below the maximum charges exactly the override", "/used/below", 4321},
		{"an override above the maximum charges the maximum", "/used/above", uptoMaximum},
		{"an override of zero charges nothing and sends no transaction", "/used/zero", 0},
		{"no override charges the maximum", "/used/none", uptoMaximum},
		{"a malformed override charges the maximum, as if absent", "/used/malformed", uptoMaximum},
		{"an override in dollars charges them, truncated to the token's decimals", "/used/dollars", 2500},
		{"an override in percent charges that share of the maximum", "/used/percent", 1250},
		{"no override under default_amount zero charges nothing", "/unmetered/none", 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := u.payAndCheck(t, u.gateURL+c.path, common.Address{}, c.charged)
			if want := "the upstream's answer to " + c.path; got.Body != want {
				t.Errorf("the client got %q, want %q", got.Body, want)
			}
			if !u.upstream.asked(c.path) {
				t.Errorf("the upstream was never asked for %s", c.path)
			}
		})
	}
	u.caddy.stop()
}

// payAndCheck pays url with the TypeScript client and checks that exactly charged moved (u.charged), that the
// Settlement-Overrides header did not reach the client, and, when facilitator is set, that the client signed
// for it and the settlement was sent from it: the only address the payer allowed to settle.
func (u *uptoInterop) payAndCheck(t *testing.T, url string, facilitator common.Address, charged int64) paidByTypeScript {
	t.Helper()
	start := time.Now()
	dev, payer := u.chain(t), crypto.PubkeyToAddress(u.payer.PublicKey)
	from := dev.head() + 1
	payerBefore, sellerBefore := dev.balance(payer), dev.balance(seller)
	got := u.payWithTypeScript(t, url)
	if got.SettlementOverrides != nil {
		t.Errorf("the Settlement-Overrides header reached the client: %q", *got.SettlementOverrides)
	}
	u.charged(t, got.PaymentResponse, from, payerBefore, sellerBefore, charged)
	if facilitator != (common.Address{}) {
		if got.Sent != nil && !strings.EqualFold(got.Sent.Facilitator, facilitator.Hex()) {
			t.Errorf("the client signed for facilitator %s, want %s", got.Sent.Facilitator, facilitator.Hex())
		}
		if charged != 0 && got.PaymentResponse != nil && txHashPattern.MatchString(got.PaymentResponse.Transaction) {
			if sender := dev.sender(common.HexToHash(got.PaymentResponse.Transaction)); sender != facilitator {
				t.Errorf("the settlement was sent by %s; the payer allowed only %s", sender, facilitator)
			}
		}
	}
	t.Logf("%s: %d raw units in %s", url, charged, time.Since(start).Round(time.Millisecond))
	return got
}

// TestAnHonoUptoServerSettlesWhatItsHandlerUsedThroughOurFacilitator runs an @x402/hono resource server with an
// upto route (UptoEvmScheme of @x402/evm/upto/server, $0.01 at most) whose handler calls
// setSettlementOverrides, settling through our x402_facilitator handler over the embedded engine. Our
// /supported lists the upto kind with a facilitatorAddress that is one of our settlement wallets; the
// TypeScript client signs for that address, and the hono server's settlement moves exactly what the handler
// named, sent by that wallet, as its PAYMENT-RESPONSE says.
func TestAnHonoUptoServerSettlesWhatItsHandlerUsedThroughOurFacilitator(t *testing.T) {
	u := startUptoInterop(t, false)
	network := fmt.Sprintf("eip155:%d", devchain.DefaultChainID)

	a, err := get(u.gateURL + "/facilitator/supported")
	if err != nil || a.status != 200 {
		t.Fatalf("GET /facilitator/supported = %d, %v; want 200", a.status, err)
	}
	var supported x402.SupportedResponse
	if err := json.Unmarshal([]byte(a.body), &supported); err != nil {
		t.Fatalf("/supported is not JSON: %v\n%s", err, a.body)
	}
	kind, ok := supported.SchemeKind(x402.Version2, x402.SchemeUpto, network, x402.TransferPermit2)
	if !ok {
		t.Fatalf("our /supported lists no upto kind for %s by permit2:\n%s", network, a.body)
	}
	var wallets []common.Address
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		wallets = append(wallets, crypto.PubkeyToAddress(k.PublicKey))
	}
	if !common.IsHexAddress(kind.Extra.FacilitatorAddress) || !slices.Contains(wallets, common.HexToAddress(kind.Extra.FacilitatorAddress)) {
		t.Fatalf("our upto kind names facilitatorAddress %q; want one of our settlement wallets %v\n%s", kind.Extra.FacilitatorAddress, wallets, a.body)
	}
	facilitator := common.HexToAddress(kind.Extra.FacilitatorAddress)
	t.Logf("our upto kind: %+v", kind)

	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	hono := startProgram(t, "the @x402/hono server with an upto route", u.sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+u.gateURL+"/facilitator", "X402_NETWORK="+network, "X402_ASSET="+devchain.TokenAddress.Hex(),
		"X402_PAY_TO="+seller.Hex(), fmt.Sprintf("X402_AMOUNT=%d", interopPrice), fmt.Sprintf("X402_UPTO_AMOUNT=%d", uptoMaximum),
		"X402_LIFETIME_SECONDS=300"),
		u.node, "server.mjs", portOf(t, honoURL))
	started := time.Now()
	hono.waitUntil("a 402 from the hono server's upto route", 60*time.Second, answersWith(honoURL+"/upto", 402))
	t.Logf("the @x402/hono server served after %s", time.Since(started).Round(time.Millisecond))

	cases := []struct {
		name, use string
		charged   int64
	}{
		{"the handler's override below the maximum is what our facilitator settles", "4321", 4321},
		{"the handler's override of zero settles nothing", "0", 0},
		{"no override settles the maximum", "", uptoMaximum},
	}
	for _, c := range cases {
		t.Run("@x402/fetch pays: "+c.name, func(t *testing.T) {
			url := honoURL + "/upto"
			if c.use != "" {
				url += "?use=" + c.use
			}
			u.payAndCheck(t, url, facilitator, c.charged)
		})
	}
	hono.stop()
	u.caddy.stop()
}

// TestOurUptoGateSettlesWhatItsUpstreamUsedThroughTheTypeScriptReferenceFacilitator puts our upto gate in front
// of the public TypeScript reference facilitator (x402Facilitator with UptoEvmScheme of @x402/evm/upto/facilitator,
// settling from a key of its own through the upto proxy at the canonical address): the gate takes the
// facilitatorAddress from the reference facilitator's /supported upto kind, the TypeScript client signs for
// it, and the reference facilitator settles on our dev chain's upto proxy exactly what the upstream named.
func TestOurUptoGateSettlesWhatItsUpstreamUsedThroughTheTypeScriptReferenceFacilitator(t *testing.T) {
	u := startUptoInterop(t, true)
	facilitator := crypto.PubkeyToAddress(u.tsFacilitatorKey.PublicKey)
	cases := []struct {
		name, path string
		charged    int64
	}{
		{"an override below the maximum settles exactly the override", "/through-ts/below", 4321},
		{"an override of zero settles nothing", "/through-ts/zero", 0},
		{"no override settles the maximum", "/through-ts/none", uptoMaximum},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			u.payAndCheck(t, u.gateURL+c.path, facilitator, c.charged)
		})
	}
	u.caddy.stop()
	u.tsFacilitator.stop()
}
