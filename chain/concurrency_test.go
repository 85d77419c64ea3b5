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
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// settleAll settles every request concurrently and fails the test on any answer that is not a success.
func settleAll(t *testing.T, f *chain.Facilitator, reqs []x402.VerifyRequest) []x402.SettleResponse {
	t.Helper()
	out := make([]x402.SettleResponse, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = f.Settle(context.Background(), reqs[i])
		}()
	}
	wg.Wait()
	for i := range reqs {
		if errs[i] != nil || !out[i].Success {
			t.Fatalf("payment %d: settle = %+v, %v; want success", i, out[i], errs[i])
		}
	}
	return out
}

func TestTwoHundredDistinctPaymentsSettleConcurrentlyWithoutNonceGaps(t *testing.T) {
	for _, wallets := range []int{4, 1} {
		t.Run(map[int]string{4: "four wallets", 1: "one wallet pipelining"}[wallets], func(t *testing.T) {
			fx := newFixture(t, fixtureOpts{wallets: wallets, receiptTimeout: 3 * time.Minute, tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.MaxInFlightPerWallet = 256 }})
			payers := fx.c.Payers
			fx.approvePermit2(payers...)
			var reqs []x402.VerifyRequest
			before := map[common.Address]*big.Int{}
			for _, p := range payers {
				before[p.Address] = fx.c.TokenBalance(p.Address)
			}
			sellerBefore := fx.c.TokenBalance(fx.payTo)
			perPayer := map[common.Address]int64{}
			for i := range 200 {
				p := payers[i%len(payers)]
				reqs = append(reqs, fx.permit2(p, fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
				perPayer[p.Address]++
			}
			var sent uint64
			for _, w := range fx.c.Wallets[:wallets] {
				sent += fx.c.TxCount(w.Address)
			}
			start := time.Now()
			answers := settleAll(t, fx.f, reqs)
			elapsed := time.Since(start)
			t.Logf("%d wallets: 200 settlements in %v (%.0f/s, simulated chain committing every 5ms)", wallets, elapsed.Round(time.Millisecond), 200/elapsed.Seconds())

			hashes := map[string]bool{}
			for _, a := range answers {
				hashes[a.Transaction] = true
			}
			if len(hashes) != 200 {
				t.Fatalf("%d distinct transactions, want 200", len(hashes))
			}
			for p, n := range perPayer {
				if got := new(big.Int).Sub(before[p], fx.c.TokenBalance(p)); got.Cmp(big.NewInt(n*price)) != 0 {
					t.Fatalf("payer %s paid %s, want %d", p.Hex(), got, n*price)
				}
			}
			if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(200*price)) != 0 {
				t.Fatalf("seller received %s, want %d", got, 200*price)
			}
			// No gaps: every nonce a wallet used is mined, and together they sent exactly 200 transactions.
			var after uint64
			for _, w := range fx.c.Wallets[:wallets] {
				mined := fx.c.TxCount(w.Address)
				pending, err := fx.c.Client.PendingNonceAt(context.Background(), w.Address)
				if err != nil {
					t.Fatal(err)
				}
				if pending != mined {
					t.Fatalf("wallet %s: pending nonce %d but %d mined: a transaction is stuck behind a gap", w.Address.Hex(), pending, mined)
				}
				after += mined
			}
			if after-sent != 200 {
				t.Fatalf("wallets sent %d transactions, want 200", after-sent)
			}
		})
	}
}

func TestFiftyConcurrentSettlesOfOnePaymentMakeOneTransferAndShareItsHash(t *testing.T) {
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		t.Run(method, func(t *testing.T) {
			fx := newFixture(t, fixtureOpts{})
			payer := fx.c.Payers[0]
			fx.approvePermit2(payer)
			req := fx.payment(method, payer)
			before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
			reqs := make([]x402.VerifyRequest, 50)
			for i := range reqs {
				reqs[i] = req
			}
			answers := settleAll(t, fx.f, reqs)
			for i, a := range answers {
				if a.Transaction != answers[0].Transaction {
					t.Fatalf("answer %d carries %s, answer 0 carries %s", i, a.Transaction, answers[0].Transaction)
				}
			}
			assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
			if n := fx.c.CountTokenTransfers(payer.Address, fx.payTo); n != 1 {
				t.Fatalf("%d transfers from payer to seller on chain, want 1", n)
			}
		})
	}
}

func TestTwoFacilitatorsSharingAJournalSettleOnePaymentOnce(t *testing.T) {
	shared := journal.NewMemory(journal.Options{})
	fx := newFixture(t, fixtureOpts{journal: shared})
	// A second replica on the same chain and journal, with its own wallet, as two gateway replicas would be.
	second := newReplica(t, fx, shared)
	payer := fx.c.Payers[1]
	fx.approvePermit2(payer)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)

	var wg sync.WaitGroup
	answers := make([]x402.SettleResponse, 20)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f := fx.f
			if i%2 == 1 {
				f = second
			}
			a, err := f.Settle(context.Background(), req)
			if err != nil {
				t.Error(err)
			}
			answers[i] = a
		}()
	}
	wg.Wait()
	for i, a := range answers {
		if !a.Success || a.Transaction != answers[0].Transaction {
			t.Fatalf("answer %d = %+v; want success with %s", i, a, answers[0].Transaction)
		}
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}

// newReplica starts a second facilitator on fx's chain and the given journal, settling from the last wallet.
func newReplica(t *testing.T, fx *fixture, j journal.Store) *chain.Facilitator {
	t.Helper()
	last := fx.c.Wallets[len(fx.c.Wallets)-1]
	f, err := chain.New(context.Background(), chain.Config{Journal: j, Networks: []chain.NetworkConfig{{
		Network: fx.net, Backend: fx.c.Client, Keys: []*ecdsa.PrivateKey{last.Key}, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}
