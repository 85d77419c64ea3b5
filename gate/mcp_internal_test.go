package gate

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-json-experiment/json/jsontext"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A body naming a member twice, anywhere, is refused: the gate and the MCP server must not read two tool names,
// ids or payments out of one message.
func TestAnMCPBodyNamingAMemberTwiceIsRefused(t *testing.T) {
	for _, body := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","name":"search"}}`,
		`{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/call","params":{"name":"search"}}`,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","_meta":{"x402/payment":{},"x402/payment":{}}}}`,
		`[{"jsonrpc":"2.0","id":1,"method":"tools/call","method":"initialize","params":{"name":"search"}}]`,
	} {
		if _, _, err := parseMCPBody([]byte(body)); err == nil {
			t.Errorf("%s was read", body)
		}
	}
	msgs, batch, err := parseMCPBody([]byte(`[{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"se\u0061rch","_meta":{"x402/payment":{"x402Version":2}}}}]`))
	if err != nil || !batch || msgs[0].tool != "search" || msgs[0].payment == nil {
		t.Fatalf("a batch of one escaped name = %+v, %v, %v", msgs, batch, err)
	}
}

// The SSE event answering the call's id gains the settlement; every other event, and the event's other fields,
// pass as they came, whatever the stream's line endings and however it is cut into writes.
func TestTheSSEEventAnsweringThePaidCallGainsTheSettlement(t *testing.T) {
	stream := "event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\r\n\r\n" +
		"event: message\nid: 7\ndata: {\"jsonrpc\":\"2.0\",\"id\":\"c1\",\n" +
		"data: \"result\":{\"content\":[]}}\n\n"
	for _, cut := range []int{1, 7, len(stream)} {
		rec := httptest.NewRecorder()
		rec.Header().Set("Content-Type", "text/event-stream")
		settled, _ := x402.EncodeHeader(x402.SettleResponse{Success: true, Transaction: "0xabc", Network: "eip155:1"})
		rec.Header().Set(x402.HeaderPaymentResponse, settled)
		m := &mcpWriter{w: rec, id: jsontext.Value(`"c1"`)}
		m.WriteHeader(http.StatusOK)
		for i := 0; i < len(stream); i += cut {
			_, _ = m.Write([]byte(stream[i:min(i+cut, len(stream))]))
		}
		if err := m.finish(); err != nil {
			t.Fatal(err)
		}
		events := sseEvents(rec.Body.Bytes())
		if len(events) != 2 || !strings.Contains(string(events[0]), "notifications/progress") ||
			!strings.Contains(string(events[1]), `"x402/payment-response":{"success":true,"transaction":"0xabc"`) {
			t.Fatalf("cut %d: the stream became %q", cut, rec.Body.String())
		}
		if !strings.Contains(rec.Body.String(), "id: 7\n") {
			t.Fatalf("cut %d: the event lost its id: %q", cut, rec.Body.String())
		}
	}
}

// JSON-RPC ids are compared as JSON values (RFC 8785's canonical form): the string "1" is not the number 1, an
// escaped string is the string, and a number written with an exponent is its value.
func TestMCPIdsAreComparedAsJSONValues(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		same bool
	}{{`1`, `1`, true}, {`"1"`, `1`, false}, {`"a"`, `"\u0061"`, true}, {`10`, `1e1`, true}, {`1`, `2`, false}} {
		if got := sameID(jsontext.Value(tc.a), jsontext.Value(tc.b)); got != tc.same {
			t.Errorf("sameID(%s, %s) = %v, want %v", tc.a, tc.b, got, tc.same)
		}
	}
}
