package payer_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

func TestTransportNamesItsPaymentWithTheRequestsIdentifierWhereTheServerDeclaresIt(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "10000")
	s.extensions = map[string]json.RawMessage{x402.ExtensionPaymentIdentifier: x402.PaymentIdentifierDeclaration(true)}
	c, _ := client(newPayer(t), 10_000)
	const id = "pay_7d5d747be160e280504c099d984bcfe0"

	get := func(ctx context.Context) x402.PaymentPayload {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/report", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		payments, _ := s.seen()
		pl, err := x402.DecodePaymentPayload(payments[len(payments)-1])
		if err != nil {
			t.Fatalf("the payment does not decode: %v", err)
		}
		return pl
	}
	pl := get(payer.WithPaymentIdentifier(context.Background(), id))
	if got, err := pl.PaymentIdentifier(); err != nil || got != id {
		t.Fatalf("the payment names %q (%v), want %q", got, err, id)
	}
	var ext struct {
		Info   map[string]any `json:"info"`
		Schema map[string]any `json:"schema"`
	}
	if err := json.Unmarshal(pl.Extensions[x402.ExtensionPaymentIdentifier], &ext); err != nil || ext.Info["required"] != true || ext.Schema["type"] != "object" {
		t.Fatalf("the extension = %s (%v), want the declaration echoed beside the id", pl.Extensions[x402.ExtensionPaymentIdentifier], err)
	}

	// Named by nobody, the payment gets an id of its own, as the SDK's clients give one.
	if got, err := get(context.Background()).PaymentIdentifier(); err != nil || !strings.HasPrefix(got, "pay_") || len(got) != 36 {
		t.Fatalf("an unnamed payment names %q (%v), want a fresh pay_ id", got, err)
	}

	// A bad id is refused before anything is sent.
	before, _ := s.seen()
	req, _ := http.NewRequestWithContext(payer.WithPaymentIdentifier(context.Background(), "short"), http.MethodGet, srv.URL+"/report", nil)
	if resp, err := c.Do(req); err == nil || !strings.Contains(err.Error(), "info.id must be 16 to 128 characters") {
		if resp != nil {
			resp.Body.Close()
		}
		t.Fatalf("a bad id: error %v, want one naming info.id", err)
	}
	if after, _ := s.seen(); len(after) != len(before)+1 {
		t.Errorf("%d requests reached the server for a bad id, want only the unpaid one", len(after)-len(before))
	}
}

func TestTransportAddsNoIdentifierWhereTheServerDeclaresNone(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "10000")
	c, _ := client(newPayer(t), 10_000)
	req, _ := http.NewRequestWithContext(payer.WithPaymentIdentifier(context.Background(), "pay_7d5d747be160e280504c099d984bcfe0"), http.MethodGet, srv.URL+"/report", nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	payments, _ := s.seen()
	pl, err := x402.DecodePaymentPayload(payments[len(payments)-1])
	if err != nil || pl.Extensions[x402.ExtensionPaymentIdentifier] != nil {
		t.Fatalf("the payment's extensions = %s (%v), want no payment-identifier", pl.Extensions, err)
	}
}
