package gate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"strings"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Values of Config.PaymentIdentifier.
const (
	// PaymentIdentifierOptional declares the payment-identifier extension: a client may name its payment with an id.
	PaymentIdentifierOptional = "optional"
	// PaymentIdentifierRequired declares it required: a new payment that names no id is refused (400).
	PaymentIdentifierRequired = "required"
)

// checkPaymentIdentifierMode says what is wrong with a Config.PaymentIdentifier.
func checkPaymentIdentifierMode(mode string) error {
	switch mode {
	case "", PaymentIdentifierOptional, PaymentIdentifierRequired:
		return nil
	}
	return fmt.Errorf("payment_identifier %q is not one; want %q or %q", mode, PaymentIdentifierOptional, PaymentIdentifierRequired)
}

// Declarations of the payment-identifier extension, built once: a 402 carries one of them.
var (
	paymentIdentifierOptional = x402.PaymentIdentifierDeclaration(false)
	paymentIdentifierRequired = x402.PaymentIdentifierDeclaration(true)
)

// declareExtensions adds to a 402 the extensions the gate declares itself (the offer set declares the
// facilitator's): payment-identifier, sign-in-with-x and bazaar when configured; of the facilitator's gas-sponsoring
// extensions, those gas_sponsoring names. The offer set's map is shared by every 402 built from it,
// so it is copied, never written.
func (x *exchange) declareExtensions(pr x402.PaymentRequired) x402.PaymentRequired {
	var decl json.RawMessage
	switch x.g.cfg.PaymentIdentifier {
	case PaymentIdentifierOptional:
		decl = paymentIdentifierOptional
	case PaymentIdentifierRequired:
		decl = paymentIdentifierRequired
	}
	if decl == nil && x.g.cfg.Access == nil && x.g.cfg.Discovery == nil && x.g.cfg.GasSponsoring == nil {
		return pr
	}
	ext := make(map[string]json.RawMessage, len(pr.Extensions)+2)
	maps.Copy(ext, pr.Extensions)
	if x.g.cfg.GasSponsoring != nil {
		withholdGasSponsoring(ext, x.g.cfg.GasSponsoring) // sponsoring.go
	}
	if decl != nil {
		ext[x402.ExtensionPaymentIdentifier] = decl
	}
	if x.g.cfg.Access != nil {
		x.declareSignIn(ext) // siwx.go
	}
	if x.g.cfg.Discovery != nil {
		x.declareDiscovery(ext) // bazaar.go
	}
	pr.Extensions = ext
	return pr
}

// errPaymentIdentifierRequired refuses a payment that names no id where the gate requires one.
var errPaymentIdentifierRequired = errors.New("this resource requires a payment identifier: name the payment in extensions." +
	x402.ExtensionPaymentIdentifier + ".info.id (16 to 128 letters, digits, '-' or '_')")

// paymentIdentifierProblem says why a payment's id is refused before anything is verified (the gate answers 400,
// as the SDK's servers do): where the gate declares the extension, an id that does not read, or none where it
// is required. A gate that does not declare it ignores the extension, as a client echoes only what a 402
// declared.
func (x *exchange) paymentIdentifierProblem(p presented) error {
	switch {
	case x.g.cfg.PaymentIdentifier == "":
		return nil
	case p.identifierErr != nil:
		return p.identifierErr
	case p.identifier == "" && x.g.cfg.PaymentIdentifier == PaymentIdentifierRequired:
		return errPaymentIdentifierRequired
	}
	return nil
}

// paymentIdentifierKey is where the journal binds the payment's id: ids are chosen by clients, so each payer has
// ids of its own. A payer is who signed the payment, and a binding is written only once the facilitator verified
// that signature: nobody binds, or blocks, an id of another payer's, and naming another payer's id in a payment
// one cannot sign learns no more than a 409 says (that the id names some payment), and costs a verification
// nothing. The SDK leaves the scope to the server; the id is one payment's, whatever resource it buys, as the
// spec's table reads (the same id with another payload: 409).
func (x *exchange) paymentIdentifierKey(identifier string) string {
	return strings.ToLower(signedPayer(x.req)) + "/" + identifier
}

// paymentIdentifierTaken answers 409 (answered true) when the id the payment names is bound to another payment
// that still stands: one presented right now, on this gateway or another of the cluster, or one recorded and
// not refused for good. It runs before the payment is verified, so that a conflict costs nothing, and it
// remembers in x.renames a payment the id was bound to that bought nothing (its request ended before the gate
// recorded it, or its settlement was refused for good): the SDK's servers keep an id only for a payment that
// settled, so such an id may name a new payment. namePaymentIdentifier binds it once the payment is verified.
func (x *exchange) paymentIdentifierTaken(p presented) (answered bool, err error) {
	if x.g.cfg.PaymentIdentifier == "" || p.identifier == "" {
		return false, nil
	}
	ctx := x.r.Context()
	bound, ok, err := x.g.identifiers.NamedPayment(ctx, x.paymentIdentifierKey(p.identifier))
	switch {
	case err != nil:
		return true, x.verifyUnreachable("the gate's settlement journal could not be read; nothing was charged, try again", err)
	case !ok || bound == p.id:
		return false, nil
	}
	mine, err := x.g.ledger.acquire(ctx, bound)
	if err != nil {
		return true, x.verifyUnreachable("the gate's settlement journal could not be reached; nothing was charged, try again", err)
	} else if !mine {
		return true, x.paymentIdentifierConflict(p.identifier, "is being presented right now with another payment")
	}
	rec, found, err := x.g.ledger.store.Get(ctx, bound)
	x.g.ledger.release(bound)
	switch {
	case err != nil:
		return true, x.verifyUnreachable("the gate's settlement journal could not be read; nothing was charged, try again", err)
	case found && !refusedForGood(rec):
		return true, x.paymentIdentifierConflict(p.identifier, "already names another payment")
	}
	x.renames = bound
	return false, nil
}

// refusedForGood reports whether a journalled payment bought nothing and never will: its settlement was refused
// and its outcome is known.
func refusedForGood(rec journal.Record) bool {
	return rec.State == journal.StateFinal && rec.Response != nil && !rec.Response.Success && !rec.Response.OutcomeUnknown() && !rec.Served
}

// namePaymentIdentifier binds the id the verified payment names to it (answered false), or answers 409, letting go
// of what verification held, when another payment bound it since paymentIdentifierTaken looked (two payments of one
// id presented at once: one of them is verified in vain, and neither is charged twice).
func (x *exchange) namePaymentIdentifier(p presented) (answered bool, err error) {
	if x.g.cfg.PaymentIdentifier == "" || p.identifier == "" {
		return false, nil
	}
	named, err := x.g.identifiers.NamePayment(context.WithoutCancel(x.r.Context()), x.paymentIdentifierKey(p.identifier), x.id, x.renames)
	switch {
	case err != nil:
		x.unhold()
		return true, x.verifyUnreachable("the gate's settlement journal could not be written; nothing was charged, try again", err)
	case named != x.id:
		x.unhold()
		return true, x.paymentIdentifierConflict(p.identifier, "already names another payment")
	}
	return false, nil
}

// paymentIdentifierConflict answers a payment whose id names another payment: 409, as the spec says, and nothing
// was verified, settled or held for it.
func (x *exchange) paymentIdentifierConflict(identifier, why string) error {
	detail := fmt.Sprintf("the payment identifier %s %s: retry with the payment it was first sent with, or name this one with a new id", identifier, why)
	x.resetHeaders()
	x.end(x402.PaymentOutcome{Status: x402.OutcomeVerifyFailed, Detail: detail, Payer: signedPayer(x.req),
		Network: x.req.PaymentRequirements.Network, TotalMs: x.totalMs()})
	return x.writeJSON(http.StatusConflict, gateError{Error: detail, Outcome: x402.OutcomeVerifyFailed,
		Retry: "nothing was charged for this payment; its id stays with the payment it names"})
}
