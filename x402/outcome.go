package x402

import (
	"net/http"
	"strings"
)

// OutcomeStatus is the discriminator of a PaymentOutcome: how one gated request ended.
type OutcomeStatus string

// The eight outcomes of a gated request (spec section 2.7).
const (
	OutcomeNoPayment         OutcomeStatus = "no-payment"
	OutcomeInvalidHeader     OutcomeStatus = "invalid-header"
	OutcomeVerifyFailed      OutcomeStatus = "verify-failed"
	OutcomeVerifyUnreachable OutcomeStatus = "verify-unreachable"
	OutcomeSettleFailed      OutcomeStatus = "settle-failed"
	OutcomeSettleUnreachable OutcomeStatus = "settle-unreachable"
	OutcomeSettled           OutcomeStatus = "settled"
	OutcomeSettlePending     OutcomeStatus = "settle-pending"
)

// outcomeTable is the HTTP mapping of spec section 7.1, kept as one table so the mapping lives in one place.
var outcomeTable = map[OutcomeStatus]struct {
	httpStatus int
	meaning    string
}{
	OutcomeNoPayment:         {http.StatusPaymentRequired, "no payment header present"},
	OutcomeInvalidHeader:     {http.StatusBadRequest, "malformed payment header"},
	OutcomeVerifyFailed:      {http.StatusPaymentRequired, "signature or balance check failed"},
	OutcomeVerifyUnreachable: {http.StatusBadGateway, "facilitator /verify unreachable"},
	OutcomeSettleFailed:      {http.StatusPaymentRequired, "on-chain settlement rejected"},
	OutcomeSettleUnreachable: {http.StatusBadGateway, "facilitator /settle unreachable; the payment may have settled, check before paying again"},
	OutcomeSettlePending:     {http.StatusOK, "asynchronous settlement started, resource served"},
	OutcomeSettled:           {http.StatusOK, "payment confirmed on-chain, resource served"},
}

// OutcomeStatuses lists every outcome status in the order of the spec.
func OutcomeStatuses() []OutcomeStatus {
	return []OutcomeStatus{
		OutcomeNoPayment, OutcomeInvalidHeader, OutcomeVerifyFailed, OutcomeVerifyUnreachable,
		OutcomeSettleFailed, OutcomeSettleUnreachable, OutcomeSettlePending, OutcomeSettled,
	}
}

// HTTPStatus is the status code a resource server answers with for this outcome (spec section 7.1);
// 500 for a status that is not one of the eight.
func (s OutcomeStatus) HTTPStatus() int {
	if row, ok := outcomeTable[s]; ok {
		return row.httpStatus
	}
	return http.StatusInternalServerError
}

// Meaning is the spec's one-line explanation of the outcome.
func (s OutcomeStatus) Meaning() string { return outcomeTable[s].meaning }

// Valid reports whether s is one of the eight outcome statuses.
func (s OutcomeStatus) Valid() bool {
	_, ok := outcomeTable[s]
	return ok
}

// PaymentOutcome is the result of one gated request, discriminated by Status. Only the fields of its status
// are set: Requirements for no-payment; Detail for the failures; the rest for settled and settle-pending.
type PaymentOutcome struct {
	Status       OutcomeStatus    `json:"status"`
	Requirements *PaymentRequired `json:"requirements,omitempty"`
	Detail       any              `json:"detail,omitempty"`
	Transaction  string           `json:"transaction,omitempty"`
	Payer        string           `json:"payer,omitempty"`
	Network      string           `json:"network,omitempty"`
	VerifyMs     float64          `json:"verifyMs,omitempty"`
	SettleMs     float64          `json:"settleMs,omitempty"`
	TotalMs      float64          `json:"totalMs,omitempty"`
}

// HTTPStatus is the status code of the outcome's status.
func (o PaymentOutcome) HTTPStatus() int { return o.Status.HTTPStatus() }

// WantsHTML reports whether the client is a browser asking for a page (its Accept names text/html), which gets
// a page for a person where any other client gets the JSON document.
func WantsHTML(r *http.Request) bool {
	return strings.Contains(strings.ToLower(r.Header.Get("Accept")), "text/html")
}
