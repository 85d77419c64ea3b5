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
