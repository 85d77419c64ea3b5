package chain

import (
	"cmp"
	"slices"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Bounds of what the engine remembers of refused payments: it is for an operator's page, and a stream of bad
// payments must not grow it.
const (
	recentRefusals = 20  // the latest refusals kept, newest first on the page
	refusalKinds   = 128 // distinct (network, reason) counts kept; later ones are counted as otherReason
)

// otherReason and otherNetwork stand for what the engine does not count by name: a reason past refusalKinds
// distinct ones, and a network the engine does not settle on (a payer names it, so it is not echoed).
const (
	otherReason  = "other"
	otherNetwork = "other"
)

// refusalKey is one line of the refusal counts.
type refusalKey struct{ network, reason string }

// refusals remembers, in memory only, what the engine refused since it started: counts by network and reason,
// and a ring of the latest. It keeps no payment, signature or header; a payer only as a well-formed address.
type refusals struct {
	mu     sync.Mutex
	total  int
	counts map[refusalKey]int
	recent []x402.Refusal // ring of at most recentRefusals
	next   int            // where the ring writes next once full
}

// note records one refusal.
func (r *refusals) note(at time.Time, op, network, reason, payer string) {
	if !common.IsHexAddress(payer) {
		payer = "" // a claimed payer is the payer's own text: an operator's page shows only an address
	} else {
		payer = common.HexToAddress(payer).Hex()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts == nil {
		r.counts = map[refusalKey]int{}
	}
	k := refusalKey{network, reason}
	if _, ok := r.counts[k]; !ok && len(r.counts) >= refusalKinds {
		k.reason = otherReason
	}
	r.total++
	r.counts[k]++
	one := x402.Refusal{At: at.UTC(), Op: op, Network: network, Reason: reason, Payer: payer}
	if len(r.recent) < recentRefusals {
		r.recent = append(r.recent, one)
		return
	}
	r.recent[r.next] = one
	r.next = (r.next + 1) % recentRefusals
}

// health is the refusals as /health shows them: counts by network then by most refusals, the latest first.
func (r *refusals) health() *x402.RefusalsHealth {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := &x402.RefusalsHealth{Total: r.total, Counts: []x402.RefusalCount{}, Recent: make([]x402.Refusal, 0, len(r.recent))}
	for k, n := range r.counts {
		h.Counts = append(h.Counts, x402.RefusalCount{Network: k.network, Reason: k.reason, Count: n})
	}
	slices.SortFunc(h.Counts, func(a, b x402.RefusalCount) int {
		return cmp.Or(cmp.Compare(a.Network, b.Network), cmp.Compare(b.Count, a.Count), cmp.Compare(a.Reason, b.Reason))
	})
	n := len(r.recent)
	newest := n - 1 // the ring's newest is the last appended until it is full, then the one before next
	if n == recentRefusals {
		newest = (r.next - 1 + n) % n
	}
	for i := range n {
		h.Recent = append(h.Recent, r.recent[(newest-i+n)%n])
	}
	return h
}

// refusalNetwork is the network a refusal is counted on: the request's when the engine settles on it.
func (f *Facilitator) refusalNetwork(network string) string {
	if _, ok := f.networks[network]; ok {
		return network
	}
	return otherNetwork
}

// noteVerify records a verification that refused the payment; an error (no answer) is no refusal.
func (f *Facilitator) noteVerify(req x402.VerifyRequest, resp x402.VerifyResponse, err error) {
	if err != nil || resp.IsValid {
		return
	}
	payer := resp.Payer
	if payer == "" {
		payer = x402.ClaimedPayer(req)
	}
	f.refused.note(f.now(), "verify", f.refusalNetwork(req.PaymentRequirements.Network), resp.InvalidReason, payer)
}

// noteSettle records a settlement that failed for good: not one pending or whose outcome is unknown, which
// may still settle.
func (f *Facilitator) noteSettle(req x402.SettleRequest, resp x402.SettleResponse, err error) {
	if err != nil || resp.Success || resp.OutcomeUnknown() {
		return
	}
	payer := resp.Payer
	if payer == "" {
		payer = x402.ClaimedPayer(req)
	}
	f.refused.note(f.now(), "settle", f.refusalNetwork(req.PaymentRequirements.Network), resp.ErrorReason, payer)
}
