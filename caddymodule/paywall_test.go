package caddymodule_test

import (
	"encoding/json"
	"html"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestThePaywallPageCarriesAWalletScriptAndAPayButtonPerOfferWithNothingFromElsewhere: the page a browser gets
// is self-contained (its script inline, no src or href to any other host), shows each offer's amount in token
// units and dollars with a pay button the script can sign, while a JSON client and HEAD get today's answers.
func TestThePaywallPageCarriesAWalletScriptAndAPayButtonPerOfferWithNothingFromElsewhere(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	a := env.get("/report", "Accept", "text/html")
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.header.Get("Content-Type"), "text/html") {
		t.Fatalf("browser answer = %d %s, want a 402 page", a.status, a.header.Get("Content-Type"))
	}
	for _, want := range []string{"$0.01", `class="x402-pay"`, `data-offer="0"`, "eth_signTypedData_v4", "eip6963:requestProvider",
		"wallet_switchEthereumChain", `id="x402-status"`} {
		if !strings.Contains(a.body, want) {
			t.Errorf("the paywall page lacks %q", want)
		}
	}
	if m := regexp.MustCompile(`(?i)(src|href)\s*=\s*["']?(https?:)?//`).FindString(a.body); m != "" {
		t.Errorf("the paywall page loads something from elsewhere: %q", m)
	}
	// The resource URL comes from the request and is written into the page's script: it cannot end the script.
	x := env.get("/report%3C/script%3E%3Cscript%3Ealert(1)%3C/script%3E", "Accept", "text/html")
	if x.status != http.StatusPaymentRequired || strings.Contains(x.body, "<script>alert(1)") {
		t.Errorf("a URL with </script> in it: %d, the page runs a script of the URL's", x.status)
	}
	j := env.get("/report", "Accept", "application/json")
	if j.status != http.StatusPaymentRequired || !strings.HasPrefix(j.header.Get("Content-Type"), "application/json") {
		t.Errorf("a JSON client got %d %s, want the 402 JSON", j.status, j.header.Get("Content-Type"))
	}
	req, err := http.NewRequest(http.MethodHead, env.srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "text/html")
	if h := env.do(req); h.status != http.StatusPaymentRequired || h.body != "" || h.header.Get("PAYMENT-REQUIRED") == "" {
		t.Errorf("HEAD from a browser = %d with %d bytes of body, want a bodiless 402 with PAYMENT-REQUIRED", h.status, len(h.body))
	}
}

// TestThePaywallBlockGivesThePageItsTitleLogoAndColourAndABadColourIsRefusedByName: the Caddyfile's paywall
// block reaches the page; a colour that is not a CSS hex colour is refused when the Caddyfile is read, naming
// the option and the value.
func TestThePaywallBlockGivesThePageItsTitleLogoAndColourAndABadColourIsRefusedByName(t *testing.T) {
	env := newGateEnv(t, gateSetup{gate: "\t\tpaywall {\n\t\t\ttitle \"Premium reports\"\n\t\t\tlogo /static/logo.png\n\t\t\tcolor 0b7a75\n\t\t}\n"})
	a := env.get("/report", "Accept", "text/html")
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("browser answer = %d, want 402", a.status)
	}
	for _, want := range []string{"<title>Premium reports</title>", "<h1>Premium reports</h1>", `src="/static/logo.png"`, "background:#0b7a75"} {
		if !strings.Contains(a.body, want) {
			t.Errorf("the styled paywall page lacks %q", want)
		}
	}
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("http://127.0.0.1:1 {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tpaywall {\n\t\t\tcolor red;}\n\t\t}\n\t}\n\trespond ok\n}\n"), map[string]any{"filename": "Caddyfile"})
	if err == nil || !strings.Contains(err.Error(), "paywall color") || !strings.Contains(err.Error(), "red;}") {
		t.Errorf("a paywall color of red;} = %v, want an error naming paywall color and the value", err)
	}
}

// TestThePaywallPageCannotBeFramedAndADataLogoRendersWhileAnUnsafeOneIsRefused: the page says frame-ancestors
// 'none' (a pay button framed by another site is a click waiting to be stolen) unless frame_ancestors names who
// may; a base64 data:image/png logo reaches the page as given (html/template wrote #ZgotmplZ), and logos of other
// kinds (data:text/html, javascript:, http:, an SVG not in base64) are refused naming the option.
func TestThePaywallPageCannotBeFramedAndADataLogoRendersWhileAnUnsafeOneIsRefused(t *testing.T) {
	const logo = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
	env := newGateEnv(t, gateSetup{})
	a := env.get("/report", "Accept", "text/html")
	if csp := a.header.Get("Content-Security-Policy"); csp != "frame-ancestors 'none'" || a.header.Get("X-Frame-Options") != "DENY" {
		t.Errorf("the paywall page's Content-Security-Policy is %q, X-Frame-Options %q; want frame-ancestors 'none' and DENY", csp, a.header.Get("X-Frame-Options"))
	}
	env.reload(gateSetup{gate: "\t\tpaywall {\n\t\t\tlogo " + logo + "\n\t\t\tframe_ancestors 'self' https://shop.example.com\n\t\t}\n"})
	a = env.get("/report", "Accept", "text/html")
	if csp := a.header.Get("Content-Security-Policy"); csp != "frame-ancestors 'self' https://shop.example.com" || a.header.Get("X-Frame-Options") != "" {
		t.Errorf("with frame_ancestors the page's policy is %q (X-Frame-Options %q), want the sources given and no DENY", csp, a.header.Get("X-Frame-Options"))
	}
	if !strings.Contains(html.UnescapeString(a.body), `src="`+logo+`"`) || strings.Contains(a.body, "ZgotmplZ") {
		t.Errorf("the data: logo did not reach the page as given:\n%s", a.body)
	}
	for _, bad := range []string{"data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==", "javascript:alert(1)",
		"http://logo.example.com/l.png", `"data:image/svg+xml,<svg onload=alert(1)>"`, "//evil.example.com/l.png"} {
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("http://127.0.0.1:1 {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tpaywall {\n\t\t\tlogo "+bad+"\n\t\t}\n\t}\n\trespond ok\n}\n"), map[string]any{"filename": "Caddyfile"})
		if err == nil || !strings.Contains(err.Error(), "paywall logo") {
			t.Errorf("a paywall logo of %s = %v, want it refused naming paywall logo", bad, err)
		}
	}
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("http://127.0.0.1:1 {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tpaywall {\n\t\t\tframe_ancestors \"* 'unsafe-inline'\"\n\t\t}\n\t}\n\trespond ok\n}\n"), map[string]any{"filename": "Caddyfile"})
	if err == nil || !strings.Contains(err.Error(), "frame_ancestors") {
		t.Errorf("a frame_ancestors source that is no source = %v, want it refused by name", err)
	}
}

// TestAPaywallRPCURLCarryingAKeyIsRefusedAndAPublicOneReachesThePage: every visitor reads the RPC URL a wallet
// is asked to add, so one with a user, a query or an API key in its path is refused when the Caddyfile is read,
// and the error does not repeat the key; a public one reaches the page's chains for the gate's network.
func TestAPaywallRPCURLCarryingAKeyIsRefusedAndAPublicOneReachesThePage(t *testing.T) {
	const key = "Zx9aQ2bT7kLm3Np8Rs4Uv6Wy"
	for _, bad := range []string{"https://base-sepolia.g.alchemy.com/v2/" + key, "https://rpc.example.com/?apikey=" + key,
		"https://user:" + key + "@rpc.example.com/", "http://rpc.example.com/"} {
		_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("http://127.0.0.1:1 {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tpaywall {\n\t\t\trpc_url "+bad+"\n\t\t}\n\t}\n\trespond ok\n}\n"), map[string]any{"filename": "Caddyfile"})
		if err == nil || !strings.Contains(err.Error(), "paywall rpc_url") {
			t.Errorf("a paywall rpc_url of %s = %v, want it refused naming paywall rpc_url", bad, err)
		} else if strings.Contains(err.Error(), key) {
			t.Errorf("the refusal of a keyed rpc_url repeats the key: %v", err)
		}
	}
	env := newGateEnv(t, gateSetup{gate: "\t\tpaywall {\n\t\t\trpc_url https://rpc.example.com/public\n\t\t}\n"})
	a := env.get("/report", "Accept", "text/html")
	m := regexp.MustCompile(`(?s)<script type="application/json" id="x402-chains">(.*?)</script>`).FindStringSubmatch(a.body)
	if m == nil {
		t.Fatalf("the page carries no chains for the wallet:\n%s", a.body)
	}
	var chains map[string]struct {
		ChainName string   `json:"chainName"`
		RPCURLs   []string `json:"rpcUrls"`
	}
	network := env.offer("/report").Accepts[0].Network
	if err := json.Unmarshal([]byte(m[1]), &chains); err != nil || len(chains[network].RPCURLs) != 1 || chains[network].RPCURLs[0] != "https://rpc.example.com/public" {
		t.Errorf("the page's chains are %s (%v), want %s with the rpc_url given", m[1], err, network)
	}
}

// TestAPaywallTemplateOfTheUsersOwnRendersThePageWithTheOfferAndTheScript: paywall { template <file> } renders the
// user's page from the data the built-in one gets, with the built-in script; a template that does not parse, or
// names a field the data lacks, is refused when the config loads, naming the file and the line.
func TestAPaywallTemplateOfTheUsersOwnRendersThePageWithTheOfferAndTheScript(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "paywall.html")
	page := `<!DOCTYPE html><html><head><title>Acme: {{.Title}}</title></head>
<body data-header="{{.Header}}"><h1 class="acme">Acme pays for {{.Description}}</h1><p>{{.Price}}</p>
{{range .Rows}}<button class="x402-pay" data-offer="{{.Index}}" data-decimals="{{.Decimals}}">Pay {{.Dollars}} to {{.PayTo}}</button>{{end}}
<div id="x402-status"></div><div id="x402-content"></div>
<script type="application/json" id="x402-payment-required">{{.JSON}}</script>
<script type="application/json" id="x402-chains">{{.Chains}}</script>
<script>{{.Script}}</script></body></html>`
	if err := os.WriteFile(file, []byte(page), 0o644); err != nil {
		t.Fatal(err)
	}
	env := newGateEnv(t, gateSetup{gate: "\t\tdescription \"<b>the report</b>\"\n\t\tpaywall {\n\t\t\ttitle Reports\n\t\t\ttemplate " + file + "\n\t\t}\n"})
	a := env.get("/report", "Accept", "text/html")
	if a.status != http.StatusPaymentRequired || a.header.Get("Content-Security-Policy") != "frame-ancestors 'none'" {
		t.Fatalf("browser answer = %d (policy %q), want a 402 that cannot be framed", a.status, a.header.Get("Content-Security-Policy"))
	}
	payTo := env.offer("/report").Accepts[0].PayTo
	for _, want := range []string{"<title>Acme: Reports</title>", "Acme pays for &lt;b&gt;the report&lt;/b&gt;", "Pay $0.01 to " + payTo,
		`data-offer="0"`, "eth_signTypedData_v4", `"accepts":[`} {
		if !strings.Contains(a.body, want) {
			t.Errorf("the user's page lacks %q:\n%s", want, a.body)
		}
	}
	for _, c := range []struct{ text, want string }{
		{"<html>\n<p>{{.Price}</p>", file + ":2"},    // does not parse
		{"<html>\n\n<p>{{.Prise}}</p>", file + ":3"}, // no such field
	} {
		bad := filepath.Join(dir, "bad.html")
		if err := os.WriteFile(bad, []byte(c.text), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte("{\n\tadmin off\n}\nhttp://127.0.0.1:0 {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tfacilitator http://127.0.0.1:1\n\t\tpaywall {\n\t\t\ttemplate "+bad+"\n\t\t}\n\t}\n\trespond ok\n}\n"), map[string]any{"filename": "Caddyfile"})
		if err != nil {
			t.Fatalf("adapting: %v", err)
		}
		err = caddy.Validate(mustConfig(t, cfg))
		if want := strings.ReplaceAll(c.want, file, bad); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("a template %q = %v, want an error naming %s", c.text, err, c.want)
		}
	}
}
