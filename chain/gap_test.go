package chain_test

import (
	"context"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// forgetfulNode answers the first read of a wallet's pending nonce one too high, as a node does whose pool held a
// transaction of the wallet that it then lost (a restart that dropped its pool, an eviction, a reorg that left it
// out). Nothing the facilitator journalled holds the nonce below.
type forgetfulNode struct {
	chain.Backend
	armed atomic.Bool
}

func (b *forgetfulNode) PendingNonceAt(ctx context.Context, a common.Address) (uint64, error) {
	n, err := b.Backend.PendingNonceAt(ctx, a)
	if err == nil && b.armed.CompareAndSwap(true, false) {
		n++
	}
	return n, err
}

// TestASettlementQueuedBehindANonceTheNodeLostSettles: the settlement is signed with a nonce above a hole that
// no transaction holds, so the node queues it for ever and the payment would answer settlement_pending to every
// presentation. Reconciliation fills the hole (one plain transfer of the wallet to itself), the settlement mines
// as it was signed, and the payment settles, once.
func TestASettlementQueuedBehindANonceTheNodeLostSettles(t *testing.T) {
	var node *forgetfulNode
	fx := newFixture(t, fixtureOpts{
		// The second settlement waits in the pool behind the first's lost nonce for longer than its receipt wait.
		wallets: 1, receiptTimeout: 500 * time.Millisecond, pendingBlockPace: true,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			node = &forgetfulNode{Backend: nc.Backend}
			node.armed.Store(true)
			nc.Backend = node
		},
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery, cfg.ReconcileGrace = 50*time.Millisecond, 100*time.Millisecond
		},
	})
	payer, wallet := fx.c.Payers[2], fx.c.Wallets[0].Address
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	sent := fx.c.TxCount(wallet)
	req := fx.payment(x402.TransferPermit2, payer)

	first := fx.settle(req)
	if !first.Pending() || first.Transaction == "" {
		t.Fatalf("first answer %+v; want settlement_pending with the queued transaction", first)
	}
	final, seen := settleUntilFinal(t, fx.f, req, time.Now().Add(15*time.Second))
	if !final.Success || final.Transaction != first.Transaction {
		t.Fatalf("final answer %+v after %v; want the queued transaction %s settled", final, seen, first.Transaction)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if got := fx.c.TxCount(wallet) - sent; got != 2 {
		t.Fatalf("the wallet sent %d transactions; want 2 (the hole's filler and the settlement)", got)
	}
}

// swallowingNode takes the first transaction it is sent (after the first pass ones) and drops it, answering as if
// it had taken it: a pool that evicted it, a node restarted before it relayed it.
type swallowingNode struct {
	chain.Backend
	armed atomic.Bool
	pass  atomic.Int32
}

func (b *swallowingNode) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	if b.pass.Add(-1) >= 0 {
		return b.Backend.SendTransaction(ctx, tx)
	}
	if b.armed.CompareAndSwap(true, false) {
		return nil
	}
	return b.Backend.SendTransaction(ctx, tx)
}

// nodeFixture is a one-wallet fixture whose node is wrap's, reconciliation passing every 50 ms over records grace
// old (the grace keeps it from sending a dropped transaction's bytes again before the test's next step).
func nodeFixture(t *testing.T, grace time.Duration, wrap func(chain.Backend) chain.Backend) *fixture {
	return newFixture(t, fixtureOpts{
		wallets: 1, receiptTimeout: 300 * time.Millisecond,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.Backend = wrap(nc.Backend) },
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery, cfg.ReconcileGrace = 50*time.Millisecond, grace
		},
	})
}

// swallowing is nodeFixture's wrap of a swallowingNode that lets pass transactions through, then drops one.
func swallowing(pass int32) func(chain.Backend) chain.Backend {
	return func(b chain.Backend) chain.Backend {
		node := &swallowingNode{Backend: b}
		node.pass.Store(pass)
		node.armed.Store(true)
		return node
	}
}

// TestASettlementWhoseNonceAnotherTransactionTookIsSignedAgainAndSettlesOnce: the node dropped the settlement,
// and another transaction of the wallet then took its nonce, so the recorded transaction can never mine.
// Reconciliation signs the payment again with the wallet's next nonce (it is still valid), and it settles, once,
// under the new transaction.
func TestASettlementWhoseNonceAnotherTransactionTookIsSignedAgainAndSettlesOnce(t *testing.T) {
	fx := nodeFixture(t, 2*time.Second, swallowing(0)) // sent again only after the nonce is taken
	payer, wallet := fx.c.Payers[3], fx.c.Wallets[0]
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	req := fx.payment(x402.TransferPermit2, payer)

	first := fx.settle(req)
	if !first.Pending() || first.Transaction == "" {
		t.Fatalf("first answer %+v; want settlement_pending with the dropped transaction", first)
	}
	fx.c.SendETH(wallet, wallet.Address, big.NewInt(1)) // takes the dropped transaction's nonce
	final, seen := settleUntilFinal(t, fx.f, req, time.Now().Add(15*time.Second))
	if !final.Success || final.Transaction == first.Transaction {
		t.Fatalf("final answer %+v after %v; want settled by a transaction other than the dropped %s", final, seen, first.Transaction)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if r, err := fx.c.Client.TransactionReceipt(context.Background(), common.HexToHash(first.Transaction)); err == nil && r != nil {
		t.Fatal("the dropped transaction mined")
	}
}

// TestASettlementTheNodeDroppedIsNotSentAgainOnceItsPaymentsDeadlinePassed: the node dropped the settlement, and by
// the time reconciliation finds it unknown the chain's time is past the payment's deadline. Its recorded bytes
// would revert in any block to come, at the wallet's cost: reconciliation sends nothing, and the payment is answered
// refused for good (no tokens moved), not pending for ever nor reverted.
func TestASettlementTheNodeDroppedIsNotSentAgainOnceItsPaymentsDeadlinePassed(t *testing.T) {
	fx := nodeFixture(t, 2*time.Second, swallowing(0)) // looked at only after the chain's time moved on
	payer, wallet := fx.c.Payers[3], fx.c.Wallets[0].Address
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	sent := fx.c.TxCount(wallet)
	deadline := fx.chainNow().Add(2 * time.Minute)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(deadline.Unix())})

	first := fx.settle(req)
	if !first.Pending() || first.Transaction == "" {
		t.Fatalf("first answer %+v; want settlement_pending with the dropped transaction", first)
	}
	fx.c.AdjustTime(5 * time.Minute) // the head is stamped past the deadline
	var final x402.SettleResponse
	for end := time.Now().Add(15 * time.Second); ; {
		if final = fx.settle(req); !final.Pending() || time.Now().After(end) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if final.Success || final.Pending() || final.ErrorReason != x402.ReasonPermit2DeadlineExpired || final.Transaction != "" {
		t.Fatalf("final answer %+v; want refused for good for its deadline, naming no transaction: nothing was sent, nor will be", final)
	}
	if r, err := fx.c.Client.TransactionReceipt(context.Background(), common.HexToHash(first.Transaction)); err == nil && r != nil {
		t.Fatalf("the dropped transaction was sent again past its payment's deadline and mined (status %d), at the wallet's cost", r.Status)
	}
	time.Sleep(300 * time.Millisecond) // more reconciliation passes
	if got := fx.c.TxCount(wallet) - sent; got != 0 {
		t.Errorf("the wallet sent %d transactions; want none (the only one was dropped, and past its deadline it can only revert)", got)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 0)
}

// TestAnERC2612SettlementWhosePermitMinedSendsItsDroppedTransferPastTheDeadline: the permit mined and the node
// dropped the transfer after it; by the time reconciliation finds it unknown the chain's time is past the payment's
// deadline. The transfer spends the allowance the permit granted, which no deadline binds: it is sent again and the
// payment settles, once (a refusal would leave the payer's allowance granted and the seller unpaid).
func TestAnERC2612SettlementWhosePermitMinedSendsItsDroppedTransferPastTheDeadline(t *testing.T) {
	fx := nodeFixture(t, 2*time.Second, swallowing(1)) // the permit passes, the transfer is dropped
	payer := fx.c.Payers[3]
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	rq := fx.requirements(x402.TransferERC2612)
	req := fx.erc2612(payer, rq, chain.ERC2612Options{Deadline: big.NewInt(fx.chainNow().Add(2 * time.Minute).Unix())})

	first := fx.settle(req)
	if !first.Pending() || first.Transaction == "" {
		t.Fatalf("first answer %+v; want settlement_pending with the dropped transfer", first)
	}
	fx.c.AdjustTime(5 * time.Minute) // the head is stamped past the deadline
	final, seen := settleUntilFinal(t, fx.f, req, time.Now().Add(15*time.Second))
	if !final.Success {
		t.Fatalf("final answer %+v after %v; want settled by the transfer its mined permit pays for", final, seen)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}

// hidingNode serves no receipt and no transaction for the hashes it hides: a node behind the one that mined them.
// It hides the next transaction sent while hideNext is set.
type hidingNode struct {
	chain.Backend
	hideNext atomic.Bool
	mu       sync.Mutex
	hidden   map[common.Hash]bool
}

func (b *hidingNode) isHidden(h common.Hash) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.hidden[h]
}

func (b *hidingNode) unhide() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hidden = nil
}

func (b *hidingNode) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	if b.hideNext.CompareAndSwap(true, false) {
		b.mu.Lock()
		b.hidden = map[common.Hash]bool{tx.Hash(): true}
		b.mu.Unlock()
	}
	return b.Backend.SendTransaction(ctx, tx)
}

func (b *hidingNode) TransactionReceipt(ctx context.Context, h common.Hash) (*types.Receipt, error) {
	if b.isHidden(h) {
		return nil, ethereum.NotFound
	}
	return b.Backend.TransactionReceipt(ctx, h)
}

func (b *hidingNode) TransactionByHash(ctx context.Context, h common.Hash) (*types.Transaction, bool, error) {
	if b.isHidden(h) {
		return nil, false, ethereum.NotFound
	}
	return b.Backend.TransactionByHash(ctx, h)
}

// TestASettlementMinedBeforeItsDeadlineWhoseReceiptTheNodeHidesIsNeverRefusedPastTheDeadline: the settlement mined in
// time, but the node answering reconciliation knows neither its receipt nor its transaction (it lags the one that
// mined it), and by then the chain's time is past the payment's deadline. The payer was charged: reconciliation must
// not record a refusal for the deadline (a gate would answer 402 and the payer pay again), and once the node serves
// the receipt the payment is answered settled, by its one transaction.
func TestASettlementMinedBeforeItsDeadlineWhoseReceiptTheNodeHidesIsNeverRefusedPastTheDeadline(t *testing.T) {
	var node *hidingNode
	fx := nodeFixture(t, 500*time.Millisecond, func(b chain.Backend) chain.Backend {
		node = &hidingNode{Backend: b}
		node.hideNext.Store(true)
		return node
	})
	payer := fx.c.Payers[3]
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	deadline := fx.chainNow().Add(2 * time.Minute)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(deadline.Unix())})

	first := fx.settle(req)
	if !first.Pending() || first.Transaction == "" {
		t.Fatalf("first answer %+v; want settlement_pending (its receipt hidden)", first)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1) // mined, in time
	fx.c.AdjustTime(5 * time.Minute)                           // the head is stamped past the deadline
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		// Reconciliation passes meanwhile (every 50 ms, past its grace).
		if again, err := fx.f.Settle(context.Background(), req); err == nil && !again.Success && !again.Pending() {
			t.Fatalf("the payment, charged on chain before its deadline, was answered %+v once the chain passed it; want pending until its receipt shows", again)
		}
	}
	node.unhide()
	final, seen := settleUntilFinal(t, fx.f, req, time.Now().Add(15*time.Second))
	if !final.Success || final.Transaction != first.Transaction {
		t.Fatalf("final answer %+v after %v; want settled by its one transaction %s", final, seen, first.Transaction)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}
