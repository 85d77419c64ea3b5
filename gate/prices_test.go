package gate_test

import (
	"errors"
	"math/big"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// pricing is a gate's price set per request, as a placeholder resolved per request sets it: whatever amount
// holds when the request comes, or an error when broken is set.
type pricing struct {
	amount atomic.Int64
	broken atomic.Bool
	offset atomic.Int64 // added to the gate's clock, in nanoseconds
	logs   *observer.ObservedLogs
}

// pricedSetup configures a gate priced by p, with price grace grace.
func pricedSetup(p *pricing, grace time.Duration) setup {
	p.amount.Store(1_000)
	core, logs := observer.New(zapcore.InfoLevel)
	p.logs = logs
	return setup{config: func(cfg *gate.Config) {
		static := cfg.Offers[0]
		cfg.OffersFor = func(*http.Request) ([]gate.Offer, error) {
			if p.broken.Load() {
				return nil, errors.New(`price "{price}" resolved to "$abc"`)
			}
			o := static
			o.Amount = strconv.FormatInt(p.amount.Load(), 10)
			return []gate.Offer{o}, nil
		}
		cfg.DescriptionFor = func(*http.Request) string { return "costs " + strconv.FormatInt(p.amount.Load(), 10) }
		cfg.PriceGrace = grace
		cfg.Now = func() time.Time { return time.Now().Add(time.Duration(p.offset.Load())) }
		cfg.Logger = zap.New(core)
	}}
}

func TestAGateWithOffersForOffersAndMatchesEachRequestAtItsOwnPrice(t *testing.T) {
	var p pricing
	e := newEnv(t, pricedSetup(&p, 0))
	payer := e.c.Payers[0]
	if rq := e.offer(); rq.Amount != "1000" {
		t.Fatalf("offered amount %s, want the request's 1000", rq.Amount)
	}
	pr, err := x402.DecodePaymentRequired(e.get().header.Get(x402.HeaderPaymentRequired))
	if err != nil || pr.Resource.Description != "costs 1000" {
		t.Fatalf("resource %+v (%v), want the request's description", pr.Resource, err)
	}
	header := e.permit2(payer)
	before := e.balances(payer)

	p.amount.Store(5_000)
	a := e.get(x402.HeaderPaymentSignature, header)
	refusedForItsPrice(t, e, a, payer, before, "a payment of 1000 where 5000 is asked")
	if e.served.Load() != 0 {
		t.Fatalf("a refused payment reached the upstream %d times", e.served.Load())
	}

	p.amount.Store(1_000)
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("the payment at its own price = %d %q, want 200", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Cmp(big.NewInt(1_000)) != 0 || gained.Cmp(big.NewInt(1_000)) != 0 {
		t.Fatalf("payer lost %s and seller gained %s, want 1000 each", lost, gained)
	}
}

func TestAnOffersForErrorIs500AndNeverReachesTheUpstream(t *testing.T) {
	var p pricing
	e := newEnv(t, pricedSetup(&p, 0))
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	p.broken.Store(true)
	for _, h := range [][]string{nil, {x402.HeaderPaymentSignature, header}} {
		a := e.get(h...)
		if a.status != http.StatusInternalServerError || !strings.Contains(a.body, `"$abc"`) {
			t.Fatalf("a request whose price does not resolve = %d %q, want 500 naming the value", a.status, a.body)
		}
		if a.header.Get(x402.HeaderPaymentRequired) != "" {
			t.Errorf("a 500 carried an offer")
		}
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 || e.served.Load() != 0 {
		t.Fatalf("moved %s/%s and reached the upstream %d times", lost, gained, e.served.Load())
	}
}

func TestWithinPriceGraceAPaymentAtTheEarlierPriceIsTakenAndPastItRefused(t *testing.T) {
	var p pricing
	e := newEnv(t, pricedSetup(&p, 2*time.Second))
	payer := e.c.Payers[0]
	first, second := e.permit2(payer), e.permit2(payer) // both signed for 1000
	before := e.balances(payer)
	p.amount.Store(5_000)
	if rq := e.offer(); rq.Amount != "5000" {
		t.Fatalf("offered %s after the change, want 5000", rq.Amount)
	}

	if a := e.get(x402.HeaderPaymentSignature, first); a.status != http.StatusOK {
		t.Fatalf("a payment at the earlier price within the grace = %d %q, want 200", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Cmp(big.NewInt(1_000)) != 0 || gained.Cmp(big.NewInt(1_000)) != 0 {
		t.Fatalf("payer lost %s and seller gained %s, want the earlier price, 1000, each", lost, gained)
	}
	if logged := p.logs.FilterMessageSnippet("within price_grace").Len(); logged != 1 {
		t.Errorf("%d info lines about the grace, want 1", logged)
	}

	p.offset.Store(int64(2*time.Second + time.Millisecond))
	before = e.balances(payer)
	a := e.get(x402.HeaderPaymentSignature, second)
	refusedForItsPrice(t, e, a, payer, before, "a payment at the earlier price past the grace")
}

func TestWithoutPriceGraceAPaymentAtTheEarlierPriceIsRefused(t *testing.T) {
	var p pricing
	e := newEnv(t, pricedSetup(&p, 0))
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	p.amount.Store(5_000)
	a := e.get(x402.HeaderPaymentSignature, header)
	refusedForItsPrice(t, e, a, payer, before, "a payment at the earlier price")
	if e.served.Load() != 0 {
		t.Fatalf("a refused payment reached the upstream %d times", e.served.Load())
	}
}

// requiredErrorOf is the error text of an answer's PAYMENT-REQUIRED.
func requiredErrorOf(t *testing.T, a answer) string {
	t.Helper()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatalf("decoding PAYMENT-REQUIRED of %d %q: %v", a.status, a.body, err)
	}
	return pr.Error
}

// refusedForItsPrice checks that a, the answer to payer's payment, refuses it for its amount (402,
// value mismatch) and that nothing moved since before.
func refusedForItsPrice(t *testing.T, e *env, a answer, payer *chaintest.Account, before [2]*big.Int, what string) {
	t.Helper()
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(requiredErrorOf(t, a), x402.ReasonValueMismatch) {
		t.Fatalf("%s = %d %q, want 402 %s", what, a.status, a.body, x402.ReasonValueMismatch)
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Fatalf("%s was refused but moved %s/%s", what, lost, gained)
	}
}
