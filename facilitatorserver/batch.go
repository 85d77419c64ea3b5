package facilitatorserver

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The batch-settlement scheme's /verify and /settle: its bodies have their own types (x402.BatchRequest), decoded
// as strictly as the others, and are answered by a facilitator that implements x402.BatchFacilitator. Its bodies
// fit the body limit: a deposit or voucher is about 2 KB, and the claims of a /settle claim, about 609 bytes each,
// are at most 100 within x402.MaxBodyBytes (the engine claims at most 100 channels a transaction itself).

// isBatchBody reports whether a /verify or /settle body is a batch-settlement request: its requirements name the
// scheme. A body that is not JSON is left to the standard decoder, which says what is wrong with it.
func isBatchBody(body []byte) bool {
	var probe struct {
		PaymentRequirements struct {
			Scheme string `json:"scheme"`
		} `json:"paymentRequirements"`
	}
	return json.Unmarshal(body, &probe) == nil && probe.PaymentRequirements.Scheme == x402.SchemeBatchSettlement
}

// serveBatch answers a batch-settlement /verify or /settle: 400 naming the field of a malformed body, a refusal
// when the facilitator behind does not serve the scheme or this server not the network, else the facilitator's
// answer. The rate limits are the other payments': a verification counted unless valid, a settlement counted
// against its payer unless it sent nothing (a voucher sends nothing).
func (s *Server) serveBatch(r *http.Request, body []byte, endpoint string) reply {
	settle := endpoint == EndpointSettle
	decode := x402.DecodeBatchVerifyRequest
	if settle {
		decode = x402.DecodeBatchSettleRequest
	}
	req, err := decode(body)
	if err != nil {
		var de *x402.DecodeError
		if errors.As(err, &de) && de.Kind == x402.DecodeTooLarge {
			return errorReply(http.StatusRequestEntityTooLarge, "%v", err)
		}
		res := errorReply(http.StatusBadRequest, "%v", err)
		if de != nil {
			res.body = errorBody{Error: err.Error(), Field: de.Field}
		}
		return res
	}
	payer := ""
	if cfg := req.PaymentPayload.Payload.ChannelConfig; cfg != nil {
		payer = cfg.Payer
	}
	network := req.PaymentRequirements.Network
	bf, ok := s.f.(x402.BatchFacilitator)
	reason, message := "", ""
	switch {
	case !ok:
		reason, message = x402.ReasonUnsupportedScheme, "this facilitator does not serve the batch-settlement scheme"
	case s.networks != nil && !s.networks[network]:
		reason, message = x402.ReasonInvalidNetwork, "this facilitator does not serve network "+network
	}
	if reason != "" {
		s.metrics.ObserveOutcome(endpoint, reason)
		if !settle {
			return reply{status: http.StatusOK, body: x402.VerifyResponse{Payer: payer, InvalidReason: reason, InvalidMessage: message}}
		}
		return reply{status: http.StatusOK, body: x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: reason, ErrorMessage: message}}
	}
	if !settle {
		ip := s.clientIP(r)
		if s.verifies != nil {
			if ok, who, wait := s.verifies.take(ip); !ok {
				return tooManyVerifications(s.verifies, who, wait, payer)
			}
		}
		resp, err := bf.VerifyBatch(r.Context(), req)
		if err != nil {
			return s.failure(endpoint, err, x402.SchemeBatchSettlement)
		}
		if resp.IsValid && s.verifies != nil {
			s.verifies.refund(ip)
		}
		s.metrics.ObserveOutcome(endpoint, resp.InvalidReason)
		return reply{status: http.StatusOK, body: resp}
	}
	res, ok, shared := s.limiter.takePayer(r.Context(), payer)
	if !ok {
		return res
	}
	// As any settlement, it runs to its end when the caller hangs up: a deposit may have been broadcast.
	resp, err := bf.SettleBatch(context.WithoutCancel(r.Context()), req)
	if err != nil {
		// No answer: the deposit may have been sent, and the payer's count stays.
		return s.failure(endpoint, err, x402.SchemeBatchSettlement)
	}
	if resp.Transaction == "" {
		s.limiter.refundPayer(r.Context(), payer, shared)
	}
	s.metrics.ObserveOutcome(endpoint, resp.ErrorReason)
	s.logger.Info("batch-settlement settled", zap.Bool("success", resp.Success), zap.String("payer", resp.Payer),
		zap.String("network", resp.Network), zap.String("commitment", resp.Commitment()), zap.String("transaction", resp.Transaction),
		zap.String("reason", resp.ErrorReason))
	return reply{status: http.StatusOK, body: resp}
}
