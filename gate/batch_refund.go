package gate

import (
	"context"
	"net/http"
	"slices"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A payer's refund on a batch-settlement route asks for what is left in its channel: its payload is a voucher
// at the channel's last accepted amount (it charges nothing) and the amount wanted, or none for all that is
// left. The engine claims what the channel's accepted vouchers charge and returns the rest to the payer, in one
// transaction, checked before any gas; presented again, the refund is answered from its record and nothing is
// sent (chain/batch_refund.go).
//
// The gate answers it as the public SDK's batch-settlement server does: a refund buys no response, so the
// upstream never runs (the SDK's server skips the route's handler for a refund); done, 200 with a JSON body
// acknowledging the refund and naming the channel, and PAYMENT-RESPONSE the refund's settlement (its transaction,
// the amount returned, the channel as it stands after, what its vouchers charge); refused, 402 with
// PAYMENT-RESPONSE naming the reason and a fresh offer, nothing sent.

// refundAcknowledged is the body of a refund's answer, in the SDK server's words.
type refundAcknowledged struct {
	Message   string `json:"message"`
	ChannelID string `json:"channelId"`
}

// serveBatchRefund serves a payer's refund (see the top of this file).
func (x *exchange) serveBatchRefund(bf x402.BatchFacilitator, req x402.BatchRequest) error {
	// A refund charges nothing: the payment log and placeholders say so.
	x.req.PaymentRequirements.Amount = "0"
	channel := req.PaymentPayload.Payload.Voucher.ChannelID
	t := x.g.now()
	// As any settlement, it runs to its end when the client hangs up: its transaction may be on its way.
	resp, err := bf.SettleBatch(context.WithoutCancel(x.r.Context()), req)
	x.settleMs = msSince(x.g.now, t)
	if resp.Payer != "" {
		x.payer = resp.Payer
	}
	x.setVar(VarChannel, channel)
	switch {
	case err != nil:
		return x.settleUnreachable("the facilitator did not answer the refund; present the same refund again for its outcome", err, nil)
	case resp.ErrorReason == x402.ReasonSettlementPending:
		pending := batchSettle(resp)
		return x.settleUnreachable("the refund was sent and is not yet mined; present the same refund again for its outcome", nil, &pending)
	case !resp.Success:
		if corrected, err := x.corrective(resp); corrected {
			return err
		}
		return x.settleFailed(batchSettle(resp))
	}
	x.resetHeaders()
	if h, err := x402.EncodeHeader(resp); err == nil {
		x.w.Header().Set(x402.HeaderPaymentResponse, h)
	} else {
		x.g.logger.Error("encoding PAYMENT-RESPONSE", zap.String("tx", resp.Transaction), zap.Error(err))
	}
	x.setVar(VarCumulative, x.cumulative(resp))
	x.end(x402.PaymentOutcome{Status: x402.OutcomeSettled, Transaction: resp.Transaction, Payer: x.payer, Network: resp.Network,
		SettleMs: x.settleMs, TotalMs: x.totalMs()},
		zap.String("action", "refund"), zap.String("channel", channel), zap.String("refunded", resp.Amount), zap.String("cumulative", x.cumulative(resp)))
	return x.writeJSON(http.StatusOK, refundAcknowledged{Message: "Refund acknowledged", ChannelID: channel})
}

// batchSettle is the generic settlement answer of a batch one (its extra left out).
func batchSettle(r x402.BatchSettleResponse) x402.SettleResponse {
	return x402.SettleResponse{Success: r.Success, Transaction: r.Transaction, Network: r.Network, Payer: r.Payer, Amount: r.Amount,
		ErrorReason: r.ErrorReason, ErrorMessage: r.ErrorMessage}
}

// corrective answers a batch payment refused because its cumulative amount is not the one the engine holds for
// its channel, when the engine named the channel and its last voucher: 402 whose offer's error is the SDK's reason
// code alone and whose batch-settlement requirement carries the channel's state and that voucher, as the SDK's
// batch-settlement server's corrective 402 does. The payer's client (the SDK's, or ours) checks the voucher is its
// own and pays again from it. corrected false: the answer is not corrective, and nothing was written.
func (x *exchange) corrective(resp x402.BatchSettleResponse) (corrected bool, err error) {
	if resp.ErrorReason != x402.ReasonBatchCumulativeAmountMismatch || resp.Extra == nil || resp.Extra.ChannelState == nil || resp.Extra.VoucherState == nil {
		return false, nil
	}
	x.resetHeaders()
	if resp.Payer != "" {
		x.payer = resp.Payer
	}
	pr := x.paymentRequired(resp.ErrorReason)
	// The offers' own slice is shared by every request: the corrective state goes into a copy.
	pr.Accepts = slices.Clone(pr.Accepts)
	for i := range pr.Accepts {
		if rq := &pr.Accepts[i]; rq.Scheme == x402.SchemeBatchSettlement && rq.Network == x.req.PaymentRequirements.Network {
			cs, vs := *resp.Extra.ChannelState, *resp.Extra.VoucherState
			rq.Extra.ChannelState, rq.Extra.VoucherState = &cs, &vs
		}
	}
	x.end(x402.PaymentOutcome{Status: x402.OutcomeVerifyFailed, Payer: x.payer, Network: x.req.PaymentRequirements.Network, SettleMs: x.settleMs, TotalMs: x.totalMs(),
		Detail: x402.VerifyResponse{IsValid: false, Payer: x.payer, InvalidReason: resp.ErrorReason, InvalidMessage: resp.ErrorMessage}})
	x.setRequiredHeader(pr)
	return true, x.writeRequired(http.StatusPaymentRequired, pr)
}
