package payer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"strings"
	"sync"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// DefaultMaxBufferedBody is how much of a request body without GetBody a Transport buffers, unless told
// otherwise, so that it can send the body again with the payment.
const DefaultMaxBufferedBody = 64 << 10

// maxOfferBody caps how much of a 402 answer's body a Transport reads for a version 1 offer.
const maxOfferBody = 1 << 20

// Limit bounds what a Transport pays in one asset. Amounts are raw token units: 10000 is 0.01 of a token of 6
// decimals.
type Limit struct {
	// Network is the CAIP-2 chain the asset lives on, such as eip155:8453; "" matches every network.
	Network string
	// Asset is the token's address; "" matches every asset, each of which still has a total of its own.
	Asset string
	// PerRequest is the most one payment may cost; nil puts no bound on one payment.
	PerRequest *big.Int
	// Total is the most all payments through the Transport may cost together in the asset; nil puts no bound on
	// the total.
	Total *big.Int
}

// matches says whether the limit covers asset on network.
func (l Limit) matches(network, asset string) bool {
	return (l.Network == "" || l.Network == network) && (l.Asset == "" || x402.SameAddress(l.Asset, asset))
}

// LimitError is a payment a Transport refused to sign because of its limits. Nothing was signed or sent.
type LimitError struct {
	// URL is the resource that asked for the payment, without its query.
	URL string
	// Network and Asset say what the server asked to be paid in.
	Network, Asset string
	// Amount is the amount it asked, in raw units.
	Amount *big.Int
	// Limit is the bound the payment would have passed: the limit per request, or the Total; nil when no Limit
	// covers the asset.
	Limit *big.Int
	// Spent is, for a Total, what was already paid in the asset; nil otherwise.
	Spent *big.Int
	// Deposit says Amount is the deposit a batch-settlement channel needs (the least the offer takes), not a
	// request's price.
	Deposit bool
}

func (e *LimitError) Error() string {
	asked := fmt.Sprintf("payer: %s asks %s of asset %s on %s", e.URL, e.Amount, e.Asset, e.Network)
	if e.Deposit {
		asked = fmt.Sprintf("payer: %s needs a batch-settlement deposit of at least %s of asset %s on %s", e.URL, e.Amount, e.Asset, e.Network)
	}
	switch {
	case e.Limit == nil:
		return asked + ", and no spending limit covers that asset: not paid"
	case e.Spent == nil && e.Deposit:
		return fmt.Sprintf("%s, over the %s a deposit may be with no Total (DepositRequests times the limit per request): not paid", asked, e.Limit)
	case e.Spent == nil:
		return fmt.Sprintf("%s, over the limit of %s per request: not paid", asked, e.Limit)
	}
	return fmt.Sprintf("%s, over the total budget of %s, of which %s is spent: not paid", asked, e.Limit, e.Spent)
}

// Transport is an http.RoundTripper that pays for what it fetches. It sends the request; when the answer is
// 402 Payment Required with an x402 offer (the PAYMENT-REQUIRED header, or a version 1 body), it chooses a
// requirement, checks it against the limits, signs the payment and sends the request once more with it. The
// answer to that second request is returned whatever it is; Settlement decodes its PAYMENT-RESPONSE.
//
// A 402 without an x402 offer is returned as it came. A request that already carries a payment header is
// sent as it is. A redirect is followed by the http.Client above, without the payment, which went only to the
// request that asked for it.
//
// The budget counts what was signed, and only the chain gives any of it back, never a server's word: a signed
// payment is a bearer authorization that whoever holds it can settle, up to its amount, until its deadline.
// With an RPC (the Payer's Options.RPC; without one nothing is given back), a permit2 payment is followed:
//   - an upto payment the server says it settled gives back its maximum less what the transaction named in
//     PAYMENT-RESPONSE moved, if that transaction is mined, successful, a call of the pinned proxy the payment
//     was signed for, and spends this payment's Permit2 nonce from this payer in its calldata (so one
//     transaction proves one payment, and another payment's settlement or someone else's transfer proves
//     nothing); what it moved is the sum of the asset's Transfer logs from the payer in its receipt;
//   - Reconcile later finds a settlement the answer did not prove among the asset's Transfer logs from the
//     payer to payTo, and gives back the whole of a payment whose deadline the head block has passed with its
//     nonce unspent (Permit2 refuses it from then on).
//
// eip3009 and erc2612 payments stay counted at their amount. A mined receipt is taken as final: on a chain
// that reorganizes, a settlement that gave budget back could be undone.
//
// A Transport is safe for concurrent use; its fields must not change once it is in use. To bound a request, give
// its context a deadline rather than the http.Client a Timeout: for a RoundTripper it does not know, net/http
// enforces Timeout with two goroutines a request, which cost more than a voucher-paid request's own work.
type Transport struct {
	// Payer signs the payments; required.
	Payer *Payer
	// Base sends the requests; nil is http.DefaultTransport.
	Base http.RoundTripper
	// Limits bound what is paid: a payment is checked against the first Limit that covers its network and
	// asset, and one that no Limit covers is not paid. With no Limits, nothing is paid. Totals count what was
	// signed: every payment sent, at the amount it authorizes (an upto payment at its maximum), whether or not
	// and whatever the server says it charged, since whoever holds a signed payment can settle it until it
	// expires. Only the chain gives budget back; see Spent.
	Limits []Limit
	// MaxBufferedBody is the largest request body without GetBody that is buffered so that it can be sent
	// again with the payment; 0 is DefaultMaxBufferedBody, and a negative value buffers none. A request whose
	// body cannot be sent again is sent once, and a 402 to it is an error.
	MaxBufferedBody int64
	// SignIn answers a 402's sign-in-with-x challenge with the payer's wallet before paying (Payer.SignIn), as
	// the SDK's clients do with the extension registered: a server where the payer paid before serves it without
	// a payment; where it answers 402 again, the first 402's offer is paid.
	SignIn bool

	mu      sync.Mutex
	covered map[common.Hash]*big.Int  // by batch-settlement channel: the cumulative amount its counted deposits cover
	spent   map[string]*big.Int       // by network and lower-case asset address: reserved, less what the chain gave back
	signed  map[string]*big.Int       // the same key: the amounts of the payments sent
	open    map[string]*authorization // permit2 payments sent whose final cost the chain has not shown, by nonce
}

// RoundTrip sends req, and pays and sends it once more when it is answered 402 with an x402 offer.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.Payer == nil {
		closeBody(req)
		return nil, errors.New("payer: Transport.Payer is nil")
	}
	if req.Header.Get(x402.HeaderPaymentSignature) != "" || req.Header.Get(x402.HeaderXPayment) != "" {
		return t.base().RoundTrip(req)
	}
	where := requestURL(req)
	firstBody, again, err := t.replayable(req, where)
	if err != nil {
		return nil, err
	}
	first := req.Clone(req.Context())
	first.Body = firstBody
	if req.GetBody == nil && again != nil && firstBody != nil && firstBody != http.NoBody {
		first.GetBody = again
	}
	resp, err := t.base().RoundTrip(first)
	if err != nil || resp.StatusCode != http.StatusPaymentRequired {
		return resp, err
	}

	body, err := io.ReadAll(io.LimitReader(resp.Body, maxOfferBody+1))
	if err != nil {
		resp.Body.Close()
		return nil, fmt.Errorf("payer: reading the 402 answer of %s: %w", where, err)
	}
	if int64(len(body)) > maxOfferBody && resp.Header.Get(x402.HeaderPaymentRequired) == "" {
		// Too big for a version 1 offer: the 402 is the caller's to read, all of it.
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(body), resp.Body), resp.Body}
		return resp, nil
	}
	resp.Body.Close()
	offer, err := ReadOffer(resp.Header, body)
	if err != nil {
		if resp.Header.Get(x402.HeaderPaymentRequired) == "" {
			// Not an x402 offer: the 402 is the caller's to read.
			resp.Body = io.NopCloser(bytes.NewReader(body))
			return resp, nil
		}
		return nil, fmt.Errorf("payer: %s: %w", where, err)
	}
	if again == nil {
		return nil, fmt.Errorf("payer: %s asks for a payment, but the request's body has no GetBody and is over %d bytes, so it cannot be sent again with the payment", where, t.maxBuffered())
	}
	return t.payOffer(req, where, offer, again)
}

// PayOffer sends req once, paid for offer (the offer an earlier 402 of req's URL made), without the unpaid request
// RoundTrip sends first: for a client that makes many requests of one resource, such as a load test, whose every
// request would otherwise cost two round trips. It signs in, or chooses, checks against the limits and pays, as
// RoundTrip does (a batch-settlement channel's next voucher, resynced and sent once more after a corrective 402),
// and returns the answer whatever it is.
func (t *Transport) PayOffer(req *http.Request, offer Offer) (*http.Response, error) {
	if t.Payer == nil {
		closeBody(req)
		return nil, errors.New("payer: Transport.Payer is nil")
	}
	where := requestURL(req)
	body, again, err := t.replayable(req, where)
	if err != nil {
		return nil, err
	}
	if again == nil {
		closeBody(req)
		return nil, fmt.Errorf("payer: %s: the request's body has no GetBody and is over %d bytes, so it cannot be paid for by PayOffer", where, t.maxBuffered())
	}
	if body != nil && body != http.NoBody {
		body.Close()
	}
	return t.payOffer(req, where, offer, again)
}

// payOffer answers offer for req as RoundTrip does once it has read it: by signing in, when SignIn says so and the
// offer takes it, else by choosing a requirement, paying it and sending req with the payment; again gives req's
// body.
func (t *Transport) payOffer(req *http.Request, where string, offer Offer, again func() (io.ReadCloser, error)) (*http.Response, error) {
	if t.SignIn {
		if resp, err := t.signIn(req, where, offer, again); resp != nil || err != nil {
			return resp, err
		}
	}

	ctx := req.Context()
	rpc, err := t.Payer.chain(ctx)
	if err != nil {
		return nil, fmt.Errorf("payer: %s: %w", where, err)
	}
	i, err := t.Payer.choose(offer, rpc, func(r x402.PaymentRequirements) error {
		if r.Scheme == x402.SchemeBatchSettlement {
			_, err := t.priceLimit(where, r)
			return err
		}
		return t.check(where, r, false)
	})
	if err != nil {
		var le *LimitError
		if errors.As(err, &le) {
			return nil, err
		}
		return nil, fmt.Errorf("payer: %s: %w", where, err)
	}
	chosen := offer.Required.Accepts[i]
	if chosen.Scheme == x402.SchemeBatchSettlement {
		return t.payBatch(req, where, offer, i, rpc, again)
	}
	// Checked again, and reserved, under the lock: a concurrent payment may have spent the budget meanwhile.
	if err := t.check(where, chosen, true); err != nil {
		return nil, err
	}
	pay, err := t.Payer.Sign(ctx, offer, i)
	if err != nil {
		t.release(chosen)
		return nil, fmt.Errorf("payer: %s: %w", where, err)
	}
	paid := req.Clone(ctx)
	if paid.Body, err = again(); err != nil {
		t.release(chosen)
		return nil, fmt.Errorf("payer: %s: the request body for the paid request: %w", where, err)
	}
	if req.GetBody == nil && paid.Body != nil && paid.Body != http.NoBody {
		paid.GetBody = again
	}
	paid.Header.Set(pay.Header, pay.Value)
	t.sent(chosen)
	a := t.watch(rpc, pay)
	resp, err := t.base().RoundTrip(paid)
	if a != nil && err == nil {
		t.answered(ctx, rpc, a, resp)
	}
	return resp, err
}

// Spent returns what the Transport counts as paid in asset on network, in raw units: the amounts of the
// payments it signed and sent (an upto payment's maximum), less what the chain has shown they did not cost
// (the part of an upto maximum its settlement did not move, a payment that expired unspent). Whatever the
// servers say, it is never less than what the payments sent have moved and can still move.
func (t *Transport) Spent(network, asset string) *big.Int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return amountOf(t.spent, network, asset)
}

// Signed returns the sum of the amounts of the payments the Transport signed and sent in asset on network, in
// raw units (an upto payment at its maximum): what Spent started from, before anything was given back.
func (t *Transport) Signed(network, asset string) *big.Int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return amountOf(t.signed, network, asset)
}

func amountOf(m map[string]*big.Int, network, asset string) *big.Int {
	if s := m[spentKey(network, asset)]; s != nil {
		return new(big.Int).Set(s)
	}
	return new(big.Int)
}

// sent counts a payment of req as signed and sent.
func (t *Transport) sent(req x402.PaymentRequirements) {
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return
	}
	t.sentAmount(req, amount)
}

// sentAmount counts amount of req's asset as signed and sent.
func (t *Transport) sentAmount(req x402.PaymentRequirements, amount *big.Int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.signed == nil {
		t.signed = map[string]*big.Int{}
	}
	key := spentKey(req.Network, req.Asset)
	if t.signed[key] == nil {
		t.signed[key] = new(big.Int)
	}
	t.signed[key].Add(t.signed[key], amount)
}

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

func (t *Transport) maxBuffered() int64 {
	if t.MaxBufferedBody == 0 {
		return DefaultMaxBufferedBody
	}
	return max(t.MaxBufferedBody, 0)
}

// check says whether req may be paid under the limits, as a *LimitError when not. With reserve, it adds the
// amount to what the asset has spent.
func (t *Transport) check(where string, req x402.PaymentRequirements, reserve bool) error {
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return fmt.Errorf("requirements.amount: %w", err)
	}
	refuse := &LimitError{URL: where, Network: req.Network, Asset: req.Asset, Amount: amount}
	var limit *Limit
	for i := range t.Limits {
		if t.Limits[i].matches(req.Network, req.Asset) {
			limit = &t.Limits[i]
			break
		}
	}
	if limit == nil {
		return refuse
	}
	if limit.PerRequest != nil && amount.Cmp(limit.PerRequest) > 0 {
		refuse.Limit = new(big.Int).Set(limit.PerRequest)
		return refuse
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	key := spentKey(req.Network, req.Asset)
	spent := t.spent[key]
	if spent == nil {
		spent = new(big.Int)
	}
	after := new(big.Int).Add(spent, amount)
	if limit.Total != nil && after.Cmp(limit.Total) > 0 {
		refuse.Limit, refuse.Spent = new(big.Int).Set(limit.Total), new(big.Int).Set(spent)
		return refuse
	}
	if reserve {
		if t.spent == nil {
			t.spent = map[string]*big.Int{}
		}
		t.spent[key] = after
	}
	return nil
}

// release gives back a reservation whose payment was never sent.
func (t *Transport) release(req x402.PaymentRequirements) {
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return
	}
	t.releaseAmount(req, amount)
}

// releaseAmount gives back amount of what was reserved for req's asset.
func (t *Transport) releaseAmount(req x402.PaymentRequirements, amount *big.Int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.spent[spentKey(req.Network, req.Asset)]; s != nil {
		s.Sub(s, amount)
	}
}

func spentKey(network, asset string) string { return network + " " + strings.ToLower(asset) }

// replayable returns the body to send req with first, and a function that gives it again for the paid
// request; again is nil when the body cannot be given again (no GetBody, and over the buffer).
func (t *Transport) replayable(req *http.Request, where string) (first io.ReadCloser, again func() (io.ReadCloser, error), err error) {
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		body := req.Body
		return body, func() (io.ReadCloser, error) { return body, nil }, nil
	case req.GetBody != nil:
		return req.Body, req.GetBody, nil
	}
	limit := t.maxBuffered()
	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		req.Body.Close()
		return nil, nil, fmt.Errorf("payer: reading the request body of %s: %w", where, err)
	}
	if int64(len(buf)) > limit {
		// Too big to keep: sent once as it streams.
		return struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}, nil, nil
	}
	req.Body.Close()
	again = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	first, _ = again()
	return first, again, nil
}

// requestURL is the request's URL without user info, query or fragment, which may hold secrets, for errors.
func requestURL(req *http.Request) string {
	u := *req.URL
	u.User, u.RawQuery, u.Fragment = nil, "", ""
	return u.String()
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

var _ http.RoundTripper = (*Transport)(nil)

// payBatch pays a batch-settlement requirement: the next voucher of the payer's channel with the offer's
// receiver, and a deposit when the channel does not cover it. A corrective 402 (the server holds another
// cumulative amount, proven by a voucher the payer signed) resyncs the channel, and the request is paid once
// more.
func (t *Transport) payBatch(req *http.Request, where string, offer Offer, i int, rpc *chainReader, again func() (io.ReadCloser, error)) (*http.Response, error) {
	ctx := req.Context()
	for attempt := 0; ; attempt++ {
		plan, err := t.Payer.planBatch(ctx, rpc, offer, i, false)
		if err != nil {
			return nil, fmt.Errorf("payer: %s: %w", where, err)
		}
		resp, resynced, err := t.payPlan(ctx, req, where, plan, rpc, again)
		plan.finish()
		if err != nil || !resynced || attempt > 0 {
			return resp, err
		}
		resp.Body.Close()
	}
}

// payPlan reserves, signs and sends the plan's payment, and records the answer on the channel.
func (t *Transport) payPlan(ctx context.Context, req *http.Request, where string, plan *batchPlan, rpc *chainReader, again func() (io.ReadCloser, error)) (*http.Response, bool, error) {
	generic := plan.req.Generic()
	deposit, undo, err := t.reserveBatch(where, plan)
	if err != nil {
		return nil, false, err
	}
	pay, err := plan.sign(ctx, rpc, deposit, false, nil)
	if err != nil {
		undo()
		return nil, false, fmt.Errorf("payer: %s: %w", where, err)
	}
	paid := req.Clone(ctx)
	if paid.Body, err = again(); err != nil {
		undo()
		return nil, false, fmt.Errorf("payer: %s: the request body for the paid request: %w", where, err)
	}
	if req.GetBody == nil && paid.Body != nil && paid.Body != http.NoBody {
		paid.GetBody = again
	}
	paid.Header.Set(pay.Header, pay.Value)
	t.sentAmount(generic, t.counted(plan))
	resp, err := t.base().RoundTrip(paid)
	if err != nil {
		plan.answered(ctx, rpc, nil)
		return nil, false, err
	}
	// An answer that does not add up leaves the channel stale, read again before the next payment; the
	// response is the caller's all the same.
	resynced, _ := plan.answered(ctx, rpc, resp)
	if resynced {
		// The payer's own signature proves it authorized the server's last amount before: a voucher up to it
		// signs nothing new, so the budget counts only what a voucher adds above it.
		t.mu.Lock()
		if c := t.covered[plan.ch.state.ID]; c == nil || c.Cmp(plan.ch.state.Signed) < 0 {
			t.covered[plan.ch.state.ID] = new(big.Int).Set(plan.ch.state.Signed)
		}
		t.mu.Unlock()
	}
	return resp, resynced, nil
}

// priceLimit is the Limit that covers req's asset, after checking one request's price against its PerRequest.
func (t *Transport) priceLimit(where string, req x402.PaymentRequirements) (*Limit, error) {
	price, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return nil, fmt.Errorf("requirements.amount: %w", err)
	}
	refuse := &LimitError{URL: where, Network: req.Network, Asset: req.Asset, Amount: price}
	for i := range t.Limits {
		if l := &t.Limits[i]; l.matches(req.Network, req.Asset) {
			if l.PerRequest != nil && price.Cmp(l.PerRequest) > 0 {
				refuse.Limit = new(big.Int).Set(l.PerRequest)
				return nil, refuse
			}
			return l, nil
		}
	}
	return nil, refuse
}

// reserveBatch works out the deposit the plan signs (nil for none) and reserves what the payment adds to the
// budget: the deposit, which every voucher up to it spends from, and, on a channel whose deposits this
// Transport did not count (one found on chain), whatever the voucher signs beyond what they cover. A deposit is
// what the payer wants (Options.DepositRequests requests, or the offer's minDeposit), less when the Total leaves
// less (with no Total, at most DepositRequests times PerRequest), and never less than the offer's minDeposit or
// what the voucher needs: then it is refused. undo gives the reservation back.
func (t *Transport) reserveBatch(where string, plan *batchPlan) (deposit *big.Int, undo func(), err error) {
	generic := plan.req.Generic()
	limit, err := t.priceLimit(where, generic)
	if err != nil {
		return nil, nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	key, id := spentKey(generic.Network, generic.Asset), plan.ch.state.ID
	spent := orZero(t.spent[key])
	oldCovered := t.covered[id]
	covered := new(big.Int).Set(plan.ch.state.Charged)
	if oldCovered != nil {
		covered.Set(oldCovered)
	}
	count := new(big.Int)
	if plan.need.Sign() > 0 {
		amount := new(big.Int).Set(plan.want)
		var room *big.Int
		switch {
		case limit.Total != nil:
			room = new(big.Int).Sub(limit.Total, spent)
		case limit.PerRequest != nil:
			n := int64(t.Payer.opts.DepositRequests)
			if n <= 0 {
				n = DefaultDepositRequests
			}
			room = new(big.Int).Mul(limit.PerRequest, big.NewInt(n))
		}
		if room != nil && amount.Cmp(room) > 0 {
			amount.Set(room)
		}
		if amount.Cmp(plan.least) < 0 {
			refuse := &LimitError{URL: where, Network: generic.Network, Asset: generic.Asset, Amount: new(big.Int).Set(plan.least), Deposit: true}
			if limit.Total != nil {
				refuse.Limit, refuse.Spent = new(big.Int).Set(limit.Total), new(big.Int).Set(spent)
			} else {
				refuse.Limit = room
			}
			return nil, nil, refuse
		}
		deposit = amount
		count.Add(count, amount)
		covered.Add(covered, amount)
	}
	if plan.next.Cmp(covered) > 0 {
		count.Add(count, new(big.Int).Sub(plan.next, covered))
		covered.Set(plan.next)
	}
	if after := new(big.Int).Add(spent, count); limit.Total != nil && after.Cmp(limit.Total) > 0 {
		return nil, nil, &LimitError{URL: where, Network: generic.Network, Asset: generic.Asset, Amount: count,
			Limit: new(big.Int).Set(limit.Total), Spent: new(big.Int).Set(spent)}
	}
	if t.spent == nil {
		t.spent = map[string]*big.Int{}
	}
	if t.covered == nil {
		t.covered = map[common.Hash]*big.Int{}
	}
	t.spent[key] = new(big.Int).Add(spent, count)
	t.covered[id] = covered
	plan.counted = count
	return deposit, func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		t.spent[key].Sub(t.spent[key], count)
		if oldCovered == nil {
			delete(t.covered, id)
		} else {
			t.covered[id] = oldCovered
		}
	}, nil
}

// counted is what the plan's payment added to the budget.
func (t *Transport) counted(plan *batchPlan) *big.Int { return orZero(plan.counted) }

// signIn sends req again answering offer's sign-in-with-x challenge, and returns the answer unless it is 402
// (nil, nil then: the offer is to be paid). A 402 without a challenge, or with one the payer does not sign, is
// nil, nil too.
func (t *Transport) signIn(req *http.Request, where string, offer Offer, again func() (io.ReadCloser, error)) (*http.Response, error) {
	header, ok, err := t.Payer.SignIn(offer, where)
	if err != nil || !ok {
		return nil, nil // a challenge the payer does not sign is no reason not to pay
	}
	signed := req.Clone(req.Context())
	if signed.Body, err = again(); err != nil {
		return nil, fmt.Errorf("payer: %s: the request body for the sign-in: %w", where, err)
	}
	if req.GetBody == nil && signed.Body != nil && signed.Body != http.NoBody {
		signed.GetBody = again
	}
	signed.Header.Set(x402.HeaderSignInWithX, header)
	resp, err := t.base().RoundTrip(signed)
	if err != nil || resp.StatusCode != http.StatusPaymentRequired {
		return resp, err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, maxOfferBody))
	resp.Body.Close()
	return nil, nil
}
