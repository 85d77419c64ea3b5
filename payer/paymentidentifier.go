package payer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"

	"github.com/x402-gateway/caddy-x402/x402"
)

// paymentIdentifierKey is the context key of WithPaymentIdentifier.
type paymentIdentifierKey struct{}

// WithPaymentIdentifier returns ctx naming the payments signed under it (Payer.Sign, a Transport's request sent
// with it) with id, in the payment-identifier extension of a server that declares it: a client that sends the
// same signed payment again under the same id gets the same outcome, and a server refuses (409) another payment
// naming it. id must be 16 to 128 letters, digits, '-' and '_'.
func WithPaymentIdentifier(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, paymentIdentifierKey{}, id)
}

// NewPaymentIdentifier returns a fresh payment identifier as the SDK's clients make them: "pay_" and 32 hex digits
// of randomness.
func NewPaymentIdentifier() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return "pay_" + hex.EncodeToString(b[:])
}

// namePayment adds to pl the payment-identifier extension, when the offer declares it, as the SDK's clients do:
// the server's declaration with the id added to its info. The id is ctx's (WithPaymentIdentifier), or a new one
// where the caller named none. It returns the id, "" when the server declared no such extension.
func namePayment(ctx context.Context, offer Offer, pl *x402.PaymentPayload) (string, error) {
	declared, ok := offer.Required.Extensions[x402.ExtensionPaymentIdentifier]
	if !ok {
		return "", nil
	}
	id, _ := ctx.Value(paymentIdentifierKey{}).(string)
	if id == "" {
		id = NewPaymentIdentifier()
	}
	if err := x402.CheckPaymentIdentifier(id); err != nil {
		return "", err
	}
	added, err := json.Marshal(map[string]map[string]string{"info": {"id": id}})
	if err != nil {
		return "", err
	}
	merged, err := x402.MergeExtension(declared, added)
	if err != nil {
		return "", fmt.Errorf("extensions.%s: %w", x402.ExtensionPaymentIdentifier, err)
	}
	if pl.Extensions == nil {
		pl.Extensions = map[string]json.RawMessage{}
	}
	pl.Extensions[x402.ExtensionPaymentIdentifier] = merged
	return id, nil
}
