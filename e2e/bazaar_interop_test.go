package e2e

import (
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An @x402/hono server declaring bazaar discovery, paid by the public TypeScript client and settling through our
// x402_facilitator on the dev chain, is catalogued: the SDK's own discovery client lists it from our
// /discovery/resources with what the hono server declared, and its settle answer reported the indexing in
// EXTENSION-RESPONSES. Our gate's 402 declaring discovery is read by the SDK's own extractDiscoveryInfo, which
// validates it against its schema.
func TestAnHonoServerDeclaringBazaarIsCataloguedByOurFacilitatorAndListedToTheSDKsDiscoveryClient(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
		}
	}
}

%s {
	bind 127.0.0.1
	handle_path /facilitator/* {
		x402_facilitator
	}
	handle {
		x402 $0.01 {
			pay_to %s
			description "a gated forecast"
			discovery {
				input_schema `+"`"+`{"properties": {"city": {"type": "string"}}}`+"`"+`
				input_example `+"`"+`{"city": "Lima"}`+"`"+`
				service_name "Gate Weather"
				tags weather caddy
			}
		}
		respond "paid"
	}
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain, our facilitator and a gate declaring discovery", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/forecast", 402))
	dev := dialChain(t, chainURL)

	// Our gate's 402, read by the SDK's facilitator-side extraction (which validates info against its schema).
	r := runCommand(t, time.Minute, sdk, os.Environ(), node, "discover.mjs", "extract", gateURL+"/forecast?city=Lima")
	var ex struct {
		Status    int    `json:"status"`
		Error     string `json:"error"`
		Extracted *struct {
			ResourceURL   string   `json:"resourceUrl"`
			Description   string   `json:"description"`
			ServiceName   string   `json:"serviceName"`
			Tags          []string `json:"tags"`
			Method        string   `json:"method"`
			DiscoveryInfo struct {
				Input struct {
					Type        string            `json:"type"`
					Method      string            `json:"method"`
					QueryParams map[string]string `json:"queryParams"`
				} `json:"input"`
			} `json:"discoveryInfo"`
		} `json:"extracted"`
	}
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &ex); err != nil || ex.Extracted == nil {
		t.Fatalf("discover.mjs extract exited %d: %v\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
	}
	if e := ex.Extracted; e.ResourceURL != gateURL+"/forecast" || e.Method != "GET" || e.DiscoveryInfo.Input.Type != "http" ||
		e.DiscoveryInfo.Input.QueryParams["city"] != "Lima" || e.Description != "a gated forecast" || e.ServiceName != "Gate Weather" ||
		strings.Join(e.Tags, ",") != "weather,caddy" {
		t.Errorf("the SDK extracted %+v from our gate's 402; want the declared GET /forecast, city Lima, Gate Weather", *e)
	}

	hono := startProgram(t, "the @x402/hono server declaring bazaar", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+gateURL+"/facilitator", fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		"X402_ASSET="+devchain.TokenAddress.Hex(), "X402_PAY_TO="+seller.Hex(), "X402_AMOUNT=10000",
		"X402_BAZAAR=1", "X402_LIFETIME_SECONDS=300"),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))

	// Nothing is listed before a payment settled.
	list := func(args ...string) x402.DiscoveryResourcesResponse {
		t.Helper()
		r := runCommand(t, time.Minute, sdk, os.Environ(), node, append([]string{"discover.mjs", "list", gateURL + "/facilitator"}, args...)...)
		var got struct {
			Listed *x402.DiscoveryResourcesResponse `json:"listed"`
			Error  string                           `json:"error"`
		}
		if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil || got.Listed == nil {
			t.Fatalf("discover.mjs list exited %d: %v\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
		}
		return *got.Listed
	}
	if got := list(); got.Pagination.Total != 0 {
		t.Fatalf("before any payment the catalog lists %+v", got.Items)
	}

	key := devchain.PayerKeyN(3)
	payerAddr := crypto.PubkeyToAddress(key.PublicKey)
	dev.fundPayer(key)
	payerBefore, sellerBefore, from := dev.balance(payerAddr), dev.balance(seller), dev.head()+1

	env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
		"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID), "X402_METHOD=permit2")
	r = runCommand(t, 2*time.Minute, sdk, env, node, "pay.mjs", honoURL+"/paid?city=Oslo")
	var paid paidByTypeScript
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &paid); err != nil || paid.Status != 200 || paid.PaymentResponse == nil || !paid.PaymentResponse.Success {
		t.Fatalf("the TypeScript client paying the hono server: exit %d, %+v (%v)\nstderr:\n%s", r.code, paid, err, r.stderr)
	}
	if d := delta(payerBefore, dev.balance(payerAddr)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payerAddr, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}

	got := list("http", "10", "0")
	if got.Pagination.Total != 1 || len(got.Items) != 1 {
		t.Fatalf("the SDK's discovery client lists %+v; want the hono server's /paid", got)
	}
	item := got.Items[0]
	var decl struct {
		Info struct {
			Input struct {
				Method      string            `json:"method"`
				QueryParams map[string]string `json:"queryParams"`
			} `json:"input"`
			Output struct {
				Example map[string]float64 `json:"example"`
			} `json:"output"`
		} `json:"info"`
	}
	_ = json.Unmarshal(item.Extensions[x402.ExtensionBazaar], &decl)
	if item.Resource != honoURL+"/paid" || item.Type != "http" || item.X402Version != 2 || item.Description != "Content sold by an @x402/hono server" ||
		item.ServiceName != "Hono Weather" || strings.Join(item.Tags, ",") != "weather,interop" || item.IconURL != "https://hono.example/icon.png" ||
		len(item.Accepts) != 1 || item.Accepts[0].PayTo != seller.Hex() || decl.Info.Input.Method != "GET" ||
		decl.Info.Input.QueryParams["city"] != "Oslo" || decl.Info.Output.Example["tempC"] != 4 {
		t.Errorf("listed %+v (bazaar %s); want what the hono server declared", item, item.Extensions[x402.ExtensionBazaar])
	}
	if !strings.Contains(hono.out.String(), `"bazaar":{"status":"success"}`) {
		t.Errorf("the hono server's facilitator client logged no bazaar success from EXTENSION-RESPONSES:\n%s", lastLines(hono.out.String(), 20))
	}

	// Our payer against the hono server: `caddy x402 pay` and payer.Transport each pay once, echoing its
	// declaration as the SDK's client does, and the facilitator catalogs it again from their payments (one entry,
	// updated, still the hono server's declaration).
	ours := []struct {
		name string
		pay  func(key *ecdsa.PrivateKey)
	}{
		{"caddy x402 pay", func(key *ecdsa.PrivateKey) {
			r := runCommand(t, 2*time.Minute, dir, childEnv(t, "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key))),
				caddyBin, "x402", "pay", "--rpc", chainURL, honoURL+"/paid?city=Oslo")
			if r.code != 0 || !strings.HasPrefix(r.stdout, "HTTP/1.1 200 OK\n") {
				t.Fatalf("caddy x402 pay exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
			}
		}},
		{"payer.Transport", func(key *ecdsa.PrivateKey) {
			p, err := payer.New(key, payer.Options{RPC: chainURL})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: fmt.Sprintf("eip155:%d", devchain.DefaultChainID),
				Asset: devchain.TokenAddress.Hex(), PerRequest: big.NewInt(10_000), Total: big.NewInt(10_000)}}}}
			resp, err := client.Get(honoURL + "/paid?city=Oslo")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("payer.Transport paying the hono server = %d", resp.StatusCode)
			}
		}},
	}
	for i, o := range ours {
		key := devchain.PayerKeyN(5 + i)
		addr := crypto.PubkeyToAddress(key.PublicKey)
		dev.fundPayer(key)
		payerBefore, sellerBefore, from := dev.balance(addr), dev.balance(seller), dev.head()+1
		o.pay(key)
		if d := delta(payerBefore, dev.balance(addr)); d.Cmp(big.NewInt(-10_000)) != 0 {
			t.Errorf("%s: the payer's balance moved by %s, want -10000", o.name, d)
		}
		if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
			t.Errorf("%s: the seller's balance moved by %s, want +10000", o.name, d)
		}
		if n := len(dev.transfers(addr, seller, from)); n != 1 {
			t.Errorf("%s: %d Transfers from the payer to the seller, want 1", o.name, n)
		}
		again := list("http", "10", "0")
		if again.Pagination.Total != 1 || again.Items[0].Resource != honoURL+"/paid" || again.Items[0].ServiceName != "Hono Weather" ||
			again.Items[0].LastUpdated <= got.Items[0].LastUpdated {
			t.Errorf("%s: after its payment the catalog lists %+v; want the hono server's /paid alone, updated", o.name, again)
		}
		got = again
		if n := strings.Count(hono.out.String(), `"bazaar":{"status":"success"}`); n != 2+i {
			t.Errorf("%s: the hono server logged %d bazaar successes, want %d: our payer's payment echoed no declaration", o.name, n, 2+i)
		}
	}
	hono.stop()
	caddy.stop()
}
