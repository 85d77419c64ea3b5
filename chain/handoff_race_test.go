package chain_test

import (
	"context"
	"errors"
	"math/big"
	"reflect"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// hookedStore is an engine's PostgreSQL journal with a test's hooks around it: every other call is the store's.
type hookedStore struct {
	*journal.PostgresStore
	failUpdates atomic.Bool // Update fails, changing nothing: the database out of reach for writes
	hidePending atomic.Bool // PendingOf finds nothing: the engine sees no hand-off to take
	hangGets    atomic.Bool // Get waits for its caller to give up: a database that hangs rather than refuses
	failGets    atomic.Bool // Get fails at once: the database out of reach for reads
	afterGet    atomic.Pointer[func(journal.ID)]
	gets        atomic.Int64
	pendings    atomic.Int64
}

var (
	errWritesDown = errors.New("test: the journal's database takes no writes")
	errReadsDown  = errors.New("test: the journal's database answers no reads")
)

func (s *hookedStore) Update(ctx context.Context, id journal.ID, fn func(*journal.Record) error) (journal.Record, error) {
	if s.failUpdates.Load() {
		return journal.Record{}, errWritesDown
	}
	return s.PostgresStore.Update(ctx, id, fn)
}

func (s *hookedStore) PendingOf(ctx context.Context, async bool) ([]journal.Record, error) {
	s.pendings.Add(1)
	if s.hidePending.Load() {
		return nil, nil
	}
	return s.PostgresStore.PendingOf(ctx, async)
}

// Get reads the record, then runs the hook armed by afterGet, once: what another process does between the
// caller's read and its next step.
func (s *hookedStore) Get(ctx context.Context, id journal.ID) (journal.Record, bool, error) {
	s.gets.Add(1)
	if s.hangGets.Load() {
		<-ctx.Done()
		return journal.Record{}, false, ctx.Err()
	}
	if s.failGets.Load() {
		return journal.Record{}, false, errReadsDown
	}
	rec, ok, err := s.PostgresStore.Get(ctx, id)
	if h := s.afterGet.Swap(nil); h != nil {
		(*h)(id)
	}
	return rec, ok, err
}

// sendGate holds every transaction sent through a heldSends node while on, and every fee quote while fees is,
// until release is closed; a transaction held while refuse is set is then refused as a node refuses one whose
// sender cannot pay, instead of sent.
type sendGate struct {
	on, fees, refuse atomic.Bool
	entered          chan struct{}
	release          chan struct{}
}

var errSendRefused = errors.New("insufficient funds for gas * price + value (injected)")

func newSendGate() *sendGate {
	return &sendGate{entered: make(chan struct{}, 64), release: make(chan struct{})}
}

type heldSends struct {
	chain.Backend
	g *sendGate
}

func (b heldSends) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	if b.g.on.Load() {
		select {
		case b.g.entered <- struct{}{}:
		default:
		}
		select {
		case <-b.g.release:
		case <-ctx.Done():
			return ctx.Err()
		}
		if b.g.refuse.Load() {
			return errSendRefused
		}
	}
	return b.Backend.SendTransaction(ctx, tx)
}

func (b heldSends) SuggestGasTipCap(ctx context.Context) (*big.Int, error) {
	if b.g.fees.Load() {
		select {
		case <-b.g.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return b.Backend.SuggestGasTipCap(ctx)
}

// handoffPair is two engines on one PostgreSQL journal and one wallet, each behind a hookedStore, every
// transaction sent through g: the taker holds the wallet, the claimant none. The payer's tokens cover one payment.
type handoffPair struct {
	fx              *fixture
	engines         []*chain.Facilitator
	hooked          []*hookedStore
	taker, claimant int
	g               *sendGate
	payer           *chaintest.Account
	first, second   x402.VerifyRequest
}

func newHandoffPair(t *testing.T, receiptTimeout, walletWait time.Duration) *handoffPair {
	t.Helper()
	return newHandoffPairLeasing(t, receiptTimeout, walletWait, 3*time.Second)
}

// newHandoffPairLeasing is newHandoffPair with the wallet's lease lasting leaseTTL: a test whose claimant must not
// come to hold the wallet during its wait gives a lease that a loaded machine's late renewal does not let lapse.
func newHandoffPairLeasing(t *testing.T, receiptTimeout, walletWait, leaseTTL time.Duration) *handoffPair {
	t.Helper()
	hp := &handoffPair{g: newSendGate()}
	fx, engines, _ := sharedEnginesOn(t, pgtest.Start(t).DSN(), 2, leaseTTL, fixtureOpts{wallets: 1, receiptTimeout: receiptTimeout,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(price))},
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			nc.Backend = heldSends{Backend: nc.Backend, g: hp.g}
			nc.WalletWait = walletWait
		},
		wrap: func(st *journal.PostgresStore) journal.Store {
			h := &hookedStore{PostgresStore: st}
			hp.hooked = append(hp.hooked, h)
			return h
		}})
	hp.fx, hp.engines = fx, engines
	hp.taker, hp.claimant = 0, 1
	if len(stableLeases(t, fx, engines, 1)[0]) == 0 {
		hp.taker, hp.claimant = 1, 0
	}
	hp.payer = fx.c.Payers[0]
	fx.approvePermit2(hp.payer)
	rq := fx.requirements(x402.TransferPermit2)
	hp.first, hp.second = fx.permit2(hp.payer, rq, chain.Permit2Options{}), fx.permit2(hp.payer, rq, chain.Permit2Options{})
	return hp
}

// stableLeases is waitEven's share of the wallets once it stays put a while: the leases may still move once as the
// engines learn of each other, and a test's roles are taken by who holds what.
func stableLeases(t *testing.T, fx *fixture, engines []*chain.Facilitator, wallets int) [][]common.Address {
	t.Helper()
	for {
		leases := waitEven(t, fx, engines, wallets)
		time.Sleep(1500 * time.Millisecond)
		again := waitEven(t, fx, engines, wallets)
		if reflect.DeepEqual(leases, again) {
			return again
		}
	}
}

// record is the first payment's record as the journal holds it.
func (hp *handoffPair) record(t *testing.T) (journal.Record, bool) {
	t.Helper()
	recs, err := hp.hooked[hp.claimant].PostgresStore.PendingOf(context.Background(), false)
	if err != nil {
		t.Fatalf("reading the journal: %v", err)
	}
	for _, r := range recs {
		return r, true
	}
	return journal.Record{}, false
}

// waitRecord waits until the first payment's record is as ok says.
func (hp *handoffPair) waitRecord(t *testing.T, what string, ok func(journal.Record) bool) journal.Record {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		if r, found := hp.record(t); found && ok(r) {
			return r
		}
		if time.Now().After(deadline) {
			r, found := hp.record(t)
			t.Fatalf("the payment's record never got %s: %+v (found %v)", what, r, found)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// secondIsRefusedForFunds checks that the payer's second payment is refused for want of funds on the engines
// given: the first payment's hold still counts while its transaction is in flight.
func (hp *handoffPair) secondIsRefusedForFunds(t *testing.T, when string, engines ...int) {
	t.Helper()
	for _, i := range engines {
		e := hp.engines[i]
		v, err := e.Verify(context.Background(), hp.second)
		if err != nil || v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
			t.Errorf("%s: the payer's second payment on engine %d verified %+v, %v; want refused for insufficient_funds (the first one's funds hold is gone while its transaction is in flight)",
				when, i, v, err)
		}
	}
}

type settleAnswer struct {
	s   x402.SettleResponse
	err error
}

// settleAt settles the first payment at engine i in the background; its answer comes on the channel.
func (hp *handoffPair) settleAt(i int) <-chan settleAnswer {
	answers := make(chan settleAnswer, 1)
	go func() {
		s, err := hp.engines[i].Settle(context.Background(), hp.first)
		answers <- settleAnswer{s, err}
	}()
	return answers
}

// waitHeldSend waits until a transaction is held at the send gate (on): who names the engine that sends it.
func (hp *handoffPair) waitHeldSend(t *testing.T, who string) {
	t.Helper()
	select {
	case <-hp.g.entered:
	case <-time.After(20 * time.Second):
		t.Fatalf("%s never sent the settlement", who)
	}
}

// TestReconciliationLeavesAClaimOnOfferThatATakerTakesAsItReadsItToTheTaker: the claimant of a payment handed off
// gives up waiting without taking it back (its journal took no writes as it gave up), which leaves the claim on
// offer with nobody waiting for it. Its reconciliation reads the claim to release it and, right then, the engine
// holding the wallet takes it, holds the payer's funds and sends its transaction. Reconciliation must leave the
// claim, and the hold, to the taker: a hold let go while the transaction is in flight lets the payer's next
// payment through on funds already spent. The payment settles once.
func TestReconciliationLeavesAClaimOnOfferThatATakerTakesAsItReadsItToTheTaker(t *testing.T) {
	hp := newHandoffPair(t, 30*time.Second, 20*time.Second)
	claimant, taker := hp.hooked[hp.claimant], hp.hooked[hp.taker]
	taker.hidePending.Store(true) // takes nothing until the race
	hp.g.on.Store(true)
	before := hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo)

	ctx, cancel := context.WithCancel(context.Background())
	answers := make(chan settleAnswer, 1)
	go func() { s, err := hp.engines[hp.claimant].Settle(ctx, hp.first); answers <- settleAnswer{s, err} }()
	hp.waitRecord(t, "on offer", func(r journal.Record) bool { return r.OnOffer() })
	claimant.failUpdates.Store(true)
	cancel()
	a := <-answers
	claimant.failUpdates.Store(false)
	if a.err == nil {
		t.Fatalf("the claimant that gave up answered %+v; want an error (its claim could not be taken back)", a.s)
	}
	rec := hp.waitRecord(t, "on offer", func(r journal.Record) bool { return r.OnOffer() })

	// The race: the claimant's reconciliation reads the claim, and the taker takes it and sends before its next step.
	sent := make(chan struct{})
	hook := func(journal.ID) {
		defer close(sent)
		taker.hidePending.Store(false)
		select {
		case <-hp.g.entered:
		case <-time.After(10 * time.Second):
			t.Error("the taker never sent the settlement it was offered")
		}
	}
	claimant.afterGet.Store(&hook)
	select {
	case <-sent:
	case <-time.After(20 * time.Second):
		t.Fatal("the claimant's reconciliation never read the abandoned claim")
	}
	time.Sleep(300 * time.Millisecond) // reconciliation's next steps
	if cur, ok := hp.record(t); !ok || cur.Owner != taker.Instance() || cur.State != journal.StateBroadcast {
		t.Errorf("the record after the race: %+v (found %v); want the taker's, broadcast", cur, ok)
	}
	hp.secondIsRefusedForFunds(t, "the taker's transaction in flight", hp.claimant, hp.taker)

	hp.g.on.Store(false)
	close(hp.g.release)
	hp.waitRecordGone(t, rec.ID)
	if got := hp.fx.c.CountTokenTransfers(hp.payer.Address, hp.fx.payTo) - before; got != 1 {
		t.Errorf("%d transfers from the payer; want 1", got)
	}
}

// waitRecordGone waits until the payment's record is final.
func (hp *handoffPair) waitRecordGone(t *testing.T, id journal.ID) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		r, ok, err := hp.hooked[hp.claimant].PostgresStore.Get(context.Background(), id)
		if err == nil && (!ok || r.State == journal.StateFinal) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment's record never became final: %+v, %v, %v", r, ok, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
