package x402

import (
	"encoding/json"
	"strings"
	"testing"
)

func withPaymentIdentifier(ext string) PaymentPayload {
	if ext == "" {
		return PaymentPayload{}
	}
	return PaymentPayload{Extensions: map[string]json.RawMessage{ExtensionPaymentIdentifier: json.RawMessage(ext)}}
}

func TestPaymentIdentifierIsReadAsTheSDKWritesIt(t *testing.T) {
	long := strings.Repeat("a", 128)
	for _, tc := range []struct {
		name, ext, want, problem string
	}{
		{name: "no extension", ext: "", want: ""},
		{name: "declaration echoed without an id", ext: `{"info":{"required":false},"schema":{}}`, want: ""},
		{name: "the SDK's id", ext: `{"info":{"required":false,"id":"pay_7d5d747be160e280504c099d984bcfe0"},"schema":{}}`,
			want: "pay_7d5d747be160e280504c099d984bcfe0"},
		{name: "128 characters", ext: `{"info":{"id":"` + long + `"}}`, want: long},
		{name: "16 characters", ext: `{"info":{"id":"abcdefghij-_0123"}}`, want: "abcdefghij-_0123"},
		{name: "15 characters", ext: `{"info":{"id":"abcdefghij-_012"}}`, problem: "info.id must be 16 to 128 characters, got 15"},
		{name: "129 characters", ext: `{"info":{"id":"` + long + `b"}}`, problem: "got 129"},
		{name: "a dot", ext: `{"info":{"id":"abcdefghij.0123456"}}`, problem: `byte 10 is '.'`},
		{name: "not ASCII", ext: `{"info":{"id":"abcdefghijé0123456"}}`, problem: "may hold only letters"},
		{name: "a number", ext: `{"info":{"id":1234567890123456789}}`, problem: "extensions.payment-identifier must be"},
		{name: "no info", ext: `{"id":"abcdefghij0123456"}`, problem: "has no info object"},
		{name: "info not an object", ext: `{"info":"abcdefghij0123456"}`, problem: "must be"},
		{name: "ID in other case is no id", ext: `{"info":{"ID":"x"}}`, want: ""},
		{name: "duplicate id", ext: `{"info":{"id":"abcdefghij0123456","id":"zzzzzzzzzzzzzzzzz"}}`, problem: "must be"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := withPaymentIdentifier(tc.ext).PaymentIdentifier()
			if tc.problem != "" {
				if err == nil || !strings.Contains(err.Error(), tc.problem) {
					t.Fatalf("PaymentIdentifier() = %q, %v; want an error containing %q", got, err, tc.problem)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("PaymentIdentifier() = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestPaymentIdentifierDeclarationIsTheSDKs(t *testing.T) {
	var d struct {
		Info   map[string]any `json:"info"`
		Schema struct {
			Properties map[string]map[string]any `json:"properties"`
			Required   []string                  `json:"required"`
		} `json:"schema"`
	}
	if err := json.Unmarshal(PaymentIdentifierDeclaration(true), &d); err != nil {
		t.Fatal(err)
	}
	if d.Info["required"] != true || len(d.Info) != 1 {
		t.Fatalf("info = %v, want {required: true}", d.Info)
	}
	id := d.Schema.Properties["id"]
	if id["minLength"] != 16.0 || id["maxLength"] != 128.0 || id["pattern"] != "^[a-zA-Z0-9_-]+$" {
		t.Fatalf("schema id = %v", id)
	}
	if len(d.Schema.Required) != 1 || d.Schema.Required[0] != "required" {
		t.Fatalf("schema required = %v", d.Schema.Required)
	}
}

// FuzzPaymentIdentifier checks that whatever the extension holds, an id read from it is one CheckPaymentIdentifier
// accepts and an error names the extension.
func FuzzPaymentIdentifier(f *testing.F) {
	for _, s := range []string{`{"info":{"id":"pay_7d5d747be160e280504c099d984bcfe0"}}`, `{"info":{}}`, `{"info":{"id":null}}`,
		`{"info":{"id":"` + strings.Repeat("z", 129) + `"}}`, `[]`, `null`, `{"info":{"id":"\u0000aaaaaaaaaaaaaaaaaa"}}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, ext string) {
		id, err := withPaymentIdentifier(ext).PaymentIdentifier()
		if err != nil {
			if id != "" || !strings.Contains(err.Error(), "extensions.payment-identifier") {
				t.Fatalf("PaymentIdentifier(%q) = %q, %v", ext, id, err)
			}
			return
		}
		if id != "" && CheckPaymentIdentifier(id) != nil {
			t.Fatalf("PaymentIdentifier(%q) = %q, which CheckPaymentIdentifier refuses", ext, id)
		}
	})
}
