package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestASettlementTheNodeRefusesLetsGoOfItsHoldWithItsRecordThoughTheDatabaseStopsBetween: the node refuses the
// settlement's signed transaction, so its write-ahead record goes (journal.ReleaseUnsent) and its funds hold with
// it; the database stops as the hold's end waits for a lock. The engine wrote the record's deletion first and the
// hold's end after, in two transactions: the record went, the hold stayed, and nothing ends a hold whose payment the
// journal holds no record of (reconciliation looks at records, a gate at the holds it took itself) before the
// payment's deadline and the prune margin. A batch-settlement deposit, which no gate holds, kept two such holds to
// the end of the money-invariant run. Both go in one transaction now: stopped between, neither is written, and the
// broadcast record leads reconciliation to the payment, which ends as any settlement whose recording write was
// lost does (settlementEndsOnceTheDatabaseIsBack): its recorded bytes sent once the node takes them, the hold
// ended as mined.
func TestASettlementTheNodeRefusesLetsGoOfItsHoldWithItsRecordThoughTheDatabaseStopsBetween(t *testing.T) {
	srv := pgtest.Start(t)
	var proxy *chaintest.FaultProxy
	fx, engines, stores := sharedEnginesOn(t, srv.DSN(), 1, 15*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute, autoCommit: -1,
		chainOpts: []chaintest.Option{chaintest.WithHTTP()}, tune: behindFaultProxy(t, &proxy, false, 0)})
	waitLeases(t, fx, engines, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	fx.c.Commit()
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	id := permit2ID(fx, req)
	sent := fx.walletTxs()

	// The send reaches the node once the claim, the hold and the record of the signed transaction are written: the
	// hold's table is locked then, before the node's refusal lets the engine go on.
	arrived, locked := make(chan struct{}), make(chan struct{})
	refused := false
	proxy.SetDecide(func(method string) chaintest.Fault {
		if method != "eth_sendRawTransaction" {
			return chaintest.Pass
		}
		if !refused {
			refused = true
			close(arrived)
			<-locked
		}
		return chaintest.Refuse
	})
	settled := settleInBackground(engines[0], req)
	select {
	case <-arrived:
	case r := <-settled:
		t.Fatalf("the settlement ended before its transaction reached the node: %+v, %v", r.resp, r.err)
	case <-time.After(20 * time.Second):
		t.Fatal("the settlement's transaction never reached the node")
	}
	if mined, err := holdMined(srv.DSN(), id); err != nil || mined != "0" {
		close(locked)
		t.Fatalf("the settlement's hold as its transaction is sent = %q, %v; want one, not seen mined", mined, err)
	}
	unlock := lockTable(t, srv.DSN(), "x402_holds", "ACCESS EXCLUSIVE")
	defer unlock()
	close(locked)
	waitBlocked(t, srv.DSN(), "DELETE FROM x402_holds")
	srv.Stop(t)
	if r := <-settled; r.err == nil && r.resp.Success {
		t.Fatalf("the settlement the node refused = %+v; want no success", r.resp)
	}
	proxy.SetDecide(nil) // the node takes transactions again
	srv.Restart(t)
	settlementEndsOnceTheDatabaseIsBack(t, fx, srv.DSN(), stores[0], id, payer.Address, sent)
}

// TestASettlementWhoseRecordCouldNotBeForgottenKeepsItsHold: as above, the node refuses the settlement's signed
// transaction and its record and funds hold are let go of together; this time that one transaction fails while
// the database keeps answering (its statement cancelled as it waits for a lock). The record stays, and with it the
// recorded bytes that reconciliation sends: the hold must stay too. The engine took the failure for "nothing
// kept" and let go of the hold on its own right after, so the recorded settlement would have gone out later
// against funds counted free (the review of the change that wrote both in one transaction). Kept, reconciliation
// sends the recorded transaction once the node takes it and ends the hold as mined.
func TestASettlementWhoseRecordCouldNotBeForgottenKeepsItsHold(t *testing.T) {
	srv := pgtest.Start(t)
	var proxy *chaintest.FaultProxy
	fx, engines, stores := sharedEnginesOn(t, srv.DSN(), 1, 15*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute, autoCommit: -1,
		chainOpts: []chaintest.Option{chaintest.WithHTTP()}, tune: behindFaultProxy(t, &proxy, false, 0)})
	waitLeases(t, fx, engines, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	fx.c.Commit()
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	id := permit2ID(fx, req)
	sent := fx.walletTxs()

	arrived, locked := make(chan struct{}), make(chan struct{})
	refused := false
	proxy.SetDecide(func(method string) chaintest.Fault {
		if method != "eth_sendRawTransaction" {
			return chaintest.Pass
		}
		if !refused {
			refused = true
			close(arrived)
			<-locked
		}
		return chaintest.Refuse
	})
	settled := settleInBackground(engines[0], req)
	select {
	case <-arrived:
	case r := <-settled:
		t.Fatalf("the settlement ended before its transaction reached the node: %+v, %v", r.resp, r.err)
	case <-time.After(20 * time.Second):
		t.Fatal("the settlement's transaction never reached the node")
	}
	unlock := lockTable(t, srv.DSN(), "x402_holds", "ACCESS EXCLUSIVE")
	close(locked)
	waitBlocked(t, srv.DSN(), "DELETE FROM x402_holds")
	if err := query(srv.DSN(), func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND starts_with(query, 'DELETE FROM x402_holds')`)
		return err
	}); err != nil {
		unlock()
		t.Fatal(err)
	}
	unlock()
	if r := <-settled; r.err == nil && r.resp.Success {
		t.Fatalf("the settlement the node refused = %+v; want no success", r.resp)
	}
	rec, ok, err := stores[0].Get(context.Background(), id)
	mined, herr := holdMined(srv.DSN(), id)
	if err != nil || herr != nil {
		t.Fatalf("reading the record (%v) and the hold (%v)", err, herr)
	}
	if ok && mined == "" {
		t.Fatalf("after the settlement ended the record is kept (%s, transaction %s) and the hold is gone; want the hold kept with the record", rec.State, rec.TxHash)
	}
	proxy.SetDecide(nil) // the node takes transactions again
	settlementEndsOnceTheDatabaseIsBack(t, fx, srv.DSN(), stores[0], id, payer.Address, sent)
}
