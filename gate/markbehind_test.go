package gate_test

import (
	"context"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// holdsOf are the funds holds the shared journal st keeps against payer's funds of e's token.
func holdsOf(t *testing.T, e *env, st journal.Cluster, payer *chaintest.Account) []journal.Hold {
	t.Helper()
	holds, err := st.HoldsOf(context.Background(), e.net+":"+e.c.Token.Hex()+":"+payer.Address.Hex())
	if err != nil {
		t.Fatal(err)
	}
	return holds
}

// alreadyUsedAnswer fails the test unless a is a 402 whose PAYMENT-REQUIRED says payment_already_used, with what.
func alreadyUsedAnswer(t *testing.T, what string, a answer, says string) {
	t.Helper()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil || !strings.HasPrefix(pr.Error, x402.ReasonPaymentAlreadyUsed) || !strings.Contains(pr.Error, says) {
		t.Fatalf("%s = %d %q, PAYMENT-REQUIRED %+v (%v); want 402 %s saying %q", what, a.status, a.body, pr.Error, err, x402.ReasonPaymentAlreadyUsed, says)
	}
}

// TestAPaymentAnotherGatewayHasInFlightHoldsNothingOfThePayersFunds: a settle async gateway marks a payment in
// flight in the engine's batch of its verification, which holds the payment against the payer's funds. Presented
// while another gateway has it in flight, the payment is turned away (402, in use by another request) and must
// hold nothing: the other gateway's request may end without holding it (its verification refused, say), and a
// hold left by the one turned away would count against the payer until the payment's deadline, nobody to let it
// go. The payer, who can pay one price, is then served a new payment.
func TestAPaymentAnotherGatewayHasInFlightHoldsNothingOfThePayersFunds(t *testing.T) {
	gws := twoGateways(t, gate.SettleAsync, chaintest.WithTokenBalance(big.NewInt(price)))
	e := gws[0]
	st := e.store.(journal.Cluster)
	other := gws[1].store.(journal.Cluster)
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	gateID, _ := paymentIDs(t, e, header)
	if marked, err := other.Busy(context.Background(), gateID); err != nil || !marked {
		t.Fatalf("the other gateway's mark = %v, %v", marked, err)
	}

	alreadyUsedAnswer(t, "a payment another gateway has in flight", e.get(x402.HeaderPaymentSignature, header), "another request")
	if holds := holdsOf(t, e, st, payer); len(holds) != 0 {
		t.Errorf("the payer's funds holds = %+v; want none: the request turned away held the payment", holds)
	}
	// The other gateway's request ends without serving it.
	if err := other.Idle(context.Background(), gateID); err != nil {
		t.Fatal(err)
	}
	before := e.balances(payer)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
		t.Fatalf("a new payment of the payer, who can pay it = %d %q (%s); want 200", a.status, a.body, pr.Error)
	}
	e.waitPaidOnce(t, payer, before, price, 30*time.Second)
}

// TestAnAsyncPaymentPresentedAgainBeforeItSettlesKeepsItsOneHold: a settle async payment is served and not settled
// yet: the gate holds its record, the engine none, and its funds hold is the one the first presentation took.
// Presented again, its verification now runs before the gate reads its record: the answer is as it always was (402,
// the payment bought its response already), and the hold stays the one, neither counted twice nor let go. Once
// settlement resumes, the payment settles once.
func TestAnAsyncPaymentPresentedAgainBeforeItSettlesKeepsItsOneHold(t *testing.T) {
	st, err := journal.OpenPostgres(context.Background(), pgtest.Shared(t), journal.Options{InstanceTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	e := newEnv(t, setup{settle: gate.SettleAsync, journal: st})
	waitShares(t, e)
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	gateID, engineID := paymentIDs(t, e, header)
	before := e.balances(payer)
	resume := ledgers.PauseBackgroundSettlement()
	resumed := false
	defer func() {
		if !resumed {
			resume()
		}
	}()

	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q; want 200", a.status, a.body)
	}
	waitRecord(t, st, gateID, "the served mark", func(r journal.Record) bool { return r.Served })
	if _, found, err := st.Get(context.Background(), engineID); err != nil || found {
		t.Fatalf("the engine's record before settlement: found %v, %v; want none", found, err)
	}
	first := holdsOf(t, e, st, payer)
	if len(first) != 1 || first[0].ID != engineID || first[0].Amount.Int64() != price || !first[0].Served {
		t.Fatalf("the payer's funds holds = %+v; want the payment's, served, of %d", first, price)
	}
	for i := range 3 {
		alreadyUsedAnswer(t, "the payment presented again", e.get(x402.HeaderPaymentSignature, header), "already bought its response")
		if holds := holdsOf(t, e, st, payer); len(holds) != 1 || holds[0].ID != engineID || holds[0].Amount.Cmp(first[0].Amount) != 0 || !holds[0].Served {
			t.Fatalf("presentation %d again: the payer's funds holds = %+v; want the first presentation's alone, as it was (%+v)", i, holds, first)
		}
	}
	if n := e.served.Load(); n != 1 {
		t.Fatalf("the upstream ran %d times; want once", n)
	}
	resume()
	resumed = true
	e.waitPaidOnce(t, payer, before, price, 30*time.Second)
}

// TestASettledPaymentPresentedAgainIsAnsweredFromItsRecordAsItAlwaysWas: a payment settled and served is presented
// again to its gateway, whose in-flight mark and read of the record now ride in the engine's verification, which
// runs before the gate knows the payment is recorded and refuses it (its nonce spent by its own settlement). The
// answer is the one it always was, from the record (402 payment_already_used, the payment bought its response
// already, no PAYMENT-RESPONSE), in every settle mode; and the engine notes no refusal of it on the operator's page
// (journal.WhenMarked): nothing was refused, the payment was answered as presented again.
func TestASettledPaymentPresentedAgainIsAnsweredFromItsRecordAsItAlwaysWas(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleBefore, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			st, err := journal.OpenPostgres(context.Background(), pgtest.Shared(t), journal.Options{InstanceTTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			e := newEnv(t, setup{settle: settle, journal: st})
			waitShares(t, e)
			payer := e.c.Payers[0]
			before := e.balances(payer)
			header := e.permit2(payer)
			gateID, _ := paymentIDs(t, e, header)
			if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
				t.Fatalf("the payment = %d %q; want 200", a.status, a.body)
			}
			e.waitPaidOnce(t, payer, before, price, 30*time.Second)
			waitRecord(t, st, gateID, "the payment settled and served", func(r journal.Record) bool {
				return r.Served && r.State == journal.StateFinal && r.Response != nil && r.Response.Success
			})
			for i := range 2 {
				a := e.get(x402.HeaderPaymentSignature, header)
				alreadyUsedAnswer(t, "the settled payment presented again", a, "already bought its response")
				if pr := a.header.Get(x402.HeaderPaymentResponse); pr != "" {
					t.Fatalf("presentation %d again carries PAYMENT-RESPONSE %q; want none", i, pr)
				}
			}
			h, err := e.fac.Health(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if h.Refusals == nil || h.Refusals.Total != 0 {
				t.Fatalf("the engine's refusals = %+v; want none: the payment presented again was answered from its record", h.Refusals)
			}
			if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
				t.Fatalf("the payer lost %s and the seller gained %s; want exactly %d", lost, gained, price)
			}
			if n := e.served.Load(); n != 1 {
				t.Fatalf("the upstream ran %d times; want once", n)
			}
		})
	}
}

// markWatcher is the engine as a gate sees another facilitator: sharesJournal says whether it keeps the gate's
// journal, and each verification notes whether the journal held the gate's in-flight mark of the payment by then.
type markWatcher struct {
	*chain.Facilitator
	sharesJournal bool
	conn          *pgx.Conn
	owner         string
	id            journal.ID
	mu            sync.Mutex
	markedFirst   []bool
}

func (w *markWatcher) SharesJournal(s journal.Store) bool {
	return w.sharesJournal && w.Facilitator.SharesJournal(s)
}

func (w *markWatcher) Verify(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	var owner string
	err := w.conn.QueryRow(context.Background(), `SELECT owner FROM x402_busy WHERE id = $1`, w.id[:]).Scan(&owner)
	w.mu.Lock()
	w.markedFirst = append(w.markedFirst, err == nil && owner == w.owner)
	w.mu.Unlock()
	return w.Facilitator.Verify(ctx, req)
}

// TestOnlyAGateOnItsEnginesJournalMarksAPaymentWhileItVerifies: the in-flight mark rides in the verification only
// where the embedded engine keeps the gate's own PostgreSQL journal. A gate whose facilitator is remote, or an
// engine keeping another journal, marks the payment in the journal before it asks for the verification, as it
// always did; each serves the payment once.
func TestOnlyAGateOnItsEnginesJournalMarksAPaymentWhileItVerifies(t *testing.T) {
	dsn := pgtest.Shared(t)
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	for _, tc := range []struct {
		name                    string
		embedded, sharesJournal bool
		wantMarkedFirst         bool
	}{
		{"a remote facilitator", false, true, true},
		{"an engine keeping another journal", true, false, true},
		{"the engine keeping the gate's journal", true, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{InstanceTTL: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			e := newEnv(t, setup{settle: gate.SettleAfter, journal: st, noGate: true})
			e.cfg.Embedded = tc.embedded
			w := &markWatcher{Facilitator: e.fac, sharesJournal: tc.sharesJournal, conn: conn, owner: st.Instance()}
			e.startGateWith(w)
			waitShares(t, e)
			payer := e.c.Payers[0]
			before := e.balances(payer)
			header := e.permit2(payer)
			w.id, _ = paymentIDs(t, e, header)
			if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
				t.Fatalf("the payment = %d %q; want 200", a.status, a.body)
			}
			e.waitPaidOnce(t, payer, before, price, 30*time.Second)
			w.mu.Lock()
			defer w.mu.Unlock()
			if len(w.markedFirst) != 1 || w.markedFirst[0] != tc.wantMarkedFirst {
				t.Fatalf("the journal held the gate's mark when the payment was verified: %v; want %v", w.markedFirst, tc.wantMarkedFirst)
			}
		})
	}
}
