package caddymodule_test

import (
	"encoding/hex"

	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

// hexKey is the private key of a test account as a Caddyfile would hold it.
func hexKey(a *chaintest.Account) string { return hex.EncodeToString(crypto.FromECDSA(a.Key)) }
