package x402

import (
	"fmt"
	"slices"
	"strings"
)

// Mismatch says why a payment pays none of the requirements offered to it, as a reason code and a message a
// client can act on.
type Mismatch struct {
	Reason  string
	Message string
}

func (m *Mismatch) Error() string { return m.Reason + ": " + m.Message }

// MatchAccepted finds the offered requirement a version 2 payment chose: the one its accepted echoes. Scheme,
// network and transfer method pick the candidates; asset, recipient and amount must then be what was offered,
// addresses compared as 20-byte values and amounts as numbers. Without a match, the first candidate's
// difference, or what no offer has, says why.
func MatchAccepted(offered []PaymentRequirements, p *PaymentPayload) (int, *Mismatch) {
	a := p.Accepted
	method := TransferMethod(a, p.Payload)
	amount, amountErr := ParseAmount(a.Amount)
	var closest *Mismatch
	for i, o := range offered {
		if o.Scheme != a.Scheme || o.Network != a.Network || o.Extra.AssetTransferMethod != method {
			continue
		}
		var m *Mismatch
		switch {
		case !SameAddress(o.Asset, a.Asset):
			m = &Mismatch{ReasonInvalidPaymentRequirements, fmt.Sprintf("accepted.asset is %s, but this resource is paid in %s on %s", a.Asset, o.Asset, o.Network)}
		case !SameAddress(o.PayTo, a.PayTo):
			m = &Mismatch{ReasonRecipientMismatch, fmt.Sprintf("accepted.payTo is %s, but this resource pays %s", a.PayTo, o.PayTo)}
		case amountErr != nil || amount.String() != o.Amount:
			m = &Mismatch{ReasonValueMismatch, fmt.Sprintf("accepted.amount is %q, but this resource costs exactly %s raw units", a.Amount, o.Amount)}
		}
		if m == nil {
			return i, nil
		}
		if closest == nil {
			closest = m
		}
	}
	if closest == nil {
		return -1, ExplainUnoffered(offered, a.Scheme, a.Network, method)
	}
	return -1, closest
}

// ExplainUnoffered says which of scheme, network and transfer method no offered requirement has.
func ExplainUnoffered(offered []PaymentRequirements, scheme, network, method string) *Mismatch {
	var schemes, networks, methods []string
	for _, o := range offered {
		schemes = appendNew(schemes, o.Scheme)
		if o.Scheme == scheme {
			networks = appendNew(networks, o.Network)
			if o.Network == network {
				methods = appendNew(methods, o.Extra.AssetTransferMethod)
			}
		}
	}
	switch {
	case len(offered) == 0:
		return &Mismatch{ReasonInvalidPaymentRequirements, "this resource offers no way to pay right now (its facilitator could not be asked what it supports); try again shortly"}
	case len(networks) == 0:
		return &Mismatch{ReasonUnsupportedScheme, fmt.Sprintf("scheme %q is not offered; this resource takes %s", scheme, strings.Join(schemes, ", "))}
	case len(methods) == 0:
		return &Mismatch{ReasonInvalidNetwork, fmt.Sprintf("network %q is not offered; this resource takes %s", network, strings.Join(networks, ", "))}
	default:
		return &Mismatch{ReasonInvalidPaymentRequirements, fmt.Sprintf("transfer method %q is not offered on %s; this resource takes %s", method, network, strings.Join(methods, ", "))}
	}
}

func appendNew(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}

// SameTerms reports whether two requirements ask for the same payment: scheme, network, asset, recipient, amount
// and transfer method. A payment bought under one requirement buys nothing under another, whatever the journal
// says of it.
func SameTerms(a, b PaymentRequirements) bool {
	return a.Scheme == b.Scheme && a.Network == b.Network && SameAddress(a.Asset, b.Asset) &&
		SameAddress(a.PayTo, b.PayTo) && sameAmount(a.Amount, b.Amount) &&
		a.Extra.AssetTransferMethod == b.Extra.AssetTransferMethod
}

// SettlementProblem says why a successful settlement answer is no proof that req's payment settled, or "" when
// it is: the answer must name a transaction, the requirement's network and the payer the payment is signed by,
// and the required amount when it names an amount. An upto settlement of zero sends nothing: its answer names
// no transaction. A facilitator's "success" that does not say so is an unknown
// outcome, not a settlement.
func SettlementProblem(req VerifyRequest, resp SettleResponse) string {
	rq := req.PaymentRequirements
	from, _ := req.PaymentPayload.Payload.PayerAndNonce()
	nothingToSend := rq.Scheme == SchemeUpto && sameAmount(rq.Amount, "0")
	switch {
	case nothingToSend && resp.Transaction != "" && !IsTxHash(resp.Transaction):
		return fmt.Sprintf("its answer to a settlement of nothing names no transaction but %q", resp.Transaction)
	case !nothingToSend && !IsTxHash(resp.Transaction):
		return fmt.Sprintf("its answer names no transaction (%q)", resp.Transaction)
	case resp.Network != rq.Network:
		return fmt.Sprintf("its answer is for network %q, not %s", resp.Network, rq.Network)
	case !SameAddress(resp.Payer, from):
		return fmt.Sprintf("its answer names payer %q, not the payment's %s", resp.Payer, from)
	case resp.Amount != "" && !sameAmount(resp.Amount, rq.Amount):
		return fmt.Sprintf("its answer settled %s raw units, not the required %s", resp.Amount, rq.Amount)
	}
	return ""
}

// VerifyProblem says why a verification answer of a valid payment is no answer about req's payment, or "" when
// it is: a facilitator that checked the signature names the payer who signed it, or no payer at all.
func VerifyProblem(req VerifyRequest, resp VerifyResponse) string {
	from, _ := req.PaymentPayload.Payload.PayerAndNonce()
	if resp.IsValid && resp.Payer != "" && !SameAddress(resp.Payer, from) {
		return fmt.Sprintf("its answer names payer %s, but the payment is signed by %s", resp.Payer, from)
	}
	return ""
}

// sameAmount reports whether two amounts are the same valid amount.
func sameAmount(a, b string) bool {
	x, errA := ParseAmount(a)
	y, errB := ParseAmount(b)
	return errA == nil && errB == nil && x.Cmp(y) == 0
}
