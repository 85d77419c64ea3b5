package chain

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/rpc"
)

// contractCall is one transaction a settlement sends: a call of To with Data, limited to Gas.
type contractCall struct {
	To   common.Address
	Data []byte
	Gas  uint64
	// Value is the wei the transaction sends (the gas money a sponsored approval's payer is funded with); nil:
	// none.
	Value *big.Int
	// Signed is a transaction someone else signed (a payer's approval of Permit2, see approval.go), sent as it is
	// between this wallet's: it takes none of the wallet's nonces, and the next transaction goes out only once
	// it has mined and succeeded. To, Data, Gas and Value are then unused.
	Signed *types.Transaction
}

// FeePolicy says how settlement transactions are priced.
type FeePolicy struct {
	// Legacy sends type-0 transactions priced by eth_gasPrice, for networks without EIP-1559.
	Legacy bool
	// CacheFor is how long a fee quote is reused; settlements in one block pay alike.
	CacheFor time.Duration
}

// feeQuote is a cached price for new transactions.
type feeQuote struct {
	tipCap, feeCap *big.Int // EIP-1559
	gasPrice       *big.Int // legacy
}

// sender signs and broadcasts settlement transactions for one network: nonces per wallet, fee quotes, and the
// write-ahead record of every signed transaction before it leaves the process.
type sender struct {
	backend Backend
	chainID *big.Int
	signer  types.Signer
	fees    FeePolicy
	now     func() time.Time
	// poll is how often a Signed call's receipt is asked for while the send waits for it to mine.
	poll time.Duration

	quote sharedRead[*feeQuote]
}

func newSender(b Backend, chainID *big.Int, fees FeePolicy, now func() time.Time) *sender {
	if fees.CacheFor == 0 {
		fees.CacheFor = time.Second
	}
	return &sender{backend: b, chainID: chainID, signer: types.LatestSignerForChainID(chainID), fees: fees, now: now}
}

// feeQuote is the price of new transactions, shared for fees.CacheFor; concurrent callers share one read of it
// and no lock is held across the calls to the node.
func (s *sender) feeQuote(ctx context.Context) (*feeQuote, error) {
	return s.quote.get(ctx, s.now, s.fees.CacheFor, s.readFeeQuote)
}

func (s *sender) readFeeQuote(ctx context.Context) (*feeQuote, error) {
	q := &feeQuote{}
	if s.fees.Legacy {
		gp, err := s.backend.SuggestGasPrice(ctx)
		if err != nil {
			return nil, fmt.Errorf("gas price: %w", err)
		}
		q.gasPrice = gp
	} else {
		head, err := s.backend.HeaderByNumber(ctx, nil)
		if err != nil {
			return nil, fmt.Errorf("head block for the base fee: %w", err)
		}
		tip, err := s.backend.SuggestGasTipCap(ctx)
		if err != nil {
			return nil, fmt.Errorf("priority fee: %w", err)
		}
		base := head.BaseFee
		if base == nil {
			base = new(big.Int)
		}
		// Twice the base fee survives six full blocks of base fee increases.
		q.tipCap, q.feeCap = tip, new(big.Int).Add(new(big.Int).Mul(base, big.NewInt(2)), tip)
	}
	return q, nil
}

// bump prices a replacement of tx: at least 12.5% more on every fee, which every client accepts (geth wants 10%).
func bump(v *big.Int) *big.Int {
	out := new(big.Int).Mul(v, big.NewInt(9))
	out.Div(out, big.NewInt(8))
	return out.Add(out, big.NewInt(1))
}

func (s *sender) sign(w *wallet, nonce uint64, c contractCall, q *feeQuote) (*types.Transaction, error) {
	var inner types.TxData
	if q.gasPrice != nil {
		inner = &types.LegacyTx{Nonce: nonce, GasPrice: q.gasPrice, Gas: c.Gas, To: &c.To, Data: c.Data, Value: c.Value}
	} else {
		inner = &types.DynamicFeeTx{ChainID: s.chainID, Nonce: nonce, GasTipCap: q.tipCap, GasFeeCap: q.feeCap, Gas: c.Gas, To: &c.To, Data: c.Data, Value: c.Value}
	}
	return types.SignNewTx(w.key, s.signer, inner)
}

// errNodeNotAsked marks a send that stopped before it signed anything because the node could not be asked what a
// transaction needs (its fee, the wallet's nonce): nothing is wrong with the payment, and a later attempt sends
// it once the node answers.
var errNodeNotAsked = errors.New("the node could not be asked for what the settlement transaction needs")

// errBroadcastUnknown marks a send whose transactions were signed and recorded but whose delivery to a node is
// unknown: they may be in a mempool. They keep their nonces and are re-broadcast as they are, never re-signed.
var errBroadcastUnknown = errors.New("the node could not be reached while broadcasting; the transaction may have been sent")

// send signs calls with consecutive nonces of w, priced by q (the quote the settlement was simulated with), hands
// them to record (the write-ahead journal entry) and broadcasts them in order. It returns the transactions that
// may have reached a node. A nonce conflict (another sender used the wallet, or a restart forgot pending
// transactions) re-reads the pending nonce and re-signs before anything of the batch went out.
func (s *sender) send(ctx context.Context, w *wallet, calls []contractCall, q *feeQuote, record func([]*types.Transaction) error) ([]*types.Transaction, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var err error
	for attempt := 0; ; attempt++ {
		if !w.synced {
			n, err := s.backend.PendingNonceAt(ctx, w.Address)
			if err != nil {
				return nil, fmt.Errorf("%w: pending nonce of %s: %w", errNodeNotAsked, w.Address.Hex(), err)
			}
			w.nonce, w.synced = max(n, w.floor), true
		}
		txs := make([]*types.Transaction, len(calls))
		own := uint64(0) // the wallet's transactions among them: Signed ones take none of its nonces
		for i, c := range calls {
			if c.Signed != nil {
				txs[i] = c.Signed
				continue
			}
			if txs[i], err = s.sign(w, w.nonce+own, c, q); err != nil {
				return nil, fmt.Errorf("signing settlement transaction: %w", err)
			}
			own++
		}
		if err := record(txs); err != nil {
			return nil, fmt.Errorf("recording the transaction before broadcast: %w", err)
		}
	broadcast:
		for i, tx := range txs {
			if calls[i].Signed != nil {
				// The node takes it only once what comes before it (its sender's gas money) has mined.
				for _, before := range txs[:i] {
					if err := s.awaitMined(ctx, before); err != nil {
						w.nonce += own
						return txs, fmt.Errorf("%w: %v", errBroadcastUnknown, err)
					}
				}
				if err := s.sendSigned(ctx, tx); err != nil {
					if errors.Is(err, errBroadcastUnknown) {
						// Still on its way: the rest stays recorded, and reconciliation sends it once it mined.
						w.nonce += own
						return txs, err
					}
					// Never to succeed: nothing after it went out, and the wallet's nonces it would have taken stay
					// free (the caller releases the record that held them).
					w.nonce += ownIn(calls[:i])
					return txs[:i], err
				}
				continue
			}
			if i > 0 && calls[i-1].Signed != nil {
				// The payer's approval mined just now, and the payer may have done more since it signed the
				// payment (revoked the approval with its next nonce, moved its tokens): the settlement is
				// simulated again before it leaves, and never sent to revert at the wallet's cost.
				if err := s.recheck(ctx, tx, txs[i-1].Hash()); err != nil {
					if errors.Is(err, errSettlementWouldRevert) {
						w.nonce += ownIn(calls[:i])
						return txs[:i], err
					}
					// Not asked: kept recorded, and reconciliation simulates it again before it sends it.
					w.nonce += own
					return txs, err
				}
			}
			err := s.backend.SendTransaction(ctx, tx)
			switch {
			case err == nil || isAlreadyKnown(err):
				continue
			case isTransportError(err) || !isAnswer(err):
				// No answer of the node's (a network failure, or an error of the client's own: go-ethereum's
				// "client reconnected" when its connection was replaced under the call): the node may hold it.
				w.nonce += own
				return txs, fmt.Errorf("%w: %v", errBroadcastUnknown, err)
			case i == 0 && isNonceConflict(err):
				known, kerr := s.known(ctx, tx)
				switch {
				case known:
					// Our own transaction, already sent by a re-broadcast or mined: not a conflict.
					continue
				case kerr != nil:
					// Whether the nonce holds this very transaction is unknown: it is treated as sent, never
					// signed again under another nonce here. Reconciliation settles it again if it is not.
					w.synced = false
					return txs, fmt.Errorf("%w: the node answered %v, and whether it holds this transaction could not be read: %v", errBroadcastUnknown, err, kerr)
				case attempt < 3:
					w.synced = false
					break broadcast
				}
				w.synced = false
				return nil, fmt.Errorf("node refused the settlement transaction: %w", err)
			case i == 0:
				// Refused outright (no gas money, fee too low...): the nonce is still free. Read it again
				// before the next send, in case the refusal came from a node that sees the wallet otherwise.
				w.synced = false
				return nil, fmt.Errorf("node refused the settlement transaction: %w", err)
			default:
				// The first went out, a later one was refused. The later one stays recorded with its nonce
				// and is re-broadcast by reconciliation; giving its nonce to another settlement would
				// strand this one half done.
				w.nonce += own
				return txs, fmt.Errorf("%w: node refused settlement transaction %d of %d: %v", errBroadcastUnknown, i+1, len(txs), err)
			}
		}
		if w.synced {
			w.nonce += own
			return txs, nil
		}
	}
}

// ownIn counts the calls a wallet signs (not Signed ones).
func ownIn(calls []contractCall) uint64 {
	n := uint64(0)
	for _, c := range calls {
		if c.Signed == nil {
			n++
		}
	}
	return n
}

// errSignedRefused says a transaction someone else signed (a sponsored approval) was refused by the node, or
// mined and failed: the transactions after it were not sent.
var errSignedRefused = errors.New("the payer's signed approval transaction")

// errSignedFailed says a transaction someone else signed mined and failed (see errSignedRefused).
var errSignedFailed = fmt.Errorf("%w mined and failed", errSignedRefused)

// sendSigned broadcasts tx, signed by someone else, and waits until it mined and succeeded: the transactions after
// it depend on what it does. A node that already knows it, or a nonce of its sender's that it took already, is
// fine when it is tx itself that mined. errSignedRefused when the node refuses it or it fails on chain;
// errBroadcastUnknown when it could not be seen mined in time (it may yet).
func (s *sender) sendSigned(ctx context.Context, tx *types.Transaction) error {
	err := s.backend.SendTransaction(ctx, tx)
	// A node's pool checks balances against the state it last caught up with, which may lag the block that
	// just mined the sender's gas money: asked again for a while, it takes the transaction once it has.
	for try := 0; err != nil && strings.Contains(err.Error(), "insufficient funds") && try < 40; try++ {
		select {
		case <-ctx.Done():
		case <-time.After(25 * time.Millisecond):
			err = s.backend.SendTransaction(ctx, tx)
			continue
		}
		break
	}
	switch {
	case err == nil || isAlreadyKnown(err):
	case isTransportError(err) || !isAnswer(err):
		return fmt.Errorf("%w: %v", errBroadcastUnknown, err)
	case isNonceConflict(err):
		// Mined already (a send of an earlier attempt), or its nonce went to another of the payer's transactions.
		r, rerr := s.backend.TransactionReceipt(ctx, tx.Hash())
		switch {
		case rerr != nil && !errors.Is(rerr, ethereum.NotFound):
			// Which of the two is not known (the node did not answer): most likely the first, and never a
			// refusal, which would tell the payer nothing was sent and let its payment be settled again, its
			// approval funded again (the money-invariant run, under RPC 503s).
			return fmt.Errorf("%w: the node answered %v, and the receipt of the payer's approval could not be read: %v", errBroadcastUnknown, err, rerr)
		case rerr != nil || r == nil:
			return fmt.Errorf("%w was refused by the node: %v", errSignedRefused, err)
		}
	default:
		return fmt.Errorf("%w was refused by the node: %v", errSignedRefused, err)
	}
	if err := s.awaitMined(ctx, tx); err != nil {
		if errors.Is(err, errMinedFailed) {
			return fmt.Errorf("%w: %s", errSignedFailed, tx.Hash().Hex())
		}
		return fmt.Errorf("%w: %v", errBroadcastUnknown, err)
	}
	return nil
}

// errSettlementWouldRevert says a settlement that waited for a payer's signed approval to mine would revert now,
// simulated again once it did: it was not sent, and its wallet nonce stays free.
var errSettlementWouldRevert = errors.New("the settlement, simulated again once the payer's approval mined, would revert")

// recheck simulates tx, this engine's own signed settlement, on the latest block once it holds after, the payer's
// approval that just mined (eth_call from its wallet, with its calldata, value and gas limit; fees left out, as
// they do not change what the call does): errSettlementWouldRevert when it would revert, errBroadcastUnknown when
// the node could not be asked. A node serves a block's receipts a moment before its head moves to the block: the
// latest state read then is the one before the approval, whose allowance is not there yet (the money-invariant
// run: an honest payment refused permit2_simulation_failed, ERC20InsufficientAllowance, once its approval mined).
func (s *sender) recheck(ctx context.Context, tx *types.Transaction, after common.Hash) error {
	from, err := types.Sender(s.signer, tx)
	if err != nil {
		return err
	}
	if err := s.awaitHeadHolds(ctx, after); err != nil {
		return fmt.Errorf("%w: simulating the settlement again after the payer's approval mined: %v", errBroadcastUnknown, err)
	}
	_, err = s.backend.CallContract(ctx, ethereum.CallMsg{From: from, To: tx.To(), Gas: tx.Gas(), Value: tx.Value(), Data: tx.Data()}, nil)
	switch {
	case err == nil:
		return nil
	case failsOnChain(err):
		return fmt.Errorf("%w: %s", errSettlementWouldRevert, revertReason(err))
	}
	return fmt.Errorf("%w: simulating the settlement again after the payer's approval mined: %v", errBroadcastUnknown, err)
}

// awaitHeadHolds waits until the node's head is the block that mined the transaction mined (or a later one).
func (s *sender) awaitHeadHolds(ctx context.Context, mined common.Hash) error {
	r, err := s.backend.TransactionReceipt(ctx, mined)
	if err != nil {
		return fmt.Errorf("the receipt of %s: %w", mined.Hex(), err)
	}
	poll := s.poll
	if poll <= 0 {
		poll = 50 * time.Millisecond
	}
	for {
		head, err := s.backend.HeaderByNumber(ctx, nil)
		if err != nil {
			return fmt.Errorf("the head block: %w", err)
		}
		if r.BlockNumber == nil || head.Number.Cmp(r.BlockNumber) >= 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the head did not reach block %s, which mined %s: %w", r.BlockNumber, mined.Hex(), ctx.Err())
		case <-time.After(poll):
		}
	}
}

// errMinedFailed: a transaction awaited mined and failed.
var errMinedFailed = errors.New("mined and failed")

// awaitMined waits until tx mined and succeeded: errMinedFailed when it failed, the context's error when it was
// not seen mined in time.
func (s *sender) awaitMined(ctx context.Context, tx *types.Transaction) error {
	poll := s.poll
	if poll <= 0 {
		poll = 50 * time.Millisecond
	}
	for {
		r, err := s.backend.TransactionReceipt(ctx, tx.Hash())
		switch {
		case err == nil && r != nil && r.Status == types.ReceiptStatusSuccessful:
			return nil
		case err == nil && r != nil:
			return fmt.Errorf("%w: %s", errMinedFailed, tx.Hash().Hex())
		case err != nil && !errors.Is(err, ethereum.NotFound) && ctx.Err() == nil && !isTransportError(err):
			return fmt.Errorf("the receipt of %s: %w", tx.Hash().Hex(), err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not seen mined: %w", tx.Hash().Hex(), ctx.Err())
		case <-time.After(poll):
		}
	}
}

// replace signs a fee-bumped copy of a transaction stuck in the pool: same wallet, nonce, recipient, data, gas and value,
// every fee raised by at least an eighth and to no less than a fresh quote. Whichever of the two mines, the
// other cannot: they share the nonce.
func (s *sender) replace(ctx context.Context, w *wallet, stuck *types.Transaction) (*types.Transaction, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s.quote.forget() // the quote that priced the stuck transaction is stale by definition
	q, err := s.feeQuote(ctx)
	if err != nil {
		return nil, err
	}
	// The value too: a sponsored approval's gas money replaced without it would leave the payer unfunded.
	c := contractCall{To: *stuck.To(), Data: stuck.Data(), Gas: stuck.Gas(), Value: stuck.Value()}
	bumped := &feeQuote{}
	if stuck.Type() == types.LegacyTxType {
		bumped.gasPrice = maxBig(bump(stuck.GasPrice()), q.gasPrice)
	} else {
		bumped.tipCap = maxBig(bump(stuck.GasTipCap()), q.tipCap)
		bumped.feeCap = maxBig(bump(stuck.GasFeeCap()), q.feeCap)
		if bumped.feeCap.Cmp(bumped.tipCap) < 0 {
			bumped.feeCap = new(big.Int).Set(bumped.tipCap)
		}
	}
	return s.sign(w, stuck.Nonce(), c, bumped)
}

// fillNonce sends a zero-value transfer from w to itself at nonce, a hole below transactions of w that the node
// holds back: a nonce no transaction of the node or the journal holds.
func (s *sender) fillNonce(ctx context.Context, w *wallet, nonce uint64) (common.Hash, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	q, err := s.feeQuote(ctx)
	if err != nil {
		return common.Hash{}, err
	}
	tx, err := s.sign(w, nonce, contractCall{To: w.Address, Gas: fillerGas}, q)
	if err != nil {
		return common.Hash{}, err
	}
	if err := s.rebroadcast(ctx, tx); err != nil {
		return common.Hash{}, err
	}
	if w.synced && w.nonce <= nonce {
		w.nonce = nonce + 1
	}
	return tx.Hash(), nil
}

// signFiller signs, without sending it, a zero-value transfer from w to itself at nonce: what takes a recorded
// transaction's nonce in its place when that transaction must no longer go out (see fundingToSend).
func (s *sender) signFiller(ctx context.Context, w *wallet, nonce uint64) (*types.Transaction, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	q, err := s.feeQuote(ctx)
	if err != nil {
		return nil, err
	}
	return s.sign(w, nonce, contractCall{To: w.Address, Gas: fillerGas}, q)
}

// fillerGas is the gas of a plain transfer.
const fillerGas = 21_000

func maxBig(a, b *big.Int) *big.Int {
	if b == nil || a.Cmp(b) >= 0 {
		return a
	}
	return b
}

// known reports whether the node already has tx, in its pool or mined; an error says the node could not tell.
func (s *sender) known(ctx context.Context, tx *types.Transaction) (bool, error) {
	_, _, err := s.backend.TransactionByHash(ctx, tx.Hash())
	if err == nil {
		return true, nil
	} else if !errors.Is(err, ethereum.NotFound) {
		return false, err
	}
	r, err := s.backend.TransactionReceipt(ctx, tx.Hash())
	if err != nil && !errors.Is(err, ethereum.NotFound) {
		return false, err
	}
	return err == nil && r != nil, nil
}

// rebroadcast sends an already signed transaction again (after a restart or an unreachable node). It is safe:
// the same bytes have the same hash and cannot be mined twice.
func (s *sender) rebroadcast(ctx context.Context, tx *types.Transaction) error {
	err := s.backend.SendTransaction(ctx, tx)
	if err == nil || isAlreadyKnown(err) {
		return nil
	}
	return err
}

func isAlreadyKnown(err error) bool {
	return err != nil && strings.Contains(err.Error(), "already known")
}

func isNonceConflict(err error) bool {
	if err == nil {
		return false
	}
	m := err.Error()
	return strings.Contains(m, "nonce too low") || strings.Contains(m, "replacement transaction underpriced")
}

// receiptWatcher waits for receipts: while anyone waits it polls the head block, and each time the head moves it
// looks up the receipts of the watched transactions. One poll serves every waiter.
type receiptWatcher struct {
	backend Backend
	poll    time.Duration

	mu      sync.Mutex
	waiters map[common.Hash][]chan *types.Receipt
	// filed lists every hash each waiter is filed under in waiters: its own, and the replacements of those
	// (see replaced), so that a waiter leaving takes itself out of all of them.
	filed   map[chan *types.Receipt][]common.Hash
	fresh   []common.Hash // registered since the last look: looked up even if the head has not moved
	sent    []common.Hash // registered right after their broadcast: looked up only if a recent block holds them
	running bool

	// recent maps the transactions of the last recentBlocks scanned blocks to their block, and recentOrder
	// lists those blocks' transactions oldest first, to forget them. A transaction registered right after its
	// broadcast can only sit in a block scanned since: it needs a receipt lookup only if recent holds it (one
	// call saved per settlement). Only the loop goroutine touches them.
	recent      map[common.Hash]uint64
	recentOrder []scannedBlock

	noBlockReceipts bool // the node does not serve eth_getBlockReceipts; only the loop goroutine touches it
	// lastHead is the head the last loop had scanned up to when it stopped (no waiters left); the next loop goes
	// on from it, scanning the blocks since, instead of taking them in unscanned and looking its first
	// transactions up one poll later. Only a loop goroutine touches it, and one runs at a time.
	lastHead uint64
}

func newReceiptWatcher(b Backend, poll time.Duration) *receiptWatcher {
	if poll <= 0 {
		poll = 50 * time.Millisecond
	}
	return &receiptWatcher{backend: b, poll: poll, waiters: map[common.Hash][]chan *types.Receipt{},
		filed: map[chan *types.Receipt][]common.Hash{}, recent: map[common.Hash]uint64{}}
}

// recentBlocks is how many scanned blocks the watcher remembers the transactions of.
const recentBlocks = 64

// wait returns the first receipt seen for any of hashes (a transaction and its fee replacements), or ctx's error.
// justSent says the transactions were broadcast just now, so that no block scanned before the last few can
// hold them.
func (rw *receiptWatcher) wait(ctx context.Context, justSent bool, hashes ...common.Hash) (*types.Receipt, error) {
	ch := make(chan *types.Receipt, len(hashes))
	rw.mu.Lock()
	for _, h := range hashes {
		rw.waiters[h] = append(rw.waiters[h], ch)
	}
	rw.filed[ch] = append([]common.Hash(nil), hashes...)
	if justSent {
		rw.sent = append(rw.sent, hashes...)
	} else {
		rw.fresh = append(rw.fresh, hashes...)
	}
	if !rw.running {
		rw.running = true
		go rw.loop()
	}
	rw.mu.Unlock()
	defer func() {
		rw.mu.Lock()
		for _, h := range rw.filed[ch] {
			list := rw.waiters[h]
			for i, c := range list {
				if c == ch {
					list = append(list[:i], list[i+1:]...)
					break
				}
			}
			if len(list) == 0 {
				delete(rw.waiters, h)
			} else {
				rw.waiters[h] = list
			}
		}
		delete(rw.filed, ch)
		rw.mu.Unlock()
	}()
	// A transaction registered right after its broadcast is looked up only if a block scanned since holds it. A
	// block the watcher did not scan one by one (after a gap of more than maxScan blocks it looks up the waiters
	// it has instead, and remembers no block; a block scanned more than recentBlocks ago is forgotten) may hold it
	// when the waiter registered after that look: it would then be found by no later block and wait its whole
	// timeout for a receipt the node has had all along. Seen under load on a dev chain sealing a block per
	// transaction: a settlement mined in a second answered settlement_pending after 30 s. So a waiter still
	// waiting after sentRescue is looked up once by receipt: whatever was mined before it registered shows then,
	// and what is mined after is in a block scanned (or a gap looked up) since.
	var rescue <-chan time.Time
	if justSent {
		t := time.NewTimer(sentRescue)
		defer t.Stop()
		rescue = t.C
	}
	for {
		select {
		case r := <-ch:
			return r, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-rescue:
			rescue = nil
			rw.mu.Lock()
			rw.fresh = append(rw.fresh, hashes...)
			rw.mu.Unlock()
		}
	}
}

// sentRescue is how long a transaction registered right after its broadcast waits before it is looked up by
// receipt regardless of the blocks scanned (see wait): one more call only for a settlement slower than this.
const sentRescue = 2 * time.Second

func (rw *receiptWatcher) loop() {
	lastHead := rw.lastHead
	// unscanned: the last round took in blocks without scanning them (the first look, or a gap past maxScan).
	// A transaction registered as just sent while it ran may sit in one of them, where no later scan finds
	// it: this round looks up every such transaction instead.
	unscanned := false
	ticker := time.NewTicker(rw.poll)
	defer ticker.Stop()
	// A node in this process pushes its new heads: a round starts as soon as a block comes. The poll stays, for
	// a head the subscription loses.
	var heads chan *types.Header
	var subErr <-chan error
	if hs, ok := rw.backend.(headSubscriber); ok {
		ch := make(chan *types.Header, 64)
		ctx, cancel := context.WithTimeout(context.Background(), rw.poll+time.Second)
		sub, err := hs.SubscribeNewHead(ctx, ch)
		cancel()
		if err == nil {
			defer sub.Unsubscribe()
			heads, subErr = ch, sub.Err()
		}
	}
	for {
		rw.mu.Lock()
		if len(rw.waiters) == 0 {
			rw.running = false
			rw.lastHead = lastHead
			rw.mu.Unlock()
			return
		}
		fresh, sent := rw.fresh, rw.sent
		rw.fresh, rw.sent = nil, nil
		rw.mu.Unlock()
		if unscanned {
			fresh, sent = append(fresh, sent...), nil
			unscanned = false
		}

		ctx, cancel := context.WithTimeout(context.Background(), 10*rw.poll+time.Second)
		lookups, head, err := rw.newlyMined(ctx, lastHead)
		if err != nil {
			// Nothing learned: look at the fresh ones again next time.
			rw.mu.Lock()
			rw.fresh = append(rw.fresh, fresh...)
			rw.sent = append(rw.sent, sent...)
			rw.mu.Unlock()
		} else {
			if lastHead == 0 || head-lastHead > maxScan {
				// The blocks up to head were not scanned: every transaction awaited when this round began was
				// looked up, and those registered since are looked up next round.
				sent, unscanned = nil, true
			}
			lastHead = head
			for _, h := range sent {
				if _, inScanned := rw.recent[h]; inScanned {
					fresh = append(fresh, h)
				}
			}
			// A transaction registered just now may sit in a block already scanned.
			retry := rw.lookUp(ctx, head, lookups, fresh)
			if len(retry) > 0 {
				rw.mu.Lock()
				rw.fresh = append(rw.fresh, retry...)
				rw.mu.Unlock()
			}
		}
		cancel()
		select {
		case <-ticker.C:
		case <-heads:
		case <-subErr:
			heads, subErr = nil, nil
		}
		// One round scans every block up to the head it reads: the heads pushed meanwhile need no round of
		// their own (and must not pile up in the subscription's buffer).
		for drained := false; !drained; {
			select {
			case <-heads:
			default:
				drained = true
			}
		}
	}
}

// maxScan is how many new blocks the watcher reads transaction lists of; after a longer gap it asks for the
// receipt of every awaited transaction instead.
const maxScan = 32

// newlyMined returns the awaited transactions that blocks after lastHead include, and the new head. A receipt
// is then fetched only for those: one lookup per mined settlement, not one per waiter and block.
func (rw *receiptWatcher) newlyMined(ctx context.Context, lastHead uint64) ([]common.Hash, uint64, error) {
	head, err := rw.backend.HeaderByNumber(ctx, nil)
	if err != nil {
		return nil, lastHead, err
	}
	n := head.Number.Uint64()
	if n == lastHead {
		return nil, n, nil
	}
	rw.mu.Lock()
	awaited := make(map[common.Hash]bool, len(rw.waiters))
	for h := range rw.waiters {
		awaited[h] = true
	}
	rw.mu.Unlock()
	if lastHead == 0 || n-lastHead > maxScan {
		all := make([]common.Hash, 0, len(awaited))
		for h := range awaited {
			all = append(all, h)
		}
		return all, n, nil
	}
	var found []common.Hash
	for b := lastHead + 1; b <= n; b++ {
		if br, ok := rw.backend.(blockReceiptsReader); ok && !rw.noBlockReceipts {
			receipts, err := br.BlockReceipts(ctx, rpc.BlockNumberOrHashWithNumber(rpc.BlockNumber(b)))
			if err == nil {
				// Every receipt of the block in one call: deliver the awaited ones, nothing to look up.
				hashes := make([]common.Hash, len(receipts))
				for i, r := range receipts {
					hashes[i] = r.TxHash
					if awaited[r.TxHash] {
						rw.deliver(r.TxHash, r)
					}
				}
				rw.remember(b, hashes)
				continue
			}
			var rpcErr rpc.Error
			if !errors.Is(err, errNoBlockReceipts) && !(errors.As(err, &rpcErr) && rpcErr.ErrorCode() == -32601) {
				return nil, lastHead, err
			}
			rw.noBlockReceipts = true // the node lacks the method: list transactions instead
		}
		block, err := rw.backend.BlockByNumber(ctx, new(big.Int).SetUint64(b))
		if err != nil {
			return nil, lastHead, err
		}
		hashes := make([]common.Hash, 0, len(block.Transactions()))
		for _, tx := range block.Transactions() {
			hashes = append(hashes, tx.Hash())
			if awaited[tx.Hash()] {
				found = append(found, tx.Hash())
			}
		}
		rw.remember(b, hashes)
	}
	return found, n, nil
}

// scannedBlock is a block the watcher scanned and its transactions.
type scannedBlock struct {
	number uint64
	hashes []common.Hash
}

// remember records a scanned block's transactions in recent, forgetting the oldest block's past recentBlocks.
func (rw *receiptWatcher) remember(block uint64, hashes []common.Hash) {
	for _, h := range hashes {
		rw.recent[h] = block
	}
	rw.recentOrder = append(rw.recentOrder, scannedBlock{block, hashes})
	if len(rw.recentOrder) > recentBlocks {
		old := rw.recentOrder[0]
		for _, h := range old.hashes {
			if rw.recent[h] == old.number {
				delete(rw.recent, h)
			}
		}
		rw.recentOrder = rw.recentOrder[1:]
	}
}

// lookupWorkers bounds the receipt lookups the watcher has in flight at once.
const lookupWorkers = 16

// lookUp fetches the receipts of mined (found in a scanned block) and fresh (just registered) transactions, a
// few at a time, and delivers them. It returns what must be asked again: a mined one whose receipt is not served
// yet, or any the node could not answer for (one still indexing says "transaction indexing is in progress").
// "Not found" for a fresh one means not mined yet: a later block will show it.
//
// A receipt of a block past head (the head this round read) is held back and asked again: a node indexes a
// block's transactions before it moves its head to it (go-ethereum's writeHeadBlock), so a settlement answered
// on such a receipt would be read back, by whoever asks the node's latest state right after (a payer checking
// its balance, the funds holds), as not having happened yet.
func (rw *receiptWatcher) lookUp(ctx context.Context, head uint64, mined, fresh []common.Hash) []common.Hash {
	var (
		mu    sync.Mutex
		retry []common.Hash
		wg    sync.WaitGroup
		sem   = make(chan struct{}, lookupWorkers)
	)
	all := append(append([]common.Hash(nil), mined...), fresh...)
	for i, h := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			r, err := rw.backend.TransactionReceipt(ctx, h)
			if err == nil && r != nil && (r.BlockNumber == nil || r.BlockNumber.Uint64() <= head) {
				rw.deliver(h, r)
				return
			}
			if err == nil && r != nil {
				mu.Lock()
				retry = append(retry, h) // mined in a block the head has not reached yet
				mu.Unlock()
				return
			}
			if i < len(mined) || (err != nil && !errors.Is(err, ethereum.NotFound)) {
				mu.Lock()
				retry = append(retry, h)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return retry
}

func (rw *receiptWatcher) deliver(h common.Hash, r *types.Receipt) {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	for _, c := range rw.waiters[h] {
		select {
		case c <- r:
		default:
		}
	}
	// Each waiter needs one receipt: the entry is done with.
	delete(rw.waiters, h)
}

// replaced makes everyone waiting for old wait for its replacement too.
func (rw *receiptWatcher) replaced(old, replacement common.Hash) {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	if chans := rw.waiters[old]; len(chans) > 0 {
		rw.waiters[replacement] = append(rw.waiters[replacement], chans...)
		for _, c := range chans {
			rw.filed[c] = append(rw.filed[c], replacement)
		}
		rw.fresh = append(rw.fresh, replacement)
	}
}
