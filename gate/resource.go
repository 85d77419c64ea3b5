package gate

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net"
	"strings"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment buys one resource: the one it was first presented for, which its journal record names
// (journal.Record.Resource). A response cut short leaves the payment good to present again, so that a broken
// connection never strands a payer; presented again for another resource, it buys nothing. Presented again for
// that resource, it is judged by its record, the terms it was accepted under, not by the route's offers now: a
// reload that changed the price, the recipient or the networks, a price_grace that has passed, a price set per
// request that resolves otherwise now, or another gateway of the cluster configured otherwise must not leave a
// payer charged for nothing.

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

// describedKey is what the 402 of this request says of its resource beside the URL (its description and MIME
// type), as a payment's record keeps it (journal.Record.Described): a digest, whatever the description's length.
// Another route of the same URL (chosen by a header) that describes another resource does not serve a payment on
// the record of this one.
func (x *exchange) describedKey() string {
	info := x.resource()
	sum := sha256.Sum256([]byte(info.Description + "\x00" + info.MimeType))
	return hex.EncodeToString(sum[:16])
}

// boughtHere reports whether rec, whose request is recorded, is the record of this very payment (the payload byte
// for byte) first presented for this request's resource at this very route (Config.Route), which described it as
// it does now: the payment is then judged by its record. Two routes of one URL (chosen by a header, say) may
// describe it alike, or not at all, and sell it at different prices: a description is no route. A record of a
// release before records named their resource, described it or named their route says too little to tell, as
// does a gate without a route: the payment is judged by the request's offers, as then.
func (x *exchange) boughtHere(rec journal.Record, recorded x402.VerifyRequest, payload x402.ExactEVMPayload) bool {
	return rec.Resource != "" && rec.Described != "" && rec.Route != "" && rec.Resource == x.boughtResource() &&
		rec.Described == x.describedKey() && rec.Route == x.g.cfg.Route && samePayload(recorded.PaymentPayload.Payload, payload)
}

// onRecord reports whether a payment that matches none of this request's offers is one the journal holds for this
// very resource (boughtHere), to be judged by its record (presentedAgain). Only a version 2 payment names the asset
// its journal id needs before it matches an offer. The record is only read here: it is read again once the
// payment is marked in flight.
func (x *exchange) onRecord(p presented) (bool, error) {
	if !p.haveID {
		return false, nil
	}
	rec, found, err := x.g.ledger.store.Get(x.r.Context(), p.id)
	if err != nil || !found {
		return false, err
	}
	var recorded x402.VerifyRequest
	if json.Unmarshal(rec.Request, &recorded) != nil {
		return false, nil
	}
	return x.boughtHere(rec, recorded, p.payload), nil
}

// shownResource is a resource as an answer names it: cut to shownResourceLen bytes.
func shownResource(resource string) string {
	if len(resource) <= shownResourceLen {
		return resource
	}
	return resource[:shownResourceLen] + "..."
}
