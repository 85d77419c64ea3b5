package caddymodule

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// decodeFacilitatorRequest decodes the body of /verify or /settle of either version. A version 1 body
// ({"x402Version":1, "paymentPayload": v1 payment, "paymentRequirements": v1 requirement}) comes back in the
// version 2 shape with x402Version 1, as the engine takes it, and v1 set; network names become CAIP-2 ids.
func decodeFacilitatorRequest(body []byte, reg *x402.Registry) (req x402.VerifyRequest, v1 bool, err error) {
	req, err = x402.DecodeVerifyRequest(body)
	var de *x402.DecodeError
	if err == nil || !errors.As(err, &de) || de.Kind != x402.DecodeUnsupportedVersion || de.Field != "x402Version" {
		return req, false, err
	}
	var top struct {
		X402Version         json.RawMessage `json:"x402Version"`
		PaymentPayload      json.RawMessage `json:"paymentPayload"`
		PaymentRequirements json.RawMessage `json:"paymentRequirements"`
	}
	if json.Unmarshal(body, &top) != nil || string(top.X402Version) != "1" {
		return req, false, err // not version 1 either: the version 2 decoder said what is wrong
	}
	req, err = decodeVerifyRequestV1(top.PaymentPayload, top.PaymentRequirements, reg)
	return req, true, err
}

// Document name of a version 1 request in DecodeErrors, as package x402 names the version 2 one.
const docVerifyRequestV1 = "version 1 verify request"

// decodeVerifyRequestV1 reads the two halves of a version 1 request with package x402's strict readers (the
// payment as a header would carry it, the requirement as a 402 body would), so that both versions are held to
// the same rules, and converts them to version 2. Field paths in errors are those of the request body.
func decodeVerifyRequestV1(payload, requirements json.RawMessage, reg *x402.Registry) (x402.VerifyRequest, error) {
	if isAbsent(payload) {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeMissingField, Field: "paymentPayload",
			Detail: "is missing; expected the version 1 payment {x402Version, scheme, network, payload}"}
	}
	if isAbsent(requirements) {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeMissingField, Field: "paymentRequirements",
			Detail: "is missing; expected the version 1 requirement {scheme, network, maxAmountRequired, resource, payTo, maxTimeoutSeconds, asset}"}
	}
	if len(payload) > x402.MaxHeaderBytes {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeTooLarge, Field: "paymentPayload",
			Detail: "is larger than a payment header may be"}
	}
	pay, err := x402.DecodePaymentPayloadV1(base64.StdEncoding.EncodeToString(payload))
	if err != nil {
		return x402.VerifyRequest{}, reframe(err, "paymentPayload", "")
	}
	wrapped := make([]byte, 0, len(requirements)+32)
	wrapped = append(append(append(wrapped, `{"x402Version":1,"accepts":[`...), requirements...), "]}"...)
	offered, err := x402.DecodePaymentRequiredV1(wrapped)
	if err != nil {
		return x402.VerifyRequest{}, reframe(err, "paymentRequirements", "accepts[0]")
	}
	if len(offered.Accepts) != 1 {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeWrongType, Field: "paymentRequirements",
			Detail: "expected one requirement object"}
	}
	rq, _, err := reg.RequirementsFromV1(offered.Accepts[0])
	if err != nil {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeInvalidValue, Field: "paymentRequirements.network",
			Detail: err.Error() + "; version 1 names the networks " + x402.V1NameMainnet + " and " + x402.V1NameTestnet}
	}
	p2, err := reg.PaymentPayloadFromV1(pay, rq)
	if err != nil {
		return x402.VerifyRequest{}, &x402.DecodeError{Doc: docVerifyRequestV1, Kind: x402.DecodeInvalidValue, Field: "paymentPayload.network",
			Detail: err.Error()}
	}
	p2.X402Version = x402.Version1
	return x402.VerifyRequest{X402Version: x402.Version1, PaymentPayload: p2, PaymentRequirements: rq}, nil
}

// reframe moves a DecodeError of a part into the request: the document becomes the request and the field
// path is prefixed with where the part sits (after dropping the wrapper's own prefix).
func reframe(err error, at, wrapper string) error {
	var de *x402.DecodeError
	if !errors.As(err, &de) {
		return err
	}
	out := *de
	out.Doc, out.Offset = docVerifyRequestV1, 0
	field := strings.TrimPrefix(strings.TrimPrefix(de.Field, wrapper), ".")
	switch {
	case de.Field == "" || de.Field == wrapper:
		out.Field = at
	default:
		out.Field = at + "." + field
	}
	return &out
}

func isAbsent(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}
