// pay.mjs pays for one URL with the public TypeScript x402 client (@x402/fetch with @x402/evm's exact and upto
// EVM schemes), as a third party's agent would, and prints what happened as one JSON line on stdout for
// e2e/interop_test.go and e2e/upto_interop_test.go to check.
//
//   X402_PAYER_KEY=0x... X402_RPC_URL=http://127.0.0.1:8545 node pay.mjs <url>
//
// Environment:
//   X402_PAYER_KEY   the payer's private key, hex (read from the environment so it never shows in `ps`)
//   X402_RPC_URL     JSON-RPC URL of the chain: the client reads the payer's Permit2 allowance and the
//                    token's EIP-2612 nonce there to decide on, and sign, eip2612GasSponsoring
//   X402_NETWORK     the CAIP-2 network of X402_ASSET for the spend controls (default eip155:72344); the exact
//                    and upto EVM schemes are registered for every EVM network, eip155:*
//   X402_ASSET       the token to allow through the client's spend controls; they accept only well-known
//                    assets (USDC and the like) by default, and the dev chain's token is none of them
//   X402_MAX_AMOUNT  the largest payment, in raw token units, the spend controls allow (default 1000000)
//   X402_METHOD      pay the first offer of this transfer method (permit2 or eip3009; an offer naming none is
//                    eip3009, as the client reads it) instead of the client's default, the first offer
//   X402_SCHEME      pay the first offer of this scheme (exact or upto); with X402_METHOD, of both
//   X402_PAYMENT_ID  name the payment with this id in the payment-identifier extension, where the server declares
//                    it (@x402/extensions' appendPaymentIdentifierToExtensions, as the SDK's example client does)
//   X402_SIWX        1: answer a 402's sign-in-with-x challenge with the payer's wallet before paying
//                    (@x402/extensions' createSIWxClientExtension registered on the client, as the SDK's docs do)
//   X402_REPEAT      fetch the URL this many times in a row (default 1); the JSON line then carries runs, each
//                    run's status, body and whether it paid, beside the fields of the last run
//
// The JSON line: status and body of the final answer, payer, what the client signed (sent: scheme, method,
// the amount signed, extensions, whether gas-sponsored, the payment identifier named), the decoded PAYMENT-RESPONSE (paymentResponse), and
// the Settlement-Overrides header of the final answer if one reached the client (settlementOverrides, else
// null: a resource server must strip it).
//
// Exit status: 0 when the paid request answered 2xx with a successful PAYMENT-RESPONSE, 1 otherwise, 2 on
// wrong usage.
import { decodePaymentResponseHeader, wrapFetchWithPayment, x402Client } from "@x402/fetch";
import { ExactEvmScheme, toClientEvmSigner } from "@x402/evm";
import { UptoEvmScheme } from "@x402/evm/upto/client";
import { appendPaymentIdentifierToExtensions } from "@x402/extensions/payment-identifier";
import { createSIWxClientExtension } from "@x402/extensions/sign-in-with-x";
import { createPublicClient, http } from "viem";
import { privateKeyToAccount } from "viem/accounts";

function usage(message) {
  process.stderr.write(`pay.mjs: ${message}\nusage: X402_PAYER_KEY=0x... X402_RPC_URL=http://... X402_ASSET=0x... node pay.mjs <url>\n`);
  process.exit(2);
}

const url = process.argv[2];
if (!url) usage("expected the URL to pay for as the only argument");
const rawKey = (process.env.X402_PAYER_KEY ?? "").trim();
if (!/^(0x)?[0-9a-fA-F]{64}$/.test(rawKey)) usage("X402_PAYER_KEY must hold a private key of 64 hex digits");
const rpcUrl = process.env.X402_RPC_URL;
if (!rpcUrl) usage("X402_RPC_URL must name the chain's JSON-RPC URL");
const asset = process.env.X402_ASSET;
if (!/^0x[0-9a-fA-F]{40}$/.test(asset ?? "")) usage("X402_ASSET must be the token's address (0x and 40 hex digits)");
const network = process.env.X402_NETWORK || "eip155:72344";
const maxAmount = process.env.X402_MAX_AMOUNT || "1000000";
const method = process.env.X402_METHOD;
const scheme = process.env.X402_SCHEME;
const methodOf = (requirement) => requirement.extra?.assetTransferMethod ?? "eip3009";
const describe = (r) => `${r.scheme} by ${methodOf(r)}`;
// The client's selector sees the offers it can pay; with no offer of the method (or scheme) the payment fails, as
// it should.
const selector = method || scheme
  ? (_version, accepts) => {
      const chosen = accepts.find((r) => (!method || methodOf(r) === method) && (!scheme || r.scheme === scheme));
      if (!chosen) throw new Error(`no offer of ${scheme ?? "any scheme"} by ${method ?? "any method"} among ${accepts.map(describe).join(", ")}`);
      return chosen;
    }
  : undefined;

const account = privateKeyToAccount(rawKey.startsWith("0x") ? rawKey : `0x${rawKey}`);
// The public client gives the signer readContract, which the scheme needs to see a missing Permit2 allowance
// and to read the token's permit nonce for eip2612GasSponsoring.
const publicClient = createPublicClient({ transport: http(rpcUrl) });
const signer = toClientEvmSigner(account, publicClient);

// Record what the client signed, so the test can tell the plain permit2 flow from the sponsored one, and the
// upto maximum from the amount settled. Both schemes under one network pattern: the client looks up the schemes
// of the most specific registered network only.
let sent;
const client = new x402Client(selector)
  .register("eip155:*", new ExactEvmScheme(signer, { rpcUrl }))
  .register("eip155:*", new UptoEvmScheme(signer, { rpcUrl }))
  .setSpendControls({ allowedAssets: [{ network, asset, maxAmountPerPayment: maxAmount }] })
  .onAfterPaymentCreation(async ({ paymentPayload }) => {
    const authorization = paymentPayload.payload?.permit2Authorization ?? paymentPayload.payload?.authorization;
    sent = {
      scheme: paymentPayload.accepted?.scheme ?? null,
      method: methodOf(paymentPayload.accepted ?? {}),
      amount: authorization?.permitted?.amount ?? authorization?.value ?? null,
      facilitator: authorization?.witness?.facilitator ?? null,
      extensions: Object.keys(paymentPayload.extensions ?? {}),
      sponsored: paymentPayload.extensions?.eip2612GasSponsoring?.info?.signature != null,
      paymentIdentifier: paymentPayload.extensions?.["payment-identifier"]?.info?.id ?? null,
    };
  });
const paymentId = process.env.X402_PAYMENT_ID;
if (paymentId) {
  client.onBeforePaymentCreation(async ({ paymentRequired }) => {
    if (paymentRequired.extensions) appendPaymentIdentifierToExtensions(paymentRequired.extensions, paymentId);
  });
}

const siwx = process.env.X402_SIWX === "1";
if (siwx) client.registerExtension(createSIWxClientExtension({ signers: [account] }));

const fetchWithPayment = wrapFetchWithPayment(fetch, client);

// A run succeeded when it answered 2xx with a successful PAYMENT-RESPONSE, or, signing in, 2xx without paying.
const succeeded = (r) => r.status >= 200 && r.status < 300 && (r.paymentResponse?.success === true || (siwx && r.sent === null));
const repeat = Number.parseInt(process.env.X402_REPEAT || "1", 10);
let result;
const runs = [];
for (let i = 0; i < repeat; i++) {
  sent = undefined;
  try {
    const response = await fetchWithPayment(url, { method: "GET" });
    const header = response.headers.get("PAYMENT-RESPONSE");
    result = {
      status: response.status,
      body: await response.text(),
      payer: account.address,
      sent: sent ?? null,
      paymentResponse: header ? decodePaymentResponseHeader(header) : null,
      settlementOverrides: response.headers.get("Settlement-Overrides"),
    };
  } catch (err) {
    result = { error: err instanceof Error ? err.message : String(err), payer: account.address, sent: sent ?? null };
  }
  runs.push({ status: result.status ?? 0, body: result.body ?? result.error, paid: result.sent !== null });
  if (!succeeded(result)) break;
}
if (repeat > 1) result.runs = runs;
process.stdout.write(JSON.stringify(result) + "\n");
process.exit(succeeded(result) ? 0 : 1);
