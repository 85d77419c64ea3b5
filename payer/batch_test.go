package payer_test

import (
	"context"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchOffer is a version 2 offer of one exact requirement paid by method, of 10000 raw units of token.
func batchOffer(method, token string) payer.Offer {
	return payer.Offer{Version: x402.Version2, Required: x402.PaymentRequired{
		X402Version: x402.Version2,
		Resource:    x402.ResourceInfo{URL: "http://127.0.0.1/report"},
		Accepts: []x402.PaymentRequirements{{Scheme: x402.SchemeExact, Network: testNetwork, Amount: "10000", Asset: token,
			PayTo: testPayTo, MaxTimeoutSeconds: 60,
			Extra: x402.Extra{Name: "Stable Coin", Version: "1", AssetTransferMethod: method, Spender: testPayTo}}},
	}}
}

func TestSignBatchSignsDistinctPaymentsEachWithANonceOfItsOwn(t *testing.T) {
	p := newPayer(t)
	for _, method := range []string{x402.TransferPermit2, x402.TransferEIP3009} {
		pays, err := p.SignBatch(context.Background(), batchOffer(method, testToken), 0, 50)
		if err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		if len(pays) != 50 {
			t.Fatalf("%s: %d payments, want 50", method, len(pays))
		}
		nonces, values := map[string]bool{}, map[string]bool{}
		for _, pay := range pays {
			_, nonce := pay.Payload.Payload.PayerAndNonce()
			if nonce == "" || pay.Header != x402.HeaderPaymentSignature || pay.Method != method || pay.GasSponsored {
				t.Fatalf("%s: payment %+v, want a signed %s payment with a nonce, not sponsored", method, pay, method)
			}
			nonces[nonce], values[pay.Value] = true, true
		}
		if len(nonces) != 50 || len(values) != 50 {
			t.Errorf("%s: %d distinct nonces and %d distinct header values in 50 payments, want 50 of each", method, len(nonces), len(values))
		}
	}
}

func TestSignBatchRefusesErc2612WhosePermitsTakeTheTokenNoncesInTurn(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	_, err = p.SignBatch(context.Background(), batchOffer(x402.TransferERC2612, c.Token.Hex()), 0, 2)
	if err == nil || !strings.Contains(err.Error(), "erc2612") || !strings.Contains(err.Error(), "nonces") {
		t.Fatalf("signing a batch of erc2612 payments: %v; want a refusal naming erc2612 and the token's nonces", err)
	}
}

func TestApprovePermit2RaisesTheAllowanceThatPermit2AllowanceReads(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	defer c.AutoCommit(5 * time.Millisecond)()
	from := c.Payers[0]
	p, err := payer.New(from.Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req := batchOffer(x402.TransferPermit2, c.Token.Hex()).Required.Accepts[0]

	if a, err := p.Permit2Allowance(ctx, req); err != nil || a.Sign() != 0 {
		t.Fatalf("the allowance before approving: %v (%v), want 0", a, err)
	}
	if _, err := p.ApprovePermit2(ctx, req, big.NewInt(123_456)); err != nil {
		t.Fatalf("approving Permit2: %v", err)
	}
	if a, err := p.Permit2Allowance(ctx, req); err != nil || a.Int64() != 123_456 {
		t.Errorf("the allowance after approving 123456: %v (%v)", a, err)
	}
	if a, err := chain.CallTokenUint(ctx, c.Client, c.Token, "allowance", from.Address, contracts.Permit2Address); err != nil || a.Int64() != 123_456 {
		t.Errorf("the chain says the allowance is %v (%v), want 123456", a, err)
	}
	b, err := p.TokenBalance(ctx, c.Token, from.Address)
	if err != nil || b.Cmp(big.NewInt(chaintest.DefaultTokenBalance)) != 0 {
		t.Errorf("the payer's balance reads %v (%v), want the %d minted", b, err, chaintest.DefaultTokenBalance)
	}
}

func TestTheChainReadersNeedAnRPC(t *testing.T) {
	p := newPayer(t)
	req := batchOffer(x402.TransferPermit2, testToken).Required.Accepts[0]
	if _, err := p.Permit2Allowance(context.Background(), req); err == nil || !strings.Contains(err.Error(), "RPC") {
		t.Errorf("Permit2Allowance without an RPC: %v, want an error naming the RPC", err)
	}
}
