package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAClaimantWaitingOnAHandOffNobodyTakesBacksOffItsReads: a claimant whose hand-off nobody takes reads its
// record while it waits; a record that does not change is read less and less often, not every 15 ms for the
// whole wait. It is refused no_available_wallets after the wait, having sent nothing.
func TestAClaimantWaitingOnAHandOffNobodyTakesBacksOffItsReads(t *testing.T) {
	const wait = 2 * time.Second
	// A lease of 3 s lapsed once under CI's load (a renewal late): the claimant took the wallet and settled the
	// payment itself, which says nothing of its reads.
	hp := newHandoffPairLeasing(t, 30*time.Second, wait, 15*time.Second)
	claimant, taker := hp.hooked[hp.claimant], hp.hooked[hp.taker]
	taker.hidePending.Store(true) // takes nothing
	before := claimant.gets.Load()
	s, err := hp.engines[hp.claimant].Settle(context.Background(), hp.first)
	reads := claimant.gets.Load() - before
	if err != nil || s.Success || s.ErrorReason != x402.ReasonNoAvailableWallets {
		t.Errorf("the claimant answered %+v, %v; want refused for no_available_wallets", s, err)
	}
	// Every 15 ms reads it some 130 times in the wait; backing off to every 200 ms, some 15.
	if reads > 40 {
		t.Errorf("the claimant read the journal %d times in a wait of %v for a record that did not change; want it to back off (at most 40)", reads, wait)
	}
	t.Logf("%d reads in a wait of %v", reads, wait)
}

// TestAClaimantWhoseHandOffWasTakenAnswersWithinTheReceiptTimeoutWhenTheJournalHangs: the claimant's hand-off is
// taken (the taker slow to send it) and the journal's database stops answering without refusing: a read of it
// hangs. The claimant must answer once the receipt timeout has passed (no final answer), not wait on the read
// for as long as its caller lets it.
func TestAClaimantWhoseHandOffWasTakenAnswersWithinTheReceiptTimeoutWhenTheJournalHangs(t *testing.T) {
	const receiptTimeout = 2 * time.Second
	hp := newHandoffPair(t, receiptTimeout, 20*time.Second)
	claimant, taker := hp.hooked[hp.claimant], hp.hooked[hp.taker]
	hp.g.fees.Store(true) // the taker takes the settlement and waits for a fee quote

	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	answers := make(chan settleAnswer, 1)
	go func() { s, err := hp.engines[hp.claimant].Settle(ctx, hp.first); answers <- settleAnswer{s, err} }()
	hp.waitRecord(t, "taken", func(r journal.Record) bool { return r.Handoff != nil && r.Handoff.Taker == taker.Instance() })
	time.Sleep(200 * time.Millisecond) // the claimant reads it taken
	claimant.hangGets.Store(true)
	hung := time.Now()
	select {
	case a := <-answers:
		took := time.Since(hung)
		if took > receiptTimeout+2*time.Second {
			t.Errorf("the claimant answered %v after the journal hung; want within the receipt timeout (%v) and a little", took.Round(10*time.Millisecond), receiptTimeout)
		}
		if a.err == nil && (a.s.Success || !a.s.Pending()) {
			t.Errorf("the claimant answered %+v; want no final answer (an error, or settlement_pending)", a.s)
		}
		t.Logf("answered %v after the journal hung: %+v, %v", took.Round(10*time.Millisecond), a.s, a.err)
	case <-time.After(45 * time.Second):
		t.Fatal("the claimant never answered")
	}
	claimant.hangGets.Store(false)
	hp.g.fees.Store(false)
	close(hp.g.release)
}

// TestAHandOffThisInstanceCannotTakeDoesNotSpeedUpItsLooks: a payment bound to a wallet (an upto witness names its
// facilitator) is handed off by an engine that does not hold it, and the engine that does takes nothing. A third
// engine, which holds a free wallet but not that one, sees the offer and can never take it: it must go on looking
// at its usual pace, not at the pace of a spell of hand-offs it could take.
func TestAHandOffThisInstanceCannotTakeDoesNotSpeedUpItsLooks(t *testing.T) {
	// A lease of 12 s: the stalled holder must keep its wallet through the test on a loaded machine (see
	// TestASettlementHandedOffThatNoInstanceTakesIsRefusedAfterTheWaitAndSendsNothing).
	var hooked []*hookedStore
	fx, engines, _ := sharedEnginesOn(t, pgtest.Start(t).DSN(), 3, 12*time.Second, fixtureOpts{wallets: 3,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.WalletWait = 20 * time.Second },
		wrap: func(st *journal.PostgresStore) journal.Store {
			h := &hookedStore{PostgresStore: st}
			hooked = append(hooked, h)
			return h
		}})
	leases := stableLeases(t, fx, engines, 3)
	holder, claimant, other := 0, 1, 2
	engines[holder].StallLeasesForTest() // takes no hand-off: the offer stays
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.permit2(payer, fx.uptoRequirements(leases[holder][0]), chain.Permit2Options{})

	ctx, cancel := context.WithCancel(context.Background())
	answers := make(chan settleAnswer, 1)
	go func() { s, err := engines[claimant].Settle(ctx, req); answers <- settleAnswer{s, err} }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		recs, err := hooked[other].PostgresStore.PendingOf(context.Background(), false)
		if err == nil && len(recs) == 1 && recs[0].OnOffer() {
			if recs[0].Handoff.Wallet != leases[holder][0].Hex() {
				t.Fatalf("the offer is bound to %q; want %s", recs[0].Handoff.Wallet, leases[holder][0].Hex())
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment was never handed off: %+v, %v", recs, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // a look or two sees it
	before := hooked[other].pendings.Load()
	const window = 2 * time.Second
	time.Sleep(window)
	looks := hooked[other].pendings.Load() - before
	cancel()
	<-answers
	// Reconciliation (every 200 ms here) and the usual looks (every 200 ms): some 20 reads in the window; looking
	// every 25 ms as after an offer it could take, some 90.
	if looks > 40 {
		t.Errorf("the engine read the pending records %d times in %v while the only offer was one it cannot take; want its usual pace (at most 40)", looks, window)
	}
	t.Logf("%d reads of the pending records in %v", looks, window)
}
