// mcp-client.mjs calls the tools of an MCP server behind Caddy's x402 gate with the official
// @modelcontextprotocol/sdk client (streamable HTTP), paying the priced ones with the public TypeScript x402 client
// (@x402/core's x402Client with @x402/evm's exact scheme, permit2) as the x402 MCP transport says: the unpaid call
// answers a tool result with isError and the PaymentRequired, the retry carries the payment in
// _meta["x402/payment"], the result its settlement in _meta["x402/payment-response"]. It prints one JSON line on
// stdout for e2e/mcp_interop_test.go to check.
//
//   X402_PAYER_KEY=0x... X402_RPC_URL=http://... X402_ASSET=0x... node mcp-client.mjs <mcp url>
//
// What it does, in order: list the tools (prices), call echo (free), call search unpaid, pay it and call again,
// present the same payment again, pay a call whose tool fails, then send two JSON-RPC batches on the session with the SDK's transport: echo
// with search unpaid, and echo with search paid.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { x402Client } from "@x402/core/client";
import { ExactEvmScheme, toClientEvmSigner } from "@x402/evm";
import { createPublicClient, http } from "viem";
import { privateKeyToAccount } from "viem/accounts";

const url = process.argv[2];
const rawKey = (process.env.X402_PAYER_KEY ?? "").trim();
const rpcUrl = process.env.X402_RPC_URL;
if (!url || !/^(0x)?[0-9a-fA-F]{64}$/.test(rawKey) || !rpcUrl) {
  process.stderr.write("usage: X402_PAYER_KEY=0x... X402_RPC_URL=http://... node mcp-client.mjs <mcp url>\n");
  process.exit(2);
}
const account = privateKeyToAccount(rawKey.startsWith("0x") ? rawKey : `0x${rawKey}`);
const signer = toClientEvmSigner(account, createPublicClient({ transport: http(rpcUrl) }));
const permit2 = (_version, accepts) => accepts.find((r) => r.extra?.assetTransferMethod === "permit2") ?? accepts[0];
// The client's spend controls accept only well-known assets by default; the dev chain's token is none of them.
const payments = new x402Client(permit2)
  .register("eip155:*", new ExactEvmScheme(signer, { rpcUrl }))
  .setSpendControls({ allowedAssets: [{ network: process.env.X402_NETWORK || "eip155:72344", asset: process.env.X402_ASSET, maxAmountPerPayment: "1000000" }] });

const out = {};
try {
  const client = new Client({ name: "caddy-x402-e2e-client", version: "1.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)));
  out.sessionId = client.transport.sessionId ?? null;
  const { tools } = await client.listTools();
  out.prices = Object.fromEntries(tools.map((t) => [t.name, t._meta?.["x402/price"] ?? null]));
  out.echo = await client.callTool({ name: "echo", arguments: { q: "hello" } });
  out.unpaid = await client.callTool({ name: "search", arguments: { q: "caddy" } });
  const required = out.unpaid.structuredContent ?? JSON.parse(out.unpaid.content[0].text);
  const payment = await payments.createPaymentPayload(required);
  out.paid = await client.callTool({ name: "search", arguments: { q: "caddy" }, _meta: { "x402/payment": payment, trace: "t1" } });
  out.again = await client.callTool({ name: "search", arguments: { q: "caddy" }, _meta: { "x402/payment": payment } });
  // A paid call whose tool fails (the SDK answers a tool result with isError): not charged.
  out.failed = await client.callTool({ name: "search", arguments: { q: "fail" }, _meta: { "x402/payment": await payments.createPaymentPayload(required) } });

  // Batches on the same session, through the SDK's own transport.
  const raw = new StreamableHTTPClientTransport(new URL(url), { sessionId: client.transport.sessionId });
  const answers = new Map();
  raw.onmessage = (m) => answers.set(m.id, m);
  await raw.start();
  const call = (id, name, meta) => ({ jsonrpc: "2.0", id, method: "tools/call", params: { name, arguments: { q: "batch" }, ...(meta ? { _meta: meta } : {}) } });
  const batch = async (msgs) => {
    await raw.send(msgs);
    for (let i = 0; i < 100 && !msgs.every((m) => answers.has(m.id)); i++) await new Promise((r) => setTimeout(r, 50));
    return msgs.map((m) => answers.get(m.id) ?? null);
  };
  out.batchUnpaid = await batch([call(901, "echo"), call(902, "search")]);
  const second = await payments.createPaymentPayload(required);
  out.batchPaid = await batch([call(903, "echo"), call(904, "search", { "x402/payment": second })]);
  await client.close();
  out.ok = true;
} catch (err) {
  out.error = String(err?.stack ?? err);
}
process.stdout.write(JSON.stringify(out) + "\n");
process.exit(out.ok ? 0 : 1);
