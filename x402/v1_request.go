package x402

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strings"
)

// DecodeFacilitatorRequest decodes the body of a facilitator's /verify or /settle of either version. A version 1
// body ({"x402Version":1, "paymentPayload": v1 payment, "paymentRequirements": v1 requirement}) comes back in the
// version 2 shape with x402Version 1, and v1 set; network names become CAIP-2 ids through r.
func (r *Registry) DecodeFacilitatorRequest(body []byte) (req VerifyRequest, v1 bool, err error) {
	req, err = DecodeVerifyRequest(body)
	var de *DecodeError
	if err == nil || !errors.As(err, &de) || de.Kind != DecodeUnsupportedVersion || de.Field != "x402Version" {
		return req, false, err
	}
	if v, _ := locate(body, "/x402Version"); string(v) != "1" {
		return req, false, err // not version 1 either: the version 2 decoder said what is wrong
	}
	var top struct {
		PaymentPayload      json.RawMessage `json:"paymentPayload"`
		PaymentRequirements json.RawMessage `json:"paymentRequirements"`
	}
	c := checker{doc: body}
	if c.unmarshal(&top); c.err != nil {
		return VerifyRequest{}, true, c.finish(docVerifyRequestV1)
	}
	req, err = r.decodeVerifyRequestV1(top.PaymentPayload, top.PaymentRequirements)
	return req, true, err
}

// Document name of a version 1 request in DecodeErrors, as the version 2 one is named.
const docVerifyRequestV1 = "version 1 verify request"

// decodeVerifyRequestV1 reads the two halves of a version 1 request with this package's strict readers (the
// payment as a header would carry it, the requirement as a 402 body would), so that both versions are held to
// the same rules, and converts them to version 2. Field paths in errors are those of the request body.
func (r *Registry) decodeVerifyRequestV1(payload, requirements json.RawMessage) (VerifyRequest, error) {
	if isAbsent(payload) {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeMissingField, Field: "paymentPayload",
			Detail: "is missing; expected the version 1 payment {x402Version, scheme, network, payload}"}
	}
	if isAbsent(requirements) {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeMissingField, Field: "paymentRequirements",
			Detail: "is missing; expected the version 1 requirement {scheme, network, maxAmountRequired, resource, payTo, maxTimeoutSeconds, asset}"}
	}
	if len(payload) > MaxHeaderBytes {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeTooLarge, Field: "paymentPayload",
			Detail: "is larger than a payment header may be"}
	}
	pay, err := DecodePaymentPayloadV1(base64.StdEncoding.EncodeToString(payload))
	if err != nil {
		return VerifyRequest{}, reframeV1(err, "paymentPayload", "")
	}
	wrapped := make([]byte, 0, len(requirements)+32)
	wrapped = append(append(append(wrapped, `{"x402Version":1,"accepts":[`...), requirements...), "]}"...)
	offered, err := DecodePaymentRequiredV1(wrapped)
	if err != nil {
		return VerifyRequest{}, reframeV1(err, "paymentRequirements", "accepts[0]")
	}
	if len(offered.Accepts) != 1 {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeWrongType, Field: "paymentRequirements",
			Detail: "expected one requirement object"}
	}
	rq, _, err := r.RequirementsFromV1(offered.Accepts[0])
	if err != nil {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeInvalidValue, Field: "paymentRequirements.network",
			Detail: err.Error() + "; version 1 names the networks " + V1NameMainnet + " and " + V1NameTestnet}
	}
	if rq.Extra.AssetTransferMethod == "" {
		// Version 1 requirements seldom name the transfer method; the payment says which it is, and a
		// facilitator set routes by it.
		rq.Extra.AssetTransferMethod = TransferMethod(rq, pay.Payload)
	}
	p2, err := r.PaymentPayloadFromV1(pay, rq)
	if err != nil {
		return VerifyRequest{}, &DecodeError{Doc: docVerifyRequestV1, Kind: DecodeInvalidValue, Field: "paymentPayload.network",
			Detail: err.Error()}
	}
	p2.X402Version = Version1
	return VerifyRequest{X402Version: Version1, PaymentPayload: p2, PaymentRequirements: rq}, nil
}

// reframeV1 moves a DecodeError of a part into the request: the document becomes the request and the field
// path is prefixed with where the part sits (after dropping the wrapper's own prefix).
func reframeV1(err error, at, wrapper string) error {
	var de *DecodeError
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
