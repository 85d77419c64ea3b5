package chain_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAWaitOnABroadcastRecordWhoseTransactionTheNodeRefusedEndsWhenItsSenderForgetsIt: a settlement's record is
// written broadcast before its transaction is sent, and forgotten when the node refuses the transaction. Another
// engine that read the record in between waits for the outcome of a transaction that never left: it must learn
// from the record's going that nothing was sent, not wait out the receipt timeout (in the money-invariant run,
// such waits of a gateway's requests and background settlements after an RPC that refused transactions held its
// graceful stop past 20 s).
func TestAWaitOnABroadcastRecordWhoseTransactionTheNodeRefusedEndsWhenItsSenderForgetsIt(t *testing.T) {
	const receiptTimeout = 60 * time.Second
	const bound = 15 * time.Second // well within the receipt timeout; the wait it ends is the timeout's
	answerWithin := func(t *testing.T, who string, answers <-chan settleAnswer, from time.Time) settleAnswer {
		t.Helper()
		select {
		case a := <-answers:
			return a
		case <-time.After(bound):
			t.Fatalf("%s had no answer %v after the node refused the transaction it waits for (receipt timeout %v): it waits for the receipt of a transaction never sent",
				who, time.Since(from).Round(time.Second), receiptTimeout)
			return settleAnswer{}
		}
	}
	refuseHeldSend := func(t *testing.T, hp *handoffPair) time.Time {
		t.Helper()
		// The other engine reads the broadcast record meanwhile (a claimant reads it every 200 ms at most).
		time.Sleep(700 * time.Millisecond)
		hp.g.on.Store(false)
		close(hp.g.release)
		return time.Now()
	}

	// refusingPair is a hand-off pair whose every send is held, then refused, and the count of the payer's transfers
	// to the seller since.
	refusingPair := func(t *testing.T) (*handoffPair, func() int) {
		hp := newHandoffPair(t, receiptTimeout, 20*time.Second)
		hp.g.refuse.Store(true)
		hp.g.on.Store(true)
		before := hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo)
		return hp, func() int { return hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo) - before }
	}

	t.Run("the claimant of a hand-off whose taker the node refused", func(t *testing.T) {
		hp, transfers := refusingPair(t)
		answers := hp.settleAt(hp.claimant)
		hp.waitHeldSend(t, "the taker of the hand-off")
		from := refuseHeldSend(t, hp)
		a := answerWithin(t, "the claimant", answers, from)
		if a.err == nil || a.s.Success || !strings.Contains(a.err.Error(), "nothing was sent") {
			t.Errorf("the claimant answered %+v, %v; want an error saying nothing was sent", a.s, a.err)
		}
		if got := transfers(); got != 0 {
			t.Fatalf("%d transfers from the payer after a refused transaction; want none", got)
		}
		hp.g.refuse.Store(false)
		if again, err := hp.engines[hp.claimant].Settle(context.Background(), hp.first); err != nil || !again.Success {
			t.Fatalf("the payment presented again = %+v, %v; want settled", again, err)
		}
		if got := transfers(); got != 1 {
			t.Errorf("%d transfers from the payer; want 1", got)
		}
	})

	t.Run("a presentation answered from the record of another engine that the node refused", func(t *testing.T) {
		hp, transfers := refusingPair(t)
		first := hp.settleAt(hp.taker)
		hp.waitHeldSend(t, "the engine holding the wallet")
		again := hp.settleAt(hp.claimant)
		from := refuseHeldSend(t, hp)
		if a := answerWithin(t, "the engine that sent it", first, from); a.s.Success {
			t.Errorf("the settlement the node refused answered %+v; want no success", a.s)
		}
		a := answerWithin(t, "the presentation at the other engine", again, from)
		if a.err != nil || !a.s.Success {
			t.Errorf("the payment presented at the other engine as the first settlement was refused = %+v, %v; want settled afresh", a.s, a.err)
		}
		if got := transfers(); got != 1 {
			t.Errorf("%d transfers from the payer; want 1", got)
		}
		if a.s.ErrorReason == x402.ReasonSettlementPending {
			t.Errorf("answered pending for a transaction never sent")
		}
	})
}
