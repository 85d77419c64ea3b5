package chain_test

import (
	"context"
	"math/big"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestASettlementHandedOffThatNoInstanceTakesIsRefusedAfterTheWaitAndSendsNothing: two engines share one wallet,
// and the one holding it stalls (its lease loop and its taking of hand-offs stop, as a paused process's would). A
// payment settled on the other, which holds no wallet, is handed off and taken by nobody: after the pool's wait
// its claimant takes it back and answers no_available_wallets (every wallet of the cluster stayed busy), sends
// nothing, and releases its claim. Once the stalled engine is gone the other takes the wallet, and the same
// payment settles there, once.
func TestASettlementHandedOffThatNoInstanceTakesIsRefusedAfterTheWaitAndSendsNothing(t *testing.T) {
	const wait = 500 * time.Millisecond
	// A lease of 12 s: the stalled engine's lease must outlast the approval, the verification and the pool's wait
	// on a loaded machine (with 3 s, CI's three test binaries at a time let it lapse, the other engine took the
	// wallet and settled the payment there).
	fx, engines, stores := sharedEnginesOn(t, pgtest.Shared(t), 2, 12*time.Second, fixtureOpts{wallets: 1, receiptTimeout: time.Minute,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.WalletWait = wait }})
	held := waitEven(t, fx, engines, 1)
	holder, other := 0, 1
	if len(held[0]) == 0 {
		holder, other = 1, 0
	}
	engines[holder].StallLeasesForTest()
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if v, err := engines[other].Verify(context.Background(), req); err != nil || !v.IsValid {
		t.Fatalf("verified on the engine that holds no wallet as %+v, %v; want valid", v, err)
	}
	before := fx.walletTxs()
	start := time.Now()
	s, err := engines[other].Settle(context.Background(), req)
	took := time.Since(start)
	if err != nil || s.Success || s.ErrorReason != x402.ReasonNoAvailableWallets || !strings.Contains(s.ErrorMessage, "no instance sharing the journal") {
		t.Fatalf("settled, handed off to nobody, as %+v, %v; want %s saying no instance had a free wallet", s, err, x402.ReasonNoAvailableWallets)
	}
	if took < wait {
		t.Errorf("refused after %v; want after the pool's wait, %v, offered to the cluster meanwhile", took, wait)
	}
	if n, _ := fx.sentSince(before); n != 0 {
		t.Fatalf("%d transactions sent for a settlement refused, want none", n)
	}
	if recs, err := stores[other].PendingOf(context.Background(), false); err != nil || len(recs) != 0 {
		t.Fatalf("the journal keeps %d records pending (%v) after the refusal; want the claim released", len(recs), err)
	}

	engines[holder].Close()
	stores[holder].Close()
	deadline := time.Now().Add(40 * time.Second)
	for len(engines[other].LeasedWallets(fx.net)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the wallet of the engine gone never passed to the other")
		}
		time.Sleep(50 * time.Millisecond)
	}
	s, err = engines[other].Settle(context.Background(), req)
	if err != nil || !s.Success {
		t.Fatalf("the same payment settled again, once the wallet is held, as %+v, %v; want settled", s, err)
	}
	if n, _ := fx.sentSince(before); n != 1 {
		t.Errorf("%d transactions sent in all, want one", n)
	}
}

// TestAWalletBeingGivenUpIsKeptWhenItsShareGrowsAgain: an engine holds both wallets and verifies an upto payment
// bound to one, then a second engine joins: the first gives a wallet up, which it keeps while the payment bound
// to it may still come to settle (bindingGrace), offering it no more. The second engine goes: the wallet is
// within the first's share again, and it is offered again at once, its lease kept (it used to stay out of use
// until the grace ran out, then be given up and taken again).
func TestAWalletBeingGivenUpIsKeptWhenItsShareGrowsAgain(t *testing.T) {
	fx, join := clusterOn(t, pgtest.Shared(t), 3*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute})
	first, _ := join()
	waitEven(t, fx, []*chain.Facilitator{first}, 2)
	fx.approvePermit2(fx.c.Payers[0], fx.c.Payers[1])
	for i, w := range fx.c.Wallets[:2] {
		req := fx.permit2(fx.c.Payers[i], fx.uptoRequirements(w.Address), chain.Permit2Options{})
		if v, err := first.Verify(context.Background(), req); err != nil || !v.IsValid {
			t.Fatalf("an upto payment bound to %s = %+v, %v; want valid", w.Address.Hex(), v, err)
		}
	}
	second, store := join()
	deadline := time.Now().Add(10 * time.Second)
	for len(first.LeasedWallets(fx.net)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the first engine still offers %v with a second engine beside it; want one wallet", first.LeasedWallets(fx.net))
		}
		time.Sleep(50 * time.Millisecond)
	}
	second.Close()
	store.Close()
	gone := time.Now()
	deadline = gone.Add(10 * time.Second)
	for len(first.LeasedWallets(fx.net)) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%v after the second engine went, the first offers %v; want both wallets again", time.Since(gone).Round(time.Second), first.LeasedWallets(fx.net))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("both wallets offered again %v after the second engine went", time.Since(gone).Round(10*time.Millisecond))
}

// TestPaymentsSettledAtOnceOnEnginesWithoutAWalletSettleOnceThroughTheOneThatHasIt: three engines share one
// wallet; twelve payments are settled at once, four on each engine, so that eight are handed off together to the
// one engine holding the wallet while it settles its own. Every payment settles, each once, all from that wallet,
// and the seller receives twelve prices.
func TestPaymentsSettledAtOnceOnEnginesWithoutAWalletSettleOnceThroughTheOneThatHasIt(t *testing.T) {
	fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 3, 3*time.Second, fixtureOpts{wallets: 1, receiptTimeout: time.Minute})
	waitEven(t, fx, engines, 1)
	payers := fx.c.Payers[:2]
	fx.approvePermit2(payers...)
	const n = 12
	reqs := make([]x402.VerifyRequest, n)
	for i := range reqs {
		reqs[i] = fx.permit2(payers[i%len(payers)], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	}
	before, sellerBefore := fx.walletTxs(), fx.c.TokenBalance(fx.payTo)
	var wg sync.WaitGroup
	txs := make([]string, n)
	for i, req := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := engines[i%len(engines)].Settle(context.Background(), req)
			if err != nil || !s.Success {
				t.Errorf("payment %d on engine %d settled as %+v, %v; want settled", i, i%len(engines), s, err)
			}
			txs[i] = s.Transaction
		}()
	}
	wg.Wait()
	seen := map[string]int{}
	for i, tx := range txs {
		if j, dup := seen[tx]; dup && tx != "" {
			t.Errorf("payments %d and %d answered with the same transaction %s", j, i, tx)
		}
		seen[tx] = i
	}
	if sent, from := fx.sentSince(before); sent != n || len(from) != 1 {
		t.Errorf("%d transactions sent from %v; want %d from the one wallet", sent, from, n)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(n*price)) != 0 {
		t.Errorf("the seller received %s, want %d", got, n*price)
	}
}
