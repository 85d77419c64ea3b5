package chain_test

import (
	"context"
	"math/big"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// settleUntilFinal presents one payment again and again, as a patient gateway would, until it settles. Every
// answer on the way must be one a payer can act on: settled, pending with a transaction, or the facilitator
// unreachable (nothing sent, or its outcome unknown: present the payment again), never a refusal of the good
// payment; and it must come by the caller's deadline (with room for a loaded machine), whatever the node does. It returns the final answer and the answers seen.
func settleUntilFinal(t *testing.T, f *chain.Facilitator, req x402.VerifyRequest, deadline time.Time) (x402.SettleResponse, []string) {
	const perCall, slack = 5 * time.Second, 5 * time.Second
	var seen []string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), perCall)
		var resp x402.SettleResponse
		var err error
		if !returnsWithin(perCall+slack, func() { resp, err = f.Settle(ctx, req) }) {
			cancel()
			t.Errorf("a settlement given %v is still running %v later; answers before: %v", perCall, slack, seen)
			return x402.SettleResponse{}, seen
		}
		cancel()
		switch {
		case err != nil:
			if !x402.IsUnreachable(err) {
				t.Errorf("settle error %v is not marked unreachable", err)
			}
			seen = append(seen, "unreachable")
		case resp.Success:
			return resp, append(seen, "settled")
		case resp.Pending():
			if resp.Transaction == "" {
				t.Errorf("a pending answer without its transaction: %+v", resp)
			}
			seen = append(seen, "pending")
		default:
			t.Errorf("unexpected answer under faults: %+v", resp)
			return resp, seen
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Errorf("payment not settled before the deadline; answers: %v", seen)
	return x402.SettleResponse{}, seen
}

func TestSettlementsThroughAFaultyRPCSettleEachPaymentExactlyOnce(t *testing.T) {
	faults := []chaintest.Fault{chaintest.Drop, chaintest.DieAfterForward, chaintest.Delay, chaintest.ErrorStatus, chaintest.RPCError}
	withHangs := append(slices.Clone(faults), chaintest.Hang)
	everyFault := append(slices.Clone(withHangs), chaintest.Refuse)
	cases := []struct {
		name      string
		failover  bool // a healthy second endpoint behind the faulty one
		rate      float64
		onlySends bool
		faults    []chaintest.Fault
		// rpcTimeout is the per-call timeout, what a hung call costs (zero: the default); far less than a
		// settlement's time, so that hangs are many, and far more than a healthy call on a loaded machine.
		rpcTimeout time.Duration
	}{
		{"one endpoint, 30% faults on every call", false, 0.3, false, faults, 0},
		{"one endpoint, every other broadcast lost or cut", false, 0.5, true, faults, 0},
		{"failover to a healthy endpoint, 50% faults", true, 0.5, false, faults, 0},
		{"one endpoint, 30% faults on every call, hangs among them", false, 0.3, false, withHangs, time.Second},
		{"one endpoint, every other broadcast hung or refused", false, 0.5, true, []chaintest.Fault{chaintest.Hang, chaintest.Refuse}, time.Second},
		{"failover to a healthy endpoint, 50% faults, hangs and refusals among them", true, 0.5, false, everyFault, time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var proxy *chaintest.FaultProxy
			fx := newFixture(t, fixtureOpts{
				chainOpts: []chaintest.Option{chaintest.WithHTTP()}, receiptTimeout: time.Second,
				configure: func(cfg *chain.Config) {
					cfg.ReconcileEvery, cfg.ReconcileGrace = 200*time.Millisecond, 300*time.Millisecond
				},
				tune: func(fx *fixture, nc *chain.NetworkConfig) {
					c := fx.c
					proxy = chaintest.NewFaultProxy(t, c.RPCURL)
					names, backends := []string{"faulty"}, []chain.Backend{dial(t, proxy.URL)}
					if tc.failover {
						names, backends = append(names, "healthy"), append(backends, dial(t, c.RPCURL))
					}
					fo, err := chain.NewFailover(names, backends)
					if err != nil {
						t.Fatal(err)
					}
					fo.SetRetryAfterForTest(20*time.Millisecond, 200*time.Millisecond)
					nc.Backend, nc.RPCTimeout = fo, tc.rpcTimeout
				},
			})
			payers := fx.c.Payers
			fx.approvePermit2(payers...)
			var reqs []x402.VerifyRequest
			for i := range 24 {
				method := x402.TransferPermit2
				var req x402.VerifyRequest
				if i%4 == 3 && i/4 < len(payers) {
					// erc2612 permits are nonce-ordered per payer: one per payer keeps them independent.
					method = x402.TransferERC2612
					req = fx.erc2612(payers[i/4%len(payers)], fx.requirements(method), chain.ERC2612Options{})
				} else {
					req = fx.permit2(payers[i%len(payers)], fx.requirements(method), chain.Permit2Options{})
				}
				reqs = append(reqs, req)
			}
			sellerBefore := fx.c.TokenBalance(fx.payTo)
			var prefixes []string
			if tc.onlySends {
				prefixes = []string{"eth_sendRawTransaction"}
			}
			proxy.SetDecide(chaintest.Random(tc.rate, tc.faults, prefixes...))

			deadline := time.Now().Add(60 * time.Second)
			answers := make([]x402.SettleResponse, len(reqs))
			var mu sync.Mutex
			outcomes := map[string]int{}
			var wg sync.WaitGroup
			for i := range reqs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					a, seen := settleUntilFinal(t, fx.f, reqs[i], deadline)
					answers[i] = a
					mu.Lock()
					for _, s := range seen {
						outcomes[s]++
					}
					mu.Unlock()
				}()
			}
			wg.Wait()
			proxy.SetDecide(nil)
			t.Logf("answers on the way: %v; faults injected: drop %d, cut after forward %d, delay %d, 503 %d, rpc error %d, hang %d, refuse %d",
				outcomes, proxy.Count(chaintest.Drop), proxy.Count(chaintest.DieAfterForward), proxy.Count(chaintest.Delay),
				proxy.Count(chaintest.ErrorStatus), proxy.Count(chaintest.RPCError), proxy.Count(chaintest.Hang), proxy.Count(chaintest.Refuse))

			hashes := map[string]bool{}
			for i, a := range answers {
				if !a.Success {
					t.Fatalf("payment %d never settled", i)
				}
				hashes[a.Transaction] = true
			}
			if len(hashes) != len(reqs) {
				t.Fatalf("%d distinct settlement transactions for %d payments", len(hashes), len(reqs))
			}
			if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(int64(len(reqs))*price)) != 0 {
				t.Fatalf("seller received %s, want exactly %d", got, int64(len(reqs))*price)
			}
			if n := fx.c.CountTokenTransfers(zeroAddr, fx.payTo); n != len(reqs) {
				t.Fatalf("%d transfers reached the seller, want %d", n, len(reqs))
			}
		})
	}
}

func dial(t *testing.T, url string) *ethclient.Client {
	t.Helper()
	c, err := ethclient.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// zeroAddr matches any address in chaintest's transfer queries.
var zeroAddr common.Address
