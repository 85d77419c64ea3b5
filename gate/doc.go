// Package gate is the x402 payment gate without a server around it: the exchange of one request (read the
// payment header, match it against the offers, verify, run the next handler with its response held back,
// settle, answer with exactly one PaymentOutcome), the serve-once ledger a journal's gates share (payments in
// flight, async settlement in the background and its replay after a restart, pruning), the offers and the
// 402 answers, the paywall page and CORS. It takes an x402.Facilitator (in-process or remote, it does not
// care), a journal.Store and a next Handler; what a server wants to observe (placeholders, metrics, logs)
// comes out through the hooks of Config.
//
// It must never import Caddy: caddymodule adapts it to Caddy, and anything Caddy-specific belongs there.
// One payment buys one response, and the payer never pays for an upstream error unless the gate settles before.
package gate
