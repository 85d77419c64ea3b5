package caddymodule

import (
	"fmt"
	"html/template"
	"io"
	"os"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/gate"
)

// GatePaywall is how the paywall page looks, in the Caddyfile:
//
//	paywall {
//		title "Premium reports"
//		logo /static/logo.png
//		color 0b7a75   # or "#0b7a75": unquoted, # starts a comment
//		template paywall.html            # a page of your own: Go html/template, given gate.PaywallData
//		frame_ancestors 'self' https://shop.example.com   # default 'none'
//		rpc_url https://sepolia.base.org  # for wallets that must add the chain; or rpc_url <network> <url>
//	}
type GatePaywall struct {
	// Title heads the page. Default "Payment required".
	Title string `json:"title,omitempty"`
	// Logo is the URL of an image above the title: a path on this site, an https URL or a base64 data:image/ URL
	// of a PNG, GIF, JPEG, WebP, AVIF or SVG image.
	Logo string `json:"logo,omitempty"`
	// Color is the accent colour, a CSS hex colour (#rgb or #rrggbb; the # may be left out).
	Color string `json:"color,omitempty"`
	// Template is a file holding a Go html/template that renders the page instead of the built-in one, given the
	// data the built-in page gets (gate.PaywallData). It is read when the config loads: a parse error names the
	// file and line.
	Template string `json:"template,omitempty"`
	// FrameAncestors are the Content-Security-Policy frame-ancestors sources that may frame the page; default
	// 'none' (no page may frame it, with X-Frame-Options: DENY for older browsers).
	FrameAncestors []string `json:"frame_ancestors,omitempty"`
	// RPCURLs are JSON-RPC URLs a browser's wallet can reach, for a wallet that does not know an offer's network
	// and is asked to add it (wallet_addEthereumChain), by network; the network "" is every network of the
	// gate. Every visitor reads them: a URL carrying credentials (user, query, an API key in its path) is refused.
	// The dev chain's own URL is the default for its network.
	RPCURLs map[string]string `json:"rpc_urls,omitempty"`

	tmpl *template.Template
}

// style is the gate core's form of the options; nil is the plain page. app, when not nil, gives the dev chain's
// RPC URL as the default for its network.
func (p *GatePaywall) style(app *App) gate.PaywallStyle {
	var s gate.PaywallStyle
	if p != nil {
		color := p.Color
		if color != "" && !strings.HasPrefix(color, "#") {
			color = "#" + color // a Caddyfile reads an unquoted #... as a comment
		}
		s = gate.PaywallStyle{Title: p.Title, Logo: p.Logo, Color: color, Template: p.tmpl, TemplateFile: p.Template,
			FrameAncestors: p.FrameAncestors}
		for network, u := range p.RPCURLs {
			if s.Chains == nil {
				s.Chains = map[string]gate.PaywallChain{}
			}
			s.Chains[network] = gate.PaywallChain{Name: network, RPCURL: u}
		}
	}
	if app != nil && app.devNet != nil {
		if _, named := s.Chains[app.devNet.Network]; !named {
			if s.Chains == nil {
				s.Chains = map[string]gate.PaywallChain{}
			}
			s.Chains[app.devNet.Network] = gate.PaywallChain{Name: "x402 dev chain", RPCURLFunc: app.devChainRPC}
		}
	}
	return s
}

// devChainRPC is the dev chain's RPC URL once the app runs it, "" before.
func (a *App) devChainRPC() string {
	if a.DevChain == nil {
		return ""
	}
	if a.DevChain.RPC != "" {
		return a.DevChain.RPC
	}
	select {
	case <-a.ready:
	default:
		return ""
	}
	if a.devChain == nil {
		return ""
	}
	return a.devChain.RPCURL()
}

// provision reads the template file, if any.
func (p *GatePaywall) provision() error {
	if p == nil || p.Template == "" {
		return nil
	}
	file := caddy.NewReplacer().ReplaceAll(p.Template, "")
	text, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("paywall template: %w", err)
	}
	t, err := gate.ParsePaywallTemplate(file, text)
	if err != nil {
		return err
	}
	// Run once with sample data: a field the data lacks ({{.Prise}}) is an error now, naming the file and line,
	// not a 500 for the first browser.
	if err := t.Execute(io.Discard, gate.SamplePaywallData()); err != nil {
		return fmt.Errorf("paywall template: %w", err)
	}
	p.tmpl = t
	return nil
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
		case "template":
			dst = &p.Template
		case "frame_ancestors":
			p.FrameAncestors = d.RemainingArgs()
			if len(p.FrameAncestors) == 0 {
				return d.Errf("paywall frame_ancestors needs one or more sources, such as 'self' or https://shop.example.com")
			}
			continue
		case "rpc_url":
			args := d.RemainingArgs()
			network, u := "", ""
			switch len(args) {
			case 1:
				u = args[0]
			case 2:
				network, u = args[0], args[1]
			default:
				return d.Errf("paywall rpc_url: want <url> or <network> <url>")
			}
			if err := gate.CheckPaywallRPC(u); err != nil {
				return d.Err(err.Error())
			}
			if p.RPCURLs == nil {
				p.RPCURLs = map[string]string{}
			}
			if _, dup := p.RPCURLs[network]; dup {
				return d.Errf("paywall rpc_url for %q given twice", network)
			}
			p.RPCURLs[network] = u
			continue
		default:
			return d.Errf("unknown paywall option '%s'; want title, logo, color, template, frame_ancestors or rpc_url", d.Val())
		}
		name := d.Val()
		if !d.AllArgs(dst) {
			return d.Errf("paywall %s needs one argument; quote text with spaces", name)
		}
	}
	if err := p.style(nil).Check(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}
