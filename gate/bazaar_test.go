package gate_test

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// sdkDeclaration is the declaration @x402/extensions 2.27 makes of the vector named name
// (x402/testdata/bazaar-sdk-vectors.json).
func sdkDeclaration(t *testing.T, name string) any {
	t.Helper()
	b, err := os.ReadFile("../x402/testdata/bazaar-sdk-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var vectors []struct {
		Name        string
		Declaration any
	}
	if err := json.Unmarshal(b, &vectors); err != nil {
		t.Fatal(err)
	}
	for _, v := range vectors {
		if v.Name == name {
			return v.Declaration
		}
	}
	t.Fatalf("no vector %q", name)
	return nil
}

// A gate with discovery declares its route in the 402's extensions.bazaar exactly as the SDK's server declares
// it for the request's method, and describes the service in the 402's resource.
func TestAGateDeclaresDiscoveryInIts402AsTheSDKsServerDoes(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) {
		c.Description = "the route's own description"
		c.Discovery = &gate.Discovery{
			Description:   "Weather by city",
			InputExample:  json.RawMessage(`{"city":"Oslo"}`),
			InputSchema:   json.RawMessage(`{"properties":{"city":{"type":"string"}},"required":["city"]}`),
			OutputExample: json.RawMessage(`{"tempC":4}`),
			OutputSchema:  json.RawMessage(`{"properties":{"tempC":{"type":"number"}}}`),
			ServiceName:   "Weather Co", Tags: []string{"weather", "data"}, IconURL: "https://weather.example/icon.png",
		}
	}})
	pr, err := x402.DecodePaymentRequired(e.get().header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatal(err)
	}
	var got any
	if err := json.Unmarshal(pr.Extensions[x402.ExtensionBazaar], &got); err != nil {
		t.Fatalf("extensions = %s: %v; want bazaar", pr.Extensions, err)
	}
	if want := sdkDeclaration(t, "GET with an input and an output"); !reflect.DeepEqual(got, want) {
		t.Errorf("bazaar = %s\nwant the SDK's %v", pr.Extensions[x402.ExtensionBazaar], want)
	}
	if r := pr.Resource; r.Description != "Weather by city" || r.ServiceName != "Weather Co" || !reflect.DeepEqual(r.Tags, []string{"weather", "data"}) ||
		r.IconURL != "https://weather.example/icon.png" {
		t.Errorf("resource = %+v; want the discovery's description, service name, tags and icon", r)
	}

	// A POST declares the body shape, with the request's method.
	resp, err := http.Post(e.srv.URL+"/report", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	pr, err = x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatal(err)
	}
	var post struct {
		Info struct {
			Input struct {
				Method, BodyType string
			}
		}
	}
	if json.Unmarshal(pr.Extensions[x402.ExtensionBazaar], &post); post.Info.Input.Method != "POST" || post.Info.Input.BodyType != "json" {
		t.Errorf("a POST's bazaar = %s; want method POST, bodyType json", pr.Extensions[x402.ExtensionBazaar])
	}
}

// A discovery the extension cannot say is refused when the gate is built, naming the option.
func TestAGateRefusesADiscoveryItCannotDeclare(t *testing.T) {
	e := newEnv(t, setup{})
	for _, c := range []struct {
		d    gate.Discovery
		want string
	}{
		{gate.Discovery{InputSchema: json.RawMessage(`{"type":`)}, "input_schema is not JSON"},
		{gate.Discovery{OutputSchema: json.RawMessage(`[1]`)}, "output_schema must be a JSON object"},
		{gate.Discovery{BodyType: "xml"}, "body_type"},
		{gate.Discovery{ServiceName: strings.Repeat("n", 33)}, "service_name"},
		{gate.Discovery{Tags: []string{"a", "b", "c", "d", "e", "f"}}, "tags"},
		{gate.Discovery{IconURL: "http://localhost/i.png"}, "icon"},
		{gate.Discovery{IconURL: "https://user:pw@cdn.example/i.png"}, "icon"},
	} {
		cfg := e.cfg
		cfg.Discovery = &c.d
		if _, err := gate.New(cfg, e.fac, e.store, "test"); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New with discovery %+v = %v; want an error naming %q", c.d, err, c.want)
		}
	}
}
