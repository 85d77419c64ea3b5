package facilitatorserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// EndpointDiscoveryResources is the catalog's endpoint, GET /discovery/resources (the last two segments).
const EndpointDiscoveryResources = "discovery/resources"

// Bounds of the catalog's listing and of what one resource may take in it.
const (
	// DefaultDiscoveryLimit is the page size of a listing that names no limit; MaxDiscoveryLimit the largest.
	DefaultDiscoveryLimit = 20
	MaxDiscoveryLimit     = 100
	// MaxDiscoveryEntryBytes is the most one catalogued resource takes, as JSON: a larger declaration is rejected.
	MaxDiscoveryEntryBytes = 16 << 10
	// DefaultDiscoveryEntries is how many resources a catalog keeps when Options.DiscoveryEntries says nothing.
	DefaultDiscoveryEntries = 1000
)

// Catalog is where a server keeps the resources it settled payments for (the bazaar extension): one entry per
// resource, the latest declaration winning, the oldest evicted beyond a bound.
type Catalog interface {
	// Add writes r as its resource's entry, now, keeping at most maxEntries entries.
	Add(ctx context.Context, r x402.DiscoveredResource, maxEntries int) error
	// List returns the catalog, the most recently updated first.
	List(ctx context.Context) ([]x402.DiscoveredResource, error)
}

// bazaarResponse is the bazaar key of an EXTENSION-RESPONSES header.
type bazaarResponse struct {
	Status         string `json:"status"`
	RejectedReason string `json:"rejectedReason,omitempty"`
}

// catalog returns where the server catalogs, or nil while there is no such place (yet).
func (s *Server) catalog() Catalog {
	if s.opts.Catalog == nil {
		return nil
	}
	return s.opts.Catalog()
}

// catalogSettled catalogs the resource of a payment that settled, when its payload declares it for discovery,
// and returns the EXTENSION-RESPONSES header that says so ("" when the payment declares nothing, or the server
// keeps no catalog). A payment that did not settle is never catalogued: the caller calls this on success only.
func (s *Server) catalogSettled(ctx context.Context, req x402.SettleRequest) string {
	c := s.catalog()
	if c == nil {
		return ""
	}
	d, err := x402.DiscoverResource(req)
	if errors.Is(err, x402.ErrNoBazaar) {
		return ""
	}
	if err == nil {
		doc, _ := json.Marshal(d)
		if len(doc) > MaxDiscoveryEntryBytes {
			err = fmt.Errorf("the declaration takes %d bytes; this facilitator catalogs at most %d per resource", len(doc), MaxDiscoveryEntryBytes)
		}
	}
	if err == nil {
		if err = c.Add(ctx, d, s.discoveryEntries()); err != nil {
			s.logger.Warn("cataloging a settled resource failed", zap.String("error", s.redact(err.Error())))
			err = errors.New("the catalog could not be written; the payment settled all the same")
		}
	}
	res := bazaarResponse{Status: x402.BazaarStatusSuccess}
	if err != nil {
		res = bazaarResponse{Status: x402.BazaarStatusRejected, RejectedReason: err.Error()}
	}
	b, _ := json.Marshal(map[string]bazaarResponse{x402.ExtensionBazaar: res})
	return base64.StdEncoding.EncodeToString(b)
}

func (s *Server) discoveryEntries() int {
	if s.opts.DiscoveryEntries > 0 {
		return s.opts.DiscoveryEntries
	}
	return DefaultDiscoveryEntries
}

// discoveryQuery is what a listing asks for.
type discoveryQuery struct {
	typ, payTo, scheme, network, extension string
	limit, offset                          int
}

// discoveryParams are the query parameters a listing reads; any other is refused, so that a client misspelling
// a filter learns so instead of getting everything.
var discoveryParams = []string{"type", "payTo", "scheme", "network", "extensions", "limit", "offset"}

// readDiscoveryQuery reads a listing's query parameters, or says which one is wrong.
func readDiscoveryQuery(q url.Values) (discoveryQuery, error) {
	for k := range q {
		known := false
		for _, p := range discoveryParams {
			known = known || k == p
		}
		if !known {
			return discoveryQuery{}, fmt.Errorf("query parameter %q is not one this endpoint reads (%s)", k, strings.Join(discoveryParams, ", "))
		}
		if len(q[k]) > 1 {
			return discoveryQuery{}, fmt.Errorf("query parameter %q is given %d times; give it once", k, len(q[k]))
		}
	}
	d := discoveryQuery{typ: q.Get("type"), payTo: q.Get("payTo"), scheme: q.Get("scheme"), network: q.Get("network"),
		extension: q.Get("extensions"), limit: DefaultDiscoveryLimit}
	num := func(name string, lo, hi int, into *int) error {
		v, ok := q[name]
		if !ok {
			return nil
		}
		n, err := strconv.Atoi(v[0])
		if err != nil || n < lo || n > hi {
			return fmt.Errorf("query parameter %q is %q; want a whole number from %d to %d", name, v[0], lo, hi)
		}
		*into = n
		return nil
	}
	if err := num("limit", 1, MaxDiscoveryLimit, &d.limit); err != nil {
		return d, err
	}
	if err := num("offset", 0, 1<<30, &d.offset); err != nil {
		return d, err
	}
	if d.typ != "" && d.typ != "http" && d.typ != "mcp" {
		return d, fmt.Errorf("query parameter \"type\" is %q; want \"http\" or \"mcp\"", d.typ)
	}
	return d, nil
}

// matches reports whether r passes the listing's filters.
func (d discoveryQuery) matches(r x402.DiscoveredResource) bool {
	if d.typ != "" && r.Type != d.typ {
		return false
	}
	if d.extension != "" {
		if _, ok := r.Extensions[d.extension]; !ok {
			return false
		}
	}
	if d.payTo == "" && d.scheme == "" && d.network == "" {
		return true
	}
	for _, a := range r.Accepts {
		if (d.payTo == "" || strings.EqualFold(a.PayTo, d.payTo)) && (d.scheme == "" || a.Scheme == d.scheme) &&
			(d.network == "" || a.Network == d.network) {
			return true
		}
	}
	return false
}

// serveDiscoveryResources answers GET /discovery/resources: the catalog, filtered and paged as the SDK's
// facilitator client asks.
func (s *Server) serveDiscoveryResources(r *http.Request) reply {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		res := errorReply(http.StatusMethodNotAllowed, "%s /%s is not served; use GET", r.Method, EndpointDiscoveryResources)
		res.allow = "GET, HEAD"
		return res
	}
	q, err := readDiscoveryQuery(r.URL.Query())
	if err != nil {
		return errorReply(http.StatusBadRequest, "%v", err)
	}
	out := x402.DiscoveryResourcesResponse{X402Version: x402.Version2, Items: []x402.DiscoveredResource{},
		Pagination: x402.DiscoveryPagination{Limit: q.limit, Offset: q.offset}}
	c := s.catalog()
	if c == nil {
		return reply{status: http.StatusOK, body: out}
	}
	all, err := c.List(r.Context())
	if err != nil {
		s.logger.Error("reading the catalog failed", zap.String("error", s.redact(err.Error())))
		return errorReply(http.StatusServiceUnavailable, "the catalog could not be read; try again")
	}
	for _, d := range all {
		if !q.matches(d) {
			continue
		}
		if out.Pagination.Total >= q.offset && len(out.Items) < q.limit {
			out.Items = append(out.Items, d)
		}
		out.Pagination.Total++
	}
	return reply{status: http.StatusOK, body: out}
}
