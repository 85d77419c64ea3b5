package gate

import (
	"fmt"
	"net/http"
	"strings"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// An upto payment is charged what the response it was first presented for named, and that charge is decided once:
// its journal record keeps it, and presented again (its response cut short) the payment is settled for it, whatever
// the upstream names now. But a payment buys its resource by method and URL, and a request's body, or its headers,
// may choose other work at the same URL: presented again with an expensive request, the payment would buy a
// response that names more than it was charged. So a response that names more than the decided charge is not sent:
// the gate answers 409 instead, naming both charges, and the payment stays good for a response that costs no more.
// Not 402: the payment is charged (or being charged) already, and a payer must never be told to pay again for a
// payment that settled.

// reasonChargeAboveCharged is the reason of the gate's 409: this request's response names more than the payment
// was charged.
const reasonChargeAboveCharged = "charge_above_charged"

// namesMoreThanCharged reports whether the upstream's answer names a charge (as decideCharge reads it: the
// default amount when it names none usable) above the one the payment's record decided, and which.
func (x *exchange) namesMoreThanCharged(up *upstream) (named string, more bool) {
	if !x.upto() || !x.chargeRecorded {
		return "", false
	}
	values, inTrailer := up.rec.chargeNamed()
	named = x.namedCharge(values, inTrailer)
	n, errNamed := x402.ParseAmount(named)
	charged, errCharged := x402.ParseAmount(x.charge)
	if errNamed != nil || errCharged != nil {
		return named, true // what cannot be compared is not sent
	}
	return named, n.Cmp(charged) > 0
}

// assetDecimals are the decimals of rq's asset as the gate's offers name them; 0 when none does.
func (x *exchange) assetDecimals(rq x402.PaymentRequirements) uint8 {
	for _, o := range x.offers.offers {
		if o.req.Network == rq.Network && strings.EqualFold(o.req.Asset, rq.Asset) {
			return o.decimals
		}
	}
	for _, o := range x.g.cfg.Offers {
		if o.Network == rq.Network && strings.EqualFold(o.Asset, rq.Asset) {
			return o.Decimals
		}
	}
	return 0
}

// chargeConflict is the body of the gate's 409: the payment was charged less than this request's response names.
type chargeConflict struct {
	Error   string             `json:"error"`
	Reason  string             `json:"reason"`
	Outcome x402.OutcomeStatus `json:"outcome"`
	// Charged is what the payment was charged (raw units of Asset on Network), Named what this request's
	// response names.
	Charged     string `json:"charged"`
	Named       string `json:"named"`
	Asset       string `json:"asset"`
	Network     string `json:"network"`
	Transaction string `json:"transaction,omitempty"`
	Retry       string `json:"retry"`
}

// chargedLess answers a payment presented again whose response names more (named) than it was charged: 409, with
// its settlement (resp: settled, or pending in the background) in PAYMENT-RESPONSE, and the upstream's response is
// not sent. The payment stays unserved: presented again for a request whose response costs no more, it is served
// without being charged again.
func (x *exchange) chargedLess(named string, resp x402.SettleResponse) error {
	rq := x.req.PaymentRequirements
	o := x402.PaymentOutcome{Status: x402.OutcomeSettlePending, Payer: x.payer, Network: rq.Network, TotalMs: x.totalMs()}
	if resp.Success {
		o = x.settledOutcome(resp)
	}
	x.resetHeaders()
	x.setSettleHeader(resp)
	x.end(o, zap.String("note", "the response names more than the payment was charged when first presented; it was not sent"),
		zap.String("named", named))
	return x.writeJSON(http.StatusConflict, chargeConflict{
		Error: fmt.Sprintf("this payment was charged %s, decided by the response to the request it was first presented for; "+
			"the response to this request names %s, more than that, and was not sent", x.charge, named),
		Reason: reasonChargeAboveCharged, Outcome: o.Status, Charged: x.charge, Named: named, Asset: rq.Asset, Network: rq.Network,
		Transaction: resp.Transaction,
		Retry: "the payment is not charged again: present it again for a request whose response costs at most what it was charged, " +
			"or sign a new payment for this one",
	})
}
