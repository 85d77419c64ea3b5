package caddymodule_test

import (
	"context"
	"io"
	"math/big"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

// busyProxy forwards to a facilitator; while busy is set, it answers /settle itself as a facilitator whose
// settlement wallets are all in use does: no_available_wallets, nothing sent (the failover set moves on).
type busyProxy struct {
	target  string
	busy    atomic.Bool
	settles atomic.Int64 // the /settle calls forwarded
}

func (p *busyProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path == "/settle" {
		if p.busy.Load() {
			gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonNoAvailableWallets,
				ErrorMessage: "all settlement wallets are in use"})
			return
		}
		p.settles.Add(1)
	}
	status, answer, err := forwardTo(p.target, r, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	writeAnswer(w, status, answer)
}

// restartGate stops the gateway's Caddy and starts it again on the same journal, with the memory of a new
// process: the failover member each payment's /settle was sent to is forgotten, as when the process is killed.
func (env *gateEnv) restartGate(s gateSetup) {
	env.t.Helper()
	if err := caddy.Stop(); err != nil {
		env.t.Fatalf("stopping the gateway: %v", err)
	}
	caddymodule.ForgetSentPayments()
	env.srv.load(env.caddyfile(s))
}

// A gate settles through two remote facilitators, a failover set, each with its own journal. A is down, or has
// no wallet free, so B settles the payment; B's answer is lost and the gateway dies before it serves (the
// money-invariant run's SIGKILL mid-request on /remote/): the payment is charged and its response not delivered.
// The gateway comes back without its memory of where the payment was sent (so would any other gateway of a
// cluster), and A is back. Presented again, the payment goes to A, which never saw it and finds its nonce spent:
// that refusal must not be the last word. B, whose journal knows it settled the payment, must be asked, and the
// payment served, once, without paying again.
func TestAPaymentSettledByTheSecondFacilitatorIsServedAfterTheGatewayRestarts(t *testing.T) {
	for _, aDown := range []bool{true, false} {
		name := "A busy"
		if aDown {
			name = "A down"
		}
		t.Run(name, func(t *testing.T) {
			c := chaintest.New(t, chaintest.WithHTTP())
			t.Cleanup(commitPending(t, c))
			a := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
			b := newRemoteFacilitatorOf(t, c, c.Wallets[2:4], 20*time.Second)
			proxyA := &busyProxy{target: a.URL}
			addrA := freeAddr(t) // nothing listens there until A is back: connections are refused
			setup := gateSetup{facURL: "http http://" + addrA + " " + b.URL}
			env := startGateOn(t, c, setup)
			startA := func() {
				ln, err := net.Listen("tcp", addrA)
				if err != nil {
					t.Fatalf("A listening again on %s: %v", addrA, err)
				}
				srv := &http.Server{Handler: proxyA}
				go func() { _ = srv.Serve(ln) }()
				t.Cleanup(func() { _ = srv.Close() })
			}
			if !aDown {
				startA()
				proxyA.busy.Store(true)
			}
			payer := c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/", payer)

			b.setSettleFault("lose-gateAnswer")
			first := env.get("/", x402.HeaderPaymentSignature, header)
			if first.status != http.StatusBadGateway {
				t.Fatalf("the first presentation, B's answer lost: %d %q; want 502", first.status, first.body)
			}
			env.waitPaid(payer, before, 1) // B settled it
			b.setSettleFault("")
			if aDown {
				startA()
			}
			proxyA.busy.Store(false)

			env.restartGate(setup)
			again := env.get("/", x402.HeaderPaymentSignature, header)
			if again.status != http.StatusOK || again.body != "paid content" {
				t.Fatalf("the same payment presented again after the gateway restarted: %d %q; want 200 with the content (B settled it)", again.status, again.body)
			}
			if resp := settleResponse(t, again); !resp.Success || resp.Transaction == "" {
				t.Errorf("PAYMENT-RESPONSE %+v; want B's settlement, with its transaction", resp)
			}
			if n := proxyA.settles.Load(); n != 1 {
				t.Errorf("A was asked to settle the payment %d times; want once (it refuses the spent nonce; B answers)", n)
			}
			once := env.get("/", x402.HeaderPaymentSignature, header)
			if once.status == http.StatusOK {
				t.Errorf("the payment presented once more after it was served: 200; want it refused (it bought one response)")
			} else if !strings.Contains(once.body, "already") {
				t.Errorf("the payment presented once more after it was served: %d %q; want it refused as already used", once.status, once.body)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// The other side of asking every member of a failover set about a payment one of them finds spent: a payment
// whose nonce another payment's settlement spent buys nothing. Payment P settles at B; P', the same payer and
// nonce on other terms (a later deadline), is refused by A (nonce spent) and by B, whose journal holds P, not P'.
// P itself, asked of the set, is answered from B's journal with its one transfer, and nothing moves again.
func TestAFailoverSetAnswersOnlyForThePaymentAMemberSettledNotAnotherWithItsNonce(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	a := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	b := newRemoteFacilitatorOf(t, c, c.Wallets[2:4], 20*time.Second)
	env := startGateOn(t, c, gateSetup{facURL: "http " + a.URL + " " + b.URL})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	rq := env.requirement("/", x402.TransferPermit2)
	nonce := big.NewInt(7_777_001)
	sign := func(deadline time.Duration) x402.SettleRequest {
		now := env.chainNow()
		p, err := chain.SignPermit2Payment(payer.Key, rq, c.ChainID, chain.Permit2Options{Now: now, Nonce: nonce,
			Deadline: big.NewInt(now.Add(deadline).Unix())})
		if err != nil {
			t.Fatalf("signing: %v", err)
		}
		return x402.SettleRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
	}
	paid, other := sign(2*time.Minute), sign(4*time.Minute)
	clientOf := func(url string) *facilitatorclient.Client {
		cl, err := facilitatorclient.New(url)
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	ctx := context.Background()
	if resp, err := clientOf(b.URL).Settle(ctx, paid); err != nil || !resp.Success {
		t.Fatalf("B settling P: %+v, %v", resp, err)
	}
	env.assertPaid(payer, before, 1)

	set := facilitatorclient.NewFailover(clientOf(a.URL), clientOf(b.URL))
	settlesB := b.settles.Load()
	resp, err := set.Settle(ctx, other)
	if err != nil || resp.Success || resp.ErrorReason != x402.ReasonPermit2InvalidNonce {
		t.Fatalf("P', whose nonce P spent: %+v, %v; want refused, %s", resp, err, x402.ReasonPermit2InvalidNonce)
	}
	if n := b.settles.Load() - settlesB; n != 1 {
		t.Errorf("B was asked about P' %d times; want once (A found its nonce spent)", n)
	}
	res, err := set.SettleDetailed(ctx, paid)
	if err != nil || !res.Response.Success || res.Facilitator != b.URL || res.Response.Transaction == "" {
		t.Fatalf("P asked of the set: %+v from %s, %v; want B's settlement", res.Response, res.Facilitator, err)
	}
	env.assertPaid(payer, before, 1)
}
