package caddymodule

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(Gate{})
}

// Settlement modes of a gate: when the payment is settled relative to serving the resource.
const (
	// SettleAfter runs the upstream first and settles only a successful response (the default): the payer
	// never pays for an error.
	SettleAfter = "after"
	// SettleBefore settles first and runs the upstream only for a settled payment, for resources that must
	// not be served unpaid (the upstream does something that cannot be undone).
	SettleBefore = "before"
	// SettleAsync records the verified payment in the journal, serves at once and settles in the background.
	SettleAsync = "async"

	// defaultAsyncBacklog is how many served payments may wait for settlement before settle async settles
	// first: ten seconds of the dev chain's settlement rate, minutes of a slow network's, inside the default
	// five-minute validity of a payment either way.
	defaultAsyncBacklog = 10_000

	// defaultMaxBuffer bounds the response body a gate holds back per request: a page or a document is served
	// whole after settlement, a download streams once its payment settled.
	defaultMaxBuffer = 8 << 20
)

// EmbeddedFacilitator is the facilitator_url that names the x402 app's in-process engine.
const EmbeddedFacilitator = "embedded"

// Gate is the x402 payment gate (`http.handlers.x402`): it answers an unpaid request with 402 and what to
// pay, verifies the payment a client sends, runs the rest of the route, settles, and answers with the
// resource and the settlement. One payment buys exactly one response.
//
// The gate's own way to pay is given by its inline fields; accept blocks add more (another network, asset
// or method) and take whatever they leave empty from the gate.
//
// Placeholders, for access logs (log_append) and for the upstream (header_up):
//
//	{http.x402.status}       the PaymentOutcome status; "verified" while the upstream runs before settlement
//	{http.x402.payer}        the verified payer
//	{http.x402.network}      the CAIP-2 network paid on
//	{http.x402.amount}       the amount in raw token units
//	{http.x402.transaction}  the settlement transaction, once known
type Gate struct {
	GateAccept

	// Accepts are further ways to pay, offered after the gate's own. A field an accept leaves empty takes the
	// gate's value.
	Accepts []*GateAccept `json:"accepts,omitempty"`

	// FacilitatorURL is the base URL of the facilitator that verifies and settles, or "embedded" for the x402
	// app's in-process engine. Default: embedded when the x402 app configures the gate's networks.
	FacilitatorURL string `json:"facilitator_url,omitempty"`

	// FacilitatorAPIKey is sent as x-api-key to a remote facilitator; placeholders such as {env.KEY} are
	// replaced. It is never logged.
	FacilitatorAPIKey string `json:"facilitator_api_key,omitempty"`

	// FacilitatorTimeout bounds each call to a remote facilitator: verify, supported and health, and settle
	// unless it is shorter than a settlement takes (default: 10s for verify and supported, 5s for health, 60s
	// for settle). A settle call cut short has an unknown outcome: the payer is answered 502 and presents the
	// payment again.
	FacilitatorTimeout caddy.Duration `json:"facilitator_timeout,omitempty"`

	// PaymentHeader is the request header carrying a version 2 payment. Default PAYMENT-SIGNATURE. Version 1
	// payments always come in X-PAYMENT.
	PaymentHeader string `json:"payment_header,omitempty"`

	// Description and MimeType describe the resource in the 402 answer.
	Description string `json:"description,omitempty"`
	MimeType    string `json:"mime_type,omitempty"`

	// Settle is when the payment is settled: "after" the upstream answered successfully (default),
	// "before" the upstream is called, or "async" in the background after serving.
	Settle string `json:"settle,omitempty"`
	// AsyncBacklog bounds, with settle "async", the payments served and not settled yet (per journal). Past it a
	// payment is settled before it is served, as with "after": serving cannot run ahead of settlement until
	// payments expire unsettled, and throughput falls back to what settlement sustains. Default 10000.
	AsyncBacklog int `json:"async_backlog,omitempty"`
	// MaxBuffer is how much of the upstream's response body, in bytes, the gate holds back until it decides
	// what to send. A body that grows past it is decided on there and then, and the rest streams: a paid-for
	// response (no 4xx/5xx) is settled first with settle "after", served as with a small one with "before" and
	// "async"; an upstream error streams through unpaid. Default 8 MiB.
	MaxBuffer int64 `json:"max_buffer,omitempty"`

	// V1Body answers unpaid requests with the version 1 JSON body (x402Version 1, maxAmountRequired, network
	// names) for clients that read only the body; the PAYMENT-REQUIRED header still carries version 2.
	V1Body bool `json:"v1_body,omitempty"`

	// CORSOrigins are the origins whose browser scripts may pay for the resource: the gate answers their CORS
	// preflight itself (never passing it on unpaid) and lets them read its answers. "*" allows any origin.
	// Default: any origin.
	CORSOrigins []string `json:"cors_origins,omitempty"`

	app      *App
	fac      x402.Facilitator // for the embedded facilitator, set when the x402 app starts
	holder   fundsHolder      // fac, when it can hold payments against payers' funds and the gate settles async
	embedded bool
	facName  string            // for logs: "embedded" or the facilitator's base URL
	redact   *strings.Replacer // takes RPC URLs (which may hold provider keys) out of engine errors
	specs    []offerSpec
	registry *x402.Registry
	ledger   *gateLedger
	// enginePrunes: the x402 app's embedded engine prunes the journal, so the ledger need not.
	enginePrunes bool
	// untrackBacklog takes the ledger out of the backlog gauge.
	untrackBacklog func()
	metrics        *metrics
	logger         *zap.Logger
	now            func() time.Time
	state          *gateState
}

// gateState is what a gate changes while it serves (kept behind a pointer so that Gate stays copyable).
type gateState struct {
	offers   atomic.Pointer[offerSet] // the current offers, rebuilt from /supported of a remote facilitator
	refresh  sync.Mutex               // one /supported fetch at a time
	rotation atomic.Uint64            // spreads erc2612 payers over the settlement wallets
	warnedAt atomic.Int64             // when the async backlog was last reported full (unix nanoseconds)
}

// warnBacklog logs, at most every ten seconds, that settle async is settling before serving because too many
// served payments wait for settlement.
func (g *Gate) warnBacklog() {
	now := g.now().UnixNano()
	last := g.state.warnedAt.Load()
	if now-last < int64(10*time.Second) || !g.state.warnedAt.CompareAndSwap(last, now) {
		return
	}
	g.logger.Warn("settle async: the backlog of served payments waiting for settlement is full; settling before serving until it drains",
		zap.Int("async_backlog", g.AsyncBacklog))
}

// GateAccept is one way to pay: a network, an asset, a recipient, a price and optionally one transfer method.
type GateAccept struct {
	// PayTo is the address that receives the payment.
	PayTo string `json:"pay_to,omitempty"`
	// Amount is the price in raw token units, a decimal string ("10000" is 0.01 of a 6-decimal token).
	Amount string `json:"amount,omitempty"`
	// Price is the price in dollars ("$0.01"), converted to raw units with the asset's decimals. Give either
	// Amount or Price.
	Price string `json:"price,omitempty"`
	// Network is the CAIP-2 network, such as eip155:72344. Default: the first network the x402 app configures.
	Network string `json:"network,omitempty"`
	// Asset is the token's contract address. Default: the first asset the x402 app configures for the network.
	Asset string `json:"asset,omitempty"`
	// AssetTransferMethod restricts the offer to permit2, eip3009 or erc2612. Default: every method the
	// facilitator supports on the network, in the order permit2, eip3009 (for a token with EIP-3009, see
	// TokenEIP3009), erc2612.
	AssetTransferMethod string `json:"asset_transfer_method,omitempty"`
	// TokenName and TokenVersion are the token's EIP-712 domain (of its permits and EIP-3009
	// authorizations). Default: the x402 app's asset configuration, else "Stable Coin" and "1".
	TokenName    string `json:"token_name,omitempty"`
	TokenVersion string `json:"token_version,omitempty"`
	// TokenEIP3009 says the token implements EIP-3009 transferWithAuthorization (USDC and the tokens modelled
	// on it), so eip3009 is offered beside permit2. Default: what the x402 app's asset configuration says.
	TokenEIP3009 bool `json:"token_eip3009,omitempty"`
	// MaxTimeout is how long a signed payment stays valid (maxTimeoutSeconds). Default 5m.
	MaxTimeout caddy.Duration `json:"max_timeout,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Gate) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.x402",
		New: func() caddy.Module { return new(Gate) },
	}
}

// Defaults of a gate.
const (
	defaultMaxTimeout = 5 * time.Minute
	// supportedTTL is how long a remote facilitator's /supported answer shapes the offers before it is asked
	// again; supportedRetry how long a failed fetch is not retried, so a facilitator that is down costs an
	// unpaid request nothing; supportedWait how long an unpaid request waits for a fetch.
	supportedTTL   = 30 * time.Second
	supportedRetry = 5 * time.Second
	supportedWait  = 3 * time.Second
	// settleTimeout bounds one settlement; it runs on even when the client has gone, because a payment that
	// reached the facilitator must be accounted for.
	settleTimeout = 2 * time.Minute
)

// Provision resolves the gate's offers against the x402 app and picks its facilitator; the gate joins the
// journal and its ledger when the app starts (see start).
func (g *Gate) Provision(ctx caddy.Context) error {
	g.logger = ctx.Logger()
	g.now = time.Now
	var err error
	if g.metrics, err = metricsFor(ctx); err != nil {
		return err
	}
	g.state = new(gateState)
	g.registry = x402.NewRegistry()
	if g.PaymentHeader == "" {
		g.PaymentHeader = x402.HeaderPaymentSignature
	}
	if g.Settle == "" {
		g.Settle = SettleAfter
	}
	if g.AsyncBacklog == 0 {
		g.AsyncBacklog = defaultAsyncBacklog
	}
	if g.MaxBuffer == 0 {
		g.MaxBuffer = defaultMaxBuffer
	}
	appVal, err := ctx.App("x402")
	if err != nil {
		return fmt.Errorf("loading the x402 app: %w", err)
	}
	app := appVal.(*App)
	repl := caddy.NewReplacer()
	if g.specs, err = g.resolveOffers(app, repl); err != nil {
		return err
	}
	if err := g.pickFacilitator(app, repl); err != nil {
		return err
	}
	if !g.embedded {
		// A remote facilitator may be down now; Caddy starts anyway and asks when payments come.
		g.state.offers.Store(buildOffers(g.specs, nil, g.registry, time.Time{}))
	}
	g.app = app
	return app.onStart(func() error {
		if err := g.start(app); err != nil {
			return fmt.Errorf("starting the x402 gate: %w", err)
		}
		return nil
	})
}

// start takes up what the gate works with once the x402 app runs: the embedded engine and its offers, the
// journal, and the ledger with its background settlements.
func (g *Gate) start(app *App) error {
	if g.embedded {
		g.fac = app.Facilitator()
		// The engine's /supported never changes while it runs: shape the offers once.
		sup, err := g.fac.Supported(context.Background())
		if err != nil {
			return fmt.Errorf("asking the embedded facilitator what it supports: %w", err)
		}
		g.state.offers.Store(buildOffers(g.specs, &sup, g.registry, g.now()))
	}
	store, owner, err := app.SettlementJournal()
	if err != nil {
		return err
	}
	if h, ok := g.fac.(fundsHolder); ok && g.Settle == SettleAsync {
		g.holder = h
	}
	ledger, err := joinLedger(store, owner, g.logger)
	if err != nil {
		return err
	}
	// The engine's journal is the app's settlement journal: an app with an engine prunes it.
	g.enginePrunes = app.Facilitator() != nil
	if err := ledger.register(g); err != nil {
		ledger.unregister(g)
		_ = leaveLedger(ledger)
		return err
	}
	g.ledger = ledger
	g.untrackBacklog = g.metrics.trackBacklog(g.ledger)
	return nil
}

// pickFacilitator sets the facilitator: the app's engine, or a client of a remote one.
func (g *Gate) pickFacilitator(app *App, repl *caddy.Replacer) error {
	url := strings.TrimSpace(repl.ReplaceAll(g.FacilitatorURL, ""))
	if url == "" || url == EmbeddedFacilitator {
		networks := app.networkIDs()
		if len(networks) == 0 {
			return errors.New("no facilitator: set facilitator_url, or configure the gate's network in the x402 global option to use the embedded facilitator")
		}
		for _, s := range g.specs {
			if !slices.Contains(networks, s.network) {
				return fmt.Errorf("the embedded facilitator does not settle on %s (it settles on %s); configure that network in the x402 global option or set facilitator_url",
					s.network, strings.Join(networks, ", "))
			}
		}
		// The engine itself runs once the app has started (see start).
		g.embedded, g.facName, g.redact = true, EmbeddedFacilitator, app.rpcRedactor()
		return nil
	}
	var opts []facilitatorclient.Option
	if key := repl.ReplaceAll(g.FacilitatorAPIKey, ""); key != "" {
		opts = append(opts, facilitatorclient.WithAPIKey(key))
	}
	if d := time.Duration(g.FacilitatorTimeout); d > 0 {
		opts = append(opts, facilitatorclient.WithTimeouts(facilitatorclient.Timeouts{Verify: d, Settle: d, Supported: d, Health: d}))
	}
	c, err := facilitatorclient.New(url, opts...)
	if err != nil {
		return err
	}
	g.fac, g.facName, g.redact = c, c.BaseURL(), strings.NewReplacer()
	return nil
}

// settlesOn reports whether the gate's facilitator settles on network: the engine's networks for the
// embedded one, the networks of the gate's own offers for a remote one (what else it serves is not known here).
func (g *Gate) settlesOn(network string) bool {
	if n, ok := g.fac.(interface{ Networks() []string }); ok && g.embedded {
		return slices.Contains(n.Networks(), network)
	}
	return slices.ContainsFunc(g.specs, func(s offerSpec) bool { return s.network == network })
}

// Validate checks what Provision could not have fixed.
func (g *Gate) Validate() error {
	switch g.Settle {
	case SettleAfter, SettleBefore, SettleAsync:
	default:
		return fmt.Errorf("settle %q is not a settlement mode; want %q, %q or %q", g.Settle, SettleAfter, SettleBefore, SettleAsync)
	}
	if g.FacilitatorTimeout < 0 {
		return fmt.Errorf("facilitator_timeout %s is negative", time.Duration(g.FacilitatorTimeout))
	}
	if g.AsyncBacklog < 0 {
		return fmt.Errorf("async_backlog %d is negative", g.AsyncBacklog)
	}
	if g.MaxBuffer < 0 {
		return fmt.Errorf("max_buffer %d is negative; want a size in bytes", g.MaxBuffer)
	}
	if len(g.specs) == 0 {
		return errors.New("no way to pay is configured")
	}
	for _, o := range g.CORSOrigins {
		if u, err := url.Parse(o); o != "*" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || strings.Trim(u.Path, "/") != "" || u.RawQuery != "") {
			return fmt.Errorf("cors_origins %q is not an origin; want * or scheme://host[:port], such as https://app.example.com", o)
		}
	}
	if strings.EqualFold(g.PaymentHeader, x402.HeaderXPayment) {
		return fmt.Errorf("payment_header %s is the version 1 header, which the gate always reads; choose another name", x402.HeaderXPayment)
	}
	return nil
}

// Cleanup leaves the journal; the last gate of a journal stops its background settlements.
func (g *Gate) Cleanup() error {
	if g.ledger == nil {
		return nil
	}
	if g.untrackBacklog != nil {
		g.untrackBacklog()
	}
	g.ledger.unregister(g)
	return leaveLedger(g.ledger)
}

// currentOffers returns the offers to make now. For a remote facilitator they are rebuilt from its /supported
// answer when that is older than supportedTTL: in the background while a stale answer serves, or, when none
// is known yet, while the request waits (up to supportedWait). A fetch that fails keeps the last offers (or
// only what is configured explicitly) and is not repeated for supportedRetry.
func (g *Gate) currentOffers(ctx context.Context) *offerSet {
	st := g.state
	cur := st.offers.Load()
	if g.embedded {
		return cur
	}
	now := g.now()
	if (cur.known && now.Sub(cur.at) < supportedTTL) || (!cur.failedAt.IsZero() && now.Sub(cur.failedAt) < supportedRetry) {
		return cur
	}
	if cur.known {
		if st.refresh.TryLock() {
			go func() {
				defer st.refresh.Unlock()
				g.fetchOffers(context.Background())
			}()
		}
		return cur
	}
	st.refresh.Lock()
	defer st.refresh.Unlock()
	if latest := st.offers.Load(); latest != cur {
		return latest // fetched while this request waited for the lock
	}
	return g.fetchOffers(ctx)
}

// fetchOffers asks the facilitator's /supported and rebuilds the offers from it; the caller holds refresh.
func (g *Gate) fetchOffers(ctx context.Context) *offerSet {
	st := g.state
	ctx, cancel := context.WithTimeout(ctx, supportedWait)
	defer cancel()
	sup, err := g.fac.Supported(ctx)
	now := g.now()
	if err != nil {
		g.logger.Warn("the facilitator's /supported could not be read; the offers stay as they were",
			zap.String("facilitator", g.facName), zap.String("error", g.describe(err)))
		next := *st.offers.Load()
		next.failedAt = now
		st.offers.Store(&next)
		return &next
	}
	next := buildOffers(g.specs, &sup, g.registry, now)
	st.offers.Store(next)
	return next
}

// ServeHTTP gates the request behind a payment.
func (g *Gate) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if isPreflight(r) {
		// A CORS preflight carries no payment and must not reach the upstream, which may answer it with the
		// paid resource: the gate answers it itself.
		return g.answerPreflight(w, r)
	}
	if err := g.app.awaitStart(r.Context()); err != nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
	x := &exchange{g: g, w: w, r: r, next: next, start: g.now()}
	x.repl, _ = r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if x.repl == nil {
		x.repl = caddy.NewReplacer()
	}
	g.allowOrigin(w.Header(), r)
	exposePaymentHeaders(w.Header())
	return x.run()
}

// preflightMaxAge is how long a browser may keep a preflight answer, in seconds.
const preflightMaxAge = "600"

// answerPreflight answers a CORS preflight: 204 naming what a paying request may send, or 403 for an origin the
// gate does not allow. The upstream is never called.
func (g *Gate) answerPreflight(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	if !g.allowOrigin(h, r) {
		h.Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		_, err := fmt.Fprintf(w, "origin %q may not make cross-origin requests to this resource\n", r.Header.Get("Origin"))
		return err
	}
	allowed := []string{g.PaymentHeader, x402.HeaderXPayment, "Content-Type"}
	for _, v := range r.Header.Values("Access-Control-Request-Headers") {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" && !slices.ContainsFunc(allowed, func(a string) bool { return strings.EqualFold(a, name) }) {
				allowed = append(allowed, name)
			}
		}
	}
	h.Set("Access-Control-Allow-Methods", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
	h.Set("Access-Control-Allow-Headers", strings.Join(allowed, ", "))
	h.Set("Access-Control-Max-Age", preflightMaxAge)
	exposePaymentHeaders(h)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// allowOrigin sets Access-Control-Allow-Origin for a cross-origin request from an allowed origin and reports
// whether the origin is allowed.
func (g *Gate) allowOrigin(h http.Header, r *http.Request) bool {
	origin := r.Header.Get("Origin")
	if origin == "" {
		return true
	}
	if len(g.CORSOrigins) == 0 || slices.Contains(g.CORSOrigins, "*") {
		h.Set("Access-Control-Allow-Origin", "*")
		return true
	}
	h.Add("Vary", "Origin")
	if !slices.ContainsFunc(g.CORSOrigins, func(o string) bool { return strings.EqualFold(strings.TrimSuffix(o, "/"), origin) }) {
		return false
	}
	h.Set("Access-Control-Allow-Origin", origin)
	return true
}

// isUpgrade reports whether r asks for a tunnel (a protocol upgrade such as WebSocket, or CONNECT), which is
// served as it goes and may outlast the payment's validity: such a request is paid for before it opens.
func isUpgrade(r *http.Request) bool {
	if r.Method == http.MethodConnect {
		return true
	}
	if r.Header.Get("Upgrade") == "" {
		return false
	}
	for _, v := range r.Header.Values("Connection") {
		for _, tok := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(tok), "upgrade") {
				return true
			}
		}
	}
	return false
}

// describe is an error's text with RPC URLs taken out, for answers and logs.
func (g *Gate) describe(err error) string { return g.redact.Replace(err.Error()) }

// isPreflight reports whether r is a CORS preflight request.
func isPreflight(r *http.Request) bool {
	return r.Method == http.MethodOptions && r.Header.Get("Origin") != "" && r.Header.Get("Access-Control-Request-Method") != ""
}

// exposePaymentHeaders lets browser scripts read the payment headers of cross-origin answers.
func exposePaymentHeaders(h http.Header) {
	const name = "Access-Control-Expose-Headers"
	have := strings.ToLower(strings.Join(h.Values(name), ","))
	var add []string
	for _, v := range []string{x402.HeaderPaymentRequired, x402.HeaderPaymentResponse, x402.HeaderXPaymentResponse} {
		if !strings.Contains(have, strings.ToLower(v)) {
			add = append(add, v)
		}
	}
	if len(add) > 0 {
		h.Add(name, strings.Join(add, ", "))
	}
}

// gateBuffers recycles the buffers upstream responses are held in until the payment is settled.
var gateBuffers = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// gateID is the journal id of the gate's record of a payment: the engine's own settlement record of the same
// payment lives in the same journal, so the method is prefixed to keep the two apart.
func gateID(network, method, asset string, p x402.ExactEVMPayload) (journal.ID, bool) {
	from, nonce := p.PayerAndNonce()
	if from == "" || nonce == "" || network == "" || asset == "" || method == "" {
		return journal.ID{}, false
	}
	return journal.PaymentID(network, "gate/"+method, asset, from, nonce), true
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Gate)(nil)
	_ caddy.Validator             = (*Gate)(nil)
	_ caddy.CleanerUpper          = (*Gate)(nil)
	_ caddyhttp.MiddlewareHandler = (*Gate)(nil)
)
