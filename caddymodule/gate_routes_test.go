package caddymodule_test

import (
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// One payment, many routes: a payment is presented to every gated route of one Caddy in each state of its life,
// and is served at most once, only by the route whose offer it matches, and paid for exactly once.

// routesOfFour differ in price, recipient, method and settlement mode.
var routesOfFour = []route{
	{path: "/a", payTo: sellerA, amount: 10_000, method: x402.TransferPermit2},
	{path: "/b", payTo: sellerB, amount: 10_000, method: x402.TransferPermit2, settle: "async"},
	{path: "/c", payTo: sellerA, amount: 20_000, method: x402.TransferPermit2},
	{path: "/d", payTo: sellerA, amount: 10_000, method: x402.TransferERC2612},
}

// routesEnv is a Caddy with routesOfFour on a chain whose mining the test can pause.
type routesEnv struct {
	*gateEnv
	cfg    string
	paused atomic.Bool
	served int // 200 answers to presentations of the current payment
}

func newRoutesOfFour(t *testing.T) *routesEnv {
	env := &routesEnv{gateEnv: newStoppedGateEnv(t)}
	t.Cleanup(commitPendingUnless(env.c, &env.paused))
	// A short receipt timeout, so a settlement left unmined answers settlement_pending (502) soon.
	env.cfg = env.routesCaddyfile(routesOfFour, "\t\t\treceipt_timeout 2s\n")
	env.srv = startCaddy(t, env.cfg)
	return env
}

func routeOf(path string) route {
	for _, r := range routesOfFour {
		if r.path == path {
			return r
		}
	}
	panic("no route " + path)
}

// sign signs a payment for the offer of the route at path.
func (env *routesEnv) sign(path string, payer *chaintest.Account) x402.PaymentPayload {
	r := routeOf(path)
	rq := env.requirement(path, r.method)
	if r.method == x402.TransferERC2612 {
		return env.signERC2612(payer, rq)
	}
	return env.signPermit2(payer, rq)
}

// present presents header to path and counts a 200.
func (env *routesEnv) present(path, header string) gateAnswer {
	env.t.Helper()
	a := env.get(path, x402.HeaderPaymentSignature, header)
	if a.status == http.StatusOK {
		env.served++
	}
	return a
}

// presentElsewhere presents payment p, as signed and with accepted rewritten to each route's own offer, to
// every route but home: each must refuse it, without serving and without charging.
func (env *routesEnv) presentElsewhere(home string, p x402.PaymentPayload) {
	env.t.Helper()
	for _, r := range routesOfFour {
		if r.path == home {
			continue
		}
		for name, h := range map[string]string{
			"as signed": gateEncode(env.t, p),
			"accepted rewritten to the route's offer": withAccepted(env.t, p, env.requirement(r.path, r.method)),
		} {
			if a := env.present(r.path, h); a.status != http.StatusPaymentRequired && a.status != http.StatusBadRequest {
				env.t.Errorf("a payment for %s presented to %s (%s) = %d %.120q, want it refused", home, r.path, name, a.status, a.body)
			}
		}
	}
}

// expect presents header to path and checks the status, and for a 402 that the reason is reason. A 200 may
// first come as 502 "not final yet" on a loaded machine: the gate then says to present the payment again.
func (env *routesEnv) expect(path, header string, status int, reason string) {
	env.t.Helper()
	a := env.present(path, header)
	for i := 0; status == http.StatusOK && a.status == http.StatusBadGateway && i < 10; i++ {
		a = env.present(path, header)
	}
	if a.status != status {
		env.t.Fatalf("%s: %d %.200q, want %d", path, a.status, a.body, status)
	}
	if status == http.StatusOK && a.body != "content of "+path {
		env.t.Fatalf("%s served %q, want its own content", path, a.body)
	}
	if reason != "" && !strings.HasPrefix(requiredError(env.t, a), reason) {
		env.t.Fatalf("%s: refused with %q, want %s", path, requiredError(env.t, a), reason)
	}
}

// waitSent waits until the settlement wallets have sent more than n transactions.
func (env *routesEnv) waitSent(n uint64) {
	env.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); env.sent() <= n; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			env.t.Fatal("no settlement transaction was sent")
		}
	}
}

// settleWithTheClientGone presents header to path, goes away while its settlement waits to be mined, and returns
// once the gate has recorded it settled: a payment that settled and bought nothing yet.
func (env *routesEnv) settleWithTheClientGone(path, header string) {
	env.t.Helper()
	env.paused.Store(true)
	settled := samples(env.t)[`caddy_x402_gate_outcomes_total{status="settled"}`]
	env.leaveWhileSettling(path, header)
	env.paused.Store(false)
	env.waitOutcomes(x402.OutcomeSettled, settled+1)
}

// restart stops Caddy and starts it again from the same config and journal.
func (env *routesEnv) restart() {
	env.t.Helper()
	if err := caddy.Stop(); err != nil {
		env.t.Fatalf("stopping Caddy: %v", err)
	}
	env.srv.load(env.cfg)
}

// waitSellers waits until sellers A and B hold a and b.
func (env *routesEnv) waitSellers(a, b *big.Int) {
	env.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		gotA, gotB := env.c.TokenBalance(sellerA), env.c.TokenBalance(sellerB)
		if gotA.Cmp(a) == 0 && gotB.Cmp(b) == 0 {
			return
		}
		if time.Now().After(deadline) {
			env.t.Fatalf("seller A holds %s (want %s), seller B %s (want %s)", gotA, a, gotB, b)
		}
	}
}

func TestOnePaymentPresentedToEveryRouteInEveryStateIsServedOnceAndOnlyByItsOwnRoute(t *testing.T) {
	const (
		ok      = http.StatusOK
		refused = http.StatusPaymentRequired
		used    = x402.ReasonPaymentAlreadyUsed
	)
	states := []struct {
		name string
		home string
		// life brings the payment into the state, presents it to the other routes there, and leaves it served
		// (or being settled in the background).
		life func(env *routesEnv, p x402.PaymentPayload, h string)
	}{
		{"fresh", "/a", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.presentElsewhere("/a", p)
			env.expect("/a", h, ok, "")
			env.expect("/a", h, refused, used)
		}},
		{"fresh erc2612", "/d", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.presentElsewhere("/d", p)
			env.expect("/d", h, ok, "")
			env.expect("/d", h, refused, used)
		}},
		{"in flight", "/a", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.paused.Store(true)
			sent := env.sent()
			first := env.getAsync("/a", x402.HeaderPaymentSignature, h)
			env.waitSent(sent)
			env.presentElsewhere("/a", p)
			env.expect("/a", h, refused, used) // another request is presenting it
			env.paused.Store(false)
			if a := gateWait(env.t, first, "the first presentation"); a.status != ok {
				env.t.Fatalf("the first presentation = %d %q, want 200 once mined", a.status, a.body)
			}
			env.served++
			env.expect("/a", h, refused, used)
		}},
		{"settlement pending", "/d", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.paused.Store(true)
			env.expect("/d", h, http.StatusBadGateway, "")
			env.presentElsewhere("/d", p)
			env.paused.Store(false)
			env.expect("/d", h, ok, "")
			env.expect("/d", h, refused, used)
		}},
		{"settled, client gone", "/a", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.settleWithTheClientGone("/a", h)
			env.presentElsewhere("/a", p)
			env.expect("/a", h, ok, "")
			env.expect("/a", h, refused, used)
		}},
		{"served", "/c", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.expect("/c", h, ok, "")
			env.presentElsewhere("/c", p)
			env.expect("/c", h, refused, used)
		}},
		{"async, journalled and not settled", "/b", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.paused.Store(true)
			env.expect("/b", h, ok, "")
			env.presentElsewhere("/b", p)
			env.expect("/b", h, refused, used)
			env.paused.Store(false)
		}},
		{"settled, client gone, after a restart", "/a", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.settleWithTheClientGone("/a", h)
			env.restart()
			env.presentElsewhere("/a", p)
			env.expect("/a", h, ok, "")
			env.expect("/a", h, refused, used)
		}},
		{"async, journalled, after a restart", "/b", func(env *routesEnv, p x402.PaymentPayload, h string) {
			env.paused.Store(true)
			env.expect("/b", h, ok, "")
			env.restart()
			env.presentElsewhere("/b", p)
			env.expect("/b", h, refused, used)
			env.paused.Store(false)
		}},
	}
	env := newRoutesOfFour(t)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	for _, st := range states {
		t.Run(st.name, func(t *testing.T) {
			env.gateEnv.t = t
			defer env.paused.Store(false)
			env.served = 0
			home := routeOf(st.home)
			a, b := env.c.TokenBalance(sellerA), env.c.TokenBalance(sellerB)
			payerBefore := env.c.TokenBalance(payer.Address)
			p := env.sign(st.home, payer)
			st.life(env, p, gateEncode(t, p))
			if env.served != 1 {
				t.Errorf("the payment was served %d times across the routes, want once", env.served)
			}
			price := big.NewInt(home.amount)
			if home.payTo == sellerA {
				a = new(big.Int).Add(a, price)
			} else {
				b = new(big.Int).Add(b, price)
			}
			env.waitSellers(a, b)
			if got := new(big.Int).Sub(payerBefore, env.c.TokenBalance(payer.Address)); got.Cmp(price) != 0 {
				t.Errorf("the payer paid %s, want %s once", got, price)
			}
			t.Log(fmt.Sprintf("%s: served once by %s, paid %s to its seller", st.name, st.home, price))
		})
	}
}
