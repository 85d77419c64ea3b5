// Package devchain runs a go-ethereum dev chain inside the process, for development and tests only: one
// post-merge node that seals on demand or on a period, with Permit2 and the x402 proxy at their canonical
// addresses, two tokens (the StableCoin and the USDC-like USDCoin) at fixed addresses, funded settlement wallets
// and demo payers, served over JSON-RPC. The x402 app starts one for its dev_chain option,
// `caddy x402 devchain` runs one on its own for several Caddy processes to share (dev_chain's rpc), and
// `caddy x402 pay --dev` pays as its demo payer.
//
// Its accounts' keys are derived from a public seed (see WalletKeys and PayerKeyN), so anyone can compute
// them: they must never hold anything of value on any other chain, and the chain should not listen beyond
// loopback (Start warns when it does). The engine package chain must never import devchain; it holds nothing
// the engine needs.
package devchain
