package gate_test

import (
	"encoding/json"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// permit2Named is a signed permit2 payment of payer naming its payment-identifier extension ext ("" none).
func (e *env) permit2Named(payer *chaintest.Account, ext string) string {
	e.t.Helper()
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	e.c.Approve(payer, contracts.Permit2Address, max)
	p, err := chain.SignPermit2Payment(payer.Key, e.offer(), e.c.ChainID,
		chain.Permit2Options{Now: time.Unix(int64(e.c.HeadTime()), 0)})
	if err != nil {
		e.t.Fatalf("signing a permit2 payment: %v", err)
	}
	if ext != "" {
		p.Extensions = map[string]json.RawMessage{x402.ExtensionPaymentIdentifier: json.RawMessage(ext)}
	}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		e.t.Fatal(err)
	}
	return h
}

func TestAGateDeclaresPaymentIdentifierInIts402AsTheSDKDoes(t *testing.T) {
	for _, mode := range []string{gate.PaymentIdentifierOptional, gate.PaymentIdentifierRequired} {
		t.Run(mode, func(t *testing.T) {
			e := newEnv(t, setup{config: func(c *gate.Config) { c.PaymentIdentifier = mode }})
			a := e.get()
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if err != nil {
				t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
			}
			var decl struct {
				Info struct {
					Required *bool `json:"required"`
				} `json:"info"`
				Schema map[string]any `json:"schema"`
			}
			if err := json.Unmarshal(pr.Extensions[x402.ExtensionPaymentIdentifier], &decl); err != nil || decl.Info.Required == nil {
				t.Fatalf("extensions = %s (%v), want payment-identifier with info.required", pr.Extensions, err)
			}
			if *decl.Info.Required != (mode == gate.PaymentIdentifierRequired) || decl.Schema["type"] != "object" {
				t.Errorf("payment-identifier = %+v, want required %v and its schema", decl, mode == gate.PaymentIdentifierRequired)
			}
		})
	}
	e := newEnv(t, setup{})
	pr, err := x402.DecodePaymentRequired(e.get().header.Get(x402.HeaderPaymentRequired))
	if err != nil || pr.Extensions[x402.ExtensionPaymentIdentifier] != nil {
		t.Errorf("a gate not configured for it declares %s (%v)", pr.Extensions, err)
	}
}

func TestAPaymentWithABadOrMissingRequiredPaymentIdentifierIs400NamingTheFieldAndNothingMoves(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) { c.PaymentIdentifier = gate.PaymentIdentifierRequired }})
	payer := e.c.Payers[0]
	before := e.balances(payer)
	for _, tc := range []struct{ name, ext, says string }{
		{"no extension", "", "requires a payment identifier"},
		{"no id", `{"info":{"required":true}}`, "requires a payment identifier"},
		{"too short", `{"info":{"required":true,"id":"pay_short"}}`, "extensions.payment-identifier.info.id must be 16 to 128 characters"},
		{"a slash", `{"info":{"required":true,"id":"pay_0123456789/abcdef"}}`, "extensions.payment-identifier.info.id may hold only"},
		{"not a string", `{"info":{"required":true,"id":12345678901234567}}`, "extensions.payment-identifier"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := e.get(x402.HeaderPaymentSignature, e.permit2Named(payer, tc.ext))
			if a.status != http.StatusBadRequest {
				t.Fatalf("payment = %d %q, want 400", a.status, a.body)
			}
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if err != nil || !strings.Contains(pr.Error, tc.says) {
				t.Fatalf("the answer says %q (%v), want it to say %q", pr.Error, err, tc.says)
			}
		})
	}
	if e.served.Load() != 0 {
		t.Errorf("the upstream ran %d times for refused payments", e.served.Load())
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Errorf("the payer lost %s and the seller gained %s for refused payments, want nothing", lost, gained)
	}

	a := e.get(x402.HeaderPaymentSignature, e.permit2Named(payer, `{"info":{"required":true,"id":"pay_7d5d747be160e280504c099d984bcfe0"}}`))
	if a.status != http.StatusOK {
		t.Fatalf("a payment naming a good id = %d %q, want 200", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d", lost, gained, price)
	}
}

func TestAGateNotDeclaringPaymentIdentifierIgnoresIt(t *testing.T) {
	e := newEnv(t, setup{})
	a := e.get(x402.HeaderPaymentSignature, e.permit2Named(e.c.Payers[0], `{"info":{"id":"bad"}}`))
	if a.status != http.StatusOK {
		t.Fatalf("payment = %d %q, want 200: the gate never asked for an id", a.status, a.body)
	}
}

// namedBy is the payment-identifier extension naming id, as the SDK's client echoes the declaration with it.
func namedBy(id string) string {
	return `{"info":{"required":false,"id":"` + id + `"},"schema":{"type":"object"}}`
}

func TestTheSamePaymentIdentifierWithAnotherPaymentIs409AndNothingIsVerifiedOrCharged(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleBefore, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			e := newEnv(t, setup{settle: settle, config: func(c *gate.Config) { c.PaymentIdentifier = gate.PaymentIdentifierOptional }})
			payer := e.c.Payers[0]
			before := e.balances(payer)
			first := e.permit2Named(payer, namedBy("pay_7d5d747be160e280504c099d984bcfe0"))
			if a := e.get(x402.HeaderPaymentSignature, first); a.status != http.StatusOK {
				t.Fatalf("first payment = %d %q, want 200", a.status, a.body)
			}
			e.waitPaidOnce(t, payer, before, price, 10*time.Second)

			other := e.permit2Named(payer, namedBy("pay_7d5d747be160e280504c099d984bcfe0"))
			a := e.get(x402.HeaderPaymentSignature, other)
			if a.status != http.StatusConflict || !strings.Contains(a.body, "pay_7d5d747be160e280504c099d984bcfe0 already names another payment") {
				t.Fatalf("another payment with the same id = %d %q, want 409 naming the id", a.status, a.body)
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" {
				t.Errorf("the 409 carries PAYMENT-RESPONSE %q", a.header.Get(x402.HeaderPaymentResponse))
			}
			// The same payment again is presented again, as without an id: it bought its response already.
			if a := e.get(x402.HeaderPaymentSignature, first); a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.ReasonPaymentAlreadyUsed) {
				t.Errorf("the first payment again = %d %q, want 402 %s", a.status, a.body, x402.ReasonPaymentAlreadyUsed)
			}
			time.Sleep(200 * time.Millisecond) // an async settlement would have started by now
			if e.served.Load() != 1 {
				t.Errorf("the upstream ran %d times, want once", e.served.Load())
			}
			if n := e.c.CountTokenTransfers(payer.Address, e.payTo); n != 1 {
				t.Errorf("%d token transfers from payer to seller, want 1", n)
			}
			if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
				t.Errorf("the payer lost %s and the seller gained %s, want %d", lost, gained, price)
			}
		})
	}
}

func TestAPaymentIdentifierIsThePayersOwnAndOneThatBoughtNothingNamesANewPayment(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) { c.PaymentIdentifier = gate.PaymentIdentifierOptional }})
	alice, bob := e.c.Payers[0], e.c.Payers[1]
	beforeA, beforeB := e.balances(alice), e.balances(bob)
	const id = "shared_id_0123456789"

	// The upstream fails: the payment buys nothing, so its id may name the next one (the SDK keeps ids of
	// settled payments only).
	e.failing.Store(true)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(alice, namedBy(id))); a.status != http.StatusServiceUnavailable {
		t.Fatalf("payment to a failing upstream = %d %q, want 503", a.status, a.body)
	}
	e.failing.Store(false)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(alice, namedBy(id))); a.status != http.StatusOK {
		t.Fatalf("a new payment with the id of one that bought nothing = %d %q, want 200", a.status, a.body)
	}
	// Another payer's id is its own.
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(bob, namedBy(id))); a.status != http.StatusOK {
		t.Fatalf("another payer's payment with the same id = %d %q, want 200", a.status, a.body)
	}
	for _, p := range []struct {
		who    *chaintest.Account
		before [2]*big.Int
	}{{alice, beforeA}, {bob, beforeB}} {
		if lost := new(big.Int).Sub(p.before[0], e.c.TokenBalance(p.who.Address)); lost.Int64() != price {
			t.Errorf("payer %s lost %s, want %d", p.who.Address, lost, price)
		}
	}
}

func TestTwoPaymentsOfOneIdentifierAtTwoGatewaysOfAClusterBuyOneResponse(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			gws := gateways(t, setup{settle: settle, config: func(c *gate.Config) { c.PaymentIdentifier = gate.PaymentIdentifierRequired }}, 2)
			payer := gws[0].c.Payers[1]
			before := gws[0].balances(payer)
			for round := range 3 {
				id := "pay_cluster_round_" + strings.Repeat("x", round+1)
				headers := [2]string{gws[0].permit2Named(payer, namedBy(id)), gws[1].permit2Named(payer, namedBy(id))}
				answers := make(chan answer, 2)
				for i, g := range gws {
					go func() { answers <- g.get(x402.HeaderPaymentSignature, headers[i]) }()
				}
				got := map[int]int{}
				for range 2 {
					a := <-answers
					got[a.status]++
					if a.status != http.StatusOK && a.status != http.StatusConflict {
						t.Logf("answer %d %q", a.status, a.body)
					}
				}
				if got[http.StatusOK] != 1 || got[http.StatusConflict] != 1 {
					t.Fatalf("round %d: two payments of one id at two gateways answered %v; want one 200 and one 409", round, got)
				}
				// Sent to either gateway after, another payment of the id is refused too.
				if a := gws[round%2].get(x402.HeaderPaymentSignature, gws[0].permit2Named(payer, namedBy(id))); a.status != http.StatusConflict {
					t.Fatalf("round %d: a third payment of the id = %d %q, want 409", round, a.status, a.body)
				}
			}
			deadline := time.Now().Add(30 * time.Second)
			for gws[0].gate.Ledger().Backlog()+gws[1].gate.Ledger().Backlog() > 0 {
				if time.Now().After(deadline) {
					t.Fatal("the payments did not settle in time")
				}
				time.Sleep(10 * time.Millisecond)
			}
			if lost, gained := gws[0].paid(payer, before); lost.Int64() != 3*price || gained.Int64() != 3*price {
				t.Fatalf("the payer lost %s and the seller gained %s for 3 ids; want exactly %d", lost, gained, 3*price)
			}
			if n := gws[0].served.Load() + gws[1].served.Load(); n != 3 {
				t.Fatalf("the upstreams ran %d times for 3 ids; want 3", n)
			}
		})
	}
}

func TestAnUptoPaymentsIdentifierNamesItAndAnotherUptoPaymentOfTheIdIs409(t *testing.T) {
	e := newEnv(t, setup{scheme: x402.SchemeUpto, override: func(*http.Request) string { return `{"amount":"4321"}` },
		config: func(c *gate.Config) { c.PaymentIdentifier = gate.PaymentIdentifierRequired }})
	payer := e.c.Payers[0]
	before := e.balances(payer)
	const id = "pay_upto_0123456789abcdef"
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(payer, namedBy(id))); a.status != http.StatusOK {
		t.Fatalf("an upto payment naming an id = %d %q, want 200", a.status, a.body)
	}
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(payer, namedBy(id))); a.status != http.StatusConflict {
		t.Fatalf("another upto payment of the id = %d %q, want 409", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != 4321 || gained.Int64() != 4321 {
		t.Errorf("the payer lost %s and the seller gained %s, want the 4321 the upstream named once", lost, gained)
	}
	if n := e.c.CountTokenTransfers(payer.Address, e.payTo); n != 1 {
		t.Errorf("%d token transfers, want 1", n)
	}
}
