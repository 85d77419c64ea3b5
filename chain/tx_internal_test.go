package chain

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/params"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

// A stuck transaction that sends value (a sponsored approval's gas money) is replaced by one that sends the same
// value, with higher fees: a replacement without it would leave the payer unfunded and its approval stuck.
func TestAFeeBumpKeepsTheValueTheStuckTransactionSends(t *testing.T) {
	c := chaintest.New(t)
	s := newSender(c.EthClient, c.ChainID, FeePolicy{CacheFor: time.Second}, time.Now)
	w := &wallet{key: c.Wallets[0].Key, Address: c.Wallets[0].Address}
	q, err := s.feeQuote(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	value := big.NewInt(7_000_000_000_000)
	stuck, err := s.sign(w, 0, contractCall{To: c.PayerNoGas.Address, Value: value, Gas: params.TxGas}, q)
	if err != nil {
		t.Fatal(err)
	}
	replacement, err := s.replace(context.Background(), w, stuck)
	if err != nil {
		t.Fatal(err)
	}
	if replacement.Value().Cmp(value) != 0 || replacement.Nonce() != stuck.Nonce() || replacement.GasFeeCap().Cmp(stuck.GasFeeCap()) <= 0 {
		t.Fatalf("replacement sends %s at nonce %d with fee cap %s; want %s at %d above %s", replacement.Value(), replacement.Nonce(), replacement.GasFeeCap(), value, stuck.Nonce(), stuck.GasFeeCap())
	}
}
