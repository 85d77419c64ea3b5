package gate

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"

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
// facilitator's): payment-identifier when configured. The offer set's map is shared by every 402 built from it,
// so it is copied, never written.
func (x *exchange) declareExtensions(pr x402.PaymentRequired) x402.PaymentRequired {
	var decl json.RawMessage
	switch x.g.cfg.PaymentIdentifier {
	case PaymentIdentifierOptional:
		decl = paymentIdentifierOptional
	case PaymentIdentifierRequired:
		decl = paymentIdentifierRequired
	default:
		return pr
	}
	ext := make(map[string]json.RawMessage, len(pr.Extensions)+1)
	maps.Copy(ext, pr.Extensions)
	ext[x402.ExtensionPaymentIdentifier] = decl
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
