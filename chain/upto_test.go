package chain_test

import (
	"context"
	"math/big"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// uptoRequirements is what a gate offers for an upto payment of at most price, naming wallet as the facilitator.
func (fx *fixture) uptoRequirements(wallet common.Address) x402.PaymentRequirements {
	rq := fx.requirements(x402.TransferPermit2)
	rq.Scheme = x402.SchemeUpto
	rq.Extra.FacilitatorAddress = wallet.Hex()
	return rq
}

// upto signs an upto payment of payer of at most price, naming the pool's second wallet (not the one an
// unnamed settlement would pick first) as the facilitator.
func (fx *fixture) upto(payer *chaintest.Account) x402.VerifyRequest {
	fx.t.Helper()
	return fx.permit2(payer, fx.uptoRequirements(fx.c.Wallets[1].Address), chain.Permit2Options{})
}

// settleFor is req presented for settlement of amount: the requirements carry the amount to settle, the payload
// stays as signed.
func settleFor(req x402.VerifyRequest, amount int64) x402.VerifyRequest {
	req.PaymentRequirements.Amount = big.NewInt(amount).String()
	return req
}

// walletTxs is how many transactions each settlement wallet has sent.
func (fx *fixture) walletTxs() []uint64 {
	out := make([]uint64, len(fx.c.Wallets))
	for i, w := range fx.c.Wallets {
		out[i] = fx.c.TxCount(w.Address)
	}
	return out
}

// sentSince is how many transactions the wallets sent since before, and from which wallets.
func (fx *fixture) sentSince(before []uint64) (total int, from []common.Address) {
	for i, n := range fx.walletTxs() {
		if d := int(n - before[i]); d > 0 {
			total += d
			from = append(from, fx.c.Wallets[i].Address)
		}
	}
	return total, from
}

func TestAnUptoPaymentVerifiesAtItsMaximum(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.upto(payer)
	if a := req.PaymentPayload.Payload.Permit2Authorization; a.Spender != contracts.UptoProxyAddress.Hex() || a.Witness.Facilitator != fx.c.Wallets[1].Address.Hex() {
		t.Fatalf("signed authorization %+v, want the upto proxy as spender and wallet 1 as facilitator", a)
	}
	if v := fx.verify(req); !v.IsValid || v.Payer != payer.Address.Hex() {
		t.Fatalf("verify = %+v, want valid for %s", v, payer.Address.Hex())
	}
}

func TestUptoPaymentsTheFacilitatorWouldNotSettleAreRefusedByVerify(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	stranger := common.HexToAddress("0x00000000000000000000000000000000000bad01")
	tests := []struct {
		name, reason, message string
		build                 func() x402.VerifyRequest
	}{{
		name: "a witness facilitator that is not one of our wallets", reason: x402.ReasonUptoFacilitatorMismatch, message: fx.c.Wallets[0].Address.Hex(),
		build: func() x402.VerifyRequest {
			return fx.permit2(payer, fx.uptoRequirements(stranger), chain.Permit2Options{})
		},
	}, {
		name: "the exact proxy as spender", reason: x402.ReasonPermit2InvalidSpender, message: contracts.UptoProxyAddress.Hex(),
		build: func() x402.VerifyRequest {
			return fx.permit2(payer, fx.uptoRequirements(fx.c.Wallets[1].Address), chain.Permit2Options{Proxy: contracts.ProxyAddress})
		},
	}, {
		name: "a permitted amount other than the required one", reason: x402.ReasonPermit2AmountMismatch, message: "verified at its maximum",
		build: func() x402.VerifyRequest { return settleFor(fx.upto(payer), price/2) },
	}, {
		name: "a signature over other values", reason: x402.ReasonPermit2InvalidSignature, message: "upto witness",
		build: func() x402.VerifyRequest {
			req := fx.upto(payer)
			a := *req.PaymentPayload.Payload.Permit2Authorization
			a.Nonce = "1"
			req.PaymentPayload.Payload.Permit2Authorization = &a
			return req
		},
	}, {
		name: "an exact witness presented as upto", reason: x402.ReasonInvalidPayload, message: "witness.facilitator is missing",
		build: func() x402.VerifyRequest {
			req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{Proxy: contracts.UptoProxyAddress})
			req.PaymentRequirements.Scheme, req.PaymentPayload.Accepted.Scheme = x402.SchemeUpto, x402.SchemeUpto
			return req
		},
	}, {
		name: "an upto witness presented as exact", reason: x402.ReasonInvalidPayload, message: "upto witness",
		build: func() x402.VerifyRequest {
			req := fx.upto(payer)
			req.PaymentRequirements.Scheme, req.PaymentPayload.Accepted.Scheme = x402.SchemeExact, x402.SchemeExact
			return req
		},
	}, {
		name: "upto by another transfer method", reason: x402.ReasonInvalidPaymentRequirements, message: "permit2 only",
		build: func() x402.VerifyRequest {
			req := fx.upto(payer)
			req.PaymentRequirements.Extra.AssetTransferMethod = x402.TransferERC2612
			return req
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := fx.verify(tt.build())
			if v.IsValid || v.InvalidReason != tt.reason || !strings.Contains(v.InvalidMessage, tt.message) {
				t.Fatalf("verify = %+v, want reason %s with a message mentioning %q", v, tt.reason, tt.message)
			}
		})
	}
}

func TestAnUptoSettlementOfLessThanTheMaximumMovesExactlyThatFromTheNamedWallet(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	before, sellerBefore, txsBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo), fx.walletTxs()
	req := fx.upto(payer)
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v, want valid", v)
	}

	s := fx.settle(settleFor(req, 2_500))
	if !s.Success || s.Transaction == "" || s.Amount != "2500" || s.Payer != payer.Address.Hex() {
		t.Fatalf("settle = %+v, want success with a transaction and amount 2500", s)
	}
	if got := new(big.Int).Sub(before, fx.c.TokenBalance(payer.Address)); got.Int64() != 2_500 {
		t.Errorf("payer paid %s, want 2500", got)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != 2_500 {
		t.Errorf("seller received %s, want 2500", got)
	}
	n, from := fx.sentSince(txsBefore)
	if n != 1 || len(from) != 1 || from[0] != fx.c.Wallets[1].Address {
		t.Errorf("%d transactions sent, from %v; want one, from the witness's facilitator %s", n, from, fx.c.Wallets[1].Address.Hex())
	}
	tx, _, err := fx.c.Client.TransactionByHash(context.Background(), common.HexToHash(s.Transaction))
	if err != nil {
		t.Fatal(err)
	}
	if sender, err := types.Sender(fx.c.Signer, tx); err != nil || sender != fx.c.Wallets[1].Address || *tx.To() != contracts.UptoProxyAddress {
		t.Errorf("the settlement went from %s (%v) to %s, want from %s to the upto proxy", sender.Hex(), err, tx.To().Hex(), fx.c.Wallets[1].Address.Hex())
	}
	if again := fx.settle(settleFor(req, 2_500)); !reflect.DeepEqual(again, s) {
		t.Errorf("settling the same request again = %+v, want the first answer %+v", again, s)
	}
	if n, _ := fx.sentSince(txsBefore); n != 1 {
		t.Errorf("%d transactions after a retry, want 1", n)
	}
}

func TestAnUptoSettlementOfTheMaximumMovesTheMaximum(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	s := fx.settle(fx.upto(payer))
	if !s.Success || s.Amount != "10000" {
		t.Fatalf("settle = %+v, want success for 10000", s)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != price {
		t.Errorf("seller received %s, want %d", got, price)
	}
}

func TestAnUptoSettlementOfZeroSendsNothingAndSettlesThePaymentOnce(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.upto(payer)
	before, txsBefore := fx.c.TokenBalance(payer.Address), fx.walletTxs()

	s := fx.settle(settleFor(req, 0))
	want := x402.SettleResponse{Success: true, Network: fx.net, Payer: payer.Address.Hex(), Amount: "0"}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("settle of 0 = %+v, want %+v", s, want)
	}
	if again := fx.settle(settleFor(req, 0)); !reflect.DeepEqual(again, want) {
		t.Errorf("settling it again = %+v, want the same answer", again)
	}
	more := fx.settle(settleFor(req, 100))
	if more.Success || more.ErrorReason != x402.ReasonPermit2InvalidNonce || more.Transaction != "" {
		t.Errorf("the same payload settled for 100 after 0 = %+v, want refused as %s", more, x402.ReasonPermit2InvalidNonce)
	}
	if n, _ := fx.sentSince(txsBefore); n != 0 {
		t.Errorf("%d transactions sent, want none", n)
	}
	if got := fx.c.TokenBalance(payer.Address); got.Cmp(before) != 0 {
		t.Errorf("payer holds %s, want %s untouched", got, before)
	}
	auth := req.PaymentPayload.Payload.Permit2Authorization
	nonce, _ := new(big.Int).SetString(auth.Nonce, 10)
	if fx.c.Permit2NonceUsed(payer.Address, nonce) {
		t.Error("a settlement of zero spent the payer's Permit2 nonce on chain")
	}
}

func TestAnUptoSettlementAboveThePermittedMaximumIsRefusedAndSendsNothing(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.upto(payer)
	txsBefore := fx.walletTxs()
	s := fx.settle(settleFor(req, price+1))
	if s.Success || s.ErrorReason != x402.ReasonUptoSettlementExceedsAmount || s.Transaction != "" {
		t.Fatalf("settle above the maximum = %+v, want %s", s, x402.ReasonUptoSettlementExceedsAmount)
	}
	if n, _ := fx.sentSince(txsBefore); n != 0 {
		t.Errorf("%d transactions sent, want none", n)
	}
	// Nothing was claimed: the payment still settles for what it permits.
	if s := fx.settle(settleFor(req, price)); !s.Success {
		t.Errorf("settling the maximum afterwards = %+v, want success", s)
	}
}

func TestTheSameUptoSettlementTwiceAtOnceSendsOneTransaction(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := settleFor(fx.upto(payer), 4_000)
	txsBefore := fx.walletTxs()
	var wg sync.WaitGroup
	answers := make([]x402.SettleResponse, 2)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := fx.f.Settle(context.Background(), req)
			if err != nil {
				t.Error(err)
			}
			answers[i] = resp
		}()
	}
	wg.Wait()
	if !answers[0].Success || !reflect.DeepEqual(answers[0], answers[1]) {
		t.Fatalf("answers %+v and %+v, want one success shared", answers[0], answers[1])
	}
	if n, _ := fx.sentSince(txsBefore); n != 1 {
		t.Errorf("%d transactions sent, want 1", n)
	}
	if n := fx.c.CountTokenTransfers(payer.Address, fx.payTo); n != 1 {
		t.Errorf("%d transfers to the seller, want 1", n)
	}
}

func TestAnUptoPaymentHeldAtItsMaximumAndSettledForZeroFreesThePayersFunds(t *testing.T) {
	// The payer holds 1.5 payments' worth: the upto payment held at its maximum leaves too little for another.
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(price * 3 / 2))}})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	held := fx.upto(payer)
	if v, err := fx.f.VerifyAndHold(context.Background(), held); err != nil || !v.IsValid {
		t.Fatalf("verify and hold = %+v, %v; want valid", v, err)
	}
	other := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if v := fx.verify(other); v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
		t.Fatalf("verify of another payment beside the held maximum = %+v, want %s", v, x402.ReasonInsufficientFunds)
	}
	if s := fx.settle(settleFor(held, 0)); !s.Success {
		t.Fatalf("settle of 0 = %+v, want success", s)
	}
	if v := fx.verify(other); !v.IsValid {
		t.Errorf("verify of the other payment once the upto payment settled for nothing = %+v, want valid", v)
	}
}

func TestAnUptoPaymentOfAPayerWithoutAllowancePaysThroughTheGasSponsoringPermitOfItsMaximum(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.PayerNoGas
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	req := fx.upto(payer)
	if err := chain.AddGasSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, "Stable Coin", "1", fx.c.TokenNonce(payer.Address)); err != nil {
		t.Fatal(err)
	}
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v, want valid", v)
	}
	s := fx.settle(settleFor(req, 3_000))
	if !s.Success || s.Amount != "3000" {
		t.Fatalf("settle = %+v, want success for 3000", s)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != 3_000 {
		t.Errorf("seller received %s, want 3000", got)
	}
	if got := fx.c.Allowance(payer.Address, fx.permit2Address()); got.Int64() != price-3_000 {
		t.Errorf("Permit2 allowance left %s, want %d: the permit approves the maximum", got, price-3_000)
	}
}

func TestSupportedListsTheUptoKindNamingAPoolWallet(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	resp, err := fx.f.Supported(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	kind, ok := resp.SchemeKind(x402.Version2, x402.SchemeUpto, fx.net, x402.TransferPermit2)
	if !ok {
		t.Fatalf("no upto kind in %+v", resp.Kinds)
	}
	e := kind.Extra
	if e.FacilitatorAddress != fx.c.Wallets[0].Address.Hex() || e.X402Permit2ProxyAddress != contracts.UptoProxyAddress.Hex() ||
		e.Permit2Address != contracts.Permit2Address.Hex() || e.AssetTransferMethod != x402.TransferPermit2 || e.Name != "Stable Coin" || e.Version != "1" {
		t.Errorf("upto kind extra %+v, want the first wallet %s, the upto proxy and Permit2", e, fx.c.Wallets[0].Address.Hex())
	}
	if exact, ok := resp.SchemeKind(x402.Version2, x402.SchemeExact, fx.net, x402.TransferPermit2); !ok || exact.Extra.X402Permit2ProxyAddress != contracts.ProxyAddress.Hex() || exact.Extra.FacilitatorAddress != "" {
		t.Errorf("exact permit2 kind %+v, want the exact proxy and no facilitator", exact)
	}
}

func TestAnUptoPaymentSignedHereRecoversUnderTheTypeScriptClientsTypes(t *testing.T) {
	fx := newFixture(t, fixtureOpts{autoCommit: -1})
	payer := fx.c.Payers[0]
	req := fx.upto(payer)
	a := req.PaymentPayload.Payload.Permit2Authorization
	// chaintest.UptoWitnessTypedData carries the type definitions of @x402/evm 2.27's uptoPermit2WitnessTypes.
	td := chaintest.UptoWitnessTypedData(fx.c.ChainID, contracts.Permit2Address, a.Permitted.Token, a.Permitted.Amount, a.Spender,
		a.Nonce, a.Deadline, a.Witness.To, a.Witness.Facilitator, a.Witness.ValidAfter)
	hash, _, err := apitypes.TypedDataAndHash(td)
	if err != nil {
		t.Fatal(err)
	}
	sig := common.FromHex(req.PaymentPayload.Payload.Signature)
	sig[64] -= 27
	pub, err := crypto.SigToPub(hash, sig)
	if err != nil || crypto.PubkeyToAddress(*pub) != payer.Address {
		t.Fatalf("the signature recovers %v (%v) under apitypes, want the payer %s", pub, err, payer.Address.Hex())
	}
}

// A broadcast upto settlement whose receipt is not seen in time is journalled with its request: an engine that
// restarts on the same journal re-reads that request (the amount to settle, not the maximum) and answers from
// the chain, and nothing is sent twice.
func TestAnUptoSettlementPendingAcrossARestartSettlesOnceForItsAmount(t *testing.T) {
	store := journal.NewMemory(journal.Options{})
	fx := newFixture(t, fixtureOpts{journal: store, autoCommit: -1, receiptTimeout: 200 * time.Millisecond})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	fx.c.Commit()
	sellerBefore, txsBefore := fx.c.TokenBalance(fx.payTo), fx.walletTxs()
	req := settleFor(fx.upto(payer), 1_500)
	s := fx.settle(req)
	if !s.Pending() || s.Amount != "1500" {
		t.Fatalf("settle with no block sealed = %+v, want settlement_pending for 1500 with the transaction", s)
	}
	fx.f.Close()

	again, err := chain.New(context.Background(), chain.Config{Journal: store, Networks: []chain.NetworkConfig{{
		Network: fx.net, Backend: fx.c.Client, ReceiptTimeout: 5 * time.Second, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		Keys:   chaintestKeys(fx.c),
	}}})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	stop := fx.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	final, err := again.Settle(context.Background(), req)
	if err != nil || !final.Success || final.Transaction != s.Transaction || final.Amount != "1500" {
		t.Fatalf("after the restart the payment answered %+v, %v; want settled for 1500 by %s", final, err, s.Transaction)
	}
	if n, _ := fx.sentSince(txsBefore); n != 1 {
		t.Errorf("%d transactions sent, want 1", n)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != 1_500 {
		t.Errorf("seller received %s, want 1500", got)
	}
}

// With a shared journal a wallet sends only from the process holding its lease: an upto payment naming a wallet
// another engine holds, settled on this one, is handed to the engine holding it and settles from that wallet
// (it used to be refused as busy, no_available_wallets); settled again on the holder, it answers the same.
// Each engine's upto kind names a wallet it holds.
func TestAnUptoPaymentSettlesOnlyOnTheEngineHoldingTheNamedWalletsLease(t *testing.T) {
	fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 2, 2*time.Second, fixtureOpts{wallets: 4, receiptTimeout: time.Minute,
		tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.WalletWait = 200 * time.Millisecond }})
	waitLeases(t, fx, engines, 2, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	for i, f := range engines {
		resp, err := f.Supported(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		kind, ok := resp.SchemeKind(x402.Version2, x402.SchemeUpto, fx.net, x402.TransferPermit2)
		if !ok || kind.Extra.FacilitatorAddress != f.LeasedWallets(fx.net)[0].Hex() {
			t.Errorf("engine %d's upto kind %+v, want it to name the first wallet it holds, %s", i, kind, f.LeasedWallets(fx.net)[0].Hex())
		}
	}
	named := engines[1].LeasedWallets(fx.net)[0]
	req := fx.permit2(payer, fx.uptoRequirements(named), chain.Permit2Options{})
	txsBefore := fx.walletTxs()
	handed, err := engines[0].Settle(context.Background(), req)
	if err != nil || !handed.Success {
		t.Fatalf("settle on the engine without the named wallet's lease = %+v, %v; want settled by the engine holding it", handed, err)
	}
	settled, err := engines[1].Settle(context.Background(), req)
	if err != nil || !settled.Success || settled.Transaction != handed.Transaction {
		t.Fatalf("settle on the engine holding the named wallet = %+v, %v; want the same settlement, %s", settled, err, handed.Transaction)
	}
	if _, from := fx.sentSince(txsBefore); len(from) != 1 || from[0] != named {
		t.Errorf("sent from %v, want from %s", from, named.Hex())
	}
}

// What the configuration alone says the engine supports (for offers while its chain does not answer) is what the
// engine says once up, less what names a settlement wallet (no upto kind, no signers) and what only the chain says
// (the batch-settlement kind, listed where the escrow is deployed).
func TestConfiguredSupportedIsTheEnginesLessWhatNamesAWallet(t *testing.T) {
	var nc chain.NetworkConfig
	fx := newFixture(t, fixtureOpts{tune: func(_ *fixture, c *chain.NetworkConfig) { nc = *c }})
	up, err := fx.f.Supported(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	nc.Backend, nc.Keys = nil, nil
	offline, err := chain.ConfiguredSupported([]chain.NetworkConfig{nc})
	if err != nil {
		t.Fatal(err)
	}
	var want []x402.SupportedKind
	for _, k := range up.Kinds {
		if k.Scheme != x402.SchemeUpto && k.Scheme != x402.SchemeBatchSettlement {
			want = append(want, k)
		}
	}
	if !reflect.DeepEqual(offline.Kinds, want) || !reflect.DeepEqual(offline.Extensions, up.Extensions) || len(offline.Signers) != 0 {
		t.Errorf("configured: %+v\nengine less upto and signers: kinds %+v extensions %v", offline, want, up.Extensions)
	}
	if _, err := chain.ConfiguredSupported([]chain.NetworkConfig{{Network: fx.net, Methods: []string{"wire"}, Assets: nc.Assets}}); err == nil {
		t.Error("an unknown transfer method was taken")
	}
}
