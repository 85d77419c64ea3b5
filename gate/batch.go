package gate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A route of scheme batch-settlement is paid by the public SDK's channels: a deposit into the escrow once (the
// facilitator sends it on chain), then a cumulative voucher a request, which the facilitator accepts off chain
// and claims in batches. The gate hands each payment to the facilitator's SettleBatch before the upstream runs
// (the voucher's acceptance is durable before the response it buys is served, whatever the settle mode), holds
// the voucher's in-flight mark meanwhile, and marks the voucher served once the response is delivered: the same
// voucher presented again is answered as first (no charge more) until then, and refused as used after.

// batchWithdrawDelay is the withdrawal delay, in seconds, a batch-settlement route asks of its channels: the
// escrow's least (15 minutes), which the public SDK's servers offer by default.
const batchWithdrawDelay = 900

// batchOffer is the batch-settlement offer of s: only when the facilitator's /supported lists the scheme on the
// network and names the receiver authorizer that signs its claims (without one, vouchers would never be claimed),
// and only in a token known to implement EIP-3009, by which deposits are made.
func batchOffer(s Offer, sup *x402.SupportedResponse) (offer, bool) {
	kind, ok := sup.SchemeKind(x402.Version2, x402.SchemeBatchSettlement, s.Network, x402.TransferEIP3009)
	if !ok || kind.Extra.ReceiverAuthorizer == "" || !s.EIP3009 {
		return offer{}, false
	}
	return offer{req: x402.PaymentRequirements{
		Scheme: x402.SchemeBatchSettlement, Network: s.Network, Amount: s.Amount, Asset: s.Asset, PayTo: s.PayTo,
		MaxTimeoutSeconds: s.MaxTimeoutSeconds,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferEIP3009, Name: s.TokenName, Version: s.TokenVersion,
			ReceiverAuthorizer: kind.Extra.ReceiverAuthorizer, WithdrawDelay: batchWithdrawDelay},
	}, decimals: s.Decimals, batch: true}, true
}

// hasBatch reports whether the set offers batch-settlement.
func (s *offerSet) hasBatch() bool {
	for _, o := range s.offers {
		if o.batch {
			return true
		}
	}
	return false
}

// batchMatch finds the batch-settlement offer a payment's accepted requirement names: the same network, asset,
// recipient, price, receiver authorizer and withdrawal delay. It returns the offer's own requirement, which the
// facilitator judges the payment against, or why none matches.
func (s *offerSet) batchMatch(a x402.BatchRequirements) (x402.BatchRequirements, *offer, *x402.Mismatch) {
	var closest *x402.Mismatch
	for i, o := range s.offers {
		if !o.batch || o.req.Network != a.Network {
			continue
		}
		rq := o.req
		var m *x402.Mismatch
		switch amount, err := x402.ParseAmount(a.Amount); {
		case !x402.SameAddress(rq.Asset, a.Asset):
			m = &x402.Mismatch{Reason: x402.ReasonInvalidPaymentRequirements, Message: fmt.Sprintf("accepted.asset is %s, but this resource is paid in %s on %s", a.Asset, rq.Asset, rq.Network)}
		case !x402.SameAddress(rq.PayTo, a.PayTo):
			m = &x402.Mismatch{Reason: x402.ReasonRecipientMismatch, Message: fmt.Sprintf("accepted.payTo is %s, but this resource pays %s", a.PayTo, rq.PayTo)}
		case err != nil || amount.String() != rq.Amount:
			m = &x402.Mismatch{Reason: x402.ReasonValueMismatch, Message: fmt.Sprintf("accepted.amount is %q, but this resource costs exactly %s raw units", a.Amount, rq.Amount)}
		case !x402.SameAddress(rq.Extra.ReceiverAuthorizer, a.Extra.ReceiverAuthorizer) || a.Extra.WithdrawDelay != rq.Extra.WithdrawDelay:
			m = &x402.Mismatch{Reason: x402.ReasonInvalidPaymentRequirements, Message: fmt.Sprintf("accepted.extra names receiverAuthorizer %s and withdrawDelay %d, but this resource's channels name %s and %d",
				a.Extra.ReceiverAuthorizer, a.Extra.WithdrawDelay, rq.Extra.ReceiverAuthorizer, rq.Extra.WithdrawDelay)}
		}
		if m == nil {
			return x402.BatchRequirements{Scheme: rq.Scheme, Network: rq.Network, Amount: rq.Amount, Asset: rq.Asset, PayTo: rq.PayTo,
				MaxTimeoutSeconds: rq.MaxTimeoutSeconds, Extra: x402.BatchExtra{ReceiverAuthorizer: rq.Extra.ReceiverAuthorizer,
					WithdrawDelay: rq.Extra.WithdrawDelay, Name: rq.Extra.Name, Version: rq.Extra.Version, AssetTransferMethod: rq.Extra.AssetTransferMethod}}, &s.offers[i], nil
		}
		if closest == nil {
			closest = m
		}
	}
	if closest == nil {
		closest = &x402.Mismatch{Reason: x402.ReasonInvalidPaymentRequirements, Message: fmt.Sprintf("this resource is not paid by batch-settlement on %s", a.Network)}
	}
	return x402.BatchRequirements{}, nil, closest
}

// decodeBatchPayment decodes a version 2 payment header that names the batch-settlement scheme, which has a
// decoder of its own (x402.ReadBatchPaymentHeader, on the JSON x402.HeaderJSON decodes): ok says it names it, and
// then p is the payment or err what is wrong with it. Anything unreadable is left to the standard decoder, which
// says what is wrong with it.
//
// It decodes the payment once: a header whose JSON holds the scheme's name is read by the batch decoder first,
// and only one the batch decoder refuses is probed for its accepted.scheme, to tell whose refusal to answer.
func decodeBatchPayment(value string) (p x402.BatchPayment, ok bool, err error) {
	raw, rerr := x402.HeaderJSON(value) // once: the payment is read from these bytes
	// A JSON string may write the scheme's name with escapes ("batch\u002dsettlement"), which the quick look for
	// its bytes misses: a header holding an escape is probed as before the quick look.
	if rerr != nil || (!bytes.Contains(raw, []byte(x402.SchemeBatchSettlement)) && !bytes.Contains(raw, []byte(`\u`))) {
		return p, false, nil
	}
	if p, err = x402.ReadBatchPaymentHeader(raw); err == nil && p.Accepted.Scheme == x402.SchemeBatchSettlement {
		return p, true, nil
	}
	var probe struct {
		Accepted struct {
			Scheme string `json:"scheme"`
		} `json:"accepted"`
	}
	if json.Unmarshal(raw, &probe) != nil || probe.Accepted.Scheme != x402.SchemeBatchSettlement {
		return x402.BatchPayment{}, false, nil
	}
	return p, true, err
}

// serveBatch serves a request paid by a batch-settlement deposit or voucher (see the top of this file): p as
// decodeBatchPayment read it, or decodeErr what is wrong with it.
func (x *exchange) serveBatch(p x402.BatchPayment, decodeErr error) error {
	if decodeErr != nil {
		return x.invalidHeader(decodeErr)
	}
	if cfg := p.Payload.ChannelConfig; cfg != nil {
		x.payer = cfg.Payer
	}
	rq, o, mismatch := x.offers.batchMatch(p.Accepted)
	if mismatch != nil {
		// A voucher accepted (charged) here whose response was not delivered is judged by the terms it was
		// accepted under, as any payment presented again is: a reload since (another price, say) leaves its
		// payer charged for nothing otherwise, while the claimer claims it.
		if !x.batchOnRecord(p) {
			return x.verifyFailed(x402.VerifyResponse{IsValid: false, InvalidReason: mismatch.Reason, InvalidMessage: mismatch.Message})
		}
		rq = p.Accepted
		rq.Extra.ChannelState, rq.Extra.VoucherState = nil, nil
		x.g.logger.Info("a batch-settlement voucher presented again for the resource it was accepted for is judged by its record: the terms it was accepted under are no longer offered here",
			zap.String("channel", p.Payload.Voucher.ChannelID), zap.String("cumulative", p.Payload.Voucher.MaxClaimableAmount),
			zap.String("amount", rq.Amount), zap.String("mismatch", mismatch.Reason))
	}
	x.req = x402.VerifyRequest{X402Version: x402.Version2, PaymentRequirements: rq.Generic()}
	if o != nil {
		x.decimals = o.decimals
	} else {
		x.decimals = x.assetDecimals(x.req.PaymentRequirements)
	}
	bf := x.g.batchFacilitator()
	if bf == nil {
		return x.verifyFailed(x402.VerifyResponse{IsValid: false, InvalidReason: x402.ReasonUnsupportedScheme,
			InvalidMessage: "this gate's facilitator does not serve the batch-settlement scheme"})
	}
	if p.Payload.Type == x402.BatchRefund {
		return x.serveBatchRefund(bf, x402.BatchRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}) // batch_refund.go
	}
	v := p.Payload.Voucher
	x.id = journal.BatchVoucherID(rq.Network, v.ChannelID, v.MaxClaimableAmount)
	mine, _, _, err := x.g.ledger.acquireRecord(x.r.Context(), x.id)
	if err != nil {
		return x.verifyUnreachable("the gate's settlement journal could not be reached; nothing was charged, try again", err)
	} else if !mine {
		return x.alreadyUsed("another request is presenting this voucher right now; wait for its answer instead of paying again")
	}
	defer func() { x.g.ledger.releaseIdled(x.id, x.idled) }()

	t := x.g.now()
	// As any settlement, it runs to its end when the client hangs up: a deposit may be on its way on chain.
	// The engine notes on the voucher's record what it is served for, in the write that accepts it.
	note := journal.RecordNote{Route: x.g.cfg.Route, Resource: x.boughtResource(), Described: x.describedKey()}
	if mismatch == nil {
		note.Amount = rq.Amount // the route's price: a voucher accepted at another route of the same price buys here
	}
	ctx := journal.WithRecordNote(context.WithoutCancel(x.r.Context()), note)
	resp, err := bf.SettleBatch(ctx, x402.BatchRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq})
	x.settleMs = msSince(x.g.now, t)
	if err != nil {
		// A deposit may have been sent: its payer presents the same payment again to learn what became of it.
		return x.settleUnreachable("the facilitator did not answer the batch-settlement payment; present the same payment again", err, nil)
	}
	if !resp.Success {
		if corrected, err := x.corrective(resp); corrected { // batch_refund.go
			return err
		}
		// Refused before this request was charged anything (a voucher already served is refused as used).
		return x.verifyFailed(x402.VerifyResponse{IsValid: false, Payer: resp.Payer, InvalidReason: resp.ErrorReason, InvalidMessage: resp.ErrorMessage})
	}
	if resp.Payer != "" {
		x.payer = resp.Payer
	}
	x.setPaymentPlaceholders()
	x.setVar(VarChannel, v.ChannelID)
	x.setVar(VarCumulative, v.MaxClaimableAmount)
	return x.serveUpstream(func(up *upstream) error { return x.serveBatchUpstream(resp, up) })
}

// serveBatchUpstream serves the upstream's response of a request whose voucher was accepted: with its answer in
// PAYMENT-RESPONSE, marked served once delivered. A failed upstream, or a response not delivered, leaves the
// voucher unserved: presented again, it gets the response and is charged nothing more.
func (x *exchange) serveBatchUpstream(resp x402.BatchSettleResponse, up *upstream) error {
	outcome := x402.PaymentOutcome{Status: x402.OutcomeSettled, Transaction: resp.Transaction, Payer: x.payer,
		Network: resp.Network, SettleMs: x.settleMs, TotalMs: x.totalMs()}
	channel := []zap.Field{zap.String("channel", resp.Commitment()), zap.String("cumulative", x.cumulative(resp))}
	if !up.ok() {
		x.end(outcome, append(channel, zap.String("note", "the upstream failed after the voucher was accepted; presenting the same voucher again retries it"))...)
		return x.writeUpstream(up)
	}
	if x.lostMark() {
		return x.servedNothing("the voucher was accepted (" + resp.Commitment() + ")")
	}
	if h, err := x402.EncodeHeader(resp); err == nil {
		x.w.Header().Set(x402.HeaderPaymentResponse, h)
	} else {
		x.g.logger.Error("encoding PAYMENT-RESPONSE", zap.String("commitment", resp.Commitment()), zap.Error(err))
	}
	x.endHeld(outcome, channel...)
	return x.deliver(up, nil)
}

// batchOnRecord reports whether a batch-settlement payment that matches none of the route's offers is a voucher
// the journal holds as accepted at this route for this very resource, under the terms the payment names.
func (x *exchange) batchOnRecord(p x402.BatchPayment) bool {
	v, a := p.Payload.Voucher, p.Accepted
	if p.Payload.Type == x402.BatchRefund || v == nil || x.g.cfg.Route == "" {
		return false
	}
	rec, found, err := x.g.ledger.store.Get(x.r.Context(), journal.BatchVoucherID(a.Network, v.ChannelID, v.MaxClaimableAmount))
	if err != nil {
		return false
	}
	if !found {
		return x.batchAcceptedUnrecorded(p)
	}
	return rec.Route == x.g.cfg.Route && rec.Resource == x.boughtResource() && rec.Described == x.describedKey() &&
		rec.Network == a.Network && x402.SameAddress(rec.PayTo, a.PayTo) && x402.SameAddress(rec.Asset, a.Asset) && rec.Amount == a.Amount
}

// cumulative is the channel's cumulative amount the answer names, "" when it names none.
func (x *exchange) cumulative(resp x402.BatchSettleResponse) string {
	if resp.Extra != nil && resp.Extra.ChannelState != nil {
		return resp.Extra.ChannelState.ChargedCumulativeAmount
	}
	return ""
}

// batchAcceptedUnrecorded reports whether the payment's voucher is the last one its channel's row accepted, with no
// record yet: an engine stopped (SIGKILLed) between the row's step and the voucher's record, on a journal written by
// a release that wrote them apart on PostgreSQL (every store writes both in one commit now, journal.VoucherRecords),
// or on a journal without VoucherRecords. The engine writes the record when the voucher comes again; judged by the
// terms it names, it is served here only if this route sells batch-settlement to the same receiver in the same
// asset. Which route accepted it is not known: only a crash in that window, never its payer, makes such a voucher.
func (x *exchange) batchAcceptedUnrecorded(p x402.BatchPayment) bool {
	v, a := p.Payload.Voucher, p.Accepted
	chs, ok := x.g.ledger.store.(journal.Channels)
	if !ok || !x402.IsBytes32(v.ChannelID) {
		return false
	}
	sold := false
	for _, o := range x.offers.offers {
		sold = sold || (o.batch && o.req.Network == a.Network && x402.SameAddress(o.req.PayTo, a.PayTo) && x402.SameAddress(o.req.Asset, a.Asset))
	}
	if !sold {
		return false
	}
	key := journal.ChannelKey{Network: a.Network, Escrow: contracts.BatchSettlementAddress.Hex(), ID: common.HexToHash(v.ChannelID).Hex()}
	row, found, err := chs.Channel(x.r.Context(), key)
	if err != nil || !found || row.Charged == nil || len(row.Signature) == 0 {
		return false
	}
	return row.Charged.String() == v.MaxClaimableAmount && strings.EqualFold(hexutil.Encode(row.Signature), v.Signature) &&
		x402.SameAddress(row.Config.Receiver, a.PayTo) && x402.SameAddress(row.Config.Token, a.Asset)
}
