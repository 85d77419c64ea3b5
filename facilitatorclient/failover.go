package facilitatorclient

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Failover is a set of facilitators tried in order. A payment goes only to members whose /supported lists
// its version, scheme, network and transfer method, so that, say, an erc2612-only facilitator never becomes
// the failover of a permit2 payment; a payment bound to one settlement wallet (an erc2612 permit's spender, an
// upto witness's facilitator) goes only to a member that may own that wallet: members sharing a journal each
// list only the wallets whose leases they hold. A member that failed a call, or whose /supported is past its
// TTL, is asked /supported again aside, and a payment does not wait for that while another compatible member is
// known; a member whose /supported failed is skipped until its retry time (WithSupportedRetry). It is safe for
// concurrent use.
type Failover struct {
	members []*Client
	sticky  *SentPayments // payments whose /settle may have reached a member, and that member
	now     func() time.Time
}

// NewFailover returns a failover set of clients, tried in the given order; nil clients are left out.
func NewFailover(clients ...*Client) *Failover {
	return NewFailoverSharing(nil, clients...)
}

// NewFailoverSharing is NewFailover remembering the payments it sends in memory, which other sets may share (nil:
// a memory of its own). A payment remembered as sent to a member of this set stays with it; one sent only to
// base URLs that are no member of this set (a member a reload took out) is routed as a new one.
func NewFailoverSharing(memory *SentPayments, clients ...*Client) *Failover {
	if memory == nil {
		memory = NewSentPayments()
	}
	f := &Failover{sticky: memory, now: time.Now}
	for _, c := range clients {
		if c != nil {
			f.members = append(f.members, c)
		}
	}
	return f
}

// stickyMember is the member of this set a payment was last sent to, by the memory's record, or nil.
func (f *Failover) stickyMember(key string) *Client {
	bases := f.sticky.get(key, f.now())
	for i := len(bases) - 1; i >= 0; i-- {
		for _, c := range f.members {
			if c.base == bases[i] {
				return c
			}
		}
	}
	return nil
}

// Members returns the clients of the set in the order they are tried.
func (f *Failover) Members() []*Client { return slices.Clone(f.members) }

// String lists the members' base URLs.
func (f *Failover) String() string {
	names := make([]string, len(f.members))
	for i, c := range f.members {
		names[i] = c.base
	}
	return "failover[" + strings.Join(names, ", ") + "]"
}

// Verify asks the first compatible member, and the next compatible one when a member gives no answer
// (unreachable or a malformed answer). A refused payment is an answer and is not asked elsewhere.
func (f *Failover) Verify(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	r := routing{op: opVerify, want: wantOf(req)}
	var (
		resp x402.VerifyResponse
		err  error
	)
	if r.route(ctx, f.members, func(c *Client) bool {
		resp, err = c.Verify(ctx, req)
		if err == nil {
			return true
		}
		r.failed(c, err)
		if ctx.Err() != nil || !x402.IsUnreachable(err) {
			return true
		}
		c.invalidateSupported()
		return false
	}) {
		return resp, err
	}
	return x402.VerifyResponse{}, r.err(ctx)
}

// Settle is SettleDetailed without the detail.
func (f *Failover) Settle(ctx context.Context, req x402.SettleRequest) (x402.SettleResponse, error) {
	res, err := f.SettleDetailed(ctx, req)
	return res.Response, err
}

// SettleDetailed asks the first compatible member, and moves on to the next only when the request surely
// never reached the member (ErrNotSent), or the member answered that it sent nothing, no wallet of its being free
// (no_available_wallets: the answer, unless another member settles the payment): after anything else the payment
// may have settled there, so the answer or error is returned. A payment whose /settle may have reached a member
// stays with that member until a day past its deadline: presented again (after an unknown outcome), it is asked
// of that member only, whatever the others' state, for another would find its nonce spent, or its deadline
// passed, and refuse a payment that settled; the member that may have settled it is the only one whose journal
// can tell, before its deadline and after. That memory is the process's: a member refusing the payment for a
// spent nonce or a passed deadline may be one that never saw it, so the others are asked then (settledElsewhere).
// SettleResult.Facilitator names the member whose answer it is.
func (f *Failover) SettleDetailed(ctx context.Context, req x402.SettleRequest) (SettleResult, error) {
	key := stickyKey(req)
	if c := f.stickyMember(key); c != nil {
		res, err := c.SettleDetailed(ctx, req)
		if err != nil && errors.Is(err, ErrNotSent) {
			// This request never left, but an earlier one for the payment may have reached the member: the
			// outcome is unknown, and the payment must not go elsewhere.
			err = &x402.FacilitatorError{Op: opSettle, Kind: x402.FailureUnreachable, Err: fmt.Errorf(
				"%s, the only facilitator this payment's settlement was sent to, could not be reached (%v); it may have settled there", c.base, err)}
		}
		if err == nil && spentOrExpired(res.Response) {
			return f.settledElsewhere(ctx, req, key, c, res), nil
		}
		return res, err
	}
	r := routing{op: opSettle, want: wantOf(req)}
	var (
		res SettleResult
		err error
		// noWallet is a member's answer that it sent nothing, no settlement wallet of its being free: the
		// answer, unless another member settles the payment.
		noWallet *SettleResult
	)
	if r.route(ctx, f.members, func(c *Client) bool {
		res, err = c.SettleDetailed(ctx, req)
		if err == nil && sentNothing(res.Response) {
			// The payment did not reach the chain through this member, so it is not kept with it: another may
			// settle it, now or when it is presented again.
			answer := res
			noWallet = &answer
			return ctx.Err() != nil
		}
		if err == nil || !errors.Is(err, ErrNotSent) {
			now := f.now()
			f.sticky.put(key, c.base, stickyUntil(req, now), now)
		}
		if err == nil {
			return true
		}
		r.failed(c, err)
		if x402.IsUnreachable(err) {
			c.invalidateSupported()
		}
		return ctx.Err() != nil || !errors.Is(err, ErrNotSent)
	}) {
		if err == nil && spentOrExpired(res.Response) {
			return f.settledElsewhere(ctx, req, key, f.member(res.Facilitator), res), nil
		}
		return res, err
	}
	if noWallet != nil {
		return *noWallet, nil
	}
	return SettleResult{}, r.err(ctx)
}

// spentOrExpired reports whether a settlement's refusal could be another member's settlement of the payment seen
// from outside it: the nonce is spent, or the authorization's deadline passed (after it settled elsewhere).
func spentOrExpired(resp x402.SettleResponse) bool {
	if resp.Success || resp.Transaction != "" {
		return false
	}
	switch resp.ErrorReason {
	case x402.ReasonPermit2InvalidNonce, x402.ReasonNonceAlreadyUsed,
		x402.ReasonPermit2DeadlineExpired, x402.ReasonEIP2612DeadlineExpired, x402.ReasonValidBefore:
		return true
	}
	return false
}

// settledElsewhere answers a payment that member refused for a spent nonce or a passed deadline (refusal): the
// answer of another compatible member that knows the payment as its own (it settled it, or its settlement is under
// way or its outcome unknown), else the refusal. The memory of where a payment was sent is this process's: it is
// lost when the process restarts, and another gateway of a cluster never had it, so a payment settled by the second
// member, its answer lost with the process that asked, is presented again to the first, which never saw it and finds
// its nonce spent. Only the member that settled it can tell, from its journal; the others refuse it too. Asking them
// spends nothing: the nonce is spent or the deadline passed, so no member can settle the payment anew, and a member
// answers success only for this very payment, never for another whose settlement spent the same nonce (a facilitator
// journal refuses a payment whose nonce its record of another payment holds).
func (f *Failover) settledElsewhere(ctx context.Context, req x402.SettleRequest, key string, member *Client, refusal SettleResult) SettleResult {
	r := routing{op: opSettle, want: wantOf(req)}
	var found *SettleResult
	r.route(ctx, f.members, func(c *Client) bool {
		if c == member {
			return false
		}
		res, err := c.SettleDetailed(ctx, req)
		if err == nil || !errors.Is(err, ErrNotSent) {
			now := f.now()
			f.sticky.put(key, c.base, stickyUntil(req, now), now)
		}
		if err == nil && (res.Response.Success || res.Response.OutcomeUnknown()) {
			found = &res
			return true
		}
		return ctx.Err() != nil
	})
	if found != nil {
		return *found
	}
	if member != nil {
		// Presented again, the payment is asked of the member that refused it first, then of the others again.
		now := f.now()
		f.sticky.put(key, member.base, stickyUntil(req, now), now)
	}
	return refusal
}

// member is the member of the set whose base URL is base, or nil.
func (f *Failover) member(base string) *Client {
	for _, c := range f.members {
		if c.base == base {
			return c
		}
	}
	return nil
}

// sentNothing reports whether a settlement answer says the facilitator sent nothing and the payment stays good:
// no settlement wallet of its was free (no_available_wallets, naming no transaction).
func sentNothing(resp x402.SettleResponse) bool {
	return !resp.Success && resp.ErrorReason == x402.ReasonNoAvailableWallets && resp.Transaction == ""
}

// Supported merges the members' /supported answers: kinds and extensions without duplicates, signers per
// pattern. Members that cannot be reached are left out; only when none can is it an error.
func (f *Failover) Supported(ctx context.Context) (x402.SupportedResponse, error) {
	answers := make([]x402.SupportedResponse, len(f.members))
	errs := make([]error, len(f.members))
	var wg sync.WaitGroup
	for i, c := range f.members {
		wg.Go(func() {
			resp, state, err := c.peekSupported()
			if state == supportedMissing {
				resp, err = c.cachedSupported(ctx, true)
			}
			answers[i], errs[i] = resp, err
		})
	}
	wg.Wait()

	merged := x402.SupportedResponse{Kinds: []x402.SupportedKind{}, Extensions: []string{}, Signers: map[string][]string{}}
	var failures []memberError
	answered := 0
	for i, resp := range answers {
		if errs[i] != nil {
			failures = append(failures, memberError{f.members[i].base, errs[i]})
			continue
		}
		answered++
		for _, k := range resp.Kinds {
			if !slices.Contains(merged.Kinds, k) {
				merged.Kinds = append(merged.Kinds, k)
			}
		}
		for _, e := range resp.Extensions {
			if !slices.Contains(merged.Extensions, e) {
				merged.Extensions = append(merged.Extensions, e)
			}
		}
		for pattern, addrs := range resp.Signers {
			for _, a := range addrs {
				if !x402.ContainsAddress(merged.Signers[pattern], a) {
					merged.Signers[pattern] = append(merged.Signers[pattern], a)
				}
			}
		}
	}
	if answered == 0 && len(f.members) > 0 {
		return x402.SupportedResponse{}, &x402.FacilitatorError{
			Op: opSupported, Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("no member answered: %w", joinMembers(failures)),
		}
	}
	return merged, nil
}

// MemberHealth is the health of one member of a Failover, or why it could not be had.
type MemberHealth struct {
	Facilitator string
	Health      x402.HealthResponse
	Err         error
}

// HealthByMember asks every member's /health at once and returns the answers in member order.
func (f *Failover) HealthByMember(ctx context.Context) []MemberHealth {
	out := make([]MemberHealth, len(f.members))
	var wg sync.WaitGroup
	for i, c := range f.members {
		wg.Go(func() {
			h, err := c.Health(ctx)
			out[i] = MemberHealth{Facilitator: c.base, Health: h, Err: err}
		})
	}
	wg.Wait()
	return out
}

// Health sums up the members: ok when every member is ok, down when none is ok or degraded, degraded
// otherwise. Per network it keeps the best member's entry, as a payment on that network can go there.
// It is an error only when no member answered; HealthByMember has the detail.
func (f *Failover) Health(ctx context.Context) (x402.HealthResponse, error) {
	members := f.HealthByMember(ctx)
	var failures []memberError
	okCount, upCount := 0, 0
	best := map[string]int{} // network -> index into networks
	var networks []x402.NetworkHealth
	for _, m := range members {
		if m.Err != nil {
			failures = append(failures, memberError{m.Facilitator, m.Err})
			continue
		}
		switch m.Health.Status {
		case x402.HealthOK:
			okCount++
			upCount++
		case x402.HealthDegraded:
			upCount++
		}
		for _, n := range m.Health.Networks {
			i, seen := best[n.Network]
			if !seen {
				best[n.Network] = len(networks)
				networks = append(networks, n)
			} else if healthRank(n.Status) > healthRank(networks[i].Status) {
				networks[i] = n
			}
		}
	}
	if len(members) > 0 && len(failures) == len(members) {
		return x402.HealthResponse{}, &x402.FacilitatorError{
			Op: opHealth, Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("no member answered: %w", joinMembers(failures)),
		}
	}
	status := x402.HealthDegraded
	switch {
	case len(members) == 0:
		status = x402.HealthDown
	case okCount == len(members):
		status = x402.HealthOK
	case upCount == 0:
		status = x402.HealthDown
	}
	return x402.HealthResponse{Status: status, Networks: networks}, nil
}

func healthRank(status string) int {
	switch status {
	case x402.HealthOK:
		return 2
	case x402.HealthDegraded:
		return 1
	}
	return 0
}

// want is what a payment needs of a facilitator.
type want struct {
	version int
	scheme  string
	network string
	method  string
	// spender is the settlement wallet the payment is bound to (x402.BoundWallet: an erc2612 permit's spender,
	// an upto witness's facilitator): only the facilitator owning it can settle.
	spender string
	// implied: the requirements named no transfer method and method is the one the payload implies (a version
	// 1 body); a kind that names no method then serves it too.
	implied bool
}

// wantOf reads the routing key of a request: the payload's version and the requirements' scheme, network
// and transfer method, falling back to the accepted requirements where the requirements are silent.
func wantOf(req x402.VerifyRequest) want {
	r, acc := req.PaymentRequirements, req.PaymentPayload.Accepted
	w := want{
		version: cmp.Or(req.PaymentPayload.X402Version, req.X402Version),
		scheme:  cmp.Or(r.Scheme, acc.Scheme),
		network: cmp.Or(r.Network, acc.Network),
		method:  cmp.Or(r.Extra.AssetTransferMethod, acc.Extra.AssetTransferMethod),
	}
	if p := req.PaymentPayload.Payload; w.method == "" {
		switch {
		case p.Permit2Authorization != nil:
			w.method, w.implied = x402.TransferPermit2, true
		case p.Authorization != nil:
			w.method, w.implied = x402.TransferERC2612, true
		}
	}
	rq := req.PaymentRequirements
	rq.Scheme, rq.Extra.AssetTransferMethod = w.scheme, w.method
	w.spender = x402.BoundWallet(rq, req.PaymentPayload.Payload)
	return w
}

func (w want) String() string {
	method := w.method
	if method == "" {
		method = "payments without assetTransferMethod"
	}
	return fmt.Sprintf("%s on %s (x402Version %d, scheme %q)", method, w.network, w.version, w.scheme)
}

// Why servedBy turned a member down.
const (
	servedOK = iota
	servedNoKind
	servedOtherSpender
)

// servedBy says whether a facilitator with this /supported answer can take the payment, and if not why.
func (w want) servedBy(s x402.SupportedResponse) int {
	var kind *x402.SupportedKind
	for i, k := range s.Kinds {
		if k.X402Version == w.version && k.Scheme == w.scheme && k.Network == w.network &&
			(k.Extra.AssetTransferMethod == w.method || w.implied && k.Extra.AssetTransferMethod == "") {
			kind = &s.Kinds[i]
			break
		}
	}
	if kind == nil {
		return servedNoKind
	}
	if w.spender == "" {
		return servedOK
	}
	// A facilitator that names its wallets and not this one cannot spend the permit; one that names none
	// may still own it.
	owned := s.SignersFor(w.network)
	for _, a := range []string{kind.Extra.Spender, kind.Extra.FacilitatorAddress} {
		if a != "" {
			owned = append(owned, a)
		}
	}
	if len(owned) == 0 || x402.ContainsAddress(owned, w.spender) {
		return servedOK
	}
	return servedOtherSpender
}

func kindsText(kinds []x402.SupportedKind) string {
	if len(kinds) == 0 {
		return "no kinds"
	}
	const most = 6
	parts := make([]string, 0, most+1)
	for i, k := range kinds {
		if i == most {
			parts = append(parts, fmt.Sprintf("and %d more", len(kinds)-most))
			break
		}
		method := cmp.Or(k.Extra.AssetTransferMethod, "-")
		parts = append(parts, fmt.Sprintf("%s/%s on %s v%d", k.Scheme, method, k.Network, k.X402Version))
	}
	return strings.Join(parts, ", ")
}

// routing records, for one call, which members were passed over and which failed, so that the final error
// says why no member answered.
type routing struct {
	op           string
	want         want
	incompatible []passedOver
	unknown      []memberError // /supported could not be had
	tried        []memberError // compatible, asked, failed
}

// passedOver is a member that cannot take the payment; the text saying why is built only if it is needed.
type passedOver struct {
	facilitator string
	supported   x402.SupportedResponse
	why         int
}

func (p passedOver) text(w want) string {
	if p.why == servedOtherSpender {
		if w.scheme == x402.SchemeUpto {
			return p.facilitator + " does not own the upto witness's facilitator " + w.spender
		}
		return p.facilitator + " does not own the permit's spender " + w.spender
	}
	return p.facilitator + " offers " + kindsText(p.supported.Kinds)
}

type memberError struct {
	facilitator string
	err         error
}

// route calls try with each member that can take the payment, in order, until try reports that it has the
// final word, and reports whether it did. Members whose /supported is known come first, so that a payment
// never waits for a sick member's /supported while a healthy member is at hand; only when none of them gives
// the final word does route wait for the /supported of the others, still in order.
func (r *routing) route(ctx context.Context, members []*Client, try func(*Client) bool) bool {
	var waitFor []*Client
	for _, c := range members {
		if ctx.Err() != nil {
			return false
		}
		s, state, err := c.peekSupported()
		switch state {
		case supportedKnown:
			if r.admit(c, s) && try(c) {
				return true
			}
		case supportedFailed:
			r.unknown = append(r.unknown, memberError{c.base, err})
		case supportedMissing:
			waitFor = append(waitFor, c)
		}
	}
	for _, c := range waitFor {
		if ctx.Err() != nil {
			return false
		}
		s, err := c.cachedSupported(ctx, true)
		if err != nil {
			r.unknown = append(r.unknown, memberError{c.base, err})
			continue
		}
		if r.admit(c, s) && try(c) {
			return true
		}
	}
	return false
}

// admit reports whether c, with /supported answer s, can take the payment, and notes why not.
func (r *routing) admit(c *Client, s x402.SupportedResponse) bool {
	why := r.want.servedBy(s)
	if why != servedOK {
		r.incompatible = append(r.incompatible, passedOver{c.base, s, why})
	}
	return why == servedOK
}

func (r *routing) failed(c *Client, err error) {
	r.tried = append(r.tried, memberError{c.base, err})
}

// err explains why no member gave an answer.
func (r *routing) err(ctx context.Context) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return &x402.FacilitatorError{Op: r.op, Kind: x402.FailureUnreachable,
			Err: fmt.Errorf("call abandoned by its caller while routing %s: %w", r.want, ctxErr)}
	}
	if len(r.tried) == 1 && len(r.unknown) == 0 {
		return r.tried[0].err
	}
	if len(r.tried) > 0 || len(r.unknown) > 0 {
		failures := append(slices.Clone(r.tried), r.unknown...)
		err := fmt.Errorf("no facilitator answered for %s: %w", r.want, joinMembers(failures))
		if r.noneSent() {
			err = fmt.Errorf("%w: %w", ErrNotSent, err)
		}
		return &x402.FacilitatorError{Op: r.op, Kind: x402.FailureUnreachable, Err: err}
	}
	if len(r.incompatible) == 0 {
		return &x402.FacilitatorError{Op: r.op, Kind: x402.FailureRejected,
			Err: fmt.Errorf("no facilitator configured for %s", r.want)}
	}
	reasons := make([]string, len(r.incompatible))
	for i, p := range r.incompatible {
		reasons[i] = p.text(r.want)
	}
	return &x402.FacilitatorError{Op: r.op, Kind: x402.FailureRejected,
		Err: fmt.Errorf("no facilitator supports %s: %s", r.want, strings.Join(reasons, "; "))}
}

// noneSent reports whether no member was sent the request in a way it may have received.
func (r *routing) noneSent() bool {
	for _, t := range r.tried {
		if !errors.Is(t.err, ErrNotSent) {
			return false
		}
	}
	return true
}

// joinedMembers is several members' errors on one line, each still reachable by errors.Is and errors.As.
type joinedMembers []memberError

func joinMembers(errs []memberError) error { return joinedMembers(errs) }

func (j joinedMembers) Error() string {
	parts := make([]string, len(j))
	for i, m := range j {
		parts[i] = m.facilitator + ": " + m.err.Error()
	}
	return strings.Join(parts, "; ")
}

func (j joinedMembers) Unwrap() []error {
	out := make([]error, len(j))
	for i, m := range j {
		out[i] = m.err
	}
	return out
}

// Interface guard.
var _ x402.Facilitator = (*Failover)(nil)
