package gate_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A gate declares of its facilitator's gas-sponsoring extensions those gas_sponsoring names (all by default,
// none for an empty list): a payer without a Permit2 allowance signs its own approval where only
// erc20ApprovalGasSponsoring is declared, whether or not the token has a permit (as the public SDK decides).
func TestAGateDeclaresOnlyTheGasSponsoringExtensionsItIsConfiguredFor(t *testing.T) {
	both := []string{x402.ExtensionEIP2612GasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring}
	for _, tc := range []struct {
		name     string
		declared []string
		want     []string
	}{
		{"default", nil, both},
		{"approval only", []string{x402.ExtensionERC20ApprovalGasSponsoring}, []string{x402.ExtensionERC20ApprovalGasSponsoring}},
		{"permit only", []string{x402.ExtensionEIP2612GasSponsoring}, []string{x402.ExtensionEIP2612GasSponsoring}},
		{"none", []string{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, setup{
				network: func(nc *chain.NetworkConfig) { nc.ApprovalSponsoring = &chain.ApprovalSponsoring{} },
				config:  func(c *gate.Config) { c.GasSponsoring = tc.declared },
			})
			pr, err := x402.DecodePaymentRequired(e.get().header.Get(x402.HeaderPaymentRequired))
			if err != nil {
				t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
			}
			var got []string
			for _, n := range both {
				if pr.Extensions[n] != nil {
					got = append(got, n)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("the 402 declares %v, want %v", got, tc.want)
			}
		})
	}
}

func TestAGasSponsoringListNamingAnUnknownExtensionOrOneTwiceIsRefused(t *testing.T) {
	for _, tc := range []struct {
		names []string
		says  string
	}{
		{[]string{"eip3009GasSponsoring"}, `gas_sponsoring "eip3009GasSponsoring" is not a gas-sponsoring extension`},
		{[]string{x402.ExtensionERC20ApprovalGasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring}, `gas_sponsoring names "erc20ApprovalGasSponsoring" twice`},
	} {
		if err := gate.CheckGasSponsoring(tc.names); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("CheckGasSponsoring(%q) = %v, want %q", tc.names, err, tc.says)
		}
	}
}
