package e2e

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"math/rand/v2"
	"mime"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The client side of the money-invariant run: payments and what each presentation of them got, the request
// shapes a payment is presented in, and the HTTP clients that send them. The client keeps its own records:
// the checks judge the chain against them.

// invResource is what a payment buys: a method and a path, on whichever gateway.
type invResource struct{ method, path string }

func (r invResource) String() string { return r.method + " " + r.path }

// invPayment is one signed payment and every answer its presentations got.
type invPayment struct {
	n          int
	payer      *invPayer
	route      *routeKind
	req        x402.PaymentRequirements // the requirement it pays, as signed
	headerName string
	header     string
	nonce      string
	amount     *big.Int    // what it authorizes: the price, or upto's maximum
	use        string      // upto: what the upstream names for it (see overrideFor)
	transport  int         // the worker whose payer.Transport signed it, -1 for none
	gen        int         // the configuration the gateways ran when it was signed (invWorld.gen)
	signed     time.Time   // when the offer it was signed from was asked for (a reload may have changed its terms since)
	first      invResource // the resource it was first presented for
	firstShape string
	firstGate  int
	fromPage   bool // signed from the offer a paywall page embeds (invariants_browser_test.go)

	mu         sync.Mutex
	answers    []*invAnswer
	bound      *invResource // the resource of its first 2xx (or 101) answer: the one it bought
	deliveries []*invAnswer // whole responses
}

// invAnswer is one presentation of a payment and what came of it.
type invAnswer struct {
	action    int
	gate      int
	res       invResource
	shape     string
	gen       int // the configuration the gateways ran when it was sent (invWorld.gen)
	sent, got time.Time
	status    int    // 0: no answer
	whole     bool   // a whole response of the resource asked for
	note      string // the refusal's reason, the error, or what was wrong with the response
	outcome   string // the gate's outcome, as its JSON error body names it
	gateError string // the gate's error, as its JSON error body says it (whole: note is shortened)
	settle    *x402.SettleResponse
	final     bool // a whole response, or a refusal that presenting again would not change
	wrong     bool // a 2xx whose body is not the resource asked for
	page      bool // its body was the gate's paywall page (invariants_browser_test.go)
	json      bool // its body was JSON
}

func (a *invAnswer) String() string {
	s := fmt.Sprintf("#%d gw%d %s [%s] ", a.action, a.gate, a.res, a.shape)
	switch {
	case a.status == 0:
		s += "no answer"
	default:
		s += strconv.Itoa(a.status)
	}
	if a.whole {
		s += " whole"
	}
	if a.settle != nil {
		switch {
		case a.settle.Success:
			s += fmt.Sprintf(" settled %s tx %s", cmp.Or(a.settle.Amount, "?"), shortHash(a.settle.Transaction))
		case a.settle.Pending():
			s += " pending"
		default:
			s += " failed " + a.settle.ErrorReason
		}
	}
	if a.note != "" {
		s += " (" + a.note + ")"
	}
	return s
}

func shortHash(h string) string {
	if len(h) > 12 {
		return h[:12]
	}
	return h
}

// A payment's history shows its first answers and its last ones, invShownAnswers in all.
const invShownAnswers, invShownLast = 12, 4

// String is the payment's one-line history.
func (p *invPayment) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var as []string
	for i, a := range p.answers {
		if i == invShownAnswers-invShownLast && len(p.answers) > invShownAnswers {
			as = append(as, fmt.Sprintf("... %d more ...", len(p.answers)-invShownAnswers))
		}
		if i < invShownAnswers-invShownLast || i >= len(p.answers)-invShownLast {
			as = append(as, a.String())
		}
	}
	use := ""
	if p.route.scheme == x402.SchemeUpto {
		use = ", upstream names " + cmp.Or(p.use, "none")
	}
	by := ""
	if p.transport >= 0 {
		by = fmt.Sprintf(", signed by worker %d's payer.Transport", p.transport)
	}
	return fmt.Sprintf("payment #%d (%s %s of %s on %q, payer %d, %s %s%s%s, first %s): %s", p.n, p.route.scheme, p.route.method,
		p.amount, p.route.name, p.payer.n, x402.HeaderPaymentSignature, shortHash(p.nonce), use, by, p.first, strings.Join(as, "; "))
}

// delivered reports how many whole responses the payment bought.
func (p *invPayment) delivered() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.deliveries)
}

// lastAt returns the last answer to a presentation of the payment for res, nil when there was none.
func (p *invPayment) lastAt(res invResource) *invAnswer {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i := len(p.answers) - 1; i >= 0; i-- {
		if p.answers[i].res == res {
			return p.answers[i]
		}
	}
	return nil
}

// home is the resource the payment bought or was first presented for.
func (p *invPayment) home() invResource {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bound != nil {
		return *p.bound
	}
	return p.first
}

// homes are the resources the payment may have bought, in the order to present it again for them: the one it
// bought when an answer showed it; else each it was presented for without a final answer (no answer, a 5xx: the
// gate may have recorded it there, as when a settle-before request's body was cut short after its payment
// settled), in the order presented, then the one it was first presented for.
func (p *invPayment) homes() []invResource {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bound != nil {
		return []invResource{*p.bound}
	}
	var out []invResource
	for _, a := range p.answers {
		if !a.final && !slices.Contains(out, a.res) {
			out = append(out, a.res)
		}
	}
	if !slices.Contains(out, p.first) {
		out = append(out, p.first)
	}
	return out
}

// charge is what a payment owes once it delivered its response: the price, or for upto what the upstream named
// (capped at the maximum; the default when it named none or nothing readable).
func (p *invPayment) charge() *big.Int {
	if p.route.scheme != x402.SchemeUpto {
		return new(big.Int).Set(p.amount)
	}
	if n := bigIntOf(p.use); n != nil {
		if n.Cmp(p.amount) > 0 {
			return new(big.Int).Set(p.amount)
		}
		return n
	}
	if p.route.defaultAmount == "zero" {
		return new(big.Int)
	}
	return new(big.Int).Set(p.amount)
}

// bigIntOf parses a decimal amount; nil when it does not parse.
func bigIntOf(s string) *big.Int {
	n, ok := new(big.Int).SetString(s, 10)
	if !ok || n.Sign() < 0 {
		return nil
	}
	return n
}

// invShape is a way of presenting a payment: the request's method and form, and the routes it fits.
type invShape struct {
	name   string
	method string
	weight int
	fits   func(rk *routeKind, path string) bool
}

func upstreamRoute(rk *routeKind, _ string) bool { return rk.serve == serveUpstream }

func fileRoute(rk *routeKind, _ string) bool { return rk.serve == serveFiles }

// notWebSocket fits the routes asked for with plain HTTP requests: neither WebSocket nor MCP routes.
func notWebSocket(rk *routeKind, _ string) bool {
	return rk.serve != serveWebSocket && rk.serve != serveMCP
}

// bigFile fits the files a client can surely cut short (see invBigFile).
func bigFile(rk *routeKind, path string) bool {
	if rk.serve != serveFiles {
		return false
	}
	for _, f := range invFiles {
		if strings.HasSuffix(path, "/"+f.name) {
			return f.size >= invBigFile
		}
	}
	return false
}

// The request shapes. Adding one is adding a row here and a case to send.
const (
	shapeGET          = "GET"
	shapeHEAD         = "HEAD"
	shapePOST         = "POST"
	shapeRange        = "Range"
	shapeUpgrade      = "upgrade headers"
	shapeExpect       = "Expect: 100-continue"
	shapeH2           = "HTTP/2 (h2c)"
	shapeCut          = "response cut short"
	shapeH2Reset      = "HTTP/2 stream reset"
	shapeBodyCut      = "request body cut short"
	shapeWebSocket    = "WebSocket"
	invRequestBody    = 2048 // the body of a POST
	invCutRequestBody = 700  // of which a cut-short request sends this much
)

var invShapes = []invShape{
	{shapeGET, http.MethodGet, 6, notWebSocket},
	{shapeHEAD, http.MethodHead, 2, notWebSocket},
	{shapePOST, http.MethodPost, 1, upstreamRoute},
	{shapeRange, http.MethodGet, 2, fileRoute},
	{shapeUpgrade, http.MethodGet, 3, upstreamRoute},
	{shapeExpect, http.MethodPost, 2, upstreamRoute},
	{shapeH2, http.MethodGet, 3, notWebSocket},
	{shapeCut, http.MethodGet, 6, bigFile},
	{shapeH2Reset, http.MethodGet, 4, bigFile},
	{shapeBodyCut, http.MethodPost, 2, upstreamRoute},
	{shapeWebSocket, http.MethodGet, 6, func(rk *routeKind, _ string) bool { return rk.serve == serveWebSocket }},
	{shapeMCP, http.MethodPost, 4, mcpRoute},
	{shapeMCPSSE, http.MethodPost, 2, mcpRoute},
	{shapeMCPH2, http.MethodPost, 2, mcpRoute},
	{shapeBrowserFetch, http.MethodGet, 3, browserRoute},
	{shapeBrowserNav, http.MethodGet, 2, browserRoute},
	{shapeBrowserHEAD, http.MethodHead, 1, browserRoute},
}

// plainShape is the shape a payment is presented in again to get its response from rk: the plain request of its
// method, the WebSocket handshake it was bought with, or a tool call.
func plainShape(rk *routeKind, method, firstShape string) string {
	switch {
	case rk != nil && rk.serve == serveMCP:
		return shapeMCP
	case firstShape == shapeWebSocket:
		return shapeWebSocket
	case method == http.MethodHead:
		return shapeHEAD
	case method == http.MethodPost:
		return shapePOST
	}
	return shapeGET
}

// pickShape draws a shape that fits path of rk, and whose method is method unless that is "".
func pickShape(rng *rand.Rand, rk *routeKind, path, method string) string {
	var fit []invShape
	total := 0
	for _, s := range invShapes {
		if s.fits(rk, path) && (method == "" || s.method == method) {
			fit = append(fit, s)
			total += s.weight
		}
	}
	if total == 0 {
		return plainShape(rk, method, "")
	}
	n := rng.IntN(total)
	for _, s := range fit {
		if n < s.weight {
			return s.name
		}
		n -= s.weight
	}
	return fit[len(fit)-1].name
}

func shapeMethod(name string) string {
	for _, s := range invShapes {
		if s.name == name {
			return s.method
		}
	}
	return http.MethodGet
}

// invClient holds the HTTP clients of the run's payers.
type invClient struct {
	h1      *http.Client // kept-alive HTTP/1.1
	fresh   *http.Client // a connection per request, its receive buffer capped: for cuts and upgrade headers
	h2c     *http.Client // HTTP/2 without TLS
	h2small *http.Client // HTTP/2 without TLS, a small stream window: for stream resets
	all     []*http.Transport
}

// invRequestTimeout outlasts the gate's settlement timeout (2 minutes) with a fault proxy hanging.
const invRequestTimeout = 150 * time.Second

func newInvClient() *invClient {
	c := &invClient{}
	mk := func(configure func(*http.Transport)) *http.Client {
		tr := &http.Transport{MaxIdleConnsPerHost: 16, ExpectContinueTimeout: 2 * time.Second, DisableCompression: true}
		configure(tr)
		c.all = append(c.all, tr)
		return &http.Client{Transport: tr, Timeout: invRequestTimeout,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	c.h1 = mk(func(*http.Transport) {})
	c.fresh = mk(func(tr *http.Transport) {
		tr.DisableKeepAlives = true
		d := &net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
			var err error
			if cerr := rc.Control(func(fd uintptr) { err = capReceiveBuffer(fd, 32<<10) }); cerr != nil {
				return cerr
			}
			return err
		}}
		tr.DialContext = d.DialContext
	})
	h2c := func(window int) func(*http.Transport) {
		return func(tr *http.Transport) {
			tr.Protocols = new(http.Protocols)
			tr.Protocols.SetUnencryptedHTTP2(true)
			if window > 0 {
				tr.HTTP2 = &http.HTTP2Config{MaxReceiveBufferPerStream: window}
			}
		}
	}
	c.h2c = mk(h2c(0))
	c.h2small = mk(h2c(64 << 10))
	return c
}

func (c *invClient) closeIdle() {
	for _, tr := range c.all {
		tr.CloseIdleConnections()
	}
}

// send presents payment p to gateway base (the gateway's URL) for res in shape, and returns the answer; the
// caller records it. draw, in [0, 1), places a Range and, for the shapes that cut a response short, is the
// fraction of the body read first.
func (r *invRun) send(ctx context.Context, p *invPayment, base string, res invResource, shape string, draw float64) *invAnswer {
	a := &invAnswer{res: res, shape: shape, sent: time.Now(), gen: r.w.generation()}
	defer func() { a.got = time.Now() }()
	url := base + res.path
	switch shape {
	case shapeWebSocket:
		r.sendWebSocket(ctx, a, p, base)
		return a
	case shapeBodyCut:
		r.sendCutBody(ctx, a, p, base)
		return a
	case shapeMCP, shapeMCPSSE, shapeMCPH2:
		r.sendMCP(ctx, a, p, base, res, shape)
		return a
	}
	var body io.Reader
	bodyLen := 0
	if res.method == http.MethodPost {
		body, bodyLen = bytes.NewReader(bytes.Repeat([]byte{'x'}, invRequestBody)), invRequestBody
	}
	req, err := http.NewRequestWithContext(ctx, res.method, url, body)
	if err != nil {
		a.note = err.Error()
		return a
	}
	r.setPaymentHeaders(req.Header, p)
	client := r.client.h1
	var rangeFrom, rangeTo int
	switch shape {
	case shapeRange:
		size := len(r.w.files[res.path])
		rangeFrom = int(draw * float64(size/2))
		rangeTo = rangeFrom + int((1-draw)*float64(size-rangeFrom-1))
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", rangeFrom, rangeTo))
	case shapeUpgrade:
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", "x-invariant")
		client = r.client.fresh
	case shapeExpect:
		req.Header.Set("Expect", "100-continue")
	case shapeH2:
		client = r.client.h2c
	case shapeCut:
		client = r.client.fresh
	case shapeH2Reset:
		client = r.client.h2small
	case shapeBrowserFetch, shapeBrowserNav, shapeBrowserHEAD:
		req.Header.Set("Accept", browserAccept(shape))
	}
	cutAt := -1
	if shape == shapeCut || shape == shapeH2Reset {
		cutAt = max(1, int(draw*float64(len(r.w.files[res.path]))))
	}
	resp, err := client.Do(req)
	r.readAnswer(a, p, resp, err, cutAt, bodyLen, rangeFrom, rangeTo)
	return a
}

// readAnswer reads the answer to a presentation into a: the settlement, and the body, read whole or, with
// cutAt >= 0, only that far before the client hangs up.
func (r *invRun) readAnswer(a *invAnswer, p *invPayment, resp *http.Response, err error, cutAt, bodyLen, rangeFrom, rangeTo int) {
	if err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	defer resp.Body.Close()
	a.status = resp.StatusCode
	if s, err := x402.DecodeSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse)); err == nil && resp.Header.Get(x402.HeaderPaymentResponse) != "" {
		a.settle = &s
	}
	var got []byte
	if cutAt >= 0 && resp.StatusCode < 300 {
		got, err = io.ReadAll(io.LimitReader(resp.Body, int64(cutAt)))
		if err == nil && len(got) == cutAt {
			a.note = fmt.Sprintf("cut short by the client after %d of %d bytes", len(got), len(r.w.files[a.res.path]))
			return
		}
	} else {
		got, err = io.ReadAll(resp.Body)
	}
	if err != nil && (resp.ContentLength < 0 || int64(len(got)) != resp.ContentLength) {
		a.note = fmt.Sprintf("the body broke after %d bytes: %s", len(got), shorten(err.Error()))
		return
	}
	// A body whose every byte of its Content-Length arrived was delivered whole, even when the connection then
	// broke before its end was signalled (an HTTP/2 stream's END_STREAM, sent once the handler returns, lost to
	// a SIGKILL): the payer holds the response, which judge compares with the resource.
	r.judge(a, p, resp, got, bodyLen, rangeFrom, rangeTo)
}

// setPaymentHeaders puts the payment and the run's headers for the upstream on a request.
func (r *invRun) setPaymentHeaders(h http.Header, p *invPayment) {
	h.Set(p.headerName, p.header)
	h.Set(invPaymentHeader, strconv.Itoa(p.n))
	if p.use != "" {
		h.Set(invUseHeader, p.use)
	}
}

// judge classifies an answer read whole: a response of the resource asked for, a refusal (final or not), or
// something wrong.
func (r *invRun) judge(a *invAnswer, p *invPayment, resp *http.Response, body []byte, bodyLen, rangeFrom, rangeTo int) {
	rk := r.w.route(a.res.path)
	a.page = isPaywallPage(resp, body)
	media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	a.json = media == "application/json" && (json.Valid(body) || a.res.method == http.MethodHead)
	switch {
	case resp.StatusCode == http.StatusPaymentRequired:
		a.note = refusalReason(resp, body)
		// Not final: another request presents the payment right now, or the gateway offers no way to pay at all
		// right now (a 402 that names nothing to pay instead cannot be a "pay again"; a later answer decides).
		pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
		a.final = !strings.Contains(a.note, "another request is presenting") && (err != nil || len(pr.Accepts) > 0)
		return
	case resp.StatusCode >= 500 || resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode == http.StatusTooManyRequests:
		a.note = shorten(string(body))
		var gateBody struct {
			Outcome string `json:"outcome"`
			Error   string `json:"error"`
		}
		if json.Unmarshal(body, &gateBody) == nil {
			a.outcome, a.gateError = gateBody.Outcome, gateBody.Error
		}
		return
	case resp.StatusCode >= 400:
		a.note = shorten(string(body))
		a.final = true
		return
	}
	want := ""
	switch {
	case a.res.method == http.MethodHead:
	case rk.serve == serveFiles && a.shape == shapeRange:
		content := r.w.files[a.res.path]
		if resp.StatusCode != http.StatusPartialContent {
			a.note = fmt.Sprintf("a Range request answered %d, want 206", resp.StatusCode)
			a.wrong = true
			return
		}
		want = string(content[rangeFrom : min(rangeTo, len(content)-1)+1])
	case rk.serve == serveFiles:
		want = string(r.w.files[a.res.path])
	default:
		want = upstreamBody(a.res.method, a.res.path, bodyLen)
	}
	if string(body) != want {
		a.note = fmt.Sprintf("%d bytes that are not the response of %s (want %d bytes): %q", len(body), a.res, len(want), shorten(string(body[:min(len(body), 80)])))
		a.wrong = true
		return
	}
	a.whole, a.final = true, true
}

// refusalReason is the reason a 402 gives: PAYMENT-REQUIRED's error, else PAYMENT-RESPONSE's, else the body.
func refusalReason(resp *http.Response, body []byte) string {
	if pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired)); err == nil && pr.Error != "" {
		return shorten(pr.Error)
	}
	if s, err := x402.DecodeSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse)); err == nil && s.ErrorReason != "" {
		return shorten(s.ErrorReason + ": " + s.ErrorMessage)
	}
	return shorten(string(body))
}

// sendWebSocket presents p with a WebSocket handshake on a connection of its own, and on 101 sends a line and
// reads its echo: the whole response of a WebSocket resource.
func (r *invRun) sendWebSocket(ctx context.Context, a *invAnswer, p *invPayment, base string) {
	host := strings.TrimPrefix(base, "http://")
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	req, _ := http.NewRequest(http.MethodGet, base+a.res.path, nil)
	req.Header.Set("Connection", "Upgrade")
	req.Header.Set("Upgrade", "websocket")
	req.Header.Set("Sec-WebSocket-Version", "13")
	req.Header.Set("Sec-WebSocket-Key", base64Key(p.n))
	r.setPaymentHeaders(req.Header, p)
	if err := req.Write(conn); err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	a.status = resp.StatusCode
	if s, err := x402.DecodeSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse)); err == nil && resp.Header.Get(x402.HeaderPaymentResponse) != "" {
		a.settle = &s
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		if resp.StatusCode < 300 {
			a.note = fmt.Sprintf("a WebSocket handshake answered %d, want 101", resp.StatusCode)
			a.wrong = true
			return
		}
		r.judge(a, p, resp, body, 0, 0, 0)
		return
	}
	if resp.Header.Get("Sec-WebSocket-Accept") != wsAccept(base64Key(p.n)) {
		a.note = "a 101 without the upstream's Sec-WebSocket-Accept"
		a.wrong = true
		return
	}
	line := fmt.Sprintf("payment %d says hello on %s\n", p.n, a.res.path)
	if _, err := io.WriteString(conn, line); err != nil {
		a.note = "the tunnel broke: " + shorten(err.Error())
		return
	}
	echo := make([]byte, len(line))
	if _, err := io.ReadFull(br, echo); err != nil {
		a.note = "the tunnel broke before the echo: " + shorten(err.Error())
		return
	}
	if string(echo) != line {
		a.note = fmt.Sprintf("the tunnel echoed %q", echo)
		a.wrong = true
		return
	}
	a.whole, a.final = true, true
}

// base64Key is the Sec-WebSocket-Key of payment n's handshakes.
func base64Key(n int) string { return fmt.Sprintf("invariant-key-%010d", n) }

// sendCutBody presents p with a POST whose body the client cuts short: it says how long the body is, sends a
// part, and hangs up. Whatever the gate did, its client never learns it.
func (r *invRun) sendCutBody(ctx context.Context, a *invAnswer, p *invPayment, base string) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	defer conn.Close()
	req, _ := http.NewRequest(http.MethodPost, base+a.res.path, nil)
	r.setPaymentHeaders(req.Header, p)
	var head bytes.Buffer
	fmt.Fprintf(&head, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\nContent-Type: application/octet-stream\r\n", a.res.path, req.Host, invRequestBody)
	req.Header.Write(&head)
	head.WriteString("\r\n")
	head.Write(bytes.Repeat([]byte{'x'}, invCutRequestBody))
	if _, err := conn.Write(head.Bytes()); err != nil {
		a.note = "no answer: " + shorten(err.Error())
		return
	}
	time.Sleep(100 * time.Millisecond)
	a.note = fmt.Sprintf("the request body was cut short after %d of %d bytes; no answer read", invCutRequestBody, invRequestBody)
}

// recorded says whether the answer shows that the gate recorded the payment for the resource asked: it served
// it (2xx, 101), or it asked for its settlement (a PAYMENT-RESPONSE, or a 502 "settle-unreachable"). From then on
// the payment buys that resource or nothing.
func (a *invAnswer) recorded() bool {
	return a.status >= 200 && a.status < 300 || a.status == http.StatusSwitchingProtocols || a.settle != nil ||
		a.outcome == string(x402.OutcomeSettleUnreachable)
}

// record adds an answer to the payment's history.
func (p *invPayment) record(a *invAnswer) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.answers = append(p.answers, a)
	if p.bound == nil && a.recorded() {
		res := a.res
		p.bound = &res
	}
	if a.whole {
		p.deliveries = append(p.deliveries, a)
	}
}

// readOffer asks gateway base for path without paying and reads the 402's offer.
func (r *invRun) readOffer(ctx context.Context, base, path string) (payer.Offer, error) {
	if rk := r.w.route(path); rk != nil && rk.serve == serveMCP {
		return mcpOffer(ctx, r.client.h1, base, path)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+path, nil)
	if err != nil {
		return payer.Offer{}, err
	}
	resp, err := r.client.h1.Do(req)
	if err != nil {
		return payer.Offer{}, fmt.Errorf("asking %s for its offer: %w", path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusPaymentRequired {
		return payer.Offer{}, fmt.Errorf("unpaid GET %s answered %d %s, want 402", path, resp.StatusCode, shorten(string(body)))
	}
	return payer.ReadOffer(resp.Header, body)
}

// offerIndex finds rk's requirement in an offer.
func offerIndex(offer payer.Offer, rk *routeKind) (int, error) {
	for i, rq := range offer.Required.Accepts {
		if rq.Scheme == rk.scheme && rq.Extra.AssetTransferMethod == rk.method {
			return i, nil
		}
	}
	return 0, fmt.Errorf("the offer of %s names no %s %s requirement: %+v", rk.prefix, rk.scheme, rk.method, offer.Required.Accepts)
}

// newPayment registers a payment signed as pay.
func (r *invRun) newPayment(pp *invPayer, rk *routeKind, name, value string, rq x402.PaymentRequirements, pl x402.PaymentPayload, use string, transport int, first invResource, firstShape string, gate int, asked time.Time) (*invPayment, error) {
	amount, err := x402.ParseUint256(rq.Amount)
	if err != nil {
		return nil, fmt.Errorf("the requirement's amount: %w", err)
	}
	_, nonce := pl.Payload.PayerAndNonce()
	r.mu.Lock()
	defer r.mu.Unlock()
	p := &invPayment{n: len(r.payments) + 1, payer: pp, route: rk, req: rq, headerName: name, header: value, nonce: nonce,
		amount: amount, use: use, transport: transport, gen: r.w.generation(), signed: asked, first: first, firstShape: firstShape, firstGate: gate}
	r.payments = append(r.payments, p)
	return p, nil
}

// pickUse draws what the upstream names for an upto payment of maximum max: a charge below it, none, nothing
// readable, zero, or more than the maximum.
func pickUse(rng *rand.Rand, max *big.Int) string {
	switch n := rng.IntN(20); {
	case n < 9:
		return strconv.FormatInt(1+rng.Int64N(max.Int64()-1), 10)
	case n < 13:
		return "none"
	case n < 14:
		return "malformed"
	case n < 16:
		return "0"
	default:
		return new(big.Int).Mul(max, big.NewInt(2)).String()
	}
}
