package caddymodule

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(App{})
}

// App is the `x402` Caddy app: the long-lived parts every x402 handler of a config shares. It owns the networks
// (RPC endpoints, assets, settlement wallets), the embedded facilitator engine and the settlement journal. The
// engine and the journal live in usage pools, so a config reload that keeps them hands the same instances to the
// new handlers and no in-flight settlement, nonce or journal entry is lost.
type App struct {
	// Networks the embedded facilitator settles on.
	Networks []*Network `json:"networks,omitempty"`

	// Journal is the path of the settlement journal (a bbolt file), or a PostgreSQL DSN (postgres://...) for a
	// journal several Caddy instances share (see README, "Several instances, one database"). Placeholders such
	// as {env.X402_JOURNAL_DSN} are replaced. Default: x402/journal.db in Caddy's data directory; with an
	// in-memory dev chain, or a dev chain another process runs (dev_chain rpc), an in-memory journal (Caddy warns
	// at start in the second case: the chain outlives the journal).
	Journal string `json:"journal,omitempty"`

	// DevChain runs an embedded go-ethereum dev chain in this process, with the Stable Coin, the USDC-like USD Coin
	// (EIP-3009; the network's second asset, offered by eip3009 too), Permit2 and the
	// x402 proxy deployed and funded dev wallets and payer, and settles on it: a paid route with no chain, no
	// keys and no network. Its keys are public: for development only.
	DevChain *DevChainConfig `json:"dev_chain,omitempty"`

	ctx    caddy.Context
	logger *zap.Logger
	engine *engineEntry
	key    string

	journalMu *sync.Mutex
	journal   *journalEntry // this config's own reference, taken by SettlementJournal()
	devKey    string
	// devChain is the dev chain this process runs, once started: the engine reaches it in process.
	devChain *devchain.Chain
	// devNet is the dev chain's network among Networks; its RPC URL is known once the chain runs.
	devNet *Network

	// starters are the handlers' start hooks, registered while they are provisioned and run by Start, after
	// the engine and the journal are up, in the order the handlers were provisioned.
	starters []func() error
	// gatesAlike counts the gates provisioned so far by what their routes leave out of their ordinals (see
	// Gate.route).
	gatesAlike map[string]int
	// ready is closed when Start has finished, well or not; startErr then says which.
	ready    chan struct{}
	startErr error
	// wait is the engine's start in the background when no RPC endpoint answered as the app started (see
	// startWithoutChain); nil when the engine started with the app, or the app has none.
	wait *chainWait
	// engineStarters are the start hooks that need the engine: with the chain down at start they run once the
	// engine is up.
	engineStarters []func() error
}

// DevChainConfig configures the embedded dev chain.
type DevChainConfig struct {
	// ChainID of the dev chain. Default 72344, the spec's testnet.
	ChainID uint64 `json:"chain_id,omitempty"`
	// Listen is the loopback address of its JSON-RPC endpoint. Default 127.0.0.1:8545.
	Listen string `json:"listen,omitempty"`
	// BlockTime is 0 (a block as soon as transactions arrive: instant, but chain time runs ahead of wall time
	// under load) or a whole number of seconds (many transactions per block, chain time follows the clock).
	BlockTime caddy.Duration `json:"block_time,omitempty"`
	// DataDir keeps the chain on disk across restarts, writing each block through as it is sealed, so that
	// Caddy killed mid-run restarts the chain from its last block; empty starts a fresh chain each time (in a
	// scratch directory removed at exit).
	DataDir string `json:"data_dir,omitempty"`
	// Alloc is a JSON file of extra genesis accounts and contract code (geth's genesis alloc format).
	Alloc string `json:"alloc,omitempty"`
	// RPC is the JSON-RPC URL of a dev chain already running, such as one `caddy x402 devchain` runs: the app
	// settles on it with the dev chain's network, tokens and settlement wallets, and starts no chain of its own,
	// so several Caddy processes can share one. Listen, BlockTime, DataDir and Alloc configure a chain this app
	// starts and must then be empty. Unless Journal is set, the journal is in memory, as each process's own, and
	// Caddy warns as it starts that a restart forgets what the chain still remembers.
	RPC string `json:"rpc,omitempty"`
	// Wallets are the numbers of the dev chain's settlement wallets this app settles with (devchain.WalletKeys
	// order, from 0). Default: 0 to 3, every wallet the embedded chain funds. Processes sharing a dev chain must
	// not share a wallet: each engine sends from its wallets with nonces of its own counting.
	Wallets []int `json:"wallets,omitempty"`
	// Batch configures the batch-settlement claims of the embedded engine on the dev chain's network, as a
	// network's Batch does; default none. A config that names the dev chain's network itself gives it there.
	Batch *BatchSettlement `json:"batch,omitempty"`
	// ApprovalSponsoring takes the erc20ApprovalGasSponsoring extension on the dev chain's network, as a
	// network's ApprovalSponsoring does; default not taken.
	ApprovalSponsoring *ApprovalSponsoring `json:"approval_sponsoring,omitempty"`
}

// devChains holds running dev chains across config reloads, keyed by their configuration.
var devChains = caddy.NewUsagePool()

type devChainEntry struct{ chain *devchain.Chain }

func (d *devChainEntry) Destruct() error { return d.chain.Close() }

// planDevChain adds the dev chain's network, unless the config names that network itself. Everything about it
// but its RPC URL is fixed by the configuration (the dev keys and token addresses are), so the gates and the
// facilitator handler can be configured against it before the chain runs; startDevChain fills in the URL, or
// RPC gives it for a chain running elsewhere.
func (a *App) planDevChain() error {
	dc := a.DevChain
	if dc.BlockTime < 0 || time.Duration(dc.BlockTime)%time.Second != 0 {
		return fmt.Errorf("dev_chain: block_time must be 0 (a block per transaction burst) or whole seconds such as 1s, got %s",
			time.Duration(dc.BlockTime))
	}
	if dc.RPC != "" && (dc.Listen != "" || dc.BlockTime != 0 || dc.DataDir != "" || dc.Alloc != "") {
		return fmt.Errorf("dev_chain: rpc %s names a dev chain already running, which this app does not start; listen, "+
			"block_time, data_dir and alloc configure a chain it starts: leave them out, or give them to `caddy x402 devchain`",
			chain.RedactRPCURL(dc.RPC))
	}
	wallets, err := dc.walletNumbers()
	if err != nil {
		return err
	}
	id := dc.ChainID
	if id == 0 {
		id = devchain.DefaultChainID
	}
	network := x402.EIP155(id)
	for _, n := range a.Networks {
		if n.Network == network {
			if dc.Batch != nil {
				return fmt.Errorf("dev_chain: batch: the config names the dev chain's network %s itself, whose batch block it takes: give batch there", network)
			}
			if dc.ApprovalSponsoring != nil {
				return fmt.Errorf("dev_chain: approval_sponsoring: the config names the dev chain's network %s itself, whose options it takes: give approval_sponsoring there", network)
			}
			return nil
		}
	}
	all := devchain.WalletKeys(slices.Max(wallets) + 1)
	keys := make([]string, 0, len(wallets))
	for _, i := range wallets {
		keys = append(keys, hex.EncodeToString(crypto.FromECDSA(all[i])))
	}
	a.devNet = &Network{
		Network: network, WalletKeys: []string{strings.Join(keys, ",")},
		Assets: devChainAssets(),
		// Blocks come as soon as transactions do: look for receipts often.
		ReceiptPoll: caddy.Duration(2 * time.Millisecond),
		// A chain this app runs at block_time 0 seals a block per transaction burst: the engine judges deadlines
		// by a block for each of its settlements ahead (chain.NetworkConfig.SealsPerBurst). One it reaches by RPC
		// is judged by its head's lead over the clock.
		sealsPerBurst:      dc.RPC == "" && dc.BlockTime == 0,
		Batch:              dc.Batch,
		ApprovalSponsoring: dc.ApprovalSponsoring,
	}
	if dc.RPC != "" {
		a.devNet.RPC = []string{dc.RPC}
	}
	a.Networks = append(a.Networks, a.devNet)
	return nil
}

// walletNumbers returns the numbers of the dev chain's settlement wallets the app settles with, checked.
func (dc *DevChainConfig) walletNumbers() ([]int, error) {
	if len(dc.Wallets) == 0 {
		wallets := make([]int, devchain.DefaultWallets)
		for i := range wallets {
			wallets[i] = i
		}
		return wallets, nil
	}
	for i, w := range dc.Wallets {
		switch {
		case w < 0:
			return nil, fmt.Errorf("dev_chain: wallets: %d is no wallet number; they count from 0", w)
		case dc.RPC == "" && w >= devchain.DefaultWallets:
			return nil, fmt.Errorf("dev_chain: wallets: the dev chain this app starts funds wallets 0 to %d, not %d; for more, "+
				"run `caddy x402 devchain --wallets %d` and give its URL as rpc", devchain.DefaultWallets-1, w, w+1)
		case slices.Contains(dc.Wallets[:i], w):
			return nil, fmt.Errorf("dev_chain: wallets: wallet %d is listed twice", w)
		}
	}
	return dc.Wallets, nil
}

// devChainAssets are the dev chain's tokens as the app's assets: the Stable Coin first (the default of gates),
// then the USDC-like USD Coin with EIP-3009.
func devChainAssets() []*Asset {
	return []*Asset{
		{Address: devchain.TokenAddress.Hex(), Name: x402.DefaultTokenName, Version: x402.DefaultTokenVersion, Decimals: x402.DefaultTokenDecimals},
		{Address: devchain.EIP3009TokenAddress.Hex(), Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: contracts.USDCoinDecimals, EIP3009: true},
	}
}

// startDevChain starts the dev chain (or takes over the running one) and points the dev network at it.
func (a *App) startDevChain() error {
	repl := caddy.NewReplacer()
	cfg := devchain.Config{
		ChainID: a.DevChain.ChainID, Listen: repl.ReplaceAll(a.DevChain.Listen, ""), BlockTime: time.Duration(a.DevChain.BlockTime),
		DataDir: repl.ReplaceAll(a.DevChain.DataDir, ""), AllocFile: repl.ReplaceAll(a.DevChain.Alloc, ""), Logger: a.logger.Named("dev_chain"),
	}
	// Which wallets settle is no part of the chain: a reload that changes them keeps the chain running.
	chainOnly := *a.DevChain
	chainOnly.Wallets = nil
	b, _ := json.Marshal(chainOnly)
	key := string(b)
	v, _, err := devChains.LoadOrNew(key, func() (caddy.Destructor, error) {
		dc, err := devchain.Start(context.Background(), cfg)
		if err != nil {
			return nil, err
		}
		return &devChainEntry{chain: dc}, nil
	})
	if err != nil {
		return fmt.Errorf("starting the dev chain: %w", err)
	}
	a.devKey, a.devChain = key, v.(*devChainEntry).chain
	if a.devNet != nil {
		a.devNet.RPC = []string{a.devChain.RPCURL()}
	}
	return nil
}

// Network configures one EVM network of the embedded facilitator.
type Network struct {
	// Network is the CAIP-2 identifier, eip155:<chain id>.
	Network string `json:"network"`
	// RPC lists JSON-RPC URLs of the chain; more than one is a failover set, tried in order.
	RPC []string `json:"rpc,omitempty"`
	// RPCTimeout bounds each call to one RPC node; a node that has not answered by then is rested and the call
	// moves on to the next URL of RPC (with one URL, it is tried again while the payment's time allows).
	// Default 5s.
	RPCTimeout caddy.Duration `json:"rpc_timeout,omitempty"`
	// DeadlineSkew is how far a payment's deadline may lie beyond chain time plus the requirements'
	// maxTimeoutSeconds before it is refused (a client's clock ahead, a head block seconds old). Default 60s.
	DeadlineSkew caddy.Duration `json:"deadline_skew,omitempty"`
	// Assets are the accepted tokens; the first is the default of gates on this network. Default for the
	// spec's known networks: the token of the network registry (its address must still be given).
	Assets []*Asset `json:"assets,omitempty"`
	// WalletKeys are hex private keys of the settlement wallets, or placeholders such as {env.X402_KEYS}
	// holding a comma-separated list. They are never logged.
	WalletKeys []string `json:"wallet_keys,omitempty"`
	// WalletKeyFile is a file with one hex key per line, as an alternative to WalletKeys.
	WalletKeyFile string `json:"wallet_key_file,omitempty"`
	// ReceiptTimeout is how long a settlement waits for its receipt before answering settlement_pending.
	// Default 30s.
	ReceiptTimeout caddy.Duration `json:"receipt_timeout,omitempty"`
	// ReceiptPoll is how often the head block is polled while receipts are awaited. Default 50ms.
	ReceiptPoll caddy.Duration `json:"receipt_poll,omitempty"`
	// Methods restricts the asset transfer methods settled on this network: permit2, eip3009, erc2612. Default
	// all three (whether a token implements EIP-3009, the chain says when a payment in it is verified).
	Methods []string `json:"methods,omitempty"`
	// LegacyFees sends type-0 transactions priced by eth_gasPrice, for chains without EIP-1559.
	LegacyFees bool `json:"legacy_fees,omitempty"`
	// ReplaceAfter is how long a settlement transaction may wait in the node's pool before it is replaced by a
	// copy with higher fees. Default 60s.
	ReplaceAfter caddy.Duration `json:"replace_after,omitempty"`
	// FundsCache is how long a payer's token balance and Permit2 allowance, once read from the chain, answer
	// the verification of the payer's later permit2 payments (less the payments not yet settled). Default 2s;
	// negative ("off" in the Caddyfile): every verification asks the chain. Settlement always simulates first.
	FundsCache caddy.Duration `json:"funds_cache,omitempty"`
	// MaxInFlightPerWallet caps the settlements one wallet pipelines. Default 64.
	MaxInFlightPerWallet int `json:"max_in_flight_per_wallet,omitempty"`
	// WalletWait bounds the wait for a free wallet before "No available wallets in pool". Default 2s.
	WalletWait caddy.Duration `json:"wallet_wait,omitempty"`
	// MinAmount, when set, is the smallest payment the embedded engine verifies or settles on this network, in
	// raw token units; a smaller one is refused with invalid_payment_requirements before any chain call, for
	// gates and facilitator routes alike. Default: any amount.
	MinAmount string `json:"min_amount,omitempty"`
	// PayTo, when set, are the only recipients the embedded engine settles for on this network; a payment to
	// another is refused with invalid_payment_requirements before any chain call. Default: any recipient.
	PayTo []string `json:"pay_to,omitempty"`
	// SmartWalletFactories are the ERC-6492 factories through which the embedded engine deploys a payer's
	// undeployed smart wallet before settling its payment: a transaction of the facilitator's own with the
	// payer's calldata, so only factories the operator trusts. Default: none (such payments are refused with
	// eip6492_factory_not_allowed; deployed contract wallets pay by ERC-1271 either way).
	SmartWalletFactories []string `json:"smart_wallet_factories,omitempty"`
	// ApprovalSponsoring, when set, takes the erc20ApprovalGasSponsoring extension on this network: a permit2
	// payer without a Permit2 allowance attaches its own signed approve(Permit2) transaction, which the embedded
	// engine funds (the gas money the payer lacks, from a settlement wallet), broadcasts and waits for before the
	// settlement. Default: not taken (not declared in /supported nor in 402s).
	ApprovalSponsoring *ApprovalSponsoring `json:"approval_sponsoring,omitempty"`
	// Batch configures the batch-settlement claims of the embedded engine on this network: the receiver
	// authorizer's key and when accepted vouchers are claimed. Default: none (vouchers are accepted, never
	// claimed by this engine, and /supported names no receiver authorizer).
	Batch *BatchSettlement `json:"batch,omitempty"`

	// sealsPerBurst says the network is the dev chain this app runs at block_time 0 (see planDevChain).
	sealsPerBurst bool
}

// BatchSettlement is how the embedded engine claims the batch-settlement vouchers it accepted on a network.
type BatchSettlement struct {
	// ReceiverAuthorizerKey is the hex private key, or a placeholder such as {env.X402_RECEIVER_AUTHORIZER_KEY},
	// of the receiverAuthorizer that batch-settlement routes name: it signs the claims of their channels' vouchers,
	// which a settlement wallet sends. It is never logged.
	ReceiverAuthorizerKey string `json:"receiver_authorizer_key"`
	// ClaimEvery claims once this many vouchers were accepted since the last claim. Default 100.
	ClaimEvery int `json:"claim_every,omitempty"`
	// ClaimAmount claims once this much (raw token units) is accepted and unclaimed. Default: never by amount.
	ClaimAmount string `json:"claim_amount,omitempty"`
	// ClaimAfter claims once the oldest unclaimed voucher is this old. Default 1m.
	ClaimAfter caddy.Duration `json:"claim_after,omitempty"`
}

// Asset is one accepted ERC-20 token and its EIP-2612 permit domain.
type Asset struct {
	Address string `json:"address"`
	Name    string `json:"name,omitempty"`
	Version string `json:"version,omitempty"`
	// Decimals of the token. Default (and 0): 6.
	Decimals uint8 `json:"decimals,omitempty"`
	// EIP3009 marks a token with EIP-3009 transferWithAuthorization (USDC and the tokens modelled on it):
	// gates offer eip3009 payments in it beside permit2.
	EIP3009 bool `json:"eip3009,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "x402",
		New: func() caddy.Module { return new(App) },
	}
}

// engines holds embedded facilitator engines across config reloads, keyed by their configuration.
var engines = caddy.NewUsagePool()

// journals holds open settlement journals across config reloads, keyed by path: a bbolt file can be open once.
var journals = caddy.NewUsagePool()

// gateLedgers holds the gates' ledger of each open journal, which the app hands every gate it starts
// (gate.Config.Ledgers): a Caddy app is made anew by each config, so what the gates of the old and the new config
// must share across a reload (the payments in flight, the background settlements, the requests at work on a
// journal) lives here, beside the journals, as the engines do.
var gateLedgers = gate.NewLedgers()

// Provision checks the configuration and fills in its defaults. It starts nothing: no dev chain, no RPC
// client, no journal, no settlement (Start does), so that `caddy validate` is safe beside a running server.
func (a *App) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	a.journalMu = new(sync.Mutex)
	a.logger = ctx.Logger()
	a.ready = make(chan struct{})
	a.engineStarters = nil
	if a.DevChain != nil {
		if err := a.planDevChain(); err != nil {
			return err
		}
	}
	if len(a.Networks) == 0 {
		return nil
	}
	a.Journal = a.journalPath()
	if isPostgresDSN(a.Journal) {
		// Checked here, connected to only at Start: `caddy validate` must not talk to the database.
		if _, err := url.Parse(a.Journal); err != nil {
			return fmt.Errorf("journal: the PostgreSQL DSN is not a URL (postgres://user:password@host:port/database): %v", redactDSNError(err, a.Journal))
		}
	}
	_, err := a.networkSpecs()
	return err
}

// isPostgresDSN reports whether a journal setting names a PostgreSQL database rather than a file.
func isPostgresDSN(s string) bool {
	return strings.HasPrefix(s, "postgres://") || strings.HasPrefix(s, "postgresql://")
}

// journalName is how a journal is named in errors and logs: a DSN without its password.
func journalName(path string) string {
	if !isPostgresDSN(path) {
		return path
	}
	u, err := url.Parse(path)
	if err != nil {
		return "the PostgreSQL database (its DSN is not a URL)"
	}
	return u.Redacted()
}

// redactDSNError is err's text with the DSN's password taken out, should the parser have quoted it.
func redactDSNError(err error, dsn string) string {
	msg := err.Error()
	if i := strings.Index(dsn, "://"); i >= 0 {
		if at := strings.LastIndex(dsn, "@"); at > i {
			if colon := strings.Index(dsn[i+3:at], ":"); colon >= 0 {
				if pw := dsn[i+3+colon+1 : at]; pw != "" {
					msg = strings.ReplaceAll(msg, pw, "xxxxx")
				}
			}
		}
	}
	return msg
}

// networkSpecs resolves every network: placeholders replaced, defaults filled in, values checked.
func (a *App) networkSpecs() ([]networkSpec, error) {
	repl := caddy.NewReplacer()
	specs := make([]networkSpec, 0, len(a.Networks))
	for i, n := range a.Networks {
		if n == a.devNet && len(n.RPC) == 0 {
			// Its URL comes when the chain runs; nothing else about it needs checking.
			specs = append(specs, networkSpec{Network: n, Assets: n.Assets})
			continue
		}
		spec, err := n.resolve(repl)
		if err != nil {
			return nil, fmt.Errorf("network #%d (%s): %w", i+1, n.Network, err)
		}
		if n.ApprovalSponsoring != nil && n != a.devNet && n.Network != a.devChainNetwork() {
			return nil, fmt.Errorf("network #%d (%s): approval_sponsoring is taken on the dev chain only for now: the engine funds a payer's "+
				"approval with its gas limit times its fee cap, not what the approval uses, and bounds that per payment only, not per payer "+
				"or over time, so a payer could keep gas money on a network of value, payment after payment (README: erc20ApprovalGasSponsoring)",
				i+1, n.Network)
		}
		specs = append(specs, spec)
	}
	return specs, nil
}

// devChainNetwork is the CAIP-2 network of the dev chain this app runs, or of the dev chain's default id when it
// runs none (no network of value uses it).
func (a *App) devChainNetwork() string {
	if a.DevChain != nil && a.DevChain.ChainID != 0 {
		return x402.EIP155(a.DevChain.ChainID)
	}
	return x402.EIP155(devchain.DefaultChainID)
}

// networkIDs are the CAIP-2 identifiers of the networks the embedded engine settles on, in configuration order.
func (a *App) networkIDs() []string {
	ids := make([]string, 0, len(a.Networks))
	for _, n := range a.Networks {
		ids = append(ids, n.Network)
	}
	return ids
}

// onStart registers a handler's start hook, run by Start once the engine and the journal are up. Handlers are
// provisioned before their config's apps start, so every hook is registered by then. A hook that needs the
// engine (needsEngine) runs later when the chain was down at start: once the engine is up.
func (a *App) onStart(needsEngine bool, start func() error) {
	if needsEngine {
		a.engineStarters = append(a.engineStarters, start)
		return
	}
	a.starters = append(a.starters, start)
}

// awaitStart waits until Start has run, for a request that arrives before it: Caddy starts its apps in no
// fixed order, so the HTTP servers may accept requests before the x402 app has started.
func (a *App) awaitStart(ctx context.Context) error {
	select {
	case <-a.ready:
		return a.startErr
	default:
	}
	t := time.NewTimer(startWait)
	defer t.Stop()
	select {
	case <-a.ready:
		return a.startErr
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return errors.New("the x402 app is still starting")
	}
}

// startWait bounds how long a request waits for the x402 app to start.
const startWait = 30 * time.Second

// Start starts the dev chain, the embedded facilitator engine with its journal (or takes them over from the
// previous config), then the handlers that registered with the app.
func (a *App) Start() error {
	err := a.start()
	if err == nil {
		liveApps.Add(1)
	}
	a.startErr = err
	if err != nil {
		a.startErr = fmt.Errorf("the x402 app did not start: %w", err)
	}
	close(a.ready)
	return err
}

func (a *App) start() error {
	if a.DevChain != nil && a.DevChain.RPC == "" {
		if err := a.startDevChain(); err != nil {
			return err
		}
	}
	a.warnForgetfulJournal()
	if len(a.Networks) > 0 {
		specs, err := a.networkSpecs()
		if err != nil {
			return err
		}
		key, err := engineKey(a.Journal, specs)
		if err != nil {
			return err
		}
		val, _, err := engines.LoadOrNew(key, func() (caddy.Destructor, error) {
			return a.newEngine(context.Background(), specs)
		})
		if err != nil && a.chainDown(specs, err) {
			return a.startWithoutChain(key, specs, err)
		}
		if err != nil && a.devNet != nil && a.DevChain.RPC != "" {
			return fmt.Errorf("starting the embedded facilitator on the dev chain at %s (dev_chain rpc; is `caddy x402 devchain` "+
				"running there?): %w", chain.RedactRPCURL(a.DevChain.RPC), err)
		}
		if err != nil {
			return fmt.Errorf("starting the embedded facilitator: %w", err)
		}
		a.key, a.engine = key, val.(*engineEntry)
	}
	return a.runStarters(append(slices.Clone(a.engineStarters), a.starters...))
}

// runStarters runs start hooks in order, stopping at the first that fails.
func (*App) runStarters(starters []func() error) error {
	for _, start := range starters {
		if err := start(); err != nil {
			return err
		}
	}
	return nil
}

// ApprovalSponsoring bounds what the embedded engine pays for one payer's approval of Permit2
// (erc20ApprovalGasSponsoring): an approval whose gas limit or fee cap is above them is refused before anything
// is sent, so the gas money sent for one payment is at most MaxGas times MaxFeePerGas.
type ApprovalSponsoring struct {
	// MaxGas is the largest gas limit an approval may carry. Default 100000.
	MaxGas uint64 `json:"max_gas,omitempty"`
	// MaxFeePerGas is the highest fee cap an approval may carry, in wei (decimal). Default 10 gwei.
	MaxFeePerGas string `json:"max_fee_per_gas,omitempty"`
}

// config is the engine's ApprovalSponsoring; nil when a is.
func (a *ApprovalSponsoring) config() (*chain.ApprovalSponsoring, error) {
	if a == nil {
		return nil, nil
	}
	c := &chain.ApprovalSponsoring{MaxGas: a.MaxGas}
	if a.MaxFeePerGas != "" {
		v, err := x402.ParseUint256(a.MaxFeePerGas)
		if err != nil || v.Sign() == 0 {
			return nil, fmt.Errorf("approval_sponsoring: max_fee_per_gas %q is not a positive number of wei", a.MaxFeePerGas)
		}
		c.MaxFeePerGas = v
	}
	return c, nil
}

// networkSpec is a Network with its placeholders replaced and its keys parsed.
type networkSpec struct {
	Network *Network
	Keys    []string // hex, for the pool key only; never logged
	RPC     []string
	Assets  []*Asset
	terms   facilitatorserver.Terms // parsed from Network.MinAmount and PayTo, which are part of the pool key
	// factories are Network.SmartWalletFactories, parsed.
	factories []common.Address
	// BatchKey is Network.Batch's receiver authorizer key, hex, for the pool key only; never logged.
	BatchKey string
	// claimAmount is Network.Batch's ClaimAmount, parsed.
	claimAmount *big.Int
}

func (n *Network) resolve(repl *caddy.Replacer) (networkSpec, error) {
	spec := networkSpec{Network: n}
	if _, err := x402.ChainID(n.Network); err != nil {
		return spec, err
	}
	for _, u := range n.RPC {
		u = repl.ReplaceAll(u, "")
		if _, err := url.Parse(u); err != nil || u == "" {
			return spec, fmt.Errorf("rpc %q is not a URL", chain.RedactRPCURL(u))
		}
		spec.RPC = append(spec.RPC, u)
	}
	if len(spec.RPC) == 0 {
		return spec, errors.New("no rpc URL configured")
	}
	var list []string
	for i, k := range n.WalletKeys {
		v := repl.ReplaceAll(k, "")
		// The keys' form is checked here, without the chain, so that `caddy validate` finds a malformed key and
		// names where it came from; the error holds no part of it.
		if err := walletKeysProblem(walletKeysSource(k, i, len(n.WalletKeys)), v); err != nil {
			return spec, err
		}
		list = append(list, v)
	}
	if len(list) > 0 {
		spec.Keys = list
	} else if n.WalletKeyFile != "" {
		path := repl.ReplaceAll(n.WalletKeyFile, "")
		if _, err := chain.ReadPrivateKeyFile(path); err != nil {
			return spec, fmt.Errorf("wallet_key_file: %w", err)
		}
		spec.Keys = []string{"file:" + path}
	} else {
		return spec, errors.New("no settlement wallet: set wallet_keys or wallet_key_file")
	}
	terms, err := facilitatorserver.ParseTerms(n.MinAmount, n.PayTo)
	if err != nil {
		return spec, err
	}
	spec.terms = terms
	for _, f := range n.SmartWalletFactories {
		if err := addressProblem("smart_wallet_factories:", f); err != nil {
			return spec, err
		}
		spec.factories = append(spec.factories, common.HexToAddress(f))
	}
	if err := n.Batch.resolve(repl, &spec); err != nil {
		return spec, err
	}
	if _, err := n.ApprovalSponsoring.config(); err != nil {
		return spec, err
	}
	spec.Assets = n.Assets
	if len(spec.Assets) == 0 {
		return spec, errors.New("no asset configured: add `asset <address>`")
	}
	for _, as := range spec.Assets {
		if err := addressProblem("asset", as.Address); err != nil {
			return spec, err
		}
		if as.Name == "" {
			as.Name = x402.DefaultTokenName
		}
		if as.Version == "" {
			as.Version = x402.DefaultTokenVersion
		}
		if as.Decimals == 0 {
			as.Decimals = x402.DefaultTokenDecimals
		}
	}
	return spec, nil
}

// engineKey identifies an engine configuration without holding secrets in clear.
func engineKey(journalPath string, specs []networkSpec) (string, error) {
	b, err := json.Marshal(struct {
		J string
		S []networkSpec
	}{journalPath, specs})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}

// engineEntry is a pooled engine with the journal it holds.
type engineEntry struct {
	facilitator *chain.Facilitator
	journalPath string
	clients     []*chain.RPCClient
}

// Destruct stops the engine and lets go of its journal when the last config using it is gone.
func (e *engineEntry) Destruct() error {
	err := e.facilitator.Close()
	for _, c := range e.clients {
		c.Close()
	}
	_, jerr := journals.Delete(e.journalPath)
	return errors.Join(err, jerr)
}

// journalEntry is a pooled open journal and the owner token of this process's claims in it.
type journalEntry struct {
	store journal.Store
	owner string
	path  string
}

// Destruct closes the journal once the gates' requests at work on it have finished (at most journalDrainWait).
// Caddy's Stop does not wait for the requests of a server it shuts down unless the process exits, and a request
// writes its payment's served mark after its response is out: closed under it, the journal would lose the mark,
// and the payment would buy its response again after the next start.
func (j *journalEntry) Destruct() error {
	gateLedgers.WaitIdle(j.store, journalDrainWait)
	return j.store.Close()
}

// journalDrainWait bounds how long closing a journal waits for the requests at work on it.
const journalDrainWait = 30 * time.Second

func (a *App) newEngine(ctx context.Context, specs []networkSpec) (*engineEntry, error) {
	je, err := openJournal(a.Journal)
	if err != nil {
		return nil, err
	}
	entry := &engineEntry{journalPath: a.Journal}
	ok := false
	defer func() {
		if !ok {
			for _, c := range entry.clients {
				c.Close()
			}
			_, _ = journals.Delete(a.Journal)
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cfg := chain.Config{Journal: je.store, Owner: je.owner, Logger: a.logger.Named("facilitator")}
	for _, s := range specs {
		nc, err := a.networkConfig(ctx, s, entry)
		if err != nil {
			return nil, fmt.Errorf("network %s: %w", s.Network.Network, err)
		}
		cfg.Networks = append(cfg.Networks, nc)
	}
	f, err := chain.New(ctx, cfg)
	if err != nil {
		return nil, err
	}
	entry.facilitator, ok = f, true
	return entry, nil
}

// configuredNetworks is what the networks' configuration says without a chain: network, methods and assets
// (for chain.ConfiguredSupported while the chain does not answer).
func (a *App) configuredNetworks(specs []networkSpec) []chain.NetworkConfig {
	var ncs []chain.NetworkConfig
	for _, s := range specs {
		nc := chain.NetworkConfig{Network: s.Network.Network, Methods: s.Network.Methods}
		nc.Assets = assetConfigs(s.Assets)
		ncs = append(ncs, nc)
	}
	return ncs
}

// assetConfigs are the engine's view of a network's configured assets.
func assetConfigs(assets []*Asset) []chain.AssetConfig {
	var acs []chain.AssetConfig
	for _, as := range assets {
		acs = append(acs, chain.AssetConfig{Address: common.HexToAddress(as.Address), Name: as.Name, Version: as.Version, Decimals: as.Decimals})
	}
	return acs
}

func (a *App) networkConfig(ctx context.Context, s networkSpec, entry *engineEntry) (chain.NetworkConfig, error) {
	n := s.Network
	nc := chain.NetworkConfig{
		Network: n.Network, Methods: n.Methods, RPCTimeout: time.Duration(n.RPCTimeout), DeadlineSkew: time.Duration(n.DeadlineSkew), ReceiptTimeout: time.Duration(n.ReceiptTimeout),
		ReceiptPoll: time.Duration(n.ReceiptPoll), Fees: chain.FeePolicy{Legacy: n.LegacyFees},
		MaxInFlightPerWallet: n.MaxInFlightPerWallet, WalletWait: time.Duration(n.WalletWait),
		ReplaceAfter: time.Duration(n.ReplaceAfter), FundsCacheTTL: time.Duration(n.FundsCache),
		// Payments verified within a quarter second share one read of chain time: far inside the 6 s margin
		// deadlines must keep, and one round trip less per payment under load.
		HeadCacheTTL: 250 * time.Millisecond,
		MinAmount:    s.terms.MinAmount(), SmartWalletFactories: s.factories, SealsPerBurst: n.sealsPerBurst,
	}
	for _, a := range s.terms.PayTo() {
		nc.PayTo = append(nc.PayTo, common.HexToAddress(a))
	}
	approvals, err := n.ApprovalSponsoring.config()
	if err != nil {
		return nc, err
	}
	nc.ApprovalSponsoring = approvals
	var names []string
	var backends []chain.Backend
	for _, u := range s.RPC {
		if a.devChain != nil && u == a.devChain.RPCURL() {
			// The dev chain runs in this process: the engine calls it without HTTP, and is told of its blocks as
			// they are sealed. Its URL still serves everyone else.
			names, backends = append(names, chain.RedactRPCURL(u)), append(backends, chain.AttachedClient(a.devChain.Client(), a.devChain.StorageAt))
			continue
		}
		c, err := chain.DialRPC(ctx, u)
		if err != nil {
			return nc, fmt.Errorf("rpc %s: %w", chain.RedactRPCURL(u), err)
		}
		entry.clients = append(entry.clients, c)
		names, backends = append(names, chain.RedactRPCURL(u)), append(backends, c)
	}
	fo, err := chain.NewFailover(names, backends)
	if err != nil {
		return nc, err
	}
	nc.Backend = fo
	for _, k := range s.Keys {
		var keys []*ecdsa.PrivateKey
		if path, isFile := strings.CutPrefix(k, "file:"); isFile {
			keys, err = chain.ReadPrivateKeyFile(path)
		} else {
			keys, err = chain.ParsePrivateKeys(k)
		}
		if err != nil {
			return nc, err
		}
		nc.Keys = append(nc.Keys, keys...)
	}
	nc.Assets = assetConfigs(s.Assets)
	if b := n.Batch; b != nil {
		if nc.BatchReceiverAuthorizer, err = receiverAuthorizerKey(s.BatchKey); err != nil {
			return nc, fmt.Errorf("batch: receiver_authorizer_key: %w", err)
		}
		nc.BatchClaimEvery, nc.BatchClaimAmount, nc.BatchClaimAfter = b.ClaimEvery, s.claimAmount, time.Duration(b.ClaimAfter)
	}
	return nc, nil
}

// resolve checks the batch-settlement claims of a network (nil: none) and puts its key and amount in spec. Its
// errors name the option, never the key or any part of it.
func (b *BatchSettlement) resolve(repl *caddy.Replacer, spec *networkSpec) error {
	if b == nil {
		return nil
	}
	if b.ReceiverAuthorizerKey == "" {
		return errors.New("batch: receiver_authorizer_key is required: the key that signs the claims of the vouchers it accepts")
	}
	key := repl.ReplaceAll(b.ReceiverAuthorizerKey, "")
	if err := receiverAuthorizerKeyProblem(b.ReceiverAuthorizerKey, key); err != nil {
		return err
	}
	switch {
	case b.ClaimEvery < 0:
		return fmt.Errorf("batch: claim_every %d: want a positive number of vouchers", b.ClaimEvery)
	case b.ClaimAfter < 0:
		return fmt.Errorf("batch: claim_after %s: want a positive duration", time.Duration(b.ClaimAfter))
	}
	if b.ClaimAmount != "" {
		amount, err := claimAmountValue(b.ClaimAmount)
		if err != nil {
			return err
		}
		spec.claimAmount = amount
	}
	spec.BatchKey = key
	return nil
}

// Stop stops the app; what Start took up is let go of by Cleanup, once the next config (if any) has taken it over.
// An engine still waiting for its chain stops waiting here, before the handlers are cleaned up, so that none is
// started after its Cleanup.
func (a *App) Stop() error {
	if a.wait != nil {
		a.wait.stop()
	}
	return nil
}

// Cleanup lets go of this config's hold on the engine; the last holder stops it.
func (a *App) Cleanup() error {
	var errs []error
	if a.wait != nil {
		a.wait.stop()
	}
	if a.started() {
		liveApps.Add(-1)
	}
	if a.journal != nil {
		_, err := journals.Delete(a.journal.path)
		errs = append(errs, err)
	}
	if a.key != "" {
		_, err := engines.Delete(a.key)
		errs = append(errs, err)
	}
	if a.devKey != "" {
		_, err := devChains.Delete(a.devKey)
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// SettlementJournal is the settlement journal of this app, opened on first use (a gate with a remote facilitator needs it
// too, to serve each payment once). It stays open across config reloads that keep its path.
func (a *App) SettlementJournal() (journal.Store, string, error) {
	a.journalMu.Lock()
	defer a.journalMu.Unlock()
	if a.journal == nil {
		je, err := openJournal(a.journalPath())
		if err != nil {
			return nil, "", err
		}
		a.journal = je
	}
	return a.journal.store, a.journal.owner, nil
}

func (a *App) journalPath() string {
	if a.Journal == "" && a.DevChain != nil && a.DevChain.DataDir == "" {
		// A chain that forgets everything on exit must not meet a journal that remembers it. A dev chain running
		// elsewhere (rpc) is shared by several Caddy processes, which would all open the one default journal file.
		return memoryJournal
	}
	if a.Journal == "" {
		return filepath.Join(caddy.AppDataDir(), "x402", "journal.db")
	}
	return caddy.NewReplacer().ReplaceAll(a.Journal, "")
}

// warnForgetfulJournal warns, as the app starts, when its settlement journal is in memory but its chain outlives
// the process (a dev chain another process runs, `dev_chain { rpc }`): a restart then forgets what the chain still
// remembers. Only a dev chain this app runs in memory forgets with it.
func (a *App) warnForgetfulJournal() {
	if len(a.Networks) == 0 || a.journalPath() != memoryJournal || (a.DevChain != nil && a.DevChain.RPC == "" && a.DevChain.DataDir == "") {
		return
	}
	chainName := "its networks' chains"
	if a.DevChain != nil && a.DevChain.RPC != "" {
		chainName = "the dev chain at " + chain.RedactRPCURL(a.DevChain.RPC) + " (dev_chain rpc)"
	}
	a.logger.Warn("the settlement journal is in memory, but "+chainName+" outlives this process: when Caddy restarts, "+
		"a payment whose response was cut short is no longer served when presented again (its payer is told to pay again), "+
		"a settle async payment served and not yet settled is never settled, and an upto payment charged zero (nothing is sent "+
		"to the chain for it) buys its response again; set journal <path> in the x402 global option, a file of this process's own, "+
		"to keep them across restarts",
		zap.String("journal", memoryJournal))
}

// postgresOpenTimeout bounds connecting to a PostgreSQL journal and migrating its schema at start.
const postgresOpenTimeout = 30 * time.Second

// memoryJournal is the journal path that means "in memory, for this process only".
const memoryJournal = ":memory:"

// openJournal takes a reference on the pooled journal at path, opening it if no config holds it yet.
func openJournal(path string) (*journalEntry, error) {
	jv, _, err := journals.LoadOrNew(path, func() (caddy.Destructor, error) {
		var st journal.Store = journal.NewMemory(journal.Options{})
		var tok [8]byte
		_, _ = rand.Read(tok[:])
		owner := hex.EncodeToString(tok[:])
		switch {
		case isPostgresDSN(path):
			ctx, cancel := context.WithTimeout(context.Background(), postgresOpenTimeout)
			defer cancel()
			pg, err := journal.OpenPostgres(ctx, path, journal.Options{})
			if err != nil {
				return nil, err
			}
			// The instance token the database keeps alive: other instances tell by it whether this one is there.
			st, owner = pg, pg.Instance()
		case path != memoryJournal:
			var err error
			if st, err = journal.OpenBolt(path, journal.Options{}); err != nil {
				return nil, err
			}
		}
		return &journalEntry{store: st, owner: owner, path: path}, nil
	})
	if err != nil {
		return nil, fmt.Errorf("opening the settlement journal %s: %w", journalName(path), err)
	}
	return jv.(*journalEntry), nil
}

// Facilitator is the embedded facilitator engine, or nil when the app configures no network.
func (a *App) Facilitator() *chain.Facilitator {
	if a.engine == nil {
		return nil
	}
	return a.engine.facilitator
}

// Interface guards
var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)
