package gate

import (
	"bytes"
	"net/http"
	"strconv"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// headerMCPToolFailed marks, between mcpUpstream and mcpWriter, an answer of the MCP server whose status was raised
// because the paid call failed: its value is the status the server gave, which the client gets back.
const headerMCPToolFailed = "X-X402-Mcp-Tool-Failed"

// mcpToolFailedStatus is what the gate sees of an MCP answer whose paid call failed: an upstream error, which
// settle after and settle async do not charge.
const mcpToolFailedStatus = http.StatusUnprocessableEntity

// mcpUpstream holds back the MCP server's answer to a paid call until it is whole, to tell the gate whether the
// call succeeded: a tool result with isError, or a JSON-RPC error, is an error the payer does not pay for (as the
// x402 MCP server SDK does not settle it), so the gate sees it as an upstream error (mcpToolFailedStatus) and
// passes it on unpaid. An answer larger than limit is passed on as it is, and judged by its status only.
type mcpUpstream struct {
	w     http.ResponseWriter
	id    jsontext.Value
	limit int64

	status  int
	buf     bytes.Buffer
	passing bool
}

func (u *mcpUpstream) Header() http.Header { return u.w.Header() }

// Unwrap gives http.ResponseController the writer underneath.
func (u *mcpUpstream) Unwrap() http.ResponseWriter { return u.w }

func (u *mcpUpstream) WriteHeader(status int) {
	switch {
	case u.passing || u.status != 0:
	case status < http.StatusOK:
		u.w.WriteHeader(status)
	case status >= http.StatusMultipleChoices:
		u.passing = true // an error already: the gate charges nothing for it
		u.w.WriteHeader(status)
	default:
		u.status = status
	}
}

func (u *mcpUpstream) Write(p []byte) (int, error) {
	if u.status == 0 && !u.passing {
		u.WriteHeader(http.StatusOK)
	}
	if u.passing {
		return u.w.Write(p)
	}
	if int64(u.buf.Len()+len(p)) > u.limit {
		u.passing = true
		u.w.WriteHeader(u.status)
		if _, err := u.w.Write(u.buf.Bytes()); err != nil {
			return 0, err
		}
		u.buf.Reset()
		return u.w.Write(p)
	}
	return u.buf.Write(p)
}

// FlushError holds the answer back until it is whole; one passed on as it is flushes.
func (u *mcpUpstream) FlushError() error {
	if !u.passing {
		return nil
	}
	return http.NewResponseController(u.w).Flush()
}

// finish passes the whole answer on, its status raised when the paid call failed.
func (u *mcpUpstream) finish() error {
	if u.passing || u.status == 0 {
		return nil
	}
	status := u.status
	if u.callFailed() {
		u.w.Header().Set(headerMCPToolFailed, strconv.Itoa(status))
		status = mcpToolFailedStatus
	}
	u.w.WriteHeader(status)
	_, err := u.w.Write(u.buf.Bytes())
	return err
}

// callFailed reports whether the held answer (JSON, or an SSE stream) answers the call with a JSON-RPC error or
// a tool result with isError.
func (u *mcpUpstream) callFailed() bool {
	failed := false
	check := func(doc []byte) {
		var one map[string]jsontext.Value
		var many []map[string]jsontext.Value
		if json.Unmarshal(doc, &one) == nil {
			many = []map[string]jsontext.Value{one}
		} else if json.Unmarshal(doc, &many) != nil {
			return
		}
		for _, msg := range many {
			if !sameID(msg["id"], u.id) {
				continue
			}
			var result struct {
				IsError bool `json:"isError"`
			}
			_ = json.Unmarshal(msg["result"], &result, json.RejectUnknownMembers(false))
			if msg["error"] != nil || result.IsError {
				failed = true
			}
		}
	}
	body := u.buf.Bytes()
	if media := u.w.Header().Get("Content-Type"); bytes.HasPrefix([]byte(media), []byte("text/event-stream")) {
		for _, event := range sseEvents(body) {
			check(event)
		}
	} else {
		check(body)
	}
	return failed
}
