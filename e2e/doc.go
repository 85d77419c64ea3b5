// Package e2e holds the end-to-end tests of the built binary: they build ./cmd/caddy once, run it as real
// processes on real loopback ports (Caddy, its embedded dev chain, `caddy x402 pay`, the public TypeScript
// x402 client), kill it where a crash would hurt, and judge the outcome by token balances on the chain.
//
// It has no code of its own beyond the tests, which must never reach beyond 127.0.0.1 (npm's registry, for
// the TypeScript client's install, excepted), and every process they start ends with the test.
package e2e
