package chain_test

import (
	"context"
	"math/big"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// deadlineMargin is the engine's: how long a deadline must outlast the time its settlement is mined by.
const deadlineMargin = 6

// blocksDuringCall is a chain backend that seals blocks, each a second past the one before, right after the next
// eth_call a settlement wallet makes once it is armed: the settlement's simulation, which runs in the next
// block's context as the engine read it for its deadline check. So the chain moves, as one sealing a block per
// transaction burst does under load, after the checks and before the engine signs: while it holds the payment,
// writes its claim and takes a wallet's nonce.
type blocksDuringCall struct {
	chain.Backend
	c   *chaintest.Chain
	arm atomic.Int32
}

func (b *blocksDuringCall) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	out, err := b.Backend.CallContract(ctx, msg, block)
	if b.fromWallet(msg) {
		for range b.arm.Swap(0) {
			b.c.Commit()
		}
	}
	return out, err
}

func (b *blocksDuringCall) fromWallet(msg ethereum.CallMsg) bool {
	for _, w := range b.c.Wallets {
		if msg.From == w.Address {
			return true
		}
	}
	return false
}

// blocksDuringCallTune puts a blocksDuringCall in front of the fixture's chain.
func blocksDuringCallTune(b **blocksDuringCall) func(*fixture, *chain.NetworkConfig) {
	return func(fx *fixture, nc *chain.NetworkConfig) {
		*b = &blocksDuringCall{Backend: nc.Backend, c: fx.c}
		nc.Backend = *b
	}
}

// nextBlockAt is the earliest time the engine's next block can be stamped: a second past the head, and no earlier
// than the clock.
func nextBlockAt(fx *fixture) int64 {
	return max(int64(fx.c.HeadTime())+1, time.Now().Unix())
}

// A payment valid when its settlement began, whose deadline the chain's clock passes while the engine claims it,
// holds it and simulates it (a chain sealing a block per transaction burst, under load), is refused before
// anything is signed: the deadline reason, no transaction from any wallet, the seller's balance unchanged, and its
// funds hold gone (the payer, whose funds cover one payment, pays another at once). Before, the deadline was
// judged only before the claim: the settlement was sent, mined past its deadline and reverted, at the settlement
// wallet's expense, and the payer was told transaction_failed. A payment with room for the same blocks settles.
func TestASettlementWhoseDeadlinePassesWhileItIsPreparedIsRefusedBeforeAnythingIsSent(t *testing.T) {
	racepass.Once(t, "20 blocks sealed inside each of four settlements, one at a time: its time is the simulated chain's; the settling goroutine's deadline check runs under -race in every settle test")
	const blocks = 20 // sealed while the settlement is prepared: 20 s of chain time
	var chainMoves *blocksDuringCall
	u := newUSDCFixture(t, price, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(price))},
		tune:      blocksDuringCallTune(&chainMoves),
	})
	fx := u.fixture
	payers := fx.c.Payers
	fx.approvePermit2(payers...)
	for _, c := range []struct {
		method, reason string
		sign           func(deadline int64) x402.VerifyRequest
		paidIn         func() *big.Int // the seller's balance in the payment's token
	}{
		{x402.TransferPermit2, x402.ReasonPermit2DeadlineExpired, func(d int64) x402.VerifyRequest {
			return fx.permit2(payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(d)})
		}, func() *big.Int { return fx.c.TokenBalance(fx.payTo) }},
		{x402.TransferERC2612, x402.ReasonValidBefore, func(d int64) x402.VerifyRequest {
			return fx.erc2612(payers[1], fx.requirements(x402.TransferERC2612), chain.ERC2612Options{Deadline: big.NewInt(d)})
		}, func() *big.Int { return fx.c.TokenBalance(fx.payTo) }},
		{x402.TransferEIP3009, x402.ReasonValidBefore, func(d int64) x402.VerifyRequest {
			return u.eip3009(payers[2], u.eip3009Requirements(), chain.EIP3009Options{ValidBefore: big.NewInt(d)})
		}, func() *big.Int { return fx.c.BalanceOf(u.usdc, fx.payTo) }},
	} {
		t.Run(c.method, func(t *testing.T) {
			// Valid by 3 s when the settlement reads chain time; 20 blocks later, 17 s short.
			req := c.sign(nextBlockAt(fx) + deadlineMargin + 3)
			if v := fx.verify(req); !v.IsValid {
				t.Fatalf("verify = %+v; want valid before the chain moves", v)
			}
			sellerBefore, sentBefore := c.paidIn(), fx.walletTxs()
			chainMoves.arm.Store(blocks)
			s := fx.settle(req)
			if s.Success || s.ErrorReason != c.reason || s.Transaction != "" {
				t.Errorf("settle = %+v; want %s with no transaction", s, c.reason)
			}
			if n, from := fx.sentSince(sentBefore); n != 0 {
				t.Errorf("the wallets %v sent %d transactions for a payment whose deadline passed before it was signed", from, n)
			}
			if got := c.paidIn(); got.Cmp(sellerBefore) != 0 {
				t.Errorf("the seller's balance moved from %s to %s", sellerBefore, got)
			}
			// The payer's funds cover one payment: a hold left by the refused one would refuse this one.
			again := c.sign(nextBlockAt(fx) + 600)
			if s := fx.settle(again); !s.Success {
				t.Fatalf("the payer's next payment = %+v; want it settled (the refused payment's hold gone)", s)
			}
			if got := new(big.Int).Sub(c.paidIn(), sellerBefore); got.Int64() != price {
				t.Errorf("the seller received %s, want %d", got, price)
			}
		})
	}
	t.Run("with room", func(t *testing.T) {
		fx.c.Mint(payers[0].Address, big.NewInt(price))
		req := fx.permit2(payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(nextBlockAt(fx) + deadlineMargin + blocks + 30)})
		sellerBefore := fx.c.TokenBalance(fx.payTo)
		chainMoves.arm.Store(blocks)
		if s := fx.settle(req); !s.Success {
			t.Fatalf("settle = %+v; want settled: its deadline outlasts the blocks sealed meanwhile", s)
		}
		if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != price {
			t.Errorf("the seller received %s, want %d", got, price)
		}
	})
}

// The same on engines sharing a PostgreSQL journal, where the claim is written with the funds hold after the
// simulation (journal.HoldClaimAndSign): the refusal at the last moment lets both go, nothing sent.
func TestASettlementWhoseDeadlinePassesAfterItsClaimAndHoldAreWrittenLetsBothGo(t *testing.T) {
	dsn := pgtest.Shared(t)
	var chainMoves *blocksDuringCall
	fx, engines, stores := sharedEnginesOn(t, dsn, 1, 3*time.Second, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(price))},
		tune:      blocksDuringCallTune(&chainMoves),
	})
	f := engines[0]
	waitLeases(t, fx, engines, len(fx.c.Wallets))
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(nextBlockAt(fx) + deadlineMargin + 3)})
	sellerBefore, sentBefore := fx.c.TokenBalance(fx.payTo), fx.walletTxs()
	chainMoves.arm.Store(20)
	s, err := f.Settle(context.Background(), req)
	if err != nil || s.Success || s.ErrorReason != x402.ReasonPermit2DeadlineExpired || s.Transaction != "" {
		t.Errorf("settle = %+v, %v; want %s with no transaction", s, err, x402.ReasonPermit2DeadlineExpired)
	}
	if n, from := fx.sentSince(sentBefore); n != 0 {
		t.Errorf("the wallets %v sent %d transactions", from, n)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(sellerBefore) != 0 {
		t.Errorf("the seller's balance moved from %s to %s", sellerBefore, got)
	}
	if held, err := holdMined(dsn, permit2ID(fx, req)); err != nil || held != "" {
		t.Errorf("the refused payment's funds hold = %q, %v; want it gone", held, err)
	}
	if _, ok, err := stores[0].Get(context.Background(), permit2ID(fx, req)); err != nil || ok {
		t.Errorf("the refused payment's claim: found %v, %v; want it released", ok, err)
	}
	again := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if s, err := f.Settle(context.Background(), again); err != nil || !s.Success {
		t.Fatalf("the payer's next payment = %+v, %v; want it settled (the refused payment's hold gone)", s, err)
	}
}

// On a chain that seals a block per transaction burst, each of the engine's settlements sent and not yet mined
// may take a block of its own ahead of the next, a second of chain time each: a payment whose deadline the next
// block allows, but not those blocks, is refused at verification and at settlement with the deadline reason, and
// nothing is sent for it. Once they are mined the same deadline has room again. On a chain with periodic blocks
// (stamped by the clock, its head not ahead of the engine's), the settlements ahead share the next block: the
// same payment is valid. Before, the engine judged only the next block, and such a settlement could be mined
// blocks later, past its deadline.
func TestASettlementBehindTheEnginesUnminedTransactionsIsJudgedByTheBlocksTheyMayTake(t *testing.T) {
	const ahead = 3
	for _, c := range []struct {
		name   string
		bursts bool
	}{{"a chain sealing per transaction burst", true}, {"a chain with periodic blocks", false}} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			var clockLead time.Duration // the engine's clock ahead of the wall clock: a periodic chain's head is not ahead of it
			fx := newFixture(t, fixtureOpts{autoCommit: -1, receiptTimeout: time.Minute,
				tune: func(fx *fixture, nc *chain.NetworkConfig) {
					nc.SealsPerBurst = c.bursts
					if !c.bursts {
						clockLead = time.Until(time.Unix(int64(fx.c.HeadTime()), 0)) + 30*time.Second
					}
				},
				configure: func(cfg *chain.Config) { cfg.Now = func() time.Time { return time.Now().Add(clockLead) } },
			})
			next := func() int64 { return max(int64(fx.c.HeadTime())+1, time.Now().Add(clockLead).Unix()) }
			payers := fx.c.Payers
			fx.approvePermit2(payers...)
			// ahead settlements, sent and waiting in the pool for a block.
			sentStart := fx.walletTxs()
			var answers []<-chan settleResult
			for i := range ahead {
				answers = append(answers, settleInBackground(fx.f, fx.permit2(payers[i], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})))
			}
			for pending := 0; pending < ahead; {
				if time.Since(start) > 20*time.Second {
					t.Fatalf("%d of the %d settlements ahead reached the pool", pending, ahead)
				}
				time.Sleep(5 * time.Millisecond)
				pending = 0
				for _, w := range fx.c.Wallets {
					n, err := fx.c.Client.PendingNonceAt(context.Background(), w.Address)
					if err != nil {
						t.Fatal(err)
					}
					pending += int(n - fx.c.TxCount(w.Address))
				}
			}
			// The next block allows it by a second; the blocks ahead do not.
			req := fx.permit2(payers[ahead], fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(next() + deadlineMargin + 1)})
			v := fx.verify(req)
			if !c.bursts {
				if !v.IsValid {
					t.Fatalf("verify = %+v; want valid: on a chain with periodic blocks the settlements ahead share the next block", v)
				}
			} else {
				if v.IsValid || v.InvalidReason != x402.ReasonPermit2DeadlineExpired || !strings.Contains(v.InvalidMessage, "3 of this facilitator's settlements are ahead of it") {
					t.Fatalf("verify = %+v; want %s naming the 3 settlements ahead", v, x402.ReasonPermit2DeadlineExpired)
				}
				if s := fx.settle(req); s.Success || s.ErrorReason != x402.ReasonPermit2DeadlineExpired || s.Transaction != "" {
					t.Fatalf("settle = %+v; want %s with no transaction", s, x402.ReasonPermit2DeadlineExpired)
				}
			}
			fx.c.Commit()
			for i, a := range answers {
				if r := <-a; r.err != nil || !r.resp.Success {
					t.Fatalf("settlement %d ahead: %+v, %v; want settled", i, r.resp, r.err)
				}
			}
			if n, _ := fx.sentSince(sentStart); n != ahead {
				t.Fatalf("the wallets sent %d transactions; want the %d ahead only", n, ahead)
			}
			// Nothing ahead now: the same deadline, as close to the next block, has room.
			again := fx.permit2(payers[ahead], fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(next() + deadlineMargin + 1)})
			if v := fx.verify(again); !v.IsValid {
				t.Fatalf("verify with nothing ahead = %+v; want valid", v)
			}
		})
	}
}

// A chain with periodic blocks whose head is stamped a few seconds past the engine's clock (the facilitator's
// clock behind, or a node's) is still one whose blocks come by the clock: the engine's settlements ahead share
// the next block, and a payment whose deadline the next block allows by deadlineMargin is valid. The engine took
// any head more than aheadOfClock past its clock for a chain sealing per burst, and refused it, a second for each
// of its settlements sent and not mined (under load on a real chain, tens of seconds): it now asks too that the
// heads it saw come a second a block apart or less (r-review41).
func TestAPeriodicChainWhoseHeadIsAheadOfTheEnginesClockRefusesNoValidPaymentForTheSettlementsAhead(t *testing.T) {
	const ahead = 3
	start := time.Now()
	var clockLag time.Duration // the engine's clock behind the chain's head, well past aheadOfClock
	fx := newFixture(t, fixtureOpts{autoCommit: -1, receiptTimeout: time.Minute,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			clockLag = time.Until(time.Unix(int64(fx.c.HeadTime()), 0)) - 10*time.Second
		},
		configure: func(cfg *chain.Config) { cfg.Now = func() time.Time { return time.Now().Add(clockLag) } },
	})
	next := func() int64 { return max(int64(fx.c.HeadTime())+1, time.Now().Add(clockLag).Unix()) }
	payers := fx.c.Payers
	fx.approvePermit2(payers...)
	// The chain's blocks come two seconds apart, and the engine sees them come (a verification reads the head).
	for range 3 {
		fx.c.AdjustTime(2 * time.Second)
		fx.verify(fx.permit2(payers[ahead], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
	}
	var answers []<-chan settleResult
	for i := range ahead {
		answers = append(answers, settleInBackground(fx.f, fx.permit2(payers[i], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})))
	}
	for pending := 0; pending < ahead; {
		if time.Since(start) > 20*time.Second {
			t.Fatalf("%d of the %d settlements ahead reached the pool", pending, ahead)
		}
		time.Sleep(5 * time.Millisecond)
		pending = 0
		for _, w := range fx.c.Wallets {
			n, err := fx.c.Client.PendingNonceAt(context.Background(), w.Address)
			if err != nil {
				t.Fatal(err)
			}
			pending += int(n - fx.c.TxCount(w.Address))
		}
	}
	req := fx.permit2(payers[ahead], fx.requirements(x402.TransferPermit2), chain.Permit2Options{Deadline: big.NewInt(next() + deadlineMargin + 1)})
	v := fx.verify(req)
	fx.c.Commit()
	for i, a := range answers {
		if r := <-a; r.err != nil || !r.resp.Success {
			t.Fatalf("settlement %d ahead: %+v, %v; want settled", i, r.resp, r.err)
		}
	}
	if !v.IsValid {
		t.Fatalf("verify = %+v; want valid: on a chain with periodic blocks the settlements ahead share the next block, wherever the engine's clock is", v)
	}
}

// TestAPaymentSignedFromAFresherHeadThanTheSharedReadIsNotTakenAsSignedTooFarAhead: on a chain sealing per burst
// the shared head read (HeadCacheTTL) may lag the payer's by many blocks, a second each, and before its clock runs
// ahead of the engine's nothing says the chain is one. A payment whose deadline
// is maxTimeoutSeconds past the payer's fresh head then lies more than maxTimeoutSeconds and the clock skew past
// the shared read's: it was refused as signed too far ahead (invalid_exact_evm_payload_authorization_valid_before),
// as the bench, signing its payments as the run goes, met under load in CI. It is judged again from a head read
// now before any such refusal.
func TestAPaymentSignedFromAFresherHeadThanTheSharedReadIsNotTakenAsSignedTooFarAhead(t *testing.T) {
	fx := newFixture(t, fixtureOpts{autoCommit: -1, tune: func(fx *fixture, nc *chain.NetworkConfig) {
		nc.HeadCacheTTL = time.Hour
	}})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	// The shared read is taken now...
	if v := fx.verify(fx.permit2(payer, rq, chain.Permit2Options{})); !v.IsValid {
		t.Fatalf("verify = %+v", v)
	}
	// ...and the chain moves on by more than the clock skew allowed (60 s) before the next payment is signed.
	fx.c.AdjustTime(90 * time.Second)
	time.Sleep(30 * time.Millisecond) // past farDeadlineHeadAge
	deadline := int64(fx.c.HeadTime()) + int64(rq.MaxTimeoutSeconds)
	v := fx.verify(fx.permit2(payer, rq, chain.Permit2Options{Deadline: big.NewInt(deadline)}))
	if !v.IsValid {
		t.Fatalf("verify of a payment signed maxTimeoutSeconds past the chain's head = %+v; want valid", v)
	}
	// Signed past that from the fresh head too, it is refused.
	v = fx.verify(fx.permit2(payer, rq, chain.Permit2Options{Deadline: big.NewInt(deadline + 120)}))
	if v.IsValid || v.InvalidReason != x402.ReasonValidBefore {
		t.Fatalf("verify of a payment signed further ahead than maxTimeoutSeconds and the skew = %+v; want %s", v, x402.ReasonValidBefore)
	}
}
