package x402

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// readExample returns a testdata document compacted, the form a header carries.
func readExample(t testing.TB, name string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, raw); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return buf.Bytes()
}

func b64(doc []byte) string { return base64.StdEncoding.EncodeToString(doc) }

// mutated returns an example with edit applied to its generic JSON form.
func mutated(t *testing.T, name string, edit func(m map[string]any)) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(readExample(t, name), &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	out, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// at walks a dotted path of objects in m and returns the parent object and the last key.
func at(m map[string]any, path string) (map[string]any, string) {
	keys := strings.Split(path, ".")
	for _, k := range keys[:len(keys)-1] {
		m = m[k].(map[string]any)
	}
	return m, keys[len(keys)-1]
}

func set(path string, v any) func(map[string]any) {
	return func(m map[string]any) { p, k := at(m, path); p[k] = v }
}

func del(path string) func(map[string]any) {
	return func(m map[string]any) { p, k := at(m, path); delete(p, k) }
}

// sameJSON compares two values by their encoding, which is how peers see them (it also makes raw extension
// values that differ only in whitespace equal).
func sameJSON(t *testing.T, got, want any) {
	t.Helper()
	g, err1 := json.Marshal(got)
	w, err2 := json.Marshal(want)
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	if !bytes.Equal(g, w) {
		t.Errorf("values differ:\n got  %s\n want %s", g, w)
	}
}

func TestExampleBodiesDecodeAsEncodingJSONReadsThem(t *testing.T) {
	t.Run("v2 payment required", func(t *testing.T) {
		doc := readExample(t, "v2-payment-required.json")
		got, err := DecodePaymentRequired(b64(doc))
		if err != nil {
			t.Fatal(err)
		}
		var want PaymentRequired
		mustUnmarshal(t, doc, &want)
		sameJSON(t, got, want)
		if len(got.Accepts) != 2 || got.Accepts[0].Extra.AssetTransferMethod != TransferPermit2 ||
			got.Accepts[1].Extra.Spender == "" || got.Extensions[ExtensionEIP2612GasSponsoring] == nil {
			t.Errorf("decoded %+v", got)
		}
	})
	for _, name := range []string{"v2-payload-permit2.json", "v2-payload-permit2-gas-sponsoring.json", "v2-payload-erc2612.json"} {
		t.Run(name, func(t *testing.T) {
			doc := readExample(t, name)
			got, err := DecodePaymentPayload(b64(doc))
			if err != nil {
				t.Fatal(err)
			}
			var want PaymentPayload
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
			if (got.Payload.Authorization == nil) == (got.Payload.Permit2Authorization == nil) {
				t.Errorf("want exactly one authorization: %+v", got.Payload)
			}
			viaBody, err := UnmarshalPaymentPayload(doc)
			if err != nil || !reflect.DeepEqual(viaBody, got) {
				t.Errorf("UnmarshalPaymentPayload = %+v, %v; want the header's value", viaBody, err)
			}
		})
	}
	t.Run("gas sponsoring info", func(t *testing.T) {
		p, err := DecodePaymentPayload(b64(readExample(t, "v2-payload-permit2-gas-sponsoring.json")))
		if err != nil {
			t.Fatal(err)
		}
		var ext struct{ Info EIP2612GasSponsoringInfo }
		mustUnmarshal(t, p.Extensions[ExtensionEIP2612GasSponsoring], &ext)
		if ext.Info.Spender != "0x000000000022D473030F116dDEE9F6B43aC78BA3" || ext.Info.Version != "1" || ext.Info.Amount != p.Accepted.Amount {
			t.Errorf("gas sponsoring info = %+v", ext.Info)
		}
	})
	for _, name := range []string{"verify-request-permit2.json", "verify-request-erc2612.json"} {
		t.Run(name, func(t *testing.T) {
			doc := readExample(t, name)
			got, err := DecodeVerifyRequest(doc)
			if err != nil {
				t.Fatal(err)
			}
			var want VerifyRequest
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
			if got.X402Version != Version2 || got.PaymentRequirements.Amount != "10000" {
				t.Errorf("decoded %+v", got)
			}
		})
	}
	for _, name := range []string{"verify-response-valid.json", "verify-response-invalid.json"} {
		t.Run(name, func(t *testing.T) {
			doc := readExample(t, name)
			got, err := UnmarshalVerifyResponse(doc)
			if err != nil {
				t.Fatal(err)
			}
			var want VerifyResponse
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
		})
	}
	for _, name := range []string{"settle-response-success.json", "settle-response-failure.json", "settle-response-pending.json"} {
		t.Run(name, func(t *testing.T) {
			doc := readExample(t, name)
			got, err := DecodeSettleResponse(b64(doc))
			if err != nil {
				t.Fatal(err)
			}
			var want SettleResponse
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
			if body, err := UnmarshalSettleResponse(doc); err != nil || !reflect.DeepEqual(body, got) {
				t.Errorf("UnmarshalSettleResponse = %+v, %v", body, err)
			}
			if got.Pending() != strings.Contains(name, "pending") {
				t.Errorf("Pending() = %v", got.Pending())
			}
		})
	}
	t.Run("supported with signers mapped to arrays", func(t *testing.T) {
		var s SupportedResponse
		mustUnmarshal(t, readExample(t, "supported.json"), &s)
		if len(s.Kinds) != 3 || s.Kinds[2].X402Version != Version1 || len(s.Signers["eip155:*"]) != 2 ||
			s.Extensions[0] != ExtensionEIP2612GasSponsoring || s.Kinds[1].Extra.X402Permit2ProxyAddress == "" {
			t.Errorf("decoded %+v", s)
		}
	})
	t.Run("health", func(t *testing.T) {
		var h HealthResponse
		mustUnmarshal(t, readExample(t, "health.json"), &h)
		if h.Status != HealthOK || len(h.Networks) != 1 || h.Networks[0].Wallets[0].Balance != "2500000000000000000" {
			t.Errorf("decoded %+v", h)
		}
	})
	t.Run("v1 402 body", func(t *testing.T) {
		doc := readExample(t, "v1-payment-required.json")
		got, err := DecodePaymentRequiredV1(doc)
		if err != nil {
			t.Fatal(err)
		}
		var want PaymentRequiredV1
		mustUnmarshal(t, doc, &want)
		sameJSON(t, got, want)
		if got.Accepts[0].MaxAmountRequired != "10000" || len(got.Accepts[0].OutputSchema) == 0 {
			t.Errorf("decoded %+v", got)
		}
	})
	t.Run("v1 payload", func(t *testing.T) {
		doc := readExample(t, "v1-payload.json")
		got, err := DecodePaymentPayloadV1(b64(doc))
		if err != nil {
			t.Fatal(err)
		}
		var want PaymentPayloadV1
		mustUnmarshal(t, doc, &want)
		sameJSON(t, got, want)
		if got.Network != V1NameTestnet || got.Payload.Authorization == nil {
			t.Errorf("decoded %+v", got)
		}
	})
}

func mustUnmarshal(t *testing.T, doc []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(doc, v); err != nil {
		t.Fatal(err)
	}
}

func TestEveryWireTypeEncodesAndDecodesToTheSameValue(t *testing.T) {
	ext := map[string]json.RawMessage{"eip2612GasSponsoring": json.RawMessage(`{"info":{"version":"1","note":"<&>"}}`)}
	p2 := PaymentPayload{
		X402Version: 2,
		Resource:    &ResourceInfo{URL: "https://example.com/a?b=c&d=<e>", Description: "ünïcödé \u2028 \"quoted\"", MimeType: "text/plain"},
		Accepted: PaymentRequirements{Scheme: "exact", Network: NetworkMainnet, Amount: "1", Asset: "0xa", PayTo: "0xb", MaxTimeoutSeconds: 1,
			Extra: Extra{AssetTransferMethod: "permit2", Name: "n", Version: "v", Spender: "s", Permit2Address: "p", X402Permit2ProxyAddress: "x"}},
		Payload: ExactEVMPayload{Signature: "0xsig", Permit2Authorization: &Permit2Authorization{From: "f", Permitted: TokenPermissions{Token: "t", Amount: "1"},
			Spender: "s", Nonce: "1", Deadline: "2", Witness: Permit2Witness{To: "to", ValidAfter: "0"}}},
		Extensions: ext,
	}
	erc := PaymentPayload{X402Version: 2, Accepted: p2.Accepted, Payload: ExactEVMPayload{Signature: "0xsig",
		Authorization: &EIP2612Authorization{From: "f", To: "t", Value: "1", ValidAfter: "0", ValidBefore: maxUint256Dec, Nonce: "0"}}}
	required := PaymentRequired{X402Version: 2, Error: "pay", Resource: ResourceInfo{URL: "https://example.com"}, Accepts: []PaymentRequirements{p2.Accepted, erc.Accepted}, Extensions: ext}
	settle := SettleResponse{Success: true, Transaction: "0xtx", Network: NetworkTestnet, Payer: "0xp", Amount: "1", ErrorReason: "r", ErrorMessage: "m", Extensions: ext}
	v1 := PaymentPayloadV1{X402Version: 1, Scheme: "exact", Network: "testnet", Payload: erc.Payload}

	headers := []struct {
		name   string
		value  any
		decode func(string) (any, error)
	}{
		{"payment payload permit2", p2, func(h string) (any, error) { return DecodePaymentPayload(h) }},
		{"payment payload erc2612", erc, func(h string) (any, error) { return DecodePaymentPayload(h) }},
		{"payment required", required, func(h string) (any, error) { return DecodePaymentRequired(h) }},
		{"settle response", settle, func(h string) (any, error) { return DecodeSettleResponse(h) }},
		{"settle response, failed", SettleResponse{Network: NetworkTestnet}, func(h string) (any, error) { return DecodeSettleResponse(h) }},
		{"payment payload v1", v1, func(h string) (any, error) { return DecodePaymentPayloadV1(h) }},
	}
	for _, tt := range headers {
		t.Run(tt.name, func(t *testing.T) {
			h, err := EncodeHeader(tt.value)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tt.decode(h)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.value) {
				t.Errorf("round trip changed the value:\n got  %+v\n want %+v", got, tt.value)
			}
		})
	}

	bodies := []struct {
		name   string
		value  any
		decode func([]byte) (any, error)
	}{
		{"verify request", VerifyRequest{X402Version: 2, PaymentPayload: p2, PaymentRequirements: p2.Accepted}, func(b []byte) (any, error) { return DecodeVerifyRequest(b) }},
		{"verify response", VerifyResponse{IsValid: false, Payer: "0xp", InvalidReason: ReasonInsufficientFunds, InvalidMessage: "m", Extensions: ext}, func(b []byte) (any, error) { return UnmarshalVerifyResponse(b) }},
		{"settle response", settle, func(b []byte) (any, error) { return UnmarshalSettleResponse(b) }},
		{"v1 402 body", PaymentRequiredV1{X402Version: 1, Error: "e", Accepts: []PaymentRequirementsV1{{Scheme: "exact", Network: "testnet", MaxAmountRequired: "1",
			Resource: "https://example.com", Description: "d", MimeType: "m", OutputSchema: json.RawMessage(`{"input":{"type":"http"}}`), PayTo: "0xb",
			MaxTimeoutSeconds: 60, Asset: "0xa", Extra: &Extra{Name: "Stable Coin", Version: "1"}}}}, func(b []byte) (any, error) { return DecodePaymentRequiredV1(b) }},
		{"payment payload", p2, func(b []byte) (any, error) { return UnmarshalPaymentPayload(b) }},
	}
	for _, tt := range bodies {
		t.Run(tt.name, func(t *testing.T) {
			// json.Marshal would escape <, > and & inside raw extension values: equal JSON, different bytes.
			var buf bytes.Buffer
			enc := json.NewEncoder(&buf)
			enc.SetEscapeHTML(false)
			if err := enc.Encode(tt.value); err != nil {
				t.Fatal(err)
			}
			got, err := tt.decode(buf.Bytes())
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.value) {
				t.Errorf("round trip changed the value:\n got  %+v\n want %+v", got, tt.value)
			}
		})
	}

	// Types without a strict decoder of their own round-trip through encoding/json.
	plain := []any{
		SupportedResponse{Kinds: []SupportedKind{{X402Version: 2, Scheme: "exact", Network: NetworkMainnet, Extra: Extra{AssetTransferMethod: "permit2"}}},
			Extensions: []string{ExtensionEIP2612GasSponsoring}, Signers: map[string][]string{"eip155:*": {"0x1", "0x2"}}},
		HealthResponse{Status: HealthDegraded, Networks: []NetworkHealth{{Network: NetworkTestnet, Status: HealthDown, Error: "rpc down", JournalBacklog: 3,
			Wallets: []WalletHealth{{Address: "0x1", Balance: "0", Low: true}}}}},
		EIP2612GasSponsoringInfo{From: "f", Asset: "a", Spender: "s", Amount: "1", Nonce: "0", Deadline: "9", Signature: "0x", Version: "1"},
	}
	for _, v := range plain {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		back := reflect.New(reflect.TypeOf(v))
		if err := json.Unmarshal(b, back.Interface()); err != nil || !reflect.DeepEqual(back.Elem().Interface(), v) {
			t.Errorf("%T round trip = %+v, %v", v, back.Elem().Interface(), err)
		}
	}
}

func TestEncodeHeaderWritesStandardPaddedBase64OfCompactJSON(t *testing.T) {
	h, err := EncodeHeader(SettleResponse{Success: true, Transaction: "0x<tx>&", Network: NetworkTestnet})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := base64.StdEncoding.Strict().DecodeString(h)
	if err != nil {
		t.Fatalf("not standard padded Base64: %v", err)
	}
	const want = `{"success":true,"transaction":"0x<tx>&","network":"eip155:72344","payer":""}`
	if string(raw) != want {
		t.Errorf("JSON = %s, want %s", raw, want)
	}
	if _, err := EncodeHeader(map[string]string{"a": strings.Repeat("x", MaxHeaderBytes)}); err == nil {
		t.Error("a header over MaxHeaderBytes was encoded")
	}
	if _, err := EncodeHeader(func() {}); err == nil {
		t.Error("a value JSON cannot encode was encoded")
	}
}

func TestHeadersInAnyBase64FlavourDecodeToTheSamePayment(t *testing.T) {
	doc := readExample(t, "v2-payload-permit2.json")
	// Pad the document so that its Base64 has both padding and the characters that differ between alphabets.
	want, err := DecodePaymentPayload(b64(doc))
	if err != nil {
		t.Fatal(err)
	}
	for _, extra := range []string{"", " ", "  "} {
		d := append(append([]byte{}, doc[:len(doc)-1]...), []byte(`,"pad":"??>>`+extra+`"}`)...)
		flavours := map[string]string{
			"standard padded":   base64.StdEncoding.EncodeToString(d),
			"standard unpadded": base64.RawStdEncoding.EncodeToString(d),
			"url-safe padded":   base64.URLEncoding.EncodeToString(d),
			"url-safe unpadded": base64.RawURLEncoding.EncodeToString(d),
			"with spaces":       " \t" + base64.StdEncoding.EncodeToString(d) + " ",
		}
		for name, h := range flavours {
			got, err := DecodePaymentPayload(h)
			if err != nil {
				t.Errorf("%s (%d pad bytes): %v", name, len(extra), err)
				continue
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("%s: decoded a different payment", name)
			}
		}
	}
	raw, err := HeaderJSON(base64.RawURLEncoding.EncodeToString(doc))
	if err != nil || !bytes.Equal(raw, doc) {
		t.Errorf("HeaderJSON = %s, %v; want the document itself", raw, err)
	}
}

// wantDecodeError checks the kind and field of a decode error and that its message names both.
func wantDecodeError(t *testing.T, err error, kind DecodeErrorKind, field string) {
	t.Helper()
	de, ok := err.(*DecodeError)
	if !ok {
		t.Fatalf("error = %v (%T), want *DecodeError %s %s", err, err, kind, field)
	}
	if de.Kind != kind || de.Field != field {
		t.Fatalf("error = %s %q (%v), want %s %q", de.Kind, de.Field, err, kind, field)
	}
	msg := err.Error()
	if !strings.Contains(msg, string(kind)) || !strings.Contains(msg, field) || de.Detail == "" || !IsDecodeKind(err, kind) {
		t.Errorf("message %q does not name the kind, the field and the detail", msg)
	}
}

func TestDecodePaymentPayloadNamesTheFieldAndTheProblem(t *testing.T) {
	const p2, erc = "v2-payload-permit2.json", "v2-payload-erc2612.json"
	p2doc := string(readExample(t, p2))
	tests := []struct {
		name   string
		header string
		kind   DecodeErrorKind
		field  string
		detail string // part of the message
	}{
		{"empty header", "", DecodeNotBase64, "", "empty"},
		{"not base64", "eyJ4NDAy%%%", DecodeNotBase64, "", "'%'"},
		{"newline inside", b64([]byte(p2doc))[:20] + "\n" + b64([]byte(p2doc))[20:], DecodeNotBase64, "", "byte 0x0a"},
		{"mixed alphabets", "ab+c-d==", DecodeNotBase64, "", "mixes"},
		{"impossible length", "abcde", DecodeNotBase64, "", "cannot be complete"},
		{"too much padding", "abc===", DecodeNotBase64, "", "padding"},
		{"padding of a wrong length", "abcdef=", DecodeNotBase64, "", "padding"},
		{"too large", strings.Repeat("A", maxHeaderText+4), DecodeTooLarge, "", "more than"},
		{"too large once decoded", base64.RawStdEncoding.EncodeToString(make([]byte, MaxHeaderBytes+1)), DecodeTooLarge, "", "more than"},
		{"not json", b64([]byte("x402Version=2")), DecodeNotJSON, "", "expected a JSON value"},
		{"truncated json", b64([]byte(p2doc[:len(p2doc)-3])), DecodeNotJSON, "", ""},
		{"trailing data", b64([]byte(p2doc + " {}")), DecodeNotJSON, "", "after the end"},
		{"json array", b64([]byte(`[1,2]`)), DecodeWrongType, "", "got an array, expected an object"},
		{"amount as a JSON number", b64(mutated(t, p2, set("payload.permit2Authorization.permitted.amount", 10000))),
			DecodeWrongType, "payload.permit2Authorization.permitted.amount", "decimal strings"},
		{"erc2612 value as a JSON number", b64(mutated(t, erc, set("payload.authorization.value", 10000))),
			DecodeWrongType, "payload.authorization.value", "got a number, expected a string"},
		{"accepted amount as a JSON number", b64(mutated(t, p2, set("accepted.amount", 1e4))), DecodeWrongType, "accepted.amount", ""},
		{"nonce as an object", b64(mutated(t, p2, set("payload.permit2Authorization.nonce", map[string]any{}))),
			DecodeWrongType, "payload.permit2Authorization.nonce", "got an object"},
		{"timeout as a string", b64(mutated(t, p2, set("accepted.maxTimeoutSeconds", "60"))), DecodeWrongType, "accepted.maxTimeoutSeconds", "got a string"},
		{"timeout as a fraction", b64(mutated(t, p2, set("accepted.maxTimeoutSeconds", 60.5))), DecodeWrongType, "accepted.maxTimeoutSeconds", "integer"},
		{"timeout out of range", b64([]byte(strings.Replace(p2doc, `"maxTimeoutSeconds":60`, `"maxTimeoutSeconds":99999999999999999999`, 1))),
			DecodeWrongType, "accepted.maxTimeoutSeconds", "64 bits"},
		{"timeout zero", b64(mutated(t, p2, set("accepted.maxTimeoutSeconds", 0))), DecodeInvalidValue, "accepted.maxTimeoutSeconds", "positive"},
		{"x402Version as a string", b64(mutated(t, p2, set("x402Version", "2"))), DecodeWrongType, "x402Version", ""},
		{"x402Version missing", b64(mutated(t, p2, del("x402Version"))), DecodeMissingField, "x402Version", "expected version 2"},
		{"version 1 in a version 2 decoder", b64(mutated(t, p2, set("x402Version", 1))), DecodeUnsupportedVersion, "x402Version", "X-PAYMENT"},
		{"version 3", b64(mutated(t, p2, set("x402Version", 3))), DecodeUnsupportedVersion, "x402Version", "is 3"},
		{"version 3 wins over missing fields", b64([]byte(`{"x402Version":3}`)), DecodeUnsupportedVersion, "x402Version", ""},
		{"accepted missing", b64(mutated(t, p2, del("accepted"))), DecodeMissingField, "accepted", "missing"},
		{"accepted null", b64(mutated(t, p2, set("accepted", nil))), DecodeMissingField, "accepted", "null"},
		{"accepted amount missing", b64(mutated(t, p2, del("accepted.amount"))), DecodeMissingField, "accepted.amount", "missing"},
		{"accepted amount empty", b64(mutated(t, p2, set("accepted.amount", ""))), DecodeMissingField, "accepted.amount", "empty"},
		{"accepted scheme missing", b64(mutated(t, p2, del("accepted.scheme"))), DecodeMissingField, "accepted.scheme", ""},
		{"accepted network missing", b64(mutated(t, p2, del("accepted.network"))), DecodeMissingField, "accepted.network", ""},
		{"accepted asset missing", b64(mutated(t, p2, del("accepted.asset"))), DecodeMissingField, "accepted.asset", ""},
		{"accepted payTo missing", b64(mutated(t, p2, del("accepted.payTo"))), DecodeMissingField, "accepted.payTo", ""},
		{"accepted timeout missing", b64(mutated(t, p2, del("accepted.maxTimeoutSeconds"))), DecodeMissingField, "accepted.maxTimeoutSeconds", ""},
		{"accepted extra missing", b64(mutated(t, p2, del("accepted.extra"))), DecodeMissingField, "accepted.extra", ""},
		{"extra as a string", b64(mutated(t, p2, set("accepted.extra", "permit2"))), DecodeWrongType, "accepted.extra", "expected an object"},
		{"payload missing", b64(mutated(t, p2, del("payload"))), DecodeMissingField, "payload", ""},
		{"signature missing", b64(mutated(t, p2, del("payload.signature"))), DecodeMissingField, "payload.signature", "missing"},
		{"signature empty", b64(mutated(t, p2, set("payload.signature", ""))), DecodeMissingField, "payload.signature", "empty"},
		{"no authorization", b64(mutated(t, p2, del("payload.permit2Authorization"))), DecodeMissingField, "payload.authorization", "exactly one"},
		{"both authorizations", b64(mutated(t, p2, set("payload.authorization", map[string]any{
			"from": "0x1", "to": "0x2", "value": "1", "validAfter": "0", "validBefore": "1", "nonce": "0"}))), DecodeInvalidValue, "payload", "both"},
		{"permit2 from missing", b64(mutated(t, p2, del("payload.permit2Authorization.from"))), DecodeMissingField, "payload.permit2Authorization.from", ""},
		{"permit2 spender missing", b64(mutated(t, p2, del("payload.permit2Authorization.spender"))), DecodeMissingField, "payload.permit2Authorization.spender", ""},
		{"permit2 deadline missing", b64(mutated(t, p2, del("payload.permit2Authorization.deadline"))), DecodeMissingField, "payload.permit2Authorization.deadline", ""},
		{"permit2 permitted missing", b64(mutated(t, p2, del("payload.permit2Authorization.permitted"))), DecodeMissingField, "payload.permit2Authorization.permitted", ""},
		{"permit2 token missing", b64(mutated(t, p2, del("payload.permit2Authorization.permitted.token"))), DecodeMissingField, "payload.permit2Authorization.permitted.token", ""},
		{"permit2 witness missing", b64(mutated(t, p2, del("payload.permit2Authorization.witness"))), DecodeMissingField, "payload.permit2Authorization.witness", ""},
		{"permit2 witness.to missing", b64(mutated(t, p2, del("payload.permit2Authorization.witness.to"))), DecodeMissingField, "payload.permit2Authorization.witness.to", ""},
		{"permit2 validAfter missing", b64(mutated(t, p2, del("payload.permit2Authorization.witness.validAfter"))), DecodeMissingField, "payload.permit2Authorization.witness.validAfter", ""},
		{"erc2612 nonce missing", b64(mutated(t, erc, del("payload.authorization.nonce"))), DecodeMissingField, "payload.authorization.nonce", ""},
		{"erc2612 validBefore null", b64(mutated(t, erc, set("payload.authorization.validBefore", nil))), DecodeMissingField, "payload.authorization.validBefore", "null"},
		{"erc2612 from missing", b64(mutated(t, erc, del("payload.authorization.from"))), DecodeMissingField, "payload.authorization.from", ""},
		{"duplicate key", b64([]byte(strings.Replace(p2doc, `"amount":"10000"`, `"amount":"10000","amount":"1"`, 1))), DecodeInvalidValue, "accepted.amount", "more than once"},
		{"keys match case-sensitively", b64([]byte(strings.Replace(p2doc, `"amount":"10000"`, `"Amount":"10000"`, 1))), DecodeMissingField, "accepted.amount", ""},
		{"resource as an array", b64(mutated(t, p2, set("resource", []any{}))), DecodeWrongType, "resource", ""},
		{"extensions as an array", b64(mutated(t, p2, set("extensions", []any{}))), DecodeWrongType, "extensions", ""},
		{"deeply nested unknown field", b64([]byte(`{"x":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `}`)), DecodeNotJSON, "", "nested deeper"},
		{"control character in a string", b64([]byte(strings.Replace(p2doc, `"exact"`, "\"ex\x01act\"", 1))), DecodeNotJSON, "", "control character"},
		{"invalid utf-8", b64([]byte(strings.Replace(p2doc, `"exact"`, "\"ex\xffact\"", 1))), DecodeNotJSON, "", "UTF-8"},
		{"bad escape", b64([]byte(strings.Replace(p2doc, `"exact"`, `"ex\qact"`, 1))), DecodeNotJSON, "", "invalid escape"},
		{"syntax error wins over a type error before it", b64([]byte(strings.Replace(p2doc, `"amount":"10000"`, `"amount":10000`, 1)[:200])), DecodeNotJSON, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := DecodePaymentPayload(tt.header)
			wantDecodeError(t, err, tt.kind, tt.field)
			if !strings.Contains(err.Error(), tt.detail) {
				t.Errorf("message %q does not mention %q", err, tt.detail)
			}
			if !strings.HasPrefix(err.Error(), "decode payment header: ") {
				t.Errorf("message %q does not say what was being decoded", err)
			}
			if !reflect.DeepEqual(p, PaymentPayload{}) {
				t.Errorf("a failed decode returned a partial payment %+v", p)
			}
		})
	}
}

func TestDecodePaymentPayloadToleratesWhatPeersAdd(t *testing.T) {
	const p2 = "v2-payload-permit2.json"
	edits := map[string]func(map[string]any){
		"unknown top-level field":   set("paymentId", "abc"),
		"unknown nested field":      set("payload.permit2Authorization.witness.extra", "0x"),
		"unknown extra field":       set("accepted.extra.feePayer", "0x1"),
		"null resource":             set("resource", nil),
		"null extensions":           set("extensions", nil),
		"empty extensions":          set("extensions", map[string]any{}),
		"deep extension":            set("extensions", map[string]any{"a": map[string]any{"b": []any{1.5, true, nil, "s"}}}),
		"resource without url":      set("resource", map[string]any{"description": "d"}),
		"hex nonce (verifier says)": set("payload.permit2Authorization.nonce", "0xabc"),
	}
	for name, edit := range edits {
		t.Run(name, func(t *testing.T) {
			if _, err := DecodePaymentPayload(b64(mutated(t, p2, edit))); err != nil {
				t.Fatal(err)
			}
		})
	}
	t.Run("escaped keys and strings", func(t *testing.T) {
		doc := strings.Replace(string(readExample(t, p2)), `"scheme":"exact"`, `"sch\u0065me":"ex\u0061ct"`, 1)
		p, err := DecodePaymentPayload(b64([]byte(doc)))
		if err != nil || p.Accepted.Scheme != "exact" {
			t.Fatalf("scheme = %q, %v", p.Accepted.Scheme, err)
		}
	})
	t.Run("empty extensions read as none", func(t *testing.T) {
		p, err := DecodePaymentPayload(b64(mutated(t, p2, set("extensions", map[string]any{}))))
		if err != nil || p.Extensions != nil {
			t.Fatalf("extensions = %#v, %v", p.Extensions, err)
		}
	})
	t.Run("extension values are kept compact", func(t *testing.T) {
		doc := strings.Replace(string(readExample(t, "v2-payload-permit2-gas-sponsoring.json")), `{"info":{`, `{ "info" : {`, 1)
		p, err := DecodePaymentPayload(b64([]byte(doc)))
		if err != nil {
			t.Fatal(err)
		}
		if got := string(p.Extensions[ExtensionEIP2612GasSponsoring]); strings.ContainsAny(got, " \n") || !strings.HasPrefix(got, `{"info":{"from"`) {
			t.Errorf("extension = %s", got)
		}
	})
}

func TestDecodePaymentHeaderTellsTheVersion(t *testing.T) {
	v2, err := DecodePaymentHeader(b64(readExample(t, "v2-payload-erc2612.json")))
	if err != nil || v2.Version != 2 || v2.V2 == nil || v2.V1 != nil {
		t.Fatalf("v2 header = %+v, %v", v2, err)
	}
	v1, err := DecodePaymentHeader(b64(readExample(t, "v1-payload.json")))
	if err != nil || v1.Version != 1 || v1.V1 == nil || v1.V2 != nil || v1.V1.Network != V1NameTestnet {
		t.Fatalf("v1 header = %+v, %v", v1, err)
	}
	tests := []struct {
		name  string
		doc   string
		kind  DecodeErrorKind
		field string
	}{
		{"v1 without network", `{"x402Version":1,"scheme":"exact","payload":{"signature":"0x1","authorization":{"from":"a","to":"b","value":"1","validAfter":"0","validBefore":"1","nonce":"0"}}}`, DecodeMissingField, "network"},
		{"v1 without scheme", `{"x402Version":1,"network":"testnet","payload":{}}`, DecodeMissingField, "payload.signature"},
		{"v2 shape without accepted", `{"x402Version":2,"scheme":"exact","network":"testnet","payload":{"signature":"0x1","authorization":{"from":"a","to":"b","value":"1","validAfter":"0","validBefore":"1","nonce":"0"}}}`, DecodeMissingField, "accepted"},
		{"version 0", `{"x402Version":0}`, DecodeUnsupportedVersion, "x402Version"},
		{"version -1", `{"x402Version":-1}`, DecodeUnsupportedVersion, "x402Version"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodePaymentHeader(b64([]byte(tt.doc)))
			wantDecodeError(t, err, tt.kind, tt.field)
		})
	}
	_, err = DecodePaymentPayloadV1(b64(readExample(t, "v2-payload-erc2612.json")))
	wantDecodeError(t, err, DecodeUnsupportedVersion, "x402Version")
}

func TestDecodeVerifyRequestNamesFieldsByTheirPathInTheBody(t *testing.T) {
	const vr = "verify-request-permit2.json"
	tests := []struct {
		name  string
		body  []byte
		kind  DecodeErrorKind
		field string
	}{
		{"empty body", nil, DecodeNotJSON, ""},
		{"whitespace body", []byte(" \n"), DecodeNotJSON, ""},
		{"too large", append(append([]byte(`{"x":"`), bytes.Repeat([]byte("a"), MaxBodyBytes)...), `"}`...), DecodeTooLarge, ""},
		{"requirements amount as a number", mutated(t, vr, set("paymentRequirements.amount", 10000)), DecodeWrongType, "paymentRequirements.amount"},
		{"requirements asset missing", mutated(t, vr, del("paymentRequirements.asset")), DecodeMissingField, "paymentRequirements.asset"},
		{"requirements missing", mutated(t, vr, del("paymentRequirements")), DecodeMissingField, "paymentRequirements"},
		{"payload missing", mutated(t, vr, del("paymentPayload")), DecodeMissingField, "paymentPayload"},
		{"payload null", mutated(t, vr, set("paymentPayload", nil)), DecodeMissingField, "paymentPayload"},
		{"payload empty", mutated(t, vr, set("paymentPayload", map[string]any{})), DecodeMissingField, "paymentPayload.x402Version"},
		{"signature missing", mutated(t, vr, del("paymentPayload.payload.signature")), DecodeMissingField, "paymentPayload.payload.signature"},
		{"nested amount as a number", mutated(t, vr, set("paymentPayload.payload.permit2Authorization.permitted.amount", 1)), DecodeWrongType, "paymentPayload.payload.permit2Authorization.permitted.amount"},
		{"accepted missing", mutated(t, vr, del("paymentPayload.accepted")), DecodeMissingField, "paymentPayload.accepted"},
		{"version missing", mutated(t, vr, del("x402Version")), DecodeMissingField, "x402Version"},
		{"version 1 request", mutated(t, vr, set("x402Version", 1)), DecodeUnsupportedVersion, "x402Version"},
		{"version 1 payment", mutated(t, vr, set("paymentPayload.x402Version", 1)), DecodeUnsupportedVersion, "paymentPayload.x402Version"},
		{"duplicate payload", []byte(`{"x402Version":2,"paymentPayload":{},"paymentPayload":{}}`), DecodeInvalidValue, "paymentPayload"},
		{"not an object", []byte(`"verify"`), DecodeWrongType, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodeVerifyRequest(tt.body)
			wantDecodeError(t, err, tt.kind, tt.field)
			if !strings.HasPrefix(err.Error(), "decode verify request: ") {
				t.Errorf("message %q does not say what was being decoded", err)
			}
		})
	}
	t.Run("unknown top-level fields are tolerated", func(t *testing.T) {
		req, err := DecodeVerifyRequest(mutated(t, vr, set("traceId", map[string]any{"a": []any{1}})))
		if err != nil || req.PaymentPayload.Payload.Permit2Authorization == nil {
			t.Fatalf("%+v, %v", req, err)
		}
	})
}

func TestResponseDecodersRequireTheirVerdict(t *testing.T) {
	if _, err := UnmarshalVerifyResponse([]byte(`{"payer":"0x1"}`)); err == nil {
		t.Error("a verify response without isValid was accepted")
	} else {
		wantDecodeError(t, err, DecodeMissingField, "isValid")
	}
	_, err := UnmarshalVerifyResponse([]byte(`{"isValid":"true"}`))
	wantDecodeError(t, err, DecodeWrongType, "isValid")
	_, err = UnmarshalSettleResponse([]byte(`{"error":"boom"}`))
	wantDecodeError(t, err, DecodeMissingField, "success")
	_, err = UnmarshalSettleResponse([]byte(`{"success":true,"transaction":5}`))
	wantDecodeError(t, err, DecodeWrongType, "transaction")
	_, err = UnmarshalSettleResponse([]byte(`<html>502 Bad Gateway</html>`))
	wantDecodeError(t, err, DecodeNotJSON, "")
	s, err := UnmarshalSettleResponse([]byte(`{"success":false,"errorReason":"insufficient_funds"}`))
	if err != nil || s.Success || s.ErrorReason != ReasonInsufficientFunds {
		t.Errorf("a minimal failure answer = %+v, %v", s, err)
	}
}

func TestDecodePaymentRequiredChecksTheSpecFields(t *testing.T) {
	const pr = "v2-payment-required.json"
	tests := []struct {
		name  string
		doc   []byte
		kind  DecodeErrorKind
		field string
	}{
		{"resource missing", mutated(t, pr, del("resource")), DecodeMissingField, "resource"},
		{"resource url missing", mutated(t, pr, del("resource.url")), DecodeMissingField, "resource.url"},
		{"accepts missing", mutated(t, pr, del("accepts")), DecodeMissingField, "accepts"},
		{"accepts as an object", mutated(t, pr, set("accepts", map[string]any{})), DecodeWrongType, "accepts"},
		{"second requirement's amount as a number", []byte(strings.Replace(string(readExample(t, pr)), `"amount":"10000","asset":"0x5FbDB2315678afecb367f032d93F642f64180aa3","payTo":"0x70997970C51812dc3A010C7d01b50e0d17dc79C8","maxTimeoutSeconds":60,"extra":{"assetTransferMethod":"erc2612"`,
			`"amount":10000,"asset":"0x5FbDB2315678afecb367f032d93F642f64180aa3","payTo":"0x70997970C51812dc3A010C7d01b50e0d17dc79C8","maxTimeoutSeconds":60,"extra":{"assetTransferMethod":"erc2612"`, 1)),
			DecodeWrongType, "accepts[1].amount"},
		{"version 1", mutated(t, pr, set("x402Version", 1)), DecodeUnsupportedVersion, "x402Version"},
		// A null requirement was read as an empty one (FuzzDecodePaymentRequired, seeded with a null element).
		{"a null requirement", mutated(t, pr, set("accepts", []any{nil})), DecodeWrongType, "accepts[0]"},
		{"a null requirement after a valid one", mutated(t, pr, func(m map[string]any) { m["accepts"] = append(m["accepts"].([]any), nil) }), DecodeWrongType, "accepts[2]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodePaymentRequired(b64(tt.doc))
			wantDecodeError(t, err, tt.kind, tt.field)
		})
	}
	p, err := DecodePaymentRequired(b64(mutated(t, pr, set("accepts", []any{}))))
	if err != nil || p.Accepts == nil || len(p.Accepts) != 0 {
		t.Errorf("empty accepts = %#v, %v; want an empty, non-nil list", p.Accepts, err)
	}
}

func TestDecodePaymentRequiredV1ChecksVersion1Fields(t *testing.T) {
	const pr = "v1-payment-required.json"
	doc := string(readExample(t, pr))
	tests := []struct {
		name  string
		doc   string
		kind  DecodeErrorKind
		field string
	}{
		{"maxAmountRequired missing", strings.Replace(doc, `"maxAmountRequired":"10000",`, "", 1), DecodeMissingField, "accepts[0].maxAmountRequired"},
		{"resource missing", strings.Replace(doc, `"resource":"https://api.example.com/v1/weather?city=Lisbon",`, "", 1), DecodeMissingField, "accepts[0].resource"},
		{"maxAmountRequired as a number", strings.Replace(doc, `"maxAmountRequired":"10000"`, `"maxAmountRequired":10000`, 1), DecodeWrongType, "accepts[0].maxAmountRequired"},
		{"version 2", strings.Replace(doc, `"x402Version":1`, `"x402Version":2`, 1), DecodeUnsupportedVersion, "x402Version"},
		// A null requirement was read as an empty one (FuzzDecodePaymentRequiredV1, seeded with a null element).
		{"a null requirement", `{"x402Version":1,"accepts":[null]}`, DecodeWrongType, "accepts[0]"},
		{"a null requirement after a valid one", strings.Replace(doc, `}]}`, `},null]}`, 1), DecodeWrongType, "accepts[1]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecodePaymentRequiredV1([]byte(tt.doc))
			wantDecodeError(t, err, tt.kind, tt.field)
		})
	}
	p, err := DecodePaymentRequiredV1([]byte(strings.NewReplacer(`"description":"Current weather for one city",`, "", `"mimeType":"application/json",`, "").Replace(doc)))
	if err != nil || p.Accepts[0].Description != "" {
		t.Errorf("a version 1 requirement without description and mimeType = %+v, %v", p, err)
	}
}

func TestDecodersHoldTheWholeDocumentToJSONV2Rules(t *testing.T) {
	const p2 = "v2-payload-permit2.json"
	p2doc := string(readExample(t, p2))
	t.Run("duplicate names are refused in unknown members and extension values too", func(t *testing.T) {
		withExt := string(mutated(t, p2, set("extensions", map[string]any{"x": map[string]any{}})))
		for _, tt := range []struct{ doc, field string }{
			{strings.Replace(p2doc, `{`, `{"paymentId":"a","paymentId":"b",`, 1), "paymentId"},
			{strings.Replace(withExt, `"x":{}`, `"x":{"a":1,"a":2}`, 1), "extensions.x.a"},
		} {
			_, err := DecodePaymentPayload(b64([]byte(tt.doc)))
			wantDecodeError(t, err, DecodeInvalidValue, tt.field)
		}
	})
	t.Run("a lone escaped surrogate reads as U+FFFD, as encoding/json reads it", func(t *testing.T) {
		doc := strings.Replace(p2doc, `"scheme":"exact"`, `"scheme":"exact","note":"\ud800"`, 1)
		doc = strings.Replace(doc, `"name":"Stable Coin"`, `"name":"Stable\udc00Coin"`, 1)
		p, err := DecodePaymentPayload(b64([]byte(doc)))
		if err != nil || p.Accepted.Extra.Name != "Stable\uFFFDCoin" {
			t.Fatalf("name = %q, %v", p.Accepted.Extra.Name, err)
		}
	})
	t.Run("a type error after a valid version names the field", func(t *testing.T) {
		_, err := DecodeVerifyRequest(mutated(t, "verify-request-permit2.json", set("paymentRequirements.extra", []any{})))
		wantDecodeError(t, err, DecodeWrongType, "paymentRequirements.extra")
	})
}
