package chain_test

import (
	"context"
	"math/big"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A settlement that reverts because the chain's time ran past its payment's deadline while it waited to be mined
// (a dev chain sealing a block per batch of transactions runs a second a block ahead under load: `caddy x402
// bench --dev -c 32` saw it) is the engine's timing, not the payer's doing: it is logged as such, and the payer is
// not refused for the revert penalty, as a payer whose own state made its settlement revert is
// (TestAPayerWhoseSettlementRevertedIsRefusedForAWhileBeforeAnyChainCall). Before, the demo payer of a bench run
// was refused for ten minutes after such a revert, and every later run failed.
func TestASettlementThatExpiredWhileItWaitedToBeMinedDoesNotRefuseItsPayer(t *testing.T) {
	logs, logged := observer.New(zapcore.InfoLevel)
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{
		autoCommit: -1, // the test seals the block, once the chain's time has passed the deadline
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery = -1
			cfg.Logger = zap.New(logs)
		},
	})
	payer := u.c.Payers[0]
	u.approvePermit2(payer)
	u.c.Commit()

	// A deadline the engine accepts: just past its margin after the next block's earliest time.
	mineAt := max(int64(u.c.HeadTime())+1, time.Now().Unix())
	deadline := mineAt + 8
	req := u.permit2(payer, u.requirements(x402.TransferPermit2), chain.Permit2Options{Now: u.chainNow(), Deadline: big.NewInt(deadline)})
	if v := u.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v; want valid", v)
	}
	sent := sum(u.sentByWallets())
	settled := make(chan x402.SettleResponse, 1)
	go func() {
		resp, err := u.f.Settle(context.Background(), req)
		if err != nil {
			t.Errorf("settle: %v", err)
		}
		settled <- resp
	}()
	waitFor(t, "the settlement transaction", func() bool { return sum(u.sentByWallets()) > sent })
	// The transaction waits while the chain's time passes the deadline; the next block is stamped past it.
	for time.Now().Unix() <= deadline {
		time.Sleep(100 * time.Millisecond)
	}
	stop := u.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	s := <-settled
	if s.Success || s.Transaction == "" || s.ErrorReason != x402.ReasonTransactionFailed {
		t.Fatalf("settle = %+v; want %s with its transaction (mined past its deadline)", s, x402.ReasonTransactionFailed)
	}
	if logged.FilterMessageSnippet("deadline passed while it waited to be mined").Len() != 1 {
		t.Errorf("the revert was not logged as a deadline passed in flight; logs: %v", logged.All())
	}

	// The payer pays again: accepted and settled, not refused for the revert.
	again := u.payment(x402.TransferPermit2, payer)
	if v := u.verify(again); !v.IsValid {
		t.Fatalf("verify of the payer's next payment = %+v; want valid (the revert was the chain's time, not the payer)", v)
	}
	if r := u.settle(again); !r.Success {
		t.Fatalf("settle of the payer's next payment = %+v; want settled", r)
	}
	if n := logged.FilterMessageSnippet("refused for a while").Len(); n != 0 {
		t.Errorf("%d reverts refused the payer for a while", n)
	}
}
