// Package caddymodule adapts Caddy to the x402 packages: the `x402` app (networks, the embedded facilitator
// engine and the settlement journal, shared by every handler and kept across config reloads), the payment gate
// handler `http.handlers.x402` (over package gate), the facilitator handler `http.handlers.x402_facilitator`, their Caddyfile
// parsing, placeholders and metrics, and the `caddy x402 ...` subcommands.
//
// It is the only package that knows Caddy, and it stays thin: no protocol or chain logic lives here.
package caddymodule
