package caddymodule_test

import (
	"net/http"
	"regexp"
	"strings"
	"testing"

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
