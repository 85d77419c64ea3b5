package facilitatorclient

import (
	"container/list"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// SentPayments is the memory of a Failover: the member each payment's /settle may have reached. Only that member
// is asked to settle the payment again: another would find its nonce spent by the first member's settlement, or,
// past the payment's deadline, the authorization expired, and refuse it, and the payer, who paid, would be told
// to pay again. Past the deadline the payment cannot settle anywhere any more, but the member that may have
// settled it is still the only one whose journal can say whether it did. Failover sets that share one
// (NewFailoverSharing) keep a payment with its member across them, a set built anew when a configuration is
// reloaded included. It is safe for concurrent use, and bounded.
type SentPayments struct{ stickyPayments }

// NewSentPayments returns an empty memory to share between failover sets.
func NewSentPayments() *SentPayments { return new(SentPayments) }

// stickyPayments is the memory of SentPayments.
type stickyPayments struct {
	mu    sync.Mutex
	by    map[string]*list.Element // of *stickyMember, in order
	order list.List                // the payments in the order they were last sent, the earliest first
}

type stickyMember struct {
	key string
	// members are the base URLs of the members the payment was sent to, the last sent to last: in every set
	// that shares the memory, the payment stays with the last of them that is a member of the set. Several
	// sets of one process may each send it once (a gate's set whose member is a middleware of this process,
	// with a set of its own).
	members []string
	until   time.Time
}

// maxStickyMembers bounds the members remembered of one payment.
const maxStickyMembers = 4

// maxSticky bounds the payments remembered. Past it, the payment sent the longest ago is forgotten: at the
// default deadline of minutes and stickyPastDeadline, that is one whose deadline passed long ago, unless more
// than 2^17 settlements were sent since (some 400 a second for the deadline alone).
const maxSticky = 1 << 17

// stickyPastDeadline is how long a payment is remembered after its deadline: long enough for a payment presented
// again after its deadline (a gate keeps its record of it for minutes past the deadline, an async settlement is
// retried until its member answers) to be asked of its member, which keeps its own record for a day.
const stickyPastDeadline = 24 * time.Hour

// maxStickyFor caps how long a payment is remembered, whatever deadline it carries.
const maxStickyFor = 48 * time.Hour

// stickyKey names a payment by network, payer and nonce; "" when the payload names no payer or nonce.
func stickyKey(req x402.VerifyRequest) string {
	from, nonce := req.PaymentPayload.Payload.PayerAndNonce()
	if from == "" || nonce == "" {
		return ""
	}
	return req.PaymentRequirements.Network + "|" + strings.ToLower(from) + "|" + nonce
}

// stickyUntil is how long a payment is remembered: stickyPastDeadline past its deadline, or past
// maxTimeoutSeconds from now when the payload names none, at most maxStickyFor from now.
func stickyUntil(req x402.VerifyRequest, now time.Time) time.Time {
	limit := now.Add(maxStickyFor)
	deadline := req.PaymentPayload.Payload.Deadline()
	if deadline.IsZero() {
		deadline = now.Add(time.Duration(max(req.PaymentRequirements.MaxTimeoutSeconds, 60)) * time.Second)
	}
	if until := deadline.Add(stickyPastDeadline); until.Before(limit) {
		return until
	}
	return limit
}

// get names the members a payment was sent to (their base URLs, the last sent to last), or none.
func (s *stickyPayments) get(key string, now time.Time) []string {
	if key == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.by[key]
	if !ok {
		return nil
	}
	m := e.Value.(*stickyMember)
	if !now.Before(m.until) {
		s.forget(e)
		return nil
	}
	return slices.Clone(m.members)
}

// put remembers that a payment was sent to member (its base URL), until until.
func (s *stickyPayments) put(key, member string, until, now time.Time) {
	if key == "" || !now.Before(until) {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.by == nil {
		s.by = map[string]*list.Element{}
	}
	if e, known := s.by[key]; known {
		m := e.Value.(*stickyMember)
		m.members = append(slices.DeleteFunc(m.members, func(b string) bool { return b == member }), member)
		if len(m.members) > maxStickyMembers {
			m.members = m.members[len(m.members)-maxStickyMembers:]
		}
		if until.After(m.until) {
			m.until = until
		}
		s.order.MoveToBack(e)
		return
	}
	// Make room, and forget what has run out, from the earliest sent: each put looks at what it forgets and at
	// most one more.
	for e := s.order.Front(); e != nil; e = s.order.Front() {
		if len(s.by) < maxSticky && now.Before(e.Value.(*stickyMember).until) {
			break
		}
		s.forget(e)
	}
	s.by[key] = s.order.PushBack(&stickyMember{key: key, members: []string{member}, until: until})
}

// forget drops one payment; s.mu is held.
func (s *stickyPayments) forget(e *list.Element) {
	delete(s.by, e.Value.(*stickyMember).key)
	s.order.Remove(e)
}

// size is how many payments are remembered.
func (s *stickyPayments) size() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.by)
}
