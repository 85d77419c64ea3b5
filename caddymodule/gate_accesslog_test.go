package caddymodule_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment header is a bearer value: the access log of a paid site never holds one (PAYMENT-SIGNATURE or
// X-PAYMENT, valid or not), while every request still has its entry, in Caddy's shape with its log_append fields, and a paid one says
// who paid what and by which transaction. PAYMENT-RESPONSE, the answer's receipt, may be logged: it buys
// nothing.
func TestAPaidSitesAccessLogHoldsNoPaymentHeader(t *testing.T) {
	env := newGateEnv(t, gateSetup{site: `log {
		output file {{DATA}}/access.log
	}
	log_append marker "x402-log-test"
	respond "paid content"`})
	logPath := filepath.Join(env.srv.dir, "access.log")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	paid := env.permit2Header("/", payer)
	other := env.permit2Header("/", payer) // signed and never accepted here: presentable elsewhere
	requests := []struct {
		name, header, value string
		status              int
	}{
		{"unpaid", "", "", http.StatusPaymentRequired},
		{"paid", x402.HeaderPaymentSignature, paid, http.StatusOK},
		{"paid again", x402.HeaderPaymentSignature, paid, http.StatusPaymentRequired},
		{"version 1 header", x402.HeaderXPayment, other, http.StatusOK},
	}
	for _, rq := range requests {
		var headers []string
		if rq.header != "" {
			headers = []string{rq.header, rq.value}
		}
		if a := env.get("/", headers...); a.status != rq.status {
			t.Fatalf("%s = %d %q, want %d", rq.name, a.status, a.body, rq.status)
		}
	}

	type entry struct {
		Msg     string            `json:"msg"`
		Logger  string            `json:"logger"`
		Status  int               `json:"status"`
		Marker  string            `json:"marker"`
		X402    map[string]string `json:"x402"`
		Request struct {
			Headers map[string][]string `json:"headers"`
		} `json:"request"`
		RespHeaders map[string][]string `json:"resp_headers"`
	}
	var entries []entry
	var raw []byte
	deadline := time.Now().Add(5 * time.Second)
	for {
		raw, _ = os.ReadFile(logPath)
		entries = entries[:0]
		sc := bufio.NewScanner(bytes.NewReader(raw))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var e entry
			if json.Unmarshal(sc.Bytes(), &e) == nil && e.Msg == "handled request" {
				entries = append(entries, e)
			}
		}
		if len(entries) >= len(requests)+2 || time.Now().After(deadline) { // +2: the 402s permit2Header asked for
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, v := range []string{paid, other} {
		if bytes.Contains(raw, []byte(v)) || bytes.Contains(raw, []byte(v[:64])) {
			t.Fatalf("the access log holds a payment header's value:\n%.2000s", raw)
		}
	}
	if len(entries) != len(requests)+2 {
		t.Fatalf("the access log holds %d request entries, want %d (one per request):\n%.3000s", len(entries), len(requests)+2, raw)
	}
	// An entry the gate writes is written once its request has ended, as Caddy's is: entries of requests in a row
	// may land a moment out of order, so each is found by what it logs.
	find := func(header string, status int) (entry, bool) {
		for _, e := range entries {
			if e.Status != status {
				continue
			}
			if (header == "" && len(e.Request.Headers[http.CanonicalHeaderKey(x402.HeaderPaymentSignature)]) == 0 && len(e.Request.Headers[http.CanonicalHeaderKey(x402.HeaderXPayment)]) == 0) ||
				(header != "" && len(e.Request.Headers[http.CanonicalHeaderKey(header)]) > 0) {
				return e, true
			}
		}
		return entry{}, false
	}
	if e, ok := find("", http.StatusPaymentRequired); !ok || e.Marker != "x402-log-test" {
		t.Errorf("the unpaid request's entry = %+v (found %v), want Caddy's own, with its log_append field", e, ok)
	}
	var paidEntry entry
	for _, rq := range requests[1:] {
		e, ok := find(rq.header, rq.status)
		if !ok || !strings.HasPrefix(e.Logger, "http.log.access") || strings.Join(e.Request.Headers[http.CanonicalHeaderKey(rq.header)], ",") != "REDACTED" ||
			e.Marker != "x402-log-test" {
			t.Errorf("%s: entry %+v (found %v), want status %d by Caddy's access logger with %s REDACTED and the log_append field", rq.name, e, ok, rq.status, rq.header)
		}
		if rq.name == "paid" {
			paidEntry = e
		}
	}
	if e := paidEntry; e.X402["payer"] != payer.Address.Hex() || e.X402["amount"] != strconv.Itoa(gatePrice) ||
		e.X402["status"] != string(x402.OutcomeSettled) || e.X402["transaction"] == "" || len(e.RespHeaders[http.CanonicalHeaderKey(x402.HeaderPaymentResponse)]) != 1 {
		t.Errorf("the paid request's entry says of its payment %v and answers %v; want who paid what, by which transaction, and PAYMENT-RESPONSE",
			e.X402, e.RespHeaders)
	}
}
