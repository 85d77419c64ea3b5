package gate_test

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAPaymentWhoseFinalAnswerIsDeferredIsServedOnceAcrossGateways: settled before its upstream runs on a
// PostgreSQL journal, a payment's engine final answer is deferred (journal.UpdateKnownHoldMinedBehind) until the
// gate's last write while the upstream works. Presented meanwhile at another gateway of the cluster, the payment
// must be refused as in use (402), not settled or served a second time; presented again there once the first
// request answered, it must be refused as served. The payer pays once, the upstreams run once, and the engine's
// record ends final, its answer the one the payer was given.
func TestAPaymentWhoseFinalAnswerIsDeferredIsServedOnceAcrossGateways(t *testing.T) {
	var runs atomic.Int64
	started := make(chan struct{}, 4)
	slow := gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		runs.Add(1)
		started <- struct{}{}
		time.Sleep(600 * time.Millisecond)
		_, err := w.Write([]byte("paid content"))
		return err
	})
	gws := gatewaysOf(t, []setup{{settle: gate.SettleBefore, upstream: slow}, {settle: gate.SettleBefore, upstream: slow}})
	payer := gws[0].c.Payers[1]
	header := gws[0].permit2(payer)
	_, engineID := paymentIDs(t, gws[0], header)
	before := gws[0].balances(payer)

	first := make(chan answer, 1)
	go func() { first <- gws[0].get(x402.HeaderPaymentSignature, header) }()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the first request's upstream never ran")
	}
	if rec, _, err := gws[1].store.Get(context.Background(), engineID); err != nil || rec.State != journal.StateBroadcast {
		t.Logf("while the first upstream runs the engine's record is %s (%v)", rec.State, err)
	}
	if a := gws[1].get(x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
		t.Fatalf("the payment presented at another gateway while its first request served it = %d %q; want 402, in use", a.status, a.body)
	}
	if a := <-first; a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the first request = %d %q; want 200", a.status, a.body)
	}
	for i, g := range gws {
		if a := g.get(x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
			t.Fatalf("the payment presented again at gateway %d after it was served = %d %q; want 402", i, a.status, a.body)
		}
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the upstreams ran %d times for one payment; want 1", n)
	}
	gws[0].waitPaidOnce(t, payer, before, price, 10*time.Second)
	// Written with the gate's served mark, once the response is out: the client may read it first.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		rec, found, err := gws[1].store.Get(context.Background(), engineID)
		if err == nil && found && rec.State == journal.StateFinal && rec.Response != nil && rec.Response.Success {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the engine's record after the request = %s %+v (found %v, %v); want final, settled", rec.State, rec.Response, found, err)
		}
	}
}

// TestAClientGoneWhileAPaymentsFinalAnswerIsDeferredGetsItServedOnceWhenPresentedAgain: the client of a payment
// settled before its upstream runs hangs up while the upstream works (the engine's final answer deferred). The
// payment is not served, and the request's deferred writes still land: presented again at another gateway, it is
// served without being charged again, and then never again.
func TestAClientGoneWhileAPaymentsFinalAnswerIsDeferredGetsItServedOnceWhenPresentedAgain(t *testing.T) {
	var runs atomic.Int64
	started := make(chan struct{}, 4)
	hangs := gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if runs.Add(1) == 1 {
			started <- struct{}{}
			<-r.Context().Done() // the client hung up: the upstream's request ends with it, as reverse_proxy's does
			return r.Context().Err()
		}
		_, err := w.Write([]byte("paid content"))
		return err
	})
	gws := gatewaysOf(t, []setup{{settle: gate.SettleBefore, upstream: hangs}, {settle: gate.SettleBefore, upstream: hangs}})
	payer := gws[0].c.Payers[1]
	header := gws[0].permit2(payer)
	gateID, _ := paymentIDs(t, gws[0], header)
	before := gws[0].balances(payer)

	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, gws[0].srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, header)
	done := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	select {
	case <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("the first request's upstream never ran")
	}
	cancel()
	<-done
	// The gone request clears its in-flight mark once it ends.
	deadline := time.Now().Add(10 * time.Second)
	for {
		a := gws[1].get(x402.HeaderPaymentSignature, header)
		if a.status == http.StatusOK {
			if a.body != "paid content" {
				t.Fatalf("the payment presented again = %d %q", a.status, a.body)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment presented again after its client hung up = %d %q; want 200 once the first request ended", a.status, a.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if a := gws[0].get(x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
		t.Fatalf("the payment presented a third time = %d %q; want 402, served", a.status, a.body)
	}
	gws[0].waitPaidOnce(t, payer, before, price, 10*time.Second)
	// The served mark is written once the response is out: the client may read it first.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		rec, found, err := gws[0].store.Get(context.Background(), gateID)
		if err == nil && found && rec.Served {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the gate's record = served %v (found %v, %v); want served", rec.Served, found, err)
		}
	}
}
