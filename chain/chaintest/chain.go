package chaintest

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/eth/ethconfig"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/ethclient/simulated"
	"github.com/ethereum/go-ethereum/node"
	"github.com/ethereum/go-ethereum/params"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// Chain IDs the project's networks use.
const (
	// DefaultChainID is the chain ID of the harness unless WithChainID says otherwise.
	DefaultChainID = 72344
	// AltChainID is the second network of the service spec.
	AltChainID = 723487
)

// Default sizes and amounts; Option functions override them.
const (
	// DefaultWallets is the number of settlement wallets.
	DefaultWallets = 4
	// DefaultPayers is the number of payers holding ETH.
	DefaultPayers = 4
	// DefaultPayersNoGas is the number of payers holding tokens but no ETH.
	DefaultPayersNoGas = 1
	// DefaultTokenBalance is each payer's minted balance in raw units: 1,000 tokens of 6 decimals.
	DefaultTokenBalance = 1_000_000_000
)

// DefaultETHBalance returns the wei every funded account starts with: 1,000 ETH.
func DefaultETHBalance() *big.Int {
	return new(big.Int).Mul(big.NewInt(1000), big.NewInt(params.Ether))
}

// Account is a key and its address.
type Account struct {
	Key     *ecdsa.PrivateKey
	Address common.Address
}

// DeriveAccount returns the deterministic account number i of role label:
// key = keccak256("caddy-x402 chaintest/" + label + "/" + i), rehashed in the
// negligible case that this is not a valid secp256k1 scalar.
func DeriveAccount(label string, i int) *Account {
	seed := crypto.Keccak256([]byte("caddy-x402 chaintest/" + label + "/" + strconv.Itoa(i)))
	for {
		key, err := crypto.ToECDSA(seed)
		if err == nil {
			return &Account{Key: key, Address: crypto.PubkeyToAddress(key.PublicKey)}
		}
		seed = crypto.Keccak256(seed)
	}
}

// Chain is a simulated chain with the x402 contracts and funded accounts.
// Its helpers that take no context fail the test on error: call them from the test's goroutine.
type Chain struct {
	// Backend is the underlying simulated backend.
	Backend *simulated.Backend
	// Client talks to the chain; it satisfies bind.ContractBackend and the ethereum interfaces.
	Client simulated.Client
	// EthClient is the go-ethereum client Client wraps, which hands out its JSON-RPC client: for calls the
	// ethereum interfaces have no method for, such as an eth_call with block overrides. Code under test that
	// takes a backend gets this one, as it gets a client of a real node.
	EthClient *ethclient.Client
	// ChainID is the chain's ID (72344 unless WithChainID).
	ChainID *big.Int
	// Config is the chain configuration (the dev fork set without Bogota and Amsterdam).
	Config *params.ChainConfig
	// Signer signs transactions for this chain.
	Signer types.Signer
	// Token is the deployed StableCoin.
	Token common.Address
	// Deployer deployed and owns the StableCoin (so it may mint); it holds ETH.
	Deployer *Account
	// Wallets are settlement wallets holding ETH and no tokens.
	Wallets []*Account
	// Payers hold ETH and tokens.
	Payers []*Account
	// PayersNoGas hold tokens and zero ETH (for gas-sponsored settlement).
	PayersNoGas []*Account
	// PayerNoGas is PayersNoGas[0], or nil when WithPayersNoGas(0).
	PayerNoGas *Account
	// RPCURL is the loopback HTTP JSON-RPC endpoint when WithHTTP was given, else "".
	RPCURL string

	tb testing.TB
	// mu serialises block production: the beacon is not safe for concurrent sealing.
	mu       sync.Mutex
	autoStop func()
	prompt   bool // see WithPromptCommit

	nonceMu   sync.Mutex
	nextNonce map[common.Address]uint64
}

type config struct {
	chainID      uint64
	wallets      int
	payers       int
	payersNoGas  int
	tokenBalance *big.Int
	ethBalance   *big.Int
	alloc        types.GenesisAlloc
	http         bool
	gasLimit     uint64
	prompt       bool
}

// WithPromptCommit makes AutoCommit seal a block as soon as the pool holds a transaction ready to be mined.
// Without it AutoCommit goes by the node's pending block, which the node caches for up to two seconds: a
// settlement sent just after a block waits that long for the next. Tests that measure latency want this; tests
// tuned to the slower pace (killing a process mid-settlement, say) do not.
func WithPromptCommit() Option { return func(c *config) { c.prompt = true } }

// WithBlockGasLimit sets the block gas limit (default go-ethereum's 60M): load tests fit a thousand
// settlements in a block.
func WithBlockGasLimit(limit uint64) Option { return func(c *config) { c.gasLimit = limit } }

// Option changes how New builds the chain.
type Option func(*config)

// WithChainID sets the chain ID (default 72344).
func WithChainID(id uint64) Option { return func(c *config) { c.chainID = id } }

// WithWallets sets the number of settlement wallets (default 4).
func WithWallets(n int) Option { return func(c *config) { c.wallets = n } }

// WithPayers sets the number of payers with ETH (default 4).
func WithPayers(n int) Option { return func(c *config) { c.payers = n } }

// WithPayersNoGas sets the number of payers without ETH (default 1).
func WithPayersNoGas(n int) Option { return func(c *config) { c.payersNoGas = n } }

// WithTokenBalance sets the raw token amount minted to each payer (default 1_000_000_000).
func WithTokenBalance(raw *big.Int) Option {
	return func(c *config) { c.tokenBalance = new(big.Int).Set(raw) }
}

// WithETHBalance sets the wei each funded account starts with (default 1,000 ETH).
func WithETHBalance(wei *big.Int) Option {
	return func(c *config) { c.ethBalance = new(big.Int).Set(wei) }
}

// WithAlloc adds genesis accounts; they win over the harness's own on conflict.
func WithAlloc(alloc types.GenesisAlloc) Option {
	return func(c *config) {
		for addr, acc := range alloc {
			c.alloc[addr] = acc
		}
	}
}

// WithHTTP serves the chain's JSON-RPC (eth, net, web3) on a free 127.0.0.1 port, in RPCURL.
func WithHTTP() Option { return func(c *config) { c.http = true } }

// New starts a simulated chain, deploys the StableCoin, mints to the payers and closes
// the chain when the test ends.
func New(tb testing.TB, opts ...Option) *Chain {
	tb.Helper()
	cfg := config{
		chainID:      DefaultChainID,
		wallets:      DefaultWallets,
		payers:       DefaultPayers,
		payersNoGas:  DefaultPayersNoGas,
		tokenBalance: big.NewInt(DefaultTokenBalance),
		ethBalance:   DefaultETHBalance(),
		alloc:        types.GenesisAlloc{},
	}
	for _, opt := range opts {
		opt(&cfg)
	}

	c := &Chain{
		ChainID:   new(big.Int).SetUint64(cfg.chainID),
		Config:    contracts.ChainConfig(cfg.chainID),
		Deployer:  DeriveAccount("deployer", 0),
		tb:        tb,
		nextNonce: make(map[common.Address]uint64),
		prompt:    cfg.prompt,
	}
	c.Signer = types.LatestSigner(c.Config)
	for i := range cfg.wallets {
		c.Wallets = append(c.Wallets, DeriveAccount("wallet", i))
	}
	for i := range cfg.payers {
		c.Payers = append(c.Payers, DeriveAccount("payer", i))
	}
	for i := range cfg.payersNoGas {
		c.PayersNoGas = append(c.PayersNoGas, DeriveAccount("payer-nogas", i))
	}
	if len(c.PayersNoGas) > 0 {
		c.PayerNoGas = c.PayersNoGas[0]
	}

	alloc := contracts.GenesisAlloc()
	funded := append(append([]*Account{c.Deployer}, c.Wallets...), c.Payers...)
	for _, acc := range funded {
		alloc[acc.Address] = types.Account{Balance: new(big.Int).Set(cfg.ethBalance)}
	}
	for addr, acc := range cfg.alloc {
		alloc[addr] = acc
	}

	var httpPort int
	if cfg.http {
		port, err := freeLoopbackPort()
		if err != nil {
			tb.Fatalf("chaintest: finding a free port for JSON-RPC: %v", err)
		}
		httpPort = port
	}
	c.Backend = simulated.NewBackend(alloc, func(nodeConf *node.Config, ethConf *ethconfig.Config) {
		ethConf.Genesis.Config = c.Config
		ethConf.NetworkId = cfg.chainID
		if cfg.gasLimit > 0 {
			ethConf.Genesis.GasLimit, ethConf.Miner.GasCeil = cfg.gasLimit, cfg.gasLimit
		}
		if cfg.http {
			nodeConf.HTTPHost = "127.0.0.1"
			nodeConf.HTTPPort = httpPort
			nodeConf.HTTPModules = []string{"eth", "net", "web3"}
		}
	})
	c.Client = c.Backend.Client()
	c.EthClient = unwrapClient(c.Client)
	if cfg.http {
		c.RPCURL = "http://127.0.0.1:" + strconv.Itoa(httpPort)
	}
	tb.Cleanup(c.close)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	token, err := c.deployToken(ctx, "StableCoin", contracts.StableCoinCreationCode(), cfg.tokenBalance)
	if err != nil {
		tb.Fatalf("chaintest: %v", err)
	}
	c.Token = token
	return c
}

// DeployToken deploys another StableCoin (same name and version, its own address, so its own EIP-712 domain)
// and mints every payer perPayer raw units of it.
func (c *Chain) DeployToken(perPayer *big.Int) common.Address {
	c.tb.Helper()
	token, err := c.deployToken(context.Background(), "StableCoin", contracts.StableCoinCreationCode(), perPayer)
	if err != nil {
		c.tb.Fatalf("chaintest: %v", err)
	}
	return token
}

// DeployUSDCoin deploys a USDCoin (USDC-like: domain "USD Coin" / "2", EIP-2612 and EIP-3009) and mints every
// payer perPayer raw units of it.
func (c *Chain) DeployUSDCoin(perPayer *big.Int) common.Address {
	c.tb.Helper()
	token, err := c.deployToken(context.Background(), "USDCoin", contracts.USDCoinCreationCode(), perPayer)
	if err != nil {
		c.tb.Fatalf("chaintest: %v", err)
	}
	return token
}

func (c *Chain) deployToken(ctx context.Context, name string, code []byte, perPayer *big.Int) (common.Address, error) {
	tx, err := c.SendTx(ctx, c.Deployer, nil, code)
	if err != nil {
		return common.Address{}, fmt.Errorf("deploying %s: %w", name, err)
	}
	receipts, err := c.CommitUntilIncluded(ctx, tx.Hash())
	if err != nil {
		return common.Address{}, fmt.Errorf("deploying %s: %w", name, err)
	}
	if receipts[0].Status != types.ReceiptStatusSuccessful {
		return common.Address{}, fmt.Errorf("deploying %s: transaction %s reverted", name, tx.Hash())
	}
	token := receipts[0].ContractAddress

	var minted []common.Hash
	for _, payer := range append(append([]*Account{}, c.Payers...), c.PayersNoGas...) {
		data, err := contracts.StableCoinABI.Pack("mint", payer.Address, perPayer)
		if err != nil {
			return common.Address{}, fmt.Errorf("packing mint: %w", err)
		}
		tx, err := c.SendTx(ctx, c.Deployer, &token, data)
		if err != nil {
			return common.Address{}, fmt.Errorf("minting to %s: %w", payer.Address, err)
		}
		minted = append(minted, tx.Hash())
	}
	receipts, err = c.CommitUntilIncluded(ctx, minted...)
	if err != nil {
		return common.Address{}, fmt.Errorf("minting: %w", err)
	}
	for _, r := range receipts {
		if r.Status != types.ReceiptStatusSuccessful {
			return common.Address{}, fmt.Errorf("minting: transaction %s reverted", r.TxHash)
		}
	}
	return token, nil
}

func (c *Chain) close() {
	c.mu.Lock()
	stop := c.autoStop
	c.autoStop = nil
	c.mu.Unlock()
	if stop != nil {
		stop()
	}
	if err := c.Backend.Close(); err != nil {
		c.tb.Errorf("chaintest: closing the simulated chain: %v", err)
	}
}

// Commit seals the pending transactions into a new block and returns its hash.
// Safe for concurrent use.
func (c *Chain) Commit() common.Hash {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.Backend.Commit()
}

// sealed waits for a block being sealed to become the head. The node indexes a new block's transactions before
// it moves its head (core.BlockChain.writeHeadBlock), so a receipt can be served a moment before "latest" holds
// the block: code under test that returned on that receipt would otherwise have its effects read from the block
// before (seen under load: a settlement answered success, and the seller's balance read right after was the old
// one). Sealing holds mu until the head has moved, so taking mu once is enough. Every read of the head goes
// through here; mu must not be held.
func (c *Chain) sealed() {
	c.mu.Lock()
	c.mu.Unlock() //nolint:staticcheck // an empty critical section: waiting for the sealer is the point
}

// waiting says which transactions wait to be mined, as a key that changes when they do ("" for none). The pending
// block's transaction count lags by up to two seconds (the node caches its pending block); with WithPromptCommit
// the pool's own content is read, which it keeps current, less what the chain has mined already (the pool forgets
// a mined transaction a moment after its block).
func (c *Chain) waiting() string {
	ctx := context.Background()
	if !c.prompt {
		if n, err := c.Client.PendingTransactionCount(ctx); err == nil && n > 0 {
			return "pending block"
		}
		return ""
	}
	var content struct {
		Pending map[common.Address]map[string]json.RawMessage `json:"pending"`
	}
	if c.EthClient.Client().CallContext(ctx, &content, "txpool_content") != nil {
		return ""
	}
	var keys []string
	for from, txs := range content.Pending {
		mined, err := c.Client.NonceAt(ctx, from, nil)
		if err != nil {
			continue
		}
		for nonce := range txs {
			if n, err := strconv.ParseUint(nonce, 10, 64); err == nil && n >= mined {
				keys = append(keys, from.Hex()+"/"+nonce)
			}
		}
	}
	slices.Sort(keys)
	return strings.Join(keys, ",")
}

// AdjustTime seals a block d later than the head (pending transactions first go into a
// block of their own), moving chain time forward for validAfter/deadline tests.
func (c *Chain) AdjustTime(d time.Duration) {
	c.tb.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	// The beacon only moves time on an empty pool, and the pool forgets included
	// transactions in the background: seal what is pending and retry until it has.
	var err error
	for range 200 {
		if err = c.Backend.AdjustTime(d); err == nil {
			return
		}
		c.Backend.Commit()
		time.Sleep(5 * time.Millisecond)
	}
	c.tb.Fatalf("chaintest: adjusting time by %s: %v", d, err)
}

// HeadTime returns the timestamp of the head block, the "now" contracts see in eth_call.
func (c *Chain) HeadTime() uint64 {
	c.tb.Helper()
	return c.head().Time
}

// HeadNumber returns the number of the head block.
func (c *Chain) HeadNumber() uint64 {
	c.tb.Helper()
	return c.head().Number.Uint64()
}

func (c *Chain) head() *types.Header {
	c.tb.Helper()
	c.sealed()
	h, err := c.Client.HeaderByNumber(context.Background(), nil)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the head block: %v", err)
	}
	return h
}

// AutoCommit seals a block every interval in the background, so code that waits for
// receipts can run against the chain, until the returned stop function is called or the
// test ends. Calling it while already running replaces the previous interval.
func (c *Chain) AutoCommit(interval time.Duration) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	var once sync.Once
	stop = func() {
		once.Do(func() {
			close(done)
			<-finished
		})
	}
	go func() {
		defer close(finished)
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		// stuck is what waited before a block that mined none of it (a fee cap under the base fee, say): no block
		// is sealed for it again until what waits changes. (The pending block's count, without WithPromptCommit,
		// says nothing of which transactions wait: a block it asks for after the one that mined them is empty.)
		stuck := ""
		for {
			select {
			case <-done:
				return
			case <-ticker.C:
				// Empty blocks would push chain time a second ahead each: commit only what waits.
				w := c.waiting()
				if w == "" || w == stuck {
					continue
				}
				stuck = ""
				if mined, err := c.Client.TransactionCount(context.Background(), c.Commit()); err == nil && mined == 0 && c.prompt {
					stuck = w
				}
			}
		}
	}()
	c.mu.Lock()
	prev := c.autoStop
	c.autoStop = stop
	c.mu.Unlock()
	if prev != nil {
		prev()
	}
	return stop
}

// unwrapClient returns the ethclient.Client inside the simulated backend's client. go-ethereum wraps it in a
// struct of its own to hide it (the exported field of an unexported type), which only reflection reaches.
func unwrapClient(c simulated.Client) *ethclient.Client {
	if f := reflect.ValueOf(c).FieldByName("Client"); f.IsValid() {
		if ec, ok := f.Interface().(*ethclient.Client); ok {
			return ec
		}
	}
	panic(fmt.Sprintf("chaintest: the simulated backend's client %T no longer wraps an ethclient.Client", c))
}

func freeLoopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
