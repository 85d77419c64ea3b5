package chain_test

import (
	"context"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAPaymentThatExpiresBeforeTheNextBlockIsRefusedBeforeAnythingIsSent: the engine's clock runs five minutes
// past the head block (a chain that seals only when transactions come, idle for that long: its next block is
// stamped with the wall clock). A payment signed at the head's time with a deadline two minutes after it, valid
// by the head, would expire before the block its settlement lands in: it is refused at verification and at
// settlement with the method's deadline reason and a message saying why, nothing sent, by permit2, eip3009 and
// erc2612. The same payment signed at the engine's clock verifies and settles.
func TestAPaymentThatExpiresBeforeTheNextBlockIsRefusedBeforeAnythingIsSent(t *testing.T) {
	const ahead = 5 * time.Minute
	clock := func() time.Time { return time.Now().Add(ahead) }
	u := newUSDCFixture(t, 1_000_000, fixtureOpts{configure: func(cfg *chain.Config) { cfg.Now = clock }})
	payer := u.c.Payers[0]
	u.approvePermit2(payer)
	sign := func(method string, now time.Time) x402.VerifyRequest {
		switch method {
		case x402.TransferPermit2:
			rq := u.requirements(method)
			rq.MaxTimeoutSeconds = 120
			return u.permit2(payer, rq, chain.Permit2Options{Now: now})
		case x402.TransferEIP3009:
			rq := u.eip3009Requirements()
			rq.MaxTimeoutSeconds = 120
			return u.eip3009(payer, rq, chain.EIP3009Options{Now: now})
		}
		rq := u.requirements(method)
		rq.MaxTimeoutSeconds = 120
		return u.erc2612(payer, rq, chain.ERC2612Options{Now: now})
	}
	for _, tc := range []struct{ method, reason string }{
		{x402.TransferPermit2, x402.ReasonPermit2DeadlineExpired},
		{x402.TransferEIP3009, x402.ReasonValidBefore},
		{x402.TransferERC2612, x402.ReasonValidBefore},
	} {
		t.Run(tc.method, func(t *testing.T) {
			stale := sign(tc.method, u.chainNow())
			sent := sum(u.sentByWallets())
			v := u.verify(stale)
			s := u.settle(stale)
			if n := sum(u.sentByWallets()) - sent; n != 0 || s.Transaction != "" {
				t.Fatalf("verify = %+v; settle = %+v: %d transactions sent for a payment that expires before the next block; want it refused before anything is sent", v, s, n)
			}
			if v.IsValid || v.InvalidReason != tc.reason || !strings.Contains(v.InvalidMessage, "next block") {
				t.Fatalf("verify = %+v; want %s naming the next block", v, tc.reason)
			}
			if s.Success || s.ErrorReason != tc.reason {
				t.Fatalf("settle = %+v; want %s", s, tc.reason)
			}
			t.Logf("refused: %s", v.InvalidMessage)

			fresh := sign(tc.method, clock())
			if v := u.verify(fresh); !v.IsValid {
				t.Fatalf("verify of the payment signed at the engine's clock = %+v; want valid", v)
			}
			if s := u.settle(fresh); !s.Success {
				t.Fatalf("settle of the payment signed at the engine's clock = %+v; want settled", s)
			}
		})
	}
}

// TestAnIdleDevChainsNextBlockIsJudgedByTheWallClock: a dev chain that seals a block only when a transaction
// comes sat idle; its next block will be stamped with the wall clock, seconds past the head. A payment signed
// at the head's time (as a payer reading chain time signs) whose deadline the head allows but the next block
// passes is refused before anything is sent: before, it was verified, simulated at the head's time, and its
// settlement mined and reverted at the settlement wallet's expense (invalid_exact_evm_transaction_failed). A
// payment signed at the wall clock settles. The test waits about eight seconds of idle chain.
func TestAnIdleDevChainsNextBlockIsJudgedByTheWallClock(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dc, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dc.Close() })
	approve(t, dc.Client(), dc, dc.Payer(), contracts.Permit2Address)
	wallet := dc.WalletKeys()[0]
	f, err := chain.New(ctx, chain.Config{Journal: journal.NewMemory(journal.Options{}), Networks: []chain.NetworkConfig{{
		Network: dc.Network(), Backend: chain.AttachedClient(dc.Client(), dc.StorageAt), Keys: dc.WalletKeys()[:1],
		ReceiptTimeout: 20 * time.Second,
		Assets:         []chain.AssetConfig{{Address: dc.Token(), Name: "Stable Coin", Version: "1", Decimals: 6}},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	rq := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: dc.Network(), Amount: "10000", Asset: dc.Token().Hex(),
		PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 6,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
	head, err := dc.Client().HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Idle until the wall clock is two seconds past the deadline the head allows (head + 6 s).
	for time.Now().Unix() < int64(head.Time)+8 {
		time.Sleep(100 * time.Millisecond)
	}
	if now, _ := dc.Client().HeaderByNumber(ctx, nil); now.Number.Cmp(head.Number) != 0 {
		t.Fatalf("the dev chain sealed block %s while idle", now.Number)
	}
	pay := func(now time.Time) (x402.VerifyResponse, x402.SettleResponse) {
		t.Helper()
		p, err := chain.SignPermit2Payment(dc.Payer(), rq, new(big.Int).SetUint64(dc.ChainID()), chain.Permit2Options{Now: now})
		if err != nil {
			t.Fatal(err)
		}
		req := x402.VerifyRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
		v, err := f.Verify(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		s, err := f.Settle(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return v, s
	}
	from := crypto.PubkeyToAddress(wallet.PublicKey)
	nonce, err := dc.Client().PendingNonceAt(ctx, from)
	if err != nil {
		t.Fatal(err)
	}
	eth, err := dc.Client().BalanceAt(ctx, from, nil)
	if err != nil {
		t.Fatal(err)
	}
	v, s := pay(time.Unix(int64(head.Time), 0))
	after, _ := dc.Client().PendingNonceAt(ctx, from)
	ethAfter, _ := dc.Client().BalanceAt(ctx, from, nil)
	if after != nonce || s.Transaction != "" || ethAfter.Cmp(eth) != 0 {
		t.Fatalf("verify = %+v; settle = %+v: the settlement wallet sent %d transactions and spent %s wei on a payment the next block is past the deadline of; want it refused before anything is sent",
			v, s, after-nonce, new(big.Int).Sub(eth, ethAfter))
	}
	if v.IsValid || v.InvalidReason != x402.ReasonPermit2DeadlineExpired || s.Success || s.ErrorReason != x402.ReasonPermit2DeadlineExpired {
		t.Fatalf("verify = %+v; settle = %+v; want both %s", v, s, x402.ReasonPermit2DeadlineExpired)
	}
	t.Logf("refused: %s", v.InvalidMessage)

	rq.MaxTimeoutSeconds = 60
	if v, s := pay(time.Now()); !v.IsValid || !s.Success {
		t.Fatalf("a payment signed at the wall clock: verify = %+v, settle = %+v; want settled", v, s)
	}
}
