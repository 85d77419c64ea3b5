package chain_test

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"math/big"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// BenchmarkSustainedSettlement settles b.N distinct permit2 payments through wallet pools of 1, 4 and 16 wallets
// on the embedded dev chain (a real go-ethereum node over HTTP JSON-RPC) sealing a block every second, so chain
// time follows the clock and every settlement waits for a real block; the journal is the durable bbolt one.
// Each wallet pipelines up to 256 settlements (max_in_flight_per_wallet), and as many payments are offered at once
// as the pool can carry.
//
//	go test ./chain -run '^$' -bench SustainedSettlement -benchtime 6000x
func BenchmarkSustainedSettlement(b *testing.B) {
	for _, wallets := range []int{1, 4, 16} {
		b.Run(fmt.Sprintf("wallets=%d", wallets), func(b *testing.B) {
			ctx := context.Background()
			const payers, perWallet = 8, 256
			dc, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0", BlockTime: time.Second, Wallets: wallets, Payers: payers})
			if err != nil {
				b.Fatal(err)
			}
			defer dc.Close()
			client, err := chain.DialRPC(ctx, dc.RPCURL())
			if err != nil {
				b.Fatal(err)
			}
			defer client.Close()
			for _, k := range dc.Payers() {
				approve(b, client.Client, dc, k, contracts.Permit2Address)
			}
			store, err := journal.OpenBolt(filepath.Join(b.TempDir(), "journal.db"), journal.Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer store.Close()
			logger, _ := zap.NewDevelopment(zap.IncreaseLevel(zap.WarnLevel))
			f, err := chain.New(ctx, chain.Config{Logger: logger, Journal: store, Networks: []chain.NetworkConfig{{
				Network: dc.Network(), Backend: client, Keys: dc.WalletKeys(), ReceiptTimeout: 2 * time.Minute, ReceiptPoll: 50 * time.Millisecond, HeadCacheTTL: 250 * time.Millisecond, MaxInFlightPerWallet: perWallet,
				Assets: []chain.AssetConfig{{Address: dc.Token(), Name: "Stable Coin", Version: "1", Decimals: 6}},
			}}})
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			rq := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: dc.Network(), Amount: "10000", Asset: dc.Token().Hex(),
				PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 3600,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
			head, err := client.HeaderByNumber(ctx, nil)
			if err != nil {
				b.Fatal(err)
			}
			work := make(chan x402.VerifyRequest, b.N)
			for i := range b.N {
				p, err := chain.SignPermit2Payment(dc.Payers()[i%payers], rq, new(big.Int).SetUint64(dc.ChainID()), chain.Permit2Options{Now: time.Unix(int64(head.Time), 0)})
				if err != nil {
					b.Fatal(err)
				}
				work <- x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
			}
			close(work)
			var failures atomic.Int64
			var firstFailure atomic.Value
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for range wallets * perWallet {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for r := range work {
						resp, err := f.Settle(ctx, r)
						if err != nil || !resp.Success {
							failures.Add(1)
							firstFailure.CompareAndSwap(nil, fmt.Sprintf("%+v %v", resp, err))
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			if n := failures.Load(); n > 0 {
				b.Fatalf("%d of %d settlements failed; first: %v", n, b.N, firstFailure.Load())
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "settlements/s")
		})
	}
}

// approve has owner allow spender to move all its dev tokens, and waits for the receipt.
func approve(b testing.TB, client *ethclient.Client, dc *devchain.Chain, owner *ecdsa.PrivateKey, spender common.Address) {
	b.Helper()
	ctx := context.Background()
	data, err := contracts.StableCoinABI.Pack("approve", spender, new(big.Int).Lsh(big.NewInt(1), 255))
	if err != nil {
		b.Fatal(err)
	}
	from := crypto.PubkeyToAddress(owner.PublicKey)
	nonce, err := client.PendingNonceAt(ctx, from)
	if err != nil {
		b.Fatal(err)
	}
	token := dc.Token()
	tx, err := types.SignNewTx(owner, types.LatestSignerForChainID(new(big.Int).SetUint64(dc.ChainID())), &types.DynamicFeeTx{
		ChainID: new(big.Int).SetUint64(dc.ChainID()), Nonce: nonce, GasTipCap: big.NewInt(1e9), GasFeeCap: big.NewInt(100e9), Gas: 100_000, To: &token, Data: data})
	if err != nil {
		b.Fatal(err)
	}
	if err := client.SendTransaction(ctx, tx); err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if r, err := client.TransactionReceipt(ctx, tx.Hash()); err == nil && r.Status == 1 {
			return
		}
	}
	b.Fatal("approve was not mined")
}
