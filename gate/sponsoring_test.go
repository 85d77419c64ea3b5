package gate_test

import (
	"context"
	"math/big"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
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

// TestAGasSponsoringExtensionTheRouteDoesNotDeclareIsNotPassedToTheFacilitator: gas_sponsoring says what a route
// sponsors, not only what its 402 offers. A payer without a Permit2 allowance or gas that attaches its own
// approval (erc20ApprovalGasSponsoring) is paid through it on a route that declares it; on a route whose operator
// turned it off, the extension is withheld from the facilitator, which takes it (its network sponsors approvals)
// and would otherwise fund the payer's gas and send its approval anyway: the payment is refused for the allowance
// it lacks, and nothing is sent, no gas money and no approval.
func TestAGasSponsoringExtensionTheRouteDoesNotDeclareIsNotPassedToTheFacilitator(t *testing.T) {
	for _, tc := range []struct {
		name     string
		declared []string
		paid     bool
	}{
		{"declared", []string{x402.ExtensionERC20ApprovalGasSponsoring}, true},
		{"off", []string{}, false},
		{"eip2612 only", []string{x402.ExtensionEIP2612GasSponsoring}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := chaintest.New(t, chaintest.WithPayersNoGas(1), chaintest.WithPromptCommit())
			t.Cleanup(c.AutoCommit(5 * time.Millisecond))
			e := newEnv(t, setup{chain: c,
				network: func(nc *chain.NetworkConfig) { nc.ApprovalSponsoring = &chain.ApprovalSponsoring{} },
				config:  func(cfg *gate.Config) { cfg.GasSponsoring = tc.declared },
			})
			payer := c.PayerNoGas
			rq := e.offer()
			p, err := chain.SignPermit2Payment(payer.Key, rq, c.ChainID, chain.Permit2Options{Now: time.Unix(int64(c.HeadTime()), 0)})
			if err != nil {
				t.Fatal(err)
			}
			head, err := c.Client.HeaderByNumber(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			tip := big.NewInt(1_000_000_000)
			fees := chain.ApprovalTx{Gas: 70_000, TipCap: tip, FeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)}
			if err := chain.AddApprovalSponsoring(&p, payer.Key, c.ChainID, fees); err != nil {
				t.Fatal(err)
			}
			h, err := x402.EncodeHeader(p)
			if err != nil {
				t.Fatal(err)
			}
			walletTxs := c.TxCount(c.Wallets[0].Address) + c.TxCount(c.Wallets[1].Address)

			a := e.get(x402.HeaderPaymentSignature, h)
			sent := c.TxCount(c.Wallets[0].Address) + c.TxCount(c.Wallets[1].Address) - walletTxs
			if tc.paid {
				if a.status != http.StatusOK || sent != 2 || c.TxCount(payer.Address) != 1 {
					t.Fatalf("a payment through its approval on a route declaring it = %d %q, the wallets sent %d, the payer %d; want 200, 2 (gas money, settlement) and 1 (its approval)",
						a.status, a.body, sent, c.TxCount(payer.Address))
				}
				return
			}
			pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if a.status != http.StatusPaymentRequired || !strings.HasPrefix(pr.Error, x402.ReasonPermit2AllowanceRequired) {
				t.Errorf("a payment through its approval on a route not declaring it = %d (%s); want 402 %s", a.status, pr.Error, x402.ReasonPermit2AllowanceRequired)
			}
			if sent != 0 || c.TxCount(payer.Address) != 0 || c.ETHBalance(payer.Address).Sign() != 0 || e.served.Load() != 0 {
				t.Errorf("the wallets sent %d transactions, the payer %d, and hold %s wei; the upstream ran %d times: want nothing sent, funded or served",
					sent, c.TxCount(payer.Address), c.ETHBalance(payer.Address), e.served.Load())
			}
		})
	}
}
