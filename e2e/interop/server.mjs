// server.mjs runs a resource server built with the public TypeScript SDK (@x402/hono with @x402/core's
// x402ResourceServer and the exact EVM scheme of @x402/evm) on 127.0.0.1, settling through a facilitator at
// X402_FACILITATOR_URL: e2e/interop_test.go points it at our facilitator handler.
//
//   X402_FACILITATOR_URL=http://127.0.0.1:8080/facilitator X402_ASSET=0x... X402_PAY_TO=0x... node server.mjs <port>
//
// GET /paid costs X402_AMOUNT raw units of X402_ASSET (EIP-712 domain X402_TOKEN_NAME / X402_TOKEN_VERSION) by
// permit2, and declares the eip2612GasSponsoring extension, so that a payer who never approved Permit2 can pay.
// With X402_GAS_SPONSORING=erc20_approval it declares erc20ApprovalGasSponsoring instead
// (declareErc20ApprovalGasSponsoringExtension), so that such a payer signs its own approval of Permit2.
// With X402_UPTO_AMOUNT set, GET /upto is sold by the upto scheme (@x402/evm/upto/server) for at most that many
// raw units, and its handler charges what the request names in ?use= (raw units or a percentage such as "50%", as
// setSettlementOverrides takes them; no ?use= sets no override, so the maximum is charged). The facilitator must
// then list an upto kind for the network: the SDK takes the facilitatorAddress the payer signs for from it.
// With X402_BATCH_AMOUNT set, GET /batch is sold by the batch-settlement scheme (@x402/evm/batch-settlement/server,
// its channels in memory) at that many raw units a request of X402_BATCH_ASSET (default X402_ASSET; EIP-712
// domain X402_BATCH_TOKEN_NAME / X402_BATCH_TOKEN_VERSION, for ERC-3009 deposits), the receiver authorizer the
// facilitator's (it must list a batch-settlement kind naming one); POST /batch-claim claims every voucher the
// server holds and settles what was claimed to X402_PAY_TO through the facilitator, and prints the results.
// With X402_PAYMENT_IDENTIFIER set to "optional" or "required", GET /paid also declares @x402/extensions'
// payment-identifier extension so, and answers with the id the payment named as the SDK's validators read it, in
// its X-Payment-Identifier header and its body's last line ("payment identifier: <id>", "none" when it named none,
// "invalid: <why>" when they refuse it).
// With X402_SIWX=1, GET /paid also declares @x402/extensions' sign-in-with-x (declareSIWxExtension on the network,
// createSIWxResourceServerExtension with the server's own origin and the SDK's InMemorySIWxStorage): a payer whose
// payment the server settled is served again on its wallet's signature alone, as the SDK's server grants it.
// With X402_BAZAAR=1, GET /paid also declares @x402/extensions' bazaar discovery (declareDiscoveryExtension with a
// query input {city}, its schema, and an output example; bazaarResourceServerExtension registered), and the route
// names its service (serviceName "Hono Weather", tags weather and interop, iconUrl), so that the facilitator that
// settles its payments catalogs it.
// It prints "listening <url>" once it serves, and stops by itself after X402_LIFETIME_SECONDS (default 600).
import { Hono } from "hono";
import { serve } from "@hono/node-server";
import { paymentMiddleware, setSettlementOverrides, x402ResourceServer } from "@x402/hono";
import { HTTPFacilitatorClient } from "@x402/core/server";
import { ExactEvmScheme } from "@x402/evm/exact/server";
import { UptoEvmScheme } from "@x402/evm/upto/server";
import { BatchSettlementEvmScheme } from "@x402/evm/batch-settlement/server";
import {
  declareEip2612GasSponsoringExtension,
  declareErc20ApprovalGasSponsoringExtension,
  declarePaymentIdentifierExtension,
  extractAndValidatePaymentIdentifier,
  PAYMENT_IDENTIFIER,
  paymentIdentifierResourceServerExtension,
  validatePaymentIdentifierRequirement,
} from "@x402/extensions";
import { decodePaymentSignatureHeader } from "@x402/core/http";
import { createSIWxResourceServerExtension, declareSIWxExtension, InMemorySIWxStorage } from "@x402/extensions/sign-in-with-x";
import { bazaarResourceServerExtension, declareDiscoveryExtension } from "@x402/extensions/bazaar";

function usage(message) {
  process.stderr.write(`server.mjs: ${message}\n`);
  process.exit(2);
}

const port = Number(process.argv[2]);
if (!Number.isInteger(port) || port <= 0) usage("expected the port to listen on as the only argument");
const facilitatorUrl = process.env.X402_FACILITATOR_URL;
if (!facilitatorUrl) usage("X402_FACILITATOR_URL must name the facilitator");
const asset = process.env.X402_ASSET;
const payTo = process.env.X402_PAY_TO;
if (!/^0x[0-9a-fA-F]{40}$/.test(asset ?? "") || !/^0x[0-9a-fA-F]{40}$/.test(payTo ?? "")) usage("X402_ASSET and X402_PAY_TO must be addresses");
const network = process.env.X402_NETWORK || "eip155:72344";
const uptoAmount = process.env.X402_UPTO_AMOUNT;
if (uptoAmount !== undefined && !/^\d+$/.test(uptoAmount)) usage("X402_UPTO_AMOUNT must be raw token units (digits)");
const token = { name: process.env.X402_TOKEN_NAME || "Stable Coin", version: process.env.X402_TOKEN_VERSION || "1" };

const batchAmount = process.env.X402_BATCH_AMOUNT;
if (batchAmount !== undefined && !/^\d+$/.test(batchAmount)) usage("X402_BATCH_AMOUNT must be raw token units (digits)");
const batchAsset = process.env.X402_BATCH_ASSET || asset;
const batchToken = { name: process.env.X402_BATCH_TOKEN_NAME || token.name, version: process.env.X402_BATCH_TOKEN_VERSION || token.version };

const gasSponsoring = process.env.X402_GAS_SPONSORING || "eip2612";
if (gasSponsoring !== "eip2612" && gasSponsoring !== "erc20_approval") usage('X402_GAS_SPONSORING must be "eip2612" or "erc20_approval"');
const paymentIdentifier = process.env.X402_PAYMENT_IDENTIFIER;
if (paymentIdentifier !== undefined && paymentIdentifier !== "optional" && paymentIdentifier !== "required") {
  usage('X402_PAYMENT_IDENTIFIER must be "optional" or "required"');
}

const facilitatorClient = new HTTPFacilitatorClient({ url: facilitatorUrl });
const resourceServer = new x402ResourceServer(facilitatorClient)
  .register(network, new ExactEvmScheme());
if (uptoAmount !== undefined) resourceServer.register(network, new UptoEvmScheme());
if (paymentIdentifier !== undefined) resourceServer.registerExtension(paymentIdentifierResourceServerExtension);
const siwx = process.env.X402_SIWX === "1";
if (siwx) {
  resourceServer.registerExtension(createSIWxResourceServerExtension({
    origin: `http://127.0.0.1:${port}`,
    storage: new InMemorySIWxStorage(),
    onEvent: (e) => process.stderr.write(`siwx: ${JSON.stringify(e)}\n`),
  }));
}
const bazaar = process.env.X402_BAZAAR === "1";
if (bazaar) resourceServer.registerExtension(bazaarResourceServerExtension);
const batchScheme = batchAmount === undefined ? undefined : new BatchSettlementEvmScheme(payTo);
if (batchScheme) resourceServer.register(network, batchScheme);
const batchRoutes = batchAmount === undefined ? {} : {
  "GET /batch": {
    accepts: {
      scheme: "batch-settlement",
      network,
      payTo,
      price: { amount: batchAmount, asset: batchAsset, extra: { ...batchToken } },
      maxTimeoutSeconds: 600,
    },
    description: "Content sold per request by vouchers of a batch-settlement channel",
  },
};

// The upto route exists only when asked for: the SDK refuses to start a route its facilitator lists no kind for.
const uptoRoutes = uptoAmount === undefined ? {} : {
  "GET /upto": {
    accepts: {
      scheme: "upto",
      network,
      payTo,
      price: { amount: uptoAmount, asset, extra: { ...token } },
      maxTimeoutSeconds: 600,
    },
    description: "Content sold by use by an @x402/hono server",
  },
};

const app = new Hono();
app.use(
  paymentMiddleware(
    {
      ...uptoRoutes,
      ...batchRoutes,
      "GET /paid": {
        accepts: {
          scheme: "exact",
          network,
          payTo,
          price: {
            amount: process.env.X402_AMOUNT || "10000",
            asset,
            extra: { ...token, assetTransferMethod: "permit2" },
          },
          maxTimeoutSeconds: 600,
        },
        description: "Content sold by an @x402/hono server",
        ...(bazaar ? { serviceName: "Hono Weather", tags: ["weather", "interop"], iconUrl: "https://hono.example/icon.png" } : {}),
        extensions: {
          ...(bazaar ? declareDiscoveryExtension({
            input: { city: "Oslo" },
            inputSchema: { properties: { city: { type: "string" } }, required: ["city"] },
            output: { example: { tempC: 4 }, schema: { properties: { tempC: { type: "number" } } } },
          }) : {}),
          ...(gasSponsoring === "erc20_approval" ? declareErc20ApprovalGasSponsoringExtension() : declareEip2612GasSponsoringExtension()),
          // Unlike the gas-sponsoring helper, this one returns the declaration itself, not keyed by its name.
          ...(paymentIdentifier === undefined ? {} : { [PAYMENT_IDENTIFIER]: declarePaymentIdentifierExtension(paymentIdentifier === "required") }),
          ...(siwx ? declareSIWxExtension({ network }) : {}),
        },
      },
    },
    resourceServer,
  ),
);
app.get("/paid", (c) => {
  if (paymentIdentifier !== undefined) {
    const payload = decodePaymentSignatureHeader(c.req.header("PAYMENT-SIGNATURE"));
    const { id, validation } = extractAndValidatePaymentIdentifier(payload);
    const required = validatePaymentIdentifierRequirement(payload, paymentIdentifier === "required");
    const invalid = [validation, required].flatMap((v) => (v.valid ? [] : v.errors ?? ["invalid"]));
    const named = invalid.length ? `invalid: ${invalid.join("; ")}` : id ?? "none";
    c.header("X-Payment-Identifier", named);
    return c.text(`paid content from the hono server\npayment identifier: ${named}`);
  }
  return c.text("paid content from the hono server");
});
app.get("/upto", (c) => {
  const use = c.req.query("use");
  if (use !== undefined) setSettlementOverrides(c, { amount: use });
  return c.text(`used ${use ?? "everything"} of the hono server's upto content`);
});

app.get("/batch", (c) => c.text("batch-settled content from the hono server"));
app.post("/batch-claim", async (c) => {
  const manager = batchScheme.createChannelManager(facilitatorClient, network, batchAsset);
  const claims = await manager.claim();
  let settle;
  try {
    settle = await manager.settle();
  } catch (err) {
    settle = { error: err instanceof Error ? err.message : String(err) };
  }
  const result = { claims, settle };
  process.stderr.write(`/batch-claim: ${JSON.stringify(result, (_, v) => (typeof v === "bigint" ? v.toString() : v))}\n`);
  return c.json(JSON.parse(JSON.stringify(result, (_, v) => (typeof v === "bigint" ? v.toString() : v))));
});

serve({ fetch: app.fetch, port, hostname: "127.0.0.1" }, () => {
  process.stdout.write(`listening http://127.0.0.1:${port}\n`);
});
// Ctrl-C (the test's stop) is a clean exit, as is the end of its lifetime.
process.on("SIGINT", () => process.exit(0));
setTimeout(() => process.exit(0), 1000 * Number(process.env.X402_LIFETIME_SECONDS || 600)).unref();
