package caddymodule_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// mcpUpstream is a JSON-RPC server in the shape of an MCP server on the streamable HTTP transport: it answers
// with JSON, or with an SSE stream (a progress notification, then the response) when the URL asks ?sse.
type mcpUpstream struct {
	Addr   string
	mu     sync.Mutex
	bodies []string
	// lastEventIDs are the Last-Event-ID headers of the GETs the upstream received.
	lastEventIDs []string
}

func newMCPUpstream(t *testing.T) *mcpUpstream {
	u := &mcpUpstream{}
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	u.Addr = strings.TrimPrefix(srv.URL, "http://")
	return u
}

// seen is the bodies the upstream received.
func (u *mcpUpstream) seen() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.bodies...)
}

func (u *mcpUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet {
		u.mu.Lock()
		u.lastEventIDs = append(u.lastEventIDs, r.Header.Get("Last-Event-ID"))
		u.mu.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		return
	}
	body, _ := io.ReadAll(r.Body)
	u.mu.Lock()
	u.bodies = append(u.bodies, string(body))
	u.mu.Unlock()
	var msgs []map[string]any
	batch := strings.HasPrefix(strings.TrimSpace(string(body)), "[")
	if batch {
		_ = json.Unmarshal(body, &msgs)
	} else {
		var one map[string]any
		_ = json.Unmarshal(body, &one)
		msgs = []map[string]any{one}
	}
	var answers []any
	for _, m := range msgs {
		id, ok := m["id"]
		if !ok {
			continue
		}
		var result any
		switch m["method"] {
		case "initialize":
			result = map[string]any{"protocolVersion": "2025-06-18", "capabilities": map[string]any{}, "serverInfo": map[string]any{"name": "t", "version": "1"}}
		case "tools/list":
			result = map[string]any{"tools": []any{map[string]any{"name": "search"}, map[string]any{"name": "summarize"}, map[string]any{"name": "echo"}}}
		case "tools/call":
			params, _ := m["params"].(map[string]any)
			args, _ := params["arguments"].(map[string]any)
			switch args["q"] {
			case "slow": // a tool that takes its time, and stops when its caller went away
				select {
				case <-r.Context().Done():
					return
				case <-time.After(5 * time.Second):
				}
				result = map[string]any{"content": []any{map[string]any{"type": "text", "text": "slow done"}}}
			case "fail": // the tool failed: a tool result with isError
				result = map[string]any{"isError": true, "content": []any{map[string]any{"type": "text", "text": "the tool failed"}}}
			case "rpcerror": // the server refused the call: a JSON-RPC error
				answers = append(answers, map[string]any{"jsonrpc": "2.0", "id": id, "error": map[string]any{"code": -32602, "message": "bad arguments"}})
				continue
			default:
				result = map[string]any{"content": []any{map[string]any{"type": "text", "text": fmt.Sprintf("ran %v", params["name"])}}}
			}
		}
		answers = append(answers, map[string]any{"jsonrpc": "2.0", "id": id, "result": result})
	}
	w.Header().Set("Mcp-Session-Id", "s1")
	if len(answers) == 0 {
		w.WriteHeader(http.StatusAccepted)
		return
	}
	if r.URL.Query().Has("sse") {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, "event: message\ndata: %s\n\n", `{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}`)
		for _, a := range answers {
			b, _ := json.Marshal(a)
			fmt.Fprintf(w, "event: message\nid: e1\ndata: %s\n\n", b)
		}
		return
	}
	var out any = answers[0]
	if batch {
		out = answers
	}
	b, _ := json.Marshal(out)
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Query().Has("chunked") { // no Content-Length: the body streams
		w.WriteHeader(http.StatusOK)
		_ = http.NewResponseController(w).Flush()
	}
	_, _ = w.Write(b)
}

// mcpEnv is a gateEnv whose gate prices the tools of an mcpUpstream.
type mcpEnv struct {
	*gateEnv
	up        *mcpUpstream
	caddyfile string // the Caddyfile it started with
}

// newMCPEnv starts a Caddy whose gate prices search at $0.01 and summarize at $0.05 (others free), with more
// lines inside its mcp block and inside the gate, before an mcpUpstream.
func newMCPEnv(t *testing.T, inMCP, inGate string) *mcpEnv {
	t.Helper()
	return newMCPEnvWith(t, inMCP, inGate, "")
}

// newMCPEnvWith is newMCPEnv with more global options.
func newMCPEnvWith(t *testing.T, inMCP, inGate, global string) *mcpEnv {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	up := newMCPUpstream(t)
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	block := "\t\tmcp {\n\t\t\ttool search $0.01\n\t\t\ttool summarize $0.05\n\t\t\tdefault free\n" + inMCP + "\t\t}\n"
	cf := env.caddyfile(gateSetup{gate: block + inGate, site: "reverse_proxy " + up.Addr})
	cf = strings.Replace(cf, fmt.Sprintf("\t\tamount %d\n", gatePrice), "", 1)
	cf = strings.Replace(cf, "{\n", "{\n"+global, 1)
	env.srv = startCaddy(t, cf)
	return &mcpEnv{gateEnv: env, up: up, caddyfile: cf}
}

// post posts a JSON-RPC body to path and reads the answer.
func (env *mcpEnv) post(path, body string) gateAnswer {
	env.t.Helper()
	req, err := http.NewRequest(http.MethodPost, env.srv.URL+path, strings.NewReader(body))
	if err != nil {
		env.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	return env.do(req)
}

// toolCall is a tools/call of tool with id, carrying payment in _meta when it is not nil.
func toolCall(id int, tool string, payment any) string { return toolCallQ(id, tool, "x", payment) }

// toolCallQ is toolCall with the argument q.
func toolCallQ(id int, tool, q string, payment any) string {
	params := map[string]any{"name": tool, "arguments": map[string]any{"q": q}}
	if payment != nil {
		params["_meta"] = map[string]any{"x402/payment": payment, "progressToken": 7}
	}
	b, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
	return string(b)
}

// mcpResponse is a JSON-RPC response as the tests read it.
type mcpResponse struct {
	ID     json.RawMessage `json:"id"`
	Result struct {
		IsError           bool                       `json:"isError"`
		StructuredContent *x402.PaymentRequired      `json:"structuredContent"`
		Content           []map[string]any           `json:"content"`
		Meta              map[string]json.RawMessage `json:"_meta"`
		Tools             []map[string]any           `json:"tools"`
	} `json:"result"`
	Error *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func readMCP(t *testing.T, body string) mcpResponse {
	t.Helper()
	var r mcpResponse
	if err := json.Unmarshal([]byte(body), &r); err != nil {
		t.Fatalf("the answer is no JSON-RPC response: %v: %q", err, body)
	}
	return r
}

// sseResponse is the JSON-RPC response an SSE answer carries for id.
func sseResponse(t *testing.T, body, id string) mcpResponse {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok && strings.Contains(data, `"id":`+id) {
			return readMCP(t, data)
		}
	}
	t.Fatalf("no SSE event answers id %s: %q", id, body)
	return mcpResponse{}
}

// priceOf is the permit2 requirement of an unpaid call's PaymentRequired.
func permit2Of(t *testing.T, r mcpResponse) x402.PaymentRequirements {
	t.Helper()
	if !r.Result.IsError || r.Result.StructuredContent == nil {
		t.Fatalf("the unpaid call's result is not an isError PaymentRequired: %+v", r)
	}
	for _, rq := range r.Result.StructuredContent.Accepts {
		if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
			return rq
		}
	}
	t.Fatalf("no permit2 offer in %+v", r.Result.StructuredContent)
	return x402.PaymentRequirements{}
}

// An MCP server behind a gate with an mcp block: initialize, tools/list and a free tool pass to the server unpaid;
// tools/list names each priced tool's price in its _meta (a JSON answer, with or without its length, or SSE); an unpaid call of a priced tool is answered, without
// reaching the server, with HTTP 200 and a tool result with isError whose structuredContent is the
// PaymentRequired at the tool's price and whose content[0].text is the same JSON; the call paid in
// _meta["x402/payment"] runs (the server never sees the payment, and keeps the rest of _meta), settles once on
// chain, and its result carries the settlement in _meta["x402/payment-response"]; the same payment again, and a
// payment for the cheap tool used on the dear one, are refused as tool results, with nothing moved.
func TestAnMCPGatePricesToolCallsAndTakesThePaymentInMeta(t *testing.T) {
	env := newMCPEnv(t, "", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)

	if a := env.post("/mcp", `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}`); a.status != http.StatusOK ||
		!strings.Contains(a.body, "protocolVersion") {
		t.Fatalf("initialize = %d %q, want the server's answer", a.status, a.body)
	}
	list := readMCP(t, env.post("/mcp", `{"jsonrpc":"2.0","id":2,"method":"tools/list"}`).body)
	prices := map[string]any{}
	for _, tool := range list.Result.Tools {
		meta, _ := tool["_meta"].(map[string]any)
		prices[tool["name"].(string)] = meta["x402/price"]
	}
	if prices["search"] != "$0.01" || prices["summarize"] != "$0.05" || prices["echo"] != nil {
		t.Fatalf("tools/list prices = %v, want search $0.01, summarize $0.05, echo none", prices)
	}
	for _, path := range []string{"/mcp?sse", "/mcp?chunked"} {
		if a := env.post(path, `{"jsonrpc":"2.0","id":2,"method":"tools/list"}`); !strings.Contains(a.body, `"x402/price":"$0.01"`) {
			t.Fatalf("tools/list at %s = %d %q, want the prices", path, a.status, a.body)
		}
	}
	if a := env.post("/mcp", toolCall(3, "echo", nil)); a.status != http.StatusOK || !strings.Contains(a.body, "ran echo") {
		t.Fatalf("a free tool = %d %q, want the server's answer", a.status, a.body)
	}

	calls := len(env.up.seen())
	a := env.post("/mcp", toolCall(4, "search", nil))
	unpaid := readMCP(t, a.body)
	if a.status != http.StatusOK || string(unpaid.ID) != "4" {
		t.Fatalf("an unpaid priced call = %d %q, want 200 with a result for id 4", a.status, a.body)
	}
	rq := permit2Of(t, unpaid)
	if want := `payment required: send the payment in params._meta["x402/payment"]`; unpaid.Result.StructuredContent.Error != want {
		t.Errorf("the PaymentRequired's error = %q, want %q", unpaid.Result.StructuredContent.Error, want)
	}
	if rq.Amount != "10000" {
		t.Fatalf("search is offered at %s, want 10000 ($0.01)", rq.Amount)
	}
	text, _ := unpaid.Result.Content[0]["text"].(string)
	var fromText x402.PaymentRequired
	if err := json.Unmarshal([]byte(text), &fromText); err != nil || len(fromText.Accepts) != len(unpaid.Result.StructuredContent.Accepts) {
		t.Fatalf("content[0].text is not the PaymentRequired: %q (%v)", text, err)
	}
	if got := len(env.up.seen()); got != calls {
		t.Fatalf("the unpaid call reached the server (%d calls, want %d)", got, calls)
	}

	before := env.balances(payer)
	payment := env.signPermit2(payer, rq)
	a = env.post("/mcp", toolCall(5, "search", payment))
	paid := readMCP(t, a.body)
	if a.status != http.StatusOK || paid.Result.IsError || len(paid.Result.Content) == 0 || paid.Result.Content[0]["text"] != "ran search" {
		t.Fatalf("the paid call = %d %q, want the tool's result", a.status, a.body)
	}
	var settled x402.SettleResponse
	if err := json.Unmarshal(paid.Result.Meta["x402/payment-response"], &settled); err != nil || !settled.Success || settled.Transaction == "" {
		t.Fatalf("the paid result's _meta[x402/payment-response] = %s (%v), want a settlement", paid.Result.Meta["x402/payment-response"], err)
	}
	env.assertPaid(payer, before, 1)
	seen := env.up.seen()
	last := seen[len(seen)-1]
	if strings.Contains(last, "x402/payment") || strings.Contains(last, "signature") || !strings.Contains(last, "progressToken") {
		t.Fatalf("the server saw %q: want the call without its payment, the rest of _meta kept", last)
	}

	calls = len(env.up.seen())
	again := readMCP(t, env.post("/mcp", toolCall(6, "search", payment)).body)
	if !again.Result.IsError || again.Result.StructuredContent == nil || !strings.Contains(again.Result.StructuredContent.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the same payment again = %+v, want an isError result naming %s", again, x402.ReasonPaymentAlreadyUsed)
	}
	// Replayed in another session (the gate prices calls, not sessions) and on another tool: refused all the same.
	req, _ := http.NewRequest(http.MethodPost, env.srv.URL+"/mcp", strings.NewReader(toolCall(8, "search", payment)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Mcp-Session-Id", "another-session")
	if r := readMCP(t, env.do(req).body); !r.Result.IsError || r.Result.StructuredContent == nil || !strings.Contains(r.Result.StructuredContent.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the same payment in another session = %+v, want refused as already used", r)
	}
	if r := readMCP(t, env.post("/mcp", toolCall(9, "summarize", payment)).body); !r.Result.IsError || r.Result.StructuredContent == nil {
		t.Fatalf("the same payment on another tool = %+v, want refused", r)
	}
	cheap := env.signPermit2(payer, rq)
	dear := readMCP(t, env.post("/mcp", toolCall(7, "summarize", cheap)).body)
	if !dear.Result.IsError || dear.Result.StructuredContent == nil || permit2Of(t, dear).Amount != "50000" {
		t.Fatalf("a payment for search on summarize = %+v, want an isError result offering 50000", dear)
	}
	if got := len(env.up.seen()); got != calls {
		t.Fatalf("a refused payment reached the server (%d calls, want %d)", got, calls)
	}
	env.assertPaid(payer, before, 1)
}

// The response to a paid call streamed as SSE carries the settlement in the event answering the call; the other
// events pass as they came. Held back until settled, the stream goes out whole with its length, as any paid
// answer the gate held back: a client never takes a cut stream for a whole one.
func TestAnMCPGateAddsTheSettlementToTheSSEEventAnsweringThePaidCall(t *testing.T) {
	env := newMCPEnv(t, "", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := permit2Of(t, readMCP(t, env.post("/mcp?sse", toolCall(1, "search", nil)).body))
	before := env.balances(payer)
	a := env.post("/mcp?sse", toolCall(2, "search", env.signPermit2(payer, rq)))
	if a.status != http.StatusOK || !strings.HasPrefix(a.header.Get("Content-Type"), "text/event-stream") ||
		!strings.Contains(a.body, "notifications/progress") {
		t.Fatalf("the paid SSE call = %d %q (%s), want the server's stream", a.status, a.body, a.header.Get("Content-Type"))
	}
	if cl := a.header.Get("Content-Length"); cl != fmt.Sprint(len(a.body)) {
		t.Errorf("the paid SSE answer's Content-Length = %q for %d bytes: a held-back answer goes out whole, with its length", cl, len(a.body))
	}
	r := sseResponse(t, a.body, "2")
	var settled x402.SettleResponse
	if err := json.Unmarshal(r.Result.Meta["x402/payment-response"], &settled); err != nil || !settled.Success {
		t.Fatalf("the SSE response event's _meta = %v (%v), want the settlement", r.Result.Meta, err)
	}
	env.assertPaid(payer, before, 1)
}

// A batch with an unpaid priced call is refused whole before any of it runs: the priced call gets its
// PaymentRequired, the other requests a JSON-RPC error saying why they did not run. A batch with one paid priced
// call runs whole, its result carrying the settlement; one with two priced calls is refused whole.
func TestAnMCPGateRunsABatchWholeOrNotAtAll(t *testing.T) {
	env := newMCPEnv(t, "", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	calls := len(env.up.seen())
	a := env.post("/mcp", "["+toolCall(1, "echo", nil)+","+toolCall(2, "search", nil)+`,{"jsonrpc":"2.0","method":"notifications/initialized"}]`)
	var answers []mcpResponse
	if err := json.Unmarshal([]byte(a.body), &answers); err != nil || a.status != http.StatusOK || len(answers) != 2 {
		t.Fatalf("a batch with an unpaid priced call = %d %q, want two answers", a.status, a.body)
	}
	if answers[0].Error == nil || !strings.Contains(answers[0].Error.Message, "not run") {
		t.Fatalf("the free call of the refused batch = %+v, want an error saying it did not run", answers[0])
	}
	rq := permit2Of(t, answers[1])
	if got := len(env.up.seen()); got != calls {
		t.Fatalf("a refused batch reached the server (%d calls, want %d)", got, calls)
	}

	before := env.balances(payer)
	a = env.post("/mcp", "["+toolCall(3, "echo", nil)+","+toolCall(4, "search", env.signPermit2(payer, rq))+"]")
	answers = nil
	if err := json.Unmarshal([]byte(a.body), &answers); err != nil || len(answers) != 2 {
		t.Fatalf("a batch with a paid call = %d %q", a.status, a.body)
	}
	if answers[1].Result.Meta["x402/payment-response"] == nil || answers[0].Result.Meta != nil {
		t.Fatalf("the batch's answers = %s, want the settlement on the paid call's only", a.body)
	}
	env.assertPaid(payer, before, 1)

	calls = len(env.up.seen())
	a = env.post("/mcp", "["+toolCall(5, "search", env.signPermit2(payer, rq))+","+toolCall(6, "search", env.signPermit2(payer, rq))+"]")
	if !strings.Contains(a.body, "2 priced tool calls") || len(env.up.seen()) != calls {
		t.Fatalf("a batch with two priced calls = %d %q, want it refused whole", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// What the gate cannot read is refused with a JSON-RPC error and never reaches the server: a tools/call naming
// its tool twice (the gate and the server could read different names), a body cut short, a body over max_body.
func TestAnMCPGateRefusesABodyItCannotReadWithAJSONRPCError(t *testing.T) {
	env := newMCPEnv(t, "\t\t\tmax_body 4KiB\n", "")
	calls := len(env.up.seen())
	refused := func(what string, a gateAnswer, status int) {
		t.Helper()
		r := readMCP(t, a.body)
		if a.status != status || r.Error == nil || r.Error.Code != -32700 {
			t.Errorf("%s = %d %q, want %d with a JSON-RPC parse error", what, a.status, a.body, status)
		}
	}
	refused("a tools/call naming its tool twice", env.post("/mcp",
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","name":"search"}}`), http.StatusBadRequest)
	refused("a batch whose call names its tool twice", env.post("/mcp",
		`[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","arguments":{},"name":"echo"}}]`), http.StatusBadRequest)
	refused("a body over max_body", env.post("/mcp", toolCall(1, "search", map[string]any{"pad": strings.Repeat("x", 5000)})), http.StatusRequestEntityTooLarge)
	refused("a body that is no JSON", env.post("/mcp", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search"`), http.StatusBadRequest)

	// A body cut short: the client sends less than its Content-Length and stops sending.
	host := strings.TrimPrefix(env.srv.URL, "http://")
	conn, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	call := toolCall(1, "search", nil)
	fmt.Fprintf(conn, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", host, len(call)+100, call)
	_ = conn.(*net.TCPConn).CloseWrite()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("reading the answer to a body cut short: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	refused("a body cut short", gateAnswer{status: resp.StatusCode, body: string(body)}, http.StatusBadRequest)
	if got := len(env.up.seen()); got != calls {
		t.Fatalf("a body the gate could not read reached the server (%d calls, want %d)", got, calls)
	}
}

// payer.MCPClient pays the priced tool calls of an MCP server behind a gate within its Transport's limits: a
// priced call is paid once and carries its settlement, a free one is not paid, a tool dearer than the limit per
// request and a call past the total are refused with a *payer.LimitError before anything is signed; the chain
// shows exactly the two payments made, and the Transport's budget counts them.
func TestThePayersMCPClientPaysToolCallsWithinItsLimits(t *testing.T) {
	env := newMCPEnv(t, "", "")
	who := env.c.Payers[0]
	env.approvePermit2(who)
	p, err := payer.New(who.Key, payer.Options{RPC: env.c.RPCURL, Method: x402.TransferPermit2})
	if err != nil {
		t.Fatal(err)
	}
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{PerRequest: big.NewInt(20_000), Total: big.NewInt(25_000)}}}
	client := &payer.MCPClient{URL: env.srv.URL + "/mcp?sse", Transport: tr}
	ctx := context.Background()
	if err := client.Initialize(ctx); err != nil {
		t.Fatal(err)
	}
	before := env.balances(who)
	for i := range 2 {
		res, err := client.CallTool(ctx, "search", map[string]any{"q": "x"})
		if err != nil || res.IsError || res.Paid == nil || res.Settlement == nil || !res.Settlement.Success {
			t.Fatalf("paid call %d = %+v, %v; want a result with its settlement", i, res, err)
		}
	}
	if res, err := client.CallTool(ctx, "echo", map[string]any{"q": "x"}); err != nil || res.Paid != nil || !strings.Contains(string(res.Result), "ran echo") {
		t.Fatalf("a free call = %+v, %v; want it unpaid", res, err)
	}
	var le *payer.LimitError
	if _, err := client.CallTool(ctx, "summarize", map[string]any{"q": "x"}); !errors.As(err, &le) || le.Limit.Int64() != 20_000 {
		t.Fatalf("a tool over the limit per request = %v, want a LimitError naming 20000", err)
	}
	if _, err := client.CallTool(ctx, "search", map[string]any{"q": "x"}); !errors.As(err, &le) || le.Spent.Int64() != 20_000 {
		t.Fatalf("a call past the total = %v, want a LimitError with 20000 spent", err)
	}
	env.assertPaid(who, before, 2)
	if got := tr.Signed(env.net, env.c.Token.Hex()); got.Int64() != 20_000 {
		t.Fatalf("the Transport counts %s signed, want 20000", got)
	}
}

// A paid call the MCP server answers with a tool result with isError, or with a JSON-RPC error, is not charged
// (settle after, the default; as the x402 MCP server SDK does not settle a failed tool): the client gets the
// server's answer as it was, with HTTP 200 and no settlement, nothing moves on chain, and the same payment then
// buys a call that succeeds. Over JSON and over SSE.
func TestAnMCPGateDoesNotChargeACallTheToolFailed(t *testing.T) {
	env := newMCPEnv(t, "", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	for _, path := range []string{"/mcp", "/mcp?sse"} {
		rq := permit2Of(t, readMCP(t, env.post(path, toolCall(1, "search", nil)).body))
		payment := env.signPermit2(payer, rq)
		before := env.balances(payer)
		read := func(a gateAnswer, id string) mcpResponse {
			t.Helper()
			if strings.HasPrefix(a.header.Get("Content-Type"), "text/event-stream") {
				return sseResponse(t, a.body, id)
			}
			return readMCP(t, a.body)
		}
		a := env.post(path, toolCallQ(2, "search", "fail", payment))
		failed := read(a, "2")
		if a.status != http.StatusOK || !failed.Result.IsError || failed.Result.StructuredContent != nil || failed.Result.Meta != nil ||
			len(failed.Result.Content) == 0 || failed.Result.Content[0]["text"] != "the tool failed" {
			t.Fatalf("%s: a paid call whose tool failed = %d %q, want the server's isError result, unpaid", path, a.status, a.body)
		}
		a = env.post(path, toolCallQ(3, "search", "rpcerror", payment))
		if r := read(a, "3"); a.status != http.StatusOK || r.Error == nil || r.Error.Code != -32602 {
			t.Fatalf("%s: a paid call the server refused = %d %q, want its JSON-RPC error, unpaid", path, a.status, a.body)
		}
		env.assertPaid(payer, before, 0)
		a = env.post(path, toolCallQ(4, "search", "x", payment))
		if r := read(a, "4"); r.Result.IsError || r.Result.Meta["x402/payment-response"] == nil {
			t.Fatalf("%s: the same payment on a call that succeeds = %d %q, want it served and settled", path, a.status, a.body)
		}
		env.assertPaid(payer, before, 1)
	}
}

// The mcp block of the shape adapts to the gate's "mcp" JSON: the tools' prices by name and the default.
func TestTheMCPBlockAdaptsToTheGatesJSON(t *testing.T) {
	handlers := adaptGate(t, ":8080\nroute /mcp {\n\tx402 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tmcp {\n\t\t\ttool search $0.01\n\t\t\ttool summarize $0.05\n\t\t\tdefault free\n\t\t\tmax_body 64KiB\n\t\t}\n\t}\n\treverse_proxy 127.0.0.1:3000\n}\n")
	if len(handlers) < 2 || handlers[0]["handler"] != "x402" {
		t.Fatalf("handlers = %v, want the gate first", handlers)
	}
	got, _ := json.Marshal(handlers[0]["mcp"])
	if want := `{"default":"free","max_body":65536,"tools":{"search":"$0.01","summarize":"$0.05"}}`; string(got) != want {
		t.Fatalf("mcp = %s, want %s", got, want)
	}
}

// A bad mcp block is refused as the Caddyfile is read, naming its line and what is wrong.
func TestBadMCPBlocksAreRefusedNamingTheLine(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"a tool without a price", "tool search", "mcp tool needs a name and a price"},
		{"a bare number", "tool search 10000", `mcp tool search: price "10000"`},
		{"a tool priced twice", "tool search $0.01\n\t\ttool search $0.02", "mcp tool search is priced twice, at Caddyfile:6"},
		{"a default that is no price", "default lots", "mcp default: price \"lots\""},
		{"a price with a placeholder", "tool search {http.request.header.price}", "holds a placeholder"},
		{"an unknown option", "colour blue", "unrecognized mcp option 'colour'"},
		{"max_body that is no size", "max_body lots", "mcp max_body 'lots'"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":8080\nx402 {\n\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\tmcp {\n\t\t"+tc.block+"\n\t}\n}\nrespond ok\n"),
				map[string]any{"filename": "Caddyfile"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !regexp.MustCompile(`Caddyfile:[56]\b`).MatchString(err.Error()) {
				t.Fatalf("adapt error = %v, want one naming its line and containing %q", err, tc.want)
			}
		})
	}
	if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":8080\nx402 {\n\tmcp now {\n\t}\n}\n"), map[string]any{"filename": "Caddyfile"}); err == nil ||
		!strings.Contains(err.Error(), "Caddyfile:3") {
		t.Fatalf("mcp with an argument: %v, want refused naming line 3", err)
	}
}

// An mcp gate whose other options cannot work with it is refused when loaded: a price of the gate's own (the
// price is the tool's), price_grace and access (they key by the URL every tool shares), upto, and a tool's
// price finer than the token.
func TestMCPGatesThatCannotWorkAreRefusedWhenLoaded(t *testing.T) {
	const payTo = "0x05e11e75e11e75e11e75e11e75e11e75e11e75e1"
	const asset = "0xFCc9EBb7682E831668990F8333F2Ea453bFDD563"
	const base = "pay_to " + payTo + "\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9\n\t"
	const tools = "mcp {\n\t\ttool search $0.01\n\t}"
	for _, tc := range []struct{ name, block, want string }{
		{"a price of the gate's own", base + "price $0.01\n\t" + tools, "mcp: the price of a call is the tool's"},
		{"an accept's amount", base + "accept {\n\t\tamount 5\n\t}\n\t" + tools, "mcp: the price of a call is the tool's"},
		{"price_grace", base + "price_grace 1m\n\t" + tools, "price_grace"},
		{"access", base + "access 1h\n\t" + tools, "mcp: access grants"},
		{"upto", base + "scheme upto\n\t" + tools, "scheme upto is not offered for tool calls"},
		{"a tool's price finer than the token", base + "mcp {\n\t\ttool search $0.0000001\n\t}", "mcp tool search"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := loadGateConfig(t, "{\n\tx402 {\n\t\tjournal {{DATA}}/j.db\n\t}\n}\nhttp://127.0.0.1:0 {\n\tx402 {\n\t"+tc.block+"\n\t}\n\trespond ok\n}\n")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("load error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// A paid call is settled as the route's settle mode says, and its result carries what the gate knows of the
// settlement: before and after, the transaction; async, the payment's pending answer, its transaction on chain
// soon after (settlement_pending, as the HTTP gate's PAYMENT-RESPONSE says). Each settles once.
func TestAnMCPGateSettlesAPaidCallInEachSettleMode(t *testing.T) {
	for _, mode := range []string{"before", "after", "async"} {
		t.Run(mode, func(t *testing.T) {
			env := newMCPEnv(t, "", "\t\tsettle "+mode+"\n")
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			rq := permit2Of(t, readMCP(t, env.post("/mcp", toolCall(1, "search", nil)).body))
			before := env.balances(payer)
			payment := env.signPermit2(payer, rq)
			a := env.post("/mcp", toolCall(2, "search", payment))
			r := readMCP(t, a.body)
			var settled x402.SettleResponse
			if err := json.Unmarshal(r.Result.Meta["x402/payment-response"], &settled); err != nil || r.Result.IsError {
				t.Fatalf("settle %s: the paid call = %d %q, want its result with the settlement", mode, a.status, a.body)
			}
			// Async, the answer is the PAYMENT-RESPONSE of the HTTP gate: pending, settled in the background.
			if pending := mode == "async"; pending && settled.ErrorReason != "settlement_pending" || !pending && (!settled.Success || settled.Transaction == "") {
				t.Fatalf("settle %s: the result's settlement = %+v", mode, settled)
			}
			env.waitPaid(payer, before, 1)
			again := readMCP(t, env.post("/mcp", toolCall(3, "search", payment)).body)
			if !again.Result.IsError || again.Result.StructuredContent == nil || !strings.Contains(again.Result.StructuredContent.Error, x402.ReasonPaymentAlreadyUsed) {
				t.Fatalf("settle %s: the same payment again = %+v, want refused as already used", mode, again)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// A gate whose payment_header is its own takes a paid call's payment from _meta all the same.
func TestAnMCPGateWithItsOwnPaymentHeaderTakesThePaymentFromMeta(t *testing.T) {
	env := newMCPEnv(t, "", "\t\tpayment_header X-Pay\n")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := permit2Of(t, readMCP(t, env.post("/mcp", toolCall(1, "search", nil)).body))
	before := env.balances(payer)
	a := env.post("/mcp", toolCall(2, "search", env.signPermit2(payer, rq)))
	if r := readMCP(t, a.body); r.Result.IsError || r.Result.Meta["x402/payment-response"] == nil {
		t.Fatalf("the paid call = %d %q, want its result with the settlement", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// With payment_identifier required, the PaymentRequired of an unpaid call declares the extension, and a payment
// in _meta that names no id is refused as a tool result with isError (the gate's 400), before anything is
// verified or run.
func TestAnMCPGateWithPaymentIdentifierRefusesAPaymentNamingNone(t *testing.T) {
	env := newMCPEnv(t, "", "\t\tpayment_identifier required\n")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	unpaid := readMCP(t, env.post("/mcp", toolCall(1, "search", nil)).body)
	rq := permit2Of(t, unpaid)
	if _, ok := unpaid.Result.StructuredContent.Extensions[x402.ExtensionPaymentIdentifier]; !ok {
		t.Fatalf("the PaymentRequired declares %v, want payment-identifier", unpaid.Result.StructuredContent.Extensions)
	}
	calls := len(env.up.seen())
	before := env.balances(payer)
	a := env.post("/mcp", toolCall(2, "search", env.signPermit2(payer, rq)))
	r := readMCP(t, a.body)
	if a.status != http.StatusOK || !r.Result.IsError || r.Result.StructuredContent == nil || !strings.Contains(r.Result.StructuredContent.Error, "payment-identifier") {
		t.Fatalf("a payment naming no id = %d %q, want an isError result naming payment-identifier", a.status, a.body)
	}
	if len(env.up.seen()) != calls {
		t.Fatal("a refused payment reached the server")
	}
	env.assertPaid(payer, before, 0)
}

// Over HTTP/2 (h2c), a paid call streamed as SSE is served and settled as over HTTP/1.1, and an unpaid one
// answered as the transport says.
func TestAnMCPGateServesPaidCallsOverHTTP2(t *testing.T) {
	env := newMCPEnvWith(t, "", "", "\tservers {\n\t\tprotocols h1 h2c\n\t}\n")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: &http.Transport{Protocols: &protocols}, Timeout: 30 * time.Second}
	post := func(body string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, env.srv.URL+"/mcp?sse", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	resp, body := post(toolCall(1, "search", nil))
	if resp.ProtoMajor != 2 {
		t.Fatalf("answered over %s, want HTTP/2", resp.Proto)
	}
	rq := permit2Of(t, readMCP(t, body))
	before := env.balances(payer)
	resp, body = post(toolCall(2, "search", env.signPermit2(payer, rq)))
	if r := sseResponse(t, body, "2"); resp.StatusCode != http.StatusOK || r.Result.Meta["x402/payment-response"] == nil {
		t.Fatalf("the paid call over HTTP/2 = %d %q, want its result with the settlement", resp.StatusCode, body)
	}
	env.assertPaid(payer, before, 1)
}

// A client that drops a paid call's SSE stream before the tool answered is charged nothing (settle after): the
// server's call is cancelled with the request, the gate sees an upstream error and settles nothing; the same
// payment then buys one call, settled once.
func TestAnMCPClientThatDropsTheStreamBeforeTheResponseIsNotCharged(t *testing.T) {
	env := newMCPEnv(t, "", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := permit2Of(t, readMCP(t, env.post("/mcp?sse", toolCall(1, "search", nil)).body))
	payment := env.signPermit2(payer, rq)
	before := env.balances(payer)
	env.dropSlowCall("/mcp?sse", 2, payment, 300*time.Millisecond)
	time.Sleep(time.Second) // the gate's answer to the cancelled call, had it settled, would be on chain by now
	env.assertPaid(payer, before, 0)
	a := env.post("/mcp?sse", toolCall(3, "search", payment))
	if r := sseResponse(t, a.body, "3"); r.Result.Meta["x402/payment-response"] == nil {
		t.Fatalf("the same payment again = %d %q, want served and settled", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// dropSlowCall posts to path a call of search, paid with payment, whose tool takes its time (q "slow"), and hangs
// up after wait, before the tool answers.
func (env *mcpEnv) dropSlowCall(path string, id int, payment any, wait time.Duration) {
	env.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, env.srv.URL+path, strings.NewReader(toolCallQ(id, "search", "slow", payment)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		env.t.Fatalf("the call dropped after %s was answered %d before the tool finished", wait, resp.StatusCode)
	}
}

// A GET of the session's SSE stream reaches the server unpaid, but never with Last-Event-ID: a server that keeps
// its events would replay after it the response to a paid call, one whose payment was refused at settlement
// among them.
func TestAnMCPGateDoesNotLetAStreamBeReplayedAfterAnEvent(t *testing.T) {
	env := newMCPEnv(t, "", "")
	req, _ := http.NewRequest(http.MethodGet, env.srv.URL+"/mcp", nil)
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Last-Event-ID", "e1")
	a := env.do(req)
	env.up.mu.Lock()
	ids := append([]string(nil), env.up.lastEventIDs...)
	env.up.mu.Unlock()
	if a.status != http.StatusOK || len(ids) != 1 || ids[0] != "" {
		t.Fatalf("a GET with Last-Event-ID = %d, the server saw Last-Event-ID %q; want it passed without one", a.status, ids)
	}
}

// A tool call charged and cut short (settle before: paid, then the client went away before the tool answered) is
// served by its record when presented again after a reload that changed the tool's price, as a cut-short payment
// of an HTTP route is after a reload of its price: the mcp block's prices are the route's terms, not its identity.
// Before, the reload renamed the route, and the payment was judged by the new price and refused value_mismatch.
func TestAToolCallChargedAndCutShortIsServedByItsRecordAfterAReloadChangedTheToolsPrice(t *testing.T) {
	env := newMCPEnv(t, "", "\t\tsettle before\n")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := permit2Of(t, readMCP(t, env.post("/mcp", toolCall(1, "search", nil)).body))
	payment := env.signPermit2(payer, rq)
	before := env.balances(payer)
	env.dropSlowCall("/mcp", 2, payment, 500*time.Millisecond)
	env.waitPaid(payer, before, 1) // settled before the tool ran

	env.srv.load(strings.Replace(env.caddyfile, "tool search $0.01", "tool search $0.02", 1))
	if got := permit2Of(t, readMCP(t, env.post("/mcp", toolCall(3, "search", nil)).body)).Amount; got != "20000" {
		t.Fatalf("after the reload search is offered at %s, want 20000", got)
	}
	calls := len(env.up.seen())
	a := env.post("/mcp", toolCall(4, "search", payment))
	r := readMCP(t, a.body)
	// The call cut short may still be ending at the gate (it settled before the tool ran): the gate says so, and
	// the payer waits for it, as it is told.
	for start := time.Now(); r.Result.IsError && r.Result.StructuredContent != nil && strings.Contains(r.Result.StructuredContent.Error, "right now") && time.Since(start) < 10*time.Second; {
		time.Sleep(100 * time.Millisecond)
		a = env.post("/mcp", toolCall(4, "search", payment))
		r = readMCP(t, a.body)
	}
	if r.Result.IsError || len(r.Result.Content) == 0 || r.Result.Content[0]["text"] != "ran search" {
		t.Fatalf("the charged call presented again after the reload = %d %q, want the tool's result", a.status, a.body)
	}
	if got := len(env.up.seen()); got != calls+1 {
		t.Fatalf("the server ran %d calls for the payment presented again, want 1", got-calls)
	}
	// Once served whole, it buys nothing more; and it never bought another tool.
	if again := readMCP(t, env.post("/mcp", toolCall(5, "search", payment)).body); !again.Result.IsError || again.Result.StructuredContent == nil ||
		!strings.Contains(again.Result.StructuredContent.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("presented a third time = %+v, want refused as already used", again)
	}
	if other := readMCP(t, env.post("/mcp", toolCall(6, "summarize", payment)).body); !other.Result.IsError {
		t.Fatalf("presented for another tool = %+v, want refused", other)
	}
	time.Sleep(200 * time.Millisecond) // a settlement wrongly sent would have mined by now
	env.assertPaid(payer, before, 1)
}
