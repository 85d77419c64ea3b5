package x402

import (
	"encoding/base64"
	"encoding/json"
	"reflect"
	"testing"
)

// addBatchSeeds seeds a fuzz target with the SDK's documents, as JSON and as a header.
func addBatchSeeds(f *testing.F, names ...string) {
	for _, name := range names {
		doc := readExample(f, name)
		f.Add(string(doc))
		f.Add(base64.StdEncoding.EncodeToString(doc))
	}
	for _, s := range []string{"", "{}", "null", `{"x402Version":2}`, `{"x402Version":2,"payload":{"type":"voucher"}}`} {
		f.Add(s)
	}
}

// roundTrip fails unless v, encoded and decoded again by decode, is v.
func roundTrip[T any](t *testing.T, v T, decode func([]byte) (T, error)) {
	t.Helper()
	again, err := decode(reencode(t, v))
	if err != nil {
		t.Fatalf("re-encoded value does not decode: %v\n%s", err, reencode(t, v))
	}
	if !reflect.DeepEqual(again, v) {
		t.Fatalf("decode(encode(v)) != v:\n%+v\n%+v", again, v)
	}
}

// checkBatchPayload fails unless an accepted payload has the members its kind requires.
func checkBatchPayload(t *testing.T, p BatchPayload, settle bool) {
	t.Helper()
	switch p.Type {
	case BatchDeposit:
		a := p.Deposit.Authorization
		if p.ChannelConfig == nil || p.Voucher == nil || (a.ERC3009Authorization == nil) == (a.Permit2Authorization == nil) {
			t.Fatalf("accepted a deposit without channel, voucher or exactly one authorization: %+v", p)
		}
	case BatchVoucher, BatchRefund:
		if settle && p.Type == BatchVoucher {
			t.Fatal("a /settle request accepted a voucher")
		}
		if p.ChannelConfig == nil || p.Voucher == nil || p.Voucher.Signature == "" {
			t.Fatalf("accepted a %s without channel or signed voucher: %+v", p.Type, p)
		}
		if settle && (p.Claims == nil || p.RefundNonce == "" || p.Amount == "") {
			t.Fatalf("a /settle request accepted a refund that is not enriched: %+v", p)
		}
	case BatchClaim:
		if !settle || len(p.Claims) == 0 {
			t.Fatalf("accepted a claim here, or one with no claims: %+v", p)
		}
	case BatchSettle:
		if !settle || p.Receiver == "" || p.Token == "" {
			t.Fatalf("accepted a settle here, or one without receiver and token: %+v", p)
		}
	default:
		t.Fatalf("accepted payload type %q", p.Type)
	}
}

func FuzzDecodeBatchPayment(f *testing.F) {
	addBatchSeeds(f, batchDeposit3009, batchDepositPermit2, batchVoucherDoc, batchRefundDoc)
	f.Fuzz(func(t *testing.T, in string) {
		for _, decode := range []func() (BatchPayment, error){
			func() (BatchPayment, error) { return UnmarshalBatchPayment([]byte(in)) },
			func() (BatchPayment, error) { return DecodeBatchPayment(in) },
		} {
			p, err := decode()
			if err != nil {
				checkDecodeErr(t, err)
				continue
			}
			if p.X402Version != Version2 || p.Accepted.Scheme != SchemeBatchSettlement || p.Accepted.Extra.ReceiverAuthorizer == "" {
				t.Fatalf("accepted %+v", p)
			}
			checkBatchPayload(t, p.Payload, false)
			roundTrip(t, p, UnmarshalBatchPayment)
		}
	})
}

func FuzzDecodeBatchRequest(f *testing.F) {
	addBatchSeeds(f, batchVerifyDoc, batchClaimDoc, batchSettleDoc, batchSettleRefund)
	f.Fuzz(func(t *testing.T, in string) {
		for _, settle := range []bool{false, true} {
			decode := DecodeBatchVerifyRequest
			if settle {
				decode = DecodeBatchSettleRequest
			}
			req, err := decode([]byte(in))
			if err != nil {
				checkDecodeErr(t, err)
				continue
			}
			if !json.Valid([]byte(in)) || req.X402Version != Version2 || req.PaymentPayload.X402Version != Version2 {
				t.Fatalf("accepted %+v", req)
			}
			checkBatchPayload(t, req.PaymentPayload.Payload, settle)
			roundTrip(t, req, decode)
		}
	})
}

func FuzzUnmarshalBatchRequirements(f *testing.F) {
	for _, name := range []string{batchDeposit3009, batchDepositPermit2, batchVoucherDoc} {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(readExample(f, name), &m); err != nil {
			f.Fatal(err)
		}
		f.Add(string(m["accepted"]))
	}
	f.Add(`{"scheme":"batch-settlement","extra":{"channelState":{"channelId":"0x1","withdrawRequestedAt":1}}}`)
	f.Fuzz(func(t *testing.T, in string) {
		rq, err := UnmarshalBatchRequirements([]byte(in))
		if err != nil {
			checkDecodeErr(t, err)
			return
		}
		if rq.Scheme != SchemeBatchSettlement || rq.Extra.ReceiverAuthorizer == "" || rq.MaxTimeoutSeconds <= 0 {
			t.Fatalf("accepted %+v", rq)
		}
		roundTrip(t, rq, UnmarshalBatchRequirements)
	})
}

func FuzzDecodeBatchSettleResponse(f *testing.F) {
	addBatchSeeds(f, batchResponseDoc, "settle-response-success.json", "settle-response-failure.json")
	f.Fuzz(func(t *testing.T, in string) {
		for _, decode := range []func() (BatchSettleResponse, error){
			func() (BatchSettleResponse, error) { return UnmarshalBatchSettleResponse([]byte(in)) },
			func() (BatchSettleResponse, error) { return DecodeBatchSettleResponse(in) },
		} {
			r, err := decode()
			if err != nil {
				checkDecodeErr(t, err)
				continue
			}
			if r.Success && r.Commitment() == "" {
				t.Fatalf("accepted a success naming no commitment: %+v", r)
			}
			roundTrip(t, r, UnmarshalBatchSettleResponse)
		}
	})
}
