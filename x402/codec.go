package x402

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Size limits of decoded documents. A payment header is a few hundred bytes to 2 KiB; 16 KiB leaves room for
// extensions and matches the header size limit of common HTTP servers, so anything larger is refused before it
// is decoded.
const (
	// MaxHeaderBytes is the largest JSON document a protocol header may carry, counted after Base64 decoding.
	MaxHeaderBytes = 16 << 10
	// MaxBodyBytes is the largest JSON body the body decoders accept (a /verify or /settle request carries one
	// payment and one set of requirements).
	MaxBodyBytes = 64 << 10
)

// maxHeaderText is the longest Base64 text that can decode to MaxHeaderBytes, padding included.
const maxHeaderText = (MaxHeaderBytes + 2) / 3 * 4

// DecodeErrorKind says what is wrong with a document that could not be decoded.
type DecodeErrorKind string

// Kinds of DecodeError.
const (
	DecodeNotBase64          DecodeErrorKind = "not-base64"
	DecodeNotJSON            DecodeErrorKind = "not-json"
	DecodeMissingField       DecodeErrorKind = "missing-field"
	DecodeWrongType          DecodeErrorKind = "wrong-type"
	DecodeUnsupportedVersion DecodeErrorKind = "unsupported-version"
	DecodeTooLarge           DecodeErrorKind = "too-large"
	// DecodeInvalidValue: well-typed but unacceptable, such as a duplicate key, both kinds of authorization
	// at once, or a maxTimeoutSeconds that is not positive.
	DecodeInvalidValue DecodeErrorKind = "invalid-value"
)

// DecodeError is a header or body that is not a well-formed protocol document. A gate answers it with 400
// (invalid-header), a facilitator with 400 and the error text.
type DecodeError struct {
	Doc    string          // what was being decoded, e.g. "payment header"
	Kind   DecodeErrorKind // what kind of problem
	Field  string          // JSON path of the offending field, e.g. "payload.authorization.value"; "" for the whole document
	Offset int             // byte offset of a not-base64 problem in the header text, or of a not-json problem in the JSON
	Detail string          // what was expected and what came
}

func (e *DecodeError) Error() string {
	var b strings.Builder
	b.WriteString("decode ")
	b.WriteString(e.Doc)
	b.WriteString(": ")
	b.WriteString(string(e.Kind))
	switch {
	case e.Field != "":
		b.WriteString(": ")
		b.WriteString(e.Field)
	case e.Kind == DecodeNotBase64 || e.Kind == DecodeNotJSON:
		b.WriteString(" at byte ")
		b.WriteString(strconv.Itoa(e.Offset))
	}
	if e.Detail != "" {
		b.WriteString(": ")
		b.WriteString(e.Detail)
	}
	return b.String()
}

// IsDecodeKind reports whether err is a DecodeError of the given kind.
func IsDecodeKind(err error, kind DecodeErrorKind) bool {
	var de *DecodeError
	return errors.As(err, &de) && de.Kind == kind
}

// Names of the documents, as DecodeError.Doc spells them.
const (
	docPaymentHeader     = "payment header"
	docPaymentRequired   = "payment-required header"
	docPaymentResponse   = "payment-response header"
	docVerifyRequest     = "verify request"
	docPaymentRequiredV1 = "version 1 payment-required body"
	docPayment           = "payment payload"
	docVerifyResponse    = "verify response"
	docSettleResponse    = "settle response"
	docPaymentVersioned  = "a payment" // how a version error names a payment header or payload
)

// EncodeHeader encodes v as a protocol header value: compact JSON (HTML characters not escaped) in standard
// Base64 with padding, the one form every peer accepts.
func EncodeHeader(v any) (string, error) {
	if h, ok, err := encodeAnswerHeader(v); ok { // header_answer.go: the answers a gate sends on every paid response
		return h, err
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return "", fmt.Errorf("encode header: %w", err)
	}
	doc := bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
	if len(doc) > MaxHeaderBytes {
		return "", headerTooLarge(len(doc))
	}
	return base64.StdEncoding.EncodeToString(doc), nil
}

func headerTooLarge(n int) error {
	return fmt.Errorf("encode header: %d bytes of JSON, more than the %d a peer accepts", n, MaxHeaderBytes)
}

// HeaderJSON returns the JSON document a header value carries, for callers that pass it on unchanged (a gate
// forwards the client's payment to a facilitator as it came). It accepts standard or URL-safe Base64, padded
// or not, surrounded by spaces or tabs, and refuses a value that would decode to more than MaxHeaderBytes.
func HeaderJSON(header string) ([]byte, error) {
	return decodeHeader(docPaymentHeader, header)
}

// decodeHeader undoes the Base64 of a header value, tolerating either alphabet and missing padding.
func decodeHeader(docName, header string) ([]byte, error) {
	fail := func(kind DecodeErrorKind, offset int, format string, args ...any) error {
		return &DecodeError{Doc: docName, Kind: kind, Offset: offset, Detail: fmt.Sprintf(format, args...)}
	}
	lead := len(header) - len(strings.TrimLeft(header, " \t"))
	text := strings.Trim(header, " \t")
	if text == "" {
		return nil, fail(DecodeNotBase64, 0, "the header is empty, expected Base64 of a JSON document")
	}
	if len(text) > maxHeaderText {
		return nil, fail(DecodeTooLarge, 0, "%d characters of Base64, more than the %d that %d bytes of JSON take", len(text), maxHeaderText, MaxHeaderBytes)
	}
	body := strings.TrimRight(text, "=")
	padding := len(text) - len(body)
	// encoding/base64 skips CR and LF; a header cannot carry them, so their presence means a mangled value.
	for _, c := range []byte{'\r', '\n'} { // two IndexByte scans are far cheaper than one IndexAny
		if i := strings.IndexByte(body, c); i >= 0 {
			return nil, fail(DecodeNotBase64, lead+i, "unexpected %s, expected Base64", describeByte(c))
		}
	}
	if padding > 2 || (padding > 0 && len(text)%4 != 0) {
		return nil, fail(DecodeNotBase64, lead+len(body), "wrong '=' padding for %d characters of Base64", len(body))
	}
	// Try the standard alphabet, then the URL-safe one; work out what is wrong only when both fail.
	buf := make([]byte, base64.RawStdEncoding.DecodedLen(len(body)))
	n, err := base64.RawStdEncoding.Decode(buf, []byte(body))
	if err != nil {
		n, err = base64.RawURLEncoding.Decode(buf, []byte(body))
	}
	if err != nil {
		return nil, diagnoseBase64(fail, lead, body)
	}
	if n > MaxHeaderBytes {
		return nil, fail(DecodeTooLarge, 0, "%d bytes of JSON, more than %d", n, MaxHeaderBytes)
	}
	return buf[:n], nil
}

// diagnoseBase64 explains why Base64 text decodes in neither alphabet.
func diagnoseBase64(fail func(DecodeErrorKind, int, string, ...any) error, lead int, body string) error {
	var std, url bool
	for i := 0; i < len(body); i++ {
		switch c := body[i]; {
		case c >= 'A' && c <= 'Z', c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '+' || c == '/':
			std = true
		case c == '-' || c == '_':
			url = true
		default:
			return fail(DecodeNotBase64, lead+i, "unexpected %s, expected Base64 (A-Z a-z 0-9 + / or - _, then '=' padding)", describeByte(c))
		}
	}
	if std && url {
		return fail(DecodeNotBase64, lead, "mixes the standard (+ /) and URL-safe (- _) Base64 alphabets")
	}
	return fail(DecodeNotBase64, lead+len(body), "%d characters of Base64 cannot be complete (a character is missing or extra)", len(body))
}

// finish names the document in the checker's error, if any.
func (c *checker) finish(docName string) error {
	if c.err == nil {
		return nil
	}
	c.err.Doc = docName
	return c.err
}

// checkBody refuses an oversized or empty body before reading it.
func checkBody(docName string, body []byte) error {
	switch {
	case len(body) > MaxBodyBytes:
		return &DecodeError{Doc: docName, Kind: DecodeTooLarge, Detail: fmt.Sprintf("%d bytes, more than %d", len(body), MaxBodyBytes)}
	case len(bytes.TrimSpace(body)) == 0:
		return &DecodeError{Doc: docName, Kind: DecodeNotJSON, Detail: "the body is empty, expected a JSON object"}
	}
	return nil
}

// readPayment reads a payment of the versions in want from a JSON document.
func readPayment(docName string, doc []byte, want versionSet) (paymentWire, error) {
	c := checker{doc: doc}
	var w paymentWire
	c.unmarshal(&w)
	if c.version(nil, w.X402Version, docPaymentVersioned, want) && c.decoded {
		hasAccepted, hasPayload := c.paymentParts(nil, &w)
		c.paymentRequires(nil, &w, hasAccepted, hasPayload)
	}
	return w, c.finish(docName)
}

func (w *paymentWire) v1() PaymentPayloadV1 {
	return PaymentPayloadV1{X402Version: w.X402Version, Scheme: w.Scheme, Network: w.Network, Payload: w.Payload}
}

// DecodePaymentPayload decodes a version 2 PAYMENT-SIGNATURE header value. Any problem is a *DecodeError that
// names the field and says what was expected: required fields (spec 2.2), exactly one of authorization and
// permit2Authorization with every member a string (an amount sent as a JSON number is wrong-type), no
// duplicate keys. Amount and address syntax is the verifier's to judge, so it can answer with a reason code.
func DecodePaymentPayload(header string) (PaymentPayload, error) {
	doc, err := decodeHeader(docPaymentHeader, header)
	if err != nil {
		return PaymentPayload{}, err
	}
	w, err := readPayment(docPaymentHeader, doc, onlyV2)
	if err != nil {
		return PaymentPayload{}, err
	}
	return w.PaymentPayload, nil
}

// DecodePaymentPayloadV1 decodes a version 1 X-PAYMENT header value.
func DecodePaymentPayloadV1(header string) (PaymentPayloadV1, error) {
	doc, err := decodeHeader(docPaymentHeader, header)
	if err != nil {
		return PaymentPayloadV1{}, err
	}
	w, err := readPayment(docPaymentHeader, doc, onlyV1)
	if err != nil {
		return PaymentPayloadV1{}, err
	}
	return w.v1(), nil
}

// AnyPaymentPayload is a payment header of either version: Version says which of V1 and V2 is set.
type AnyPaymentPayload struct {
	Version int
	V1      *PaymentPayloadV1
	V2      *PaymentPayload
}

// DecodePaymentHeader decodes a payment header of either version, for a gate that serves both; the version is
// read from the payment itself.
func DecodePaymentHeader(header string) (AnyPaymentPayload, error) {
	doc, err := decodeHeader(docPaymentHeader, header)
	if err != nil {
		return AnyPaymentPayload{}, err
	}
	w, err := readPayment(docPaymentHeader, doc, v1OrV2)
	if err != nil {
		return AnyPaymentPayload{}, err
	}
	if w.X402Version == Version1 {
		p := w.v1()
		return AnyPaymentPayload{Version: Version1, V1: &p}, nil
	}
	return AnyPaymentPayload{Version: Version2, V2: &w.PaymentPayload}, nil
}

// UnmarshalPaymentPayload decodes a version 2 payment given as JSON (the paymentPayload of a request, or the
// output of HeaderJSON) with the checks of DecodePaymentPayload.
func UnmarshalPaymentPayload(data []byte) (PaymentPayload, error) {
	if err := checkBody(docPayment, data); err != nil {
		return PaymentPayload{}, err
	}
	w, err := readPayment(docPayment, data, onlyV2)
	if err != nil {
		return PaymentPayload{}, err
	}
	return w.PaymentPayload, nil
}

// DecodeVerifyRequest decodes the body of POST /verify or POST /settle (version 2). Field paths in errors are
// those of the body, such as "paymentRequirements.amount" or "paymentPayload.payload.signature"; unknown fields
// are tolerated at every level.
func DecodeVerifyRequest(body []byte) (VerifyRequest, error) {
	if err := checkBody(docVerifyRequest, body); err != nil {
		return VerifyRequest{}, err
	}
	c := checker{doc: body}
	var req VerifyRequest
	c.unmarshal(&req)
	if c.version(nil, req.X402Version, "a request", onlyV2) {
		at := (*fieldPath)(nil).key("paymentPayload")
		w := paymentWire{PaymentPayload: req.PaymentPayload}
		hasPayment := c.present(nil, "paymentPayload", w.zero())
		if (!hasPayment || c.version(&at, w.X402Version, "the payment of a request", onlyV2)) && c.decoded {
			var hasAccepted, hasPayload bool
			if hasPayment {
				hasAccepted, hasPayload = c.paymentParts(&at, &w)
			}
			hasRequirements := c.present(nil, "paymentRequirements", req.PaymentRequirements == PaymentRequirements{})
			if hasRequirements {
				rq := (*fieldPath)(nil).key("paymentRequirements")
				c.requirements(&rq, &req.PaymentRequirements)
			}
			if !hasPayment {
				c.missing(nil, "paymentPayload")
			}
			if !hasRequirements {
				c.missing(nil, "paymentRequirements")
			}
			if hasPayment {
				c.paymentRequires(&at, &w, hasAccepted, hasPayload)
			}
			req.PaymentPayload = w.PaymentPayload
		}
	}
	if err := c.finish(docVerifyRequest); err != nil {
		return VerifyRequest{}, err
	}
	return req, nil
}

// DecodePaymentRequired decodes a version 2 PAYMENT-REQUIRED header value (spec 2.6).
func DecodePaymentRequired(header string) (PaymentRequired, error) {
	doc, err := decodeHeader(docPaymentRequired, header)
	if err != nil {
		return PaymentRequired{}, err
	}
	c := checker{doc: doc}
	var p PaymentRequired
	c.unmarshal(&p)
	if c.version(nil, p.X402Version, "a payment-required header", onlyV2) && c.decoded {
		hasResource := c.present(nil, "resource", p.Resource.isZero())
		if hasResource {
			at := (*fieldPath)(nil).key("resource")
			c.requireString(&at, "url", p.Resource.URL)
		}
		checkAccepts(&c, p.Accepts, (*checker).requirements)
		if !hasResource {
			c.missing(nil, "resource")
		}
		if p.Accepts == nil {
			c.missing(nil, "accepts")
		}
		p.Extensions = compactExtensions(p.Extensions)
	}
	if err := c.finish(docPaymentRequired); err != nil {
		return PaymentRequired{}, err
	}
	return p, nil
}

// DecodePaymentRequiredV1 decodes the JSON body of a version 1 402 answer.
func DecodePaymentRequiredV1(body []byte) (PaymentRequiredV1, error) {
	if err := checkBody(docPaymentRequiredV1, body); err != nil {
		return PaymentRequiredV1{}, err
	}
	c := checker{doc: body}
	var p PaymentRequiredV1
	c.unmarshal(&p)
	if c.version(nil, p.X402Version, "a version 1 402 body", onlyV1) && c.decoded {
		checkAccepts(&c, p.Accepts, (*checker).requirementsV1)
		if p.Accepts == nil {
			c.missing(nil, "accepts")
		}
	}
	if err := c.finish(docPaymentRequiredV1); err != nil {
		return PaymentRequiredV1{}, err
	}
	return p, nil
}

// DecodeSettleResponse decodes a PAYMENT-RESPONSE (or X-PAYMENT-RESPONSE) header value.
func DecodeSettleResponse(header string) (SettleResponse, error) {
	doc, err := decodeHeader(docPaymentResponse, header)
	if err != nil {
		return SettleResponse{}, err
	}
	return unmarshalSettleResponse(docPaymentResponse, doc)
}

// UnmarshalSettleResponse decodes the JSON body of a /settle answer; a body without a boolean success is not
// an answer (missing-field).
func UnmarshalSettleResponse(body []byte) (SettleResponse, error) {
	if err := checkBody(docSettleResponse, body); err != nil {
		return SettleResponse{}, err
	}
	return unmarshalSettleResponse(docSettleResponse, body)
}

// unmarshalSettleResponse reads a SettleResponse. Only success is required: a peer's answer with success and a
// reason is an answer, and the facts sheet's "transaction and network always present" is ours to keep, not to
// demand.
func unmarshalSettleResponse(docName string, doc []byte) (SettleResponse, error) {
	c := checker{doc: doc}
	var s SettleResponse
	if c.unmarshal(&s); c.decoded {
		c.require(nil, "success", !s.Success)
		s.Extensions = compactExtensions(s.Extensions)
	}
	if err := c.finish(docName); err != nil {
		return SettleResponse{}, err
	}
	return s, nil
}

// UnmarshalVerifyResponse decodes the JSON body of a /verify answer; a body without a boolean isValid is not an
// answer (missing-field).
func UnmarshalVerifyResponse(body []byte) (VerifyResponse, error) {
	if err := checkBody(docVerifyResponse, body); err != nil {
		return VerifyResponse{}, err
	}
	c := checker{doc: body}
	var v VerifyResponse
	if c.unmarshal(&v); c.decoded {
		c.require(nil, "isValid", !v.IsValid)
		v.Extensions = compactExtensions(v.Extensions)
	}
	if err := c.finish(docVerifyResponse); err != nil {
		return VerifyResponse{}, err
	}
	return v, nil
}
