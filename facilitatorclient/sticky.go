package facilitatorclient

import (
	"strings"
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// stickyPayments remembers, for every payment whose /settle may have reached a member of a failover set, that
// member. Until the payment's deadline has passed, only that member is asked to settle it: another would find
// its nonce spent by the first member's settlement and refuse it, and the payer, who paid, would be told to pay
// again.
type stickyPayments struct {
	mu sync.Mutex
	by map[string]stickyMember
}

type stickyMember struct {
	member *Client
	until  time.Time
}

// maxSticky bounds the payments remembered. Past it, the one whose deadline comes first is forgotten; with the
// bound at 2^17 and a default deadline of minutes, that takes more than 400 settlements a second.
const maxSticky = 1 << 17

// maxStickyFor caps how long a payment is remembered, whatever deadline it carries.
const maxStickyFor = 24 * time.Hour

// stickyKey names a payment by network, payer and nonce; "" when the payload names no payer or nonce.
func stickyKey(req x402.VerifyRequest) string {
	from, nonce := req.PaymentPayload.Payload.PayerAndNonce()
	if from == "" || nonce == "" {
		return ""
	}
	return req.PaymentRequirements.Network + "|" + strings.ToLower(from) + "|" + nonce
}

// stickyUntil is how long a payment is remembered: until its deadline, or for maxTimeoutSeconds when the
// payload names none, at most maxStickyFor.
func stickyUntil(req x402.VerifyRequest, now time.Time) time.Time {
	limit := now.Add(maxStickyFor)
	until := req.PaymentPayload.Payload.Deadline()
	if until.IsZero() {
		until = now.Add(time.Duration(max(req.PaymentRequirements.MaxTimeoutSeconds, 60)) * time.Second)
	}
	if until.After(limit) {
		return limit
	}
	return until
}

func (s *stickyPayments) get(key string, now time.Time) *Client {
	if key == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.by[key]
	if !ok {
		return nil
	}
	if !now.Before(m.until) {
		delete(s.by, key)
		return nil
	}
	return m.member
}

func (s *stickyPayments) put(key string, c *Client, until, now time.Time) {
	if key == "" || !now.Before(until) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.by == nil {
		s.by = map[string]stickyMember{}
	}
	if _, known := s.by[key]; !known && len(s.by) >= maxSticky {
		// Make room: the expired first; if none, the payment whose deadline comes soonest.
		var soonest string
		var soonestAt time.Time
		for k, m := range s.by {
			if !now.Before(m.until) {
				delete(s.by, k)
				continue
			}
			if soonest == "" || m.until.Before(soonestAt) {
				soonest, soonestAt = k, m.until
			}
		}
		if len(s.by) >= maxSticky {
			delete(s.by, soonest)
		}
	}
	s.by[key] = stickyMember{member: c, until: until}
}
