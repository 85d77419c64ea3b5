package facilitatorclient

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Operation names carried in x402.FacilitatorError.Op.
const (
	opSupported = "supported"
	opVerify    = "verify"
	opSettle    = "settle"
	opHealth    = "health"
)

// ErrNotSent is wrapped into an error of a call none of whose requests can have reached the facilitator
// (connection refused, name not resolved, TLS handshake failed): sending the same payment elsewhere is safe.
// It is x402.ErrNotSent, which callers that know no facilitatorclient test for.
var ErrNotSent = x402.ErrNotSent

// Client is one remote facilitator. It is safe for concurrent use.
type Client struct {
	base         string
	supportedURL string
	verifyURL    string
	settleURL    string
	healthURL    string

	settings // as the options left them, with the HTTP client filled in

	supported supportedCache
}

// New returns a client of the facilitator at baseURL (http or https, no query, no credentials); the endpoints
// are baseURL + /supported, /verify, /settle and /health.
func New(baseURL string, opts ...Option) (*Client, error) {
	base, err := parseBaseURL(baseURL)
	if err != nil {
		return nil, err
	}
	s := defaultSettings()
	for _, opt := range opts {
		if opt == nil {
			continue
		}
		if err := opt(&s); err != nil {
			return nil, fmt.Errorf("facilitator client for %s: %w", base, err)
		}
	}
	if s.httpClient == nil {
		s.httpClient = defaultHTTPClient()
	} else {
		hc := *s.httpClient // the caller's client keeps its own redirect policy for its other uses
		s.httpClient = &hc
	}
	// A redirect is an answer of the facilitator asked, and a bad one: following it would send the API key and
	// the payment to whatever host it names, and take that host's word for the settlement.
	s.httpClient.CheckRedirect = refuseRedirect
	return &Client{
		base:         base,
		supportedURL: base + "/supported",
		verifyURL:    base + "/verify",
		settleURL:    base + "/settle",
		healthURL:    base + "/health",
		settings:     s,
	}, nil
}

// parseBaseURL checks that raw is an http(s) URL a path can be appended to, and drops a trailing slash.
func parseBaseURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("facilitator base URL: expected an http:// or https:// URL: %w", err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("facilitator base URL %q: expected scheme http or https, got %q", u.Redacted(), u.Scheme)
	case u.Host == "":
		return "", fmt.Errorf("facilitator base URL %q: expected a host", u.Redacted())
	case u.User != nil:
		// Credentials in the URL would end up in every transport error; the key belongs in WithAPIKey.
		return "", fmt.Errorf("facilitator base URL %q: must not carry credentials, pass an API key with WithAPIKey", u.Redacted())
	case u.RawQuery != "" || u.ForceQuery:
		return "", fmt.Errorf("facilitator base URL %q: must not have a query, the endpoint paths are appended to it", u.Redacted())
	case u.Fragment != "":
		return "", fmt.Errorf("facilitator base URL %q: must not have a fragment", u.Redacted())
	}
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = strings.TrimRight(u.RawPath, "/")
	return u.String(), nil
}

// defaultHTTPClient keeps more idle connections per host than Go's default of two, because a gate sends all
// its payments to the same one or two facilitators.
func defaultHTTPClient() *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 64
	return &http.Client{Transport: tr}
}

// refuseRedirect makes the HTTP client hand back a redirect as the answer instead of following it.
func refuseRedirect(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// String is the facilitator's base URL; it never includes the API key.
func (c *Client) String() string { return c.base }

// GoString keeps %#v from printing the client's fields.
func (c *Client) GoString() string { return fmt.Sprintf("facilitatorclient.Client(%q)", c.base) }

// BaseURL is the facilitator's base URL as the endpoint paths are appended to it.
func (c *Client) BaseURL() string { return c.base }

// Verify posts req to /verify. A refused payment is an answer with IsValid false, not an error; a valid answer
// that names another payer than the payment's signer is an error (x402.ErrAnswerNotThisPayment).
func (c *Client) Verify(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return x402.VerifyResponse{}, fmt.Errorf("facilitator verify: cannot encode the request: %w", err)
	}
	sent := c.send(ctx, http.MethodPost, c.verifyURL, body, c.timeouts.Verify, c.retries, true)
	if sent.last.err != nil {
		return x402.VerifyResponse{}, c.transportFailure(ctx, opVerify, sent)
	}
	if resp, ok := decodeVerify(sent.last.status, sent.last.body); ok {
		if problem := x402.VerifyProblem(req, resp); problem != "" {
			return x402.VerifyResponse{}, notThisPayment(opVerify, sent.last.status, "the facilitator answered valid, but "+problem)
		}
		return resp, nil
	}
	return x402.VerifyResponse{}, c.statusFailure(opVerify, sent.last, "a VerifyResponse with isValid")
}

// SettleResult is a /settle answer together with how it was had.
type SettleResult struct {
	// Response is the facilitator's answer; zero when the call failed.
	Response x402.SettleResponse
	// Attempts is how many times the request was sent, 1 unless it was resent.
	Attempts int
	// Resent is true when an earlier attempt may have reached the facilitator. Since a /settle that may have
	// reached it is never sent again, it stays false; it is kept for callers that read it.
	Resent bool
	// Facilitator is the base URL of the facilitator that was asked last.
	Facilitator string
}

// Settle posts req to /settle; see SettleDetailed for when it is resent. A failed settlement is an answer
// with Success false, not an error; a success that does not show this payment settled is an error
// (x402.ErrAnswerNotThisPayment); after an error the payment may still have settled.
func (c *Client) Settle(ctx context.Context, req x402.SettleRequest) (x402.SettleResponse, error) {
	res, err := c.SettleDetailed(ctx, req)
	return res.Response, err
}

// SettleDetailed posts req to /settle and says how the answer was had. The body is encoded once; it is sent
// again, as those same bytes and up to WithSettleResends times, only after an attempt that surely never reached
// the facilitator (connection refused, name not resolved): one that may have reached it (a timeout, a
// connection cut after the body went out) ends the call with an unknown outcome, for a facilitator without a
// journal would answer the repeat of a settlement it made with "nonce already used". An error wraps ErrNotSent
// only when no attempt can have reached the facilitator, or the facilitator answered that it sent nothing (an error
// body with "sent": false, which wraps x402.ErrSentNothing too).
func (c *Client) SettleDetailed(ctx context.Context, req x402.SettleRequest) (SettleResult, error) {
	res := SettleResult{Facilitator: c.base}
	body, err := json.Marshal(req)
	if err != nil {
		return res, fmt.Errorf("facilitator settle: cannot encode the request: %w", err)
	}
	sent := c.send(ctx, http.MethodPost, c.settleURL, body, c.timeouts.Settle, c.settleResends, false)
	res.Attempts = sent.attempts
	res.Resent = sent.earlierReached
	if sent.last.err != nil {
		return res, c.transportFailure(ctx, opSettle, sent)
	}
	if resp, ok := decodeSettle(sent.last.status, sent.last.body); ok {
		if problem := x402.SettlementProblem(req, resp); resp.Success && problem != "" {
			return res, notThisPayment(opSettle, sent.last.status, "the facilitator answered success, but "+problem+"; the outcome is unknown, and the payment may have settled")
		}
		res.Response = resp
		return res, nil
	}
	return res, c.statusFailure(opSettle, sent.last, "a SettleResponse with success")
}

// notThisPayment is the error of an answer that does not show it is about the payment asked of (see
// x402.ErrAnswerNotThisPayment): no answer, never a refusal, so that no caller tells a payer whose payment may
// have settled to pay again, nor serves on the strength of another payment's success.
func notThisPayment(op string, status int, problem string) error {
	return &x402.FacilitatorError{Op: op, Kind: x402.FailureBadAnswer, Status: status, Err: fmt.Errorf("%w: %s", x402.ErrAnswerNotThisPayment, problem)}
}

// Health asks /health once, without retries: it is a probe, and its caller decides how often to ask.
// A body with a status is an answer even with a 5xx, which is how facilitators report being down.
func (c *Client) Health(ctx context.Context) (x402.HealthResponse, error) {
	sent := c.send(ctx, http.MethodGet, c.healthURL, nil, c.timeouts.Health, 0, true)
	if sent.last.err != nil {
		return x402.HealthResponse{}, c.transportFailure(ctx, opHealth, sent)
	}
	if resp, ok := decodeHealth(sent.last.status, sent.last.body); ok {
		return resp, nil
	}
	return x402.HealthResponse{}, c.statusFailure(opHealth, sent.last, `a health body with "status"`)
}

// fetchSupported asks /supported, with retries, bypassing the cache.
func (c *Client) fetchSupported(ctx context.Context) (x402.SupportedResponse, error) {
	sent := c.send(ctx, http.MethodGet, c.supportedURL, nil, c.timeouts.Supported, c.retries, true)
	if sent.last.err != nil {
		return x402.SupportedResponse{}, c.transportFailure(ctx, opSupported, sent)
	}
	if resp, ok := decodeSupported(sent.last.status, sent.last.body); ok {
		return resp, nil
	}
	return x402.SupportedResponse{}, c.statusFailure(opSupported, sent.last, "a SupportedResponse with kinds")
}

// Interface guard.
var _ x402.Facilitator = (*Client)(nil)
