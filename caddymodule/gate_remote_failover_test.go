package caddymodule_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	bolt "go.etcd.io/bbolt"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// forwardTo sends the request r (whose body was read into body) to the same path of target, and returns the
// target's status and body. The forward outlives r's caller: a facilitator behind acts on what it received.
func forwardTo(target string, r *http.Request, body []byte) (int, []byte, error) {
	req, err := http.NewRequestWithContext(context.WithoutCancel(r.Context()), r.Method, target+r.URL.Path, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	return resp.StatusCode, answer, err
}

// writeAnswer writes a facilitator's JSON answer.
func writeAnswer(w http.ResponseWriter, status int, answer []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(answer)
}

// serveTest serves h on 127.0.0.1 until the test ends and returns its URL.
func serveTest(t *testing.T, h http.Handler) string {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// holdingProxy forwards to a facilitator; while hold is set, a /settle is forwarded (the facilitator acts on
// it) and its answer is held back until the caller gives up: a facilitator that settles more slowly than its
// caller waits.
type holdingProxy struct {
	target  string
	hold    atomic.Bool
	settles atomic.Int64
}

func (p *holdingProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if r.URL.Path == "/settle" {
		p.settles.Add(1)
	}
	hold := r.URL.Path == "/settle" && p.hold.Load()
	status, answer, err := forwardTo(p.target, r, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if hold {
		<-r.Context().Done()
		return
	}
	writeAnswer(w, status, answer)
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
	proxy := &holdingProxy{target: a.URL}
	mw := freeAddr(t)
	env := startGateOn(t, c, gateSetup{facURL: "http://" + mw + "/mw", sites: `
http://` + mw + ` {
	handle_path /mw/* {
		x402_facilitator {
			upstream ` + serveTest(t, proxy) + ` {
				settle_timeout 700ms
			}
			upstream ` + b.URL + `
		}
	}
}
`})
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
}

func (f *journalLessFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	target := f.b
	first := r.URL.Path == "/settle" && f.settles.Add(1) == 1
	if first {
		target = f.a
	}
	status, answer, err := forwardTo(target, r, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if first {
		hangUpOn(w) // the answer is lost on the way back
		return
	}
	writeAnswer(w, status, answer)
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
	env := startGateOn(t, c, gateSetup{facURL: serveTest(t, remote)})
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

// blockingFacilitator forwards to a facilitator, holding every /settle until released, and counts /verify calls.
type blockingFacilitator struct {
	target   string
	release  chan struct{}
	verifies atomic.Int64
}

func (f *blockingFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	switch r.URL.Path {
	case "/verify":
		f.verifies.Add(1)
	case "/settle":
		select {
		case <-f.release:
		case <-r.Context().Done():
			return
		}
	}
	status, answer, err := forwardTo(f.target, r, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	writeAnswer(w, status, answer)
}

// settle async with a remote facilitator serves a payer one unsettled payment at a time: the payer's next
// requests wait for it to settle, each holding a connection. Only a few may wait; the rest are answered 429 with
// Retry-After before they cost a /verify, and the waiting ones are served once the first payment settles.
func TestAPayerCannotParkManyRequestsWaitingForItsAsyncPaymentToSettle(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	remote := &blockingFacilitator{target: engine.URL, release: make(chan struct{})}
	env := startGateOn(t, c, gateSetup{facURL: serveTest(t, remote), gate: "\t\tsettle async\n"})
	released := false
	t.Cleanup(func() {
		if !released {
			close(remote.release)
		}
	})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("the first async payment: %d %q; want served", a.status, a.body)
	}
	verifiesBefore := remote.verifies.Load()

	const extra = 3 // beyond the places to wait
	const n = 4 + extra
	answers := make([]<-chan gateAnswer, n)
	for i := range n {
		answers[i] = env.getAsync("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	}
	var turnedAway int
	deadline := time.After(5 * time.Second)
	for turnedAway < extra {
		select {
		case <-deadline:
			t.Fatalf("%d of %d requests turned away after 5 s; want %d", turnedAway, n, extra)
		default:
		}
		for i, ch := range answers {
			if ch == nil {
				continue
			}
			select {
			case a := <-ch:
				if a.status != http.StatusTooManyRequests || a.header.Get("Retry-After") == "" {
					t.Fatalf("a request while the first payment is unsettled: %d %q; want 429 with Retry-After", a.status, a.body)
				}
				turnedAway++
				answers[i] = nil
			default:
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if v := remote.verifies.Load() - verifiesBefore; v > n-extra {
		t.Errorf("%d /verify calls for %d waiting requests; the turned-away ones must cost none", v, n-extra)
	}
	close(remote.release)
	released = true
	for _, ch := range answers {
		if ch == nil {
			continue
		}
		if a := <-ch; a.status != http.StatusOK || a.body != "paid content" {
			t.Errorf("a waiting request once the first payment settled: %d %q; want served", a.status, a.body)
		}
	}
	env.waitPaid(payer, before, int64(1+n-extra))
}

// A gate whose journal cannot be read at start-up (here: an async payment's record written by a newer release)
// refuses to start, naming what it could not read, rather than start with the served payments waiting to be
// settled forgotten: they would never be settled, and their payers never counted.
func TestAGateThatCannotReadItsAsyncPaymentsAtStartUpRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "journal.db")
	store, err := journal.OpenBolt(path, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	id := journal.ID{1, 2, 3}
	if _, _, err := store.Claim(context.Background(), journal.Record{ID: id, State: journal.StateClaimed, Async: true, Payer: "0x1", Request: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if err := store.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket([]byte("records")).Put(id[:], []byte("\x09{}")) // a record format this release does not read
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	text := `{
	x402 {
		journal ` + path + `
	}
}

http://` + freeAddr(t) + ` {
	x402 {
		pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e10
		amount 10000
		asset 0xFCc9EBb7682E831668990F8333F2Ea453bFDD563
		network eip155:72344
		facilitator http://` + freeAddr(t) + `
		settle async
	}
	respond "paid content"
}
`
	caddyMu.Lock()
	defer caddyMu.Unlock()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	err = caddy.Load(adaptCaddyfile(t, text, dir), true)
	if err == nil {
		_ = caddy.Stop()
		t.Fatal("Caddy started with a journal whose async payments it could not read")
	}
	if !strings.Contains(err.Error(), "async payments") || !strings.Contains(err.Error(), "format 9") {
		t.Fatalf("load error = %v; want it to say the async payments could not be read, and why", err)
	}
}
