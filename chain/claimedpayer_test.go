package chain_test

import (
	"testing"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// x402 spells addresses without go-ethereum; it must spell them as go-ethereum does.
func TestX402ChecksumAddressAgreesWithGoEthereum(t *testing.T) {
	for i := 0; i < 64; i++ {
		a := chaintest.DeriveAccount("checksum", i).Address
		lower := "0x" + common.Bytes2Hex(a.Bytes())
		if got, want := x402.ChecksumAddress(lower), a.Hex(); got != want {
			t.Fatalf("x402.ChecksumAddress(%s) = %s, go-ethereum says %s", lower, got, want)
		}
	}
}
