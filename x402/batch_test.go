package x402

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// The batch-settlement examples are what the public TypeScript SDK sends: the payments its client signed
// (e2e/interop/batch-vectors.mjs), and the /settle requests and answer shaped as its server's channel manager
// and resource server build them.
const (
	batchDeposit3009    = "batch-payment-deposit-eip3009.json"
	batchDepositPermit2 = "batch-payment-deposit-permit2.json"
	batchVoucherDoc     = "batch-payment-voucher.json"
	batchRefundDoc      = "batch-payment-refund.json"
	batchVerifyDoc      = "batch-verify-voucher.json"
	batchClaimDoc       = "batch-settle-claim.json"
	batchSettleDoc      = "batch-settle-settle.json"
	batchSettleRefund   = "batch-settle-refund.json"
	batchResponseDoc    = "batch-settle-response-voucher.json"
)

func TestBatchDocumentsTheSDKSendsDecodeAsEncodingJSONReadsThem(t *testing.T) {
	for _, name := range []string{batchDeposit3009, batchDepositPermit2, batchVoucherDoc, batchRefundDoc} {
		t.Run(name, func(t *testing.T) {
			doc := readExample(t, name)
			got, err := DecodeBatchPayment(b64(doc))
			if err != nil {
				t.Fatal(err)
			}
			var want BatchPayment
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
			if body, err := UnmarshalBatchPayment(doc); err != nil || !reflect.DeepEqual(body, got) {
				t.Errorf("UnmarshalBatchPayment = %+v, %v; want the header's value", body, err)
			}
			if got.Payload.ChannelConfig.WithdrawDelay != 900 || got.Accepted.Extra.ReceiverAuthorizer == "" || got.Payload.Voucher.Signature == "" {
				t.Errorf("decoded %+v", got)
			}
			rq, err := json.Marshal(got.Accepted)
			if err != nil {
				t.Fatal(err)
			}
			if back, err := UnmarshalBatchRequirements(rq); err != nil || !reflect.DeepEqual(back, got.Accepted) {
				t.Errorf("UnmarshalBatchRequirements(accepted) = %+v, %v", back, err)
			}
		})
	}
	for _, tc := range []struct {
		name   string
		decode func([]byte) (BatchRequest, error)
		kind   string
	}{
		{batchVerifyDoc, DecodeBatchVerifyRequest, BatchVoucher},
		{batchClaimDoc, DecodeBatchSettleRequest, BatchClaim},
		{batchSettleDoc, DecodeBatchSettleRequest, BatchSettle},
		{batchSettleRefund, DecodeBatchSettleRequest, BatchRefund},
	} {
		t.Run(tc.name, func(t *testing.T) {
			doc := readExample(t, tc.name)
			got, err := tc.decode(doc)
			if err != nil {
				t.Fatal(err)
			}
			var want BatchRequest
			mustUnmarshal(t, doc, &want)
			sameJSON(t, got, want)
			if got.PaymentPayload.Payload.Type != tc.kind {
				t.Errorf("payload type %q, want %q", got.PaymentPayload.Payload.Type, tc.kind)
			}
		})
	}
	t.Run(batchResponseDoc, func(t *testing.T) {
		doc := readExample(t, batchResponseDoc)
		got, err := DecodeBatchSettleResponse(b64(doc))
		if err != nil {
			t.Fatal(err)
		}
		var want BatchSettleResponse
		mustUnmarshal(t, doc, &want)
		sameJSON(t, got, want)
		if c := got.Commitment(); !strings.HasPrefix(c, "0x") || !strings.HasSuffix(c, "@3000") {
			t.Errorf("Commitment() = %q, want the channel at its cumulative amount 3000", c)
		}
		if body, err := UnmarshalBatchSettleResponse(doc); err != nil || !reflect.DeepEqual(body, got) {
			t.Errorf("UnmarshalBatchSettleResponse = %+v, %v", body, err)
		}
	})
}

// A refund with nothing to claim first keeps its empty claims: the public SDK tells an enriched refund by the
// member's presence.
func TestAnEnrichedRefundKeepsAnEmptyClaimsArray(t *testing.T) {
	doc := mutated(t, batchSettleRefund, set("paymentPayload.payload.claims", []any{}))
	req, err := DecodeBatchSettleRequest(doc)
	if err != nil {
		t.Fatal(err)
	}
	out, err := json.Marshal(req.PaymentPayload.Payload)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"claims":[]`) {
		t.Fatalf("re-encoded refund %s lost its empty claims", out)
	}
}

// claim0 edits the first claim of a claim or refund /settle request.
func claim0(edit func(map[string]any)) func(map[string]any) {
	return func(m map[string]any) {
		pl := m["paymentPayload"].(map[string]any)["payload"].(map[string]any)
		edit(pl["claims"].([]any)[0].(map[string]any))
	}
}

func TestBatchDecodersRefuseNamingTheField(t *testing.T) {
	payment := func(name string, edit func(map[string]any)) func() error {
		return func() error { _, err := DecodeBatchPayment(b64(mutated(t, name, edit))); return err }
	}
	verify := func(edit func(map[string]any)) func() error {
		return func() error { _, err := DecodeBatchVerifyRequest(mutated(t, batchVerifyDoc, edit)); return err }
	}
	settle := func(name string, edit func(map[string]any)) func() error {
		return func() error { _, err := DecodeBatchSettleRequest(mutated(t, name, edit)); return err }
	}
	response := func(edit func(map[string]any)) func() error {
		return func() error { _, err := UnmarshalBatchSettleResponse(mutated(t, batchResponseDoc, edit)); return err }
	}
	requirements := func(edit func(map[string]any)) func() error {
		return func() error {
			var m map[string]any
			mustUnmarshal(t, readExample(t, batchVoucherDoc), &m)
			rq := m["accepted"].(map[string]any)
			edit(rq)
			doc, _ := json.Marshal(rq)
			_, err := UnmarshalBatchRequirements(doc)
			return err
		}
	}
	const dep = "payload.deposit.authorization"
	tests := []struct {
		name   string
		decode func() error
		kind   DecodeErrorKind
		field  string
	}{
		{"payload type missing", payment(batchVoucherDoc, del("payload.type")), DecodeMissingField, "payload.type"},
		{"payload type unknown", payment(batchVoucherDoc, set("payload.type", "tip")), DecodeInvalidValue, "payload.type"},
		{"a claim where a client pays", payment(batchVoucherDoc, set("payload.type", "claim")), DecodeInvalidValue, "payload.type"},
		{"type as a number", payment(batchVoucherDoc, set("payload.type", 1)), DecodeWrongType, "payload.type"},
		{"scheme exact", payment(batchVoucherDoc, set("accepted.scheme", "exact")), DecodeInvalidValue, "accepted.scheme"},
		{"receiverAuthorizer missing", payment(batchVoucherDoc, del("accepted.extra.receiverAuthorizer")), DecodeMissingField, "accepted.extra.receiverAuthorizer"},
		{"withdrawDelay a string", payment(batchVoucherDoc, set("accepted.extra.withdrawDelay", "900")), DecodeWrongType, "accepted.extra.withdrawDelay"},
		{"withdrawDelay negative", payment(batchVoucherDoc, set("accepted.extra.withdrawDelay", -1)), DecodeInvalidValue, "accepted.extra.withdrawDelay"},
		{"transfer method erc2612", payment(batchVoucherDoc, set("accepted.extra.assetTransferMethod", "erc2612")), DecodeInvalidValue, "accepted.extra.assetTransferMethod"},
		{"timeout zero for a resource", payment(batchVoucherDoc, set("accepted.maxTimeoutSeconds", 0)), DecodeInvalidValue, "accepted.maxTimeoutSeconds"},
		{"channelConfig missing", payment(batchVoucherDoc, del("payload.channelConfig")), DecodeMissingField, "payload.channelConfig"},
		{"channelConfig null", payment(batchVoucherDoc, set("payload.channelConfig", nil)), DecodeMissingField, "payload.channelConfig"},
		{"payerAuthorizer missing", payment(batchVoucherDoc, del("payload.channelConfig.payerAuthorizer")), DecodeMissingField, "payload.channelConfig.payerAuthorizer"},
		{"salt empty", payment(batchVoucherDoc, set("payload.channelConfig.salt", "")), DecodeMissingField, "payload.channelConfig.salt"},
		{"channel withdrawDelay missing", payment(batchVoucherDoc, del("payload.channelConfig.withdrawDelay")), DecodeMissingField, "payload.channelConfig.withdrawDelay"},
		{"channel withdrawDelay a fraction", payment(batchVoucherDoc, set("payload.channelConfig.withdrawDelay", 900.5)), DecodeWrongType, "payload.channelConfig.withdrawDelay"},
		{"voucher missing", payment(batchVoucherDoc, del("payload.voucher")), DecodeMissingField, "payload.voucher"},
		{"voucher channelId missing", payment(batchVoucherDoc, del("payload.voucher.channelId")), DecodeMissingField, "payload.voucher.channelId"},
		{"maxClaimableAmount a number", payment(batchVoucherDoc, set("payload.voucher.maxClaimableAmount", 3000)), DecodeWrongType, "payload.voucher.maxClaimableAmount"},
		{"voucher signature empty", payment(batchVoucherDoc, set("payload.voucher.signature", "")), DecodeMissingField, "payload.voucher.signature"},
		{"refund amount empty", payment(batchRefundDoc, set("payload.amount", "")), DecodeMissingField, "payload.amount"},
		{"deposit missing", payment(batchDeposit3009, del("payload.deposit")), DecodeMissingField, "payload.deposit"},
		{"deposit amount missing", payment(batchDeposit3009, del("payload.deposit.amount")), DecodeMissingField, "payload.deposit.amount"},
		{"deposit authorization missing", payment(batchDeposit3009, del(dep)), DecodeMissingField, dep},
		{"deposit with no authorization", payment(batchDeposit3009, del(dep+".erc3009Authorization")), DecodeMissingField, dep + ".erc3009Authorization"},
		{"deposit with both authorizations", payment(batchDeposit3009, set(dep+".permit2Authorization", map[string]any{"from": "0x1"})), DecodeInvalidValue, dep},
		{"erc3009 salt missing", payment(batchDeposit3009, del(dep+".erc3009Authorization.salt")), DecodeMissingField, dep + ".erc3009Authorization.salt"},
		{"erc3009 validBefore a number", payment(batchDeposit3009, set(dep+".erc3009Authorization.validBefore", 1795760745)), DecodeWrongType, dep + ".erc3009Authorization.validBefore"},
		{"permit2 witness missing", payment(batchDepositPermit2, del(dep+".permit2Authorization.witness")), DecodeMissingField, dep + ".permit2Authorization.witness"},
		{"permit2 witness channelId missing", payment(batchDepositPermit2, del(dep+".permit2Authorization.witness.channelId")), DecodeMissingField, dep + ".permit2Authorization.witness.channelId"},
		{"permit2 permitted amount missing", payment(batchDepositPermit2, del(dep+".permit2Authorization.permitted.amount")), DecodeMissingField, dep + ".permit2Authorization.permitted.amount"},
		{"permit2 signature missing", payment(batchDepositPermit2, del(dep+".permit2Authorization.signature")), DecodeMissingField, dep + ".permit2Authorization.signature"},
		{"version 1", payment(batchVoucherDoc, set("x402Version", 1)), DecodeUnsupportedVersion, "x402Version"},
		{"a duplicate member", func() error {
			doc := strings.Replace(string(readExample(t, batchVoucherDoc)), `"type":"voucher"`, `"type":"voucher","type":"deposit"`, 1)
			_, err := DecodeBatchPayment(b64([]byte(doc)))
			return err
		}, DecodeInvalidValue, "payload.type"},

		{"verify: a claim", verify(set("paymentPayload.payload.type", "claim")), DecodeInvalidValue, "paymentPayload.payload.type"},
		{"verify: paymentPayload missing", verify(del("paymentPayload")), DecodeMissingField, "paymentPayload"},
		{"verify: paymentRequirements missing", verify(del("paymentRequirements")), DecodeMissingField, "paymentRequirements"},
		{"verify: requirements name no receiver authorizer", verify(del("paymentRequirements.extra.receiverAuthorizer")), DecodeMissingField, "paymentRequirements.extra.receiverAuthorizer"},
		{"verify: payment of version 1", verify(set("paymentPayload.x402Version", 1)), DecodeUnsupportedVersion, "paymentPayload.x402Version"},

		{"settle: a voucher (served by the resource server, not settled)", settle(batchClaimDoc, set("paymentPayload.payload.type", "voucher")), DecodeInvalidValue, "paymentPayload.payload.type"},
		{"settle: claims missing", settle(batchClaimDoc, del("paymentPayload.payload.claims")), DecodeMissingField, "paymentPayload.payload.claims"},
		{"settle: claims empty", settle(batchClaimDoc, set("paymentPayload.payload.claims", []any{})), DecodeMissingField, "paymentPayload.payload.claims"},
		{"settle: a claim null", settle(batchClaimDoc, set("paymentPayload.payload.claims", []any{nil})), DecodeWrongType, "paymentPayload.payload.claims[0]"},
		{"settle: a claim's totalClaimed missing", settle(batchClaimDoc, claim0(del("totalClaimed"))), DecodeMissingField, "paymentPayload.payload.claims[0].totalClaimed"},
		{"settle: a claim's channel payer missing", settle(batchClaimDoc, claim0(func(m map[string]any) {
			delete(m["voucher"].(map[string]any)["channel"].(map[string]any), "payer")
		})), DecodeMissingField, "paymentPayload.payload.claims[0].voucher.channel.payer"},
		{"settle: a claim's voucher missing", settle(batchClaimDoc, claim0(del("voucher"))), DecodeMissingField, "paymentPayload.payload.claims[0].voucher"},
		{"settle: settle's token missing", settle(batchSettleDoc, del("paymentPayload.payload.token")), DecodeMissingField, "paymentPayload.payload.token"},
		{"settle: refund's nonce missing", settle(batchSettleRefund, del("paymentPayload.payload.refundNonce")), DecodeMissingField, "paymentPayload.payload.refundNonce"},
		{"settle: refund's amount missing", settle(batchSettleRefund, del("paymentPayload.payload.amount")), DecodeMissingField, "paymentPayload.payload.amount"},
		{"settle: refund's claims missing", settle(batchSettleRefund, del("paymentPayload.payload.claims")), DecodeMissingField, "paymentPayload.payload.claims"},
		{"settle: a negative timeout", settle(batchSettleDoc, set("paymentRequirements.maxTimeoutSeconds", -1)), DecodeInvalidValue, "paymentRequirements.maxTimeoutSeconds"},
		{"settle: extra missing", settle(batchSettleDoc, del("paymentRequirements.extra")), DecodeMissingField, "paymentRequirements.extra"},

		{"requirements: receiverAuthorizer missing", requirements(func(m map[string]any) { delete(m["extra"].(map[string]any), "receiverAuthorizer") }), DecodeMissingField, "extra.receiverAuthorizer"},
		{"requirements: channelState without its channel", requirements(func(m map[string]any) {
			m["extra"].(map[string]any)["channelState"] = map[string]any{"balance": "1"}
		}), DecodeMissingField, "extra.channelState.channelId"},
		{"requirements: withdrawRequestedAt a string", requirements(func(m map[string]any) {
			m["extra"].(map[string]any)["channelState"] = map[string]any{"channelId": "0x1", "withdrawRequestedAt": "0"}
		}), DecodeWrongType, "extra.channelState.withdrawRequestedAt"},

		{"response: success missing", response(del("success")), DecodeMissingField, "success"},
		{"response: a success that names no commitment", response(del("extra")), DecodeMissingField, "transaction"},
		{"response: a channel state without its channel", response(del("extra.channelState.channelId")), DecodeMissingField, "extra.channelState.channelId"},
		{"response: chargedAmount a number", response(set("extra.chargedAmount", 1000)), DecodeWrongType, "extra.chargedAmount"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantDecodeError(t, tt.decode(), tt.kind, tt.field)
		})
	}
}

func TestABatchFailureNeedsNoCommitment(t *testing.T) {
	r, err := UnmarshalBatchSettleResponse([]byte(`{"success":false,"transaction":"","network":"eip155:72344","errorReason":"invalid_batch_settlement_evm_channel_busy"}`))
	if err != nil || r.Commitment() != "" || r.ErrorReason != ReasonBatchChannelBusy {
		t.Fatalf("got %+v, %v", r, err)
	}
}
