// Package chain is the EVM side of the embedded x402 facilitator: EIP-712 digests of the EIP-2612 Permit and
// the Permit2 PermitWitnessTransferFrom, signature parsing and recovery, payer-side signing of x402 payments,
// and (as it grows) verification, settlement, the wallet pool, nonces, RPC failover and the settlement journal.
// For the batch-settlement scheme (batch.go, batch_deposit.go): its digests (channel id, voucher, refund, claim
// batch, deposit authorizations) and the off-chain checks of a voucher and a deposit, which a voucher-paid
// request runs with no chain call.
//
// The digest and recovery code sits on the hot path of every paid request: it hand-rolls the EIP-712
// encoding over fixed-size buffers and caches domain separators, and is cross-checked against go-ethereum's
// apitypes in tests.
//
// It must never import Caddy or know about HTTP servers, and it must never import facilitatorclient. The dev
// chain (a whole go-ethereum node) lives in chain/devchain, which may import chain; chain never imports it.
package chain
