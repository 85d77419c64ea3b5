package chain_test

import (
	"context"
	"math/big"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// sharedEngines is a fixture's chain with n engines that share one PostgreSQL journal, as n processes would:
// each has a store of its own on the same database, and every one is configured with the same wallets.
func sharedEngines(t *testing.T, n int, leaseTTL time.Duration) (*fixture, []*chain.Facilitator, []*journal.PostgresStore) {
	return sharedEnginesOn(t, pgtest.Shared(t), n, leaseTTL, fixtureOpts{wallets: 4, receiptTimeout: time.Minute})
}

func sharedEnginesOn(t *testing.T, dsn string, n int, leaseTTL time.Duration, o fixtureOpts) (*fixture, []*chain.Facilitator, []*journal.PostgresStore) {
	t.Helper()
	var stores []*journal.PostgresStore
	var nc chain.NetworkConfig
	tune := o.tune
	o.tune = func(fx *fixture, c *chain.NetworkConfig) {
		if tune != nil {
			tune(fx, c)
		}
		nc = *c
	}
	fx := newFixture(t, o)
	var engines []*chain.Facilitator
	for range n {
		st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{InstanceTTL: o.instanceTTL})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: st,
			Logger: engineLog(t), WalletLeaseTTL: leaseTTL, ReconcileEvery: 200 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		stores, engines = append(stores, st), append(engines, f)
	}
	return fx, engines, stores
}

// waitLeases waits until the engines hold want wallets each (their shares, once the lease passes have run).
func waitLeases(t *testing.T, fx *fixture, engines []*chain.Facilitator, want ...int) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ok := true
		seen := map[common.Address]int{}
		var got []int
		for i, f := range engines {
			ws := f.LeasedWallets(fx.net)
			got = append(got, len(ws))
			if len(ws) != want[i] {
				ok = false
			}
			for _, w := range ws {
				seen[w]++
			}
		}
		for w, k := range seen {
			if k > 1 {
				t.Fatalf("wallet %s is leased to %d engines at once", w.Hex(), k)
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("engines hold %v wallets, want %v", got, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestEnginesSharingAJournalSplitTheWalletsAndSettleEachPaymentOnce(t *testing.T) {
	fx, engines, _ := sharedEngines(t, 2, 3*time.Second)
	waitLeases(t, fx, engines, 2, 2)

	payers := fx.c.Payers
	fx.approvePermit2(payers...)
	const payments = 60
	var reqs []x402.VerifyRequest
	for i := range payments {
		reqs = append(reqs, fx.permit2(payers[i%len(payers)], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
	}
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	var sentBefore uint64
	for _, w := range fx.c.Wallets[:4] {
		sentBefore += fx.c.TxCount(w.Address)
	}
	// Every payment goes to both engines at once, as one header sent to two gateways behind a balancer.
	answers := make([][2]x402.SettleResponse, payments)
	var wg sync.WaitGroup
	for i := range reqs {
		for e := range engines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := engines[e].Settle(context.Background(), reqs[i])
				if err != nil {
					t.Errorf("payment %d on engine %d: %v", i, e, err)
				}
				answers[i][e] = resp
			}()
		}
	}
	wg.Wait()
	for i, a := range answers {
		if !a[0].Success || !a[1].Success || a[0].Transaction != a[1].Transaction {
			t.Fatalf("payment %d: engines answered %+v and %+v; want one success, the same transaction for both", i, a[0], a[1])
		}
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(payments*price)) != 0 {
		t.Fatalf("seller received %s, want %d", got, payments*price)
	}
	var sent uint64
	for _, w := range fx.c.Wallets[:4] {
		sent += fx.c.TxCount(w.Address)
	}
	if sent-sentBefore != payments {
		t.Fatalf("the wallets sent %d transactions, want %d: one per payment", sent-sentBefore, payments)
	}
}

func TestAClosedEnginesWalletsPassToTheOthers(t *testing.T) {
	fx, engines, stores := sharedEngines(t, 2, 3*time.Second)
	waitLeases(t, fx, engines, 2, 2)
	// A clean shutdown: the engine gives its leases up, and the store's instance leaves.
	engines[0].Close()
	stores[0].Close()
	start := time.Now()
	waitLeases(t, fx, engines[1:], 4)
	if waited := time.Since(start); waited > 3*time.Second {
		t.Fatalf("the wallets a closed engine gave up passed on after %v, later than a lease would have expired", waited)
	}

	fx.approvePermit2(fx.c.Payers[0])
	resp, err := engines[1].Settle(context.Background(), fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
	if err != nil || !resp.Success {
		t.Fatalf("settle on the remaining engine = %+v, %v; want success", resp, err)
	}
}

func TestADeadInstancesWalletsPassToTheLivingAfterTheLeaseExpires(t *testing.T) {
	fx, engines, stores := sharedEngines(t, 2, 2*time.Second)
	waitLeases(t, fx, engines, 2, 2)
	// The first instance dies: its store stops (no heartbeat, nothing given up), its engine is never closed
	// cleanly. Its engine's lease loop can no longer renew, so it stops signing as its leases run out.
	stores[0].Close()
	start := time.Now()
	waitLeases(t, fx, engines, 0, 4)
	t.Logf("the dead instance's wallets passed to the living after %v", time.Since(start).Round(10*time.Millisecond))

	fx.approvePermit2(fx.c.Payers[0])
	resp, err := engines[1].Settle(context.Background(), fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
	if err != nil || !resp.Success {
		t.Fatalf("settle on the living engine = %+v, %v; want success", resp, err)
	}
}

func TestALivingEngineFinishesTheBroadcastSettlementOfAnInstanceThatIsGone(t *testing.T) {
	// Blocks are sealed by hand: the first engine's settlement waits in the node's pool when its process goes.
	fx, engines, stores := sharedEnginesOn(t, pgtest.Shared(t), 2, 2*time.Second, fixtureOpts{wallets: 4, receiptTimeout: 300 * time.Millisecond, autoCommit: -1})
	waitLeases(t, fx, engines, 2, 2)
	fx.approvePermit2(fx.c.Payers[0])
	fx.c.Commit()
	req := fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	resp, err := engines[0].Settle(context.Background(), req)
	if err != nil || !resp.Pending() {
		t.Fatalf("settle with no block sealed = %+v, %v; want settlement_pending with the transaction", resp, err)
	}
	// The process goes: its engine stops and its store leaves the database, the record still broadcast.
	engines[0].Close()
	stores[0].Close()
	fx.c.Commit()

	a := req.PaymentPayload.Payload.Permit2Authorization
	id := journal.PaymentID(fx.net, x402.TransferPermit2, fx.c.Token.Hex(), a.From, a.Nonce)
	deadline := time.Now().Add(15 * time.Second)
	for {
		rec, ok, err := stores[1].Get(context.Background(), id)
		if err != nil || !ok {
			t.Fatalf("the journal lost the payment: %+v, %v, %v", rec, ok, err)
		}
		if rec.State == journal.StateFinal {
			if !rec.Response.Success || rec.Response.Transaction != resp.Transaction || rec.Owner != stores[1].Instance() {
				t.Fatalf("final record %+v (owner %s); want a success with the first engine's transaction %s, taken over by %s",
					rec.Response, rec.Owner, resp.Transaction, stores[1].Instance())
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the living engine did not finish the gone instance's settlement: record %s, owner %s", rec.State, rec.Owner)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(price)) != 0 {
		t.Fatalf("seller received %s, want %d: once", got, price)
	}
	// Presented again to the living engine, the payment gets the same answer.
	again, err := engines[1].Settle(context.Background(), req)
	if err != nil || !again.Success || again.Transaction != resp.Transaction {
		t.Fatalf("settle again on the living engine = %+v, %v; want the first settlement's answer", again, err)
	}
}

func TestAnEngineThatLostAWalletLeaseWithoutKnowingSendsNothingWithIt(t *testing.T) {
	dsn := pgtest.Shared(t)
	fx, engines, _ := sharedEnginesOn(t, dsn, 1, time.Second, fixtureOpts{wallets: 1, receiptTimeout: time.Minute})
	f := engines[0]
	waitLeases(t, fx, engines, 1)
	wallet := fx.c.Wallets[0].Address
	// The process stalls (a long pause, a stopped clock): it renews nothing and still takes its lease for valid.
	f.StallLeasesForTest()
	other, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	name := chain.LeaseNameForTest(fx.net, wallet)
	deadline := time.Now().Add(10 * time.Second)
	for {
		l, err := other.Lease(context.Background(), name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if l.Held {
			break // another instance holds the wallet now, at a higher fence
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stalled engine's lease never expired: %+v", l)
		}
		time.Sleep(100 * time.Millisecond)
	}

	fx.approvePermit2(fx.c.Payers[0])
	sent := fx.c.TxCount(wallet)
	resp, err := f.Settle(context.Background(), fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
	if err == nil || resp.Success {
		t.Fatalf("settle with a wallet whose lease another instance holds = %+v, %v; want an error, nothing sent", resp, err)
	}
	if got := fx.c.TxCount(wallet); got != sent {
		t.Fatalf("the wallet sent %d transactions under a lease it had lost; want none", got-sent)
	}
	if ws := f.LeasedWallets(fx.net); len(ws) != 0 {
		t.Fatalf("the engine still hands out %v after its fenced write failed", ws)
	}
}
