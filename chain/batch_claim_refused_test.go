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
)

// TestABatchClaimTheNodeRefusedLeavesNothingPending: the node refuses the claim's transaction (a wallet short of
// gas, say): nothing was sent, and the channels are offered to the next claim, which claims them once. The
// refused claim's broadcast record, written before the transaction left, is final then, not pending for good: a
// journal backlog that never drains (what /health reports, what a graceful stop waits for) would say a claim is
// still on its way.
func TestABatchClaimTheNodeRefusedLeavesNothingPending(t *testing.T) {
	var refusing atomic.Bool
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
			nc.Backend = sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error {
				if refusing.Load() {
					return errors.New("insufficient funds for gas * price + value (injected)")
				}
				return fx.c.Client.SendTransaction(ctx, tx)
			}}
		}})
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
