package chain

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/rpc"
)

// Backend is what the facilitator needs of an EVM node. go-ethereum's ethclient.Client and the simulated
// backend's client both satisfy it.
type Backend interface {
	ethereum.ChainIDReader
	HeaderByNumber(ctx context.Context, number *big.Int) (*types.Header, error)
	BlockByNumber(ctx context.Context, number *big.Int) (*types.Block, error)
	CallContract(ctx context.Context, msg ethereum.CallMsg, blockNumber *big.Int) ([]byte, error)
	EstimateGas(ctx context.Context, msg ethereum.CallMsg) (uint64, error)
	SuggestGasTipCap(ctx context.Context) (*big.Int, error)
	SuggestGasPrice(ctx context.Context) (*big.Int, error)
	PendingNonceAt(ctx context.Context, account common.Address) (uint64, error)
	NonceAt(ctx context.Context, account common.Address, blockNumber *big.Int) (uint64, error)
	BalanceAt(ctx context.Context, account common.Address, blockNumber *big.Int) (*big.Int, error)
	CodeAt(ctx context.Context, account common.Address, blockNumber *big.Int) ([]byte, error)
	SendTransaction(ctx context.Context, tx *types.Transaction) error
	TransactionReceipt(ctx context.Context, txHash common.Hash) (*types.Receipt, error)
	TransactionByHash(ctx context.Context, txHash common.Hash) (tx *types.Transaction, isPending bool, err error)
}

// DialRPC connects to a JSON-RPC endpoint (http, https, ws, wss). Over HTTP it keeps enough idle connections
// to the node for hundreds of settlements in flight: the standard client keeps two, and would open and close a
// connection for nearly every call under load.
func DialRPC(ctx context.Context, url string) (*RPCClient, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConns, transport.MaxIdleConnsPerHost = 512, 512
	// Answers are small and the node usually near: gzip costs both ends more CPU than it saves.
	transport.DisableCompression = true
	// Every engine call carries its own deadline (Failover.callTimeout); the client's timeout is only the last
	// guard against a caller that passed none, so that a node that never answers cannot hold a call forever.
	c, err := rpc.DialOptions(ctx, url, rpc.WithHTTPClient(&http.Client{Transport: transport, Timeout: time.Minute}))
	if err != nil {
		return nil, err
	}
	return &RPCClient{Client: ethclient.NewClient(c), transport: transport}, nil
}

// RPCClient is a client DialRPC made: an ethclient.Client whose Close also closes its pooled connections.
type RPCClient struct {
	*ethclient.Client
	transport *http.Transport
	attached  bool // a client of a node in this process (AttachedClient): the node's to close
	// storage reads a storage slot at the head straight from the state of a node in this process; nil: by RPC.
	storage func(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error)
}

// AttachedClient is an RPCClient over a client of a node that runs in this process (the embedded dev chain,
// through go-ethereum's in-process RPC): every call skips HTTP and its framing on loopback, and new heads are
// pushed rather than polled. storage, when given, reads a storage slot at the head straight from the node's
// state, with no RPC at all: the read every permit2 verification makes. Close leaves the client open: it
// belongs to the node and closes with it.
func AttachedClient(c *ethclient.Client, storage func(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error)) *RPCClient {
	return &RPCClient{Client: c, attached: true, storage: storage}
}

// localStorageReader is a backend that reads storage at the head from a node in this process, with no RPC.
type localStorageReader interface {
	LocalStorageAt(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error)
}

// errNoLocalStorage says a backend has no node in this process to read storage from.
var errNoLocalStorage = errors.New("no node in this process to read storage from")

// LocalStorageAt reads a storage slot at the head from the node in this process, if the client has one.
func (c *RPCClient) LocalStorageAt(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error) {
	if c.storage == nil {
		return nil, errNoLocalStorage
	}
	return c.storage(ctx, contract, slot)
}

// LocalStorageAt reads a storage slot at the head from the first endpoint that is a node in this process.
func (f *Failover) LocalStorageAt(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error) {
	for _, e := range f.endpoints {
		if ls, ok := e.backend.(localStorageReader); ok {
			if b, err := ls.LocalStorageAt(ctx, contract, slot); !errors.Is(err, errNoLocalStorage) {
				return b, err
			}
		}
	}
	return nil, errNoLocalStorage
}

// Close closes the client and its idle connections. go-ethereum's Close does nothing for an HTTP client, so
// without this every engine a config reload replaced would leave its connections open, and a node shutting
// down would wait out the ones the transport had dialled but not yet used.
func (c *RPCClient) Close() {
	if c.attached {
		return
	}
	c.Client.Close()
	c.transport.CloseIdleConnections()
}

// headSubscriber is a backend that pushes new heads.
type headSubscriber interface {
	SubscribeNewHead(ctx context.Context, ch chan<- *types.Header) (ethereum.Subscription, error)
}

// errNoHeadPush says no endpoint pushes new heads: callers poll.
var errNoHeadPush = errors.New("no node in this process to push new heads")

// SubscribeNewHead subscribes to the new heads of the first endpoint that is a node in this process
// (AttachedClient). A node over WebSocket could push them too, but the receipt watcher subscribes each time it
// starts waiting, and a round trip to a remote node before its first look would delay the settlements it
// waits for: remote nodes are polled.
func (f *Failover) SubscribeNewHead(ctx context.Context, ch chan<- *types.Header) (ethereum.Subscription, error) {
	for _, e := range f.endpoints {
		if c, ok := e.backend.(*RPCClient); ok && c.attached {
			if sub, err := c.SubscribeNewHead(ctx, ch); err == nil {
				return sub, nil
			}
		}
	}
	return nil, errNoHeadPush
}

// blockReceiptsReader is a backend that serves eth_getBlockReceipts: every receipt of a block in one call.
type blockReceiptsReader interface {
	BlockReceipts(ctx context.Context, blockNrOrHash rpc.BlockNumberOrHash) ([]*types.Receipt, error)
}

// errNoBlockReceipts says a backend cannot list a block's receipts; callers look receipts up one by one.
var errNoBlockReceipts = errors.New("the backend does not serve eth_getBlockReceipts")

// BlockReceipts lists the receipts of a block, from the first endpoint that can.
func (f *Failover) BlockReceipts(ctx context.Context, n rpc.BlockNumberOrHash) ([]*types.Receipt, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) ([]*types.Receipt, error) {
		if br, ok := b.(blockReceiptsReader); ok {
			return br.BlockReceipts(ctx, n)
		}
		return nil, errNoBlockReceipts
	})
}

// isAnswer reports whether err is an answer of the node (a JSON-RPC error such as a revert or "nonce too low",
// or "not found"), as opposed to a failure to reach it. Answers are never retried on another endpoint: another
// node would say the same.
func isAnswer(err error) bool {
	if err == nil || errors.Is(err, ethereum.NotFound) || errors.Is(err, errNoBlockReceipts) || errors.Is(err, errNoBatch) || errors.Is(err, errNoBlockOverrides) {
		return true
	}
	var rpcErr rpc.Error
	if errors.As(err, &rpcErr) {
		// An internal error or an exceeded limit is the node failing, not answering: another may do better.
		code := rpcErr.ErrorCode()
		return code != -32603 && code != -32005
	}
	var dataErr rpc.DataError
	if errors.As(err, &dataErr) {
		return true
	}
	// The in-process simulated backend returns plain errors for rejected transactions.
	msg := err.Error()
	for _, s := range answerTexts {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// answerTexts are node rejections that come back as plain errors from some transports.
var answerTexts = []string{
	"execution reverted", "nonce too low", "nonce too high", "already known", "replacement transaction underpriced",
	"insufficient funds", "intrinsic gas too low", "gas limit", "max fee per gas less than block base fee",
	"transaction underpriced", "invalid sender", "exceeds block gas limit",
}

// endpoint is one RPC node of a Failover and when it may be tried again after failing.
type endpoint struct {
	name    string
	backend Backend
	mu      sync.Mutex
	downTil time.Time
	fails   int
	// probing says one call is trying the endpoint again after its rest: the others leave it to that call, so
	// that a node that still hangs costs one caller its timeout, not every caller of that moment.
	probing bool
}

// defaultRPCTimeout bounds one call to one RPC node unless configured otherwise: far longer than any healthy
// node takes, short enough that a node that accepts and never answers does not stall a payment.
const defaultRPCTimeout = 5 * time.Second

// Failover is a Backend over several RPC endpoints of one chain: each call goes to the first endpoint that is not
// resting after a failure; an endpoint that fails to answer, or does not answer within callTimeout, is skipped
// for a growing pause and the call moves on. When no endpoint answered (unreachable, overloaded, an internal
// error), the call is tried again over all of them with growing pauses for up to retryFor: every call of the
// Backend is safe to repeat, reads by nature and sends because the same signed transaction has the same hash.
// A round in which every endpoint let the call time out is not repeated: those nodes had their chance.
// A node's answer (a revert, "nonce too low", "not found") is never retried: another try would say the same.
type Failover struct {
	endpoints []*endpoint
	now       func() time.Time
	// retryAfter is the first pause of a failed endpoint; it doubles per consecutive failure up to maxRetryAfter.
	retryAfter, maxRetryAfter time.Duration
	// callTimeout bounds one call to one endpoint (default defaultRPCTimeout; zero: only the caller's deadline).
	callTimeout time.Duration
	// retryFor is how long after its start a call that no endpoint answered may begin another round over the
	// endpoints (default 2s; zero: one round). The caller's deadline bounds the retries too: no round starts
	// that the deadline would cut short before its pause is over.
	retryFor time.Duration
	// retryBackoff is the pause before the second round; it doubles for each round after (default 25ms).
	retryBackoff time.Duration
}

// NewFailover returns a Failover over the given backends, tried in order. Names label endpoints in errors and
// must not carry secrets (an RPC URL with an API key in it should be redacted by the caller).
func NewFailover(names []string, backends []Backend) (*Failover, error) {
	if len(backends) == 0 || len(names) != len(backends) {
		return nil, fmt.Errorf("failover needs at least one RPC endpoint and one name per endpoint (got %d names, %d endpoints)", len(names), len(backends))
	}
	f := &Failover{now: time.Now, retryAfter: 500 * time.Millisecond, maxRetryAfter: 30 * time.Second,
		callTimeout: defaultRPCTimeout, retryFor: 2 * time.Second, retryBackoff: 25 * time.Millisecond}
	for i, b := range backends {
		f.endpoints = append(f.endpoints, &endpoint{name: names[i], backend: b})
	}
	return f, nil
}

// do runs call against the endpoints in order until one answers, each try bounded by callTimeout, and repeats
// the round with growing pauses while retryFor and ctx allow, unless every endpoint let the round time out. If
// every endpoint is resting, the one that rests the shortest is tried anyway: a call is never refused without
// trying.
func do[T any](ctx context.Context, f *Failover, call func(context.Context, Backend) (T, error)) (T, error) {
	var zero T
	start := time.Now()
	pause := max(f.retryBackoff, time.Millisecond)
	tried, rounds := 0, 0
	var errs []error
	for {
		rounds++
		v, answered, hung, err := round(ctx, f, call, &tried)
		if answered {
			return v, err
		}
		errs = nil // the last round's failures say what is wrong now
		if err != nil {
			errs = []error{err}
		}
		// A node that did not answer within callTimeout had its chance: another round would cost as much again.
		if hung || ctx.Err() != nil || time.Since(start)+pause > f.retryFor {
			break
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < pause {
			break
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
		}
		if ctx.Err() != nil {
			break
		}
		pause *= 2
	}
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	return zero, &unreachableError{Tried: tried, Rounds: rounds, Err: errors.Join(errs...)}
}

// round tries each endpoint once, resting ones last, and reports whether one answered. When none did, err
// joins the failures of the round, and hung says every endpoint tried let the call time out.
func round[T any](ctx context.Context, f *Failover, call func(context.Context, Backend) (T, error), tried *int) (_ T, answered, hung bool, _ error) {
	var zero T
	var errs []error
	hung = true
	now := f.now()
	order := make([]*endpoint, 0, len(f.endpoints))
	var resting, probes []*endpoint
	for _, e := range f.endpoints {
		e.mu.Lock()
		ready := !now.Before(e.downTil) && !(e.fails > 0 && e.probing)
		if ready && e.fails > 0 {
			e.probing = true // this call tries the endpoint again; others keep resting it meanwhile
			probes = append(probes, e)
		}
		e.mu.Unlock()
		if ready {
			order = append(order, e)
		} else {
			resting = append(resting, e)
		}
	}
	defer func() {
		for _, e := range probes {
			e.mu.Lock()
			e.probing = false
			e.mu.Unlock()
		}
	}()
	order = append(order, resting...)
	for _, e := range order {
		if ctx.Err() != nil {
			break
		}
		*tried++
		cctx, cancel := ctx, context.CancelFunc(func() {})
		if f.callTimeout > 0 {
			cctx, cancel = context.WithTimeout(ctx, f.callTimeout)
		}
		v, err := call(cctx, e.backend)
		timedOut := err != nil && cctx.Err() != nil && ctx.Err() == nil
		cancel()
		if isAnswer(err) {
			e.mu.Lock()
			e.fails, e.downTil = 0, time.Time{}
			e.mu.Unlock()
			return v, true, false, err
		}
		e.mu.Lock()
		e.fails++
		pause := f.retryAfter << min(e.fails-1, 16)
		if pause > f.maxRetryAfter || pause <= 0 {
			pause = f.maxRetryAfter
		}
		e.downTil = f.now().Add(pause)
		e.mu.Unlock()
		if timedOut {
			err = fmt.Errorf("no answer within %v: %w", f.callTimeout, err)
		}
		hung = hung && timedOut
		errs = append(errs, fmt.Errorf("rpc %s: %w", e.name, redactErr(err, e.name)))
	}
	return zero, false, hung && len(errs) > 0, errors.Join(errs...)
}

// RedactRPCURL keeps the scheme and host of an RPC URL, for logs and errors: node providers put API keys in its
// user info, path and query.
func RedactRPCURL(u string) string {
	p, err := url.Parse(u)
	if err != nil || p.Host == "" {
		return "<rpc url>"
	}
	return p.Scheme + "://" + p.Host
}

// RedactRPCError keeps an RPC URL out of a transport error of a call to it, naming the endpoint as RedactRPCURL
// does: Go's HTTP client quotes the whole URL (user:***@host/path?query), and providers put API keys in its path.
func RedactRPCError(err error, rpcURL string) error { return redactErr(err, RedactRPCURL(rpcURL)) }

// redactErr keeps the endpoint's URL out of a transport error: providers put API keys in its path and query,
// and Go's HTTP client quotes the whole URL. name is the endpoint's safe label.
func redactErr(err error, name string) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		ue.URL = name
	}
	return err
}

// unreachableError says no RPC endpoint of a network answered: Tried calls in Rounds rounds over the endpoints.
// Err holds the failures of the last round.
type unreachableError struct {
	Tried  int
	Rounds int
	Err    error
}

func (e *unreachableError) Error() string {
	if e.Rounds > 1 {
		return fmt.Sprintf("no RPC endpoint answered (%d tries in %d rounds): %v", e.Tried, e.Rounds, e.Err)
	}
	return fmt.Sprintf("no RPC endpoint answered (%d tried): %v", e.Tried, e.Err)
}

func (e *unreachableError) Unwrap() error { return e.Err }

// IsUnreachable reports whether err says no RPC endpoint of a network answered at all (as opposed to a node
// that answered, wrongly or with a refusal).
func IsUnreachable(err error) bool {
	var ue *unreachableError
	return errors.As(err, &ue)
}

// wrongChainError is the error of an engine whose RPC node answered for another chain than its network's: a
// configuration that no retry makes right.
type wrongChainError struct {
	served  *big.Int
	network string
}

func (e *wrongChainError) Error() string {
	return fmt.Sprintf("the RPC node serves chain %s, but the network is configured as %s", e.served, e.network)
}

// IsWrongChain reports whether err says an RPC node answered for another chain than the network configured.
func IsWrongChain(err error) bool {
	var wc *wrongChainError
	return errors.As(err, &wc)
}

// isTransportError reports whether err means the node was not reached (as opposed to a node's answer).
func isTransportError(err error) bool {
	var ue *unreachableError
	if errors.As(err, &ue) {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

func (f *Failover) ChainID(ctx context.Context) (*big.Int, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*big.Int, error) { return b.ChainID(ctx) })
}

func (f *Failover) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*types.Header, error) { return b.HeaderByNumber(ctx, n) })
}

func (f *Failover) BlockByNumber(ctx context.Context, n *big.Int) (*types.Block, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*types.Block, error) { return b.BlockByNumber(ctx, n) })
}

func (f *Failover) CallContract(ctx context.Context, msg ethereum.CallMsg, n *big.Int) ([]byte, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) ([]byte, error) { return b.CallContract(ctx, msg, n) })
}

func (f *Failover) EstimateGas(ctx context.Context, msg ethereum.CallMsg) (uint64, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (uint64, error) { return b.EstimateGas(ctx, msg) })
}

func (f *Failover) SuggestGasTipCap(ctx context.Context) (*big.Int, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*big.Int, error) { return b.SuggestGasTipCap(ctx) })
}

func (f *Failover) SuggestGasPrice(ctx context.Context) (*big.Int, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*big.Int, error) { return b.SuggestGasPrice(ctx) })
}

func (f *Failover) PendingNonceAt(ctx context.Context, a common.Address) (uint64, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (uint64, error) { return b.PendingNonceAt(ctx, a) })
}

func (f *Failover) NonceAt(ctx context.Context, a common.Address, n *big.Int) (uint64, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (uint64, error) { return b.NonceAt(ctx, a, n) })
}

func (f *Failover) BalanceAt(ctx context.Context, a common.Address, n *big.Int) (*big.Int, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*big.Int, error) { return b.BalanceAt(ctx, a, n) })
}

func (f *Failover) CodeAt(ctx context.Context, a common.Address, n *big.Int) ([]byte, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) ([]byte, error) { return b.CodeAt(ctx, a, n) })
}

// SendTransaction sends tx to the first endpoint that answers. A refusal is final only if no endpoint tried
// before it may hold tx: one that failed without answering may have taken it into its pool, so a refusal after
// such a failure is reported as the node being unreachable (the transaction may be on its way), never as
// "not sent".
func (f *Failover) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	reachedUnanswered := 0 // do tries endpoints one after another, never at once
	_, err := do(ctx, f, func(ctx context.Context, b Backend) (struct{}, error) {
		err := b.SendTransaction(ctx, tx)
		if !isAnswer(err) {
			reachedUnanswered++
		}
		return struct{}{}, err
	})
	if err != nil && reachedUnanswered > 0 && isAnswer(err) && !isAlreadyKnown(err) {
		return &unreachableError{Tried: reachedUnanswered + 1, Rounds: 1, Err: fmt.Errorf(
			"an endpoint failed without answering (it may hold the transaction) before another refused it: %w", err)}
	}
	return err
}

func (f *Failover) TransactionReceipt(ctx context.Context, h common.Hash) (*types.Receipt, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*types.Receipt, error) { return b.TransactionReceipt(ctx, h) })
}

func (f *Failover) TransactionByHash(ctx context.Context, h common.Hash) (*types.Transaction, bool, error) {
	type r struct {
		tx      *types.Transaction
		pending bool
	}
	v, err := do(ctx, f, func(ctx context.Context, b Backend) (r, error) {
		tx, p, err := b.TransactionByHash(ctx, h)
		return r{tx, p}, err
	})
	return v.tx, v.pending, err
}

// errNoBlockOverrides says a backend cannot run an eth_call in another block's context (block overrides): the
// call runs in the head block's.
var errNoBlockOverrides = errors.New("the backend does not take block overrides in eth_call")

// blockOverrideCaller is a backend that runs an eth_call with block overrides (number, time), the fourth
// parameter of eth_call that geth, reth and most node software take.
type blockOverrideCaller interface {
	CallContractInBlock(ctx context.Context, msg ethereum.CallMsg, block *ethereum.BlockOverrides) ([]byte, error)
}

// rawRPCClient is a backend that hands out its JSON-RPC client: go-ethereum's ethclient.Client.
type rawRPCClient interface {
	Client() *rpc.Client
}

// callContractInBlock runs msg as an eth_call at the latest state in the block context block describes, through
// b's JSON-RPC client; errNoBlockOverrides when b has none, or its node refuses the parameter.
func callContractInBlock(ctx context.Context, b Backend, msg ethereum.CallMsg, block *ethereum.BlockOverrides) ([]byte, error) {
	if c, ok := b.(blockOverrideCaller); ok {
		return c.CallContractInBlock(ctx, msg, block)
	}
	c, ok := b.(rawRPCClient)
	if !ok {
		return nil, errNoBlockOverrides
	}
	var out hexutil.Bytes
	err := c.Client().CallContext(ctx, &out, "eth_call", callArg(msg), "latest", nil, block)
	if err != nil && refusesBlockOverrides(err) {
		return nil, fmt.Errorf("%w: %v", errNoBlockOverrides, err)
	}
	return out, err
}

// refusesBlockOverrides reports whether a node's error says it does not take eth_call's fourth parameter.
func refusesBlockOverrides(err error) bool {
	var rpcErr rpc.Error
	if errors.As(err, &rpcErr) && rpcErr.ErrorCode() == -32602 {
		return true // invalid params
	}
	msg := strings.ToLower(err.Error())
	return strings.Contains(msg, "too many arguments") || strings.Contains(msg, "blockoverrides") || strings.Contains(msg, "block override")
}

// callArg is the eth_call transaction object of msg, as go-ethereum's ethclient writes it.
func callArg(msg ethereum.CallMsg) map[string]any {
	arg := map[string]any{"from": msg.From, "to": msg.To}
	if len(msg.Data) > 0 {
		arg["input"] = hexutil.Bytes(msg.Data)
	}
	if msg.Value != nil {
		arg["value"] = (*hexutil.Big)(msg.Value)
	}
	if msg.Gas != 0 {
		arg["gas"] = hexutil.Uint64(msg.Gas)
	}
	if msg.GasPrice != nil {
		arg["gasPrice"] = (*hexutil.Big)(msg.GasPrice)
	}
	if msg.GasFeeCap != nil {
		arg["maxFeePerGas"] = (*hexutil.Big)(msg.GasFeeCap)
	}
	if msg.GasTipCap != nil {
		arg["maxPriorityFeePerGas"] = (*hexutil.Big)(msg.GasTipCap)
	}
	return arg
}

// CallContractInBlock runs an eth_call with block overrides through the node.
func (c *RPCClient) CallContractInBlock(ctx context.Context, msg ethereum.CallMsg, block *ethereum.BlockOverrides) ([]byte, error) {
	return callContractInBlock(ctx, c.Client, msg, block)
}

// CallContractInBlock runs an eth_call with block overrides on the first endpoint that answers; an endpoint
// that cannot take them answers errNoBlockOverrides, which is not retried elsewhere (the caller then calls
// without them).
func (f *Failover) CallContractInBlock(ctx context.Context, msg ethereum.CallMsg, block *ethereum.BlockOverrides) ([]byte, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) ([]byte, error) { return callContractInBlock(ctx, b, msg, block) })
}

var _ Backend = (*Failover)(nil)
