// Package payer is the paying side of x402 on EVM chains: it reads a 402 Payment Required answer (the
// PAYMENT-REQUIRED header of version 2, or the JSON body of version 1), chooses one of the offered
// requirements, signs its payment (permit2, eip3009 or erc2612, with eip2612GasSponsoring when a permit2 payer
// has not approved Permit2) and encodes it as the header the server reads. Transport does all of that inside
// an http.RoundTripper, so that any http.Client pays for what it fetches, within a spending limit.
//
// `caddy x402 pay` is a thin command over this package, and Go programs import it directly. It knows HTTP,
// x402 and chain signing, never Caddy.
//
// What it must never do:
//   - sign a payment over the Transport's limit: the amount is checked, and the budget reserved, before
//     anything is signed, and a payment no limit covers is refused;
//   - give budget back on a server's word: a signed payment counts at its amount until the chain shows it
//     cost less or can no longer be settled;
//   - sign a payment valid longer than Options.MaxValidity, or for a Permit2 or proxy other than those pinned
//     for its network (a hostile 402 names the spender it wants);
//   - log, print or put into an error the payer's private key (a Payer prints as its address), or an RPC
//     URL's credentials (errors name the RPC by scheme and host only);
//   - send a payment anywhere but to the request that asked for it: it retries that request once, and
//     follows no redirect with the payment attached.
package payer
