package gate_test

import (
	"context"
	"io"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAHoldAKilledGatewayLeftIsLetGoWhenAnotherGatewayRefusesThePayment: a settle async gateway of a cluster
// verifies a payment bound to its wallet (upto's facilitator, erc2612's spender), which holds it against the
// payer's funds in the journal the gateways share, and is killed before it records the payment (its upstream was
// still running). Presented again to a gateway that does not send from that wallet, the payment is refused at
// verification (nothing runs, nothing is charged). That refusal must let the dead gateway's hold go: nobody else
// presents the payment (the refusing request holds its in-flight mark) and no journal records it, so nothing would
// ever settle it or let its hold go before its deadline, and the payer, who can pay one price, would be refused
// every new payment meanwhile (the money-invariant run's scarce topology, seed 1795789866834961745: "a hold of
// 10000 for payment #…, not released and not seen mined" after upto_facilitator_mismatch).
func TestAHoldAKilledGatewayLeftIsLetGoWhenAnotherGatewayRefusesThePayment(t *testing.T) {
	reasons := map[string]string{"upto": x402.ReasonUptoFacilitatorMismatch, "erc2612": x402.ReasonRecipientMismatch}
	for _, tc := range boundCases {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.s
			s.settle = gate.SettleAsync
			gws := gateways(t, s, 2, chaintest.WithTokenBalance(big.NewInt(price)))
			st := gws[0].store.(journal.Cluster)
			payer := gws[0].c.Payers[1]
			rq := gws[0].required(tc.method)
			h := gws[0].signFor(payer, rq)
			p, err := x402.DecodePaymentPayload(h)
			if err != nil {
				t.Fatal(err)
			}

			// Gateway 0's request verified and held the payment, and died with its process.
			vres, err := gws[0].fac.VerifyAndHold(context.Background(), x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq})
			if err != nil || !vres.IsValid {
				t.Fatalf("gateway 0's verification = %+v, %v; want valid", vres, err)
			}
			if holds := holdsOf(t, gws[0], st, payer); len(holds) != 1 {
				t.Fatalf("after gateway 0's verification the journal keeps %d holds; want 1", len(holds))
			}

			a := gws[1].get(x402.HeaderPaymentSignature, h)
			pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if a.status != http.StatusPaymentRequired || !strings.HasPrefix(pr.Error, reasons[tc.name]) {
				t.Fatalf("presented to the other gateway = %d %q (%s); want 402 %s", a.status, a.body, pr.Error, reasons[tc.name])
			}
			if holds := holdsOf(t, gws[0], st, payer); len(holds) != 0 {
				t.Fatalf("after the other gateway refused the payment the journal keeps %d holds (%+v); want none: nothing will settle it", len(holds), holds[0])
			}

			// The payer's one price is free again: a new payment is served and settled once.
			before := gws[1].balances(payer)
			if a := gws[1].get(x402.HeaderPaymentSignature, gws[1].signFor(payer, gws[1].required(tc.method))); a.status != http.StatusOK {
				pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
				t.Fatalf("a new payment of the payer = %d (%s); want 200", a.status, pr.Error)
			}
			gws[1].waitPaidOnce(t, payer, before, price, 20*time.Second)
		})
	}
}

// TestAHoldIsLetGoWhenTheUpstreamAbortsBeforeTheGateDecided: a settle async gate holds a payment against the
// payer's funds when it verifies it, then runs the upstream, which aborts (panics with http.ErrAbortHandler, as
// reverse_proxy does when the upstream's body breaks off) before anything was decided: nothing was recorded or
// served, and the hold must go with the request, or the payer, who can pay one price, is refused every new
// payment until the first one's deadline.
func TestAHoldIsLetGoWhenTheUpstreamAbortsBeforeTheGateDecided(t *testing.T) {
	c := chaintest.New(t, chaintest.WithTokenBalance(big.NewInt(price)), chaintest.WithPromptCommit())
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	var abort atomic.Bool
	e := newEnv(t, setup{settle: gate.SettleAsync, chain: c, upstream: func(w http.ResponseWriter, r *http.Request) error {
		if abort.Swap(false) {
			_, _ = io.WriteString(w, "paid con")
			panic(http.ErrAbortHandler)
		}
		_, err := io.WriteString(w, "paid content")
		return err
	}})
	payer := e.c.Payers[0]
	first := e.permit2(payer)
	abort.Store(true)
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, first)
	fresh := &http.Transport{} // a request that fails on a reused connection is sent again, on a fresh one it is not
	defer fresh.CloseIdleConnections()
	if resp, err := fresh.RoundTrip(req); err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("the request whose upstream aborted = %d %q; want the connection cut", resp.StatusCode, body)
	}

	before := e.balances(payer)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
		t.Fatalf("a new payment of the payer after the aborted one = %d (%s); want 200: the aborted payment holds nothing", a.status, pr.Error)
	}
	e.waitPaidOnce(t, payer, before, price, 20*time.Second)
}
