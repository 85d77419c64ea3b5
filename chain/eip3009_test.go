package chain_test

import (
	"context"
	"crypto/ecdsa"
	"math/big"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// usdcFixture is a facilitator that accepts the StableCoin (no EIP-3009) and a USDCoin (EIP-3009), which every
// payer holds perPayer raw units of.
type usdcFixture struct {
	*fixture
	usdc common.Address
}

func newUSDCFixture(t *testing.T, perPayer int64, o fixtureOpts) *usdcFixture {
	t.Helper()
	u := &usdcFixture{}
	tune := o.tune
	o.tune = func(fx *fixture, nc *chain.NetworkConfig) {
		u.usdc = fx.c.DeployUSDCoin(big.NewInt(perPayer))
		nc.Assets = append(nc.Assets, chain.AssetConfig{Address: u.usdc, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6})
		if tune != nil {
			tune(fx, nc)
		}
	}
	u.fixture = newFixture(t, o)
	return u
}

// eip3009Requirements is what a gate offers for an eip3009 payment in the USDCoin.
func (u *usdcFixture) eip3009Requirements() x402.PaymentRequirements {
	rq := u.requirements(x402.TransferEIP3009)
	rq.Asset = u.usdc.Hex()
	rq.Extra.Name, rq.Extra.Version = contracts.USDCoinName, contracts.USDCoinVersion
	return rq
}

// eip3009 signs an eip3009 payment of payer for rq, dated by chain time unless opts says otherwise.
func (u *usdcFixture) eip3009(payer *chaintest.Account, rq x402.PaymentRequirements, opts chain.EIP3009Options) x402.VerifyRequest {
	u.t.Helper()
	if opts.Now.IsZero() {
		opts.Now = u.chainNow()
	}
	p, err := chain.SignEIP3009Payment(payer.Key, rq, u.c.ChainID, opts)
	if err != nil {
		u.t.Fatalf("signing an eip3009 payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
}

func (u *usdcFixture) authorizationUsed(payer common.Address, nonce string) bool {
	u.t.Helper()
	data, err := contracts.USDCoinABI.Pack("authorizationState", payer, common.HexToHash(nonce))
	if err != nil {
		u.t.Fatal(err)
	}
	out, err := u.c.Call(context.Background(), common.Address{}, u.usdc, data)
	if err != nil {
		u.t.Fatalf("authorizationState: %v", err)
	}
	return new(big.Int).SetBytes(out).Sign() != 0
}

func sum(ns []uint64) (t uint64) {
	for _, n := range ns {
		t += n
	}
	return t
}

func TestAnEIP3009PaymentSettlesInOneTransactionMovingExactlyTheAmount(t *testing.T) {
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{})
	payer := u.c.Payers[0]
	before, sellerBefore := u.c.BalanceOf(u.usdc, payer.Address), u.c.BalanceOf(u.usdc, u.payTo)
	sent := sum(u.sentByWallets())

	req := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	if v := u.verify(req); !v.IsValid || v.Payer != payer.Address.Hex() {
		t.Fatalf("verify = %+v, want valid for %s", v, payer.Address.Hex())
	}
	s := u.settle(req)
	if !s.Success || !x402.IsTxHash(s.Transaction) || s.Payer != payer.Address.Hex() || s.Amount != req.PaymentRequirements.Amount {
		t.Fatalf("settle = %+v, want success with a transaction, the payer and the amount", s)
	}
	if got := new(big.Int).Sub(before, u.c.BalanceOf(u.usdc, payer.Address)); got.Int64() != price {
		t.Fatalf("payer's USDC fell by %s, want %d", got, price)
	}
	if got := new(big.Int).Sub(u.c.BalanceOf(u.usdc, u.payTo), sellerBefore); got.Int64() != price {
		t.Fatalf("seller's USDC rose by %s, want %d", got, price)
	}
	if n := sum(u.sentByWallets()) - sent; n != 1 {
		t.Fatalf("the settlement wallets sent %d transactions, want 1", n)
	}
	if !u.authorizationUsed(payer.Address, req.PaymentPayload.Payload.Authorization.Nonce) {
		t.Fatal("the token does not show the authorization's nonce as used")
	}
	// The same payment again: the journal's answer, nothing sent.
	if again := u.settle(req); !again.Success || again.Transaction != s.Transaction {
		t.Fatalf("the same payment settled again answered %+v, want the first answer %+v", again, s)
	}
	if v := u.verify(req); v.IsValid || v.InvalidReason != x402.ReasonNonceAlreadyUsed {
		t.Fatalf("verify of the settled payment = %+v, want %s", v, x402.ReasonNonceAlreadyUsed)
	}
	if n := sum(u.sentByWallets()) - sent; n != 1 {
		t.Fatalf("after the repeats the settlement wallets sent %d transactions, want 1", n)
	}
}

func TestOneEIP3009PaymentPresentedConcurrentlySendsOneTransaction(t *testing.T) {
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{})
	payer := u.c.Payers[1]
	sent := sum(u.sentByWallets())
	req := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	var wg sync.WaitGroup
	answers := make([]x402.SettleResponse, 6)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i], _ = u.f.Settle(context.Background(), req)
		}()
	}
	wg.Wait()
	for i, a := range answers {
		if !a.Success || a.Transaction != answers[0].Transaction {
			t.Fatalf("answer %d = %+v, want the one settlement %s", i, a, answers[0].Transaction)
		}
	}
	if n := sum(u.sentByWallets()) - sent; n != 1 {
		t.Fatalf("the settlement wallets sent %d transactions, want 1", n)
	}
}

// Every refusal names its reason as the public SDKs do, sends nothing and leaves no journal record.
func TestEIP3009PaymentsTheChainWouldNotSettleAreRefusedWithTheirReasonAndNothingSent(t *testing.T) {
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{})
	payer := u.c.Payers[2]
	spent := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	if s := u.settle(spent); !s.Success {
		t.Fatalf("settling the payment whose nonce later cases reuse: %+v", s)
	}
	broke := chaintest.DeriveAccount("eip3009-broke", 0)
	cases := []struct {
		name   string
		build  func() x402.VerifyRequest
		reason string
	}{
		{"signed by another key", func() x402.VerifyRequest {
			req := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
			other := u.eip3009(u.c.Payers[3], u.eip3009Requirements(), chain.EIP3009Options{Nonce: common.HexToHash(req.PaymentPayload.Payload.Authorization.Nonce)})
			req.PaymentPayload.Payload.Signature = other.PaymentPayload.Payload.Signature
			return req
		}, x402.ReasonEIP3009InvalidSignature},
		{"to another recipient", func() x402.VerifyRequest {
			rq := u.eip3009Requirements()
			elsewhere := rq
			elsewhere.PayTo = u.c.Payers[3].Address.Hex()
			req := u.eip3009(payer, elsewhere, chain.EIP3009Options{})
			req.PaymentRequirements, req.PaymentPayload.Accepted = rq, rq
			return req
		}, x402.ReasonEIP3009RecipientMismatch},
		{"for another value", func() x402.VerifyRequest {
			rq := u.eip3009Requirements()
			less := rq
			less.Amount = "9999"
			req := u.eip3009(payer, less, chain.EIP3009Options{})
			req.PaymentRequirements, req.PaymentPayload.Accepted = rq, rq
			return req
		}, x402.ReasonEIP3009AuthorizationValue},
		{"expiring within the margin", func() x402.VerifyRequest {
			return u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{ValidBefore: u.headPlus(2)})
		}, x402.ReasonValidBefore},
		{"not valid yet", func() x402.VerifyRequest {
			return u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{ValidAfter: u.headPlus(600)})
		}, x402.ReasonValidAfter},
		{"reusing a settled authorization's nonce", func() x402.VerifyRequest {
			a := spent.PaymentPayload.Payload.Authorization
			return u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{Nonce: common.HexToHash(a.Nonce), ValidBefore: u.headPlus(1800)})
		}, x402.ReasonNonceAlreadyUsed},
		{"from a payer without the funds", func() x402.VerifyRequest {
			return u.eip3009(broke, u.eip3009Requirements(), chain.EIP3009Options{})
		}, x402.ReasonEIP3009InsufficientBalance},
		{"in a token without EIP-3009", func() x402.VerifyRequest {
			rq := u.requirements(x402.TransferEIP3009) // the StableCoin: EIP-2612 only
			return u.eip3009(payer, rq, chain.EIP3009Options{})
		}, x402.ReasonEIP3009NotSupported},
		{"under another token name", func() x402.VerifyRequest {
			rq := u.eip3009Requirements()
			rq.Extra.Name = "USDC"
			return u.eip3009(payer, rq, chain.EIP3009Options{})
		}, x402.ReasonEIP3009TokenNameMismatch},
		{"under another domain version", func() x402.VerifyRequest {
			rq := u.eip3009Requirements()
			rq.Extra.Version = "1"
			return u.eip3009(payer, rq, chain.EIP3009Options{})
		}, x402.ReasonEIP3009TokenVersionMismatch},
		{"with a decimal nonce", func() x402.VerifyRequest {
			req := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
			req.PaymentPayload.Payload.Authorization.Nonce = "12345"
			return req
		}, x402.ReasonInvalidPayload},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := tc.build()
			sent := u.sentByWallets()
			v := u.verify(req)
			if v.IsValid || v.InvalidReason != tc.reason || v.InvalidMessage == "" {
				t.Fatalf("verify = %+v, want %s with a message", v, tc.reason)
			}
			s := u.settle(req)
			if s.Success || s.ErrorReason != tc.reason || s.Transaction != "" {
				t.Fatalf("settle = %+v, want %s and no transaction", s, tc.reason)
			}
			if got := u.sentByWallets(); sum(got) != sum(sent) {
				t.Fatalf("the settlement wallets sent %d transactions for a refused payment", sum(got)-sum(sent))
			}
			if a := req.PaymentPayload.Payload.Authorization; tc.reason != x402.ReasonNonceAlreadyUsed && x402.IsBytes32(a.Nonce) {
				id := journal.PaymentID(u.net, x402.TransferEIP3009, req.PaymentRequirements.Asset, common.HexToAddress(a.From).Hex(), common.HexToHash(a.Nonce).Hex())
				if _, ok, err := u.journal.Get(context.Background(), id); err != nil || ok {
					t.Fatalf("the journal holds a record of the refused payment (%v, %v)", ok, err)
				}
			}
		})
	}
}

// A gate that serves before it settles holds each payment against the payer's balance: a payer whose balance
// covers one payment is not served a second while the first waits to be settled.
func TestHeldEIP3009PaymentsCountAgainstThePayersBalance(t *testing.T) {
	u := newUSDCFixture(t, price, fixtureOpts{})
	payer := u.c.Payers[0]
	first := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	second := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	if v, err := u.f.VerifyAndHold(context.Background(), first); err != nil || !v.IsValid {
		t.Fatalf("holding the first payment: %+v, %v", v, err)
	}
	v, err := u.f.VerifyAndHold(context.Background(), second)
	if err != nil || v.IsValid || v.InvalidReason != x402.ReasonEIP3009InsufficientBalance {
		t.Fatalf("holding a second payment the balance does not cover = %+v, %v; want %s", v, err, x402.ReasonEIP3009InsufficientBalance)
	}
	u.f.Release(first)
	if v, err := u.f.VerifyAndHold(context.Background(), second); err != nil || !v.IsValid {
		t.Fatalf("once the first is let go, the second = %+v, %v; want valid", v, err)
	}
}

// A payment whose receipt is not seen in time answers settlement_pending; the engine that restarts on the
// same journal answers it from the chain, and nothing is sent twice.
func TestAnEIP3009SettlementPendingAcrossARestartSettlesOnce(t *testing.T) {
	store := journal.NewMemory(journal.Options{})
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{journal: store, autoCommit: -1, receiptTimeout: 200 * time.Millisecond})
	payer := u.c.Payers[1]
	sent := sum(u.sentByWallets())
	req := u.eip3009(payer, u.eip3009Requirements(), chain.EIP3009Options{})
	s := u.settle(req)
	if s.Success || s.ErrorReason != x402.ReasonSettlementPending || !x402.IsTxHash(s.Transaction) {
		t.Fatalf("settle with no block sealed = %+v, want settlement_pending with the transaction", s)
	}
	u.f.Close()

	again, err := chain.New(context.Background(), chain.Config{Journal: store, Networks: []chain.NetworkConfig{{
		Network: u.net, Backend: u.c.Client, ReceiptTimeout: 5 * time.Second, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: u.usdc, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		Keys:   chaintestKeys(u.c),
	}}})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	stop := u.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	final, err := again.Settle(context.Background(), req)
	if err != nil || !final.Success || final.Transaction != s.Transaction {
		t.Fatalf("after the restart the payment answered %+v, %v; want settled by %s", final, err, s.Transaction)
	}
	if n := sum(u.sentByWallets()) - sent; n != 1 {
		t.Fatalf("the settlement wallets sent %d transactions, want 1", n)
	}
}

func chaintestKeys(c *chaintest.Chain) (keys []*ecdsa.PrivateKey) {
	for _, w := range c.Wallets {
		keys = append(keys, w.Key)
	}
	return keys
}
