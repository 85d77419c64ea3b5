package payer

import (
	"encoding/json"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A plain voucher's payment made from its channel's template is, byte for byte, the payment encoded whole; a
// template is refused where it could not be (a resource holding a marker) and keyed by the requirement and the
// resource it was made of.
func TestVoucherTemplateEncodesThePaymentAsEncodeHeaderDoes(t *testing.T) {
	accepted := json.RawMessage(`{"scheme":"batch-settlement","network":"eip155:72344","amount":"10000","unknownMember":{"a":[1,2]}}`)
	cfg := x402.ChannelConfig{Payer: "0x850ec0D9fF24AeFeE83Dec34973B271e755B93B9", PayerAuthorizer: "0x850ec0D9fF24AeFeE83Dec34973B271e755B93B9",
		Receiver: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e13", ReceiverAuthorizer: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e14",
		Token: "0x0BD8CEB7EBD1e9e83d8552584eA50B8385fd8025", WithdrawDelay: 900, Salt: "0x0000000000000000000000000000000000000000000000000000000000000000"}
	res := &x402.ResourceInfo{URL: "http://127.0.0.1/batch/index.html?q=<&>", Description: "a \"quoted\" page é", Tags: []string{"a", "b"}}
	wire := func(amount, sig string) batchPaymentWire {
		c := cfg
		return batchPaymentWire{X402Version: x402.Version2, Resource: res, Accepted: accepted, Payload: x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: &c,
			Voucher: &x402.BatchVoucherFields{ChannelID: "0xabcd00000000000000000000000000000000000000000000000000000000000000", MaxClaimableAmount: amount, Signature: sig}}}
	}
	key := templateKey(accepted, res)
	tmpl := newVoucherTemplate(key, wire("10000", "0x01"))
	if tmpl == nil {
		t.Fatal("no template for a plain voucher")
	}
	for _, v := range []struct{ amount, sig string }{{"10000", "0x01"}, {"20000", "0x1b2c00ff"}, {"340282366920938463463374607431768211455", "0x"}} {
		want, err := x402.EncodeHeader(wire(v.amount, v.sig))
		if err != nil {
			t.Fatal(err)
		}
		got, ok := tmpl.encode(v.amount, v.sig)
		if !ok || got != want {
			t.Errorf("voucher %s %s: the template gives %q (%v), EncodeHeader %q", v.amount, v.sig, got, ok, want)
		}
	}
	if templateKey(accepted, &x402.ResourceInfo{URL: res.URL}) == key || templateKey(json.RawMessage(`{}`), res) == key {
		t.Error("the template's key does not tell another resource or requirement apart")
	}
	marked := wire("1", "0x01")
	marked.Resource = &x402.ResourceInfo{URL: "http://h/" + templateAmount}
	if newVoucherTemplate(key, marked) != nil {
		t.Error("a template was made of a payment whose resource holds the amount's marker")
	}
	deposit := wire("1", "0x01")
	deposit.Payload.Type = x402.BatchDeposit
	if newVoucherTemplate(key, deposit) != nil {
		t.Error("a template was made of a deposit")
	}
}

// Two resources that differ never share a template key, whatever bytes their strings hold: the template made for
// the first would write the first's resource into the second's payment (the review of this stop; a key joining the
// parts with NUL bytes gave these two one key).
func TestTheVoucherTemplateKeyTellsResourcesWithAnyBytesApart(t *testing.T) {
	accepted := json.RawMessage(`{"scheme":"batch-settlement"}`)
	pairs := [][2]*x402.ResourceInfo{
		{{URL: "http://h/x\x00y"}, {URL: "http://h/x", Description: "y\x00"}},
		{{URL: "http://h/x", Tags: []string{"a\x01b"}}, {URL: "http://h/x", Tags: []string{"a", "b"}}},
		{{URL: "http://h/x"}, nil},
	}
	for _, p := range pairs {
		if templateKey(accepted, p[0]) == templateKey(accepted, p[1]) {
			t.Errorf("resources %+v and %+v share a template key", p[0], p[1])
		}
	}
}
