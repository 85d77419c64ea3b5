package payer

import (
	"encoding/json"

	"github.com/x402-gateway/caddy-x402/x402"
)

// echoDiscovery adds to a version 2 payment the server's bazaar declaration, unchanged, as the SDK's clients
// echo it: the facilitator that settles the payment catalogs the resource from it. A server that declared none
// gets none.
func echoDiscovery(offer Offer, pl *x402.PaymentPayload) {
	declared, ok := offer.Required.Extensions[x402.ExtensionBazaar]
	if !ok || offer.Version != x402.Version2 {
		return
	}
	if pl.Extensions == nil {
		pl.Extensions = map[string]json.RawMessage{}
	}
	pl.Extensions[x402.ExtensionBazaar] = declared
}
