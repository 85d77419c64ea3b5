package caddymodule

import (
	"slices"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("x402", parseGateCaddyfile)
	// An auth directive: it runs before the handlers that answer (reverse_proxy, file_server, respond), so a
	// site needs no route block to put the gate in front of them.
	httpcaddyfile.RegisterDirectiveOrder("x402", httpcaddyfile.After, "forward_auth")
}

func parseGateCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	g := new(Gate)
	if err := g.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return g, err
	}
	if err := g.pricePrecisionOfCaddyfile(h.Option("x402")); err != nil {
		return nil, err
	}
	return g, nil
}

// UnmarshalCaddyfile sets up the gate from Caddyfile tokens. Syntax:
//
//	x402 [<matcher>] [<price>] {
//		pay_to <address>
//		scheme exact|upto|batch              # upto: the price is a maximum, the upstream names the charge; batch: paid by batch-settlement vouchers
//		default_amount max|zero              # upto without a usable Settlement-Overrides answer; default max
//		price <dollars>                      # or: amount <raw token units>
//		network <caip2>
//		asset <token address>
//		asset_transfer_method permit2|eip3009|erc2612
//		token_name <name>
//		token_version <version>
//		token_eip3009                        # the token has EIP-3009: offer eip3009 too
//		max_timeout <duration>
//		facilitator embedded|<url>           # or: facilitator_url <url>
//		facilitator <module> [...] {         # or a module of x402.facilitators: http { upstream <url> ... }, a plugin's
//			...
//		}
//		facilitator_api_key <key>
//		facilitator_timeout <duration>
//		payment_header <header name>
//		description <text>
//		paywall {             # how the page a browser gets looks
//			title <text>
//			logo <path, https or data:image/<type>;base64, URL>
//			color <rrggbb or "#rrggbb">
//			template <file>                  # a Go html/template of your own, given gate.PaywallData
//			frame_ancestors <source>...      # CSP frame-ancestors; default 'none'
//			rpc_url [<network>] <url>        # for a wallet that must add the chain; no credentials
//		}
//		mime_type <type>
//		settle before|after|async [<backlog>]
//		max_buffer <size>
//		v1_body
//		payment_identifier [optional|required] # declare the payment-identifier extension (default optional)
//		gas_sponsoring eip2612|erc20_approval... | off # the gas-sponsoring extensions declared, of the facilitator's (default all)
//		access <duration> {                  # a settled payment grants its payer this long by sign-in-with-x
//			requests <n>                     # at most n requests in that time (default: any number)
//			paths <path>...                  # the paths granted, /reports/* for a prefix (default: the one paid for)
//		}
//		sign_in_only                         # sells nothing (accepts: []): signs in wallets holding access's grant, bought on another route paid to pay_to
//		discovery {                          # declare the route for discovery (bazaar), catalogued by its facilitator
//			description <text>               # default: the route's description
//			input_schema <json or file>      # of the query parameters (GET...) or the body (POST...)
//			input_example <json or file>
//			body_type json|form-data|text    # of a body (default json)
//			output_schema <json or file>
//			output_example <json or file>
//			service_name <name>
//			tags <tag>...
//			icon <url>
//		}
//		cors_origins <origin>...             # default *
//		price_grace <duration>               # keep earlier offers of a resource good this long after a reload
//		batch {                              # scheme batch through facilitator_url: the claim policy
//			claim_every <n>
//			claim_amount <raw units>
//			claim_after <duration>
//		}
//		                                     # (terms then set from the method and URL only)
//		mcp {                                # an MCP server behind: priced per tool call (see GateMCP)
//			tool <name> <dollars>|free
//			default <dollars>|free           # default free
//			max_body <size>                  # default 1MiB
//		}
//		accept {
//			pay_to, scheme, price, amount, network, asset, asset_transfer_method,
//			token_name, token_version, token_eip3009, max_timeout
//		}
//	}
//
// Each accept block is one more way to pay; what it leaves out it takes from the gate. price, amount, pay_to
// and description may hold placeholders a request fills (a map's output, {http.request.host}): they are then
// resolved and checked for each request.
func (g *Gate) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		g.Price = d.Val()
		at := *d
		g.priceAt = &at
		if err := gateValueProblem("price", g.Price); err != nil {
			return d.Errf("x402 %s: %v", g.Price, err)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	var graceAt *caddyfile.Dispenser  // at price_grace, to name its line
	var accessAt *caddyfile.Dispenser // at access, to name its line
	var signInAt *caddyfile.Dispenser // at sign_in_only, to name its line
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if handled, err := g.GateAccept.unmarshalOption(d, opt); handled || err != nil {
			if err != nil {
				return err
			}
			continue
		}
		switch opt {
		case "accept":
			if d.NextArg() {
				return d.ArgErr()
			}
			a := new(GateAccept)
			for n := d.Nesting(); d.NextBlock(n); {
				handled, err := a.unmarshalOption(d, d.Val())
				if err != nil {
					return err
				}
				if !handled {
					return d.Errf("unrecognized accept option '%s'; want pay_to, scheme, price, amount, network, asset, asset_transfer_method, token_name, token_version, token_eip3009 or max_timeout", d.Val())
				}
			}
			g.Accepts = append(g.Accepts, a)
		case "facilitator", "facilitator_url":
			if opt == "facilitator" {
				url, module, err := unmarshalFacilitatorOption(d)
				if err != nil {
					return err
				}
				g.FacilitatorURL, g.FacilitatorRaw = url, module
				continue
			}
			if !d.AllArgs(&g.FacilitatorURL) {
				return d.Errf("%s needs one argument: %s or the facilitator's base URL", opt, EmbeddedFacilitator)
			}
		case "facilitator_api_key":
			if !d.AllArgs(&g.FacilitatorAPIKey) {
				return d.ArgErr()
			}
		case "facilitator_timeout":
			dur, err := durationArg(d, "facilitator_timeout")
			if err != nil {
				return err
			}
			if dur <= 0 {
				return d.Errf("facilitator_timeout %s is not a positive duration such as 30s", dur)
			}
			g.FacilitatorTimeout = caddy.Duration(dur)
		case "default_amount":
			if !d.AllArgs(&g.DefaultAmount) {
				return d.ArgErr()
			}
			if g.DefaultAmount != gate.DefaultAmountMax && g.DefaultAmount != gate.DefaultAmountZero {
				return d.Errf("default_amount '%s': want %s or %s", g.DefaultAmount, gate.DefaultAmountMax, gate.DefaultAmountZero)
			}
		case "payment_header":
			if !d.AllArgs(&g.PaymentHeader) {
				return d.ArgErr()
			}
		case "description":
			if !d.AllArgs(&g.Description) {
				return d.Err("description needs one argument; quote text with spaces")
			}
		case "mime_type":
			if !d.AllArgs(&g.MimeType) {
				return d.ArgErr()
			}
		case "settle":
			args := d.RemainingArgs()
			if len(args) == 0 || len(args) > 2 {
				return d.ArgErr()
			}
			g.Settle = args[0]
			switch g.Settle {
			case SettleAfter, SettleBefore, SettleAsync:
			default:
				return d.Errf("settle '%s': want %s, %s or %s", g.Settle, SettleBefore, SettleAfter, SettleAsync)
			}
			if len(args) == 2 {
				n, err := strconv.Atoi(args[1])
				if g.Settle != SettleAsync || err != nil || n <= 0 {
					return d.Errf("settle %s %s: only async takes a backlog, a positive number of payments", g.Settle, args[1])
				}
				g.AsyncBacklog = n
			}
		case "cors_origins":
			origins := d.RemainingArgs()
			if len(origins) == 0 {
				return d.Err("cors_origins needs at least one origin, such as https://app.example.com, or *")
			}
			g.CORSOrigins = append(g.CORSOrigins, origins...)
		case "max_buffer":
			var size string
			if !d.AllArgs(&size) {
				return d.ArgErr()
			}
			n, err := humanize.ParseBytes(size)
			if err != nil || n == 0 || n > 1<<62 {
				return d.Errf("max_buffer '%s': want a positive size such as 8MiB or 512KB", size)
			}
			g.MaxBuffer = int64(n)
		case "v1_body":
			if d.NextArg() {
				return d.ArgErr()
			}
			g.V1Body = true
		case "batch":
			b, err := parseBatchBlock(d, true)
			if err != nil {
				return err
			}
			g.Batch = b
		case "payment_identifier":
			args := d.RemainingArgs()
			switch {
			case len(args) == 0:
				g.PaymentIdentifier = gate.PaymentIdentifierOptional
			case len(args) > 1:
				return d.ArgErr()
			case args[0] == gate.PaymentIdentifierOptional || args[0] == gate.PaymentIdentifierRequired:
				g.PaymentIdentifier = args[0]
			default:
				return d.Errf("payment_identifier '%s': want %s or %s", args[0], gate.PaymentIdentifierOptional, gate.PaymentIdentifierRequired)
			}
		case "gas_sponsoring":
			if err := g.unmarshalGasSponsoring(d); err != nil {
				return err
			}
		case "paywall":
			g.Paywall = new(GatePaywall)
			if err := g.Paywall.unmarshalPaywall(d); err != nil {
				return err
			}
		case "discovery":
			if err := g.unmarshalDiscovery(d); err != nil { // gate_discovery.go
				return err
			}
		case "mcp":
			g.MCP = new(GateMCP)
			if err := g.MCP.unmarshalMCP(d); err != nil {
				return err
			}
		case "access":
			at := *d
			accessAt = &at
			if err := g.unmarshalAccess(d); err != nil {
				return err
			}
		case "sign_in_only":
			at := *d
			signInAt = &at
			if d.NextArg() {
				return d.ArgErr()
			}
			g.SignInOnly = true
		case "price_grace":
			at := *d
			graceAt = &at
			dur, err := durationArg(d, opt)
			if err != nil {
				return err
			}
			if dur < 0 {
				return d.Errf("price_grace %s is negative; want a duration such as 1m, or 0 for none", dur)
			}
			g.PriceGrace = caddy.Duration(dur)
		default:
			return d.Errf("unrecognized x402 option '%s'", opt)
		}
	}
	if err := g.graceProblem(); err != nil {
		return graceAt.WrapErr(err)
	}
	if g.Access != nil && g.Settle == SettleAsync {
		return accessAt.WrapErr(gate.CheckAccess(g.Access.core(), g.Settle))
	}
	if err := g.signInOnlyProblem(); err != nil {
		return signInAt.WrapErr(err)
	}
	return nil
}

// unmarshalOption reads one option of a way to pay, and reports whether opt is one.
func (a *GateAccept) unmarshalOption(d *caddyfile.Dispenser, opt string) (bool, error) {
	var dst *string
	switch opt {
	case "pay_to":
		dst = &a.PayTo
	case "scheme":
		dst = &a.Scheme
	case "price":
		dst = &a.Price
	case "amount":
		dst = &a.Amount
	case "network":
		dst = &a.Network
	case "asset":
		dst = &a.Asset
	case "asset_transfer_method":
		dst = &a.AssetTransferMethod
	case "token_name":
		dst = &a.TokenName
	case "token_version":
		dst = &a.TokenVersion
	case "token_eip3009":
		if d.NextArg() {
			return true, d.Errf("token_eip3009 takes no argument, got '%s'", d.Val())
		}
		a.TokenEIP3009 = true
		return true, nil
	case "max_timeout":
		dur, err := durationArg(d, opt)
		if err != nil {
			return true, err
		}
		a.MaxTimeout = caddy.Duration(dur)
		return true, nil
	default:
		return false, nil
	}
	if !d.AllArgs(dst) {
		return true, d.Errf("%s needs exactly one argument", opt)
	}
	if opt == "price" {
		at := *d
		a.priceAt = &at
	}
	switch {
	case opt == "scheme" && !x402.IsScheme(*dst) && !isBatchScheme(*dst):
		return true, d.Errf("scheme '%s': want %s, %s or batch", *dst, x402.SchemeExact, x402.SchemeUpto)
	case opt == "asset_transfer_method" && !x402.IsTransferMethod(*dst):
		return true, d.Errf("asset_transfer_method '%s': want %s, %s or %s", *dst, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	case opt == "price" && a.Amount != "", opt == "amount" && a.Price != "":
		return true, d.Err("give either price or amount, not both")
	}
	if err := gateValueProblem(opt, *dst); err != nil {
		return true, d.Err(err.Error())
	}
	return true, nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Gate)(nil)

// unmarshalAccess reads a gate's access option: access <duration> [{ requests <n>; paths <path>... }].
func (g *Gate) unmarshalAccess(d *caddyfile.Dispenser) error {
	var s string
	if !d.NextArg() {
		return d.Errf("access needs a duration, such as access 1h")
	}
	s = d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil || dur <= 0 {
		return d.Errf("access '%s': want a positive duration, such as 1h or 30m", s)
	}
	a := &GateAccess{For: caddy.Duration(dur)}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch opt := d.Val(); opt {
		case "requests":
			var n string
			if !d.AllArgs(&n) {
				return d.ArgErr()
			}
			v, err := strconv.ParseInt(n, 10, 64)
			if err != nil || v <= 0 {
				return d.Errf("access requests '%s': want a positive number of requests", n)
			}
			a.Requests = v
		case "paths":
			paths := d.RemainingArgs()
			if len(paths) == 0 {
				return d.ArgErr()
			}
			a.Paths = append(a.Paths, paths...)
		case "grant":
			if !d.AllArgs(&a.Grant) {
				return d.ArgErr()
			}
		default:
			return d.Errf("unrecognized access option '%s'", opt)
		}
	}
	if err := gate.CheckAccess(a.core(), SettleAfter); err != nil {
		return d.Err(err.Error())
	}
	g.Access = a
	return nil
}

// gasSponsoringNames are the Caddyfile's names of the gas-sponsoring extensions.
var gasSponsoringNames = map[string]string{
	"eip2612":        x402.ExtensionEIP2612GasSponsoring,
	"erc20_approval": x402.ExtensionERC20ApprovalGasSponsoring,
}

// unmarshalGasSponsoring reads `gas_sponsoring eip2612|erc20_approval... | off`.
func (g *Gate) unmarshalGasSponsoring(d *caddyfile.Dispenser) error {
	if g.GasSponsoring != nil {
		return d.Err("gas_sponsoring is configured twice in this gate")
	}
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Err("gas_sponsoring takes the extensions to declare: eip2612, erc20_approval, or off for none")
	}
	names := []string{}
	for _, a := range args {
		if a == "off" {
			if len(args) > 1 {
				return d.Err("gas_sponsoring off declares none: it takes no other argument")
			}
			break
		}
		n, ok := gasSponsoringNames[a]
		if !ok {
			return d.Errf("gas_sponsoring '%s': want eip2612, erc20_approval, or off", a)
		}
		if slices.Contains(names, n) {
			return d.Errf("gas_sponsoring names '%s' twice", a)
		}
		names = append(names, n)
	}
	g.GasSponsoring = &names
	return nil
}
