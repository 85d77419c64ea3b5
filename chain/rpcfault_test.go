package chain_test

import (
	"context"
	"math/big"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// behindFaultProxy is a fixture tune that puts the network behind a fault proxy in front of the simulated
// chain's RPC, followed by the chain's RPC itself when healthy is set: a Failover of a faulty endpoint and
// perhaps a healthy one. rpcTimeout is the network's per-call timeout (zero: the default). The proxy is set
// into *proxy.
func behindFaultProxy(t *testing.T, proxy **chaintest.FaultProxy, healthy bool, rpcTimeout time.Duration) func(*fixture, *chain.NetworkConfig) {
	return func(fx *fixture, nc *chain.NetworkConfig) {
		c := fx.c
		*proxy = chaintest.NewFaultProxy(t, c.RPCURL)
		names, backends := []string{"faulty"}, []chain.Backend{dial(t, (*proxy).URL)}
		if healthy {
			names, backends = append(names, "healthy"), append(backends, dial(t, c.RPCURL))
		}
		fo, err := chain.NewFailover(names, backends)
		if err != nil {
			t.Fatal(err)
		}
		nc.Backend, nc.RPCTimeout = fo, rpcTimeout
	}
}

// mixedPayments signs n payments spread over the payers: permit2, with one erc2612 payment per payer while
// payers last (erc2612 permits are nonce-ordered per payer: one each keeps them independent).
func mixedPayments(fx *fixture, n int) []x402.VerifyRequest {
	payers := fx.c.Payers
	fx.approvePermit2(payers...)
	var reqs []x402.VerifyRequest
	for i := range n {
		if i%4 == 3 && i/4 < len(payers) {
			reqs = append(reqs, fx.erc2612(payers[i/4], fx.requirements(x402.TransferERC2612), chain.ERC2612Options{}))
		} else {
			reqs = append(reqs, fx.permit2(payers[i%len(payers)], fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
		}
	}
	return reqs
}

// settledExactlyOnce checks the chain after every payment of reqs answered success in answers: one distinct
// transaction each, the seller richer by exactly their sum, each payer poorer by exactly its payments.
func settledExactlyOnce(t *testing.T, fx *fixture, reqs []x402.VerifyRequest, answers []x402.SettleResponse, sellerBefore *big.Int, payersBefore map[common.Address]*big.Int) {
	t.Helper()
	hashes := map[string]bool{}
	owed := map[common.Address]int64{}
	for i, a := range answers {
		if !a.Success {
			t.Fatalf("payment %d did not settle: %+v", i, a)
		}
		hashes[a.Transaction] = true
		owed[common.HexToAddress(a.Payer)] += price
	}
	if len(hashes) != len(reqs) {
		t.Fatalf("%d distinct settlement transactions for %d payments", len(hashes), len(reqs))
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(int64(len(reqs))*price)) != 0 {
		t.Fatalf("seller received %s, want exactly %d", got, int64(len(reqs))*price)
	}
	for payer, before := range payersBefore {
		if paid := new(big.Int).Sub(before, fx.c.TokenBalance(payer)); paid.Cmp(big.NewInt(owed[payer])) != 0 {
			t.Fatalf("payer %s paid %s, want exactly %d", payer.Hex(), paid, owed[payer])
		}
	}
	if n := fx.c.CountTokenTransfers(zeroAddr, fx.payTo); n != len(reqs) {
		t.Fatalf("%d transfers reached the seller, want %d", n, len(reqs))
	}
}

func tokenBalances(fx *fixture) map[common.Address]*big.Int {
	out := map[common.Address]*big.Int{}
	for _, p := range fx.c.Payers {
		out[p.Address] = fx.c.TokenBalance(p.Address)
	}
	return out
}

// returnsWithin runs op and reports whether it returned within d. An op that does not is left running: the
// fault proxy's cleanup ends the requests it hangs, so the test still stops.
func returnsWithin(d time.Duration, op func()) bool {
	done := make(chan struct{})
	go func() { defer close(done); op() }()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// p99 is the 99th percentile of ds.
func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)*99+99)/100-1]
}

func TestOneHangingRPCEndpointLeavesVerificationsAndSettlementsFlowingThroughTheHealthyOne(t *testing.T) {
	const rpcTimeout = 500 * time.Millisecond
	var proxy *chaintest.FaultProxy
	tune := behindFaultProxy(t, &proxy, true, rpcTimeout)
	fx := newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithPromptCommit()}, receiptTimeout: 10 * time.Second,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			tune(fx, nc)
			// The hanging node is tried again after short rests, so that payments keep meeting it.
			fo := nc.Backend.(*chain.Failover)
			fo.SetRetryAfterForTest(50*time.Millisecond, 200*time.Millisecond)
			// Payments share reads of the head: one read stuck on the hanging node must not hold up the rest.
			nc.HeadCacheTTL = 250 * time.Millisecond
		},
	})
	reqs := mixedPayments(fx, 64)
	sellerBefore, payersBefore := fx.c.TokenBalance(fx.payTo), tokenBalances(fx)
	proxy.SetDecide(func(string) chaintest.Fault { return chaintest.Hang })

	// An operation is given far longer than the bound, so that a hang shows as a latency, not a test stuck.
	const opLimit = 15 * time.Second
	var (
		mu               sync.Mutex
		verifyL, settleL []time.Duration
		answers          = make([]x402.SettleResponse, len(reqs))
		work             = make(chan int, len(reqs))
		wg               sync.WaitGroup
	)
	for i := range reqs {
		work <- i
	}
	close(work)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				ctx, cancel := context.WithTimeout(context.Background(), opLimit)
				start := time.Now()
				var v x402.VerifyResponse
				var err error
				if !returnsWithin(opLimit+5*time.Second, func() { v, err = fx.f.Verify(ctx, reqs[i]) }) {
					t.Errorf("payment %d: verify still running after %v", i, opLimit+5*time.Second)
					cancel()
					return
				}
				took := time.Since(start)
				mu.Lock()
				verifyL = append(verifyL, took)
				mu.Unlock()
				if err != nil || !v.IsValid {
					t.Errorf("payment %d: verify after %v: %+v, %v", i, took, v, err)
					cancel()
					continue
				}
				start = time.Now()
				var s x402.SettleResponse
				if !returnsWithin(opLimit+5*time.Second, func() { s, err = fx.f.Settle(ctx, reqs[i]) }) {
					t.Errorf("payment %d: settle still running after %v", i, opLimit+5*time.Second)
					cancel()
					return
				}
				took = time.Since(start)
				cancel()
				mu.Lock()
				settleL = append(settleL, took)
				mu.Unlock()
				if err != nil || !s.Success {
					t.Errorf("payment %d: settle after %v: %+v, %v", i, took, s, err)
					continue
				}
				answers[i] = s
			}
		}()
	}
	wg.Wait()
	hung := proxy.Count(chaintest.Hang)
	proxy.SetDecide(nil)
	if t.Failed() {
		t.FailNow()
	}
	// The bound: the per-call timeout on the hanging node, plus what the healthy node takes, with room for a
	// loaded machine (2s, and a second timeout: a settlement may probe the hanging node itself and wait for a
	// receipt the watcher's probe delayed). Without per-call deadlines a payment waits as long as its caller.
	bound := 2*rpcTimeout + 2*time.Second
	t.Logf("%d calls hung; verify p99 %v (max %v), settle p99 %v (max %v); bound %v", hung,
		p99(verifyL), slices.Max(verifyL), p99(settleL), slices.Max(settleL), bound)
	if hung == 0 {
		t.Fatal("no call reached the hanging endpoint: the test proves nothing")
	}
	if p99(verifyL) > bound || p99(settleL) > bound {
		t.Errorf("p99 latency verify %v, settle %v: over the bound %v of one per-call timeout (%v) and a healthy call",
			p99(verifyL), p99(settleL), bound, rpcTimeout)
	}
	settledExactlyOnce(t, fx, reqs, answers, sellerBefore, payersBefore)
}

func TestAHangingOnlyRPCEndpointIsAnsweredUnreachableWithinTheTimeout(t *testing.T) {
	const rpcTimeout = 500 * time.Millisecond
	var proxy *chaintest.FaultProxy
	fx := newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithPromptCommit()}, receiptTimeout: 5 * time.Second,
		tune: behindFaultProxy(t, &proxy, false, rpcTimeout),
	})
	reqs := mixedPayments(fx, 4)
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	proxy.SetDecide(func(string) chaintest.Fault { return chaintest.Hang })

	// A verification or settlement reads the head block, then asks the chain about the payment, before it knows
	// the chain cannot be asked: two calls, each bounded by the per-call timeout (a call the node let time out
	// is not retried); the caller's deadline is far later.
	bound := 2*rpcTimeout + time.Second
	for i, req := range reqs {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		start := time.Now()
		var v x402.VerifyResponse
		var err error
		if !returnsWithin(25*time.Second, func() { v, err = fx.f.Verify(ctx, req) }) {
			t.Fatalf("payment %d: verify hangs with the node", i)
		}
		took := time.Since(start)
		cancel()
		if !x402.IsUnreachable(err) || took > bound {
			t.Errorf("payment %d: verify answered %+v, %v after %v; want unreachable within %v", i, v, err, took, bound)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 20*time.Second)
		start = time.Now()
		var s x402.SettleResponse
		if !returnsWithin(25*time.Second, func() { s, err = fx.f.Settle(ctx, req) }) {
			t.Fatalf("payment %d: settle hangs with the node", i)
		}
		took = time.Since(start)
		cancel()
		if !x402.IsUnreachable(err) || took > bound {
			t.Errorf("payment %d: settle answered %+v, %v after %v; want unreachable within %v", i, s, err, took, bound)
		}

	}
	proxy.SetDecide(nil)
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(sellerBefore) != 0 {
		t.Fatalf("the seller's balance moved from %s to %s though nothing was settled", sellerBefore, got)
	}
	// The node back, the same payments settle, once each.
	payersBefore := tokenBalances(fx)
	answers := make([]x402.SettleResponse, len(reqs))
	for i, req := range reqs {
		answers[i], _ = settleUntilFinal(t, fx.f, req, time.Now().Add(30*time.Second))
	}
	settledExactlyOnce(t, fx, reqs, answers, sellerBefore, payersBefore)
}

func TestTransientRPCErrorsAreRetriedBeforeAPaymentIsRefused(t *testing.T) {
	var proxy *chaintest.FaultProxy
	fx := newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithPromptCommit()}, receiptTimeout: 10 * time.Second,
		tune: behindFaultProxy(t, &proxy, false, 0),
	})
	reqs := mixedPayments(fx, 40)
	sellerBefore, payersBefore := fx.c.TokenBalance(fx.payTo), tokenBalances(fx)
	proxy.SetDecide(chaintest.Random(0.08, []chaintest.Fault{chaintest.ErrorStatus, chaintest.RPCError}))

	answers := make([]x402.SettleResponse, len(reqs))
	work := make(chan int, len(reqs))
	for i := range reqs {
		work <- i
	}
	close(work)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				v, err := fx.f.Verify(ctx, reqs[i])
				if err != nil || !v.IsValid {
					t.Errorf("payment %d refused at verification for a hiccup of the node: %+v, %v", i, v, err)
					cancel()
					continue
				}
				// A pending answer may be presented again; a refusal or an error may not happen at all.
				for try := 0; try < 5; try++ {
					s, err := fx.f.Settle(ctx, reqs[i])
					if err != nil || (!s.Success && !s.Pending()) {
						t.Errorf("payment %d refused at settlement for a hiccup of the node: %+v, %v", i, s, err)
						break
					}
					if s.Success {
						answers[i] = s
						break
					}
				}
				cancel()
			}
		}()
	}
	wg.Wait()
	proxy.SetDecide(nil)
	t.Logf("faults injected: 503 %d, rpc error %d", proxy.Count(chaintest.ErrorStatus), proxy.Count(chaintest.RPCError))
	if proxy.Count(chaintest.ErrorStatus)+proxy.Count(chaintest.RPCError) == 0 {
		t.Fatal("no fault was injected: the test proves nothing")
	}
	if t.Failed() {
		t.FailNow()
	}
	settledExactlyOnce(t, fx, reqs, answers, sellerBefore, payersBefore)
}

func TestABroadcastTheOnlyNodeRefusesIsAnsweredNotSentAndNeverSentLater(t *testing.T) {
	// The write-ahead record of a broadcast every node refused goes (journal.ReleaseUnsent): kept, reconciliation
	// would send it once the node takes transactions again, after the payer was told nothing was sent.
	var proxy *chaintest.FaultProxy
	fx := newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithPromptCommit()}, receiptTimeout: 2 * time.Second,
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery, cfg.ReconcileGrace = 100*time.Millisecond, 100*time.Millisecond
		},
		tune: behindFaultProxy(t, &proxy, false, 0),
	})
	reqs := mixedPayments(fx, 8)
	sellerBefore, payersBefore := fx.c.TokenBalance(fx.payTo), tokenBalances(fx)
	proxy.SetDecide(func(string) chaintest.Fault { return chaintest.Refuse })
	for i, req := range reqs {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		s, err := fx.f.Settle(ctx, req)
		cancel()
		// Nothing was sent and nothing is wrong with the payment: not a refusal (the payer would pay again) but
		// the facilitator unable to settle it now (present the same payment again).
		if !x402.IsUnreachable(err) {
			t.Fatalf("payment %d: a settlement the node refused answered %+v, %v; want an unreachable error", i, s, err)
		}
	}
	if proxy.Count(chaintest.Refuse) == 0 {
		t.Fatal("no broadcast was refused: the test proves nothing")
	}
	// The node takes transactions again. Nothing was sent, so nothing may be sent now by anyone but a payer
	// presenting the payment again: reconciliation passes by many times meanwhile.
	proxy.SetDecide(nil)
	time.Sleep(time.Second)
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(sellerBefore) != 0 {
		t.Fatalf("a settlement answered not sent was sent later: the seller's balance moved from %s to %s", sellerBefore, got)
	}
	answers := make([]x402.SettleResponse, len(reqs))
	for i, req := range reqs {
		answers[i], _ = settleUntilFinal(t, fx.f, req, time.Now().Add(30*time.Second))
	}
	settledExactlyOnce(t, fx, reqs, answers, sellerBefore, payersBefore)
}

// sendRawFault is a fault policy that gives every eth_sendRawTransaction fault f and passes everything else.
func sendRawFault(f chaintest.Fault) func(string) chaintest.Fault {
	return func(method string) chaintest.Fault {
		if method == "eth_sendRawTransaction" {
			return f
		}
		return chaintest.Pass
	}
}

// A settlement whose broadcast fails is never answered as refused, whichever way it fails: a refusal tells the
// payer to pay again, and the payment is good. Each way eth_sendRawTransaction can fail, through the only node's
// fault proxy:
//   - the node may have received the transaction (the connection cut after the request went out, or no answer
//     in time), or cannot be known not to have (503, the connection closed before forwarding: from the sender's
//     side a proxy's 503 or a reset looks the same whether or not the node behind got the request): the signed
//     transaction stays in the journal, its nonce spent, and the answer is its success or settlement_pending
//     with its hash; reconciliation sends the same bytes again once the node takes them, so it settles once,
//     with that very transaction;
//   - the node answered and refused it (here "insufficient funds for gas"): it is surely not sent, its
//     write-ahead record goes so that nothing sends it later, and the answer is an unreachable error (present
//     the same payment again), not unexpected_settle_error; presented again, it settles, once.
func TestABroadcastThatFailsIsNeverAnsweredRefusedAndSettlesOnce(t *testing.T) {
	ways := []struct {
		name  string
		fault chaintest.Fault
		// sent: the answer names the transaction (success or pending), which is the one that settles; else
		// the answer is an unreachable error and nothing is sent until the payment is presented again.
		sent bool
	}{
		{"the node refuses it", chaintest.Refuse, false},
		{"503 before the node", chaintest.ErrorStatus, true},
		{"the connection closed before the node", chaintest.Drop, true},
		{"no answer in time", chaintest.Hang, true},
		{"the answer lost after the node took it", chaintest.DieAfterForward, true},
	}
	for _, way := range ways {
		t.Run(way.name, func(t *testing.T) {
			var proxy *chaintest.FaultProxy
			fx := newFixture(t, fixtureOpts{
				chainOpts: []chaintest.Option{chaintest.WithHTTP(), chaintest.WithPromptCommit()}, receiptTimeout: 2 * time.Second,
				configure: func(cfg *chain.Config) {
					cfg.ReconcileEvery, cfg.ReconcileGrace = 100*time.Millisecond, 100*time.Millisecond
				},
				tune: behindFaultProxy(t, &proxy, false, 500*time.Millisecond),
			})
			payer := fx.c.Payers[0]
			fx.approvePermit2(payer)
			req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
			payerBefore, sellerBefore, sentBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo), fx.walletTxs()

			proxy.SetDecide(sendRawFault(way.fault))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			resp, err := fx.f.Settle(ctx, req)
			cancel()
			if proxy.Count(way.fault) == 0 {
				t.Fatal("no broadcast met the fault: the test proves nothing")
			}
			var tx string
			switch {
			case err == nil && !resp.Success && !resp.Pending():
				t.Fatalf("a broadcast that failed (%s) was answered refused: %+v; the payer would pay again for a good payment", way.name, resp)
			case way.sent && err != nil:
				t.Fatalf("a broadcast the node may hold answered %v; want its success or settlement_pending with its transaction", err)
			case way.sent:
				if tx = resp.Transaction; tx == "" {
					t.Fatalf("answer %+v names no transaction", resp)
				}
			case err == nil:
				t.Fatalf("a broadcast the node refused answered %+v; want an unreachable error: nothing was sent", resp)
			case !x402.IsUnreachable(err):
				t.Fatalf("a broadcast the node refused answered %v; want an unreachable error", err)
			}
			t.Logf("answered %+v, %v", resp, err)

			// The node takes transactions again. Reconciliation passes many times meanwhile: what may have been
			// sent goes out (the same bytes), what was surely not sent stays unsent.
			proxy.SetDecide(nil)
			time.Sleep(time.Second)
			sent, _ := fx.sentSince(sentBefore)
			if want := map[bool]int{true: 1, false: 0}[way.sent]; sent != want {
				t.Fatalf("the settlement wallets sent %d transactions once the node was back, before the payment was presented again; want %d", sent, want)
			}

			final, seen := settleUntilFinal(t, fx.f, req, time.Now().Add(30*time.Second))
			if !final.Success {
				t.Fatalf("the same payment presented again did not settle: %+v (answers %v)", final, seen)
			}
			if tx != "" && final.Transaction != tx {
				t.Errorf("settled by %s, not by the transaction first answered (%s)", final.Transaction, tx)
			}
			time.Sleep(200 * time.Millisecond) // blocks are sealed at once: anything else sent would be mined
			if sent, _ := fx.sentSince(sentBefore); sent != 1 {
				t.Errorf("the settlement wallets sent %d transactions, want 1", sent)
			}
			if paid := new(big.Int).Sub(payerBefore, fx.c.TokenBalance(payer.Address)); paid.Int64() != price {
				t.Errorf("the payer paid %s, want %d", paid, price)
			}
			if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Int64() != price {
				t.Errorf("the seller received %s, want %d", got, price)
			}
		})
	}
}
