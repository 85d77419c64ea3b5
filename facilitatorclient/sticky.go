package facilitatorclient

import (
	"cmp"
	"container/list"
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// SentPayments is the memory of a Failover: the member each payment's /settle may have reached. That member is
// asked to settle the payment again, and another only once it refused the payment for a spent nonce or a passed
// deadline (Failover.settledElsewhere): another would find its nonce spent by the first member's settlement, or,
// past the payment's deadline, the authorization expired, and refuse it, and the payer, who paid, would be told
// to pay again. Past the deadline the payment cannot settle anywhere any more, but the member that may have
// settled it is still the only one whose journal can say whether it did. A payment is known by what its payer
// signed (stickyKey): another one with the same payer and nonce is routed as a new one. Failover sets that share
// one (NewFailoverSharing) keep a payment with its member across them, a set built anew when a configuration is
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

// stickyKey names a payment by what its payer signed: the network, the transfer method, the token and every field
// of the authorization; "" when the payload names no payer or nonce. Payer and nonce alone do not name one payment:
// an erc2612 nonce is the token's counter, the same after a refused settlement (nothing spent it), so the payer's
// next permit, to another member's wallet, carries it too; and an eip3009 or permit2 nonce is the client's choice.
// The signature is left out: another signature of the same authorization (re-encoded, or malleated) spends the
// same nonce on the same terms, so it is the same payment on chain and must go where the first may have settled.
// Text is compared without case, as addresses and hex are.
func stickyKey(req x402.VerifyRequest) string {
	p := req.PaymentPayload.Payload
	from, nonce := p.PayerAndNonce()
	if from == "" || nonce == "" {
		return ""
	}
	rq, acc := req.PaymentRequirements, req.PaymentPayload.Accepted
	fields := []string{cmp.Or(rq.Network, acc.Network), x402.TransferMethod(rq, p), cmp.Or(rq.Asset, acc.Asset)}
	switch a, a2 := p.Authorization, p.Permit2Authorization; {
	case a2 != nil:
		fields = append(fields, "permit2Authorization", a2.From, a2.Permitted.Token, a2.Permitted.Amount, a2.Spender,
			a2.Nonce, a2.Deadline, a2.Witness.To, a2.Witness.Facilitator, a2.Witness.ValidAfter)
	case a != nil:
		fields = append(fields, "authorization", a.From, a.To, a.Value, a.ValidAfter, a.ValidBefore, a.Nonce)
	}
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	for _, f := range fields {
		// Length-prefixed, so that no choice of field contents makes two different payments one key.
		f = strings.ToLower(f)
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(f)))])
		h.Write([]byte(f))
	}
	return string(h.Sum(nil))
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
