package chain_test

import (
	"context"
	"math/big"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// hostileWallet deploys a SimulationOnlyWallet of a fresh owner key playing trick, holding both tokens and
// approving Permit2 for the StableCoin: a payer that accepts its own signature only where no mined transaction
// runs.
func (w *walletFixture) hostileWallet(label string, trick uint8) *smartWallet {
	w.t.Helper()
	sw := &smartWallet{owner: chaintest.DeriveAccount(label, 0)}
	sw.addr = w.c.DeploySimulationOnlyWallet(sw.owner.Address, trick, w.c.Token, contracts.Permit2Address)
	w.c.MintTo(w.c.Token, sw.addr, big.NewInt(1_000_000))
	w.c.MintTo(w.usdc, sw.addr, big.NewInt(1_000_000))
	return sw
}

// walletsETH is what the settlement wallets hold in wei together.
func (fx *fixture) walletsETH() *big.Int {
	fx.t.Helper()
	total := new(big.Int)
	for _, w := range fx.c.Wallets {
		total.Add(total, fx.c.ETHBalance(w.Address))
	}
	return total
}

// TestAContractWalletThatAcceptsOnlyInSimulationIsRefusedBeforeAnythingIsSent: a payer contract whose ERC-1271
// isValidSignature accepts its owner's signature only under a zero gas price (what an eth_call without fee
// fields runs with), or only with more gas than a settlement carries (what an eth_call without a gas limit runs
// with), is refused at verification and at settlement, by permit2 and by eip3009, with nothing sent: the
// settlement wallets' nonces and ETH stay where they were and no token moves. Before the simulation ran as the
// transaction will run, both passed verification and their settlement was mined and reverted at the
// settlement wallet's expense.
func TestAContractWalletThatAcceptsOnlyInSimulationIsRefusedBeforeAnythingIsSent(t *testing.T) {
	w := newWalletFixture(t)
	tricks := []struct {
		name  string
		trick uint8
	}{
		{"a zero gas price", contracts.TrickZeroGasPrice},
		{"more gas than a settlement carries", contracts.TrickPlentyOfGas},
	}
	for _, tr := range tricks {
		for _, method := range []string{x402.TransferPermit2, x402.TransferEIP3009} {
			t.Run(method+" from a wallet that accepts only with "+tr.name, func(t *testing.T) {
				sw := w.hostileWallet("hostile wallet: "+method+", "+tr.name, tr.trick)
				req := w.payment(method, sw, sw.owner)
				sent, eth := sum(w.sentByWallets()), w.walletsETH()
				payerBefore, sellerBefore := w.balance(method, sw.addr), w.balance(method, w.payTo)

				v := w.verify(req)
				s := w.settle(req)
				spent := new(big.Int).Sub(eth, w.walletsETH())
				if n := sum(w.sentByWallets()) - sent; n != 0 || s.Transaction != "" || spent.Sign() != 0 {
					t.Fatalf("verify = %+v; settle = %+v: the settlement wallets sent %d transactions and spent %s wei on a payment that cannot settle; want it refused before anything is sent",
						v, s, n, spent)
				}
				if v.IsValid || v.InvalidReason == "" || v.InvalidMessage == "" {
					t.Fatalf("verify = %+v; want refused with a reason and a message", v)
				}
				if s.Success || s.ErrorReason == "" || s.ErrorMessage == "" {
					t.Fatalf("settle = %+v; want refused with a reason and a message", s)
				}
				if w.balance(method, sw.addr).Cmp(payerBefore) != 0 || w.balance(method, w.payTo).Cmp(sellerBefore) != 0 {
					t.Fatal("tokens moved for a refused payment")
				}
				t.Logf("verify: %s (%s); settle: %s (%s)", v.InvalidReason, v.InvalidMessage, s.ErrorReason, s.ErrorMessage)
			})
		}
	}
}

// sendWithTip sends a transaction from an account with a priority fee far above the settlement's, so that a
// block holding both runs it first: a payer front-running its own settlement.
func sendWithTip(t *testing.T, c *chaintest.Chain, from *chaintest.Account, to common.Address, data []byte) *types.Transaction {
	t.Helper()
	ctx := context.Background()
	nonce, err := c.Client.PendingNonceAt(ctx, from.Address)
	if err != nil {
		t.Fatal(err)
	}
	head, err := c.Client.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	tip := big.NewInt(1000e9)
	tx, err := types.SignNewTx(from.Key, c.Signer, &types.DynamicFeeTx{ChainID: c.ChainID, Nonce: nonce, GasTipCap: tip,
		GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip), Gas: 200_000, To: &to, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Client.SendTransaction(ctx, tx); err != nil {
		t.Fatal(err)
	}
	return tx
}

// waitFor polls cond every few milliseconds for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10 s for %s", what)
		}
	}
}

// TestAPayerWhoseSettlementRevertedIsRefusedForAWhileBeforeAnyChainCall: a contract-wallet payer that moves its
// tokens away in the block of its own settlement, ahead of it (a race no simulation can see), makes the
// settlement revert once, at the settlement wallet's expense, which is logged as an error. From then on the
// payer's payments are refused at verification and at settlement for the network's RevertPenalty, with a
// reason naming the reverted transaction, without asking the node anything and with nothing sent; another
// payer pays as usual; once the penalty is over the payer pays again.
func TestAPayerWhoseSettlementRevertedIsRefusedForAWhileBeforeAnyChainCall(t *testing.T) {
	var counter *chainCallCounter
	var offset atomic.Int64 // how far the engine's clock is ahead of the wall clock
	logs, logged := observer.New(zapcore.InfoLevel)
	const penalty = 10 * time.Minute // the default RevertPenalty
	w := &walletFixture{}
	w.usdcFixture = newUSDCFixture(t, 1_000_000, fixtureOpts{
		autoCommit: -1, // the test seals the blocks, to put the payer's transaction ahead of the settlement
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			w.factory = fx.c.DeploySmartWalletFactory()
			counter = &chainCallCounter{Backend: nc.Backend}
			nc.Backend = counter // the penalty is the default RevertPenalty
		},
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery = -1 // no background pass asks the node anything while the test counts
			cfg.Logger = zap.New(logs)
			cfg.Now = func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
		},
	})
	sw := w.newWallet("front-running wallet", true, w.factory)
	w.c.SendETH(w.c.Deployer, sw.owner.Address, big.NewInt(1e18)) // the owner pays the gas of its own race
	w.approvePermit2(w.c.Payers[0])

	// The first payment: verified, then its settlement raced by the payer's own transfer of everything.
	req := w.payment(x402.TransferPermit2, sw, sw.owner)
	if v := w.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v; want valid", v)
	}
	eth, sent := w.walletsETH(), sum(w.sentByWallets())
	settled := make(chan x402.SettleResponse, 1)
	go func() {
		resp, err := w.f.Settle(context.Background(), req)
		if err != nil {
			t.Errorf("settle: %v", err)
		}
		settled <- resp
	}()
	waitFor(t, "the settlement transaction", func() bool { return sum(w.sentByWallets()) > sent })
	drain, err := contracts.StableCoinABI.Pack("transfer", common.HexToAddress("0xd1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1"), w.c.TokenBalance(sw.addr))
	if err != nil {
		t.Fatal(err)
	}
	execute, err := contracts.SmartWalletABI.Pack("execute", w.c.Token, drain)
	if err != nil {
		t.Fatal(err)
	}
	race := sendWithTip(t, w.c, sw.owner, sw.addr, execute)
	waitFor(t, "the payer's transaction in the pool", func() bool {
		n, err := w.c.Client.PendingNonceAt(context.Background(), sw.owner.Address)
		return err == nil && n > race.Nonce()
	})
	if _, err := w.c.CommitUntilIncluded(context.Background(), race.Hash()); err != nil {
		t.Fatal(err)
	}
	stop := w.c.AutoCommit(5 * time.Millisecond)
	s := <-settled
	stop()
	if s.Success || s.Transaction == "" || s.ErrorReason != x402.ReasonTransactionFailed {
		t.Fatalf("settle of the raced payment = %+v; want %s with its transaction (the race must make it revert)", s, x402.ReasonTransactionFailed)
	}
	if w.walletsETH().Cmp(eth) >= 0 {
		t.Fatal("the reverted settlement cost the settlement wallets nothing; the race did not happen as the test means")
	}

	// The payer tops up and pays again: refused by the penalty before any chain call.
	w.c.MintTo(w.c.Token, sw.addr, big.NewInt(1_000_000))
	again := w.payment(x402.TransferPermit2, sw, sw.owner)
	calls, sent := counter.calls.Load(), sum(w.sentByWallets())
	v := w.verify(again)
	if v.IsValid || !strings.Contains(v.InvalidMessage, s.Transaction) {
		t.Fatalf("verify of the payer's next payment = %+v; want refused, naming the reverted transaction %s", v, s.Transaction)
	}
	if r := w.settle(again); r.Success || r.Transaction != "" || r.ErrorReason != v.InvalidReason {
		t.Fatalf("settle of the payer's next payment = %+v; want %s with nothing sent", r, v.InvalidReason)
	}
	if n := counter.calls.Load() - calls; n != 0 {
		t.Fatalf("the penalised payer's payment cost %d chain calls; want none", n)
	}
	if n := sum(w.sentByWallets()) - sent; n != 0 {
		t.Fatalf("the settlement wallets sent %d transactions for the penalised payer", n)
	}
	t.Logf("refused: %s (%s)", v.InvalidReason, v.InvalidMessage)
	reverted := logged.FilterMessageSnippet("reverted").All()
	if len(reverted) == 0 || reverted[0].Level < zapcore.WarnLevel {
		t.Fatalf("the reverted settlement was logged as %+v; want a warning or an error", reverted)
	}

	// Another payer is not concerned; the payer itself pays again once the penalty is over.
	stop = w.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	other := w.permit2(w.c.Payers[0], w.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if r := w.settle(other); !r.Success {
		t.Fatalf("settle of another payer's payment = %+v; want settled", r)
	}
	offset.Store(int64(penalty + time.Second))
	later := w.payment(x402.TransferPermit2, sw, sw.owner)
	if v := w.verify(later); !v.IsValid {
		t.Fatalf("verify after the penalty = %+v; want valid", v)
	}
	if r := w.settle(later); !r.Success {
		t.Fatalf("settle after the penalty = %+v; want settled", r)
	}
}
