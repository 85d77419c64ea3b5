package chain_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// TestABatchClaimTheNodeRefusedLeavesNothingPending: the node refuses the claim's transaction (a wallet short of
// gas, say): nothing was sent, and the channels are offered to the next claim, which claims them once. The
// refused claim's broadcast record, written before the transaction left, is final then, not pending for good: a
// journal backlog that never drains (what /health reports, what a graceful stop waits for) would say a claim is
// still on its way.
func TestABatchClaimTheNodeRefusedLeavesNothingPending(t *testing.T) {
	var refusing atomic.Bool
	b := claimRouteSending(t, 30*time.Second, 0, func(fx *fixture, ctx context.Context, tx *types.Transaction) error {
		if refusing.Load() {
			return errors.New("insufficient funds for gas * price + value (injected)")
		}
		return fx.c.Client.SendTransaction(ctx, tx)
	})
	b.deposit(t, 30*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	refusing.Store(true)
	if err := b.fx.f.ClaimBatches(context.Background()); err == nil || !strings.Contains(err.Error(), "not sent") {
		t.Fatalf("the claim the node refused: %v; want it not sent", err)
	}
	refusing.Store(false)
	// Another voucher accepted since: the next claim is another transaction than the one refused.
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); !resp.Success {
		t.Fatalf("voucher 4: %+v", resp)
	}
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 4*batchPrice {
		t.Fatalf("the receiver holds %d after the second claim, want exactly the %d accepted", got, 4*batchPrice)
	}
	pending, err := b.fx.journal.Pending(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range pending {
		t.Errorf("the journal holds %s pending: state %s, tx %s", rec.ID, rec.State, rec.TxHash)
	}
}

// claimRouteSending is a batch route on a bbolt journal whose claims are made when asked (claimEvery > 0: the
// engine's own pass claims after that many vouchers, and waits for the receipt), sealing every 5 ms, on a node
// whose sends go through send.
func claimRouteSending(t *testing.T, receiptTimeout time.Duration, claimEvery int, send func(fx *fixture, ctx context.Context, tx *types.Transaction) error) *batchRoute {
	t.Helper()
	return newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: receiptTimeout,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
			if claimEvery > 0 {
				nc.BatchClaimEvery = claimEvery
			}
			nc.Backend = sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error { return send(fx, ctx, tx) }}
		}})
}

// TestABatchClaimTheNodeLostIsSentAgainWithinItsWait: the node answers the claim's send and never holds the
// transaction (dropped from its pool, or lost behind a proxy): the engine's claim pass, waiting for the receipt,
// looks the claim up and gives the node the same signed transaction again, so it mines long before the wait is
// over, once. Before, the pass waited out the whole wait (30 s here) and only the next pass sent it again: the
// money-invariant run's drain ran out with a claim in the journal's backlog that the node never had (topology
// one, seed 1795852080991833810).
func TestABatchClaimTheNodeLostIsSentAgainWithinItsWait(t *testing.T) {
	var losing atomic.Bool
	var sent atomic.Int64
	// claim_every 3: the engine's own pass claims, and waits for the receipt.
	b := claimRouteSending(t, 30*time.Second, 3, func(fx *fixture, ctx context.Context, tx *types.Transaction) error {
		if losing.Load() && sent.Add(1) == 1 {
			return nil // answered as taken, never held
		}
		return fx.c.Client.SendTransaction(ctx, tx)
	})
	b.deposit(t, 30*batchPrice)
	before := b.sentBy(t, b.fx.c.Wallets)
	losing.Store(true)
	start := time.Now()
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	for b.c.BalanceOf(b.token, b.receiver.Address).Int64() != 3*batchPrice {
		if time.Since(start) > 15*time.Second {
			t.Fatalf("the receiver holds %d %s after the third voucher, want the %d accepted: the claim the node lost was not sent again within its 30 s wait",
				b.c.BalanceOf(b.token, b.receiver.Address).Int64(), time.Since(start), 3*batchPrice)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := b.sentBy(t, b.fx.c.Wallets) - before; got != 1 {
		t.Fatalf("the wallets sent %d transactions for the claim, want 1 (the same signed claim, given twice)", got)
	}
	if got := sent.Load(); got != 2 {
		t.Fatalf("the node was given %d sends, want 2: the claim, lost, and the same claim again", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for pending, _ := b.fx.journal.Pending(context.Background()); len(pending) > 0 && time.Now().Before(deadline); pending, _ = b.fx.journal.Pending(context.Background()) {
		time.Sleep(20 * time.Millisecond)
	}
	assertNothingPending(t, b.fx.journal)
}

// TestABatchClaimWhoseNonceWentToAnotherTransactionIsClaimedAgainWithinItsWait: the node answers the claim's send
// and never holds it, and the wallet's nonce goes to another transaction meanwhile (a hole filled, a resync after a
// refusal): the claim can never mine. The pass that waits for it learns so at its first look-up (the same signed
// claim given again is refused: nonce too low) and offers the channels to the next claim, which claims them, once,
// within the same pass; it does not wait out the whole receipt wait for a transaction no node will ever mine.
func TestABatchClaimWhoseNonceWentToAnotherTransactionIsClaimedAgainWithinItsWait(t *testing.T) {
	var stealing atomic.Bool
	b := claimRouteSending(t, 20*time.Second, 0, func(fx *fixture, ctx context.Context, tx *types.Transaction) error {
		if tx.To() == nil || *tx.To() != contracts.BatchSettlementAddress || !stealing.CompareAndSwap(true, false) {
			return fx.c.Client.SendTransaction(ctx, tx)
		}
		// Answered as taken, never held; another transaction of the wallet takes its nonce.
		from, err := types.Sender(types.LatestSignerForChainID(tx.ChainId()), tx)
		if err != nil {
			return err
		}
		for _, w := range fx.c.Wallets {
			if w.Address == from {
				other, err := types.SignNewTx(w.Key, types.LatestSignerForChainID(tx.ChainId()), &types.DynamicFeeTx{ChainID: tx.ChainId(),
					Nonce: tx.Nonce(), GasTipCap: tx.GasTipCap(), GasFeeCap: tx.GasFeeCap(), Gas: 21_000, To: &w.Address})
				if err != nil {
					return err
				}
				return fx.c.Client.SendTransaction(ctx, other)
			}
		}
		return errors.New("the claim's sender is no wallet of the chain")
	})
	b.deposit(t, 30*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	stealing.Store(true)
	start := time.Now()
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	if stealing.Load() {
		t.Fatal("the claim was never sent")
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 3*batchPrice || took > 10*time.Second {
		t.Fatalf("the receiver holds %d after a claim pass of %s, want the %d accepted within half the 20 s receipt wait: the pass waited for a claim whose nonce another transaction took",
			got, took.Round(time.Millisecond), 3*batchPrice)
	}
	deadline := time.Now().Add(5 * time.Second)
	for pending, _ := b.fx.journal.Pending(context.Background()); len(pending) > 0 && time.Now().Before(deadline); pending, _ = b.fx.journal.Pending(context.Background()) {
		time.Sleep(20 * time.Millisecond)
	}
	assertNothingPending(t, b.fx.journal)
}
