package caddymodule_test

import (
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A real Caddy whose gate declares discovery and settles through the x402_facilitator of the same Caddy (over
// HTTP, a bbolt journal): paid by payer.Transport, the route is catalogued and listed at
// /facilitator/discovery/resources, still after a reload and after a restart on the same journal.
func TestOurGatePaidThroughOurFacilitatorIsCataloguedAndKeptAcrossAReloadAndARestart(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	network := x402.EIP155(c.ChainID.Uint64())
	caddyfile := `{
	x402 {
		network ` + network + ` {
			rpc ` + c.RPCURL + `
			asset ` + c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(c.Wallets[0]) + `
			receipt_poll 5ms
			receipt_timeout 20s
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle_path /facilitator/* {
		x402_facilitator {
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
		}
	}
	handle /weather {
		x402 $0.01 {
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
			facilitator {{ADDR}}/facilitator
			description "the weather"
			discovery {
				input_example ` + "`" + `{"city": "Oslo"}` + "`" + `
				service_name "Caddy Weather"
				tags weather
			}
		}
		respond "sunny"
	}
}
`
	srv := startCaddy(t, caddyfile)
	p := c.Payers[0]
	c.Approve(p, contracts.Permit2Address, new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1)))
	pay, err := payer.New(p.Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &payer.Transport{Payer: pay, Limits: []payer.Limit{{Network: network, Asset: c.Token.Hex(),
		PerRequest: big.NewInt(10_000), Total: big.NewInt(10_000)}}}}

	listed := func(when string) x402.DiscoveryResourcesResponse {
		t.Helper()
		resp, err := http.Get(srv.URL + "/facilitator/discovery/resources?type=http")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var out x402.DiscoveryResourcesResponse
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &out) != nil {
			t.Fatalf("%s: /discovery/resources = %d %s", when, resp.StatusCode, b)
		}
		return out
	}
	if got := listed("before any payment"); got.Pagination.Total != 0 {
		t.Fatalf("before any payment the catalog lists %+v", got.Items)
	}
	resp, err := client.Get(srv.URL + "/weather?city=Oslo")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "sunny" {
		t.Fatalf("paying the gate: %d %q", resp.StatusCode, body)
	}
	check := func(when string) {
		t.Helper()
		got := listed(when)
		if got.Pagination.Total != 1 || got.Items[0].Resource != srv.URL+"/weather" || got.Items[0].ServiceName != "Caddy Weather" ||
			got.Items[0].Description != "the weather" || len(got.Items[0].Tags) != 1 {
			t.Fatalf("%s the catalog lists %+v; want the gate's /weather as it declared it", when, got)
		}
	}
	check("after the payment")
	srv.load(caddyfile)
	check("after a reload")
	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	srv.load(caddyfile)
	check("after a restart")
}
