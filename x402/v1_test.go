package x402

import (
	"reflect"
	"strings"
	"testing"
)

func TestVersion1RequirementsConvertToVersion2AndBack(t *testing.T) {
	r := NewRegistry()
	v1body, err := DecodePaymentRequiredV1(readExample(t, "v1-payment-required.json"))
	if err != nil {
		t.Fatal(err)
	}
	v2, err := r.PaymentRequiredFromV1(v1body)
	if err != nil {
		t.Fatal(err)
	}
	req := v2.Accepts[0]
	if v2.X402Version != Version2 || req.Network != NetworkTestnet || req.Amount != "10000" || req.Extra.Spender == "" ||
		v2.Resource.URL != v1body.Accepts[0].Resource || v2.Resource.MimeType != "application/json" || v2.Error != v1body.Error {
		t.Fatalf("version 2 form = %+v", v2)
	}
	back, err := r.PaymentRequiredToV1(v2)
	if err != nil {
		t.Fatal(err)
	}
	want := v1body
	want.Accepts = append([]PaymentRequirementsV1(nil), v1body.Accepts...)
	want.Accepts[0].OutputSchema = nil // version 2 has no place for it
	if !reflect.DeepEqual(back, want) {
		t.Errorf("back to version 1:\n got  %+v\n want %+v", back, want)
	}
}

func TestVersion1PaymentsConvertWithTheRequirementTheyPay(t *testing.T) {
	r := NewRegistry()
	h, err := EncodeHeader(mustPayloadV1(t))
	if err != nil {
		t.Fatal(err)
	}
	v1, err := DecodePaymentPayloadV1(h)
	if err != nil {
		t.Fatal(err)
	}
	req := PaymentRequirements{Scheme: SchemeExact, Network: NetworkTestnet, Amount: "10000", Asset: "0xa", PayTo: "0xb", MaxTimeoutSeconds: 60}
	v2, err := r.PaymentPayloadFromV1(v1, req)
	if err != nil {
		t.Fatal(err)
	}
	if v2.X402Version != Version2 || v2.Accepted != req || !reflect.DeepEqual(v2.Payload, v1.Payload) {
		t.Errorf("version 2 payment = %+v", v2)
	}
	back, err := r.PaymentPayloadToV1(v2)
	if err != nil || !reflect.DeepEqual(back, v1) {
		t.Errorf("back to version 1 = %+v, %v; want %+v", back, err, v1)
	}
	req.Network = NetworkMainnet
	if _, err := r.PaymentPayloadFromV1(v1, req); err == nil || !strings.Contains(err.Error(), "eip155:723487") {
		t.Errorf("a payment for testnet matched a mainnet requirement: %v", err)
	}
}

func mustPayloadV1(t *testing.T) PaymentPayloadV1 {
	t.Helper()
	p, err := DecodePaymentPayloadV1(b64(readExample(t, "v1-payload.json")))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConversionsFailForNetworksWithoutAVersion1Name(t *testing.T) {
	r := NewRegistry()
	if err := r.Add(Network{CAIP2: "eip155:5"}); err != nil {
		t.Fatal(err)
	}
	req := PaymentRequirements{Scheme: SchemeExact, Network: "eip155:5", Amount: "1"}
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"unnamed network", second(r.RequirementsToV1(req, ResourceInfo{})), "no version 1 name"},
		{"unknown network", second(r.RequirementsToV1(PaymentRequirements{Network: "eip155:6"}, ResourceInfo{})), "not registered"},
		{"unknown v1 name", third(r.RequirementsFromV1(PaymentRequirementsV1{Network: "base-sepolia"})), "base-sepolia"},
		{"payment on unnamed network", second(r.PaymentPayloadToV1(PaymentPayload{Accepted: req})), "no version 1 name"},
		{"payment with unknown name", second(r.PaymentPayloadFromV1(PaymentPayloadV1{Network: "base"}, req)), "\"base\""},
		{"402 with unknown name", second(r.PaymentRequiredFromV1(PaymentRequiredV1{Accepts: []PaymentRequirementsV1{{Network: "base"}}})), "accepts[0]"},
		{"402 on unnamed network", second(r.PaymentRequiredToV1(PaymentRequired{Accepts: []PaymentRequirements{req}})), "accepts[0]"},
		{"402 with two resources", second(r.PaymentRequiredFromV1(PaymentRequiredV1{Accepts: []PaymentRequirementsV1{
			{Network: V1NameTestnet, Resource: "https://a"}, {Network: V1NameTestnet, Resource: "https://b"}}})), "one resource per answer"},
	}
	for _, tt := range tests {
		if tt.err == nil || !strings.Contains(tt.err.Error(), tt.want) {
			t.Errorf("%s: error = %v, want it to mention %q", tt.name, tt.err, tt.want)
		}
	}
}

func second[A any](_ A, err error) error        { return err }
func third[A, B any](_ A, _ B, err error) error { return err }
