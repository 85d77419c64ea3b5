package gate

import (
	"crypto/sha256"
	"encoding/hex"
	"net"
	"strings"
)

// A payment buys one resource: the one it was first presented for, which its journal record names
// (journal.Record.Resource). A response cut short leaves the payment good to present again, so that a broken
// connection never strands a payer; presented again for another resource, it buys nothing.

// Bounds of the resource a record names.
const (
	// maxResourceLen bounds the resource kept in a journal record (see boundedKey).
	maxResourceLen    = 2048
	resourcePrefixLen = 1024
	// shownResourceLen bounds the resource an answer names.
	shownResourceLen = 256
)

// boughtResource names what this request asks for, as a payment's record keeps it: the method, the host
// without its port, and the request URI the client sent (path and query, before any rewrite), as in
// "GET example.com/files/report.pdf?v=2". Not the scheme or the port: the gateways of a cluster are reached
// under one name by different addresses (a load balancer's, each gateway's own), and a payment whose response
// one of them could not finish must be served by the others.
func (x *exchange) boughtResource() string {
	return resourceKey(x.r.Method, x.r.Host, x.g.cfg.OriginalURI(x.r))
}

// resourceKey is boughtResource of a request's method, Host and original request URI.
func resourceKey(method, host, uri string) string {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
		if strings.Contains(h, ":") {
			host = "[" + h + "]" // an IPv6 address keeps its brackets
		}
	}
	return boundedKey(method + " " + strings.TrimSuffix(strings.ToLower(host), ".") + uri)
}

// boundedKey is key, or, when it is longer than maxResourceLen, its first resourcePrefixLen bytes and the SHA-256
// of the whole, which tells it apart from any other key just as well: what a request's URL makes the gate keep
// (a journal record, the price grace's memory) is bounded whatever the URL's length.
func boundedKey(key string) string {
	if len(key) <= maxResourceLen {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	return key[:resourcePrefixLen] + "... sha256:" + hex.EncodeToString(sum[:])
}

// shownResource is a resource as an answer names it: cut to shownResourceLen bytes.
func shownResource(resource string) string {
	if len(resource) <= shownResourceLen {
		return resource
	}
	return resource[:shownResourceLen] + "..."
}
