package gate

import "github.com/x402-gateway/caddy-x402/x402"

// batchFacilitator is what accepts a batch-settlement payment: the batch server in front of a remote facilitator
// (Config.Batch), or the embedded engine. A remote facilitator is never handed a voucher itself: it keeps no
// vouchers for this gate, and would neither record nor claim them.
func (g *Gate) batchFacilitator() x402.BatchFacilitator {
	if g.cfg.Batch != nil {
		return g.cfg.Batch
	}
	if bf, ok := g.fac.(x402.BatchFacilitator); ok && g.cfg.Embedded {
		return bf
	}
	return nil
}
