package e2e

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// testWalletJS is the browser wallet the test puts in the page before it loads: an EIP-1193 provider as
// window.ethereum that also announces itself by EIP-6963, whose every request goes to the Go test
// (window.x402TestWallet, exposed by chromedp), which signs with the demo payer's key and forwards reads to
// the dev chain.
const testWalletJS = `(() => {
  const provider = { isX402TestWallet: true, request: async ({ method, params }) => {
    const r = JSON.parse(await window.x402TestWallet(JSON.stringify({ method, params: params || [] })));
    if (r.error) { const e = new Error(r.error.message); e.code = r.error.code; throw e; }
    return r.result;
  } };
  window.ethereum = provider;
  const info = { uuid: "6f1c1a52-2d8e-4a43-9a0e-402402402402", name: "x402 test wallet", rdns: "test.x402.wallet",
    icon: "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E" };
  const announce = () => window.dispatchEvent(new CustomEvent("eip6963:announceProvider", { detail: Object.freeze({ info, provider }) }));
  window.addEventListener("eip6963:requestProvider", announce);
  announce();
  // A page loaded with ?x402-test-spender=V has its offers' extra.spender set to V ("" removes it) as the
  // page's script reads them: an offer naming no valid spender, which the script must refuse to sign.
  const spender = new URLSearchParams(location.search).get("x402-test-spender");
  if (spender !== null) {
    const parse = JSON.parse;
    JSON.parse = function (text, reviver) {
      const v = parse.call(this, text, reviver);
      if (v && Array.isArray(v.accepts)) v.accepts.forEach((a) => { if (a.extra) { if (spender === "") delete a.extra.spender; else a.extra.spender = spender; } });
      return v;
    };
  }
})();`

// testWallet answers the page's wallet requests for the demo payer: accounts, chain (starting on another chain,
// so that the page must ask to switch; with known set, it knows only those chains until the page adds one),
// eth_signTypedData_v4 and personal_sign with the payer's key, other reads from the chain.
type testWallet struct {
	t      *testing.T
	chain  *devChain
	onSign func(primaryType string)
	key    *ecdsa.PrivateKey // whose wallet this is

	mu sync.Mutex
	// refuse answers a method with this error instead of doing it (4001: the person refused); signer, when set,
	// signs typed data in place of key while the wallet still claims key's address (a wallet whose signature is
	// not the payer's).
	refuse  map[string]walletError
	signer  *ecdsa.PrivateKey
	chainID uint64
	known   map[uint64]bool      // nil: every chain; else switching to another answers 4902
	added   []addedChain         // what wallet_addEthereumChain was asked
	signed  []string             // primary types (personal_sign for a message), in order
	typed   []apitypes.TypedData // what eth_signTypedData_v4 signed, in order
	methods []string
}

// addedChain is a wallet_addEthereumChain parameter (EIP-3085).
type addedChain struct {
	ChainID        hexutil.Uint64 `json:"chainId"`
	ChainName      string         `json:"chainName"`
	RPCURLs        []string       `json:"rpcUrls"`
	NativeCurrency struct {
		Name     string `json:"name"`
		Symbol   string `json:"symbol"`
		Decimals int    `json:"decimals"`
	} `json:"nativeCurrency"`
}

type walletAnswer struct {
	Result any          `json:"result,omitempty"`
	Error  *walletError `json:"error,omitempty"`
}

type walletError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

func (w *testWallet) handle(ctx context.Context, arg string) (string, error) {
	var req struct {
		Method string            `json:"method"`
		Params []json.RawMessage `json:"params"`
	}
	if err := json.Unmarshal([]byte(arg), &req); err != nil {
		return "", err
	}
	w.mu.Lock()
	w.methods = append(w.methods, req.Method)
	refused, isRefused := w.refuse[req.Method]
	payer, signKey := w.key, w.key
	if w.signer != nil {
		signKey = w.signer
	}
	w.mu.Unlock()
	if isRefused {
		b, err := json.Marshal(walletAnswer{Error: &refused})
		return string(b), err
	}
	from := crypto.PubkeyToAddress(payer.PublicKey)
	answer := func(v any) (string, error) { b, err := json.Marshal(walletAnswer{Result: v}); return string(b), err }
	switch req.Method {
	case "eth_requestAccounts", "eth_accounts":
		return answer([]string{from.Hex()})
	case "eth_chainId":
		w.mu.Lock()
		defer w.mu.Unlock()
		return answer(hexutil.EncodeUint64(w.chainID))
	case "wallet_switchEthereumChain":
		var p []struct {
			ChainID hexutil.Uint64 `json:"chainId"`
		}
		if err := json.Unmarshal([]byte("["+string(req.Params[0])+"]"), &p); err != nil {
			return "", err
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		if w.known != nil && !w.known[uint64(p[0].ChainID)] {
			b, err := json.Marshal(walletAnswer{Error: &walletError{Code: 4902, Message: "Unrecognized chain ID"}})
			return string(b), err
		}
		w.chainID = uint64(p[0].ChainID)
		return answer(nil)
	case "wallet_addEthereumChain":
		var c addedChain
		if len(req.Params) != 1 || json.Unmarshal(req.Params[0], &c) != nil {
			return "", fmt.Errorf("wallet_addEthereumChain: want [chain], got %s", arg)
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		w.added = append(w.added, c)
		if w.known != nil {
			w.known[uint64(c.ChainID)] = true
		}
		w.chainID = uint64(c.ChainID) // as wallets do, switching to the chain added
		return answer(nil)
	case "personal_sign":
		var msg, signer string
		if len(req.Params) != 2 || json.Unmarshal(req.Params[0], &msg) != nil || json.Unmarshal(req.Params[1], &signer) != nil {
			return "", fmt.Errorf("personal_sign: want [message, address], got %s", arg)
		}
		if !strings.EqualFold(signer, from.Hex()) {
			return "", fmt.Errorf("personal_sign for %s, the wallet holds %s", signer, from.Hex())
		}
		text, err := hexutil.Decode(msg)
		if err != nil {
			return "", fmt.Errorf("personal_sign: the message is not hex: %w", err)
		}
		sig, err := crypto.Sign(accounts.TextHash(text), payer)
		if err != nil {
			return "", err
		}
		sig[64] += 27
		w.mu.Lock()
		w.signed = append(w.signed, "personal_sign")
		w.mu.Unlock()
		return answer(hexutil.Encode(sig))
	case "eth_signTypedData_v4":
		var signer, doc string
		if len(req.Params) != 2 || json.Unmarshal(req.Params[0], &signer) != nil || json.Unmarshal(req.Params[1], &doc) != nil {
			return "", fmt.Errorf("eth_signTypedData_v4: want [address, typed data JSON], got %s", arg)
		}
		if !strings.EqualFold(signer, from.Hex()) {
			return "", fmt.Errorf("eth_signTypedData_v4 for %s, the wallet holds %s", signer, from.Hex())
		}
		var td apitypes.TypedData
		if err := json.Unmarshal([]byte(doc), &td); err != nil {
			return "", fmt.Errorf("eth_signTypedData_v4: the typed data: %w", err)
		}
		hash, _, err := apitypes.TypedDataAndHash(td)
		if err != nil {
			return "", fmt.Errorf("eth_signTypedData_v4: hashing %s: %w", td.PrimaryType, err)
		}
		if w.onSign != nil {
			w.onSign(td.PrimaryType)
		}
		sig, err := crypto.Sign(hash, signKey)
		if err != nil {
			return "", err
		}
		sig[64] += 27
		w.mu.Lock()
		w.signed = append(w.signed, td.PrimaryType)
		w.typed = append(w.typed, td)
		w.mu.Unlock()
		return answer(hexutil.Encode(sig))
	default:
		params := make([]any, len(req.Params))
		for i, p := range req.Params {
			params[i] = p
		}
		var out json.RawMessage
		if err := w.chain.client.Client().CallContext(ctx, &out, req.Method, params...); err != nil {
			b, _ := json.Marshal(walletAnswer{Error: &walletError{Code: -32000, Message: err.Error()}})
			return string(b), nil
		}
		return answer(out)
	}
}

// TestAPersonPaysThePaywallFromABrowserWalletAndSeesTheContentWithTheTransaction drives headless Chromium to a
// paid URL on a real Caddy settling on the dev chain, with a test wallet injected as window.ethereum that signs
// with the demo payer's key. The person's wallet starts on another chain and has no Permit2 allowance: the page
// switches chain, signs the permit2 payment and the gas-sponsoring permit, retries with PAYMENT-SIGNATURE, and
// shows the paid content with its transaction; the seller's balance rises by exactly the price. Screenshots of
// the unpaid page, the signing state and the paid page are kept in the test's artifact directory (go test
// -artifacts keeps them; X402_SCREENSHOT_DIR overrides).
func TestAPersonPaysThePaywallFromABrowserWalletAndSeesTheContentWithTheTransaction(t *testing.T) {
	needBinary(t)
	browser := needs.Command(t, "chromium", "apt-get install chromium")
	dir := t.TempDir()
	chainProc, facts := startDevchain(t, dir)
	defer chainProc.stop()
	dev := dialChain(t, facts.RPC)
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	file := writeFile(t, dir, "paywall.Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			rpc %[1]s
		}
	}
}

%[2]s {
	bind 127.0.0.1
	handle /metered {
		route {
			x402 {
				scheme upto
				price $0.01
				pay_to %[3]s
				description "The metered report"
			}
			header Settlement-Overrides `+"`"+`{"amount":"2500"}`+"`"+`
			respond "the metered report: paid content"
		}
	}
	handle /permit {
		x402 $0.01 {
			pay_to %[3]s
			description "The permit report"
			accept {
				asset_transfer_method erc2612
			}
		}
		respond "the permit report: paid content"
	}
	handle /members {
		x402 $0.01 {
			pay_to %[3]s
			description "The members' report"
			access 1h
		}
		respond "the members' report: paid content"
	}
	handle {
		x402 $0.01 {
			pay_to %[3]s
			description "The premium report"
			accept {
				price $0.02
				asset %[4]s
				asset_transfer_method eip3009
			}
		}
		respond "the premium report: paid content"
	}
}
`, facts.RPC, gateURL, seller.Hex(), devchain.EIP3009TokenAddress.Hex()))
	gate := startProcess(t, "the Caddy with the paywall", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", file)
	defer gate.stop()
	gate.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/report", 402))

	shots := t.ArtifactDir()
	if d := os.Getenv(screenshotDirEnv); d != "" {
		shots = d
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, chromedp.ExecPath(browser), chromedp.Headless, chromedp.NoSandbox,
		chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1100, 900))
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	shootIn := func(bctx context.Context, name string) {
		t.Helper()
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Errorf("screenshot %s: %v", name, err)
			return
		}
		path := filepath.Join(shots, name)
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Error(err)
		}
		t.Logf("screenshot: %s", path)
	}
	shoot := func(name string) { t.Helper(); shootIn(bctx, name) }

	wallet := &testWallet{t: t, chain: dev, chainID: 1, key: devchain.PayerKey()}
	var once sync.Once
	wallet.onSign = func(string) { once.Do(func() { shoot("paywall-2-signing.png") }) }
	before := dev.balance(seller)
	if err := chromedp.Do(bctx, chromedp.ExposeFunc("x402TestWallet", wallet.handle)); err != nil {
		t.Fatalf("exposing the test wallet: %v", err)
	}
	if err := chromedp.Do(bctx, chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := cdp.Call(ctx, tg, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: testWalletJS})
		return err
	})); err != nil {
		t.Fatalf("adding the test wallet to the page: %v", err)
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/report")); err != nil {
		t.Fatalf("Chromium loading the paywall at %s: %v", gateURL, err)
	}
	wctx, cancelWait := context.WithTimeout(bctx, 15*time.Second)
	defer cancelWait()
	if _, err := chromedp.Run(wctx, chromedp.Poll[bool](`document.querySelector("button.x402-pay") !== null || null`)); err != nil {
		html, _ := chromedp.Run(bctx, chromedp.Evaluate[string](`document.documentElement.outerHTML`))
		t.Fatalf("the paywall at %s shows no pay button (%v):\n%s", gateURL, err, html)
	}
	text, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil || !strings.Contains(text, "The premium report") || !strings.Contains(text, "$0.01") || !strings.Contains(text, seller.Hex()) {
		t.Fatalf("the unpaid page reads (%v):\n%s\nwant the description, $0.01 and the payee", err, text)
	}
	shoot("paywall-1-unpaid.png")

	// The permit2 offer: the wallet has no Permit2 allowance, so the page adds the gas-sponsoring permit.
	idx, err := chromedp.Run(bctx, chromedp.Evaluate[int](`JSON.parse(document.getElementById("x402-payment-required").textContent).accepts.findIndex(a => a.extra && a.extra.assetTransferMethod === "permit2")`))
	if err != nil || idx < 0 {
		t.Fatalf("the page offers no permit2 payment (%d, %v)", idx, err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](fmt.Sprintf(`document.querySelector('button.x402-pay[data-offer="%d"]').click() || true`, idx))); err != nil {
		t.Fatalf("clicking pay: %v", err)
	}
	state, err := chromedp.Run(bctx, chromedp.Poll[string](`(() => { const s = document.getElementById("x402-status").getAttribute("data-state"); return s === "paid" || s === "error" ? s : null; })()`,
		chromedp.WithPollingTimeout(60*time.Second)))
	status, _ := chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-status").textContent`))
	shoot("paywall-3-paid.png")
	if err != nil || state != "paid" {
		t.Fatalf("after paying the status is %q (%v): %s; the wallet saw %v", state, err, status, wallet.methods)
	}
	content, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-paid").textContent`))
	if err != nil || content != "the premium report: paid content" {
		t.Errorf("the paid content on the page is %q (%v)", content, err)
	}
	tx, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-status").getAttribute("data-transaction")`))
	if err != nil || !strings.Contains(status, tx) || len(common.FromHex(tx)) != 32 {
		t.Errorf("the page shows %q with transaction %q (%v), want a transaction hash", status, tx, err)
	} else if from := dev.sender(common.HexToHash(tx)); from == (common.Address{}) {
		t.Errorf("transaction %s is not on the chain", tx)
	}
	if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 {
		t.Errorf("the seller's balance moved by %s, want exactly the price %d", d, asyncPrice)
	}
	wallet.mu.Lock()
	if want := []string{"PermitWitnessTransferFrom", "Permit"}; strings.Join(wallet.signed, ",") != strings.Join(want, ",") {
		t.Errorf("the wallet signed %v, want %v (the permit2 payment, then the gas-sponsoring permit)", wallet.signed, want)
	}
	if !slices.Contains(wallet.methods, "wallet_switchEthereumChain") || fmt.Sprintf("eip155:%d", wallet.chainID) != facts.Network {
		t.Errorf("the page did not switch the wallet to the dev chain: chain %d, methods %v", wallet.chainID, wallet.methods)
	}

	wallet.mu.Unlock()

	// A wallet holding none of the token: the page says so before anything is signed, and nothing moves.
	poor, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	wallet.mu.Lock()
	wallet.key, wallet.signed = poor, nil
	wallet.mu.Unlock()
	before = dev.balance(seller)
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/report")); err != nil {
		t.Fatalf("Chromium loading the paywall again: %v", err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](fmt.Sprintf(`document.querySelector('button.x402-pay[data-offer="%d"]').click() || true`, idx))); err != nil {
		t.Fatalf("clicking pay with the poor wallet: %v", err)
	}
	state, err = chromedp.Run(bctx, chromedp.Poll[string](`(() => { const s = document.getElementById("x402-status").getAttribute("data-state"); return s === "paid" || s === "error" ? s : null; })()`,
		chromedp.WithPollingTimeout(30*time.Second)))
	status, _ = chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-status").textContent`))
	shoot("paywall-4-too-little-balance.png")
	if err != nil || state != "error" || !strings.Contains(status, "Too little balance") || !strings.Contains(status, "Nothing was charged") {
		t.Errorf("a wallet without the token: the status is %q (%v): %q, want the too-little-balance error", state, err, status)
	}
	wallet.mu.Lock()
	if len(wallet.signed) != 0 {
		t.Errorf("the page had the poor wallet sign %v before finding it cannot pay", wallet.signed)
	}
	if d := delta(before, dev.balance(seller)); d.Sign() != 0 {
		t.Errorf("the seller's balance moved by %s on a payment refused in the page", d)
	}

	wallet.mu.Unlock()

	// Several offers, and the person picks the eip3009 one in USD Coin at $0.02: the page signs an EIP-3009
	// TransferWithAuthorization under the token's own domain, and only that token moves.
	wallet.mu.Lock()
	wallet.key, wallet.signed = devchain.PayerKey(), nil
	wallet.mu.Unlock()
	usdcBefore, stableBefore := dev.balanceOf(devchain.EIP3009TokenAddress, seller), dev.balance(seller)
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/report")); err != nil {
		t.Fatalf("Chromium loading the paywall a third time: %v", err)
	}
	idx3009, err := chromedp.Run(bctx, chromedp.Evaluate[int](`JSON.parse(document.getElementById("x402-payment-required").textContent).accepts.findIndex(a => a.extra && a.extra.assetTransferMethod === "eip3009")`))
	if err != nil || idx3009 < 0 {
		t.Fatalf("the page offers no eip3009 payment (%d, %v)", idx3009, err)
	}
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](fmt.Sprintf(`document.querySelector('button.x402-pay[data-offer="%d"]').click() || true`, idx3009))); err != nil {
		t.Fatalf("clicking the eip3009 offer: %v", err)
	}
	state, err = chromedp.Run(bctx, chromedp.Poll[string](`(() => { const s = document.getElementById("x402-status").getAttribute("data-state"); return s === "paid" || s === "error" ? s : null; })()`,
		chromedp.WithPollingTimeout(30*time.Second)))
	status, _ = chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-status").textContent`))
	shoot("paywall-5-paid-eip3009.png")
	if err != nil || state != "paid" {
		t.Fatalf("paying the eip3009 offer: the status is %q (%v): %s", state, err, status)
	}
	if d := delta(usdcBefore, dev.balanceOf(devchain.EIP3009TokenAddress, seller)); d.Cmp(big.NewInt(2*asyncPrice)) != 0 {
		t.Errorf("the seller's USD Coin moved by %s, want exactly the picked offer's %d", d, 2*asyncPrice)
	}
	if d := delta(stableBefore, dev.balance(seller)); d.Sign() != 0 {
		t.Errorf("the seller's Stable Coin moved by %s when the person picked USD Coin", d)
	}
	wallet.mu.Lock()
	if strings.Join(wallet.signed, ",") != "TransferWithAuthorization" {
		t.Errorf("the wallet signed %v for the eip3009 offer, want one TransferWithAuthorization", wallet.signed)
	}
	wallet.mu.Unlock()

	// visit loads path, clicks the button selector names and waits for the page to say paid or error.
	visit := func(path, selector, shot string) (state, status string) {
		t.Helper()
		if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+path)); err != nil {
			t.Fatalf("Chromium loading %s: %v", path, err)
		}
		if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](fmt.Sprintf(`document.querySelector(%q).click() || true`, selector))); err != nil {
			t.Fatalf("clicking %s on %s: %v", selector, path, err)
		}
		state, err := chromedp.Run(bctx, chromedp.Poll[string](`(() => { const s = document.getElementById("x402-status").getAttribute("data-state"); return s === "paid" || s === "error" ? s : null; })()`,
			chromedp.WithPollingTimeout(30*time.Second)))
		status, _ = chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("x402-status").textContent`))
		shoot(shot)
		if err != nil {
			t.Fatalf("%s: the page never said paid or error (%v): %q; the wallet saw %v", path, err, status, wallet.methods)
		}
		return state, status
	}
	pageText := func(expr string) string {
		t.Helper()
		v, err := chromedp.Run(bctx, chromedp.Evaluate[string](expr))
		if err != nil {
			t.Errorf("reading %s: %v", expr, err)
		}
		return v
	}

	// The errors a person meets, each said plainly, with nothing signed that should not be, no transaction sent
	// and no balance moved.
	refused := func(what string, path, selector, shot string, wantSigned []string, wantStatus ...string) {
		t.Helper()
		wallet.mu.Lock()
		wallet.signed = nil
		wallet.mu.Unlock()
		before, head := dev.balance(seller), dev.head()
		state, status := visit(path, selector, shot)
		if state != "error" {
			t.Errorf("%s: the page says %s: %q, want an error", what, state, status)
		}
		for _, want := range wantStatus {
			if !strings.Contains(status, want) {
				t.Errorf("%s: the page says %q, want it to say %q", what, status, want)
			}
		}
		wallet.mu.Lock()
		if strings.Join(wallet.signed, ",") != strings.Join(wantSigned, ",") {
			t.Errorf("%s: the wallet signed %v, want %v", what, wallet.signed, wantSigned)
		}
		wallet.refuse, wallet.signer = nil, nil
		wallet.mu.Unlock()
		if d := delta(before, dev.balance(seller)); d.Sign() != 0 {
			t.Errorf("%s: the seller's balance moved by %s", what, d)
		}
		if h := dev.head(); h != head {
			t.Errorf("%s: transactions were sent: the head moved from block %d to %d", what, head, h)
		}
	}
	permit2Button := fmt.Sprintf(`button.x402-pay[data-offer="%d"]`, idx)
	refuse := func(method string, code int, message string) {
		wallet.mu.Lock()
		wallet.refuse = map[string]walletError{method: {Code: code, Message: message}}
		wallet.mu.Unlock()
	}

	// No wallet at all: a tab without the injected wallet.
	wallet.mu.Lock()
	wallet.signed = nil
	wallet.mu.Unlock()
	{
		tab, cancelTab := chromedp.NewContext(bctx)
		if err := chromedp.Do(tab, chromedp.Navigate(gateURL+"/report")); err != nil {
			t.Fatalf("a tab without a wallet loading the paywall: %v", err)
		}
		before, head := dev.balance(seller), dev.head()
		if _, err := chromedp.Run(tab, chromedp.Evaluate[bool](`(window.ethereum === undefined) && (document.querySelector("button.x402-pay").click() || true)`)); err != nil {
			t.Fatalf("clicking pay without a wallet: %v", err)
		}
		state, err := chromedp.Run(tab, chromedp.Poll[string](`(() => { const s = document.getElementById("x402-status").getAttribute("data-state"); return s === "paid" || s === "error" ? s : null; })()`,
			chromedp.WithPollingTimeout(15*time.Second)))
		status, _ := chromedp.Run(tab, chromedp.Evaluate[string](`document.getElementById("x402-status").textContent`))
		shootIn(tab, "paywall-err-1-no-wallet.png")
		if err != nil || state != "error" || !strings.Contains(status, "No browser wallet was found") {
			t.Errorf("no wallet: the page says %q (%v): %q, want that no browser wallet was found", state, err, status)
		}
		if d := delta(before, dev.balance(seller)); d.Sign() != 0 || dev.head() != head {
			t.Errorf("no wallet: the seller's balance moved by %s or the head moved", d)
		}
		cancelTab()
		wallet.mu.Lock()
		if len(wallet.signed) != 0 {
			t.Errorf("the page without a wallet reached the test wallet: %v", wallet.signed)
		}
		wallet.mu.Unlock()
	}
	refuse("eth_requestAccounts", 4001, "User rejected the request.")
	refused("refusing to connect", "/report", permit2Button, "paywall-err-2-refused-connect.png", nil,
		"You declined to connect your wallet", "Nothing was charged")
	refuse("eth_signTypedData_v4", 4001, "User rejected the request.")
	refused("refusing to sign", "/report", permit2Button, "paywall-err-3-refused-sign.png", nil,
		"You refused to sign the payment", "Nothing was charged")
	wallet.mu.Lock()
	wallet.chainID = 1
	wallet.mu.Unlock()
	refuse("wallet_switchEthereumChain", 4001, "User rejected the request.")
	refused("refusing to switch chain", "/report", permit2Button, "paywall-err-4-refused-switch.png", nil,
		"You declined to switch your wallet to "+facts.Network, "Nothing was charged")
	refuse("wallet_switchEthereumChain", -32603, "the wallet is busy")
	refused("failing to switch chain", "/report", permit2Button, "paywall-err-5-failed-switch.png", nil,
		"did not switch to "+facts.Network, "the wallet is busy", "Nothing was charged")
	wallet.mu.Lock()
	wallet.chainID = 1 // the page switches it on the next payment
	if wallet.signer, err = crypto.GenerateKey(); err != nil {
		t.Fatal(err)
	}
	wallet.mu.Unlock()
	// A wallet whose signature is not the payer's: the facilitator refuses it, and the page shows the HTTP status
	// and the facilitator's reason.
	refused("a signature not the payer's", "/report", fmt.Sprintf(`button.x402-pay[data-offer="%d"]`, idx3009), "paywall-err-6-facilitator-refused.png",
		[]string{"TransferWithAuthorization"}, "The payment was refused (HTTP 402)", "invalid_exact_evm_signature", "the signature is not "+crypto.PubkeyToAddress(devchain.PayerKey().PublicKey).Hex(), "Nothing was charged")

	// An erc2612 offer: the page signs one EIP-2612 permit of exactly the price to the offer's spender (the
	// facilitator's settlement wallet) with the token's nonce, and the seller gets exactly the price.
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/permit")); err != nil {
		t.Fatalf("Chromium loading the erc2612 paywall: %v", err)
	}
	offerOf2612 := `JSON.stringify((() => { const a = JSON.parse(document.getElementById("x402-payment-required").textContent).accepts; const i = a.findIndex(r => r.extra && r.extra.assetTransferMethod === "erc2612"); return { index: i, spender: i < 0 ? "" : a[i].extra.spender || "", amount: i < 0 ? "" : a[i].amount }; })())`
	var offer2612 struct {
		Index   int    `json:"index"`
		Spender string `json:"spender"`
		Amount  string `json:"amount"`
	}
	if err := json.Unmarshal([]byte(pageText(offerOf2612)), &offer2612); err != nil || offer2612.Index < 0 || !common.IsHexAddress(offer2612.Spender) {
		t.Fatalf("the erc2612 page offers %+v (%v), want an erc2612 offer naming its spender", offer2612, err)
	}
	// An erc2612 offer whose spender is missing or the zero address: the page signs nothing (a permit lets its
	// spender move the amount anywhere).
	for i, spender := range []string{"", "0x0000000000000000000000000000000000000000"} {
		wallet.mu.Lock()
		wallet.chainID = 1
		wallet.mu.Unlock()
		refused(fmt.Sprintf("an erc2612 offer with spender %q", spender), "/permit?x402-test-spender="+spender, fmt.Sprintf(`button.x402-pay[data-offer="%d"]`, offer2612.Index),
			fmt.Sprintf("paywall-err-%d-erc2612-no-spender.png", 7+i), nil, "names no wallet to spend its permit", "not signed")
	}

	wallet.mu.Lock()
	wallet.signed, wallet.typed = nil, nil
	wallet.mu.Unlock()
	payerAddr := crypto.PubkeyToAddress(devchain.PayerKey().PublicKey)
	before, head := dev.balance(seller), dev.head()
	state, status = visit("/permit", fmt.Sprintf(`button.x402-pay[data-offer="%d"]`, offer2612.Index), "paywall-9-paid-erc2612.png")
	if state != "paid" || !strings.Contains(status, "Transaction 0x") {
		t.Fatalf("paying the erc2612 offer: %s: %q, want paid with its transaction; the wallet saw %v", state, status, wallet.methods)
	}
	// Each 402 names the next settlement wallet: the spender is the one of the page the person paid on.
	if err := json.Unmarshal([]byte(pageText(offerOf2612)), &offer2612); err != nil {
		t.Fatalf("reading the paid page's erc2612 offer: %v", err)
	}
	if content := pageText(`document.getElementById("x402-paid").textContent`); content != "the permit report: paid content" {
		t.Errorf("the erc2612 content on the page is %q", content)
	}
	if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 {
		t.Errorf("the seller's balance moved by %s for the erc2612 payment, want exactly the price %d", d, asyncPrice)
	}
	if dev.head() == head {
		t.Errorf("the erc2612 payment sent no transaction")
	}
	wallet.mu.Lock()
	if strings.Join(wallet.signed, ",") != "Permit" || len(wallet.typed) != 1 {
		t.Errorf("the wallet signed %v for the erc2612 offer, want one Permit", wallet.signed)
	} else if m, d := wallet.typed[0].Message, wallet.typed[0].Domain; !strings.EqualFold(fmt.Sprint(m["spender"]), offer2612.Spender) ||
		fmt.Sprint(m["value"]) != offer2612.Amount || !strings.EqualFold(fmt.Sprint(m["owner"]), payerAddr.Hex()) ||
		!strings.EqualFold(d.VerifyingContract, devchain.TokenAddress.Hex()) || fmt.Sprintf("eip155:%s", (*big.Int)(d.ChainId)) != facts.Network {
		t.Errorf("the permit signed was %v under %+v; want exactly %s to %s of the dev chain's token on %s", m, d, offer2612.Amount, offer2612.Spender, facts.Network)
	}
	wallet.mu.Unlock()

	// An upto route, paid from a wallet that knows no chain but mainnet: the page shows the maximum as "up to",
	// adds the dev chain to the wallet (wallet_addEthereumChain with the dev chain's RPC URL), signs the upto
	// authorization (the witness names the facilitator wallet) and shows what was charged. The seller gets
	// what the upstream named, 2500, not the maximum.
	wallet.mu.Lock()
	wallet.signed, wallet.chainID, wallet.known = nil, 1, map[uint64]bool{1: true}
	wallet.mu.Unlock()
	before = dev.balance(seller)
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/metered")); err != nil {
		t.Fatalf("Chromium loading the upto paywall: %v", err)
	}
	if text := pageText(`document.body.innerText`); !strings.Contains(text, "up to 0.01") || !strings.Contains(text, "up to $0.01") {
		t.Errorf("the upto page does not show the maximum as up to:\n%s", text)
	}
	state, status = visit("/metered", `button.x402-pay`, "paywall-6-paid-upto.png")
	if state != "paid" || !strings.Contains(status, "Paid 0.0025 Stable Coin of up to 0.01") {
		t.Fatalf("paying the upto route: %s: %q, want paid with the charge of up to the maximum; the wallet saw %v", state, status, wallet.methods)
	}
	if got := pageText(`document.getElementById("x402-status").getAttribute("data-charged")`); got != "2500" {
		t.Errorf("the page says %q was charged, want 2500", got)
	}
	if content := pageText(`document.getElementById("x402-paid").textContent`); content != "the metered report: paid content" {
		t.Errorf("the metered content on the page is %q", content)
	}
	if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(2500)) != 0 {
		t.Errorf("the seller's balance moved by %s for the upto payment, want what was charged, 2500, not the maximum", d)
	}
	wallet.mu.Lock()
	if len(wallet.signed) == 0 || wallet.signed[0] != "PermitWitnessTransferFrom" {
		t.Errorf("the wallet signed %v for the upto offer, want the permit2 authorization first", wallet.signed)
	}
	if len(wallet.added) != 1 || fmt.Sprintf("eip155:%d", wallet.added[0].ChainID) != facts.Network ||
		strings.Join(wallet.added[0].RPCURLs, ",") != facts.RPC || wallet.added[0].ChainName == "" ||
		wallet.added[0].NativeCurrency.Decimals != 18 || fmt.Sprintf("eip155:%d", wallet.chainID) != facts.Network {
		t.Errorf("the wallet was asked to add %+v and is on chain %d; want the dev chain %s with its RPC URL %s", wallet.added, wallet.chainID, facts.Network, facts.RPC)
	}
	wallet.known = nil
	wallet.mu.Unlock()

	// A route with access: the person pays once, and on a later visit signs in instead of paying again
	// (personal_sign of the sign-in-with-x message, retried with SIGN-IN-WITH-X): the content is shown, and
	// no transaction is sent, nothing moves.
	membersIdx := -1
	before = dev.balance(seller)
	if err := chromedp.Do(bctx, chromedp.Navigate(gateURL+"/members")); err != nil {
		t.Fatalf("Chromium loading the members' paywall: %v", err)
	}
	if membersIdx, err = chromedp.Run(bctx, chromedp.Evaluate[int](`JSON.parse(document.getElementById("x402-payment-required").textContent).accepts.findIndex(a => a.extra && a.extra.assetTransferMethod === "permit2")`)); err != nil || membersIdx < 0 {
		t.Fatalf("the members' page offers no permit2 payment (%d, %v)", membersIdx, err)
	}
	state, status = visit("/members", fmt.Sprintf(`button.x402-pay[data-offer="%d"]`, membersIdx), "paywall-7-paid-members.png")
	if state != "paid" {
		t.Fatalf("paying the members' route: %s: %q", state, status)
	}
	if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 {
		t.Errorf("the seller's balance moved by %s for the members' payment, want %d", d, asyncPrice)
	}
	wallet.mu.Lock()
	wallet.signed = nil
	wallet.mu.Unlock()
	before, head = dev.balance(seller), dev.head()
	state, status = visit("/members", `button.x402-signin`, "paywall-8-signed-in.png")
	if state != "paid" || !strings.Contains(status, "Signed in as") {
		t.Fatalf("signing in on the members' route: %s: %q, want signed in", state, status)
	}
	if content := pageText(`document.getElementById("x402-paid").textContent`); content != "the members' report: paid content" {
		t.Errorf("after signing in the page shows %q", content)
	}
	if d := delta(before, dev.balance(seller)); d.Sign() != 0 {
		t.Errorf("signing in moved the seller's balance by %s", d)
	}
	if h := dev.head(); h != head {
		t.Errorf("signing in sent transactions: the head moved from block %d to %d", head, h)
	}
	wallet.mu.Lock()
	defer wallet.mu.Unlock()
	if strings.Join(wallet.signed, ",") != "personal_sign" {
		t.Errorf("signing in, the wallet signed %v, want one personal_sign and no payment", wallet.signed)
	}
}
