package gate

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"

	"github.com/x402-gateway/caddy-x402/x402"
)

// This file holds the gate's MCP mode: an MCP server behind the gate (the streamable HTTP transport: JSON-RPC
// posted to one endpoint, answered with JSON or an SSE stream) is paid per tool call, as the x402 MCP transport
// says (specs/transports-v2/mcp.md). The gate reads the JSON-RPC body; a tools/call of a priced tool is gated
// like any paid request, its payment carried in params._meta["x402/payment"] instead of a header, the
// PaymentRequired answered as a tool result with isError (HTTP 200, not 402), and the settlement added to the
// tool result's _meta["x402/payment-response"]. Everything else (initialize, tools/list, notifications, GET and
// DELETE of the session) passes free.

// DefaultMCPMaxBody bounds the JSON-RPC body an MCP gate reads before it decides what a request costs.
const DefaultMCPMaxBody = 1 << 20

// JSON-RPC error codes the gate answers with.
const (
	jsonrpcParseError     = -32700
	jsonrpcInvalidRequest = -32600
	// jsonrpcNotRun is the server-defined error of a request of a batch the gate refused whole.
	jsonrpcNotRun = -32001
)

// MCP prices the tool calls of an MCP server behind a gate.
type MCP struct {
	// Price is what a call of tool costs as configured (such as "$0.01"), "" for a free tool. The gate's
	// Config.OffersFor reads the tool of a request with MCPTool and offers that price.
	Price func(tool string) string
	// MaxBody bounds the request body read, in bytes. Default DefaultMCPMaxBody.
	MaxBody int64
	// PaymentHeader is the gate's Config.PaymentHeader, in which a paid call's payment is presented to the gate.
	// Default PAYMENT-SIGNATURE.
	PaymentHeader string
}

// MCPServe is the gate's exchange of one request around next, which MCP.ServeHTTP runs for a priced call.
type MCPServe func(w http.ResponseWriter, r *http.Request, next Handler) error

// mcpToolKey is the context key of the priced tool a request calls.
type mcpToolKey struct{}

// MCPTool returns the priced tool an MCP request calls, when the gate's MCP mode is pricing one.
func MCPTool(r *http.Request) (string, bool) {
	name, ok := r.Context().Value(mcpToolKey{}).(string)
	return name, ok
}

// mcpMessage is one JSON-RPC message of a request body, as read.
type mcpMessage struct {
	fields map[string]jsontext.Value
	method string
	id     jsontext.Value // nil for a notification
	// tool is a tools/call's params.name; params its params, payment its _meta["x402/payment"] (nil: none).
	tool    string
	params  map[string]jsontext.Value
	payment jsontext.Value
}

// ServeHTTP gates one request to the MCP server: serve is the gate itself (the payment exchange around next),
// next the MCP server. A request with no priced tool call goes to next unpaid.
func (m *MCP) ServeHTTP(w http.ResponseWriter, r *http.Request, serve MCPServe, next Handler) error {
	// A payment (or a sign-in) in a header is no payment here (the transport carries it in _meta), and a bearer
	// value the MCP server need not see.
	for _, name := range []string{m.paymentHeader(), x402.HeaderPaymentSignature, x402.HeaderXPayment, x402.HeaderSignInWithX} {
		r.Header.Del(name)
	}
	if r.Method != http.MethodPost {
		// The session's SSE stream (GET) and its end (DELETE) carry no call. A GET with Last-Event-ID asks a
		// server that keeps its events to replay a stream after that event, the response to a paid call among
		// them: one whose payment was refused at settlement, or that a payment already bought once. Without it
		// the server opens a new stream, which carries no response to an earlier call.
		r.Header.Del("Last-Event-ID")
		return next.ServeHTTP(w, r)
	}
	body, status, err := m.readBody(r)
	if err != nil {
		// Never passed on unpaid: a body the gate cannot read whole may hold a priced call.
		return writeJSONRPCError(w, status, nil, jsonrpcParseError, err.Error())
	}
	msgs, batch, err := parseMCPBody(body)
	if err != nil {
		return writeJSONRPCError(w, http.StatusBadRequest, nil, jsonrpcParseError, err.Error())
	}
	var priced []*mcpMessage
	for _, msg := range msgs {
		if msg.method == "tools/call" && m.Price(msg.tool) != "" {
			priced = append(priced, msg)
		}
	}
	if len(priced) == 0 {
		setBody(r, body)
		mw := m.advertising(w, msgs)
		if mw == nil {
			return next.ServeHTTP(w, r)
		}
		err := next.ServeHTTP(mw, r)
		if ferr := mw.finish(); err == nil {
			err = ferr
		}
		return err
	}
	for _, msg := range priced {
		if msg.id == nil {
			return writeJSONRPCError(w, http.StatusBadRequest, nil, jsonrpcInvalidRequest,
				fmt.Sprintf("tools/call of priced tool %q is a notification (no id): its price could not be asked for nor its result paid for", msg.tool))
		}
	}
	if batch {
		return m.serveBatch(w, r, msgs, priced, serve, next)
	}
	return m.servePriced(w, r, body, priced[0], serve, next, false)
}

// serveBatch serves a batch holding priced tool calls. One payment buys one response, and the response of a
// batch is one: a batch buys at most one priced call, paid; the others run first or not at all. A batch with
// a priced call unpaid, or with two, is refused whole before anything of it runs: a batch whose free calls ran
// while its priced one waited for payment would run them again when paid. The priced call unpaid is answered
// with its PaymentRequired, every other request of the batch with a JSON-RPC error that says why it did not run.
func (m *MCP) serveBatch(w http.ResponseWriter, r *http.Request, msgs, priced []*mcpMessage, serve MCPServe, next Handler) error {
	var unpaid *mcpMessage
	for _, msg := range priced {
		if msg.payment == nil {
			unpaid = msg
			break
		}
	}
	if unpaid == nil && len(priced) == 1 {
		body, err := json.Marshal(encodeMessages(msgs, priced[0]))
		if err != nil {
			return fmt.Errorf("x402 mcp: encoding the batch: %w", err)
		}
		return m.servePriced(w, r, body, priced[0], serve, next, true)
	}
	why := fmt.Sprintf("not run: this batch carries %d priced tool calls; a batch may carry one, paid, and runs whole or not at all", len(priced))
	var required jsontext.Value
	if unpaid != nil {
		why = fmt.Sprintf("not run: tool call %s of this batch (%q) is priced and carries no payment; a batch runs whole or not at all", unpaid.id, unpaid.tool)
		var err error
		if required, err = m.askPrice(r, unpaid, serve); err != nil {
			return writeJSONRPCError(w, http.StatusServiceUnavailable, unpaid.id, jsonrpcNotRun, "not run: "+err.Error())
		}
	}
	var answers []any
	for _, msg := range msgs {
		switch {
		case msg.id == nil:
		case msg == unpaid:
			answers = append(answers, jsonrpcResult(msg.id, paymentRequiredResult(required)))
		default:
			answers = append(answers, jsonrpcError(msg.id, jsonrpcNotRun, why))
		}
	}
	return writeJSONRPC(w, http.StatusOK, answers)
}

// askPrice is the PaymentRequired of a priced call without payment: the gate's 402 for the tool, taken whole.
func (m *MCP) askPrice(r *http.Request, msg *mcpMessage, serve MCPServe) (jsontext.Value, error) {
	rec := &capturedAnswer{header: http.Header{}}
	r = r.WithContext(context.WithValue(r.Context(), mcpToolKey{}, msg.tool))
	r.Header.Del("Accept") // the 402's JSON, never the paywall page
	if err := serve(rec, r, HandlerFunc(unreachedWithoutPayment)); err != nil {
		return nil, fmt.Errorf("the gate could not say what tool %q costs: %w", msg.tool, err)
	}
	if v := rec.header.Get(x402.HeaderPaymentRequired); v != "" {
		var doc map[string]jsontext.Value
		if raw, err := x402.HeaderJSON(v); err == nil && json.Unmarshal(raw, &doc) == nil {
			doc["error"], _ = json.Marshal(mcpPaymentRequiredError())
			if b, err := json.Marshal(doc); err == nil {
				return b, nil
			}
		}
	}
	return nil, fmt.Errorf("the gate could not say what tool %q costs now (it answered %d); try again", msg.tool, rec.status)
}

// unreachedWithoutPayment is the MCP server to a gate asked for the price of a call: a request without payment
// never reaches it.
func unreachedWithoutPayment(http.ResponseWriter, *http.Request) error {
	return errors.New("x402 mcp: a call without payment reached the MCP server")
}

// servePriced serves a body holding one priced call: without payment, its PaymentRequired as a tool result; with
// one, the payment presented to the gate as its header and taken out of what the MCP server sees.
func (m *MCP) servePriced(w http.ResponseWriter, r *http.Request, body []byte, msg *mcpMessage, serve MCPServe, next Handler, batch bool) error {
	if msg.payment == nil {
		// The gate's answer without payment (its 402, or a 503 while it has nothing to offer), as a tool result.
		r = r.WithContext(context.WithValue(r.Context(), mcpToolKey{}, msg.tool))
		r.Header.Del("Accept") // the 402's JSON, never the paywall page
		mw := &mcpWriter{w: w, id: msg.id, unpaid: true}
		err := serve(mw, r, HandlerFunc(unreachedWithoutPayment))
		if ferr := mw.finish(); err == nil {
			err = ferr
		}
		return err
	}
	if !batch {
		var err error
		if body, err = json.Marshal(encodeMessage(msg, true)); err != nil {
			return fmt.Errorf("x402 mcp: encoding the call: %w", err)
		}
	}
	r = r.WithContext(context.WithValue(r.Context(), mcpToolKey{}, msg.tool))
	r.Header.Set(m.paymentHeader(), base64.StdEncoding.EncodeToString(msg.payment))
	r.Header.Del("Accept-Encoding") // the answer is rewritten, so it must come uncompressed
	setBody(r, body)
	mw := &mcpWriter{w: w, id: msg.id}
	err := serve(mw, r, HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		up := &mcpUpstream{w: w, id: msg.id, limit: DefaultMaxBuffer}
		err := next.ServeHTTP(up, r)
		if ferr := up.finish(); err == nil {
			err = ferr
		}
		return err
	}))
	if ferr := mw.finish(); err == nil {
		err = ferr
	}
	return err
}

// advertising is a writer that adds each priced tool's price to the tools/list answer msgs ask for; nil when
// they ask for none.
func (m *MCP) advertising(w http.ResponseWriter, msgs []*mcpMessage) *mcpWriter {
	for _, msg := range msgs {
		if msg.method == "tools/list" && msg.id != nil {
			return &mcpWriter{w: w, id: msg.id, list: m.Price, passErrors: true}
		}
	}
	return nil
}

func (m *MCP) paymentHeader() string {
	if m.PaymentHeader == "" {
		return x402.HeaderPaymentSignature
	}
	return m.PaymentHeader
}

// readBody reads the request body whole, up to MaxBody.
func (m *MCP) readBody(r *http.Request) ([]byte, int, error) {
	limit := m.MaxBody
	if limit <= 0 {
		limit = DefaultMCPMaxBody
	}
	if r.Body == nil {
		return nil, http.StatusBadRequest, errors.New("the request has no body; want a JSON-RPC message")
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	switch {
	case err != nil:
		return nil, http.StatusBadRequest, fmt.Errorf("the request body could not be read whole (%v); nothing was run", err)
	case int64(len(body)) > limit:
		return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("the request body is larger than the %d bytes the x402 gate reads", limit)
	}
	return body, 0, nil
}

// parseMCPBody reads a JSON-RPC message or batch. A name given twice anywhere in it is refused: the gate and the
// MCP server must not read two different tool names (or payments) out of one call. So is a batch whose messages
// share an id.
func parseMCPBody(body []byte) (msgs []*mcpMessage, batch bool, err error) {
	var raws []jsontext.Value
	if trimmed := bytes.TrimLeft(body, " \t\r\n"); len(trimmed) > 0 && trimmed[0] == '[' {
		batch = true
		if err := json.Unmarshal(body, &raws); err != nil {
			return nil, true, fmt.Errorf("the JSON-RPC batch does not read: %v", err)
		}
		if len(raws) == 0 {
			return nil, true, errors.New("the JSON-RPC batch is empty")
		}
	} else {
		raws = []jsontext.Value{body}
	}
	for i, raw := range raws {
		msg, err := parseMCPMessage(raw)
		if err != nil {
			if batch {
				return nil, true, fmt.Errorf("message %d of the batch: %w", i, err)
			}
			return nil, false, err
		}
		for j, prev := range msgs {
			if msg.id != nil && prev.id != nil && sameID(msg.id, prev.id) {
				// The answers are told apart by id: an error answering one would pass for the other's, and a paid
				// call would look failed (not charged) while its result went out beside it.
				return nil, true, fmt.Errorf("messages %d and %d of the batch share the id %s; ids in a batch must differ", j, i, msg.id)
			}
		}
		msgs = append(msgs, msg)
	}
	return msgs, batch, nil
}

// parseMCPMessage reads one JSON-RPC message, and a tools/call's name and payment.
func parseMCPMessage(raw jsontext.Value) (*mcpMessage, error) {
	msg := &mcpMessage{}
	if err := json.Unmarshal(raw, &msg.fields); err != nil {
		return nil, fmt.Errorf("the JSON-RPC message does not read: %v", err)
	}
	if v, ok := msg.fields["method"]; ok {
		if err := json.Unmarshal(v, &msg.method); err != nil {
			return nil, fmt.Errorf("the JSON-RPC method is not a string: %v", err)
		}
	}
	if v, ok := msg.fields["id"]; ok && string(v) != "null" {
		msg.id = v
	}
	if msg.method != "tools/call" {
		return msg, nil
	}
	if err := json.Unmarshal(msg.fields["params"], &msg.params); err != nil || msg.params == nil {
		return nil, errors.New("tools/call has no params object")
	}
	if err := json.Unmarshal(msg.params["name"], &msg.tool); err != nil || msg.tool == "" {
		return nil, errors.New("tools/call names no tool: params.name is not a string")
	}
	if v, ok := msg.params["_meta"]; ok {
		var meta map[string]jsontext.Value
		if err := json.Unmarshal(v, &meta); err != nil {
			return nil, fmt.Errorf("tools/call params._meta is not an object: %v", err)
		}
		if p, ok := meta[x402.MCPMetaPayment]; ok && string(p) != "null" {
			if p.Kind() != '{' {
				return nil, fmt.Errorf("tools/call params._meta[%q] is not an object", x402.MCPMetaPayment)
			}
			msg.payment = p
		}
	}
	return msg, nil
}

// encodeMessage is msg for the MCP server: without its payment when strip is set.
func encodeMessage(msg *mcpMessage, strip bool) any {
	if !strip || msg.payment == nil {
		return msg.fields
	}
	params := make(map[string]jsontext.Value, len(msg.params))
	for k, v := range msg.params {
		params[k] = v
	}
	var meta map[string]jsontext.Value
	_ = json.Unmarshal(params["_meta"], &meta) // read by parseMCPMessage
	delete(meta, x402.MCPMetaPayment)
	if len(meta) == 0 {
		delete(params, "_meta")
	} else {
		b, _ := json.Marshal(meta)
		params["_meta"] = b
	}
	fields := make(map[string]jsontext.Value, len(msg.fields))
	for k, v := range msg.fields {
		fields[k] = v
	}
	b, _ := json.Marshal(params)
	fields["params"] = b
	return fields
}

// encodeMessages is a batch for the MCP server, paid's payment taken out.
func encodeMessages(msgs []*mcpMessage, paid *mcpMessage) []any {
	out := make([]any, len(msgs))
	for i, msg := range msgs {
		out[i] = encodeMessage(msg, msg == paid)
	}
	return out
}

// setBody makes body the request's body.
func setBody(r *http.Request, body []byte) {
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
}

// paymentRequiredResult is the tool result of a call that must be paid, as the transport says: isError, the
// PaymentRequired as structuredContent and as the text of content[0].
func paymentRequiredResult(required jsontext.Value) map[string]any {
	return map[string]any{
		"isError":           true,
		"structuredContent": required,
		"content":           []any{map[string]any{"type": "text", "text": string(required)}},
	}
}

func jsonrpcResult(id jsontext.Value, result any) map[string]any {
	return map[string]any{"jsonrpc": "2.0", "id": id, "result": result}
}

func jsonrpcError(id jsontext.Value, code int, message string) map[string]any {
	if id == nil {
		id = jsontext.Value("null")
	}
	return map[string]any{"jsonrpc": "2.0", "id": id, "error": map[string]any{"code": code, "message": message}}
}

// writeJSONRPCError answers a JSON-RPC error with status.
func writeJSONRPCError(w http.ResponseWriter, status int, id jsontext.Value, code int, message string) error {
	return writeJSONRPC(w, status, jsonrpcError(id, code, message))
}

func writeJSONRPC(w http.ResponseWriter, status int, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("x402 mcp: encoding the answer: %w", err)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, err = w.Write(body)
	return err
}

// capturedAnswer keeps an answer of the gate that is not sent as it is.
type capturedAnswer struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (c *capturedAnswer) Header() http.Header { return c.header }
func (c *capturedAnswer) WriteHeader(status int) {
	if c.status == 0 {
		c.status = status
	}
}
func (c *capturedAnswer) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	return c.body.Write(p)
}
