package devchain

import (
	"context"
	"crypto/ecdsa"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core"
	"github.com/ethereum/go-ethereum/core/rawdb"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/eth"
	"github.com/ethereum/go-ethereum/eth/catalyst"
	"github.com/ethereum/go-ethereum/eth/ethconfig"
	"github.com/ethereum/go-ethereum/eth/filters"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/node"
	"github.com/ethereum/go-ethereum/p2p"
	"github.com/ethereum/go-ethereum/params"
	"github.com/ethereum/go-ethereum/rpc"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Defaults and fixed figures of the dev chain.
const (
	// DefaultChainID is the dev chain's chain ID unless configured otherwise: the spec's testnet.
	DefaultChainID = 72344
	// DefaultListen is where the dev chain serves JSON-RPC over HTTP unless configured otherwise.
	DefaultListen = "127.0.0.1:8545"
	// DefaultWallets is the number of funded settlement wallets unless configured otherwise.
	DefaultWallets = 4
	// defaultPayers is the number of funded demo payers unless configured otherwise.
	defaultPayers = 1
	// gasLimit is the block gas limit: high, so that a block holds thousands of settlements under load.
	gasLimit = 1_000_000_000
	// mintPerPayer is the amount of each dev token (StableCoin, USDCoin), in raw units, minted to each demo payer:
	// 1,000,000 tokens.
	mintPerPayer = 1_000_000_000_000
)

// mintGas bounds the gas of a mint to a fresh holder (about 70,000); a fixed figure lets the mints go
// out with the deployment, before the token exists to estimate against.
const mintGas = 150_000

// receiptPoll is how often startup looks for the receipts of its own transactions.
const receiptPoll = 20 * time.Millisecond

// accountBalance returns the wei the deployer, each settlement wallet and each demo payer start with: 1,000 ETH.
func accountBalance() *big.Int {
	return new(big.Int).Mul(big.NewInt(1000), big.NewInt(params.Ether))
}

// Config configures Start. Zero values select the defaults.
type Config struct {
	// ChainID is the chain ID (default 72344).
	ChainID uint64
	// Listen is the host:port of the JSON-RPC HTTP endpoint (default 127.0.0.1:8545); port 0 picks a free
	// port, which RPCURL reports. The dev keys are public, so anything but loopback exposes funds to all.
	Listen string
	// BlockTime is 0 to seal a block as soon as transactions arrive (instant, but each block moves chain
	// time at least one second, so under load chain time runs ahead of the wall clock), or a whole number
	// of seconds to seal on that period (many transactions per block; chain time follows the wall clock).
	BlockTime time.Duration
	// DataDir keeps the chain on disk across restarts; empty starts a fresh chain each time, kept in a scratch
	// directory that Close removes. The chain writes each block through to the operating system before the
	// block becomes the head, so a killed process restarts from its last sealed block (a power loss may still
	// take the last blocks the operating system had not written to the disk).
	DataDir string
	// AllocFile names a JSON file of extra genesis accounts in geth's genesis "alloc" format
	// ({"0xaddress": {"balance": "0x..", "code": "0x..", "storage": {..}, "nonce": "0x.."}}).
	// Its entries replace the dev chain's own for the same address.
	AllocFile string
	// Wallets is the number of funded settlement wallets, WalletKeys(Wallets) (default 4).
	Wallets int
	// Payers is the number of funded demo payers, PayerKeyN(0..Payers-1) (default 1).
	Payers int
	// Logger receives the startup report, including the demo payer's key (default: no logging).
	Logger *zap.Logger

	// era is the genesis of a data dir made before contracts were added to it, which opens on that genesis
	// (see Start); the zero value is today's.
	era genesisEra
}

// genesisEra names the dev chain's genesis as it was before contracts were added to it. Only a genesis places
// code at a canonical address, so a data dir made earlier keeps its genesis, without them.
type genesisEra int

const (
	// eraNow is today's genesis.
	eraNow genesisEra = iota
	// eraFirstEscrow has the first batch-settlement escrow (firstBatchEscrowRuntime) in place of today's.
	eraFirstEscrow
	// eraBeforeMulticall lacks Multicall3 (and has the first escrow).
	eraBeforeMulticall
	// eraBeforeBatch lacks the batch-settlement contracts (the escrow and its two deposit collectors) as well.
	eraBeforeBatch
	// eraBeforeUpto lacks the upto proxy as well.
	eraBeforeUpto
)

// firstBatchEscrowRuntime is the runtime code of the first X402BatchSettlement (b86efdf to 2026706), kept for the
// genesis of the data dirs made then. It judged the voucher of a payer with code by ERC-1271 alone, so a payer that
// delegates its account (EIP-7702) after paying can make its own vouchers unclaimable there.
//
//go:embed first-batch-escrow.bin-runtime
var firstBatchEscrowRuntimeHex string

// Chain is a running in-process go-ethereum node for development: a single post-merge node driven by a
// simulated beacon, with Permit2 and the x402 proxy at their canonical addresses, the StableCoin at
// TokenAddress, funded settlement wallets and demo payers. Its keys are public (see the package doc).
type Chain struct {
	chainID uint64
	url     string
	wallets []*ecdsa.PrivateKey
	payers  []*ecdsa.PrivateKey
	stack   *node.Node
	client  *ethclient.Client
	eth     *eth.Ethereum
	// nudge asks the sealer for a block now, with block_time 0. Startup nudges when its own transactions wait
	// too long.
	nudge func()

	scratch string // the database directory of a chain without DataDir, removed at Close

	closeOnce sync.Once
	closeErr  error
}

// Start starts a dev chain, deploys the StableCoin and mints to the demo payers unless a chain in
// DataDir already has them, and logs how to use it. ctx bounds the startup only; the chain runs until Close.
func Start(ctx context.Context, cfg Config) (*Chain, error) {
	cfg, host, port, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	extra, err := readAlloc(cfg.AllocFile)
	if err != nil {
		return nil, err
	}
	d := &Chain{
		chainID: cfg.ChainID,
		wallets: WalletKeys(cfg.Wallets),
	}
	for i := range cfg.Payers {
		d.payers = append(d.payers, PayerKeyN(i))
	}

	nodeConf := node.DefaultConfig
	nodeConf.Name = "x402-devchain"
	nodeConf.DataDir = cfg.DataDir
	if cfg.DataDir == "" {
		// A chain "in memory" still lives in a database in a scratch directory, removed at Close: go-ethereum's
		// in-memory database lists keys by scanning all of them, and its freezer lists each finalized block's
		// keys, so a long-running in-memory chain gets slower with every block (after 100,000 blocks, sealing
		// one took tens of milliseconds).
		if d.scratch, err = os.MkdirTemp("", "caddy-x402-devchain-"); err != nil {
			return nil, fmt.Errorf("dev chain: creating its scratch directory: %w", err)
		}
		nodeConf.DataDir = d.scratch
	}
	// A chain on a data dir writes every sealed block through, so that a killed process loses none of them.
	writeThrough := cfg.DataDir != "" && writesThrough(nodeConf.ResolvePath("chaindata"))
	if writeThrough {
		nodeConf.DBEngine = rawdb.DBLeveldb
	} else if cfg.DataDir != "" {
		cfg.Logger.Warn("dev chain data dir was created by an earlier version, which keeps the state of recent "+
			"blocks in memory: a crash (SIGKILL, power loss) rewinds the chain to its last clean stop; start on an "+
			"empty data dir to keep every sealed block", zap.String("data_dir", cfg.DataDir))
	}
	nodeConf.IPCPath = ""
	nodeConf.HTTPHost = host
	nodeConf.HTTPPort = port
	nodeConf.HTTPModules = []string{"eth", "net", "web3"}
	nodeConf.HTTPVirtualHosts = []string{"localhost", host}
	nodeConf.WSHost = ""
	// No engine API is registered, so no authenticated endpoint opens; port 0 keeps a stray one off 8551.
	nodeConf.AuthAddr = "127.0.0.1"
	nodeConf.AuthPort = 0
	nodeConf.P2P = p2p.Config{MaxPeers: 0, NoDiscovery: true, NoDial: true, ListenAddr: ""}

	stack, err := node.New(&nodeConf)
	if err != nil {
		d.removeScratch()
		return nil, fmt.Errorf("dev chain: creating the node (data dir %q): %w", cfg.DataDir, err)
	}
	d.stack = stack

	ethConf := ethconfig.Defaults
	ethConf.Genesis = genesis(cfg, d.wallets, d.payers, extra)
	ethConf.NetworkId = cfg.ChainID
	ethConf.SyncMode = ethconfig.FullSync
	ethConf.TxPool.NoLocals = true
	ethConf.TxPool.Journal = ""
	// x402 sends no blob transactions; an on-disk blob pool only costs seconds of compaction at each restart.
	ethConf.BlobPool.Datadir = ""
	// eth_getLogs still answers by scanning blocks; the log index would cost CPU on every block under load
	// and reads a whole filter map at every restart.
	ethConf.LogNoHistory = true
	ethConf.Miner.GasCeil = gasLimit
	// The pool admits any tip of at least 1 wei; a miner demanding more would leave such a transaction
	// pending forever and the seal-on-arrival loop spinning on it.
	ethConf.Miner.GasPrice = big.NewInt(1)
	if writeThrough {
		// An archive node on the hash scheme writes each block's state to the database with the block, before
		// the block becomes the head; the default path scheme keeps the last 128 blocks' state in memory and
		// writes it at a clean stop only.
		ethConf.StateScheme = rawdb.HashScheme
		ethConf.NoPruning = true
		// LevelDB allocates a quarter of its cache as each of two write buffers; go-ethereum's 2 GiB default
		// took seconds to open after a crash, for a chain whose whole state is kilobytes.
		ethConf.DatabaseCache = 64
	}

	backend, err := eth.New(stack, &ethConf)
	if err != nil {
		stack.Close()
		d.removeScratch()
		var mismatch *core.GenesisMismatchError
		if errors.As(err, &mismatch) && cfg.era == eraNow {
			// A data dir made before the upto proxy, the batch-settlement contracts or Multicall3 were part of the
			// genesis holds the same chain but for them. They cannot be deployed at their canonical addresses afterwards
			// (only a genesis places code there), so such a chain opens as it is, and says what cannot settle on it.
			for _, era := range []genesisEra{eraFirstEscrow, eraBeforeMulticall, eraBeforeBatch, eraBeforeUpto} {
				before := cfg
				before.era = era
				if mismatch.Stored != genesis(before, d.wallets, d.payers, extra).ToBlock().Hash() {
					continue
				}
				switch era {
				case eraFirstEscrow:
					cfg.Logger.Warn("dev chain data dir was created with the first x402 batch-settlement escrow, which refuses "+
						"the claim of a payer's own voucher once the payer delegates its account (EIP-7702); start on an empty "+
						"data dir to have today's", zap.String("data_dir", cfg.DataDir), zap.String("batch_settlement", contracts.BatchSettlementAddress.Hex()))
				case eraBeforeMulticall:
					cfg.Logger.Warn("dev chain data dir was created before Multicall3 was part of the genesis: the public "+
						"SDK's batch-settlement facilitator cannot read channels on it, and its first batch-settlement escrow refuses the "+
						"claim of a payer's own voucher once the payer delegates its account (EIP-7702); start on an empty data dir to have both",
						zap.String("data_dir", cfg.DataDir), zap.String("multicall3", contracts.Multicall3Address.Hex()))
				case eraBeforeBatch:
					cfg.Logger.Warn("dev chain data dir was created before the x402 batch-settlement contracts were part of "+
						"the genesis: batch-settlement payments cannot settle on it; start on an empty data dir to have them",
						zap.String("data_dir", cfg.DataDir), zap.String("batch_settlement", contracts.BatchSettlementAddress.Hex()))
				default:
					cfg.Logger.Warn("dev chain data dir was created before the x402 upto proxy was part of the genesis: "+
						"upto and batch-settlement payments cannot settle on it; start on an empty data dir to have them",
						zap.String("data_dir", cfg.DataDir), zap.String("upto_proxy", contracts.UptoProxyAddress.Hex()),
						zap.String("batch_settlement", contracts.BatchSettlementAddress.Hex()))
				}
				return Start(ctx, before)
			}
		}
		if errors.As(err, &mismatch) {
			return nil, fmt.Errorf("dev chain: data dir %q holds a chain with another genesis (chain id, wallets, "+
				"payers or alloc file changed since it was created); use those settings again or an empty data dir: %w",
				cfg.DataDir, err)
		}
		return nil, fmt.Errorf("dev chain: setting up the Ethereum service: %w", err)
	}
	stack.RegisterAPIs([]rpc.API{{
		Namespace: "eth",
		Service:   filters.NewFilterAPI(filters.NewFilterSystem(backend.APIBackend, filters.Config{})),
	}})
	// The beacon is given a period of at least a second, and never started: with period 0 its API would start a
	// sealing loop of its own, and started it would run one per period, neither waited for when the node closes
	// (see sealer). The sealer seals, at the period asked for.
	beacon, err := catalyst.NewSimulatedBeacon(max(uint64(cfg.BlockTime/time.Second), 1), common.Address{}, backend)
	if err != nil {
		stack.Close()
		d.removeScratch()
		return nil, fmt.Errorf("dev chain: setting up the simulated beacon: %w", err)
	}
	catalyst.RegisterSimulatedBeaconAPIs(stack, beacon)
	seal := newSealer(beacon, backend.TxPool(), cfg.BlockTime)
	stack.RegisterLifecycle(seal)
	if err := stack.Start(); err != nil {
		seal.Stop()
		stack.Close()
		d.removeScratch()
		return nil, fmt.Errorf("dev chain: starting the node with JSON-RPC on %s: %w", cfg.Listen, err)
	}
	d.client, d.eth = ethclient.NewClient(stack.Attach()), backend
	d.url = stack.HTTPEndpoint()
	if cfg.BlockTime == 0 {
		d.nudge = seal.nudge
	}

	deployed, deployedUSDC, err := d.provisionTokens(ctx)
	if err == nil {
		err = waitTxIndex(ctx, backend.BlockChain())
	}
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("dev chain: %w", err)
	}
	d.logStart(cfg, deployed, deployedUSDC)
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		cfg.Logger.Warn("dev chain JSON-RPC listens beyond loopback; its keys are public, so anyone who reaches it "+
			"can spend its funds", zap.String("listen", cfg.Listen))
	}
	return d, nil
}

// writesThrough reports whether the dev chain database at dir is, or will be when created, one that writes
// every sealed block through to the operating system before the block becomes the head. That takes two
// settings on the database's creation, and go-ethereum refuses to change either later:
//   - LevelDB, which hands each write to the operating system before it returns, where go-ethereum's Pebble
//     holds writes in a buffer of the process for up to 32 KiB of log (a block or two), lost on SIGKILL;
//   - the hash state scheme as an archive node, which commits each block's state with the block, where the
//     path scheme keeps the last 128 blocks' state in memory and writes it at a clean stop only.
//
// A Pebble database was created by an earlier version of the dev chain, on the path scheme; it keeps both.
func writesThrough(dir string) bool {
	return rawdb.PreexistingDatabase(dir) != rawdb.DBPebble
}

// resolve fills in defaults and checks cfg, returning the HTTP host and port to listen on.
func (cfg Config) resolve() (Config, string, int, error) {
	if cfg.ChainID == 0 {
		cfg.ChainID = DefaultChainID
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.Wallets == 0 {
		cfg.Wallets = DefaultWallets
	}
	if cfg.Payers == 0 {
		cfg.Payers = defaultPayers
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	if cfg.Wallets < 0 || cfg.Payers < 0 {
		return cfg, "", 0, fmt.Errorf("dev chain: wallets and payers must not be negative, got %d and %d", cfg.Wallets, cfg.Payers)
	}
	if cfg.BlockTime < 0 || cfg.BlockTime%time.Second != 0 {
		return cfg, "", 0, fmt.Errorf("dev chain: block time must be 0 (a block per transaction burst) or whole seconds such as 1s, got %s", cfg.BlockTime)
	}
	host, portText, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return cfg, "", 0, fmt.Errorf("dev chain: listen address must be host:port such as %s, got %q: %w", DefaultListen, cfg.Listen, err)
	}
	if host == "" {
		return cfg, "", 0, fmt.Errorf("dev chain: listen address %q names no host; give one, such as %s", cfg.Listen, DefaultListen)
	}
	port, err := strconv.ParseUint(portText, 10, 16)
	if err != nil {
		return cfg, "", 0, fmt.Errorf("dev chain: listen port must be a number from 0 to 65535, got %q", portText)
	}
	return cfg, host, int(port), nil
}

// readAlloc reads the genesis accounts of path, or none when path is empty.
func readAlloc(path string) (types.GenesisAlloc, error) {
	if path == "" {
		return nil, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("dev chain: reading the alloc file: %w", err)
	}
	var alloc types.GenesisAlloc
	if err := json.Unmarshal(raw, &alloc); err != nil {
		return nil, fmt.Errorf("dev chain: alloc file %s must hold a genesis alloc object such as "+
			`{"0x…address": {"balance": "0x…", "code": "0x…"}}: %w`, path, err)
	}
	return alloc, nil
}

// genesis is the dev chain's genesis. It is a pure function of its arguments (timestamp 0, no randomness)
// so that a restart on a data dir finds the same genesis hash. The chain ID is not part of a block hash, and
// go-ethereum would quietly adopt a new one on restart; naming it in the extra data makes a changed chain ID
// a changed genesis, which the restart refuses.
func genesis(cfg Config, wallets, payers []*ecdsa.PrivateKey, extra types.GenesisAlloc) *core.Genesis {
	// The forks the dev chain starts on call into system contracts that must exist from genesis.
	alloc := core.SystemContractAllocs()
	for addr, acc := range contracts.GenesisAlloc() {
		alloc[addr] = acc
	}
	if cfg.era >= eraFirstEscrow {
		escrow := alloc[contracts.BatchSettlementAddress]
		escrow.Code = common.FromHex(strings.TrimSpace(firstBatchEscrowRuntimeHex))
		alloc[contracts.BatchSettlementAddress] = escrow
	}
	if cfg.era >= eraBeforeMulticall {
		delete(alloc, contracts.Multicall3Address)
	}
	if cfg.era >= eraBeforeBatch {
		for _, addr := range contracts.BatchSettlementAddresses() {
			delete(alloc, addr)
		}
	}
	if cfg.era >= eraBeforeUpto {
		delete(alloc, contracts.UptoProxyAddress)
	}
	// The USDCoin's deployer is left out: provisionTokens funds it (see there).
	funded := append([]*ecdsa.PrivateKey{deployerKey()}, wallets...)
	for _, key := range append(funded, payers...) {
		alloc[crypto.PubkeyToAddress(key.PublicKey)] = types.Account{Balance: accountBalance()}
	}
	for addr, acc := range extra {
		alloc[addr] = acc
	}
	return &core.Genesis{
		Config:     contracts.ChainConfig(cfg.ChainID),
		GasLimit:   gasLimit,
		BaseFee:    big.NewInt(params.InitialBaseFee),
		Difficulty: new(big.Int),
		ExtraData:  []byte("x402 dev chain " + strconv.FormatUint(cfg.ChainID, 10)),
		Alloc:      alloc,
	}
}

// tokenSpec is one token the dev chain deploys and mints to its demo payers.
type tokenSpec struct {
	name     string // for messages: "StableCoin"
	deployer *ecdsa.PrivateKey
	address  common.Address // crypto.CreateAddress(deployer, 0)
	creation []byte
}

// tokenSpecs are the dev chain's tokens: the StableCoin (EIP-2612) and the USDC-like USDCoin (EIP-2612 and
// EIP-3009), each from a deployer of its own so that each lives at a fixed address.
func tokenSpecs() (stable, usdc tokenSpec) {
	return tokenSpec{name: "StableCoin", deployer: deployerKey(), address: TokenAddress, creation: contracts.StableCoinCreationCode()},
		tokenSpec{name: "USDCoin", deployer: eip3009DeployerKey(), address: EIP3009TokenAddress, creation: contracts.USDCoinCreationCode()}
}

// setupFees are the fees of the dev chain's setup transactions: twice the head's base fee plus the tip, as
// wallets do, so that a rising base fee cannot leave them pending.
type setupFees struct{ tip, feeCap *big.Int }

// tokenSetup is what the chain still lacks of one dev token: the deployment (deployGas > 0) and the mints to
// the payers from number firstMint on. The deployer's nonce counts its transactions: deployment at 0, the
// mint to payer i at 1+i.
type tokenSetup struct {
	tok       tokenSpec
	nonce     uint64 // the deployer's nonce on chain
	deployGas uint64
	firstMint int
}

// nextNonce is the deployer's nonce once the setup's transactions are sent: past the last mint, or past what
// the deployer sent after the mints. It is computed, not asked of the transaction pool, which takes in what
// was just sent in a goroutine of its own and may not count it yet.
func (s tokenSetup) nextNonce(d *Chain) uint64 { return max(s.nonce, uint64(1+len(d.payers))) }

// cost is the most the setup's transactions pay in gas at fees.
func (s tokenSetup) cost(d *Chain, fees setupFees) *big.Int {
	gas := s.deployGas + uint64(len(d.payers)-s.firstMint)*mintGas
	return new(big.Int).Mul(new(big.Int).SetUint64(gas), fees.feeCap)
}

// provisionTokens deploys every dev token and mints to each payer, skipping what the chain already has; it
// reports whether it deployed the StableCoin and the USDCoin. The USDCoin's deployer is not in the genesis
// alloc, whose every change makes go-ethereum refuse the data dirs made before it: the StableCoin's deployer
// gives it its gas money, in the block of the StableCoin's own setup.
func (d *Chain) provisionTokens(ctx context.Context) (deployedStable, deployedUSDC bool, err error) {
	head, err := d.client.HeaderByNumber(ctx, nil)
	if err != nil {
		return false, false, fmt.Errorf("reading the head block: %w", err)
	}
	tip := big.NewInt(params.GWei)
	fees := setupFees{tip: tip, feeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)}

	stableTok, usdcTok := tokenSpecs()
	stable, err := d.planToken(ctx, stableTok)
	if err != nil {
		return false, false, err
	}
	usdc, err := d.planToken(ctx, usdcTok)
	if err != nil {
		return false, false, err
	}
	sent, err := d.sendSetup(ctx, stable, fees)
	if err != nil {
		return false, false, err
	}
	usdcDeployer := crypto.PubkeyToAddress(usdcTok.deployer.PublicKey)
	balance, err := d.client.BalanceAt(ctx, usdcDeployer, nil)
	if err != nil {
		return false, false, fmt.Errorf("reading the USDCoin deployer's balance: %w", err)
	}
	if need := usdc.cost(d, fees); balance.Cmp(need) < 0 {
		hash, err := d.sendSetupTx(ctx, stableTok.deployer, fees, stable.nextNonce(d), &usdcDeployer, params.TxGas, new(big.Int).Sub(need, balance), nil)
		if err != nil {
			return false, false, fmt.Errorf("funding the USDCoin deployer %s: %w", usdcDeployer, err)
		}
		sent = append(sent, hash)
	}
	if err := d.waitSetup(ctx, sent); err != nil {
		return false, false, err
	}
	// The USDCoin's deployer was funded in the blocks just waited for, but the transaction pool catches up with a
	// new block in a goroutine of its own: its deployment may be checked against the balance before the funding
	// ("insufficient funds ... balance 0", seen once in about fifteen starts with six payers). Refused so, nothing
	// was sent (the deployment is its first transaction), and it is sent again once the pool has caught up.
	// (geth's TxPool.Sync, which would wait for that, can wait for a block that never comes: it hung a start.)
	for attempt := 0; ; attempt++ {
		sent, err = d.sendSetup(ctx, usdc, fees)
		if err == nil || attempt >= 40 || len(sent) > 0 || !strings.Contains(err.Error(), "insufficient funds") {
			break
		}
		select {
		case <-ctx.Done():
			return false, false, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	if err == nil {
		err = d.waitSetup(ctx, sent)
	}
	return stable.deployGas > 0, usdc.deployGas > 0, err
}

// planToken reads what the chain lacks of tok, refusing a chain this dev chain did not set up.
func (d *Chain) planToken(ctx context.Context, tok tokenSpec) (tokenSetup, error) {
	deployerAddr := crypto.PubkeyToAddress(tok.deployer.PublicKey)
	nonce, err := d.client.NonceAt(ctx, deployerAddr, nil)
	if err != nil {
		return tokenSetup{}, fmt.Errorf("reading the %s deployer's nonce: %w", tok.name, err)
	}
	code, err := d.client.CodeAt(ctx, tok.address, nil)
	if err != nil {
		return tokenSetup{}, fmt.Errorf("reading the %s's code: %w", tok.name, err)
	}
	switch {
	case nonce == 0 && len(code) > 0:
		return tokenSetup{}, fmt.Errorf("the alloc places code at the dev token address %s; the dev chain deploys its "+
			"%s there, so leave that address out", tok.address, tok.name)
	case nonce > 0 && len(code) == 0:
		return tokenSetup{}, fmt.Errorf("the deployer %s has sent %d transactions but no token lives at %s: the chain "+
			"was not set up by this dev chain; start on an empty data dir", deployerAddr, nonce, tok.address)
	}
	s := tokenSetup{tok: tok, nonce: nonce, firstMint: min(len(d.payers), max(0, int(nonce)-1))}
	if nonce == 0 {
		// No fee fields: the estimate does not cap the gas by a balance the deployer may not have yet.
		if s.deployGas, err = d.client.EstimateGas(ctx, ethereum.CallMsg{From: deployerAddr, Data: tok.creation}); err != nil {
			return tokenSetup{}, fmt.Errorf("estimating the %s deployment: %w", tok.name, err)
		}
	}
	return s, nil
}

// sendSetup sends the transactions of s, the mints right behind the deployment, and returns their hashes.
func (d *Chain) sendSetup(ctx context.Context, s tokenSetup, fees setupFees) ([]common.Hash, error) {
	var sent []common.Hash
	if s.deployGas > 0 {
		hash, err := d.sendSetupTx(ctx, s.tok.deployer, fees, 0, nil, s.deployGas, nil, s.tok.creation)
		if err != nil {
			return nil, fmt.Errorf("deploying the %s: %w", s.tok.name, err)
		}
		sent = append(sent, hash)
	}
	token := s.tok.address
	for i := s.firstMint; i < len(d.payers); i++ {
		to := crypto.PubkeyToAddress(d.payers[i].PublicKey)
		data, err := contracts.StableCoinABI.Pack("mint", to, big.NewInt(mintPerPayer))
		if err != nil {
			return nil, fmt.Errorf("encoding the mint to %s: %w", to, err)
		}
		hash, err := d.sendSetupTx(ctx, s.tok.deployer, fees, uint64(1+i), &token, mintGas, nil, data)
		if err != nil {
			return nil, fmt.Errorf("minting %s to demo payer %s: %w", s.tok.name, to, err)
		}
		sent = append(sent, hash)
	}
	return sent, nil
}

// sendSetupTx signs and sends one setup transaction from key.
func (d *Chain) sendSetupTx(ctx context.Context, key *ecdsa.PrivateKey, fees setupFees, nonce uint64, to *common.Address, gas uint64, value *big.Int, data []byte) (common.Hash, error) {
	signer := types.LatestSignerForChainID(new(big.Int).SetUint64(d.chainID))
	tx, err := types.SignNewTx(key, signer, &types.DynamicFeeTx{
		ChainID: signer.ChainID(), Nonce: nonce, GasTipCap: fees.tip, GasFeeCap: fees.feeCap, Gas: gas, To: to, Value: value, Data: data,
	})
	if err != nil {
		return common.Hash{}, err
	}
	return tx.Hash(), d.client.SendTransaction(ctx, tx)
}

// waitSetup waits until every setup transaction is mined and fails on one that reverted.
func (d *Chain) waitSetup(ctx context.Context, sent []common.Hash) error {
	for _, hash := range sent {
		receipt, err := d.waitReceipt(ctx, hash)
		if err != nil {
			return fmt.Errorf("waiting for setup transaction %s: %w", hash, err)
		}
		if receipt.Status != types.ReceiptStatusSuccessful {
			return fmt.Errorf("setup transaction %s reverted", hash)
		}
	}
	return nil
}

// errTxIndexing is how a node answers a receipt query before its transaction indexer has caught up with
// the chain, as a fresh chain's has until its first block.
const errTxIndexing = "transaction indexing is in progress"

// waitReceipt polls for the receipt of hash until it is mined or ctx ends.
func (d *Chain) waitReceipt(ctx context.Context, hash common.Hash) (*types.Receipt, error) {
	ticker := time.NewTicker(receiptPoll)
	defer ticker.Stop()
	for polls := 1; ; polls++ {
		receipt, err := d.client.TransactionReceipt(ctx, hash)
		if err == nil {
			return receipt, nil
		}
		if !errors.Is(err, ethereum.NotFound) && !strings.Contains(err.Error(), errTxIndexing) {
			return nil, err
		}
		if d.nudge != nil && polls%25 == 0 {
			d.nudge() // half a second with no block: the sealer may have missed the transaction
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("not mined before startup gave up: %w", ctx.Err())
		case <-ticker.C:
		}
	}
}

// waitTxIndex waits until the transaction indexer has caught up, so that clients asking for receipts from the
// first moment get receipts or "not found", never "indexing is in progress".
func waitTxIndex(ctx context.Context, bc *core.BlockChain) error {
	ticker := time.NewTicker(receiptPoll)
	defer ticker.Stop()
	for !bc.TxIndexDone() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the transaction index to catch up: %w", ctx.Err())
		case <-ticker.C:
		}
	}
	return nil
}

// logStart reports where the chain is and which keys use it; the keys are public, and the log says so.
func (d *Chain) logStart(cfg Config, deployed, deployedUSDC bool) {
	storage := "memory"
	if cfg.DataDir != "" {
		storage = cfg.DataDir
	}
	wallets := make([]string, len(d.wallets))
	for i, key := range d.wallets {
		wallets[i] = crypto.PubkeyToAddress(key.PublicKey).Hex()
	}
	cfg.Logger.Info("dev chain started",
		zap.String("rpc", d.url),
		zap.Uint64("chain_id", d.chainID),
		zap.String("network", d.Network()),
		zap.Duration("block_time", cfg.BlockTime),
		zap.String("storage", storage),
		zap.String("token", TokenAddress.Hex()),
		zap.Bool("token_deployed_now", deployed),
		zap.String("eip3009_token", EIP3009TokenAddress.Hex()),
		zap.Bool("eip3009_token_deployed_now", deployedUSDC),
		zap.String("permit2", contracts.Permit2Address.Hex()),
		zap.String("proxy", contracts.ProxyAddress.Hex()),
		zap.Bool("upto_proxy_in_genesis", cfg.era < eraBeforeUpto),
		zap.String("upto_proxy", contracts.UptoProxyAddress.Hex()),
		zap.Bool("batch_settlement_in_genesis", cfg.era < eraBeforeBatch),
		zap.String("batch_settlement", contracts.BatchSettlementAddress.Hex()),
		zap.Bool("multicall3_in_genesis", cfg.era < eraBeforeMulticall),
		zap.String("multicall3", contracts.Multicall3Address.Hex()),
		zap.Strings("settlement_wallets", wallets),
	)
	for i, key := range d.payers {
		cfg.Logger.Info("dev chain demo payer: DEV CHAIN ONLY - these keys are public, never use them elsewhere",
			zap.Int("payer", i),
			zap.String("address", crypto.PubkeyToAddress(key.PublicKey).Hex()),
			zap.String("private_key", hexutil.Encode(crypto.FromECDSA(key))),
			zap.String("tokens_raw", strconv.FormatUint(mintPerPayer, 10)),
		)
	}
}

// RPCURL returns the JSON-RPC HTTP endpoint, with the port actually bound.
func (d *Chain) RPCURL() string { return d.url }

// ChainID returns the chain's ID.
func (d *Chain) ChainID() uint64 { return d.chainID }

// Network returns the chain's CAIP-2 identifier, such as eip155:72344.
func (d *Chain) Network() string { return x402.EIP155(d.chainID) }

// EIP3009Token returns the address of the chain's USDCoin (USDC-like, with EIP-3009), EIP3009TokenAddress.
func (d *Chain) EIP3009Token() common.Address { return EIP3009TokenAddress }

// Token returns the address of the chain's StableCoin, TokenAddress.
func (d *Chain) Token() common.Address { return TokenAddress }

// WalletKeys returns the funded settlement wallets' keys.
func (d *Chain) WalletKeys() []*ecdsa.PrivateKey {
	return append([]*ecdsa.PrivateKey(nil), d.wallets...)
}

// Payer returns the demo payer's key, which holds 1,000 ETH and 1,000,000 of each dev token and no Permit2
// allowance.
func (d *Chain) Payer() *ecdsa.PrivateKey { return d.payers[0] }

// Payers returns the keys of all demo payers; Payers()[0] is Payer().
func (d *Chain) Payers() []*ecdsa.PrivateKey { return append([]*ecdsa.PrivateKey(nil), d.payers...) }

// StorageAt reads one storage slot of a contract at the head block straight from the node's state, with no RPC
// in between: what an engine in this process asks at every verification (the payer's Permit2 nonce bitmap).
func (d *Chain) StorageAt(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error) {
	state, _, err := d.eth.APIBackend.StateAndHeaderByNumber(ctx, rpc.LatestBlockNumber)
	if err != nil {
		return nil, err
	}
	v := state.GetState(contract, slot)
	return v[:], nil
}

// Client returns an in-process client of the chain (no HTTP); it is closed by Close.
func (d *Chain) Client() *ethclient.Client { return d.client }

// Close stops the chain and frees its port; with a data dir the state is on disk for the next start.
// Calling it again returns the first result.
func (d *Chain) Close() error {
	d.closeOnce.Do(func() {
		if d.client != nil {
			d.client.Close()
		}
		if err := d.stack.Close(); err != nil {
			d.closeErr = fmt.Errorf("dev chain: stopping the node: %w", err)
		}
		d.removeScratch()
	})
	return d.closeErr
}

// removeScratch deletes the scratch directory of a chain kept "in memory".
func (d *Chain) removeScratch() {
	if d.scratch != "" {
		_ = os.RemoveAll(d.scratch)
	}
}
