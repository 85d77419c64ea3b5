package caddymodule_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/x402-gateway/caddy-x402/caddymodule"
)

func TestTheX402DirectivesDiscoveryAdaptsToTheGatesDiscovery(t *testing.T) {
	schema := filepath.Join(t.TempDir(), "out.json")
	if err := os.WriteFile(schema, []byte("{\n  \"properties\": {\"tempC\": {\"type\": \"number\"}}\n}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	block := "discovery {\n\t\tdescription \"Weather by city\"\n\t\tinput_schema `{\"properties\": {\"city\": {\"type\": \"string\"}}}`\n" +
		"\t\tinput_example `{\"city\": \"Oslo\"}`\n\t\toutput_schema " + schema + "\n\t\tservice_name \"Weather Co\"\n" +
		"\t\ttags weather data\n\t\ticon https://weather.example/icon.png\n\t}"
	handlers := adaptGate(t, ":8080\nx402 /paid/* $0.002 {\n\tpay_to 0x05e11e75e11e75e11e75e11e75e11e75e11e75e1\n\t"+block+"\n}\nrespond paid\n")
	want := map[string]any{
		"description":   "Weather by city",
		"input_schema":  map[string]any{"properties": map[string]any{"city": map[string]any{"type": "string"}}},
		"input_example": map[string]any{"city": "Oslo"},
		"output_schema": map[string]any{"properties": map[string]any{"tempC": map[string]any{"type": "number"}}},
		"service_name":  "Weather Co", "tags": []any{"weather", "data"}, "icon": "https://weather.example/icon.png",
	}
	if got := handlers[0]["discovery"]; !reflect.DeepEqual(got, want) {
		t.Errorf("discovery adapts to %v, want %v", got, want)
	}
}

func TestBadDiscoveryOptionsAreRefusedNamingTheirLine(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"a schema that is not JSON", "discovery {\n\t\tinput_schema `{\"type\":`\n\t}", "discovery input_schema: not JSON"},
		{"a schema that is no object", "discovery {\n\t\toutput_schema `[1, 2]`\n\t}", "output_schema must be a JSON object"},
		{"a schema file that is not there", "discovery {\n\t\tinput_schema /nonexistent/schema.json\n\t}", "discovery input_schema"},
		{"a body type", "discovery {\n\t\tbody_type xml\n\t}", "body_type \"xml\""},
		{"a service name too long", "discovery {\n\t\tservice_name " + strings.Repeat("n", 33) + "\n\t}", "service_name"},
		{"six tags", "discovery {\n\t\ttags a b c d e f\n\t}", "tags"},
		{"an icon on localhost", "discovery {\n\t\ticon http://localhost/i.png\n\t}", "icon"},
		{"an unknown option", "discovery {\n\t\tcolour blue\n\t}", "unrecognized discovery option 'colour'"},
		{"an argument", "discovery now {\n\t}", "wrong argument count"},
		{"two descriptions in one", "discovery {\n\t\tdescription a b\n\t}", "wrong argument count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":8080\nx402 {\n\t"+tc.block+"\n}\nrespond ok\n"),
				map[string]any{"filename": "Caddyfile"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile:") {
				t.Fatalf("adapt error = %v, want one naming the line and containing %q", err, tc.want)
			}
		})
	}
}

func TestAGateInJSONWithADiscoveryItCannotDeclareIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		d    caddymodule.GateDiscovery
		want string
	}{
		{"a schema that is no object", caddymodule.GateDiscovery{OutputSchema: json.RawMessage(`"x"`)}, "output_schema must be a JSON object"},
		{"an icon with credentials", caddymodule.GateDiscovery{IconURL: "https://u:p@cdn.example/i.png"}, "icon"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &caddymodule.Gate{Settle: caddymodule.SettleAfter, Discovery: &tc.d}
			if err := g.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "discovery") {
				t.Fatalf("Validate() = %v, want it to name discovery and %q", err, tc.want)
			}
		})
	}
}
