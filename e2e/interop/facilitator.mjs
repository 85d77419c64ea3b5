// facilitator.mjs runs the public TypeScript reference facilitator (x402Facilitator from @x402/core with the
// exact EVM scheme of @x402/evm, no transfer method configured, and its upto EVM scheme, which settles through
// the x402 upto Permit2 proxy from the facilitator's key) over HTTP on 127.0.0.1, so that e2e/interop_test.go
// can put our gate in front of a facilitator nobody here wrote.
//
//   X402_FACILITATOR_KEY=0x... X402_RPC_URL=http://127.0.0.1:8545 X402_NETWORK=eip155:72344 node facilitator.mjs <port>
//
// With X402_BATCH=1 it also serves the batch-settlement scheme (@x402/evm/batch-settlement/facilitator), its
// receiver authorizer the facilitator's own key (listed in /supported): deposits, claims, settles and refunds are
// sent from that key. It reads channels through Multicall3, which the dev chain's genesis holds.
//
// With X402_APPROVAL_SPONSORING=1 it takes erc20ApprovalGasSponsoring (@x402/extensions'
// createErc20ApprovalGasSponsoringExtension registered on the facilitator, as the SDK's docs do) with a signer
// whose sendTransactions runs the transactions in order from the facilitator's key: for the payer's signed
// approval it first sends the payer the gas money it lacks (its gas limit times its fee cap, less its balance),
// broadcasts it and waits for it to mine; then it sends the settlement.
//
// Endpoints: GET /supported, POST /verify and POST /settle ({paymentPayload, paymentRequirements}), as the
// public HTTPFacilitatorClient calls them. It prints "listening <url>" once it serves, and stops by itself
// after X402_LIFETIME_SECONDS (default 600).
import http from "node:http";
import { x402Facilitator } from "@x402/core/facilitator";
import { registerExactEvmScheme } from "@x402/evm/exact/facilitator";
import { UptoEvmScheme } from "@x402/evm/upto/facilitator";
import { BatchSettlementEvmScheme } from "@x402/evm/batch-settlement/facilitator";
import { toFacilitatorEvmSigner } from "@x402/evm";
import { createErc20ApprovalGasSponsoringExtension } from "@x402/extensions";
import { createWalletClient, defineChain, http as viemHttp, parseTransaction, publicActions, recoverTransactionAddress } from "viem";
import { privateKeyToAccount } from "viem/accounts";

function usage(message) {
  process.stderr.write(`facilitator.mjs: ${message}\n`);
  process.exit(2);
}

const port = Number(process.argv[2]);
if (!Number.isInteger(port) || port <= 0) usage("expected the port to listen on as the only argument");
const rawKey = (process.env.X402_FACILITATOR_KEY ?? "").trim();
if (!/^0x[0-9a-fA-F]{64}$/.test(rawKey)) usage("X402_FACILITATOR_KEY must hold a 0x-prefixed private key");
const rpcUrl = process.env.X402_RPC_URL;
if (!rpcUrl) usage("X402_RPC_URL must name the chain's JSON-RPC URL");
const network = process.env.X402_NETWORK || "eip155:72344";
const chainId = Number(network.split(":")[1]);

const chain = defineChain({
  id: chainId,
  name: "x402 dev chain",
  nativeCurrency: { name: "Ether", symbol: "ETH", decimals: 18 },
  rpcUrls: { default: { http: [rpcUrl] } },
});
const account = privateKeyToAccount(rawKey);
const client = createWalletClient({ account, chain, transport: viemHttp(rpcUrl) }).extend(publicActions);
const signer = toFacilitatorEvmSigner({ ...client, address: account.address });

const facilitator = new x402Facilitator();
registerExactEvmScheme(facilitator, { signer, networks: network });
facilitator.register(network, new UptoEvmScheme(signer));
if (process.env.X402_BATCH === "1") facilitator.register(network, new BatchSettlementEvmScheme(signer, account));
if (process.env.X402_APPROVAL_SPONSORING === "1") {
  facilitator.registerExtension(createErc20ApprovalGasSponsoringExtension({
    ...signer,
    async sendTransactions(transactions) {
      const hashes = [];
      for (const tx of transactions) {
        if (typeof tx === "string") {
          const parsed = parseTransaction(tx);
          const from = await recoverTransactionAddress({ serializedTransaction: tx });
          const need = parsed.gas * parsed.maxFeePerGas;
          const have = await client.getBalance({ address: from });
          if (have < need) {
            const funding = await client.sendTransaction({ to: from, value: need - have });
            await client.waitForTransactionReceipt({ hash: funding });
          }
          const hash = await client.sendRawTransaction({ serializedTransaction: tx });
          const receipt = await client.waitForTransactionReceipt({ hash });
          if (receipt.status !== "success") throw new Error(`the approval ${hash} reverted`);
          hashes.push(hash);
        } else {
          hashes.push(await client.sendTransaction({ to: tx.to, data: tx.data, gas: tx.gas }));
        }
      }
      return hashes;
    },
  }));
}

async function body(req) {
  const chunks = [];
  for await (const c of req) chunks.push(c);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

function answer(res, status, value) {
  res.writeHead(status, { "Content-Type": "application/json" });
  res.end(JSON.stringify(value, (_, v) => (typeof v === "bigint" ? v.toString() : v)));
}

const server = http.createServer(async (req, res) => {
  try {
    if (req.method === "GET" && req.url === "/supported") {
      return answer(res, 200, facilitator.getSupported());
    }
    if (req.method === "POST" && (req.url === "/verify" || req.url === "/settle")) {
      const { paymentPayload, paymentRequirements } = await body(req);
      const result = req.url === "/verify"
        ? await facilitator.verify(paymentPayload, paymentRequirements)
        : await facilitator.settle(paymentPayload, paymentRequirements);
      process.stderr.write(`${req.url}: ${JSON.stringify(result)}\n`);
      return answer(res, 200, result);
    }
    answer(res, 404, { error: `no ${req.method} ${req.url}` });
  } catch (err) {
    process.stderr.write(`${req.url}: ${err?.stack ?? err}\n`);
    answer(res, 500, { error: err instanceof Error ? err.message : String(err) });
  }
});
server.listen(port, "127.0.0.1", () => {
  process.stdout.write(`listening http://127.0.0.1:${port}\n`);
});
// Ctrl-C (the test's stop) is a clean exit, as is the end of its lifetime.
process.on("SIGINT", () => process.exit(0));
setTimeout(() => process.exit(0), 1000 * Number(process.env.X402_LIFETIME_SECONDS || 600)).unref();
