package caddymodule_test

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// TestMalformedAndMismatchedPaymentsGetTheirDocumentedStatusAndNeverReachSettle sends payment headers that
// are broken at every level, from Base64 to the signature, to one gate in front of a counting facilitator.
// Undecodable headers are 400 (invalid-header); decodable payments that pay something else, or that the
// facilitator refuses, are 402 with a fresh offer naming the problem. None is settled.
func TestMalformedAndMismatchedPaymentsGetTheirDocumentedStatusAndNeverReachSettle(t *testing.T) {
	env := newGateEnv(t, gateSetup{remote: true})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	valid := env.signPermit2(payer, env.requirement("/", x402.TransferPermit2))
	validERC := env.signERC2612(payer, env.requirement("/", x402.TransferERC2612))

	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	// mutate returns the valid payment (or validERC) with an edit applied to its JSON.
	mutate := func(base x402.PaymentPayload, edit func(m map[string]any)) string {
		raw, _ := json.Marshal(base)
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		edit(m)
		out, _ := json.Marshal(m)
		return b64(string(out))
	}
	obj := func(m map[string]any, path ...string) map[string]any {
		for _, k := range path {
			m = m[k].(map[string]any)
		}
		return m
	}
	validJSON, _ := json.Marshal(valid)
	other := "0x000000000000000000000000000000000000bEEF"

	cases := []struct {
		name   string
		header string
		status int
		want   string // in the PAYMENT-REQUIRED error
	}{
		// Base64
		{"not base64 at all", "%%% not base64 %%%", 400, "not-base64"},
		{"mixed base64 alphabets", "ab+-cd_/", 400, "not-base64"},
		{"too much padding", "eyJ4IjoxfQ===", 400, "not-base64"},
		{"truncated base64", b64(string(validJSON))[:101], 400, "not-"},
		{"huge header", b64(`{"x402Version":2,"pad":"` + strings.Repeat("a", 17<<10) + `"}`), 400, "too-large"},
		// Beyond Caddy's own header limit (max_header_size, 16 KiB by default) Caddy answers before the gate.
		{"header beyond Caddy's limit", b64(strings.Repeat("a", 64<<10)), 431, ""},
		// JSON
		{"base64 of text", b64("hello, I would like to pay"), 400, "not-json"},
		{"a JSON array", b64(`[1,2,3]`), 400, "wrong-type"},
		{"JSON null", b64(`null`), 400, ""},
		{"an empty object", b64(`{}`), 400, "x402Version"},
		{"garbage after the object", b64(string(validJSON) + "xyz"), 400, "not-json"},
		{"duplicate key", b64(`{"x402Version":2,"x402Version":2}`), 400, "x402Version"},
		// Versions and types
		{"version 3", mutate(valid, func(m map[string]any) { m["x402Version"] = 3 }), 400, "unsupported-version"},
		{"version 1 in PAYMENT-SIGNATURE", mutate(valid, func(m map[string]any) { m["x402Version"] = 1 }), 400, "unsupported-version"},
		{"version as a string", mutate(valid, func(m map[string]any) { m["x402Version"] = "2" }), 400, "wrong-type"},
		{"no accepted", mutate(valid, func(m map[string]any) { delete(m, "accepted") }), 400, "accepted"},
		{"amount as a number", mutate(valid, func(m map[string]any) { obj(m, "accepted")["amount"] = 10000 }), 400, "wrong-type"},
		{"timeout as a string", mutate(valid, func(m map[string]any) { obj(m, "accepted")["maxTimeoutSeconds"] = "300" }), 400, "wrong-type"},
		{"timeout zero", mutate(valid, func(m map[string]any) { obj(m, "accepted")["maxTimeoutSeconds"] = 0 }), 400, "invalid-value"},
		{"no payload", mutate(valid, func(m map[string]any) { delete(m, "payload") }), 400, "payload"},
		{"no signature", mutate(valid, func(m map[string]any) { delete(obj(m, "payload"), "signature") }), 400, "signature"},
		{"signature as a number", mutate(valid, func(m map[string]any) { obj(m, "payload")["signature"] = 7 }), 400, "wrong-type"},
		{"both authorizations", mutate(valid, func(m map[string]any) {
			obj(m, "payload")["authorization"] = map[string]any{"from": other, "to": other, "value": "1", "validAfter": "0", "validBefore": "9", "nonce": "1"}
		}), 400, "invalid-value"},
		{"no authorization", mutate(valid, func(m map[string]any) { delete(obj(m, "payload"), "permit2Authorization") }), 400, "authorization"},
		{"nonce as a number", mutate(valid, func(m map[string]any) { obj(m, "payload", "permit2Authorization")["nonce"] = 5 }), 400, "wrong-type"},
		{"permitted amount as a number", mutate(valid, func(m map[string]any) {
			obj(m, "payload", "permit2Authorization", "permitted")["amount"] = 10000
		}), 400, "wrong-type"},
		{"no witness", mutate(valid, func(m map[string]any) { delete(obj(m, "payload", "permit2Authorization"), "witness") }), 400, "witness"},
		{"erc2612 value as a number", mutate(validERC, func(m map[string]any) { obj(m, "payload", "authorization")["value"] = 10000 }), 400, "wrong-type"},
		// Decodable, but paying something this resource does not offer
		{"wrong network", mutate(valid, func(m map[string]any) { obj(m, "accepted")["network"] = "eip155:1" }), 402, x402.ReasonInvalidNetwork},
		{"network not CAIP-2", mutate(valid, func(m map[string]any) { obj(m, "accepted")["network"] = "base" }), 402, x402.ReasonInvalidNetwork},
		{"wrong scheme", mutate(valid, func(m map[string]any) { obj(m, "accepted")["scheme"] = "upto" }), 402, x402.ReasonUnsupportedScheme},
		{"unknown transfer method", mutate(valid, func(m map[string]any) { obj(m, "accepted", "extra")["assetTransferMethod"] = "eip3009" }), 402, "transfer method"},
		{"too little", mutate(valid, func(m map[string]any) { obj(m, "accepted")["amount"] = "1" }), 402, x402.ReasonValueMismatch},
		{"negative amount", mutate(valid, func(m map[string]any) { obj(m, "accepted")["amount"] = "-10000" }), 402, x402.ReasonValueMismatch},
		{"amount with an exponent", mutate(valid, func(m map[string]any) { obj(m, "accepted")["amount"] = "1e4" }), 402, x402.ReasonValueMismatch},
		{"amount with a leading zero", mutate(valid, func(m map[string]any) { obj(m, "accepted")["amount"] = "010000" }), 402, x402.ReasonValueMismatch},
		{"another asset", mutate(valid, func(m map[string]any) { obj(m, "accepted")["asset"] = other }), 402, "accepted.asset"},
		{"another recipient", mutate(valid, func(m map[string]any) { obj(m, "accepted")["payTo"] = other }), 402, x402.ReasonRecipientMismatch},
		// Matching what is offered, refused by the facilitator
		{"tampered signature", mutate(valid, func(m map[string]any) {
			sig := obj(m, "payload")["signature"].(string)
			obj(m, "payload")["signature"] = sig[:10] + strings.Map(func(r rune) rune {
				if r == 'a' {
					return 'b'
				}
				return 'a'
			}, sig[10:12]) + sig[12:]
		}), 402, x402.ReasonPermit2InvalidSignature},
		{"short signature", mutate(valid, func(m map[string]any) { obj(m, "payload")["signature"] = "0x1234" }), 402, x402.ReasonInvalidPayload},
		{"authorization for less", mutate(valid, func(m map[string]any) {
			obj(m, "payload", "permit2Authorization", "permitted")["amount"] = "1"
		}), 402, x402.ReasonPermit2AmountMismatch},
		{"witness paying someone else", mutate(valid, func(m map[string]any) {
			obj(m, "payload", "permit2Authorization", "witness")["to"] = other
		}), 402, x402.ReasonPermit2RecipientMismatch},
		{"erc2612 permit to a stranger", mutate(validERC, func(m map[string]any) { obj(m, "payload", "authorization")["to"] = other }), 402, ""},
	}
	if len(cases) < 30 {
		t.Fatalf("only %d cases", len(cases))
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := env.get("/", x402.HeaderPaymentSignature, tc.header)
			if a.status != tc.status {
				t.Fatalf("status = %d %q, want %d", a.status, a.body, tc.status)
			}
			if tc.status != http.StatusRequestHeaderFieldsTooLarge {
				if msg := requiredError(t, a); !strings.Contains(msg, tc.want) {
					t.Errorf("the answer's error %q does not mention %q", msg, tc.want)
				}
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" || strings.Contains(a.body, "paid content") {
				t.Errorf("a bad payment was settled or served: %q", a.body)
			}
		})
	}
	if n := env.remote.settles.Load(); n != 0 {
		t.Errorf("/settle was called %d times, want 0", n)
	}
	env.assertPaid(payer, before, 0)
	// The valid payment the bad ones were made from still works: none of them used it up.
	if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, valid)); a.status != http.StatusOK {
		t.Fatalf("the untouched payment = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

func TestVersion1HeadersThatDoNotFitGetTheirStatusInVersion1Form(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	cases := []struct {
		name, header string
		status       int
	}{
		{"garbage", "%%%", 400},
		{"unknown network name", base64.StdEncoding.EncodeToString([]byte(
			`{"x402Version":1,"scheme":"exact","network":"atlantis","payload":{"signature":"0x00","authorization":{"from":"0x000000000000000000000000000000000000bEEF","to":"0x000000000000000000000000000000000000bEEF","value":"10000","validAfter":"0","validBefore":"99999999999","nonce":"0"}}}`)), 402},
		{"permit2 in version 1", base64.StdEncoding.EncodeToString([]byte(
			`{"x402Version":1,"scheme":"exact","network":"testnet","payload":{"signature":"0x00","permit2Authorization":{"from":"0x000000000000000000000000000000000000bEEF","permitted":{"token":"0x000000000000000000000000000000000000bEEF","amount":"10000"},"spender":"0x000000000000000000000000000000000000bEEF","nonce":"1","deadline":"9","witness":{"to":"0x000000000000000000000000000000000000bEEF","validAfter":"0"}}}}`)), 402},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := env.get("/", x402.HeaderXPayment, tc.header)
			if a.status != tc.status {
				t.Fatalf("status = %d %q, want %d", a.status, a.body, tc.status)
			}
			var body x402.PaymentRequiredV1
			if err := json.Unmarshal([]byte(a.body), &body); err != nil || body.X402Version != 1 || body.Error == "" {
				t.Fatalf("body %q is not a version 1 answer with an error (%v)", a.body, err)
			}
		})
	}
}
