package x402

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// reencode encodes v without HTML escaping, as EncodeHeader does, so raw extension values keep their bytes.
func reencode(t *testing.T, v any) []byte {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatalf("re-encoding a decoded value failed: %v", err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

// checkDecodeErr fails unless err is a *DecodeError of a known kind with a message.
func checkDecodeErr(t *testing.T, err error) {
	var de *DecodeError
	if !errors.As(err, &de) {
		t.Fatalf("error %v (%T) is not a *DecodeError", err, err)
	}
	switch de.Kind {
	case DecodeNotBase64, DecodeNotJSON, DecodeMissingField, DecodeWrongType, DecodeUnsupportedVersion, DecodeTooLarge, DecodeInvalidValue:
	default:
		t.Fatalf("unknown kind %q in %v", de.Kind, err)
	}
	if de.Detail == "" {
		t.Fatalf("error without detail: %v", err)
	}
}

func addExampleSeeds(f *testing.F, names ...string) {
	for _, name := range names {
		doc := readExample(f, name)
		f.Add(base64.StdEncoding.EncodeToString(doc))
		f.Add(base64.RawURLEncoding.EncodeToString(doc))
		f.Add(string(doc))
	}
}

func FuzzDecodePaymentPayload(f *testing.F) {
	addExampleSeeds(f, "v2-payload-permit2.json", "v2-payload-erc2612.json", "v2-payload-permit2-gas-sponsoring.json", "v1-payload.json")
	for _, s := range []string{"", "=", "e30=", "W10=", "bnVsbA==", "eyJ4NDAyVmVyc2lvbiI6Mn0", "eyJ4NDAyVmVyc2lvbiI6MS4wfQ=="} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, header string) {
		// The input is tried as a header and, so that mutations reach the JSON reader directly, as JSON.
		if p, err := UnmarshalPaymentPayload([]byte(header)); err != nil {
			checkDecodeErr(t, err)
		} else {
			checkDecodedPayment(t, []byte(header), p)
		}
		p, err := DecodePaymentPayload(header)
		if err != nil {
			checkDecodeErr(t, err)
			return
		}
		raw, err := HeaderJSON(header)
		if err != nil {
			t.Fatalf("HeaderJSON refuses a header DecodePaymentPayload accepts: %v", err)
		}
		checkDecodedPayment(t, raw, p)
	})
}

// checkDecodedPayment checks an accepted payment: valid JSON, exactly one authorization, a stable re-encoding,
// and the same reading as encoding/json.
func checkDecodedPayment(t *testing.T, raw []byte, p PaymentPayload) {
	if !json.Valid(raw) {
		t.Fatalf("accepted a payment whose JSON is not valid: %q", raw)
	}
	if (p.Payload.Authorization == nil) == (p.Payload.Permit2Authorization == nil) || p.X402Version != Version2 {
		t.Fatalf("accepted a payment without exactly one authorization: %+v", p)
	}
	again, err := DecodePaymentPayload(base64.StdEncoding.EncodeToString(reencode(t, p)))
	if err != nil {
		t.Fatalf("re-encoded payment does not decode: %v", err)
	}
	if !reflect.DeepEqual(again, p) {
		t.Fatalf("decode(encode(p)) != p:\n%+v\n%+v", again, p)
	}
	// The strict reader agrees with encoding/json on everything it accepts.
	var std PaymentPayload
	if err := json.Unmarshal(raw, &std); err == nil && !hasCaseFoldedKeys(raw) {
		if g, w := reencode(t, p), reencode(t, std); !bytes.Equal(g, w) {
			t.Fatalf("encoding/json reads differently:\n strict %s\n std    %s", g, w)
		}
	}
}

// wireKeys are the JSON names of the wire types' fields.
var wireKeys = strings.Fields(`x402Version resource accepted scheme network payload extensions url description mimeType
	amount asset payTo maxTimeoutSeconds extra assetTransferMethod name version spender permit2Address
	x402Permit2ProxyAddress signature authorization permit2Authorization from to value validAfter validBefore
	nonce permitted token deadline witness paymentPayload paymentRequirements`)

// hasCaseFoldedKeys reports whether a document has a key that differs from a wire name only in case, where
// encoding/json (case-insensitive) deliberately reads differently from the strict reader.
func hasCaseFoldedKeys(raw []byte) bool {
	var generic any
	if json.Unmarshal(raw, &generic) != nil {
		return true
	}
	var walk func(v any) bool
	walk = func(v any) bool {
		switch v := v.(type) {
		case map[string]any:
			for k, child := range v {
				for _, w := range wireKeys {
					if k != w && strings.EqualFold(k, w) {
						return true
					}
				}
				if walk(child) {
					return true
				}
			}
		case []any:
			for _, child := range v {
				if walk(child) {
					return true
				}
			}
		}
		return false
	}
	return walk(generic)
}

func FuzzDecodeVerifyRequest(f *testing.F) {
	for _, name := range []string{"verify-request-permit2.json", "verify-request-erc2612.json"} {
		f.Add(readExample(f, name))
	}
	for _, s := range []string{"", "{}", "[]", "null", `{"x402Version":2}`, `{"x402Version":2,"paymentPayload":{},"paymentRequirements":{}}`,
		`{"x402Version":2,"paymentPayload":{"x402Version":2,"accepted":{"extra":{}},"payload":{"authorization":{}}}}`, `{"a":"\ud800\udc00\u00e9\\"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := DecodeVerifyRequest(body)
		if err != nil {
			checkDecodeErr(t, err)
			return
		}
		if !json.Valid(body) {
			t.Fatalf("accepted a body that is not valid JSON")
		}
		if req.X402Version != Version2 || req.PaymentPayload.X402Version != Version2 || req.PaymentRequirements.Amount == "" ||
			req.PaymentRequirements.MaxTimeoutSeconds <= 0 || req.PaymentPayload.Payload.Signature == "" {
			t.Fatalf("accepted a request missing what is required: %+v", req)
		}
		again, err := DecodeVerifyRequest(reencode(t, req))
		if err != nil {
			t.Fatalf("re-encoded request does not decode: %v", err)
		}
		if !reflect.DeepEqual(again, req) {
			t.Fatalf("decode(encode(r)) != r:\n%+v\n%+v", again, req)
		}
	})
}

func FuzzParseAmount(f *testing.F) {
	for _, s := range []string{"0", "1", "10000", "007", "-1", "+1", "1e6", " 1", "18446744073709551616", maxUint256Dec,
		"115792089237316195423570985008687907853269984665640564039457584007913129639936", "0x10", "１"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseAmount(s)
		m, err2 := ParseUint256(s)
		if (err == nil) != (err2 == nil) {
			t.Fatalf("ParseAmount and ParseUint256 disagree on %q: %v / %v", s, err, err2)
		}
		if err != nil {
			if n != nil || !(errors.Is(err, ErrNumberSyntax) || errors.Is(err, ErrNumberRange)) {
				t.Fatalf("ParseAmount(%q) = %v, %v", s, n, err)
			}
			return
		}
		if n.String() != s || m.Cmp(n) != 0 {
			t.Fatalf("ParseAmount(%q) = %v: accepted text is not the canonical spelling", s, n)
		}
		if n.Sign() < 0 || n.Cmp(MaxUint256()) > 0 {
			t.Fatalf("ParseAmount(%q) = %v outside [0, 2^256-1]", s, n)
		}
		if ref, ok := new(big.Int).SetString(s, 10); !ok || ref.Cmp(n) != 0 {
			t.Fatalf("ParseAmount(%q) = %v, math/big says %v", s, n, ref)
		}
	})
}

func FuzzParsePrice(f *testing.F) {
	for _, s := range []string{"$0.01", "0.01 USD", "0.01", "10000", "$1", "$0.0000001", "-0.01", "", "$", ".5", "1e3", "$12345678.123456", "0.01usd", "$0.000001000"} {
		f.Add(s, uint8(6))
	}
	f.Add("$0.5", uint8(0))
	f.Add("$1.000000000000000001", uint8(18))
	f.Fuzz(func(t *testing.T, s string, decimals uint8) {
		n, err := ParsePrice(s, decimals)
		if err != nil {
			if n != nil {
				t.Fatalf("ParsePrice(%q) returned a value with an error", s)
			}
			return
		}
		if n.Sign() < 0 || n.BitLen() > 256 {
			t.Fatalf("ParsePrice(%q, %d) = %v outside [0, 2^256-1]", s, decimals, n)
		}
		// Exactness: the raw units, written back as a decimal with the token's precision, equal the number given.
		num, _ := priceNumber(s)
		want, ok := new(big.Rat).SetString(num)
		if !ok {
			t.Fatalf("ParsePrice accepted %q that math/big cannot read", s)
		}
		got := new(big.Rat).SetFrac(n, new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(decimals)), nil))
		if got.Cmp(want) != 0 {
			t.Fatalf("ParsePrice(%q, %d) = %v units = %s, want %s", s, decimals, n, got.FloatString(int(decimals)), want.FloatString(int(decimals)))
		}
		if strings.ContainsAny(num, "eE+-_, ") {
			t.Fatalf("ParsePrice accepted %q", s)
		}
		if trimmed := strings.TrimSpace(s); !strings.HasPrefix(trimmed, "$") && !strings.HasSuffix(strings.ToUpper(trimmed), "USD") {
			t.Fatalf("ParsePrice accepted %q, a price that names no currency", s)
		}
	})
}

func FuzzDecodeFacilitatorRequest(f *testing.F) {
	for _, name := range []string{"verify-request-permit2.json", "verify-request-erc2612.json"} {
		f.Add(readExample(f, name))
	}
	var offered struct {
		Accepts []json.RawMessage `json:"accepts"`
	}
	if err := json.Unmarshal(readExample(f, "v1-payment-required.json"), &offered); err != nil || len(offered.Accepts) == 0 {
		f.Fatalf("v1-payment-required.json: %v", err)
	}
	v1 := `{"x402Version":1,"paymentPayload":` + string(readExample(f, "v1-payload.json")) + `,"paymentRequirements":` + string(offered.Accepts[0]) + `}`
	for _, s := range []string{v1, "", "{}", `{"x402Version":1}`, `{"x402Version":1,"paymentPayload":null,"paymentRequirements":{}}`,
		`{"x402Version":1,"paymentPayload":{"x402Version":1},"paymentRequirements":[]}`} {
		f.Add([]byte(s))
	}
	reg := NewRegistry()
	if _, isV1, err := reg.DecodeFacilitatorRequest([]byte(v1)); err != nil || !isV1 {
		f.Fatalf("the version 1 seed does not decode as version 1: %v", err)
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, isV1, err := reg.DecodeFacilitatorRequest(body)
		if err != nil {
			checkDecodeErr(t, err)
			return
		}
		if !json.Valid(body) {
			t.Fatalf("accepted a body that is not valid JSON")
		}
		if isV1 != (req.X402Version == Version1) || req.PaymentPayload.X402Version != req.X402Version {
			t.Fatalf("v1 = %v for a request of x402Version %d (payload %d)", isV1, req.X402Version, req.PaymentPayload.X402Version)
		}
		if isV1 && !strings.HasPrefix(req.PaymentRequirements.Network, "eip155:") {
			t.Fatalf("a version 1 request came back with network %q, want a CAIP-2 id", req.PaymentRequirements.Network)
		}
	})
}

// checkDecodeErrOf checks a refusal as checkDecodeErr does, and that it names the document decoded and stays
// within a fixed size beyond the input (a refusal quotes at most a bounded piece of what came).
func checkDecodeErrOf(t *testing.T, err error, doc string, inputLen int) {
	t.Helper()
	checkDecodeErr(t, err)
	var de *DecodeError
	errors.As(err, &de)
	if de.Doc != doc || !strings.Contains(err.Error(), doc) {
		t.Fatalf("error %q names document %q, want %q", err, de.Doc, doc)
	}
	if n := len(err.Error()); n > inputLen+512 {
		t.Fatalf("a refusal of %d bytes of input is %d bytes long", inputLen, n)
	}
}

// checkHeaderLimit fails unless a header value longer than the Base64 of MaxHeaderBytes was refused as too large,
// before it was decoded.
func checkHeaderLimit(t *testing.T, header string, err error) {
	t.Helper()
	if len(strings.Trim(header, " \t")) > maxHeaderText && !IsDecodeKind(err, DecodeTooLarge) {
		t.Fatalf("a header of %d characters was not refused as too large: %v", len(header), err)
	}
}

// checkBodyLimit fails unless a body larger than MaxBodyBytes was refused as too large.
func checkBodyLimit(t *testing.T, body []byte, err error) {
	t.Helper()
	if len(body) > MaxBodyBytes && !IsDecodeKind(err, DecodeTooLarge) {
		t.Fatalf("a body of %d bytes was not refused as too large: %v", len(body), err)
	}
}

// headerForms are the header values a fuzz input is tried as: itself, and its Base64, so that mutations of a
// JSON seed reach the JSON reader rather than the Base64 decoder.
func headerForms(s string) []string {
	return []string{s, base64.StdEncoding.EncodeToString([]byte(s))}
}

// checkRequirements fails unless an accepted version 2 requirement has every field the spec requires.
func checkRequirements(t *testing.T, where string, rq PaymentRequirements) {
	t.Helper()
	if rq.Scheme == "" || rq.Network == "" || rq.Amount == "" || rq.Asset == "" || rq.PayTo == "" || rq.MaxTimeoutSeconds <= 0 {
		t.Fatalf("%s: accepted a requirement missing what is required: %+v", where, rq)
	}
}

// topLevelBool reads a top-level member of a JSON object with encoding/json, as a boolean.
func topLevelBool(t *testing.T, doc []byte, key string) (value, ok bool) {
	t.Helper()
	var top map[string]json.RawMessage
	if err := json.Unmarshal(doc, &top); err != nil {
		t.Fatalf("encoding/json cannot read a document the strict reader accepted: %v", err)
	}
	switch string(top[key]) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// A payment header of either version decodes as the decoder of its own version decodes it, and is refused by
// the other one as of the wrong version; what one refuses all three refuse. Accepted payments are complete and
// survive encoding again.
func FuzzDecodePaymentHeader(f *testing.F) {
	addExampleSeeds(f, "v1-payload.json", "v2-payload-permit2.json", "v2-payload-erc2612.json")
	for _, s := range []string{"", " \t", "e30=", `{"x402Version":1}`, `{"x402Version":1,"scheme":"exact","network":"testnet","payload":{}}`,
		`{"x402Version":1,"scheme":"exact","network":"testnet","payload":{"signature":"0x00","authorization":null}}`,
		`{"x402Version":2,"scheme":"exact","network":"testnet","payload":{"signature":"0x00","authorization":{}}}`,
		`{"x402Version":3}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, header := range headerForms(s) {
			checkPaymentHeader(t, header)
		}
	})
}

func checkPaymentHeader(t *testing.T, header string) {
	t.Helper()
	any, err := DecodePaymentHeader(header)
	v1, err1 := DecodePaymentPayloadV1(header)
	v2, err2 := DecodePaymentPayload(header)
	checkHeaderLimit(t, header, err)
	if err != nil {
		checkDecodeErrOf(t, err, docPaymentHeader, len(header))
		if err1 == nil || err2 == nil {
			t.Fatalf("DecodePaymentHeader refuses (%v) what a one-version decoder accepts (v1: %v, v2: %v)", err, err1, err2)
		}
		return
	}
	switch any.Version {
	case Version1:
		if any.V1 == nil || any.V2 != nil {
			t.Fatalf("version 1 payment with V1 %v, V2 %v", any.V1, any.V2)
		}
		if err1 != nil || !reflect.DeepEqual(v1, *any.V1) {
			t.Fatalf("DecodePaymentPayloadV1 reads the payment differently: %+v, %v; want %+v", v1, err1, *any.V1)
		}
		if !IsDecodeKind(err2, DecodeUnsupportedVersion) {
			t.Fatalf("DecodePaymentPayload on a version 1 payment: %v, want unsupported-version", err2)
		}
		p := v1.Payload
		if v1.X402Version != Version1 || v1.Scheme == "" || v1.Network == "" || p.Signature == "" || (p.Authorization == nil) == (p.Permit2Authorization == nil) {
			t.Fatalf("accepted a version 1 payment missing what is required: %+v", v1)
		}
		h, err := EncodeHeader(v1)
		if err != nil {
			t.Fatalf("encoding an accepted payment: %v", err)
		}
		again, err := DecodePaymentPayloadV1(h)
		if err != nil || !reflect.DeepEqual(again, v1) {
			t.Fatalf("decode(encode(p)) = %+v, %v; want %+v", again, err, v1)
		}
	case Version2:
		if any.V2 == nil || any.V1 != nil {
			t.Fatalf("version 2 payment with V1 %v, V2 %v", any.V1, any.V2)
		}
		if err2 != nil || !reflect.DeepEqual(v2, *any.V2) {
			t.Fatalf("DecodePaymentPayload reads the payment differently: %+v, %v; want %+v", v2, err2, *any.V2)
		}
		if !IsDecodeKind(err1, DecodeUnsupportedVersion) {
			t.Fatalf("DecodePaymentPayloadV1 on a version 2 payment: %v, want unsupported-version", err1)
		}
		raw, err := HeaderJSON(header)
		if err != nil {
			t.Fatalf("HeaderJSON refuses a header DecodePaymentHeader accepts: %v", err)
		}
		checkDecodedPayment(t, raw, v2)
	default:
		t.Fatalf("accepted a payment of version %d", any.Version)
	}
}

// A PAYMENT-REQUIRED header is accepted only with a resource url and complete requirements, and decodes again
// from its own encoding to the same value.
func FuzzDecodePaymentRequired(f *testing.F) {
	addExampleSeeds(f, "v2-payment-required.json")
	for _, s := range []string{"", `{"x402Version":2,"resource":{"url":"u"},"accepts":[]}`, `{"x402Version":2,"resource":{"url":"u"},"accepts":null}`,
		`{"x402Version":2,"resource":{"url":"u"},"accepts":[{}]}`, `{"x402Version":2,"resource":{"url":"u"},"accepts":[null]}`, `{"x402Version":2,"resource":{},"accepts":[],"extensions":{"a":1,"a":2}}`,
		`{"x402Version":1,"accepts":[]}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, header := range headerForms(s) {
			p, err := DecodePaymentRequired(header)
			checkHeaderLimit(t, header, err)
			if err != nil {
				checkDecodeErrOf(t, err, docPaymentRequired, len(header))
				continue
			}
			if p.X402Version != Version2 || p.Resource.URL == "" || p.Accepts == nil {
				t.Fatalf("accepted a payment-required header missing what is required: %+v", p)
			}
			for i, rq := range p.Accepts {
				checkRequirements(t, fmt.Sprintf("accepts[%d]", i), rq)
			}
			h, err := EncodeHeader(p)
			if err != nil {
				t.Fatalf("encoding an accepted document: %v", err)
			}
			again, err := DecodePaymentRequired(h)
			if err != nil || !reflect.DeepEqual(again, p) {
				t.Fatalf("decode(encode(p)) = %+v, %v; want %+v", again, err, p)
			}
		}
	})
}

// A version 1 402 body is accepted only with complete requirements, and decodes again from its own encoding to
// the same value.
func FuzzDecodePaymentRequiredV1(f *testing.F) {
	f.Add(readExample(f, "v1-payment-required.json"))
	for _, s := range []string{"", "{}", `{"x402Version":1,"accepts":[]}`, `{"x402Version":1,"accepts":[{}]}`, `{"x402Version":1,"accepts":[null]}`,
		`{"x402Version":2,"accepts":[]}`, `{"x402Version":1,"accepts":[{"outputSchema":{ "a" : [1, 2] },"extra":null}]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		p, err := DecodePaymentRequiredV1(body)
		checkBodyLimit(t, body, err)
		if err != nil {
			checkDecodeErrOf(t, err, docPaymentRequiredV1, len(body))
			return
		}
		if p.X402Version != Version1 || p.Accepts == nil {
			t.Fatalf("accepted a version 1 402 body missing what is required: %+v", p)
		}
		for i, rq := range p.Accepts {
			if rq.Scheme == "" || rq.Network == "" || rq.MaxAmountRequired == "" || rq.Resource == "" || rq.PayTo == "" ||
				rq.Asset == "" || rq.MaxTimeoutSeconds <= 0 {
				t.Fatalf("accepts[%d]: accepted a requirement missing what is required: %+v", i, rq)
			}
		}
		again, err := DecodePaymentRequiredV1(reencode(t, p))
		if err != nil || !reflect.DeepEqual(again, p) {
			t.Fatalf("decode(encode(p)) = %+v, %v; want %+v", again, err, p)
		}
	})
}

// A settlement answer reads the same as a /settle body and as a PAYMENT-RESPONSE header, is accepted only with a
// boolean success, and decodes again from its own encoding to the same value.
func FuzzDecodeSettleResponse(f *testing.F) {
	for _, name := range []string{"settle-response-success.json", "settle-response-failure.json", "settle-response-pending.json"} {
		f.Add(readExample(f, name))
	}
	for _, s := range []string{"", "{}", `{"success":null}`, `{"success":"true"}`, `{"success":true,"success":false}`,
		`{"success":false,"extensions":{}}`, `{"success":true,"extensions":{"x":{ "y" : [ 1 ] }}}`, `{"success":true} x`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		s, err := UnmarshalSettleResponse(body)
		checkBodyLimit(t, body, err)
		if len(body) <= MaxHeaderBytes {
			h, herr := DecodeSettleResponse(base64.StdEncoding.EncodeToString(body))
			if (herr == nil) != (err == nil) || !reflect.DeepEqual(h, s) {
				t.Fatalf("as a header: %+v, %v; as a body: %+v, %v", h, herr, s, err)
			}
			if herr != nil {
				checkDecodeErrOf(t, herr, docPaymentResponse, len(body)*4/3+4)
			}
		}
		if h, herr := DecodeSettleResponse(string(body)); herr != nil {
			checkDecodeErrOf(t, herr, docPaymentResponse, len(body))
		} else if again, err := UnmarshalSettleResponse(reencode(t, h)); err != nil || !reflect.DeepEqual(again, h) {
			t.Fatalf("decode(encode(r)) = %+v, %v; want %+v", again, err, h)
		}
		if err != nil {
			checkDecodeErrOf(t, err, docSettleResponse, len(body))
			return
		}
		if success, ok := topLevelBool(t, body, "success"); !ok || success != s.Success {
			t.Fatalf("accepted a settlement answer whose success is not the boolean %v", s.Success)
		}
		again, err := UnmarshalSettleResponse(reencode(t, s))
		if err != nil || !reflect.DeepEqual(again, s) {
			t.Fatalf("decode(encode(r)) = %+v, %v; want %+v", again, err, s)
		}
	})
}

// A /verify answer is accepted only with a boolean isValid, and decodes again from its own encoding to the same
// value.
func FuzzUnmarshalVerifyResponse(f *testing.F) {
	for _, name := range []string{"verify-response-valid.json", "verify-response-invalid.json"} {
		f.Add(readExample(f, name))
	}
	for _, s := range []string{"", "{}", `{"isValid":null}`, `{"isValid":1}`, `{"isValid":true,"isValid":true}`,
		`{"isValid":false,"invalidReason":"insufficient_funds","extensions":{"a":{}}}`, `{"isValid":true}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		v, err := UnmarshalVerifyResponse(body)
		checkBodyLimit(t, body, err)
		if err != nil {
			checkDecodeErrOf(t, err, docVerifyResponse, len(body))
			return
		}
		if valid, ok := topLevelBool(t, body, "isValid"); !ok || valid != v.IsValid {
			t.Fatalf("accepted a verify answer whose isValid is not the boolean %v", v.IsValid)
		}
		again, err := UnmarshalVerifyResponse(reencode(t, v))
		if err != nil || !reflect.DeepEqual(again, v) {
			t.Fatalf("decode(encode(r)) = %+v, %v; want %+v", again, err, v)
		}
	})
}

// maxCAIP2Error bounds a network error: it quotes at most 100 bytes of the input, each at most 4 characters
// once escaped (\x9b), and says what was expected.
const maxCAIP2Error = 600

// caip2Grammar is the CAIP-2 grammar, written independently of ParseCAIP2.
var caip2Grammar = regexp.MustCompile(`^[-a-z0-9]{3,8}:[-_a-zA-Z0-9]{1,32}$`)

// ParseCAIP2 accepts exactly the CAIP-2 grammar and splits without losing a byte; ChainID accepts exactly one
// spelling of each chain id, the one EIP155 writes.
func FuzzParseCAIP2(f *testing.F) {
	for _, s := range []string{NetworkMainnet, NetworkTestnet, "eip155:1", "eip155:01", "eip155:0", "eip155:18446744073709551616", "cosmos:cosmoshub-4",
		"EIP155:1", "ei:1", "eip155:", ":1", "eip155:1:2", "eip155:" + strings.Repeat("9", 33), "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp",
		"eip155:" + strings.Repeat("\x9b", 120)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ns, ref, err := ParseCAIP2(s)
		if (err == nil) != caip2Grammar.MatchString(s) {
			t.Fatalf("ParseCAIP2(%q) = %v; the grammar says %v", s, err, caip2Grammar.MatchString(s))
		}
		if err != nil {
			if !errors.Is(err, ErrCAIP2) || len(err.Error()) > maxCAIP2Error {
				t.Fatalf("ParseCAIP2(%q) error %q: want ErrCAIP2, at most %d bytes", s, err, maxCAIP2Error)
			}
		} else if ns+":"+ref != s {
			t.Fatalf("ParseCAIP2(%q) = %q, %q", s, ns, ref)
		}
		id, err := ChainID(s)
		if err != nil {
			if !errors.Is(err, ErrCAIP2) || len(err.Error()) > maxCAIP2Error {
				t.Fatalf("ChainID(%q) error %q: want ErrCAIP2, at most %d bytes", s, err, maxCAIP2Error)
			}
			return
		}
		if id == 0 || EIP155(id) != s {
			t.Fatalf("ChainID(%q) = %d, which is written %q", s, id, EIP155(id))
		}
	})
}
