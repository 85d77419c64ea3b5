package caddymodule_test

import (
	"context"
	"encoding/json"
	"math/big"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// One payment buys one response: these tests present payments concurrently, repeatedly, after failures and
// across restarts, and count what was served and what moved on chain.

func TestOnePaymentSentEightTimesAtOnceAndAgainAfterIsServedExactlyOnce(t *testing.T) {
	for _, mode := range []string{"after", "before", "async"} {
		for _, k := range facilitatorKinds {
			t.Run(mode+" "+k.name, func(t *testing.T) {
				up := newTestUpstream(t)
				env := newGateEnv(t, gateSetup{remote: k.remote, site: "reverse_proxy " + up.Addr, gate: "\t\tsettle " + mode + "\n"})
				payer := env.c.Payers[0]
				env.approvePermit2(payer)
				before := env.balances(payer)
				header := env.permit2Header("/", payer)

				answers := env.presentAtOnce(8, header)
				answers = append(answers, env.get("/", x402.HeaderPaymentSignature, header))
				if served := countServed(t, answers); served != 1 {
					t.Fatalf("%d of %d presentations were served, want exactly 1", served, len(answers))
				}
				if got := up.calls.Load(); got != 1 {
					t.Errorf("the upstream ran %d times for one payment, want 1", got)
				}
				if mode == "async" {
					env.waitPaid(payer, before, 1)
				} else {
					env.assertPaid(payer, before, 1)
				}
				if k.remote && env.remote.settles.Load() != 1 {
					t.Errorf("/settle was called %d times, want 1", env.remote.settles.Load())
				}
			})
		}
	}
}

func TestAPaymentWhoseSettlementWasPendingIsServedOnceItSettlesWithoutASecondTransfer(t *testing.T) {
	for _, k := range facilitatorKinds {
		t.Run(k.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: k.remote, noCommit: true, receiptTimeout: 300 * time.Millisecond})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/", payer)
			wallets := env.c.TxCount(env.c.Wallets[0].Address) + env.c.TxCount(env.c.Wallets[1].Address)

			// No block comes: the settlement is broadcast but its receipt is not seen in time.
			first := env.get("/", x402.HeaderPaymentSignature, header)
			if first.status != http.StatusBadGateway || first.body == "paid content" {
				t.Fatalf("first presentation = %d %q, want 502 and nothing served", first.status, first.body)
			}
			pending := settleResponse(t, first)
			if !pending.Pending() || pending.Transaction == "" {
				t.Fatalf("PAYMENT-RESPONSE = %+v, want settlement_pending with the transaction", pending)
			}
			if !strings.Contains(first.body, "may have settled") || first.header.Get(x402.HeaderPaymentRequired) != "" {
				t.Fatalf("the 502 %q must say the payment may have settled and offer nothing to pay", first.body)
			}
			// Presented again while still pending: still not served, and nothing is sent a second time.
			again := env.get("/", x402.HeaderPaymentSignature, header)
			if again.status != http.StatusBadGateway || settleResponse(t, again).Transaction != pending.Transaction {
				t.Fatalf("second presentation while pending = %d %+v, want 502 with the same transaction", again.status, settleResponse(t, again))
			}

			env.c.Commit()
			answers := env.presentAtOnce(8, header)
			if n := countServed(t, answers); n != 1 {
				t.Fatalf("%d of 8 presentations after the block were served, want exactly 1", n)
			}
			var served gateAnswer
			for _, a := range answers {
				if a.status == http.StatusOK {
					served = a
				}
			}
			if resp := settleResponse(t, served); !resp.Success || resp.Transaction != pending.Transaction {
				t.Fatalf("PAYMENT-RESPONSE = %+v, want success with the pending transaction %s", resp, pending.Transaction)
			}
			if got := env.c.TxCount(env.c.Wallets[0].Address) + env.c.TxCount(env.c.Wallets[1].Address) - wallets; got != 1 {
				t.Errorf("the settlement wallets sent %d transactions, want 1", got)
			}
			if last := env.get("/", x402.HeaderPaymentSignature, header); last.status != http.StatusPaymentRequired {
				t.Fatalf("presentation after it was served = %d, want 402", last.status)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// A client that leaves while its payment settles receives nothing, so the payment has not bought its response
// yet: presented again, it is served from its settlement, with no second transfer, and only then is it used.
func TestAClientThatLeftWhileItsPaymentSettledIsServedWhenItPresentsThePaymentAgain(t *testing.T) {
	for _, mode := range []string{"after", "before"} {
		t.Run(mode, func(t *testing.T) {
			// respond, unlike reverse_proxy, answers a request whose client is gone: the gate alone must notice.
			env := newGateEnv(t, gateSetup{noCommit: true, gate: "\t\tsettle " + mode + "\n"})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			sentBefore := env.sent()
			header := env.permit2Header("/", payer)

			// Nothing is mined: the settlement waits in the pool while the client leaves.
			env.leaveWhileSettling("/", header)
			t.Cleanup(commitPending(t, env.c))
			env.waitOutcomes(x402.OutcomeSettled, 1)

			a := env.get("/", x402.HeaderPaymentSignature, header)
			if resp := settleResponse(t, a); a.status != http.StatusOK || a.body != "paid content" || !resp.Success || resp.Transaction == "" {
				t.Fatalf("the same payment presented again = %d %q %+v, want the resource with its settlement", a.status, a.body, resp)
			}
			env.assertPaid(payer, before, 1)
			if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
				t.Fatalf("the payment presented after it was served = %d, want 402", a.status)
			}
			if got := env.sent() - sentBefore; got != 1 {
				t.Errorf("the settlement wallets sent %d transactions, want 1", got)
			}
		})
	}
}

func TestAnUpstreamThatFailsIsNotPaidForAndThePaymentStaysGoodForAnotherTry(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) {
			up := newTestUpstream(t)
			env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tsettle " + mode + "\n"})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/", payer)

			for _, status := range []int{http.StatusInternalServerError, http.StatusNotFound, http.StatusServiceUnavailable} {
				up.setStatus(status)
				a := env.get("/", x402.HeaderPaymentSignature, header)
				if a.status != status || !strings.Contains(a.body, "upstream says") {
					t.Fatalf("upstream %d came back as %d %q, want it passed on", status, a.status, a.body)
				}
				if a.header.Get(x402.HeaderPaymentResponse) != "" {
					t.Errorf("the failed response (%d) carries a PAYMENT-RESPONSE", status)
				}
			}
			time.Sleep(100 * time.Millisecond) // room for a background settlement that must not happen
			env.assertPaid(payer, before, 0)

			up.setStatus(http.StatusOK)
			a := env.get("/", x402.HeaderPaymentSignature, header)
			if a.status != http.StatusOK {
				t.Fatalf("the same payment with the upstream working = %d %q, want 200", a.status, a.body)
			}
			if mode == "async" {
				env.waitPaid(payer, before, 1)
			} else {
				env.assertPaid(payer, before, 1)
			}
		})
	}
	t.Run("handler error", func(t *testing.T) {
		env := newGateEnv(t, gateSetup{site: `error "gone" 410`})
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		before := env.balances(payer)
		if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusGone {
			t.Fatalf("status = %d %q, want the handler's 410", a.status, a.body)
		}
		env.assertPaid(payer, before, 0)
	})
}

func TestSettleBeforePaysBeforeTheUpstreamIsCalled(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tsettle before\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)

	entered, release := up.hold()
	pending := env.getAsync("/", x402.HeaderPaymentSignature, header)
	gateWait(t, entered, "the upstream call")
	// The upstream is running: the payment must already be on chain.
	env.assertPaid(payer, before, 1)
	release()
	up.unhold()
	a := gateWait(t, pending, "the gated answer")
	if a.status != http.StatusOK || !settleResponse(t, a).Success {
		t.Fatalf("answer = %d %q, want 200 with a successful PAYMENT-RESPONSE", a.status, a.body)
	}

	t.Run("a refused payment never reaches the upstream", func(t *testing.T) {
		calls := up.calls.Load()
		stranger := env.c.Payers[1] // no Permit2 allowance
		a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", stranger))
		if a.status != http.StatusPaymentRequired || up.calls.Load() != calls {
			t.Fatalf("answer = %d, upstream calls %d -> %d; want 402 and no call", a.status, calls, up.calls.Load())
		}
	})
	t.Run("an upstream failing after payment is retried by presenting the payment again", func(t *testing.T) {
		payer := env.c.Payers[2]
		env.approvePermit2(payer)
		before := env.balances(payer)
		header := env.permit2Header("/", payer)
		up.setStatus(http.StatusBadGateway)
		a := env.get("/", x402.HeaderPaymentSignature, header)
		if a.status != http.StatusBadGateway {
			t.Fatalf("answer = %d %q, want the upstream's 502", a.status, a.body)
		}
		first := settleResponse(t, a)
		if !first.Success {
			t.Fatalf("PAYMENT-RESPONSE = %+v, want the settlement that happened", first)
		}
		up.setStatus(http.StatusOK)
		a = env.get("/", x402.HeaderPaymentSignature, header)
		if a.status != http.StatusOK || settleResponse(t, a).Transaction != first.Transaction {
			t.Fatalf("presented again = %d %q, want 200 with the first transaction", a.status, a.body)
		}
		if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
			t.Fatalf("presented a third time = %d, want 402", a.status)
		}
		env.assertPaid(payer, before, 1)
	})
}

func TestABackgroundSettlementRetriesUntilTheFacilitatorIsBack(t *testing.T) {
	env := newGateEnv(t, gateSetup{remote: true, gate: "\t\tsettle async\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	env.remote.setSettleFault("down")
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("async answer = %d %q, want 200", a.status, a.body)
	}
	deadline := time.Now().Add(10 * time.Second)
	for env.remote.settles.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the background settlement was not retried")
		}
		time.Sleep(10 * time.Millisecond)
	}
	env.assertPaid(payer, before, 0)
	env.remote.setSettleFault("")
	env.waitPaid(payer, before, 1)
}

func TestServedAsyncPaymentsLeftInTheJournalAreSettledOnceAfterARestart(t *testing.T) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)

	// What a gate wrote before it was killed: a served async payment, not settled.
	journalPath := filepath.Join(t.TempDir(), "journal.db")
	p := env.journalServedAsync(journalPath, payer, 1)[0]

	setup := gateSetup{journal: journalPath, gate: "\t\tsettle async\n"}
	env.srv = startCaddy(t, env.caddyfile(setup))
	env.waitPaid(payer, before, 1)
	// Presenting the payment now finds it served.
	if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p)); a.status != http.StatusPaymentRequired {
		t.Fatalf("the served payment presented after the restart = %d %q, want 402", a.status, a.body)
	}
	// A further reload (a second start) finds nothing left to settle.
	env.reload(setup)
	time.Sleep(200 * time.Millisecond)
	env.assertPaid(payer, before, 1)
}

// presentAtOnce sends n requests with the same payment as close together as it can.
func (env *gateEnv) presentAtOnce(n int, header string) []gateAnswer {
	answers := make([]gateAnswer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest(http.MethodGet, env.srv.URL+"/", nil)
			req.Header.Set(x402.HeaderPaymentSignature, header)
			<-start
			a, err := gateDo(req)
			if err != nil {
				a = gateAnswer{status: -1, body: err.Error()}
			}
			answers[i] = a
		}()
	}
	close(start)
	wg.Wait()
	return answers
}

// countServed counts the answers that served the resource, and checks that every other one is a 402 saying
// the payment was used.
func countServed(t *testing.T, answers []gateAnswer) int {
	t.Helper()
	served := 0
	for i, a := range answers {
		switch a.status {
		case http.StatusOK:
			served++
			if !strings.Contains(a.body, "paid content") && !strings.Contains(a.body, "upstream says 200") {
				t.Errorf("answer %d served %q", i, a.body)
			}
		case http.StatusPaymentRequired:
			if msg := requiredError(t, a); !strings.HasPrefix(msg, x402.ReasonPaymentAlreadyUsed) {
				t.Errorf("answer %d is a 402 saying %q, want %s", i, msg, x402.ReasonPaymentAlreadyUsed)
			}
		default:
			t.Errorf("answer %d = %d %q, want 200 once and 402 otherwise", i, a.status, a.body)
		}
	}
	return served
}

// After a restart, the served async payments in the journal count against their payer's funds at once, not only
// as their settlements start (64 at a time): a payer who spent everything before the restart is not served again
// while the backlog settles.
func TestReplayedAsyncPaymentsCountAgainstThePayersFunds(t *testing.T) {
	const backlog = 70 // more than the 64 background settlements that run at once
	env := newStoppedGateEnv(t, chaintest.WithTokenBalance(big.NewInt(backlog*gatePrice)))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)

	// What a gate wrote before it was killed: served async payments spending all the payer has, none settled.
	journalPath := filepath.Join(t.TempDir(), "journal.db")
	env.journalServedAsync(journalPath, payer, backlog)
	rq := env.journalRequirement()

	// Nothing is mined until the new payment has been answered.
	env.srv = startCaddy(t, env.caddyfile(gateSetup{journal: journalPath, gate: "\t\tsettle async\n", noCommit: true}))
	engine := x402App(t).Facilitator()
	probe := x402.VerifyRequest{X402Version: 2, PaymentPayload: env.signPermit2(payer, rq), PaymentRequirements: rq}
	for deadline := time.Now().Add(10 * time.Second); ; {
		v, err := engine.Verify(context.Background(), probe)
		if err == nil && !v.IsValid && v.InvalidReason == x402.ReasonInsufficientFunds {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after the restart a new payment still verifies as %+v, %v; want insufficient_funds: the replayed payments are not all counted", v, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusPaymentRequired {
		t.Fatalf("a new payment of a payer whose funds the replayed payments spend = %d %q, want 402", a.status, a.body)
	}
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(payer, before, backlog)
}

// newStoppedGateEnv is a gate test's chain with no Caddy yet: the test writes a journal first, as a gate killed
// before it finished would have left it, and then starts Caddy on it.
func newStoppedGateEnv(t *testing.T, opts ...chaintest.Option) *gateEnv {
	env := &gateEnv{t: t, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1")}
	env.c = chaintest.New(t, append([]chaintest.Option{chaintest.WithHTTP()}, opts...)...)
	env.net = x402.EIP155(env.c.ChainID.Uint64())
	return env
}

// journalRequirement is the permit2 requirement of the gate env.caddyfile configures, as its offer names it.
func (env *gateEnv) journalRequirement() x402.PaymentRequirements {
	return x402.PaymentRequirements{Scheme: "exact", Network: env.net, Amount: "10000", Asset: env.c.Token.Hex(),
		PayTo: env.payTo.Hex(), MaxTimeoutSeconds: 300, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2,
			Name: "Stable Coin", Version: "1", Permit2Address: contracts.Permit2Address.Hex(), X402Permit2ProxyAddress: contracts.ProxyAddress.Hex()}}
}

// journalServedAsync writes n payments of payer into the journal at path as a settle-async gate records them
// once served and before they settle, and returns them.
func (env *gateEnv) journalServedAsync(path string, payer *chaintest.Account, n int) []x402.PaymentPayload {
	t := env.t
	t.Helper()
	rq := env.journalRequirement()
	store, err := journal.OpenBolt(path, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	var out []x402.PaymentPayload
	for range n {
		p := env.signPermit2(payer, rq)
		req, _ := json.Marshal(x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq})
		auth := p.Payload.Permit2Authorization
		id := journal.PaymentID(env.net, "gate/permit2", rq.Asset, auth.From, auth.Nonce)
		if _, claimed, err := store.Claim(context.Background(), journal.Record{ID: id, Network: env.net, Payer: auth.From,
			Amount: "10000", Request: req, Owner: "killed-process", Async: true, Served: true, ServedAt: time.Now()}); err != nil || !claimed {
			t.Fatalf("writing the journal: claimed %v, %v", claimed, err)
		}
		out = append(out, p)
	}
	return out
}
