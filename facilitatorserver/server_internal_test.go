package facilitatorserver

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// nothingBehind is a facilitator a test never expects to be called.
type nothingBehind struct{ x402.Facilitator }

func newTestServer(t *testing.T, o Options) *Server {
	t.Helper()
	s, err := New(nothingBehind{}, o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestTheEndpointIsTheLastPathSegment(t *testing.T) {
	for path, want := range map[string]string{
		"/supported":                  EndpointSupported,
		"/facilitator/verify":         EndpointVerify,
		"/a/b/settle":                 EndpointSettle,
		"/health":                     EndpointHealth,
		"/":                           "",
		"/verify/":                    "",
		"/settlements":                "",
		"/Health":                     "",
		"/facilitator/supported.json": "",
	} {
		if got := Endpoint(path); got != want {
			t.Errorf("Endpoint(%q) = %q, want %q", path, got, want)
		}
	}
}

func TestAServerAcceptsAnyOfItsAPIKeysAndNothingElse(t *testing.T) {
	s := newTestServer(t, Options{APIKeys: []string{"first-key", "second-key"}})
	for key, want := range map[string]bool{
		"first-key":   true,
		"second-key":  true,
		"":            false,
		"first-ke":    false,
		"first-keyy":  false,
		"SECOND-KEY":  false,
		"second-key ": false,
	} {
		r := httptest.NewRequest("GET", "/supported", nil)
		if key != "" {
			r.Header.Set("x-api-key", key)
		}
		if got := s.authorized(r); got != want {
			t.Errorf("authorized with key %q = %v, want %v", key, got, want)
		}
	}
	if !newTestServer(t, Options{}).authorized(httptest.NewRequest("GET", "/supported", nil)) {
		t.Error("a server without API keys refused a request without one")
	}
}

func TestHealthSumsUpTheNetworksTheServerServes(t *testing.T) {
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
			s := newTestServer(t, Options{Networks: tc.networks})
			got := s.filterHealth(tc.in)
			if got.Status != tc.want || len(got.Networks) != tc.kept {
				t.Fatalf("filterHealth = %+v, want status %s with %d networks", got, tc.want, tc.kept)
			}
		})
	}
}

func TestSupportedKeepsOnlyServedKindsSignersAndExtensions(t *testing.T) {
	in := x402.SupportedResponse{
		Kinds: []x402.SupportedKind{
			{X402Version: 2, Scheme: "exact", Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: "permit2"}},
			{X402Version: 1, Scheme: "exact", Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: "erc2612"}},
			{X402Version: 2, Scheme: "exact", Network: x402.NetworkMainnet, Extra: x402.Extra{AssetTransferMethod: "erc2612"}},
		},
		Extensions: []string{x402.ExtensionEIP2612GasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring, "bazaar"},
		Signers:    map[string][]string{x402.NetworkTestnet: {"0xa"}, x402.NetworkMainnet: {"0xb"}, "eip155:*": {"0xc"}},
	}
	s := newTestServer(t, Options{Kinds: []string{"erc2612"}, Networks: []string{x402.NetworkMainnet}})
	got := s.FilterSupported(in)
	if len(got.Kinds) != 1 || got.Kinds[0].Network != x402.NetworkMainnet || got.Kinds[0].Extra.AssetTransferMethod != "erc2612" {
		t.Errorf("kinds = %+v, want only erc2612 on mainnet", got.Kinds)
	}
	if len(got.Extensions) != 1 || got.Extensions[0] != "bazaar" {
		t.Errorf("extensions = %v, want [bazaar]: gas and approval sponsoring go with permit2", got.Extensions)
	}
	if _, ok := got.Signers[x402.NetworkTestnet]; ok || len(got.Signers[x402.NetworkMainnet]) != 1 || len(got.Signers["eip155:*"]) != 1 {
		t.Errorf("signers = %v, want mainnet's and the wildcard's", got.Signers)
	}
}

// Several callers asking /health at once share one check, and a caller within the cache's time gets its answer
// without a check of its own.
func TestHealthChecksRunOnceForCallersThatComeTogether(t *testing.T) {
	c := &healthCache{ttl: healthCacheTTL}
	calls := 0
	release := make(chan struct{})
	fetch := func(context.Context) reply {
		calls++
		<-release
		return reply{status: 200, body: "ok"}
	}
	done := make(chan reply, 3)
	go func() { done <- c.get(context.Background(), fetch) }()
	for {
		c.mu.Lock()
		started := c.flight != nil
		c.mu.Unlock()
		if started {
			break
		}
	}
	go func() { done <- c.get(context.Background(), fetch) }()
	go func() { done <- c.get(context.Background(), fetch) }()
	close(release)
	for i := 0; i < 3; i++ {
		if res := <-done; res.status != 200 {
			t.Fatalf("answer %d = %+v, want the check's", i, res)
		}
	}
	c.get(context.Background(), fetch)
	if calls != 1 {
		t.Fatalf("%d checks, want 1", calls)
	}
}

func TestNewRefusesWhatNoRequestCouldMakeRight(t *testing.T) {
	for _, tc := range []struct {
		name string
		f    x402.Facilitator
		o    Options
	}{
		{"no facilitator", nil, Options{}},
		{"a body limit above the codec's", nothingBehind{}, Options{MaxBodySize: x402.MaxBodyBytes + 1}},
		{"a negative body limit", nothingBehind{}, Options{MaxBodySize: -1}},
		{"an empty API key", nothingBehind{}, Options{APIKeys: []string{"k", ""}}},
		{"a negative rate", nothingBehind{}, Options{SettleRateLimit: RateLimit{PerPayer: -1}}},
		{"a rate above the maximum", nothingBehind{}, Options{SettleRateLimit: RateLimit{PerIP: MaxPerMinute + 1}}},
	} {
		if _, err := New(tc.f, tc.o); err == nil {
			t.Errorf("New with %s = nil error, want a refusal", tc.name)
		}
	}
}
