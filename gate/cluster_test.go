package gate_test

import (
	"context"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// twoGateways are two gates, each with an engine and a store of its own on one PostgreSQL database, settling on
// one chain: two processes behind a load balancer.
func twoGateways(t *testing.T, settle string, opts ...chaintest.Option) [2]*env {
	t.Helper()
	gws := gateways(t, setup{settle: settle}, 2, opts...)
	return [2]*env{gws[0], gws[1]}
}

// gateways are n gates as twoGateways's, each configured by s (its journal and chain are set here), and
// returns once every wallet is leased, each engine holding its share.
func gateways(t *testing.T, s setup, n int, opts ...chaintest.Option) []*env {
	t.Helper()
	setups := make([]setup, n)
	for i := range setups {
		setups[i] = s
	}
	return gatewaysOf(t, setups, opts...)
}

// gatewaysOf is gateways, each configured by its own setup: gateways of a cluster whose configs differ (a rolling
// reload).
func gatewaysOf(t *testing.T, setups []setup, opts ...chaintest.Option) []*env {
	t.Helper()
	dsn := pgtest.Shared(t)
	c := chaintest.New(t, append([]chaintest.Option{chaintest.WithPromptCommit()}, opts...)...)
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	var out []*env
	for _, s := range setups {
		st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		s.journal, s.chain = st, c
		out = append(out, newEnv(t, s))
	}
	waitShares(t, out...)
	return out
}

// waitShares waits until the engines of envs hold every one of their wallets between them, evenly (each the
// same number, or one more), as the engines share them out once the first ones give theirs up.
func waitShares(t *testing.T, envs ...*env) {
	t.Helper()
	wallets := len(envs[0].fac.Wallets(envs[0].net))
	deadline := time.Now().Add(20 * time.Second)
	for {
		held, even := 0, true
		var got []int
		for _, e := range envs {
			k := len(e.fac.LeasedWallets(e.net))
			held += k
			got = append(got, k)
			even = even && (k == wallets/len(envs) || k == (wallets+len(envs)-1)/len(envs))
		}
		if held == wallets && even {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the engines hold %v of the %d wallets; want them all, shared evenly", got, wallets)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// required is the requirement of method (and the gate's scheme) that an unpaid request to e gets.
func (e *env) required(method string) x402.PaymentRequirements {
	e.t.Helper()
	a := e.get()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil {
		e.t.Fatalf("an unpaid request = %d %q (%v); want 402 with PAYMENT-REQUIRED", a.status, a.body, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Extra.AssetTransferMethod == method {
			return rq
		}
	}
	e.t.Fatalf("the 402 offers no %s requirement: %+v", method, pr.Accepts)
	return x402.PaymentRequirements{}
}

// boundTo is the settlement wallet a requirement binds its payment to: the upto facilitatorAddress, the erc2612
// spender.
func boundTo(rq x402.PaymentRequirements) string {
	if rq.Scheme == x402.SchemeUpto {
		return rq.Extra.FacilitatorAddress
	}
	return rq.Extra.Spender
}

// signFor signs a payment of payer for rq (upto and exact permit2 by Permit2, which payer approved; erc2612 by
// a permit to rq's spender).
func (e *env) signFor(payer *chaintest.Account, rq x402.PaymentRequirements) string {
	e.t.Helper()
	now := time.Unix(int64(e.c.HeadTime()), 0)
	var p x402.PaymentPayload
	var err error
	if rq.Extra.AssetTransferMethod == x402.TransferERC2612 {
		p, err = chain.SignERC2612Payment(payer.Key, rq, e.c.ChainID, chain.ERC2612Options{Now: now, TokenNonce: e.c.TokenNonce(payer.Address)})
	} else {
		e.c.Approve(payer, contracts.Permit2Address, new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1)))
		p, err = chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: now})
	}
	if err != nil {
		e.t.Fatalf("signing a payment for %+v: %v", rq, err)
	}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		e.t.Fatal(err)
	}
	return h
}

// boundCases are the ways to pay that bind a payment to one settlement wallet: upto (the witness's
// facilitator) and erc2612 (the permit's spender).
var boundCases = []struct {
	name, method string
	s            setup
}{
	{"upto", x402.TransferPermit2, setup{scheme: x402.SchemeUpto}},
	{"erc2612", x402.TransferERC2612, setup{config: func(c *gate.Config) { c.Offers[0].Method = x402.TransferERC2612 }}},
}

// TestEveryOfferOfAGatewayOfAClusterNamesAWalletItSendsFrom: two gateways share two wallets, one each. Every
// 402 of each names, as the upto facilitatorAddress and the erc2612 spender, the wallet that gateway holds the
// lease of (the 402s used to rotate over both, naming the other gateway's wallet every other time), and every
// payment signed against a gateway's 402 and presented to it is served and settled: nothing is refused for want
// of a wallet after its upstream ran.
func TestEveryOfferOfAGatewayOfAClusterNamesAWalletItSendsFrom(t *testing.T) {
	for _, tc := range boundCases {
		t.Run(tc.name, func(t *testing.T) {
			gws := gateways(t, tc.s, 2)
			for i, g := range gws {
				held := g.fac.LeasedWallets(g.net)
				for range 6 {
					if named := boundTo(g.required(tc.method)); !x402.ContainsAddress(hexes(held), named) {
						t.Errorf("gateway %d's 402 names %s; it holds the lease of %v only", i, named, held)
					}
				}
			}
			payer := gws[0].c.Payers[0]
			before := gws[0].balances(payer)
			const each = 3
			for i, g := range gws {
				for k := range each {
					a := g.get(x402.HeaderPaymentSignature, g.signFor(payer, g.required(tc.method)))
					resp, err := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
					if a.status != http.StatusOK || err != nil || !resp.Success {
						pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
						t.Errorf("payment %d signed against gateway %d's 402 and presented to it = %d %q (%s), settlement %+v; want 200 settled",
							k, i, a.status, a.body, pr.Error, resp)
					}
				}
			}
			want := int64(len(gws) * each * price)
			if lost, gained := gws[0].paid(payer, before); lost.Int64() != want || gained.Int64() != want {
				t.Errorf("the payer lost %s and the seller gained %s; want exactly %d", lost, gained, want)
			}
		})
	}
}

func hexes(ws []common.Address) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Hex()
	}
	return out
}

// TestAPaymentBoundToAnotherGatewaysWalletIsRefusedBeforeItsUpstreamRuns: a payment signed against gateway 0's
// 402 names gateway 0's wallet; presented to gateway 1, which cannot send from it, it is refused with 402 and a
// reason before the upstream runs or anything is served (settle after: it used to run the upstream, then answer
// 402 no_available_wallets; settle async: it used to be served, then never settled), and nothing moves. The
// refusal spends nothing: presented to gateway 0, the same payment is served and settled once.
func TestAPaymentBoundToAnotherGatewaysWalletIsRefusedBeforeItsUpstreamRuns(t *testing.T) {
	reasons := map[string]string{"upto": x402.ReasonUptoFacilitatorMismatch, "erc2612": x402.ReasonRecipientMismatch}
	for _, tc := range boundCases {
		for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
			t.Run(tc.name+"/"+settle, func(t *testing.T) {
				s := tc.s
				s.settle = settle
				gws := gateways(t, s, 2)
				payer := gws[0].c.Payers[1]
				rq := gws[0].required(tc.method)
				h := gws[0].signFor(payer, rq)
				before := gws[0].balances(payer)

				a := gws[1].get(x402.HeaderPaymentSignature, h)
				pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
				if a.status != http.StatusPaymentRequired || !strings.HasPrefix(pr.Error, reasons[tc.name]) || !strings.Contains(pr.Error, boundTo(rq)) {
					t.Errorf("presented to the other gateway = %d %q (%s); want 402 %s naming wallet %s", a.status, a.body, pr.Error, reasons[tc.name], boundTo(rq))
				}
				if n := gws[1].served.Load(); n != 0 {
					t.Errorf("the other gateway ran its upstream %d times for a payment it cannot settle", n)
				}
				for _, offered := range pr.Accepts {
					if offered.Scheme == rq.Scheme && offered.Extra.AssetTransferMethod == tc.method &&
						!x402.ContainsAddress(hexes(gws[1].fac.LeasedWallets(gws[1].net)), boundTo(offered)) {
						t.Errorf("the refusal offers %s, which the refusing gateway does not hold", boundTo(offered))
					}
				}
				if lost, gained := gws[0].paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
					t.Fatalf("the refusal cost the payer %s (the seller gained %s); want nothing", lost, gained)
				}

				if a := gws[0].get(x402.HeaderPaymentSignature, h); a.status != http.StatusOK || a.body != "paid content" {
					t.Fatalf("the same payment presented to the gateway that offered it = %d %q; want 200", a.status, a.body)
				}
				gws[0].waitPaidOnce(t, payer, before, price, 20*time.Second)
			})
		}
	}
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
	resume := ledgers.PauseBackgroundSettlement()
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
			e.waitPaidOnce(t, payer, before, price, 30*time.Second)
		})
	}
}

// TestAStreamWhoseGatewayMayHaveLookedDeadIsCutShortAndServedOnceWhenPresentedAgain: a paid-for response larger
// than max_buffer streams, and midway the shared journal's database is out of reach for most of the heartbeat's
// TTL, so that another gateway may have taken the payment's in-flight mark over and be serving it too. The rest of
// the stream is not sent: the response is cut short (the client cannot take it for whole), and the payment,
// presented again, is served once, whole, and then never again; it settles once.
func TestAStreamWhoseGatewayMayHaveLookedDeadIsCutShortAndServedOnceWhenPresentedAgain(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			srv := pgtest.Start(t)
			const ttl = 3 * time.Second
			st, err := journal.OpenPostgres(context.Background(), srv.DSN(), journal.Options{InstanceTTL: ttl, OpenTimeout: time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			part := strings.Repeat("s", 4<<10)
			streaming, proceed := make(chan struct{}, 1), make(chan struct{})
			var first sync.Once
			e := newEnv(t, setup{settle: settle, journal: st, config: func(cfg *gate.Config) { cfg.MaxBuffer = 1 << 10 },
				upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
					if _, err := io.WriteString(w, part); err != nil {
						return err
					}
					http.NewResponseController(w).Flush()
					first.Do(func() {
						streaming <- struct{}{}
						<-proceed
					})
					_, err := io.WriteString(w, part)
					return err
				})})
			payer := e.c.Payers[0]
			h := e.permit2(payer)
			before := e.balances(payer)

			req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/report", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set(x402.HeaderPaymentSignature, h)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("the paid stream = %d; want 200", resp.StatusCode)
			}
			<-streaming
			// The database goes for longer than the heartbeat can vouch for this gateway, and comes back.
			srv.Stop(t)
			time.Sleep(ttl)
			srv.Restart(t)
			close(proceed)
			body, err := io.ReadAll(resp.Body)
			if err == nil || len(body) >= 2*len(part) {
				t.Fatalf("the stream whose gateway may have looked dead delivered %d bytes of %d (read error %v); want it cut short", len(body), 2*len(part), err)
			}

			// Presented again, as a client whose response was cut short does, until the gateway's heartbeat has
			// caught up (502 meanwhile, serving nothing).
			again, retryUntil := answer{}, time.Now().Add(ttl)
			for again = e.get(x402.HeaderPaymentSignature, h); again.status == http.StatusBadGateway && time.Now().Before(retryUntil); {
				time.Sleep(50 * time.Millisecond)
				again = e.get(x402.HeaderPaymentSignature, h)
			}
			if again.status != http.StatusOK || again.body != part+part {
				t.Fatalf("presented again = %d, %d bytes; want 200 and the whole response the payment bought", again.status, len(again.body))
			}
			if third := e.get(x402.HeaderPaymentSignature, h); third.status != http.StatusPaymentRequired {
				t.Fatalf("presented a third time = %d %q; want 402: it bought one response", third.status, third.body)
			}
			e.waitPaidOnce(t, payer, before, price, 30*time.Second)
		})
	}
}

// TestAServedAsyncPaymentIsSettledByTheHolderOfTheWalletItIsBoundTo: three instances share three wallets, one
// each: C and B run settle async upto gates, A only the engine so far. C serves an upto payment (bound to C's
// wallet) and goes before it settles. The living share the wallets anew, A (first by its token) taking two, C's
// among them; B's gate takes C's served payment over, as it takes every payment of a gone instance, but B cannot
// send from C's wallet: only A can. B's engine hands the settlement to A's, which holds the wallet (see chain's
// handoff.go), or, once A runs a gate too, A takes the payment over from B, which is alive: either way it
// settles once, from C's wallet. (Before: B retried until the payment expired, and it went unpaid.) Past its
// authorization's deadline before anyone tries it again, nobody can settle it: its record says so, final, and
// payment_failed is reported; the resource went unpaid.
func TestAServedAsyncPaymentIsSettledByTheHolderOfTheWalletItIsBoundTo(t *testing.T) {
	for _, holderRunsAGate := range []bool{true, false} {
		name := "the holder settles it"
		if !holderRunsAGate {
			name = "nobody can: failed at its deadline"
		}
		t.Run(name, func(t *testing.T) {
			dsn := pgtest.Shared(t)
			c := chaintest.New(t, chaintest.WithPromptCommit())
			t.Cleanup(c.AutoCommit(5 * time.Millisecond))
			open := func() *journal.PostgresStore {
				st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { st.Close() })
				return st
			}
			sa, sb := open(), open()
			if sb.Instance() < sa.Instance() {
				sa, sb = sb, sa // A ranks first of the two that stay: it takes two wallets of three
			}
			var failed []map[string]any
			var mu sync.Mutex
			s := setup{settle: gate.SettleAsync, scheme: x402.SchemeUpto, wallets: 3, chain: c, config: func(cfg *gate.Config) {
				cfg.Event = func(r *http.Request, name string, data func() map[string]any) {
					if name == gate.EventFailed && r == nil {
						mu.Lock()
						failed = append(failed, data())
						mu.Unlock()
					}
				}
			}}
			withStore := func(st journal.Store, noGate bool) setup {
				x := s
				x.journal, x.noGate = st, noGate
				return x
			}
			a := newEnv(t, withStore(sa, true))
			b := newEnv(t, withStore(sb, false))
			sc := open()
			gc := newEnv(t, withStore(sc, false))
			waitShares(t, a, b, gc)

			resume := ledgers.PauseBackgroundSettlement()
			resumed := false
			defer func() {
				if !resumed {
					resume()
				}
			}()
			payer := c.Payers[0]
			rq := gc.required(x402.TransferPermit2)
			bound := common.HexToAddress(boundTo(rq))
			h := gc.signFor(payer, rq)
			before := gc.balances(payer)
			if got := gc.get(x402.HeaderPaymentSignature, h); got.status != http.StatusOK {
				t.Fatalf("the async payment at C = %d %q; want 200", got.status, got.body)
			}
			// C goes, its payment served and not settled: its gate, its engine (which gives its leases up), its
			// store (its instance).
			_ = gc.gate.Close()
			gc.fac.Close()
			sc.Close()

			deadline := time.Now().Add(20 * time.Second)
			for !slices.Contains(a.fac.LeasedWallets(a.net), bound) {
				if time.Now().After(deadline) {
					t.Fatalf("A holds %v and B %v; want A (first by its token, two wallets of three) to hold C's wallet %s",
						a.fac.LeasedWallets(a.net), b.fac.LeasedWallets(b.net), bound.Hex())
				}
				time.Sleep(20 * time.Millisecond)
			}
			var rec journal.Record
			for {
				recs, err := sb.PendingOf(context.Background(), true)
				if err != nil {
					t.Fatal(err)
				}
				if len(recs) == 1 && recs[0].Owner == sb.Instance() {
					rec = recs[0]
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("B did not take over C's served payment: %+v", recs)
				}
				time.Sleep(50 * time.Millisecond)
			}
			sent := c.TxCount(bound)
			if !holderRunsAGate {
				// Past the payment's deadline (chain time), before B tries it again: nothing can settle it now.
				c.AdjustTime(time.Duration(rq.MaxTimeoutSeconds+120) * time.Second)
			}
			resume()
			resumed = true

			if !holderRunsAGate {
				deadline := time.Now().Add(30 * time.Second)
				for {
					got, _, err := sb.Get(context.Background(), rec.ID)
					if err == nil && got.State == journal.StateFinal {
						if got.Response == nil || got.Response.Success {
							t.Fatalf("the payment's final record says %+v; want a failure naming why", got.Response)
						}
						t.Logf("final: %s: %s", got.Response.ErrorReason, got.Response.ErrorMessage)
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("the payment nobody can settle is still %s past its deadline; want a final failure", got.State)
					}
					time.Sleep(50 * time.Millisecond)
				}
				waitBacklog(t, b)
				mu.Lock()
				defer mu.Unlock()
				if len(failed) != 1 || failed[0]["async"] != true || failed[0]["reason"] == "" || !strings.EqualFold(fmt.Sprint(failed[0]["payer"]), payer.Address.Hex()) {
					t.Fatalf("payment_failed events of background settlements: %v; want one, of the payer's async payment, with its reason", failed)
				}
				if lost, gained := gc.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
					t.Fatalf("the payer lost %s and the seller gained %s; want nothing moved", lost, gained)
				}
				return
			}

			a.startGate()
			deadline = time.Now().Add(30 * time.Second)
			for {
				got, _, err := sa.Get(context.Background(), rec.ID)
				if err == nil && got.State == journal.StateFinal {
					if got.Response == nil || !got.Response.Success || (got.Owner != sa.Instance() && got.Owner != sb.Instance()) {
						t.Fatalf("the payment's final record is %+v, owner %s; want settled by A (%s) or by B (%s) through A's engine",
							got.Response, got.Owner, sa.Instance(), sb.Instance())
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the payment bound to A's wallet is still %s (owner %s, A is %s, B is %s)", got.State, got.Owner, sa.Instance(), sb.Instance())
				}
				time.Sleep(50 * time.Millisecond)
			}
			waitBacklog(t, a, b)
			if lost, gained := gc.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
				t.Fatalf("the payer lost %s and the seller gained %s; want exactly %d", lost, gained, price)
			}
			if n := c.TxCount(bound) - sent; n != 1 {
				t.Fatalf("C's wallet, now A's, sent %d transactions; want the one settlement", n)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(failed) != 0 {
				t.Fatalf("payment_failed reported for a payment that settled: %v", failed)
			}
		})
	}
}

// waitBacklog waits until the ledgers of envs have no background settlement left.
func waitBacklog(t *testing.T, envs ...*env) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := 0
		for _, e := range envs {
			n += e.gate.Ledger().Backlog()
		}
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d background settlements are still running", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestAGatewayOffersTheWalletsItTakesOverOnceItHoldsThem: two gateways hold one wallet each; the second goes (its
// engine gives its lease up, its instance leaves). Once the first holds both wallets, its 402s name both in
// turn: its offers follow its leases without a restart, and payments bound to the wallet it took over settle.
func TestAGatewayOffersTheWalletsItTakesOverOnceItHoldsThem(t *testing.T) {
	gws := gateways(t, setup{scheme: x402.SchemeUpto}, 2)
	first, second := gws[0], gws[1]
	held := first.fac.LeasedWallets(first.net)
	for range 4 {
		if named := boundTo(first.required(x402.TransferPermit2)); !x402.ContainsAddress(hexes(held), named) {
			t.Fatalf("before: the first gateway's 402 names %s; it holds %v", named, held)
		}
	}
	_ = second.gate.Close()
	second.fac.Close()
	second.store.Close()
	deadline := time.Now().Add(20 * time.Second)
	for len(first.fac.LeasedWallets(first.net)) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the first gateway holds %v after the second went; want both wallets", first.fac.LeasedWallets(first.net))
		}
		time.Sleep(20 * time.Millisecond)
	}
	named := map[string]bool{}
	payer := first.c.Payers[2]
	before := first.balances(payer)
	var rqs []x402.PaymentRequirements
	for range 4 {
		rq := first.required(x402.TransferPermit2)
		named[strings.ToLower(boundTo(rq))] = true
		rqs = append(rqs, rq)
	}
	for _, rq := range rqs {
		if a := first.get(x402.HeaderPaymentSignature, first.signFor(payer, rq)); a.status != http.StatusOK {
			t.Fatalf("a payment bound to %s = %d %q; want 200", boundTo(rq), a.status, a.body)
		}
	}
	if len(named) != 2 {
		t.Fatalf("the first gateway's 402s named %v once it held both wallets; want both, in turn", named)
	}
	if lost, gained := first.paid(payer, before); lost.Int64() != 4*price || gained.Int64() != 4*price {
		t.Fatalf("the payer lost %s and the seller gained %s; want exactly %d", lost, gained, 4*price)
	}
}
