package caddymodule

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestFacilitatorValidateRefusesConfigurationsNoRequestCouldMakeRight(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    FacilitatorHandler
		want string // "" when valid
	}{
		{"the zero value", FacilitatorHandler{}, ""},
		{"both kinds on two networks", FacilitatorHandler{Kinds: []string{"permit2", "erc2612"}, Networks: []string{x402.NetworkMainnet, x402.NetworkTestnet}}, ""},
		{"an unknown kind", FacilitatorHandler{Kinds: []string{"upto"}}, `unknown kind "upto"`},
		{"a network that is not CAIP-2", FacilitatorHandler{Networks: []string{"base"}}, "malformed CAIP-2"},
		{"a body limit above the codec's", FacilitatorHandler{MaxBodySize: x402.MaxBodyBytes + 1}, "max_body_size is 65537 bytes"},
		{"a negative body limit", FacilitatorHandler{MaxBodySize: -1}, "max_body_size is -1 bytes"},
		{"an upstream without a URL", FacilitatorHandler{Upstreams: []*FacilitatorUpstream{{APIKey: "k"}}}, "upstream #1 has no URL"},
		{"a negative upstream timeout", FacilitatorHandler{Upstreams: []*FacilitatorUpstream{{URL: "http://a", Timeout: -1}}}, "timeout must not be negative"},
		{"terms and rate limits", FacilitatorHandler{MinAmount: "1000", PayTo: []string{"0x1111111111111111111111111111111111111111"}, SettleRateLimit: &SettleRateLimit{PerIP: 60, PerPayer: 10}}, ""},
		{"a min_amount that is no number", FacilitatorHandler{MinAmount: "1e3"}, "min_amount '1e3' is not a whole number"},
		{"a min_amount of zero", FacilitatorHandler{MinAmount: "0"}, "min_amount '0'"},
		{"a pay_to that is no address", FacilitatorHandler{PayTo: []string{"seller"}}, `pay_to: expected an address (0x and 40 hex digits), got "seller"`},
		{"a negative rate", FacilitatorHandler{SettleRateLimit: &SettleRateLimit{PerPayer: -1}}, "settle_rate_limit per_payer is -1 a minute"},
		{"a rate above the maximum", FacilitatorHandler{SettleRateLimit: &SettleRateLimit{PerIP: 60_001}}, "settle_rate_limit per_ip is 60001 a minute"},
		{"an IPv6 prefix too long", FacilitatorHandler{SettleRateLimit: &SettleRateLimit{PerIP: 1, IPv6Prefix: 129}}, "settle_rate_limit per_ip ipv6_prefix is 129 bits"},
		{"a negative verify rate", FacilitatorHandler{VerifyRateLimit: &VerifyRateLimit{PerIP: -1}}, "verify_rate_limit per_ip is -1 a minute"},
		{"a negative verify IPv6 prefix", FacilitatorHandler{VerifyRateLimit: &VerifyRateLimit{IPv6Prefix: -1}}, "verify_rate_limit per_ip ipv6_prefix is -1 bits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.h.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Validate() = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

func TestFacilitatorProvisionRefusesAnAPIKeyWhosePlaceholderIsEmpty(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, h := range []*FacilitatorHandler{
		{APIKeys: []string{"set", "{env.X402_TEST_UNSET_KEY_3b8e}"}},
		{Upstreams: []*FacilitatorUpstream{{URL: "http://127.0.0.1:1", APIKey: "{env.X402_TEST_UNSET_KEY_3b8e}"}}},
	} {
		err := h.Provision(ctx)
		if err == nil || !strings.Contains(err.Error(), "empty once its placeholders are replaced") {
			t.Errorf("Provision(%+v) = %v, want an error about the empty key", h, err)
		}
	}
}

func TestFacilitatorAcceptsAnyOfItsAPIKeysAndNothingElse(t *testing.T) {
	t.Setenv("X402_TEST_KEY_9c1d", "from-the-environment")
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	h := &FacilitatorHandler{
		APIKeys:   []string{"written-in-the-caddyfile", "{env.X402_TEST_KEY_9c1d}"},
		Upstreams: []*FacilitatorUpstream{{URL: "http://127.0.0.1:1"}},
	}
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]bool{
		"written-in-the-caddyfile":  true,
		"from-the-environment":      true,
		"{env.X402_TEST_KEY_9c1d}":  false,
		"":                          false,
		"written-in-the-caddyfil":   false,
		"written-in-the-caddyfilee": false,
	} {
		// A path that names no endpoint: 404 once the key is accepted, and nothing asked of the upstream.
		r := httptest.NewRequest("GET", "/no-such-endpoint", nil)
		if key != "" {
			r.Header.Set("x-api-key", key)
		}
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, r, nil); err != nil {
			t.Fatal(err)
		}
		if got := w.Code != http.StatusUnauthorized; got != want {
			t.Errorf("authorized with key %q = %v (HTTP %d), want %v", key, got, w.Code, want)
		}
	}
}

// A handler that configures no verify_rate_limit has the default; a block without per_ip keeps the default
// rate; off turns it off.
func TestTheVerifyRateLimitIsOnByDefault(t *testing.T) {
	for _, tc := range []struct {
		name        string
		l           *VerifyRateLimit
		perIP, bits int
	}{
		{"none configured", nil, DefaultVerifyPerIP, 0},
		{"a prefix only", &VerifyRateLimit{IPv6Prefix: 56}, DefaultVerifyPerIP, 56},
		{"a rate", &VerifyRateLimit{PerIP: 30}, 30, 0},
		{"off", &VerifyRateLimit{PerIP: 30, Off: true}, 0, 0},
	} {
		if got := verifyLimit(tc.l); got.PerIP != tc.perIP || got.IPv6Prefix != tc.bits {
			t.Errorf("%s: limit %+v, want per IP %d, IPv6 prefix %d", tc.name, got, tc.perIP, tc.bits)
		}
	}
}
