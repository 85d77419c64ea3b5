package caddymodule_test

import (
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	neturl "net/url"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/x402"
)

// overridingUpstream is a legacy app behind reverse_proxy that says what a request used: the Settlement-Overrides
// header is the request's ?use= query, verbatim, when it has one.
func overridingUpstream(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if use := r.URL.Query().Get("use"); use != "" {
			w.Header().Set(x402.HeaderSettlementOverrides, use)
		}
		fmt.Fprint(w, "metered content")
	}))
	t.Cleanup(srv.Close)
	return srv
}

// A real Caddy gates a reverse_proxy with `scheme upto`, through the embedded engine and through our facilitator
// over HTTP; `caddy x402 pay` pays each request. Exactly what the upstream names moves on chain (the maximum when
// it asks more or says nothing usable, nothing for zero), PAYMENT-RESPONSE names it, and the upstream's header
// never reaches the client.
func TestCaddyChargesAnUptoPaymentWhatItsReverseProxiedUpstreamNamesAndPayPaysIt(t *testing.T) {
	upstream := overridingUpstream(t)
	for _, kind := range facilitatorKinds {
		t.Run(kind.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: kind.remote, gate: "\t\tscheme upto\n",
				site: "reverse_proxy " + strings.TrimPrefix(upstream.URL, "http://")})
			a := env.get("/")
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if a.status != http.StatusPaymentRequired || err != nil || len(pr.Accepts) != 1 {
				t.Fatalf("unpaid = %d (%v) %+v, want 402 with one upto offer", a.status, err, pr.Accepts)
			}
			if rq := pr.Accepts[0]; rq.Scheme != x402.SchemeUpto || rq.Amount != "10000" || rq.Extra.AssetTransferMethod != x402.TransferPermit2 ||
				!x402.IsHexAddress(rq.Extra.FacilitatorAddress) {
				t.Fatalf("offer = %+v, want upto by permit2 of at most 10000 naming a facilitator address", rq)
			}
			payer := env.c.Payers[0]
			key := fmt.Sprintf("%x", crypto.FromECDSA(payer.Key))
			for _, tc := range []struct {
				name, use string
				charged   int64
			}{
				{"less than the maximum", `{"amount":"1234"}`, 1234},
				{"dollars", `{"amount":"$0.0025"}`, 2500},
				{"more than the maximum", `{"amount":"50000"}`, gatePrice},
				{"zero", `{"amount":"0"}`, 0},
				{"nothing", "", gatePrice},
				{"garbage", `{"amount":"lots"}`, gatePrice},
			} {
				payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo)
				url := env.srv.URL + "/metered"
				if tc.use != "" {
					url += "?use=" + neturl.QueryEscape(tc.use)
				}
				stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", env.c.RPCURL, url)
				if err != nil || !strings.Contains(stdout, "metered content") {
					t.Fatalf("%s: pay = %v\nstdout: %s\nstderr: %s", tc.name, err, stdout, stderr)
				}
				if !strings.Contains(stderr, "paying up to 10000") {
					t.Errorf("%s: the progress line does not say the price is a maximum: %s", tc.name, stderr)
				}
				if !strings.Contains(stdout, fmt.Sprintf(`"amount": "%d"`, tc.charged)) || strings.Contains(stdout, x402.HeaderSettlementOverrides) {
					t.Errorf("%s: pay printed no settlement of %d, or the upstream's header:\n%s", tc.name, tc.charged, stdout)
				}
				lost := new(big.Int).Sub(payerBefore, env.c.TokenBalance(payer.Address))
				gained := new(big.Int).Sub(env.c.TokenBalance(env.payTo), sellerBefore)
				if lost.Int64() != tc.charged || gained.Int64() != tc.charged {
					t.Errorf("%s: the payer lost %s and the seller gained %s, want exactly %d each", tc.name, lost, gained, tc.charged)
				}
			}
		})
	}
}

// Settle before cannot know what the upstream used: Caddy refuses the combination when it loads the config.
func TestCaddyRefusesSchemeUptoWithSettleBefore(t *testing.T) {
	cfg := adaptCaddyfile(t, `{
	x402 {
		network eip155:72344 {
			rpc http://127.0.0.1:1
			asset 0x1111111111111111111111111111111111111111
			wallet_keys 0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d
		}
	}
}
http://127.0.0.1:`+freePortOf(t)+` {
	x402 {
		scheme upto
		settle before
		price $0.01
		pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
	}
	respond ok
}
`, t.TempDir())
	err := caddy.Validate(mustConfig(t, cfg))
	if err == nil || !strings.Contains(err.Error(), "not settle before") {
		t.Fatalf("validate = %v, want the upto/settle before refusal", err)
	}
}
