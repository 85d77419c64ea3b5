package chain_test

import (
	"bytes"
	"context"
	"math/big"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/rpc"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// stingyBackend quotes a base fee and a priority fee of 1 wei while stingy is set, so the facilitator prices a
// transaction no block will take: a stuck transaction, as a fee spike leaves one.
type stingyBackend struct {
	chain.Backend
	stingy atomic.Bool
}

func (s *stingyBackend) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	h, err := s.Backend.HeaderByNumber(ctx, n)
	if err == nil && s.stingy.Load() {
		h = types.CopyHeader(h)
		h.BaseFee = big.NewInt(1)
	}
	return h, err
}

// Client is the node's JSON-RPC client, through which the engine simulates a settlement in the next block's
// context: a block whose base fee the stingy quote pays, as a block that takes the stuck transaction would.
func (s *stingyBackend) Client() *rpc.Client {
	return s.Backend.(interface{ Client() *rpc.Client }).Client()
}

func (s *stingyBackend) SuggestGasTipCap(ctx context.Context) (*big.Int, error) {
	if s.stingy.Load() {
		return big.NewInt(1), nil
	}
	return s.Backend.SuggestGasTipCap(ctx)
}

// stuckFixture is a one-wallet facilitator whose node (sb) quotes fees no block takes while sb.stingy is set, no
// block sealed unless the test seals it, stuck transactions replaced after 300 ms.
func stuckFixture(t *testing.T) (*fixture, *stingyBackend) {
	t.Helper()
	var sb *stingyBackend
	fx := newFixture(t, fixtureOpts{
		autoCommit: -1, wallets: 1, receiptTimeout: 20 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			sb = &stingyBackend{Backend: nc.Backend}
			nc.Backend, nc.ReplaceAfter = sb, 300*time.Millisecond
			nc.Fees.CacheFor = time.Millisecond
		},
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery, cfg.ReconcileGrace = 100*time.Millisecond, 100*time.Millisecond
		},
	})
	return fx, sb
}

// settleStuck settles req in the background at fees no block takes (sb stingy from now on), and returns where its
// answer comes and its record once broadcast.
func settleStuck(t *testing.T, fx *fixture, sb *stingyBackend, req x402.VerifyRequest) (<-chan x402.SettleResponse, journal.Record) {
	t.Helper()
	sb.stingy.Store(true)
	done := make(chan x402.SettleResponse, 1)
	go func() {
		resp, err := fx.f.Settle(context.Background(), req)
		if err != nil {
			t.Error(err)
		}
		done <- resp
	}()
	old := waitForRecord(t, fx.journal, func(r journal.Record) bool { return r.State == journal.StateBroadcast })
	return done, old
}

func TestAStuckSettlementIsReplacedWithHigherFeesAndSettlesOnce(t *testing.T) {
	fx, sb := stuckFixture(t)
	payer, wallet := fx.c.Payers[0], fx.c.Wallets[0].Address
	fx.approvePermit2(payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	mined := fx.c.TxCount(wallet)
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})

	done, old := settleStuck(t, fx, sb, req)
	for range 3 {
		fx.c.Commit()
	}
	if got := fx.c.TxCount(wallet); got != mined {
		t.Fatalf("the underpriced settlement was mined (wallet nonce %d -> %d): the test needs it stuck", mined, got)
	}

	sb.stingy.Store(false)
	replaced := waitForRecord(t, fx.journal, func(r journal.Record) bool { return len(r.ReplacedTxHashes) > 0 })
	if replaced.ReplacedTxHashes[0] != old.TxHash || replaced.TxHash == old.TxHash || replaced.TxNonce != old.TxNonce {
		t.Fatalf("replacement %s (nonce %d) of %s (nonce %d), recorded replaced %v", replaced.TxHash, replaced.TxNonce, old.TxHash, old.TxNonce, replaced.ReplacedTxHashes)
	}
	resp := commitUntilAnswered(t, fx, done)
	if !resp.Success || resp.Transaction != replaced.TxHash {
		t.Fatalf("settle = %+v, want success with the replacement %s", resp, replaced.TxHash)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if got := fx.c.TxCount(wallet); got != mined+1 {
		t.Fatalf("the wallet's nonce moved by %d, want 1: one of the two versions mined", got-mined)
	}
	if r, err := fx.c.Client.TransactionReceipt(context.Background(), common.HexToHash(old.TxHash)); err == nil && r != nil {
		t.Fatal("the replaced transaction mined too")
	}
}

// commitUntilAnswered seals a block every 50 ms until the settlement under way answers on done (15 s at most).
func commitUntilAnswered(t *testing.T, fx *fixture, done <-chan x402.SettleResponse) x402.SettleResponse {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; {
		fx.c.Commit()
		select {
		case resp := <-done:
			return resp
		case <-time.After(50 * time.Millisecond):
			if time.Now().After(deadline) {
				t.Fatal("the settlement never answered after its replacements were mined")
			}
		}
	}
}

// waitForRecord polls the journal until some record satisfies ok, and returns it.
func waitForRecord(t *testing.T, j journal.Store, ok func(journal.Record) bool) journal.Record {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		recs, err := j.Pending(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			if ok(r) {
				return r
			}
		}
	}
	t.Fatal("no journal record reached the awaited state")
	return journal.Record{}
}

// An erc2612 settlement stuck at fees no block takes, its permit and its transfer both: each is replaced with
// higher fees, and the record names the permit's replacement among its prior transactions (PriorTxHashes), as it
// names the transfer's: reconciliation settling the payment again looks for a mined permit there (resettle), and
// one it does not name is taken for unspent: the payment answered nonce_already_used for ten minutes and was then
// refused, its allowance granted and nothing moved (a fault run's erc2612 payment refused "was dropped and cannot
// be sent again").
func TestAStuckERC2612SettlementsPermitReplacementIsNamedInItsRecord(t *testing.T) {
	fx, sb := stuckFixture(t)
	payer := fx.c.Payers[0]
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	req := fx.erc2612(payer, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{})
	done, old := settleStuck(t, fx, sb, req)
	if len(old.PriorRawTxs) != 1 {
		t.Fatalf("the erc2612 settlement recorded %d prior transactions, want its permit", len(old.PriorRawTxs))
	}
	fx.c.Commit()
	sb.stingy.Store(false)
	replaced := waitForRecord(t, fx.journal, func(r journal.Record) bool {
		return len(r.ReplacedTxHashes) > 0 && len(r.PriorRawTxs) == 1 && !bytes.Equal(r.PriorRawTxs[0], old.PriorRawTxs[0])
	})
	permit := new(types.Transaction)
	if err := permit.UnmarshalBinary(replaced.PriorRawTxs[0]); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(replaced.PriorTxHashes, permit.Hash().Hex()) {
		t.Fatalf("the record's prior transactions %v do not name the permit's replacement %s", replaced.PriorTxHashes, permit.Hash().Hex())
	}
	resp := commitUntilAnswered(t, fx, done)
	if !resp.Success {
		t.Fatalf("settle = %+v, want success", resp)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}
