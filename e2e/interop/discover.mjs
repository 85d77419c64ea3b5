// discover.mjs reads bazaar discovery with the public TypeScript SDK (@x402/extensions' bazaar, @x402/core's
// HTTPFacilitatorClient) and prints what it read as one JSON line on stdout, for e2e/bazaar_interop_test.go.
//
//   node discover.mjs list <facilitator URL> [type] [limit] [offset]
//       the SDK's discovery client (withBazaar) lists the facilitator's /discovery/resources
//   node discover.mjs extract <URL>
//       fetches the URL's 402 and reads its bazaar declaration with the SDK's facilitator-side extractDiscoveryInfo
//       (validating info against its schema), as a payment echoing the declaration carries it
import { HTTPFacilitatorClient } from "@x402/core/server";
import { decodePaymentRequiredHeader } from "@x402/core/http";
import { extractDiscoveryInfo, withBazaar } from "@x402/extensions/bazaar";

const [cmd, url, ...rest] = process.argv.slice(2);
try {
  if (cmd === "list") {
    const client = withBazaar(new HTTPFacilitatorClient({ url }));
    const params = {};
    if (rest[0]) params.type = rest[0];
    if (rest[1]) params.limit = Number(rest[1]);
    if (rest[2]) params.offset = Number(rest[2]);
    const listed = await client.extensions.bazaar.listResources(params);
    process.stdout.write(JSON.stringify({ listed }) + "\n");
  } else if (cmd === "extract") {
    const res = await fetch(url);
    const pr = decodePaymentRequiredHeader(res.headers.get("PAYMENT-REQUIRED"));
    const payload = { x402Version: 2, resource: pr.resource, accepted: pr.accepts[0], payload: {}, extensions: pr.extensions };
    const extracted = extractDiscoveryInfo(payload, pr.accepts[0], true);
    process.stdout.write(JSON.stringify({ status: res.status, extracted }) + "\n");
  } else {
    throw new Error(`unknown command ${cmd}; want list or extract`);
  }
} catch (err) {
  process.stdout.write(JSON.stringify({ error: err instanceof Error ? err.message : String(err) }) + "\n");
  process.exit(1);
}
