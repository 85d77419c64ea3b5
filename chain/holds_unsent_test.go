package chain_test

import (
	"context"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
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
	h := refusedSettlementHeldAtItsSend(t)
	if mined, err := holdMined(h.srv.DSN(), h.id); err != nil || mined != "0" {
		close(h.locked)
		t.Fatalf("the settlement's hold as its transaction is sent = %q, %v; want one, not seen mined", mined, err)
	}
	unlock := lockTable(t, h.srv.DSN(), "x402_holds", "ACCESS EXCLUSIVE")
	defer unlock()
	close(h.locked)
	waitBlocked(t, h.srv.DSN(), "DELETE FROM x402_holds")
	h.srv.Stop(t)
	if r := <-h.settled; r.err == nil && r.resp.Success {
		t.Fatalf("the settlement the node refused = %+v; want no success", r.resp)
	}
	h.proxy.SetDecide(nil) // the node takes transactions again
	h.srv.Restart(t)
	settlementEndsOnceTheDatabaseIsBack(t, h.fx, h.srv.DSN(), h.stores[0], h.id, h.payer, h.sent)
}

// TestASettlementWhoseRecordCouldNotBeForgottenKeepsItsHold: as above, the node refuses the settlement's signed
// transaction and its record and funds hold are let go of together; this time that one transaction fails while
// the database keeps answering (its statement cancelled as it waits for a lock). The record stays, and with it the
// recorded bytes that reconciliation sends: the hold must stay too. The engine took the failure for "nothing
// kept" and let go of the hold on its own right after, so the recorded settlement would have gone out later
// against funds counted free (the review of the change that wrote both in one transaction). Kept, reconciliation
// sends the recorded transaction once the node takes it and ends the hold as mined.
func TestASettlementWhoseRecordCouldNotBeForgottenKeepsItsHold(t *testing.T) {
	h := refusedSettlementHeldAtItsSend(t)
	unlock := lockTable(t, h.srv.DSN(), "x402_holds", "ACCESS EXCLUSIVE")
	close(h.locked)
	waitBlocked(t, h.srv.DSN(), "DELETE FROM x402_holds")
	if err := query(h.srv.DSN(), func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND starts_with(query, 'DELETE FROM x402_holds')`)
		return err
	}); err != nil {
		unlock()
		t.Fatal(err)
	}
	unlock()
	if r := <-h.settled; r.err == nil && r.resp.Success {
		t.Fatalf("the settlement the node refused = %+v; want no success", r.resp)
	}
	rec, ok, err := h.stores[0].Get(context.Background(), h.id)
	mined, herr := holdMined(h.srv.DSN(), h.id)
	if err != nil || herr != nil {
		t.Fatalf("reading the record (%v) and the hold (%v)", err, herr)
	}
	if ok && mined == "" {
		t.Fatalf("after the settlement ended the record is kept (%s, transaction %s) and the hold is gone; want the hold kept with the record", rec.State, rec.TxHash)
	}
	h.proxy.SetDecide(nil) // the node takes transactions again
	settlementEndsOnceTheDatabaseIsBack(t, h.fx, h.srv.DSN(), h.stores[0], h.id, h.payer, h.sent)
}

// TestARefusedSettlementLeavesAHoldOfItsPaymentTakenSinceItsReleaseAlone: the node refuses the settlement's
// signed transaction, and its record and funds hold go together (journal.ReleaseUnsentUnhold). The payment is new
// to the journal again: another settlement of it (a concurrent /settle at another gateway, an adopting gateway)
// may claim and hold it at once, which the test stands for by a hold of the payment written the moment the
// release commits (a deferred trigger, in the release's own commit). The engine then deleted the payment's hold by
// its id once more as the settlement ended, the new one with it: funds counted free that a live settlement needs.
// It must leave that hold alone.
func TestARefusedSettlementLeavesAHoldOfItsPaymentTakenSinceItsReleaseAlone(t *testing.T) {
	h := refusedSettlementHeldAtItsSend(t)
	if err := query(h.srv.DSN(), func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `
CREATE TABLE held_again (done boolean NOT NULL);
INSERT INTO held_again VALUES (false);
CREATE FUNCTION hold_again() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	UPDATE held_again SET done = true WHERE NOT done;
	IF FOUND THEN
		INSERT INTO x402_holds SELECT (OLD).*;
	END IF;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER hold_again AFTER DELETE ON x402_holds DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_again();`)
		return err
	}); err != nil {
		close(h.locked)
		t.Fatal(err)
	}
	close(h.locked)
	if r := <-h.settled; r.err == nil && r.resp.Success {
		t.Fatalf("the settlement the node refused = %+v; want no success", r.resp)
	}
	if _, ok, err := h.stores[0].Get(context.Background(), h.id); err != nil || ok {
		t.Fatalf("the refused settlement's record is kept (%v, %v); want it released", ok, err)
	}
	var again bool
	if err := query(h.srv.DSN(), func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT done FROM held_again`).Scan(&again)
	}); err != nil || !again {
		t.Fatalf("the payment was not held again as the release committed (%v, %v)", again, err)
	}
	if mined, err := holdMined(h.srv.DSN(), h.id); err != nil || mined != "0" {
		t.Fatalf("the hold of the payment taken after the refused settlement's release = %q, %v; want it kept, not seen mined", mined, err)
	}
}

// heldRefusal is a settlement whose signed transaction reached the node, which holds it and refuses it once the
// test closes locked: its claim, funds hold and write-ahead record are written by then.
type heldRefusal struct {
	srv     *pgtest.Server
	fx      *fixture
	stores  []*journal.PostgresStore
	proxy   *chaintest.FaultProxy
	id      journal.ID
	payer   common.Address
	sent    []uint64
	settled <-chan settleResult
	locked  chan struct{}
}

// refusedSettlementHeldAtItsSend starts one engine on a PostgreSQL of its own behind an RPC fault proxy and settles a
// permit2 payment whose send the node holds until locked is closed, then refuses (and refuses every later send).
func refusedSettlementHeldAtItsSend(t *testing.T) heldRefusal {
	t.Helper()
	r := heldRefusal{srv: pgtest.Start(t), locked: make(chan struct{})}
	fx, engines, stores := sharedEnginesOn(t, r.srv.DSN(), 1, 15*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute, autoCommit: -1,
		chainOpts: []chaintest.Option{chaintest.WithHTTP()}, tune: behindFaultProxy(t, &r.proxy, false, 0)})
	r.fx, r.stores = fx, stores
	waitLeases(t, fx, engines, 2)
	payer := fx.c.Payers[0]
	r.payer = payer.Address
	fx.approvePermit2(payer)
	fx.c.Commit()
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	r.id = permit2ID(fx, req)
	r.sent = fx.walletTxs()

	arrived := make(chan struct{})
	refused := false
	r.proxy.SetDecide(func(method string) chaintest.Fault {
		if method != "eth_sendRawTransaction" {
			return chaintest.Pass
		}
		if !refused {
			refused = true
			close(arrived)
			<-r.locked
		}
		return chaintest.Refuse
	})
	r.settled = settleInBackground(engines[0], req)
	select {
	case <-arrived:
	case res := <-r.settled:
		t.Fatalf("the settlement ended before its transaction reached the node: %+v, %v", res.resp, res.err)
	case <-time.After(20 * time.Second):
		t.Fatal("the settlement's transaction never reached the node")
	}
	return r
}
