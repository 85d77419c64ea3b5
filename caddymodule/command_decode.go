package caddymodule

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// decodedHeader is an x402 header value decoded by `caddy x402 decode`.
type decodedHeader struct {
	// Name is the header the value belongs to, such as PAYMENT-SIGNATURE.
	Name string
	// Version is the document's x402Version; 0 for a settlement response, which carries none.
	Version int
	// JSON is the document as it came, indented.
	JSON []byte
}

// headerDecoders check a header value as the document of a header name, for values given as a whole header
// line ("PAYMENT-SIGNATURE: eyJ...").
var headerDecoders = map[string]func(string) (int, error){
	x402.HeaderPaymentRequired: func(v string) (int, error) {
		p, err := x402.DecodePaymentRequired(v)
		return p.X402Version, err
	},
	x402.HeaderPaymentSignature: func(v string) (int, error) {
		p, err := x402.DecodePaymentPayload(v)
		return p.X402Version, err
	},
	x402.HeaderXPayment: func(v string) (int, error) {
		p, err := x402.DecodePaymentPayloadV1(v)
		return p.X402Version, err
	},
	x402.HeaderPaymentResponse: func(v string) (int, error) {
		_, err := x402.DecodeSettleResponse(v)
		return 0, err
	},
	x402.HeaderXPaymentResponse: func(v string) (int, error) {
		_, err := x402.DecodeSettleResponse(v)
		return 0, err
	},
}

// decodeHeaderValue decodes any PAYMENT-* (or X-PAYMENT*) header value. A value prefixed with its header
// name is decoded as that header; a bare one is told by its shape: accepts (PAYMENT-REQUIRED), payload
// (PAYMENT-SIGNATURE, or X-PAYMENT when its version is 1) or success (PAYMENT-RESPONSE). The value is checked
// with the protocol's strict decoders, so an error is the *x402.DecodeError that names the offending field.
func decodeHeaderValue(value string) (decodedHeader, error) {
	value = strings.TrimSpace(value)
	name := ""
	if n, rest, ok := strings.Cut(value, ":"); ok {
		if _, known := headerDecoders[strings.ToUpper(strings.TrimSpace(n))]; known {
			name, value = strings.ToUpper(strings.TrimSpace(n)), strings.TrimSpace(rest)
		}
	}
	doc, err := x402.HeaderJSON(value)
	if err != nil {
		return decodedHeader{}, fmt.Errorf("not an x402 header value: %w", err)
	}
	if name == "" {
		if name, err = headerByShape(value, doc); err != nil {
			return decodedHeader{}, err
		}
	}
	version, err := headerDecoders[name](value)
	if err != nil {
		return decodedHeader{}, fmt.Errorf("not a valid %s value: %w", name, err)
	}
	var out bytes.Buffer
	if err := json.Indent(&out, doc, "", "  "); err != nil {
		return decodedHeader{}, fmt.Errorf("indenting the %s document: %w", name, err)
	}
	return decodedHeader{Name: name, Version: version, JSON: out.Bytes()}, nil
}

// headerByShape names the header a document belongs to from its top-level keys.
func headerByShape(value string, doc []byte) (string, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(doc, &top); err != nil || top == nil {
		// Not a JSON object: the payment decoder says precisely where and why.
		if _, derr := x402.DecodePaymentHeader(value); derr != nil {
			return "", fmt.Errorf("not an x402 header value: %w", derr)
		}
		return "", fmt.Errorf("not an x402 header value: expected a JSON object, got %.40s", doc)
	}
	switch {
	case top["accepts"] != nil:
		return x402.HeaderPaymentRequired, nil
	case top["payload"] != nil:
		if string(top["x402Version"]) == "1" {
			return x402.HeaderXPayment, nil
		}
		return x402.HeaderPaymentSignature, nil
	case top["success"] != nil:
		return x402.HeaderPaymentResponse, nil
	}
	keys := make([]string, 0, len(top))
	for k := range top {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return "", fmt.Errorf("not an x402 header value: expected a JSON object with accepts (PAYMENT-REQUIRED), payload (PAYMENT-SIGNATURE, X-PAYMENT) or success (PAYMENT-RESPONSE), got one with keys [%s]",
		strings.Join(keys, ", "))
}

// runDecode prints the decoded header's JSON on stdout and which header it is on stderr.
func runDecode(value string, stdout, stderr io.Writer) error {
	d, err := decodeHeaderValue(value)
	if err != nil {
		return err
	}
	if d.Version != 0 {
		fmt.Fprintf(stderr, "%s (x402 version %d)\n", d.Name, d.Version)
	} else {
		fmt.Fprintln(stderr, d.Name)
	}
	_, err = fmt.Fprintf(stdout, "%s\n", d.JSON)
	return err
}
