package caddymodule

import (
	"cmp"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
)

// SettleRateLimit caps how often /settle is called, per client IP and per payer, so that nobody can make a
// facilitator send settlement after settlement (each paying gas) as fast as it can sign them. A call over a limit
// is answered 429 with Retry-After and never reaches the facilitator behind. Limits are per minute, as token
// buckets: up to the limit at once, then one more each 60s/limit. With a PostgreSQL journal they are kept in its
// database, shared by every instance of the cluster and by config reloads that keep the rate, so that the cluster
// allows the limit once, not once per instance; while the database does not answer (within a second), each
// instance counts in memory and logs a warning. With a bbolt or in-memory journal they are kept in memory per
// handler and start afresh when the config is reloaded.
type SettleRateLimit struct {
	// PerIP is the number of /settle calls a client may make per minute; 0: no limit. Every call counts,
	// malformed or refused ones too (calls refused for their API key or method do not). The client IP is Caddy's:
	// the peer's address, or what the trusted_proxies of the server say the client is. An IPv6 client is counted
	// by its network of IPv6Prefix bits.
	PerIP int `json:"per_ip,omitempty"`
	// IPv6Prefix is how many leading bits of an IPv6 client address name one client for PerIP: every address of
	// one such network shares its limit. Default: 64 (the smallest network a subscriber is given).
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`
	// PerPayer is the number of settlements per minute of the payer a payment names; 0: no limit. It counts the
	// /settle calls whose answer carries a transaction hash (settled, pending or failed on chain: each may have
	// cost gas), and those that got no answer from the facilitator behind; a call refused before anything was
	// sent does not count, so a payload that merely names someone else as payer cannot use up that payer's
	// budget. Re-presenting a payment to learn its outcome counts like a new one.
	PerPayer int `json:"per_payer,omitempty"`
}

// VerifyRateLimit caps, per client IP, the /verify calls the facilitator behind refuses or fails: each costs it
// work and often a chain read (a forged signature an eth_getCode, an ERC-6492 wrapper a simulation), and the
// caller signs nothing to make it. A valid payment costs nothing against the limit, nor do the refusals the
// handler makes itself (kind, network, terms, a malformed body). Each GET /discovery/resources counts against it
// too: a public read of the journal. Over the limit, the client's /verify calls are
// answered 429 with Retry-After (and a VerifyResponse with unexpected_verify_error) before the facilitator behind
// is asked, until its bucket refills: the limit per minute, up to the limit at once. It is on by default.
type VerifyRateLimit struct {
	// PerIP is the number of refused or failed /verify calls a client may have per minute. Default: 600 (see
	// DefaultVerifyPerIP). A resource server that passes on the payments of many clients from one address
	// counts their bad payments together: raise it for such callers, or give them a route of their own.
	PerIP int `json:"per_ip,omitempty"`
	// IPv6Prefix is how many leading bits of an IPv6 client address name one client. Default: 64.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`
	// Off turns the limit off.
	Off bool `json:"off,omitempty"`
}

// DefaultVerifyPerIP is the verify rate limit of a handler that configures none: ten refused verifications a
// second, six hundred at once, per client. It bounds what one client's forged payments cost in chain reads,
// far above what a client paying honestly is refused.
const DefaultVerifyPerIP = 600

// verifyLimit is the facilitatorserver limit of l (nil: the default).
func verifyLimit(l *VerifyRateLimit) facilitatorserver.VerifyRateLimit {
	switch {
	case l == nil:
		return facilitatorserver.VerifyRateLimit{PerIP: DefaultVerifyPerIP}
	case l.Off:
		return facilitatorserver.VerifyRateLimit{}
	}
	return facilitatorserver.VerifyRateLimit{PerIP: cmp.Or(l.PerIP, DefaultVerifyPerIP), IPv6Prefix: l.IPv6Prefix}
}

// clientIP is the client's address as Caddy determined it (honouring the server's trusted_proxies), else the
// peer's.
func clientIP(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		return host
	}
	return r.RemoteAddr
}

// unmarshalSettleRateLimit reads a settle_rate_limit block:
//
//	settle_rate_limit {
//		per_ip <n>/min [ipv6_prefix <bits>]
//		per_payer <n>/min
//	}
func unmarshalSettleRateLimit(d *caddyfile.Dispenser) (*SettleRateLimit, error) {
	if d.NextArg() {
		return nil, d.Err("settle_rate_limit takes no arguments; write its limits in a block: settle_rate_limit { per_ip 60/min  per_payer 10/min }")
	}
	l := new(SettleRateLimit)
	file, line := d.File(), d.Line() // an empty block is reported at its opening line
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var err error
		switch option := d.Val(); option {
		case "per_ip":
			l.PerIP, l.IPv6Prefix, err = unmarshalPerIP(d)
		case "per_payer":
			var s string
			if !d.AllArgs(&s) {
				return nil, d.Errf("%s needs one rate such as 10/min", option)
			}
			if l.PerPayer, err = parsePerMinute(s); err != nil {
				return nil, d.Errf("%s '%s': %v", option, s, err)
			}
		default:
			return nil, d.Errf("unrecognized settle_rate_limit option '%s'; want per_ip or per_payer", option)
		}
		if err != nil {
			return nil, err
		}
	}
	if l.PerIP == 0 && l.PerPayer == 0 {
		return nil, fmt.Errorf("settle_rate_limit needs per_ip, per_payer or both, at %s:%d", file, line)
	}
	return l, nil
}

// unmarshalVerifyRateLimit reads verify_rate_limit, a block or off:
//
//	verify_rate_limit {
//		per_ip <n>/min [ipv6_prefix <bits>]
//	}
//	verify_rate_limit off
func unmarshalVerifyRateLimit(d *caddyfile.Dispenser) (*VerifyRateLimit, error) {
	l := new(VerifyRateLimit)
	if d.NextArg() {
		if d.Val() != "off" || d.NextArg() {
			return nil, d.Errf("verify_rate_limit takes no arguments but off; write its limit in a block: verify_rate_limit { per_ip %d/min }", DefaultVerifyPerIP)
		}
		if d.NextBlock(d.Nesting()) {
			return nil, d.Err("verify_rate_limit off takes no block")
		}
		l.Off = true
		return l, nil
	}
	file, line := d.File(), d.Line()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if option := d.Val(); option != "per_ip" {
			return nil, d.Errf("unrecognized verify_rate_limit option '%s'; want per_ip", option)
		}
		var err error
		if l.PerIP, l.IPv6Prefix, err = unmarshalPerIP(d); err != nil {
			return nil, err
		}
	}
	if l.PerIP == 0 {
		return nil, fmt.Errorf("verify_rate_limit needs per_ip (or write verify_rate_limit off), at %s:%d", file, line)
	}
	return l, nil
}

// unmarshalPerIP reads the arguments of a per_ip line: a rate, and the IPv6 prefix counted as one client.
func unmarshalPerIP(d *caddyfile.Dispenser) (perMinute, ipv6Prefix int, err error) {
	args := d.RemainingArgs()
	if len(args) != 1 && (len(args) != 3 || args[1] != "ipv6_prefix") {
		return 0, 0, d.Err("per_ip needs one rate such as 10/min, and may name the IPv6 prefix counted as one client: per_ip 10/min ipv6_prefix 56")
	}
	if perMinute, err = parsePerMinute(args[0]); err != nil {
		return 0, 0, d.Errf("per_ip '%s': %v", args[0], err)
	}
	if len(args) == 3 {
		if ipv6Prefix, err = strconv.Atoi(args[2]); err != nil || ipv6Prefix < 1 || ipv6Prefix > 128 {
			return 0, 0, d.Errf("ipv6_prefix '%s' is not a prefix length from 1 to 128 (64: every address of a /64 is one client)", args[2])
		}
	}
	return perMinute, ipv6Prefix, nil
}

// parsePerMinute reads "<n>/min" with n a positive whole number.
func parsePerMinute(s string) (int, error) {
	num, ok := strings.CutSuffix(s, "/min")
	n, err := strconv.Atoi(num)
	if !ok || err != nil || n < 1 || n > facilitatorserver.MaxPerMinute {
		return 0, fmt.Errorf("want a rate of calls per minute such as 10/min, from 1/min to %d/min", facilitatorserver.MaxPerMinute)
	}
	return n, nil
}
