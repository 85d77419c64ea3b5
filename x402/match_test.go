package x402

import (
	"strings"
	"testing"
)

func TestSameTermsComparesEveryTermThatDecidesWhatAPaymentBuys(t *testing.T) {
	base := PaymentRequirements{Scheme: SchemeExact, Network: "eip155:72344", Amount: "10000",
		Asset: "0x69c1c4280cd64e46F1525c67AA9e5F784d09cB4C", PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11",
		MaxTimeoutSeconds: 300, Extra: Extra{AssetTransferMethod: TransferPermit2, Name: "Stable Coin", Version: "1"}}
	tests := []struct {
		name string
		edit func(*PaymentRequirements)
		same bool
	}{
		{"identical", func(*PaymentRequirements) {}, true},
		{"addresses in another letter case", func(r *PaymentRequirements) {
			r.Asset, r.PayTo = "0x69C1C4280CD64E46F1525C67AA9E5F784D09CB4C", "0x5E11E75E11E75E11E75E11E75E11E75E11E75E11"
		}, true},
		{"another timeout and token name", func(r *PaymentRequirements) { r.MaxTimeoutSeconds, r.Extra.Name = 60, "X" }, true},
		{"another amount", func(r *PaymentRequirements) { r.Amount = "5000000" }, false},
		{"another recipient", func(r *PaymentRequirements) { r.PayTo = "0x000000000000000000000000000000000000beef" }, false},
		{"another asset", func(r *PaymentRequirements) { r.Asset = "0x000000000000000000000000000000000000beef" }, false},
		{"another network", func(r *PaymentRequirements) { r.Network = "eip155:1" }, false},
		{"another scheme", func(r *PaymentRequirements) { r.Scheme = "upto" }, false},
		{"another method", func(r *PaymentRequirements) { r.Extra.AssetTransferMethod = TransferERC2612 }, false},
		{"an amount that is no number", func(r *PaymentRequirements) { r.Amount = "ten" }, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			other := base
			tc.edit(&other)
			if got := SameTerms(base, other); got != tc.same {
				t.Errorf("SameTerms = %v, want %v", got, tc.same)
			}
			if got := SameTerms(other, base); got != tc.same {
				t.Errorf("SameTerms (swapped) = %v, want %v", got, tc.same)
			}
		})
	}
}

func TestASettlementAnswerProvesTheSettlementOnlyIfItNamesTheTransactionNetworkPayerAndAmount(t *testing.T) {
	const payer = "0xfe74B321980545471E50a8d27F3d072cD5D8F44B"
	req := VerifyRequest{
		PaymentRequirements: PaymentRequirements{Network: "eip155:72344", Amount: "10000"},
		PaymentPayload:      PaymentPayload{Payload: ExactEVMPayload{Permit2Authorization: &Permit2Authorization{From: payer, Nonce: "7"}}},
	}
	good := SettleResponse{Success: true, Transaction: "0x" + strings.Repeat("ab", 32), Network: "eip155:72344", Payer: strings.ToLower(payer), Amount: "10000"}
	tests := []struct {
		name    string
		edit    func(*SettleResponse)
		problem string // "" for proof
	}{
		{"well formed", func(*SettleResponse) {}, ""},
		{"without an amount", func(r *SettleResponse) { r.Amount = "" }, ""},
		{"no transaction", func(r *SettleResponse) { r.Transaction = "" }, "no transaction"},
		{"a transaction hash too short", func(r *SettleResponse) { r.Transaction = "0xabcd" }, "no transaction"},
		{"another network", func(r *SettleResponse) { r.Network = "eip155:1" }, "network"},
		{"another payer", func(r *SettleResponse) { r.Payer = "0x000000000000000000000000000000000000bEEF" }, "payer"},
		{"no payer", func(r *SettleResponse) { r.Payer = "" }, "payer"},
		{"another amount", func(r *SettleResponse) { r.Amount = "1" }, "raw units"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp := good
			tc.edit(&resp)
			got := SettlementProblem(req, resp)
			if (tc.problem == "") != (got == "") || !strings.Contains(got, tc.problem) {
				t.Errorf("SettlementProblem = %q, want %q", got, tc.problem)
			}
		})
	}
}
