package x402

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
)

// ExtensionBazaar is the extension under which a resource server declares its route for discovery (method,
// input, output), and a facilitator that settles its payments catalogs it.
const ExtensionBazaar = "bazaar"

// HeaderExtensionResponses is the header of a /verify or /settle answer that reports, per extension, what the
// facilitator did with it: base64 of a JSON object keyed by extension ({"bazaar": {"status": "success"}}).
const HeaderExtensionResponses = "EXTENSION-RESPONSES"

// Statuses of the bazaar extension in an EXTENSION-RESPONSES header.
const (
	BazaarStatusSuccess  = "success"
	BazaarStatusRejected = "rejected"
)

// Bounds of what a facilitator catalogs of one resource, as the SDK's facilitator sanitizes them.
const (
	MaxBazaarServiceNameLen = 32
	MaxBazaarTagLen         = 32
	MaxBazaarTags           = 5
	MaxBazaarIconURLLen     = 2048
)

// Body types of an HTTP route declared for discovery that takes a body (POST, PUT, PATCH).
const (
	BazaarBodyJSON     = "json"
	BazaarBodyFormData = "form-data"
	BazaarBodyText     = "text"
)

// BazaarHTTP is what a route declares of itself for discovery. Its JSON fields are JSON documents; empty: none.
type BazaarHTTP struct {
	// Method is the request's method: GET, HEAD and DELETE take query parameters, POST, PUT and PATCH a body.
	Method string
	// BodyType is the body's kind for a body method: "json" (the default), "form-data" or "text".
	BodyType string
	// InputExample is an example of the query parameters or of the body; InputSchema their JSON schema.
	InputExample, InputSchema json.RawMessage
	// OutputExample is an example of the response; OutputSchema its JSON schema. Either declares an output.
	OutputExample, OutputSchema json.RawMessage
}

// IsBazaarQueryMethod reports whether a route of method takes its input as query parameters (GET, HEAD, DELETE).
func IsBazaarQueryMethod(method string) bool {
	return method == "GET" || method == "HEAD" || method == "DELETE"
}

// IsBazaarBodyMethod reports whether a route of method takes its input as a body (POST, PUT, PATCH).
func IsBazaarBodyMethod(method string) bool {
	return method == "POST" || method == "PUT" || method == "PATCH"
}

// bazaarSchemaURI is the JSON Schema dialect of every declaration.
const bazaarSchemaURI = "https://json-schema.org/draft/2020-12/schema"

// BazaarDeclaration is the bazaar extension as a 402 declares it for one request of method d.Method: the
// document the SDK's declareDiscoveryExtension builds, as its server enriches it with the request's method. An
// error names a field that is not a JSON object, or a method the extension has no shape for.
func BazaarDeclaration(d BazaarHTTP) (json.RawMessage, error) {
	obj := func(field string, raw json.RawMessage, dflt map[string]any) (map[string]any, error) {
		if len(raw) == 0 {
			return dflt, nil
		}
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil || m == nil {
			return nil, fmt.Errorf("bazaar %s must be a JSON object", field)
		}
		return m, nil
	}
	inputSchema, err := obj("input schema", d.InputSchema, map[string]any{"properties": map[string]any{}})
	if err != nil {
		return nil, err
	}
	inputExample, err := obj("input example", d.InputExample, map[string]any{})
	if err != nil {
		return nil, err
	}
	outputSchema, err := obj("output schema", d.OutputSchema, nil)
	if err != nil {
		return nil, err
	}
	var outputExample any
	if len(d.OutputExample) > 0 {
		if err := json.Unmarshal(d.OutputExample, &outputExample); err != nil {
			return nil, fmt.Errorf("bazaar output example must be JSON: %w", err)
		}
	} else if outputSchema != nil {
		outputExample = map[string]any{}
	}
	input := map[string]any{"type": "http", "method": d.Method}
	inputProps := map[string]any{
		"type":   map[string]any{"type": "string", "const": "http"},
		"method": map[string]any{"type": "string", "enum": []string{d.Method}},
	}
	var required []string
	switch {
	case IsBazaarQueryMethod(d.Method):
		input["queryParams"] = inputExample
		qp := map[string]any{"type": "object"}
		for k, v := range inputSchema {
			qp[k] = v
		}
		inputProps["queryParams"] = qp
		required = []string{"type", "method"}
	case IsBazaarBodyMethod(d.Method):
		bodyType := d.BodyType
		if bodyType == "" {
			bodyType = BazaarBodyJSON
		}
		if bodyType != BazaarBodyJSON && bodyType != BazaarBodyFormData && bodyType != BazaarBodyText {
			return nil, fmt.Errorf("bazaar body type %q is not one; want %q, %q or %q", bodyType, BazaarBodyJSON, BazaarBodyFormData, BazaarBodyText)
		}
		input["bodyType"], input["body"] = bodyType, inputExample
		inputProps["bodyType"] = map[string]any{"type": "string", "enum": []string{BazaarBodyJSON, BazaarBodyFormData, BazaarBodyText}}
		inputProps["body"] = inputSchema
		required = []string{"type", "method", "bodyType", "body"}
	default:
		return nil, fmt.Errorf("bazaar declares no %s routes; want GET, HEAD, DELETE, POST, PUT or PATCH", d.Method)
	}
	info := map[string]any{"input": input}
	props := map[string]any{"input": map[string]any{
		"type": "object", "properties": inputProps, "required": required, "additionalProperties": false,
	}}
	if outputExample != nil {
		info["output"] = map[string]any{"type": "json", "example": outputExample}
		ex := map[string]any{"type": "object"}
		for k, v := range outputSchema {
			ex[k] = v
		}
		props["output"] = map[string]any{
			"type":       "object",
			"properties": map[string]any{"type": map[string]any{"type": "string"}, "example": ex},
			"required":   []string{"type"},
		}
	}
	return json.Marshal(map[string]any{
		"info":   info,
		"schema": map[string]any{"$schema": bazaarSchemaURI, "type": "object", "properties": props, "required": []string{"input"}},
	})
}

// DiscoveredResource is one resource of a facilitator's catalog, as GET /discovery/resources lists it.
type DiscoveredResource struct {
	// Resource is the resource's canonical URL: its origin and path (or route template), no query.
	Resource    string                `json:"resource"`
	Type        string                `json:"type"`
	X402Version int                   `json:"x402Version"`
	Accepts     []PaymentRequirements `json:"accepts"`
	// LastUpdated is when a payment last catalogued it, RFC 3339.
	LastUpdated string                     `json:"lastUpdated"`
	Description string                     `json:"description,omitempty"`
	MimeType    string                     `json:"mimeType,omitempty"`
	ServiceName string                     `json:"serviceName,omitempty"`
	Tags        []string                   `json:"tags,omitempty"`
	IconURL     string                     `json:"iconUrl,omitempty"`
	Extensions  map[string]json.RawMessage `json:"extensions,omitempty"`
}

// DiscoveryResourcesResponse is the answer of GET /discovery/resources.
type DiscoveryResourcesResponse struct {
	X402Version int                  `json:"x402Version"`
	Items       []DiscoveredResource `json:"items"`
	Pagination  DiscoveryPagination  `json:"pagination"`
}

// DiscoveryPagination says which page of how many matching resources a listing is.
type DiscoveryPagination struct {
	Limit  int `json:"limit"`
	Offset int `json:"offset"`
	Total  int `json:"total"`
}

// DiscoveryQuery is what a listing of a catalog asks for (GET /discovery/resources): its filters, each empty for
// any, and its page, the most recently updated resources first.
type DiscoveryQuery struct {
	// Type is "http" or "mcp"; Extension a key the resource's extensions hold.
	Type, Extension string
	// PayTo (any case), Scheme and Network must all hold of one of the resource's accepts.
	PayTo, Scheme, Network string
	// Limit is how many resources the page holds at most, Offset how many matching ones come before it.
	Limit, Offset int
}

// Matches reports whether r passes q's filters.
func (q DiscoveryQuery) Matches(r DiscoveredResource) bool {
	if q.Type != "" && r.Type != q.Type {
		return false
	}
	if q.Extension != "" {
		if _, ok := r.Extensions[q.Extension]; !ok {
			return false
		}
	}
	if q.PayTo == "" && q.Scheme == "" && q.Network == "" {
		return true
	}
	for _, a := range r.Accepts {
		if (q.PayTo == "" || strings.EqualFold(a.PayTo, q.PayTo)) && (q.Scheme == "" || a.Scheme == q.Scheme) &&
			(q.Network == "" || a.Network == q.Network) {
			return true
		}
	}
	return false
}

// ErrNoBazaar is DiscoverResource's answer for a payment that declares nothing for discovery.
var ErrNoBazaar = errors.New("the payment carries no bazaar extension")

// DiscoverResource is what a facilitator catalogs of a version 2 payment whose payload echoes a bazaar
// declaration: its resource and how to call it, as the SDK's facilitator extracts it. Only the bazaar extension
// is kept of the payload's extensions: the others are the payer's (signatures, ids), never a catalog's. The
// error is ErrNoBazaar when there is nothing to catalog, else it says why the declaration is rejected.
func DiscoverResource(req VerifyRequest) (DiscoveredResource, error) {
	p := req.PaymentPayload
	raw, ok := p.Extensions[ExtensionBazaar]
	if !ok || p.X402Version != Version2 {
		return DiscoveredResource{}, ErrNoBazaar
	}
	var ext struct {
		Info          map[string]json.RawMessage `json:"info"`
		Schema        json.RawMessage            `json:"schema"`
		RouteTemplate *string                    `json:"routeTemplate"`
	}
	if err := json.Unmarshal(raw, &ext); err != nil {
		return DiscoveredResource{}, fmt.Errorf("extensions.bazaar must be {\"info\": {...}, \"schema\": {...}}: %w", err)
	}
	typ, err := checkBazaarInfo(ext.Info)
	if err != nil {
		return DiscoveredResource{}, err
	}
	if err := checkBazaarSchema(ext.Schema); err != nil {
		return DiscoveredResource{}, err
	}
	if p.Resource == nil || p.Resource.URL == "" {
		return DiscoveredResource{}, errors.New("the payment names no resource.url to catalog")
	}
	u, err := url.Parse(p.Resource.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return DiscoveredResource{}, fmt.Errorf("resource.url %q is not an absolute http(s) URL", p.Resource.URL)
	}
	path := u.EscapedPath()
	if ext.RouteTemplate != nil && validRouteTemplate(*ext.RouteTemplate) {
		path = *ext.RouteTemplate
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, raw); err != nil {
		return DiscoveredResource{}, fmt.Errorf("extensions.bazaar: %w", err)
	}
	d := DiscoveredResource{
		Resource: u.Scheme + "://" + u.Host + path, Type: typ, X402Version: p.X402Version,
		Accepts:     []PaymentRequirements{req.PaymentRequirements},
		Description: p.Resource.Description, MimeType: p.Resource.MimeType,
		Extensions: map[string]json.RawMessage{ExtensionBazaar: compact.Bytes()},
	}
	if validServiceName(p.Resource.ServiceName) {
		d.ServiceName = p.Resource.ServiceName
	}
	d.Tags = sanitizeTags(p.Resource.Tags)
	if validIconURL(p.Resource.IconURL) {
		d.IconURL = p.Resource.IconURL
	}
	return d, nil
}

// checkBazaarInfo checks a declaration's info as the SDK's facilitator does before cataloging, and returns its
// input type ("http" or "mcp").
func checkBazaarInfo(info map[string]json.RawMessage) (string, error) {
	if info == nil {
		return "", errors.New("extensions.bazaar.info is missing or not an object")
	}
	var input struct {
		Type        string          `json:"type"`
		Method      *string         `json:"method"`
		BodyType    *string         `json:"bodyType"`
		ToolName    string          `json:"toolName"`
		InputSchema json.RawMessage `json:"inputSchema"`
		Transport   *string         `json:"transport"`
	}
	if raw, ok := info["input"]; !ok || json.Unmarshal(raw, &input) != nil {
		return "", errors.New("extensions.bazaar.info.input is missing or not an object")
	}
	switch input.Type {
	case "http":
		if input.Method != nil && !IsBazaarQueryMethod(*input.Method) && !IsBazaarBodyMethod(*input.Method) {
			return "", fmt.Errorf("extensions.bazaar.info.input.method %q is not GET, HEAD, DELETE, POST, PUT or PATCH", *input.Method)
		}
		if input.BodyType != nil {
			if b := *input.BodyType; b != BazaarBodyJSON && b != BazaarBodyFormData && b != BazaarBodyText {
				return "", fmt.Errorf("extensions.bazaar.info.input.bodyType %q is not json, form-data or text", b)
			}
			if input.Method != nil && !IsBazaarBodyMethod(*input.Method) {
				return "", fmt.Errorf("extensions.bazaar.info.input.bodyType is set but method %q takes no body", *input.Method)
			}
		}
	case "mcp":
		if input.ToolName == "" {
			return "", errors.New("extensions.bazaar.info.input.toolName is required for an mcp tool")
		}
		if !isJSONObject(input.InputSchema) {
			return "", errors.New("extensions.bazaar.info.input.inputSchema is required for an mcp tool and must be an object")
		}
		if t := input.Transport; t != nil && *t != "streamable-http" && *t != "sse" {
			return "", fmt.Errorf("extensions.bazaar.info.input.transport %q is not streamable-http or sse", *t)
		}
	default:
		return "", fmt.Errorf("extensions.bazaar.info.input.type must be \"http\" or \"mcp\", got %q", input.Type)
	}
	return input.Type, nil
}

// checkBazaarSchema checks a declaration's schema: a JSON object that refers to nothing outside itself (a
// catalog never fetches a schema from a URL a payer chose).
func checkBazaarSchema(schema json.RawMessage) error {
	if !isJSONObject(schema) {
		return errors.New("extensions.bazaar.schema is missing or not an object")
	}
	var doc any
	if err := json.Unmarshal(schema, &doc); err != nil {
		return fmt.Errorf("extensions.bazaar.schema: %w", err)
	}
	if externalSchemaReference(doc) {
		return errors.New("extensions.bazaar.schema must not contain external $ref/$id references")
	}
	return nil
}

// externalSchemaReference reports whether a schema has a $ref or $id that is not a fragment of itself.
func externalSchemaReference(node any) bool {
	switch n := node.(type) {
	case []any:
		for _, v := range n {
			if externalSchemaReference(v) {
				return true
			}
		}
	case map[string]any:
		for k, v := range n {
			if k == "$ref" || k == "$id" {
				if s, ok := v.(string); !ok || !strings.HasPrefix(s, "#") {
					return true
				}
			}
			if externalSchemaReference(v) {
				return true
			}
		}
	}
	return false
}

func isJSONObject(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && raw[0] == '{' && json.Valid(raw)
}

// routeTemplateRE is the shape of a route template a catalog keys a dynamic route by.
var routeTemplateRE = regexp.MustCompile(`^/[a-zA-Z0-9_/:.\-~%]+$`)

// validRouteTemplate reports whether a declaration's routeTemplate may stand for the resource's path: a path of
// safe characters that, decoded, climbs no directory and names no other origin.
func validRouteTemplate(s string) bool {
	if !routeTemplateRE.MatchString(s) {
		return false
	}
	decoded := s
	for range 5 {
		next, err := url.PathUnescape(decoded)
		if err != nil {
			return false
		}
		if next == decoded {
			return !strings.Contains(decoded, "..") && !strings.Contains(decoded, "://")
		}
		decoded = next
	}
	return false
}

// numericHostRE matches a host that is an IPv4 address or a number a resolver would read as one.
var numericHostRE = regexp.MustCompile(`^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}$|^\d+$|^0x[0-9a-f]+$`)

// printableASCII reports whether s is one or more printable ASCII characters.
func printableASCII(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func validServiceName(s string) bool {
	return len(s) <= MaxBazaarServiceNameLen && printableASCII(s)
}

// sanitizeTags keeps the first MaxBazaarTags distinct (case-insensitively) printable tags of up to
// MaxBazaarTagLen characters.
func sanitizeTags(tags []string) []string {
	var out []string
	seen := map[string]bool{}
	for _, t := range tags {
		if len(t) > MaxBazaarTagLen || !printableASCII(t) || seen[strings.ToLower(t)] {
			continue
		}
		seen[strings.ToLower(t)] = true
		out = append(out, t)
		if len(out) == MaxBazaarTags {
			break
		}
	}
	return out
}

// validIconURL reports whether s may be listed as a service's icon: an http(s) URL without credentials whose
// host is a name, not a loopback name or an IP literal.
func validIconURL(s string) bool {
	if len(s) == 0 || len(s) > MaxBazaarIconURLLen || !printableASCII(s) {
		return false
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.User != nil || strings.HasPrefix(u.Host, "[") {
		return false
	}
	host := strings.ToLower(u.Hostname())
	switch {
	case host == "", host == "localhost", host == "localhost.localdomain", host == "ip6-localhost", host == "ip6-loopback":
		return false
	case numericHostRE.MatchString(host):
		return false
	}
	return true
}

// CheckBazaarServiceName says what is wrong with a service name a route declares for discovery.
func CheckBazaarServiceName(s string) error {
	if !validServiceName(s) {
		return fmt.Errorf("service name %q must be 1 to %d printable ASCII characters", s, MaxBazaarServiceNameLen)
	}
	return nil
}

// CheckBazaarTags says what is wrong with the tags a route declares for discovery.
func CheckBazaarTags(tags []string) error {
	if len(tags) > MaxBazaarTags {
		return fmt.Errorf("%d tags; a catalog lists at most %d", len(tags), MaxBazaarTags)
	}
	for _, t := range tags {
		if len(t) > MaxBazaarTagLen || !printableASCII(t) {
			return fmt.Errorf("tag %q must be 1 to %d printable ASCII characters", t, MaxBazaarTagLen)
		}
	}
	return nil
}

// CheckBazaarIconURL says what is wrong with the icon URL a route declares for discovery.
func CheckBazaarIconURL(s string) error {
	if !validIconURL(s) {
		return fmt.Errorf("icon %q must be an http(s) URL of a host name (no credentials, no IP address, no localhost), at most %d characters", s, MaxBazaarIconURLLen)
	}
	return nil
}

// isZero reports whether r describes nothing (a document without its resource object).
func (r ResourceInfo) isZero() bool {
	return r.URL == "" && r.Description == "" && r.MimeType == "" && r.ServiceName == "" && len(r.Tags) == 0 && r.IconURL == ""
}
