// Package facilitatorclient is x402.Facilitator over HTTP: a Client for one remote facilitator
// (GET /supported, POST /verify, POST /settle, GET /health) and a Failover set that routes each payment only
// to members whose /supported says they can take it.
//
// A payment the facilitator refuses comes back as an answer, never as an error; an error is always an
// *x402.FacilitatorError whose Kind tells an unreachable facilitator from a malformed answer from a refused
// request. Every answer passed on is about the payment asked of: a settlement's success names its network,
// payer and amount and a transaction, a verification's names its signer or no payer; any other is an error
// wrapping x402.ErrAnswerNotThisPayment, the outcome unknown, so that every caller is protected, not only a gate. /verify and /supported are retried on transport errors; /settle is only ever resent as the very
// same bytes, never after any HTTP response arrived, and SettleDetailed reports when that happened.
//
// It must never import Caddy, go-ethereum or package chain: it speaks the protocol of package x402 and
// nothing else, and it must never put the API key into an error, a log line or a String.
package facilitatorclient
