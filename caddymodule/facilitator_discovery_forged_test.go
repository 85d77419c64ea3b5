package caddymodule_test

import (
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payer that echoes a forged resource and bazaar declaration (another URL, its own description, service name
// and schema) pays our gate, which settles through the x402_facilitator of the same Caddy: the catalog lists the
// gate's route as the gate declared it, never the payer's text. A route that declares nothing, paid with a
// forged declaration, is not catalogued at all.
func TestAPayersForgedBazaarEchoIsReplacedByTheGatesOwnDeclaration(t *testing.T) {
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
			}
		}
		respond "sunny"
	}
	handle /private {
		x402 $0.01 {
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
			facilitator {{ADDR}}/facilitator
		}
		respond "quiet"
	}
}
`
	srv := startCaddy(t, caddyfile)
	p := c.Payers[0]
	c.Approve(p, contracts.Permit2Address, new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1)))
	forged := json.RawMessage(`{"info":{"input":{"type":"http","method":"GET","queryParams":{"free":"money"}}},` +
		`"schema":{"type":"object","properties":{"input":{"type":"object"}},"required":["input"]}}`)
	pay := func(path string) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			t.Fatalf("GET %s = %d: %v", path, resp.StatusCode, err)
		}
		var rq *x402.PaymentRequirements
		for i := range pr.Accepts {
			if pr.Accepts[i].Extra.AssetTransferMethod == x402.TransferPermit2 {
				rq = &pr.Accepts[i]
			}
		}
		if rq == nil {
			t.Fatalf("GET %s offers no permit2 requirement: %+v", path, pr.Accepts)
		}
		payload, err := chain.SignPermit2Payment(p.Key, *rq, c.ChainID, chain.Permit2Options{Now: time.Unix(int64(c.HeadTime()), 0)})
		if err != nil {
			t.Fatal(err)
		}
		payload.Resource = &x402.ResourceInfo{URL: "https://evil.example/free", Description: "free money", ServiceName: "Evil", Tags: []string{"scam"}}
		payload.Extensions = map[string]json.RawMessage{x402.ExtensionBazaar: forged}
		header, err := x402.EncodeHeader(payload)
		if err != nil {
			t.Fatal(err)
		}
		req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		req.Header.Set(x402.HeaderPaymentSignature, header)
		resp, err = http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("paying %s with a forged echo = %d %q, want 200 (the payment itself is good)", path, resp.StatusCode, body)
		}
	}
	pay("/weather?city=Oslo")
	pay("/private")

	resp, err := http.Get(srv.URL + "/facilitator/discovery/resources")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var got x402.DiscoveryResourcesResponse
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &got) != nil {
		t.Fatalf("/discovery/resources = %d %s", resp.StatusCode, b)
	}
	if got.Pagination.Total != 1 || len(got.Items) != 1 {
		t.Fatalf("the catalog lists %s; want the gate's /weather alone", b)
	}
	item := got.Items[0]
	if item.Resource != srv.URL+"/weather" || item.Description != "the weather" || item.ServiceName != "Caddy Weather" ||
		len(item.Tags) != 0 || strings.Contains(string(b), "evil") || strings.Contains(string(b), "money") ||
		!strings.Contains(string(item.Extensions[x402.ExtensionBazaar]), `"city":"Oslo"`) {
		t.Fatalf("the catalog lists %s; want /weather as the gate declared it, nothing of the payer's", b)
	}
}
