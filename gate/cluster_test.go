package gate_test

import (
	"context"
	"io"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// twoGateways are two gates, each with an engine and a store of its own on one PostgreSQL database, settling on
// one chain: two processes behind a load balancer.
func twoGateways(t *testing.T, settle string, opts ...chaintest.Option) [2]*env {
	t.Helper()
	return twoGatewaysOf(t, [2]setup{{settle: settle}, {settle: settle}}, opts...)
}

// twoGatewaysOf is twoGateways with each gate set up as its setup says (its journal and chain aside).
func twoGatewaysOf(t *testing.T, setups [2]setup, opts ...chaintest.Option) [2]*env {
	t.Helper()
	dsn := pgtest.Shared(t)
	c := chaintest.New(t, opts...)
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	var out [2]*env
	for i := range out {
		st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		s := setups[i]
		s.journal, s.chain = st, c
		out[i] = newEnv(t, s)
	}
	// The second engine gets its share of the settlement wallets once the first gives it up.
	deadline := time.Now().Add(20 * time.Second)
	for len(out[0].fac.LeasedWallets(out[0].net)) != 1 || len(out[1].fac.LeasedWallets(out[1].net)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the two engines hold %v and %v of the two wallets; want one each", out[0].fac.LeasedWallets(out[0].net), out[1].fac.LeasedWallets(out[1].net))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return out
}

func TestTwoSettleAsyncGatewaysTogetherServeAPayerNoMoreThanThePayerCanPay(t *testing.T) {
	// Each payer holds three prices. Served before they settle, six payments alternating between the two
	// gateways: each gateway alone would see funds for three, and only the holds they share stop the fourth.
	gws := twoGateways(t, gate.SettleAsync, chaintest.WithTokenBalance(big.NewInt(3*price)))
	payer := gws[0].c.Payers[0]
	headers := make([]string, 6)
	for i := range headers {
		headers[i] = gws[i%2].permit2(payer)
	}
	before := gws[0].balances(payer)
	resume := gate.PauseBackgroundSettlement()
	resumed := false
	defer func() {
		if !resumed {
			resume()
		}
	}()

	served, refused := 0, 0
	for i, h := range headers {
		a := gws[i%2].get(x402.HeaderPaymentSignature, h)
		switch a.status {
		case http.StatusOK:
			served++
		case http.StatusPaymentRequired:
			refused++
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if err != nil || pr.Error == "" {
				t.Fatalf("payment %d refused without a reason: %+v, %v", i, pr, err)
			}
		default:
			t.Fatalf("payment %d on gateway %d = %d %q; want 200 or 402", i, i%2, a.status, a.body)
		}
	}
	if served != 3 || refused != 3 {
		t.Fatalf("the two gateways served %d payments and refused %d; want 3 and 3: the payer can pay for three", served, refused)
	}
	resume()
	resumed = true
	deadline := time.Now().Add(30 * time.Second)
	for gws[0].gate.Ledger().Backlog()+gws[1].gate.Ledger().Backlog() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the served payments did not settle in time")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != 3*price || gained.Int64() != 3*price {
		t.Fatalf("the payer lost %s and the seller gained %s; want exactly %d: every served payment paid", lost, gained, 3*price)
	}
}

func TestOnePaymentPresentedToTwoGatewaysAtOnceBuysOneResponse(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			gws := twoGateways(t, settle)
			payer := gws[0].c.Payers[1]
			for round := range 3 {
				h := gws[0].permit2(payer)
				before := gws[0].balances(payer)
				answers := make(chan answer, 2)
				for _, g := range gws {
					go func() { answers <- g.get(x402.HeaderPaymentSignature, h) }()
				}
				got := map[int]int{}
				var seen []answer
				for range 2 {
					a := <-answers
					got[a.status]++
					seen = append(seen, a)
				}
				if got[http.StatusOK] != 1 || got[http.StatusPaymentRequired] != 1 {
					for _, a := range seen {
						pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
						t.Logf("answer %d: %q %s", a.status, a.body, pr.Error)
					}
					t.Fatalf("round %d: the two gateways answered %v; want one 200 and one 402 (already used or in flight)", round, got)
				}
				deadline := time.Now().Add(30 * time.Second)
				for gws[0].gate.Ledger().Backlog()+gws[1].gate.Ledger().Backlog() > 0 {
					if time.Now().After(deadline) {
						t.Fatal("the payment did not settle in time")
					}
					time.Sleep(10 * time.Millisecond)
				}
				if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
					t.Fatalf("round %d: the payer lost %s and the seller gained %s; want exactly %d", round, lost, gained, price)
				}
			}
			if n := gws[0].served.Load() + gws[1].served.Load(); n != 3 {
				t.Fatalf("the upstreams ran %d times for 3 payments; want 3", n)
			}
		})
	}
}

// TestAGatewayThatMayHaveLookedDeadServesNothingAndThePaymentIsServedOnceWhenPresentedAgain: the shared
// journal's database is out of reach for most of the heartbeat's TTL while a request works on a payment, so
// other gateways may have taken its in-flight mark over and be serving the payment themselves. The request
// serves nothing (502, nothing charged twice: the payment settles once); presented again, the payment is
// served once, and then never again.
func TestAGatewayThatMayHaveLookedDeadServesNothingAndThePaymentIsServedOnceWhenPresentedAgain(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			srv := pgtest.Start(t)
			const ttl = 3 * time.Second
			st, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{InstanceTTL: ttl, OpenTimeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			entered, proceed := make(chan struct{}, 1), make(chan struct{})
			var first sync.Once
			e := newEnv(t, setup{settle: settle, journal: st, upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				first.Do(func() {
					entered <- struct{}{}
					<-proceed
				})
				_, err := io.WriteString(w, "paid content")
				return err
			})})
			payer := e.c.Payers[0]
			h := e.permit2(payer)
			before := e.balances(payer)

			answers := make(chan answer, 1)
			go func() { answers <- e.get(x402.HeaderPaymentSignature, h) }()
			<-entered
			// The database goes for longer than the heartbeat can vouch for this gateway, and comes back.
			srv.Stop(t)
			time.Sleep(ttl)
			srv.Restart(t)
			close(proceed)
			a := <-answers
			if a.status != http.StatusBadGateway || !strings.Contains(a.body, "present the same payment again") {
				t.Fatalf("the request whose gateway may have looked dead = %d %q; want 502 saying to present the payment again", a.status, a.body)
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" {
				t.Fatalf("the 502 carries PAYMENT-RESPONSE %q", a.header.Get(x402.HeaderPaymentResponse))
			}

			// Presented again, as a client told to would, until the gateway's heartbeat has caught up (502
			// meanwhile, serving nothing).
			again, retryUntil := answer{}, time.Now().Add(ttl)
			for again = e.get(x402.HeaderPaymentSignature, h); again.status == http.StatusBadGateway && time.Now().Before(retryUntil); {
				time.Sleep(50 * time.Millisecond)
				again = e.get(x402.HeaderPaymentSignature, h)
			}
			if again.status != http.StatusOK || again.body != "paid content" {
				t.Fatalf("presented again = %d %q; want the response the payment bought", again.status, again.body)
			}
			if third := e.get(x402.HeaderPaymentSignature, h); third.status != http.StatusPaymentRequired {
				t.Fatalf("presented a third time = %d %q; want 402: it bought one response", third.status, third.body)
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				lost, gained := e.paid(payer, before)
				if lost.Int64() == price && gained.Int64() == price {
					break
				}
				if time.Now().After(deadline) || lost.Int64() > price {
					t.Fatalf("the payer lost %s and the seller gained %s; want %d once", lost, gained, price)
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
}
