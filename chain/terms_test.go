package chain_test

import (
	"context"
	"crypto/ecdsa"
	"math/big"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// chainCallCounter counts what the engine asks of the node for a payment: chain time, calls and simulations,
// and transactions.
type chainCallCounter struct {
	chain.Backend
	calls atomic.Int64
}

func (b *chainCallCounter) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	b.calls.Add(1)
	return b.Backend.HeaderByNumber(ctx, n)
}

func (b *chainCallCounter) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	b.calls.Add(1)
	return b.Backend.CallContract(ctx, msg, block)
}

func (b *chainCallCounter) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	b.calls.Add(1)
	return b.Backend.SendTransaction(ctx, tx)
}

// TestANetworksMinAmountAndPayToRefuseAPaymentBeforeAnyChainCall: a network with min_amount and a pay_to
// allow-list refuses, at verification and at settlement, a payment below the minimum or to another recipient,
// with invalid_payment_requirements and a message naming the amount or the recipient, without asking the node
// anything and with nothing sent; a payment within the terms is verified and settled as usual.
func TestANetworksMinAmountAndPayToRefuseAPaymentBeforeAnyChainCall(t *testing.T) {
	const minAmount = price
	partner := common.HexToAddress("0xbeefbeefbeefbeefbeefbeefbeefbeefbeefbeef")
	var counter *chainCallCounter
	fx := newFixture(t, fixtureOpts{
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			counter = &chainCallCounter{Backend: nc.Backend}
			nc.Backend = counter
			nc.MinAmount = big.NewInt(minAmount)
			nc.PayTo = []common.Address{partner, fx.payTo}
		},
		// No background pass may ask the node anything while the test counts.
		configure: func(cfg *chain.Config) { cfg.ReconcileEvery = -1 },
	})
	fx.approvePermit2(fx.c.Payers...)
	sent := func() (n uint64) {
		for _, w := range fx.c.Wallets {
			got, err := fx.c.Client.PendingNonceAt(context.Background(), w.Address)
			if err != nil {
				t.Fatal(err)
			}
			n += got
		}
		return n
	}

	payer := 0
	for _, method := range both {
		for _, tc := range []struct {
			name   string
			amount int64
			payTo  common.Address
			refuse string // a part of the refusal's message; "" for a payment within the terms
		}{
			{"one unit", 1, fx.payTo, "paymentRequirements.amount 1 is below min_amount 10000"},
			{"one unit below the minimum", minAmount - 1, fx.payTo, "paymentRequirements.amount 9999 is below min_amount 10000"},
			{"to a recipient not allowed", minAmount, stranger, "paymentRequirements.payTo " + stranger.Hex() + " is not among the allowed recipients"},
			{"exactly the minimum, to an allowed recipient", minAmount, fx.payTo, ""},
			{"above the minimum, to the other allowed recipient", minAmount + 1, partner, ""},
		} {
			t.Run(method+", "+tc.name, func(t *testing.T) {
				p := fx.c.Payers[payer%len(fx.c.Payers)]
				payer++
				rq := fx.requirements(method)
				rq.Amount, rq.PayTo = big.NewInt(tc.amount).String(), tc.payTo.Hex()
				var req x402.VerifyRequest
				if method == x402.TransferPermit2 {
					req = fx.permit2(p, rq, chain.Permit2Options{})
				} else {
					req = fx.erc2612(p, rq, chain.ERC2612Options{})
				}
				calls, txs := counter.calls.Load(), sent()
				v := fx.verify(req)
				s := fx.settle(req)
				if tc.refuse == "" {
					if !v.IsValid || !s.Success || s.Transaction == "" {
						t.Fatalf("verify = %+v, settle = %+v; want a payment within the terms settled", v, s)
					}
					if counter.calls.Load() == calls {
						t.Fatal("a payment within the terms was settled without a chain call: the counter counts nothing")
					}
					return
				}
				if v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(v.InvalidMessage, tc.refuse) || v.Payer != p.Address.Hex() {
					t.Errorf("verify = %+v; want %s saying %q, naming the payer", v, x402.ReasonInvalidPaymentRequirements, tc.refuse)
				}
				if s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(s.ErrorMessage, tc.refuse) ||
					s.Transaction != "" || s.Network != fx.net || s.Payer != p.Address.Hex() {
					t.Errorf("settle = %+v; want a full %s answer saying %q", s, x402.ReasonInvalidPaymentRequirements, tc.refuse)
				}
				if n := counter.calls.Load() - calls; n != 0 {
					t.Errorf("the engine made %d chain calls for a payment outside the terms, want none", n)
				}
				if n := sent() - txs; n != 0 {
					t.Errorf("the wallets sent %d transactions for a payment outside the terms", n)
				}
			})
		}
	}
}

// TestAPaymentSettledBeforeTheTermsTightenedIsStillAnsweredFromTheJournal: terms apply to payments presented
// anew. A payment settled under looser terms, presented again to an engine whose min_amount it is below (after a
// reload, say), gets its recorded answer and transaction, not a refusal telling its payer to pay again.
func TestAPaymentSettledBeforeTheTermsTightenedIsStillAnsweredFromTheJournal(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)
	first := fx.settle(req)
	if !first.Success {
		t.Fatalf("settle = %+v", first)
	}
	fx.f.Close()

	nc := chain.NetworkConfig{
		Network: fx.net, Backend: fx.c.Client, Keys: walletKeys(fx),
		Assets:    []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		MinAmount: big.NewInt(price + 1),
	}
	stricter, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: fx.journal, ReconcileEvery: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer stricter.Close()
	again, err := stricter.Settle(context.Background(), req)
	if err != nil || !again.Success || again.Transaction != first.Transaction {
		t.Fatalf("settle again under min_amount %d = %+v, %v; want the recorded answer with %s", price+1, again, err, first.Transaction)
	}
	// A new payment of the same amount is refused.
	other := fx.payment(x402.TransferPermit2, payer)
	if s, err := stricter.Settle(context.Background(), other); err != nil || s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements {
		t.Fatalf("a new payment below min_amount = %+v, %v; want %s", s, err, x402.ReasonInvalidPaymentRequirements)
	}
}

// TestANetworkRefusesTermsThatCannotBeMet: a min_amount below 1 or a zero address among the recipients is a
// configuration error, not a facilitator that refuses everything or nothing.
func TestANetworkRefusesTermsThatCannotBeMet(t *testing.T) {
	for _, tc := range []struct {
		name string
		tune func(*chain.NetworkConfig)
		want string
	}{
		{"a min_amount of zero", func(nc *chain.NetworkConfig) { nc.MinAmount = new(big.Int) }, "minimum amount 0"},
		{"a negative min_amount", func(nc *chain.NetworkConfig) { nc.MinAmount = big.NewInt(-5) }, "minimum amount -5"},
		{"the zero address as a recipient", func(nc *chain.NetworkConfig) { nc.PayTo = []common.Address{{}} }, "zero address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t, fixtureOpts{autoCommit: -1})
			nc := chain.NetworkConfig{
				Network: fx.net, Backend: fx.c.Client, Keys: walletKeys(fx),
				Assets: []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
			}
			tc.tune(&nc)
			f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, ReconcileEvery: -1})
			if err == nil {
				f.Close()
				t.Fatal("the facilitator started, want a configuration error")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error = %v, want it to say %q", err, tc.want)
			}
		})
	}
}

// walletKeys are the keys of the fixture's settlement wallets, for a second engine on its chain.
func walletKeys(fx *fixture) []*ecdsa.PrivateKey {
	var keys []*ecdsa.PrivateKey
	for _, w := range fx.c.Wallets {
		keys = append(keys, w.Key)
	}
	return keys
}
