package x402

import (
	"encoding/base64"
	"encoding/json"
	"testing"
)

// BenchmarkDecodePaymentPayload decodes a realistic permit2 PAYMENT-SIGNATURE header (the hot path of every
// paid request): Base64, strict JSON, required-field checks.
func BenchmarkDecodePaymentPayload(b *testing.B) {
	h := b64(readExample(b, "v2-payload-permit2.json"))
	b.SetBytes(int64(len(h)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodePaymentPayload(h); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodePaymentPayloadGasSponsoring adds the eip2612GasSponsoring extension (raw JSON kept).
func BenchmarkDecodePaymentPayloadGasSponsoring(b *testing.B) {
	h := b64(readExample(b, "v2-payload-permit2-gas-sponsoring.json"))
	b.SetBytes(int64(len(h)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodePaymentPayload(h); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodePaymentPayloadEncodingJSON is the baseline the strict reader replaces: Base64 and
// encoding/json, with no required-field checks at all.
func BenchmarkDecodePaymentPayloadEncodingJSON(b *testing.B) {
	h := b64(readExample(b, "v2-payload-permit2.json"))
	b.SetBytes(int64(len(h)))
	b.ReportAllocs()
	for b.Loop() {
		raw, err := base64.StdEncoding.DecodeString(h)
		if err != nil {
			b.Fatal(err)
		}
		var p PaymentPayload
		if err := json.Unmarshal(raw, &p); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeVerifyRequest decodes a /verify body carrying a permit2 payment with gas sponsoring.
func BenchmarkDecodeVerifyRequest(b *testing.B) {
	body := readExample(b, "verify-request-permit2.json")
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeVerifyRequest(body); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseUint256Nonce parses a 77-digit Permit2 nonce (the big.Int path).
func BenchmarkParseUint256Nonce(b *testing.B) {
	const nonce = "35042881646379787321924979519395511350089164335240271609287806624810748378378"
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseUint256(nonce); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkParseAmount parses a typical amount (the uint64 fast path).
func BenchmarkParseAmount(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseAmount("10000"); err != nil {
			b.Fatal(err)
		}
	}
}
