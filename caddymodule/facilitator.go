package caddymodule

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(FacilitatorHandler{})
}

// Endpoints of the facilitator handler, named by the last segment of the request path.
const (
	facilitatorEndpointSupported = "supported"
	facilitatorEndpointVerify    = "verify"
	facilitatorEndpointSettle    = "settle"
	facilitatorEndpointHealth    = "health"
)

// FacilitatorHandler serves an x402 facilitator over HTTP: GET /supported, POST /verify, POST /settle and
// GET /health. It serves the embedded engine of the `x402` app, or, given upstreams, another facilitator
// reached over HTTP (the "middleware layer" of the service spec), adding its own API keys, limits and metrics.
//
// It answers by the last segment of the request path, so it serves the same under
// `handle_path /facilitator/* { x402_facilitator }` (prefix stripped) as under `handle /facilitator/*`.
// A refused payment is a full VerifyResponse or SettleResponse with HTTP 200; a malformed body is 400 and
// names the field; a facilitator or chain that cannot be reached is 502 with a JSON error.
type FacilitatorHandler struct {
	// Kinds restricts the asset transfer methods served: "permit2" (x402 version 2, with
	// eip2612GasSponsoring), "eip3009" and "erc2612" (versions 1 and 2). Default: every method the facilitator
	// behind offers. /supported lists only these; /verify and /settle refuse other methods.
	// An erc2612 permit does not sign the recipient: a caller holding one can have it paid to any payTo, so a
	// route serving erc2612 should be reached by trusted resource servers only (APIKeys, PayTo).
	Kinds []string `json:"kinds,omitempty"`

	// Networks restricts the CAIP-2 networks served. Default: every network of the facilitator behind.
	Networks []string `json:"networks,omitempty"`

	// APIKeys, when set, are the keys of which a request must present one in the x-api-key header; without
	// a match it gets 401. Placeholders such as {env.FACILITATOR_KEY} are replaced when the handler is
	// provisioned. Keys are compared in constant time and never logged.
	APIKeys []string `json:"api_keys,omitempty"`

	// MaxBodySize is the largest /verify or /settle body accepted, in bytes; a larger one gets 413.
	// Default and maximum: 65536 (x402.MaxBodyBytes).
	MaxBodySize int64 `json:"max_body_size,omitempty"`

	// MinAmount, when set, is the smallest paymentRequirements.amount (raw token units) this handler passes on:
	// a /verify or /settle of a smaller payment is refused with invalid_payment_requirements before the
	// facilitator behind is called.
	MinAmount string `json:"min_amount,omitempty"`

	// PayTo, when set, are the only recipients (paymentRequirements.payTo) this handler passes payments on for;
	// a payment to another is refused with invalid_payment_requirements before the facilitator behind is called.
	// Default: any recipient.
	PayTo []string `json:"pay_to,omitempty"`

	// SettleRateLimit caps the /settle calls per client IP and per payer; over it, 429 with Retry-After.
	SettleRateLimit *SettleRateLimit `json:"settle_rate_limit,omitempty"`

	// Upstreams make this handler serve other facilitators over HTTP instead of the embedded engine.
	// Several are a failover set: each payment goes to the first member whose /supported lists its kind,
	// and on to the next only when a member cannot be reached.
	Upstreams []*FacilitatorUpstream `json:"upstreams,omitempty"`

	facilitator    x402.Facilitator // the embedded engine is set when the x402 app starts
	app            *App             // nil for upstreams
	embedded       bool
	kinds          map[string]bool // nil: every kind
	networks       map[string]bool // nil: every network
	keys           [][sha256.Size]byte
	maxBody        int64
	terms          paymentTerms
	limiter        *settleLimiter // nil: no rate limit
	registry       *x402.Registry
	metrics        *metrics
	releaseWallets func()
	redactor       *strings.Replacer // hides RPC URLs (and the API keys in them) in engine errors; nil for upstreams
	health         *healthCache
	accessLog      *keyedAccessLog
	logger         *zap.Logger
}

// FacilitatorUpstream is a facilitator the handler forwards to in middleware mode.
type FacilitatorUpstream struct {
	// URL is the facilitator's base URL; /supported, /verify, /settle and /health are appended to it.
	URL string `json:"url"`
	// APIKey is sent in the x-api-key header of every call. Placeholders are replaced when the handler is
	// provisioned.
	APIKey string `json:"api_key,omitempty"`
	// Timeout bounds each verify, supported and health call to this facilitator. Default: 10s for verify and
	// supported, 5s for health.
	Timeout caddy.Duration `json:"timeout,omitempty"`
	// SettleTimeout bounds each settle call (default 60s, whatever Timeout says): a settlement waits for a
	// block, and one cut short has an unknown outcome, which the payer can learn only by presenting the
	// payment again.
	SettleTimeout caddy.Duration `json:"settle_timeout,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (FacilitatorHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.x402_facilitator",
		New: func() caddy.Module { return new(FacilitatorHandler) },
	}
}

// Provision resolves the API keys and finds the facilitator to serve: the upstreams, or the x402 app's engine.
func (h *FacilitatorHandler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	repl := caddy.NewReplacer()
	for i, k := range h.APIKeys {
		key := repl.ReplaceAll(k, "")
		if key == "" {
			return fmt.Errorf("api_key #%d is empty once its placeholders are replaced; is its environment variable set?", i+1)
		}
		h.keys = append(h.keys, sha256.Sum256([]byte(key)))
	}
	h.maxBody = h.MaxBodySize
	if h.maxBody == 0 {
		h.maxBody = x402.MaxBodyBytes
	}
	if len(h.Kinds) > 0 {
		h.kinds = map[string]bool{}
		for _, k := range h.Kinds {
			h.kinds[k] = true
		}
	}
	if len(h.Networks) > 0 {
		h.networks = map[string]bool{}
		for _, n := range h.Networks {
			h.networks[n] = true
		}
	}
	h.registry = x402.NewRegistry()
	h.health = &healthCache{ttl: healthCacheTTL}
	h.accessLog = newKeyedAccessLog(ctx)

	var err error
	if h.terms, err = parsePaymentTerms(h.MinAmount, h.PayTo); err != nil {
		return fmt.Errorf("%w", err)
	}
	h.limiter = newSettleLimiter(h.SettleRateLimit, nil)

	if h.metrics, err = metricsFor(ctx); err != nil {
		return err
	}
	if len(h.Upstreams) > 0 {
		h.facilitator, err = h.upstreamFacilitator(repl)
		return err
	}
	appModule, err := ctx.App("x402")
	if err != nil {
		return fmt.Errorf("loading the x402 app: %w", err)
	}
	app := appModule.(*App)
	networks := app.networkIDs()
	if len(networks) == 0 {
		return errors.New("no facilitator to serve: configure a network in the x402 global option " +
			"(x402 { network <caip2> { rpc ... asset ... wallet_keys ... } }), or give an upstream facilitator")
	}
	h.embedded, h.redactor, h.app = true, app.rpcRedactor(), app
	for _, n := range h.Networks {
		if !slices.Contains(networks, n) {
			return fmt.Errorf("network %s is not configured in the x402 app, which settles on %s", n, strings.Join(networks, ", "))
		}
	}
	// The engine runs once the app has started.
	return app.onStart(func() error { return h.start(app) })
}

// start takes up the embedded engine once the x402 app runs.
func (h *FacilitatorHandler) start(app *App) error {
	engine := app.Facilitator()
	supported, err := engine.Supported(context.Background())
	if err != nil {
		return fmt.Errorf("x402_facilitator: reading the kinds of the embedded facilitator: %w", err)
	}
	if len(h.filterSupported(supported).Kinds) == 0 {
		return fmt.Errorf("x402_facilitator: kinds %v on networks %v leave nothing to serve; the x402 app offers %s",
			h.Kinds, h.Networks, describeKinds(supported.Kinds))
	}
	h.facilitator = engine
	h.releaseWallets = h.metrics.trackWallets(engine)
	return nil
}

// upstreamFacilitator builds the facilitatorclient for the upstreams: one client, or a failover set.
func (h *FacilitatorHandler) upstreamFacilitator(repl *caddy.Replacer) (x402.Facilitator, error) {
	clients := make([]*facilitatorclient.Client, 0, len(h.Upstreams))
	for i, u := range h.Upstreams {
		opts := []facilitatorclient.Option{}
		if key := repl.ReplaceAll(u.APIKey, ""); key != "" {
			opts = append(opts, facilitatorclient.WithAPIKey(key))
		} else if u.APIKey != "" {
			return nil, fmt.Errorf("the api_key of upstream #%d is empty once its placeholders are replaced; is its environment variable set?", i+1)
		}
		t := facilitatorclient.Timeouts{Settle: time.Duration(u.SettleTimeout)}
		if d := time.Duration(u.Timeout); d > 0 {
			t.Verify, t.Supported, t.Health = d, d, d
		}
		opts = append(opts, facilitatorclient.WithTimeouts(t))
		c, err := facilitatorclient.New(repl.ReplaceAll(u.URL, ""), opts...)
		if err != nil {
			return nil, fmt.Errorf("upstream #%d: %w", i+1, err)
		}
		clients = append(clients, c)
	}
	if len(clients) == 1 {
		return clients[0], nil
	}
	return facilitatorclient.NewFailover(clients...), nil
}

// Validate checks the configuration for values no request could make right.
func (h *FacilitatorHandler) Validate() error {
	for _, k := range h.Kinds {
		if !x402.IsTransferMethod(k) {
			return fmt.Errorf("unknown kind %q; want %q, %q or %q", k, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
		}
	}
	for _, n := range h.Networks {
		if _, _, err := x402.ParseCAIP2(n); err != nil {
			return fmt.Errorf("networks: %w", err)
		}
	}
	if _, err := parsePaymentTerms(h.MinAmount, h.PayTo); err != nil {
		return fmt.Errorf("%w", err)
	}
	if l := h.SettleRateLimit; l != nil {
		for _, r := range []struct {
			name string
			n    int
		}{{"per_ip", l.PerIP}, {"per_payer", l.PerPayer}} {
			if r.n < 0 || r.n > maxPerMinute {
				return fmt.Errorf("settle_rate_limit %s is %d a minute; want 0 (no limit) to %d", r.name, r.n, maxPerMinute)
			}
		}
	}
	if h.MaxBodySize < 0 || h.MaxBodySize > x402.MaxBodyBytes {
		return fmt.Errorf("max_body_size is %d bytes; want 1 to %d (larger bodies are never valid requests)",
			h.MaxBodySize, x402.MaxBodyBytes)
	}
	for i, u := range h.Upstreams {
		switch {
		case u == nil || u.URL == "":
			return fmt.Errorf("upstream #%d has no URL", i+1)
		case u.Timeout < 0:
			return fmt.Errorf("upstream #%d: timeout must not be negative", i+1)
		case u.SettleTimeout < 0:
			return fmt.Errorf("upstream #%d: settle_timeout must not be negative", i+1)
		}
	}
	return nil
}

// Cleanup stops reporting the engine's wallets; the engine itself belongs to the x402 app.
func (h *FacilitatorHandler) Cleanup() error {
	if h.releaseWallets != nil {
		h.releaseWallets()
	}
	return nil
}

// facilitatorReply is one answer of the handler, written as JSON.
type facilitatorReply struct {
	status     int
	body       any
	allow      string // the Allow header of a 405
	retryAfter int    // the Retry-After header of a 429, in seconds
}

// facilitatorError is the JSON body of an answer that is not a protocol document.
type facilitatorError struct {
	Error string `json:"error"`
	// Field is the JSON path of the offending field of a malformed body.
	Field string `json:"field,omitempty"`
}

func errorReply(status int, format string, args ...any) facilitatorReply {
	return facilitatorReply{status: status, body: facilitatorError{Error: fmt.Sprintf(format, args...)}}
}

// ServeHTTP answers the request; it is a terminal handler and never calls next.
func (h *FacilitatorHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	entry := h.accessLog.takeOver(r) // the x-api-key header must not reach the access log
	endpoint := facilitatorEndpoint(r.URL.Path)
	res := h.serve(r, endpoint)
	size := writeFacilitatorReply(w, res)
	if entry != nil {
		entry.write(w, res.status, size)
	}
	h.metrics.observeFacilitatorRequest(endpoint, res.status)
	return nil
}

// facilitatorEndpoint names the endpoint by the last path segment, or metricsOther.
func facilitatorEndpoint(path string) string {
	switch seg := path[strings.LastIndexByte(path, '/')+1:]; seg {
	case facilitatorEndpointSupported, facilitatorEndpointVerify, facilitatorEndpointSettle, facilitatorEndpointHealth:
		return seg
	}
	return metricsOther
}

func (h *FacilitatorHandler) serve(r *http.Request, endpoint string) facilitatorReply {
	if !h.authorized(r) {
		return errorReply(http.StatusUnauthorized, "missing or wrong x-api-key header: this facilitator needs an API key")
	}
	if h.app != nil {
		if err := h.app.awaitStart(r.Context()); err != nil {
			return errorReply(http.StatusServiceUnavailable, "the embedded facilitator is not running: %v", err)
		}
	}
	switch endpoint {
	case facilitatorEndpointSupported, facilitatorEndpointHealth:
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			res := errorReply(http.StatusMethodNotAllowed, "%s /%s is not served; use GET", r.Method, endpoint)
			res.allow = "GET, HEAD"
			return res
		}
		if endpoint == facilitatorEndpointSupported {
			return h.serveSupported(r.Context())
		}
		return h.health.get(r.Context(), h.serveHealth)
	case facilitatorEndpointVerify, facilitatorEndpointSettle:
		if r.Method != http.MethodPost {
			res := errorReply(http.StatusMethodNotAllowed, "%s /%s is not served; use POST with a JSON body", r.Method, endpoint)
			res.allow = http.MethodPost
			return res
		}
		return h.servePayment(r, endpoint)
	}
	return errorReply(http.StatusNotFound, "no facilitator endpoint at %q; this facilitator serves GET /supported, POST /verify, POST /settle and GET /health",
		r.URL.Path)
}

// authorized reports whether the request carries one of the API keys, or none is needed. Every key is
// compared, and compared as a hash, so that neither the time taken nor the length of a key gives it away.
func (h *FacilitatorHandler) authorized(r *http.Request) bool {
	if len(h.keys) == 0 {
		return true
	}
	got := sha256.Sum256([]byte(r.Header.Get(x402.HeaderAPIKey)))
	match := 0
	for i := range h.keys {
		match |= subtle.ConstantTimeCompare(got[:], h.keys[i][:])
	}
	return match == 1
}

func (h *FacilitatorHandler) serveSupported(ctx context.Context) facilitatorReply {
	resp, err := h.facilitator.Supported(ctx)
	if err != nil {
		return h.failure(facilitatorEndpointSupported, err, "")
	}
	return facilitatorReply{status: http.StatusOK, body: h.filterSupported(resp)}
}

// filterSupported keeps the kinds, signers and extensions of the networks and methods this handler serves.
func (h *FacilitatorHandler) filterSupported(resp x402.SupportedResponse) x402.SupportedResponse {
	out := x402.SupportedResponse{Kinds: []x402.SupportedKind{}, Extensions: []string{}, Signers: map[string][]string{}}
	permit2 := false
	for _, k := range resp.Kinds {
		if h.serves(k.Extra.AssetTransferMethod, k.Network) {
			out.Kinds = append(out.Kinds, k)
			permit2 = permit2 || k.Extra.AssetTransferMethod == x402.TransferPermit2
		}
	}
	for _, e := range resp.Extensions {
		if e != x402.ExtensionEIP2612GasSponsoring || permit2 {
			out.Extensions = append(out.Extensions, e)
		}
	}
	for pattern, addrs := range resp.Signers {
		// A wildcard pattern such as "eip155:*" may cover a served network; exact ids are kept if served.
		if h.networks == nil || h.networks[pattern] || strings.HasSuffix(pattern, "*") {
			out.Signers[pattern] = addrs
		}
	}
	return out
}

// serves reports whether the handler serves a method on a network.
func (h *FacilitatorHandler) serves(method, network string) bool {
	return (h.kinds == nil || h.kinds[method]) && (h.networks == nil || h.networks[network])
}

func (h *FacilitatorHandler) serveHealth(ctx context.Context) facilitatorReply {
	resp, err := h.facilitator.Health(ctx)
	if err != nil {
		logged := h.redact(err.Error())
		h.logger.Warn("health unknown: the facilitator gave no answer", zap.String("error", logged))
		return facilitatorReply{status: http.StatusServiceUnavailable, body: struct {
			x402.HealthResponse
			Error string `json:"error"`
		}{x402.HealthResponse{Status: x402.HealthDown}, h.answerText(err, logged, "")}}
	}
	resp = h.filterHealth(resp)
	for i := range resp.Networks {
		resp.Networks[i].Error = h.redact(resp.Networks[i].Error)
	}
	status := http.StatusOK
	if resp.Status != x402.HealthOK && resp.Status != x402.HealthDegraded {
		status = http.StatusServiceUnavailable
	}
	return facilitatorReply{status: status, body: resp}
}

// healthCacheTTL is how long a /health answer is reused. Each answer costs a head read and a balance read per
// settlement wallet on every network; without a key anyone may ask, and a probe every few seconds loses
// nothing by being told what was true two seconds ago.
const healthCacheTTL = 2 * time.Second

// healthFetchTimeout bounds one health check: the callers waiting for it are not the one that started it.
const healthFetchTimeout = 15 * time.Second

// healthCache holds the last /health answer for its ttl and lets one check run at a time, which every caller
// that comes meanwhile waits for and shares.
type healthCache struct {
	ttl time.Duration

	mu     sync.Mutex
	at     time.Time
	reply  *facilitatorReply
	flight chan struct{} // closed when the running check is done; nil when none runs
}

// get returns the cached answer while it is fresh, and otherwise the answer of a check by fetch, started now or
// already under way. A caller that leaves while it waits gets 503; the check goes on for the others.
func (c *healthCache) get(ctx context.Context, fetch func(context.Context) facilitatorReply) facilitatorReply {
	if c == nil {
		return fetch(ctx)
	}
	for {
		c.mu.Lock()
		if c.reply != nil && time.Since(c.at) < c.ttl {
			res := *c.reply
			c.mu.Unlock()
			return res
		}
		if flight := c.flight; flight != nil {
			c.mu.Unlock()
			select {
			case <-flight:
				continue
			case <-ctx.Done():
				return errorReply(http.StatusServiceUnavailable, "health unknown: the request ended while the check ran")
			}
		}
		c.flight = make(chan struct{})
		c.mu.Unlock()
		return c.check(ctx, fetch)
	}
}

// check runs fetch on a context of its own, so that the first caller leaving does not fail the others, and
// keeps its answer. The waiters are let go even if fetch panics.
func (c *healthCache) check(ctx context.Context, fetch func(context.Context) facilitatorReply) (res facilitatorReply) {
	done := false
	defer func() {
		c.mu.Lock()
		if done {
			c.reply, c.at = &res, time.Now()
		}
		close(c.flight)
		c.flight = nil
		c.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), healthFetchTimeout)
	defer cancel()
	res = fetch(ctx)
	done = true
	return res
}

// filterHealth keeps the networks this handler serves and sums them up: down when every one of them is down,
// degraded when any is not ok.
func (h *FacilitatorHandler) filterHealth(resp x402.HealthResponse) x402.HealthResponse {
	if h.networks != nil {
		kept := resp.Networks[:0:0]
		for _, n := range resp.Networks {
			if h.networks[n.Network] {
				kept = append(kept, n)
			}
		}
		resp.Networks = kept
		if resp.Status == x402.HealthDegraded {
			resp.Status = x402.HealthOK // re-derived below from the networks that are left
		}
	}
	if len(resp.Networks) == 0 {
		return resp
	}
	down := 0
	for _, n := range resp.Networks {
		if n.Status == x402.HealthDown {
			down++
		}
		if n.Status != x402.HealthOK && resp.Status == x402.HealthOK {
			resp.Status = x402.HealthDegraded
		}
	}
	if down == len(resp.Networks) {
		resp.Status = x402.HealthDown
	}
	return resp
}

// servePayment answers /verify and /settle. A /settle call is counted against the client IP's rate limit before
// its body is read, and against its payer's once the body names one; a call over either gets 429 and goes no
// further. The payer's count is given back when the answer carries no transaction: nothing was sent.
func (h *FacilitatorHandler) servePayment(r *http.Request, endpoint string) facilitatorReply {
	settle := endpoint == facilitatorEndpointSettle
	if settle {
		ip := clientIP(r)
		if res, ok := h.limiter.takeIP(ip); !ok {
			h.logger.Debug("settlement refused: client IP over its rate limit", zap.String("client_ip", ip))
			return res
		}
	}
	if r.ContentLength > h.maxBody {
		return errorReply(http.StatusRequestEntityTooLarge, "the body is %d bytes; this facilitator accepts at most %d", r.ContentLength, h.maxBody)
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, h.maxBody+1))
	if err != nil {
		return errorReply(http.StatusBadRequest, "reading the body: %v", err)
	}
	if int64(len(body)) > h.maxBody {
		return errorReply(http.StatusRequestEntityTooLarge, "the body is more than %d bytes, the most this facilitator accepts", h.maxBody)
	}
	req, v1, err := h.registry.DecodeFacilitatorRequest(body)
	if err != nil {
		var de *x402.DecodeError
		if errors.As(err, &de) && de.Kind == x402.DecodeTooLarge {
			return errorReply(http.StatusRequestEntityTooLarge, "%v", err)
		}
		res := errorReply(http.StatusBadRequest, "%v", err)
		if de != nil {
			res.body = facilitatorError{Error: err.Error(), Field: de.Field}
		}
		return res
	}
	if !settle {
		return h.answerPayment(r, req, v1, endpoint)
	}
	payer := chain.ClaimedPayer(req)
	if res, ok := h.limiter.takePayer(payer); !ok {
		h.logger.Debug("settlement refused: payer over its rate limit", zap.String("payer", payer))
		return res
	}
	res := h.answerPayment(r, req, v1, endpoint)
	if s, ok := res.body.(x402.SettleResponse); ok && s.Transaction == "" {
		h.limiter.refundPayer(payer)
	}
	return res
}

// answerPayment answers a decoded /verify or /settle: refused here when the route does not serve its kind or
// its terms, else by the facilitator behind.
func (h *FacilitatorHandler) answerPayment(r *http.Request, req x402.VerifyRequest, v1 bool, endpoint string) facilitatorReply {
	if reason, message := h.refusal(req); reason != "" {
		h.logger.Info("payment refused: not served by this route", zap.String("endpoint", endpoint),
			zap.String("network", req.PaymentRequirements.Network), zap.String("reason", reason))
		h.metrics.observeFacilitatorOutcome(endpoint, reason)
		payer := chain.ClaimedPayer(req)
		if endpoint == facilitatorEndpointVerify {
			return facilitatorReply{status: http.StatusOK, body: x402.VerifyResponse{Payer: payer, InvalidReason: reason, InvalidMessage: message}}
		}
		return facilitatorReply{status: http.StatusOK, body: x402.SettleResponse{
			Network: h.networkName(req.PaymentRequirements.Network, v1), Payer: payer, ErrorReason: reason, ErrorMessage: message,
		}}
	}
	if v1 && !h.embedded {
		// A remote facilitator reads a version 1 request in the version 1 shape only; an erc2612 permit signs
		// no version, so the converted payment is the same payment in the version 2 shape.
		req.X402Version, req.PaymentPayload.X402Version = x402.Version2, x402.Version2
	}
	if endpoint == facilitatorEndpointVerify {
		return h.verify(r.Context(), req)
	}
	// A settlement runs to its end even when the caller hangs up: it may have been broadcast, and its
	// answer must reach the journal (and the caller, if it asks again).
	return h.settle(context.WithoutCancel(r.Context()), req, v1)
}

func (h *FacilitatorHandler) verify(ctx context.Context, req x402.VerifyRequest) facilitatorReply {
	start := time.Now()
	resp, err := h.facilitator.Verify(ctx, req)
	took := time.Since(start)
	h.metrics.observeVerify(metricsHandlerFacilitator, took)
	if err != nil {
		return h.failure(facilitatorEndpointVerify, err, paymentKind(req))
	}
	h.metrics.observeFacilitatorOutcome(facilitatorEndpointVerify, resp.InvalidReason)
	if c := h.logger.Check(zap.DebugLevel, "verified"); c != nil {
		c.Write(zap.Bool("valid", resp.IsValid), zap.String("payer", resp.Payer),
			zap.String("network", req.PaymentRequirements.Network), zap.String("amount", req.PaymentRequirements.Amount),
			zap.String("reason", resp.InvalidReason), zap.Duration("took", took))
	}
	return facilitatorReply{status: http.StatusOK, body: resp}
}

func (h *FacilitatorHandler) settle(ctx context.Context, req x402.SettleRequest, v1 bool) facilitatorReply {
	start := time.Now()
	resp, err := h.facilitator.Settle(ctx, req)
	took := time.Since(start)
	h.metrics.observeSettle(metricsHandlerFacilitator, took)
	if err != nil {
		return h.failure(facilitatorEndpointSettle, err, paymentKind(req))
	}
	h.metrics.observeFacilitatorOutcome(facilitatorEndpointSettle, resp.ErrorReason)
	fields := []zap.Field{
		zap.String("payer", resp.Payer), zap.String("network", resp.Network),
		zap.String("amount", req.PaymentRequirements.Amount), zap.String("transaction", resp.Transaction),
		zap.Duration("took", took),
	}
	switch {
	case resp.Success:
		h.logger.Info("settled", fields...)
	case resp.Pending():
		h.logger.Warn("settlement broadcast, receipt not seen yet", fields...)
	default:
		h.logger.Info("settlement refused", append(fields, zap.String("reason", resp.ErrorReason))...)
	}
	resp.Network = h.networkName(resp.Network, v1)
	return facilitatorReply{status: http.StatusOK, body: resp}
}

// failure answers a call that got no answer from the facilitator behind: 502 with what went wrong, and for a
// settlement the warning that it may have happened all the same. payment names the payment's kind, if any.
func (h *FacilitatorHandler) failure(endpoint string, err error, payment string) facilitatorReply {
	logged := h.redact(err.Error())
	h.logger.Error("the facilitator gave no answer", zap.String("endpoint", endpoint), zap.String("error", logged))
	status := http.StatusBadGateway
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) {
		status = http.StatusInternalServerError
	}
	msg := h.answerText(err, logged, payment)
	if endpoint == facilitatorEndpointSettle {
		msg += "; the payment may have settled: send the same payload to /settle again to learn its outcome, never a new payment"
	}
	return facilitatorReply{status: status, body: facilitatorError{Error: msg}}
}

// answerText is what an answer says of err, a failure of the facilitator behind. The embedded engine's own
// words are given with its RPC URLs cut to scheme://host (logged is that text). An upstream's error names the
// upstreams' URLs and the hosts behind them, which are for the log only: the answer says what kind of failure
// it was, and for which payment.
func (h *FacilitatorHandler) answerText(err error, logged, payment string) string {
	if h.embedded {
		return logged
	}
	if len(h.Upstreams) == 1 {
		return "the upstream facilitator gave no usable answer: " + facilitatorProblem(err)
	}
	who := "no facilitator upstream answered"
	if payment != "" {
		who += " for a " + payment
	}
	return who + ": " + facilitatorProblem(err)
}

// paymentKind names a payment's transfer method and network, for an error answer.
func paymentKind(req x402.VerifyRequest) string {
	rq := req.PaymentRequirements
	return x402.TransferMethod(rq, req.PaymentPayload.Payload) + " payment on " + rq.Network
}

// redact hides the RPC URLs of the embedded engine in a text bound for an answer or a log.
func (h *FacilitatorHandler) redact(s string) string {
	if h.redactor == nil || s == "" {
		return s
	}
	return h.redactor.Replace(s)
}

// refusal says why the handler does not serve a payment's kind or terms, or "" when it does.
func (h *FacilitatorHandler) refusal(req x402.VerifyRequest) (reason, message string) {
	rq := req.PaymentRequirements
	method := x402.TransferMethod(rq, req.PaymentPayload.Payload)
	switch {
	case h.networks != nil && !h.networks[rq.Network]:
		return x402.ReasonInvalidNetwork, fmt.Sprintf("network %q is not served by this facilitator (it serves %s)", rq.Network, strings.Join(h.Networks, ", "))
	case h.kinds != nil && !h.kinds[method]:
		return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("this facilitator does not settle %s payments (it settles %s)", method, strings.Join(h.Kinds, ", "))
	case req.X402Version == x402.Version1 && method != x402.TransferERC2612:
		return x402.ReasonInvalidX402Version, fmt.Sprintf("%s payments need x402Version 2; version 1 is served for erc2612 only", method)
	}
	return h.terms.refusal(rq)
}

// networkName is the network as the caller named it: the version 1 name for a version 1 request.
func (h *FacilitatorHandler) networkName(caip2 string, v1 bool) string {
	if !v1 {
		return caip2
	}
	if name, err := h.registry.V1Name(caip2); err == nil {
		return name
	}
	return caip2
}

// describeKinds lists kinds for an error message.
func describeKinds(kinds []x402.SupportedKind) string {
	if len(kinds) == 0 {
		return "no kinds"
	}
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		parts = append(parts, fmt.Sprintf("%s on %s (v%d)", k.Extra.AssetTransferMethod, k.Network, k.X402Version))
	}
	return strings.Join(parts, ", ")
}

// writeFacilitatorReply writes res as JSON and returns how many bytes of body it wrote.
func writeFacilitatorReply(w http.ResponseWriter, res facilitatorReply) int {
	body, err := json.Marshal(res.body)
	if err != nil {
		res.status, body = http.StatusInternalServerError, []byte(`{"error":"encoding the answer failed"}`)
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("Cache-Control", "no-store")
	if res.allow != "" {
		hdr.Set("Allow", res.allow)
	}
	if res.retryAfter > 0 {
		hdr.Set("Retry-After", strconv.Itoa(res.retryAfter))
	}
	w.WriteHeader(res.status)
	n, _ := w.Write(append(body, '\n'))
	return n
}

// Interface guards
var (
	_ caddy.Provisioner           = (*FacilitatorHandler)(nil)
	_ caddy.Validator             = (*FacilitatorHandler)(nil)
	_ caddy.CleanerUpper          = (*FacilitatorHandler)(nil)
	_ caddyhttp.MiddlewareHandler = (*FacilitatorHandler)(nil)
)
