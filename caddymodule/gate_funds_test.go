package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A gate that serves before it settles holds each payment against the payer's funds: a payer who can pay for
// three responses and presents five distinct payments before any settles is served three, and the other two are
// refused with a 402 that says why, before the upstream runs. The three then settle, exactly.
func TestSettleAsyncServesAPayerNoMoreThanThePayerCanPay(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{
		gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr, noCommit: true,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(3 * gatePrice))},
	})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)

	var served, refused int
	for i := range 5 {
		a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
		switch a.status {
		case http.StatusOK:
			served++
			if resp := settleResponse(t, a); resp.ErrorReason != x402.ReasonSettlementPending {
				t.Errorf("payment %d served with PAYMENT-RESPONSE %+v; want settlement_pending", i, resp)
			}
		case http.StatusPaymentRequired:
			refused++
			if msg := requiredError(t, a); !strings.Contains(msg, x402.ReasonInsufficientFunds) {
				t.Errorf("payment %d refused saying %q; want it to name insufficient_funds", i, msg)
			}
		default:
			t.Fatalf("payment %d answered %d %q", i, a.status, a.body)
		}
	}
	if served != 3 || refused != 2 {
		t.Fatalf("%d served and %d refused, want 3 and 2", served, refused)
	}
	if got := up.calls.Load(); got != 3 {
		t.Errorf("the upstream ran %d times, want 3", got)
	}
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(payer, before, 3)
}

// A gas-sponsoring permit does not let a payer skip the holds. A payer who never approved Permit2, whose funds
// cover one response, presents before any settles five payments that carry one sponsor permit (which can be
// applied once): one is served, and the other four are refused with a 402 that says why, before the upstream
// runs. The one settles, and no settlement is sent that would revert on the facilitator's gas.
func TestSettleAsyncServesSponsoredPaymentsNoMoreThanTheHoldsAllow(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{
		gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr, noCommit: true,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(gatePrice))},
	})
	payer := env.c.Payers[0]
	if got := env.c.Allowance(payer.Address, contracts.Permit2Address); got.Sign() != 0 {
		t.Fatalf("the payer has approved Permit2 for %s; the test needs a payer who did not", got)
	}
	before, sentBefore := env.balances(payer), env.sent()
	pr := env.offer("/")
	rq := env.requirement("/", x402.TransferPermit2)
	payments := make([]x402.PaymentPayload, 5)
	for i := range payments {
		payments[i] = env.signPermit2(payer, rq)
		payments[i].Extensions = pr.Extensions
		if i > 0 {
			payments[i].Extensions = payments[0].Extensions
		} else if err := chain.AddGasSponsoring(&payments[0], payer.Key, env.c.ChainID, "", "", env.c.TokenNonce(payer.Address)); err != nil {
			t.Fatal(err)
		}
	}

	var served, refused int
	for i, p := range payments {
		a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p))
		switch a.status {
		case http.StatusOK:
			served++
		case http.StatusPaymentRequired:
			refused++
			if msg := requiredError(t, a); !strings.Contains(msg, x402.ReasonInvalidEIP2612ExtensionFormat) {
				t.Errorf("payment %d refused saying %q; want it to name %s", i, msg, x402.ReasonInvalidEIP2612ExtensionFormat)
			}
		default:
			t.Fatalf("payment %d answered %d %q", i, a.status, a.body)
		}
	}
	if served != 1 || refused != 4 {
		t.Errorf("%d served and %d refused, want 1 and 4", served, refused)
	}
	if got := up.calls.Load(); got != 1 {
		t.Errorf("the upstream ran %d times, want 1", got)
	}
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(payer, before, 1)
	waitBacklog(t, 0)
	if got := env.sent() - sentBefore; got != 1 {
		t.Errorf("the settlement wallets sent %d transactions, want 1: one per payment that settled, none reverting on the facilitator's gas", got)
	}
}

// settle async serves at once only while the backlog of served, unsettled payments is below its bound: past it a
// payment is settled before it is served, so serving cannot run ahead of settlement until payments expire.
func TestSettleAsyncSettlesFirstWhenItsBacklogIsFull(t *testing.T) {
	env := newGateEnv(t, gateSetup{gate: "\t\tsettle async 2\n", noCommit: true})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	sentBefore := env.sent()

	// Nothing is mined: the first two wait in the backlog.
	for i := range 2 {
		a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
		if a.status != http.StatusOK {
			t.Fatalf("payment %d: %d %q", i, a.status, a.body)
		}
		if resp := settleResponse(t, a); resp.Success || resp.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("payment %d within the backlog answered %+v; want served with settlement_pending", i, resp)
		}
	}
	if got := samples(t)["caddy_x402_gate_async_backlog{}"]; got != 2 {
		t.Errorf("caddy_x402_gate_async_backlog = %v with two payments waiting, want 2", got)
	}
	third := env.getAsync("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	// The third is settled before it is served: its transaction joins the two in the pool, and it is answered
	// only once blocks are sealed.
	deadline := time.Now().Add(10 * time.Second)
	for env.sent()-sentBefore < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("%d settlement transactions sent, want 3", env.sent()-sentBefore)
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case a := <-third:
		t.Fatalf("the third payment was answered (%d) before its settlement was mined", a.status)
	case <-time.After(100 * time.Millisecond):
	}
	t.Cleanup(commitPending(t, env.c))
	a := gateWait(t, third, "the third payment's answer")
	if a.status != http.StatusOK {
		t.Fatalf("the third payment: %d %q", a.status, a.body)
	}
	if resp := settleResponse(t, a); !resp.Success || resp.Transaction == "" {
		t.Errorf("the third payment answered %+v; want it settled, with its transaction", resp)
	}
	env.waitPaid(payer, before, 3)
	waitBacklog(t, 0)
}

// sent is how many transactions the settlement wallets have sent, counting those still in the pool.
func (env *gateEnv) sent() uint64 {
	env.t.Helper()
	return walletsSent(env.t, env.c, env.c.Wallets)
}

// walletsSent is how many transactions the wallets have sent on c, those still in the node's pool included.
func walletsSent(t testing.TB, c *chaintest.Chain, wallets []*chaintest.Account) uint64 {
	t.Helper()
	var n uint64
	for _, w := range wallets {
		got, err := c.Client.PendingNonceAt(context.Background(), w.Address)
		if err != nil {
			t.Fatal(err)
		}
		n += got
	}
	return n
}

// A payment whose upstream failed is not paid for, and no longer counts against the payer: in settle async and
// in its settle-first fallback once the backlog is full, the payer's next payment is served.
func TestAnUnpaidFailureReleasesWhatThePaymentHeld(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{
		gate: "\t\tsettle async 1\n", site: "reverse_proxy " + up.Addr, noCommit: true,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(gatePrice))},
	})
	payer, other := env.c.Payers[0], env.c.Payers[1]
	env.approvePermit2(payer)
	env.approvePermit2(other)
	otherBefore := env.balances(other)

	// Another payer's payment waits for settlement (nothing is mined): the backlog of 1 is full.
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", other)); a.status != http.StatusOK {
		t.Fatalf("the other payer's payment: %d %q", a.status, a.body)
	}
	up.setStatus(http.StatusInternalServerError)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusInternalServerError {
		t.Fatalf("a payment whose upstream fails: %d %q, want the upstream's 500", a.status, a.body)
	}
	up.setStatus(http.StatusOK)
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(other, otherBefore, 1)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("the payer's next payment, with all of its funds free again: %d %q", a.status, a.body)
	}
	env.waitPaid(payer, before, 1)
}

// A remote facilitator verifies against the funds the chain shows, unaware of what the gate served and has not
// settled yet, and cannot hold payments. So a settle async gate with a remote facilitator serves a payer one
// unsettled payment at a time: the payer's next payment waits for the earlier one to settle, and is then settled
// before it is served. A payer who can pay for two responses and presents three is served two, and pays both.
func TestARemoteAsyncGateServesAPayerOneUnsettledPaymentAtATime(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{
		remote: true, gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(2 * gatePrice))},
	})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
	t.Cleanup(resume)

	// The first payment is served at once, and its settlement waits (held back).
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK ||
		settleResponse(t, a).ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the first payment: %d %q, want served with settlement_pending", a.status, a.body)
	}
	// The second, which the facilitator finds valid (the chain still shows funds for two), is not served while
	// the first is unsettled.
	second := env.getAsync("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	select {
	case a := <-second:
		t.Fatalf("the second payment was answered (%d %q) while the first was not settled", a.status, a.body)
	case <-time.After(300 * time.Millisecond):
	}
	if got := up.calls.Load(); got != 1 {
		t.Errorf("the upstream ran %d times while the second payment waited, want 1", got)
	}
	resume()
	a := gateWait(t, second, "the second payment's answer")
	if resp := settleResponse(t, a); a.status != http.StatusOK || !resp.Success || resp.Transaction == "" {
		t.Fatalf("the second payment: %d %+v, want it settled before it was served, with its transaction", a.status, resp)
	}
	env.waitPaid(payer, before, 2)
	waitBacklog(t, 0)

	// Both settled: the payer's funds are spent, and the third payment is refused before anything is served.
	a = env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	if a.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, a), x402.ReasonInsufficientFunds) {
		t.Fatalf("the third payment: %d %q, want 402 naming insufficient_funds", a.status, a.body)
	}
	if got := up.calls.Load(); got != 2 {
		t.Errorf("the upstream ran %d times, want 2", got)
	}
	env.assertPaid(payer, before, 2)
}

// A payment a remote async gate did not serve (its upstream failed) is not counted as owed: the payer's next
// payment is served at once.
func TestARemoteAsyncGateForgetsAPaymentItDidNotServe(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{remote: true, gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	up.setStatus(http.StatusBadGateway)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusBadGateway {
		t.Fatalf("the payment whose upstream failed: %d %q, want the upstream's 502", a.status, a.body)
	}
	up.setStatus(http.StatusOK)
	next := env.getAsync("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	select {
	case a := <-next:
		if resp := settleResponse(t, a); a.status != http.StatusOK || resp.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("the next payment: %d %+v, want served at once with settlement_pending", a.status, resp)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the next payment waited for a payment that was never served")
	}
	env.waitPaid(payer, before, 1)
}

// A payment waiting for the payer's earlier one to settle is not settled if its request ends meanwhile: nobody
// would receive the response it buys.
func TestARemoteAsyncGateDoesNotSettleForAClientThatLeftWhileWaiting(t *testing.T) {
	env := newGateEnv(t, gateSetup{remote: true, gate: "\t\tsettle async\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
	t.Cleanup(resume)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("the first payment: %d %q", a.status, a.body)
	}

	ctx, leave := context.WithCancel(context.Background())
	second := env.getAsyncCtx(ctx, "/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	time.Sleep(200 * time.Millisecond) // the second payment is waiting for the first
	leave()
	if a := gateWait(t, second, "the request of the client that left"); a.status != -1 {
		t.Fatalf("the second payment was answered (%d %q) while the first was not settled", a.status, a.body)
	}
	const gone, settled = `caddy_x402_gate_outcomes_total{status="verify-unreachable"}`, `caddy_x402_gate_outcomes_total{status="settled"}`
	for deadline := time.Now().Add(5 * time.Second); samples(t)[gone] != 1; {
		if time.Now().After(deadline) {
			t.Fatalf("%s = %v after the client left, want 1 (%s = %v)", gone, samples(t)[gone], settled, samples(t)[settled])
		}
		time.Sleep(10 * time.Millisecond)
	}
	resume()
	env.waitPaid(payer, before, 1)
	waitBacklog(t, 0)
	if got := samples(t)[settled]; got != 0 {
		t.Errorf("%v payments settled before serving, want 0: the client that left was charged", got)
	}
	env.assertPaid(payer, before, 1)
}

// waitBacklog waits until the gates' backlog of served, unsettled async payments is n.
func waitBacklog(t *testing.T, n float64) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); samples(t)["caddy_x402_gate_async_backlog{}"] != n; {
		if time.Now().After(deadline) {
			t.Fatalf("caddy_x402_gate_async_backlog = %v, want %v", samples(t)["caddy_x402_gate_async_backlog{}"], n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
