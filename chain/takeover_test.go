package chain_test

import (
	"context"
	"errors"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// pausingBackend holds every read of a wallet's pending nonce made while it is armed (what a settlement asks
// once it holds its claim, checked and held, and before it signs and records its transaction, the first time it
// sends from a wallet) until the test lets that call go.
type pausingBackend struct {
	chain.Backend
	armed  atomic.Bool
	paused chan chan struct{} // each held call, as it is held: close the channel to let it go
}

func (b *pausingBackend) PendingNonceAt(ctx context.Context, account common.Address) (uint64, error) {
	if b.armed.Load() {
		resume := make(chan struct{})
		b.paused <- resume
		<-resume
	}
	return b.Backend.PendingNonceAt(ctx, account)
}

// takeoverCluster is two engines on one PostgreSQL journal, the first of which can be made to look dead to the
// second (its heartbeat row expired by hand) while it works on: what a database outage longer than the
// heartbeat can do to a living process. Their stores beat once a minute, so the row stays expired for the test.
type takeoverCluster struct {
	fx      *fixture
	a, b    *chain.Facilitator
	stores  []*journal.PostgresStore
	dsn     string
	backend *pausingBackend
	req     x402.VerifyRequest
	id      journal.ID
	// sellerBefore and sentBefore are the seller's balance and the wallets' transactions before the payment.
	sellerBefore *big.Int
	sentBefore   uint64
}

func newTakeoverCluster(t *testing.T) *takeoverCluster {
	c := &takeoverCluster{dsn: pgtest.Shared(t)}
	fx, engines, stores := sharedEnginesOn(t, c.dsn, 2, time.Minute, fixtureOpts{
		wallets: 4, receiptTimeout: time.Minute, instanceTTL: 3 * time.Minute,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			c.backend = &pausingBackend{Backend: nc.Backend, paused: make(chan chan struct{}, 8)}
			nc.Backend = c.backend
		},
	})
	waitLeases(t, fx, engines, 2, 2)
	fx.approvePermit2(fx.c.Payers[0])
	c.fx, c.a, c.b, c.stores = fx, engines[0], engines[1], stores
	c.sellerBefore, c.sentBefore = fx.c.TokenBalance(fx.payTo), c.sent()
	c.req = fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	a := c.req.PaymentPayload.Payload.Permit2Authorization
	c.id = journal.PaymentID(fx.net, x402.TransferPermit2, fx.c.Token.Hex(), a.From, a.Nonce)
	return c
}

type settleResult struct {
	resp x402.SettleResponse
	err  error
}

// settle settles the payment on f in the background.
func (c *takeoverCluster) settle(f *chain.Facilitator) <-chan settleResult {
	out := make(chan settleResult, 1)
	go func() {
		resp, err := f.Settle(context.Background(), c.req)
		out <- settleResult{resp, err}
	}()
	return out
}

// held waits for the next contract call the armed backend holds.
func (c *takeoverCluster) held(t *testing.T, who string) chan struct{} {
	t.Helper()
	select {
	case resume := <-c.backend.paused:
		return resume
	case <-time.After(30 * time.Second):
		t.Fatalf("%s's settlement did not read its wallet's nonce", who)
		return nil
	}
}

// record is the journal's record of the payment, and whether there is one.
func (c *takeoverCluster) record(t *testing.T) (journal.Record, bool) {
	t.Helper()
	rec, ok, err := c.stores[1].Get(context.Background(), c.id)
	if err != nil {
		t.Fatal(err)
	}
	return rec, ok
}

// aLooksDead expires the first engine's heartbeat row, and waits until the second has taken its claim of the
// payment over and released it (nothing had been sent). A settlement on the shared holds writes its claim with
// its signed transaction's record (journal.HoldClaimAndSign), after the pause: then there is no claim to take over,
// and the first engine only looks dead.
func (c *takeoverCluster) aLooksDead(t *testing.T) {
	t.Helper()
	rec, claimed := c.record(t)
	if claimed && (rec.State != journal.StateClaimed || rec.Owner != c.stores[0].Instance()) {
		t.Fatalf("the payment's record is not the first engine's claim: %+v", rec)
	}
	conn, err := pgx.Connect(context.Background(), c.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), `UPDATE x402_instances SET expires_at = now() - interval '1 second' WHERE token = $1`,
		c.stores[0].Instance()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok := c.record(t); !ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the second engine did not take over the claim of an instance that looks dead")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// sent is the number of transactions the settlement wallets have sent.
func (c *takeoverCluster) sent() uint64 {
	var n uint64
	for _, w := range c.fx.c.Wallets[:4] {
		n += c.fx.c.TxCount(w.Address)
	}
	return n
}

// pausedInA starts the payment's settlement on the first engine and pauses it at its wallet's nonce read, after
// its claim; the backend stays armed.
func (c *takeoverCluster) pausedInA(t *testing.T) (<-chan settleResult, chan struct{}) {
	t.Helper()
	c.backend.armed.Store(true)
	first := c.settle(c.a)
	return first, c.held(t, "the first engine")
}

// settledOnce checks that the payment moved the price to the seller once, in one transaction of the wallets.
func (c *takeoverCluster) settledOnce(t *testing.T) {
	t.Helper()
	if n := c.sent() - c.sentBefore; n != 1 {
		t.Fatalf("the settlement wallets sent %d transactions; want 1", n)
	}
	if paid := new(big.Int).Sub(c.fx.c.TokenBalance(c.fx.payTo), c.sellerBefore); paid.Cmp(big.NewInt(price)) != 0 {
		t.Fatalf("the seller received %s; want %d, once", paid, price)
	}
}

// TestAClaimTakenOverAndSettledByAnotherInstanceIsAnsweredWithItsSettlement: an engine's settlement claims a
// payment and is paused before it records its transaction; meanwhile its instance looks dead to another engine
// (the database was down longer than the heartbeat), which takes the claim over, releases it, and settles the
// payment when it is presented there. The first settlement then sends nothing, and answers the settlement the
// other made: never "not sent" (a 402 telling the payer to pay again) for a payment that settled.
func TestAClaimTakenOverAndSettledByAnotherInstanceIsAnsweredWithItsSettlement(t *testing.T) {
	c := newTakeoverCluster(t)
	first, resumeA := c.pausedInA(t)
	c.backend.armed.Store(false)
	c.aLooksDead(t)

	other, err := c.b.Settle(context.Background(), c.req)
	if err != nil || !other.Success {
		t.Fatalf("settle on the engine that took the claim over = %+v, %v; want a success", other, err)
	}
	close(resumeA)
	got := <-first
	if got.err != nil || !got.resp.Success || got.resp.Transaction != other.Transaction {
		t.Fatalf("the first settlement, resumed after its claim was taken over and settled = %+v, %v; want the other's success with %s",
			got.resp, got.err, other.Transaction)
	}
	c.settledOnce(t)
}

// TestAClaimTakenOverWhileAnotherSettlementHoldsItIsNeverSentTwice: as above, but the other engine's settlement
// of the payment is itself paused, before it records its transaction, when the first resumes. Whichever records
// first sends; the other neither writes its transaction over the first's record nor releases it, and answers with
// the first's settlement: one transaction is sent.
func TestAClaimTakenOverWhileAnotherSettlementHoldsItIsNeverSentTwice(t *testing.T) {
	c := newTakeoverCluster(t)
	first, resumeA := c.pausedInA(t)
	c.aLooksDead(t)
	second := c.settle(c.b)
	resumeB := c.held(t, "the second engine")
	c.backend.armed.Store(false)
	claimedByB := false
	if rec, ok := c.record(t); ok {
		if rec.State != journal.StateClaimed || rec.Owner != c.stores[1].Instance() {
			t.Fatalf("the payment's record is not the second engine's claim: %+v", rec)
		}
		claimedByB = true
	}

	close(resumeA)
	if claimedByB {
		// The first settlement runs to its journal write and finds the claim is not its own any more.
		time.Sleep(500 * time.Millisecond)
		if rec, ok := c.record(t); !ok || rec.State != journal.StateClaimed || rec.Owner != c.stores[1].Instance() {
			t.Fatalf("the first settlement, resumed, changed the second's claim: %+v, %v", rec, ok)
		}
		if n := c.sent() - c.sentBefore; n != 0 {
			t.Fatalf("the first settlement sent %d transactions over another's claim", n)
		}
	} else {
		// Neither had claimed: the first records its transaction with its claim and settles.
		r := <-first
		first = func() <-chan settleResult { ch := make(chan settleResult, 1); ch <- r; return ch }()
	}
	close(resumeB)
	results := map[string]settleResult{"first": <-first, "second": <-second}
	var tx string
	for who, r := range results {
		if r.err != nil || !r.resp.Success {
			t.Fatalf("the %s settlement = %+v, %v; want a success", who, r.resp, r.err)
		}
		if tx == "" {
			tx = r.resp.Transaction
		} else if r.resp.Transaction != tx {
			t.Fatalf("the settlements answered transactions %s and %s; want one", tx, r.resp.Transaction)
		}
	}
	c.settledOnce(t)
}

// TestAClaimTakenOverAndReleasedIsAnsweredPresentAgainAndSettlesOnce: the other engine takes the claim over and
// releases it, and nobody settles the payment meanwhile. The first settlement, resumed, sends nothing and says
// the payment may be presented again (an error: a gate answers 502, never a 402 refusal); presented again, it
// settles once.
func TestAClaimTakenOverAndReleasedIsAnsweredPresentAgainAndSettlesOnce(t *testing.T) {
	c := newTakeoverCluster(t)
	first, resumeA := c.pausedInA(t)
	c.backend.armed.Store(false)
	_, claimed := c.record(t)
	c.aLooksDead(t)
	close(resumeA)
	got := <-first
	var fe *x402.FacilitatorError
	switch {
	case !claimed:
		// Its claim goes with its transaction's record, after the pause: nothing was taken over, and it settles.
		if got.err != nil || !got.resp.Success {
			t.Fatalf("the first settlement, resumed after its instance looked dead before it claimed = %+v, %v; want a success", got.resp, got.err)
		}
	case got.err == nil || !errors.As(got.err, &fe) || fe.Kind != x402.FailureUnreachable:
		t.Fatalf("the first settlement, resumed after its claim was taken over and released = %+v, %v; want an error saying to present it again",
			got.resp, got.err)
	default:
		if n := c.sent() - c.sentBefore; n != 0 {
			t.Fatalf("the settlement wallets sent %d transactions; want none", n)
		}
	}
	var wg sync.WaitGroup
	answers := make([]x402.SettleResponse, 2)
	for i, f := range []*chain.Facilitator{c.a, c.b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := f.Settle(context.Background(), c.req)
			if err != nil {
				t.Errorf("settle presented again = %v", err)
			}
			answers[i] = resp
		}()
	}
	wg.Wait()
	if !answers[0].Success || answers[0].Transaction != answers[1].Transaction {
		t.Fatalf("presented again to both engines: %+v and %+v; want one success", answers[0], answers[1])
	}
	c.settledOnce(t)
}
