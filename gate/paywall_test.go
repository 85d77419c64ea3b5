package gate_test

import (
	"encoding/json"
	"html"
	"net/http"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestThePaywallOffersAPayButtonForAnERC2612OfferAndThePageCarriesItsSpender: an erc2612 offer names the
// facilitator's settlement wallet as extra.spender; the page shows a pay button for it (the script signs an
// EIP-2612 permit to that wallet), and the offer the script signs from carries the spender.
func TestThePaywallOffersAPayButtonForAnERC2612OfferAndThePageCarriesItsSpender(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) { c.Offers[0].Method = x402.TransferERC2612 }})
	a := e.get("Accept", "text/html")
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.header.Get("Content-Type"), "text/html") {
		t.Fatalf("browser answer = %d %s, want the 402 page", a.status, a.header.Get("Content-Type"))
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || len(pr.Accepts) != 1 || pr.Accepts[0].Extra.AssetTransferMethod != x402.TransferERC2612 || !x402.IsHexAddress(pr.Accepts[0].Extra.Spender) {
		t.Fatalf("the 402 offers %+v (%v), want one erc2612 offer naming its spender", pr.Accepts, err)
	}
	if !strings.Contains(a.body, `class="x402-pay" data-offer="0"`) {
		t.Errorf("the page has no pay button for the erc2612 offer:\n%s", a.body)
	}
	m := regexp.MustCompile(`(?s)<script type="application/json" id="x402-payment-required">(.*?)</script>`).FindStringSubmatch(a.body)
	if m == nil || !strings.Contains(html.UnescapeString(m[1]), `"spender":"`+pr.Accepts[0].Extra.Spender+`"`) {
		t.Errorf("the page's offer does not carry the spender %s", pr.Accepts[0].Extra.Spender)
	}
}

// TestASignInOnlyRoutesPaywallSaysItSellsNothingAndOffersTheSignIn: the page a browser gets from a route that
// sells nothing (sign_in_only) says so and shows the sign-in button, with no price and no pay button, and embeds
// the header's PaymentRequired (accepts []) for the script.
func TestASignInOnlyRoutesPaywallSaysItSellsNothingAndOffersTheSignIn(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) {
		c.Route, c.Access, c.SignInOnly = "the sign-in-only route", &gate.Access{For: time.Hour, Requests: 2, Grant: "members"}, true
	}})
	a := e.get("Accept", "text/html,application/xhtml+xml,*/*;q=0.8")
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.header.Get("Content-Type"), "text/html") {
		t.Fatalf("browser answer = %d %s, want the 402 page", a.status, a.header.Get("Content-Type"))
	}
	for _, bad := range []string{"This resource costs", "cannot state", `class="x402-pay"`} {
		if strings.Contains(a.body, bad) {
			t.Errorf("the sign-in-only route's page says %q, as if it sold the resource:\n%s", bad, a.body)
		}
	}
	for _, want := range []string{"not sold here", `class="x402-signin"`} {
		if !strings.Contains(a.body, want) {
			t.Errorf("the sign-in-only route's page does not say %q:\n%s", want, a.body)
		}
	}
	m := regexp.MustCompile(`(?s)<script type="application/json" id="x402-payment-required">(.*?)</script>`).FindStringSubmatch(a.body)
	header, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	var page x402.PaymentRequired
	if m == nil || err != nil || json.Unmarshal([]byte(m[1]), &page) != nil || !reflect.DeepEqual(page, header) || page.Accepts == nil || len(page.Accepts) != 0 {
		t.Errorf("the page's offer is not the header's PaymentRequired with accepts [] (%v):\n%s", err, a.body)
	}
}
