// Writes what @x402/extensions 2.27's bazaar server helpers declare for a route, as a 402 carries it:
// x402/testdata/bazaar-sdk-vectors.json (node bazaar-vectors.mjs > ../../x402/testdata/bazaar-sdk-vectors.json).
import { declareDiscoveryExtension, bazaarResourceServerExtension, validateDiscoveryExtension } from "@x402/extensions/bazaar";
const ctx = (method) => ({ method, adapter: { getPath: () => "/weather" }, routePattern: "/weather" });
const cases = [
  { name: "GET with an input and an output", method: "GET",
    config: { input: { city: "Oslo" }, inputSchema: { properties: { city: { type: "string" } }, required: ["city"] },
              output: { example: { tempC: 4 }, schema: { properties: { tempC: { type: "number" } } } } } },
  { name: "GET declaring nothing", method: "GET", config: {} },
  { name: "HEAD declaring nothing", method: "HEAD", config: {} },
  { name: "POST with a JSON body", method: "POST",
    config: { bodyType: "json", input: { q: "rain" }, inputSchema: { properties: { q: { type: "string" } } } } },
  { name: "PUT with a form body and an output schema", method: "PUT",
    config: { bodyType: "form-data", output: { example: {}, schema: { properties: { ok: { type: "boolean" } } } } } },
];
const out = cases.map(({ name, method, config }) => {
  const decl = bazaarResourceServerExtension.enrichDeclaration(declareDiscoveryExtension(config).bazaar, ctx(method));
  const v = validateDiscoveryExtension(decl);
  if (!v.valid) throw new Error(name + ": " + v.errors.join(", "));
  return { name, method, config, declaration: decl };
});
console.log(JSON.stringify(out, null, 1));
