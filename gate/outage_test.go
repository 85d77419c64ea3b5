package gate_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAnAsyncPaymentThatSettlesWhileTheJournalIsDownIsRecordedFinalOnceItIsBack: a settle async payment is served
// and its settlement sent; PostgreSQL stops while the transaction waits for its block, and the settlement ends
// (mined) while the database is down, so the gate's final write of the payment cannot land. Once the database is
// back the gate's record must become final with the settlement, leaving the backlog (the money-invariant run found
// one left claimed for ever, every gateway's journal backlog at 1), and no funds hold may be left unmined.
func TestAnAsyncPaymentThatSettlesWhileTheJournalIsDownIsRecordedFinalOnceItIsBack(t *testing.T) {
	srv := pgtest.Start(t)
	st, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{OpenTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	// Blocks are sealed by the test: the settlement waits in the node's pool until the database is down.
	c := chaintest.New(t)
	e := newEnv(t, setup{settle: gate.SettleAsync, journal: st, chain: c})
	payer := c.Payers[0]
	h := e.permit2(payer)
	before := e.balances(payer)
	gateID, engineID := paymentIDs(t, e, h)

	if a := e.get(x402.HeaderPaymentSignature, h); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the async payment = %d %q; want 200 with the content, served before it settles", a.status, a.body)
	}
	waitRecord(t, st, engineID, "the settlement sent and waiting for its block", func(r journal.Record) bool { return r.State == journal.StateBroadcast })
	waitRecord(t, st, gateID, "the gate's record served", func(r journal.Record) bool { return r.Served })

	srv.Stop(t)
	c.Commit()
	deadline := time.Now().Add(10 * time.Second)
	for lost, _ := e.paid(payer, before); lost.Int64() != price; lost, _ = e.paid(payer, before) {
		if time.Now().After(deadline) {
			t.Fatalf("the settlement did not mine: the payer lost %s", lost)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The settlement ends, with the journal out of reach, a few milliseconds after its block.
	time.Sleep(time.Second)
	srv.Restart(t)
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))

	var rec journal.Record
	deadline = time.Now().Add(30 * time.Second)
	for {
		r, ok, err := st.Get(context.Background(), gateID)
		if err == nil && ok && r.State == journal.StateFinal && e.gate.Ledger().Backlog() == 0 {
			rec = r
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("30 s after the database came back the gate's record of the settled payment is %s (found %v, %v), backlog %d; want final, the backlog 0",
				r.State, ok, err, e.gate.Ledger().Backlog())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if rec.Response == nil || !rec.Response.Success || rec.Response.Transaction == "" {
		t.Fatalf("the gate's final record answers %+v; want the settlement's success with its transaction", rec.Response)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Fatalf("the payer lost %s and the seller gained %s; want %d once", lost, gained, price)
	}
	waitNoHoldLeft(t, srv.DSN(), engineID)
	if a := e.get(x402.HeaderPaymentSignature, h); a.status != http.StatusPaymentRequired {
		t.Fatalf("presented again = %d %q; want 402: it bought its response", a.status, a.body)
	}
}

// paymentIDs are the journal ids of a permit2 payment header: the gate's record and the engine's settlement.
func paymentIDs(t *testing.T, e *env, header string) (gateID, engineID journal.ID) {
	t.Helper()
	p, err := x402.DecodePaymentPayload(header)
	if err != nil {
		t.Fatal(err)
	}
	from, nonce := p.Payload.PayerAndNonce()
	return journal.PaymentID(e.net, "gate/"+x402.TransferPermit2, p.Accepted.Asset, from, nonce),
		journal.PaymentID(e.net, x402.TransferPermit2, p.Accepted.Asset, from, nonce)
}

// waitRecord waits until the journal's record of id is as ok says.
func waitRecord(t *testing.T, st journal.Store, id journal.ID, what string, ok func(journal.Record) bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		r, found, err := st.Get(context.Background(), id)
		if err == nil && found && ok(r) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waiting for %s: the record is %+v (found %v, %v)", what, r, found, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitNoHoldLeft waits until the database at dsn holds no funds hold of payment id that its settlement did not end
// (not seen mined), as after quiescence none may be.
func waitNoHoldLeft(t *testing.T, dsn string, id journal.ID) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		mined, err := holdMined(dsn, id)
		if err == nil && mined != "0" {
			return // none, or seen mined
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment's funds hold is still there, not seen mined (%v): the payer's funds look spent for ever", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// holdMined reads the mined block of payment id's hold; "" when there is none.
func holdMined(dsn string, id journal.ID) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	var mined string
	err = conn.QueryRow(ctx, `SELECT mined::text FROM x402_holds WHERE id = $1`, id[:]).Scan(&mined)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return mined, err
}

// TestAHoldWhoseReleaseTheOutageLostEndsOnceTheJournalIsBack: PostgreSQL stops after a settle async payment was
// verified and held, before the gate records it: the gate answers 502 (nothing charged), and neither its release
// of the funds hold nor its clearing of the payment's in-flight mark can reach the database. Once the database is
// back both must end: the money-invariant run found the hold left until its deadline (the payer's funds counted
// spent meanwhile) and the mark telling every other gateway "another request is presenting this payment right
// now". Presented again afterwards, the payment is served and its new hold stays until its settlement is mined:
// the retried release must not take a hold a later presentation took.
func TestAHoldWhoseReleaseTheOutageLostEndsOnceTheJournalIsBack(t *testing.T) {
	srv := pgtest.Start(t)
	st, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{OpenTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var stopped atomic.Bool
	e := newEnv(t, setup{settle: gate.SettleAsync, journal: st, config: func(c *gate.Config) {
		c.Event = func(r *http.Request, name string, data func() map[string]any) {
			if name == gate.EventVerified && stopped.CompareAndSwap(false, true) {
				srv.Stop(t) // held already, not recorded yet
			}
		}
	}})
	payer := e.c.Payers[0]
	h := e.permit2(payer)
	before := e.balances(payer)
	gateID, engineID := paymentIDs(t, e, h)

	if a := e.get(x402.HeaderPaymentSignature, h); a.status != http.StatusBadGateway {
		t.Fatalf("the payment with the journal stopping = %d %q; want 502, nothing charged", a.status, a.body)
	}
	srv.Restart(t)

	// Another gateway sharing the journal: it may take the payment as soon as the mark is cleared.
	other, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{OpenTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	deadline := time.Now().Add(15 * time.Second)
	for {
		mined, herr := holdMined(srv.DSN(), engineID)
		busy, berr := busyOwner(srv.DSN(), gateID)
		if herr == nil && berr == nil && mined == "" && busy == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("15 s after the database came back the payment's hold is %q (%v) and its in-flight mark %q (%v); want both gone: nothing will settle it",
				mined, herr, busy, berr)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if mine, err := other.Busy(context.Background(), gateID); err != nil || !mine {
		t.Fatalf("another gateway marking the payment = %v, %v; want it free", mine, err)
	}
	if err := other.Idle(context.Background(), gateID); err != nil {
		t.Fatal(err)
	}

	if a := e.get(x402.HeaderPaymentSignature, h); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("presented again once the database is back = %d %q; want 200 with the content", a.status, a.body)
	}
	deadline = time.Now().Add(10 * time.Second)
	for lost, _ := e.paid(payer, before); lost.Int64() != price; lost, _ = e.paid(payer, before) {
		if time.Now().After(deadline) {
			t.Fatalf("the payment presented again did not settle: the payer lost %s", lost)
		}
		time.Sleep(10 * time.Millisecond)
	}
	waitNoHoldLeft(t, srv.DSN(), engineID)
}

// busyOwner reads the owner of payment id's in-flight mark; "" when there is none.
func busyOwner(dsn string, id journal.ID) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	var owner string
	err = conn.QueryRow(ctx, `SELECT owner FROM x402_busy WHERE id = $1`, id[:]).Scan(&owner)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	return owner, err
}

// TestALeftHoldIsNotTakenFromALaterPresentation: as above, but the payment is presented again as soon as the
// database is back, before the release the outage lost is tried again, and is served; its settlement waits for
// its block. The hold it took over (the same row) must stay until the settlement is mined: a retried release
// that deleted the payment's hold regardless would leave a served, unsettled payment counting nothing against
// its payer.
func TestALeftHoldIsNotTakenFromALaterPresentation(t *testing.T) {
	srv := pgtest.Start(t)
	st, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{OpenTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	c := chaintest.New(t) // blocks are sealed by the test
	var stopped atomic.Bool
	e := newEnv(t, setup{settle: gate.SettleAsync, journal: st, chain: c, config: func(c *gate.Config) {
		c.Event = func(r *http.Request, name string, data func() map[string]any) {
			if name == gate.EventVerified && stopped.CompareAndSwap(false, true) {
				srv.Stop(t)
			}
		}
	}})
	payer := c.Payers[0]
	h := e.permit2(payer)
	before := e.balances(payer)
	gateID, engineID := paymentIDs(t, e, h)
	if a := e.get(x402.HeaderPaymentSignature, h); a.status != http.StatusBadGateway {
		t.Fatalf("the payment with the journal stopping = %d %q; want 502, nothing charged", a.status, a.body)
	}
	srv.Restart(t)
	// The leftover loop may be holding the payment's mark a moment: the payer is told to wait, and presents again.
	a := e.get(x402.HeaderPaymentSignature, h)
	for i := 0; i < 50 && a.status == http.StatusPaymentRequired && strings.Contains(a.body, "presenting this payment right now"); i++ {
		time.Sleep(20 * time.Millisecond)
		a = e.get(x402.HeaderPaymentSignature, h)
	}
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("presented again once the database is back = %d %q; want 200 with the content", a.status, a.body)
	}
	waitRecord(t, st, gateID, "the gate's record served", func(r journal.Record) bool { return r.Served })
	time.Sleep(2 * time.Second) // the leftovers are tried again meanwhile
	if mined, err := holdMined(srv.DSN(), engineID); err != nil || mined != "0" {
		t.Fatalf("the served payment's hold, its settlement not mined, reads %q (%v); want it held", mined, err)
	}
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	deadline := time.Now().Add(10 * time.Second)
	for lost, _ := e.paid(payer, before); lost.Int64() != price; lost, _ = e.paid(payer, before) {
		if time.Now().After(deadline) {
			t.Fatalf("the payment presented again did not settle: the payer lost %s", lost)
		}
		time.Sleep(10 * time.Millisecond)
	}
	waitNoHoldLeft(t, srv.DSN(), engineID)
}
