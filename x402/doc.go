// Package x402 is the x402 payment protocol as data: the wire types of versions 1 and 2, the payment header
// codec, strict amount and price parsing, CAIP-2 network identifiers, reason codes, the PaymentOutcome of a
// gated request with its HTTP status, and the Facilitator interface.
//
// It must never import Caddy, go-ethereum or any other package of this module: it is the vocabulary both
// sides share, and it stays pure, fast and fuzzed.
package x402
