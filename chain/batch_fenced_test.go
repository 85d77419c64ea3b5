package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An engine of a cluster that lost its one wallet's lease without knowing it (paused past the lease's expiry,
// another instance holding it now) sends no batch-settlement transaction with it: neither the claim of the vouchers
// it accepted nor a payer's refund. Either would sign the nonce the lease's new holder signs. The transaction's
// record, written before it leaves, is fenced by the lease, as a settlement's is; the wallet is then out of use.
func TestABatchClaimOrRefundFromAWalletWhoseLeaseWasLostUnknowinglySendsNothing(t *testing.T) {
	for _, what := range []string{"claim", "refund"} {
		t.Run(what, func(t *testing.T) {
			dsn := pgtest.Shared(t)
			b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 1, autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
				configure: func(cfg *chain.Config) { cfg.WalletLeaseTTL = time.Second },
				tune: func(_ *fixture, nc *chain.NetworkConfig) {
					claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
				}})
			waitLeases(t, b.fx, []*chain.Facilitator{b.fx.f}, 1)
			b.deposit(t, 10*batchPrice)
			for i := int64(1); i <= 3; i++ {
				if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
					t.Fatalf("voucher %d: %+v", i, resp)
				}
			}
			wallet := b.c.Wallets[0].Address
			b.fx.f.StallLeasesForTest()
			leaseElsewhere(t, dsn, b.fx.net, wallet)
			sent := b.sentBy(t, b.c.Wallets[:1])
			switch what {
			case "claim":
				if err := b.fx.f.ClaimBatches(context.Background()); err == nil {
					t.Fatal("the claim from a wallet whose lease another instance holds succeeded; want an error, nothing sent")
				}
			case "refund":
				if resp := settleBatch(t, b.fx.f, b.payerRefund(b.payer, 3*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonNoAvailableWallets {
					t.Fatalf("the refund from a wallet whose lease another instance holds = %+v; want refused as not sent", resp)
				}
			}
			if got := b.sentBy(t, b.c.Wallets[:1]) - sent; got != 0 {
				t.Fatalf("the wallet sent %d transactions under a lease it had lost; want none", got)
			}
			if ws := b.fx.f.LeasedWallets(b.fx.net); len(ws) != 0 {
				t.Fatalf("the engine still hands out %v after its fenced write failed", ws)
			}
			if _, claimed := b.channelOnChain(t); claimed != 0 {
				t.Fatalf("claimed %d on chain; want nothing", claimed)
			}
			if what == "refund" {
				// Certainly not sent: the channel is not left closed to vouchers as if the refund might be on its way.
				if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); !resp.Success {
					t.Fatalf("a voucher after the refund the lease stopped: %+v", resp)
				}
			}
		})
	}
}
