package gate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Settlement modes of a gate: when the payment is settled relative to serving the resource.
const (
	// SettleAfter runs the upstream first and settles only a successful response (the default): the payer
	// never pays for an error.
	SettleAfter = "after"
	// SettleBefore settles first and runs the upstream only for a settled payment, for resources that must
	// not be served unpaid (the upstream does something that cannot be undone).
	SettleBefore = "before"
	// SettleAsync records the verified payment in the journal, serves at once and settles in the background; a
	// payment whose deadline leaves its settlement too little room for that is settled first (asyncSettleMargin).
	SettleAsync = "async"
)

// What an upto payment is charged when the upstream names no amount (Config.DefaultAmount).
const (
	// DefaultAmountMax charges the maximum the payer authorized, the price offered.
	DefaultAmountMax = "max"
	// DefaultAmountZero charges nothing: only an upstream that names an amount is paid.
	DefaultAmountZero = "zero"
)

// Defaults of a Config field left zero.
const (
	// DefaultAsyncBacklog is how many served payments may wait for settlement before settle async settles
	// first: ten seconds of the dev chain's settlement rate, minutes of a slow network's, inside the default
	// five-minute validity of a payment either way.
	DefaultAsyncBacklog = 10_000
	// DefaultMaxBuffer bounds the response body a gate holds back per request: a page or a document is served
	// whole after settlement, a download streams once its payment settled.
	DefaultMaxBuffer = 8 << 20
)

// Names of the variables a gate publishes about a request's payment through Config.SetVar.
const (
	// VarStatus is the PaymentOutcome status; "verified" while the upstream runs before settlement.
	VarStatus = "status"
	// VarPayer is the verified payer.
	VarPayer = "payer"
	// VarNetwork is the CAIP-2 network paid on.
	VarNetwork = "network"
	// VarAmount is the amount in raw token units.
	VarAmount = "amount"
	// VarTransaction is the settlement transaction, once known.
	VarTransaction = "transaction"
	// VarChannel is the batch-settlement channel a voucher pays from (bytes32 hex).
	VarChannel = "channel"
	// VarCumulative is the channel's cumulative amount with the voucher, in raw token units.
	VarCumulative = "cumulative"
)

// Timing of a gate.
const (
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

// Offer is one way to pay with every default applied: a network, an asset, a recipient, a price and
// optionally one transfer method.
type Offer struct {
	// Network is the CAIP-2 network, Asset the token's address, PayTo the recipient, Amount the price in raw
	// token units (a decimal string).
	Network, Asset, PayTo, Amount string
	// TokenName and TokenVersion are the token's EIP-712 domain.
	TokenName, TokenVersion string
	// Decimals are the token's, to show the price to people.
	Decimals uint8
	// EIP3009 says the token implements EIP-3009 transferWithAuthorization.
	EIP3009 bool
	// Method restricts the offer to one transfer method; "" offers every method the facilitator supports.
	Method string
	// Scheme is x402.SchemeExact ("" too) or x402.SchemeUpto: the payer signs Amount as a maximum, and the
	// gate settles what the upstream's Settlement-Overrides header names (see Config.DefaultAmount); or
	// x402.SchemeBatchSettlement: Amount a request, paid by the vouchers of a channel (batch.go).
	Scheme string
	// MaxTimeoutSeconds is how long a signed payment stays valid.
	MaxTimeoutSeconds int64
}

// Config is what a gate sells and how: its ways to pay, already resolved, and the hooks through which the
// server around it observes each request.
type Config struct {
	// Offers are the ways to pay, in the order a 402 lists them (before the facilitator's methods expand them).
	Offers []Offer
	// Settle is SettleAfter (default), SettleBefore or SettleAsync.
	Settle string
	// AsyncBacklog bounds, with SettleAsync, the payments served and not settled yet (per journal); past it a
	// payment is settled before it is served. Default DefaultAsyncBacklog.
	AsyncBacklog int
	// MaxBuffer is how much of the upstream's response body, in bytes, is held back until the gate decides what
	// to send. Default DefaultMaxBuffer.
	MaxBuffer int64
	// DefaultAmount is what an upto payment is charged when the upstream names no amount (no Settlement-Overrides
	// header, or one that says nothing usable): DefaultAmountMax (the default) or DefaultAmountZero.
	DefaultAmount string
	// PaymentIdentifier declares the payment-identifier extension in the 402: "" (the default) declares
	// nothing, PaymentIdentifierOptional lets a client name its payment with an id, PaymentIdentifierRequired
	// refuses a payment that names none.
	PaymentIdentifier string
	// GasSponsoring, when not nil, names the gas-sponsoring extensions the gate declares in its 402s
	// (x402.ExtensionEIP2612GasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring), of those its facilitator
	// takes; an empty list declares neither. Default nil: every one the facilitator takes. A client without a
	// Permit2 allowance signs the EIP-2612 permit where eip2612GasSponsoring is declared and the token has a
	// permit, its own approval of Permit2 where only erc20ApprovalGasSponsoring is.
	GasSponsoring []string
	// Access, when set, grants a payer whose payment was served access to the route for a while
	// (sign-in-with-x): the 402 carries the challenge, and a signed answer is served without paying, within the
	// grant. Default nil: every request pays.
	Access *Access
	// SignInOnly makes the route one that sells nothing: its 402 offers no way to pay (accepts: []) and carries
	// the sign-in challenge, a payment presented to it is refused, and a sign-in is served for a wallet holding
	// Access.Grant (required), bought on another route paid to the same recipients. Offers name those recipients
	// (PayTo, required) and the networks of the challenge; they are never offered.
	SignInOnly bool
	// Discovery, when set, declares the route for discovery (the bazaar extension) in its 402s (bazaar.go).
	Discovery *Discovery
	// V1Body answers unpaid requests with the version 1 JSON body.
	V1Body bool
	// CORSOrigins are the origins whose browser scripts may pay; empty or "*" allows any origin.
	CORSOrigins []string
	// PaymentHeader is the request header carrying a version 2 payment. Default PAYMENT-SIGNATURE.
	PaymentHeader string
	// Description and MimeType describe the resource in the 402 answer.
	Description, MimeType string
	// Paywall is how the page a browser gets with the 402 looks.
	Paywall PaywallStyle
	// Route identifies the route this gate guards among the routes of its configuration: the same on every gateway
	// of that configuration and after a reload that changes only its terms (price, recipient, networks), and never
	// the same as another route's. A payment presented again for its resource is judged by its journal record only
	// at the route the record names. Default "": none, and every payment is judged by the route's offers.
	Route string

	// Unloaded reports whether the configuration serving the gate is being unloaded (a reload, a shutdown), which
	// closes the connections of open tunnels: a tunnel that ends then was cut by the server, not by its client or
	// upstream, and its payment bought nothing yet. Default nil: never.
	Unloaded func() bool

	// Embedded says the facilitator is the in-process engine: what it supports is asked once at Start, its
	// answers about a settlement are its journal's, and it settles on the networks it names.
	Embedded bool
	// EnginePrunes says an embedded engine prunes the journal, so the gates need not.
	EnginePrunes bool
	// FacilitatorName names the facilitator in logs: "embedded" or its base URL.
	FacilitatorName string
	// Redact takes secrets (RPC URLs holding provider keys) out of a facilitator's error text before it is
	// logged or answered. Default: none.
	Redact func(string) string

	// Logger receives the gate's log. Default: none.
	Logger *zap.Logger
	// Metrics counts outcomes and times verifications and settlements. Default: none.
	Metrics Metrics
	// SetVar publishes what the gate learns about a request's payment (names Var*), for access logs and the
	// upstream. Default: none.
	SetVar func(r *http.Request, name, value string)
	// OriginalURI is the request URI the client sent, before any rewrite, which the 402 names as the resource.
	// Default: r.URL.RequestURI().
	OriginalURI func(r *http.Request) string
	// Event reports what happens to payments (names Event*), with the payment's details, for other parts of
	// the server to react to; data builds the details only when called, so an event nobody listens to costs
	// nothing. It is called on the request's goroutine and must return quickly. r is nil for what happens to
	// a served async payment in the background (its settlement failing for good, say). Default: none.
	Event func(r *http.Request, name string, data func() map[string]any)
	// HandsOff reports whether the server answers errors itself (Caddy's handle_errors): then a 502 outcome is
	// returned as a *StatusError, its payment headers set, instead of being answered with the gate's JSON body.
	// Default: the gate answers.
	HandsOff func(r *http.Request) bool
	// ErrorStatus is the HTTP status an error of the next handler stands for, 0 when it names none (then 500).
	// Default: a *StatusError's status.
	ErrorStatus func(err error) int
	// Now is the gate's clock. Default time.Now.
	Now func() time.Time

	// OffersFor, when set, gives the ways to pay of one request, for a gate whose prices or recipients depend
	// on the request: the 402 offers them and a payment is matched against them. Offers then lists the ways to
	// pay as far as they are known without a request (their networks, to find the gate that settles a
	// journalled payment). An error stops the request with a 500 before the next handler runs; the offers
	// built from each distinct answer are kept, so the hook should return what it resolves quickly.
	OffersFor func(r *http.Request) ([]Offer, error)
	// DescriptionFor, when set, describes the resource of one request in place of Description.
	DescriptionFor func(r *http.Request) string
	// PriceGrace is how long after a 402 offered them its terms stay good for a payment of the same resource
	// (the same HTTP method and URL, and the URI a rewrite made of it), when they are no longer among the
	// request's offers: a price changed by a reload does not fail payments already signed. Its memory is keyed by
	// those alone, so OffersFor must then depend on nothing else of the request (caddymodule refuses a config
	// whose terms do). 0: off.
	PriceGrace time.Duration
	// OfferMemory is where the 402s' offers are remembered for PriceGrace, shared by the gates that replace one
	// another on a reload. Default: a memory of this gate's own.
	OfferMemory *OfferMemory

	// Ledgers holds the ledger of the gate's journal, shared with every other gate of that journal, of this
	// config and of the next after a reload: the owner of the journal (the Caddy app) holds it. Required by Start:
	// two ledgers of one journal would each miss the payments in flight at the other.
	Ledgers *Ledgers
	// Permits recovers who signed a version 1 erc2612 payment's permit, which tells the offer it was signed for
	// (the gate knows no EIP-712 itself). Required by New.
	Permits x402.PermitSigners
	// Batch serves scheme batch in front of a remote facilitator: it accepts the vouchers and claims them through
	// the facilitator (chain.RemoteBatch). Without it, scheme batch is served by an embedded facilitator only.
	Batch x402.BatchFacilitator
}

// Payment events, reported through Config.Event.
const (
	// EventVerified: the facilitator verified a payment; the resource is about to be produced.
	EventVerified = "payment_verified"
	// EventSettled: the payment settled on chain and bought the response.
	EventSettled = "payment_settled"
	// EventPending: the response was served and the payment settles in the background (settle async), or its
	// settlement's outcome is not known yet (the facilitator did not answer /settle). Reported too, with "async"
	// true and outcome settle-unreachable, for a served async payment whose settlement's outcome could not be
	// learnt: an earlier attempt may have settled it, its answer lost, and the facilitator now refuses it.
	EventPending = "payment_pending"
	// EventFailed: a payment was refused or not settled (malformed, not verified, settlement refused, or the
	// facilitator unreachable for verification); nothing was served for it. Reported too, with "async" true,
	// for a served async payment whose settlement failed for good: its resource went unpaid.
	EventFailed = "payment_failed"
)

// outcomeEvents names the event of each outcome that concerns a payment.
var outcomeEvents = map[x402.OutcomeStatus]string{
	x402.OutcomeInvalidHeader:     EventFailed,
	x402.OutcomeVerifyFailed:      EventFailed,
	x402.OutcomeVerifyUnreachable: EventFailed,
	x402.OutcomeSettleFailed:      EventFailed,
	x402.OutcomeSettleUnreachable: EventPending,
	x402.OutcomeSettlePending:     EventPending,
	x402.OutcomeSettled:           EventSettled,
}

// Metrics is what a gate reports to a metrics collector; its methods must be safe for concurrent use.
type Metrics interface {
	// ObserveOutcome counts one gated request by its PaymentOutcome status.
	ObserveOutcome(status x402.OutcomeStatus)
	// ObserveVerify records how long the facilitator took to verify a payment.
	ObserveVerify(d time.Duration)
	// ObserveSettle records how long the facilitator took to settle a payment.
	ObserveSettle(d time.Duration)
}

// Handler is the rest of the route a gate runs once a payment is good: the same shape as Caddy's
// caddyhttp.Handler, so a Caddy middleware passes its next handler straight through.
type Handler interface {
	ServeHTTP(http.ResponseWriter, *http.Request) error
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(http.ResponseWriter, *http.Request) error

// ServeHTTP calls f(w, r).
func (f HandlerFunc) ServeHTTP(w http.ResponseWriter, r *http.Request) error { return f(w, r) }

// StatusError is an error that stands for an HTTP status the server should log and, if nothing was written
// yet, answer: the gate returns 499 for a client that left while its payment settled.
type StatusError struct {
	// Status is the HTTP status, such as 499 for a client that went away.
	Status int
	// Err is what happened.
	Err error
}

// Error implements error.
func (e *StatusError) Error() string { return fmt.Sprintf("HTTP %d: %v", e.Status, e.Err) }

// Unwrap returns the cause.
func (e *StatusError) Unwrap() error { return e.Err }

// Gate is the x402 payment gate: it answers an unpaid request with 402 and what to pay, verifies the payment
// a client sends, runs the next handler, settles, and answers with the resource and the settlement. One
// payment buys exactly one response, across every gate of one journal.
type Gate struct {
	cfg      Config
	fac      x402.Facilitator
	holder   fundsHolder // fac, when it can hold payments against payers' funds and the gate settles async
	store    journal.Store
	owner    string
	registry *x402.Registry
	ledger   *Ledger
	metrics  Metrics
	logger   *zap.Logger
	now      func() time.Time

	// identifiers is store's PaymentIdentifiers, where the gate declares payment-identifier.
	identifiers journal.PaymentIdentifiers
	// access is store's Access, where the gate grants access (Config.Access).
	access journal.Access

	offers   atomic.Pointer[offerSet] // the current offers, rebuilt from /supported as it changes
	priced   pricedOffers             // with Config.OffersFor: the offers of each distinct answer
	refresh  sync.Mutex               // one /supported fetch at a time
	rotation atomic.Uint64            // spreads erc2612 payers over the settlement wallets
	warnedAt atomic.Int64             // when the async backlog was last reported full (unix nanoseconds)
	// versioned is the embedded facilitator, when its /supported answer changes while it runs (see
	// supportedVersioner); nil otherwise.
	versioned supportedVersioner
	// behind: fac is the embedded engine on this gate's own journal, so a paid request's writes to it may ride in
	// the engine's batches and the engine's in the gate's (journal.Defer). Never with a facilitator elsewhere: the
	// gate's record must be written before a settlement request leaves the process.
	behind bool
}

// New makes a gate that verifies and settles with fac and records payments in store, claiming them as owner
// (the token of this process's claims in the journal). It does no I/O: Start takes up the journal.
func New(cfg Config, fac x402.Facilitator, store journal.Store, owner string) (*Gate, error) {
	if fac == nil {
		return nil, errors.New("no facilitator")
	}
	if store == nil {
		return nil, errors.New("no settlement journal")
	}
	if len(cfg.Offers) == 0 {
		return nil, errors.New("no way to pay is configured")
	}
	if cfg.Permits == nil {
		return nil, errors.New("Config.Permits is nil: a version 1 erc2612 payment could not be matched to the offer it was signed for")
	}
	if cfg.PaymentHeader == "" {
		cfg.PaymentHeader = x402.HeaderPaymentSignature
	}
	switch cfg.DefaultAmount {
	case "":
		cfg.DefaultAmount = DefaultAmountMax
	case DefaultAmountMax, DefaultAmountZero:
	default:
		return nil, fmt.Errorf("default_amount %q is not one; want %q or %q", cfg.DefaultAmount, DefaultAmountMax, DefaultAmountZero)
	}
	if err := checkPaymentIdentifierMode(cfg.PaymentIdentifier); err != nil {
		return nil, err
	}
	if err := CheckGasSponsoring(cfg.GasSponsoring); err != nil {
		return nil, err
	}
	if err := CheckSignInOnly(cfg); err != nil {
		return nil, err
	}
	for _, o := range cfg.Offers {
		switch {
		case !x402.IsScheme(o.Scheme) && o.Scheme != "" && o.Scheme != x402.SchemeBatchSettlement:
			return nil, fmt.Errorf("scheme %q is not supported; want %q, %q or %q", o.Scheme, x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement)
		case o.Scheme == x402.SchemeBatchSettlement && o.Method != "" && o.Method != x402.TransferEIP3009:
			return nil, fmt.Errorf("scheme batch-settlement is paid by deposits by eip3009 only, not %s", o.Method)
		case o.Scheme == x402.SchemeUpto && o.Method != "" && o.Method != x402.TransferPermit2:
			return nil, fmt.Errorf("scheme upto is paid by permit2 only, not %s", o.Method)
		case o.Scheme == x402.SchemeUpto && cfg.Settle == SettleBefore:
			return nil, errors.New("scheme upto settles what the upstream used, which is known only after it answers: use settle after (the default) or settle async, not settle before")
		}
	}
	switch cfg.Settle {
	case "":
		cfg.Settle = SettleAfter
	case SettleAfter, SettleBefore, SettleAsync:
	default:
		return nil, fmt.Errorf("settle %q is not a settlement mode; want %q, %q or %q", cfg.Settle, SettleAfter, SettleBefore, SettleAsync)
	}
	if cfg.AsyncBacklog == 0 {
		cfg.AsyncBacklog = DefaultAsyncBacklog
	}
	if cfg.MaxBuffer == 0 {
		cfg.MaxBuffer = DefaultMaxBuffer
	}
	if cfg.Redact == nil {
		cfg.Redact = func(s string) string { return s }
	}
	if cfg.OriginalURI == nil {
		cfg.OriginalURI = func(r *http.Request) string { return r.URL.RequestURI() }
	}
	if cfg.ErrorStatus == nil {
		cfg.ErrorStatus = func(err error) int {
			var se *StatusError
			if errors.As(err, &se) {
				return se.Status
			}
			return 0
		}
	}
	g := &Gate{cfg: cfg, fac: fac, store: store, owner: owner, registry: x402.NewRegistry(),
		metrics: cfg.Metrics, logger: cfg.Logger, now: cfg.Now}
	if sj, ok := fac.(interface{ SharesJournal(journal.Store) bool }); ok && cfg.Embedded {
		g.behind = sj.SharesJournal(store)
	}
	if g.metrics == nil {
		g.metrics = noMetrics{}
	}
	if g.logger == nil {
		g.logger = zap.NewNop()
	}
	if g.now == nil {
		g.now = time.Now
	}
	if cfg.PriceGrace > 0 && cfg.OfferMemory == nil {
		g.cfg.OfferMemory = NewOfferMemory(DefaultOfferMemoryBytes)
	}
	if h, ok := fac.(fundsHolder); ok && cfg.Settle == SettleAsync {
		g.holder = h
	}
	if cfg.PaymentIdentifier != "" {
		ids, ok := store.(journal.PaymentIdentifiers)
		if !ok {
			return nil, fmt.Errorf("payment_identifier: the settlement journal (%T) keeps no payment identifiers", store)
		}
		g.identifiers = ids
	}
	if err := CheckDiscovery(cfg.Discovery); err != nil {
		return nil, err
	}
	if err := CheckAccess(cfg.Access, cfg.Settle); err != nil {
		return nil, err
	}
	if cfg.Access != nil && cfg.OffersFor != nil {
		// A grant is the route's (its paths), not one request's terms: bought at the price or by the recipient of
		// one request, it would serve another's (a cheap query the dear one, tenant A's payment tenant B's page).
		return nil, errors.New("access: the route's price or recipient depends on the request (placeholders in price, amount or pay_to): a grant bought on one request's terms would serve requests of other terms; give access a gate of fixed terms (split the route by path)")
	}
	if cfg.Access != nil {
		a, ok := store.(journal.Access)
		if !ok {
			return nil, fmt.Errorf("access: the settlement journal (%T) keeps no access grants", store)
		}
		g.access = a
	}
	if cfg.Settle == SettleAsync {
		for _, o := range cfg.Offers {
			if time.Duration(o.MaxTimeoutSeconds)*time.Second <= asyncSettleMargin {
				g.logger.Warn("settle async: an offer's payments are valid too briefly to be settled after serving; each is settled before it is served",
					zap.Int64("max_timeout_seconds", o.MaxTimeoutSeconds), zap.Duration("settle_margin", asyncSettleMargin))
				break
			}
		}
	}
	if !cfg.Embedded {
		// A remote facilitator may be down now; the gate starts anyway and asks when payments come.
		g.offers.Store(buildOffers(cfg.Offers, nil, g.registry, time.Time{}))
	} else {
		g.versioned, _ = fac.(supportedVersioner)
	}
	return g, nil
}

// supportedVersioner is an embedded facilitator whose /supported answer changes while it runs: the engine sharing
// its journal with other processes sends only from the wallets whose leases it holds, and an upto or erc2612
// offer binds the payment to one of them. SupportedVersion changes whenever the answer may have.
type supportedVersioner interface {
	SupportedVersion() uint64
}

// Start takes up what the gate works with: the embedded engine's offers, and the journal's ledger with its
// background settlements (async payments a previous process served are settled from here on).
func (g *Gate) Start() error {
	if g.cfg.Embedded {
		// Shaped once, and again only when the engine says its answer changed (see currentOffers).
		if _, err := g.fetchEmbeddedOffers(); err != nil {
			return err
		}
	}
	if g.cfg.Ledgers == nil {
		return errors.New("x402 gate: Config.Ledgers is nil: the gates of a journal must share its owner's ledgers")
	}
	ledger := g.cfg.Ledgers.join(g.store, g.owner, g.logger)
	if err := ledger.register(g); err != nil {
		ledger.unregister(g)
		g.cfg.Ledgers.leave(ledger)
		return err
	}
	g.ledger = ledger
	return nil
}

// Close leaves the journal; the last gate of a journal stops its background settlements, and the payments
// they did not finish are settled after the next Start.
func (g *Gate) Close() error {
	if g.ledger == nil {
		return nil
	}
	g.ledger.unregister(g)
	g.cfg.Ledgers.leave(g.ledger)
	return nil
}

// Ledger is the ledger the gate shares with the other gates of its journal, once started.
func (g *Gate) Ledger() *Ledger { return g.ledger }

// ServeHTTP gates one request behind a payment: next runs only for a payment that is good for it.
func (g *Gate) ServeHTTP(w http.ResponseWriter, r *http.Request, next Handler) error {
	if IsPreflight(r) {
		// A CORS preflight carries no payment and must not reach the upstream, which may answer it with the
		// paid resource: the gate answers it itself.
		return AnswerPreflight(w, r, g.cfg.CORSOrigins, g.cfg.PaymentHeader)
	}
	if g.ledger == nil {
		return &StatusError{Status: http.StatusServiceUnavailable, Err: errors.New("the x402 gate has not started")}
	}
	x := &exchange{g: g, w: w, r: r, next: next, start: g.now()}
	allowOrigin(g.cfg.CORSOrigins, w.Header(), r)
	exposePaymentHeaders(w.Header())
	defer x.writeLog() // a line endHeld held back for a response that never reached deliver
	return x.run()
}

// Offer answers a request that carries no payment with what to pay (402, or 503 with Retry-After when there is
// nothing to offer), without the gate having started: for a gate whose embedded facilitator says what it
// supports from its configuration but cannot verify or settle yet (its chain does not answer). It reads no
// journal and calls no next handler; a request carrying a payment is not its to answer.
func (g *Gate) Offer(w http.ResponseWriter, r *http.Request) error {
	if g.cfg.Embedded && g.offers.Load() == nil {
		g.refresh.Lock()
		if g.offers.Load() == nil {
			if _, err := g.fetchEmbeddedOffers(); err != nil {
				g.refresh.Unlock()
				x := &exchange{g: g, w: w, r: r, start: g.now()}
				return x.noOffer()
			}
		}
		g.refresh.Unlock()
	}
	x := &exchange{g: g, w: w, r: r, start: g.now()}
	allowOrigin(g.cfg.CORSOrigins, w.Header(), r)
	exposePaymentHeaders(w.Header())
	offers, err := g.offersFor(r)
	if err != nil {
		return &StatusError{Status: http.StatusInternalServerError, Err: err}
	}
	x.offers, x.turn = offers, g.rotation.Add(1)
	return x.noPayment()
}

// noMetrics is the Metrics of a gate configured without any.
type noMetrics struct{}

func (noMetrics) ObserveOutcome(x402.OutcomeStatus) {}
func (noMetrics) ObserveVerify(time.Duration)       {}
func (noMetrics) ObserveSettle(time.Duration)       {}

// warnBacklog logs, at most every ten seconds, that settle async is settling before serving because too many
// served payments wait for settlement.
func (g *Gate) warnBacklog() {
	now := g.now().UnixNano()
	last := g.warnedAt.Load()
	if now-last < int64(10*time.Second) || !g.warnedAt.CompareAndSwap(last, now) {
		return
	}
	g.logger.Warn("settle async: the backlog of served payments waiting for settlement is full; settling before serving until it drains",
		zap.Int("async_backlog", g.cfg.AsyncBacklog))
}

// settlesOn reports whether the gate's facilitator settles on network: the engine's networks for the
// embedded one, the networks of the gate's own offers for a remote one (what else it serves is not known here).
func (g *Gate) settlesOn(network string) bool {
	if n, ok := g.fac.(interface{ Networks() []string }); ok && g.cfg.Embedded {
		return slices.Contains(n.Networks(), network)
	}
	return slices.ContainsFunc(g.cfg.Offers, func(s Offer) bool { return s.Network == network })
}

// currentOffers returns the offers to make now. For a remote facilitator they are rebuilt from its /supported
// answer when that is older than supportedTTL: in the background while a stale answer serves, or, when none
// is known yet, while the request waits (up to supportedWait). A fetch that fails keeps the last offers (or
// only what is configured explicitly) and is not repeated for supportedRetry.
//
// The embedded engine's offers are rebuilt when its SupportedVersion moved (a wallet lease taken, lost or being
// given up), before the request is answered: a 402 names only wallets the engine sends from at that moment.
// Checking costs one atomic read; rebuilding, done once per change, a few microseconds.
func (g *Gate) currentOffers(ctx context.Context) *offerSet {
	cur := g.offers.Load()
	if g.cfg.Embedded {
		if g.versioned == nil || g.versioned.SupportedVersion() == cur.version {
			return cur
		}
		g.refresh.Lock()
		defer g.refresh.Unlock()
		if latest := g.offers.Load(); latest.version == g.versioned.SupportedVersion() {
			return latest // rebuilt while this request waited for the lock
		}
		set, err := g.fetchEmbeddedOffers()
		if err != nil {
			g.logger.Warn("the embedded facilitator's offers could not be rebuilt; they stay as they were", zap.Error(err))
			return cur
		}
		return set
	}
	now := g.now()
	if (cur.known && now.Sub(cur.at) < supportedTTL) || (!cur.failedAt.IsZero() && now.Sub(cur.failedAt) < supportedRetry) {
		return cur
	}
	if cur.known {
		if g.refresh.TryLock() {
			go func() {
				defer g.refresh.Unlock()
				g.fetchOffers(context.Background())
			}()
		}
		return cur
	}
	g.refresh.Lock()
	defer g.refresh.Unlock()
	if latest := g.offers.Load(); latest != cur {
		return latest // fetched while this request waited for the lock
	}
	return g.fetchOffers(ctx)
}

// fetchEmbeddedOffers asks the embedded facilitator what it supports and builds the offers from it, noting the
// version of the answer (read before it, so that a change while it is asked makes the next request ask again).
// The caller holds refresh, or is Start.
func (g *Gate) fetchEmbeddedOffers() (*offerSet, error) {
	var version uint64
	if g.versioned != nil {
		version = g.versioned.SupportedVersion()
	}
	sup, err := g.fac.Supported(context.Background())
	if err != nil {
		return nil, fmt.Errorf("asking the embedded facilitator what it supports: %w", err)
	}
	set := buildOffers(g.cfg.Offers, &sup, g.registry, g.now())
	set.sup, set.version = &sup, version
	g.offers.Store(set)
	return set, nil
}

// fetchOffers asks the facilitator's /supported and rebuilds the offers from it; the caller holds refresh.
func (g *Gate) fetchOffers(ctx context.Context) *offerSet {
	ctx, cancel := context.WithTimeout(ctx, supportedWait)
	defer cancel()
	sup, err := g.fac.Supported(ctx)
	now := g.now()
	if err != nil {
		g.logger.Warn("the facilitator's /supported could not be read; the offers stay as they were",
			zap.String("facilitator", g.cfg.FacilitatorName), zap.String("error", g.describe(err)))
		next := *g.offers.Load()
		next.failedAt = now
		g.offers.Store(&next)
		return &next
	}
	next := buildOffers(g.cfg.Offers, &sup, g.registry, now)
	next.sup = &sup
	g.offers.Store(next)
	return next
}

// describe is an error's text with secrets taken out, for answers and logs.
func (g *Gate) describe(err error) string { return g.cfg.Redact(err.Error()) }

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
