package chain

import (
	"context"
	"crypto/ecdsa"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// blockContextCode is creation code that returns what a transaction sees of its block and itself: timestamp,
// number, gas price, origin and gas left, one word each.
var blockContextCode = common.FromHex("0x42600052436020523a604052326060525a60805260a06000f3")

// noOverrides is a backend that hides its JSON-RPC client: the engine cannot pass block overrides through it.
type noOverrides struct{ Backend }

// TestTheSimulationRunsAsTheSettlementTransactionWillRun: an eth_call standing for a settlement sees the
// settlement wallet as tx.origin, the fee quote's gas price, the call's gas limit, and the next block: number
// head+1, time the later of head+1 and the engine's clock, a base fee the quote pays (a stuck transaction's
// quote is under the head's), through a node client and through a Failover. A backend that cannot pass block
// overrides runs the call at the head block, priced at no less than its base fee, and says so once in the log.
func TestTheSimulationRunsAsTheSettlementTransactionWillRun(t *testing.T) {
	c := chaintest.New(t)
	failover, err := NewFailover([]string{"node"}, []Backend{c.EthClient})
	if err != nil {
		t.Fatal(err)
	}
	const ahead = 90 * time.Second
	for _, tc := range []struct {
		name      string
		backend   Backend
		overrides bool
	}{
		{"through a node client", c.EthClient, true},
		{"through a failover", failover, true},
		{"through a backend without block overrides", noOverrides{c.EthClient}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			logs, logged := observer.New(zapcore.WarnLevel)
			f, err := New(ctx, Config{Logger: zap.New(logs), Now: func() time.Time { return time.Now().Add(ahead) }, ReconcileEvery: -1,
				Networks: []NetworkConfig{{Network: x402.EIP155(c.ChainID.Uint64()), Backend: tc.backend, Keys: []*ecdsa.PrivateKey{c.Wallets[0].Key, c.Wallets[1].Key},
					Assets: []AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}}}}})
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			n := f.networks[x402.EIP155(c.ChainID.Uint64())]
			head, err := n.backend.HeaderByNumber(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, q := range []*feeQuote{
				{tipCap: big.NewInt(3e9), feeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), big.NewInt(3e9))},
				{tipCap: big.NewInt(1), feeCap: big.NewInt(2)}, // a stuck transaction's quote, under the base fee
			} {
				p := &payment{net: n}
				p.head, p.mineAt = head, max(head.Time+1, uint64(time.Now().Add(ahead).Unix()))
				p.exec = newExecution(c.Wallets[1].Address, q, head, p.mineAt)
				out, err := p.call(ctx, nil, blockContextCode, 150_000)
				if err != nil || len(out) != 5*32 {
					t.Fatalf("the call = 0x%x, %v; want five words", out, err)
				}
				word := func(i int) *big.Int { return new(big.Int).SetBytes(out[32*i : 32*i+32]) }
				wantTime, wantNumber := p.mineAt, head.Number.Uint64()+1
				if !tc.overrides {
					wantTime, wantNumber = head.Time, head.Number.Uint64()
				}
				if got := word(0).Uint64(); got != wantTime {
					t.Errorf("block.timestamp = %d; want %d (head %d, the engine's clock %s ahead)", got, wantTime, head.Time, ahead)
				}
				if got := word(1).Uint64(); got != wantNumber {
					t.Errorf("block.number = %d; want %d", got, wantNumber)
				}
				// In the next block, whose base fee is one the quote pays; at the head, at no less than its base fee.
				baseFee, feeCap := minBig(head.BaseFee, q.feeCap), q.feeCap
				if !tc.overrides {
					baseFee, feeCap = head.BaseFee, maxBig(q.feeCap, head.BaseFee)
				}
				wantPrice := minBig(feeCap, new(big.Int).Add(baseFee, q.tipCap))
				if got := word(2); got.Cmp(wantPrice) != 0 || got.Sign() == 0 {
					t.Errorf("tx.gasprice = %s; want %s (tip %s, fee cap %s, base fee %s)", got, wantPrice, q.tipCap, q.feeCap, head.BaseFee)
				}
				if got := common.BytesToAddress(out[3*32 : 4*32]); got != c.Wallets[1].Address {
					t.Errorf("tx.origin = %s; want the settlement wallet %s", got.Hex(), c.Wallets[1].Address.Hex())
				}
				if got := word(4).Uint64(); got >= 150_000 || got < 50_000 {
					t.Errorf("gasleft() = %d; want under the call's gas limit of 150000", got)
				}
			}
			if warned := logged.FilterMessageSnippet("block overrides").Len(); warned != map[bool]int{true: 0, false: 1}[tc.overrides] {
				t.Errorf("the log says %d times that the node takes no block overrides", warned)
			}
		})
	}
}
