package x402

import (
	"testing"
	"time"
)

func TestTransferMethodIsTheRequirementsElseThePayloadsShape(t *testing.T) {
	p2 := ExactEVMPayload{Permit2Authorization: &Permit2Authorization{From: "0xp2", Nonce: "7"}}
	e := ExactEVMPayload{Authorization: &EIP2612Authorization{From: "0xe", Nonce: "3"}}
	for _, tc := range []struct {
		name   string
		method string
		p      ExactEVMPayload
		want   string
	}{
		{"named permit2, erc2612 shape", TransferPermit2, e, TransferPermit2},
		{"named erc2612, permit2 shape", TransferERC2612, p2, TransferERC2612},
		{"unnamed, permit2 shape", "", p2, TransferPermit2},
		{"unnamed, erc2612 shape", "", e, TransferERC2612},
		{"unnamed, no authorization", "", ExactEVMPayload{}, TransferERC2612},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rq := PaymentRequirements{Extra: Extra{AssetTransferMethod: tc.method}}
			if got := TransferMethod(rq, tc.p); got != tc.want {
				t.Errorf("TransferMethod = %q, want %q", got, tc.want)
			}
		})
	}
	for _, tc := range []struct {
		p           ExactEVMPayload
		from, nonce string
	}{{p2, "0xp2", "7"}, {e, "0xe", "3"}, {ExactEVMPayload{}, "", ""}} {
		if from, nonce := tc.p.PayerAndNonce(); from != tc.from || nonce != tc.nonce {
			t.Errorf("PayerAndNonce = %q, %q; want %q, %q", from, nonce, tc.from, tc.nonce)
		}
	}
}

func TestDeadlineIsThePermit2DeadlineOrTheERC2612ValidBefore(t *testing.T) {
	never := time.Date(9999, time.December, 31, 23, 59, 59, 0, time.UTC)
	permit2 := func(d string) ExactEVMPayload {
		return ExactEVMPayload{Permit2Authorization: &Permit2Authorization{Deadline: d, Witness: Permit2Witness{ValidAfter: "5"}}}
	}
	erc2612 := func(d string) ExactEVMPayload {
		return ExactEVMPayload{Authorization: &EIP2612Authorization{ValidAfter: "5", ValidBefore: d}}
	}
	for _, tc := range []struct {
		name string
		p    ExactEVMPayload
		want time.Time
	}{
		{"permit2 deadline", permit2("1700000300"), time.Unix(1700000300, 0).UTC()},
		{"erc2612 validBefore", erc2612("1700000300"), time.Unix(1700000300, 0).UTC()},
		{"the last representable second", erc2612("253402300799"), never},
		{"past the year 9999", permit2("253402300800"), never},
		{"2^256-1, never expires", erc2612(MaxUint256().String()), never},
		{"not a number", permit2("soon"), time.Time{}},
		{"a leading zero", erc2612("0100"), time.Time{}},
		{"empty", permit2(""), time.Time{}},
		{"no authorization", ExactEVMPayload{Signature: "0x00"}, time.Time{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.p.Deadline(); !got.Equal(tc.want) || got.Location() != time.UTC {
				t.Errorf("Deadline = %v, want %v (UTC)", got, tc.want)
			}
		})
	}
}
