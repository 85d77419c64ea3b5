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
			wallet_keys `+keyHex(c.Wallets[0])+`
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
}

func keyHex(a *chaintest.Account) string {
	return hexKey(a)
}
