package gate_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestADeferredGateRecordThatFindsAnotherRequestsLeavesNoEngineClaim: on a PostgreSQL journal the gate's record of a
// payment rides in the batch of the embedded engine's claim (journal.ClaimBehind). When another request recorded
// the payment between this one's look-up and its record, the record's insert must fail the batch, so that the
// engine's claim is not written and nothing is sent, and the request is answered as a record that found another's
// always was: the payment is in use by another request (402 payment_already_used), the payer charged nothing.
func TestADeferredGateRecordThatFindsAnotherRequestsLeavesNoEngineClaim(t *testing.T) {
	st, err := journal.OpenPostgres(context.Background(), pgtest.Shared(t), journal.Options{InstanceTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var gateID, engineID journal.ID
	var e *env
	e = newEnv(t, setup{settle: gate.SettleAfter, journal: st, upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		// Another request of the same payment records it now, after this one found no record and before it
		// writes its own.
		_, claimed, err := st.Claim(context.Background(), journal.Record{ID: gateID, State: journal.StateClaimed, Owner: "another request",
			Network: e.net, Payer: e.c.Payers[0].Address.Hex(), Amount: "1"})
		if err != nil || !claimed {
			t.Errorf("the other request's record: claimed %v, %v", claimed, err)
		}
		_, err = w.Write([]byte("paid content"))
		return err
	})})
	waitShares(t, e)
	payer := e.c.Payers[0]
	header := e.signFor(payer, e.required(x402.TransferPermit2))
	gateID, engineID = paymentIDs(t, e, header)
	before := e.balances(payer)

	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("a payment another request recorded meanwhile = %d %q; want 402, the payment in use by another request", a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || !strings.HasPrefix(pr.Error, x402.ReasonPaymentAlreadyUsed) || !strings.Contains(pr.Error, "another request") {
		t.Fatalf("the 402's PAYMENT-REQUIRED = %+v, %v; want it to say another request presented the payment", pr, err)
	}
	if r, found, err := st.Get(context.Background(), engineID); err != nil || found {
		t.Fatalf("the engine's record of the payment = %+v (found %v, %v); want none: the gate's record that failed stops the engine's claim with it", r, found, err)
	}
	if r, found, err := st.Get(context.Background(), gateID); err != nil || !found || r.Owner != "another request" {
		t.Fatalf("the gate's record = %+v (found %v, %v); want the other request's, untouched", r, found, err)
	}
	time.Sleep(200 * time.Millisecond)
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Fatalf("the payer lost %s and the seller gained %s; want nothing sent", lost, gained)
	}
}

// TestADeferredFinalAnswerDoesNotWaitOnASlowUpstream: settled before its upstream runs, a payment's final answer
// (and its funds hold's end) is deferred to ride with the gate's last write, after the upstream. An upstream that
// takes its time must not keep it unwritten: within about a second it goes alone, so the payer's funds do not look
// held meanwhile, and the record reads final while the upstream still works.
func TestADeferredFinalAnswerDoesNotWaitOnASlowUpstream(t *testing.T) {
	st, err := journal.OpenPostgres(context.Background(), pgtest.Shared(t), journal.Options{InstanceTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var engineID journal.ID
	var during journal.Record
	var duringErr error
	e := newEnv(t, setup{settle: gate.SettleBefore, journal: st, upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(1500 * time.Millisecond)
		during, _, duringErr = st.Get(context.Background(), engineID)
		_, err := w.Write([]byte("paid content"))
		return err
	})})
	waitShares(t, e)
	payer := e.c.Payers[0]
	header := e.signFor(payer, e.required(x402.TransferPermit2))
	_, engineID = paymentIDs(t, e, header)
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q; want 200", a.status, a.body)
	}
	if duringErr != nil || during.State != journal.StateFinal || during.Response == nil || !during.Response.Success {
		t.Fatalf("1.5 s into the upstream, after the payment settled, the engine's record is %s answering %+v (%v); want final, its deferred write sent alone",
			during.State, during.Response, duringErr)
	}
}
