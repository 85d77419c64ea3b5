package caddymodule

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/x402-gateway/caddy-x402/gate"
)

// GateDiscovery is what a gate declares of its route for discovery (the bazaar extension). The method and URL
// are the request's, as the SDK's servers declare them.
type GateDiscovery struct {
	// Description is the resource's description in the 402 and the catalog; default: the gate's description.
	Description string `json:"description,omitempty"`
	// InputSchema is the JSON schema of the query parameters (GET, HEAD, DELETE) or of the body (POST, PUT,
	// PATCH); InputExample an example of them.
	InputSchema  json.RawMessage `json:"input_schema,omitempty"`
	InputExample json.RawMessage `json:"input_example,omitempty"`
	// BodyType is the body's kind for a body method: "json" (the default), "form-data" or "text".
	BodyType string `json:"body_type,omitempty"`
	// OutputSchema is the JSON schema of the response; OutputExample an example of it.
	OutputSchema  json.RawMessage `json:"output_schema,omitempty"`
	OutputExample json.RawMessage `json:"output_example,omitempty"`
	// ServiceName names the service in the catalog (1 to 32 printable ASCII characters).
	ServiceName string `json:"service_name,omitempty"`
	// Tags are up to 5 topics of the service (each up to 32 printable ASCII characters).
	Tags []string `json:"tags,omitempty"`
	// IconURL is an http(s) URL of the service's icon.
	IconURL string `json:"icon,omitempty"`
}

// core is the gate core's Discovery of d; nil for nil.
func (d *GateDiscovery) core() *gate.Discovery {
	if d == nil {
		return nil
	}
	return &gate.Discovery{
		Description: d.Description, InputSchema: d.InputSchema, InputExample: d.InputExample, BodyType: d.BodyType,
		OutputSchema: d.OutputSchema, OutputExample: d.OutputExample, ServiceName: d.ServiceName, Tags: d.Tags, IconURL: d.IconURL,
	}
}

// unmarshalDiscovery reads a gate's discovery block; a bad value is refused naming its line.
func (g *Gate) unmarshalDiscovery(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	disc := &GateDiscovery{}
	one := func() (string, error) {
		var v string
		if !d.AllArgs(&v) {
			return "", d.ArgErr()
		}
		return v, nil
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		switch opt {
		case "description", "body_type", "service_name", "icon":
			v, err := one()
			if err != nil {
				return err
			}
			switch opt {
			case "description":
				disc.Description = v
			case "body_type":
				disc.BodyType = v
			case "service_name":
				disc.ServiceName = v
			case "icon":
				disc.IconURL = v
			}
		case "tags":
			tags := d.RemainingArgs()
			if len(tags) == 0 {
				return d.ArgErr()
			}
			disc.Tags = append(disc.Tags, tags...)
		case "input_schema", "input_example", "output_schema", "output_example":
			v, err := one()
			if err != nil {
				return err
			}
			doc, err := jsonOrFile(v)
			if err != nil {
				return d.Errf("discovery %s: %v", opt, err)
			}
			switch opt {
			case "input_schema":
				disc.InputSchema = doc
			case "input_example":
				disc.InputExample = doc
			case "output_schema":
				disc.OutputSchema = doc
			case "output_example":
				disc.OutputExample = doc
			}
			if err := gate.CheckDiscovery(disc.core()); err != nil {
				return d.Err(err.Error())
			}
		default:
			return d.Errf("unrecognized discovery option '%s'", opt)
		}
	}
	if err := gate.CheckDiscovery(disc.core()); err != nil {
		return d.Err(err.Error())
	}
	g.Discovery = disc
	return nil
}

// jsonOrFile is v when it reads as JSON (a document in backticks or quotes, starting with '{' or '['), else the
// contents of the file v names, which must be JSON.
func jsonOrFile(v string) (json.RawMessage, error) {
	doc := []byte(v)
	if t := strings.TrimSpace(v); !strings.HasPrefix(t, "{") && !strings.HasPrefix(t, "[") {
		b, err := os.ReadFile(v)
		if err != nil {
			return nil, err
		}
		doc = b
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, doc); err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	return buf.Bytes(), nil
}
