package chain_test

import (
	"context"
	"errors"
	"math/big"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// headOutage is a node whose next head reads fail (a node answering 503 for a while, in front of one that
// answers the calls that follow once it is back).
type headOutage struct {
	chain.Backend
	failing atomic.Int64 // head reads left to fail
}

var errHeadOutage = errors.New("the node answers 503")

func (b *headOutage) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	if b.failing.Add(-1) >= 0 {
		return nil, errHeadOutage
	}
	return b.Backend.HeaderByNumber(ctx, n)
}

// verifyHeadless verifies req while the next head read fails: the answer must be the node unreachable, with the
// head read's error, neither a verification nor a refusal.
func (b *headOutage) verifyHeadless(t *testing.T, fx *fixture, req x402.VerifyRequest) {
	t.Helper()
	b.failing.Store(1)
	resp, err := fx.f.Verify(context.Background(), req)
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) || fe.Kind != x402.FailureUnreachable || !errors.Is(err, errHeadOutage) {
		t.Fatalf("verified with the head unread: want the node unreachable (the head read's error), got %+v, %v", resp, err)
	}
}

// settleHeadless settles req while the next head read fails: the answer must be the node unreachable.
func (b *headOutage) settleHeadless(t *testing.T, fx *fixture, req x402.VerifyRequest) {
	t.Helper()
	b.failing.Store(1)
	resp, err := fx.f.Settle(context.Background(), req)
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) || fe.Kind != x402.FailureUnreachable {
		t.Fatalf("settled with the head unread: want the node unreachable, got %+v, %v", resp, err)
	}
}

// TestAPaymentWhoseChainTimeCouldNotBeReadIsNeitherVerifiedNorRefusedForAnotherReason: when the head block (chain
// time) cannot be read, a payment's deadline cannot be judged, so its verification answers that the node could
// not be reached, whatever the calls after it would answer: before, the time check let it through, and a
// payment past its deadline was verified valid from the payer's cached funds, or refused as a failed simulation
// (the node back for the simulation); one too close to its deadline was verified valid. Presented again with
// the node back, each is refused for its deadline; nothing is sent.
func TestAPaymentWhoseChainTimeCouldNotBeReadIsNeitherVerifiedNorRefusedForAnotherReason(t *testing.T) {
	var node *headOutage
	fx := newFixture(t, fixtureOpts{tune: func(_ *fixture, nc *chain.NetworkConfig) {
		node = &headOutage{Backend: nc.Backend}
		nc.Backend, nc.FundsCacheTTL = node, time.Hour
	}})
	fx.approvePermit2(fx.c.Payers...)
	// A first payment of each payer is verified, so that its funds are cached for the next.
	for _, p := range fx.c.Payers[:2] {
		if resp := fx.verify(fx.payment(x402.TransferPermit2, p)); !resp.IsValid {
			t.Fatalf("a payment well within its deadline was refused: %s: %s", resp.InvalidReason, resp.InvalidMessage)
		}
	}
	for _, tc := range []struct {
		name     string
		payer    int
		deadline time.Duration // from the head block's time
	}{
		{"past its deadline, funds cached", 0, -time.Minute},
		{"past its deadline, funds read", 2, -time.Minute},
		{"too close to its deadline, funds cached", 1, 2 * time.Second},
		{"too close to its deadline, funds read", 3, 2 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sentBefore := fx.walletTxs()
			now := fx.chainNow()
			req := fx.permit2(fx.c.Payers[tc.payer], fx.requirements(x402.TransferPermit2), chain.Permit2Options{
				Now: now.Add(-2 * time.Minute), Deadline: big.NewInt(now.Add(tc.deadline).Unix())})
			node.verifyHeadless(t, fx, req)
			node.failing.Store(0)
			if resp := fx.verify(req); resp.IsValid || resp.InvalidReason != x402.ReasonPermit2DeadlineExpired {
				t.Fatalf("presented again with the node back: want %s, got %+v", x402.ReasonPermit2DeadlineExpired, resp)
			}
			node.settleHeadless(t, fx, req)
			node.failing.Store(0)
			if resp := fx.settle(req); resp.Success || resp.ErrorReason != x402.ReasonPermit2DeadlineExpired {
				t.Fatalf("settled with the node back: want %s, got %+v", x402.ReasonPermit2DeadlineExpired, resp)
			}
			if got, _ := fx.sentSince(sentBefore); got != 0 {
				t.Fatalf("%d transactions sent for a payment that cannot settle", got)
			}
		})
	}
}

// TestAPaymentSignedFromAFresherHeadIsNotRefusedWhenTheHeadCannotBeReadAgain: a deadline that looks signed too far
// ahead of the shared head read (HeadCacheTTL) is judged again from a fresh head before it is refused; when that
// head cannot be read, the payment is neither verified nor refused (before, it was refused as signed too far
// ahead, at verification and for good at settlement, though it was good: with the node back it verifies).
func TestAPaymentSignedFromAFresherHeadIsNotRefusedWhenTheHeadCannotBeReadAgain(t *testing.T) {
	var node *headOutage
	fx := newFixture(t, fixtureOpts{autoCommit: -1, tune: func(_ *fixture, nc *chain.NetworkConfig) {
		node = &headOutage{Backend: nc.Backend}
		nc.Backend, nc.HeadCacheTTL = node, time.Hour
	}})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	if v := fx.verify(fx.permit2(payer, rq, chain.Permit2Options{})); !v.IsValid { // the shared read is taken now
		t.Fatalf("verify = %+v", v)
	}
	fx.c.AdjustTime(90 * time.Second) // more than the clock skew allowed (60 s)
	time.Sleep(30 * time.Millisecond) // past farDeadlineHeadAge
	req := fx.permit2(payer, rq, chain.Permit2Options{Deadline: big.NewInt(int64(fx.c.HeadTime()) + int64(rq.MaxTimeoutSeconds))})
	before := fx.walletTxs()
	node.verifyHeadless(t, fx, req)
	node.settleHeadless(t, fx, req)
	node.failing.Store(0)
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify with the node back = %+v; want valid", v)
	}
	if got, _ := fx.sentSince(before); got != 0 {
		t.Fatalf("%d transactions sent", got)
	}
}
