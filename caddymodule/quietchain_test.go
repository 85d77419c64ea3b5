package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// quietSeller is the seller of TestPayOnTheDevChainAfterAnIdleSpellSettlesAndNoSettlementReverts.
var quietSeller = common.HexToAddress("0x9e11e79e11e79e11e79e11e79e11e79e11e79e1")

// TestPayOnTheDevChainAfterAnIdleSpellSettlesAndNoSettlementReverts: a new user's trial of issue 28. The dev
// chain seals a block only when a transaction comes; after it sat idle longer than the offer's max_timeout
// (8 s here; 5 minutes by default, and the trial idled 7 to 17), its head is that old and its next block is
// stamped with the wall clock. `caddy x402 pay --dev` then pays and the seller is paid: before, the payer dated
// its payment from the head, the engine judged it by the head and simulated it there, and the settlement was
// mined and reverted at the settlement wallet's expense (402 invalid_exact_evm_transaction_failed). No
// settlement wallet spends anything but the gas of a successful settlement.
func TestPayOnTheDevChainAfterAnIdleSpellSettlesAndNoSettlementReverts(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0")
	c := d.dial(t)
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			rpc `+d.facts.RPC+`
		}
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to `+quietSeller.Hex()+`
		max_timeout 8s
	}
	respond "paid after a quiet spell"
}
`)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := http.Get(srv.URL); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusPaymentRequired {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the paid route never answered 402")
		}
	}
	ctx := context.Background()
	head, err := c.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for time.Now().Unix() < int64(head.Time)+10 { // idle past max_timeout, and the engine's 6 s margin
		time.Sleep(100 * time.Millisecond)
	}
	if now, err := c.HeaderByNumber(ctx, nil); err != nil || now.Number.Cmp(head.Number) != 0 {
		t.Fatalf("the dev chain sealed a block while idle (%v)", err)
	}
	spent := func() *big.Int {
		total := new(big.Int)
		for _, w := range d.facts.Wallets {
			b, err := c.BalanceAt(ctx, common.HexToAddress(w), nil)
			if err != nil {
				t.Fatal(err)
			}
			total.Add(total, b)
		}
		return total
	}
	walletsBefore, sellerBefore := spent(), tokenBalanceAt(t, c, devchain.TokenAddress, quietSeller)

	stdout, stderr, err := caddymodule.RunX402("", "pay", "--dev", "--rpc", d.facts.RPC, srv.URL)
	if err != nil || !strings.Contains(stdout, `"success": true`) {
		t.Fatalf("pay after an idle spell: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if got := new(big.Int).Sub(tokenBalanceAt(t, c, devchain.TokenAddress, quietSeller), sellerBefore); got.Cmp(big.NewInt(devchainPrice)) != 0 {
		t.Fatalf("the seller received %s, want %d", got, devchainPrice)
	}
	// Every settlement transaction since the idle spell succeeded: the wallets spent gas on nothing else.
	for n := new(big.Int).Add(head.Number, big.NewInt(1)); ; n.Add(n, big.NewInt(1)) {
		block, err := c.BlockByNumber(ctx, n)
		if err != nil {
			break
		}
		for _, tx := range block.Transactions() {
			r, err := c.TransactionReceipt(ctx, tx.Hash())
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != 1 {
				t.Errorf("transaction %s in block %s reverted", tx.Hash().Hex(), n)
			}
		}
	}
	if walletsBefore.Cmp(spent()) <= 0 {
		t.Error("the settlement wallets spent nothing: no settlement was sent")
	}
}
