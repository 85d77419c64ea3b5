package gate

import (
	"fmt"
	"html/template"
	"net"
	"net/url"
	"regexp"
	"strings"
)

// PaywallStyle is how the paywall page looks: its title, a logo and an accent colour, or a template of the
// user's own; which page may frame it; and the chains a wallet that does not know an offer's network is asked to
// add. The zero value is the plain page, framed by no one.
type PaywallStyle struct {
	// Title heads the page and names its tab. Default "Payment required".
	Title string
	// Logo is the URL of an image shown above the title: a path on this site, an https URL, or a data: image of
	// a type CheckLogo takes.
	Logo string
	// Color is the accent colour of the page's buttons and heading, a CSS hex colour (#rgb or #rrggbb).
	Color string
	// Template, when set, renders the page instead of the built-in one, given PaywallData. TemplateFile names
	// where it was read from, for errors.
	Template     *template.Template
	TemplateFile string
	// FrameAncestors are the CSP frame-ancestors sources allowed to frame the page; empty: 'none' (a pay button
	// in someone else's frame is a click waiting to be stolen).
	FrameAncestors []string
	// Chains are what the page tells a wallet that does not know an offer's network (wallet_addEthereumChain),
	// by CAIP-2 network. Only a URL a browser may be shown belongs here: CheckPaywallRPC refuses one carrying
	// credentials.
	Chains map[string]PaywallChain
}

// PaywallChain is a network as a wallet adds it (EIP-3085): its name, a JSON-RPC URL a browser can reach, and its
// native currency.
type PaywallChain struct {
	Name string
	// RPCURL is the URL; RPCURLFunc, when set, is asked instead as the page is rendered (the embedded dev chain's
	// URL is known once it runs).
	RPCURL     string
	RPCURLFunc func() string
	// Currency is the native currency's name and symbol (18 decimals); default Ether, ETH.
	CurrencyName, CurrencySymbol string
}

// url is the chain's RPC URL now, "" when none is known or it is not one a browser may be shown.
func (c PaywallChain) url() string {
	u := c.RPCURL
	if c.RPCURLFunc != nil {
		u = c.RPCURLFunc()
	}
	if CheckPaywallRPC(u) != nil {
		return ""
	}
	return u
}

var paywallColor = regexp.MustCompile(`^#([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$`)

// paywallDataImage is a data: URL of an image type a browser shows and runs nothing of in an <img> (SVG in an
// img element runs no script and loads nothing), base64 encoded.
var paywallDataImage = regexp.MustCompile(`^data:image/(png|gif|jpeg|webp|avif|svg\+xml);base64,[A-Za-z0-9+/]+={0,2}$`)

// paywallFrameSource is a CSP source expression frame-ancestors takes: a keyword, a scheme or a host source.
var paywallFrameSource = regexp.MustCompile(`^('self'|'none'|https?:|(https?://)?(\*\.)?[A-Za-z0-9.-]+(:[0-9]+|:\*)?)$`)

// CheckLogo says what is wrong with a logo URL: a path on this site, an https URL, or a base64 data: URL of a
// PNG, GIF, JPEG, WebP, AVIF or SVG image; anything else (javascript:, data:text/html, http:) is refused.
func CheckLogo(logo string) error {
	if logo == "" {
		return nil
	}
	if strings.HasPrefix(strings.ToLower(logo), "data:") {
		if !paywallDataImage.MatchString(logo) {
			return fmt.Errorf("paywall logo %.40q...: a data: URL must be data:image/<png|gif|jpeg|webp|avif|svg+xml>;base64,<data>", logo)
		}
		return nil
	}
	u, err := url.Parse(logo)
	ok := err == nil && (u.Scheme == "https" && u.Host != "" ||
		u.Scheme == "" && u.Host == "" && strings.HasPrefix(u.Path, "/") && !strings.HasPrefix(logo, "//"))
	if !ok || strings.ContainsAny(logo, "\"'<> \t\r\n\\") {
		return fmt.Errorf("paywall logo %q: want a path on this site (/logo.png), an https URL or a data:image/ URL", logo)
	}
	return nil
}

// CheckPaywallRPC says what is wrong with an RPC URL the paywall would show browsers: it must be http(s), and
// carry no credentials (no user or password, no query, no path segment that looks like an API key, as the
// hosted providers put theirs), since everyone who opens the page reads it. Plain http only on a loopback host.
func CheckPaywallRPC(raw string) error {
	u, err := url.Parse(raw)
	switch {
	case raw == "":
		return fmt.Errorf("paywall rpc_url: empty")
	case err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http"):
		return fmt.Errorf("paywall rpc_url: want an http(s) URL a browser can reach")
	case u.User != nil:
		return fmt.Errorf("paywall rpc_url: it carries a user or password, which every visitor of the page would read; give a public RPC URL for the page")
	case u.RawQuery != "" || u.Fragment != "":
		return fmt.Errorf("paywall rpc_url: it carries a query, where providers put API keys, which every visitor of the page would read; give a public RPC URL for the page")
	case u.Scheme == "http" && !loopbackHost(u.Hostname()):
		return fmt.Errorf("paywall rpc_url: plain http is taken for a loopback host only (a wallet refuses it elsewhere); use https")
	}
	for _, seg := range strings.Split(u.Path, "/") {
		if looksLikeKey(seg) {
			return fmt.Errorf("paywall rpc_url: its path holds what looks like an API key, which every visitor of the page would read; give a public RPC URL for the page")
		}
	}
	return nil
}

func loopbackHost(h string) bool {
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// looksLikeKey reports a path segment of 20 or more letters and digits mixing both, or of 32 or more hex digits:
// the shape of Alchemy's, Infura's and QuickNode's keys.
func looksLikeKey(seg string) bool {
	if len(seg) < 20 {
		return false
	}
	letters, digits := 0, 0
	for _, r := range seg {
		switch {
		case r >= '0' && r <= '9':
			digits++
		case r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z':
			letters++
		case r == '-' || r == '_':
		default:
			return false
		}
	}
	return digits > 0 && letters > 0
}

// Check says what is wrong with the style, naming the option.
func (s PaywallStyle) Check() error {
	if s.Color != "" && !paywallColor.MatchString(s.Color) {
		return fmt.Errorf("paywall color %q: want a CSS hex colour such as #2a5db0", s.Color)
	}
	if err := CheckLogo(s.Logo); err != nil {
		return err
	}
	if strings.ContainsAny(s.Title, "\r\n") {
		return fmt.Errorf("paywall title %q: want one line", s.Title)
	}
	for _, src := range s.FrameAncestors {
		if !paywallFrameSource.MatchString(src) {
			return fmt.Errorf("paywall frame_ancestors %q: want 'none', 'self', a scheme (https:) or a host such as https://shop.example.com", src)
		}
		if src == "'none'" && len(s.FrameAncestors) > 1 {
			return fmt.Errorf("paywall frame_ancestors: 'none' goes alone")
		}
	}
	for network, c := range s.Chains {
		if network != "" && !strings.HasPrefix(network, "eip155:") {
			return fmt.Errorf("paywall rpc_url for %s: a wallet adds EVM (eip155:) networks only", network)
		}
		if c.RPCURLFunc == nil {
			if err := CheckPaywallRPC(c.RPCURL); err != nil {
				return fmt.Errorf("%w (network %s)", err, network)
			}
		}
	}
	return nil
}

// frameAncestors is the page's Content-Security-Policy.
func (s PaywallStyle) contentSecurityPolicy() string {
	if len(s.FrameAncestors) == 0 {
		return "frame-ancestors 'none'"
	}
	return "frame-ancestors " + strings.Join(s.FrameAncestors, " ")
}
