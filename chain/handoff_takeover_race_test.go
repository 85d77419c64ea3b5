package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// TestAClaimantWhoseReconciliationTookOverItsDeadTakersSettlementWaitsForItsReceipt: the engine that took a
// payment handed off records its transaction and dies before the transaction leaves, while the claimant, still
// waiting, cannot read the record (its database answering no reads a while). The claimant is the one whose
// reconciliation takes the record over: the record is the claimant's claim again when it reads it next, and must
// not be read as given back by a taker that sent nothing, which lets the payer's funds hold go while the
// transaction, sent again by reconciliation, is in flight. The claimant answers with the settlement, once.
func TestAClaimantWhoseReconciliationTookOverItsDeadTakersSettlementWaitsForItsReceipt(t *testing.T) {
	hp := newHandoffPair(t, 30*time.Second, 20*time.Second)
	claimant, taker := hp.hooked[hp.claimant], hp.hooked[hp.taker]
	claimant.failGets.Store(true)
	hp.g.on.Store(true)
	before := hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo)

	answers := make(chan settleAnswer, 1)
	go func() {
		s, err := hp.engines[hp.claimant].Settle(context.Background(), hp.first)
		answers <- settleAnswer{s, err}
	}()
	select {
	case <-hp.g.entered:
	case <-time.After(15 * time.Second):
		t.Fatal("the taker never sent the settlement it was offered")
	}
	hp.waitRecord(t, "broadcast by the taker", func(r journal.Record) bool {
		return r.State == journal.StateBroadcast && r.Owner == taker.Instance()
	})
	taker.PostgresStore.Close() // the taker's process dies as its transaction would leave
	hp.waitRecord(t, "taken over by the claimant", func(r journal.Record) bool { return r.Owner == claimant.Instance() })
	claimant.failGets.Store(false)
	time.Sleep(300 * time.Millisecond) // the claimant reads it
	hp.secondIsRefusedForFunds(t, "the transaction sent again by the claimant's reconciliation in flight", hp.claimant)
	select {
	case a := <-answers:
		t.Errorf("the claimant answered %+v, %v while the settlement's transaction had not left; want it to wait for the receipt", a.s, a.err)
	default:
	}

	hp.g.on.Store(false)
	close(hp.g.release)
	select {
	case a := <-answers:
		if a.err != nil || !a.s.Success {
			t.Errorf("the claimant answered %+v, %v; want settled", a.s, a.err)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("the claimant never answered")
	}
	if got := hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo) - before; got != 1 {
		t.Errorf("%d transfers from the payer; want 1", got)
	}
}
