// Package chaintest runs an in-process simulated EVM chain for tests of other packages:
// Permit2 and the x402 exact proxy at their canonical addresses, a deployed StableCoin,
// deterministic funded accounts (a deployer, settlement wallets, payers with and without
// ETH), helpers that read and move tokens, and EIP-712 signing of payer authorizations
// done with go-ethereum's apitypes, independently of package chain.
//
// It must never import package chain (whose tests use it), and it never touches a network
// beyond 127.0.0.1: the optional JSON-RPC endpoint (WithHTTP) listens on loopback only.
package chaintest
