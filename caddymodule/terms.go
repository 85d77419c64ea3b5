package caddymodule

import (
	"fmt"
	"math/big"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// paymentTerms are the limits an operator puts on the payments a facilitator takes on at all: the smallest amount
// (min_amount) and the recipients payments may be for (pay_to). They keep strangers from making a public
// facilitator pay gas for 1-unit payments to themselves. The x402 app's network block and the x402_facilitator
// handler both have them: the app's bind every caller of the embedded engine, gates included; the handler's bind
// the callers of one route, whatever facilitator it serves.
type paymentTerms struct {
	minAmount *big.Int                // nil: any amount
	payTo     map[common.Address]bool // nil: any recipient
	payToList []common.Address        // payTo in configuration order
}

// parsePaymentTerms checks min_amount (raw token units, at least 1; "" for none) and the pay_to addresses.
func parsePaymentTerms(minAmount string, payTo []string) (paymentTerms, error) {
	var t paymentTerms
	if minAmount != "" {
		v, err := parseMinAmount(minAmount)
		if err != nil {
			return t, err
		}
		t.minAmount = v
	}
	for _, s := range payTo {
		a, err := parsePayTo(s)
		if err != nil {
			return t, err
		}
		if t.payTo == nil {
			t.payTo = map[common.Address]bool{}
		}
		if !t.payTo[a] {
			t.payTo[a] = true
			t.payToList = append(t.payToList, a)
		}
	}
	return t, nil
}

func parseMinAmount(s string) (*big.Int, error) {
	v, err := x402.ParseAmount(s)
	if err != nil || v.Sign() == 0 {
		return nil, fmt.Errorf("min_amount '%s' is not a whole number of raw token units from 1 to 2^256-1 (1000 is 0.001 of a 6-decimal token)", s)
	}
	return v, nil
}

func parsePayTo(s string) (common.Address, error) {
	a, err := chain.ParseAddress("pay_to", s)
	if err != nil {
		return a, err
	}
	if a == (common.Address{}) {
		return a, fmt.Errorf("pay_to %s is the zero address: tokens refuse transfers to it", s)
	}
	return a, nil
}

// refusal says why a payment's requirements are outside the terms, or "" when they are within. Both refusals are
// invalid_payment_requirements: the resource server asked for what this facilitator does not settle; the
// payment matches what it asked for, and signing again would not help.
func (t paymentTerms) refusal(rq x402.PaymentRequirements) (reason, message string) {
	if t.minAmount != nil {
		amount, err := x402.ParseAmount(rq.Amount)
		switch {
		case err != nil:
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("paymentRequirements.amount must be a whole number of raw token units, got %q", rq.Amount)
		case amount.Cmp(t.minAmount) < 0:
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("paymentRequirements.amount %s is below min_amount %s, the smallest payment this facilitator settles", amount, t.minAmount)
		}
	}
	if t.payTo != nil {
		payTo, err := chain.ParseAddress("paymentRequirements.payTo", rq.PayTo)
		switch {
		case err != nil:
			return x402.ReasonInvalidPaymentRequirements, err.Error()
		case !t.payTo[payTo]:
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("paymentRequirements.payTo %s is not among the allowed recipients (pay_to) this facilitator settles for", payTo.Hex())
		}
	}
	return "", ""
}

// unmarshalTermOption reads a min_amount or pay_to line of a Caddyfile block into minAmount or payTo; ok is false
// for any other option. Errors name the option and, through the dispenser, the line.
func unmarshalTermOption(d *caddyfile.Dispenser, minAmount *string, payTo *[]string) (ok bool, err error) {
	switch d.Val() {
	case "min_amount":
		var s string
		if !d.AllArgs(&s) {
			return true, d.Err("min_amount needs exactly one amount in raw token units, e.g. min_amount 1000")
		}
		if _, err := parseMinAmount(s); err != nil {
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
			if _, err := parsePayTo(s); err != nil {
				return true, d.Err(err.Error())
			}
		}
		*payTo = append(*payTo, args...)
		return true, nil
	}
	return false, nil
}
