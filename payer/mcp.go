package payer

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/x402-gateway/caddy-x402/x402"
)

// MCP protocol values the client sends.
const (
	// MCPProtocolVersion is the MCP revision the client speaks.
	MCPProtocolVersion = "2025-06-18"
	// maxMCPAnswer bounds an MCP answer the client reads.
	maxMCPAnswer = 16 << 20
)

// MCPClient calls the tools of an MCP server over the streamable HTTP transport and pays the priced ones as the
// x402 MCP transport says: a call answered with a tool result with isError and a PaymentRequired (in
// structuredContent, or as the text of content[0]) is paid, within the Transport's limits, and sent again with the
// payment in params._meta["x402/payment"]. What it signs counts in the Transport's budget (Spent, Signed), the
// same budget its HTTP payments count in.
//
// An MCPClient keeps one session (Initialize); it is safe for concurrent calls once initialized.
type MCPClient struct {
	// URL is the MCP endpoint, such as https://example.com/mcp.
	URL string
	// Transport signs the payments within its Limits and sends the requests; required.
	Transport *Transport

	mu      sync.Mutex
	session string
	ids     atomic.Int64
}

// MCPToolResult is the result of a tool call.
type MCPToolResult struct {
	// Result is the tool result as the server answered it (content, structuredContent, isError, _meta).
	Result json.RawMessage
	// IsError is the result's isError.
	IsError bool
	// Settlement is the result's _meta["x402/payment-response"], for a paid call; nil otherwise.
	Settlement *x402.SettleResponse
	// PaymentRequired is the PaymentRequired of a call the server still asks payment for (the paid call refused,
	// say); nil otherwise.
	PaymentRequired *x402.PaymentRequired
	// Paid is the payment sent with the call; nil for a free call.
	Paid *Payment
}

// MCPError is a JSON-RPC error the MCP server answered.
type MCPError struct {
	Code    int             `json:"code"`
	Message string          `json:"message"`
	Data    json.RawMessage `json:"data,omitempty"`
}

func (e *MCPError) Error() string { return fmt.Sprintf("payer: MCP error %d: %s", e.Code, e.Message) }

// Initialize opens the session: initialize, then notifications/initialized.
func (c *MCPClient) Initialize(ctx context.Context) error {
	params := map[string]any{"protocolVersion": MCPProtocolVersion, "capabilities": map[string]any{},
		"clientInfo": map[string]any{"name": "caddy-x402-payer", "version": "1"}}
	if _, err := c.request(ctx, "initialize", params); err != nil {
		return err
	}
	return c.notify(ctx, "notifications/initialized")
}

// CallTool calls tool name with args, paying it when the server asks.
func (c *MCPClient) CallTool(ctx context.Context, name string, args any) (*MCPToolResult, error) {
	params := map[string]any{"name": name, "arguments": args}
	raw, err := c.request(ctx, "tools/call", params)
	if err != nil {
		return nil, err
	}
	res, required, err := readToolResult(raw)
	if err != nil || required == nil {
		return res, err
	}
	where := c.URL + "#tool=" + name
	pay, chosen, err := c.pay(ctx, where, required)
	if err != nil {
		return nil, err
	}
	params["_meta"] = map[string]any{x402.MCPMetaPayment: pay.Payload}
	c.Transport.sent(chosen)
	raw, err = c.request(ctx, "tools/call", params)
	if err != nil {
		return nil, err
	}
	res, _, err = readToolResult(raw)
	if res != nil {
		res.Paid = &pay
	}
	return res, err
}

// pay chooses a requirement of the PaymentRequired doc the limits allow, reserves it and signs it.
func (c *MCPClient) pay(ctx context.Context, where string, doc json.RawMessage) (Payment, x402.PaymentRequirements, error) {
	t := c.Transport
	// The one way an offer is read: as the header a 402 carries it in.
	h := http.Header{}
	h.Set(x402.HeaderPaymentRequired, base64.StdEncoding.EncodeToString(doc))
	offer, err := ReadOffer(h, nil)
	if err != nil {
		return Payment{}, x402.PaymentRequirements{}, fmt.Errorf("payer: %s: %w", where, err)
	}
	rpc, err := t.Payer.chain(ctx)
	if err != nil {
		return Payment{}, x402.PaymentRequirements{}, fmt.Errorf("payer: %s: %w", where, err)
	}
	i, err := t.Payer.choose(offer, rpc, func(r x402.PaymentRequirements) error {
		if r.Scheme == x402.SchemeBatchSettlement {
			return errors.New("a tool call is paid by exact or upto, not batch-settlement")
		}
		return t.check(where, r, false)
	})
	if err != nil {
		var le *LimitError
		if errors.As(err, &le) {
			return Payment{}, x402.PaymentRequirements{}, err
		}
		return Payment{}, x402.PaymentRequirements{}, fmt.Errorf("payer: %s: %w", where, err)
	}
	chosen := offer.Required.Accepts[i]
	// Checked again, and reserved, under the lock: a concurrent payment may have spent the budget meanwhile.
	if err := t.check(where, chosen, true); err != nil {
		return Payment{}, chosen, err
	}
	pay, err := t.Payer.Sign(ctx, offer, i)
	if err != nil {
		t.release(chosen)
		return Payment{}, chosen, fmt.Errorf("payer: %s: %w", where, err)
	}
	return pay, chosen, nil
}

// readToolResult reads a tool result, and the PaymentRequired it carries when it asks for payment.
func readToolResult(raw json.RawMessage) (*MCPToolResult, json.RawMessage, error) {
	var r struct {
		IsError           bool            `json:"isError"`
		StructuredContent json.RawMessage `json:"structuredContent"`
		Content           []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
		Meta map[string]json.RawMessage `json:"_meta"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, nil, fmt.Errorf("payer: the tool result does not read: %w", err)
	}
	res := &MCPToolResult{Result: raw, IsError: r.IsError}
	if s, ok := r.Meta[x402.MCPMetaPaymentResponse]; ok {
		var settled x402.SettleResponse
		if err := json.Unmarshal(s, &settled); err == nil {
			res.Settlement = &settled
		}
	}
	if !r.IsError {
		return res, nil, nil
	}
	// structuredContent first, the text of content[0] for a server that sends none, as the transport says.
	candidates := []json.RawMessage{r.StructuredContent}
	if len(r.Content) > 0 && r.Content[0].Type == "text" {
		candidates = append(candidates, json.RawMessage(r.Content[0].Text))
	}
	for _, doc := range candidates {
		var pr x402.PaymentRequired
		if len(doc) == 0 || json.Unmarshal(doc, &pr) != nil || pr.X402Version == 0 || len(pr.Accepts) == 0 {
			continue
		}
		res.PaymentRequired = &pr
		return res, doc, nil
	}
	return res, nil, nil
}

// request sends a JSON-RPC request and returns its result.
func (c *MCPClient) request(ctx context.Context, method string, params any) (json.RawMessage, error) {
	id := c.ids.Add(1)
	resp, err := c.post(ctx, map[string]any{"jsonrpc": "2.0", "id": id, "method": method, "params": params})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if s := resp.Header.Get("Mcp-Session-Id"); s != "" {
		c.mu.Lock()
		c.session = s
		c.mu.Unlock()
	}
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("payer: %s answered %s to %s: %s", c.URL, resp.Status, method, strings.TrimSpace(string(body)))
	}
	answer, err := readMCPAnswer(resp, id)
	if err != nil {
		return nil, fmt.Errorf("payer: %s: %s: %w", c.URL, method, err)
	}
	var msg struct {
		Result json.RawMessage `json:"result"`
		Error  *MCPError       `json:"error"`
	}
	if err := json.Unmarshal(answer, &msg); err != nil {
		return nil, fmt.Errorf("payer: %s: the answer to %s does not read: %w", c.URL, method, err)
	}
	if msg.Error != nil {
		return nil, msg.Error
	}
	return msg.Result, nil
}

// notify sends a JSON-RPC notification.
func (c *MCPClient) notify(ctx context.Context, method string) error {
	resp, err := c.post(ctx, map[string]any{"jsonrpc": "2.0", "method": method})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode >= http.StatusBadRequest {
		return fmt.Errorf("payer: %s answered %s to %s", c.URL, resp.Status, method)
	}
	return nil
}

func (c *MCPClient) post(ctx context.Context, msg any) (*http.Response, error) {
	if c.Transport == nil {
		return nil, errors.New("payer: MCPClient.Transport is nil")
	}
	body, err := json.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("payer: encoding the MCP request: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.URL, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("payer: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("MCP-Protocol-Version", MCPProtocolVersion)
	c.mu.Lock()
	if c.session != "" {
		req.Header.Set("Mcp-Session-Id", c.session)
	}
	c.mu.Unlock()
	resp, err := c.Transport.base().RoundTrip(req)
	if err != nil {
		return nil, fmt.Errorf("payer: %s: %w", c.URL, err)
	}
	return resp, nil
}

// readMCPAnswer returns the JSON-RPC response to id of a JSON answer or of an SSE stream.
func readMCPAnswer(resp *http.Response, id int64) (json.RawMessage, error) {
	media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	want := []byte(fmt.Sprint(id))
	matches := func(doc []byte) bool {
		var m struct {
			ID json.RawMessage `json:"id"`
		}
		return json.Unmarshal(doc, &m) == nil && bytes.Equal(bytes.TrimSpace(m.ID), want)
	}
	body := io.LimitReader(resp.Body, maxMCPAnswer)
	if media != "text/event-stream" {
		doc, err := io.ReadAll(body)
		if err != nil {
			return nil, fmt.Errorf("reading the answer: %w", err)
		}
		if !matches(doc) {
			return nil, fmt.Errorf("the answer is no JSON-RPC response to request %d", id)
		}
		return doc, nil
	}
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 64<<10), maxMCPAnswer)
	var data []string
	for sc.Scan() {
		line := strings.TrimSuffix(sc.Text(), "\r")
		if v, ok := strings.CutPrefix(line, "data:"); ok {
			data = append(data, strings.TrimPrefix(v, " "))
			continue
		}
		if line == "" && len(data) > 0 {
			if doc := []byte(strings.Join(data, "\n")); matches(doc) {
				return doc, nil
			}
			data = nil
		}
	}
	if len(data) > 0 {
		if doc := []byte(strings.Join(data, "\n")); matches(doc) {
			return doc, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading the event stream: %w", err)
	}
	return nil, fmt.Errorf("the event stream ended without the response to request %d", id)
}
