package chain_test

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// outageJournal is a journal whose database goes away right after the next claim: every write after it fails
// with journal.ErrUnavailable until back is called, as a PostgreSQL journal's do while its server restarts.
type outageJournal struct {
	journal.Store
	armed atomic.Bool // the next successful Claim takes the database down
	down  atomic.Bool
}

var errOutage = fmt.Errorf("%w: the test's database is down", journal.ErrUnavailable)

func (j *outageJournal) Claim(ctx context.Context, r journal.Record) (journal.Record, bool, error) {
	if j.down.Load() {
		return journal.Record{}, false, errOutage
	}
	rec, claimed, err := j.Store.Claim(ctx, r)
	if claimed && j.armed.CompareAndSwap(true, false) {
		j.down.Store(true)
	}
	return rec, claimed, err
}

func (j *outageJournal) Update(ctx context.Context, id journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
	if j.down.Load() {
		return journal.Record{}, errOutage
	}
	return j.Store.Update(ctx, id, fn)
}

func (j *outageJournal) Release(ctx context.Context, claim journal.Record) error {
	if j.down.Load() {
		return errOutage
	}
	return j.Store.Release(ctx, claim)
}

func (j *outageJournal) ReleaseUnsent(ctx context.Context, claim journal.Record, tx string) error {
	if j.down.Load() {
		return errOutage
	}
	return j.Store.ReleaseUnsent(ctx, claim, tx)
}

// TestAClaimTheJournalCouldNotReleaseDoesNotStickForever: the journal's database goes down right after a
// settlement claimed its payment, so the record of the transaction to be sent cannot be written (nothing is
// sent) and neither can the release of the claim. Once the database is back, the payment presented again must
// settle, once: the claim, which no settlement of this process is working on any more, is released by the
// background pass. (Before, it stayed claimed by a live process, and every later settlement of the payment,
// on this process or another sharing the journal, waited for it and answered "another settlement of this
// payment is under way" forever.)
func TestAClaimTheJournalCouldNotReleaseDoesNotStickForever(t *testing.T) {
	j := &outageJournal{Store: journal.NewMemory(journal.Options{})}
	fx := newFixture(t, fixtureOpts{journal: j, receiptTimeout: 10 * time.Second, configure: func(c *chain.Config) {
		c.ReconcileEvery, c.ReconcileGrace = 50*time.Millisecond, 200*time.Millisecond
	}})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)
	before := fx.c.TokenBalance(fx.payTo)

	j.armed.Store(true)
	resp, err := fx.f.Settle(context.Background(), req)
	// Not a refusal: the payment is good, only the journal could not be reached to record its transaction. A
	// gate answers a refusal 402 (the payer signs another payment) and an error 502 (it presents this one again).
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) || fe.Kind != x402.FailureUnreachable || !errors.Is(err, journal.ErrUnavailable) {
		t.Fatalf("with the journal down after the claim: %+v, %v; want an unreachable error naming the journal", resp, err)
	}
	j.down.Store(false)

	// Presented again once the database is back: the one call settles it, though its wait for the abandoned
	// claim could last the whole receipt timeout: a settlement waiting on a claim does not keep it alive.
	start := time.Now()
	resp, err = fx.f.Settle(context.Background(), req)
	if err != nil || !resp.Success {
		t.Fatalf("the payment presented again after the outage: %+v, %v; want it settled", resp, err)
	}
	if waited := time.Since(start); waited > 8*time.Second {
		t.Errorf("settling it again took %v", waited)
	}
	if again, err := fx.f.Settle(context.Background(), req); err != nil || !again.Success || again.Transaction != resp.Transaction {
		t.Errorf("presented once more: %+v, %v; want the same settlement %s", again, err, resp.Transaction)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), before); got.Int64() != price {
		t.Fatalf("the seller received %s, want %d", got, price)
	}
}
