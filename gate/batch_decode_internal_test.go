package gate

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// decodeBatchPayment decodes a batch-settlement payment once and says whose it is: the SDK's voucher is read by
// the batch decoder; one naming the scheme that the batch decoder refuses is the batch decoder's to refuse (its
// error, naming the field); a payment of another scheme, one that only mentions the scheme's name elsewhere, and
// a header that is not Base64 go to the standard decoder.
func TestDecodeBatchPaymentDecodesOnceAndSaysWhoseRefusalItIs(t *testing.T) {
	voucher := sdkVoucherJSON(t)
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

	p, ok, err := decodeBatchPayment(b64(voucher))
	if !ok || err != nil || p.Payload.Type != x402.BatchVoucher || p.Payload.Voucher == nil || p.Accepted.Scheme != x402.SchemeBatchSettlement {
		t.Fatalf("the SDK's voucher: ok %v, err %v, payload %+v", ok, err, p.Payload)
	}
	want, err := x402.DecodeBatchPayment(b64(voucher))
	if err != nil || want.Payload.Voucher.MaxClaimableAmount != p.Payload.Voucher.MaxClaimableAmount || want.Payload.Voucher.Signature != p.Payload.Voucher.Signature {
		t.Fatalf("decodeBatchPayment read %+v, x402.DecodeBatchPayment %+v (%v)", p.Payload.Voucher, want.Payload.Voucher, err)
	}

	// Base64 as every decoder of the gate reads it (URL-safe, unpadded too): the quick look read the standard
	// alphabet only, and sent such a voucher to the standard decoder, which refused it.
	if p, ok, err := decodeBatchPayment(base64.RawURLEncoding.EncodeToString([]byte(voucher))); !ok || err != nil || p.Payload.Voucher == nil {
		t.Fatalf("the SDK's voucher in URL-safe Base64 without padding: ok %v, err %v", ok, err)
	}

	broken := strings.Replace(voucher, `"type":"voucher"`, `"type":7`, 1)
	if broken == voucher {
		t.Fatal("the voucher document has no payload type to break")
	}
	_, ok, err = decodeBatchPayment(b64(broken))
	var de *x402.DecodeError
	if !ok || err == nil || !errors.As(err, &de) || !strings.Contains(de.Error(), "payload.type") {
		t.Fatalf("a batch payment whose payload.type is a number: ok %v, err %v; want the batch decoder's refusal naming payload.type", ok, err)
	}

	exact := strings.Replace(voucher, `"scheme":"batch-settlement"`, `"scheme":"exact"`, 1)
	if _, ok, _ := decodeBatchPayment(b64(exact)); ok {
		t.Error("a payment of scheme exact that mentions batch-settlement elsewhere was taken as a batch payment")
	}
	if _, ok, _ := decodeBatchPayment(b64(`{"x402Version":2,"accepted":{"scheme":"exact"}}`)); ok {
		t.Error("an exact payment was taken as a batch payment")
	}
	if _, ok, _ := decodeBatchPayment("not base64 batch-settlement!"); ok {
		t.Error("a header that is not Base64 was taken as a batch payment")
	}
}

// A voucher whose JSON writes the scheme's name with an escape is a batch payment all the same (x402's decoder
// reads it so), and goes to the batch decoder: the quick look for the name's bytes sent it to the standard
// decoder, which refused it 400 for a missing payload.authorization (the review of this stop).
func TestAVoucherNamingItsSchemeThroughAJSONEscapeIsStillABatchPayment(t *testing.T) {
	voucher := sdkVoucherJSON(t)
	escaped := strings.Replace(voucher, `"scheme":"batch-settlement"`, `"scheme":"batch\u002dsettlement"`, 1)
	if escaped == voucher {
		t.Fatal("the test voucher names no batch-settlement scheme to escape")
	}
	value := base64.StdEncoding.EncodeToString([]byte(escaped))
	if p, err := x402.DecodeBatchPayment(value); err != nil || p.Accepted.Scheme != x402.SchemeBatchSettlement {
		t.Fatalf("x402.DecodeBatchPayment: scheme %q, %v", p.Accepted.Scheme, err)
	}
	if p, ok, err := decodeBatchPayment(value); !ok || err != nil || p.Accepted.Scheme != x402.SchemeBatchSettlement {
		t.Fatalf("decodeBatchPayment of the escaped voucher = scheme %q, ok %v, %v; want the batch payment", p.Accepted.Scheme, ok, err)
	}
}

// sdkVoucherJSON is the SDK's voucher payment (x402/testdata) as compact JSON.
func sdkVoucherJSON(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("../x402/testdata/batch-payment-voucher.json")
	if err != nil {
		t.Fatal(err)
	}
	var doc bytes.Buffer
	if err := json.Compact(&doc, raw); err != nil {
		t.Fatal(err)
	}
	return doc.String()
}
