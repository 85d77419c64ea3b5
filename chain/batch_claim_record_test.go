package chain_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// finalWriteFails is a bbolt journal whose next write making a record final fails (a crash, or the journal lost,
// between a claim's outcome and its record).
type finalWriteFails struct {
	*journal.BoltStore
	fail atomic.Bool
}

func (s *finalWriteFails) Update(ctx context.Context, id journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
	if s.fail.Load() {
		if updateMakes(ctx, s.BoltStore, id, fn, journal.StateFinal) && s.fail.CompareAndSwap(true, false) {
			return journal.Record{}, errors.New("the journal is gone (injected)")
		}
	}
	return s.BoltStore.Update(ctx, id, fn)
}

// TestABatchClaimWhoseRecordWasNotFinishedIsFinishedByTheNextPass: a claim mined, and the write that makes its
// record final lost (a crash between the channels' marks and the record, or the journal failing that write). The
// next pass finishes it. Before, the channels were marked claimed first, so no pass saw the claim again, and its
// broadcast record stayed pending for good (the money-invariant run: 'gateway 0's bbolt journal holds payment ...
// pending: state broadcast', 'not drained: journal backlog 1').
func TestABatchClaimWhoseRecordWasNotFinishedIsFinishedByTheNextPass(t *testing.T) {
	store := &finalWriteFails{BoltStore: boltJournal(t).(*journal.BoltStore)}
	b := threeVouchersClaimedWhenAsked(t, store)
	store.fail.Store(true)
	if err := b.fx.f.ClaimBatches(context.Background()); err == nil {
		t.Fatal("the claim whose record's final write failed: no error")
	}
	if store.fail.Load() {
		t.Fatal("the claim's record was never written final: the fault did not fire")
	}
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 3*batchPrice {
		t.Fatalf("the receiver holds %d, want exactly the %d accepted", got, 3*batchPrice)
	}
	assertNothingPending(t, store)
}

// broadcastWriteFails is a bbolt journal whose write that records a claim's transaction fails, and the write after
// it of the same record too (the journal's database down for both).
type broadcastWriteFails struct {
	*journal.BoltStore
	arm    atomic.Bool
	failed atomic.Int32
	id     atomic.Pointer[journal.ID]
}

// secondWriteFails fails the first write of the record whose broadcast write failed, after that one.
func (s *broadcastWriteFails) secondWriteFails(id journal.ID) bool {
	if p := s.id.Load(); p != nil && *p == id && s.failed.CompareAndSwap(1, 2) {
		return true
	}
	return false
}

func (s *broadcastWriteFails) Release(ctx context.Context, claim journal.Record) error {
	if s.secondWriteFails(claim.ID) {
		return errors.New("the journal is down (injected)")
	}
	return s.BoltStore.Release(ctx, claim)
}

func (s *broadcastWriteFails) Update(ctx context.Context, id journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
	if s.secondWriteFails(id) {
		return journal.Record{}, errors.New("the journal is down (injected)")
	}
	if s.arm.Load() {
		if updateMakes(ctx, s.BoltStore, id, fn, journal.StateBroadcast) && s.arm.CompareAndSwap(true, false) {
			s.id.Store(&id)
			s.failed.Add(1)
			return journal.Record{}, errors.New("the journal is down (injected)")
		}
	}
	return s.BoltStore.Update(ctx, id, fn)
}

// TestABatchClaimWhoseTransactionWasNeverRecordedIsFreedByTheNextPassOfItsProcess: the write that records a claim's
// transaction fails, so the transaction is not sent, and so does the write that would say so: the claim's record
// is left claimed, naming no transaction, and its channels marked in flight. The next pass of the same process,
// which sends no such claim, frees them at once and claims them: the receiver is paid what was accepted and
// nothing is left pending. Before, they waited a minute (unrecordedClaimAge), the record pending all along: the
// money-invariant run's drain saw 'journal backlog 1' with nothing settling for 20 s.
func TestABatchClaimWhoseTransactionWasNeverRecordedIsFreedByTheNextPassOfItsProcess(t *testing.T) {
	store := &broadcastWriteFails{BoltStore: boltJournal(t).(*journal.BoltStore)}
	b := threeVouchersClaimedWhenAsked(t, store)
	store.arm.Store(true)
	if err := b.fx.f.ClaimBatches(context.Background()); err == nil {
		t.Fatal("the claim whose transaction could not be recorded: no error")
	}
	if got := store.failed.Load(); got != 2 {
		t.Fatalf("%d writes failed; want 2: the transaction's record and the write saying it was not sent", got)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 0 {
		t.Fatalf("the receiver holds %d after a claim that was never sent; want 0", got)
	}
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 3*batchPrice {
		t.Fatalf("the receiver holds %d after the next pass, want exactly the %d accepted", got, 3*batchPrice)
	}
	assertNothingPending(t, store)
}

// updateMakes says whether fn, applied to the record id holds now in store (an empty one if none), leaves it in state.
func updateMakes(ctx context.Context, store journal.Store, id journal.ID, fn func(*journal.Record) error, state journal.State) bool {
	var probe journal.Record
	if r, ok, err := store.Get(ctx, id); err == nil && ok {
		probe = r
	}
	return fn(&probe) == nil && probe.State == state
}

// threeVouchersClaimedWhenAsked is a batch route on store, claimed only when the test asks, whose channel holds 30
// prices and has accepted vouchers at 1, 2 and 3 prices.
func threeVouchersClaimedWhenAsked(t *testing.T, store journal.Store) *batchRoute {
	t.Helper()
	b := newBatchRoute(t, fixtureOpts{journal: store, autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 30*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	return b
}

// assertNothingPending fails the test for every record store holds pending.
func assertNothingPending(t *testing.T, store journal.Store) {
	t.Helper()
	pending, err := store.Pending(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range pending {
		t.Errorf("the journal holds %s pending: state %s, tx %q", rec.ID, rec.State, rec.TxHash)
	}
}
