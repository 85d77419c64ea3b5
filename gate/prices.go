package gate

import (
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/x402-gateway/caddy-x402/x402"
)

// maxPricedOffers bounds the offer sets a gate keeps for the distinct answers of Config.OffersFor: a price
// taken from a request field can take any number of values, and past the bound the sets are built afresh.
const maxPricedOffers = 1024

// offersFor returns the offers of request r: the gate's own, or, with Config.OffersFor, the ones its answer for
// r names, shaped by the same /supported answer as the gate's own.
func (g *Gate) offersFor(r *http.Request) (*offerSet, error) {
	base := g.currentOffers(r.Context())
	if g.cfg.OffersFor == nil {
		return base, nil
	}
	specs, err := g.cfg.OffersFor(r)
	if err != nil {
		return nil, err
	}
	return g.priced.get(base, specs, g.registry), nil
}

// pricedOffers keeps the offer set built for each distinct answer of Config.OffersFor, so that a request pays
// for the lookup of its terms, not for building its offers.
type pricedOffers struct {
	mu   sync.Mutex
	base *offerSet            // the gate's offers the sets were shaped by; a new one empties sets
	sets map[string]*offerSet // by pricedKey
}

// get returns the offer set of specs, shaped by base's /supported answer.
func (p *pricedOffers) get(base *offerSet, specs []Offer, reg *x402.Registry) *offerSet {
	key := pricedKey(specs)
	p.mu.Lock()
	defer p.mu.Unlock()
	if set, ok := p.sets[key]; ok && p.base == base {
		return set
	}
	if p.base != base || len(p.sets) >= maxPricedOffers {
		p.base, p.sets = base, make(map[string]*offerSet)
	}
	set := buildOffers(specs, base.sup, reg, base.at)
	set.known, set.failedAt, set.sup = base.known, base.failedAt, base.sup
	p.sets[key] = set
	return set
}

// pricedKey says everything about specs that their offers are built from.
func pricedKey(specs []Offer) string {
	var b strings.Builder
	for _, s := range specs {
		for _, f := range [...]string{s.Network, s.Asset, s.PayTo, s.Amount, s.TokenName, s.TokenVersion, s.Method, s.Scheme} {
			b.WriteString(f)
			b.WriteByte(0)
		}
		b.WriteString(strconv.Itoa(int(s.Decimals)))
		b.WriteByte(0)
		b.WriteString(strconv.FormatBool(s.EIP3009))
		b.WriteByte(0)
		b.WriteString(strconv.FormatInt(s.MaxTimeoutSeconds, 10))
		b.WriteByte(1)
	}
	return b.String()
}
