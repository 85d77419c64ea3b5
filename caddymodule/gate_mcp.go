package caddymodule

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sort"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/dustin/go-humanize"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// MCPFree is the price of a tool that is not paid for.
const MCPFree = "free"

// GateMCP prices the tool calls of an MCP server behind the gate (streamable HTTP transport, behind
// reverse_proxy), as the x402 MCP transport says: a tools/call of a priced tool is paid per call, its payment in
// params._meta["x402/payment"] and its settlement in the result's _meta["x402/payment-response"]; an unpaid one
// is answered with a tool result with isError and the PaymentRequired. initialize, tools/list (which gains each
// priced tool's price in the tool's _meta["x402/price"]), notifications and every other method pass free.
type GateMCP struct {
	// Tools are the prices of tools by name: dollars ("$0.01") or "free".
	Tools map[string]string `json:"tools,omitempty"`
	// Default is the price of a tool Tools does not name: dollars, or "free" (the default).
	Default string `json:"default,omitempty"`
	// MaxBody bounds the JSON-RPC request body the gate reads, in bytes. Default 1 MiB.
	MaxBody int64 `json:"max_body,omitempty"`

	// offers are the gate's ways to pay at each priced tool's price; byDefault at the default price.
	offers    map[string][]gate.Offer
	byDefault []gate.Offer
	core      *gate.MCP
}

// price is what a call of tool costs as configured, "" when it is free.
func (m *GateMCP) price(tool string) string {
	p, ok := m.Tools[tool]
	if !ok {
		p = m.Default
	}
	if p == MCPFree {
		return ""
	}
	return p
}

// mcpStandIn is the price the gate's ways to pay are resolved at before each tool's price replaces it.
const mcpStandIn = "$1"

// provisionMCP checks the mcp block against the rest of the gate and sets each priced tool's offers. The gate's
// own price is the tools' business: price and amount are refused beside mcp, and so are price_grace and access
// (both key by the URL, which every tool of the server shares), upto (what an MCP server would charge is not
// named) and batch.
func (g *Gate) provisionMCP(app *App) ([]gate.Offer, error) {
	m := g.MCP
	if m.Default == "" {
		m.Default = MCPFree
	}
	for i := 0; i <= len(g.Accepts); i++ {
		if w := g.way(i); w.Price != "" || w.Amount != "" {
			return nil, errors.New("mcp: the price of a call is the tool's (tool <name> <price>, default <price>); remove price and amount")
		}
	}
	if g.PriceGrace > 0 {
		return nil, errors.New("mcp: price_grace remembers a price by the URL, which every tool shares; it cannot be used with mcp")
	}
	if g.Access != nil {
		return nil, errors.New("mcp: access grants a payer the route's paths, which every tool shares (a grant bought by a cheap call would serve the dear ones); it cannot be used with mcp")
	}
	if m.MaxBody < 0 {
		return nil, fmt.Errorf("mcp max_body %d is negative", m.MaxBody)
	}
	g.Price = mcpStandIn
	defer func() { g.Price = "" }()
	specs, err := g.resolveOffers(app, caddy.NewReplacer())
	if err != nil {
		return nil, err
	}
	for _, s := range specs {
		if s.Scheme != x402.SchemeExact {
			return nil, fmt.Errorf("mcp: scheme %s is not offered for tool calls; the exact scheme is", s.Scheme)
		}
	}
	priced := func(what, price string) ([]gate.Offer, error) {
		offers := make([]gate.Offer, len(specs))
		for i, s := range specs {
			n, err := parseCost("", price, s.Decimals)
			if err != nil {
				return nil, fmt.Errorf("mcp %s: %w", what, err)
			}
			s.Amount = n.String()
			offers[i] = s
		}
		return offers, nil
	}
	m.offers = map[string][]gate.Offer{}
	names := make([]string, 0, len(m.Tools))
	for name := range m.Tools {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if m.Tools[name] == "" {
			return nil, fmt.Errorf("mcp tool %q has no price; want dollars such as $0.01, or free", name)
		}
		if p := m.price(name); p != "" {
			if m.offers[name], err = priced("tool "+name, p); err != nil {
				return nil, err
			}
		}
	}
	if p := m.price(""); m.Default != MCPFree && p != "" {
		if m.byDefault, err = priced("default", p); err != nil {
			return nil, err
		}
	}
	m.core = &gate.MCP{Price: m.price, MaxBody: m.MaxBody, PaymentHeader: g.PaymentHeader}
	g.offersFor = m.offersFor
	g.descriptionFor = func(r *http.Request) string {
		tool, _ := gate.MCPTool(r)
		if g.Description != "" {
			return g.Description + ": tool " + tool
		}
		return "MCP tool " + tool
	}
	return specs, nil
}

// offersFor is the ways to pay of a call of the request's priced tool (gate.Config.OffersFor).
func (m *GateMCP) offersFor(r *http.Request) ([]gate.Offer, error) {
	tool, ok := gate.MCPTool(r)
	if !ok {
		return nil, errors.New("mcp: a request reached the gate without a priced tool call")
	}
	if offers, ok := m.offers[tool]; ok {
		return offers, nil
	}
	if m.byDefault != nil && m.price(tool) != "" {
		return m.byDefault, nil
	}
	return nil, fmt.Errorf("mcp: tool %q is free", tool)
}

// originalURI is the gate's gate.Config.OriginalURI.
func (g *Gate) originalURI() func(*http.Request) string {
	if g.MCP != nil {
		return mcpOriginalURI
	}
	return originalURI
}

// mcpOriginalURI is the URI of a request as the gate names its resource: in the MCP mode, the endpoint's with the
// tool as its fragment, so that a payment's record names the tool it bought and a payment made for one tool is
// never served on its record for another.
func mcpOriginalURI(r *http.Request) string {
	uri := originalURI(r)
	if tool, ok := gate.MCPTool(r); ok {
		return uri + "#tool=" + url.QueryEscape(tool)
	}
	return uri
}

// unmarshalMCP reads the mcp block of the gate:
//
//	mcp {
//		tool <name> <price>|free
//		default <price>|free
//		max_body <size>
//	}
func (m *GateMCP) unmarshalMCP(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	for n := d.Nesting(); d.NextBlock(n); {
		switch opt := d.Val(); opt {
		case "tool":
			var name, price string
			if !d.AllArgs(&name, &price) {
				return d.Err("mcp tool needs a name and a price: tool <name> <dollars>|free")
			}
			if err := mcpPriceProblem(price); err != nil {
				return d.Errf("mcp tool %s: %v", name, err)
			}
			if _, dup := m.Tools[name]; dup {
				return d.Errf("mcp tool %s is priced twice", name)
			}
			if m.Tools == nil {
				m.Tools = map[string]string{}
			}
			m.Tools[name] = price
		case "default":
			if !d.AllArgs(&m.Default) {
				return d.Err("mcp default needs one argument: <dollars> or free")
			}
			if err := mcpPriceProblem(m.Default); err != nil {
				return d.Errf("mcp default: %v", err)
			}
		case "max_body":
			var size string
			if !d.AllArgs(&size) {
				return d.ArgErr()
			}
			n, err := humanize.ParseBytes(size)
			if err != nil || n == 0 || n > 1<<40 {
				return d.Errf("mcp max_body '%s': want a positive size such as 1MiB", size)
			}
			m.MaxBody = int64(n)
		default:
			return d.Errf("unrecognized mcp option '%s'; want tool, default or max_body", opt)
		}
	}
	return nil
}

// mcpPriceProblem says what is wrong with a tool's price, nil when it is dollars or free.
func mcpPriceProblem(price string) error {
	if price == MCPFree {
		return nil
	}
	if hasPlaceholder(price) {
		return fmt.Errorf("price %q holds a placeholder; a tool's price is set in the configuration", price)
	}
	if err := gateValueProblem("price", price); err != nil {
		return fmt.Errorf("price %q: %w; want dollars such as $0.01, or free", price, err)
	}
	return nil
}
