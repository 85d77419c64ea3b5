package x402

import (
	"encoding/json"
	"reflect"
	"testing"
)

func TestMergeExtensionKeepsWhatTheServerDeclaredAndAddsTheClientsFields(t *testing.T) {
	cases := []struct {
		name, declared, added, want string
	}{
		{"a gas-sponsoring echo keeps the declared info and schema",
			`{"info":{"description":"sponsored","version":"1"},"schema":{"type":"object"}}`,
			`{"info":{"from":"0xa","signature":"0xs","version":"1"}}`,
			`{"info":{"description":"sponsored","version":"1","from":"0xa","signature":"0xs"},"schema":{"type":"object"}}`},
		{"the server's value wins where both set a field", `{"info":{"version":"1"}}`, `{"info":{"version":"2","nonce":"7"}}`,
			`{"info":{"version":"1","nonce":"7"}}`},
		{"nothing declared", ``, `{"info":{"a":1}}`, `{"info":{"a":1}}`},
		{"nothing added", `{"info":{"a":1}}`, ``, `{"info":{"a":1}}`},
		{"a declaration that is not an object is replaced", `"x"`, `{"info":{"a":1}}`, `{"info":{"a":1}}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MergeExtension(json.RawMessage(tc.declared), json.RawMessage(tc.added))
			if err != nil {
				t.Fatal(err)
			}
			var g, w any
			if err := json.Unmarshal(got, &g); err != nil {
				t.Fatalf("merged %s is not JSON: %v", got, err)
			}
			if err := json.Unmarshal([]byte(tc.want), &w); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(g, w) {
				t.Fatalf("merged %s, want %s", got, tc.want)
			}
		})
	}
	if _, err := MergeExtension(json.RawMessage(`{"info":`), json.RawMessage(`{}`)); err == nil {
		t.Fatal("a declaration that is not JSON merged without an error")
	}
}
