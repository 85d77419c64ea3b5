package chain_test

import (
	"context"
	"math/big"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// price is the amount every test payment is for, in raw units (0.01 token).
const price = 10_000

// fixture is a facilitator on a simulated chain, with a seller to pay.
type fixture struct {
	t       testing.TB
	c       *chaintest.Chain
	f       *chain.Facilitator
	journal journal.Store
	payTo   common.Address
	net     string
}

type fixtureOpts struct {
	chainOpts      []chaintest.Option
	wallets        int
	receiptTimeout time.Duration
	journal        journal.Store
	autoCommit     time.Duration // 0: commit every 5ms once a transaction waits (WithPromptCommit); negative: never (tests commit by hand)
	// pendingBlockPace keeps the default autoCommit at the pace of the node's pending block, which lags the pool by
	// up to two seconds: for tests that need settlements to wait in the pool a while (a kill mid-settlement).
	pendingBlockPace bool
	tune             func(*fixture, *chain.NetworkConfig)
	configure        func(*chain.Config)
	instanceTTL      time.Duration // of each store sharedEnginesOn opens; 0: the store's default
	maxBehind        time.Duration // of each store clusterOn opens; 0: the store's default
	// wrap, when set, is the journal each engine sharedEnginesOn starts is given in place of its store: a test's
	// hooks around it.
	wrap func(*journal.PostgresStore) journal.Store
}

func newFixture(t testing.TB, o fixtureOpts) *fixture {
	t.Helper()
	opts := o.chainOpts
	if o.autoCommit == 0 && !o.pendingBlockPace {
		// A block as soon as a transaction waits: the default pace, the pending block's (which the node caches for
		// up to two seconds), made every settlement wait a second on average. Tests that give a pace keep it.
		opts = append([]chaintest.Option{chaintest.WithPromptCommit()}, opts...)
	}
	c := chaintest.New(t, opts...)
	fx := &fixture{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	if o.autoCommit >= 0 {
		every := o.autoCommit
		if every == 0 {
			every = 5 * time.Millisecond
		}
		stop := c.AutoCommit(every)
		t.Cleanup(stop)
	}
	nWallets := o.wallets
	if nWallets == 0 || nWallets > len(c.Wallets) {
		nWallets = len(c.Wallets)
	}
	nc := chain.NetworkConfig{
		Network: fx.net, Backend: c.EthClient,
		Assets:         []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		ReceiptTimeout: o.receiptTimeout, ReceiptPoll: 2 * time.Millisecond,
	}
	for _, w := range c.Wallets[:nWallets] {
		nc.Keys = append(nc.Keys, w.Key)
	}
	if o.tune != nil {
		o.tune(fx, &nc)
	}
	fx.journal = o.journal
	if fx.journal == nil {
		fx.journal = journal.NewMemory(journal.Options{})
	}
	cfg := chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: fx.journal, Logger: engineLog(t)}
	if o.configure != nil {
		o.configure(&cfg)
	}
	f, err := chain.New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("starting the facilitator: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	fx.f = f
	return fx
}

// engineLog is a logger writing the engine's log to a file of its own under $X402_ENGINE_LOG (one per test
// run), for chasing a failure that shows only under load; without the variable, no log.
func engineLog(t testing.TB) *zap.Logger {
	dir := os.Getenv("X402_ENGINE_LOG")
	if dir == "" {
		return nil
	}
	name := strings.NewReplacer("/", "_", " ", "_").Replace(t.Name())
	f, err := os.CreateTemp(dir, name+"-*.log")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	t.Logf("engine log: %s", f.Name())
	enc := zap.NewDevelopmentEncoderConfig()
	return zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(f), zapcore.DebugLevel))
}

// requirements is what a gate would offer for one payment by method.
func (fx *fixture) requirements(method string) x402.PaymentRequirements {
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: fx.net, Amount: big.NewInt(price).String(), Asset: fx.c.Token.Hex(),
		PayTo: fx.payTo.Hex(), MaxTimeoutSeconds: 3600,
		Extra: x402.Extra{AssetTransferMethod: method, Name: "Stable Coin", Version: "1"},
	}
	if method == x402.TransferERC2612 {
		rq.Extra.Spender = fx.c.Wallets[0].Address.Hex()
	}
	return rq
}

// chainNow is the head block's time: the clock the facilitator judges deadlines by.
func (fx *fixture) chainNow() time.Time { return time.Unix(int64(fx.c.HeadTime()), 0) }

// permit2 signs a permit2 payment of payer for rq; the payer has approved Permit2 unless approve is false.
func (fx *fixture) permit2(payer *chaintest.Account, rq x402.PaymentRequirements, opts chain.Permit2Options) x402.VerifyRequest {
	fx.t.Helper()
	if opts.Now.IsZero() {
		opts.Now = fx.chainNow()
	}
	p, err := chain.SignPermit2Payment(payer.Key, rq, fx.c.ChainID, opts)
	if err != nil {
		fx.t.Fatalf("signing a permit2 payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
}

// erc2612 signs an erc2612 payment of payer for rq with the token's current nonce.
func (fx *fixture) erc2612(payer *chaintest.Account, rq x402.PaymentRequirements, opts chain.ERC2612Options) x402.VerifyRequest {
	fx.t.Helper()
	if opts.Now.IsZero() {
		opts.Now = fx.chainNow()
	}
	if opts.TokenNonce == nil {
		opts.TokenNonce = fx.c.TokenNonce(payer.Address)
	}
	p, err := chain.SignERC2612Payment(payer.Key, rq, fx.c.ChainID, opts)
	if err != nil {
		fx.t.Fatalf("signing an erc2612 payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
}

// payment signs a payment of payer by method with default options.
func (fx *fixture) payment(method string, payer *chaintest.Account) x402.VerifyRequest {
	if method == x402.TransferPermit2 {
		return fx.permit2(payer, fx.requirements(method), chain.Permit2Options{})
	}
	return fx.erc2612(payer, fx.requirements(method), chain.ERC2612Options{})
}

// approvePermit2 gives Permit2 an allowance for every payer.
func (fx *fixture) approvePermit2(payers ...*chaintest.Account) {
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	for _, p := range payers {
		fx.c.Approve(p, contracts.Permit2Address, max)
	}
}

func (fx *fixture) verify(req x402.VerifyRequest) x402.VerifyResponse {
	fx.t.Helper()
	resp, err := fx.f.Verify(context.Background(), req)
	if err != nil {
		fx.t.Fatalf("verify: %v", err)
	}
	return resp
}

func (fx *fixture) settle(req x402.VerifyRequest) x402.SettleResponse {
	fx.t.Helper()
	resp, err := fx.f.Settle(context.Background(), req)
	if err != nil {
		fx.t.Fatalf("settle: %v", err)
	}
	return resp
}
