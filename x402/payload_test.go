package x402

import "testing"

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
