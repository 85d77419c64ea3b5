package facilitatorclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/x402-gateway/caddy-x402/x402"
)

// exchange is one HTTP attempt.
type exchange struct {
	status    int    // HTTP status, when a response arrived
	body      []byte // the whole answer, when it was read
	responded bool   // a status line arrived: from here on the request surely reached the facilitator
	err       error  // no whole answer: transport error, timeout, or a body that broke off
	notSent   bool   // err came before any byte of the request can have left
	timedOut  bool   // err is this attempt's own timeout, not the caller's context
	tooLarge  bool   // the answer is longer than maxBytes
	location  string // the Location header of a redirect
}

// sent is the outcome of a call of one or more attempts.
type sent struct {
	last     exchange
	attempts int
	// earlierReached: an attempt before the last one may have reached the facilitator.
	earlierReached bool
	// anyReached: some attempt, the last included, may have reached the facilitator.
	anyReached bool
}

// send makes up to 1+retries attempts with the same body. A transport error is retried; an error after a
// status line arrived is retried only when retryAfterResponse, because for /settle a response means the
// facilitator acted on the request.
func (c *Client) send(ctx context.Context, method, url string, body []byte, timeout time.Duration, retries int, retryAfterResponse bool) sent {
	var s sent
	for {
		ex := c.exchangeOnce(ctx, method, url, body, timeout)
		s.attempts++
		if s.anyReached {
			s.earlierReached = true
		}
		if !ex.notSent {
			s.anyReached = true
		}
		s.last = ex
		if ex.err == nil || (ex.responded && !retryAfterResponse) || s.attempts > retries || ctx.Err() != nil {
			return s
		}
		if !retryAfterResponse && !ex.notSent {
			// The request may have reached the facilitator (it timed out, or the connection broke after it was
			// written): it is not sent again. A facilitator without a journal would answer a repeat of a
			// settlement it made with "nonce already used", which reads as a refusal of a payment that settled.
			return s
		}
		if !sleep(ctx, c.backoffBefore(s.attempts)) {
			return s
		}
	}
}

// backoffBefore is the pause after the given number of failed attempts: backoff, doubling, capped.
func (c *Client) backoffBefore(failed int) time.Duration {
	d := c.backoff
	for i := 1; i < failed && d < maxBackoff; i++ {
		d *= 2
	}
	return min(d, maxBackoff)
}

// sleep waits for d unless ctx ends first, and reports whether the caller may go on.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// exchangeOnce makes one HTTP attempt bounded by timeout and reads the whole answer.
func (c *Client) exchangeOnce(ctx context.Context, method, url string, body []byte, timeout time.Duration) exchange {
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	// The trace tells "never left" from "may have arrived": until the headers are written, the facilitator
	// cannot have seen the request. A transport that reports no trace at all counts as "may have arrived".
	var gotConnAsked, wroteHeaders atomic.Bool
	actx = httptrace.WithClientTrace(actx, &httptrace.ClientTrace{
		GetConn:      func(string) { gotConnAsked.Store(true) },
		WroteHeaders: func() { wroteHeaders.Store(true) },
	})

	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(actx, method, url, rd)
	if err != nil {
		return exchange{err: fmt.Errorf("building %s %s: %w", method, url, err), notSent: true}
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "caddy-x402-facilitatorclient")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.apiKey != "" {
		req.Header.Set(x402.HeaderAPIKey, string(c.apiKey))
	}

	resp, err := c.httpClient.Do(req)
	if err != nil {
		ex := exchange{err: err}
		ex.notSent = isDialError(err) || (gotConnAsked.Load() && !wroteHeaders.Load())
		if ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
			ex.timedOut = true
			ex.err = fmt.Errorf("%s %s: no answer within %s: %w", method, url, timeout, context.DeadlineExceeded)
		}
		return ex
	}
	defer resp.Body.Close()

	ex := exchange{status: resp.StatusCode, responded: true}
	if resp.StatusCode >= 300 && resp.StatusCode < 400 {
		ex.location = resp.Header.Get("Location")
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, c.maxBytes+1))
	switch {
	case err != nil && ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded):
		ex.timedOut = true
		ex.err = fmt.Errorf("%s %s: answer of HTTP %d not complete within %s: %w", method, url, resp.StatusCode, timeout, context.DeadlineExceeded)
	case err != nil:
		ex.err = fmt.Errorf("%s %s: answer of HTTP %d broke off: %w", method, url, resp.StatusCode, err)
	case int64(len(data)) > c.maxBytes:
		ex.tooLarge = true
	default:
		ex.body = data
	}
	return ex
}

// isDialError reports an error from before a connection existed: name resolution or connect.
func isDialError(err error) bool {
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return true
	}
	var opErr *net.OpError
	return errors.As(err, &opErr) && opErr.Op == "dial"
}

// transportFailure is the error of a call whose last attempt produced no whole answer.
func (c *Client) transportFailure(ctx context.Context, op string, s sent) error {
	ex := s.last
	var err error
	if ctxErr := ctx.Err(); ctxErr != nil {
		err = fmt.Errorf("call abandoned by its caller after %s: %w", attemptsText(s.attempts), ctxErr)
	} else if op == opSettle && s.anyReached {
		err = fmt.Errorf("no answer after %s, the payment may have settled: %w", attemptsText(s.attempts), ex.err)
	} else {
		err = fmt.Errorf("no answer after %s: %w", attemptsText(s.attempts), ex.err)
	}
	if !s.anyReached {
		err = fmt.Errorf("%w: %w", ErrNotSent, err)
	}
	fe := &x402.FacilitatorError{Op: op, Kind: x402.FailureUnreachable, Err: err}
	if ex.responded {
		fe.Status = ex.status
	}
	return fe
}

func attemptsText(n int) string {
	if n == 1 {
		return "1 attempt"
	}
	return fmt.Sprintf("%d attempts", n)
}

// statusFailure is the error of a whole answer that is not a protocol answer. want says what was expected.
func (c *Client) statusFailure(op string, ex exchange, want string) error {
	fe := &x402.FacilitatorError{Op: op, Status: ex.status}
	got := describeBody(ex.body, c.apiKey)
	if ex.tooLarge {
		got = fmt.Sprintf("more than %d bytes", c.maxBytes)
	}
	switch s := ex.status; {
	case ex.tooLarge:
		fe.Kind = x402.FailureBadAnswer
		fe.Err = fmt.Errorf("expected %s, got %s", want, got)
	case s >= 200 && s < 300:
		fe.Kind = x402.FailureBadAnswer
		fe.Err = fmt.Errorf("expected %s, got %s", want, got)
	case s == http.StatusServiceUnavailable && op == opSettle && saysNothingSent(ex.body):
		// A settlement the facilitator could not make now, and of which it says it sent nothing (an x402_facilitator
		// whose chain refused the transaction, or could not be asked what it needs): presented again, here or
		// elsewhere, the payment settles once, and a refusal of it then is final.
		fe.Kind = x402.FailureUnreachable
		fe.Err = fmt.Errorf("%w: %w: no answer, got %s", ErrNotSent, x402.ErrSentNothing, got)
	case s == http.StatusRequestTimeout || s == http.StatusTooManyRequests || s >= 500:
		// Busy, overloaded or broken: no answer now, which is not the facilitator refusing the request.
		fe.Kind = x402.FailureUnreachable
		fe.Err = fmt.Errorf("no answer, got %s", got)
	case s >= 400:
		fe.Kind = x402.FailureRejected
		fe.Err = fmt.Errorf("the facilitator refused the request%s, got %s", rejectionHint(s), got)
	case s >= 300 && s < 400:
		fe.Kind = x402.FailureBadAnswer
		fe.Err = fmt.Errorf("expected %s with HTTP 200, got a redirect (HTTP %d%s), which is not followed: the API key and "+
			"the payment go only to the configured facilitator; check its base URL", want, s, redirectTarget(ex.location))
	default:
		fe.Kind = x402.FailureBadAnswer
		fe.Err = fmt.Errorf("expected %s with HTTP 200, got HTTP %d and %s", want, s, got)
	}
	return fe
}

// redirectTarget names where a redirect pointed, without its query (which may carry tokens).
func redirectTarget(location string) string {
	if location == "" {
		return " without a Location"
	}
	u, err := url.Parse(location)
	if err != nil {
		return " to an unreadable Location"
	}
	u.RawQuery, u.Fragment, u.User = "", "", nil
	return " to " + u.String()
}

// rejectionHint names what to check for a status that means the request itself was refused.
func rejectionHint(status int) string {
	switch status {
	case http.StatusBadRequest:
		return " as malformed"
	case http.StatusUnauthorized, http.StatusForbidden:
		return "; check the API key (x-api-key)"
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		return "; check the facilitator base URL"
	case http.StatusRequestEntityTooLarge:
		return " as too large"
	}
	return ""
}

// describeBody quotes what the facilitator said, shortened, with the API key blanked out in case the
// facilitator echoed it.
func describeBody(body []byte, key secret) string {
	if len(bytes.TrimSpace(body)) == 0 {
		return "an empty body"
	}
	var fields map[string]any
	if json.Unmarshal(body, &fields) == nil {
		for _, name := range []string{"error", "message", "errorMessage", "invalidMessage", "errorReason", "invalidReason", "detail"} {
			if s, ok := fields[name].(string); ok && s != "" {
				return fmt.Sprintf("%s %q", name, shorten(redact(s, key), 200))
			}
		}
	}
	return fmt.Sprintf("body %q", shorten(redact(string(body), key), 120))
}

// redact blanks out the key before anything is shortened, so that no prefix of it survives either.
func redact(s string, key secret) string {
	if key == "" {
		return s
	}
	return strings.ReplaceAll(s, string(key), "[redacted]")
}

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

// decodeVerify reads a VerifyResponse. With a 2xx any body with isValid is the answer; with a 400 or 5xx
// only a full refusal (isValid false and a reason) is, as public facilitators answer refusals either way.
func decodeVerify(status int, body []byte) (x402.VerifyResponse, bool) {
	var probe struct {
		IsValid *bool `json:"isValid"`
	}
	var resp x402.VerifyResponse
	if json.Unmarshal(body, &probe) != nil || probe.IsValid == nil || json.Unmarshal(body, &resp) != nil {
		return x402.VerifyResponse{}, false
	}
	switch {
	case status >= 200 && status < 300:
		return resp, true
	case status == http.StatusBadRequest || status >= 500:
		return resp, !resp.IsValid && resp.InvalidReason != ""
	}
	return x402.VerifyResponse{}, false
}

// decodeSettle reads a SettleResponse. With a 2xx any body with success is the answer; with a 400 or 5xx a
// body with success and a reason or a transaction is, because it may carry the hash of a payment that
// settled and that must not be lost.
func decodeSettle(status int, body []byte) (x402.SettleResponse, bool) {
	var probe struct {
		Success *bool `json:"success"`
	}
	var resp x402.SettleResponse
	if json.Unmarshal(body, &probe) != nil || probe.Success == nil || json.Unmarshal(body, &resp) != nil {
		return x402.SettleResponse{}, false
	}
	switch {
	case status >= 200 && status < 300:
		return resp, true
	case status == http.StatusBadRequest || status >= 500:
		return resp, resp.ErrorReason != "" || resp.Transaction != ""
	}
	return x402.SettleResponse{}, false
}

// decodeSupported reads a SupportedResponse, which needs kinds (an empty list is fine) and a 2xx.
func decodeSupported(status int, body []byte) (x402.SupportedResponse, bool) {
	if status < 200 || status >= 300 {
		return x402.SupportedResponse{}, false
	}
	var probe struct {
		Kinds *[]x402.SupportedKind `json:"kinds"`
	}
	var resp x402.SupportedResponse
	if json.Unmarshal(body, &probe) != nil || probe.Kinds == nil || json.Unmarshal(body, &resp) != nil {
		return x402.SupportedResponse{}, false
	}
	return resp, true
}

// decodeHealth reads a HealthResponse from a 2xx or 5xx answer with a status.
func decodeHealth(status int, body []byte) (x402.HealthResponse, bool) {
	if (status < 200 || status >= 300) && status < 500 {
		return x402.HealthResponse{}, false
	}
	var resp x402.HealthResponse
	if json.Unmarshal(body, &resp) != nil || resp.Status == "" {
		return x402.HealthResponse{}, false
	}
	return resp, true
}

// saysNothingSent reports whether a /settle answer's error body says the facilitator sent nothing: a JSON object
// whose "sent" is false (facilitatorserver's 503 of x402.ErrSentNothing). Any other body says nothing of it.
func saysNothingSent(body []byte) bool {
	var b struct {
		Sent *bool `json:"sent"`
	}
	return json.Unmarshal(body, &b) == nil && b.Sent != nil && !*b.Sent
}
