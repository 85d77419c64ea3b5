package caddymodule_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// holdingProxy forwards to a facilitator; while hold is set, a /settle is forwarded (the facilitator acts on
// it) and its answer is held back until the caller gives up: a facilitator that settles more slowly than its
// caller waits.
type holdingProxy struct {
	target  string
	hold    atomic.Bool
	settles atomic.Int64
	srv     *httptest.Server
}

func newHoldingProxy(t *testing.T, target string) *holdingProxy {
	p := &holdingProxy{target: target}
	p.srv = httptest.NewServer(p)
	t.Cleanup(p.srv.Close)
	return p
}

func (p *holdingProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path == "/settle" {
		p.settles.Add(1)
	}
	hold := r.URL.Path == "/settle" && p.hold.Load()
	req, _ := http.NewRequestWithContext(context.WithoutCancel(r.Context()), r.Method, p.target+r.URL.Path, bytes.NewReader(body))
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	if hold {
		<-r.Context().Done()
		return
	}
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// A gate settles through a middleware with two upstreams. Upstream A settles the payment more slowly than the
// middleware's settle_timeout: the gate answers 502, "may have settled". Presented again, as the payer is told,
// the payment must be asked of A (whose journal knows it settled) and served, not of B, which finds its nonce
// spent and refuses it: a payer who paid would be told to pay again. A's /settle, which may have reached it,
// is not sent again on its own either (a facilitator without a journal would refuse the repeat).
func TestAPaymentSentToOneUpstreamStaysWithItWhenPresentedAgain(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	a := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	b := newRemoteFacilitatorOf(t, c, c.Wallets[2:4], 20*time.Second)
	proxy := newHoldingProxy(t, a.URL)
	mw := freeAddr(t)
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	env.srv = startCaddy(t, `{
	x402 {
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	x402 {
		pay_to `+env.payTo.Hex()+`
		amount 10000
		asset `+c.Token.Hex()+`
		network `+env.net+`
		facilitator http://`+mw+`/mw
	}
	respond "paid content"
}

http://`+mw+` {
	handle_path /mw/* {
		x402_facilitator {
			upstream `+proxy.srv.URL+` {
				settle_timeout 700ms
			}
			upstream `+b.URL+`
		}
	}
}
`)
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)

	proxy.hold.Store(true)
	first := env.get("/", x402.HeaderPaymentSignature, header)
	if first.status != http.StatusBadGateway {
		t.Fatalf("the first presentation, A slower than settle_timeout: %d %q; want 502", first.status, first.body)
	}
	if n := proxy.settles.Load(); n != 1 {
		t.Errorf("A was sent the settlement %d times; want once (what may have reached it is not sent again)", n)
	}
	env.waitPaid(payer, before, 1) // A settles it meanwhile
	proxy.hold.Store(false)

	again := env.get("/", x402.HeaderPaymentSignature, header)
	if again.status != http.StatusOK || again.body != "paid content" {
		t.Fatalf("the same payment presented again: %d %q; want 200 with the content (A settled it)", again.status, again.body)
	}
	if n := b.settles.Load(); n != 0 {
		t.Errorf("B was asked to settle the payment %d times; want never", n)
	}
	env.assertPaid(payer, before, 1)
}

// journalLessFacilitator stands for a remote facilitator that keeps no journal: its first /settle reaches
// engine a (which settles) and the connection is cut before the answer; every later call goes to engine b,
// which knows nothing of the first and finds the payment's nonce spent.
type journalLessFacilitator struct {
	a, b    string
	settles atomic.Int64
	srv     *httptest.Server
}

func (f *journalLessFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	target := f.b
	first := r.URL.Path == "/settle" && f.settles.Add(1) == 1
	if first {
		target = f.a
	}
	resp, err := http.Post(target+r.URL.Path, "application/json", bytes.NewReader(body))
	if r.Method == http.MethodGet {
		resp, err = http.Get(target + r.URL.Path)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	if first {
		hj, _ := w.(http.Hijacker)
		conn, _, _ := hj.Hijack()
		_ = conn.Close() // the answer is lost on the way back
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// A gate's /settle reached a facilitator without a journal, which settled, and the answer was lost: the gate
// answers 502, and does not send the /settle again on its own. Presented again, the payment gets a refusal
// ("nonce already used", the facilitator's own settlement spent it): that is no final answer for a payment whose
// first settlement may have gone through, and the gate must not answer 402 and offer to be paid again.
func TestARefusalOfAPaymentWhoseSettlementMayHaveGoneThroughIsNoReasonToPayAgain(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	a := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	b := newRemoteFacilitatorOf(t, c, c.Wallets[2:4], 20*time.Second)
	remote := &journalLessFacilitator{a: a.URL, b: b.URL}
	remote.srv = httptest.NewServer(remote)
	t.Cleanup(remote.srv.Close)
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	env.srv = startCaddy(t, `{
	x402 {
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	x402 {
		pay_to `+env.payTo.Hex()+`
		amount 10000
		asset `+c.Token.Hex()+`
		network `+env.net+`
		facilitator `+remote.srv.URL+`
	}
	respond "paid content"
}
`)
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)

	first := env.get("/", x402.HeaderPaymentSignature, header)
	if first.status != http.StatusBadGateway {
		t.Fatalf("the first presentation, its settlement's answer lost: %d %q; want 502", first.status, first.body)
	}
	env.waitPaid(payer, before, 1)
	if n := remote.settles.Load(); n != 1 {
		t.Errorf("the facilitator was sent the settlement %d times on the first presentation; want once", n)
	}
	for i := range 2 {
		again := env.get("/", x402.HeaderPaymentSignature, header)
		if again.status != http.StatusBadGateway || !strings.Contains(again.body, "may have settled") {
			t.Fatalf("presentation %d after, the facilitator refusing the spent nonce: %d %q; want 502 saying it may have settled", i+2, again.status, again.body)
		}
	}
	env.assertPaid(payer, before, 1)
}
