package e2e

import (
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
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
			switch {
			case !deadlineRefusal(a.note):
			case strings.HasPrefix(a.note, "settlement failed: "):
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

// TestTheBriefRoutesExcuseOnlyTheirDeadlinesAndARemoteOutcomeUnknownForGood: the checks' excusals for the routes
// valid briefly, table-tested (run with the rest of the package's quick tests; the invariant run is what feeds them).
func TestTheBriefRoutesExcuseOnlyTheirDeadlinesAndARemoteOutcomeUnknownForGood(t *testing.T) {
	for note, want := range map[string]bool{
		x402.ReasonPermit2DeadlineExpired + ": Permit expired: permit2Authorization.deadline 1 is too close":                       true,
		"settlement failed: " + x402.ReasonValidBefore + ": authorization.validBefore 1 is too close":                              true,
		x402.ReasonValidBefore + ": authorization.validBefore 9 lies more than maxTimeoutSeconds (40) and the allowed clock skew":  false,
		"settlement failed: " + x402.ReasonValidBefore + ": permit2Authorization.deadline 9 lies more than maxTimeoutSeconds (40)": false,
		x402.ReasonPermit2SimulationFailed + ": simulating the settlement call failed: SignatureExpired(1)":                        false,
		"settlement failed: " + x402.ReasonNoAvailableWallets + ": No available wallets in pool; retry in 1 to 2 seconds":          false,
	} {
		if got := deadlineRefusal(note); got != want {
			t.Errorf("deadlineRefusal(%q) = %v, want %v", note, got, want)
		}
	}

	key := devchain.PayerKeyN(0)
	rq := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: "eip155:1337", Amount: "2700", Asset: devchain.TokenAddress.Hex(),
		PayTo: invSeller(0).Hex(), MaxTimeoutSeconds: 40, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
	signed := time.Unix(1_800_000_000, 0)
	pl, err := chain.SignPermit2Payment(key, rq, big.NewInt(1337), chain.Permit2Options{Now: signed})
	if err != nil {
		t.Fatal(err)
	}
	header, err := x402.EncodeHeader(pl)
	if err != nil {
		t.Fatal(err)
	}
	remote := &routeKind{remote: true, validity: invBriefValidity, method: x402.TransferPermit2}
	unknown := &invAnswer{status: http.StatusBadGateway, res: invResource{http.MethodGet, "/brief-remote/a"}, outcome: string(x402.OutcomeSettleUnreachable),
		gateError: "the facilitator refused the payment (permit2_deadline_expired: Permit expired), but its earlier settlement request may have reached the facilitator and settled it; check the chain before paying again"}
	past, before := signed.Add(time.Hour), signed.Add(10*time.Second)
	for _, c := range []struct {
		name     string
		route    *routeKind
		last     *invAnswer
		consumed bool
		now      time.Time
		want     bool
	}{
		{"unknown past its deadline, not charged", remote, unknown, false, past, true},
		{"a HEAD's bodiless 502 past its deadline, not charged", remote, &invAnswer{status: http.StatusBadGateway, res: invResource{http.MethodHead, "/brief-remote/a"}}, false, past, true},
		{"charged", remote, unknown, true, past, false},
		{"before its deadline", remote, unknown, false, before, false},
		{"a 502 for a facilitator out of reach", remote, &invAnswer{status: http.StatusBadGateway, res: invResource{http.MethodGet, "/brief-remote/a"},
			outcome: string(x402.OutcomeVerifyUnreachable), gateError: "the facilitator could not be reached to verify"}, false, past, false},
		{"a refusal", remote, &invAnswer{status: http.StatusPaymentRequired, final: true}, false, past, false},
		{"a route valid a day", &routeKind{remote: true, method: x402.TransferPermit2}, unknown, false, past, false},
		{"an embedded engine's route", &routeKind{validity: invBriefValidity, method: x402.TransferPermit2}, unknown, false, past, false},
	} {
		p := &invPayment{route: c.route, header: header}
		end := &invEnd{consumed: map[*invPayment]bool{p: c.consumed}, chainNow: c.now}
		if got := remoteUnknownPastDeadline(p, c.last, end); got != c.want {
			t.Errorf("%s: excused %v, want %v", c.name, got, c.want)
		}
	}
}
