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
