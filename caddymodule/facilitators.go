package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(FacilitatorEmbedded{})
	caddy.RegisterModule(FacilitatorHTTP{})
}

// FacilitatorSource is what a module of the x402.facilitators namespace is: the facilitator that verifies and
// settles the payments of a gate or of a facilitator handler, loaded the way reverse_proxy loads its transport.
// This project ships `embedded` (the x402 app's engine) and `http` (facilitators reached over HTTP, with
// failover); other modules may plug in their own.
//
// A source is provisioned with the gate or handler that loads it, and Facilitator is called right after: as
// everything in Provision, it must not connect, send or start anything (`caddy validate` provisions beside a
// running server). The facilitator's methods are called once the config runs, and may connect then.
type FacilitatorSource interface {
	// Facilitator returns the facilitator.
	Facilitator() (x402.Facilitator, error)
}

// inProcessSource is the embedded engine's source: its facilitator runs once the x402 app has started, settles
// on the networks the app configures, and tells the gate what it supports once rather than on a timer.
type inProcessSource interface {
	FacilitatorSource
	app() *App
}

// facilitatorSource loads the source a module's raw JSON names (field is the name of its json.RawMessage
// field), or builds the shorthand one: the upstreams given, else the embedded engine.
func facilitatorSource(ctx caddy.Context, module any, field string, raw []byte, upstreams []*FacilitatorUpstream) (FacilitatorSource, error) {
	switch {
	case raw != nil && len(upstreams) > 0:
		return nil, errors.New("give the facilitator as a module or by its URL, not both")
	case raw != nil:
		m, err := ctx.LoadModule(module, field)
		if err != nil {
			return nil, fmt.Errorf("loading the facilitator: %w", err)
		}
		src, ok := m.(FacilitatorSource)
		if !ok {
			return nil, fmt.Errorf("the module %T is not a facilitator source", m)
		}
		return src, nil
	case len(upstreams) > 0:
		src := &FacilitatorHTTP{Upstreams: upstreams}
		return src, src.Provision(ctx)
	default:
		src := new(FacilitatorEmbedded)
		return src, src.Provision(ctx)
	}
}

// FacilitatorEmbedded (`x402.facilitators.embedded`) is the x402 app's in-process engine: it settles on the
// networks of the x402 global option, from its settlement wallets.
type FacilitatorEmbedded struct {
	a *App
}

// CaddyModule returns the Caddy module information.
func (FacilitatorEmbedded) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "x402.facilitators.embedded", New: func() caddy.Module { return new(FacilitatorEmbedded) }}
}

// Provision finds the x402 app; its engine runs once the app has started.
func (f *FacilitatorEmbedded) Provision(ctx caddy.Context) error {
	v, err := ctx.App("x402")
	if err != nil {
		return fmt.Errorf("loading the x402 app: %w", err)
	}
	f.a = v.(*App)
	if len(f.a.networkIDs()) == 0 {
		return errors.New("the embedded facilitator settles on no network: configure a network in the x402 global option " +
			"(x402 { network <caip2> { rpc ... asset ... wallet_keys ... } } or x402 { dev_chain }), or use a facilitator reached over HTTP")
	}
	return nil
}

// Facilitator returns the x402 app's engine.
func (f *FacilitatorEmbedded) Facilitator() (x402.Facilitator, error) {
	engine := f.a.Facilitator()
	if engine == nil {
		return nil, errors.New("the x402 app's embedded facilitator is not running")
	}
	return engine, nil
}

func (f *FacilitatorEmbedded) app() *App { return f.a }

// UnmarshalCaddyfile reads `embedded`, which takes no options.
func (f *FacilitatorEmbedded) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if d.NextArg() || d.NextBlock(d.Nesting()) {
		return d.Err("the embedded facilitator takes no options")
	}
	return nil
}

// FacilitatorHTTP (`x402.facilitators.http`) is a facilitator reached over HTTP: /supported, /verify, /settle
// and /health under each upstream's base URL. Several upstreams are a failover set: each payment goes to the
// first member whose /supported lists its kind, and on to the next only when a member cannot be reached.
type FacilitatorHTTP struct {
	// Upstreams are the facilitators, in order of preference.
	Upstreams []*FacilitatorUpstream `json:"upstreams,omitempty"`

	fac x402.Facilitator
}

// CaddyModule returns the Caddy module information.
func (FacilitatorHTTP) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "x402.facilitators.http", New: func() caddy.Module { return new(FacilitatorHTTP) }}
}

// Provision builds the clients; it sends nothing.
func (f *FacilitatorHTTP) Provision(caddy.Context) error {
	if err := f.Validate(); err != nil {
		return err
	}
	var err error
	f.fac, err = httpFacilitator(f.Upstreams, caddy.NewReplacer())
	return err
}

// Validate checks the upstreams.
func (f *FacilitatorHTTP) Validate() error { return validateUpstreams(f.Upstreams) }

// Facilitator returns the client, or the failover set.
func (f *FacilitatorHTTP) Facilitator() (x402.Facilitator, error) { return f.fac, nil }

// name is the facilitator as logs name it: its base URL, or the first one of a failover set.
func (f *FacilitatorHTTP) name() string {
	if c, ok := f.fac.(*facilitatorclient.Client); ok {
		return c.BaseURL()
	}
	return fmt.Sprintf("a failover set of %d facilitators", len(f.Upstreams))
}

// UnmarshalCaddyfile reads
//
//	http [<url>...] {
//		upstream <url> {
//			api_key <key>
//			timeout <duration>
//			settle_timeout <duration>
//		}
//	}
func (f *FacilitatorHTTP) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	for d.NextArg() {
		f.Upstreams = append(f.Upstreams, &FacilitatorUpstream{URL: d.Val()})
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() != "upstream" {
			return d.Errf("unrecognized option '%s' of the http facilitator; want upstream", d.Val())
		}
		u, err := parseFacilitatorUpstream(d)
		if err != nil {
			return err
		}
		f.Upstreams = append(f.Upstreams, u)
	}
	return nil
}

// sourceName names a source's facilitator in logs: its URL, or its module's ID.
func sourceName(src FacilitatorSource) string {
	if h, ok := src.(*FacilitatorHTTP); ok {
		return h.name()
	}
	if m, ok := src.(caddy.Module); ok {
		return string(m.CaddyModule().ID)
	}
	return fmt.Sprintf("%T", src)
}

// httpFacilitator builds the facilitatorclient of upstreams: one client, or a failover set.
func httpFacilitator(upstreams []*FacilitatorUpstream, repl *caddy.Replacer) (x402.Facilitator, error) {
	if len(upstreams) == 0 {
		return nil, errors.New("no upstream facilitator: give at least one base URL")
	}
	clients := make([]*facilitatorclient.Client, 0, len(upstreams))
	for i, u := range upstreams {
		opts := []facilitatorclient.Option{}
		if key := repl.ReplaceAll(u.APIKey, ""); key != "" {
			opts = append(opts, facilitatorclient.WithAPIKey(key))
		} else if u.APIKey != "" {
			// Its text is placeholders only (any other character would be left), so naming it shows no secret.
			return nil, fmt.Errorf("the api_key of upstream #%d, %s, is empty once its placeholders are replaced; is its environment variable set?", i+1, u.APIKey)
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
	return facilitatorclient.NewFailoverSharing(sentPayments, clients...), nil
}

// sentPayments is the memory every failover set of this process shares: the member each payment's /settle may
// have reached. It outlives a configuration, so that a payment presented again after a reload, or retried by an
// async settlement that outlives it, is still asked of that member alone (another would refuse a payment that
// settled). It is bounded and its entries run out, so nothing needs to let go of it.
var sentPayments = facilitatorclient.NewSentPayments()

// validateUpstreams checks what no request could make right.
func validateUpstreams(upstreams []*FacilitatorUpstream) error {
	for i, u := range upstreams {
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

// Interface guards
var (
	_ FacilitatorSource     = (*FacilitatorEmbedded)(nil)
	_ inProcessSource       = (*FacilitatorEmbedded)(nil)
	_ caddy.Provisioner     = (*FacilitatorEmbedded)(nil)
	_ caddyfile.Unmarshaler = (*FacilitatorEmbedded)(nil)
	_ FacilitatorSource     = (*FacilitatorHTTP)(nil)
	_ caddy.Provisioner     = (*FacilitatorHTTP)(nil)
	_ caddy.Validator       = (*FacilitatorHTTP)(nil)
	_ caddyfile.Unmarshaler = (*FacilitatorHTTP)(nil)
)

// unmarshalFacilitatorOption reads the `facilitator` option at d: the shorthand `facilitator embedded|<url>`
// (returned as url), or a module of the x402.facilitators namespace with its options
// (`facilitator http { upstream ... }`, `facilitator <plugin> ...`), returned as its JSON.
func unmarshalFacilitatorOption(d *caddyfile.Dispenser) (url string, module json.RawMessage, err error) {
	if !d.NextArg() {
		return "", nil, d.Errf("facilitator needs one argument: %s, the facilitator's base URL, or a facilitator module such as http { upstream <url> }", EmbeddedFacilitator)
	}
	name := d.Val()
	if name == EmbeddedFacilitator || strings.Contains(name, "://") || strings.HasPrefix(name, "{") {
		if d.NextArg() {
			return "", nil, d.ArgErr()
		}
		return name, nil, nil
	}
	unm, err := caddyfile.UnmarshalModule(d, "x402.facilitators."+name)
	if err != nil {
		return "", nil, err
	}
	return "", caddyconfig.JSONModuleObject(unm, "source", name, nil), nil
}
