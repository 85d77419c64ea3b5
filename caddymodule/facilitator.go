package caddymodule

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(FacilitatorHandler{})
}

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

	// Open says the route is meant to serve anyone. A route serving the embedded engine on a network other than
	// the dev chain, with no APIKeys, PayTo or MinAmount here or in the network's x402 app block, is refused
	// without it: anyone could sign 1-unit payments to themselves and have its wallets pay the gas of each.
	Open bool `json:"open,omitempty"`

	// SettleRateLimit caps the /settle calls per client IP and per payer; over it, 429 with Retry-After.
	SettleRateLimit *SettleRateLimit `json:"settle_rate_limit,omitempty"`

	// VerifyRateLimit caps the /verify calls per client IP that the facilitator behind refuses or fails; over
	// it, 429 with Retry-After. Default: 600 a minute per client (an IPv6 client by its /64).
	VerifyRateLimit *VerifyRateLimit `json:"verify_rate_limit,omitempty"`

	// Facilitator is the facilitator served, a module of the x402.facilitators namespace: `embedded` (the x402
	// app's engine), `http` (facilitators over HTTP, with failover) or one of another plugin. Default: what
	// Upstreams say, else the embedded engine.
	FacilitatorRaw json.RawMessage `json:"facilitator,omitempty" caddy:"namespace=x402.facilitators inline_key=source"`

	// Upstreams make this handler serve other facilitators over HTTP instead of the embedded engine.
	// Several are a failover set: each payment goes to the first member whose /supported lists its kind,
	// and on to the next only when a member cannot be reached.
	Upstreams []*FacilitatorUpstream `json:"upstreams,omitempty"`

	app            *App                      // nil for upstreams
	engine         *chain.Facilitator        // the x402 app's engine, taken up when the app starts
	server         *facilitatorserver.Server // the serving: API keys, limits, refusals, answers
	metrics        *metrics
	releaseWallets func()
	logs           *bearerLog
	logger         *zap.Logger
	shared         atomic.Value // of sharedCounts: where the settle rate limits count, once the journal is open
	discovery      atomic.Value // of resourceCatalog: the bazaar catalog, in the app's journal once it is open
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

// Provision resolves the API keys, finds the facilitator to serve (the upstreams, or the x402 app's engine once
// the app has started) and builds the server of it.
func (h *FacilitatorHandler) Provision(ctx caddy.Context) error {
	// Caddy validates after provisioning; the server refuses to be built of what Validate refuses, so the
	// operator hears of it here in Validate's words.
	if err := h.Validate(); err != nil {
		return err
	}
	h.logger = ctx.Logger()
	repl := caddy.NewReplacer()
	opts := facilitatorserver.Options{
		Kinds: h.Kinds, Networks: h.Networks, MaxBodySize: h.MaxBodySize,
		ClientIP: clientIP, Logger: h.logger,
	}
	for i, k := range h.APIKeys {
		key := repl.ReplaceAll(k, "")
		if key == "" {
			// Its text is placeholders only (any other character would be left), so naming it shows no secret.
			return fmt.Errorf("api_key #%d, %s, is empty once its placeholders are replaced; is its environment variable set?", i+1, k)
		}
		opts.APIKeys = append(opts.APIKeys, key)
	}
	h.logs = newBearerLog(ctx, x402.HeaderAPIKey)

	var err error
	if opts.Terms, err = facilitatorserver.ParseTerms(h.MinAmount, h.PayTo); err != nil {
		return fmt.Errorf("%w", err)
	}
	if l := h.SettleRateLimit; l != nil {
		opts.SettleRateLimit = facilitatorserver.RateLimit{PerIP: l.PerIP, IPv6Prefix: l.IPv6Prefix, PerPayer: l.PerPayer}
	}
	opts.VerifyRateLimit = verifyLimit(h.VerifyRateLimit)
	opts.SharedCounts = h.sharedCounts
	if h.metrics, err = metricsFor(ctx, metricsHandlerFacilitator); err != nil {
		return err
	}
	opts.Metrics = facilitatorMetrics{h.metrics}
	src, err := facilitatorSource(ctx, h, "FacilitatorRaw", h.FacilitatorRaw, h.Upstreams)
	if err != nil {
		return err
	}
	ip, inProcess := src.(inProcessSource)
	if !inProcess {
		f, err := src.Facilitator()
		if err != nil {
			return err
		}
		// A remote facilitator reads a version 1 request in the version 1 shape only.
		opts.UpgradeV1, opts.Describe = true, h.describeUpstreamFailure
		if h.server, err = facilitatorserver.New(f, opts); err != nil {
			return err
		}
		// A middleware facilitator has no journal of its own; the x402 app's, when it is a cluster's, counts.
		if v, err := ctx.AppIfConfigured("x402"); err == nil && h.SettleRateLimit != nil {
			app := v.(*App)
			app.onStart(false, func() error { h.shareCounts(app); return nil })
		}
		return nil
	}
	app := ip.app()
	networks := app.networkIDs()
	h.app = app
	for _, n := range h.Networks {
		if !slices.Contains(networks, n) {
			return fmt.Errorf("network %s is not configured in the x402 app, which settles on %s", n, strings.Join(networks, ", "))
		}
	}
	devNetwork := ""
	if app.devNet != nil {
		devNetwork = app.devNet.Network
	}
	if err := h.openProblem(app.Networks, devNetwork); err != nil {
		return err
	}
	// The engine runs once the app has started: requests wait for that, then reach it through startedEngine.
	opts.Await, opts.Redact = app.awaitStart, app.rpcRedactor().Replace
	opts.Catalog = h.catalog // facilitator_discovery.go
	if h.server, err = facilitatorserver.New(startedEngine{h}, opts); err != nil {
		return err
	}
	app.onStart(true, func() error { return h.start(app) })
	app.onStart(false, func() error { h.useCatalog(app); return nil })
	if h.SettleRateLimit != nil {
		app.onStart(false, func() error { h.shareCounts(app); return nil })
	}
	return nil
}

// sharedCounts holds the journal that the settle rate limits count in.
type sharedCounts struct{ facilitatorserver.SharedCounts }

// shareCounts makes the settle rate limits count in the app's journal when it is a PostgreSQL database, which
// every instance of a cluster shares, so that the cluster enforces one limit and not one per instance. A journal
// of one process (bbolt, memory) keeps the counts in memory, as does a journal that cannot be opened now (the
// server counts in memory until its shared counts answer; see facilitatorserver.SharedCounts).
func (h *FacilitatorHandler) shareCounts(app *App) {
	if !isPostgresDSN(app.journalPath()) {
		return
	}
	store, _, err := app.SettlementJournal()
	if err != nil {
		h.logger.Warn("the settle rate limits count in memory, each instance on its own: the journal did not open", zap.Error(err))
		return
	}
	if sc, ok := store.(facilitatorserver.SharedCounts); ok {
		h.shared.Store(sharedCounts{sc})
	}
}

// sharedCounts is where the settle rate limits count: the cluster's journal, or nil (in memory).
func (h *FacilitatorHandler) sharedCounts() facilitatorserver.SharedCounts {
	if sc, ok := h.shared.Load().(sharedCounts); ok {
		return sc.SharedCounts
	}
	return nil
}

// start takes up the embedded engine once the x402 app runs.
func (h *FacilitatorHandler) start(app *App) error {
	engine := app.Facilitator()
	supported, err := engine.Supported(context.Background())
	if err != nil {
		return fmt.Errorf("x402_facilitator: reading the kinds of the embedded facilitator: %w", err)
	}
	if len(h.server.FilterSupported(supported).Kinds) == 0 {
		return fmt.Errorf("x402_facilitator: kinds %v on networks %v leave nothing to serve; the x402 app offers %s",
			h.Kinds, h.Networks, describeKinds(supported.Kinds))
	}
	h.engine = engine
	h.releaseWallets = h.metrics.trackWallets(engine)
	return nil
}

// startedEngine is the x402 app's engine as the server calls it: the server awaits the app's start
// (Options.Await) before any call, and start has set the engine by then.
type startedEngine struct{ h *FacilitatorHandler }

// While the engine waits for its chain (App.startWithoutChain) every call but /health fails as a facilitator
// that cannot be reached, and /health says why.
func (e startedEngine) Supported(ctx context.Context) (x402.SupportedResponse, error) {
	if _, err := e.h.app.engineDown(); err != nil {
		return x402.SupportedResponse{}, err
	}
	return e.h.engine.Supported(ctx)
}

func (e startedEngine) Verify(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	if _, err := e.h.app.engineDown(); err != nil {
		return x402.VerifyResponse{}, err
	}
	return e.h.engine.Verify(ctx, req)
}

func (e startedEngine) Settle(ctx context.Context, req x402.SettleRequest) (x402.SettleResponse, error) {
	if _, err := e.h.app.engineDown(); err != nil {
		return x402.SettleResponse{}, err
	}
	return e.h.engine.Settle(ctx, req)
}

// VerifyBatch serves a batch-settlement /verify (x402.BatchFacilitator) as Verify serves the other schemes: without
// it the route would answer every batch body unsupported_scheme, though the engine lists the kind.
func (e startedEngine) VerifyBatch(ctx context.Context, req x402.BatchRequest) (x402.VerifyResponse, error) {
	if _, err := e.h.app.engineDown(); err != nil {
		return x402.VerifyResponse{}, err
	}
	return e.h.engine.VerifyBatch(ctx, req)
}

// startedEngine serves batch-settlement bodies.
var _ x402.BatchFacilitator = startedEngine{}

// SettleBatch serves a batch-settlement /settle as Settle serves the other schemes.
func (e startedEngine) SettleBatch(ctx context.Context, req x402.BatchRequest) (x402.BatchSettleResponse, error) {
	if _, err := e.h.app.engineDown(); err != nil {
		return x402.BatchSettleResponse{}, err
	}
	return e.h.engine.SettleBatch(ctx, req)
}

func (e startedEngine) Health(ctx context.Context) (x402.HealthResponse, error) {
	if waiting, err := e.h.app.engineDown(); waiting {
		return e.h.app.downHealth(err.(*x402.FacilitatorError).Err.Error()), nil
	} else if err != nil {
		return x402.HealthResponse{}, err
	}
	return e.h.engine.Health(ctx)
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
	if _, err := facilitatorserver.ParseTerms(h.MinAmount, h.PayTo); err != nil {
		return fmt.Errorf("%w", err)
	}
	var limits []rateField
	if l := h.SettleRateLimit; l != nil {
		limits = append(limits, rateField{"settle_rate_limit per_ip", l.PerIP, l.IPv6Prefix}, rateField{"settle_rate_limit per_payer", l.PerPayer, 0})
	}
	if l := h.VerifyRateLimit; l != nil {
		limits = append(limits, rateField{"verify_rate_limit per_ip", l.PerIP, l.IPv6Prefix})
	}
	for _, r := range limits {
		if r.n < 0 || r.n > facilitatorserver.MaxPerMinute {
			return fmt.Errorf("%s is %d a minute; want 0 (no limit) to %d", r.name, r.n, facilitatorserver.MaxPerMinute)
		}
		if r.ipv6Prefix < 0 || r.ipv6Prefix > 128 {
			return fmt.Errorf("%s ipv6_prefix is %d bits; want 1 to 128 (0 for the default, 64)", r.name, r.ipv6Prefix)
		}
	}
	if h.MaxBodySize < 0 || h.MaxBodySize > x402.MaxBodyBytes {
		return fmt.Errorf("max_body_size is %d bytes; want 1 to %d (larger bodies are never valid requests)",
			h.MaxBodySize, x402.MaxBodyBytes)
	}
	return validateUpstreams(h.Upstreams)
}

// rateField is a configured rate limit as Validate checks it.
type rateField struct {
	name       string
	n          int
	ipv6Prefix int
}

// Cleanup stops reporting the engine's wallets; the engine itself belongs to the x402 app.
func (h *FacilitatorHandler) Cleanup() error {
	if h.releaseWallets != nil {
		h.releaseWallets()
	}
	return nil
}

// ServeHTTP answers the request through the server; it is a terminal handler and never calls next.
func (h *FacilitatorHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	entry := h.logs.takeOver(r) // the x-api-key header must not reach Caddy's logs
	status, size := h.server.Serve(w, r)
	if entry != nil {
		entry.write(w, status, size)
	}
	endpoint := facilitatorserver.Endpoint(r.URL.Path)
	if endpoint == "" {
		endpoint = metricsOther
	}
	h.metrics.observeFacilitatorRequest(endpoint, status)
	return nil
}

// describeUpstreamFailure is what an answer says of a failure of the upstreams. Their errors name the upstreams'
// URLs and the hosts behind them, which are for the log only: the answer says what kind of failure it was, and
// for which payment.
func (h *FacilitatorHandler) describeUpstreamFailure(err error, payment string) string {
	if len(h.Upstreams) == 1 {
		return "the upstream facilitator gave no usable answer: " + x402.DescribeFailure(err)
	}
	who := "no facilitator upstream answered"
	if payment != "" {
		who += " for a " + payment
	}
	return who + ": " + x402.DescribeFailure(err)
}

// facilitatorMetrics reports the server's measurements as the caddy_x402_* metrics of the facilitator handler.
type facilitatorMetrics struct{ m *metrics }

func (f facilitatorMetrics) ObserveVerify(took time.Duration) {
	f.m.observeVerify(metricsHandlerFacilitator, took)
}

func (f facilitatorMetrics) ObserveSettle(took time.Duration) {
	f.m.observeSettle(metricsHandlerFacilitator, took)
}

func (f facilitatorMetrics) ObserveOutcome(endpoint, reason string) {
	f.m.observeFacilitatorOutcome(endpoint, reason)
}

// describeKinds lists kinds for an error message.
func describeKinds(kinds []x402.SupportedKind) string {
	if len(kinds) == 0 {
		return "no kinds"
	}
	parts := make([]string, 0, len(kinds))
	for _, k := range kinds {
		kind := k.Extra.AssetTransferMethod
		if k.Scheme != x402.SchemeExact {
			kind = k.Scheme + " " + kind
		}
		parts = append(parts, fmt.Sprintf("%s on %s (v%d)", kind, k.Network, k.X402Version))
	}
	return strings.Join(parts, ", ")
}

// Interface guards
var (
	_ caddy.Provisioner           = (*FacilitatorHandler)(nil)
	_ caddy.Validator             = (*FacilitatorHandler)(nil)
	_ caddy.CleanerUpper          = (*FacilitatorHandler)(nil)
	_ caddyhttp.MiddlewareHandler = (*FacilitatorHandler)(nil)
)
