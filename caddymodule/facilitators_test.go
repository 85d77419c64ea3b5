package caddymodule_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() { caddy.RegisterModule(countingFacilitator{}) }

// countingFacilitator is a plugin's facilitator module, as a third party would write one: it reaches a
// facilitator over HTTP with facilitatorclient and counts what it is asked.
type countingFacilitator struct {
	URL string `json:"url"`

	client *facilitatorclient.Client
}

// countingCalls counts the calls of every countingFacilitator: verify, settle.
var countingCalls [2]atomic.Int64

func (countingFacilitator) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "x402.facilitators.counting_test", New: func() caddy.Module { return new(countingFacilitator) }}
}

func (f *countingFacilitator) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	for d.NextBlock(d.Nesting()) {
		if d.Val() != "url" || !d.AllArgs(&f.URL) {
			return d.Errf("want url <base url>, got %s", d.Val())
		}
	}
	return nil
}

func (f *countingFacilitator) Provision(caddy.Context) (err error) {
	f.client, err = facilitatorclient.New(f.URL)
	return err
}

func (f *countingFacilitator) Facilitator() (x402.Facilitator, error) { return f, nil }

func (f *countingFacilitator) Supported(ctx context.Context) (x402.SupportedResponse, error) {
	return f.client.Supported(ctx)
}

func (f *countingFacilitator) Verify(ctx context.Context, r x402.VerifyRequest) (x402.VerifyResponse, error) {
	countingCalls[0].Add(1)
	return f.client.Verify(ctx, r)
}

func (f *countingFacilitator) Settle(ctx context.Context, r x402.SettleRequest) (x402.SettleResponse, error) {
	countingCalls[1].Add(1)
	return f.client.Settle(ctx, r)
}

func (f *countingFacilitator) Health(ctx context.Context) (x402.HealthResponse, error) {
	return f.client.Health(ctx)
}

var _ caddymodule.FacilitatorSource = (*countingFacilitator)(nil)

// A gate loads its facilitator from the x402.facilitators namespace: a plugin's module, named in the Caddyfile
// with its own options, verifies and settles the gate's payments, and the payment moves the price once.
func TestAGatePaysThroughAPluginsFacilitatorModule(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	remote := newRemoteFacilitator(t, c, 2, 20*time.Second)
	verifies, settles := countingCalls[0].Load(), countingCalls[1].Load()
	env := startGateOn(t, c, gateSetup{facURL: remote.URL, gate: "\t\tfacilitator counting_test {\n\t\t\turl " + remote.URL + "\n\t\t}\n"})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("paid GET through the plugin's facilitator = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
	if v, s := countingCalls[0].Load()-verifies, countingCalls[1].Load()-settles; v != 1 || s != 1 {
		t.Errorf("the plugin's facilitator was asked to verify %d and settle %d times, want once each", v, s)
	}
}

// The standard `http` facilitator module serves the gate (two upstreams, the first one down: a failover set)
// and the x402_facilitator handler (in front of the same remote facilitator) alike.
func TestTheHTTPFacilitatorModuleServesAGateAndAFacilitatorRoute(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	remote := newRemoteFacilitator(t, c, 2, 20*time.Second)
	down, route := "http://"+freeAddr(t), freeAddr(t)
	env := startGateOn(t, c, gateSetup{facURL: remote.URL,
		gate:  "\t\tfacilitator http {\n\t\t\tupstream " + down + "\n\t\t\tupstream " + remote.URL + " {\n\t\t\t\ttimeout 5s\n\t\t\t}\n\t\t}\n",
		sites: "http://" + route + " {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\tfacilitator http " + remote.URL + "\n\t\t}\n\t}\n}\n",
	})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("paid GET through the http facilitator module = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)

	resp, err := http.Get("http://" + route + "/facilitator/supported")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	a := gateAnswer{status: resp.StatusCode, body: string(body)}
	var sup x402.SupportedResponse
	if a.status != http.StatusOK || json.Unmarshal([]byte(a.body), &sup) != nil || len(sup.Kinds) == 0 {
		t.Fatalf("GET /facilitator/supported through the http facilitator module = %d %q, want the remote's kinds", a.status, a.body)
	}
	if want, _ := remote.f.Supported(context.Background()); len(sup.Kinds) != len(want.Kinds) {
		t.Errorf("the facilitator route lists %d kinds, the facilitator behind it %d", len(sup.Kinds), len(want.Kinds))
	}
}
