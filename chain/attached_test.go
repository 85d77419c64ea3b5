package chain_test

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An engine whose backend is a dev chain in this process (chain.AttachedClient, with the node's state for the
// nonce read) verifies and settles payments one after another, each final in well under the 2 s rescue with a
// poll of a minute. (The watcher's first look often finds an idle dev chain's block already sealed, so this
// does not prove the pushed head was used: TestTheReceiptWatcherLooksAgainAsSoonAsANodeInThisProcessPushesANewHead
// does.)
func TestAnEngineOnANodeInThisProcessVerifiesAndSettlesThroughItOneAfterAnother(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dc, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dc.Close() })
	approve(t, dc.Client(), dc, dc.Payer(), contracts.Permit2Address)
	f, err := chain.New(ctx, chain.Config{Journal: journal.NewMemory(journal.Options{}), Networks: []chain.NetworkConfig{{
		Network: dc.Network(), Backend: chain.AttachedClient(dc.Client(), dc.StorageAt), Keys: dc.WalletKeys()[:1],
		ReceiptTimeout: 20 * time.Second, ReceiptPoll: time.Minute,
		Assets: []chain.AssetConfig{{Address: dc.Token(), Name: "Stable Coin", Version: "1", Decimals: 6}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	rq := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: dc.Network(), Amount: "10000", Asset: dc.Token().Hex(),
		PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 3600,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
	for i := range 3 {
		head, err := dc.Client().HeaderByNumber(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		p, err := chain.SignPermit2Payment(dc.Payer(), rq, new(big.Int).SetUint64(dc.ChainID()), chain.Permit2Options{Now: time.Unix(int64(head.Time), 0)})
		if err != nil {
			t.Fatal(err)
		}
		req := x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
		if v, err := f.Verify(ctx, req); err != nil || !v.IsValid {
			t.Fatalf("payment %d: verify = %+v, %v", i, v, err)
		}
		start := time.Now()
		resp, err := f.Settle(ctx, req)
		if err != nil || !resp.Success {
			t.Fatalf("payment %d: settle = %+v, %v after %s; want success", i, resp, err, time.Since(start))
		}
		if took := time.Since(start); took > 1500*time.Millisecond {
			t.Fatalf("payment %d settled in %s: its block was found by a later look (the 2 s rescue or the minute's poll)", i, took)
		}
	}
}
