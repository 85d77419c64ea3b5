// Package facilitatorserver is the HTTP side of an x402 facilitator: a Server that serves any x402.Facilitator
// (the embedded engine of package chain, or remote facilitators through package facilitatorclient) as
// GET /supported, POST /verify, POST /settle and GET /health, with the refusals a public endpoint needs: API
// keys, body limits, kinds and networks, payment terms (min_amount, pay_to) and rate limits of /settle and
// /verify. It is the sibling of facilitatorclient, and tested against it.
//
// It knows HTTP and package x402, never Caddy (package caddymodule adapts it to a Caddy handler) and never the
// engine. It must never log or echo an API key, nor an RPC URL with the key in it (Options.Redact hides those in
// every error text before it is logged or answered), and it must never call the facilitator behind for a request
// it refuses: unauthorised, malformed, too large, of a wrong method, of a kind, network or terms it does not
// serve, or over the rate limit.
package facilitatorserver
