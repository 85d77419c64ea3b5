package e2e

import (
	"bytes"
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"path"
	"strconv"
	"strings"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The MCP lane of the money-invariant run: two routes put the gate's mcp mode before the upstream's MCP tools
// (streamable HTTP), each with two tools of one price. A payment is a tools/call carrying it in
// params._meta["x402/payment"], answered by a tool result: the tool's answer with the settlement in its _meta, or
// the gate's refusal as a result with isError. Every action of the run draws these routes too, so MCP payments
// are presented again for the other tool, at another gateway, to an HTTP route, several at once, across kills,
// reloads and RPC faults, and payments of the HTTP routes are presented as tool calls; the checks judge them as
// any other payment: what was served against what settled on chain.

// invMCPHeader tells the upstream a request is an MCP call, and how to answer it: "json" or "sse".
const invMCPHeader = "X-Invariant-MCP"

// The shapes of a tool call (invShapes): answered as JSON, as an event stream, or over HTTP/2.
const (
	shapeMCP    = "MCP tools/call"
	shapeMCPSSE = "MCP tools/call, answered as an event stream"
	shapeMCPH2  = "MCP tools/call over HTTP/2 (h2c)"
)

func mcpRoute(rk *routeKind, _ string) bool { return rk.serve == serveMCP }

// mcpToolPrices is the mcp block's lines of a route whose two tools cost price; any other tool is free.
func mcpToolPrices(price string) string {
	return fmt.Sprintf("tool search %s\ntool lookup %s\ndefault free", price, price)
}

// mcpPaths are an MCP route's resources: a tool each, called at a path of the route ending in its name.
func mcpPaths(prefix string) []string { return []string{prefix + "search", prefix + "lookup"} }

// mcpAnswer is the text of the upstream's result for a call of tool at path.
func mcpAnswer(urlPath, tool string) string {
	return fmt.Sprintf("the MCP server's answer to tools/call %s at %s\n", tool, urlPath)
}

// mcpCall is a tools/call of the tool a path names, with payment (a PaymentPayload's JSON) in _meta when not nil.
func mcpCall(id int, urlPath string, payment []byte) ([]byte, error) {
	params := map[string]any{"name": path.Base(urlPath), "arguments": map[string]any{"q": "invariants"}}
	if payment != nil {
		params["_meta"] = map[string]any{x402.MCPMetaPayment: json.RawMessage(payment)}
	}
	return json.Marshal(map[string]any{"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
}

// mcpUpstream is the upstream's MCP server: it answers a tools/call with a result naming the tool and the path,
// as JSON or as one SSE event (streamed: no length), and a call whose payment reached it with what no client
// takes for the tool's answer.
func mcpUpstream(w http.ResponseWriter, r *http.Request) {
	var msg struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
		Params struct {
			Name string                     `json:"name"`
			Meta map[string]json.RawMessage `json:"_meta"`
		} `json:"params"`
	}
	body, err := io.ReadAll(r.Body)
	if err == nil {
		err = json.Unmarshal(body, &msg)
	}
	if err != nil || msg.Method != "tools/call" {
		http.Error(w, fmt.Sprintf("want one tools/call (%v)", err), http.StatusBadRequest)
		return
	}
	text := mcpAnswer(r.URL.Path, msg.Params.Name)
	if _, ok := msg.Params.Meta[x402.MCPMetaPayment]; ok {
		text = "the payment reached the MCP server\n"
	}
	answer, _ := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": msg.ID,
		"result": map[string]any{"content": []any{map[string]any{"type": "text", "text": text}}}})
	if r.Header.Get(invMCPHeader) == "sse" {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, "event: message\ndata: %s\n\n", answer)
		http.NewResponseController(w).Flush()
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
	w.Write(answer)
}

// mcpOffer calls the tool of path without payment at base and reads the PaymentRequired of its tool result.
func mcpOffer(ctx context.Context, client *http.Client, base, urlPath string) (payer.Offer, error) {
	body, err := mcpCall(1, urlPath, nil)
	if err != nil {
		return payer.Offer{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+urlPath, bytes.NewReader(body))
	if err != nil {
		return payer.Offer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	resp, err := client.Do(req)
	if err != nil {
		return payer.Offer{}, fmt.Errorf("calling %s without payment: %w", urlPath, err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	result, rpcErr, err := mcpResult(resp, got, 1)
	switch {
	case err != nil:
		return payer.Offer{}, fmt.Errorf("unpaid call of %s: %w", urlPath, err)
	case rpcErr != "":
		return payer.Offer{}, fmt.Errorf("unpaid call of %s answered a JSON-RPC error: %s", urlPath, rpcErr)
	case !result.IsError || result.StructuredContent == nil:
		return payer.Offer{}, fmt.Errorf("unpaid call of %s answered %s, want a tool result with isError and a PaymentRequired", urlPath, shorten(string(got)))
	}
	h := http.Header{}
	h.Set(x402.HeaderPaymentRequired, base64.StdEncoding.EncodeToString(result.StructuredContent))
	return payer.ReadOffer(h, nil)
}

// invToolResult is the part of a tool result the run reads.
type invToolResult struct {
	IsError           bool            `json:"isError"`
	StructuredContent json.RawMessage `json:"structuredContent"`
	Content           []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	} `json:"content"`
	Meta map[string]json.RawMessage `json:"_meta"`
}

// mcpResult reads the answer to the call of id from an HTTP response's body (JSON, or the SSE event carrying it):
// its result, or its JSON-RPC error's words.
func mcpResult(resp *http.Response, body []byte, id int) (*invToolResult, string, error) {
	docs := [][]byte{body}
	if media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); media == "text/event-stream" {
		docs = nil
		for _, event := range strings.Split(strings.ReplaceAll(string(body), "\r\n", "\n"), "\n\n") {
			var data []string
			for _, line := range strings.Split(event, "\n") {
				if v, ok := strings.CutPrefix(line, "data:"); ok {
					data = append(data, strings.TrimPrefix(v, " "))
				}
			}
			if len(data) > 0 {
				docs = append(docs, []byte(strings.Join(data, "\n")))
			}
		}
	}
	for _, doc := range docs {
		var msg struct {
			ID     json.RawMessage `json:"id"`
			Result *invToolResult  `json:"result"`
			Error  *struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(doc, &msg) != nil || string(msg.ID) != strconv.Itoa(id) {
			continue
		}
		if msg.Error != nil {
			return nil, fmt.Sprintf("%d %s", msg.Error.Code, msg.Error.Message), nil
		}
		if msg.Result == nil {
			return nil, "", fmt.Errorf("the answer to call %d has neither a result nor an error: %s", id, shorten(string(doc)))
		}
		return msg.Result, "", nil
	}
	return nil, "", fmt.Errorf("%d %s with no JSON-RPC answer to call %d: %s", resp.StatusCode, resp.Header.Get("Content-Type"), id, shorten(string(body)))
}

// sendMCP presents p as the payment of a tools/call of the tool res names, in shape, and judges the answer.
func (r *invRun) sendMCP(ctx context.Context, a *invAnswer, p *invPayment, base string, res invResource, shape string) {
	payment, err := x402.HeaderJSON(p.header)
	if err != nil {
		a.note = "the payment's header is no JSON: " + err.Error()
		return
	}
	body, err := mcpCall(p.n, res.path, payment)
	if err != nil {
		a.note = err.Error()
		return
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+res.path, bytes.NewReader(body))
	if err != nil {
		a.note = err.Error()
		return
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set(invPaymentHeader, strconv.Itoa(p.n))
	req.Header.Set(invMCPHeader, "json")
	client := r.client.h1
	switch shape {
	case shapeMCPSSE:
		req.Header.Set(invMCPHeader, "sse")
	case shapeMCPH2:
		client = r.client.h2c
	}
	resp, err := client.Do(req)
	if err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	defer resp.Body.Close()
	a.status = resp.StatusCode
	got, err := io.ReadAll(resp.Body)
	if err != nil && (resp.ContentLength < 0 || int64(len(got)) != resp.ContentLength) {
		a.note = fmt.Sprintf("the body broke after %d bytes: %s", len(got), shorten(err.Error()))
		return
	}
	// As for an HTTP answer (readAnswer): a body whose every byte of its Content-Length arrived was delivered whole,
	// even when the connection then broke before its end was signalled (an HTTP/2 stream's END_STREAM, sent once the
	// handler returns, lost to a SIGKILL just after the gate recorded the payment served): the payer holds the tool's
	// answer, which judgeMCP reads.
	if resp.StatusCode != http.StatusOK {
		// Not a tool result: the server around the gate, or the gate's own answer it passes as it is.
		if resp.StatusCode < 300 {
			a.note, a.wrong = fmt.Sprintf("a tool call answered %d, want 200", resp.StatusCode), true
			return
		}
		r.judge(a, p, resp, got, 0, 0, 0)
		return
	}
	r.judgeMCP(a, p, resp, got)
}

// judgeMCP classifies a tool call's 200 answer as judge does an HTTP answer: the tool's answer (whole), the
// gate's refusal (a result with isError and the PaymentRequired: a 402's; the gate's own JSON with its outcome:
// a 5xx's), or something wrong. a.status is set to the HTTP status the gate's refusal stands for.
func (r *invRun) judgeMCP(a *invAnswer, p *invPayment, resp *http.Response, body []byte) {
	result, rpcErr, err := mcpResult(resp, body, p.n)
	switch {
	case err != nil:
		a.note, a.wrong = err.Error(), true
		return
	case rpcErr != "":
		// The gate answers a JSON-RPC error only to a body it cannot read, which the run never sends.
		a.note, a.wrong = "a JSON-RPC error: "+shorten(rpcErr), true
		return
	}
	if doc, ok := result.Meta[x402.MCPMetaPaymentResponse]; ok {
		var s x402.SettleResponse
		if err := json.Unmarshal(doc, &s); err != nil {
			a.note, a.wrong = "the result's settlement does not read: "+err.Error(), true
			return
		}
		a.settle = &s
	}
	if result.IsError {
		var refusal struct {
			x402.PaymentRequired
			Outcome string `json:"outcome"`
		}
		if err := json.Unmarshal(result.StructuredContent, &refusal); err != nil {
			a.note, a.wrong = "a tool result with isError and no refusal of the gate's: "+shorten(string(body)), true
			return
		}
		a.note = shorten(cmp.Or(refusal.Error, string(result.StructuredContent)))
		if refusal.Outcome != "" {
			a.status, a.outcome = http.StatusBadGateway, refusal.Outcome // the gate's 502, 503 or 429
			return
		}
		a.status = http.StatusPaymentRequired
		a.final = !strings.Contains(a.note, "another request is presenting") && len(refusal.Accepts) > 0
		return
	}
	want := mcpAnswer(a.res.path, path.Base(a.res.path))
	if len(result.Content) != 1 || result.Content[0].Text != want {
		a.note, a.wrong = fmt.Sprintf("a tool result that is not the answer of %s: %s", a.res, shorten(string(body))), true
		return
	}
	a.whole, a.final = true, true
}

// checkMCPCalls judges mcp-tool-calls-answered: every tool call delivered whole carried its payment's
// settlement in the result's _meta (settled, or pending for settle async), every refusal of a tool call was a
// tool result (isError, the gate's PaymentRequired or its own JSON), and the lane ran: some tool call delivered.
func (r *invRun) checkMCPCalls(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	counts := map[string]int{}
	var calls, whole, refused, other, crossedIn, crossedOut int
	for _, p := range r.snapshot() {
		p.mu.Lock()
		answers := append([]*invAnswer(nil), p.answers...)
		p.mu.Unlock()
		for _, a := range answers {
			rk := r.w.route(a.res.path)
			mcp := rk != nil && rk.serve == serveMCP
			switch {
			case mcp && p.route.serve != serveMCP:
				crossedIn++
			case !mcp && p.route.serve == serveMCP:
				crossedOut++
			}
			if !mcp {
				continue
			}
			calls++
			counts[a.shape]++
			switch {
			case a.whole:
				whole++
				ok := a.settle != nil && (a.settle.Success || (rk.settle == "async" && a.settle.Pending()))
				if !ok {
					out = append(out, invViolation{what: fmt.Sprintf("payment #%d's tool call of %s was answered without its settlement in the result's _meta[%q]: %s",
						p.n, a.res.path, x402.MCPMetaPaymentResponse, a), payments: []*invPayment{p}})
				}
			case a.status == http.StatusPaymentRequired || a.status == http.StatusBadGateway:
				refused++
			case a.status != 0:
				other++
			}
		}
	}
	var shapes []string
	for _, s := range []string{shapeMCP, shapeMCPSSE, shapeMCPH2} {
		shapes = append(shapes, fmt.Sprintf("%d× %s", counts[s], s))
	}
	summary := fmt.Sprintf("%d paid tool calls (%s): %d answered by the tool with their settlement, %d refused as tool results, %d answered otherwise; %d of them presented payments of HTTP routes, and %d MCP payments were presented to HTTP routes",
		calls, strings.Join(shapes, ", "), whole, refused, other, crossedIn, crossedOut)
	if whole == 0 {
		out = append(out, invViolation{what: "no tool call was answered by the tool: the MCP lane did not run"})
	}
	return out, summary
}
