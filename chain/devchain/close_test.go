package devchain

import (
	"context"
	"crypto/ecdsa"
	"log/slog"
	"math/big"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	gethlog "github.com/ethereum/go-ethereum/log"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// A dev chain closed while it seals blocks closes: the seal under way ends before the database closes.
// go-ethereum's simulated beacon sealed on in a loop its Stop did not wait for: a block it built before the chain
// stopped and inserted after was written as a bad block to the closed database, which ended the process with exit
// status 1 ("Failed to write bad blocks", pebble or leveldb: closed; the final CI's race pass of this package,
// about 1 run in 10 there). Each round sends transfers over JSON-RPC one after another, a block each, and closes the
// chain while they come.
func TestADevChainClosedWhileItSealsClosesWithoutEndingTheProcess(t *testing.T) {
	warned := recordGethWarnings(t)
	for round := 0; round < 10; round++ {
		d, err := Start(devContext(t), Config{Listen: "127.0.0.1:0"})
		if err != nil {
			t.Fatalf("round %d: starting the dev chain: %v", round, err)
		}
		client := devDial(t, d)
		warned() // the start's own
		start := d.eth.BlockChain().CurrentBlock().Number.Uint64()
		txs := signedTransfers(t, d, d.Payer(), 500)
		sent := make(chan int)
		go func() {
			n := 0
			for _, tx := range txs {
				if client.SendTransaction(context.Background(), tx) != nil {
					break // the chain is closing
				}
				n++
			}
			sent <- n
		}()
		deadline := time.Now().Add(30 * time.Second)
		for d.eth.BlockChain().CurrentBlock().Number.Uint64() < start+3 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if d.eth.BlockChain().CurrentBlock().Number.Uint64() < start+3 {
			t.Fatalf("round %d: three blocks not sealed in 30 s with transfers coming", round)
		}
		time.Sleep(time.Duration(round) * 3 * time.Millisecond)
		if err := d.Close(); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
		if n := <-sent; n == len(txs) {
			t.Logf("round %d: every transfer was sent before Close: the round closed a chain at rest", round)
		}
		// A block sealed across the close is a warning before it is a crash: the seal fails once the chain
		// stopped ("NewPayload: inserting block failed", and its block written as a bad one while the database
		// is still open), or it starts after the pool closed ("Error performing sealing work").
		if w := warned(); len(w) > 0 {
			t.Fatalf("round %d: go-ethereum warned as the chain closed: %q", round, w)
		}
	}
}

// recordGethWarnings has go-ethereum's warnings and errors recorded (and its errors still written as TestMain
// has them) until the test ends; the function returned gives those recorded since it was last called.
func recordGethWarnings(t *testing.T) func() []string {
	prev := gethlog.Root()
	rec := &gethRecorder{next: prev.Handler(), mu: new(sync.Mutex), msgs: new([]string)}
	gethlog.SetDefault(gethlog.NewLogger(rec))
	t.Cleanup(func() { gethlog.SetDefault(prev) })
	return func() []string {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		out := *rec.msgs
		*rec.msgs = nil
		return out
	}
}

type gethRecorder struct {
	next slog.Handler
	mu   *sync.Mutex
	msgs *[]string
}

func (r *gethRecorder) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (r *gethRecorder) Handle(ctx context.Context, rec slog.Record) error {
	r.mu.Lock()
	*r.msgs = append(*r.msgs, rec.Message)
	r.mu.Unlock()
	if r.next.Enabled(ctx, rec.Level) {
		return r.next.Handle(ctx, rec)
	}
	return nil
}

func (r *gethRecorder) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &gethRecorder{next: r.next.WithAttrs(attrs), mu: r.mu, msgs: r.msgs}
}

func (r *gethRecorder) WithGroup(name string) slog.Handler {
	return &gethRecorder{next: r.next.WithGroup(name), mu: r.mu, msgs: r.msgs}
}

// signedTransfers signs n token transfers of key, in its next n nonces at the head.
func signedTransfers(t *testing.T, d *Chain, key *ecdsa.PrivateKey, n int) []*types.Transaction {
	t.Helper()
	head := d.eth.BlockChain().CurrentBlock()
	from := crypto.PubkeyToAddress(key.PublicKey)
	state, err := d.eth.BlockChain().State()
	if err != nil {
		t.Fatal(err)
	}
	nonce := state.GetNonce(from)
	chainID := new(big.Int).SetUint64(d.chainID)
	tip := big.NewInt(1e9)
	data, err := contracts.StableCoinABI.Pack("transfer", common.HexToAddress("0xbeef"), big.NewInt(1))
	if err != nil {
		t.Fatal(err)
	}
	out := make([]*types.Transaction, n)
	for i := range out {
		out[i], err = types.SignNewTx(key, types.LatestSignerForChainID(chainID), &types.DynamicFeeTx{
			ChainID: chainID, Nonce: nonce + uint64(i), GasTipCap: tip, Gas: 100_000, To: &TokenAddress, Data: data,
			GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(4)), tip),
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}
