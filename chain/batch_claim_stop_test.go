package chain_test

import (
	"context"
	"crypto/ecdsa"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// Two engines of a cluster share one settlement wallet, and the receiver authorizer's key. The one that holds no
// wallet leaves the claim of the vouchers it accepted to the one that holds it: its stop does not wait for a
// wallet (its wallet wait, a minute here) and sends nothing. The one that holds the wallet claims them at its
// stop, before it gives the wallet's lease up: one transaction, the receiver paid exactly what was accepted.
func TestAClusterEngineHoldingNoWalletStopsAtOnceAndTheOneHoldingItClaimsAtItsStop(t *testing.T) {
	dsn := pgtest.Shared(t)
	authorizer := chaintest.DeriveAccount("authorizer", 0)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 1, autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, authorizer)
			nc.WalletWait = time.Minute
		}})
	nc := chain.NetworkConfig{Network: b.fx.net, Backend: b.c.EthClient, ReceiptTimeout: 30 * time.Second, WalletWait: time.Minute,
		Assets: []chain.AssetConfig{{Address: b.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6},
			{Address: b.token, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		Keys: []*ecdsa.PrivateKey{b.c.Wallets[0].Key}}
	claimsWhenAsked(&nc, authorizer)
	second, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: openPostgres(t, dsn),
		Now: func() time.Time { return time.Unix(int64(b.c.HeadTime()), 0) }, ReconcileEvery: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { second.Close() })
	// Which of the two the wallet's lease settles on is the instances' rank, drawn at their start.
	holder, walletless := settledHolder(t, b.fx, b.fx.f, second)

	b.deposit(t, 100*batchPrice)
	for i := int64(1); i <= 5; i++ {
		if resp := settleBatch(t, walletless, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	wallets := b.c.Wallets[:1]
	sent := b.sentBy(t, wallets)
	start := time.Now()
	walletless.Close()
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("the engine holding no wallet took %s to stop: it waited for a wallet to claim", took)
	}
	if got := b.sentBy(t, wallets) - sent; got != 0 {
		t.Fatalf("%d transactions sent by the stop of the engine holding no wallet", got)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 0 {
		t.Fatalf("the receiver holds %d before any claim", got)
	}

	holder.Close()
	if got := b.sentBy(t, wallets) - sent; got != 1 {
		t.Fatalf("the stop of the engine holding the wallet sent %d transactions, want its one claim", got)
	}
	deadline := time.Now().Add(30 * time.Second)
	for b.c.BalanceOf(b.token, b.receiver.Address).Int64() != 5*batchPrice {
		if time.Now().After(deadline) {
			t.Fatalf("the receiver holds %d, want exactly the %d accepted", b.c.BalanceOf(b.token, b.receiver.Address).Int64(), 5*batchPrice)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, claimed := b.channelOnChain(t); claimed != 5*batchPrice {
		t.Fatalf("the channel's total claimed is %d on chain, want %d", claimed, 5*batchPrice)
	}
}

// settledHolder waits until the one wallet of a and b is leased to one of them, the same one for two seconds (the
// lease loop looks every second, and gives a wallet up to the instance that ranks first), and returns that one and
// the other.
func settledHolder(t *testing.T, fx *fixture, a, b *chain.Facilitator) (holder, other *chain.Facilitator) {
	t.Helper()
	var last *chain.Facilitator
	var since time.Time
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		na, nb := len(a.LeasedWallets(fx.net)), len(b.LeasedWallets(fx.net))
		var now *chain.Facilitator
		switch {
		case na == 1 && nb == 0:
			now = a
		case na == 0 && nb == 1:
			now = b
		}
		if now == nil || now != last {
			last, since = now, time.Now()
			continue
		}
		if time.Since(since) >= 2*time.Second {
			if now == a {
				return a, b
			}
			return b, a
		}
	}
	t.Fatal("the wallet's lease did not settle on one of the two engines")
	return nil, nil
}

// A timed claim pass waiting for its claim's receipt (no block sealed) does not hold the engine's stop, and the
// wallet's lease is kept until the last pass has run: that pass claims the vouchers accepted since, from the wallet.
// Before, the stop waited out the timed pass's whole receipt wait, renewing no lease meanwhile, and the last pass
// found the lease lapsed and claimed nothing.
func TestAStoppingClusterEngineKeepsItsWalletLeaseForItsLastClaimAndDoesNotWaitForAnEarlierClaimsReceipt(t *testing.T) {
	dsn := pgtest.Shared(t)
	authorizer := chaintest.DeriveAccount("authorizer", 0)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 1, receiptTimeout: 20 * time.Second,
		configure: func(cfg *chain.Config) { cfg.WalletLeaseTTL = time.Second },
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			nc.BatchReceiverAuthorizer, nc.BatchClaimEvery, nc.BatchClaimAfter = authorizer.Key, 3, time.Hour
		}})
	wallets, sent := claimDueThenAcceptMore(t, b)
	start := time.Now()
	b.fx.f.Close()
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the stop took %s: it waited for the timed pass's receipt", took)
	}
	if got := b.sentBy(t, wallets) - sent; got != 2 {
		t.Fatalf("%d claims sent in all; want 2: the last pass claims the second channel's vouchers", got)
	}
	for deadline := time.Now().Add(20 * time.Second); b.c.BalanceOf(b.token, b.receiver.Address).Int64() != 5*batchPrice; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the receiver holds %d, want exactly the %d accepted", b.c.BalanceOf(b.token, b.receiver.Address).Int64(), 5*batchPrice)
		}
		b.c.Commit()
	}
}

// The same, with the last pass slow (the node's receipts come 1.5 s late, longer than the lease's validity at a
// renewal): the lease loop keeps the wallet's lease while the last pass runs, which claims the vouchers accepted
// since. Before, it renewed nothing once the stop began, and the pass found the wallet's lease lapsed.
func TestAStoppingClusterEngineKeepsItsWalletLeaseThroughASlowLastClaimPass(t *testing.T) {
	dsn := pgtest.Shared(t)
	authorizer := chaintest.DeriveAccount("authorizer", 0)
	var proxy *chaintest.FaultProxy
	b := newBatchRoute(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithHTTP()}, journal: openPostgres(t, dsn), wallets: 1, receiptTimeout: 20 * time.Second,
		configure: func(cfg *chain.Config) { cfg.WalletLeaseTTL = time.Second },
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			behindFaultProxy(t, &proxy, false, 10*time.Second)(fx, nc)
			nc.BatchReceiverAuthorizer, nc.BatchClaimEvery, nc.BatchClaimAfter = authorizer.Key, 3, time.Hour
		}})
	wallets, sent := claimDueThenAcceptMore(t, b)
	proxy.DelayBy = 1500 * time.Millisecond
	proxy.SetDecide(func(m string) chaintest.Fault {
		if m == "eth_getTransactionReceipt" {
			return chaintest.Delay
		}
		return chaintest.Pass
	})
	b.fx.f.Close()
	if got := b.sentBy(t, wallets) - sent; got != 2 {
		t.Fatalf("%d claims sent in all; want 2: the last pass claims the second channel's vouchers", got)
	}
}

// claimDueThenAcceptMore has the route's engine (one wallet, claims due at three vouchers) accept three vouchers on
// one channel, waits until its claim loop's timed pass sent their claim (which waits for a receipt no block brings),
// then has it accept two on a second channel. It returns the wallet and how many transactions it had sent before.
func claimDueThenAcceptMore(t *testing.T, b *batchRoute) ([]*chaintest.Account, uint64) {
	t.Helper()
	waitLeases(t, b.fx, []*chain.Facilitator{b.fx.f}, 1)
	later := b.ofPayer(1)
	b.deposit(t, 10*batchPrice)
	later.deposit(t, 10*batchPrice)
	wallets := b.c.Wallets[:1]
	sent := b.sentBy(t, wallets)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	for deadline := time.Now().Add(10 * time.Second); b.sentBy(t, wallets)-sent != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the timed pass sent %d claims, want 1", b.sentBy(t, wallets)-sent)
		}
	}
	for i := int64(1); i <= 2; i++ {
		if resp := settleBatch(t, b.fx.f, later.voucher(later.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("the second channel's voucher %d: %+v", i, resp)
		}
	}
	return wallets, sent
}
