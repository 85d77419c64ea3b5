package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
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
		}, "failed unexpectedly; retrying"},
		{"the node refuses the transaction", func(string) chaintest.Fault { return chaintest.Refuse }, "failed unexpectedly; retrying"},
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
