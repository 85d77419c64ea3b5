package facilitatorclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestNewAcceptsHTTPBaseURLsAndRefusesOthers(t *testing.T) {
	tests := []struct {
		in      string
		want    string // base URL, or "" when New must fail
		errText string
	}{
		{in: "http://127.0.0.1:8080", want: "http://127.0.0.1:8080"},
		{in: "https://facilitator.example.com/x402/", want: "https://facilitator.example.com/x402"},
		{in: "https://facilitator.example.com/", want: "https://facilitator.example.com"},
		{in: "ftp://facilitator.example.com", errText: `expected scheme http or https, got "ftp"`},
		{in: "facilitator.example.com", errText: "expected scheme http or https"},
		{in: "http://", errText: "expected a host"},
		{in: "https://facilitator.example.com/x402?network=main", errText: "must not have a query"},
		{in: "https://facilitator.example.com/x402#top", errText: "must not have a fragment"},
		{in: "https://user:hunter2@facilitator.example.com", errText: "must not carry credentials"},
		{in: "http://[::1", errText: "expected an http:// or https:// URL"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			c, err := New(tt.in)
			if tt.want != "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				if c.BaseURL() != tt.want {
					t.Fatalf("base URL = %q, want %q", c.BaseURL(), tt.want)
				}
				return
			}
			if err == nil {
				t.Fatalf("New(%q) succeeded, want an error containing %q", tt.in, tt.errText)
			}
			if !strings.Contains(err.Error(), tt.errText) {
				t.Fatalf("error %q does not say %q", err, tt.errText)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("error %q repeats the password of the URL", err)
			}
		})
	}
}

func TestNewRefusesOptionsOutOfRange(t *testing.T) {
	tests := []struct {
		name string
		opt  Option
	}{
		{"negative verify timeout", WithTimeouts(Timeouts{Verify: -time.Second})},
		{"too many retries", WithRetries(MaxRetries+1, time.Millisecond)},
		{"negative backoff", WithRetries(1, -time.Millisecond)},
		{"too many settle resends", WithSettleResends(MaxSettleResends + 1)},
		{"negative settle resends", WithSettleResends(-1)},
		{"negative TTL", WithSupportedTTL(-time.Second)},
		{"zero response cap", WithMaxResponseBytes(0)},
		{"nil HTTP client", WithHTTPClient(nil)},
		{"nil clock", WithClock(nil)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := New("http://127.0.0.1:1", tt.opt); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
}

func TestRequestsGoToTheEndpointsUnderTheBasePath(t *testing.T) {
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.prefix = "/x402" })
	c := mustClient(t, f.URL()+"/x402/")
	ctx := context.Background()
	if _, err := c.Supported(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Verify(ctx, permit2Request(mainnet)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Settle(ctx, permit2Request(mainnet)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{"GET /x402/supported", "POST /x402/verify", "POST /x402/settle", "GET /x402/health"}
	f.mu.Lock()
	paths := append([]string(nil), f.paths...)
	f.mu.Unlock()
	if fmt.Sprint(paths) != fmt.Sprint(want) {
		t.Fatalf("paths = %v, want %v", paths, want)
	}
}

func TestVerifySendsTheRequestAndDecodesTheAnswer(t *testing.T) {
	var got x402.VerifyRequest
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.verify = func(w http.ResponseWriter, r *http.Request, body []byte) {
			if r.Header.Get("Content-Type") != "application/json" {
				writeRaw(w, http.StatusUnsupportedMediaType, `{"error":"expected application/json"}`)
				return
			}
			_ = json.Unmarshal(body, &got)
			writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: got.PaymentPayload.Payload.Permit2Authorization.From})
		}
	})
	req := permit2Request(mainnet)
	resp, err := mustClient(t, f.URL()).Verify(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if !resp.IsValid || resp.Payer != payer {
		t.Fatalf("answer = %+v, want valid from %s", resp, payer)
	}
	if !bytes.Equal(mustJSON(t, got), mustJSON(t, req)) {
		t.Fatalf("facilitator received\n%s\nwant\n%s", mustJSON(t, got), mustJSON(t, req))
	}
}

// statusRow is one row of the status conventions of the facts sheet, section 7.
type statusRow struct {
	name   string
	status int
	body   string
	// wantKind is "" when the row is an answer, else the failure kind.
	wantKind x402.FailureKind
}

// checkRow asserts a call's outcome for the row and reports whether the row is an answer: then got must be the
// row's body as the client's type reads it, else err must be a FacilitatorError of the row's kind and status
// (and of op, unless op is empty).
func checkRow[T any](t *testing.T, row statusRow, op string, got T, err error) (answered bool) {
	t.Helper()
	if row.wantKind == "" {
		if err != nil {
			t.Fatalf("want an answer, got error %v", err)
		}
		var want T
		_ = json.Unmarshal([]byte(row.body), &want)
		if !bytes.Equal(mustJSON(t, got), mustJSON(t, want)) {
			t.Fatalf("answer = %s, want %s", mustJSON(t, got), mustJSON(t, want))
		}
		return true
	}
	fe := failureOf(t, err)
	if fe.Kind != row.wantKind || fe.Status != row.status || (op != "" && fe.Op != op) {
		t.Fatalf("error = {op %s kind %s status %d}, want {op %s kind %s status %d}: %v",
			fe.Op, fe.Kind, fe.Status, op, row.wantKind, row.status, err)
	}
	return false
}

func TestVerifyFollowsTheStatusConventions(t *testing.T) {
	rows := []statusRow{
		{"200 with a valid answer is the answer", 200, `{"isValid":true,"payer":"` + payer + `"}`, ""},
		{"200 with a refusal is the answer", 200, `{"isValid":false,"invalidReason":"insufficient_funds","invalidMessage":"balance 5 below 10000","payer":"` + payer + `"}`, ""},
		{"400 with a full refusal is the answer", 400, `{"isValid":false,"invalidReason":"permit2_deadline_expired","invalidMessage":"Permit expired","payer":"` + payer + `"}`, ""},
		{"500 with a full refusal is the answer", 500, `{"isValid":false,"invalidReason":"unexpected_verify_error","invalidMessage":"rpc down","payer":""}`, ""},
		{"400 with a bare error is rejected", 400, `{"error":"paymentPayload.accepted: required"}`, x402.FailureRejected},
		{"400 with isValid but no reason is rejected", 400, `{"isValid":false}`, x402.FailureRejected},
		{"401 is rejected", 401, `{"error":"unknown api key"}`, x402.FailureRejected},
		{"403 is rejected", 403, ``, x402.FailureRejected},
		{"413 is rejected", 413, `request entity too large`, x402.FailureRejected},
		{"404 is rejected", 404, `404 page not found`, x402.FailureRejected},
		{"429 is unreachable", 429, `slow down`, x402.FailureUnreachable},
		{"500 without a body is unreachable", 500, ``, x402.FailureUnreachable},
		{"502 with a proxy page is unreachable", 502, `<html>Bad Gateway</html>`, x402.FailureUnreachable},
		{"503 with a bare error is unreachable", 503, `{"error":"No available wallets in pool"}`, x402.FailureUnreachable},
		{"200 that is not JSON is a bad answer", 200, `<html>ok</html>`, x402.FailureBadAnswer},
		{"200 without isValid is a bad answer", 200, `{"valid":true}`, x402.FailureBadAnswer},
		{"200 with isValid of the wrong type is a bad answer", 200, `{"isValid":"yes"}`, x402.FailureBadAnswer},
		{"200 longer than the cap is a bad answer", 200, `{"isValid":true,"payer":"` + strings.Repeat("a", 2048) + `"}`, x402.FailureBadAnswer},
		{"200 valid naming another payer is a bad answer", 200, `{"isValid":true,"payer":"` + walletA + `"}`, x402.FailureBadAnswer},
		{"200 valid naming no payer is the answer", 200, `{"isValid":true,"payer":""}`, ""},
		{"200 valid naming the payer in another case is the answer", 200, `{"isValid":true,"payer":"` + strings.ToLower(payer) + `"}`, ""},
		{"200 refusal naming another payer is the answer", 200, `{"isValid":false,"invalidReason":"invalid_permit2_signature","payer":"` + walletA + `"}`, ""},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, row.status, row.body) }
			})
			c := mustClient(t, f.URL(), WithMaxResponseBytes(1024))
			resp, err := c.Verify(context.Background(), permit2Request(mainnet))
			if checkRow(t, row, "verify", resp, err) {
				return
			}
			if n := f.verifyCalls.Load(); n != 1 {
				t.Fatalf("facilitator was asked %d times, want 1: a response is never retried", n)
			}
		})
	}
}

func TestSettleFollowsTheStatusConventions(t *testing.T) {
	rows := []statusRow{
		{"200 with a settlement is the answer", 200, `{"success":true,"transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + payer + `"}`, ""},
		{"200 with a failure is the answer", 200, `{"success":false,"errorReason":"insufficient_funds","errorMessage":"balance below 10000","transaction":"","network":"` + mainnet + `","payer":"` + payer + `"}`, ""},
		{"400 with a full failure is the answer", 400, `{"success":false,"errorReason":"invalid_exact_evm_nonce_already_used","transaction":"","network":"` + mainnet + `","payer":"` + payer + `"}`, ""},
		{"500 with a pending settlement is the answer", 500, `{"success":false,"errorReason":"settlement_pending","transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + payer + `"}`, ""},
		{"502 with a reverted transaction is the answer", 502, `{"success":false,"errorReason":"invalid_exact_evm_transaction_failed","transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + payer + `"}`, ""},
		{"400 with a bare error is rejected", 400, `{"error":"invalid JSON"}`, x402.FailureRejected},
		{"400 with success but no reason is rejected", 400, `{"success":false,"transaction":"","network":""}`, x402.FailureRejected},
		{"401 is rejected", 401, `{"error":"missing x-api-key"}`, x402.FailureRejected},
		{"403 is rejected", 403, `forbidden`, x402.FailureRejected},
		{"413 is rejected", 413, ``, x402.FailureRejected},
		{"500 without a body is unreachable", 500, ``, x402.FailureUnreachable},
		{"504 with a proxy page is unreachable", 504, `<html>Gateway Timeout</html>`, x402.FailureUnreachable},
		{"200 that is not JSON is a bad answer", 200, `OK`, x402.FailureBadAnswer},
		{"200 without success is a bad answer", 200, `{"transaction":"` + txHash + `"}`, x402.FailureBadAnswer},
		{"200 longer than the cap is a bad answer", 200, `{"success":true,"transaction":"` + strings.Repeat("f", 2048) + `"}`, x402.FailureBadAnswer},
		{"200 success naming another payer is a bad answer", 200, `{"success":true,"transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + walletA + `"}`, x402.FailureBadAnswer},
		{"200 success on another network is a bad answer", 200, `{"success":true,"transaction":"` + txHash + `","network":"` + testnet + `","payer":"` + payer + `"}`, x402.FailureBadAnswer},
		{"200 success for another amount is a bad answer", 200, `{"success":true,"transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + payer + `","amount":"10001"}`, x402.FailureBadAnswer},
		{"200 success without a transaction is a bad answer", 200, `{"success":true,"transaction":"","network":"` + mainnet + `","payer":"` + payer + `"}`, x402.FailureBadAnswer},
		{"200 success for the amount is the answer", 200, `{"success":true,"transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + payer + `","amount":"10000"}`, ""},
		{"200 failure naming another payer is the answer", 200, `{"success":false,"errorReason":"insufficient_funds","transaction":"","network":"` + mainnet + `","payer":"` + walletA + `"}`, ""},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, row.status, row.body) }
			})
			c := mustClient(t, f.URL(), WithMaxResponseBytes(1024))
			res, err := c.SettleDetailed(context.Background(), permit2Request(mainnet))
			if res.Attempts != 1 || res.Resent {
				t.Fatalf("attempts = %d resent = %v, want 1 attempt and no resend", res.Attempts, res.Resent)
			}
			if n := f.settleCalls.Load(); n != 1 {
				t.Fatalf("facilitator was asked %d times, want 1: a response is never followed by a resend", n)
			}
			if checkRow(t, row, "settle", res.Response, err) {
				return
			}
			if errors.Is(err, ErrNotSent) {
				t.Fatalf("error %v claims the request was not sent, but the facilitator answered", err)
			}
		})
	}
}

func TestSupportedFollowsTheStatusConventions(t *testing.T) {
	rows := []statusRow{
		{"200 with kinds is the answer", 200, string(mustJSON(t, permit2Supported(mainnet, testnet))), ""},
		{"200 with no kinds is the answer", 200, `{"kinds":[],"extensions":[],"signers":{}}`, ""},
		{"200 without kinds is a bad answer", 200, `{"extensions":[]}`, x402.FailureBadAnswer},
		{"200 that is not JSON is a bad answer", 200, `kinds: permit2`, x402.FailureBadAnswer},
		{"401 is rejected", 401, `{"error":"unknown api key"}`, x402.FailureRejected},
		{"503 is unreachable", 503, ``, x402.FailureUnreachable},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, x402.SupportedResponse{}, func(f *fakeFacilitator) {
				f.supported = func(w http.ResponseWriter, _ *http.Request) { writeRaw(w, row.status, row.body) }
			})
			resp, err := mustClient(t, f.URL()).Supported(context.Background())
			checkRow(t, row, "", resp, err)
		})
	}
}

func TestHealthFollowsTheStatusConventions(t *testing.T) {
	rows := []statusRow{
		{"200 with a status is the answer", 200, `{"status":"ok","networks":[{"network":"eip155:723487","status":"ok","rpcReachable":true,"headBlock":812,"journalBacklog":0}]}`, ""},
		{"503 with a status is the answer", 503, `{"status":"down","networks":[{"network":"eip155:723487","status":"down","rpcReachable":false,"journalBacklog":3,"error":"dial tcp: refused"}]}`, ""},
		{"200 without a status is a bad answer", 200, `{}`, x402.FailureBadAnswer},
		{"404 is rejected", 404, `404 page not found`, x402.FailureRejected},
		{"502 without a body is unreachable", 502, ``, x402.FailureUnreachable},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, x402.SupportedResponse{}, func(f *fakeFacilitator) {
				f.health = func(w http.ResponseWriter, _ *http.Request) { writeRaw(w, row.status, row.body) }
			})
			resp, err := mustClient(t, f.URL()).Health(context.Background())
			checkRow(t, row, "", resp, err)
		})
	}
}

func TestAPIKeyIsSentOnEveryCallAndNeverPrinted(t *testing.T) {
	// The facilitator echoes the key back in its refusal, as careless ones do.
	echo := func(w http.ResponseWriter, r *http.Request) {
		writeRaw(w, http.StatusUnauthorized, `{"error":"api key `+r.Header.Get("x-api-key")+` is not enabled for settle"}`)
	}
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.settle = func(w http.ResponseWriter, r *http.Request, _ []byte) { echo(w, r) }
		f.verify = func(w http.ResponseWriter, r *http.Request, _ []byte) {
			writeRaw(w, http.StatusInternalServerError, "panic: key="+r.Header.Get("x-api-key"))
		}
	})
	c := mustClient(t, f.URL(), WithAPIKey(apiKeyForTest), WithRetries(0, 0))
	ctx := context.Background()
	if _, err := c.Supported(ctx); err != nil {
		t.Fatal(err)
	}
	_, verifyErr := c.Verify(ctx, permit2Request(mainnet))
	_, settleErr := c.Settle(ctx, permit2Request(mainnet))
	for _, err := range []error{verifyErr, settleErr} {
		if err == nil {
			t.Fatal("want an error from the refusing facilitator")
		}
		if strings.Contains(err.Error(), apiKeyForTest) || strings.Contains(err.Error(), apiKeyForTest[:12]) {
			t.Fatalf("error text contains the API key: %v", err)
		}
		if !strings.Contains(err.Error(), "[redacted]") {
			t.Fatalf("error %q should still show the facilitator's words with the key blanked out", err)
		}
	}
	if !strings.Contains(settleErr.Error(), "check the API key") {
		t.Fatalf("a 401 should tell the operator what to check, got %v", settleErr)
	}
	f.mu.Lock()
	keys := append([]string(nil), f.apiKeys...)
	f.mu.Unlock()
	if len(keys) != 3 {
		t.Fatalf("facilitator saw %d requests, want 3", len(keys))
	}
	for i, k := range keys {
		if k != apiKeyForTest {
			t.Fatalf("request %d carried x-api-key %q, want the configured key", i, k)
		}
	}
	for _, format := range []string{"%v", "%+v", "%#v", "%s"} {
		if s := fmt.Sprintf(format, c); strings.Contains(s, apiKeyForTest) {
			t.Fatalf("fmt %s of the client prints the key: %s", format, s)
		}
	}
	if s := fmt.Sprintf("%v %#v", c.apiKey, c.apiKey); strings.Contains(s, apiKeyForTest) {
		t.Fatalf("printing the stored key shows it: %s", s)
	}
}

func TestVerifyIsRetriedWhenTheFacilitatorDropsTheConnection(t *testing.T) {
	var calls atomic.Int64
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			if calls.Add(1) == 1 {
				dropConnection(w)
				return
			}
			writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: payer})
		}
	})
	resp, err := mustClient(t, f.URL()).Verify(context.Background(), permit2Request(mainnet))
	if err != nil {
		t.Fatalf("want the retry to get the answer, got %v", err)
	}
	if !resp.IsValid {
		t.Fatalf("answer = %+v, want valid", resp)
	}
	if n := calls.Load(); n != 2 {
		t.Fatalf("facilitator was asked %d times, want 2", n)
	}
}

func TestVerifyGivesUpAfterItsRetriesAsUnreachable(t *testing.T) {
	for _, retries := range []int{0, 1, 3} {
		t.Run(fmt.Sprintf("%d retries", retries), func(t *testing.T) {
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) { dropConnection(w) }
			})
			_, err := mustClient(t, f.URL(), WithRetries(retries, time.Millisecond)).Verify(context.Background(), permit2Request(mainnet))
			fe := failureOf(t, err)
			if fe.Kind != x402.FailureUnreachable || fe.Status != 0 {
				t.Fatalf("error = {kind %s status %d}, want unreachable without status: %v", fe.Kind, fe.Status, err)
			}
			if want := int64(retries + 1); f.verifyCalls.Load() != want {
				t.Fatalf("facilitator was asked %d times, want %d", f.verifyCalls.Load(), want)
			}
			if errors.Is(err, ErrNotSent) {
				t.Fatalf("the facilitator read the requests, yet the error says not sent: %v", err)
			}
		})
	}
}

func TestSettleIsNeverResentAfterAResponse(t *testing.T) {
	rows := []struct {
		name     string
		answer   func(w http.ResponseWriter)
		wantKind x402.FailureKind
	}{
		{"500 without a body", func(w http.ResponseWriter) { writeRaw(w, 500, "") }, x402.FailureUnreachable},
		{"502 from a proxy", func(w http.ResponseWriter) { writeRaw(w, 502, "<html>bad gateway</html>") }, x402.FailureUnreachable},
		{"200 with garbage", func(w http.ResponseWriter) { writeRaw(w, 200, "{\"succ") }, x402.FailureBadAnswer},
		{"401", func(w http.ResponseWriter) { writeRaw(w, 401, `{"error":"unauthorised"}`) }, x402.FailureRejected},
		{"a 200 whose body breaks off", func(w http.ResponseWriter) {
			conn, buf, err := w.(http.Hijacker).Hijack()
			if err != nil {
				return
			}
			_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n{\"success\":true,\"transa")
			_ = buf.Flush()
			_ = conn.Close()
		}, x402.FailureUnreachable},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) { row.answer(w) }
			})
			c := mustClient(t, f.URL(), WithSettleResends(MaxSettleResends))
			res, err := c.SettleDetailed(context.Background(), permit2Request(mainnet))
			fe := failureOf(t, err)
			if fe.Kind != row.wantKind {
				t.Fatalf("kind = %s, want %s: %v", fe.Kind, row.wantKind, err)
			}
			if n := f.settleCalls.Load(); n != 1 {
				t.Fatalf("facilitator was sent /settle %d times, want exactly 1", n)
			}
			if res.Attempts != 1 || res.Resent {
				t.Fatalf("result says attempts %d resent %v, want 1 and false", res.Attempts, res.Resent)
			}
		})
	}
}

// A /settle that may have reached the facilitator (its connection broke after the body was written, or no answer
// came in time) is never sent again: a facilitator without a journal would answer the repeat of a settlement it
// made with "nonce already used", a refusal of a payment that settled. The outcome is unknown (unreachable, not
// "not sent"), and the caller tells the payer to present the payment again, never to pay again.
func TestSettleIsNeverSentAgainOnceItMayHaveReachedTheFacilitator(t *testing.T) {
	rows := []struct {
		name  string
		first func(w http.ResponseWriter, r *http.Request)
	}{
		{"connection dropped after the body was read", func(w http.ResponseWriter, _ *http.Request) { dropConnection(w) }},
		{"no headers within the settle timeout", func(_ http.ResponseWriter, r *http.Request) { waitForClient(r) }},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			var calls atomic.Int64
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.settle = func(w http.ResponseWriter, r *http.Request, _ []byte) {
					if calls.Add(1) == 1 {
						row.first(w, r)
						return
					}
					// What a facilitator without a journal answers a repeat of a settlement it made.
					writeJSON(w, http.StatusOK, x402.SettleResponse{Success: false, Network: mainnet, Payer: payer,
						ErrorReason: x402.ReasonPermit2InvalidNonce, ErrorMessage: "nonce already used"})
				}
			})
			c := mustClient(t, f.URL(), WithTimeouts(Timeouts{Settle: 200 * time.Millisecond}), WithSettleResends(MaxSettleResends))
			res, err := c.SettleDetailed(context.Background(), permit2Request(mainnet))
			fe := failureOf(t, err)
			if fe.Kind != x402.FailureUnreachable || errors.Is(err, ErrNotSent) {
				t.Fatalf("error %v (kind %s); want unreachable, and not 'not sent'", err, fe.Kind)
			}
			if res.Response.ErrorReason != "" || res.Attempts != 1 || res.Resent {
				t.Fatalf("result %+v; want no answer, 1 attempt, no resend", res)
			}
			if n := len(f.settled()); n != 1 {
				t.Fatalf("facilitator received %d /settle bodies, want 1", n)
			}
		})
	}
}

// A /settle that surely never left (the connection was refused) is sent again, up to the configured count.
func TestSettleResendsOfWhatNeverLeftStopAtTheConfiguredCount(t *testing.T) {
	url := closedURL(t)
	for _, resends := range []int{0, 1, 2} {
		t.Run(fmt.Sprintf("%d resends", resends), func(t *testing.T) {
			opts := []Option{WithSettleResends(resends), WithRetries(0, time.Millisecond)}
			res, err := mustClient(t, url, opts...).SettleDetailed(context.Background(), permit2Request(mainnet))
			fe := failureOf(t, err)
			if fe.Kind != x402.FailureUnreachable || !errors.Is(err, ErrNotSent) {
				t.Fatalf("error %v (kind %s); want unreachable and not sent", err, fe.Kind)
			}
			if want := resends + 1; res.Attempts != want {
				t.Fatalf("result says %d attempts, want %d", res.Attempts, want)
			}
			if res.Resent {
				t.Fatal("result says resent, but nothing ever reached the facilitator")
			}
		})
	}
}

func TestSettleToAClosedPortSaysTheRequestWasNotSent(t *testing.T) {
	res, err := mustClient(t, closedURL(t)).SettleDetailed(context.Background(), permit2Request(mainnet))
	fe := failureOf(t, err)
	if fe.Kind != x402.FailureUnreachable {
		t.Fatalf("kind = %s, want unreachable: %v", fe.Kind, err)
	}
	if !errors.Is(err, ErrNotSent) {
		t.Fatalf("a refused connection sends nothing, want ErrNotSent in %v", err)
	}
	if res.Resent {
		t.Fatal("result says resent, but nothing ever reached the facilitator")
	}
}

func TestCancelledContextEndsTheCallAsUnreachable(t *testing.T) {
	calls := []struct {
		name string
		call func(ctx context.Context, c *Client) error
	}{
		{"verify", func(ctx context.Context, c *Client) error {
			_, err := c.Verify(ctx, permit2Request(mainnet))
			return err
		}},
		{"settle", func(ctx context.Context, c *Client) error {
			_, err := c.Settle(ctx, permit2Request(mainnet))
			return err
		}},
		{"supported", func(ctx context.Context, c *Client) error { _, err := c.Supported(ctx); return err }},
		{"health", func(ctx context.Context, c *Client) error { _, err := c.Health(ctx); return err }},
	}
	for _, tt := range calls {
		t.Run(tt.name, func(t *testing.T) {
			hang := func(w http.ResponseWriter, r *http.Request) { waitForClient(r) }
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.supported, f.health = hang, hang
				f.verify = func(w http.ResponseWriter, r *http.Request, _ []byte) { hang(w, r) }
				f.settle = f.verify
			})
			c := mustClient(t, f.URL())
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(50*time.Millisecond, cancel)
			start := time.Now()
			err := tt.call(ctx, c)
			if elapsed := time.Since(start); elapsed > 2*time.Second {
				t.Fatalf("call returned %s after cancellation, want promptly", elapsed)
			}
			fe := failureOf(t, err)
			if fe.Kind != x402.FailureUnreachable || fe.Op != tt.name {
				t.Fatalf("error = {op %s kind %s}, want {op %s kind unreachable}: %v", fe.Op, fe.Kind, tt.name, err)
			}
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("want the error to wrap context.Canceled, got %v", err)
			}
		})
	}
}

func TestSlowFacilitatorTimesOutAsUnreachable(t *testing.T) {
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.verify = func(_ http.ResponseWriter, r *http.Request, _ []byte) { waitForClient(r) }
	})
	c := mustClient(t, f.URL(), WithTimeouts(Timeouts{Verify: 100 * time.Millisecond}), WithRetries(1, time.Millisecond))
	start := time.Now()
	_, err := c.Verify(context.Background(), permit2Request(mainnet))
	elapsed := time.Since(start)
	fe := failureOf(t, err)
	if fe.Kind != x402.FailureUnreachable {
		t.Fatalf("kind = %s, want unreachable: %v", fe.Kind, err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the error to wrap context.DeadlineExceeded, got %v", err)
	}
	if !strings.Contains(err.Error(), "no answer within 100ms") {
		t.Fatalf("error %q should name the timeout that ran out", err)
	}
	if elapsed < 200*time.Millisecond || elapsed > 2*time.Second {
		t.Fatalf("two attempts of 100ms took %s", elapsed)
	}
	if n := f.verifyCalls.Load(); n != 2 {
		t.Fatalf("facilitator was asked %d times, want 2 (the timed-out attempt is retried)", n)
	}
}

func TestSupportedIsCachedForItsTTL(t *testing.T) {
	clock := newTestClock()
	f := newFakeFacilitator(t, permit2Supported(mainnet))
	c := mustClient(t, f.URL(), WithSupportedTTL(time.Minute), WithClock(clock.Now))
	ctx := context.Background()
	steps := []struct {
		advance   time.Duration
		wantCalls int64
	}{
		{0, 1},
		{30 * time.Second, 1},
		{29 * time.Second, 1},
		{time.Second, 2},
		{59 * time.Second, 2},
		{time.Second, 3},
	}
	for i, s := range steps {
		clock.Advance(s.advance)
		resp, err := c.Supported(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kinds) != 1 || resp.Kinds[0].Extra.AssetTransferMethod != x402.TransferPermit2 {
			t.Fatalf("step %d: answer = %+v", i, resp)
		}
		// A caller that scribbles on its copy must not change what the next caller gets.
		resp.Kinds[0].Network = "scribbled"
		if n := f.supportedCalls.Load(); n != s.wantCalls {
			t.Fatalf("step %d: facilitator asked %d times, want %d", i, n, s.wantCalls)
		}
	}
	resp, _ := c.Supported(ctx)
	if resp.Kinds[0].Network != mainnet {
		t.Fatalf("cached answer was modified through a returned copy: %+v", resp.Kinds[0])
	}
}

func TestSupportedFailuresAreNotCached(t *testing.T) {
	var fail atomic.Bool
	fail.Store(true)
	f := newFakeFacilitator(t, permit2Supported(mainnet), supportedDownWhile(&fail))
	c := mustClient(t, f.URL())
	if _, err := c.Supported(context.Background()); err == nil {
		t.Fatal("want the 503 as an error")
	}
	fail.Store(false)
	if _, err := c.Supported(context.Background()); err != nil {
		t.Fatalf("a direct call asks again after a failure, got %v", err)
	}
}

func TestConcurrentSupportedCallsShareOneRequest(t *testing.T) {
	release := make(chan struct{})
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.supported = func(w http.ResponseWriter, _ *http.Request) {
			<-release
			writeJSON(w, http.StatusOK, permit2Supported(mainnet))
		}
	})
	c := mustClient(t, f.URL())
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Go(func() {
			if _, err := c.Supported(context.Background()); err != nil {
				errs <- err
			}
		})
	}
	for f.supportedCalls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := f.supportedCalls.Load(); n != 1 {
		t.Fatalf("50 concurrent callers cost %d requests, want 1", n)
	}
}

func TestAbandonedSupportedCallDoesNotSpoilTheSharedFetch(t *testing.T) {
	release := make(chan struct{})
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.supported = func(w http.ResponseWriter, _ *http.Request) {
			<-release
			writeJSON(w, http.StatusOK, permit2Supported(mainnet))
		}
	})
	c := mustClient(t, f.URL())
	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { _, err := c.Supported(ctx); first <- err }()
	for f.supportedCalls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	second := make(chan error, 1)
	go func() { _, err := c.Supported(context.Background()); second <- err }()
	waitForWaiters(t, c, 2)
	cancel()
	if err := <-first; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled caller should get context.Canceled, got %v", err)
	}
	close(release)
	if err := <-second; err != nil {
		t.Fatalf("the patient caller should get the answer, got %v", err)
	}
	if n := f.supportedCalls.Load(); n != 1 {
		t.Fatalf("facilitator asked %d times, want 1", n)
	}
}

// waitForWaiters blocks until n callers wait for the client's /supported fetch in flight.
func waitForWaiters(t *testing.T, c *Client, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		c.supported.mu.Lock()
		got := 0
		if c.supported.inflight != nil {
			got = c.supported.inflight.waiters
		}
		c.supported.mu.Unlock()
		if got == n {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("%d callers never came to wait for /supported", n)
}

// errorAfterHeaders is a transport that hands back an error instead of the answer once the request was
// written, as a foreign RoundTripper might; it proves that without trace events nothing is called "not sent".
type errorAfterHeaders struct{ calls atomic.Int64 }

func (e *errorAfterHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	e.calls.Add(1)
	_, _ = io.Copy(io.Discard, r.Body)
	return nil, errors.New("connection reset by peer")
}

func TestSettleThroughAnOpaqueTransportIsNeverCalledNotSent(t *testing.T) {
	rt := &errorAfterHeaders{}
	c := mustClient(t, "http://127.0.0.1:1", WithHTTPClient(&http.Client{Transport: rt}))
	res, err := c.SettleDetailed(context.Background(), erc2612Request(mainnet, walletA))
	if errors.Is(err, ErrNotSent) {
		t.Fatalf("an opaque transport error must count as possibly delivered, got %v", err)
	}
	if rt.calls.Load() != 1 || res.Resent {
		t.Fatalf("calls = %d resent = %v, want 1 and false: what may have been delivered is not sent again", rt.calls.Load(), res.Resent)
	}
}

// A success that does not show this payment settled is an unknown outcome: an error wrapping
// x402.ErrAnswerNotThisPayment that a gate reads as "may have settled" (unreachable, never ErrNotSent), and a
// failover set does not send the payment to another member after it, for the first may have settled it.
func TestASettlementAnswerAboutAnotherPaymentIsAnUnknownOutcome(t *testing.T) {
	lie := `{"success":true,"transaction":"` + txHash + `","network":"` + mainnet + `","payer":"` + walletA + `"}`
	a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 200, lie) }
	})
	b := newFakeFacilitator(t, permit2Supported(mainnet))
	set := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
	resp, err := set.Settle(context.Background(), permit2Request(mainnet))
	if !errors.Is(err, x402.ErrAnswerNotThisPayment) || !x402.IsUnreachable(err) || errors.Is(err, ErrNotSent) || resp.Success {
		t.Fatalf("settle = %+v, %v; want an unknown outcome wrapping ErrAnswerNotThisPayment", resp, err)
	}
	if !strings.Contains(err.Error(), `names payer "`+walletA+`"`) || !strings.Contains(err.Error(), "may have settled") {
		t.Errorf("error %q does not say what the answer named, nor that the payment may have settled", err)
	}
	if got := x402.DescribeFailure(err); got != "its answer claimed success for another payment (HTTP 200)" {
		t.Errorf("DescribeFailure = %q", got)
	}
	if n := b.settleCalls.Load(); n != 0 {
		t.Errorf("the second member was asked to settle %d times after the first's answer; want never", n)
	}
}

// A 503 whose error body holds "sent": false, which an x402_facilitator gives a /settle it surely sent nothing of
// (its chain refused the transaction), makes the error x402.ErrSentNothing and ErrNotSent: presented again, the
// payment settles once, and a refusal of it then is final. Nothing else does: not "sent": true or a body without
// it, not another status (a 429 asked nothing of the facilitator behind, which an earlier call may have reached), not
// a /verify.
func TestASettleAnswerSayingNothingWasSentIsNotSent(t *testing.T) {
	rows := []struct {
		name   string
		status int
		body   string
		verify bool
		want   bool
	}{
		{"503 saying nothing was sent", 503, `{"error":"node refused the transaction; nothing was sent","sent":false}`, false, true},
		{"502 saying nothing was sent", 502, `{"error":"x","sent":false}`, false, false},
		{"429 saying nothing was sent", 429, `{"error":"over the limit; nothing was sent: retry after 3 s","sent":false}`, false, false},
		{"503 saying it was sent", 503, `{"error":"x","sent":true}`, false, false},
		{"503 without a word of it", 503, `{"error":"x"}`, false, false},
		{"503 of a proxy", 503, `<html>Service Unavailable</html>`, false, false},
		{"503 whose sent is no boolean", 503, `{"error":"x","sent":"false"}`, false, false},
		{"400 saying nothing was sent is a refusal of the request", 400, `{"error":"x","sent":false}`, false, false},
		{"a /verify's 503 saying nothing was sent", 503, `{"error":"x","sent":false}`, true, false},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
				f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, row.status, row.body) }
				f.verify = f.settle
			})
			c := mustClient(t, f.URL())
			var err error
			if row.verify {
				_, err = c.Verify(context.Background(), permit2Request(mainnet))
			} else {
				_, err = c.Settle(context.Background(), permit2Request(mainnet))
			}
			if err == nil {
				t.Fatal("no error for a failed call")
			}
			if got := errors.Is(err, ErrNotSent) && errors.Is(err, x402.ErrSentNothing); got != row.want {
				t.Fatalf("error %v: not sent = %v, want %v", err, got, row.want)
			}
			if !row.want && (errors.Is(err, ErrNotSent) || errors.Is(err, x402.ErrSentNothing)) {
				t.Fatalf("error %v says half of nothing sent", err)
			}
			if row.want && !x402.IsUnreachable(err) {
				t.Fatalf("error %v is not unreachable: a payer would be told the payment failed", err)
			}
		})
	}
}
