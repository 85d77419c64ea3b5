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

// BenchmarkDecodeBatchVoucherPayment decodes a batch-settlement voucher's PAYMENT-SIGNATURE header as the gate
// does on every voucher-paid request: Base64 once, then the strict reader.
func BenchmarkDecodeBatchVoucherPayment(b *testing.B) {
	h := b64(readExample(b, "batch-payment-voucher.json"))
	b.SetBytes(int64(len(h)))
	b.ReportAllocs()
	for b.Loop() {
		doc, err := HeaderJSON(h)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ReadBatchPaymentHeader(doc); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecodeBatchSettleResponse decodes a voucher's PAYMENT-RESPONSE as the paying client does on every
// voucher-paid answer.
func BenchmarkDecodeBatchSettleResponse(b *testing.B) {
	h := b64(readExample(b, "batch-settle-response-voucher.json"))
	b.SetBytes(int64(len(h)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := DecodeBatchSettleResponse(h); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEncodeBatchSettleResponse encodes a voucher's answer as the gate sends it in PAYMENT-RESPONSE, through
// EncodeHeader (appendAnswer) and, for comparison, through encoding/json as before.
func BenchmarkEncodeBatchSettleResponse(b *testing.B) {
	r := BatchSettleResponse{Success: true, Network: "eip155:72344", Payer: "0x850ec0D9fF24AeFeE83Dec34973B271e755B93B9", Amount: "10000",
		Extra: &BatchResponseExtra{ChargedAmount: "10000", ChannelState: &BatchChannelState{
			ChannelID: "0x142087470a42cb562b2e60aa47c338a197a9dab20a22b3b1bf298fa885bea444", Balance: "50000", TotalClaimed: "0",
			RefundNonce: "0", ChargedCumulativeAmount: "50000"}}}
	b.Run("EncodeHeader", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := EncodeHeader(r); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			doc, err := json.Marshal(r)
			if err != nil {
				b.Fatal(err)
			}
			_ = base64.StdEncoding.EncodeToString(doc)
		}
	})
}
