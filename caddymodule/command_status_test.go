package caddymodule_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// startCaddyWithAdmin is startCaddy with Caddy's admin API listening on a free loopback address, which it
// returns. The admin API is closed when the test ends.
func startCaddyWithAdmin(t *testing.T, caddyfile string) (*caddyServer, string) {
	t.Helper()
	s, admin, err := loadWithAdmin(t, caddyfile)
	if err != nil {
		t.Fatalf("loading the Caddy config: %v", err)
	}
	return s, admin
}

// loadWithAdmin loads caddyfile as startCaddyWithAdmin does and returns Caddy's error.
func loadWithAdmin(t *testing.T, caddyfile string) (*caddyServer, string, error) {
	t.Helper()
	caddyMu.Lock()
	s := &caddyServer{t: t, Addr: freeAddr(t), dir: t.TempDir()}
	s.URL = "http://" + s.Addr
	t.Setenv("XDG_DATA_HOME", s.dir+"/data")
	t.Setenv("XDG_CONFIG_HOME", s.dir+"/config")
	t.Cleanup(func() {
		// Stop leaves the admin API up; a config with it disabled closes it.
		_ = caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true)
		_ = caddy.Stop()
		caddyMu.Unlock()
	})
	admin := freeAddr(t)
	var cfg map[string]any
	if err := json.Unmarshal(s.adapt(caddyfile), &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["admin"] = map[string]any{"listen": admin, "config": map[string]any{"persist": false}}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, admin, caddy.Load(raw, true)
}

// `caddy x402 status` reads the running Caddy's admin API: the dev chain's network with its head, its four
// wallets with their balances, an empty journal and no refusal; --json gives the document; a browser asking
// the admin API gets the page; anything but GET is refused.
func TestStatusShowsTheRunningCaddysNetworkAndWallets(t *testing.T) {
	srv, admin := startCaddyWithAdmin(t, `{
	x402 {
		dev_chain {
			listen `+freeAddr(t)+`
		}
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to 0x000000000000000000000000000000000000dEaD
	}
	respond "paid"
}
`)
	waitFor402(t, srv.URL)

	out, errOut, err := caddymodule.RunX402("", "status", "--address", admin)
	if err != nil {
		t.Fatalf("caddy x402 status: %v\n%s\n%s", err, out, errOut)
	}
	network := x402.EIP155(devchain.DefaultChainID)
	want := []string{"x402 status: ok", "network " + network + ": ok", "  head ", "  journal backlog      0 not final",
		"  pending settlements  0", "refused since start: 0"}
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		want = append(want, "  "+crypto.PubkeyToAddress(k.PublicKey).Hex()+"  1000.000000")
	}
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("the status lacks %q:\n%s", w, out)
		}
	}

	out, _, err = caddymodule.RunX402("", "status", "--address", admin, "--json")
	var h x402.HealthResponse
	if err != nil || json.Unmarshal([]byte(out), &h) != nil || h.Status != x402.HealthOK || len(h.Networks) != 1 ||
		len(h.Networks[0].Wallets) != devchain.DefaultWallets || h.Refusals == nil || h.Refusals.Total != 0 {
		t.Errorf("caddy x402 status --json = %v\n%s", err, out)
	}

	page := adminGet(t, http.MethodGet, "http://"+admin+"/x402/status", "text/html")
	if page.StatusCode != http.StatusOK || page.Header.Get("Content-Type") != "text/html; charset=utf-8" ||
		!strings.Contains(readAll(t, page), "<code>"+network+"</code>") {
		t.Errorf("a browser at the admin API's /x402/status: status %d, Content-Type %q", page.StatusCode, page.Header.Get("Content-Type"))
	}
	if res := adminGet(t, http.MethodPost, "http://"+admin+"/x402/status", ""); res.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /x402/status: status %d, want 405", res.StatusCode)
	}
}

// A running Caddy without the x402 app has no x402 status, and the command says so.
func TestStatusOfACaddyWithoutTheX402AppSaysSo(t *testing.T) {
	_, admin := startCaddyWithAdmin(t, "{{ADDR}} {\n\trespond \"free\"\n}\n")
	out, _, err := caddymodule.RunX402("", "status", "--address", admin)
	if err == nil || !strings.Contains(err.Error(), "the running config has no x402 app") {
		t.Errorf("caddy x402 status of a Caddy without x402 = %v, want it to say there is no x402 app\n%s", err, out)
	}
}

// A status whose facilitator is down (HTTP 503, as /health answers) is still printed, network error and fields
// this version does not know included, and the command fails.
func TestStatusPrintsADownFacilitatorAndFails(t *testing.T) {
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/x402/status" || r.Header.Get("Accept") != "application/json" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"status":"down","networks":[{"network":"eip155:8453","status":"down","rpcReachable":false,`+
			`"journalBacklog":2,"pendingSettlements":1,"oldestPendingSeconds":125,"error":"RPC unreachable: dial tcp: connection refused",`+
			`"reachability":"unreachable since start"}],"refusals":{"total":0,"counts":[],"recent":[]}}`)
	}))
	defer admin.Close()
	out, _, err := caddymodule.RunX402("", "status", "--address", strings.TrimPrefix(admin.URL, "http://"))
	if err == nil || !strings.Contains(err.Error(), "down") {
		t.Errorf("caddy x402 status of a down facilitator = %v, want a failure saying down", err)
	}
	for _, w := range []string{"x402 status: down", "network eip155:8453: down", "  error                RPC unreachable: dial tcp: connection refused",
		"  head                 unknown: the RPC is not reachable", "  journal backlog      2 not final",
		"  pending settlements  1, the oldest claimed 2 min 5 s ago", "  reachability         unreachable since start"} {
		if !strings.Contains(out, w) {
			t.Errorf("the status lacks %q:\n%s", w, out)
		}
	}
}

func adminGet(t *testing.T, method, url, accept string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { res.Body.Close() })
	return res
}

func readAll(t *testing.T, res *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The admin API is provisioned before the config's apps; its x402 module must not provision the x402 app
// itself, which would have Caddy report the app's configuration errors otherwise than without an admin API.
func TestAnX402AppErrorReadsTheSameWithTheAdminAPIOn(t *testing.T) {
	_, _, err := loadWithAdmin(t, `{
	x402 {
		network eip155:1 {
			rpc http://127.0.0.1:1
			asset 0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913
		}
		journal "postgres://u@h/%zz"
	}
}

{{ADDR}} {
	respond "free"
}
`)
	if err == nil || !strings.Contains(err.Error(), "loading x402 app module: provision x402: journal: the PostgreSQL DSN is not a URL") {
		t.Errorf("a bad journal DSN with the admin API on = %v, want Caddy's usual \"loading x402 app module: provision x402: journal: ...\"", err)
	}
}
