package chain

import (
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/params"
)

// The bound on a sponsored approval's fee cap is three times the next block's base fee and the tip, but never
// less than 0.01 gwei and the tip: on the dev chain, whose base fee is a few thousand wei after a quiet spell, a
// payment presented again once the base fee fell by half was refused for a fee cap 7104 wei above the bound (the
// money-invariant run's sponsored-approval lane: honest-payment-never-refused).
func TestASponsoredApprovalsFeeCapBoundKeepsASlackWhereTheBaseFeeIsTiny(t *testing.T) {
	tip := big.NewInt(params.GWei)
	cases := []struct {
		name             string
		nextBase, feeCap int64
		within           bool
	}{
		{"signed at twice a base fee since fallen by half, of a few thousand wei", 1776, 2*3552 + params.GWei, true},
		{"three times a base fee of 1 gwei and the tip", params.GWei, 3*params.GWei + params.GWei, true},
		{"above three times a base fee of 1 gwei and the tip", params.GWei, 3*params.GWei + params.GWei + 1, false},
		{"the slack and the tip, at a tiny base fee", 7, 10_000_000 + params.GWei, true},
		{"above the slack and the tip, at a tiny base fee", 7, 10_000_000 + params.GWei + 1, false},
		{"ten gwei at a tiny base fee", 7, 10 * params.GWei, false},
	}
	for _, tc := range cases {
		bound := approvalFeeCapBound(big.NewInt(tc.nextBase), tip)
		if within := big.NewInt(tc.feeCap).Cmp(bound) <= 0; within != tc.within {
			t.Errorf("%s: fee cap %d within the bound %s = %v, want %v", tc.name, tc.feeCap, bound, within, tc.within)
		}
	}
}
