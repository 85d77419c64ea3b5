package payer

import (
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
)

// A voucher signed ahead is the very signature signing it then gives, and only for its amount: a payment of
// another amount (the server charged less, a resync, a refund) gets its own signature and the one ahead is dropped.
func TestAVoucherSignedAheadIsUsedOnlyForItsAmount(t *testing.T) {
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	domain := chain.BatchDomainSeparator(big.NewInt(84532))
	id := common.HexToHash("0x0c0ffee0000000000000000000000000000000000000000000000000000000a1")
	want := func(amount int64) string {
		sig, err := chain.SignVoucher(key, domain, id, big.NewInt(amount))
		if err != nil {
			t.Fatal(err)
		}
		return sig.String()
	}
	ch := &channel{}

	ch.signAhead(key, domain, id, big.NewInt(2000))
	if got, err := ch.voucherSignature(key, domain, id, big.NewInt(2000)); err != nil || got != want(2000) {
		t.Errorf("the voucher at 2000 signed ahead gives %s (%v), want %s", got, err, want(2000))
	}
	if ch.ahead != nil {
		t.Error("the voucher signed ahead is kept after a payment took it")
	}

	ch.signAhead(key, domain, id, big.NewInt(3000))
	if got, err := ch.voucherSignature(key, domain, id, big.NewInt(2500)); err != nil || got != want(2500) {
		t.Errorf("a payment at 2500 with a voucher at 3000 signed ahead gets %s (%v), want its own %s", got, err, want(2500))
	}
	if ch.ahead != nil {
		t.Error("the voucher at 3000 signed ahead is kept after a payment of another amount")
	}
	if got, err := ch.voucherSignature(key, domain, id, big.NewInt(3000)); err != nil || got != want(3000) {
		t.Errorf("with nothing signed ahead the voucher at 3000 is %s (%v), want %s", got, err, want(3000))
	}
}
