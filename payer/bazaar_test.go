package payer_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment to a server that declares bazaar echoes the declaration unchanged, as the SDK's clients do, so that
// the facilitator settling it catalogs the resource; a server that declares none gets none.
func TestAPaymentEchoesTheServersBazaarDeclaration(t *testing.T) {
	decl, err := x402.BazaarDeclaration(x402.BazaarHTTP{Method: "GET", InputExample: json.RawMessage(`{"city":"Oslo"}`)})
	if err != nil {
		t.Fatal(err)
	}
	for _, declared := range []bool{true, false} {
		s, srv := newSeller(t, x402.Version2, "10000")
		if declared {
			s.extensions = map[string]json.RawMessage{x402.ExtensionBazaar: decl}
		}
		c, _ := client(newPayer(t), 10_000)
		resp, err := c.Get(srv.URL + "/report")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("paying: %d", resp.StatusCode)
		}
		payments, _ := s.seen()
		pl, err := x402.DecodePaymentPayload(payments[len(payments)-1])
		if err != nil {
			t.Fatal(err)
		}
		got, ok := pl.Extensions[x402.ExtensionBazaar]
		if declared && (!ok || !bytes.Equal(got, decl)) {
			t.Errorf("the payment's bazaar = %s, want the declaration %s", got, decl)
		}
		if !declared && ok {
			t.Errorf("the payment echoes bazaar %s that the server never declared", got)
		}
	}
}
