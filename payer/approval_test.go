package payer_test

import (
	"context"
	"encoding/json"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payer with no Permit2 allowance and no gas signs what the server declares, as the public SDK decides: its own
// approval of Permit2 where only erc20ApprovalGasSponsoring is declared (which an engine taking it funds, mines
// and settles after), the EIP-2612 permit where eip2612GasSponsoring is declared too and the token has one.
func TestAPayerWithoutAllowanceSignsItsOwnApprovalWhereTheServerDeclaresOnlyApprovalSponsoring(t *testing.T) {
	ctx := context.Background()
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayersNoGas(2))
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	network := x402.EIP155(c.ChainID.Uint64())
	nc := chain.NetworkConfig{Network: network, Backend: c.EthClient, ReceiptPoll: 2 * time.Millisecond,
		Assets:             []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		ApprovalSponsoring: &chain.ApprovalSponsoring{}}
	for _, w := range c.Wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(ctx, chain.Config{Networks: []chain.NetworkConfig{nc}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	declared := json.RawMessage(`{"info":{"description":"declared by the server","version":"1"},"schema":{"type":"object"}}`)
	offer := func(extensions ...string) payer.Offer {
		o := payer.Offer{Version: x402.Version2, Required: x402.PaymentRequired{X402Version: x402.Version2,
			Resource: x402.ResourceInfo{URL: "http://127.0.0.1/report"},
			Accepts: []x402.PaymentRequirements{{Scheme: x402.SchemeExact, Network: network, Amount: "10000", Asset: c.Token.Hex(),
				PayTo: testPayTo, MaxTimeoutSeconds: 60, Extra: x402.Extra{Name: "Stable Coin", Version: "1", AssetTransferMethod: x402.TransferPermit2}}},
			Extensions: map[string]json.RawMessage{}}}
		for _, e := range extensions {
			o.Required.Extensions[e] = declared
		}
		return o
	}
	for i, tc := range []struct {
		name              string
		offer             payer.Offer
		approval, sponsor bool
	}{
		{"only approval sponsoring declared", offer(x402.ExtensionERC20ApprovalGasSponsoring), true, false},
		{"both declared, the token has a permit", offer(x402.ExtensionERC20ApprovalGasSponsoring, x402.ExtensionEIP2612GasSponsoring), false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			who := c.PayersNoGas[i]
			p, err := payer.New(who.Key, payer.Options{RPC: c.RPCURL})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			pay, err := p.Sign(ctx, tc.offer, 0)
			if err != nil {
				t.Fatal(err)
			}
			if pay.ApprovalSponsored != tc.approval || pay.GasSponsored != tc.sponsor {
				t.Fatalf("payment: approval sponsored %v, gas sponsored %v; want %v, %v", pay.ApprovalSponsored, pay.GasSponsored, tc.approval, tc.sponsor)
			}
			before := c.TokenBalance(who.Address)
			s, err := f.Settle(ctx, x402.SettleRequest{X402Version: x402.Version2, PaymentPayload: pay.Payload, PaymentRequirements: tc.offer.Required.Accepts[0]})
			if err != nil || !s.Success {
				t.Fatalf("settle = %+v, %v; want success", s, err)
			}
			if got := new(big.Int).Sub(before, c.TokenBalance(who.Address)); got.Cmp(big.NewInt(10000)) != 0 {
				t.Fatalf("the payer paid %s, want 10000", got)
			}
			if c.Allowance(who.Address, contracts.Permit2Address).Sign() == 0 && tc.approval {
				t.Fatal("the payer's approval did not set its Permit2 allowance")
			}
			if got := c.TxCount(who.Address); got != map[bool]uint64{true: 1, false: 0}[tc.approval] {
				t.Fatalf("the payer sent %d transactions", got)
			}
		})
	}
}
