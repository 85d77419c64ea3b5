package gate

import (
	"fmt"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// RecordsKept is how long, at least, a journal no embedded engine prunes keeps a final record (a voucher's answer
// among them): a batch server in front of a remote facilitator takes a voucher accepted longer ago whose record is
// gone as used, not as one whose record a crash lost.
const RecordsKept = gatePruneAfter

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

// unoffered says why the batch ways to pay of specs are not offered by set, built from the facilitator's
// /supported answer: a configuration the facilitator cannot serve, which waiting does not mend. "" when set was
// built from no answer, or every batch way is offered.
func unoffered(specs []Offer, set *offerSet) string {
	if set == nil || !set.known {
		return ""
	}
	var why []string
	for _, s := range specs {
		if s.Scheme != x402.SchemeBatchSettlement {
			continue
		}
		if _, ok := batchOffer(s, set.sup); !ok {
			if !s.EIP3009 {
				why = append(why, fmt.Sprintf("scheme batch on %s needs a token with EIP-3009 (token_eip3009)", s.Network))
				continue
			}
			why = append(why, fmt.Sprintf("scheme batch on %s needs the facilitator's batch-settlement kind there, with a receiverAuthorizer, and its /supported lists none", s.Network))
		}
	}
	return strings.Join(why, "; ")
}
