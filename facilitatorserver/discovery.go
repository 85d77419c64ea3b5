package facilitatorserver

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math"
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
	// DefaultDiscoveryLimit is the page size of a listing that names no limit; MaxDiscoveryLimit the largest (a
	// larger limit is taken as it, and the answer's pagination.limit says so).
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
	// List returns the page q asks for of the resources that pass its filters, the most recently updated
	// first, and how many pass them.
	List(ctx context.Context, q x402.DiscoveryQuery) ([]x402.DiscoveredResource, int, error)
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

// discoveryParams are the query parameters a listing reads; any other is refused, so that a client misspelling
// a filter learns so instead of getting everything.
var discoveryParams = []string{"type", "payTo", "scheme", "network", "extensions", "limit", "offset"}

// readDiscoveryQuery reads a listing's query parameters, or says which one is wrong.
func readDiscoveryQuery(q url.Values) (x402.DiscoveryQuery, error) {
	for k := range q {
		known := false
		for _, p := range discoveryParams {
			known = known || k == p
		}
		if !known {
			return x402.DiscoveryQuery{}, fmt.Errorf("query parameter %q is not one this endpoint reads (%s)", k, strings.Join(discoveryParams, ", "))
		}
		if len(q[k]) > 1 {
			return x402.DiscoveryQuery{}, fmt.Errorf("query parameter %q is given %d times; give it once", k, len(q[k]))
		}
	}
	d := x402.DiscoveryQuery{Type: q.Get("type"), PayTo: q.Get("payTo"), Scheme: q.Get("scheme"), Network: q.Get("network"),
		Extension: q.Get("extensions"), Limit: DefaultDiscoveryLimit}
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
	// A limit above the largest page is taken as the largest, as the SDK's discovery client, which passes on
	// whatever limit its caller names and fails on any answer but 200, needs; pagination.limit says so.
	if err := num("limit", 1, math.MaxInt32, &d.Limit); err != nil {
		return d, err
	}
	d.Limit = min(d.Limit, MaxDiscoveryLimit)
	if err := num("offset", 0, 1<<30, &d.Offset); err != nil {
		return d, err
	}
	if d.Type != "" && d.Type != "http" && d.Type != "mcp" {
		return d, fmt.Errorf("query parameter \"type\" is %q; want \"http\" or \"mcp\"", d.Type)
	}
	return d, nil
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
		Pagination: x402.DiscoveryPagination{Limit: q.Limit, Offset: q.Offset}}
	c := s.catalog()
	if c == nil {
		return reply{status: http.StatusOK, body: out}
	}
	// Public, and each listing a read of the journal: counted against the client's verify rate limit, as a
	// refused /verify is, so that nobody can have the database read as fast as they can ask.
	if s.verifies != nil {
		if ok, who, wait := s.verifies.take(s.clientIP(r)); !ok {
			secs := retryAfter(wait)
			res := errorReply(http.StatusTooManyRequests, "%s has made more than %d listings and refused /verify calls in the last minute (verify_rate_limit per_ip): retry after %d s",
				who, s.verifies.buckets.perMinute, secs)
			res.retryAfter = secs
			return res
		}
	}
	items, total, err := c.List(r.Context(), q)
	if err != nil {
		s.logger.Error("reading the catalog failed", zap.String("error", s.redact(err.Error())))
		return errorReply(http.StatusServiceUnavailable, "the catalog could not be read; try again")
	}
	if items != nil {
		out.Items = items
	}
	out.Pagination.Total = total
	return reply{status: http.StatusOK, body: out}
}
