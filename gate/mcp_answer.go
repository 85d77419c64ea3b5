package gate

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"

	"github.com/x402-gateway/caddy-x402/x402"
)

// mcpWriter rewrites the answer to a request of the MCP mode on its way to the client: the response to the
// call's id gains the settlement in its result's _meta (a JSON answer, or the SSE event carrying it); the gate's
// own refusals (402, 400, 502...) become the tool result with isError the transport asks for; with list set, a
// tools/list result gains each priced tool's price.
type mcpWriter struct {
	w  http.ResponseWriter
	id jsontext.Value
	// list, when set, prices the tools of a tools/list answer; passErrors passes every answer of 300 and more
	// as it is (a free request's answers are the MCP server's own).
	list       func(tool string) string
	passErrors bool
	// unpaid: the call carries no payment, and the PaymentRequired says where one goes.
	unpaid bool

	mode    mcpMode
	status  int
	length  int64 // the Content-Length of a buffered answer, -1 when none was given
	settled jsontext.Value
	buf     bytes.Buffer // a buffered answer, or the SSE event being read
	done    bool         // the buffered answer was written out
	sse     bool         // the buffered answer is an event stream
	err     error
}

// mcpPaymentRequiredError is the error of the PaymentRequired of a call without payment.
func mcpPaymentRequiredError() string {
	return fmt.Sprintf("payment required: send the payment in params._meta[%q]", x402.MCPMetaPayment)
}

type mcpMode int

const (
	mcpUndecided mcpMode = iota
	mcpPass              // as it comes
	mcpJSON              // one JSON document, rewritten once whole
	mcpSSE               // an event stream, rewritten event by event
	mcpRefused           // the gate's own refusal, or an error to pass on
)

func (m *mcpWriter) Header() http.Header { return m.w.Header() }

// Unwrap gives http.ResponseController the writer underneath.
func (m *mcpWriter) Unwrap() http.ResponseWriter { return m.w }

func (m *mcpWriter) WriteHeader(status int) {
	if m.mode != mcpUndecided {
		return
	}
	if status < http.StatusOK {
		m.w.WriteHeader(status)
		return
	}
	h := m.w.Header()
	if v := h.Get(headerMCPToolFailed); v != "" {
		// The paid call failed and went unpaid: the client gets the server's answer as it was.
		h.Del(headerMCPToolFailed)
		if n, err := strconv.Atoi(v); err == nil {
			status = n
		}
	}
	m.status = status
	if v := h.Get(x402.HeaderPaymentResponse); v != "" {
		if doc, err := x402.HeaderJSON(v); err == nil {
			m.settled = jsontext.Value(doc)
		}
	}
	m.length = -1
	if n, err := strconv.ParseInt(h.Get("Content-Length"), 10, 64); err == nil {
		m.length = n
	}
	media, _, _ := mime.ParseMediaType(h.Get("Content-Type"))
	switch {
	case status >= http.StatusMultipleChoices && m.passErrors:
		m.mode = mcpPass
	case status >= http.StatusMultipleChoices:
		m.mode = mcpRefused
	case h.Get("Content-Encoding") != "":
		m.mode = mcpPass // an upstream that compresses anyway: not rewritten
	case media == "text/event-stream" && m.length >= 0:
		// Whole, as the gate sends a held-back answer: rewritten whole, and sent with its length.
		m.mode, m.sse = mcpJSON, true
	case media == "text/event-stream":
		m.mode = mcpSSE
	case media == "application/json":
		m.mode = mcpJSON
	default:
		m.mode = mcpPass
	}
	switch m.mode {
	case mcpPass:
		m.w.WriteHeader(status)
	case mcpSSE:
		h.Del("Content-Length")
		m.w.WriteHeader(status)
	}
}

func (m *mcpWriter) Write(p []byte) (int, error) {
	if m.mode == mcpUndecided {
		m.WriteHeader(http.StatusOK)
	}
	switch m.mode {
	case mcpSSE:
		return m.writeEvents(p)
	case mcpJSON, mcpRefused:
		m.buf.Write(p)
		if m.mode == mcpJSON && m.length >= 0 && int64(m.buf.Len()) >= m.length {
			// Whole: written out now, before the gate marks the payment served.
			if err := m.flushJSON(); err != nil {
				return len(p), err
			}
		}
		return len(p), nil
	}
	return m.w.Write(p)
}

// Flush sends what is rewritten already; a JSON answer waits until it is whole.
func (m *mcpWriter) Flush() {
	if m.mode == mcpJSON || m.mode == mcpRefused {
		return
	}
	_ = http.NewResponseController(m.w).Flush()
}

// FlushError is Flush with its error, for http.ResponseController.
func (m *mcpWriter) FlushError() error {
	if m.mode == mcpJSON || m.mode == mcpRefused {
		return nil
	}
	return http.NewResponseController(m.w).Flush()
}

// writeEvents passes an SSE stream on event by event, rewriting the one that answers the call.
func (m *mcpWriter) writeEvents(p []byte) (int, error) {
	m.buf.Write(p)
	for {
		end, sep := eventEnd(m.buf.Bytes())
		if end < 0 {
			return len(p), nil
		}
		data := m.buf.Bytes()
		event := m.rewriteEvent(data[:end])
		m.buf.Next(end + sep)
		if _, err := m.w.Write(append(event, '\n', '\n')); err != nil {
			return len(p), err
		}
	}
}

// eventEnd is where the first event of an SSE stream ends, and the length of the blank line that ends it; -1
// when the stream holds no whole event.
func eventEnd(stream []byte) (end, sep int) {
	end, sep = bytes.Index(stream, []byte("\n\n")), 2
	if i := bytes.Index(stream, []byte("\r\n\r\n")); i >= 0 && (end < 0 || i < end) {
		end, sep = i, 4
	}
	return end, sep
}

// rewriteStream rewrites a whole SSE stream event by event.
func (m *mcpWriter) rewriteStream(stream []byte) []byte {
	var out bytes.Buffer
	for len(stream) > 0 {
		end, sep := eventEnd(stream)
		if end < 0 {
			out.Write(stream)
			break
		}
		out.Write(m.rewriteEvent(stream[:end]))
		out.WriteString("\n\n")
		stream = stream[end+sep:]
	}
	return out.Bytes()
}

// rewriteEvent rewrites the data of one SSE event when it is the response to the call.
func (m *mcpWriter) rewriteEvent(event []byte) []byte {
	var lines, data []string
	sc := bufio.NewScanner(bytes.NewReader(event))
	sc.Buffer(make([]byte, 0, 64<<10), len(event)+1)
	for sc.Scan() {
		line := strings.TrimSuffix(sc.Text(), "\r")
		if v, ok := strings.CutPrefix(line, "data:"); ok {
			data = append(data, strings.TrimPrefix(v, " "))
			continue
		}
		lines = append(lines, line)
	}
	if len(data) == 0 {
		return event
	}
	doc, changed := m.rewrite([]byte(strings.Join(data, "\n")))
	if !changed {
		return event
	}
	return []byte(strings.Join(append(lines, "data: "+string(doc)), "\n"))
}

// flushJSON writes a whole answer held back (JSON, or an event stream of known length) out, rewritten.
func (m *mcpWriter) flushJSON() error {
	if m.done {
		return nil
	}
	m.done = true
	var body []byte
	if m.sse {
		body = m.rewriteStream(m.buf.Bytes())
	} else {
		body, _ = m.rewrite(m.buf.Bytes())
	}
	m.w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	m.w.WriteHeader(m.status)
	_, err := m.w.Write(body)
	if err == nil {
		err = http.NewResponseController(m.w).Flush()
		if errors.Is(err, http.ErrNotSupported) {
			err = nil
		}
	}
	return err
}

// rewrite rewrites the JSON-RPC response (or batch of responses) doc to the call; changed says whether it did.
func (m *mcpWriter) rewrite(doc []byte) ([]byte, bool) {
	var one map[string]jsontext.Value
	if err := json.Unmarshal(doc, &one); err == nil {
		if !m.edit(one) {
			return doc, false
		}
		out, err := json.Marshal(one)
		return out, err == nil
	}
	var many []map[string]jsontext.Value
	if err := json.Unmarshal(doc, &many); err != nil {
		return doc, false
	}
	changed := false
	for _, msg := range many {
		changed = m.edit(msg) || changed
	}
	if !changed {
		return doc, false
	}
	out, err := json.Marshal(many)
	return out, err == nil
}

// edit rewrites msg when it is the result of the call.
func (m *mcpWriter) edit(msg map[string]jsontext.Value) bool {
	if !sameID(msg["id"], m.id) {
		return false
	}
	var result map[string]jsontext.Value
	if json.Unmarshal(msg["result"], &result) != nil || result == nil {
		return false
	}
	if m.list != nil {
		if !m.priceTools(result) {
			return false
		}
	} else {
		if m.settled == nil {
			return false
		}
		setMeta(result, x402.MCPMetaPaymentResponse, m.settled)
	}
	b, err := json.Marshal(result)
	if err != nil {
		return false
	}
	msg["result"] = b
	return true
}

// priceTools adds the price of each priced tool of a tools/list result to the tool's _meta.
func (m *mcpWriter) priceTools(result map[string]jsontext.Value) bool {
	var tools []map[string]jsontext.Value
	if json.Unmarshal(result["tools"], &tools) != nil {
		return false
	}
	changed := false
	for _, tool := range tools {
		var name string
		if json.Unmarshal(tool["name"], &name) != nil {
			continue
		}
		if price := m.list(name); price != "" {
			b, _ := json.Marshal(price)
			setMeta(tool, x402.MCPMetaPrice, b)
			changed = true
		}
	}
	if !changed {
		return false
	}
	b, err := json.Marshal(tools)
	if err != nil {
		return false
	}
	result["tools"] = b
	return true
}

// setMeta sets key in obj's _meta, keeping what else it holds.
func setMeta(obj map[string]jsontext.Value, key string, value jsontext.Value) {
	meta := map[string]jsontext.Value{}
	_ = json.Unmarshal(obj["_meta"], &meta)
	if meta == nil {
		meta = map[string]jsontext.Value{}
	}
	meta[key] = value
	b, _ := json.Marshal(meta)
	obj["_meta"] = b
}

// sameID reports whether two JSON-RPC ids are the same value.
func sameID(a, b jsontext.Value) bool {
	if a == nil || b == nil {
		return false
	}
	ca, cb := a.Clone(), b.Clone()
	if ca.Canonicalize() != nil || cb.Canonicalize() != nil {
		return false
	}
	return bytes.Equal(ca, cb)
}

// finish writes out what is still held once the gate returned: a JSON answer not whole by its length, or the
// gate's refusal as the tool result the transport asks for.
func (m *mcpWriter) finish() error {
	switch m.mode {
	case mcpJSON:
		return m.flushJSON()
	case mcpSSE:
		if m.buf.Len() > 0 {
			_, err := m.w.Write(m.buf.Bytes()) // an event the stream did not end: as it came
			return err
		}
	case mcpRefused:
		return m.writeRefusal()
	}
	return nil
}

// writeRefusal answers the gate's refusal of the call as a tool result with isError: the PaymentRequired it
// offers (402 and 400 answers), or the gate's own JSON (its 502, 503 and 429 answers, which say whether the
// payment may have settled), with the settlement it names. An answer of the MCP server or of the server around
// the gate (no x402 in it) passes as it is.
func (m *mcpWriter) writeRefusal() error {
	h := m.w.Header()
	var content jsontext.Value
	if v := h.Get(x402.HeaderPaymentRequired); v != "" {
		if doc, err := x402.HeaderJSON(v); err == nil {
			content = jsontext.Value(doc)
		}
	}
	if content == nil {
		var body map[string]jsontext.Value
		if json.Unmarshal(m.buf.Bytes(), &body) == nil && body["outcome"] != nil {
			content = bytes.TrimSpace(m.buf.Bytes())
		}
	}
	if content == nil {
		m.w.WriteHeader(m.status)
		_, err := m.w.Write(m.buf.Bytes())
		return err
	}
	if m.unpaid && h.Get(x402.HeaderPaymentRequired) != "" {
		// The gate's own words name its payment header; a call is paid in _meta.
		var doc map[string]jsontext.Value
		if json.Unmarshal(content, &doc) == nil {
			doc["error"], _ = json.Marshal(mcpPaymentRequiredError())
			if b, err := json.Marshal(doc); err == nil {
				content = b
			}
		}
	}
	result := paymentRequiredResult(content)
	if m.settled != nil {
		result["_meta"] = map[string]any{x402.MCPMetaPaymentResponse: m.settled}
	}
	if ra := h.Get("Retry-After"); ra != "" {
		result["content"] = append(result["content"].([]any), map[string]any{"type": "text",
			"text": fmt.Sprintf("the gate answered HTTP %d; Retry-After: %s", m.status, ra)})
	}
	return writeJSONRPC(m.w, http.StatusOK, jsonrpcResult(m.id, result))
}

// sseEvents returns the data of each event of an SSE stream, its data lines joined.
func sseEvents(stream []byte) [][]byte {
	var events [][]byte
	var data []string
	flush := func() {
		if len(data) > 0 {
			events = append(events, []byte(strings.Join(data, "\n")))
		}
		data = nil
	}
	for _, line := range strings.Split(string(stream), "\n") {
		line = strings.TrimSuffix(line, "\r")
		if line == "" {
			flush()
			continue
		}
		if v, ok := strings.CutPrefix(line, "data:"); ok {
			data = append(data, strings.TrimPrefix(v, " "))
		}
	}
	flush()
	return events
}
