package caddymodule_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

func TestTheX402AppStartsAnEmbeddedFacilitatorFromTheGlobalOption(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	srv := startCaddy(t, `{
	x402 {
		network eip155:72344 {
			rpc `+c.RPCURL+`
			asset `+c.Token.Hex()+` name "Stable Coin" version 1 decimals 6
			wallet_keys `+hexKey(c.Wallets[0])+`
		}
		journal {{DATA}}/journal.db
	}
}
{{ADDR}} {
	respond "free"
}`)
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || strings.TrimSpace(string(body)) != "free" {
		t.Fatalf("GET / = %d %q", resp.StatusCode, body)
	}
	f := x402App(t).Facilitator()
	if f == nil {
		t.Fatal("the global option configured no embedded facilitator")
	}
	if nets, wallets := f.Networks(), f.Wallets("eip155:72344"); len(nets) != 1 || len(wallets) != 1 || wallets[0] != c.Wallets[0].Address {
		t.Fatalf("networks %v, wallets %v; want eip155:72344 settled from %s", nets, wallets, c.Wallets[0].Address.Hex())
	}
}

func TestTheDevChainOptionStartsAChainAndSettlesOnItWithNoOtherConfiguration(t *testing.T) {
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			listen 127.0.0.1:0
		}
	}
}
{{ADDR}} {
	respond "free"
}`)
	app := x402App(t)
	f := app.Facilitator()
	if f == nil {
		t.Fatal("the dev chain configured no embedded facilitator")
	}
	nets := f.Networks()
	if len(nets) != 1 || nets[0] != "eip155:72344" {
		t.Fatalf("networks = %v, want the dev chain's eip155:72344", nets)
	}
	if got := len(f.Wallets(nets[0])); got != 4 {
		t.Fatalf("%d settlement wallets on the dev chain, want 4", got)
	}
	_ = srv
}

func TestAConfigReloadKeepsTheEmbeddedEngineItsWalletsAndJournal(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	global := `{
	x402 {
		network eip155:72344 {
			rpc ` + c.RPCURL + `
			asset ` + c.Token.Hex() + `
			wallet_keys ` + hexKey(c.Wallets[0]) + `
		}
		journal {{DATA}}/journal.db
	}
}
`
	srv := startCaddy(t, global+`{{ADDR}} {
	respond "first"
}`)
	before := x402App(t).Facilitator()
	journalBefore, _, err := x402App(t).SettlementJournal()
	if err != nil {
		t.Fatal(err)
	}
	srv.load(global + `{{ADDR}} {
	respond "second"
}`)
	after := x402App(t).Facilitator()
	journalAfter, _, err := x402App(t).SettlementJournal()
	if err != nil {
		t.Fatal(err)
	}
	if before == nil || before != after {
		t.Fatalf("the reload replaced the embedded engine (%p -> %p): nonces and settlements in flight would be lost", before, after)
	}
	if journalBefore != journalAfter {
		t.Fatal("the reload reopened the journal")
	}
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.TrimSpace(string(body)) != "second" {
		t.Fatalf("after the reload the site answers %q", body)
	}
}
