package gate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// exchange is one gated request on its way to exactly one PaymentOutcome.
type exchange struct {
	g     *Gate
	w     http.ResponseWriter
	r     *http.Request
	next  Handler
	start time.Time

	offers *offerSet
	turn   uint64 // which settlement wallet this request's erc2612 offers name
	v1     bool   // the client paid with version 1: answer in its forms

	req      x402.VerifyRequest // the payment and the gate's own requirement, as the facilitator gets them
	decimals uint8              // of the offer's asset, to read an upstream's dollar amount
	// charge is what an upto payment is settled for once decided (decideCharge, or its journal record);
	// "" while undecided.
	charge   string
	id       journal.ID
	payer    string
	verifyMs float64
	settleMs float64
	// resend: the payment is presented again, and its earlier /settle may have reached the (remote)
	// facilitator: a refusal now is no final answer.
	resend bool

	// chargeRecorded: charge is its journal record's, decided by the response the payment was first presented
	// for; this request's response may not name more (namesMoreThanCharged).
	chargeRecorded bool
	// recorded is the gate's record of the payment as this request wrote it (claim), for a later write that
	// changes it to skip reading it first (journal.UpdateKnown); nil when this request did not write it.
	recorded *journal.Record
	// idled: the journal's in-flight mark of the payment was cleared with its served mark (markServed).
	idled bool
	// verified: the payment is new, verified by this request (serveVerified); until the request records it, a
	// funds hold of it is this request's to let go (unhold).
	verified bool
	// jctx is the context of this request's journal writes when they may be deferred into the embedded engine's
	// (journal.Defer; see Gate.behind), nil otherwise: see journalCtx.
	jctx context.Context
	// claimLater is the outcome of the gate's record, deferred to ride with the engine's claim (record).
	claimLater *journal.Later

	headers     http.Header // the response headers before the upstream ran, restored when the gate answers itself
	retryAfter  string      // the Retry-After of the gate's own 502, when it knows when to present the payment again
	sentNothing bool        // the gate's own 502 is of a settlement the facilitator says it sent nothing of
	ended       bool
	// logLine and logFields are the outcome's log line, held back until the response is out when
	// logAfterResponse says so (endHeld, writeLog).
	logLine          *zapcore.CheckedEntry
	logFields        []zap.Field
	logAfterResponse bool
	// presented is the payment as read; renames is a payment its id was bound to that bought nothing, which the
	// id may name no longer (paymentIdentifierTaken).
	presented presented
	renames   journal.ID
	// streamed is set once a response larger than max_buffer began to stream: it is marked served when the
	// upstream has sent all of it.
	streamed *streamedPayment
}

// upstream is a buffered response of the rest of the route.
type upstream struct {
	rec *heldResponse
	buf *bytes.Buffer
	err error // the next handler's error (the server then answers with its status)
}

// ok reports whether the upstream produced a response the payer pays for: no error and no 4xx/5xx status.
func (u *upstream) ok() bool { return u.err == nil && u.rec.Status() < http.StatusBadRequest }

func (u *upstream) free() {
	if u.buf.Cap() > maxPooledBuffer {
		return // one large response must not keep its memory for every later one
	}
	u.buf.Reset()
	gateBuffers.Put(u.buf)
}

// maxPooledBuffer is the largest response buffer kept for reuse.
const maxPooledBuffer = 1 << 20

// run walks the payment through the gate: decode, match, one request per payment, verify, then the
// configured order of upstream and settlement.
func (x *exchange) run() error {
	offers, err := x.g.offersFor(x.r)
	if err != nil {
		// The request's own terms are not good: answering with them, or serving, would sell at a price
		// nobody set.
		return &StatusError{Status: http.StatusInternalServerError, Err: err}
	}
	x.offers = offers
	x.turn = x.g.rotation.Add(1)
	value, fromV1Header := x.takePaymentHeader()
	if answered, err := x.signIn(value == ""); answered {
		return err
	}
	if x.g.cfg.SignInOnly && value != "" {
		return x.signInOnlyRefusesPayment() // siwx.go
	}
	if value == "" {
		return x.noPayment()
	}
	if !fromV1Header && x.offers.hasBatch() {
		if p, ok, err := decodeBatchPayment(value); ok {
			return x.serveBatch(p, err) // batch.go
		}
	}
	p, err := x.read(value, fromV1Header)
	if err == nil {
		err = x.paymentIdentifierProblem(p)
	}
	if err != nil {
		return x.invalidHeader(err)
	}
	// A payment buys only a response of a route whose offer it matches, or, presented again, the resource its
	// record names at the route it was first presented at (onRecord): a payment another route journalled is never
	// served here on the strength of its record.
	if p.mismatch != nil {
		switch again, err := x.onRecord(p); {
		case err != nil:
			return x.verifyUnreachable("the gate's settlement journal could not be read; nothing was charged, try again", err)
		case !again:
			return x.mismatched(p)
		}
	}
	switch {
	case !p.haveID:
		return x.verifyFailed(x402.VerifyResponse{IsValid: false, InvalidReason: x402.ReasonInvalidPayload,
			InvalidMessage: "the payment names no payer and nonce"})
	}
	x.req, x.id, x.decimals = p.req, p.id, p.decimals
	x.req.PaymentPayload = x.declaredPayload(x.req.PaymentPayload) // bazaar.go
	x.presented = p
	if answered, err := x.paymentIdentifierTaken(p); answered {
		return err
	}
	if x.marksWhileVerifying(p) {
		return x.markWhileVerifying(p)
	}
	mine, rec, found, err := x.g.ledger.acquireRecord(x.r.Context(), p.id)
	if err != nil {
		return x.verifyUnreachable("the gate's settlement journal could not be reached; nothing was charged, try again", err)
	} else if !mine {
		return x.alreadyUsed("another request is presenting this payment right now; wait for its answer instead of paying again")
	}
	defer func() { x.g.ledger.releaseIdled(p.id, x.idled) }()
	if x.g.behind {
		// Sent before the in-flight mark is cleared, whatever happened: no deferred write outlives the request.
		x.jctx = journal.Defer(context.WithoutCancel(x.r.Context()), x.g.ledger.store)
		defer x.flushBehind()
	}
	switch {
	case found:
		return x.presentedAgain(rec, p)
	case p.mismatch != nil:
		return x.mismatched(p) // its record went (pruned past its deadline) since onRecord read it
	}
	return x.verifyAndServe()
}

// mismatched answers a payment that matches none of the request's offers.
func (x *exchange) mismatched(p presented) error {
	return x.verifyFailed(x402.VerifyResponse{IsValid: false, InvalidReason: p.mismatch.Reason, InvalidMessage: p.mismatch.Message})
}

// presented is a payment header as read: the payload, the offer it pays (or why none), and its journal id.
type presented struct {
	payload  x402.ExactEVMPayload
	req      x402.VerifyRequest
	mismatch *x402.Mismatch
	id       journal.ID
	haveID   bool
	decimals uint8 // of the offer's asset
	// identifier is the id the payment names in its payment-identifier extension ("" none), identifierErr
	// why it names none that reads.
	identifier    string
	identifierErr error
}

// read decodes a payment header and matches it against the offers. PAYMENT-SIGNATURE carries version 2;
// X-PAYMENT either version, and a version 1 client is answered in version 1 forms. A version 2 payment's id
// comes from the payment itself; version 1 names no asset, so its id needs the offer it pays.
func (x *exchange) read(value string, fromV1Header bool) (presented, error) {
	var p presented
	var v2 *x402.PaymentPayload
	if fromV1Header {
		decoded, err := x402.DecodePaymentHeader(value)
		x.v1 = err != nil || decoded.Version == x402.Version1
		if err != nil {
			return p, err
		}
		if decoded.V1 != nil {
			p.payload = decoded.V1.Payload
			if p.req, p.mismatch = x.matchV1(decoded.V1); p.mismatch == nil {
				rq := p.req.PaymentRequirements
				p.id, p.haveID = gateID(rq.Network, rq.Extra.AssetTransferMethod, rq.Asset, p.payload)
			}
			return p, nil
		}
		v2 = decoded.V2
	} else {
		decoded, err := x402.DecodePaymentPayload(value)
		if err != nil {
			return p, err
		}
		v2 = &decoded
	}
	p.payload = v2.Payload
	p.identifier, p.identifierErr = v2.PaymentIdentifier()
	p.id, p.haveID = gateID(v2.Accepted.Network, x402.TransferMethod(v2.Accepted, p.payload), v2.Accepted.Asset, p.payload)
	var o *offer
	if p.req, o, p.mismatch = x.match(v2); o != nil {
		p.decimals = o.decimals
	}
	return p, nil
}

// takePaymentHeader returns the payment the request carries, and whether it came in the version 1 header, and takes
// every payment header off the request. A payment header is a bearer value: nothing after the gate needs it once
// read, and whatever sees it could present it (the upstream and its logs, reverse_proxy's debug log of the
// request it sends, an error route proxying the request on). Who paid what reaches the upstream through the
// gate's variables (Config.SetVar), never the payment itself.
func (x *exchange) takePaymentHeader() (value string, fromV1Header bool) {
	h := x.r.Header
	if value = h.Get(x.g.cfg.PaymentHeader); value == "" {
		value, fromV1Header = h.Get(x402.HeaderXPayment), true
	}
	for _, name := range []string{x.g.cfg.PaymentHeader, x402.HeaderPaymentSignature, x402.HeaderXPayment} {
		h.Del(name)
	}
	return value, fromV1Header && value != ""
}

// verifyAndServe verifies a new payment and serves it in the gate's settlement mode.
func (x *exchange) verifyAndServe() error {
	if x.g.cfg.Settle == SettleAsync && x.g.holder == nil {
		// A payer who owes a served payment waits for it to settle (serveFirst): only a few of its requests may
		// wait at once, each holding a connection; the rest are turned away before they cost a verification.
		release, full := x.g.ledger.reserveWaiter(signedPayer(x.req))
		if full {
			return x.tooManyWaiting()
		}
		defer release()
	}
	return x.serveVerified(x.verifyTimed(x.r.Context()))
}

// verifyTimed is verify under ctx, timed.
func (x *exchange) verifyTimed(ctx context.Context) (x402.VerifyResponse, error) {
	t := x.g.now()
	vres, err := x.verify(ctx)
	x.verifyMs = msSince(x.g.now, t)
	return vres, err
}

// serveVerified serves a new payment the facilitator answered vres, err for, in the gate's settlement mode.
func (x *exchange) serveVerified(vres x402.VerifyResponse, err error) error {
	if err != nil {
		x.unholdLater()
		return x.verifyUnreachable(fmt.Sprintf("the facilitator could not verify the payment: %s; nothing was charged, try again", x402.DescribeFailure(err)), err)
	}
	if !vres.IsValid {
		x.unhold()
		return x.verifyFailed(vres)
	}
	x.verified = true
	// The payer is the one the payment is signed by (the facilitator checked the signature); an answer that
	// names another is no answer about this payment.
	x.payer = signedPayer(x.req)
	if vres.Payer != "" && !strings.EqualFold(vres.Payer, x.payer) {
		x.unhold()
		return x.verifyUnreachable(fmt.Sprintf("the facilitator's answer names payer %s, but the payment is signed by %s; nothing was charged", vres.Payer, x.payer), nil)
	}
	if answered, err := x.namePaymentIdentifier(x.presented); answered {
		return err
	}
	x.setPaymentPlaceholders()

	x.setVar(VarStatus, "verified")
	x.emit(EventVerified, nil)
	// A request for a tunnel (upgrade headers, CONNECT) is served in its route's mode like any other: what the
	// upstream answers decides its charge, and a tunnel it opens is paid for before it opens (heldResponse).
	switch {
	case x.g.cfg.Settle == SettleBefore:
		if err := x.record(); err != nil {
			return x.recordFailed(err)
		}
		return x.settleThenServe(nil)
	case x.g.cfg.Settle == SettleAsync:
		if x.g.ledger.Backlog() >= x.g.cfg.AsyncBacklog {
			x.g.warnBacklog()
			return x.settleAfter()
		}
		if x.g.holder == nil {
			if earlier := x.g.ledger.serveFirst(x.id, x.payer); earlier != nil {
				if !x.awaitEarlierPayments(earlier) {
					return x.verifyUnreachable("the request ended while the payer's earlier payment was settling; this payment was not settled and may be sent again", nil)
				}
				return x.settleAfter()
			}
			defer x.g.ledger.forgive(x.id)
		}
		if !x.roomToSettleAfterServing() {
			// Served first, it could expire before its turn to settle: settled first, it is paid or not served.
			return x.settleAfter()
		}
		return x.serveUpstream(func(up *upstream) error {
			if up.ok() && up.rec.tunnel {
				// A tunnel is served as it goes, for as long as it stays open: it is settled before it opens.
				return x.settleHeld(up)
			}
			if !up.ok() {
				return x.passUnpaid(up)
			}
			return x.serveAsync(up)
		})
	default:
		return x.settleAfter()
	}
}

// awaitEarlierPayments waits, up to the settlement timeout, until the payer's earlier async payments have
// settled: the facilitator verified this payment against funds they may still spend. It reports false when the
// request ended first: nobody would receive the response this payment buys, so it must not be settled.
func (x *exchange) awaitEarlierPayments(settled <-chan struct{}) bool {
	t := time.NewTimer(settleTimeout)
	defer t.Stop()
	select {
	case <-settled:
	case <-t.C:
		x.g.logger.Warn("settle async: the payer's earlier payments are still not settled; settling this one anyway",
			zap.String("payer", x.payer))
	case <-x.r.Context().Done():
		return false
	}
	return true
}

// settleAfter runs the upstream and settles if it answered successfully, then serves.
func (x *exchange) settleAfter() error {
	return x.serveUpstream(x.settleHeld)
}

// settleHeld settles for the upstream's held answer, when it is one the payer pays for, and serves it.
func (x *exchange) settleHeld(up *upstream) error {
	if !up.ok() {
		return x.passUnpaid(up)
	}
	x.decideCharge(up)
	if err := x.record(); err != nil {
		return x.recordFailed(err)
	}
	return x.settleThenServe(up)
}

// fundsHolder is a facilitator that can hold a verified payment against the payer's funds until it settles
// (the embedded engine). A gate that serves before it settles verifies with it, so that a payer is not served
// more than the payer can pay while the settlements wait their turn. The hold lasts until the payment settles,
// is refused for good or expires, whatever the settlement attempts meet meanwhile, or until Release.
type fundsHolder interface {
	VerifyAndHold(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error)
	// HoldServed holds a payment served before a restart, unsettled, without verifying it again (see
	// Ledger.settleAll).
	HoldServed(ctx context.Context, req x402.SettleRequest) error
	Release(req x402.VerifyRequest) error
}

// verify asks the facilitator about the payment; in settle async, holding it against the payer's funds.
func (x *exchange) verify(ctx context.Context) (x402.VerifyResponse, error) {
	if x.g.holder != nil {
		return x.g.holder.VerifyAndHold(ctx, x.req)
	}
	return x.g.fac.Verify(ctx, x.req)
}

// unhold lets go of the hold verify placed on a payment that will not be settled after all (the upstream
// failed, or the journal could not record it), in settle async and in its fallback once the backlog is full.
// A release the journal did not take (an outage) is tried again once it is back (see Ledger.leaveBehind).
//
// A payment refused at verification, or that could not be verified, is let go too, though this verification
// held nothing (or failed after it held): the request holds the payment's in-flight mark and no journal records
// it, so nobody else presents it and nothing will settle it, and a hold of it is one an earlier presentation took
// and never let go, its gateway killed between its verification and its record. With a journal several gateways
// share, that hold outlives the gateway; left, it would count against the payer until the payment's deadline
// (a payment bound to the dead gateway's wallet, presented again to a gateway that does not send from it, is
// refused there, and nothing else would ever let its hold go).
func (x *exchange) unhold() {
	if x.g.holder == nil {
		return
	}
	if err := x.g.holder.Release(x.req); err != nil {
		x.g.logger.Warn("letting go of a payment's funds hold; trying again once the journal is back", zap.Error(err))
		x.unholdLater()
	}
}

// unholdLater hands unhold's release to the ledger's leftover loop, which lets the hold go once this request's
// in-flight mark is over and the journal holds no record of the payment. For a verification that failed, likely
// because the journal or the facilitator is out of reach: the answer must not wait on a journal that hangs.
func (x *exchange) unholdLater() {
	if x.g.holder == nil {
		return
	}
	h, req := x.g.holder, x.req
	x.g.ledger.leaveBehind(x.id, func() error { return h.Release(req) }, x.req.PaymentPayload.Payload.Deadline())
}

// presentedAgain answers a payment the journal already holds. Presented for the resource it was first presented
// for, at the route it was first presented at (boughtHere), it is judged by its record: the terms it was accepted
// under, whatever the route offers now. Elsewhere it buys nothing: not on a route whose offer differs from the one
// it was journalled under, nor for another resource than the one it was first presented for (boughtResource).
// Served: never again. Not served (its settlement was pending or unknown, the upstream failed after it settled,
// or its response was cut short): the same payment, byte for byte in what it signs, is served once without paying
// twice: a synchronous one is settled from the journal's request, which answers with the first settlement, and an
// async one is settling in the background already.
func (x *exchange) presentedAgain(rec journal.Record, p presented) error {
	var recorded x402.VerifyRequest
	if err := json.Unmarshal(rec.Request, &recorded); err != nil {
		x.g.logger.Error("a journalled payment cannot be resumed", zap.String("payment", rec.ID.String()), zap.Error(err))
		return x.alreadyUsed("this payment is already recorded and cannot be presented again")
	}
	switch rq := recorded.PaymentRequirements; {
	case x.boughtHere(rec, recorded, p.payload):
		// A reload since (another price, recipient or networks), a price_grace passed, a price set per request
		// that resolves otherwise now, another gateway configured otherwise: none leaves its payer charged for
		// nothing.
		if p.mismatch != nil {
			x.g.logger.Info("a payment presented again for the resource it bought is judged by its record: the terms it was accepted under are no longer offered here",
				zap.String("payment", rec.ID.String()), zap.String("resource", shownResource(rec.Resource)), zap.String("amount", rq.Amount),
				zap.String("pay_to", rq.PayTo), zap.String("network", rq.Network), zap.String("mismatch", p.mismatch.Reason))
		}
	case p.mismatch != nil:
		return x.mismatched(p)
	case !x402.SameTerms(rq, x.req.PaymentRequirements):
		return x.alreadyUsed(fmt.Sprintf("this payment was made for another resource (%s raw units of %s to %s on %s); it buys only that resource's response",
			rq.Amount, rq.Asset, rq.PayTo, rq.Network))
	}
	if !samePayload(recorded.PaymentPayload.Payload, p.payload) {
		return x.alreadyUsed("another payment with this payer and nonce was already presented; sign a new payment")
	}
	if rec.Served {
		return x.alreadyUsed(fmt.Sprintf("this payment already bought its response at %s; sign a new payment for another",
			rec.ServedAt.UTC().Format(time.RFC3339)))
	}
	// Only the holder of this very payment gets this far, and learns only what it was first presented for. A
	// record written before records named their resource is taken on its terms alone, as it was then.
	if rec.Resource != "" && rec.Resource != x.boughtResource() {
		return x.alreadyUsed(fmt.Sprintf("this payment was first presented for %s and buys only that resource's response: present it "+
			"for that resource to receive it (it is not charged again), or sign a new payment for this one", shownResource(rec.Resource)))
	}
	x.req, x.id, x.payer = recorded, rec.ID, rec.Payer
	if x.decimals == 0 {
		// Judged by its record, the payment matched no offer of the route, which is where decimals come from.
		x.decimals = x.assetDecimals(recorded.PaymentRequirements)
	}
	if x.upto() && rec.Amount != "" {
		// Decided when the payment was first served: the upstream's answer now changes nothing, and a response
		// that names more is not sent (namesMoreThanCharged).
		x.charge, x.chargeRecorded = rec.Amount, true
	}
	x.setPaymentPlaceholders()
	if rec.Async {
		return x.serveAsyncAgain(rec)
	}
	if rec.Response != nil && rec.Response.Success {
		// Settled before: nothing to ask the facilitator.
		resp := *rec.Response
		return x.serveSettled(resp, nil)
	}
	// The earlier /settle of the payment may have reached a remote facilitator (its outcome was never learnt, or
	// was pending): a refusal now may be that facilitator finding the nonce spent by its own settlement.
	x.resend = !x.g.cfg.Embedded && (rec.Response == nil || rec.Response.Pending())
	if !x.g.cfg.Embedded && !x.resend {
		if err := x.requestAgain(); err != nil {
			return x.verifyUnreachable("the gate's settlement journal could not be written; nothing was charged, try again", err)
		}
	}
	return x.settleThenServe(nil)
}

// requestAgain writes, before a payment is settled again whose record says no settlement of it reached the
// remote facilitator (nothing was sent, or it was refused), that its settlement is requested and its outcome not
// known: this one may reach it, and if its answer is lost, a refusal of the payment presented again after it
// ("nonce already used", from a facilitator that settled it) must be no final answer. A record that says the
// payment settled meanwhile is left as it is, and the payment is presented again to be served from it.
func (x *exchange) requestAgain() error {
	_, err := x.g.ledger.store.Update(context.WithoutCancel(x.r.Context()), x.id, func(r *journal.Record) error {
		if r.Response != nil && r.Response.Success {
			return errors.New("the payment's record says it settled meanwhile")
		}
		r.Response = requestedSettlement(x.req.PaymentRequirements.Network, x.payer)
		return nil
	})
	return err
}

// requestedSettlement is the answer recorded of a settlement on network of payer's payment, requested and not
// answered yet: its outcome is not known (x402.SettleResponse.OutcomeUnknown).
func requestedSettlement(network, payer string) *x402.SettleResponse {
	return &x402.SettleResponse{Success: false, Network: network, Payer: payer,
		ErrorReason: x402.ReasonSettlementPending, ErrorMessage: "settlement requested; its outcome is not known yet"}
}

// serveAsyncAgain serves an async payment whose first response was cut short (the client went, the write
// failed, the process died before it could record the response as delivered). Its settlement runs in the
// background, from the journal, whatever happens here; only a settlement already refused stops it. One whose
// outcome the background settlement could not learn (an earlier attempt may have settled it, see Ledger.fail) is
// served: its payer may have paid for it.
func (x *exchange) serveAsyncAgain(rec journal.Record) error {
	rq := x.req.PaymentRequirements
	resp := x402.SettleResponse{Success: false, Network: rq.Network, Payer: x.payer, ErrorReason: x402.ReasonSettlementPending,
		ErrorMessage: "the payment was accepted and is being settled in the background"}
	if rec.Response != nil && rec.State == journal.StateFinal {
		resp = *rec.Response
		if !resp.Success && !resp.OutcomeUnknown() {
			return x.settleFailed(resp)
		}
	}
	return x.serveUpstream(func(up *upstream) error {
		if !up.ok() {
			return x.passFailure(up, "the upstream answered %d; the payment is settling and may be presented again for its response")
		}
		if named, more := x.namesMoreThanCharged(up); more {
			return x.chargedLess(named, resp)
		}
		if x.lostMark() {
			return x.servedNothing("the payment is being settled")
		}
		x.setSettleHeader(resp)
		if resp.Success {
			x.endHeld(x.settledOutcome(resp))
		} else {
			x.endHeld(x402.PaymentOutcome{Status: x402.OutcomeSettlePending, Payer: x.payer, Network: rq.Network, TotalMs: x.totalMs()})
		}
		return x.deliver(up, nil)
	})
}

// samePayload reports whether two payloads are the same signed payment.
func samePayload(a, b x402.ExactEVMPayload) bool {
	ja, errA := json.Marshal(a)
	jb, errB := json.Marshal(b)
	return errA == nil && errB == nil && strings.EqualFold(string(ja), string(jb))
}

// record writes the gate's record of a payment about to be settled. It is written final (with a not-yet-known
// answer), in one write, because the engine's start-up reconciliation releases claimed records a previous
// process left, and a payment whose settlement may have been sent must stay known, so that presenting it
// again settles it from the journal and serves it.
func (x *exchange) record() error {
	return x.claim(x.journalCtx(), true, func(r *journal.Record) {
		r.State, r.Response = journal.StateFinal, requestedSettlement(x.req.PaymentRequirements.Network, x.payer)
	})
}

// claim writes the gate's record of the payment (what it is, and the request to settle it with), changed by
// edit when given; errRecordedElsewhere when the journal holds one already. later lets the write ride with the
// embedded engine's claim, when ctx allows (journal.ClaimBehind): its outcome is then x.claimLater's, which
// settleThenServe reads once the engine answered.
func (x *exchange) claim(ctx context.Context, later bool, edit func(*journal.Record)) error {
	body, err := json.Marshal(x.req)
	if err != nil {
		return err
	}
	rq := x.req.PaymentRequirements
	rec := journal.Record{
		ID: x.id, State: journal.StateClaimed, Network: rq.Network, Payer: x.payer, Asset: rq.Asset, Amount: x.chargeAmount(),
		PayTo: rq.PayTo, Request: body, Owner: x.g.ledger.owner,
		Deadline: x.req.PaymentPayload.Payload.Deadline(), Resource: x.boughtResource(), Described: x.describedKey(),
		Route: x.g.cfg.Route,
	}
	if edit != nil {
		edit(&rec)
	}
	var written journal.Record
	var claimed bool
	if later {
		written, claimed, x.claimLater, err = journal.ClaimBehind(ctx, x.g.ledger.store, rec)
	} else {
		written, claimed, err = x.g.ledger.store.Claim(ctx, rec)
	}
	if err == nil && !claimed {
		err = errRecordedElsewhere
	}
	if err == nil {
		x.recorded = &written
	}
	return err
}

// errRecordedElsewhere: the journal gained a record of the payment between the look-up and the claim.
var errRecordedElsewhere = errors.New("the payment was recorded by another request")

// recordFailed answers a payment the journal could not take: nothing was settled, so retrying is safe.
func (x *exchange) recordFailed(err error) error {
	if errors.Is(err, errRecordedElsewhere) {
		// The other record's request settles the payment, and its hold is the same as ours.
		return x.alreadyUsed("this payment was just presented by another request; wait for its answer instead of paying again")
	}
	x.unhold() // not recorded, so never settled
	x.g.logger.Error("writing a payment to the settlement journal", zap.Error(err))
	return x.verifyUnreachable("the gate could not record the payment; nothing was charged, try again", err)
}

// settleThenServe settles the recorded payment and serves it once settled: with up, the response the upstream
// already gave; without, the upstream is called now.
func (x *exchange) settleThenServe(up *upstream) error {
	ctx, cancel := context.WithTimeout(x.journalCtx(), settleTimeout)
	defer cancel()
	t := x.g.now()
	req := x.settleRequest()
	resp, err := x.g.fac.Settle(ctx, req)
	x.settleMs = msSince(x.g.now, t)
	if x.claimLater != nil {
		// The gate's record rode with the engine's claim (or goes now, if the engine wrote nothing): one that found
		// another request's record there stopped the engine's claim with it, and nothing was sent.
		if err := x.claimLater.Land(); err != nil {
			if errors.Is(err, journal.ErrExists) {
				err = errRecordedElsewhere
			}
			return x.recordFailed(err)
		}
	}
	if err != nil {
		if errors.Is(err, x402.ErrNotSent) && !x.resend {
			// Surely never reached the facilitator, or it answered that it sent nothing: a refusal of the payment
			// presented again is then final.
			what := "the settlement request never reached the facilitator"
			if errors.Is(err, x402.ErrSentNothing) {
				what = "the facilitator sent nothing for the settlement"
			}
			x.note(func(r *journal.Record) {
				r.Response = &x402.SettleResponse{Success: false, Network: x.req.PaymentRequirements.Network, Payer: x.payer,
					ErrorReason: x402.ReasonUnexpectedSettleError, ErrorMessage: what}
			})
		}
		if errors.Is(err, x402.ErrSentNothing) && !x.resend {
			x.sentNothing, x.retryAfter = true, "1"
			return x.settleUnreachable("the facilitator could not settle the payment now: the chain could not take its settlement, and nothing was sent; present the same payment again", err, nil)
		}
		return x.settleUnreachable(fmt.Sprintf("the facilitator could not be reached to settle: %s", x402.DescribeFailure(err)), err, nil)
	}
	if problem := x402.SettlementProblem(req, resp); resp.Success && problem != "" {
		x.g.logger.Error("the facilitator answered success for a settlement it does not show", zap.String("facilitator", x.g.cfg.FacilitatorName),
			zap.String("payment", x.id.String()), zap.String("problem", problem))
		return x.settleUnreachable("the facilitator answered success, but "+problem+"; the outcome is unknown", nil, nil)
	}
	if !resp.Success {
		if resp.Pending() {
			x.note(func(r *journal.Record) { r.Response = &resp })
			return x.settleUnreachable("the settlement transaction "+resp.Transaction+" is not final yet", nil, &resp)
		}
		if !x.g.cfg.Embedded && resp.OutcomeUnknown() {
			// A remote facilitator's failure after it broadcast: the transaction may still mine. The record stays
			// "outcome not known", so a refusal of the payment presented again is no final answer either (resend).
			// The engine names a transaction in a failure only when it reverted (or, in a record of an older
			// release, when it was dropped and its nonce taken): its answers are final as they are.
			return x.settleUnreachable(fmt.Sprintf("the facilitator answered %s: %s, after it sent transaction %s, which may still settle",
				resp.ErrorReason, resp.ErrorMessage, resp.Transaction), nil, nil)
		}
		if resp.ErrorReason == x402.ReasonNoAvailableWallets {
			if !x.resend {
				// Nothing was sent: presented again, the payment is settled afresh, and a refusal then is final.
				x.note(func(r *journal.Record) { r.Response = &resp })
			}
			return x.noWalletNow(resp)
		}
		if x.resend {
			// A refusal of a payment whose earlier settlement may have reached the facilitator says nothing
			// sure: a facilitator without a journal refuses a repeat of a settlement it made ("nonce already
			// used"). The outcome stays unknown; the payer is never told to pay again for it.
			return x.settleUnreachable(fmt.Sprintf("the facilitator refused the payment (%s: %s), but its earlier settlement request may have reached the facilitator and settled it; check the chain before paying again",
				resp.ErrorReason, resp.ErrorMessage), nil, nil)
		}
		// Refused: final, so the record leaves the backlog and is pruned past its deadline. Presented again, the
		// payment is still asked of the facilitator, which answers from its own journal.
		x.note(func(r *journal.Record) { r.State, r.Response = journal.StateFinal, &resp })
		x.unhold() // settle async's fallback: a refusal the facilitator would retry (a busy pool) keeps its hold
		return x.settleFailed(resp)
	}
	if x.upto() && resp.Amount == "" {
		resp.Amount = req.PaymentRequirements.Amount // a facilitator that settled it without saying how much
	}
	return x.serveSettled(resp, up)
}

// noWalletNow answers a payment no settlement wallet could send right now: the pool was busy, or (in a cluster)
// the wallet the payment is bound to is another instance's. The spec's answer to that is "retry after 1 to 2
// seconds", and the payment stays good: nothing was sent, and its record says so (a settle async fallback keeps
// its hold), so the same payment presented again (here in a moment, or at the gateway holding its wallet) is
// settled afresh, once, and a refusal then is final. A 402 would tell the payer to pay again for it, after the
// upstream ran. (Presented again after a settlement that may have reached the facilitator, the record keeps its
// outcome not known.)
func (x *exchange) noWalletNow(resp x402.SettleResponse) error {
	x.retryAfter = "2"
	return x.settleUnreachable(fmt.Sprintf("no settlement wallet could send the payment right now (%s: %s); nothing was sent: present the same payment again in a moment",
		resp.ErrorReason, resp.ErrorMessage), nil, nil)
}

// serveSettled serves a settled payment: the upstream's response (called now when up is nil) with
// PAYMENT-RESPONSE. An upstream that fails after the payment settled is passed on, and a client that left
// before the response gets nothing; either way the payment stays unserved, so presenting it again serves it
// without paying again.
func (x *exchange) serveSettled(resp x402.SettleResponse, up *upstream) error {
	x.setVar(VarStatus, string(x402.OutcomeSettled))
	x.setVar(VarTransaction, resp.Transaction)
	if err := x.r.Context().Err(); err != nil {
		// The client left while the payment settled: the response would reach nobody, so the payment has not
		// bought it yet. Presenting the same payment again serves it without paying again.
		x.note(func(r *journal.Record) { r.Response = &resp })
		x.end(x.settledOutcome(resp),
			zap.String("note", "the client left before the response; presenting the payment again serves it"))
		return &StatusError{Status: 499, Err: err} // as Caddy's reverse_proxy reports a client that went away
	}
	if up == nil {
		return x.serveUpstream(func(up *upstream) error { return x.serveSettledUpstream(resp, up) })
	}
	return x.serveSettledUpstream(resp, up)
}

// serveSettledUpstream serves a settled payment the upstream's response, as serveSettled says.
func (x *exchange) serveSettledUpstream(resp x402.SettleResponse, up *upstream) error {
	if !up.ok() {
		x.note(func(r *journal.Record) { r.Response = &resp })
		x.setSettleHeader(resp)
		x.end(x.settledOutcome(resp),
			zap.String("note", "the upstream failed after the payment settled; presenting the payment again retries it"))
		return x.writeUpstream(up)
	}
	if named, more := x.namesMoreThanCharged(up); more {
		x.note(func(r *journal.Record) { r.Response = &resp })
		return x.chargedLess(named, resp)
	}
	if x.lostMark() {
		x.note(func(r *journal.Record) { r.Response = &resp })
		return x.servedNothing(fmt.Sprintf("the payment settled (transaction %s)", resp.Transaction))
	}
	x.setSettleHeader(resp)
	x.endHeld(x.settledOutcome(resp))
	return x.deliver(up, &resp)
}

// lostMark reports whether this request's hold on its payment may have passed to another process sharing the
// journal (see Ledger.holds), which may be serving the payment: this request must then serve nothing.
func (x *exchange) lostMark() bool {
	if x.g.ledger.holds(x.id) {
		return false
	}
	x.g.logger.Warn("this gateway may have looked dead to the others sharing its journal while a request worked on a payment; serving nothing, the payment may be presented again",
		zap.String("payment", x.id.String()))
	return true
}

// servedNothing answers a request that lost its mark (lostMark) after its payment got as far as state says: 502,
// and the payment is served when presented again.
func (x *exchange) servedNothing(state string) error {
	return x.settleUnreachable(state+", but this gateway may have lost its hold on it while its shared journal was out of reach, and served nothing; "+
		"present the same payment again to receive the resource: it is not charged again", nil, nil)
}

// settledOutcome is the outcome of a request whose payment settled.
func (x *exchange) settledOutcome(resp x402.SettleResponse) x402.PaymentOutcome {
	return x402.PaymentOutcome{Status: x402.OutcomeSettled, Transaction: resp.Transaction, Payer: x.payer,
		Network: resp.Network, VerifyMs: x.verifyMs, SettleMs: x.settleMs, TotalMs: x.totalMs()}
}

// serveAsync records a verified payment as to be settled, serves, and settles in the background. The record is
// written before the response leaves, so a crash after serving loses no payment; it is marked served once the
// response is out, so a response cut short can be had by presenting the payment again.
func (x *exchange) serveAsync(up *upstream) error {
	x.decideCharge(up)
	err := x.claim(x.journalCtx(), false, func(r *journal.Record) { r.Async = true })
	if err != nil {
		return x.recordFailed(err)
	}
	rq := x.req.PaymentRequirements
	if x.lostMark() {
		x.g.ledger.settleLater(x.id) // journalled: it is settled, and served when presented again
		return x.servedNothing("the payment was accepted and is being settled")
	}
	pending := x402.SettleResponse{Success: false, Network: rq.Network, Payer: x.payer, ErrorReason: x402.ReasonSettlementPending,
		ErrorMessage: "the payment was accepted and is being settled in the background"}
	x.setSettleHeader(pending)
	x.endHeld(x402.PaymentOutcome{Status: x402.OutcomeSettlePending, Payer: x.payer, Network: rq.Network,
		VerifyMs: x.verifyMs, TotalMs: x.totalMs()})
	x.g.ledger.settleLater(x.id) // journalled: it is settled whether or not the response gets out
	return x.deliver(up, nil)
}

// deliver writes the upstream's held-back response and, once it is out, records that the payment bought it
// (with its settlement, when known). A response that could not be written out leaves the payment unserved
// (with its settlement noted), so the payer gets it by presenting the same payment again, never by paying again.
func (x *exchange) deliver(up *upstream, settled *x402.SettleResponse) error {
	defer x.writeLog()     // endHeld's line, after the response (and before the rest of a long one streams)
	x.grantAccess(settled) // siwx.go: before the response, so that the payer's next request finds it
	x.frame(up)
	err := x.writeUpstream(up)
	if err == nil && up.rec.decided {
		// Sent midway through a body larger than max_buffer: the rest streams once this returns, and the payment
		// has bought its response only when the upstream has sent it all (see callUpstream).
		x.streamed = &streamedPayment{settled: settled}
		return nil
	}
	if err == nil {
		// (A tunnel the upstream takes the connection for is decided as it opens, above: this is no hijacked
		// connection, which net/http panics flushing.)
		if ferr := http.NewResponseController(x.w).Flush(); ferr != nil && !errors.Is(ferr, http.ErrNotSupported) {
			err = ferr
		}
	}
	if err != nil {
		if settled != nil {
			x.note(func(r *journal.Record) { r.State, r.Response = journal.StateFinal, settled })
		}
		x.g.logger.Warn("the response a payment bought could not be written out; presenting the payment again serves it",
			zap.String("payment", x.id.String()), zap.Error(err))
		return err
	}
	x.markServed(settled)
	return nil
}

// frame gives a held-back response without a length its Content-Length, so that the flush in deliver sends a
// whole response: chunked, its last chunk would only be written after the handler returns, and a process killed
// in between would leave the client a 200 it cannot read to the end while the journal says it was delivered.
func (x *exchange) frame(up *upstream) {
	h, status := x.w.Header(), up.rec.Status()
	if x.r.Method == http.MethodHead || status < http.StatusOK || status == http.StatusNoContent || status == http.StatusNotModified ||
		h.Get("Content-Length") != "" || h.Get("Transfer-Encoding") != "" || up.rec.decided {
		return
	}
	h.Set("Content-Length", strconv.Itoa(up.buf.Len()))
}

// errServed stops an update of a payment some request has served already.
var errServed = errors.New("the payment was served already")

// markServed records that the payment's one response was written out (with its settlement, when given). The
// in-flight set keeps every other request of the payment out until this is written, and presentedAgain refuses
// a served payment, so only a journal failure can leave it unwritten: that is logged, and the response stands.
// Without a settlement (an async payment) the mark is the journal's MarkServed, which leaves the record alone:
// a second rewrite of the whole record per response would cost more than the rest of serving it. Either clears
// the journal's in-flight mark in the same write where the journal can (x.idled): the payment is never seen
// unmarked before it is seen served.
func (x *exchange) markServed(settled *x402.SettleResponse) {
	ctx, at := x.journalCtx(), x.g.now().UTC()
	var err error
	if settled == nil {
		x.idled, err = journal.MarkServedIdle(ctx, x.g.ledger.store, x.id, at)
	} else {
		served := func(r *journal.Record) error {
			if r.Served {
				return errServed
			}
			// Final too: a process killed between claiming the record and making it final left it claimed.
			r.Served, r.ServedAt = true, at
			r.State, r.Response = journal.StateFinal, settled
			return nil
		}
		if x.recorded != nil {
			// Written by this request, under its in-flight mark: the record is most likely as it was written, and
			// the journal then need not read it first.
			_, x.idled, err = journal.UpdateKnownIdle(ctx, x.g.ledger.store, *x.recorded, served)
		} else {
			_, err = x.g.ledger.store.Update(ctx, x.id, served)
		}
	}
	if err != nil {
		x.g.logger.Error("recording a served payment in the journal", zap.String("payment", x.id.String()), zap.Error(err))
	}
}

// note updates the gate's record of the payment. A failure is logged, not answered: the payment's fate is
// decided by then, and the record only helps a later presentation of it.
func (x *exchange) note(edit func(*journal.Record)) {
	_, err := x.g.ledger.store.Update(x.journalCtx(), x.id, func(r *journal.Record) error {
		edit(r)
		return nil
	})
	if err != nil {
		x.g.logger.Error("updating the gate's journal record of a payment", zap.String("payment", x.id.String()), zap.Error(err))
	}
}

// journalCtx is the context of this request's journal writes: its own, not cancelled with it, carrying its queue
// of deferred writes when there is one (run).
func (x *exchange) journalCtx() context.Context {
	if x.jctx != nil {
		return x.jctx
	}
	return context.WithoutCancel(x.r.Context())
}

// flushBehind sends what the request's journal writes left deferred (the engine's final answer, when the gate
// wrote nothing after it): the engine's answer stands either way, and reconciliation records it from the chain.
func (x *exchange) flushBehind() {
	if err := journal.Flush(x.jctx); err != nil {
		x.g.logger.Error("writing a payment's deferred journal writes", zap.String("payment", x.id.String()), zap.Error(err))
	}
}

// serveUpstream runs the rest of the route and hands its held-back response to serve: once the upstream has
// finished, or, when the body outgrows max_buffer, there and then, and the rest streams after what serve sent.
func (x *exchange) serveUpstream(serve func(*upstream) error) error {
	up := x.callUpstream(serve)
	defer up.free()
	if up.rec.decided {
		return up.rec.result
	}
	return serve(up)
}

// callUpstream runs the rest of the route with its response held back, so the gate can still decide; a body
// that outgrows max_buffer is handed to serve from inside the upstream's Write (see heldResponse).
func (x *exchange) callUpstream(serve func(*upstream) error) (up *upstream) {
	x.headers = x.w.Header().Clone()
	buf := gateBuffers.Get().(*bytes.Buffer)
	buf.Reset()
	up = &upstream{buf: buf}
	up.rec = newHeldResponse(x.w, buf, x.g.cfg.MaxBuffer, x.r.Method == http.MethodConnect, func() error { return serve(up) })
	if _, shared := x.g.ledger.store.(journal.Cluster); shared {
		up.rec.lost = x.holdLost
	}
	// While its tunnel is open and its client has not ended it, the request is not waited for by its journal's
	// close (storeUsers.tunnels). Once the client ended it, the request is bound to mark its payment served, which
	// the journal must still be open for: it is waited for again from then on.
	var tunnelOpen atomic.Bool
	up.rec.opened = func() { tunnelOpen.Store(x.g.ledger.tunnelOpened(x.id)) }
	tunnelEnded := func() {
		if tunnelOpen.CompareAndSwap(true, false) {
			x.g.ledger.tunnelEnded()
		}
	}
	up.rec.clientEnd = tunnelEnded
	returned := false
	defer func() {
		tunnelEnded() // (a panic: before the writes below)
		if returned {
			return
		}
		// The upstream panicked. reverse_proxy aborts so when a write fails: after the gate answered itself
		// (refusing the writes), the answer is complete and the request ends here.
		if up.rec.answered() {
			if p := recover(); p != nil && p != http.ErrAbortHandler {
				panic(p)
			}
			return
		}
		if up.rec.streaming {
			x.streamBroke(up, "the upstream aborted")
		}
		if x.verified && x.recorded == nil && !up.rec.decided {
			// A new payment whose upstream aborted before the gate decided anything (reverse_proxy does so when
			// the upstream's body breaks off): nothing recorded it or served it, and nothing will settle it.
			x.unhold()
		}
	}()
	up.err = x.next.ServeHTTP(up.rec, x.r)
	returned = true
	tunnelEnded()
	if up.rec.streaming && stripSettlementOverrides(x.w.Header()) {
		// Set after the answer began to stream: a trailer, which net/http sends once this handler returns.
		x.g.logger.Warn("the upstream named a charge in a trailer (Settlement-Overrides after its status); it is not used, and not sent",
			zap.String("payment", x.id.String()))
	}
	switch {
	case !up.rec.decided || !up.rec.streaming:
	case up.err != nil:
		x.streamBroke(up, up.err.Error())
	case up.rec.sendErr != nil:
		x.streamBroke(up, up.rec.sendErr.Error())
	case up.rec.hijacked && x.g.cfg.Unloaded != nil && x.g.cfg.Unloaded() && !up.rec.clientEnded():
		// The tunnel ended as the server unloaded its configuration, which closes upgraded connections (see
		// Config.Unloaded), and its client had not ended it: cut short by the server, it is opened again when its
		// payment is presented again. One whose client ended it (hung up, then the upstream lingered past the
		// unload) was had whole: it is served, below. (A client that only half-closed and still reads, cut then,
		// is taken as served too: the gate cannot tell it from one that hung up.)
		x.streamBroke(up, "the tunnel was closed as the server unloaded its configuration (a reload, a shutdown)")
	case x.streamed != nil:
		// (A connection the upstream hijacked is no longer the server's to flush: that panics inside net/http.)
		if !up.rec.hijacked {
			if err := http.NewResponseController(x.w).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
				x.streamBroke(up, err.Error())
				break
			}
		}
		if err := up.rec.stillHeld(); err != nil {
			x.streamBroke(up, err.Error())
			break
		}
		x.markServed(x.streamed.settled)
	}
	if errors.Is(up.rec.sendErr, errHoldLost) && !up.rec.hijacked {
		// Ended cleanly, the client would take what it got for the whole response: the connection is cut instead.
		panic(http.ErrAbortHandler)
	}
	return up
}

// errHoldLost stops a paid-for response streaming at a gateway that may have looked dead to the others sharing
// its journal: one of them may have taken over the payment's in-flight mark and be serving it too. Cut short, it
// delivered nothing; the payment presented again gets its one response.
var errHoldLost = errors.New("this gateway may have looked dead to the others sharing its journal while the response streamed; cut short, " +
	"presenting the payment again serves it")

// holdLost is heldResponse.lost for a gate whose journal other processes share: a paid-for response stops
// streaming once the request may have lost its in-flight mark (Ledger.holds).
func (x *exchange) holdLost() error {
	if x.streamed != nil && !x.g.ledger.holds(x.id) {
		return errHoldLost
	}
	return nil
}

// streamedPayment is what deliver leaves for the end of a streamed response: the settlement to record with it.
type streamedPayment struct{ settled *x402.SettleResponse }

// writeUpstream sends the held-back response, or returns the upstream's error to the server.
func (x *exchange) writeUpstream(up *upstream) error {
	// What the upstream tells the gate to charge is for the gate only, whatever the route's scheme.
	stripSettlementOverrides(x.w.Header())
	if up.err != nil {
		return up.err
	}
	if v := x.w.Header().Values("Access-Control-Allow-Origin"); len(v) > 1 {
		// The upstream has a CORS policy of its own: browsers refuse two values, and its word is the last.
		x.w.Header().Set("Access-Control-Allow-Origin", v[len(v)-1])
	}
	return up.rec.WriteResponse()
}

// passUnpaid passes on an upstream failure without settling: the payer does not pay for an error, and the
// payment stays good for another try.
func (x *exchange) passUnpaid(up *upstream) error {
	x.unhold()
	return x.passFailure(up, "the upstream answered %d; the payment was not settled and may be presented again")
}

// passFailure passes on an upstream failure, with a detail that says what became of the payment (%d: the status).
func (x *exchange) passFailure(up *upstream, detail string) error {
	status := up.rec.Status()
	if up.err != nil {
		status = http.StatusInternalServerError
		if s := x.g.cfg.ErrorStatus(up.err); s != 0 {
			status = s
		}
	}
	x.end(x402.PaymentOutcome{Status: x402.OutcomeSettleFailed, Payer: x.payer, Network: x.req.PaymentRequirements.Network,
		Detail: x402.SettleResponse{Success: false, Network: x.req.PaymentRequirements.Network, Payer: x.payer,
			ErrorReason:  "upstream_error",
			ErrorMessage: fmt.Sprintf(detail, status)},
		VerifyMs: x.verifyMs, TotalMs: x.totalMs()})
	return x.writeUpstream(up)
}

// resetHeaders drops whatever the upstream put into the response headers before the gate answers itself.
func (x *exchange) resetHeaders() {
	if x.headers == nil {
		return
	}
	h := x.w.Header()
	for k := range h {
		delete(h, k)
	}
	for k, v := range x.headers {
		h[k] = v
	}
}

// setPaymentPlaceholders publishes who pays what (Config.SetVar), for the upstream and for access logs.
func (x *exchange) setPaymentPlaceholders() {
	rq := x.req.PaymentRequirements
	x.setVar(VarPayer, x.payer)
	x.setVar(VarNetwork, rq.Network)
	x.setVar(VarAmount, x.chargeAmount())
}

// upto reports whether the payment is of the upto scheme: it is charged what the upstream used.
func (x *exchange) upto() bool { return x.req.PaymentRequirements.Scheme == x402.SchemeUpto }

// chargeAmount is what the payment is settled for: the price of an exact payment; for upto, the charge once
// decided, and until then the gate's default amount.
func (x *exchange) chargeAmount() string {
	switch {
	case !x.upto():
		return x.req.PaymentRequirements.Amount
	case x.charge != "":
		return x.charge
	case x.g.cfg.DefaultAmount == DefaultAmountZero:
		return "0"
	}
	return x.req.PaymentRequirements.Amount
}

// settleRequest is the request the facilitator settles: the payment and its requirement, whose amount for an
// upto payment is the charge (the facilitator then moves that much of what the payer authorized).
func (x *exchange) settleRequest() x402.SettleRequest {
	req := x.req
	req.PaymentRequirements.Amount = x.chargeAmount()
	return req
}

// decideCharge decides what an upto payment is charged from the Settlement-Overrides header of the upstream's
// answer, once: the amount it names, at most the maximum the payer authorized (an upstream asking more is
// charged the maximum, and logged); a missing or unusable header, or one named only in a trailer, charges the
// default amount. The header never reaches the client (writeUpstream drops it too).
func (x *exchange) decideCharge(up *upstream) {
	values, inTrailer := up.rec.chargeNamed()
	stripSettlementOverrides(x.w.Header())
	if !x.upto() || x.charge != "" {
		return
	}
	x.charge = x.namedCharge(values, inTrailer)
	x.setVar(VarAmount, x.charge)
}

// namedCharge is what the upstream's Settlement-Overrides values (with its status, or inTrailer) charge an upto
// payment, as decideCharge says; what is not usable is logged.
func (x *exchange) namedCharge(values []string, inTrailer bool) string {
	rq := x.req.PaymentRequirements
	charge := rq.Amount
	if x.g.cfg.DefaultAmount == DefaultAmountZero {
		charge = "0"
	}
	log := func(msg string, fields ...zap.Field) {
		x.g.logger.Warn(msg, append(fields, zap.String("payment", x.id.String()), zap.String("max", rq.Amount),
			zap.String("charged", charge), zap.String("default_amount", x.g.cfg.DefaultAmount))...)
	}
	switch {
	case inTrailer:
		log("the upstream named its charge in a trailer (Settlement-Overrides after its status, or announced as a trailer), which arrives after the charge is decided; it is not usable, the default amount is charged",
			zap.Strings("with_status", values))
	case len(values) == 1:
		max, err := x402.ParseAmount(rq.Amount)
		if err != nil {
			break // the offer's own amount, checked when it was configured
		}
		n, err := x402.ParseSettlementOverride(values[0], max, x.decimals)
		switch {
		case errors.Is(err, x402.ErrOverrideAboveMaximum):
			charge = rq.Amount
			log("the upstream asked to charge more than the payer authorized; the maximum is charged", zap.String("asked", n.String()))
		case err != nil:
			log("the upstream's Settlement-Overrides header is not usable; the default amount is charged", zap.Error(err))
		default:
			charge = n.String()
		}
	case len(values) > 1:
		log("the upstream sent several Settlement-Overrides headers; none is used, the default amount is charged", zap.Int("headers", len(values)))
	}
	return charge
}

// setVar publishes one variable of the request's payment (a Var* name).
// emit reports a payment event with what is known of the payment, and the outcome o when it has ended.
func (x *exchange) emit(name string, o *x402.PaymentOutcome) {
	if x.g.cfg.Event == nil {
		return
	}
	x.g.cfg.Event(x.r, name, func() map[string]any {
		rq := x.req.PaymentRequirements
		data := map[string]any{
			"network": rq.Network, "asset": rq.Asset, "amount": x.chargeAmount(), "pay_to": rq.PayTo,
			"method": rq.Extra.AssetTransferMethod, "payer": x.payer,
		}
		if o == nil {
			return data
		}
		data["outcome"] = string(o.Status)
		if o.Payer != "" {
			data["payer"] = o.Payer
		}
		if o.Transaction != "" {
			data["transaction"] = o.Transaction
		}
		switch d := o.Detail.(type) {
		case x402.VerifyResponse:
			data["reason"] = d.InvalidReason
		case x402.SettleResponse:
			data["reason"] = d.ErrorReason
		case string:
			data["reason"] = d
		}
		return data
	})
}

func (x *exchange) setVar(name, value string) {
	if x.g.cfg.SetVar != nil {
		x.g.cfg.SetVar(x.r, name, value)
	}
}

func (x *exchange) totalMs() float64 { return msSince(x.g.now, x.start) }

func msSince(now func() time.Time, t time.Time) float64 {
	return float64(now().Sub(t)) / float64(time.Millisecond)
}

// signedPayer is the payer a payment is signed by, as the payload names it (in checksum case when it is an
// address).
func signedPayer(req x402.VerifyRequest) string {
	from, _ := req.PaymentPayload.Payload.PayerAndNonce()
	if x402.IsHexAddress(from) {
		return common.HexToAddress(from).Hex()
	}
	return from
}
