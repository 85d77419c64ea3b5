package gate

import "testing"

// TestAnMCPBatchWhoseMessagesShareAnIdIsRefused: a batch whose free message shares the priced call's id is refused
// before anything runs. Read, the server's error answering the free message passed for the paid call's answer: the
// call was judged failed (not charged) while its result went out beside it, and its payment could be used again.
func TestAnMCPBatchWhoseMessagesShareAnIdIsRefused(t *testing.T) {
	for _, body := range []string{
		`[{"jsonrpc":"2.0","id":1,"method":"no/such"},{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"dear","_meta":{"x402/payment":{"x":1}}}}]`,
		`[{"jsonrpc":"2.0","id":"a","method":"tools/list"},{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"dear"}}]`,
		`[{"jsonrpc":"2.0","id":1.0,"method":"ping"},{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"dear"}}]`,
	} {
		if _, _, err := parseMCPBody([]byte(body)); err == nil {
			t.Errorf("the batch %s was read; want it refused, its ids shared", body)
		}
	}
	// Notifications (no id) and distinct ids are a batch as before.
	if msgs, batch, err := parseMCPBody([]byte(`[{"jsonrpc":"2.0","method":"notifications/initialized"},{"jsonrpc":"2.0","method":"notifications/x"},{"jsonrpc":"2.0","id":1,"method":"ping"},{"jsonrpc":"2.0","id":2,"method":"tools/list"}]`)); err != nil || !batch || len(msgs) != 4 {
		t.Errorf("a batch of two notifications and two ids = %d messages, %v, %v; want 4 read", len(msgs), batch, err)
	}
}
