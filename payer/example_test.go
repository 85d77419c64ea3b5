package payer_test

import (
	"crypto/ecdsa"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"github.com/caddyserver/caddy/v2"

	_ "github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/payer"
)

// devPayerKey is the demo payer of the dev chain the example runs: funded with the dev tokens and ETH, and
// without a Permit2 allowance, so its permit2 payment is gas sponsored. Its key is public; never use it on a
// real chain. (The example's one reference to the dev chain's Go package.)
func devPayerKey() *ecdsa.PrivateKey { return devchain.PayerKey() }

// shopConfig is a Caddy config running the x402 app's dev chain with its JSON-RPC on chainAddr, and a site on
// siteAddr whose every page costs $0.01 of the dev chain's Stable Coin (10000 raw units), settled by the
// embedded facilitator.
const shopConfig = `{
	"admin": {"disabled": true, "config": {"persist": false}},
	"logging": {"logs": {"default": {"level": "ERROR"}}},
	"apps": {
		"x402": {"dev_chain": {"listen": %q}},
		"http": {"servers": {"shop": {
			"listen": [%q],
			"automatic_https": {"disable": true},
			"routes": [{"handle": [
				{"handler": "x402", "price": "$0.01", "pay_to": "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11"},
				{"handler": "static_response", "body": "the paid report"}
			]}]
		}}}
	}
}`

// An http.Client whose Transport pays, at most 0.01 token a request, for a page behind a Caddy x402 gate.
func ExampleTransport() {
	// Caddy keeps its storage under XDG_DATA_HOME and its autosaved config under XDG_CONFIG_HOME: a scratch
	// folder, not the user's own.
	dir, err := os.MkdirTemp("", "payer-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	for _, v := range []string{"XDG_DATA_HOME", "XDG_CONFIG_HOME"} {
		old, had := os.LookupEnv(v)
		os.Setenv(v, filepath.Join(dir, v))
		defer func() {
			if had {
				os.Setenv(v, old)
			} else {
				os.Unsetenv(v)
			}
		}()
	}

	chainAddr, siteAddr := freeAddr(), freeAddr()
	cfg := fmt.Sprintf(shopConfig, chainAddr, siteAddr)
	if err := caddy.Load([]byte(cfg), true); err != nil {
		log.Fatal(err)
	}
	defer caddy.Stop()

	// The RPC gives the payer chain time to sign at, and shows it has not approved Permit2: the payment
	// carries a gas-sponsored permit, so the payer needs no transaction of its own.
	p, err := payer.New(devPayerKey(), payer.Options{RPC: "http://" + chainAddr})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	client := &http.Client{Transport: &payer.Transport{
		Payer:  p,
		Limits: []payer.Limit{{PerRequest: big.NewInt(10_000)}},
	}}

	resp, err := client.Get("http://" + siteAddr + "/report")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		log.Fatal(err)
	}
	settled, err := payer.Settlement(resp)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.Status)
	fmt.Println(string(body))
	fmt.Println("settled:", settled != nil && settled.Success)
	// Output:
	// 200 OK
	// the paid report
	// settled: true
}

// freeAddr is a loopback address with a port nobody listens on.
func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
