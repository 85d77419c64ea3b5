// pay-batch.mjs pays for one URL many times with the public TypeScript x402 client's batch-settlement scheme
// (@x402/fetch with @x402/evm's batch-settlement client: a deposit into the escrow with the first request, a
// cumulative voucher with each after), waits until the receiver has claimed what the vouchers charged, then asks
// the server for a refund of the rest (the scheme's refund), as a third party's agent would. It prints what
// happened as one JSON line on stdout for e2e/batch_gate_interop_test.go to check.
//
//   X402_PAYER_KEY=0x... X402_RPC_URL=http://127.0.0.1:8545 X402_ASSET=0x... node pay-batch.mjs <url> <requests>
//
// Environment:
//   X402_PAYER_KEY          the payer's private key, hex (read from the environment so it never shows in `ps`)
//   X402_RPC_URL            JSON-RPC URL of the chain: the client reads its channel there when it has none in memory,
//                           and this script reads what was claimed of the channel
//   X402_ASSET              the token to allow through the client's spend controls
//   X402_NETWORK            the CAIP-2 network of X402_ASSET (default eip155:72344)
//   X402_MAX_AMOUNT         the largest payment, in raw token units, the spend controls allow (default 1000)
//   X402_DEPOSIT_MULTIPLIER the client's deposit policy: a deposit of this many requests' price (default 5)
//   X402_CLAIM_WAIT_SECONDS how long to wait for the receiver's claim before the refund (default 60; 0: do not wait)
//   X402_REFUND             0: ask no refund (default 1)
//
// The JSON line: payer, channelId, requests (each: status, body, what the client sent (type, maxClaimableAmount,
// deposit) and the decoded PAYMENT-RESPONSE), lastPayment (the PAYMENT-SIGNATURE of the last request, for the
// test to present again), claimed (what the escrow says was claimed when the refund was asked), refund (the
// refund's settlement answer, or error) and refundPayment (its PAYMENT-SIGNATURE).
//
// Exit status: 0 when every request answered 2xx with a successful PAYMENT-RESPONSE and the refund succeeded, 1
// otherwise, 2 on wrong usage.
import { decodePaymentResponseHeader, wrapFetchWithPayment, x402Client } from "@x402/fetch";
import { BATCH_SETTLEMENT_ADDRESS, toClientEvmSigner } from "@x402/evm";
import { BatchSettlementEvmScheme } from "@x402/evm/batch-settlement/client";
import { createPublicClient, http, parseAbi } from "viem";
import { privateKeyToAccount } from "viem/accounts";

function usage(message) {
  process.stderr.write(`pay-batch.mjs: ${message}\nusage: X402_PAYER_KEY=0x... X402_RPC_URL=http://... X402_ASSET=0x... node pay-batch.mjs <url> <requests>\n`);
  process.exit(2);
}

const url = process.argv[2];
const count = Number(process.argv[3]);
if (!url || !Number.isInteger(count) || count <= 0) usage("expected the URL to pay for and the number of requests");
const rawKey = (process.env.X402_PAYER_KEY ?? "").trim();
if (!/^(0x)?[0-9a-fA-F]{64}$/.test(rawKey)) usage("X402_PAYER_KEY must hold a private key of 64 hex digits");
const rpcUrl = process.env.X402_RPC_URL;
if (!rpcUrl) usage("X402_RPC_URL must name the chain's JSON-RPC URL");
const asset = process.env.X402_ASSET;
if (!/^0x[0-9a-fA-F]{40}$/.test(asset ?? "")) usage("X402_ASSET must be the token's address (0x and 40 hex digits)");
const network = process.env.X402_NETWORK || "eip155:72344";
const maxAmount = process.env.X402_MAX_AMOUNT || "1000";
const multiplier = Number(process.env.X402_DEPOSIT_MULTIPLIER || "5");
const claimWait = Number(process.env.X402_CLAIM_WAIT_SECONDS ?? "60");
const refund = process.env.X402_REFUND !== "0";

const account = privateKeyToAccount(rawKey.startsWith("0x") ? rawKey : `0x${rawKey}`);
const publicClient = createPublicClient({ transport: http(rpcUrl) });
const signer = toClientEvmSigner(account, publicClient);
const scheme = new BatchSettlementEvmScheme(signer, { depositPolicy: { depositMultiplier: multiplier } });

// Every payment header the client sends, in order: the test presents the last voucher and the refund again.
const sentHeaders = [];
const recordingFetch = async (input, init) => {
  const request = new Request(input, init);
  const header = request.headers.get("PAYMENT-SIGNATURE");
  if (header) sentHeaders.push(header);
  return fetch(request);
};

let sent;
const client = new x402Client()
  .register("eip155:*", scheme)
  .setSpendControls({ allowedAssets: [{ network, asset, maxAmountPerPayment: maxAmount }] })
  .onAfterPaymentCreation(async ({ paymentPayload }) => {
    const p = paymentPayload.payload ?? {};
    sent = { type: p.type ?? null, maxClaimableAmount: p.voucher?.maxClaimableAmount ?? null, deposit: p.deposit?.amount ?? null };
  });
const fetchWithPayment = wrapFetchWithPayment(recordingFetch, client);

const result = { payer: account.address, channelId: null, requests: [] };
let ok = true;
for (let k = 1; k <= count; k++) {
  sent = undefined;
  try {
    const response = await fetchWithPayment(url, { method: "GET" });
    const header = response.headers.get("PAYMENT-RESPONSE");
    const paymentResponse = header ? decodePaymentResponseHeader(header) : null;
    result.requests.push({ status: response.status, body: await response.text(), sent: sent ?? null, paymentResponse });
    result.channelId = paymentResponse?.extra?.channelState?.channelId ?? result.channelId;
    if (response.status < 200 || response.status >= 300 || paymentResponse?.success !== true) ok = false;
  } catch (err) {
    result.requests.push({ error: err instanceof Error ? err.message : String(err), sent: sent ?? null });
    ok = false;
  }
  if (!ok) break;
}
result.lastPayment = sentHeaders[sentHeaders.length - 1] ?? null;

if (ok && refund && result.channelId) {
  // The receiver claims in batches; the refund is asked once it has claimed what the vouchers charged.
  const abi = parseAbi(["function channels(bytes32 channelId) view returns (uint128 balance, uint128 totalClaimed)"]);
  const charged = BigInt(result.requests[result.requests.length - 1].paymentResponse.extra.channelState.chargedCumulativeAmount);
  const deadline = Date.now() + claimWait * 1000;
  for (;;) {
    const [, totalClaimed] = await publicClient.readContract({ address: BATCH_SETTLEMENT_ADDRESS, abi, functionName: "channels", args: [result.channelId] });
    result.claimed = totalClaimed.toString();
    if (totalClaimed >= charged || Date.now() >= deadline) break;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  const before = sentHeaders.length;
  try {
    result.refund = await scheme.refund(url, { fetch: recordingFetch });
    if (result.refund?.success !== true) ok = false;
  } catch (err) {
    result.refund = { error: err instanceof Error ? err.message : String(err) };
    ok = false;
  }
  result.refundPayment = sentHeaders.length > before ? sentHeaders[sentHeaders.length - 1] : null;
}
process.stdout.write(JSON.stringify(result) + "\n");
process.exit(ok ? 0 : 1);
