package chain_test

import (
	"context"
	"math/big"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

func TestAPermit2PaymentVerifiesAndSettlesMovingExactlyTheAmount(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)

	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if v := fx.verify(req); !v.IsValid || v.Payer != payer.Address.Hex() {
		t.Fatalf("verify = %+v, want valid for %s", v, payer.Address.Hex())
	}
	s := fx.settle(req)
	if !s.Success || s.Transaction == "" || s.Network != fx.net || s.Payer != payer.Address.Hex() {
		t.Fatalf("settle = %+v, want success with a transaction on %s", s, fx.net)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if n := len(fx.c.TransfersInTx(common.HexToHash(s.Transaction))); n != 1 {
		t.Fatalf("the settlement transaction holds %d token transfers, want 1", n)
	}
}

func TestAnERC2612PaymentVerifiesAndSettlesMovingExactlyTheAmount(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[1]
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	wallet := fx.c.Wallets[0].Address
	walletTxs := fx.c.TxCount(wallet)

	req := fx.erc2612(payer, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{})
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v, want valid", v)
	}
	s := fx.settle(req)
	if !s.Success || s.Transaction == "" {
		t.Fatalf("settle = %+v, want success", s)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if got := fx.c.TxCount(wallet) - walletTxs; got != 2 {
		t.Fatalf("the spender wallet sent %d transactions, want 2 (permit, transferFrom)", got)
	}
}

func TestAPayerWithoutPermit2AllowanceOrGasPaysThroughTheGasSponsoringPermit(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.PayerNoGas
	if fx.c.ETHBalance(payer.Address).Sign() != 0 || fx.c.Allowance(payer.Address, fx.permit2Address()).Sign() != 0 {
		t.Fatal("the gas-less payer must start with no ETH and no Permit2 allowance")
	}
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	rq := fx.requirements(x402.TransferPermit2)
	req := fx.permit2(payer, rq, chain.Permit2Options{})
	without := fx.verify(req)
	if without.IsValid || without.InvalidReason != x402.ReasonPermit2AllowanceRequired {
		t.Fatalf("verify without the extension = %+v, want %s", without, x402.ReasonPermit2AllowanceRequired)
	}
	if err := chain.AddGasSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, "Stable Coin", "1", fx.c.TokenNonce(payer.Address)); err != nil {
		t.Fatal(err)
	}
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify with the extension = %+v, want valid", v)
	}
	s := fx.settle(req)
	if !s.Success {
		t.Fatalf("settle = %+v, want success", s)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if fx.c.ETHBalance(payer.Address).Sign() != 0 {
		t.Fatal("the payer paid gas")
	}
}

func TestAReplayedPaymentIsRefusedByVerifyAndAnsweredFromTheJournalBySettle(t *testing.T) {
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		t.Run(method, func(t *testing.T) {
			fx := newFixture(t, fixtureOpts{})
			payer := fx.c.Payers[2]
			fx.approvePermit2(payer)
			req := fx.payment(method, payer)
			before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
			first := fx.settle(req)
			if !first.Success {
				t.Fatalf("first settle = %+v", first)
			}
			v := fx.verify(req)
			want := x402.ReasonNonceAlreadyUsed
			if method == x402.TransferPermit2 {
				want = x402.ReasonPermit2InvalidNonce
			}
			if v.IsValid || v.InvalidReason != want {
				t.Fatalf("verify of the replay = %+v, want %s", v, want)
			}
			again := fx.settle(req)
			if !reflect.DeepEqual(again, first) {
				t.Fatalf("settle of the replay = %+v, want the first answer %+v", again, first)
			}
			assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
		})
	}
}

func (fx *fixture) permit2Address() common.Address { return contracts.Permit2Address }

// assertMoved checks that exactly n payments of price left payer and reached the seller.
func assertMoved(t *testing.T, fx *fixture, payer common.Address, payerBefore, sellerBefore *big.Int, n int64) {
	t.Helper()
	want := big.NewInt(price * n)
	if got := new(big.Int).Sub(payerBefore, fx.c.TokenBalance(payer)); got.Cmp(want) != 0 {
		t.Fatalf("payer balance fell by %s, want %s", got, want)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(want) != 0 {
		t.Fatalf("seller balance rose by %s, want %s", got, want)
	}
}

// A final record outlives the retention until its payment's deadline has passed (pruned earlier, a presentation
// of the payment would be new to the journal); once pruned, the payment presented again is refused, and nothing
// is sent: by its deadline, which the facilitator's clock is past (its nonce, spent on chain, would refuse it
// too).
func TestAPaymentPresentedAfterItsRecordWasPrunedIsRefusedNotSettledAgain(t *testing.T) {
	var ahead atomic.Int64 // how far the facilitator's clock runs ahead of the wall clock
	fx := newFixture(t, fixtureOpts{configure: func(cfg *chain.Config) {
		cfg.Retention, cfg.ReconcileEvery = 200*time.Millisecond, 50*time.Millisecond
		cfg.Now = func() time.Time { return time.Now().Add(time.Duration(ahead.Load())) }
	}})
	payer := fx.c.Payers[3]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	if first := fx.settle(req); !first.Success {
		t.Fatalf("settle = %+v", first)
	}
	time.Sleep(600 * time.Millisecond) // three times the retention, a dozen reconcile passes
	if n, err := fx.journal.Count(context.Background()); err != nil || n != 1 {
		t.Fatalf("the journal holds %d records (%v) past the retention, before the payment's deadline; want its record kept", n, err)
	}
	ahead.Store(int64(time.Until(req.PaymentPayload.Payload.Deadline()) + time.Minute)) // past the deadline
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if n, err := fx.journal.Count(context.Background()); err != nil {
			t.Fatal(err)
		} else if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the final record was never pruned")
		}
	}
	again := fx.settle(req)
	if again.Success || again.ErrorReason != x402.ReasonPermit2DeadlineExpired || again.Transaction != "" {
		t.Fatalf("settle after pruning = %+v, want %s with nothing sent", again, x402.ReasonPermit2DeadlineExpired)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}
