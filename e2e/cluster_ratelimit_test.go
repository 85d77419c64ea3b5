package e2e

import (
	"bytes"
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// rateLimitedRoutes are the cluster's routes with a facilitator route of settle_rate_limit per_ip 4/min, and a
// middleware one of per_ip 2/min over an upstream nobody listens on, beside the paid route.
const rateLimitedRoutes = `	handle_path /facilitator/* {
		x402_facilitator {
			settle_rate_limit {
				per_ip 4/min
			}
		}
	}
	handle_path /middleware/* {
		x402_facilitator {
			settle_rate_limit {
				per_ip 2/min
			}
			upstream http://127.0.0.1:9/facilitator {
				timeout 2s
			}
		}
	}
	handle {
		x402 $0.01 {
			pay_to %[1]s
			max_timeout 24h
		}
		respond %[2]q
	}`

// Three gateways on one PostgreSQL journal enforce one settle_rate_limit: per_ip 4/min lets a client settle four
// payments over all three (to gateways 0, 1, 2, 0), and its fifth call, to gateway 1, is 429 with Retry-After and
// moves nothing on chain. Counted in memory, each gateway allowed the client 4 a minute: 12 over the cluster.
func TestClusterEnforcesOneSettleRateLimitOverItsGateways(t *testing.T) {
	c := startClusterWith(t, clusterSetup{payers: 1, routes: rateLimitedRoutes})
	before := c.balances()
	settle := func(gate int) (int, string, x402.SettleResponse) {
		t.Helper()
		pl, err := chain.SignPermit2Payment(c.payers[0], c.offer, c.chainID, chain.Permit2Options{Now: c.chainTime()})
		if err != nil {
			t.Fatal(err)
		}
		body, err := json.Marshal(x402.SettleRequest{X402Version: x402.Version2, PaymentPayload: pl, PaymentRequirements: c.offer})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.client.Post(c.gates[gate].url+"/facilitator/settle", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatalf("settling through gateway %d: %v", gate, err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var sr x402.SettleResponse
		if resp.StatusCode == http.StatusOK {
			if err := json.Unmarshal(raw, &sr); err != nil {
				t.Fatalf("gateway %d's settlement answer %s: %v", gate, raw, err)
			}
		}
		return resp.StatusCode, resp.Header.Get("Retry-After"), sr
	}
	for i, gate := range []int{0, 1, 2, 0} {
		if status, _, sr := settle(gate); status != http.StatusOK || !sr.Success {
			t.Fatalf("settlement %d of the client, to gateway %d = HTTP %d %+v; want settled", i+1, gate, status, sr)
		}
	}
	status, retry, _ := settle(1)
	if secs, _ := strconv.Atoi(retry); status != http.StatusTooManyRequests || secs < 1 || secs > 15 {
		t.Fatalf("the client's 5th settlement, to gateway 1 = HTTP %d, Retry-After %q; want 429 with Retry-After of at most 15 s "+
			"(per_ip 4/min over the whole cluster, not per gateway)", status, retry)
	}
	// A middleware route counts in the journal's database too: its upstream is down (502), but the third call over
	// the gateways is refused here.
	for i, gate := range []int{2, 0, 1} {
		resp, err := c.client.Post(c.gates[gate].url+"/middleware/settle", "application/json", strings.NewReader("{}"))
		if err != nil {
			t.Fatalf("calling gateway %d's middleware route: %v", gate, err)
		}
		resp.Body.Close()
		if limited := resp.StatusCode == http.StatusTooManyRequests; limited != (i == 2) {
			t.Fatalf("call %d to the middleware route of gateway %d = HTTP %d; want 429 for the 3rd only (per_ip 2/min over the cluster)",
				i+1, gate, resp.StatusCode)
		}
	}

	// The refused call sent nothing: the seller has exactly the four settlements, now and once the chain is idle.
	c.drain(new(big.Int).Add(before.seller, big.NewInt(4*clusterPrice)))
	if got := new(big.Int).Sub(c.balances().seller, before.seller); got.Int64() != 4*clusterPrice {
		t.Fatalf("the seller got %s, want the four settled payments' %d", got, 4*clusterPrice)
	}

	// The database gone, each gateway counts in memory: it neither refuses every call for want of its database nor
	// lets every call through. Every /settle call counts, a malformed one too.
	c.pg.Stop(t)
	for gate := range c.gates {
		for i := range 5 {
			resp, err := c.client.Post(c.gates[gate].url+"/facilitator/settle", "application/json", strings.NewReader("{}"))
			if err != nil {
				t.Fatalf("calling gateway %d with the database down: %v", gate, err)
			}
			resp.Body.Close()
			limited := resp.StatusCode == http.StatusTooManyRequests
			if want := i == 4; limited != want || (limited && resp.Header.Get("Retry-After") == "") {
				t.Fatalf("with the database down, call %d to gateway %d = HTTP %d, Retry-After %q; want 429 with Retry-After only "+
					"for the 5th (each gateway enforces per_ip 4/min on its own)", i+1, gate, resp.StatusCode, resp.Header.Get("Retry-After"))
			}
		}
	}
	if got := c.logged("the settle rate limits shared by the cluster did not answer"); !strings.HasPrefix(got, "3×") {
		t.Errorf("logged %s; want a warning from each of the 3 gateways", got)
	}
	for _, g := range c.gates {
		g.proc.stop()
	}
}
