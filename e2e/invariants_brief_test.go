package e2e

import (
	"fmt"
	"net/http"
	"strings"
)

// checkBrief reports the payments valid briefly (routeKind.validity): the lane must have run, at least one of its
// payments delivered; their deadlines crossing the faults are judged by every other check (a refusal for the
// deadline is excused by honest-payment-never-refused only).
func (r *invRun) checkBrief(end *invEnd) ([]invViolation, string) {
	payments, delivered, charged, refusedAtVerify, refusedAtSettle, again := 0, 0, 0, 0, 0, 0
	for _, p := range r.snapshot() {
		if p.route.validity == 0 {
			continue
		}
		payments++
		if p.delivered() > 0 {
			delivered++
		}
		if end.consumed[p] {
			charged++
		}
		p.mu.Lock()
		for i, a := range p.answers {
			if i > 0 {
				again++
			}
			if a.status != http.StatusPaymentRequired {
				continue
			}
			switch note := strings.TrimPrefix(a.note, "settlement failed: "); {
			case !hasAnyPrefix(note, deadlineReasons):
			case note != a.note:
				refusedAtSettle++
			default:
				refusedAtVerify++
			}
		}
		p.mu.Unlock()
	}
	summary := fmt.Sprintf("%d payments valid %s: %d delivered, %d charged, presented %d times again; refused for their deadline %d times at verification, %d at settlement",
		payments, invBriefValidity, delivered, charged, again, refusedAtVerify, refusedAtSettle)
	if delivered == 0 {
		return []invViolation{{what: "no payment valid briefly delivered its response: the lane did not run"}}, summary
	}
	return nil, summary
}
