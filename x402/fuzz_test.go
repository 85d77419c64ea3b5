package x402

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"math/big"
	"reflect"
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
	for _, s := range []string{"$0.01", "0.01 USD", "0.01", "$1", "$0.0000001", "-0.01", "", "$", ".5", "1e3", "$12345678.123456", "0.01usd", "$0.000001000"} {
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
