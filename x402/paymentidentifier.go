package x402

import (
	"encoding/json"
	"fmt"

	jsonv2 "github.com/go-json-experiment/json"
)

// ExtensionPaymentIdentifier is the extension under which a client names its payment with an id of its choosing,
// so that it can retry safely: the same id with the same payment gets the same outcome again, the same id with
// another payment is refused (409).
const ExtensionPaymentIdentifier = "payment-identifier"

// Bounds of a payment identifier, as the public SDKs check them.
const (
	PaymentIdentifierMinLength = 16
	PaymentIdentifierMaxLength = 128
)

// paymentIdentifierField names the id in errors, where a client finds it in its payment payload.
const paymentIdentifierField = "extensions." + ExtensionPaymentIdentifier + ".info.id"

// PaymentIdentifierDeclaration is the payment-identifier extension as a 402 declares it: whether an id is
// required, and the JSON schema of the info the client echoes with its id, as the public SDKs declare it.
func PaymentIdentifierDeclaration(required bool) json.RawMessage {
	b, err := json.Marshal(map[string]any{
		"info": map[string]bool{"required": required},
		"schema": map[string]any{
			"$schema": "https://json-schema.org/draft/2020-12/schema",
			"type":    "object",
			"properties": map[string]any{
				"required": map[string]string{"type": "boolean"},
				"id": map[string]any{"type": "string", "minLength": PaymentIdentifierMinLength,
					"maxLength": PaymentIdentifierMaxLength, "pattern": "^[a-zA-Z0-9_-]+$"},
			},
			"required": []string{"required"},
		},
	})
	if err != nil {
		panic(err) // a constant document
	}
	return b
}

// PaymentIdentifier decodes the id the payment names in its payment-identifier extension: "" when it carries
// no such extension or the extension names no id (the SDKs' clients echo the declaration alone when not asked
// for an id), an error naming the field when the extension is not {"info": {...}} or its id is not a string of
// 16 to 128 letters, digits, hyphens and underscores.
func (p PaymentPayload) PaymentIdentifier() (string, error) {
	raw, ok := p.Extensions[ExtensionPaymentIdentifier]
	if !ok {
		return "", nil
	}
	var ext struct {
		Info *struct {
			ID *string `json:"id"`
		} `json:"info"`
	}
	if err := jsonv2.Unmarshal(raw, &ext); err != nil {
		return "", fmt.Errorf("extensions.%s must be {\"info\":{\"id\": string}}: %w", ExtensionPaymentIdentifier, err)
	}
	if ext.Info == nil {
		return "", fmt.Errorf("extensions.%s has no info object", ExtensionPaymentIdentifier)
	}
	if ext.Info.ID == nil {
		return "", nil
	}
	if err := CheckPaymentIdentifier(*ext.Info.ID); err != nil {
		return "", err
	}
	return *ext.Info.ID, nil
}

// CheckPaymentIdentifier says what is wrong with id as a payment identifier, naming the field; nil when it is
// 16 to 128 characters, each a letter, digit, hyphen or underscore.
func CheckPaymentIdentifier(id string) error {
	if n := len(id); n < PaymentIdentifierMinLength || n > PaymentIdentifierMaxLength {
		return fmt.Errorf("%s must be %d to %d characters, got %d", paymentIdentifierField,
			PaymentIdentifierMinLength, PaymentIdentifierMaxLength, n)
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return fmt.Errorf("%s may hold only letters, digits, '-' and '_'; byte %d is %q", paymentIdentifierField, i, c)
		}
	}
	return nil
}
