package x402_test

import (
	"encoding/json"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// BazaarDeclaration builds what @x402/extensions 2.27's declareDiscoveryExtension declares, as its server
// enriches it with the request's method (testdata/bazaar-sdk-vectors.json, written by
// e2e/interop/bazaar-vectors.mjs).
func TestBazaarDeclarationIsTheSDKsDeclaration(t *testing.T) {
	b, err := os.ReadFile("testdata/bazaar-sdk-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var vectors []struct {
		Name   string
		Method string
		Config struct {
			BodyType    string          `json:"bodyType"`
			Input       json.RawMessage `json:"input"`
			InputSchema json.RawMessage `json:"inputSchema"`
			Output      struct {
				Example json.RawMessage `json:"example"`
				Schema  json.RawMessage `json:"schema"`
			} `json:"output"`
		}
		Declaration json.RawMessage
	}
	if err := json.Unmarshal(b, &vectors); err != nil {
		t.Fatal(err)
	}
	for _, v := range vectors {
		got, err := x402.BazaarDeclaration(x402.BazaarHTTP{Method: v.Method, BodyType: v.Config.BodyType,
			InputExample: v.Config.Input, InputSchema: v.Config.InputSchema,
			OutputExample: v.Config.Output.Example, OutputSchema: v.Config.Output.Schema})
		if err != nil {
			t.Errorf("%s: %v", v.Name, err)
			continue
		}
		var a, w any
		json.Unmarshal(got, &a)
		json.Unmarshal(v.Declaration, &w)
		if !reflect.DeepEqual(a, w) {
			t.Errorf("%s:\n got %s\nwant %s", v.Name, got, v.Declaration)
		}
	}
}

// A declaration of a method the extension has no shape for, or of a schema that is no object, is refused
// naming what is wrong.
func TestBazaarDeclarationRefusesWhatTheExtensionCannotSay(t *testing.T) {
	for _, c := range []struct {
		d    x402.BazaarHTTP
		want string
	}{
		{x402.BazaarHTTP{Method: "OPTIONS"}, "OPTIONS"},
		{x402.BazaarHTTP{Method: "GET", InputSchema: json.RawMessage(`[1]`)}, "input schema"},
		{x402.BazaarHTTP{Method: "POST", BodyType: "xml"}, "body type"},
	} {
		if _, err := x402.BazaarDeclaration(c.d); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("BazaarDeclaration(%+v) = %v, want an error naming %q", c.d, err, c.want)
		}
	}
}

// What a facilitator catalogs of a payment: the resource's origin and path (or a safe route template), the bazaar
// extension alone of the payload's, and nothing of a declaration the spec's checks refuse.
func TestDiscoverResourceKeepsTheDeclarationAloneAndRefusesWhatTheSpecRefuses(t *testing.T) {
	decl, _ := x402.BazaarDeclaration(x402.BazaarHTTP{Method: "GET"})
	req := func(bazaar string, resource string) x402.VerifyRequest {
		return x402.VerifyRequest{X402Version: 2, PaymentPayload: x402.PaymentPayload{X402Version: 2,
			Resource: &x402.ResourceInfo{URL: resource, ServiceName: "bad\x01name", Tags: []string{"a", "A", strings.Repeat("t", 33), "b"}, IconURL: "http://127.0.0.1/i.png"},
			Extensions: map[string]json.RawMessage{x402.ExtensionBazaar: json.RawMessage(bazaar),
				"eip2612GasSponsoring": json.RawMessage(`{"info":{"signature":"0xsecret"}}`)}}}
	}
	d, err := x402.DiscoverResource(req(string(decl), "https://user:pw@api.example:8443/users/7?key=secret"))
	if err != nil {
		t.Fatal(err)
	}
	if d.Resource != "https://api.example:8443/users/7" || len(d.Extensions) != 1 || d.ServiceName != "" || d.IconURL != "" ||
		!reflect.DeepEqual(d.Tags, []string{"a", "b"}) {
		t.Errorf("DiscoverResource = %+v; want the origin and path without credentials or query, bazaar alone, the metadata sanitized", d)
	}
	withTemplate := strings.Replace(string(decl), `{"info"`, `{"routeTemplate":"/users/:id","info"`, 1)
	if d, _ := x402.DiscoverResource(req(withTemplate, "https://api.example/users/7")); d.Resource != "https://api.example/users/:id" {
		t.Errorf("with a route template the resource is %q, want https://api.example/users/:id", d.Resource)
	}
	climbing := strings.Replace(string(decl), `{"info"`, `{"routeTemplate":"/a/%2e%2e/admin","info"`, 1)
	if d, _ := x402.DiscoverResource(req(climbing, "https://api.example/users/7")); d.Resource != "https://api.example/users/7" {
		t.Errorf("a climbing route template made the resource %q; want the payment's path", d.Resource)
	}
	for _, c := range []struct{ bazaar, resource, want string }{
		{`{"info":{"input":{"type":"ftp"}},"schema":{}}`, "https://a.example/", "info.input.type"},
		{`{"info":{"input":{"type":"http","method":"TRACE"}},"schema":{}}`, "https://a.example/", "method"},
		{`{"info":{"input":{"type":"http","method":"GET","bodyType":"json"}},"schema":{}}`, "https://a.example/", "bodyType"},
		{`{"info":{"input":{"type":"mcp"}},"schema":{}}`, "https://a.example/", "toolName"},
		{`{"info":{"input":{"type":"http"}},"schema":{"$ref":"https://evil.example/s.json"}}`, "https://a.example/", "$ref"},
		{`{"info":{"input":{"type":"http"}}}`, "https://a.example/", "schema"},
		{`"x"`, "https://a.example/", "extensions.bazaar"},
		{string(decl), "ftp://a.example/", "resource.url"},
	} {
		if _, err := x402.DiscoverResource(req(c.bazaar, c.resource)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("DiscoverResource(%s, %s) = %v; want an error naming %q", c.bazaar, c.resource, err, c.want)
		}
	}
}
