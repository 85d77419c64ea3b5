package gate

import (
	"container/list"
	"sync"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// DefaultOfferMemoryBytes is how much an OfferMemory may hold, over all resources: tens of thousands of offers
// of ordinary URLs. A URL is counted at its length, so many long ones are forgotten sooner, never held past it.
const DefaultOfferMemoryBytes = 16 << 20

// What an OfferMemory counts beside the bytes of a resource's key: the resource's list element, map entry and
// struct, and each offered terms' struct (whose strings are the offer set's, shared, and bounded apart).
const (
	offeredResourceBytes = int64(unsafe.Sizeof(list.Element{})+unsafe.Sizeof(offeredResource{})) + 64
	offeredTermsBytes    = int64(unsafe.Sizeof(offeredTerms{}))
)

// OfferMemory remembers what the 402s of gates offered for each resource (an HTTP method and URL) and when they
// last offered it, so that a gate with a price grace takes a payment signed against an offer it made just before
// its price changed. It is kept in memory only, within a number of bytes, and is safe for concurrent use: the
// gates that replace one another on a config reload share one.
type OfferMemory struct {
	mu        sync.Mutex
	maxBytes  int64
	bytes     int64                    // counted over all resources (resourceBytes)
	size      int                      // terms remembered, over all resources
	resources map[string]*list.Element // of *offeredResource, by resource
	lru       list.List                // the resources, the one offered last in front
}

// offeredResource is what the 402s of one resource offered.
type offeredResource struct {
	key   string
	terms []offeredTerms
}

// bytes is what a resource counts for against the memory's limit.
func (r *offeredResource) bytes() int64 {
	return offeredResourceBytes + int64(len(r.key)) + int64(cap(r.terms))*offeredTermsBytes
}

// offeredTerms is one offer a 402 made, by its terms (x402.SameTerms).
type offeredTerms struct {
	offer offer
	at    time.Time // when a 402 last offered it
	until time.Time // when it may be forgotten: the grace of the gate that last offered it has passed
}

// NewOfferMemory makes a memory of at most maxBytes; when it is full, the resources offered longest ago are
// forgotten first, and a resource that alone would not fit is not remembered.
func NewOfferMemory(maxBytes int64) *OfferMemory {
	return &OfferMemory{maxBytes: max(maxBytes, 1), resources: make(map[string]*list.Element)}
}

// Len is how many offered terms the memory holds.
func (m *OfferMemory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.size
}

// Bytes is how many bytes the memory counts against its limit.
func (m *OfferMemory) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}

// remember notes that a 402 for resource offered offers at time at, by a gate whose grace is grace.
func (m *OfferMemory) remember(resource string, offers []offer, at time.Time, grace time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.resources[resource]
	if ok {
		m.lru.MoveToFront(el)
	} else {
		el = m.lru.PushFront(&offeredResource{key: resource})
		m.resources[resource] = el
	}
	res := el.Value.(*offeredResource)
	if ok {
		m.bytes -= res.bytes()
	}
	kept := res.terms[:0]
	for _, t := range res.terms {
		if !at.After(t.until) {
			kept = append(kept, t)
		}
	}
	m.size -= len(res.terms) - len(kept)
	res.terms = kept
	until := at.Add(grace)
outer:
	for _, o := range offers {
		for i := range res.terms {
			if t := &res.terms[i]; x402.SameTerms(t.offer.req, o.req) {
				t.offer, t.at, t.until = o, at, maxTime(t.until, until)
				continue outer
			}
		}
		res.terms = append(res.terms, offeredTerms{offer: o, at: at, until: until})
		m.size++
	}
	m.bytes += res.bytes()
	for m.bytes > m.maxBytes && m.lru.Len() > 0 {
		oldest := m.lru.Back()
		gone := oldest.Value.(*offeredResource)
		m.lru.Remove(oldest)
		delete(m.resources, gone.key)
		m.size -= len(gone.terms)
		m.bytes -= gone.bytes()
	}
}

// recall returns the terms a 402 for resource offered no longer than grace before now.
func (m *OfferMemory) recall(resource string, now time.Time, grace time.Duration) []offeredTerms {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.resources[resource]
	if !ok {
		return nil
	}
	var out []offeredTerms
	for _, t := range el.Value.(*offeredResource).terms {
		if age := now.Sub(t.at); age >= 0 && age <= grace {
			out = append(out, t)
		}
	}
	return out
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// offeredKey names the resource of a request in the offer memory: its method, the URL its 402 names, and the URI
// a rewrite made of that (the request's URI placeholders read the rewritten one): all that the terms of a gate
// with a price grace may depend on (Config.PriceGrace); and the gate's route (Config.Route), which keeps it across
// reloads, for another route of the same URL (chosen by a header, say) sells it at terms of its own. A long one
// is bounded (boundedKey).
func (x *exchange) offeredKey() string {
	key := x.r.Method + " " + x.resourceURL()
	if x.g.cfg.Route != "" {
		key = x.g.cfg.Route + " " + key
	}
	if uri := x.r.URL.RequestURI(); uri != x.g.cfg.OriginalURI(x.r) {
		key += " " + uri
	}
	return boundedKey(key)
}

// rememberOffered notes the offers of the 402 this request is answered with, for the price grace.
func (x *exchange) rememberOffered() {
	if x.g.cfg.PriceGrace <= 0 || len(x.offers.offers) == 0 {
		return
	}
	x.g.cfg.OfferMemory.remember(x.offeredKey(), x.offers.offers, x.g.now(), x.g.cfg.PriceGrace)
}

// match finds the offer a version 2 payment chose among the request's offers, and else, with a price grace,
// among those a 402 made for the same resource within the grace. The mismatch returned is the one with the
// request's own offers.
func (x *exchange) match(p *x402.PaymentPayload) (x402.VerifyRequest, *offer, *x402.Mismatch) {
	req, o, m := x.offers.match(p)
	if m == nil {
		return req, o, nil
	}
	if past := x.pastOffers(); past != nil {
		if earlier, eo, mm := past.match(p); mm == nil {
			x.acceptedThroughGrace(earlier.PaymentRequirements, past)
			return earlier, eo, nil
		}
	}
	return req, nil, m
}

// matchV1 is match for a version 1 payment.
func (x *exchange) matchV1(p *x402.PaymentPayloadV1) (x402.VerifyRequest, *x402.Mismatch) {
	req, m := x.offers.matchV1(p, x.g.registry, x.g.cfg.Permits)
	if m == nil {
		return req, nil
	}
	if past := x.pastOffers(); past != nil {
		if earlier, mm := past.matchV1(p, x.g.registry, x.g.cfg.Permits); mm == nil {
			x.acceptedThroughGrace(earlier.PaymentRequirements, past)
			return earlier, nil
		}
	}
	return req, m
}

// pastOffers is the offers a 402 made for the request's resource within the price grace, with when each was
// last offered; nil when there are none or the gate has no grace.
func (x *exchange) pastOffers() *pastOfferSet {
	if x.g.cfg.PriceGrace <= 0 {
		return nil
	}
	terms := x.g.cfg.OfferMemory.recall(x.offeredKey(), x.g.now(), x.g.cfg.PriceGrace)
	if len(terms) == 0 {
		return nil
	}
	past := &pastOfferSet{at: make([]time.Time, len(terms))}
	for i, t := range terms {
		past.offers = append(past.offers, t.offer)
		past.at[i] = t.at
	}
	return past
}

// pastOfferSet is offers made earlier, with when each was last offered.
type pastOfferSet struct {
	offerSet
	at []time.Time
}

// acceptedThroughGrace logs that a payment was taken under terms the request no longer offers.
func (x *exchange) acceptedThroughGrace(rq x402.PaymentRequirements, past *pastOfferSet) {
	var offeredAt time.Time
	for i, o := range past.offers {
		if x402.SameTerms(o.req, rq) {
			offeredAt = past.at[i]
			break
		}
	}
	var now []string
	for _, o := range x.offers.offers {
		now = append(now, o.req.Amount)
	}
	x.g.logger.Info("a payment signed against an earlier offer of this resource is accepted within price_grace",
		zap.String("resource", x.offeredKey()), zap.String("amount", rq.Amount), zap.String("pay_to", rq.PayTo),
		zap.String("network", rq.Network), zap.String("method", rq.Extra.AssetTransferMethod),
		zap.Time("offered_at", offeredAt), zap.Strings("amounts_now", now), zap.Duration("price_grace", x.g.cfg.PriceGrace))
}
