package e2e

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/x402"
)

// operatorPayments is how many payments the operator's Caddy settles before it is looked at.
const operatorPayments = 3

// screenshotDirEnv names a folder where the browser test leaves its screenshot of the health page, for a person
// to look at; without it, the screenshot goes to the test's temporary folder.
const screenshotDirEnv = "X402_SCREENSHOT_DIR"

// TestAnOperatorSeesNetworksWalletsJournalAndRefusals runs the built binary with the dev chain, a paid route and
// an x402_facilitator, settles a few payments and has one refused (a payer without tokens). Then `caddy x402
// status` against the admin API, as a table and as JSON, and /health in headless Chromium, each show the
// network and how old its head is, every settlement wallet with the native balance the chain holds, the
// journal's backlog, and the refusal with its reason and payer; nothing shows a key.
func TestAnOperatorSeesNetworksWalletsJournalAndRefusals(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	chainAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	admin := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	site := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	file := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin %s
	x402 {
		dev_chain {
			listen %s
		}
	}
}

%s {
	bind 127.0.0.1
	handle /paid {
		x402 {
			price $0.01
			pay_to %s
		}
		respond "paid"
	}
	handle_path /facilitator/* {
		x402_facilitator
	}
}
`, admin, chainAddr, site, seller.Hex()))
	caddy := startProcess(t, "caddy run (the operator's)", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", file)
	caddy.waitUntil("a 402 on "+site+"/paid", 90*time.Second, answersWith(site+"/paid", 402))
	rpc := "http://" + chainAddr
	dev := dialChain(t, rpc)

	for i := range operatorPayments {
		pay := runCommand(t, 2*time.Minute, dir, childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", rpc, site+"/paid")
		if pay.code != 0 || !strings.HasPrefix(pay.stdout, "HTTP/1.1 200 OK\n") {
			t.Fatalf("payment %d: caddy x402 pay exited %d\nstdout:\n%s\nstderr:\n%s", i+1, pay.code, pay.stdout, pay.stderr)
		}
	}
	brokeKey, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	broke := crypto.PubkeyToAddress(brokeKey.PublicKey)
	brokeHex := hex.EncodeToString(crypto.FromECDSA(brokeKey))
	refused := runCommand(t, 2*time.Minute, dir, childEnv(t, "X402_PAYER_KEY="+brokeHex), caddyBin, "x402", "pay", "--rpc", rpc, "--max", "10000", site+"/paid")
	if refused.code == 0 || !strings.Contains(refused.stdout+refused.stderr, x402.ReasonInsufficientFunds) {
		t.Fatalf("a payer without tokens: caddy x402 pay exited %d, want a refusal for %s\nstdout:\n%s\nstderr:\n%s",
			refused.code, x402.ReasonInsufficientFunds, refused.stdout, refused.stderr)
	}

	network := x402.EIP155(devchain.DefaultChainID)
	var wallets []common.Address
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		wallets = append(wallets, crypto.PubkeyToAddress(k.PublicKey))
	}
	secrets := []string{brokeHex, hex.EncodeToString(crypto.FromECDSA(devchain.PayerKey()))}
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		secrets = append(secrets, hex.EncodeToString(crypto.FromECDSA(k)))
	}
	noSecret := func(what, text string) {
		t.Helper()
		for _, s := range secrets {
			if strings.Contains(strings.ToLower(text), s) {
				t.Errorf("%s shows a private key", what)
			}
		}
	}

	t.Run("caddy x402 status --json", func(t *testing.T) {
		st := runCommand(t, time.Minute, dir, childEnv(t), caddyBin, "x402", "status", "--address", admin, "--json")
		if st.code != 0 {
			t.Fatalf("caddy x402 status --json exited %d\nstdout:\n%s\nstderr:\n%s", st.code, st.stdout, st.stderr)
		}
		noSecret("caddy x402 status --json", st.stdout+st.stderr)
		var h x402.HealthResponse
		if err := json.Unmarshal([]byte(st.stdout), &h); err != nil {
			t.Fatalf("caddy x402 status --json printed no status document: %v\n%s", err, st.stdout)
		}
		if h.Status != x402.HealthOK || len(h.Networks) != 1 {
			t.Fatalf("status %q with %d networks, want ok with one:\n%s", h.Status, len(h.Networks), st.stdout)
		}
		n := h.Networks[0]
		if n.Network != network || !n.RPCReachable || n.HeadBlock < operatorPayments || n.JournalBacklog != 0 || n.PendingSettlements != 0 {
			t.Errorf("network %+v, want %s reachable, at block %d or later, with nothing in the journal's backlog", n, network, operatorPayments)
		}
		if len(n.Wallets) != len(wallets) {
			t.Fatalf("wallets %+v, want the dev chain's %d", n.Wallets, len(wallets))
		}
		for i, w := range n.Wallets {
			if onChain := dev.ether(wallets[i]).String(); w.Address != wallets[i].Hex() || w.Balance != onChain || w.InFlight != 0 {
				t.Errorf("wallet #%d = %+v, want %s holding %s wei on chain, nothing in flight", i+1, w, wallets[i].Hex(), onChain)
			}
		}
		r := h.Refusals
		if r == nil || r.Total != 1 || len(r.Recent) != 1 || len(r.Counts) != 1 {
			t.Fatalf("refusals %+v, want the one refused payment", r)
		}
		if one := r.Recent[0]; one.Reason != x402.ReasonInsufficientFunds || one.Payer != broke.Hex() || one.Network != network {
			t.Errorf("the refusal %+v, want %s of %s on %s", one, x402.ReasonInsufficientFunds, broke.Hex(), network)
		}
	})

	t.Run("caddy x402 status", func(t *testing.T) {
		st := runCommand(t, time.Minute, dir, childEnv(t), caddyBin, "x402", "status", "--address", admin)
		if st.code != 0 {
			t.Fatalf("caddy x402 status exited %d\nstdout:\n%s\nstderr:\n%s", st.code, st.stdout, st.stderr)
		}
		t.Logf("caddy x402 status:\n%s", st.stdout)
		noSecret("caddy x402 status", st.stdout+st.stderr)
		lines := strings.Split(st.stdout, "\n")
		want := []string{"x402 status: ok", "network " + network + ": ok", "  head ", "  journal backlog ", "  pending settlements ",
			"refused since start: 1"}
		for _, w := range wallets {
			want = append(want, "  "+w.Hex()+" ")
		}
		for _, w := range want {
			if !hasLinePrefix(lines, w) {
				t.Errorf("no line starts with %q", w)
			}
		}
		for _, w := range []string{x402.ReasonInsufficientFunds, broke.Hex(), " old"} {
			if !strings.Contains(st.stdout, w) && !(w == " old" && strings.Contains(st.stdout, " ahead of this clock")) {
				t.Errorf("the status does not say %q", w)
			}
		}
		// A wallet line gives its balance in whole coins, as the chain holds it.
		for _, l := range lines {
			if f := strings.Fields(l); len(f) >= 3 && f[0] == wallets[0].Hex() {
				if want := facilitatorserver.FormatNative(dev.ether(wallets[0]).String()); f[1] != want {
					t.Errorf("wallet line %q: balance %s, want %s", l, f[1], want)
				}
			}
		}

		// The admin API of a Caddy that is not there: the command says where it looked.
		gone := runCommand(t, time.Minute, dir, childEnv(t), caddyBin, "x402", "status", "--address", fmt.Sprintf("127.0.0.1:%d", freePort(t)))
		if gone.code == 0 || !strings.Contains(gone.stderr, "asking the admin API at 127.0.0.1:") {
			t.Errorf("status of no Caddy exited %d, want an error naming the address:\n%s", gone.code, gone.stderr)
		}
	})

	t.Run("the health page in Chromium", func(t *testing.T) {
		text, shot := healthPageInChromium(t, site+"/facilitator/health")
		noSecret("the health page", text)
		for _, w := range append([]string{network, "Head age", "Journal backlog", "Pending settlements", "Settlement wallets",
			x402.ReasonInsufficientFunds, broke.Hex(), facilitatorserver.FormatNative(dev.ether(wallets[0]).String())}, hexes(wallets)...) {
			if !strings.Contains(text, w) {
				t.Errorf("the page as Chromium renders it does not show %q:\n%s", w, text)
			}
		}
		if !strings.Contains(text, " old") && !strings.Contains(text, "ahead of this clock") {
			t.Errorf("the page does not say how old the head is:\n%s", text)
		}
		t.Logf("the health page as Chromium shows it: %s", shot)
	})
	caddy.stop()
}

// healthPageInChromium loads url in headless Chromium, as a person's browser asks for it (Accept: text/html
// first), and returns the text it renders and the path of a screenshot of it.
func healthPageInChromium(t *testing.T, url string) (text, shot string) {
	t.Helper()
	browser := needs.Command(t, "chromium", "apt-get install chromium")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	actx, cancelAlloc := chromedp.NewExecAllocator(ctx, chromedp.ExecPath(browser), chromedp.Headless, chromedp.NoSandbox,
		chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1100, 900))
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	if err := chromedp.Do(bctx, chromedp.Navigate(url)); err != nil {
		t.Fatalf("Chromium loading %s: %v", url, err)
	}
	// The page is the HTML one, not JSON shown as text: it has the status badge.
	status, err := chromedp.Run(bctx, chromedp.Evaluate[string](`document.getElementById("status") ? document.getElementById("status").textContent : ""`))
	if err != nil || status != x402.HealthOK {
		t.Fatalf("Chromium at %s: the status badge reads %q (%v), want %q", url, status, err, x402.HealthOK)
	}
	text, err = chromedp.Run(bctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil {
		t.Fatalf("reading the page's text: %v", err)
	}
	png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("taking a screenshot: %v", err)
	}
	out := t.TempDir()
	if d := os.Getenv(screenshotDirEnv); d != "" {
		out = d
	}
	shot = filepath.Join(out, "health-page.png")
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}
	return text, shot
}

func hasLinePrefix(lines []string, prefix string) bool {
	for _, l := range lines {
		if strings.HasPrefix(l, prefix) {
			return true
		}
	}
	return false
}

func hexes(addrs []common.Address) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a.Hex()
	}
	return out
}
