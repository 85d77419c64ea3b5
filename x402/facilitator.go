package x402

import (
	"context"
	"errors"
	"fmt"
)

// Facilitator verifies and settles payments. The embedded engine (package chain) and the HTTP client (package
// facilitatorclient) both implement it, so a gate does not care which one it talks to.
//
// A payment the facilitator refuses is not an error: it comes back as a VerifyResponse with IsValid false or a
// SettleResponse with Success false and a reason. An error means no trustworthy answer was had: the facilitator
// could not be reached, answered garbage, or rejected the request itself (see FacilitatorError). After a Settle
// error the payment may still have settled.
type Facilitator interface {
	Supported(ctx context.Context) (SupportedResponse, error)
	Verify(ctx context.Context, req VerifyRequest) (VerifyResponse, error)
	Settle(ctx context.Context, req SettleRequest) (SettleResponse, error)
	Health(ctx context.Context) (HealthResponse, error)
}

// FailureKind says why a facilitator call yielded no answer.
type FailureKind string

// Failure kinds of a FacilitatorError.
const (
	// FailureUnreachable: no answer at all (connection refused, timeout, cancelled, 5xx without a body).
	FailureUnreachable FailureKind = "unreachable"
	// FailureBadAnswer: an answer that is not a well-formed response of the protocol.
	FailureBadAnswer FailureKind = "bad-answer"
	// FailureRejected: the facilitator refused the request itself (400 malformed, 401 unauthorised, 413),
	// as opposed to refusing the payment.
	FailureRejected FailureKind = "rejected"
)

// FacilitatorError is a facilitator call that produced no protocol answer.
type FacilitatorError struct {
	Op     string // "supported", "verify", "settle" or "health"
	Kind   FailureKind
	Status int // HTTP status when one was received, else 0
	Err    error
}

func (e *FacilitatorError) Error() string {
	if e.Status != 0 {
		return fmt.Sprintf("facilitator %s: %s (HTTP %d): %v", e.Op, e.Kind, e.Status, e.Err)
	}
	return fmt.Sprintf("facilitator %s: %s: %v", e.Op, e.Kind, e.Err)
}

func (e *FacilitatorError) Unwrap() error { return e.Err }

// IsUnreachable reports whether err says the facilitator gave no usable answer (unreachable or garbage), the
// case a gate maps to verify-unreachable / settle-unreachable (502).
func IsUnreachable(err error) bool {
	var fe *FacilitatorError
	if errors.As(err, &fe) {
		return fe.Kind == FailureUnreachable || fe.Kind == FailureBadAnswer
	}
	return false
}

// ErrNotSent is wrapped into the error of a facilitator call none of whose requests can have reached the
// facilitator (connection refused, name not resolved, TLS handshake failed), or whose settlement the facilitator
// answered it sent nothing of (ErrSentNothing): sending the same payment elsewhere, or again, is safe.
var ErrNotSent = errors.New("request never reached the facilitator")

// ErrSentNothing is wrapped into the error of a settlement the facilitator could not make now and of which it
// surely sent nothing on chain, nor left anything a later pass of its own would send: the node refused the
// transaction, or could not be asked what it needs (its fee, its nonce, the chain's time). The payment is as good as
// before, and presented again it is settled once, by this facilitator or another; a refusal of it then is final.
// Over HTTP an x402_facilitator answers it 503 with `"sent": false` in its error body, which facilitatorclient reads
// back as this error and ErrNotSent both.
var ErrSentNothing = errors.New("the facilitator sent nothing for the settlement")

// ErrAnswerNotThisPayment is wrapped into the error of a facilitator call whose answer does not show that it is
// about the payment asked of: a settlement's success that names another network, payer or amount, or no
// transaction (see SettlementProblem), or a verification's that names another payer (see VerifyProblem). It is
// no refusal: after such a settlement answer the payment may have settled, and its outcome is unknown.
var ErrAnswerNotThisPayment = errors.New("the facilitator's answer is not about this payment")

// DescribeFailure says what went wrong with a facilitator call in words fit for any caller, the payer included:
// the kind of failure and the HTTP status, never the facilitator's URL, the hosts behind it, or its own error
// text.
func DescribeFailure(err error) string {
	var fe *FacilitatorError
	if !errors.As(err, &fe) {
		return "an internal error"
	}
	var what string
	switch {
	case errors.Is(err, ErrSentNothing):
		what = "it sent nothing: the chain could not take the settlement now"
	case errors.Is(err, ErrNotSent):
		what = "no connection could be made"
	case errors.Is(err, context.DeadlineExceeded):
		what = "no answer came in time"
	case errors.Is(err, ErrAnswerNotThisPayment):
		what = "its answer claimed success for another payment"
	case fe.Kind == FailureBadAnswer && fe.Status >= 300 && fe.Status < 400:
		return fmt.Sprintf("the answer was a redirect (HTTP %d), which is not followed", fe.Status)
	case fe.Kind == FailureBadAnswer:
		what = "the answer was not a facilitator response"
	case fe.Kind == FailureRejected && fe.Status == 0:
		what = "no facilitator serves this kind of payment" // a failover set that asked no member
	case fe.Kind == FailureRejected:
		what = "the request was refused"
	default:
		what = "no answer came"
	}
	if fe.Status != 0 {
		what += fmt.Sprintf(" (HTTP %d)", fe.Status)
	}
	return what
}
