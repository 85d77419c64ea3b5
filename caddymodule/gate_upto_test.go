package caddymodule_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	neturl "net/url"
	"strings"
	"testing"
	"time"

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

// workUpstream is an app behind reverse_proxy whose work, and so its upto charge, a POST's body chooses: a body
// that says "expensive" costs 9000, any other 100. At /big the cheap work answers resourceBigSize bytes (past
// max_buffer: it streams), elsewhere a line naming the work.
func workUpstream(t *testing.T) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		work := 100
		if strings.Contains(string(body), "expensive") {
			work = 9000
		}
		w.Header().Set(x402.HeaderSettlementOverrides, fmt.Sprintf(`{"amount":"%d"}`, work))
		if r.URL.Path == "/big" && work == 100 {
			_ = writeBigBody(w, resourceBigSize, func(int) error { return nil })
			return
		}
		fmt.Fprintf(w, "the answer to %q, work %d", body, work)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// post POSTs body to path with the payment, reading at most limit bytes of the answer (all when limit < 0).
func (env *gateEnv) post(ctx context.Context, client *http.Client, path, header, body string, limit int64) fetched {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, env.srv.URL+path, strings.NewReader(body))
	if err != nil {
		env.t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, header)
	resp, err := client.Do(req)
	if err != nil {
		return fetched{err: err}
	}
	defer resp.Body.Close()
	var r io.Reader = resp.Body
	if limit >= 0 {
		r = io.LimitReader(resp.Body, limit)
	}
	h := sha256.New()
	var start strings.Builder
	n, err := io.Copy(io.MultiWriter(h, &prefixBuilder{b: &start, max: 4 << 10}), r)
	return fetched{proto: resp.Proto, status: resp.StatusCode, header: resp.Header, n: n, sum: [32]byte(h.Sum(nil)), body: start.String(), err: err}
}

// wantChargedLess checks that f is the gate's 409 for a payment charged 100 whose response named 9000: the
// response not sent, both charges named, the payment's settlement in PAYMENT-RESPONSE.
func wantChargedLess(t *testing.T, f fetched, settled bool, what string) {
	t.Helper()
	var body struct {
		Reason, Charged, Named, Transaction string
	}
	if err := json.Unmarshal([]byte(f.body), &body); f.status != http.StatusConflict || err != nil || strings.Contains(f.body, "work 9000") {
		t.Fatalf("%s: %v; want 409 and not the response", what, f)
	}
	if body.Reason != "charge_above_charged" || body.Charged != "100" || body.Named != "9000" {
		t.Errorf("%s: the 409 says %+v; want reason charge_above_charged, charged 100, named 9000", what, body)
	}
	resp, err := x402.DecodeSettleResponse(f.header.Get(x402.HeaderPaymentResponse))
	switch {
	case err != nil:
		t.Errorf("%s: PAYMENT-RESPONSE: %v", what, err)
	case settled && (!resp.Success || resp.Amount != "100" || resp.Transaction != body.Transaction):
		t.Errorf("%s: PAYMENT-RESPONSE %+v, the body's transaction %q; want the settlement of 100 in both", what, resp, body.Transaction)
	case !resp.Success && !resp.Pending():
		t.Errorf("%s: PAYMENT-RESPONSE %+v, want the payment settled or settling", what, resp)
	}
}

// An upto payment is charged what the response it was first presented for named (100), once: presented again,
// it is settled for that. A payment buys its resource by method and URL, and a POST's body chooses its work there:
// presented again with a body whose work the upstream names 9000 for, its response is not sent (409, naming both
// charges; never 402: the payment is charged), after a restart too (the charge is in the journal). Presented with
// the cheap body, it gets its response whole, once, and the seller has 100 in all.
func TestAnUptoPaymentPresentedAgainWithAnotherBodyIsNotSentAResponseNamingMoreThanItWasCharged(t *testing.T) {
	upstream := workUpstream(t)
	t.Run("settle after: the client leaves while its payment settles; a restart", func(t *testing.T) {
		setup := gateSetup{noCommit: true, gate: "\t\tscheme upto\n", site: "reverse_proxy " + strings.TrimPrefix(upstream.URL, "http://")}
		env := newGateEnv(t, setup)
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		sellerBefore := env.c.TokenBalance(env.payTo)
		header := gateEncode(t, env.signPermit2(payer, env.requirement("/generate", x402.TransferPermit2)))
		client := &http.Client{Timeout: time.Minute}

		// The cheap request; the client leaves once the settlement transaction is in the pool.
		sentBefore := env.sent()
		ctx, leave := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); env.post(ctx, client, "/generate", header, "cheap", -1) }()
		for deadline := time.Now().Add(10 * time.Second); env.sent() == sentBefore; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the settlement transaction was not sent")
			}
		}
		leave()
		<-done
		t.Cleanup(commitPending(t, env.c))
		env.waitOutcomes(x402.OutcomeSettled, 1)

		wantChargedLess(t, env.post(context.Background(), client, "/generate", header, "expensive", -1), true,
			"the payment charged 100 presented again with the expensive body")
		if err := caddy.Stop(); err != nil {
			t.Fatalf("stopping Caddy: %v", err)
		}
		client.CloseIdleConnections()
		env.reload(setup)
		wantChargedLess(t, env.post(context.Background(), client, "/generate", header, "expensive", -1), true,
			"the same after a restart")
		if f := env.post(context.Background(), client, "/generate", header, "cheap", -1); f.status != http.StatusOK || f.body != `the answer to "cheap", work 100` {
			t.Fatalf("the payment presented again with the body it was charged for: %v; want 200 and its answer", f)
		}
		if f := env.post(context.Background(), client, "/generate", header, "expensive", -1); f.status != http.StatusPaymentRequired ||
			!strings.HasPrefix(f.paymentError(), x402.ReasonPaymentAlreadyUsed) {
			t.Fatalf("the payment presented once more, after it bought its response: %v; want 402 %s", f, x402.ReasonPaymentAlreadyUsed)
		}
		time.Sleep(100 * time.Millisecond) // a settlement wrongly sent would have mined by now
		if got := new(big.Int).Sub(env.c.TokenBalance(env.payTo), sellerBefore); got.Int64() != 100 {
			t.Errorf("the seller received %s, want 100", got)
		}
	})
	t.Run("settle async: the response cut short", func(t *testing.T) {
		env := newGateEnv(t, gateSetup{gate: "\t\tscheme upto\n\t\tsettle async\n\t\tmax_buffer 1MiB\n",
			site: "reverse_proxy " + strings.TrimPrefix(upstream.URL, "http://")})
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		sellerBefore := env.c.TokenBalance(env.payTo)
		header := gateEncode(t, env.signPermit2(payer, env.requirement("/big", x402.TransferPermit2)))
		client := resourceClient(t, false)

		if cut := env.post(context.Background(), client, "/big", header, "cheap", resourceBigSize/4); cut.status != http.StatusOK || cut.n != resourceBigSize/4 {
			t.Fatalf("the paid request of /big: %v; want 200 and a quarter of it read", cut)
		}
		env.waitReceived(env.payTo, new(big.Int).Add(sellerBefore, big.NewInt(100)))
		f := env.post(context.Background(), client, "/big", header, "expensive", -1)
		for deadline := time.Now().Add(10 * time.Second); f.status == http.StatusPaymentRequired &&
			strings.Contains(f.paymentError(), "another request is presenting") && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond) // the request cut short has not finished yet
			f = env.post(context.Background(), client, "/big", header, "expensive", -1)
		}
		wantChargedLess(t, f, false, "the payment charged 100 presented again with the expensive body")
		whole := env.post(context.Background(), client, "/big", header, "cheap", -1)
		if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
			t.Fatalf("the payment presented again with the body it was charged for: %v; want 200 and the whole answer", whole)
		}
		time.Sleep(100 * time.Millisecond)
		if got := new(big.Int).Sub(env.c.TokenBalance(env.payTo), sellerBefore); got.Int64() != 100 {
			t.Errorf("the seller received %s, want 100", got)
		}
	})
}
