package chain_test

import (
	"math/big"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An erc2612 payment spends its signed permit even when an approval the payer gave the spender already covers
// it. Left unspent, the permit's token nonce stays the payer's next: the payer's next payment, signed with
// nonces(owner) as the protocol says, would carry the same nonce and be refused as reused, and the old permit
// could be submitted later by anyone to reset the allowance.
func TestAnERC2612PaymentSpendsItsPermitEvenWhenAnApprovalCoversIt(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	rq := fx.requirements(x402.TransferERC2612)
	fx.c.Approve(payer, fx.c.Wallets[0].Address, big.NewInt(1e15)) // the spender is the first wallet
	payerBefore, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	nonceBefore := fx.c.TokenNonce(payer.Address)

	first := fx.erc2612(payer, rq, chain.ERC2612Options{})
	if a := fx.settle(first); !a.Success {
		t.Fatalf("the first payment = %+v; want settled", a)
	}
	if got := fx.c.TokenNonce(payer.Address); got.Cmp(new(big.Int).Add(nonceBefore, big.NewInt(1))) != 0 {
		t.Fatalf("the payer's token nonce is %s after the settlement, want %s: the signed permit was not spent", got, new(big.Int).Add(nonceBefore, big.NewInt(1)))
	}
	second := fx.erc2612(payer, rq, chain.ERC2612Options{})
	if a := fx.settle(second); !a.Success {
		t.Fatalf("the payer's next payment, signed with nonces(owner) = %+v; want settled", a)
	}
	assertMoved(t, fx, payer.Address, payerBefore, sellerBefore, 2)
}
