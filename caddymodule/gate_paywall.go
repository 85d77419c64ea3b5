package caddymodule

import (
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/gate"
)

// GatePaywall is how the paywall page looks, in the Caddyfile:
//
//	paywall {
//		title "Premium reports"
//		logo /static/logo.png
//		color 0b7a75   # or "#0b7a75": unquoted, # starts a comment
//	}
type GatePaywall struct {
	// Title heads the page. Default "Payment required".
	Title string `json:"title,omitempty"`
	// Logo is the URL of an image above the title: a path on this site, an https URL or a data:image/ URL.
	Logo string `json:"logo,omitempty"`
	// Color is the accent colour, a CSS hex colour (#rgb or #rrggbb; the # may be left out).
	Color string `json:"color,omitempty"`
}

// style is the gate core's form of the options; nil is the plain page.
func (p *GatePaywall) style() gate.PaywallStyle {
	if p == nil {
		return gate.PaywallStyle{}
	}
	color := p.Color
	if color != "" && !strings.HasPrefix(color, "#") {
		color = "#" + color // a Caddyfile reads an unquoted #... as a comment
	}
	return gate.PaywallStyle{Title: p.Title, Logo: p.Logo, Color: color}
}

// unmarshalPaywall reads the paywall block.
func (p *GatePaywall) unmarshalPaywall(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var dst *string
		switch d.Val() {
		case "title":
			dst = &p.Title
		case "logo":
			dst = &p.Logo
		case "color":
			dst = &p.Color
		default:
			return d.Errf("unknown paywall option '%s'; want title, logo or color", d.Val())
		}
		name := d.Val()
		if !d.AllArgs(dst) {
			return d.Errf("paywall %s needs one argument; quote text with spaces", name)
		}
	}
	if err := p.style().Check(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}
