package caddymodule

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
)

// The payment terms (min_amount, pay_to) are facilitatorserver.Terms. The x402 app's network block and the
// x402_facilitator handler both have them: the app's bind every caller of the embedded engine, gates included;
// the handler's bind the callers of one route, whatever facilitator it serves.

// unmarshalTermOption reads a min_amount or pay_to line of a Caddyfile block into minAmount or payTo; ok is false
// for any other option. Errors name the option and, through the dispenser, the line.
func unmarshalTermOption(d *caddyfile.Dispenser, minAmount *string, payTo *[]string) (ok bool, err error) {
	switch d.Val() {
	case "min_amount":
		var s string
		if !d.AllArgs(&s) {
			return true, d.Err("min_amount needs exactly one amount in raw token units, e.g. min_amount 1000")
		}
		if _, err := facilitatorserver.ParseTerms(s, nil); err != nil {
			return true, d.Err(err.Error())
		}
		*minAmount = s
		return true, nil
	case "pay_to":
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.Err("pay_to needs at least one recipient address, e.g. pay_to 0x...")
		}
		for _, s := range args {
			if _, err := facilitatorserver.ParseTerms("", []string{s}); err != nil {
				return true, d.Err(err.Error())
			}
		}
		*payTo = append(*payTo, args...)
		return true, nil
	}
	return false, nil
}
