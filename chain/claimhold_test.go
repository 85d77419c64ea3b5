package chain_test

import (
	"bytes"
	"context"
	"errors"
	"math/big"
	"net"
	"net/url"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestEnginesSettlingOnePaymentAtOnceClaimItWithItsHoldOnceAndTheLoserEndsNothing: engines sharing one PostgreSQL
// journal claim a payment in the batch of its funds hold (journal.HoldClaimAndSign), after the checks that come
// before the hold. The same payment presented to two engines at once, twice each: one claim wins, one transaction
// goes on chain, every answer is its success, and the payment's hold is there, ended as mined: no loser let it
// go (a loser refused by the chain's checks, the winner's transaction mined already, or finding the winner's
// record in its hold's transaction, touches nothing). Presented again on either engine afterwards, it answers the
// same.
func TestEnginesSettlingOnePaymentAtOnceClaimItWithItsHoldOnceAndTheLoserEndsNothing(t *testing.T) {
	dsn := pgtest.Shared(t)
	fx, engines, _ := sharedEnginesOn(t, dsn, 2, 3*time.Second, fixtureOpts{wallets: 4, receiptTimeout: time.Minute})
	waitLeases(t, fx, engines, 2, 2)
	payers := fx.c.Payers
	fx.approvePermit2(payers...)
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	sentBefore := fx.walletTxs()
	const payments = 10
	for i := range payments {
		req := fx.permit2(payers[i%len(payers)], fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			answers []x402.SettleResponse
		)
		for k := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := engines[k%2].Settle(context.Background(), req)
				if err != nil {
					t.Errorf("payment %d, settlement %d: %v", i, k, err)
				}
				mu.Lock()
				answers = append(answers, resp)
				mu.Unlock()
			}()
		}
		wg.Wait()
		for _, e := range engines {
			again, err := e.Settle(context.Background(), req)
			if err != nil {
				t.Errorf("payment %d presented again: %v", i, err)
			}
			answers = append(answers, again)
		}
		for _, a := range answers {
			if !a.Success || a.Transaction != answers[0].Transaction {
				t.Fatalf("payment %d: answers %+v; want one success, the same transaction for all", i, answers)
			}
		}
		if mined, err := holdMined(dsn, permit2ID(fx, req)); err != nil || mined == "" || mined == "0" {
			t.Fatalf("payment %d's funds hold = %q, %v; want it there, ended as mined (a loser let it go?)", i, mined, err)
		}
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != payments*price {
		t.Fatalf("the seller received %s, want %d", got, payments*price)
	}
	if n, _ := fx.sentSince(sentBefore); n != payments {
		t.Fatalf("the wallets sent %d transactions, want %d: one per payment", n, payments)
	}
}

// TestAClaimWithItsHoldThatCommitsWhileItsCallFailsIsReleasedAndThePaymentSettlesOnce: the connection carrying a
// settlement's claim and hold breaks once the database has them, before its answer comes back. The settlement
// answers unreachable (nothing sent: present the payment again); the claim it cannot know it holds is released by
// reconciliation, its hold first (or, made broadcast in the same batch, its transaction sent by reconciliation),
// and the payment presented again settles, once. A live settlement's claim is
// never taken for such a claim: its write-ahead record, held back past the reconciliation grace, still lands and
// the payment settles.
func TestAClaimWithItsHoldThatCommitsWhileItsCallFailsIsReleasedAndThePaymentSettlesOnce(t *testing.T) {
	dsn := pgtest.Shared(t)
	proxy := newPGFaultProxy(t, dsn)
	fx, join := clusterOn(t, proxy.dsn, 3*time.Second, fixtureOpts{wallets: 2, receiptTimeout: time.Minute,
		configure: func(c *chain.Config) { c.ReconcileEvery, c.ReconcileGrace = 50*time.Millisecond, 1500*time.Millisecond }})
	f, _ := join()
	waitLeases(t, fx, []*chain.Facilitator{f}, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	holdKey := []byte(fx.net + ":" + fx.c.Token.Hex() + ":" + payer.Address.Hex())
	sellerBefore := fx.c.TokenBalance(fx.payTo)

	// Cut after the claim with its hold reached the database.
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	id := permit2ID(fx, req)
	proxy.arm(pgFault{match: [][]byte{holdKey, []byte(`"claimed"`)}, cut: true})
	resp, err := f.Settle(context.Background(), req)
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) || fe.Kind != x402.FailureUnreachable {
		t.Fatalf("the settlement whose claim and hold committed as its connection broke = %+v, %v; want an unreachable error", resp, err)
	}
	if !proxy.fired() {
		t.Fatal("the claim with its hold was never seen on its way to the database")
	}
	direct, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { direct.Close() })
	// Looked at within the reconciliation grace, the hold first (reconciliation lets it go before the claim).
	if mined, err := holdMined(dsn, id); err != nil || mined != "0" {
		t.Fatalf("the hold whose call failed = %q, %v; want it committed", mined, err)
	}
	// The claim with its hold rides in one batch with the record of the signed transaction
	// (journal.HoldClaimAndSign): the cut may find both committed, the record broadcast, which reconciliation
	// sends as recorded (a crash after a broadcast record's write), or the claim alone, which it releases.
	r, ok, err := direct.Get(context.Background(), id)
	if err != nil || !ok || (r.State != journal.StateClaimed && r.State != journal.StateBroadcast) {
		t.Fatalf("the claim whose call failed is %s (found %v, %v); want it committed, claimed or broadcast", r.State, ok, err)
	}
	if n := fx.c.CountTokenTransfers(payer.Address, fx.payTo); r.State == journal.StateClaimed && n != 0 {
		t.Fatalf("%d transfers after a settlement that failed before it sent anything", n)
	}
	resp, err = f.Settle(context.Background(), req)
	if err != nil || !resp.Success {
		t.Fatalf("the payment presented again = %+v, %v; want it settled", resp, err)
	}

	// A live settlement whose write-ahead record is held back past the grace: its claim is not released.
	live := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	proxy.arm(pgFault{match: [][]byte{[]byte(`"broadcast"`), []byte(payer.Address.Hex())}, delay: 2500 * time.Millisecond})
	if resp, err := f.Settle(context.Background(), live); err != nil || !resp.Success {
		t.Fatalf("a settlement whose write-ahead record was held back past the grace = %+v, %v; want it settled", resp, err)
	}
	if !proxy.fired() {
		t.Fatal("the write-ahead record was never held back")
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != 2*price {
		t.Fatalf("the seller received %s, want %d: each payment once", got, 2*price)
	}
	if n := fx.c.CountTokenTransfers(payer.Address, fx.payTo); n != 2 {
		t.Fatalf("%d transfers from the payer, want 2", n)
	}
}

// pgFaultProxy is a TCP proxy in front of a PostgreSQL server that does one fault, armed, to the first thing a
// client sends that holds every one of match: cut closes the connection once it reached the server and had time
// to commit, before the answer comes back; delay holds it back that long. A cut that takes the proxy down closes
// every other connection too, and refuses new ones until up: to its clients the database is gone, while the
// statement cut goes on and commits on the server.
type pgFaultProxy struct {
	dsn     string
	target  string
	mu      sync.Mutex
	fault   *pgFault
	did     bool
	isDown  bool
	clients map[net.Conn]bool
}

type pgFault struct {
	match [][]byte
	cut   bool
	down  bool // with cut: the proxy goes down as the statement is sent
	delay time.Duration
}

func newPGFaultProxy(t *testing.T, dsn string) *pgFaultProxy {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pgFaultProxy{target: u.Host, clients: map[net.Conn]bool{}}
	u.Host = ln.Addr().String()
	p.dsn = u.String()
	var conns sync.WaitGroup
	t.Cleanup(func() { ln.Close(); conns.Wait() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				p.serve(c)
			}()
		}
	}()
	return p
}

func (p *pgFaultProxy) arm(f pgFault) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fault, p.did = &f, false
}

// goDown closes every client connection but keep and refuses new ones until up.
func (p *pgFaultProxy) goDown(keep net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.isDown = true
	for c := range p.clients {
		if c != keep {
			c.Close()
		}
	}
}

// up lets clients connect again.
func (p *pgFaultProxy) up() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.isDown = false
}

// admit registers a new client connection, or says the proxy is down.
func (p *pgFaultProxy) admit(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.isDown {
		return false
	}
	p.clients[c] = true
	return true
}

func (p *pgFaultProxy) forget(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.clients, c)
}

// fired reports whether the armed fault was done.
func (p *pgFaultProxy) fired() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.did
}

// take returns the armed fault, disarmed, when b holds all it matches.
func (p *pgFaultProxy) take(b []byte) *pgFault {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fault == nil {
		return nil
	}
	for _, m := range p.fault.match {
		if !bytes.Contains(b, m) {
			return nil
		}
	}
	f := p.fault
	p.fault, p.did = nil, true
	return f
}

func (p *pgFaultProxy) serve(client net.Conn) {
	defer client.Close()
	if !p.admit(client) {
		return
	}
	defer p.forget(client)
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer server.Close()
	var mute atomic.Bool // the server's answers go nowhere
	go func() {
		defer client.Close()
		buf := make([]byte, 1<<16)
		for {
			n, err := server.Read(buf)
			if n > 0 && !mute.Load() {
				if _, err := client.Write(buf[:n]); err != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	buf := make([]byte, 1<<16)
	for {
		n, err := client.Read(buf)
		if n > 0 {
			f := p.take(buf[:n])
			if f != nil && f.delay > 0 {
				time.Sleep(f.delay)
			}
			if f != nil && f.cut {
				// The answer must not come back: stop relaying before the statement is sent.
				mute.Store(true)
				if f.down {
					p.goDown(client)
				}
				server.Write(buf[:n])
				time.Sleep(300 * time.Millisecond)
				client.Close()
				server.Close()
				return
			}
			if _, err := server.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// TestAnUptoPaymentHeldAtItsMaximumSettlesForLessWithItsClaimInTheHoldsBatch: on a shared journal, an upto payment
// a gate held at its maximum when it served it (VerifyAndHold) is settled for less: the settlement's claim goes
// with its hold, which finds the payment held already (at the maximum, which the shared holds keep until the
// settlement is mined), and it moves exactly the amount settled, once. One never held, settled on the engine
// that does not hold its named wallet (claimed alone, handed off to the one that does), is held for what its
// settlement moves.
func TestAnUptoPaymentHeldAtItsMaximumSettlesForLessWithItsClaimInTheHoldsBatch(t *testing.T) {
	dsn := pgtest.Shared(t)
	fx, engines, _ := sharedEnginesOn(t, dsn, 2, 2*time.Second, fixtureOpts{wallets: 4, receiptTimeout: time.Minute,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(price * 3 / 2))}})
	waitLeases(t, fx, engines, 2, 2)
	a, b := engines[0], engines[1]
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	sellerBefore := fx.c.TokenBalance(fx.payTo)

	held := fx.permit2(payer, fx.uptoRequirements(b.LeasedWallets(fx.net)[0]), chain.Permit2Options{})
	if v, err := b.VerifyAndHold(context.Background(), held); err != nil || !v.IsValid {
		t.Fatalf("verify and hold at the maximum = %+v, %v; want valid", v, err)
	}
	if amount, err := holdAmount(dsn, permit2ID(fx, held)); err != nil || amount != strconv.Itoa(price) {
		t.Fatalf("the served payment's hold = %q, %v; want its maximum, %d", amount, err, price)
	}
	resp, err := b.Settle(context.Background(), settleFor(held, price/2))
	if err != nil || !resp.Success || resp.Amount != strconv.Itoa(price/2) {
		t.Fatalf("settle for half the maximum = %+v, %v; want a success of %d", resp, err, price/2)
	}
	if amount, err := holdAmount(dsn, permit2ID(fx, held)); err != nil || amount != strconv.Itoa(price) {
		t.Fatalf("the hold after the settlement = %q, %v; want it kept at the maximum, %d, until it is seen mined", amount, err, price)
	}
	if mined, err := holdMined(dsn, permit2ID(fx, held)); err != nil || mined == "0" || mined == "" {
		t.Fatalf("the hold after the settlement's receipt = %q, %v; want it ended as mined", mined, err)
	}

	fresh := fx.permit2(payer, fx.uptoRequirements(b.LeasedWallets(fx.net)[0]), chain.Permit2Options{})
	if resp, err := a.Settle(context.Background(), settleFor(fresh, price/4)); err != nil || !resp.Success {
		t.Fatalf("settle for a quarter of a payment never held, handed off = %+v, %v; want a success", resp, err)
	}
	if amount, err := holdAmount(dsn, permit2ID(fx, fresh)); err != nil || amount != strconv.Itoa(price/4) {
		t.Fatalf("the hold of a payment never held, settled for a quarter = %q, %v; want %d", amount, err, price/4)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != price/2+price/4 {
		t.Fatalf("the seller received %s, want %d", got, price/2+price/4)
	}
	if n := fx.c.CountTokenTransfers(payer.Address, fx.payTo); n != 2 {
		t.Fatalf("%d transfers from the payer, want 2", n)
	}
}

// holdAmount reads the amount of payment id's funds hold: "" when there is none.
func holdAmount(dsn string, id journal.ID) (string, error) {
	var amount string
	err := query(dsn, func(ctx context.Context, conn *pgx.Conn) error {
		err := conn.QueryRow(ctx, `SELECT amount::text FROM x402_holds WHERE id = $1`, id[:]).Scan(&amount)
		if errors.Is(err, pgx.ErrNoRows) {
			amount, err = "", nil
		}
		return err
	})
	return amount, err
}

// TestEnginesSharingHoldsSendNothingForWhatTheirSignedWriteFoundThePayersFundsShortOf: engines sharing one
// PostgreSQL journal write a settlement's claim and hold with the record of its signed transaction
// (journal.HoldClaimAndSign). A payer with funds for two payments settles four at once on two engines, before any
// block: each engine checked the funds at the same read, so the holds decide in the database. Two are sent and
// settle; two are refused insufficient_funds with no transaction, the signed transactions their writes refused
// never sent (the wallets sent two in all, every one mined), and no record or hold of theirs left behind.
func TestEnginesSharingHoldsSendNothingForWhatTheirSignedWriteFoundThePayersFundsShortOf(t *testing.T) {
	dsn := pgtest.Shared(t)
	const amount = 1_000_000
	fx, engines, _ := sharedEnginesOn(t, dsn, 2, 3*time.Second, fixtureOpts{wallets: 4, autoCommit: -1, receiptTimeout: 30 * time.Second,
		chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(2 * amount))}})
	waitLeases(t, fx, engines, 2, 2)
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	rq.Amount = big.NewInt(amount).String()
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	sent := func() (n uint64) {
		for _, s := range fx.sentByWallets() {
			n += s
		}
		return n
	}
	sentBefore := sent()
	answers := make(chan x402.SettleResponse, 4)
	var reqs []x402.VerifyRequest
	var wg sync.WaitGroup
	for i := range 4 {
		req := fx.permit2(payer, rq, chain.Permit2Options{})
		reqs = append(reqs, req)
		wg.Go(func() {
			resp, err := engines[i%2].Settle(context.Background(), req)
			if err != nil {
				t.Errorf("settle %d: %v", i, err)
			}
			answers <- resp
		})
	}
	// Nothing is mined until every settlement has been sent or refused.
	var refused []x402.SettleResponse
	for deadline := time.Now().Add(30 * time.Second); len(refused) < 2 || sent()-sentBefore < 2; {
		if time.Now().After(deadline) {
			t.Fatalf("after 30s: %d answered, %d sent; want 2 refused and 2 sent", len(refused), sent()-sentBefore)
		}
		select {
		case resp := <-answers:
			refused = append(refused, resp)
		case <-time.After(5 * time.Millisecond):
		}
	}
	for _, resp := range refused {
		if resp.Success || resp.ErrorReason != x402.ReasonInsufficientFunds || resp.Transaction != "" {
			t.Errorf("a settlement beyond the payer's funds answered %+v; want insufficient_funds and no transaction", resp)
		}
	}
	fx.c.Commit()
	wg.Wait()
	close(answers)
	txs := map[string]bool{}
	for resp := range answers {
		if !resp.Success {
			t.Errorf("a settlement within the payer's funds answered %+v", resp)
		}
		txs[resp.Transaction] = true
	}
	if len(txs) != 2 {
		t.Errorf("%d distinct transactions settled, want 2", len(txs))
	}
	if got := sent() - sentBefore; got != 2 {
		t.Errorf("the wallets sent %d transactions, want 2 (none refused by its write, none that would revert)", got)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != 2*amount {
		t.Errorf("the seller received %s, want %d", got, 2*amount)
	}
	// The refused left nothing: no record (presented again later, after a top-up, it would settle) and no hold.
	left := 0
	for _, req := range reqs {
		mined, err := holdMined(dsn, permit2ID(fx, req))
		if err != nil {
			t.Fatal(err)
		}
		if mined == "" || mined == "0" {
			left++
			if mined == "0" {
				t.Errorf("a refused payment's hold is still there, unmined")
			}
		}
	}
	if left != 2 {
		t.Errorf("%d payments have no mined hold; want the 2 refused", left)
	}
}
