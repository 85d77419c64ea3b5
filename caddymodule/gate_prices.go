package caddymodule

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/gate"
)

// This file holds the gate's terms set per request: the price, amount, pay_to and description whose values
// hold placeholders only a request fills (a map's or vars' output, {http.request.*}), and the memory of
// offers that price_grace keeps across reloads.

// termOptions are the options of a way to pay that may be set per request.
var termOptions = [...]string{"price", "amount", "pay_to"}

// placeholderStandIns are values that pass the Provision checks in place of a value set per request, so that
// the rest of a way to pay is checked there.
var placeholderStandIns = map[string]string{"price": "$1", "amount": "1", "pay_to": "0x0000000000000000000000000000000000000001"}

// maxResolvedTerms bounds the distinct resolved values whose offers (or whose error) a gate keeps.
const maxResolvedTerms = 256

// requestTerms resolves, per request, the options of a gate's ways to pay whose values hold request
// placeholders, and checks them by the rules Provision checks the others by.
type requestTerms struct {
	gate   Gate        // the gate as configured, whose ways to pay are copied and filled per request
	app    *App        // whose networks and assets fill the defaults
	fields []termField // the options with request placeholders, in a fixed order
	logger *zap.Logger

	mu    sync.RWMutex
	cache map[string]resolvedTerms // by the resolved values, joined
}

// termField is one option of one way to pay whose value is set per request.
type termField struct {
	way    int    // 0: the gate's own fields; i: accept block i
	option string // price, amount or pay_to
	raw    string // its template, as configured
}

// resolvedTerms is what one set of resolved values comes to: offers, or what is wrong with which value.
type resolvedTerms struct {
	offers []gate.Offer
	err    error
}

// hasPlaceholder reports whether s holds a placeholder (an unescaped {key}).
func hasPlaceholder(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '{' && (i == 0 || s[i-1] != '\\') {
			if end := strings.IndexByte(s[i+1:], '}'); end > 0 {
				return true
			}
		}
	}
	return false
}

// requestPlaceholders reports whether v holds placeholders that only a request fills: any the global
// replacer ({env.*}, {system.*}, {file.*}, {time.*}) does not know.
func requestPlaceholders(v string) bool {
	return hasPlaceholder(caddy.NewReplacer().ReplaceKnown(v, ""))
}

// requestPlaceholderKeys returns the placeholders of v (their keys, without braces) that only a request fills:
// those the global replacer does not know.
func requestPlaceholderKeys(v string) []string {
	global := caddy.NewReplacer()
	var keys []string
	for i := 0; i < len(v); i++ {
		if v[i] != '{' || (i > 0 && v[i-1] == '\\') {
			continue
		}
		end := strings.IndexByte(v[i+1:], '}')
		if end <= 0 {
			break
		}
		key := v[i+1 : i+1+end]
		if _, known := global.Get(key); !known {
			keys = append(keys, key)
		}
		i += end + 1
	}
	return keys
}

// graceKeyed reports whether a request placeholder is part of what price_grace remembers a 402's offers by (see
// gate.Config.PriceGrace): the request's method and URL, as sent and as rewritten.
func graceKeyed(key string) bool {
	switch key {
	case "http.request.method", "http.request.orig_method", "http.request.scheme", "http.request.host",
		"http.request.hostport", "http.request.port", "http.request.uri", "http.request.orig_uri":
		return true
	}
	for _, prefix := range [...]string{"http.request.uri.", "http.request.orig_uri.", "http.request.host.labels."} {
		if strings.HasPrefix(key, prefix) {
			return true
		}
	}
	return false
}

// graceProblem says why the gate's price_grace cannot be taken, nil when it can (or there is none): price_grace
// remembers what a 402 offered by the request's method and URL, so a term set from anything else would make the
// offer one request got payable by every request of that URL.
func (g *Gate) graceProblem() error {
	if g.PriceGrace <= 0 {
		return nil
	}
	for i := 0; i <= len(g.Accepts); i++ {
		for _, opt := range termOptions {
			v := *termValue(g.way(i), opt)
			for _, key := range requestPlaceholderKeys(v) {
				if graceKeyed(key) {
					continue
				}
				name := opt
				if i > 0 {
					name = fmt.Sprintf("accept block %d's %s", i, opt)
				}
				return fmt.Errorf("price_grace %s cannot be used with %s %s: price_grace remembers a 402's offers by the request's "+
					"method and URL only, and {%s} is neither (a header, a user, the client's address, a map or vars output), so the "+
					"offer one request got would be payable by every request of that URL; set %s from the method and URL only "+
					"({http.request.uri.*}, {http.request.host}, {http.request.method}), give each price a route of its own, or leave "+
					"price_grace out", time.Duration(g.PriceGrace), name, v, key, opt)
			}
		}
	}
	return nil
}

// way returns way i of g: its own fields for 0, accept block i else.
func (g *Gate) way(i int) *GateAccept {
	if i == 0 {
		return &g.GateAccept
	}
	return g.Accepts[i-1]
}

// termValue points at the option of a way to pay.
func termValue(a *GateAccept, option string) *string {
	switch option {
	case "price":
		return &a.Price
	case "amount":
		return &a.Amount
	default:
		return &a.PayTo
	}
}

// withTerms is a copy of g whose ways to pay have fields set to values (stand-ins where values is nil).
func (g *Gate) withTerms(fields []termField, values []string) *Gate {
	c := *g
	c.Accepts = make([]*GateAccept, len(g.Accepts))
	for i, a := range g.Accepts {
		cp := *a
		c.Accepts[i] = &cp
	}
	for i, f := range fields {
		v := placeholderStandIns[f.option]
		if values != nil {
			v = values[i]
		}
		*termValue(c.way(f.way), f.option) = v
	}
	return &c
}

// provisionOffers resolves the gate's ways to pay at Provision. Options without request placeholders are
// resolved and checked here, as always; options with them are noted to be resolved per request (stand-ins take
// their place for the checks), and the offers returned then leave their amounts and recipients empty: they name
// the networks only.
func (g *Gate) provisionOffers(app *App, repl *caddy.Replacer) ([]gate.Offer, error) {
	if err := g.graceProblem(); err != nil {
		return nil, err
	}
	var fields []termField
	for i := 0; i <= len(g.Accepts); i++ {
		for _, opt := range termOptions {
			switch v := termValue(g.way(i), opt); {
			case requestPlaceholders(*v):
				fields = append(fields, termField{way: i, option: opt, raw: *v})
			case opt != "pay_to" && hasPlaceholder(*v):
				// Global placeholders ({env.PRICE}) are resolved here once; resolveOffer does so for pay_to.
				*v = strings.TrimSpace(repl.ReplaceAll(*v, ""))
			}
		}
	}
	if requestPlaceholders(g.Description) {
		g.descriptionFor = func(r *http.Request) string {
			return requestReplacer(r).ReplaceKnown(g.Description, "")
		}
	} else {
		g.Description = repl.ReplaceKnown(g.Description, "")
	}
	if len(fields) == 0 {
		return g.resolveOffers(app, repl)
	}
	specs, err := g.withTerms(fields, nil).resolveOffers(app, repl)
	if err != nil {
		return nil, err
	}
	for i := range specs {
		specs[i].Amount, specs[i].PayTo = "", ""
	}
	terms := &requestTerms{gate: *g, app: app, fields: fields, logger: g.logger, cache: make(map[string]resolvedTerms)}
	g.offersFor = terms.offers
	return specs, nil
}

// requestReplacer is the request's replacer, or the global one for a request Caddy did not give one.
func requestReplacer(r *http.Request) *caddy.Replacer {
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		return repl
	}
	return caddy.NewReplacer()
}

// offers resolves the request's ways to pay (gate.Config.OffersFor). A value that is not good is logged,
// naming the option, its template and the value, and answered 500: the request is neither offered nor served
// at a price nobody set.
func (t *requestTerms) offers(r *http.Request) ([]gate.Offer, error) {
	repl := requestReplacer(r)
	values := make([]string, len(t.fields))
	for i, f := range t.fields {
		values[i] = strings.TrimSpace(repl.ReplaceKnown(f.raw, ""))
	}
	key := strings.Join(values, "\x00")
	t.mu.RLock()
	res, ok := t.cache[key]
	t.mu.RUnlock()
	if !ok {
		res = t.resolve(values)
		t.mu.Lock()
		if len(t.cache) >= maxResolvedTerms {
			clear(t.cache)
		}
		t.cache[key] = res
		t.mu.Unlock()
	}
	if res.err != nil {
		if te, ok := res.err.(*termError); ok {
			t.logger.Error("a way to pay set by the request is not valid; answering 500 without calling the upstream",
				zap.String("option", te.field.option), zap.String("template", te.field.raw), zap.String("value", te.value),
				zap.String("error", te.err.Error()), zap.String("uri", r.RequestURI))
		}
		return nil, res.err
	}
	return res.offers, nil
}

// resolve checks resolved values by the rules of Provision and makes the offers they come to.
func (t *requestTerms) resolve(values []string) resolvedTerms {
	specs, err := t.gate.withTerms(t.fields, values).resolveOffers(t.app, caddy.NewReplacer())
	if err == nil {
		for i, f := range t.fields {
			if f.option == "pay_to" && strings.ContainsAny(values[i], "{}") {
				// An address has no braces; this one came from a value the request fills, and was read again as a
				// placeholder of the global replacer.
				return resolvedTerms{err: &termError{field: f, value: values[i], err: fmt.Errorf("pay_to %q is not an address (0x and 40 hex digits)", values[i])}}
			}
		}
		return resolvedTerms{offers: specs}
	}
	// Which value is it? Each alone, the others stood in for.
	for i, f := range t.fields {
		one := make([]string, len(t.fields))
		for j, g := range t.fields {
			one[j] = placeholderStandIns[g.option]
		}
		one[i] = values[i]
		if _, ferr := t.gate.withTerms(t.fields, one).resolveOffers(t.app, caddy.NewReplacer()); ferr != nil {
			return resolvedTerms{err: &termError{field: f, value: values[i], err: ferr}}
		}
	}
	return resolvedTerms{err: &termError{field: t.fields[0], value: values[0], err: err}}
}

// termError is a value set per request that is not good.
type termError struct {
	field termField
	value string
	err   error
}

func (e *termError) Error() string {
	return fmt.Sprintf("x402 %s %q resolved to %q for this request: %v", e.field.option, e.field.raw, e.value, e.err)
}

func (e *termError) Unwrap() error { return e.err }

// offerMemories holds the gates' memory of what their 402s offered, for price_grace: one per process, kept
// across config reloads (the new config's gates take it up before the old config's let it go) and lost when the
// process ends.
var offerMemories = caddy.NewUsagePool()

// offerMemoryKey names the process's offer memory in offerMemories.
const offerMemoryKey = "x402.gate.offers"

// offerMemory is an OfferMemory as a UsagePool value.
type offerMemory struct{ *gate.OfferMemory }

// Destruct has nothing to release: the memory is garbage once no gate holds it.
func (offerMemory) Destruct() error { return nil }

// takeOfferMemory takes up the process's offer memory for a gate with a price grace.
func (g *Gate) takeOfferMemory() error {
	if g.PriceGrace <= 0 {
		return nil
	}
	val, _, err := offerMemories.LoadOrNew(offerMemoryKey, func() (caddy.Destructor, error) {
		return offerMemory{gate.NewOfferMemory(gate.DefaultOfferMemoryBytes)}, nil
	})
	if err != nil {
		return err
	}
	g.offered = val.(offerMemory).OfferMemory
	return nil
}

// releaseOfferMemory lets go of the offer memory takeOfferMemory took up.
func (g *Gate) releaseOfferMemory() {
	if g.offered != nil {
		g.offered = nil
		_, _ = offerMemories.Delete(offerMemoryKey)
	}
}
