package gate

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// This file holds the answers the gate writes itself, one per PaymentOutcome that does not serve the resource,
// and the bookkeeping every request ends with: variables (Config.SetVar), metrics and a log line.

// noPayment answers a request without a payment: 402 with what to pay, as the PAYMENT-REQUIRED header and as
// the body (the version 1 body if so configured, a paywall page for browsers).
func (x *exchange) noPayment() error {
	if len(x.offers.offers) == 0 {
		return x.noOffer()
	}
	msg := fmt.Sprintf("%s header is required", x.g.cfg.PaymentHeader)
	if x.g.cfg.SignInOnly {
		msg = x402.HeaderSignInWithX + " header is required: this route sells nothing, it signs in wallets holding its grant"
	}
	pr := x.paymentRequired(msg)
	x.end(x402.PaymentOutcome{Status: x402.OutcomeNoPayment, Requirements: &pr, TotalMs: x.totalMs()})
	x.setRequiredHeader(pr)
	if x402.WantsHTML(x.r) {
		return x.writePaywall(pr)
	}
	x.v1 = x.g.cfg.V1Body
	return x.writeRequired(http.StatusPaymentRequired, pr)
}

// noOffer answers a request without a payment when the gate has no way to pay to offer (its facilitators could
// not be asked what they support): 503 with Retry-After, not a 402 with an empty accepts list, which would invite
// a payment no one can make.
func (x *exchange) noOffer() error {
	detail := "no way to pay is available right now: the facilitator could not be asked what it supports"
	if why := unoffered(x.g.cfg.Offers, x.offers); why != "" {
		detail = "no way to pay is available: " + why
	}
	x.end(x402.PaymentOutcome{Status: x402.OutcomeNoPayment, Detail: detail, TotalMs: x.totalMs()})
	x.w.Header().Set("Retry-After", noOfferRetryAfter)
	x.w.Header().Set("Cache-Control", "no-store")
	if x.g.cfg.HandsOff != nil && x.g.cfg.HandsOff(x.r) {
		return &StatusError{Status: http.StatusServiceUnavailable, Err: errors.New(detail)}
	}
	return x.writeJSON(http.StatusServiceUnavailable, gateError{Error: detail, Outcome: x402.OutcomeNoPayment,
		Retry: "nothing was charged; ask again after Retry-After seconds for what to pay"})
}

// noOfferRetryAfter is the Retry-After of a 503 for want of an offer: the gate asks its facilitators again
// within seconds.
const noOfferRetryAfter = "5"

// invalidHeader answers a payment header that does not decode: 400, saying what is wrong.
func (x *exchange) invalidHeader(err error) error {
	pr := x.paymentRequired("invalid payment header: " + err.Error())
	x.end(x402.PaymentOutcome{Status: x402.OutcomeInvalidHeader, TotalMs: x.totalMs()}, zap.String("problem", err.Error()))
	x.setRequiredHeader(pr)
	return x.writeRequired(http.StatusBadRequest, pr)
}

// verifyFailed answers a payment that is not good for this resource: 402 with a fresh offer naming the problem.
func (x *exchange) verifyFailed(v x402.VerifyResponse) error {
	x.resetHeaders()
	if v.Payer == "" {
		v.Payer = x.payer
	}
	pr := x.paymentRequired(v.InvalidReason + ": " + v.InvalidMessage)
	x.end(x402.PaymentOutcome{Status: x402.OutcomeVerifyFailed, Detail: v, Payer: v.Payer,
		Network: x.req.PaymentRequirements.Network, VerifyMs: x.verifyMs, TotalMs: x.totalMs()})
	x.setRequiredHeader(pr)
	return x.writeRequired(http.StatusPaymentRequired, pr)
}

// alreadyUsed answers a payment that bought its response already, or that another request is presenting.
func (x *exchange) alreadyUsed(message string) error {
	return x.verifyFailed(x402.VerifyResponse{IsValid: false, InvalidReason: x402.ReasonPaymentAlreadyUsed, InvalidMessage: message})
}

// verifyUnreachable answers when the payment could not be checked: 502, and nothing was charged. detail is
// for whoever sent the request and names no URL, host or file; cause, when there is one, goes to the log only.
func (x *exchange) verifyUnreachable(detail string, cause error) error {
	x.resetHeaders()
	x.end(x402.PaymentOutcome{Status: x402.OutcomeVerifyUnreachable, Detail: detail, Payer: x.payer,
		Network: x.req.PaymentRequirements.Network, VerifyMs: x.verifyMs, TotalMs: x.totalMs()}, x.causeField(cause)...)
	return x.writeBadGateway(gateError{Error: detail, Outcome: x402.OutcomeVerifyUnreachable,
		Retry: "the payment was not settled; the same payment may be sent again"})
}

// settleUnreachable answers when the settlement's outcome is not known: 502 that says the payment may have
// settled and must not be paid again. Presenting the same payment again serves it once it is settled. detail
// and cause are as for verifyUnreachable.
func (x *exchange) settleUnreachable(detail string, cause error, pending *x402.SettleResponse) error {
	o := x402.PaymentOutcome{Status: x402.OutcomeSettleUnreachable, Detail: detail, Payer: x.payer,
		Network: x.req.PaymentRequirements.Network, VerifyMs: x.verifyMs, SettleMs: x.settleMs, TotalMs: x.totalMs()}
	body := gateError{Error: detail, Outcome: x402.OutcomeSettleUnreachable,
		Retry: "the payment may have settled: check before paying again, and present the same payment again to receive the resource once it is settled"}
	if x.sentNothing {
		body.Retry = "nothing of the payment was sent: present the same payment again to receive the resource once it is settled"
	}
	x.resetHeaders()
	if x.retryAfter != "" {
		x.w.Header().Set("Retry-After", x.retryAfter)
	}
	if pending != nil {
		o.Transaction, body.Transaction = pending.Transaction, pending.Transaction
		x.setVar(VarTransaction, pending.Transaction)
		x.setSettleHeader(*pending)
	}
	x.end(o, x.causeField(cause)...)
	return x.writeBadGateway(body)
}

// writeBadGateway answers 502 with body, or, where the server has error handling of its own (Config.HandsOff),
// returns the 502 as a *StatusError for it to answer, the payment headers already set.
func (x *exchange) writeBadGateway(body gateError) error {
	if x.g.cfg.HandsOff != nil && x.g.cfg.HandsOff(x.r) {
		x.w.Header().Set("Cache-Control", "no-store")
		return &StatusError{Status: http.StatusBadGateway, Err: fmt.Errorf("%s: %s; %s", body.Outcome, body.Error, body.Retry)}
	}
	return x.writeJSON(http.StatusBadGateway, body)
}

// causeField is the log field of what made a request end in a 502, with the app's RPC URLs taken out: the
// facilitator's or node's own words, which name internal hosts and never go into an answer.
func (x *exchange) causeField(cause error) []zap.Field {
	if cause == nil {
		return nil
	}
	return []zap.Field{zap.String("error", x.g.describe(cause))}
}

// settleFailed answers a settlement the facilitator refused: 402 with its answer and a fresh offer.
func (x *exchange) settleFailed(resp x402.SettleResponse) error {
	pr := x.paymentRequired("settlement failed: " + resp.ErrorReason + ": " + resp.ErrorMessage)
	x.resetHeaders()
	x.end(x402.PaymentOutcome{Status: x402.OutcomeSettleFailed, Detail: resp, Payer: x.payer, Transaction: resp.Transaction,
		Network: x.req.PaymentRequirements.Network, VerifyMs: x.verifyMs, SettleMs: x.settleMs, TotalMs: x.totalMs()})
	x.setSettleHeader(resp)
	x.setRequiredHeader(pr)
	return x.writeRequired(http.StatusPaymentRequired, pr)
}

// tooManyWaiting answers 429 a payer with too many requests waiting for its earlier payments to settle. Nothing
// was verified or charged: the same payment may be sent again after Retry-After.
func (x *exchange) tooManyWaiting() error {
	detail := fmt.Sprintf("%d requests of this payer already wait for its earlier payments to settle", maxWaitersPerPayer)
	x.resetHeaders()
	x.end(x402.PaymentOutcome{Status: x402.OutcomeVerifyUnreachable, Detail: detail, Payer: signedPayer(x.req),
		Network: x.req.PaymentRequirements.Network, TotalMs: x.totalMs()})
	x.w.Header().Set("Retry-After", "2")
	return x.writeJSON(http.StatusTooManyRequests, gateError{Error: detail, Outcome: x402.OutcomeVerifyUnreachable,
		Retry: "nothing was charged; send the same payment again after Retry-After seconds"})
}

// gateError is the body of the gate's 502 answers.
type gateError struct {
	Error       string             `json:"error"`
	Outcome     x402.OutcomeStatus `json:"outcome"`
	Retry       string             `json:"retry"`
	Transaction string             `json:"transaction,omitempty"`
}

// paymentRequired is the gate's current offer for this request's resource.
func (x *exchange) paymentRequired(errText string) x402.PaymentRequired {
	x.rememberOffered()
	pr := x.declareExtensions(x.offers.paymentRequired(x.describeForDiscovery(x.resource()), errText, x.turn))
	if x.g.cfg.SignInOnly {
		pr.Accepts = []x402.PaymentRequirements{} // sells nothing: its offers only name whose grant it honours
	}
	return pr
}

// resource describes what the request buys, by the URL the client asked for (before any rewrite).
func (x *exchange) resource() x402.ResourceInfo {
	description := x.g.cfg.Description
	if x.g.cfg.DescriptionFor != nil {
		description = x.g.cfg.DescriptionFor(x.r)
	}
	return x402.ResourceInfo{URL: x.resourceURL(), Description: description, MimeType: x.g.cfg.MimeType}
}

// resourceURL is the URL the client asked for (before any rewrite), which the 402 names as the resource.
func (x *exchange) resourceURL() string {
	scheme := "http"
	if x.r.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + x.r.Host + x.g.cfg.OriginalURI(x.r)
}

func (x *exchange) setRequiredHeader(pr x402.PaymentRequired) {
	v, err := x402.EncodeHeader(pr)
	if err != nil {
		// Only an offer too large for a header fails; the body still carries it.
		x.g.logger.Error("encoding PAYMENT-REQUIRED", zap.Error(err))
		return
	}
	x.w.Header().Set(x402.HeaderPaymentRequired, v)
}

// setSettleHeader sets PAYMENT-RESPONSE, and X-PAYMENT-RESPONSE with the version 1 network name for a
// version 1 client. An answer too large for a header (a facilitator's overlong message) is logged and left
// out rather than keeping a settled payment from its response.
func (x *exchange) setSettleHeader(resp x402.SettleResponse) {
	v, err := x402.EncodeHeader(resp)
	if err != nil {
		x.g.logger.Error("encoding PAYMENT-RESPONSE", zap.String("tx", resp.Transaction), zap.Error(err))
		return
	}
	x.w.Header().Set(x402.HeaderPaymentResponse, v)
	if x.v1 {
		if name, err := x.g.registry.V1Name(resp.Network); err == nil {
			resp.Network = name
		}
		if v, err = x402.EncodeHeader(resp); err == nil {
			x.w.Header().Set(x402.HeaderXPaymentResponse, v)
		}
	}
}

// writeRequired writes a 402 or 400 whose body is the offer: version 2, or version 1 for a version 1 client.
func (x *exchange) writeRequired(status int, pr x402.PaymentRequired) error {
	if x.v1 && !x.g.cfg.SignInOnly {
		return x.writeJSON(status, x.offers.paymentRequiredV1(x.g.registry, pr.Resource, pr.Error, x.turn))
	}
	return x.writeJSON(status, pr)
}

func (x *exchange) writeJSON(status int, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("x402 gate: encoding the answer: %w", err)
	}
	h := x.w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)+1))
	h.Set("Cache-Control", "no-store")
	x.w.WriteHeader(status)
	// Not flushed: the answer reaches the client when the handler returns, after the request let go of the
	// payment's in-flight mark, so that a client presenting the payment again on its answer, at another gateway of
	// a cluster, never finds it still marked and told "another request is presenting it" (e2e's batch seams test
	// presents each refused voucher at the other gateway at once).
	_, err = x.w.Write(append(body, '\n'))
	return err
}

// end records the request's one outcome: variables for logs and later handlers, metrics, and a log line.
func (x *exchange) end(o x402.PaymentOutcome, extra ...zap.Field) {
	if x.ended {
		x.g.logger.Error("a gated request ended twice; keeping the first outcome", zap.String("second", string(o.Status)))
		return
	}
	x.ended = true
	x.g.metrics.ObserveOutcome(o.Status)
	if o.VerifyMs > 0 {
		x.g.metrics.ObserveVerify(time.Duration(o.VerifyMs * float64(time.Millisecond)))
	}
	if o.SettleMs > 0 {
		x.g.metrics.ObserveSettle(time.Duration(o.SettleMs * float64(time.Millisecond)))
	}
	x.setVar(VarStatus, string(o.Status))
	if name, ok := outcomeEvents[o.Status]; ok {
		x.emit(name, &o)
	}
	if o.Payer != "" {
		x.setVar(VarPayer, o.Payer)
	}
	if o.Network != "" {
		x.setVar(VarNetwork, o.Network)
	}
	if o.Transaction != "" {
		x.setVar(VarTransaction, o.Transaction)
	}
	fields := append([]zap.Field{
		zap.String("outcome", string(o.Status)), zap.String("payer", o.Payer), zap.String("network", o.Network),
		zap.String("amount", x.chargeAmount()), zap.String("tx", o.Transaction),
		zap.Float64("verify_ms", o.VerifyMs), zap.Float64("settle_ms", o.SettleMs), zap.Float64("total_ms", o.TotalMs),
	}, extra...)
	if o.Detail != nil {
		fields = append(fields, zap.Any("detail", o.Detail))
	}
	level := zap.DebugLevel
	switch o.Status {
	case x402.OutcomeSettled, x402.OutcomeSettlePending:
		level = zap.InfoLevel
	case x402.OutcomeVerifyUnreachable, x402.OutcomeSettleUnreachable:
		level = zap.WarnLevel
	}
	if ce := x.g.logger.Check(level, "payment"); ce != nil {
		x.logLine, x.logFields = ce, fields
		if !x.logAfterResponse {
			x.writeLog()
		}
	}
}

// endHeld is end for a request about to deliver its held response: the log line is written once the response is
// out (deliver), not before it, for a synchronous write to the log takes longer than the rest of the outcome's
// bookkeeping, and the payer waits for none of it.
func (x *exchange) endHeld(o x402.PaymentOutcome, extra ...zap.Field) {
	x.logAfterResponse = true
	x.end(o, extra...)
}

// writeLog writes the outcome's log line end held back, once.
func (x *exchange) writeLog() {
	if ce := x.logLine; ce != nil {
		x.logLine = nil
		ce.Write(x.logFields...)
	}
}
