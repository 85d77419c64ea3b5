package chain

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// AssetConfig is one ERC-20 token a network accepts, with its EIP-2612 permit domain.
type AssetConfig struct {
	Address  common.Address
	Name     string // permit domain name, e.g. "Stable Coin"
	Version  string // permit domain version, e.g. "1"
	Decimals uint8
}

// NetworkConfig is one EVM network the facilitator settles on.
type NetworkConfig struct {
	// Network is the CAIP-2 identifier, eip155:<chain id>.
	Network string
	// Backend reaches the chain: one node, or a Failover over several.
	Backend Backend
	// RPCTimeout, when set, bounds each call to one node of a Failover backend before the next endpoint is tried
	// (it is the network's copy of the Failover's call timeout, which defaults to 5s, defaultRPCTimeout).
	RPCTimeout time.Duration
	// DeadlineSkew is how far past chain time plus the requirements' maxTimeoutSeconds a payment's deadline may
	// lie (a client's clock ahead of the chain, a head block a few seconds old); a later deadline is refused.
	// Zero means 60s (defaultDeadlineSkew).
	DeadlineSkew time.Duration
	// Assets are the tokens accepted; the first is the default.
	Assets []AssetConfig
	// Keys are the settlement wallets' private keys.
	Keys []*ecdsa.PrivateKey
	// Methods are the asset transfer methods offered (x402.TransferPermit2, x402.TransferEIP3009,
	// x402.TransferERC2612); empty means all three. Whether a token implements EIP-3009 the chain says, when a
	// payment in it is verified.
	Methods []string
	// permit2, proxy (exact) and uptoProxy default to the canonical addresses.
	permit2, proxy, uptoProxy common.Address
	// ReceiptTimeout bounds how long Settle waits for a receipt before answering settlement_pending (default 30s).
	// It bounds the signing and broadcast of a settlement as well, which run on after the caller leaves.
	ReceiptTimeout time.Duration
	// ReceiptPoll is how often the head block is polled while receipts are awaited (default 50ms).
	ReceiptPoll time.Duration
	// Fees prices settlement transactions.
	Fees FeePolicy
	// MaxInFlightPerWallet caps the settlements one wallet pipelines (default 64); WalletWait bounds the wait
	// for a free wallet before "No available wallets in pool" (default 2s).
	MaxInFlightPerWallet int
	WalletWait           time.Duration
	// ReplaceAfter is how long a settlement transaction may wait in the node's pool before it is replaced by a
	// copy with higher fees (default 60s; negative: never).
	ReplaceAfter time.Duration
	// HeadCacheTTL lets verifications within this long share one read of the head block (chain time). Zero
	// reads the head for every payment; a few hundred milliseconds saves a round trip per payment under load
	// and is far inside the 6 s deadline margin.
	HeadCacheTTL time.Duration
	// FundsCacheTTL is how long a payer's token balance and Permit2 allowance, read from the chain, answer the
	// verification of the payer's later permit2 payments, less the payments held against them (default 2s,
	// about a block on most networks; negative: every verification asks the chain). Only a payment the read
	// covers is answered from it; settlement always simulates its exact call first.
	FundsCacheTTL time.Duration
	// lowBalance is the native balance (wei) under which a wallet is reported low by Health (default 0.01 ether).
	lowBalance *big.Int
	// MinAmount, when set, is the smallest payment settled, in raw token units; a smaller one is refused with
	// invalid_payment_requirements before any chain call. Nil: any amount of at least 1.
	MinAmount *big.Int
	// PayTo, when not empty, are the only recipients payments may be for; a payment to another is refused with
	// invalid_payment_requirements before any chain call. Empty: any recipient.
	PayTo []common.Address
	// RevertPenalty is how long a payer whose settlement transaction was mined and reverted is refused, at
	// verification and at settlement, before any chain call: such a revert, after a simulation run as the
	// transaction runs, is the payer's doing (see penalties). Zero means DefaultRevertPenalty (10 minutes);
	// negative: never refused.
	RevertPenalty time.Duration
	// SmartWalletFactories are the ERC-6492 factories through which this facilitator deploys a payer's
	// undeployed smart wallet before settling its payment (the deployment is a transaction of its own, sent
	// with arbitrary calldata, so only factories the operator trusts). Empty: payments of undeployed wallets
	// are refused with eip6492_factory_not_allowed; deployed contract wallets (ERC-1271) pay either way.
	SmartWalletFactories []common.Address
	// SealsPerBurst says the chain seals a block as soon as transactions arrive, each a second past the one
	// before (a dev chain with block_time 0): under load its clock runs ahead of the wall clock by a second a
	// block, and a settlement sent now may wait for a block for each transaction sent before it. Deadlines are
	// then judged by that later time (see network.mineTime). A chain whose head runs ahead of this machine's clock
	// is taken to seal so even when this is false; a chain with periodic blocks is not, and must not be set so.
	SealsPerBurst bool
	// BatchClaimMargin is how long before a batch-settlement channel's pending withdrawal could be finalized its
	// vouchers must be claimed (BatchTerms.ClaimMargin): a voucher counts only the deposit still there that long
	// from now, and a channel read older than its withdrawDelay less this margin is read again. Zero means 5
	// minutes (defaultBatchClaimMargin); it must stay under the shortest withdrawDelay (15 minutes).
	BatchClaimMargin time.Duration
	// BatchReceiverAuthorizer is the key of the receiverAuthorizer this engine's batch-settlement routes name: it
	// signs the claims of their channels' vouchers, which a settlement wallet sends. Nil: no claims are sent.
	BatchReceiverAuthorizer *ecdsa.PrivateKey
	// BatchClaimEvery, BatchClaimAmount and BatchClaimAfter are when accepted vouchers are claimed: once this
	// many were accepted here since the last claim (default 100), once this much is unclaimed (nil: never by
	// amount), or once the oldest unclaimed voucher is this old (default 1 minute); and at Close.
	BatchClaimEvery  int
	BatchClaimAmount *big.Int
	BatchClaimAfter  time.Duration
	// ApprovalSponsoring, when set, takes the erc20ApprovalGasSponsoring extension on this network: a permit2
	// payer's own signed approval of Permit2 is funded, broadcast and mined before its settlement (approval.go).
	// Nil: the extension is not declared, and a payment carrying it is settled as if it did not.
	ApprovalSponsoring *ApprovalSponsoring
}

// Config configures a Facilitator.
type Config struct {
	Networks []NetworkConfig
	// Journal remembers every settlement; nil means an in-memory journal (idempotent within this process only).
	Journal journal.Store
	// Logger receives structured logs; nil means none. Keys never reach it.
	Logger *zap.Logger
	// Owner is the claim token of this process in the journal; claims with another token at start-up were left by
	// a process that is gone. Empty means a fresh random token (one engine per journal).
	Owner string
	// Now is the wall clock (journal times, fee cache); chain time always comes from the head block.
	Now func() time.Time
	// ReconcileEvery is the period of the background pass that finalises, and re-broadcasts, journalled
	// settlements still waiting for a receipt (default 2s; negative disables it).
	ReconcileEvery time.Duration
	// Retention is how long final journal records are kept (default 24h). A payment presented again after
	// its record is gone is still refused, by its nonce on chain; the record only lets a retry get the same
	// answer and transaction hash.
	Retention time.Duration
	// ReconcileGrace is how long a broadcast settlement is left to its own caller before the background pass
	// looks at it (default 3s).
	ReconcileGrace time.Duration
	// WalletLeaseTTL is how long a settlement wallet's lease lasts unless renewed, with a journal several
	// processes share (a journal.Cluster; see lease.go): a dead process's wallets pass to the living this long
	// after its last renewal (default 15s).
	WalletLeaseTTL time.Duration
}

// Facilitator is the embedded x402 facilitator: it verifies and settles `exact` payments on the configured EVM
// networks, with erc2612 (x402 versions 1 and 2) and permit2 (version 2, with eip2612GasSponsoring), and `upto`
// payments by permit2 (version 2, with eip2612GasSponsoring).
type Facilitator struct {
	networks  map[string]*network
	order     []string
	journal   journal.Store
	log       *zap.Logger
	now       func() time.Time
	owner     string
	grace     time.Duration
	retention time.Duration
	// started is when this facilitator was made (the wall clock): on a journal one process holds at a time, a
	// mark written before it was written by an earlier process.
	started time.Time

	// signedMu guards signed: the record of each settlement this process broadcast and has not finalised, as it
	// last wrote it, so that finalise need not read it first (journal.UpdateKnown); at most maxSigned of them.
	signedMu sync.Mutex
	signed   map[journal.ID]journal.Record

	flightMu sync.Mutex
	flights  map[journal.ID]*flight
	sending  map[journal.ID]bool // payments between write-ahead record and broadcast
	// claiming counts, per payment, the settlements of this process claiming it or holding its claim: a claim of
	// this process that none holds is abandoned (see releaseAbandonedClaim).
	claiming map[journal.ID]int

	holesMu sync.Mutex
	holes   map[common.Address]holeSighting // per settlement wallet, the nonce hole reconciliation last saw

	// refused is what the engine refused lately, for /health.
	refused refusals

	// cluster is the journal when several processes share it; leases then keeps this process's wallet leases.
	// Both are nil with a journal of one process.
	cluster journal.Cluster
	leases  *leaser
	// walletsVersion is bumped whenever the wallets a network's offers may name change (see SupportedVersion).
	walletsVersion atomic.Uint64

	stop   chan struct{}
	wg     sync.WaitGroup
	closed sync.Once
	// batchClaims is the batch-settlement claim loop, running: the lease loop waits for its last pass at the
	// stop before it gives the wallets up.
	batchClaims sync.WaitGroup
}

// network is the per-network state of a Facilitator.
// defaultDeadlineSkew is the clock skew a payment's deadline is allowed beyond maxTimeoutSeconds by default.
const defaultDeadlineSkew = 60 * time.Second

type network struct {
	skew    time.Duration // see NetworkConfig.DeadlineSkew
	caip2   string
	chainID *big.Int
	backend Backend
	assets  map[common.Address]*asset
	first   *asset
	methods map[string]bool
	// factories are the ERC-6492 factories undeployed payer wallets may be deployed through.
	factories []common.Address
	permit2   common.Address
	proxy     common.Address // the spender of exact permit2 payments
	uptoProxy common.Address // the spender of upto payments
	batch     *batchNetwork  // batch-settlement: terms parsed, channel reads' block times (batch_engine.go)
	claimer   *batchClaimer  // batch-settlement claims (batch_claim.go); nil without a receiver authorizer key
	// batchEscrow says the batch-settlement escrow is deployed at its canonical address on this chain.
	batchEscrow bool
	pool        *walletPool
	sender      *sender
	watcher     *receiptWatcher
	timeout     time.Duration
	low         *big.Int
	p2dom       common.Hash

	replaceAfter time.Duration

	funds *funds
	// approval is the erc20ApprovalGasSponsoring terms; nil when the network does not take the extension.
	approval *approvalTerms
	reads    *callBatcher // reads of many callers batched (the nonce read of every verification)
	terms    paymentTerms // see NetworkConfig.MinAmount and PayTo

	headTTL time.Duration
	head    sharedRead[*types.Header]
	now     func() time.Time

	// penalties are the payers refused after a settlement of theirs reverted.
	penalties *penalties
	// noBlockOverrides says the node refused block overrides in eth_call once: simulations run at the head.
	noBlockOverrides atomic.Bool
	log              *zap.Logger

	// sealsPerBurst: see NetworkConfig.SealsPerBurst.
	sealsPerBurst bool
	// sending counts this engine's settlements past their last deadline check and not yet sent, and unmined its
	// settlements sent whose receipt was not seen yet: what is ahead of a settlement sent now (see mineTime).
	sending, unmined atomic.Int64
	// heads are the last two distinct heads this network's reads saw (see sawHead), to tell a chain whose blocks
	// come a second apart or faster from one with slower blocks (see sealsPerBurstNow).
	headsMu sync.Mutex
	heads   [2]headMark
}

// headMark is a head block seen: its number and time.
type headMark struct{ number, time uint64 }

// sawHead notes head as the newest head seen when it is newer than the last.
func (n *network) sawHead(head *types.Header) {
	if head == nil || head.Number == nil {
		return
	}
	n.headsMu.Lock()
	defer n.headsMu.Unlock()
	if num := head.Number.Uint64(); num > n.heads[1].number {
		n.heads = [2]headMark{n.heads[1], {num, head.Time}}
	}
}

// secondBlocks reports whether the last two heads seen lie at most a second a block apart: a chain that seals
// per transaction burst while it runs ahead of the clock stamps each block a second past the one before, a
// chain with periodic blocks of two seconds or more never does.
func (n *network) secondBlocks() bool {
	n.headsMu.Lock()
	defer n.headsMu.Unlock()
	prev, last := n.heads[0], n.heads[1]
	return prev.number != 0 && last.number > prev.number && last.time-prev.time <= last.number-prev.number
}

// blockInterval is the seconds between blocks, judged from the last two heads seen (rounded up), one when they do
// not say: a chain stamps each block at least a second past the one before.
func (n *network) blockInterval() uint64 {
	n.headsMu.Lock()
	defer n.headsMu.Unlock()
	prev, last := n.heads[0], n.heads[1]
	if prev.number == 0 || last.number <= prev.number || last.time <= prev.time {
		return 1
	}
	blocks := last.number - prev.number
	return max((last.time-prev.time+blocks-1)/blocks, 1)
}

// chainHead is the head block, shared for headTTL between callers. Callers that come while it is being read
// wait for that read (or give up on their own context) rather than queue behind a lock held across the call.
func (n *network) chainHead(ctx context.Context) (*types.Header, error) {
	if n.headTTL <= 0 {
		return n.readHead(ctx)
	}
	return n.head.get(ctx, n.now, n.headTTL, n.readHead)
}

// readHead reads the head block from the node, and notes it (sawHead).
func (n *network) readHead(ctx context.Context) (*types.Header, error) {
	head, err := n.backend.HeaderByNumber(ctx, nil)
	if err == nil {
		n.sawHead(head)
	}
	return head, err
}

// asset is a configured token with its cached permit domain separator.
type asset struct {
	AssetConfig
	domain common.Hash
}

// New builds a Facilitator, checks that each network's node serves the configured chain, and reconciles the
// journal with the chain before returning, so no new work starts before old work is accounted for.
func New(ctx context.Context, cfg Config) (*Facilitator, error) {
	f := &Facilitator{
		networks:  map[string]*network{},
		journal:   cfg.Journal,
		log:       cfg.Logger,
		now:       cfg.Now,
		flights:   map[journal.ID]*flight{},
		signed:    map[journal.ID]journal.Record{},
		sending:   map[journal.ID]bool{},
		claiming:  map[journal.ID]int{},
		holes:     map[common.Address]holeSighting{},
		stop:      make(chan struct{}),
		grace:     cfg.ReconcileGrace,
		retention: cfg.Retention,
	}
	if f.retention <= 0 {
		f.retention = 24 * time.Hour
	}
	if f.grace <= 0 {
		f.grace = 3 * time.Second
	}
	if f.log == nil {
		f.log = zap.NewNop()
	}
	if f.now == nil {
		f.now = time.Now
	}
	if f.journal == nil {
		f.journal = journal.NewMemory(journal.Options{Clock: f.now})
	}
	f.owner = cfg.Owner
	f.started = time.Now()
	if c, ok := f.journal.(journal.Cluster); ok {
		// Records carry the instance token the store keeps alive, so the other processes can tell a live
		// claimant from a dead one.
		f.cluster, f.owner = c, c.Instance()
		f.leases = &leaser{cluster: c, ttl: cfg.WalletLeaseTTL, now: time.Now}
		if f.leases.ttl <= 0 {
			f.leases.ttl = defaultWalletLeaseTTL
		}
	}
	if f.owner == "" {
		var tok [8]byte
		_, _ = rand.Read(tok[:])
		f.owner = hex.EncodeToString(tok[:])
	}
	if len(cfg.Networks) == 0 {
		return nil, errors.New("the facilitator needs at least one network")
	}
	for _, nc := range cfg.Networks {
		n, err := f.newNetwork(ctx, nc)
		if err != nil {
			return nil, fmt.Errorf("network %s: %w", nc.Network, err)
		}
		if _, dup := f.networks[n.caip2]; dup {
			return nil, fmt.Errorf("network %s is configured twice", n.caip2)
		}
		n.pool.versions = &f.walletsVersion
		f.networks[n.caip2] = n
		f.order = append(f.order, n.caip2)
	}
	if f.leases != nil {
		for _, id := range f.order {
			f.networks[id].pool.leasing = true
			if err := f.leasePass(ctx, f.networks[id]); err != nil {
				return nil, fmt.Errorf("network %s: taking settlement wallet leases: %w", id, err)
			}
		}
		f.wg.Add(2)
		go f.leaseLoop()
		go f.handoffLoop()
	} else {
		for _, id := range f.order {
			f.networks[id].pool.publish() // every wallet, for good
		}
	}
	if err := f.reconcile(ctx, true); err != nil {
		f.Close()
		return nil, fmt.Errorf("reconciling the settlement journal with the chain: %w", err)
	}
	every := cfg.ReconcileEvery
	if every == 0 {
		every = 2 * time.Second
	}
	if every > 0 {
		f.wg.Add(1)
		go f.reconcileLoop(every)
	}
	for _, id := range f.order {
		if f.networks[id].claimer != nil {
			f.wg.Add(1)
			f.batchClaims.Add(1)
			go f.claimLoop(time.Second)
			break
		}
	}
	return f, nil
}

func (f *Facilitator) newNetwork(ctx context.Context, nc NetworkConfig) (*network, error) {
	id, err := x402.ChainID(nc.Network)
	if err != nil {
		return nil, err
	}
	chainID := new(big.Int).SetUint64(id)
	if nc.Backend == nil {
		return nil, errors.New("no RPC backend")
	}
	backend := nc.Backend
	if fo, ok := backend.(*Failover); ok && nc.RPCTimeout != 0 {
		if nc.RPCTimeout < 0 {
			return nil, fmt.Errorf("RPC timeout %v is negative", nc.RPCTimeout)
		}
		own := *fo // the endpoints, and their rest after failures, stay shared with the caller's Failover
		own.callTimeout = nc.RPCTimeout
		backend = &own
	}
	got, err := backend.ChainID(ctx)
	if err != nil {
		return nil, fmt.Errorf("asking the node for its chain id: %w", err)
	}
	if got.Cmp(chainID) != 0 {
		return nil, &wrongChainError{served: got, network: nc.Network}
	}
	if len(nc.Assets) == 0 {
		return nil, errors.New("no asset configured")
	}
	pool, err := newWalletPool(nc.Keys)
	if err != nil {
		return nil, err
	}
	if nc.MaxInFlightPerWallet > 0 {
		pool.MaxInFlight = nc.MaxInFlightPerWallet
	}
	if nc.WalletWait > 0 {
		pool.Wait = nc.WalletWait
	}
	n := &network{
		caip2: nc.Network, chainID: chainID, backend: backend, assets: map[common.Address]*asset{},
		permit2: nc.permit2, proxy: nc.proxy, uptoProxy: nc.uptoProxy, pool: pool,
		sender: newSender(backend, chainID, nc.Fees, f.now), watcher: newReceiptWatcher(backend, nc.ReceiptPoll),
		reads:   &callBatcher{backend: backend},
		timeout: nc.ReceiptTimeout, low: nc.lowBalance, headTTL: nc.HeadCacheTTL, now: f.now, skew: nc.DeadlineSkew,
		penalties: newPenalties(nc.RevertPenalty, f.now), log: f.log, sealsPerBurst: nc.SealsPerBurst,
	}
	if n.permit2 == (common.Address{}) {
		n.permit2 = contracts.Permit2Address
	}
	n.approval = newApprovalTerms(nc.ApprovalSponsoring)
	n.sender.poll = nc.ReceiptPoll
	if n.proxy == (common.Address{}) {
		n.proxy = contracts.ProxyAddress
	}
	if n.uptoProxy == (common.Address{}) {
		n.uptoProxy = contracts.UptoProxyAddress
	}
	if n.timeout <= 0 {
		n.timeout = 30 * time.Second
	}
	switch n.replaceAfter = nc.ReplaceAfter; {
	case n.replaceAfter == 0:
		n.replaceAfter = time.Minute
	case n.replaceAfter < 0:
		n.replaceAfter = 0
	}
	fundsTTL := nc.FundsCacheTTL
	switch {
	case fundsTTL == 0:
		fundsTTL = 2 * time.Second
	case fundsTTL < 0:
		fundsTTL = 0
	}
	n.funds = newFunds(fundsTTL, f.now)
	if f.cluster != nil {
		n.funds.shared, n.funds.network = f.cluster, n.caip2
		// A hold mined after one of this engine's reads must outlive, in the journal, every hold from a newer
		// read (another instance's) for as long as the read answers.
		journal.ReadsAnswerFor(f.cluster, fundsTTL)
	}
	if n.terms, err = newPaymentTerms(nc); err != nil {
		return nil, err
	}
	n.factories = slices.Clone(nc.SmartWalletFactories)
	if n.batch, err = newBatchNetwork(nc.BatchClaimMargin); err != nil {
		return nil, err
	}
	n.claimer = newBatchClaimer(nc)
	// The batch-settlement kind is served where the escrow is deployed (read once: it never moves).
	code, err := backend.CodeAt(ctx, contracts.BatchSettlementAddress, nil)
	if err != nil {
		return nil, fmt.Errorf("reading the code of the batch-settlement escrow %s: %w", contracts.BatchSettlementAddress.Hex(), err)
	}
	n.batchEscrow = len(code) > 0
	if n.low == nil {
		n.low = new(big.Int).Exp(big.NewInt(10), big.NewInt(16), nil)
	}
	n.p2dom = permit2DomainSeparator(chainID, n.permit2)
	if n.methods, err = transferMethods(nc.Methods); err != nil {
		return nil, err
	}
	for _, ac := range nc.Assets {
		if ac.Name == "" || ac.Version == "" {
			return nil, fmt.Errorf("asset %s needs its permit domain name and version", ac.Address.Hex())
		}
		a := &asset{AssetConfig: ac, domain: PermitDomainSeparator(ac.Name, ac.Version, chainID, ac.Address)}
		n.assets[ac.Address] = a
		if n.first == nil {
			n.first = a
		}
	}
	return n, nil
}

// Close stops the background reconciliation. It does not close the journal, which belongs to the caller.
func (f *Facilitator) Close() error {
	f.closed.Do(func() { close(f.stop) })
	f.wg.Wait()
	return nil
}

// Networks lists the configured CAIP-2 networks in configuration order.
func (f *Facilitator) Networks() []string { return append([]string(nil), f.order...) }

// SharesJournal reports whether s is this engine's settlement journal: a gate writing to it may defer its writes
// into the engine's (journal.Defer), as they go to one database.
func (f *Facilitator) SharesJournal(s journal.Store) bool { return f.journal == s }

// Wallets lists the settlement wallet addresses of a network.
func (f *Facilitator) Wallets(networkID string) []common.Address {
	if n := f.networks[networkID]; n != nil {
		return n.pool.Addresses()
	}
	return nil
}

// WalletsInUse is how many settlements hold a wallet of the network right now.
func (f *Facilitator) WalletsInUse(networkID string) int {
	if n := f.networks[networkID]; n != nil {
		return n.pool.InUse()
	}
	return 0
}

// Supported lists the kinds this facilitator serves: permit2 (version 2, with eip2612GasSponsoring), eip3009
// (versions 1 and 2) and erc2612 (versions 1 and 2) per network for the exact scheme, upto by permit2 (version 2)
// where permit2 is served, and as signers the settlement wallets it sends from now. The eip3009 kind names no
// token domain: it is the token's own, which each requirement carries.
//
// The upto kind names in extra.facilitatorAddress the wallet payers are to bind into their witness: the public
// TypeScript server copies it into its requirements, so every upto payment made from that answer settles from
// that one wallet. The public facilitator names a random wallet at each call; the first signer, which does not
// change while the leases do not, makes the requirements a server derives stable (cacheable, comparable across
// its replicas) and costs nothing here, since a wallet pipelines many settlements. A gate rotating over the
// signers names the others too.
//
// With a journal several processes share, this process sends only from the wallets whose leases it holds (and
// is not giving up): only those are signers, an erc2612 permit is to name one of them, and the upto kind, which
// names one, is left out while it holds none. The answer changes as leases move; SupportedVersion says when.
func (f *Facilitator) Supported(context.Context) (x402.SupportedResponse, error) {
	resp := x402.SupportedResponse{Kinds: []x402.SupportedKind{}, Extensions: []string{}, Signers: map[string][]string{}}
	approvals := false
	for _, id := range f.order {
		n := f.networks[id]
		approvals = approvals || (n.approval != nil && n.methods[x402.TransferPermit2])
		signers := n.pool.offers()
		addNetwork(&resp, id, n.methods, n.first.AssetConfig, n.permit2, n.proxy, n.uptoProxy, signers)
		if n.batchEscrow {
			// Deposits come by ERC-3009 (the only way this engine takes them); vouchers need no chain call.
			k := x402.SupportedKind{X402Version: x402.Version2, Scheme: x402.SchemeBatchSettlement, Network: id,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferEIP3009}}
			if n.claimer != nil {
				k.Extra.ReceiverAuthorizer = n.claimer.authorizer.Hex()
			}
			resp.Kinds = append(resp.Kinds, k)
		}
	}
	return finishSupported(resp, approvals), nil
}

// ConfiguredSupported is what an engine of these networks supports as far as its configuration alone tells,
// without a chain: the kinds it settles, naming no settlement wallet (which wallets an instance sends from is
// known only once it holds their leases), so no upto kind and no signers. A gate offers from it while its chain
// does not answer yet; every payment still waits for the engine.
func ConfiguredSupported(cfgs []NetworkConfig) (x402.SupportedResponse, error) {
	resp := x402.SupportedResponse{Kinds: []x402.SupportedKind{}, Extensions: []string{}, Signers: map[string][]string{}}
	approvals := false
	for _, nc := range cfgs {
		methods, err := transferMethods(nc.Methods)
		if err != nil {
			return resp, err
		}
		approvals = approvals || (nc.ApprovalSponsoring != nil && methods[x402.TransferPermit2])
		if len(nc.Assets) == 0 {
			return resp, fmt.Errorf("network %s: no asset", nc.Network)
		}
		permit2, proxy, uptoProxy := nc.permit2, nc.proxy, nc.uptoProxy
		if permit2 == (common.Address{}) {
			permit2 = contracts.Permit2Address
		}
		if proxy == (common.Address{}) {
			proxy = contracts.ProxyAddress
		}
		if uptoProxy == (common.Address{}) {
			uptoProxy = contracts.UptoProxyAddress
		}
		addNetwork(&resp, nc.Network, methods, nc.Assets[0], permit2, proxy, uptoProxy, nil)
	}
	return finishSupported(resp, approvals), nil
}

// Health reports per network whether the node answers, how old its head block is, the wallets' native
// balances and settlements in flight, how many journalled settlements are not final and how many of them are
// claimed or broadcast; and the payments the engine refused lately.
func (f *Facilitator) Health(ctx context.Context) (x402.HealthResponse, error) {
	resp := x402.HealthResponse{Status: x402.HealthOK, Refusals: f.refused.health()}
	backlog, err := f.journal.Backlog(ctx)
	if err != nil {
		resp.Status = x402.HealthDegraded
	}
	pending, err := f.pendingSettlements(ctx)
	if err != nil {
		resp.Status = x402.HealthDegraded
	}
	for _, id := range f.order {
		n := f.networks[id]
		h := x402.NetworkHealth{Network: id, Status: x402.HealthOK, JournalBacklog: backlog, PendingSettlements: pending.count[id]}
		if at, ok := pending.oldest[id]; ok {
			h.OldestPendingSeconds = max(0, f.now().Sub(at).Seconds())
		}
		head, err := n.backend.HeaderByNumber(ctx, nil)
		if err != nil {
			h.Status, h.Error = x402.HealthDown, "RPC unreachable: "+err.Error()
			resp.Status = x402.HealthDegraded
			resp.Networks = append(resp.Networks, h)
			continue
		}
		h.RPCReachable, h.HeadBlock = true, head.Number.Uint64()
		h.HeadAgeSeconds = f.now().Sub(time.Unix(int64(head.Time), 0)).Seconds()
		for _, w := range n.pool.Wallets() {
			bal, err := n.backend.BalanceAt(ctx, w.Address, nil)
			if err != nil {
				h.Status = x402.HealthDegraded
				continue
			}
			low := bal.Cmp(n.low) < 0
			if low {
				h.Status = x402.HealthDegraded
			}
			h.Wallets = append(h.Wallets, x402.WalletHealth{Address: w.Address.Hex(), Balance: bal.String(), Low: low,
				InFlight: pending.sent[w.Address]})
		}
		if h.Status != x402.HealthOK {
			resp.Status = x402.HealthDegraded
		}
		resp.Networks = append(resp.Networks, h)
	}
	return resp, nil
}

// pendingSettlementsSeen is what the journal's settlements that are claimed or broadcast and not final say, by
// network and by the wallet that sent them. Payments a gate served before settling are not among them.
type pendingSettlementsSeen struct {
	count  map[string]int         // by network
	oldest map[string]time.Time   // by network: the oldest claim
	sent   map[common.Address]int // by the wallet that signed the latest transaction
}

// pendingSettlements reads the journal's settlements that are not final: those of every process sharing it, as
// a wallet's transactions on chain are.
func (f *Facilitator) pendingSettlements(ctx context.Context) (pendingSettlementsSeen, error) {
	seen := pendingSettlementsSeen{count: map[string]int{}, oldest: map[string]time.Time{}, sent: map[common.Address]int{}}
	recs, err := f.journal.PendingOf(ctx, false)
	if err != nil {
		return seen, fmt.Errorf("listing the journal's pending settlements: %w", err)
	}
	for _, r := range recs {
		seen.count[r.Network]++
		if at, ok := seen.oldest[r.Network]; !ok || r.ClaimedAt.Before(at) {
			seen.oldest[r.Network] = r.ClaimedAt
		}
		if r.Wallet != "" && common.IsHexAddress(r.Wallet) {
			seen.sent[common.HexToAddress(r.Wallet)]++
		}
	}
	return seen, nil
}

var _ x402.Facilitator = (*Facilitator)(nil)

// transferMethods is the set of asset transfer methods a network offers: all three when none is named.
func transferMethods(names []string) (map[string]bool, error) {
	if len(names) == 0 {
		names = []string{x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612}
	}
	methods := map[string]bool{}
	for _, m := range names {
		if !x402.IsTransferMethod(m) {
			return nil, fmt.Errorf("unknown asset transfer method %q; want %q, %q or %q", m, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
		}
		methods[m] = true
	}
	return methods, nil
}

// addNetwork adds to resp the kinds a network settles: exact by each of its methods (the permit domain of its
// first asset), and upto by permit2 when a settlement wallet is there to name; and its signers.
func addNetwork(resp *x402.SupportedResponse, id string, methods map[string]bool, first AssetConfig, permit2, proxy, uptoProxy common.Address, signers []common.Address) {
	if methods[x402.TransferPermit2] {
		resp.Kinds = append(resp.Kinds, x402.SupportedKind{X402Version: x402.Version2, Scheme: x402.SchemeExact, Network: id,
			Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: first.Name, Version: first.Version,
				Permit2Address: permit2.Hex(), X402Permit2ProxyAddress: proxy.Hex()}})
		if len(signers) > 0 {
			resp.Kinds = append(resp.Kinds, x402.SupportedKind{X402Version: x402.Version2, Scheme: x402.SchemeUpto, Network: id,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: first.Name, Version: first.Version,
					Permit2Address: permit2.Hex(), X402Permit2ProxyAddress: uptoProxy.Hex(),
					FacilitatorAddress: signers[0].Hex()}})
		}
	}
	if methods[x402.TransferEIP3009] {
		for _, v := range []int{x402.Version1, x402.Version2} {
			resp.Kinds = append(resp.Kinds, x402.SupportedKind{X402Version: v, Scheme: x402.SchemeExact, Network: id,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferEIP3009}})
		}
	}
	if methods[x402.TransferERC2612] {
		for _, v := range []int{x402.Version1, x402.Version2} {
			resp.Kinds = append(resp.Kinds, x402.SupportedKind{X402Version: v, Scheme: x402.SchemeExact, Network: id,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferERC2612, Name: first.Name, Version: first.Version}})
		}
	}
	for _, a := range signers {
		resp.Signers[id] = append(resp.Signers[id], a.Hex())
	}
}

// finishSupported declares the gas-sponsoring extension when some network settles by permit2, and the
// approval-sponsoring one when some such network takes it (approvals).
func finishSupported(resp x402.SupportedResponse, approvals bool) x402.SupportedResponse {
	if slices.ContainsFunc(resp.Kinds, func(k x402.SupportedKind) bool { return k.Extra.AssetTransferMethod == x402.TransferPermit2 }) {
		resp.Extensions = append(resp.Extensions, x402.ExtensionEIP2612GasSponsoring)
		if approvals {
			resp.Extensions = append(resp.Extensions, x402.ExtensionERC20ApprovalGasSponsoring)
		}
	}
	return resp
}
