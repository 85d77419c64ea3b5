package caddymodule_test

import (
	"encoding/hex"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

// hexKey is the private key of a test account as a Caddyfile would hold it.
func hexKey(a *chaintest.Account) string { return hex.EncodeToString(crypto.FromECDSA(a.Key)) }

// x402App is the running config's x402 app.
func x402App(t testing.TB) *caddymodule.App {
	t.Helper()
	ctx, ok := caddy.ActiveContext(), true
	if !ok {
		t.Fatal("no running Caddy")
	}
	v, err := ctx.App("x402")
	if err != nil {
		t.Fatal(err)
	}
	return v.(*caddymodule.App)
}
