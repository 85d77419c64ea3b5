package facilitatorserver

import (
	"errors"
	"fmt"
	"math/big"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Terms are the limits an operator puts on the payments a facilitator takes on at all: the smallest amount
// (min_amount) and the recipients payments may be for (pay_to). They keep strangers from making a public
// facilitator pay gas for 1-unit payments to themselves. A Server applies its terms to every /verify and /settle
// before the facilitator behind is asked; the embedded engine applies a network's terms to every caller, gates
// included. The zero Terms allow any payment.
type Terms struct {
	minAmount *big.Int        // nil: any amount
	payTo     map[string]bool // EIP-55 addresses; nil: any recipient
	payToList []string        // payTo in configuration order
}

// ParseTerms checks min_amount (raw token units, from 1 to 2^256-1; "" for none) and the pay_to addresses
// (none: any recipient; in one case, or in mixed case whose EIP-55 checksum holds). Its errors name the option, as an operator wrote it.
func ParseTerms(minAmount string, payTo []string) (Terms, error) {
	var t Terms
	if minAmount != "" {
		v, err := x402.ParseAmount(minAmount)
		if err != nil || v.Sign() == 0 {
			return t, fmt.Errorf("min_amount '%s' is not a whole number of raw token units from 1 to 2^256-1 (1000 is 0.001 of a 6-decimal token)", minAmount)
		}
		t.minAmount = v
	}
	for _, s := range payTo {
		// An operator's address in mixed case is checked against its EIP-55 checksum: a payment's payTo is
		// compared to it, and one mistyped would refuse every seller's payments, or let through a stranger's.
		if err := x402.CheckAddress(s); errors.Is(err, x402.ErrAddressChecksum) {
			return t, fmt.Errorf("pay_to %w", err)
		}
		a, err := checksumAddress("pay_to", s)
		if err != nil {
			return t, err
		}
		if a == zeroAddress {
			return t, fmt.Errorf("pay_to %s is the zero address: tokens refuse transfers to it", s)
		}
		if t.payTo == nil {
			t.payTo = map[string]bool{}
		}
		if !t.payTo[a] {
			t.payTo[a] = true
			t.payToList = append(t.payToList, a)
		}
	}
	return t, nil
}

// MinAmount is the smallest amount allowed, in raw token units, or nil when any is.
func (t Terms) MinAmount() *big.Int {
	if t.minAmount == nil {
		return nil
	}
	return new(big.Int).Set(t.minAmount)
}

// PayTo lists the allowed recipients in configuration order, in EIP-55 case, once each; nil when any is allowed.
func (t Terms) PayTo() []string {
	return append([]string(nil), t.payToList...)
}

// Refusal says why a payment is outside the terms, or "" when it is within. Both refusals are
// invalid_payment_requirements: the resource server asked for what this facilitator does not settle; the
// payment matches what it asked for, and signing again would not help.
//
// min_amount judges what the payer authorized: an exact payment's amount, an upto payment's maximum (its
// permit2Authorization.permitted.amount), at /verify and at /settle alike. An upto payment is settled for what
// the resource server found the request used, from nothing up to that maximum, and decided once its upstream
// has done the work: a charge below min_amount refused then would answer the client 402 for a response already
// made. The smallest settlement a stranger can make this facilitator send is bounded by the per-payer settle
// rate limit, and a settlement of nothing sends nothing.
func (t Terms) Refusal(req x402.VerifyRequest) (reason, message string) {
	rq := req.PaymentRequirements
	if t.minAmount != nil {
		amount, err := x402.ParseAmount(rq.Amount)
		if err != nil {
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("paymentRequirements.amount must be a whole number of raw token units, got %q", rq.Amount)
		}
		field, authorized := "paymentRequirements.amount", amount
		if p2 := req.PaymentPayload.Payload.Permit2Authorization; rq.Scheme == x402.SchemeUpto && p2 != nil {
			// An unreadable maximum leaves the requirement's amount to judge; the facilitator behind refuses
			// the payload.
			if max, err := x402.ParseAmount(p2.Permitted.Amount); err == nil {
				field, authorized = "the upto maximum permit2Authorization.permitted.amount", max
			}
		}
		if authorized.Cmp(t.minAmount) < 0 {
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("%s %s is below min_amount %s, the smallest payment this facilitator settles", field, authorized, t.minAmount)
		}
	}
	if t.payTo != nil {
		payTo, err := checksumAddress("paymentRequirements.payTo", rq.PayTo)
		switch {
		case err != nil:
			return x402.ReasonInvalidPaymentRequirements, err.Error()
		case !t.payTo[payTo]:
			return x402.ReasonInvalidPaymentRequirements, fmt.Sprintf("paymentRequirements.payTo %s is not among the allowed recipients (pay_to) this facilitator settles for", payTo)
		}
	}
	return "", ""
}

const zeroAddress = "0x0000000000000000000000000000000000000000"

// checksumAddress reads an address field as the engine does ("0x" and 40 hex digits, any case) and spells it in
// EIP-55 case; its error names the field, what was expected and what came.
func checksumAddress(field, s string) (string, error) {
	if a := x402.ChecksumAddress(s); a != "" {
		return a, nil
	}
	const max = 80
	if len(s) > max {
		s = s[:max] + "..."
	}
	return "", fmt.Errorf("%s: expected an address (0x and 40 hex digits), got %q", field, s)
}
