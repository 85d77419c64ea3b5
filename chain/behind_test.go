package chain_test

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestADeferredFinalAnswerLostInACrashEndsFinalFromTheChain: settled within a paid request that defers its journal
// writes (journal.Defer, as a gate on the same PostgreSQL journal does), the engine answers once the receipt is in
// and leaves its final answer and its hold's end queued, to ride with the gate's last write. The process dies
// before that write: the record stays broadcast in the database. Restarted, the engine must find it by its
// reconciliation and record it final from the chain's receipt, its hold ended, and send nothing again: the payer
// pays once.
func TestADeferredFinalAnswerLostInACrashEndsFinalFromTheChain(t *testing.T) {
	srv := pgtest.Start(t)
	// The final answer waits behind the request as long as the test looks at it, however loaded the machine: a
	// deferred write goes alone after MaxBehind.
	fx, join := clusterOn(t, srv.DSN(), 15*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute, maxBehind: 10 * time.Minute})
	f, st := join()
	waitLeases(t, fx, []*chain.Facilitator{f}, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	fx.c.Commit()
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	id := permit2ID(fx, req)
	payerBefore := fx.c.BalanceOf(fx.c.Token, payer.Address)
	sent := func() (n uint64) {
		for _, w := range fx.c.Wallets[:2] {
			nonce, err := fx.c.Client.NonceAt(context.Background(), w.Address, nil)
			if err != nil {
				t.Fatal(err)
			}
			n += nonce
		}
		return n
	}
	sentBefore := sent()

	ctx := journal.Defer(context.Background(), st)
	resp, err := f.Settle(ctx, x402.SettleRequest(req))
	if err != nil || !resp.Success {
		t.Fatalf("the settlement = %+v, %v; want its success", resp, err)
	}
	// The final answer is queued behind the request, not written: the record reads broadcast, its hold not ended.
	if r, ok, err := st.Get(context.Background(), id); err != nil || !ok || r.State != journal.StateBroadcast {
		t.Fatalf("after the engine answered, its record is %s (found %v, %v); want broadcast: its final answer waits for the request's next write", r.State, ok, err)
	}
	if mined, err := holdMined(srv.DSN(), id); err != nil || mined != "0" {
		t.Fatalf("the settlement's hold = %q, %v; want it there, its end deferred with the final answer", mined, err)
	}
	// The process dies before the request writes again: the queue goes with it.
	st.Close()
	f.Close()

	_, st2 := join()
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, ok, err := st2.Get(context.Background(), id)
		mined, herr := holdMined(srv.DSN(), id)
		if err == nil && ok && r.State == journal.StateFinal && herr == nil && mined != "0" {
			if r.Response == nil || !r.Response.Success || r.Response.Transaction != resp.Transaction {
				t.Fatalf("the record ends final answering %+v; want the answer given, %+v", r.Response, resp)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30 s after the restart the record is %s (found %v, %v) and its hold %q (%v); want final, the hold ended",
				r.State, ok, err, mined, herr)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // a second settlement, were one sent, would be mined by now
	if n := sent() - sentBefore; n != 1 {
		t.Fatalf("the settlement wallets sent %d transactions; want 1", n)
	}
	if lost := new(big.Int).Sub(payerBefore, fx.c.BalanceOf(fx.c.Token, payer.Address)); lost.Int64() != price {
		t.Fatalf("the payer lost %s; want the payment's amount %d, once", lost, price)
	}
}
