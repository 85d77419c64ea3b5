package caddymodule

import (
	"slices"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"

	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("x402_facilitator", parseFacilitatorCaddyfile)
	// A terminal handler like respond: it answers every request routed to it.
	httpcaddyfile.RegisterDirectiveOrder("x402_facilitator", httpcaddyfile.Before, "respond")
}

func parseFacilitatorCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	f := new(FacilitatorHandler)
	at := *h.Dispenser // before the directive, to name its line
	if err := f.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return f, err
	}
	at.Next()
	if err := f.openProblemOfCaddyfile(h.Option("x402")); err != nil {
		return nil, at.WrapErr(err)
	}
	return f, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	x402_facilitator [<matcher>] {
//		kind permit2|eip3009|erc2612 [...]
//		networks <caip2> [...]
//		api_key <key>
//		open                               # meant to serve anyone: no api_key, pay_to or min_amount needed
//		max_body_size <size>
//		min_amount <raw units>
//		pay_to <address> [...]
//		settle_rate_limit {
//			per_ip <n>/min [ipv6_prefix <bits>]
//			per_payer <n>/min
//		}
//		verify_rate_limit {                # or: verify_rate_limit off
//			per_ip <n>/min [ipv6_prefix <bits>]
//		}
//		upstream <url> {
//			api_key <key>
//			timeout <duration>
//			settle_timeout <duration>
//		}
//		facilitator <module> [...] {       # or a module of x402.facilitators: embedded, http, a plugin's
//			...
//		}
//	}
//
// kind, networks, api_key, pay_to and upstream may be repeated; several upstreams are a failover set. It is
// usually routed under a path: handle_path /facilitator/* { x402_facilitator }.
func (h *FacilitatorHandler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "kind":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Errf("kind needs one or more of %s, %s and %s", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
			}
			for _, k := range args {
				if !x402.IsTransferMethod(k) {
					return d.Errf("unknown kind '%s'; want %s, %s or %s", k, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
				}
				if !slices.Contains(h.Kinds, k) {
					h.Kinds = append(h.Kinds, k)
				}
			}
		case "networks":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Err("networks needs at least one CAIP-2 network, e.g. networks eip155:72344")
			}
			for _, n := range args {
				if _, _, err := x402.ParseCAIP2(n); err != nil {
					return d.Errf("networks: %v", err)
				}
				if !slices.Contains(h.Networks, n) {
					h.Networks = append(h.Networks, n)
				}
			}
		case "api_key":
			var key string
			if !d.AllArgs(&key) {
				return d.Err("api_key needs exactly one key, or a placeholder such as {env.FACILITATOR_KEY}")
			}
			h.APIKeys = append(h.APIKeys, key)
		case "max_body_size":
			var s string
			if !d.AllArgs(&s) {
				return d.ArgErr()
			}
			size, err := humanize.ParseBytes(s)
			if err != nil || size == 0 || size > x402.MaxBodyBytes {
				return d.Errf("max_body_size '%s' is not a size from 1 to %d bytes (64KiB)", s, x402.MaxBodyBytes)
			}
			h.MaxBodySize = int64(size)
		case "min_amount", "pay_to":
			if _, err := unmarshalTermOption(d, &h.MinAmount, &h.PayTo); err != nil {
				return err
			}
		case "open":
			if d.NextArg() {
				return d.Errf("open takes no argument, got '%s'", d.Val())
			}
			h.Open = true
		case "settle_rate_limit":
			if h.SettleRateLimit != nil {
				return d.Err("settle_rate_limit is given twice; write per_ip and per_payer in one block")
			}
			l, err := unmarshalSettleRateLimit(d)
			if err != nil {
				return err
			}
			h.SettleRateLimit = l
		case "verify_rate_limit":
			if h.VerifyRateLimit != nil {
				return d.Err("verify_rate_limit is given twice; write it once")
			}
			l, err := unmarshalVerifyRateLimit(d)
			if err != nil {
				return err
			}
			h.VerifyRateLimit = l
		case "upstream":
			u, err := parseFacilitatorUpstream(d)
			if err != nil {
				return err
			}
			h.Upstreams = append(h.Upstreams, u)
		case "facilitator":
			url, module, err := unmarshalFacilitatorOption(d)
			if err != nil {
				return err
			}
			if url != "" && url != EmbeddedFacilitator {
				h.Upstreams = append(h.Upstreams, &FacilitatorUpstream{URL: url})
			}
			h.FacilitatorRaw = module
		default:
			return d.Errf("unrecognized x402_facilitator option '%s'; want kind, networks, api_key, open, max_body_size, min_amount, pay_to, settle_rate_limit, verify_rate_limit, upstream or facilitator", d.Val())
		}
	}
	return nil
}

func parseFacilitatorUpstream(d *caddyfile.Dispenser) (*FacilitatorUpstream, error) {
	u := new(FacilitatorUpstream)
	if !d.NextArg() {
		return nil, d.Err("upstream needs the base URL of a facilitator, e.g. upstream https://facilitator.example/x402")
	}
	u.URL = d.Val()
	if d.NextArg() {
		return nil, d.Err("upstream takes one URL; write one upstream line per facilitator of a failover set")
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "api_key":
			if !d.AllArgs(&u.APIKey) {
				return nil, d.Err("api_key needs exactly one key, or a placeholder such as {env.UPSTREAM_KEY}")
			}
		case "timeout":
			dur, err := durationArg(d, "timeout")
			if err != nil {
				return nil, err
			}
			if dur <= 0 {
				return nil, d.Errf("timeout %s is not a positive duration such as 10s", dur)
			}
			u.Timeout = caddy.Duration(dur)
		case "settle_timeout":
			dur, err := durationArg(d, "settle_timeout")
			if err != nil {
				return nil, err
			}
			if dur <= 0 {
				return nil, d.Errf("settle_timeout %s is not a positive duration such as 60s", dur)
			}
			u.SettleTimeout = caddy.Duration(dur)
		default:
			return nil, d.Errf("unrecognized upstream option '%s'; want api_key, timeout or settle_timeout", d.Val())
		}
	}
	return u, nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*FacilitatorHandler)(nil)
