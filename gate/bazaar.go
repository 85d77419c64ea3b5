package gate

import (
	"encoding/json"
	"fmt"
	"maps"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Discovery is what a route declares of itself for discovery (the bazaar extension): the 402 of each request
// carries the declaration for the request's method, and a facilitator that settles a payment echoing it
// catalogs the route. Schemas and examples are JSON documents; empty: none.
type Discovery struct {
	// Description, when set, is the resource's description in the 402 (and the catalog) in place of the
	// route's.
	Description string
	// InputSchema is the JSON schema of the query parameters (GET, HEAD, DELETE) or of the body (POST, PUT,
	// PATCH); InputExample an example of them.
	InputSchema, InputExample json.RawMessage
	// BodyType is the body's kind for a body method: "json" (the default), "form-data" or "text".
	BodyType string
	// OutputSchema is the JSON schema of the response; OutputExample an example of it. Either declares an
	// output.
	OutputSchema, OutputExample json.RawMessage
	// ServiceName, Tags and IconURL describe the service in the catalog.
	ServiceName string
	Tags        []string
	IconURL     string
}

// CheckDiscovery says what is wrong with a route's Discovery, naming the option: a schema or example that is
// not a JSON object (an output example may be any JSON), a body type, service name, tag or icon a catalog
// would not keep.
func CheckDiscovery(d *Discovery) error {
	if d == nil {
		return nil
	}
	for _, f := range []struct {
		name string
		doc  json.RawMessage
		any  bool
	}{{"input_schema", d.InputSchema, false}, {"input_example", d.InputExample, false}, {"output_schema", d.OutputSchema, false}, {"output_example", d.OutputExample, true}} {
		if len(f.doc) == 0 {
			continue
		}
		var v any
		if err := json.Unmarshal(f.doc, &v); err != nil {
			return fmt.Errorf("discovery %s is not JSON: %w", f.name, err)
		}
		if _, ok := v.(map[string]any); !ok && !f.any {
			return fmt.Errorf("discovery %s must be a JSON object, got %s", f.name, f.doc)
		}
	}
	switch d.BodyType {
	case "", x402.BazaarBodyJSON, x402.BazaarBodyFormData, x402.BazaarBodyText:
	default:
		return fmt.Errorf("discovery body_type %q is not one; want %q, %q or %q", d.BodyType, x402.BazaarBodyJSON, x402.BazaarBodyFormData, x402.BazaarBodyText)
	}
	if d.ServiceName != "" {
		if err := x402.CheckBazaarServiceName(d.ServiceName); err != nil {
			return fmt.Errorf("discovery service_name: %w", err)
		}
	}
	if err := x402.CheckBazaarTags(d.Tags); err != nil {
		return fmt.Errorf("discovery tags: %w", err)
	}
	if d.IconURL != "" {
		if err := x402.CheckBazaarIconURL(d.IconURL); err != nil {
			return fmt.Errorf("discovery icon: %w", err)
		}
	}
	return nil
}

// declareDiscovery adds the bazaar declaration for this request's method to a 402's extensions; a method the
// extension has no shape for (OPTIONS, say) declares nothing.
func (x *exchange) declareDiscovery(ext map[string]json.RawMessage) {
	d := x.g.cfg.Discovery
	decl, err := x402.BazaarDeclaration(x402.BazaarHTTP{
		Method: x.r.Method, BodyType: d.BodyType, InputExample: d.InputExample, InputSchema: d.InputSchema,
		OutputExample: d.OutputExample, OutputSchema: d.OutputSchema,
	})
	if err == nil {
		ext[x402.ExtensionBazaar] = decl
	}
}

// describeForDiscovery adds what the route declares for discovery to the 402's resource. It is not part of what
// a payment's record says the resource was (describedKey): a reload that retunes discovery alone must not turn
// away a payer presenting again a payment whose response was cut short.
func (x *exchange) describeForDiscovery(info x402.ResourceInfo) x402.ResourceInfo {
	d := x.g.cfg.Discovery
	if d == nil {
		return info
	}
	if d.Description != "" {
		info.Description = d.Description
	}
	info.ServiceName, info.Tags, info.IconURL = d.ServiceName, d.Tags, d.IconURL
	return info
}

// declaredPayload is a version 2 payload as the gate sends it to its facilitator: its resource and its bazaar
// declaration are the gate's own, for this request, in place of what the payer echoed. A facilitator catalogs a
// route from the payload it settles, which the payer writes: echoed as they came, a payer could have our
// facilitator list our route under any URL, description or schema, or list a route of ours that declares
// nothing. The payer's signature covers neither (it signs the payload's payload), so nothing it signed changes.
// A gas-sponsoring extension the route does not declare (gas_sponsoring) is left out too: the facilitator would
// spend gas on it (fund the payer's approval, send its permit) on a route whose operator sponsors none.
func (x *exchange) declaredPayload(p x402.PaymentPayload) x402.PaymentPayload {
	if p.X402Version != x402.Version2 {
		return p
	}
	info := x.describeForDiscovery(x.resource())
	p.Resource = &info
	own := map[string]json.RawMessage{}
	if x.g.cfg.Discovery != nil {
		x.declareDiscovery(own)
	}
	_, echoed := p.Extensions[x402.ExtensionBazaar]
	undeclared := x.undeclaredGasSponsoring(p.Extensions) // sponsoring.go
	if own[x402.ExtensionBazaar] == nil && !echoed && len(undeclared) == 0 {
		return p
	}
	ext := make(map[string]json.RawMessage, len(p.Extensions)+1)
	maps.Copy(ext, p.Extensions)
	delete(ext, x402.ExtensionBazaar)
	if decl := own[x402.ExtensionBazaar]; decl != nil {
		ext[x402.ExtensionBazaar] = decl
	}
	for _, n := range undeclared {
		delete(ext, n)
	}
	p.Extensions = ext
	return p
}
