package x402

import (
	"bytes"
	"encoding/json"
	"testing"
)

// viaEncodingJSON is what EncodeHeader's encoder writes for v (before Base64): the reference appendAnswer
// must match byte for byte.
func viaEncodingJSON(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		t.Fatal(err)
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func sameAsEncodingJSON(t testing.TB, v any) {
	t.Helper()
	got, ok := appendAnswer(nil, v)
	if !ok {
		t.Fatalf("appendAnswer left %T to encoding/json", v)
	}
	if want := viaEncodingJSON(t, v); !bytes.Equal(got, want) {
		t.Fatalf("appendAnswer wrote\n%s\nencoding/json writes\n%s", got, want)
	}
}

func TestTheAnswerEncoderWritesWhatEncodingJSONWrites(t *testing.T) {
	awkward := "a\"b\\c\x00\x01\x1f\b\f\n\r\t<>&\u2028\u2029\x7f\xff\xc3(é€😀"
	state := &BatchChannelState{ChannelID: "0x847f", Balance: "10000", TotalClaimed: "0", WithdrawRequestedAt: 1700000000,
		RefundNonce: "0", ChargedCumulativeAmount: "3000"}
	settle := []SettleResponse{
		{},
		{Success: true, Transaction: "0xabc", Network: "eip155:8453", Payer: "0x3C44", Amount: "1000"},
		{Success: false, Network: "eip155:8453", ErrorReason: ReasonSettlementPending, ErrorMessage: awkward},
		{Transaction: awkward, Network: awkward, Payer: awkward, Amount: awkward, ErrorReason: awkward},
	}
	for _, r := range settle {
		sameAsEncodingJSON(t, r)
		sameAsEncodingJSON(t, &r)
	}
	batch := []BatchSettleResponse{
		{},
		{Success: true, Network: "eip155:72344", Payer: "0x3c44", Amount: "1000",
			Extra: &BatchResponseExtra{ChargedAmount: "1000", ChannelState: state}},
		{Success: true, Network: "eip155:72344", Extra: &BatchResponseExtra{}},
		{Success: true, Network: "eip155:72344", Extra: &BatchResponseExtra{ChannelState: &BatchChannelState{}}},
		{Extra: &BatchResponseExtra{VoucherState: &BatchVoucherState{}}},
		{Extra: &BatchResponseExtra{VoucherState: &BatchVoucherState{Signature: awkward}}},
		{ErrorReason: ReasonBatchCumulativeExceedsBalance, ErrorMessage: awkward, Extra: &BatchResponseExtra{ChargedAmount: awkward,
			ChannelState: &BatchChannelState{ChannelID: awkward, WithdrawRequestedAt: -1}, VoucherState: &BatchVoucherState{SignedMaxClaimable: "5", Signature: "0x01"}}},
	}
	for _, r := range batch {
		sameAsEncodingJSON(t, r)
		sameAsEncodingJSON(t, &r)
	}
	// Extensions, a nil pointer and any other type go through encoding/json, as before.
	for _, v := range []any{SettleResponse{Extensions: map[string]json.RawMessage{}}, BatchSettleResponse{Extensions: map[string]json.RawMessage{"a": json.RawMessage(`1`)}},
		(*SettleResponse)(nil), (*BatchSettleResponse)(nil), VerifyResponse{IsValid: true}} {
		if _, ok := appendAnswer(nil, v); ok {
			t.Errorf("appendAnswer wrote %#v, which it leaves to encoding/json", v)
		}
	}
	// EncodeHeader answers the same either way.
	r := batch[1]
	h, err := EncodeHeader(r)
	if err != nil {
		t.Fatal(err)
	}
	back, err := DecodeBatchSettleResponse(h)
	if err != nil || back.Extra == nil || back.Extra.ChannelState == nil || *back.Extra.ChannelState != *state {
		t.Fatalf("EncodeHeader's answer decodes to %+v (%v)", back, err)
	}
}

// FuzzTheAnswerEncoder crosses every string member with arbitrary bytes: appendAnswer writes what encoding/json
// writes.
func FuzzTheAnswerEncoder(f *testing.F) {
	f.Add("0xabc", "eip155:8453", "1000", "", "\u2028\x00\"\xff", int64(0), true)
	f.Add("", "", "", "reason", "<a href=\"x\">&</a>", int64(-5), false)
	f.Fuzz(func(t *testing.T, tx, network, amount, reason, message string, at int64, success bool) {
		sameAsEncodingJSON(t, SettleResponse{Success: success, Transaction: tx, Network: network, Payer: message, Amount: amount,
			ErrorReason: reason, ErrorMessage: message})
		sameAsEncodingJSON(t, BatchSettleResponse{Success: success, Transaction: tx, Network: network, Payer: amount, Amount: amount,
			ErrorReason: reason, ErrorMessage: message, Extra: &BatchResponseExtra{ChargedAmount: reason,
				ChannelState: &BatchChannelState{ChannelID: tx, Balance: network, TotalClaimed: amount, WithdrawRequestedAt: at,
					RefundNonce: message, ChargedCumulativeAmount: reason},
				VoucherState: &BatchVoucherState{SignedMaxClaimable: message, Signature: tx}}})
	})
}
