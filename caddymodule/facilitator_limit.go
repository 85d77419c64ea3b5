package caddymodule

import (
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
// buckets: up to the limit at once, then one more each 60s/limit. They are kept in memory per handler and start
// afresh when the config is reloaded.
type SettleRateLimit struct {
	// PerIP is the number of /settle calls a client IP may make per minute; 0: no limit. Every call counts,
	// malformed or refused ones too (calls refused for their API key or method do not). The client IP is Caddy's:
	// the peer's address, or what the trusted_proxies of the server say the client is.
	PerIP int `json:"per_ip,omitempty"`
	// PerPayer is the number of settlements per minute of the payer a payment names; 0: no limit. It counts the
	// /settle calls whose answer carries a transaction hash (settled, pending or failed on chain: each may have
	// cost gas), and those that got no answer from the facilitator behind; a call refused before anything was
	// sent does not count, so a payload that merely names someone else as payer cannot use up that payer's
	// budget. Re-presenting a payment to learn its outcome counts like a new one.
	PerPayer int `json:"per_payer,omitempty"`
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
//		per_ip <n>/min
//		per_payer <n>/min
//	}
func unmarshalSettleRateLimit(d *caddyfile.Dispenser) (*SettleRateLimit, error) {
	if d.NextArg() {
		return nil, d.Err("settle_rate_limit takes no arguments; write its limits in a block: settle_rate_limit { per_ip 60/min  per_payer 10/min }")
	}
	l := new(SettleRateLimit)
	file, line := d.File(), d.Line() // an empty block is reported at its opening line
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		option := d.Val()
		var target *int
		switch option {
		case "per_ip":
			target = &l.PerIP
		case "per_payer":
			target = &l.PerPayer
		default:
			return nil, d.Errf("unrecognized settle_rate_limit option '%s'; want per_ip or per_payer", option)
		}
		var s string
		if !d.AllArgs(&s) {
			return nil, d.Errf("%s needs one rate such as 10/min", option)
		}
		n, err := parsePerMinute(s)
		if err != nil {
			return nil, d.Errf("%s '%s': %v", option, s, err)
		}
		*target = n
	}
	if l.PerIP == 0 && l.PerPayer == 0 {
		return nil, fmt.Errorf("settle_rate_limit needs per_ip, per_payer or both, at %s:%d", file, line)
	}
	return l, nil
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
