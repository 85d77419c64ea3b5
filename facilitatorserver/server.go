package facilitatorserver

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Endpoints of a Server, named by the last segment of the request path.
const (
	EndpointSupported = "supported"
	EndpointVerify    = "verify"
	EndpointSettle    = "settle"
	EndpointHealth    = "health"
)

// Endpoint names the endpoint a request path is for by its last segment, or "" when it names none.
func Endpoint(path string) string {
	if strings.HasSuffix(path, "/"+EndpointDiscoveryResources) {
		return EndpointDiscoveryResources
	}
	switch seg := path[strings.LastIndexByte(path, '/')+1:]; seg {
	case EndpointSupported, EndpointVerify, EndpointSettle, EndpointHealth:
		return seg
	}
	return ""
}

// Options configure a Server. The zero Options serve every kind and network of the facilitator behind, to
// anyone, with bodies up to x402.MaxBodyBytes.
type Options struct {
	// Kinds restricts the asset transfer methods served ("permit2", "eip3009", "erc2612"); none: every method
	// of the facilitator behind. /supported lists only these; /verify and /settle refuse others.
	Kinds []string
	// Networks restricts the CAIP-2 networks served; none: every network of the facilitator behind.
	Networks []string
	// APIKeys, when any, are the keys of which a request must present one in the x-api-key header; without a
	// match it gets 401. Keys are compared as hashes in constant time and never logged or echoed.
	APIKeys []string
	// MaxBodySize is the largest /verify or /settle body accepted, in bytes; a larger one gets 413.
	// 0: x402.MaxBodyBytes, which is also the most it may be.
	MaxBodySize int64
	// Terms refuse payments below a minimum amount or to other recipients before the facilitator is asked.
	Terms Terms
	// SettleRateLimit caps the /settle calls per client IP and per payer.
	SettleRateLimit RateLimit
	// VerifyRateLimit caps the /verify calls per client IP that the facilitator behind refuses or fails. It is
	// counted in memory, by each server on its own.
	VerifyRateLimit VerifyRateLimit
	// SharedCounts, when set, returns where the SettleRateLimit counts, shared with the other servers of a
	// cluster, or nil while there is no such place (yet): then, and while it does not answer, the server counts
	// in memory.
	SharedCounts func() SharedCounts
	// ClientIP names the client of a request for the PerIP limits; nil: the host of r.RemoteAddr. A server
	// behind proxies it trusts says here which client they name.
	ClientIP func(r *http.Request) string
	// Await, when set, is waited on by every request once its API key is accepted and before anything else is
	// read of it, for a facilitator that starts after the server is built: an error is answered 503 with its
	// text, and the facilitator behind is not called before Await has returned nil.
	Await func(ctx context.Context) error
	// Redact hides secrets (the API keys in RPC URLs) in error texts of the facilitator behind, wherever they
	// are logged or answered; nil: the texts are used as they are.
	Redact func(s string) string
	// Describe, when set, is what an answer says of a failure of the facilitator behind (a 502 or 500, or an
	// unknown /health), in place of its redacted error text: a remote facilitator's errors name its URL and the
	// hosts behind it, which belong in the log only. payment names the payment's kind and network, or is "".
	Describe func(err error, payment string) string
	// UpgradeV1 passes version 1 requests on in the version 2 shape, for a facilitator behind that reads
	// version 1 only in its own shape (a remote one). An erc2612 permit, the one kind version 1 is served for,
	// signs no version, so the converted payment is the same payment.
	UpgradeV1 bool
	// Logger receives what the server does with payments; nil: no log. API keys never reach it.
	Logger *zap.Logger
	// Metrics, when set, is told of each verification, settlement and answer.
	Metrics Metrics
	// Catalog, when set, returns where the resources of settled payments that declare the bazaar extension are
	// catalogued and GET /discovery/resources lists them from, or nil while there is no such place (yet).
	Catalog func() Catalog
	// DiscoveryEntries bounds the catalog; 0: DefaultDiscoveryEntries.
	DiscoveryEntries int
}

// Metrics receives a Server's measurements. Its methods must be safe for concurrent use.
type Metrics interface {
	// ObserveVerify records how long the facilitator behind took to answer (or fail) a verification.
	ObserveVerify(took time.Duration)
	// ObserveSettle records how long the facilitator behind took to answer (or fail) a settlement.
	ObserveSettle(took time.Duration)
	// ObserveOutcome counts one /verify or /settle answer by endpoint and reason code; "" is success.
	ObserveOutcome(endpoint, reason string)
}

// Server serves an x402.Facilitator over HTTP: GET /supported, POST /verify, POST /settle and GET /health, by
// the last segment of the request path, so that it serves the same under any prefix.
//
// A refused payment is a full VerifyResponse or SettleResponse with HTTP 200; a malformed body is 400 and names
// the field; a body too large is 413; a wrong method is 405 with Allow; a missing or wrong API key is 401; a
// /settle or /verify over its rate limit is 429 with Retry-After; a facilitator behind that gives no answer is 502 (500
// for an error that is no x402.FacilitatorError) with a JSON error, and a settlement it could not make now and of
// which it sent nothing (x402.ErrSentNothing) is 503 with Retry-After and `"sent": false` in its error body. A Server
// is safe for concurrent use.
type Server struct {
	f        x402.Facilitator
	opts     Options
	kinds    map[string]bool // nil: every kind
	networks map[string]bool // nil: every network
	keys     [][sha256.Size]byte
	maxBody  int64
	limiter  *settleLimiter // nil: no rate limit of /settle
	verifies *clientLimit   // nil: no rate limit of /verify
	registry *x402.Registry
	health   *healthCache
	logger   *zap.Logger
	metrics  Metrics
}

// New returns a server of f configured by o.
func New(f x402.Facilitator, o Options) (*Server, error) {
	if f == nil {
		return nil, errors.New("facilitatorserver: no facilitator to serve")
	}
	s := &Server{
		f: f, opts: o, maxBody: o.MaxBodySize, registry: x402.NewRegistry(), health: &healthCache{ttl: healthCacheTTL},
		logger: o.Logger, metrics: o.Metrics,
	}
	if s.maxBody == 0 {
		s.maxBody = x402.MaxBodyBytes
	}
	if s.maxBody < 0 || s.maxBody > x402.MaxBodyBytes {
		return nil, fmt.Errorf("facilitatorserver: the body limit is %d bytes; want 1 to %d (larger bodies are never valid requests)", o.MaxBodySize, x402.MaxBodyBytes)
	}
	for i, k := range o.APIKeys {
		if k == "" {
			return nil, fmt.Errorf("facilitatorserver: API key #%d is empty", i+1)
		}
		s.keys = append(s.keys, sha256.Sum256([]byte(k)))
	}
	for _, r := range []struct {
		name string
		n    int
	}{{"settle rate limit per IP", o.SettleRateLimit.PerIP}, {"settle rate limit per payer", o.SettleRateLimit.PerPayer}, {"verify rate limit per IP", o.VerifyRateLimit.PerIP}} {
		if r.n < 0 || r.n > MaxPerMinute {
			return nil, fmt.Errorf("facilitatorserver: the %s is %d a minute; want 0 (no limit) to %d", r.name, r.n, MaxPerMinute)
		}
	}
	if err := checkIPv6Prefix("facilitatorserver: the settle rate limit's IPv6 prefix", o.SettleRateLimit.IPv6Prefix); err != nil {
		return nil, err
	}
	if err := checkIPv6Prefix("facilitatorserver: the verify rate limit's IPv6 prefix", o.VerifyRateLimit.IPv6Prefix); err != nil {
		return nil, err
	}
	s.verifies = newClientLimit(o.VerifyRateLimit.PerIP, o.VerifyRateLimit.IPv6Prefix, nil)
	if len(o.Kinds) > 0 {
		s.kinds = map[string]bool{}
		for _, k := range o.Kinds {
			s.kinds[k] = true
		}
	}
	if len(o.Networks) > 0 {
		s.networks = map[string]bool{}
		for _, n := range o.Networks {
			s.networks[n] = true
		}
	}
	if s.logger == nil {
		s.logger = zap.NewNop()
	}
	s.limiter = newSettleLimiter(o.SettleRateLimit, o.SharedCounts, s.logger, nil)
	if s.metrics == nil {
		s.metrics = noMetrics{}
	}
	return s, nil
}

// reply is one answer of the server, written as JSON.
type reply struct {
	status     int
	body       any
	allow      string // the Allow header of a 405
	retryAfter int    // the Retry-After header of a 429, in seconds
	// extensionResponses is the EXTENSION-RESPONSES header of a /settle answer, or "".
	extensionResponses string
}

// errorBody is the JSON body of an answer that is not a protocol document.
type errorBody struct {
	Error string `json:"error"`
	// Field is the JSON path of the offending field of a malformed body.
	Field string `json:"field,omitempty"`
	// Sent is false in the 503 of a /settle the facilitator behind surely sent nothing of, nor anything before it
	// (x402.ErrSentNothing: its engine's journal shows the payment's claim released): the payment may be presented
	// again, here or elsewhere, and a refusal of it then is final. Absent, a failed /settle may have settled the
	// payment. Never in an answer that asked nothing of the facilitator behind (the rate limits' 429): an earlier
	// call of the same payment may have reached it and be settling it.
	Sent *bool `json:"sent,omitempty"`
}

// notSent is the Sent of an errorBody that says nothing was sent.
func notSent() *bool { f := false; return &f }

func errorReply(status int, format string, args ...any) reply {
	return reply{status: status, body: errorBody{Error: fmt.Sprintf(format, args...)}}
}

// ServeHTTP answers the request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.Serve(w, r)
}

// Serve answers the request as ServeHTTP does, and returns the status and the number of body bytes it wrote,
// for an access log or a request count.
func (s *Server) Serve(w http.ResponseWriter, r *http.Request) (status, size int) {
	return s.respond(w, r, Endpoint(r.URL.Path))
}

// ServeHealth answers r as GET /health, whatever its path: for a status page mounted elsewhere (Caddy's admin
// API) that must say what /health says, redacted, cached and laid out the same.
func (s *Server) ServeHealth(w http.ResponseWriter, r *http.Request) (status, size int) {
	return s.respond(w, r, EndpointHealth)
}

func (s *Server) respond(w http.ResponseWriter, r *http.Request, endpoint string) (status, size int) {
	res := s.serve(r, endpoint)
	if endpoint == EndpointHealth && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		// One URL, two forms: a cache must not hand a browser's page to a monitor, nor the JSON to a browser.
		w.Header().Add("Vary", "Accept")
		if x402.WantsHTML(r) {
			return res.status, WriteHealthPage(w, res.status, res.body)
		}
	}
	return res.status, writeReply(w, res)
}

func (s *Server) serve(r *http.Request, endpoint string) reply {
	if endpoint == EndpointDiscoveryResources {
		// Public, as the SDK's discovery clients expect: it lists what servers declared in their 402s, and
		// reaches neither the facilitator behind nor anything of a payment.
		return s.serveDiscoveryResources(r)
	}
	if !s.authorized(r) {
		return errorReply(http.StatusUnauthorized, "missing or wrong x-api-key header: this facilitator needs an API key")
	}
	if s.opts.Await != nil {
		if err := s.opts.Await(r.Context()); err != nil {
			return errorReply(http.StatusServiceUnavailable, "the embedded facilitator is not running: %v", err)
		}
	}
	switch endpoint {
	case EndpointSupported, EndpointHealth:
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			res := errorReply(http.StatusMethodNotAllowed, "%s /%s is not served; use GET", r.Method, endpoint)
			res.allow = "GET, HEAD"
			return res
		}
		if endpoint == EndpointSupported {
			return s.serveSupported(r.Context())
		}
		return s.health.get(r.Context(), s.serveHealth)
	case EndpointVerify, EndpointSettle:
		if r.Method != http.MethodPost {
			res := errorReply(http.StatusMethodNotAllowed, "%s /%s is not served; use POST with a JSON body", r.Method, endpoint)
			res.allow = http.MethodPost
			return res
		}
		return s.servePayment(r, endpoint)
	}
	return errorReply(http.StatusNotFound, "no facilitator endpoint at %q; this facilitator serves GET /supported, POST /verify, POST /settle, GET /health and GET /discovery/resources",
		r.URL.Path)
}

// authorized reports whether the request carries one of the API keys, or none is needed. Every key is
// compared, and compared as a hash, so that neither the time taken nor the length of a key gives it away.
func (s *Server) authorized(r *http.Request) bool {
	if len(s.keys) == 0 {
		return true
	}
	got := sha256.Sum256([]byte(r.Header.Get(x402.HeaderAPIKey)))
	match := 0
	for i := range s.keys {
		match |= subtle.ConstantTimeCompare(got[:], s.keys[i][:])
	}
	return match == 1
}

func (s *Server) serveSupported(ctx context.Context) reply {
	resp, err := s.f.Supported(ctx)
	if err != nil {
		return s.failure(EndpointSupported, err, "")
	}
	return reply{status: http.StatusOK, body: s.FilterSupported(resp)}
}

// FilterSupported is what /supported answers when the facilitator behind supports resp: the kinds, signers and
// extensions of the networks and methods this server serves.
func (s *Server) FilterSupported(resp x402.SupportedResponse) x402.SupportedResponse {
	out := x402.SupportedResponse{Kinds: []x402.SupportedKind{}, Extensions: []string{}, Signers: map[string][]string{}}
	permit2 := false
	for _, k := range resp.Kinds {
		if s.serves(k.Extra.AssetTransferMethod, k.Network) {
			out.Kinds = append(out.Kinds, k)
			permit2 = permit2 || k.Extra.AssetTransferMethod == x402.TransferPermit2
		}
	}
	for _, e := range resp.Extensions {
		if (e != x402.ExtensionEIP2612GasSponsoring && e != x402.ExtensionERC20ApprovalGasSponsoring) || permit2 {
			out.Extensions = append(out.Extensions, e)
		}
	}
	for pattern, addrs := range resp.Signers {
		// A wildcard pattern such as "eip155:*" may cover a served network; exact ids are kept if served.
		if s.networks == nil || s.networks[pattern] || strings.HasSuffix(pattern, "*") {
			out.Signers[pattern] = addrs
		}
	}
	return out
}

// serves reports whether the server serves a method on a network.
func (s *Server) serves(method, network string) bool {
	return (s.kinds == nil || s.kinds[method]) && (s.networks == nil || s.networks[network])
}

// servePayment answers /verify and /settle. A /settle call is counted against the client IP's rate limit before
// its body is read, and against its payer's once the body names one; a call over either gets 429 and goes no
// further. The payer's count is given back when the answer carries no transaction: nothing was sent. A /verify
// call is counted when it is about to reach the facilitator behind (see limitedVerify).
func (s *Server) servePayment(r *http.Request, endpoint string) reply {
	settle := endpoint == EndpointSettle
	if settle {
		ip := s.clientIP(r)
		if res, ok := s.limiter.takeIP(r.Context(), ip); !ok {
			s.logger.Debug("settlement refused: client IP over its rate limit", zap.String("client_ip", ip))
			return res
		}
	}
	if r.ContentLength > s.maxBody {
		return errorReply(http.StatusRequestEntityTooLarge, "the body is %d bytes; this facilitator accepts at most %d", r.ContentLength, s.maxBody)
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, s.maxBody+1))
	if err != nil {
		return errorReply(http.StatusBadRequest, "reading the body: %v", err)
	}
	if int64(len(body)) > s.maxBody {
		return errorReply(http.StatusRequestEntityTooLarge, "the body is more than %d bytes, the most this facilitator accepts", s.maxBody)
	}
	if isBatchBody(body) {
		return s.serveBatch(r, body, endpoint)
	}
	req, v1, err := s.registry.DecodeFacilitatorRequest(body)
	if err != nil {
		var de *x402.DecodeError
		if errors.As(err, &de) && de.Kind == x402.DecodeTooLarge {
			return errorReply(http.StatusRequestEntityTooLarge, "%v", err)
		}
		res := errorReply(http.StatusBadRequest, "%v", err)
		if de != nil {
			res.body = errorBody{Error: err.Error(), Field: de.Field}
		}
		return res
	}
	if !settle {
		return s.answerPayment(r, req, v1, endpoint)
	}
	payer := x402.ClaimedPayer(req)
	res, ok, shared := s.limiter.takePayer(r.Context(), payer)
	if !ok {
		s.logger.Debug("settlement refused: payer over its rate limit", zap.String("payer", payer))
		return res
	}
	res = s.answerPayment(r, req, v1, endpoint)
	if sr, ok := res.body.(x402.SettleResponse); ok && sr.Transaction == "" {
		s.limiter.refundPayer(r.Context(), payer, shared)
	}
	return res
}

// clientIP names the client of r for the rate limits.
func (s *Server) clientIP(r *http.Request) string {
	if s.opts.ClientIP != nil {
		return s.opts.ClientIP(r)
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// answerPayment answers a decoded /verify or /settle: refused here when the server does not serve its kind or
// its terms, else by the facilitator behind.
func (s *Server) answerPayment(r *http.Request, req x402.VerifyRequest, v1 bool, endpoint string) reply {
	if reason, message := s.refusal(req); reason != "" {
		s.logger.Info("payment refused: not served by this route", zap.String("endpoint", endpoint),
			zap.String("network", req.PaymentRequirements.Network), zap.String("reason", reason))
		s.metrics.ObserveOutcome(endpoint, reason)
		payer := x402.ClaimedPayer(req)
		if endpoint == EndpointVerify {
			return reply{status: http.StatusOK, body: x402.VerifyResponse{Payer: payer, InvalidReason: reason, InvalidMessage: message}}
		}
		return reply{status: http.StatusOK, body: x402.SettleResponse{
			Network: s.networkName(req.PaymentRequirements.Network, v1), Payer: payer, ErrorReason: reason, ErrorMessage: message,
		}}
	}
	if v1 && s.opts.UpgradeV1 {
		req.X402Version, req.PaymentPayload.X402Version = x402.Version2, x402.Version2
	}
	if endpoint == EndpointVerify {
		return s.limitedVerify(r, req)
	}
	// A settlement runs to its end even when the caller hangs up: it may have been broadcast, and its
	// answer must reach the journal (and the caller, if it asks again).
	return s.settle(context.WithoutCancel(r.Context()), req, v1)
}

// limitedVerify verifies req within the client's VerifyRateLimit: a call is counted before the facilitator
// behind is asked, so that a burst of them costs it no more than the limit, and given back when the payment
// turns out valid.
func (s *Server) limitedVerify(r *http.Request, req x402.VerifyRequest) reply {
	if s.verifies == nil {
		return s.verify(r.Context(), req)
	}
	ip := s.clientIP(r)
	if ok, who, wait := s.verifies.take(ip); !ok {
		s.logger.Debug("verification refused: client over its rate limit", zap.String("client", who))
		return tooManyVerifications(s.verifies, who, wait, x402.ClaimedPayer(req))
	}
	res := s.verify(r.Context(), req)
	if v, ok := res.body.(x402.VerifyResponse); ok && v.IsValid {
		s.verifies.refund(ip)
	}
	return res
}

func (s *Server) verify(ctx context.Context, req x402.VerifyRequest) reply {
	start := time.Now()
	resp, err := s.f.Verify(ctx, req)
	took := time.Since(start)
	s.metrics.ObserveVerify(took)
	if err != nil {
		return s.failure(EndpointVerify, err, paymentKind(req))
	}
	s.metrics.ObserveOutcome(EndpointVerify, resp.InvalidReason)
	if c := s.logger.Check(zap.DebugLevel, "verified"); c != nil {
		c.Write(zap.Bool("valid", resp.IsValid), zap.String("payer", resp.Payer),
			zap.String("network", req.PaymentRequirements.Network), zap.String("amount", req.PaymentRequirements.Amount),
			zap.String("reason", resp.InvalidReason), zap.Duration("took", took))
	}
	return reply{status: http.StatusOK, body: resp}
}

func (s *Server) settle(ctx context.Context, req x402.SettleRequest, v1 bool) reply {
	start := time.Now()
	resp, err := s.f.Settle(ctx, req)
	took := time.Since(start)
	s.metrics.ObserveSettle(took)
	if err != nil {
		return s.failure(EndpointSettle, err, paymentKind(req))
	}
	s.metrics.ObserveOutcome(EndpointSettle, resp.ErrorReason)
	fields := []zap.Field{
		zap.String("payer", resp.Payer), zap.String("network", resp.Network),
		zap.String("amount", req.PaymentRequirements.Amount), zap.String("transaction", resp.Transaction),
		zap.Duration("took", took),
	}
	switch {
	case resp.Success:
		s.logger.Info("settled", fields...)
	case resp.Pending():
		s.logger.Warn("settlement broadcast, receipt not seen yet", fields...)
	default:
		s.logger.Info("settlement refused", append(fields, zap.String("reason", resp.ErrorReason))...)
	}
	resp.Network = s.networkName(resp.Network, v1)
	res := reply{status: http.StatusOK, body: resp}
	if resp.Success {
		res.extensionResponses = s.catalogSettled(ctx, req)
	}
	return res
}

// failure answers a call that got no answer from the facilitator behind: 502 with what went wrong, and for a
// settlement the warning that it may have happened all the same. payment names the payment's kind, if any.
func (s *Server) failure(endpoint string, err error, payment string) reply {
	logged := s.redact(err.Error())
	s.logger.Error("the facilitator gave no answer", zap.String("endpoint", endpoint), zap.String("error", logged))
	status := http.StatusBadGateway
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) {
		status = http.StatusInternalServerError
	}
	msg := s.answerText(err, logged, payment)
	if endpoint == EndpointSettle && errors.Is(err, x402.ErrSentNothing) && status == http.StatusBadGateway {
		// Surely nothing on its way: the payer's payment is as good as before, to be presented again.
		return reply{status: http.StatusServiceUnavailable, retryAfter: 1,
			body: errorBody{Error: msg + "; nothing was sent: send the same payload to /settle again", Sent: notSent()}}
	}
	if endpoint == EndpointSettle {
		msg += "; the payment may have settled: send the same payload to /settle again to learn its outcome, never a new payment"
	}
	return reply{status: status, body: errorBody{Error: msg}}
}

// answerText is what an answer says of err, a failure of the facilitator behind: Options.Describe's words, or
// else the error's own (logged is its redacted text).
func (s *Server) answerText(err error, logged, payment string) string {
	if s.opts.Describe != nil {
		return s.opts.Describe(err, payment)
	}
	return logged
}

// paymentKind names a payment's transfer method and network, for an error answer.
func paymentKind(req x402.VerifyRequest) string {
	rq := req.PaymentRequirements
	return x402.TransferMethod(rq, req.PaymentPayload.Payload) + " payment on " + rq.Network
}

// redact hides the secrets Options.Redact knows of in a text bound for an answer or a log.
func (s *Server) redact(text string) string {
	if s.opts.Redact == nil || text == "" {
		return text
	}
	return s.opts.Redact(text)
}

// refusal says why the server does not serve a payment's kind or terms, or "" when it does.
func (s *Server) refusal(req x402.VerifyRequest) (reason, message string) {
	rq := req.PaymentRequirements
	method := x402.TransferMethod(rq, req.PaymentPayload.Payload)
	switch {
	case s.networks != nil && !s.networks[rq.Network]:
		return x402.ReasonInvalidNetwork, fmt.Sprintf("network %q is not served by this facilitator (it serves %s)", rq.Network, strings.Join(s.opts.Networks, ", "))
	case s.kinds != nil && !s.kinds[method]:
		return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("this facilitator does not settle %s payments (it settles %s)", method, strings.Join(s.opts.Kinds, ", "))
	case req.X402Version == x402.Version1 && method != x402.TransferERC2612:
		return x402.ReasonInvalidX402Version, fmt.Sprintf("%s payments need x402Version 2; version 1 is served for erc2612 only", method)
	}
	return s.opts.Terms.Refusal(req)
}

// networkName is the network as the caller named it: the version 1 name for a version 1 request.
func (s *Server) networkName(caip2 string, v1 bool) string {
	if !v1 {
		return caip2
	}
	if name, err := s.registry.V1Name(caip2); err == nil {
		return name
	}
	return caip2
}

// writeReply writes res as JSON and returns how many bytes of body it wrote.
func writeReply(w http.ResponseWriter, res reply) int {
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
	if res.extensionResponses != "" {
		hdr.Set(x402.HeaderExtensionResponses, res.extensionResponses)
	}
	w.WriteHeader(res.status)
	n, _ := w.Write(append(body, '\n'))
	return n
}

// noMetrics measures nothing.
type noMetrics struct{}

func (noMetrics) ObserveVerify(time.Duration)   {}
func (noMetrics) ObserveSettle(time.Duration)   {}
func (noMetrics) ObserveOutcome(string, string) {}

var _ http.Handler = (*Server)(nil)
