package caddymodule_test

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A paid request on a settle-after route of the embedded engine, whose settlement's broadcast fails after the
// upstream ran, is never answered 402 (pay again): the payment is good, and it is either on its way or surely not
// sent. eth_sendRawTransaction fails, through the only node's fault proxy, each way it can:
//   - the node refuses the transaction (here "insufficient funds for gas"): nothing was sent, and nothing will be
//     until the payment is presented again: 502 settle-unreachable, no offer to pay again, no transaction;
//   - a 503, the connection closed, no answer in time, the answer lost after the node took it: the transaction
//     may be in a node's pool, and stays in the journal, sent again by reconciliation: 200 if it mined in time,
//     else 502 with PAYMENT-RESPONSE settlement_pending naming it.
//
// Presented again once the node is well, the same payment is served, and settled once: one transaction from
// the settlement wallets, the price moved once, and a third presentation is refused as already used.
func TestABroadcastThatFailsAfterTheUpstreamRanIsNeverAnswered402AndSettlesOnce(t *testing.T) {
	ways := []struct {
		name  string
		fault chaintest.Fault
	}{
		{"the node refuses it", chaintest.Refuse},
		{"503 before the node", chaintest.ErrorStatus},
		{"the connection closed before the node", chaintest.Drop},
		{"no answer in time", chaintest.Hang},
		{"the answer lost after the node took it", chaintest.DieAfterForward},
	}
	for _, way := range ways {
		t.Run(way.name, func(t *testing.T) {
			c := chaintest.New(t, chaintest.WithHTTP())
			t.Cleanup(commitPending(t, c))
			proxy := chaintest.NewFaultProxy(t, c.RPCURL)
			up := newTestUpstream(t)
			env := startGateOn(t, c, gateSetup{rpc: proxy.URL, site: "reverse_proxy " + up.Addr,
				network: "\t\t\trpc_timeout 500ms\n", receiptTimeout: 2 * time.Second})
			payer := c.Payers[0]
			env.approvePermit2(payer)
			before, sentBefore := env.balances(payer), env.sent()
			header := env.permit2Header("/", payer)

			entered, release := up.hold()
			pending := env.getAsync("/", x402.HeaderPaymentSignature, header)
			gateWait(t, entered, "the upstream call")
			// Verified, the upstream running: the settlement that follows meets the fault at its broadcast.
			proxy.SetDecide(func(method string) chaintest.Fault {
				if method == "eth_sendRawTransaction" {
					return way.fault
				}
				return chaintest.Pass
			})
			release()
			a := gateWait(t, pending, "the paid request's answer")
			up.unhold()
			if proxy.Count(way.fault) == 0 {
				t.Fatal("no broadcast met the fault: the test proves nothing")
			}
			t.Logf("answered %d %s", a.status, a.body)
			served := false
			switch a.status {
			case http.StatusOK:
				// The node took the transaction and it mined within the receipt timeout.
				if way.fault == chaintest.Refuse {
					t.Fatalf("a settlement the node refused was served: %q", a.body)
				}
				if resp := settleResponse(t, a); !resp.Success {
					t.Fatalf("served with PAYMENT-RESPONSE %+v; want success", resp)
				}
				served = true
			case http.StatusBadGateway:
				var body struct{ Outcome, Retry, Transaction string }
				if err := json.Unmarshal([]byte(a.body), &body); err != nil || body.Outcome != string(x402.OutcomeSettleUnreachable) ||
					!strings.Contains(body.Retry, "present the same payment again") {
					t.Fatalf("502 body %q (%v); want settle-unreachable telling the payer to present the same payment again", a.body, err)
				}
				if a.header.Get(x402.HeaderPaymentRequired) != "" {
					t.Error("a good payment's 502 carries an offer to pay again (PAYMENT-REQUIRED)")
				}
				if way.fault == chaintest.Refuse {
					if body.Transaction != "" || a.header.Get(x402.HeaderPaymentResponse) != "" {
						t.Errorf("a settlement the node refused names a transaction: %q", a.body)
					}
				} else if resp := settleResponse(t, a); !resp.Pending() || resp.Transaction == "" || resp.Transaction != body.Transaction {
					t.Errorf("PAYMENT-RESPONSE %+v, body transaction %q; want settlement_pending naming the transaction sent", resp, body.Transaction)
				}
			default:
				t.Fatalf("a good payment whose broadcast failed (%s) was answered %d %q; want 502 (present the same payment again) or 200",
					way.name, a.status, a.body)
			}

			proxy.SetDecide(nil)
			if way.fault == chaintest.Refuse {
				// Surely not sent: nothing may send it but the payer presenting it again.
				time.Sleep(time.Second)
				if sent := env.sent() - sentBefore; sent != 0 {
					t.Fatalf("the settlement wallets sent %d transactions for a payment answered not sent, before it was presented again", sent)
				}
			}
			for deadline := time.Now().Add(30 * time.Second); !served; {
				a := env.get("/", x402.HeaderPaymentSignature, header)
				switch {
				case a.status == http.StatusOK:
					if resp := settleResponse(t, a); !resp.Success {
						t.Fatalf("served again with PAYMENT-RESPONSE %+v; want success", resp)
					}
					served = true
				case a.status != http.StatusBadGateway:
					t.Fatalf("the same payment presented again = %d %q; want it served (or 502 while it settles)", a.status, a.body)
				case time.Now().After(deadline):
					t.Fatalf("the same payment presented again is still answered %d %q", a.status, a.body)
				default:
					time.Sleep(200 * time.Millisecond)
				}
			}
			if got := up.calls.Load(); got < 1 || got > 2 {
				t.Errorf("the upstream ran %d times; want once, or twice when the first response was not served", got)
			}
			env.assertPaid(payer, before, 1)
			if sent := env.sent() - sentBefore; sent != 1 {
				t.Errorf("the settlement wallets sent %d transactions, want 1", sent)
			}
			if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired ||
				!strings.HasPrefix(requiredError(t, a), x402.ReasonPaymentAlreadyUsed) {
				t.Errorf("the payment presented after it was served = %d %q; want 402 %s", a.status, a.body, x402.ReasonPaymentAlreadyUsed)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// A payment served on a settle-async route of the embedded engine settles however long the node refuses its
// settlement transaction (here for longer than the eleven background attempts of about 45 s that the gate made,
// before, of a settlement answered unexpected_settle_error, and then gave the payment up unpaid): nothing was
// sent and the payment is good, so the engine answers that it cannot settle it now, and the gate tries again
// until it settles (or its authorization expires). Once the node takes the transaction, the seller is paid once.
func TestSettleAsyncSettlesAServedPaymentHoweverLongTheNodeRefusesItsBroadcast(t *testing.T) {
	if testing.Short() {
		t.Skip("the node refuses for about a minute")
	}
	racepass.Once(t, "50 s of the gate's background attempts against a node that refuses them; the attempts' code runs under -race in gate_async_resend_test.go")
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	proxy := chaintest.NewFaultProxy(t, c.RPCURL)
	up := newTestUpstream(t)
	env := startGateOn(t, c, gateSetup{rpc: proxy.URL, site: "reverse_proxy " + up.Addr, gate: "\t\tsettle async\n", logFile: true})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before, sentBefore := env.balances(payer), env.sent()

	proxy.SetDecide(func(method string) chaintest.Fault {
		if method == "eth_sendRawTransaction" {
			return chaintest.Refuse
		}
		return chaintest.Pass
	})
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK ||
		settleResponse(t, a).ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the payment: %d %q, want served with settlement_pending", a.status, a.body)
	}
	// Past the eleventh attempt (0.1 s, doubling to 10 s between attempts: about 43 s), and then some.
	time.Sleep(50 * time.Second)
	if n := proxy.Count(chaintest.Refuse); n < 10 {
		t.Fatalf("the node refused %d broadcasts in 50 s; the test needs the gate to have tried at least 10 times", n)
	}
	if env.loggedNow("went unpaid") {
		t.Error("the gate gave the served payment up as unpaid while the node refused its settlement for now")
	}
	if sent := env.sent() - sentBefore; sent != 0 {
		t.Fatalf("the settlement wallets sent %d transactions while the node refused them", sent)
	}
	proxy.SetDecide(nil)
	env.waitPaid(payer, before, 1)
	waitBacklog(t, 0)
	env.assertPaid(payer, before, 1)
	if sent := env.sent() - sentBefore; sent != 1 {
		t.Errorf("the settlement wallets sent %d transactions, want 1", sent)
	}
	if env.loggedNow("went unpaid") {
		t.Error("the gate logged the served payment as unpaid, though it settled")
	}
}

// loggedNow reports whether a line of Caddy's log, as written so far, holds text.
func (env *gateEnv) loggedNow(text string) bool {
	b, _ := os.ReadFile(filepath.Join(env.srv.dir, "caddy.log"))
	return strings.Contains(string(b), text)
}

// A settle-async gate whose remote facilitator answers a background settlement with a failure that names the
// transaction it sent (its receipt not seen) keeps the payment as settling, not as refused: that transaction may
// mine (here it did). Asked again, the facilitator answers from its journal that it settled: the gate's record
// ends settled, and the gate never logs the served payment as unpaid.
func TestSettleAsyncTakesARemoteFailureAfterItsBroadcastAsNoRefusal(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	remote := &scriptedFacilitator{engine: engine.URL}
	env := startGateOn(t, c, gateSetup{facURL: serveTest(t, remote), gate: "\t\tsettle async\n", logFile: true})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	p := env.signPermit2(payer, env.requirement("/", x402.TransferPermit2))
	remote.next(rewritten(func(r *x402.SettleResponse) {
		r.Success, r.ErrorReason, r.ErrorMessage = false, x402.ReasonFailedToGetReceipt, "scripted: no receipt in time"
	}))
	if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p)); a.status != http.StatusOK {
		t.Fatalf("the payment: %d %q, want served", a.status, a.body)
	}
	env.waitPaid(payer, before, 1)
	waitBacklog(t, 0)
	if rec := env.gateRecord(p); rec.Response == nil || !rec.Response.Success {
		t.Errorf("the gate's record of the payment ends with %+v; want it settled", rec.Response)
	}
	if env.loggedNow("went unpaid") {
		t.Error("the gate logged the served payment as unpaid, though its transaction settled it")
	}
	env.assertPaid(payer, before, 1)
}
