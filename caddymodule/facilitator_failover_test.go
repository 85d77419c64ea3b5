package caddymodule_test

import (
	"context"
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// servedEngine is an embedded engine of its own (own wallets, own journal) served over HTTP by facilitatorserver,
// as another operator's facilitator would be, counting the /settle calls it receives.
type servedEngine struct {
	URL     string
	settles atomic.Int64
}

func newServedEngine(t *testing.T, c *chaintest.Chain, wallets []*chaintest.Account) *servedEngine {
	t.Helper()
	nc := chain.NetworkConfig{
		Network: x402.EIP155(c.ChainID.Uint64()), Backend: c.Client,
		Assets:      []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		ReceiptPoll: 2 * time.Millisecond, ReceiptTimeout: 20 * time.Second,
	}
	for _, w := range wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatalf("starting an engine: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	srv, err := facilitatorserver.New(f, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := &servedEngine{}
	e.URL = serveTest(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if facilitatorserver.Endpoint(r.URL.Path) == facilitatorserver.EndpointSettle {
			e.settles.Add(1)
		}
		srv.ServeHTTP(w, r)
	}))
	return e
}

// answerDropper forwards to a facilitator; while lose is set, a /settle is forwarded (the facilitator acts on
// it) and the connection is cut before its answer; while down is set, every call is answered 503 unforwarded.
type answerDropper struct {
	target     string
	lose, down atomic.Bool
	answered   atomic.Int64 // /settle answers passed back
}

func (p *answerDropper) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if p.down.Load() {
		http.Error(w, "down", http.StatusServiceUnavailable)
		return
	}
	body, _ := io.ReadAll(r.Body)
	status, answer, err := forwardTo(p.target, r, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if r.URL.Path == "/settle" && p.lose.Load() {
		hangUpOn(w)
		return
	}
	if r.URL.Path == "/settle" {
		p.answered.Add(1)
	}
	writeAnswer(w, status, answer)
}

// An x402_facilitator over a failover set: member A settles a payment and its answer is lost (502 "may have
// settled"); the configuration is reloaded. Presented again after the payment's deadline, the payment must
// still be asked of A, whose journal
// knows the settlement, and not of B, which finds its nonce spent or its deadline passed and would refuse it:
// a refusal passed on is what a resource server answers 402 "pay again" for a payment that settled. While A
// cannot be reached, the answer is 502, the outcome unknown; once A answers, its settlement. B is never asked.
func TestAPaymentAMemberMayHaveSettledIsAskedOfItAloneEvenPastItsDeadline(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	t.Cleanup(commitPending(t, c))
	a := newServedEngine(t, c, c.Wallets[:2])
	b := newServedEngine(t, c, c.Wallets[2:4])
	toA := &answerDropper{target: a.URL}
	e := &facilitatorEnv{
		t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(c.ChainID.Uint64()),
	}
	urlA := serveTest(t, toA)
	caddyfile := func(timeoutB string) string {
		return `{{ADDR}} {
	handle_path /mw/* {
		x402_facilitator {
			upstream ` + urlA + ` {
				timeout 2s
			}
			upstream ` + b.URL + ` {
				timeout ` + timeoutB + `
			}
		}
	}
}
`
	}
	e.srv = startCaddy(t, caddyfile("2s"))
	payer := c.Payers[0]
	e.permit2(payer) // approves Permit2
	// A deadline seconds ahead of both clocks: the chain's (which judges the payment) and the wall's
	// (which the failover set keeps the payment with its member by).
	deadline := time.Unix(max(time.Now().Unix(), e.chainNow().Unix())+10, 0)
	rq := e.requirements(x402.TransferPermit2)
	p, err := chain.SignPermit2Payment(payer.Key, rq, c.ChainID, chain.Permit2Options{Now: e.chainNow(), Deadline: big.NewInt(deadline.Unix())})
	if err != nil {
		t.Fatal(err)
	}
	req := mustJSON(t, x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq})
	payerBefore, sellerBefore := e.balances(payer.Address)

	toA.lose.Store(true)
	first := e.do(http.MethodPost, "/mw/settle", "", req)
	if msg, _ := first.json(t)["error"].(string); first.status != http.StatusBadGateway || !strings.Contains(msg, "may have settled") {
		t.Fatalf("settle, A's answer lost = %d %s; want 502 saying the payment may have settled", first.status, first.body)
	}
	toA.lose.Store(false)
	e.assertPaidOnce(payer.Address, payerBefore, sellerBefore) // A settled it
	// A reload builds the failover set anew: the payment stays with A all the same.
	e.srv.load(caddyfile("3s"))

	time.Sleep(time.Until(deadline.Add(1500 * time.Millisecond)))
	if now := e.chainNow(); !now.After(deadline) {
		c.AdjustTime(deadline.Sub(now) + 2*time.Second)
	}

	toA.down.Store(true)
	down := e.do(http.MethodPost, "/mw/settle", "", req)
	if msg, _ := down.json(t)["error"].(string); down.status != http.StatusBadGateway || !strings.Contains(msg, "may have settled") {
		t.Errorf("settle past the deadline, A down = %d %s; want 502 saying the payment may have settled", down.status, down.body)
	}
	toA.down.Store(false)
	again := e.do(http.MethodPost, "/mw/settle", "", req)
	var s x402.SettleResponse
	if again.status != http.StatusOK || json.Unmarshal(again.body, &s) != nil || !s.Success || !x402.IsTxHash(s.Transaction) || s.Payer != payer.Address.Hex() {
		t.Errorf("settle past the deadline, A up = %d %s; want A's settlement", again.status, again.body)
	}
	if n := b.settles.Load(); n != 0 {
		t.Errorf("B was asked to settle the payment %d times; want never", n)
	}
	e.assertPaidOnce(payer.Address, payerBefore, sellerBefore)
}

// A gate settles async through a failover set (a middleware of two members). Member A settles the payment and its
// answer is lost, again and again, until after the payment's deadline; the response was cut short, so the payer
// presents the payment again. The background settlement must keep asking A, never B (which refuses a payment
// whose deadline passed), and the payment presented again is served: a refusal by B would have been recorded as
// the payment's final answer, and the payer told 402 to pay again for a payment A settled.
func TestAnAsyncPaymentAMemberSettledIsNeverRefusedByAnotherPastItsDeadline(t *testing.T) {
	const size = 32 << 20 // beyond what loopback socket buffers hold, so the write fails once the client hangs up
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	a := newServedEngine(t, c, c.Wallets[:2])
	b := newServedEngine(t, c, c.Wallets[2:4])
	toA := &answerDropper{target: a.URL}
	mw := freeAddr(t)
	env := startGateOn(t, c, gateSetup{facURL: "http://" + mw + "/mw", site: "reverse_proxy " + newBigUpstream(t, size).Addr,
		gate: "\t\tsettle async\n\t\tmax_buffer 64MiB\n", sites: `
http://` + mw + ` {
	handle_path /mw/* {
		x402_facilitator {
			upstream ` + serveTest(t, toA) + ` {
				timeout 2s
			}
			upstream ` + b.URL + `
		}
	}
}
`})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	// As soon as settle async serves a payment before settling it: a minute past the time its settlement could
	// be mined at (by the gate's clock, with a remote facilitator), and a little more.
	deadline := time.Unix(max(time.Now().Unix(), env.chainNow().Unix()+1)+60+10, 0)
	p, err := chain.SignPermit2Payment(payer.Key, env.requirement("/", x402.TransferPermit2), c.ChainID,
		chain.Permit2Options{Now: env.chainNow(), Deadline: big.NewInt(deadline.Unix())})
	if err != nil {
		t.Fatal(err)
	}
	header := gateEncode(t, p)

	toA.lose.Store(true)
	if status := env.readHeadAndHangUp(header); status != http.StatusOK {
		t.Fatalf("first presentation = %d, want 200 (then cut short)", status)
	}
	env.waitPaid(payer, before, 1) // A settled it; its answers are lost

	// Past the deadline by chain time, which the members judge it by (a member refuses a deadline closer than
	// 6 s to the next block's time, which is never before its head's).
	if now := env.chainNow(); !now.After(deadline) {
		c.AdjustTime(deadline.Sub(now) + 2*time.Second)
	}
	// The background settlement retries with a growing pause: let its next attempt through, wherever it goes.
	toA.lose.Store(false)
	for end := time.Now().Add(30 * time.Second); b.settles.Load() == 0 && toA.answered.Load() == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the background settlement asked no member within 30 s of the deadline")
		}
	}
	time.Sleep(200 * time.Millisecond) // its answer recorded

	again := env.get("/", x402.HeaderPaymentSignature, header)
	if again.status != http.StatusOK || len(again.body) != size {
		t.Errorf("the payment presented again past its deadline = %d %.300q; want the whole response (A settled it)", again.status, again.body)
	}
	if n := b.settles.Load(); n != 0 {
		t.Errorf("B was asked to settle the payment %d times; want never", n)
	}
	env.assertPaid(payer, before, 1)
}
