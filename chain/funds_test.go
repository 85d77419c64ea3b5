package chain_test

import (
	"context"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// countingBackend counts the eth_calls the facilitator makes.
type countingBackend struct {
	chain.Backend
	calls atomic.Int64
}

func (b *countingBackend) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	b.calls.Add(1)
	return b.Backend.CallContract(ctx, msg, block)
}

// testClock is a wall clock a test can move forward.
type testClock struct{ skew atomic.Int64 }

func (c *testClock) now() time.Time          { return time.Now().Add(time.Duration(c.skew.Load())) }
func (c *testClock) advance(d time.Duration) { c.skew.Add(int64(d)) }

// fundsFixture is a facilitator whose payer 0 has approved Permit2 and holds exactly `payments` payments of
// `amount`; payments are of that amount.
type fundsFixture struct {
	*fixture
	backend *countingBackend
	clock   *testClock
	payer   *chaintest.Account
	rq      x402.PaymentRequirements
}

func newFundsFixture(t *testing.T, payments int64, ttl time.Duration, autoCommit time.Duration) *fundsFixture {
	t.Helper()
	const amount = 1_000_000
	ff := &fundsFixture{clock: &testClock{}}
	ff.fixture = newFixture(t, fixtureOpts{
		autoCommit:     autoCommit,
		receiptTimeout: 30 * time.Second,
		chainOpts:      []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(payments * amount))},
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			ff.backend = &countingBackend{Backend: nc.Backend}
			nc.Backend, nc.FundsCacheTTL = ff.backend, ttl
		},
		configure: func(cfg *chain.Config) { cfg.Now = ff.clock.now },
	})
	ff.payer = ff.c.Payers[0]
	ff.approvePermit2(ff.payer)
	ff.rq = ff.requirements(x402.TransferPermit2)
	ff.rq.Amount = big.NewInt(amount).String()
	return ff
}

func (ff *fundsFixture) pay() x402.VerifyRequest {
	return ff.permit2(ff.payer, ff.rq, chain.Permit2Options{})
}

// sent is how many transactions the settlement wallets have sent, including those still in the pool.
func (ff *fundsFixture) sent() uint64 {
	var n uint64
	for _, s := range ff.sentByWallets() {
		n += s
	}
	return n
}

// Settlements waiting in the node's pool are counted against the payer: with funds for three payments and five
// settled at once before any block, three are sent and two are refused before any gas is spent, instead of five
// sent and two reverting on chain.
func TestSettlementsInFlightAreCountedAgainstThePayersBalance(t *testing.T) {
	ff := newFundsFixture(t, 3, 0, -1)
	sellerBefore, sentBefore := ff.c.TokenBalance(ff.payTo), ff.sent()
	answers := make(chan x402.SettleResponse, 5)
	var wg sync.WaitGroup
	for range 5 {
		req := ff.pay()
		wg.Go(func() {
			resp, err := ff.f.Settle(context.Background(), req)
			if err != nil {
				t.Errorf("settle: %v", err)
			}
			answers <- resp
		})
	}
	// Nothing is mined until every settlement has been sent or refused.
	var refused []x402.SettleResponse
	for deadline := time.Now().Add(20 * time.Second); len(refused) < 2 || ff.sent()-sentBefore < 3; {
		if time.Now().After(deadline) {
			t.Fatalf("after 20s: %d refused, %d sent; want 2 and 3", len(refused), ff.sent()-sentBefore)
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
	ff.c.Commit()
	wg.Wait()
	close(answers)
	txs := map[string]bool{}
	for resp := range answers {
		if !resp.Success {
			t.Errorf("a settlement within the payer's funds answered %+v", resp)
		}
		txs[resp.Transaction] = true
	}
	if len(txs) != 3 {
		t.Errorf("%d distinct transactions settled, want 3", len(txs))
	}
	if got := ff.sent() - sentBefore; got != 3 {
		t.Errorf("the wallets sent %d transactions, want 3 (none that would revert)", got)
	}
	if got := new(big.Int).Sub(ff.c.TokenBalance(ff.payTo), sellerBefore); got.Cmp(big.NewInt(3_000_000)) != 0 {
		t.Errorf("the seller received %s, want 3000000", got)
	}
	if got := ff.c.TokenBalance(ff.payer.Address); got.Sign() != 0 {
		t.Errorf("the payer kept %s, want 0", got)
	}
}

// A payer's first payment is checked by the simulation alone; a repeat payer's funds are read once, and that
// fresh read answers the verification of the payer's next payments without a chain call. A payment the journal
// knows, and any payment once the read is older than the cache's TTL, go to the chain.
func TestVerifyingFromAFreshReadAsksTheChainOnlyForTheNonce(t *testing.T) {
	ff := newFundsFixture(t, 10, 2*time.Second, 0)
	first := ff.pay()
	before := ff.backend.calls.Load()
	if v := ff.verify(first); !v.IsValid {
		t.Fatalf("first payment: %+v", v)
	}
	if n := ff.backend.calls.Load() - before; n != 1 {
		t.Fatalf("the first payment of a payer made %d chain calls, want 1 (the simulation: a one-off payer is not worth a read)", n)
	}
	before = ff.backend.calls.Load()
	if v := ff.verify(ff.pay()); !v.IsValid {
		t.Fatalf("second payment: %+v", v)
	}
	if n := ff.backend.calls.Load() - before; n != 3 {
		t.Fatalf("the second payment of a payer made %d chain calls, want 3 (the simulation, then balance and allowance)", n)
	}

	before = ff.backend.calls.Load()
	for range 5 {
		if v := ff.verify(ff.pay()); !v.IsValid {
			t.Fatalf("a later payment: %+v", v)
		}
	}
	if n := ff.backend.calls.Load() - before; n != 5 {
		t.Errorf("5 later payments of the same payer made %d chain calls, want 5 (one nonce read each)", n)
	}

	// A nonce the payer spent elsewhere (here its own invalidateUnorderedNonces) is refused, though the funds
	// read covers the payment: the funds read knows nothing of nonces.
	nonce := chaintest.RandomNonce()
	word, bit := new(big.Int).Rsh(nonce, 8), new(big.Int).And(nonce, big.NewInt(0xff))
	data, err := contracts.Permit2ABI.Pack("invalidateUnorderedNonces", word, new(big.Int).Lsh(big.NewInt(1), uint(bit.Uint64())))
	ff.transact(ff.payer, contracts.Permit2Address, data, err)
	spent := ff.permit2(ff.payer, ff.rq, chain.Permit2Options{Nonce: nonce})
	if v := ff.verify(spent); v.IsValid || v.InvalidReason != x402.ReasonPermit2InvalidNonce {
		t.Errorf("a payment whose nonce the payer spent, its funds fresh in the cache: %+v; want %s", v, x402.ReasonPermit2InvalidNonce)
	}
	if v, err := ff.f.VerifyAndHold(context.Background(), spent); err != nil || v.IsValid || v.InvalidReason != x402.ReasonPermit2InvalidNonce {
		t.Errorf("the same payment verified to be held: %+v, %v; want %s", v, err, x402.ReasonPermit2InvalidNonce)
	}

	if s := ff.settle(first); !s.Success {
		t.Fatalf("settling the first payment: %+v", s)
	}
	before = ff.backend.calls.Load()
	if v := ff.verify(first); v.IsValid || v.InvalidReason != x402.ReasonPermit2InvalidNonce {
		t.Errorf("the settled payment verified again: %+v; want permit2_invalid_nonce from the chain", v)
	}
	if ff.backend.calls.Load() == before {
		t.Error("a payment the journal knows was answered without asking the chain")
	}

	ff.clock.advance(3 * time.Second)
	before = ff.backend.calls.Load()
	if v := ff.verify(ff.pay()); !v.IsValid {
		t.Fatalf("a payment after the read went stale: %+v", v)
	}
	if ff.backend.calls.Load() == before {
		t.Error("a payment was answered from a read older than the TTL")
	}
}

// VerifyAndHold holds what a gate serves before settling: a payer with funds for three payments is not served a
// fourth until one of the three is let go, plain verification counts the holds too, and the held payments settle.
func TestHeldPaymentsLimitWhatAPayerIsServedBeforeSettling(t *testing.T) {
	for _, ttl := range []time.Duration{2 * time.Second, -1} {
		t.Run("ttl="+ttl.String(), func(t *testing.T) {
			ff := newFundsFixture(t, 3, ttl, 0)
			ctx := context.Background()
			sellerBefore, sentBefore := ff.c.TokenBalance(ff.payTo), ff.sent()
			reqs := []x402.VerifyRequest{ff.pay(), ff.pay(), ff.pay(), ff.pay()}
			for i, req := range reqs[:3] {
				if v, err := ff.f.VerifyAndHold(ctx, req); err != nil || !v.IsValid {
					t.Fatalf("payment %d within the payer's funds: %+v, %v", i, v, err)
				}
			}
			v, err := ff.f.VerifyAndHold(ctx, reqs[3])
			if err != nil || v.IsValid || v.InvalidReason != x402.ReasonInsufficientFunds {
				t.Fatalf("a fourth payment beyond the payer's funds: %+v, %v; want insufficient_funds", v, err)
			}
			if v := ff.verify(reqs[3]); v.IsValid {
				t.Errorf("plain verification of the fourth ignored the holds: %+v", v)
			}
			ff.f.Release(reqs[2])
			if v, err := ff.f.VerifyAndHold(ctx, reqs[3]); err != nil || !v.IsValid {
				t.Fatalf("the fourth payment once the third was let go: %+v, %v", v, err)
			}
			for _, i := range []int{0, 1, 3} {
				if s := ff.settle(reqs[i]); !s.Success {
					t.Fatalf("settling held payment %d: %+v", i, s)
				}
			}
			if s := ff.settle(reqs[2]); s.Success || s.ErrorReason != x402.ReasonPermit2SimulationFailed && s.ErrorReason != x402.ReasonInsufficientFunds {
				t.Errorf("settling the payment let go, with the payer's funds spent: %+v; want a refusal", s)
			}
			if got := ff.sent() - sentBefore; got != 3 {
				t.Errorf("the wallets sent %d transactions, want 3", got)
			}
			if got := new(big.Int).Sub(ff.c.TokenBalance(ff.payTo), sellerBefore); got.Cmp(big.NewInt(3_000_000)) != 0 {
				t.Errorf("the seller received %s, want 3000000", got)
			}
		})
	}
}

// The cache answers only for the TTL: a payer who empties the wallet meanwhile may still be verified from the
// read (the documented cost of the cache), but the settlement simulates first and refuses before any gas is
// spent. With the cache off, verification sees the empty wallet at once.
func TestAStaleReadNeverSpendsGas(t *testing.T) {
	for _, tc := range []struct {
		ttl       time.Duration
		wantValid bool
	}{{2 * time.Second, true}, {-1, false}} {
		t.Run("ttl="+tc.ttl.String(), func(t *testing.T) {
			ff := newFundsFixture(t, 3, tc.ttl, 0)
			for range 2 { // a repeat payer, whose funds are read
				if v := ff.verify(ff.pay()); !v.IsValid {
					t.Fatalf("payment before: %+v", v)
				}
			}
			ff.c.TransferToken(ff.payer, common.HexToAddress("0x0000000000000000000000000000000000000b0b"), big.NewInt(3_000_000))
			req := ff.pay()
			if v := ff.verify(req); v.IsValid != tc.wantValid {
				t.Errorf("verification after the payer emptied the wallet: %+v; want valid %v", v, tc.wantValid)
			}
			sentBefore := ff.sent()
			if s := ff.settle(req); s.Success || s.Transaction != "" {
				t.Errorf("settling from an emptied wallet: %+v; want a refusal with no transaction", s)
			}
			if got := ff.sent() - sentBefore; got != 0 {
				t.Errorf("the wallets sent %d transactions for a payment the payer cannot pay", got)
			}
		})
	}
}

// Holds end: a settled payment's hold is gone once a read reflects its block, so a payer who tops up after
// spending everything is served again.
func TestHoldsEndWhenTheChainReflectsTheSettlement(t *testing.T) {
	ff := newFundsFixture(t, 1, 2*time.Second, 0)
	if s := ff.settle(ff.pay()); !s.Success {
		t.Fatalf("settle: %+v", s)
	}
	if v := ff.verify(ff.pay()); v.IsValid || v.InvalidReason == "" {
		t.Fatalf("a payment beyond the spent funds: %+v", v)
	}
	ff.c.Mint(ff.payer.Address, big.NewInt(2_000_000))
	for i := range 2 {
		if s := ff.settle(ff.pay()); !s.Success {
			t.Fatalf("payment %d after topping up: %+v", i, s)
		}
	}
	if got := ff.c.TokenBalance(ff.payer.Address); got.Sign() != 0 {
		t.Errorf("the payer kept %s, want 0", got)
	}
}

// sponsoredBy signs n permit2 payments of payer for the fixture's amount, each with its own Permit2 nonce, that
// all carry one gas-sponsoring permit: the payer's EIP-2612 permit to Permit2 at the token's current nonce, as a
// client that reads nonces(payer) once would attach to each.
func (ff *fundsFixture) sponsoredBy(payer *chaintest.Account, n int) []x402.VerifyRequest {
	ff.t.Helper()
	reqs := make([]x402.VerifyRequest, n)
	for i := range reqs {
		reqs[i] = ff.permit2(payer, ff.rq, chain.Permit2Options{})
		if i > 0 {
			reqs[i].PaymentPayload.Extensions = reqs[0].PaymentPayload.Extensions
		} else if err := chain.AddGasSponsoring(&reqs[0].PaymentPayload, payer.Key, ff.c.ChainID, "", "", ff.c.TokenNonce(payer.Address)); err != nil {
			ff.t.Fatalf("adding the gas-sponsoring permit: %v", err)
		}
	}
	return reqs
}

// Payments that share one gas-sponsoring permit can be settled once between them: the permit sets Permit2's
// allowance to one payment's amount, and the first settlement to land spends its token nonce. Five settled at
// once before any block, from a payer who never approved Permit2 and whose balance covers all five, send one
// transaction and refuse four before any gas is spent, instead of sending five of which four revert on the
// facilitator's gas.
func TestPaymentsSharingAGasSponsoringPermitAreSettledOnceBetweenThem(t *testing.T) {
	for _, ttl := range []time.Duration{2 * time.Second, -1} {
		t.Run("ttl="+ttl.String(), func(t *testing.T) {
			ff := newFundsFixture(t, 5, ttl, -1)
			payer := ff.c.Payers[1]
			if got := ff.c.Allowance(payer.Address, contracts.Permit2Address); got.Sign() != 0 {
				t.Fatalf("the payer has approved Permit2 for %s; the test needs a payer who did not", got)
			}
			payerBefore, sellerBefore, sentBefore := ff.c.TokenBalance(payer.Address), ff.c.TokenBalance(ff.payTo), ff.sent()
			answers := make(chan x402.SettleResponse, 5)
			var wg sync.WaitGroup
			for _, req := range ff.sponsoredBy(payer, 5) {
				wg.Go(func() {
					resp, err := ff.f.Settle(context.Background(), req)
					if err != nil {
						t.Errorf("settle: %v", err)
					}
					answers <- resp
				})
			}
			// Nothing is mined until one settlement has been sent and four refused. An engine that sends them
			// all answers none of them before a block: give up waiting after a while and mine.
			var got []x402.SettleResponse
			for deadline := time.Now().Add(10 * time.Second); (len(got) < 4 || ff.sent()-sentBefore < 1) && time.Now().Before(deadline); {
				select {
				case resp := <-answers:
					got = append(got, resp)
				case <-time.After(5 * time.Millisecond):
				}
			}
			sent := ff.sent() - sentBefore
			ff.c.Commit()
			wg.Wait()
			close(answers)
			for resp := range answers {
				got = append(got, resp)
			}
			var settled, refused int
			for _, resp := range got {
				switch {
				case resp.Success:
					settled++
				case resp.Transaction == "" && resp.ErrorReason == x402.ReasonInvalidEIP2612ExtensionFormat:
					refused++
				default:
					t.Errorf("a payment answered %+v; want it settled, or refused naming %s with no transaction", resp, x402.ReasonInvalidEIP2612ExtensionFormat)
				}
			}
			if settled != 1 || refused != 4 {
				t.Errorf("%d settled and %d refused, want 1 and 4", settled, refused)
			}
			if sent != 1 || ff.sent()-sentBefore != 1 {
				t.Errorf("the wallets sent %d transactions before any block and %d in all, want 1 (none that would revert)", sent, ff.sent()-sentBefore)
			}
			if got := new(big.Int).Sub(ff.c.TokenBalance(ff.payTo), sellerBefore); got.Cmp(ff.amount()) != 0 {
				t.Errorf("the seller received %s, want %s", got, ff.amount())
			}
			if got := new(big.Int).Sub(payerBefore, ff.c.TokenBalance(payer.Address)); got.Cmp(ff.amount()) != 0 {
				t.Errorf("the payer paid %s, want %s", got, ff.amount())
			}
		})
	}
}

// A payer who approved Permit2 does not need a gas-sponsoring permit, and attaching one changes nothing in how
// the payer's payments are counted: with funds for three, three of five sponsored payments are held and two are
// refused, as without the permit, and the three settle without applying it.
func TestAPayerWhoApprovedPermit2IsHeldLikeAnyOtherWhenAttachingAGasSponsoringPermit(t *testing.T) {
	for _, ttl := range []time.Duration{2 * time.Second, -1} {
		t.Run("ttl="+ttl.String(), func(t *testing.T) {
			ff := newFundsFixture(t, 3, ttl, 0)
			ctx := context.Background()
			sellerBefore, sentBefore := ff.c.TokenBalance(ff.payTo), ff.sent()
			tokenNonce := ff.c.TokenNonce(ff.payer.Address)
			reqs := ff.sponsoredBy(ff.payer, 5)
			var held []x402.VerifyRequest
			var refused int
			for i, req := range reqs {
				v, err := ff.f.VerifyAndHold(ctx, req)
				switch {
				case err != nil:
					t.Fatalf("payment %d: %v", i, err)
				case v.IsValid:
					held = append(held, req)
				case v.InvalidReason == x402.ReasonInsufficientFunds:
					refused++
				default:
					t.Errorf("payment %d refused %+v; want insufficient_funds", i, v)
				}
			}
			if len(held) != 3 || refused != 2 {
				t.Fatalf("%d payments held and %d refused, want 3 and 2", len(held), refused)
			}
			for i, req := range held {
				if s := ff.settle(req); !s.Success {
					t.Fatalf("settling held payment %d: %+v", i, s)
				}
			}
			if got := ff.sent() - sentBefore; got != 3 {
				t.Errorf("the wallets sent %d transactions, want 3", got)
			}
			want := new(big.Int).Mul(ff.amount(), big.NewInt(3))
			if got := new(big.Int).Sub(ff.c.TokenBalance(ff.payTo), sellerBefore); got.Cmp(want) != 0 {
				t.Errorf("the seller received %s, want %s", got, want)
			}
			if got := ff.c.TokenNonce(ff.payer.Address); got.Cmp(tokenNonce) != 0 {
				t.Errorf("the payer's token nonce moved from %s to %s: a settlement applied the gas-sponsoring permit the approval made needless", tokenNonce, got)
			}
		})
	}
}

// amount is what each of the fixture's payments is for.
func (ff *fundsFixture) amount() *big.Int {
	a, _ := new(big.Int).SetString(ff.rq.Amount, 10)
	return a
}

// BenchmarkVerifyPermit2 measures Verify of valid permit2 payments of one payer at 64 concurrent callers, on the
// simulated chain over JSON-RPC on loopback: with every verification asking the chain (one simulation of the
// settlement call), and with the payer's funds read once per funds_cache TTL (the default, 2s).
//
//	go test ./chain -run '^$' -bench VerifyPermit2 -benchtime 20000x
func BenchmarkVerifyPermit2(b *testing.B) {
	for _, tc := range []struct {
		name string
		ttl  time.Duration
	}{{"chain-every-time", -1}, {"funds-cache-2s", 2 * time.Second}} {
		b.Run(tc.name, func(b *testing.B) {
			fx := newFixture(b, fixtureOpts{
				chainOpts: []chaintest.Option{chaintest.WithHTTP()},
				tune: func(fx *fixture, nc *chain.NetworkConfig) {
					eth, err := chain.DialRPC(context.Background(), fx.c.RPCURL)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(eth.Close)
					nc.Backend, nc.FundsCacheTTL, nc.HeadCacheTTL = eth, tc.ttl, 250*time.Millisecond
				},
			})
			payer := fx.c.Payers[0]
			fx.approvePermit2(payer)
			reqs := make([]x402.VerifyRequest, 256)
			for i := range reqs {
				reqs[i] = fx.payment(x402.TransferPermit2, payer)
			}
			var next atomic.Int64
			b.SetParallelism(32) // 64 callers on 2 cores
			b.ResetTimer()
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					req := reqs[int(next.Add(1))%len(reqs)]
					v, err := fx.f.Verify(context.Background(), req)
					if err != nil || !v.IsValid {
						b.Errorf("verify: %+v, %v", v, err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "verifies/s")
		})
	}
}

// Over JSON-RPC the nonce of a payment answered from the funds cache is read from Permit2's storage, the reads of
// concurrent verifications batched into one request: every answer must still be its own payment's. Half of 32
// payments verified at once carry a nonce the payer spent beforehand; exactly those are refused.
func TestConcurrentVerificationsFromAFreshReadEachGetTheirOwnNonce(t *testing.T) {
	fx := newFixture(t, fixtureOpts{
		chainOpts: []chaintest.Option{chaintest.WithHTTP()},
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			eth, err := chain.DialRPC(context.Background(), fx.c.RPCURL)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(eth.Close)
			fo, err := chain.NewFailover([]string{"node"}, []chain.Backend{eth})
			if err != nil {
				t.Fatal(err)
			}
			nc.Backend, nc.FundsCacheTTL = fo, time.Minute
		},
	})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	rq := fx.requirements(x402.TransferPermit2)
	for range 2 { // the second payment of a payer reads its funds; later ones are answered from that read
		if v := fx.verify(fx.permit2(payer, rq, chain.Permit2Options{})); !v.IsValid {
			t.Fatalf("warming the funds read: %+v", v)
		}
	}
	reqs := make([]x402.VerifyRequest, 32)
	spent := make([]bool, len(reqs))
	for i := range reqs {
		nonce := chaintest.RandomNonce()
		if i%2 == 1 {
			word, bit := new(big.Int).Rsh(nonce, 8), new(big.Int).And(nonce, big.NewInt(0xff))
			data, err := contracts.Permit2ABI.Pack("invalidateUnorderedNonces", word, new(big.Int).Lsh(big.NewInt(1), uint(bit.Uint64())))
			fx.transact(payer, contracts.Permit2Address, data, err)
			spent[i] = true
		}
		reqs[i] = fx.permit2(payer, rq, chain.Permit2Options{Nonce: nonce})
	}
	answers := make([]x402.VerifyResponse, len(reqs))
	var wg sync.WaitGroup
	for i := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			answers[i] = fx.verify(reqs[i])
		}()
	}
	wg.Wait()
	for i, a := range answers {
		switch {
		case spent[i] && (a.IsValid || a.InvalidReason != x402.ReasonPermit2InvalidNonce):
			t.Errorf("payment %d, its nonce spent: %+v; want %s", i, a, x402.ReasonPermit2InvalidNonce)
		case !spent[i] && !a.IsValid:
			t.Errorf("payment %d, its nonce unused: %+v; want valid", i, a)
		}
	}
}
