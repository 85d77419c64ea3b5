package facilitatorclient

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/x402-gateway/caddy-x402/x402"
)

// VerifyBatch posts a batch-settlement body (a deposit, voucher or refund) to /verify, as the public SDK's
// server does: the answer's extra names the channel's state as the facilitator read it on chain.
func (c *Client) VerifyBatch(ctx context.Context, req x402.BatchRequest) (x402.VerifyResponse, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return x402.VerifyResponse{}, fmt.Errorf("facilitator verify: cannot encode the batch-settlement request: %w", err)
	}
	sent := c.send(ctx, http.MethodPost, c.verifyURL, body, c.timeouts.Verify, c.retries, true)
	if sent.last.err != nil {
		return x402.VerifyResponse{}, c.transportFailure(ctx, opVerify, sent)
	}
	if resp, ok := decodeVerify(sent.last.status, sent.last.body); ok {
		return resp, nil
	}
	return x402.VerifyResponse{}, c.statusFailure(opVerify, sent.last, "a VerifyResponse with isValid")
}

// SettleBatch posts a batch-settlement body to /settle: a deposit, or one of the receiver's actions (claim,
// settle, refund). As Settle, it is sent again only after an attempt that surely never reached the
// facilitator; after an error the action may still have been taken.
func (c *Client) SettleBatch(ctx context.Context, req x402.BatchRequest) (x402.BatchSettleResponse, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("facilitator settle: cannot encode the batch-settlement request: %w", err)
	}
	sent := c.send(ctx, http.MethodPost, c.settleURL, body, c.timeouts.Settle, c.settleResends, false)
	if sent.last.err != nil {
		return x402.BatchSettleResponse{}, c.transportFailure(ctx, opSettle, sent)
	}
	st := sent.last.status
	if st >= 200 && st < 300 || st == http.StatusBadRequest || st >= 500 {
		if resp, err := x402.UnmarshalBatchSettleResponse(sent.last.body); err == nil && (st < 300 || resp.ErrorReason != "" || resp.Transaction != "") {
			return resp, nil
		}
	}
	return x402.BatchSettleResponse{}, c.statusFailure(opSettle, sent.last, "a batch-settlement SettleResponse with success")
}

var _ x402.BatchFacilitator = (*Client)(nil)
