package chain_test

import (
	"context"
	"fmt"
	"math/big"
	"slices"
	"strings"
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
	fx, join := clusterOn(t, dsn, leaseTTL, o)
	var stores []*journal.PostgresStore
	var engines []*chain.Facilitator
	for range n {
		f, st := join()
		stores, engines = append(stores, st), append(engines, f)
	}
	return fx, engines, stores
}

// clusterOn is a fixture's chain and join, which starts one more engine sharing the PostgreSQL journal at dsn, as
// one more process would: a store of its own on the database, the same wallets as every other.
func clusterOn(t *testing.T, dsn string, leaseTTL time.Duration, o fixtureOpts) (*fixture, func() (*chain.Facilitator, *journal.PostgresStore)) {
	t.Helper()
	// Engines sharing a journal hand payments off within waits (a wallet's, 2 s) tuned at the pending block's pace;
	// at the prompt pace a hand-off of twelve payments at once waited past it once, under CI's load.
	o.pendingBlockPace = true
	var nc chain.NetworkConfig
	tune := o.tune
	o.tune = func(fx *fixture, c *chain.NetworkConfig) {
		if tune != nil {
			tune(fx, c)
		}
		nc = *c
	}
	fx := newFixture(t, o)
	return fx, func() (*chain.Facilitator, *journal.PostgresStore) {
		t.Helper()
		st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{InstanceTTL: o.instanceTTL, MaxBehind: o.maxBehind})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		var j journal.Store = st
		if o.wrap != nil {
			j = o.wrap(st)
		}
		cfg := chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: j,
			Logger: engineLog(t), WalletLeaseTTL: leaseTTL, ReconcileEvery: 200 * time.Millisecond}
		if o.configure != nil {
			o.configure(&cfg)
		}
		f, err := chain.New(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f, st
	}
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
	// A lease of 12 s: under CI's load a renewal of a 3 s lease came late, and a settlement lost its wallet's fence.
	fx, engines, _ := sharedEngines(t, 2, 12*time.Second)
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
	leaseElsewhere(t, dsn, fx.net, wallet)

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

// leaseElsewhere takes wallet's lease for another instance on the journal at dsn (a store of its own), once the
// lease of the engine holding it (stalled, renewing nothing) expired: that instance holds it then, at a higher fence.
func leaseElsewhere(t *testing.T, dsn, network string, wallet common.Address) {
	t.Helper()
	other, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	name := chain.LeaseNameForTest(network, wallet)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		l, err := other.Lease(context.Background(), name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if l.Held {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stalled engine's lease never expired: %+v", l)
		}
	}
}

// waitEven waits until the engines hold every wallet between them, each as many as the others or one more, and
// returns what each holds.
func waitEven(t *testing.T, fx *fixture, engines []*chain.Facilitator, wallets int) [][]common.Address {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		held, total, even := make([][]common.Address, len(engines)), 0, true
		seen := map[common.Address]int{}
		for i, f := range engines {
			held[i] = f.LeasedWallets(fx.net)
			total += len(held[i])
			even = even && (len(held[i]) == wallets/len(engines) || len(held[i]) == (wallets+len(engines)-1)/len(engines))
			for _, w := range held[i] {
				if seen[w]++; seen[w] > 1 {
					t.Fatalf("wallet %s is leased to two engines at once", w.Hex())
				}
			}
		}
		if total == wallets && even {
			return held
		}
		if time.Now().After(deadline) {
			var counts []int
			for _, h := range held {
				counts = append(counts, len(h))
			}
			t.Fatalf("the %d engines hold %v of the %d wallets; want all of them, shared evenly (each %d or %d)",
				len(engines), counts, wallets, wallets/len(engines), (wallets+len(engines)-1)/len(engines))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestEnginesSharingAJournalShareTheWalletsEvenlyWhateverTheirNumber: three engines sharing four wallets hold
// two, one and one (each used to hold at most two, rounded up for every one, and the last to come found none
// free: two, two and none), and three sharing two hold one, one and none. The one that holds none sends from no
// wallet, so it names none (no signer, no upto kind, whose facilitatorAddress would name one), yet a payment any
// wallet may settle is valid there and settles, handed to an engine that holds a wallet (it used to be refused
// at verification with no_available_wallets: a cluster with fewer wallets than gateways refused payers).
func TestEnginesSharingAJournalShareTheWalletsEvenlyWhateverTheirNumber(t *testing.T) {
	for _, wallets := range []int{4, 2} {
		t.Run(fmt.Sprintf("%d wallets", wallets), func(t *testing.T) {
			fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 3, 3*time.Second, fixtureOpts{wallets: wallets, receiptTimeout: time.Minute})
			held := waitEven(t, fx, engines, wallets)
			fx.approvePermit2(fx.c.Payers[0])
			for i, f := range engines {
				sup, err := f.Supported(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				signers := sup.SignersFor(fx.net)
				if len(signers) != len(held[i]) {
					t.Errorf("engine %d lists signers %v; it holds the leases of %v", i, signers, held[i])
				}
				_, upto := sup.SchemeKind(x402.Version2, x402.SchemeUpto, fx.net, x402.TransferPermit2)
				if len(held[i]) > 0 {
					continue
				}
				if upto {
					t.Errorf("engine %d, which holds no wallet, offers upto: payments bound to a wallet it cannot send from", i)
				}
				req := fx.permit2(fx.c.Payers[0], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
				v, err := f.Verify(context.Background(), req)
				if err != nil || !v.IsValid {
					t.Errorf("engine %d, which holds no wallet, verifies a permit2 payment as %+v, %v; want valid", i, v, err)
				}
				before := fx.walletTxs()
				s, err := f.Settle(context.Background(), req)
				if err != nil || !s.Success {
					t.Errorf("engine %d, which holds no wallet, settles a permit2 payment as %+v, %v; want settled by an engine that holds one", i, s, err)
				}
				if n, from := fx.sentSince(before); n != 1 || len(from) != 1 || slices.Contains(held[i], from[0]) {
					t.Errorf("engine %d's settlement sent %d transactions from %v; want one, from another engine's wallet", i, n, from)
				}
			}
		})
	}
}

// TestAnEngineOfAClusterOffersAndVerifiesOnlyTheWalletsItSendsFrom: two engines share four wallets, two each.
// Each one's /supported lists as signers, and as the upto facilitatorAddress, only wallets it holds the lease
// of; a payment bound to the other's wallet (an upto witness naming it, an erc2612 permit to it) is refused at
// verification, naming the wallet; settled there all the same (its lease moved between the verification and the
// settlement), it is handed to the other engine, which holds the wallet, and settles from it; one bound to its own
// is valid and settles.
func TestAnEngineOfAClusterOffersAndVerifiesOnlyTheWalletsItSendsFrom(t *testing.T) {
	fx, engines, _ := sharedEngines(t, 2, 3*time.Second)
	held := waitEven(t, fx, engines, 4)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	for i, f := range engines {
		sup, err := f.Supported(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		mine := hexAddrs(held[i])
		if signers := sup.SignersFor(fx.net); len(signers) != len(mine) || !containsAll(mine, signers) {
			t.Errorf("engine %d lists signers %v; it holds the leases of %v only", i, signers, mine)
		}
		kind, ok := sup.SchemeKind(x402.Version2, x402.SchemeUpto, fx.net, x402.TransferPermit2)
		if !ok || !x402.ContainsAddress(mine, kind.Extra.FacilitatorAddress) {
			t.Errorf("engine %d's upto kind (%v) names facilitatorAddress %s; it holds the leases of %v only", i, ok, kind.Extra.FacilitatorAddress, mine)
		}
	}
	own, other := held[0][0], held[1][0]
	erc := func(spender common.Address) x402.VerifyRequest {
		rq := fx.requirements(x402.TransferERC2612)
		rq.Extra.Spender = spender.Hex()
		return fx.erc2612(payer, rq, chain.ERC2612Options{})
	}
	for _, tc := range []struct {
		name   string
		bound  func(common.Address) x402.VerifyRequest
		reason string
	}{
		{"upto", func(w common.Address) x402.VerifyRequest {
			return fx.permit2(payer, fx.uptoRequirements(w), chain.Permit2Options{})
		}, x402.ReasonUptoFacilitatorMismatch},
		{"erc2612", erc, x402.ReasonRecipientMismatch},
	} {
		req := tc.bound(other)
		v, err := engines[0].Verify(context.Background(), req)
		if err != nil || v.IsValid || v.InvalidReason != tc.reason || !strings.Contains(v.InvalidMessage, other.Hex()) {
			t.Errorf("%s bound to the other engine's wallet: verified as %+v, %v; want refused with %s naming %s", tc.name, v, err, tc.reason, other.Hex())
		}
		before := fx.walletTxs()
		s, err := engines[0].Settle(context.Background(), req)
		if err != nil || !s.Success {
			t.Errorf("%s bound to the other engine's wallet: settled as %+v, %v; want settled, handed to the other engine", tc.name, s, err)
		}
		if _, from := fx.sentSince(before); len(from) != 1 || from[0] != other {
			t.Errorf("%s bound to %s: sent from %v; want from that wallet alone", tc.name, other.Hex(), from)
		}
		req = tc.bound(own)
		if v, err := engines[0].Verify(context.Background(), req); err != nil || !v.IsValid {
			t.Errorf("%s bound to the engine's own wallet: verified as %+v, %v; want valid", tc.name, v, err)
		}
		if s, err := engines[0].Settle(context.Background(), req); err != nil || !s.Success {
			t.Errorf("%s bound to the engine's own wallet: settled as %+v, %v; want settled", tc.name, s, err)
		}
	}
}

func hexAddrs(ws []common.Address) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Hex()
	}
	return out
}

func containsAll(set, items []string) bool {
	for _, a := range items {
		if !x402.ContainsAddress(set, a) {
			return false
		}
	}
	return true
}

// TestAWalletBeingGivenUpStillSettlesThePaymentsVerifiedAgainstIt: an engine holds both wallets and verifies an
// upto payment bound to each, as a gate does before it runs the upstream. A second engine joins: the first must
// give a wallet up, and stops offering it at once, but keeps its lease while a payment verified against it may
// still come to settle, so both payments settle (the lease used to be given up within a second, and the
// settlement of the payment bound to it refused with no_available_wallets after its upstream had run).
func TestAWalletBeingGivenUpStillSettlesThePaymentsVerifiedAgainstIt(t *testing.T) {
	fx, join := clusterOn(t, pgtest.Shared(t), 3*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute})
	first, _ := join()
	waitEven(t, fx, []*chain.Facilitator{first}, 2)
	fx.approvePermit2(fx.c.Payers[0], fx.c.Payers[1])
	var reqs []x402.VerifyRequest
	for i, w := range fx.c.Wallets[:2] {
		req := fx.permit2(fx.c.Payers[i], fx.uptoRequirements(w.Address), chain.Permit2Options{})
		if v, err := first.Verify(context.Background(), req); err != nil || !v.IsValid {
			t.Fatalf("an upto payment bound to %s = %+v, %v; want valid", w.Address.Hex(), v, err)
		}
		reqs = append(reqs, req)
	}
	second, _ := join()
	deadline := time.Now().Add(10 * time.Second)
	for len(first.LeasedWallets(fx.net)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the first engine still offers %v with a second engine beside it; want one wallet", first.LeasedWallets(fx.net))
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(3 * time.Second) // several passes of the lease loops: the wallet given up would be gone by now
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	for i, req := range reqs {
		if s, err := first.Settle(context.Background(), req); err != nil || !s.Success {
			t.Errorf("the payment bound to %s, verified before the second engine came = %+v, %v; want settled", fx.c.Wallets[i].Address.Hex(), s, err)
		}
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(2*price)) != 0 {
		t.Errorf("the seller received %s, want %d", got, 2*price)
	}
	if ws := second.LeasedWallets(fx.net); len(ws) != 0 {
		t.Errorf("the second engine holds %v while the first may still settle from them", ws)
	}
}
