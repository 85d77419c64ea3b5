// server.mjs runs a resource server built with the public TypeScript SDK (@x402/hono with @x402/core's
// x402ResourceServer and the exact EVM scheme of @x402/evm) on 127.0.0.1, settling through a facilitator at
// X402_FACILITATOR_URL: e2e/interop_test.go points it at our facilitator handler.
//
//   X402_FACILITATOR_URL=http://127.0.0.1:8080/facilitator X402_ASSET=0x... X402_PAY_TO=0x... node server.mjs <port>
//
// GET /paid costs X402_AMOUNT raw units of X402_ASSET (EIP-712 domain X402_TOKEN_NAME / X402_TOKEN_VERSION) by
// permit2, and declares the eip2612GasSponsoring extension, so that a payer who never approved Permit2 can pay.
// It prints "listening <url>" once it serves, and stops by itself after X402_LIFETIME_SECONDS (default 600).
import { Hono } from "hono";
import { serve } from "@hono/node-server";
import { paymentMiddleware, x402ResourceServer } from "@x402/hono";
import { HTTPFacilitatorClient } from "@x402/core/server";
import { ExactEvmScheme } from "@x402/evm/exact/server";
import { declareEip2612GasSponsoringExtension } from "@x402/extensions";

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

const resourceServer = new x402ResourceServer(new HTTPFacilitatorClient({ url: facilitatorUrl }))
  .register(network, new ExactEvmScheme());

const app = new Hono();
app.use(
  paymentMiddleware(
    {
      "GET /paid": {
        accepts: {
          scheme: "exact",
          network,
          payTo,
          price: {
            amount: process.env.X402_AMOUNT || "10000",
            asset,
            extra: {
              name: process.env.X402_TOKEN_NAME || "Stable Coin",
              version: process.env.X402_TOKEN_VERSION || "1",
              assetTransferMethod: "permit2",
            },
          },
          maxTimeoutSeconds: 600,
        },
        description: "Content sold by an @x402/hono server",
        extensions: { ...declareEip2612GasSponsoringExtension() },
      },
    },
    resourceServer,
  ),
);
app.get("/paid", (c) => c.text("paid content from the hono server"));

serve({ fetch: app.fetch, port, hostname: "127.0.0.1" }, () => {
  process.stdout.write(`listening http://127.0.0.1:${port}\n`);
});
// Ctrl-C (the test's stop) is a clean exit, as is the end of its lifetime.
process.on("SIGINT", () => process.exit(0));
setTimeout(() => process.exit(0), 1000 * Number(process.env.X402_LIFETIME_SECONDS || 600)).unref();
