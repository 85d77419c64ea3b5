// mcp-server.mjs is an MCP server built on the official @modelcontextprotocol/sdk, on its streamable HTTP
// transport with sessions, for e2e/mcp_interop_test.go to put behind Caddy's x402 gate: /mcp answers each POST with
// an SSE stream (the SDK's default), /mcp-json with JSON (enableJsonResponse). Its tools: echo, search and
// summarize (each throws for q "fail"); what they cost is the gate's business, never the server's.
//
//   node mcp-server.mjs <port>
//
// GET /calls answers the tool calls the server ran, as JSON: each tool's name, arguments and the _meta it saw, so
// the test can check that a paid call ran once and that the payment never reached the server.
import http from "node:http";
import { randomUUID } from "node:crypto";
import { McpServer } from "@modelcontextprotocol/sdk/server/mcp.js";
import { StreamableHTTPServerTransport } from "@modelcontextprotocol/sdk/server/streamableHttp.js";
import { isInitializeRequest } from "@modelcontextprotocol/sdk/types.js";
import { z } from "zod";

const port = Number(process.argv[2]);
if (!port) {
  process.stderr.write("usage: node mcp-server.mjs <port>\n");
  process.exit(2);
}

const calls = [];

function newServer() {
  const server = new McpServer({ name: "caddy-x402-e2e", version: "1.0.0" });
  const tool = (name, run) =>
    server.registerTool(name, { description: `the ${name} tool`, inputSchema: { q: z.string() } }, async (args, extra) => {
      calls.push({ tool: name, arguments: args, meta: extra._meta ?? null });
      // A tool that throws is answered by the SDK as a tool result with isError.
      if (args.q === "fail") throw new Error(`${name} failed`);
      return { content: [{ type: "text", text: run(args.q) }] };
    });
  tool("echo", (q) => `echo: ${q}`);
  tool("search", (q) => `results for ${q}`);
  tool("summarize", (q) => `summary of ${q}`);
  return server;
}

// One transport per session, as the SDK's examples keep them.
const sessions = new Map();

async function readBody(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  const text = Buffer.concat(chunks).toString("utf8");
  return text ? JSON.parse(text) : undefined;
}

http
  .createServer(async (req, res) => {
    try {
      const url = new URL(req.url, "http://localhost");
      if (url.pathname === "/calls") {
        res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify(calls));
        return;
      }
      const json = url.pathname === "/mcp-json";
      const body = req.method === "POST" ? await readBody(req) : undefined;
      const sid = req.headers["mcp-session-id"];
      let transport = sid ? sessions.get(`${url.pathname} ${sid}`) : undefined;
      if (!transport) {
        const first = Array.isArray(body) ? body.find(isInitializeRequest) : isInitializeRequest(body) && body;
        if (!first) {
          res.writeHead(400, { "content-type": "application/json" }).end(
            JSON.stringify({ jsonrpc: "2.0", id: null, error: { code: -32000, message: "no session" } }),
          );
          return;
        }
        transport = new StreamableHTTPServerTransport({
          sessionIdGenerator: () => randomUUID(),
          enableJsonResponse: json,
          onsessioninitialized: (id) => sessions.set(`${url.pathname} ${id}`, transport),
        });
        await newServer().connect(transport);
      }
      await transport.handleRequest(req, res, body);
    } catch (err) {
      process.stderr.write(`mcp-server: ${err?.stack ?? err}\n`);
      if (!res.headersSent) res.writeHead(500).end(String(err));
    }
  })
  .listen(port, "127.0.0.1", () => process.stdout.write(`listening on ${port}\n`));
