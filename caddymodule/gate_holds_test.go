package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An erc2612 payment is held against the payer's funds like a permit2 one. A payer whose funds cover one
// response presents, on a settle async route of the embedded engine, an erc2612 payment and a permit2 payment
// before either settles, in either order: one is served, the other is refused with a 402 naming
// insufficient_funds before the upstream runs. The one settles, exactly, and no settlement transaction reverts.
func TestSettleAsyncHoldsAnERC2612PaymentLikeAnyOther(t *testing.T) {
	for _, order := range [][2]string{{x402.TransferERC2612, x402.TransferPermit2}, {x402.TransferPermit2, x402.TransferERC2612}} {
		t.Run(order[0]+" first", func(t *testing.T) {
			up := newTestUpstream(t)
			env := newGateEnv(t, gateSetup{
				gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr, noCommit: true,
				chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(gatePrice))},
			})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before, sentBefore, fromBlock := env.balances(payer), env.sent(), env.c.HeadNumber()+1

			var served string
			for i, method := range order {
				a := env.get("/", x402.HeaderPaymentSignature, env.paymentHeader(payer, method))
				switch {
				case i == 0 && a.status == http.StatusOK:
					served = method
				case i == 1 && a.status == http.StatusPaymentRequired:
					if msg := requiredError(t, a); !strings.Contains(msg, x402.ReasonInsufficientFunds) {
						t.Errorf("the %s payment was refused saying %q; want it to name %s", method, msg, x402.ReasonInsufficientFunds)
					}
					if a.header.Get(x402.HeaderPaymentResponse) != "" || strings.Contains(a.body, "upstream says") {
						t.Errorf("the refused %s payment was served or settled: %q", method, a.body)
					}
				default:
					t.Errorf("the %s payment (%d of 2) answered %d %q; want the first served and the second refused, the payer's funds covering one", method, i+1, a.status, a.body)
				}
			}
			if got := up.calls.Load(); got != 1 {
				t.Errorf("the upstream ran %d times, want 1", got)
			}
			t.Cleanup(commitPending(t, env.c))
			env.waitPaid(payer, before, 1)
			waitBacklog(t, 0)
			// erc2612 settles in two transactions (the permit, then the transfer), permit2 in one.
			want := uint64(1)
			if served == x402.TransferERC2612 {
				want = 2
			}
			if got := env.sent() - sentBefore; got != want {
				t.Errorf("the settlement wallets sent %d transactions, want %d: the served %s payment's settlement alone", got, want, served)
			}
			if n := revertedSince(t, env.c, fromBlock); n != 0 {
				t.Errorf("%d transactions reverted on chain, want none", n)
			}
		})
	}
}

// A served async payment stays held against its payer's funds while its settlement fails for a while: the node
// answers 503, or refuses the settlement transaction. The background settlement tries again, so the payment
// still spends the payer's funds: the payer's next payment, which those funds do not cover beside it, is
// refused with a 402 naming insufficient_funds, before the upstream runs. Once the node is well again the first
// payment settles, exactly once. On bbolt (the engine's own holds) and on PostgreSQL (holds shared by the
// instances of a cluster).
func TestSettleAsyncKeepsAPaymentHeldWhileItsSettlementFailsForAWhile(t *testing.T) {
	faults := []struct {
		name   string
		decide func(string) chaintest.Fault
		logged string
	}{
		{"the node answers 503", func(method string) chaintest.Fault {
			if method == "eth_maxPriorityFeePerGas" {
				return chaintest.ErrorStatus // the settlement's fee quote: settling needs it, verifying does not
			}
			return chaintest.Pass
		}, "facilitator unreachable; retrying"},
		{"the node refuses the transaction", func(string) chaintest.Fault { return chaintest.Refuse }, "facilitator unreachable; retrying"},
	}
	for _, store := range []string{"bbolt", "postgres"} {
		for _, fault := range faults {
			t.Run(store+", "+fault.name, func(t *testing.T) {
				setup := gateSetup{gate: "\t\tsettle async\n", noCommit: true, logFile: true}
				if store == "postgres" {
					t.Setenv("X402_TEST_JOURNAL_DSN", pgtest.Shared(t))
					setup.journal = "{env.X402_TEST_JOURNAL_DSN}"
				}
				up := newTestUpstream(t)
				setup.site = "reverse_proxy " + up.Addr
				c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithTokenBalance(big.NewInt(gatePrice)))
				proxy := chaintest.NewFaultProxy(t, c.RPCURL)
				setup.rpc = proxy.URL
				env := startGateOn(t, c, setup)
				payer := c.Payers[0]
				env.approvePermit2(payer)
				before, fromBlock := env.balances(payer), c.HeadNumber()+1

				resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
				t.Cleanup(resume)
				if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK ||
					settleResponse(t, a).ErrorReason != x402.ReasonSettlementPending {
					t.Fatalf("the first payment: %d %q, want served with settlement_pending", a.status, a.body)
				}
				proxy.SetDecide(fault.decide)
				resume()
				if !env.logged("background settlement", fault.logged) {
					t.Fatalf("the first payment's settlement did not fail as the fault should make it (%q)", fault.logged)
				}

				a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
				if a.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, a), x402.ReasonInsufficientFunds) {
					t.Errorf("the second payment, which the payer's funds do not cover beside the first: %d %q, want 402 naming insufficient_funds", a.status, a.body)
				}
				if got := up.calls.Load(); got != 1 {
					t.Errorf("the upstream ran %d times, want 1", got)
				}

				proxy.SetDecide(nil)
				t.Cleanup(commitPending(t, c))
				env.waitPaid(payer, before, 1)
				waitBacklog(t, 0)
				if n := revertedSince(t, c, fromBlock); n != 0 {
					t.Errorf("%d transactions reverted on chain, want none", n)
				}
			})
		}
	}
}

// paymentHeader is a signed payment of the route "/" by method, ready for PAYMENT-SIGNATURE.
func (env *gateEnv) paymentHeader(payer *chaintest.Account, method string) string {
	env.t.Helper()
	rq := env.requirement("/", method)
	if method == x402.TransferERC2612 {
		return gateEncode(env.t, env.signERC2612(payer, rq))
	}
	return gateEncode(env.t, env.signPermit2(payer, rq))
}

// revertedSince counts the transactions of blocks from on whose receipts say they reverted.
func revertedSince(t testing.TB, c *chaintest.Chain, from uint64) int {
	t.Helper()
	ctx := context.Background()
	n := 0
	for b := from; b <= c.HeadNumber(); b++ {
		block, err := c.Client.BlockByNumber(ctx, new(big.Int).SetUint64(b))
		if err != nil {
			t.Fatal(err)
		}
		for _, tx := range block.Transactions() {
			r, err := c.Client.TransactionReceipt(ctx, tx.Hash())
			if err != nil {
				t.Fatal(err)
			}
			if r.Status != types.ReceiptStatusSuccessful {
				n++
			}
		}
	}
	return n
}

// An erc2612 payment and a permit2 payment whose gas-sponsoring permit has the same token nonce cannot both
// settle: the token takes each permit nonce once. A payer who never approved Permit2, whose funds cover both,
// presents the two on a settle async route before either settles, in either order: one is served, the other is
// refused with a 402 that names the spent nonce, before the upstream runs. The one settles, and nothing reverts.
func TestSettleAsyncServesOnePaymentPerPermitNonce(t *testing.T) {
	for _, first := range []string{x402.TransferERC2612, x402.TransferPermit2} {
		t.Run(first+" first", func(t *testing.T) {
			up := newTestUpstream(t)
			env := newGateEnv(t, gateSetup{
				gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr, noCommit: true,
				chainOpts: []chaintest.Option{chaintest.WithTokenBalance(big.NewInt(2 * gatePrice))},
			})
			payer := env.c.Payers[0]
			if got := env.c.Allowance(payer.Address, contracts.Permit2Address); got.Sign() != 0 {
				t.Fatalf("the payer has approved Permit2 for %s; the test needs a payer who did not", got)
			}
			before, sentBefore, fromBlock := env.balances(payer), env.sent(), env.c.HeadNumber()+1
			tokenNonce := env.c.TokenNonce(payer.Address)

			erc2612 := gateEncode(t, env.signERC2612(payer, env.requirement("/", x402.TransferERC2612)))
			sponsored := env.signPermit2(payer, env.requirement("/", x402.TransferPermit2))
			sponsored.Extensions = env.offer("/").Extensions
			if err := chain.AddGasSponsoring(&sponsored, payer.Key, env.c.ChainID, "", "", tokenNonce); err != nil {
				t.Fatal(err)
			}
			headers := map[string]string{x402.TransferERC2612: erc2612, x402.TransferPermit2: gateEncode(t, sponsored)}
			second, wantReason := x402.TransferPermit2, x402.ReasonInvalidEIP2612ExtensionFormat
			if first == x402.TransferPermit2 {
				second, wantReason = x402.TransferERC2612, x402.ReasonNonceAlreadyUsed
			}

			if a := env.get("/", x402.HeaderPaymentSignature, headers[first]); a.status != http.StatusOK {
				t.Fatalf("the %s payment: %d %q, want it served", first, a.status, a.body)
			}
			a := env.get("/", x402.HeaderPaymentSignature, headers[second])
			if a.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, a), wantReason) {
				t.Errorf("the %s payment spending the same permit nonce: %d %q, want 402 naming %s", second, a.status, a.body, wantReason)
			}
			if got := up.calls.Load(); got != 1 {
				t.Errorf("the upstream ran %d times, want 1", got)
			}
			t.Cleanup(commitPending(t, env.c))
			env.waitPaid(payer, before, 1)
			waitBacklog(t, 0)
			if n := revertedSince(t, env.c, fromBlock); n != 0 {
				t.Errorf("%d transactions reverted on chain, want none", n)
			}
			if got := env.sent() - sentBefore; got > 2 {
				t.Errorf("the settlement wallets sent %d transactions, want those of the served payment alone", got)
			}
		})
	}
}

// After a restart, a served async payment the journal holds unsettled counts against its payer's funds from the
// gate's first request, whether or not the node answers: here it does not, for the first seconds (eth_call
// answers 503). Once it does, the payer, whose funds cover that one payment, presents a new one: it is refused
// with a 402 naming insufficient_funds, and the replayed payment settles, once.
func TestAReplayedAsyncPaymentIsHeldWhileTheNodeIsDownAtStart(t *testing.T) {
	env := newStoppedGateEnv(t, chaintest.WithTokenBalance(big.NewInt(gatePrice)))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before, fromBlock := env.balances(payer), env.c.HeadNumber()+1
	journalPath := filepath.Join(t.TempDir(), "journal.db")
	env.journalServedAsync(journalPath, payer, 1)

	proxy := chaintest.NewFaultProxy(t, env.c.RPCURL)
	proxy.SetDecide(func(method string) chaintest.Fault {
		if method == "eth_call" {
			return chaintest.ErrorStatus
		}
		return chaintest.Pass
	})
	resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
	t.Cleanup(resume)
	up := newTestUpstream(t)
	env.srv = startCaddy(t, env.caddyfile(gateSetup{journal: journalPath, gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr,
		rpc: proxy.URL, noCommit: true}))
	// Long enough for anything the start left running to give up on the node (its calls are tried for ~2 s).
	time.Sleep(4 * time.Second)
	proxy.SetDecide(nil)

	a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	if a.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, a), x402.ReasonInsufficientFunds) {
		t.Errorf("a new payment of a payer whose funds the replayed payment spends: %d %q, want 402 naming insufficient_funds", a.status, a.body)
	}
	if got := up.calls.Load(); got != 0 {
		t.Errorf("the upstream ran %d times, want 0", got)
	}
	resume()
	t.Cleanup(commitPending(t, env.c))
	env.waitPaid(payer, before, 1)
	waitBacklog(t, 0)
	if n := revertedSince(t, env.c, fromBlock); n != 0 {
		t.Errorf("%d transactions reverted on chain, want none", n)
	}
}
