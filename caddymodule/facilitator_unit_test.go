package caddymodule

import (
	"context"
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
		r := httptest.NewRequest("GET", "/supported", nil)
		if key != "" {
			r.Header.Set("x-api-key", key)
		}
		if got := h.authorized(r); got != want {
			t.Errorf("authorized with key %q = %v, want %v", key, got, want)
		}
	}
}

func TestFacilitatorEndpointIsTheLastPathSegment(t *testing.T) {
	for path, want := range map[string]string{
		"/supported":                  facilitatorEndpointSupported,
		"/facilitator/verify":         facilitatorEndpointVerify,
		"/a/b/settle":                 facilitatorEndpointSettle,
		"/health":                     facilitatorEndpointHealth,
		"/":                           metricsOther,
		"/verify/":                    metricsOther,
		"/settlements":                metricsOther,
		"/Health":                     metricsOther,
		"/facilitator/supported.json": metricsOther,
	} {
		if got := facilitatorEndpoint(path); got != want {
			t.Errorf("facilitatorEndpoint(%q) = %q, want %q", path, got, want)
		}
	}
}

func TestFacilitatorHealthSumsUpTheNetworksItServes(t *testing.T) {
	net := func(id, status string) x402.NetworkHealth { return x402.NetworkHealth{Network: id, Status: status} }
	const a, b = x402.NetworkTestnet, x402.NetworkMainnet
	for _, tc := range []struct {
		name     string
		networks []string
		in       x402.HealthResponse
		want     string
		kept     int
	}{
		{"all ok", nil, x402.HealthResponse{Status: "ok", Networks: []x402.NetworkHealth{net(a, "ok"), net(b, "ok")}}, "ok", 2},
		{"one down of two", nil, x402.HealthResponse{Status: "degraded", Networks: []x402.NetworkHealth{net(a, "ok"), net(b, "down")}}, "degraded", 2},
		{"every network down", nil, x402.HealthResponse{Status: "degraded", Networks: []x402.NetworkHealth{net(a, "down"), net(b, "down")}}, "down", 2},
		{"a low wallet on a network", nil, x402.HealthResponse{Status: "ok", Networks: []x402.NetworkHealth{net(a, "degraded")}}, "degraded", 1},
		{"a journal problem and no networks", nil, x402.HealthResponse{Status: "degraded"}, "degraded", 0},
		{"the unserved network is the one down", []string{a}, x402.HealthResponse{Status: "degraded", Networks: []x402.NetworkHealth{net(a, "ok"), net(b, "down")}}, "ok", 1},
		{"the served network is the one down", []string{b}, x402.HealthResponse{Status: "degraded", Networks: []x402.NetworkHealth{net(a, "ok"), net(b, "down")}}, "down", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &FacilitatorHandler{}
			if tc.networks != nil {
				h.networks = map[string]bool{}
				for _, n := range tc.networks {
					h.networks[n] = true
				}
			}
			got := h.filterHealth(tc.in)
			if got.Status != tc.want || len(got.Networks) != tc.kept {
				t.Fatalf("filterHealth = %+v, want status %s with %d networks", got, tc.want, tc.kept)
			}
		})
	}
}

func TestFacilitatorSupportedKeepsOnlyServedKindsSignersAndExtensions(t *testing.T) {
	in := x402.SupportedResponse{
		Kinds: []x402.SupportedKind{
			{X402Version: 2, Scheme: "exact", Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: "permit2"}},
			{X402Version: 1, Scheme: "exact", Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: "erc2612"}},
			{X402Version: 2, Scheme: "exact", Network: x402.NetworkMainnet, Extra: x402.Extra{AssetTransferMethod: "erc2612"}},
		},
		Extensions: []string{x402.ExtensionEIP2612GasSponsoring, "bazaar"},
		Signers:    map[string][]string{x402.NetworkTestnet: {"0xa"}, x402.NetworkMainnet: {"0xb"}, "eip155:*": {"0xc"}},
	}
	h := &FacilitatorHandler{kinds: map[string]bool{"erc2612": true}, networks: map[string]bool{x402.NetworkMainnet: true}}
	got := h.filterSupported(in)
	if len(got.Kinds) != 1 || got.Kinds[0].Network != x402.NetworkMainnet || got.Kinds[0].Extra.AssetTransferMethod != "erc2612" {
		t.Errorf("kinds = %+v, want only erc2612 on mainnet", got.Kinds)
	}
	if len(got.Extensions) != 1 || got.Extensions[0] != "bazaar" {
		t.Errorf("extensions = %v, want [bazaar]: gas sponsoring goes with permit2", got.Extensions)
	}
	if _, ok := got.Signers[x402.NetworkTestnet]; ok || len(got.Signers[x402.NetworkMainnet]) != 1 || len(got.Signers["eip155:*"]) != 1 {
		t.Errorf("signers = %v, want mainnet's and the wildcard's", got.Signers)
	}
}
