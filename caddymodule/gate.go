package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(Gate{})
}

// Settlement modes of a gate: when the payment is settled relative to serving the resource.
const (
	// SettleAfter runs the upstream first and settles only a successful response (the default): the payer
	// never pays for an error.
	SettleAfter = gate.SettleAfter
	// SettleBefore settles first and runs the upstream only for a settled payment, for resources that must
	// not be served unpaid (the upstream does something that cannot be undone).
	SettleBefore = gate.SettleBefore
	// SettleAsync records the verified payment in the journal, serves at once and settles in the background.
	SettleAsync = gate.SettleAsync
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
// Price, Amount, PayTo and Description may hold placeholders a request fills (a map's or vars' output,
// {http.request.*}): they are then resolved and checked for each request, and a value that is not good answers
// 500. Global placeholders ({env.*}) are resolved once, at Provision.
//
// Placeholders, for access logs (log_append) and for the upstream (header_up):
//
//	{http.x402.status}       the PaymentOutcome status; "verified" while the upstream runs before settlement
//	{http.x402.payer}        the verified payer
//	{http.x402.network}      the CAIP-2 network paid on
//	{http.x402.amount}       the amount in raw token units
//	{http.x402.transaction}  the settlement transaction, once known
//	{http.x402.channel}      batch: the channel a voucher pays from
//	{http.x402.cumulative}   batch: the channel's cumulative amount with the voucher
type Gate struct {
	GateAccept

	// Accepts are further ways to pay, offered after the gate's own. A field an accept leaves empty takes the
	// gate's value.
	Accepts []*GateAccept `json:"accepts,omitempty"`

	// Facilitator is the facilitator that verifies and settles, a module of the x402.facilitators namespace:
	// `embedded` (the x402 app's engine), `http` (facilitators reached over HTTP, with failover) or one of another
	// plugin. Default: what FacilitatorURL says.
	FacilitatorRaw json.RawMessage `json:"facilitator,omitempty" caddy:"namespace=x402.facilitators inline_key=source"`

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
	// "before" the upstream is called, or "async" in the background after serving (a payment whose
	// authorization stays valid less than a minute past the time its settlement could be mined at is settled
	// before it is served: served first, it could expire before its turn to settle).
	Settle string `json:"settle,omitempty"`

	// DefaultAmount is what an upto payment is charged when the upstream's response names no usable amount
	// (no Settlement-Overrides header, or one that cannot be read): max (the default), the price offered, or
	// zero. An amount above the price is never charged: the price is, and the event is logged.
	DefaultAmount string `json:"default_amount,omitempty"`
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

	// PaymentIdentifier declares the payment-identifier extension in the 402, under which a client names its
	// payment with an id (16 to 128 letters, digits, '-' and '_') to retry it safely: "optional", or "required"
	// to refuse (400) a payment that names none. A payment naming an id that does not read is refused (400).
	// Default: not declared, and a payment's id is ignored.
	PaymentIdentifier string `json:"payment_identifier,omitempty"`
	// GasSponsoring names the gas-sponsoring extensions the gate declares in its 402s, of those its facilitator
	// takes: "eip2612GasSponsoring", "erc20ApprovalGasSponsoring". An empty list declares neither. Default
	// (absent): every one the facilitator takes. A payer without a Permit2 allowance signs its own approval of
	// Permit2 (erc20ApprovalGasSponsoring) only where eip2612GasSponsoring is not declared or its token has no
	// permit, as the public SDK decides.
	GasSponsoring *[]string `json:"gas_sponsoring,omitempty"`
	// Batch is the claim policy of scheme batch through facilitator_url: the gate accepts the vouchers and keeps
	// them in the x402 app's journal, and claims them through the facilitator's /settle claim action. Its
	// receiver_authorizer_key is refused: the receiver authorizer is the facilitator's, named in its /supported.
	// Defaults: claim_every 100, claim_after 1m.
	Batch *BatchSettlement `json:"batch,omitempty"`

	// Access, when set, grants a payer whose payment was settled access to the route for a while
	// (sign-in-with-x): the 402 carries a CAIP-122 challenge, and a request answering it with a SIGN-IN-WITH-X
	// header signed by the payer's wallet is served without paying, within the grant. Grants are kept in the
	// settlement journal, shared by every gateway of it. Not with settle async. Default: every request pays.
	Access *GateAccess `json:"access,omitempty"`
	// SignInOnly makes the route one that sells nothing: its 402 offers no way to pay (accepts: []) with the
	// sign-in challenge, a payment presented is refused, and a sign-in is served for a wallet holding Access's
	// grant (required), bought on another route paid to PayTo (required: grants are kept per payee). No price or
	// amount: the gate's network and asset only name the chains of the challenge.
	SignInOnly bool `json:"sign_in_only,omitempty"`

	// Discovery, when set, declares the route for discovery (the bazaar extension) in its 402s: a facilitator
	// that settles a payment for it catalogs it, and lists it at GET /discovery/resources. Default: not declared.
	Discovery *GateDiscovery `json:"discovery,omitempty"`

	// CORSOrigins are the origins whose browser scripts may pay for the resource: the gate answers their CORS
	// preflight itself (never passing it on unpaid) and lets them read its answers. "*" allows any origin.
	// Default: any origin.
	CORSOrigins []string `json:"cors_origins,omitempty"`

	// PriceGrace keeps a payment signed against an offer this resource's 402 made good for this long after the
	// offer changed (a reload with a new price): the terms each 402 offered are remembered by the gate's route and
	// the request's method and URL, across reloads but not restarts, within 16 MiB. With a grace, price, amount and pay_to may hold only
	// the request's method and URL placeholders ({http.request.uri.*}, {http.request.host}, {http.request.method}):
	// a config whose terms depend on more (a header, a user, the client's address, a map or vars output) is refused.
	// Default 0: a payment must match the offer of its request.
	PriceGrace caddy.Duration `json:"price_grace,omitempty"`

	// MCP prices the tool calls of an MCP server behind the gate, per tool (see GateMCP).
	MCP *GateMCP `json:"mcp,omitempty"`
	// Paywall is how the page a browser gets with the 402 looks: title, logo and accent colour.
	Paywall *GatePaywall `json:"paywall,omitempty"`

	// offersFor resolves price, amount and pay_to per request when they hold request placeholders;
	// descriptionFor does so for Description.
	offersFor      func(*http.Request) ([]gate.Offer, error)
	descriptionFor func(*http.Request) string
	offered        *gate.OfferMemory // the process's memory of offers, with a price grace
	routeID        string            // the gate's route (gate.Config.Route, see route)

	app      *App
	fac      x402.Facilitator // for the embedded facilitator, set when the x402 app starts
	embedded bool
	facName  string            // for logs: "embedded" or the facilitator's base URL
	redact   *strings.Replacer // takes RPC URLs (which may hold provider keys) out of engine errors
	specs    []gate.Offer
	core     *gate.Gate // the gate itself, made when the x402 app starts
	// offline makes the 402s of an embedded gate while its engine waits for its chain: offers from the
	// configuration alone (gate.Gate.Offer), never a payment taken. Made at the first request that needs it.
	offline *offlineGate
	// remoteBatch accepts and claims the vouchers of scheme batch through facilitator_url (gate_batch_remote.go).
	remoteBatch *chain.RemoteBatch
	// untrackBacklog takes the gate's ledger out of the backlog gauge.
	untrackBacklog func()
	metrics        *metrics
	events         *caddyevents.App
	ctx            caddy.Context
	logger         *zap.Logger
	logs           *bearerLog // keeps payment headers out of Caddy's access and error logs
}

// GateAccept is one way to pay: a network, an asset, a recipient, a price and optionally one transfer method.
type GateAccept struct {
	// PayTo is the address that receives the payment: in one case, or in EIP-55 mixed case whose checksum holds.
	PayTo string `json:"pay_to,omitempty"`
	// Scheme is exact (the default: the price is charged) or upto: the price is the most a payer authorizes,
	// and the upstream names what is charged in a Settlement-Overrides response header (see DefaultAmount).
	// upto is paid by permit2. batch (or batch-settlement): paid by the public SDK's batch-settlement channels, a
	// deposit once and a cumulative voucher a request, each voucher accepted off chain before the response is
	// served and claimed in batches (the embedded engine needs the network's batch block, which names the
	// receiver authorizer); the price is charged per request as for exact, and the token must implement EIP-3009.
	Scheme string `json:"scheme,omitempty"`
	// Amount is the price in raw token units, a decimal string ("10000" is 0.01 of a 6-decimal token).
	Amount string `json:"amount,omitempty"`
	// Price is the price in dollars ("$0.01" or "0.01 USD"), converted to raw units with the asset's decimals.
	// A bare number ("10000") is refused, as in the Caddyfile: dollars, or raw units meant as Amount? Give
	// either Amount or Price.
	Price string `json:"price,omitempty"`
	// Network is the CAIP-2 network, such as eip155:72344. Default: the first network the x402 app configures.
	Network string `json:"network,omitempty"`
	// Asset is the token's contract address (one case, or EIP-55 mixed case whose checksum holds). Default: the
	// first asset the x402 app configures for the network.
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

	// priceAt is the Caddyfile's price token, to name its line when the price is finer than its token.
	priceAt *caddyfile.Dispenser
}

// CaddyModule returns the Caddy module information.
func (Gate) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.x402",
		New: func() caddy.Module { return new(Gate) },
	}
}

// defaultMaxTimeout is how long a signed payment stays valid unless max_timeout says otherwise.
const defaultMaxTimeout = 5 * time.Minute

// Provision resolves the gate's offers against the x402 app and picks its facilitator; the gate joins the
// journal and its ledger when the app starts (see start).
func (g *Gate) Provision(ctx caddy.Context) error {
	g.logger = ctx.Logger()
	var err error
	if g.metrics, err = metricsFor(ctx, metricsHandlerGate); err != nil {
		return err
	}
	if g.PaymentHeader == "" {
		g.PaymentHeader = x402.HeaderPaymentSignature
	}
	// A payment header is a bearer value: whoever reads it may present the payment while it is unserved (a
	// response cut short, an upstream failure, a payment made for another route). Both headers of the
	// protocol are kept out, whatever this gate reads.
	g.logs = newBearerLog(ctx, g.PaymentHeader, x402.HeaderPaymentSignature, x402.HeaderXPayment)
	if g.Settle == "" {
		g.Settle = SettleAfter
	}
	if g.AsyncBacklog == 0 {
		g.AsyncBacklog = gate.DefaultAsyncBacklog
	}
	if g.MaxBuffer == 0 {
		g.MaxBuffer = gate.DefaultMaxBuffer
	}
	events, err := ctx.App("events")
	if err != nil {
		return fmt.Errorf("loading the events app: %w", err)
	}
	g.events, g.ctx = events.(*caddyevents.App), ctx
	appVal, err := ctx.App("x402")
	if err != nil {
		return fmt.Errorf("loading the x402 app: %w", err)
	}
	app := appVal.(*App)
	if g.routeID, err = g.route(ctx, app); err != nil {
		return err
	}
	if err := g.Paywall.provision(); err != nil {
		return err
	}
	repl := caddy.NewReplacer()
	if g.SignInOnly {
		if err := g.signInOnlyProblem(); err != nil {
			return err
		}
		// The offers only name the payee and the chains of the challenge; none is ever offered.
		g.Amount = "1"
	}
	if g.MCP != nil {
		g.specs, err = g.provisionMCP(app)
	} else {
		g.specs, err = g.provisionOffers(app, repl)
	}
	if err != nil {
		return err
	}
	if err := g.takeOfferMemory(); err != nil {
		return err
	}
	if err := g.pickFacilitator(ctx, app, repl); err != nil {
		return err
	}
	g.app = app
	g.offline = &offlineGate{}
	app.onStart(g.embedded, func() error {
		if err := g.start(app); err != nil {
			return fmt.Errorf("starting the x402 gate: %w", err)
		}
		return nil
	})
	return nil
}

// start makes the gate once the x402 app runs, with the embedded engine or the remote facilitator and the
// app's journal, and starts it: its offers, and the journal's ledger with its background settlements.
func (g *Gate) start(app *App) error {
	if g.embedded {
		g.fac = app.Facilitator()
	}
	store, owner, err := app.SettlementJournal()
	if err != nil {
		return err
	}
	if err := g.startRemoteBatch(app, store); err != nil {
		return err
	}
	core, err := gate.New(g.coreConfig(app), g.fac, store, owner)
	if err != nil {
		g.stopRemoteBatch()
		return err
	}
	if err := core.Start(); err != nil {
		return err
	}
	g.core = core
	g.untrackBacklog = g.metrics.trackBacklog(core.Ledger())
	return nil
}

// coreConfig is the configuration of the gate's core, shaped from its Caddy config.
func (g *Gate) coreConfig(app *App) gate.Config {
	cfg := gate.Config{
		SignInOnly: g.SignInOnly,
		Offers:     g.specs, Settle: g.Settle, DefaultAmount: g.DefaultAmount, AsyncBacklog: g.AsyncBacklog, MaxBuffer: g.MaxBuffer, V1Body: g.V1Body, PaymentIdentifier: g.PaymentIdentifier, Access: g.Access.core(),
		GasSponsoring: g.gasSponsoring(),
		Discovery:     g.Discovery.core(),
		CORSOrigins:   g.CORSOrigins, PaymentHeader: g.PaymentHeader, Description: g.Description, MimeType: g.MimeType, Route: g.routeID, Paywall: g.Paywall.style(app),
		// The engine's journal is the app's settlement journal: an app with an engine prunes it.
		Unloaded: g.unloaded, Embedded: g.embedded, EnginePrunes: len(app.Networks) > 0, FacilitatorName: g.facName, Redact: g.redact.Replace,
		Logger: g.logger, Metrics: gateMetrics{g.metrics}, SetVar: setPaymentPlaceholder, OriginalURI: g.originalURI(),
		ErrorStatus: handlerErrorStatus, Event: g.emit, HandsOff: handlesErrors,
		OffersFor: g.offersFor, DescriptionFor: g.descriptionFor, PriceGrace: time.Duration(g.PriceGrace), OfferMemory: g.offered,
		Ledgers: gateLedgers, Permits: chain.PermitSigners{},
	}
	if g.remoteBatch != nil {
		cfg.Batch = g.remoteBatch
	}
	return cfg
}

// offlineGate is the gate core of offerOffline, made once.
type offlineGate struct {
	once sync.Once
	core *gate.Gate
}

// offerOffline answers a request without payment while the engine waits for its chain: the offers the
// configuration alone can make (exact by permit2 and eip3009; upto and erc2612 name a settlement wallet, known
// only once the engine holds its lease), else 503 with Retry-After as for any gate with nothing to offer.
func (g *Gate) offerOffline(w http.ResponseWriter, r *http.Request, sup x402.SupportedResponse) error {
	o := g.offline
	o.once.Do(func() {
		core, err := gate.New(g.coreConfig(g.app), offlineFacilitator{sup}, journal.NewMemory(journal.Options{}), "offline")
		if err != nil {
			g.logger.Warn("no offers can be made while the chain is down", zap.Error(err))
			return
		}
		o.core = core
	})
	if o.core == nil {
		return answerChainDown(w, r, g.PaymentHeader)
	}
	err := o.core.Offer(w, r)
	if se, ok := err.(*gate.StatusError); ok {
		return caddyhttp.Error(se.Status, se.Err)
	}
	return err
}

// emit reports a payment event through Caddy's events app, for `events` subscribers to react to; it builds the
// event's data only when someone listens.
func (g *Gate) emit(_ *http.Request, name string, data func() map[string]any) {
	if g.events.ShouldEmit(name) {
		g.events.Emit(g.ctx, name, data())
	}
}

// handlesErrors reports whether the request's server has handle_errors routes: the gate's 502 outcomes are then
// returned as errors for them to answer.
func handlesErrors(r *http.Request) bool {
	srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	return ok && srv.Errors != nil && len(srv.Errors.Routes) > 0
}

// pickFacilitator loads the gate's facilitator source: its facilitator module, or the shorthand of
// FacilitatorURL (the app's engine, or one facilitator over HTTP).
func (g *Gate) pickFacilitator(ctx caddy.Context, app *App, repl *caddy.Replacer) error {
	var upstreams []*FacilitatorUpstream
	url := strings.TrimSpace(repl.ReplaceAll(g.FacilitatorURL, ""))
	if url != "" && url != EmbeddedFacilitator {
		// The gate's one timeout bounds every call, settle included.
		upstreams = []*FacilitatorUpstream{{URL: url, APIKey: g.FacilitatorAPIKey, Timeout: g.FacilitatorTimeout, SettleTimeout: g.FacilitatorTimeout}}
	} else if g.FacilitatorRaw == nil && len(app.networkIDs()) == 0 {
		return errors.New("no facilitator: set facilitator_url, or configure the gate's network in the x402 global option to use the embedded facilitator")
	}
	if g.FacilitatorRaw != nil && g.FacilitatorURL != "" {
		return errors.New("give facilitator (a module) or facilitator_url, not both")
	}
	src, err := facilitatorSource(ctx, g, "FacilitatorRaw", g.FacilitatorRaw, upstreams)
	if err != nil {
		return err
	}
	if ip, ok := src.(inProcessSource); ok {
		networks := ip.app().networkIDs()
		for _, s := range g.specs {
			if !slices.Contains(networks, s.Network) {
				return fmt.Errorf("the embedded facilitator does not settle on %s (it settles on %s); configure that network in the x402 global option or set facilitator_url",
					s.Network, strings.Join(networks, ", "))
			}
		}
		// The engine itself runs once the app has started (see start).
		g.embedded, g.facName, g.redact = true, EmbeddedFacilitator, ip.app().rpcRedactor()
		return nil
	}
	if g.fac, err = src.Facilitator(); err != nil {
		return err
	}
	if err := g.provisionRemoteBatch(); err != nil {
		return err
	}
	g.facName, g.redact = sourceName(src), strings.NewReplacer()
	return nil
}

// Validate checks what Provision could not have fixed.
func (g *Gate) Validate() error {
	if err := g.Paywall.style(nil).Check(); err != nil {
		return err
	}
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
	switch g.PaymentIdentifier {
	case "", gate.PaymentIdentifierOptional, gate.PaymentIdentifierRequired:
	default:
		return fmt.Errorf("payment_identifier %q: want %q or %q", g.PaymentIdentifier, gate.PaymentIdentifierOptional, gate.PaymentIdentifierRequired)
	}
	if g.GasSponsoring != nil {
		if err := gate.CheckGasSponsoring(*g.GasSponsoring); err != nil {
			return err
		}
	}
	if g.PriceGrace < 0 {
		return fmt.Errorf("price_grace %s is negative; want a duration such as 1m, or 0 for none", time.Duration(g.PriceGrace))
	}
	if err := gate.CheckDiscovery(g.Discovery.core()); err != nil {
		return err
	}
	if err := gate.CheckAccess(g.Access.core(), g.Settle); err != nil {
		return err
	}
	if len(g.specs) == 0 {
		return errors.New("no way to pay is configured")
	}
	if err := gate.CheckSignInOnly(gate.Config{SignInOnly: g.SignInOnly, Access: g.Access.core(), Offers: g.specs}); err != nil {
		return err
	}
	switch g.DefaultAmount {
	case "", gate.DefaultAmountMax, gate.DefaultAmountZero:
	default:
		return fmt.Errorf("default_amount %q: want %q or %q", g.DefaultAmount, gate.DefaultAmountMax, gate.DefaultAmountZero)
	}
	for _, s := range g.specs {
		if s.Scheme == x402.SchemeUpto && g.Settle == SettleBefore {
			return errors.New("scheme upto charges what the upstream used, known only once it answered: use settle after (the default) or settle async, not settle before")
		}
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

// unloaded reports whether Caddy is unloading this gate's configuration (gate.Config.Unloaded): it cancels the
// configuration's context before it cleans its modules up, reverse_proxy's closing of upgraded connections among them.
func (g *Gate) unloaded() bool { return g.ctx.Context != nil && g.ctx.Err() != nil }

// Cleanup leaves the journal; the last gate of a journal stops its background settlements.
func (g *Gate) Cleanup() error {
	g.releaseOfferMemory()
	defer g.stopRemoteBatch() // after the gate: no voucher is accepted once its last claim pass ran
	if g.core == nil {
		return nil
	}
	if g.untrackBacklog != nil {
		g.untrackBacklog()
	}
	return g.core.Close()
}

// ServeHTTP gates the request behind a payment. A CORS preflight is answered at once; anything else waits
// for the x402 app to have started. A request presenting a payment header has its logging taken over
// (bearerLog): its error, whichever handler it comes from (the gate, or one inside it such as reverse_proxy),
// is answered here rather than by Caddy, whose error log would show the header.
func (g *Gate) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if g.MCP != nil && !gate.IsPreflight(r) {
		return g.MCP.core.ServeHTTP(w, r, func(w http.ResponseWriter, r *http.Request, next gate.Handler) error {
			return g.servePaid(w, r, caddyhttp.HandlerFunc(next.ServeHTTP))
		}, next)
	}
	return g.servePaid(w, r, next)
}

// servePaid is ServeHTTP of a request the gate prices.
func (g *Gate) servePaid(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	entry := g.logs.takeOver(r)
	if entry == nil {
		return g.serve(w, r, next)
	}
	rec := caddyhttp.NewResponseRecorder(w, nil, nil)
	err := entry.answerError(rec, g.serve(rec, r, next))
	status := rec.Status()
	if status == 0 {
		status = http.StatusOK // nothing written: net/http answers 200
	}
	entry.write(rec, status, rec.Size(), paymentLogFields(r))
	return err
}

// paymentLogFields is what an access log entry the gate writes says of the payment: its {http.x402.*}
// placeholders, which log_append would have added to Caddy's own entry.
func paymentLogFields(r *http.Request) zap.Field {
	fields := map[string]string{}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		for _, name := range []string{gate.VarStatus, gate.VarPayer, gate.VarNetwork, gate.VarAmount, gate.VarTransaction, gate.VarChannel, gate.VarCumulative} {
			if v, ok := repl.GetString("http.x402." + name); ok && v != "" {
				fields[name] = v
			}
		}
	}
	return zap.Any("x402", fields)
}

// serve is ServeHTTP with the access log entry settled.
func (g *Gate) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if gate.IsPreflight(r) {
		return gate.AnswerPreflight(w, r, g.CORSOrigins, g.PaymentHeader)
	}
	if err := g.app.awaitStart(r.Context()); err != nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
	if g.embedded {
		if waiting, err := g.app.engineDown(); waiting {
			if sup, ok := g.app.offlineSupported(); ok && !carriesPayment(r, g.PaymentHeader) {
				return g.offerOffline(w, r, sup)
			}
			return answerChainDown(w, r, g.PaymentHeader)
		} else if err != nil {
			return caddyhttp.Error(http.StatusServiceUnavailable, err)
		}
	}
	if g.core == nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("the x402 gate did not start"))
	}
	err := g.core.ServeHTTP(w, r, next)
	if se, ok := err.(*gate.StatusError); ok {
		return caddyhttp.Error(se.Status, se.Err)
	}
	return err
}

// setPaymentPlaceholder publishes one of the gate's variables as its {http.x402.*} placeholder.
func setPaymentPlaceholder(r *http.Request, name, value string) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	switch name {
	case gate.VarStatus:
		repl.Set("http.x402.status", value)
	case gate.VarPayer:
		repl.Set("http.x402.payer", value)
	case gate.VarNetwork:
		repl.Set("http.x402.network", value)
	case gate.VarAmount:
		repl.Set("http.x402.amount", value)
	case gate.VarTransaction:
		repl.Set("http.x402.transaction", value)
	default:
		repl.Set("http.x402."+name, value)
	}
}

// originalURI is the URI the client asked for, before any rewrite.
func originalURI(r *http.Request) string {
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok && orig.URL != nil {
		return orig.URL.RequestURI()
	}
	return r.URL.RequestURI()
}

// handlerErrorStatus is the status a Caddy handler error carries, 0 for none.
func handlerErrorStatus(err error) int {
	var he caddyhttp.HandlerError
	if errors.As(err, &he) {
		return he.StatusCode
	}
	return 0
}

// gateMetrics reports a gate's observations as the caddy_x402_* metrics of the gate handler.
type gateMetrics struct{ m *metrics }

func (gm gateMetrics) ObserveOutcome(status x402.OutcomeStatus) { gm.m.observeOutcome(status) }
func (gm gateMetrics) ObserveVerify(d time.Duration)            { gm.m.observeVerify(metricsHandlerGate, d) }
func (gm gateMetrics) ObserveSettle(d time.Duration)            { gm.m.observeSettle(metricsHandlerGate, d) }

// Interface guards
var (
	_ caddy.Provisioner           = (*Gate)(nil)
	_ caddy.Validator             = (*Gate)(nil)
	_ caddy.CleanerUpper          = (*Gate)(nil)
	_ caddyhttp.MiddlewareHandler = (*Gate)(nil)
	_ gate.Metrics                = gateMetrics{}
	// The embedded engine checks a contract wallet's sign-in as it checks its payments.
	_ gate.MessageSignatureChecker = (*chain.Facilitator)(nil)
)

// GateAccess is what a payment buys of its route beyond its response (sign-in-with-x).
type GateAccess struct {
	// For is how long a grant lasts from the payment's settlement, such as 1h. Required.
	For caddy.Duration `json:"for,omitempty"`
	// Requests bounds how many requests a grant lets in; 0 (the default): any number within For.
	Requests int64 `json:"requests,omitempty"`
	// Paths are the request paths a grant covers ("/reports/*": every path under /reports/); default: the path
	// the payment was made for, as the public SDK's servers grant.
	Paths []string `json:"paths,omitempty"`
	// Grant names the grant a payment here buys and a sign-in here spends, shared by every gate that names it:
	// access sold on one route is honoured on the others (each of which sells it too, at its own price).
	// Default: the grant is this route's alone.
	Grant string `json:"grant,omitempty"`
}

// core is a the gate core's Access of a; nil for nil.
func (a *GateAccess) core() *gate.Access {
	if a == nil {
		return nil
	}
	return &gate.Access{For: time.Duration(a.For), Requests: a.Requests, Paths: a.Paths, Grant: a.Grant}
}

// signInOnlyProblem says what keeps a sign_in_only gate from working (nil: nothing): it sells nothing, so it has
// no price of its own, no priced tools and no other way to pay at a price; it honours a named grant kept per payee.
func (g *Gate) signInOnlyProblem() error {
	if !g.SignInOnly {
		return nil
	}
	priced := g.Price != "" || g.Amount != ""
	for _, a := range g.Accepts {
		priced = priced || a.Price != "" || a.Amount != ""
	}
	switch {
	case priced:
		return errors.New("sign_in_only: the route sells nothing; remove its price and amount (the grant is sold on the routes that name it)")
	case g.MCP != nil:
		return errors.New("sign_in_only: not with mcp, which prices tool calls")
	case g.Access == nil || g.Access.Grant == "":
		return errors.New("sign_in_only: name the grant it honours (access <duration> { grant <name> }), bought on another route")
	case g.PayTo == "":
		return errors.New("sign_in_only: pay_to is required: a grant is kept per payee, and pay_to names whose grant the route honours")
	}
	return nil
}

// gasSponsoring is the core's GasSponsoring: nil (every extension the facilitator takes) when not configured, a
// list (empty for none) when configured.
func (g *Gate) gasSponsoring() []string {
	if g.GasSponsoring == nil {
		return nil
	}
	return append([]string{}, *g.GasSponsoring...)
}
