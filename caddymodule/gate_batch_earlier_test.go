package caddymodule_test

import (
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A voucher accepted (charged) whose response was not delivered stays good for that response after the channel's
// next voucher was accepted: a payer whose request for /r/a failed (here the upstream's 500) may pay its next
// voucher for /r/b before it presents the first again. Presented again for /r/a, it gets the response, charged
// nothing more; for another resource, or once served, it is refused (with the corrective answer of any voucher
// below the channel's amount); and the channel's next voucher follows the second, as if the first had been
// presented once. Before, the channel's row knew only its
// last voucher: the first was refused (cumulative amount mismatch, with a corrective 402 that had the payer pay
// for /r/a again). Found by review.
// batchRouteWorld is one Caddy with a batch route /r/* (bbolt journal, claims at most hourly) in front of an
// upstream, on a simulated chain, and a channel of the payer's to the route's receiver.
type batchRouteWorld struct {
	c     *chaintest.Chain
	b     *batchChannel
	url   string
	token common.Address
	srv   *caddyServer
	// config is the Caddyfile with before in front of the route /r/*.
	config func(before string) string
}

func newBatchRouteWorld(t *testing.T, upstream http.Handler) *batchRouteWorld {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	token := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	b := newBatchChannel(c, token)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(b.authorizer))
	up := httptest.NewServer(upstream)
	t.Cleanup(up.Close)
	config := func(before string) string {
		return `{
	x402 {
		network ` + x402.EIP155(c.ChainID.Uint64()) + ` {
			rpc ` + c.RPCURL + `
			asset ` + token.Hex() + ` name "` + contracts.USDCoinName + `" version ` + contracts.USDCoinVersion + ` decimals 6 eip3009
			wallet_keys ` + hexKey(c.Wallets[0]) + `
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_after 1h
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {` + before + `
	handle /r/* {
		x402 {
			scheme batch
			amount ` + fmt.Sprint(batchClaimPrice) + `
			pay_to ` + b.receiver.Address.Hex() + `
		}
		reverse_proxy ` + strings.TrimPrefix(up.URL, "http://") + `
	}
}
`
	}
	srv := startCaddy(t, config(""))
	return &batchRouteWorld{c: c, b: b, url: srv.URL, token: token, srv: srv, config: config}
}

// chargedCumulative is the channel's cumulative amount a successful PAYMENT-RESPONSE in h names.
func chargedCumulative(t *testing.T, h http.Header) string {
	t.Helper()
	s, err := x402.DecodeBatchSettleResponse(h.Get(x402.HeaderPaymentResponse))
	if err != nil || !s.Success || s.Extra == nil || s.Extra.ChannelState == nil {
		t.Fatalf("PAYMENT-RESPONSE %+v (%v); want a success naming the channel's state", s, err)
	}
	return s.Extra.ChannelState.ChargedCumulativeAmount
}

// present sends the payment of req for path and reads the answer.
func (w *batchRouteWorld) present(t *testing.T, path string, req x402.BatchRequest) (int, string, http.Header) {
	t.Helper()
	h, err := x402.EncodeHeader(req.PaymentPayload)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest(http.MethodGet, w.url+path, nil)
	r.Header.Set(x402.HeaderPaymentSignature, h)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), resp.Header
}

func TestAnAcceptedVoucherWhoseResponseFailedIsServedAfterTheChannelsNextVoucher(t *testing.T) {
	var failing atomic.Bool
	var calls atomic.Int32
	w := newBatchRouteWorld(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if failing.Load() && r.URL.Path == "/r/a" {
			http.Error(w, "not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "paid "+r.URL.Path)
	}))
	b := w.b
	present := func(path string, req x402.BatchRequest) (int, string, http.Header) {
		t.Helper()
		return w.present(t, path, req)
	}
	charged := func(h http.Header) string { t.Helper(); return chargedCumulative(t, h) }

	failing.Store(true)
	first := b.deposit(t, 10*batchClaimPrice, batchClaimPrice)
	if st, body, _ := present("/r/a", first); st != http.StatusInternalServerError {
		t.Fatalf("the deposit and its voucher for /r/a, the upstream failing: %d %q; want its 500", st, body)
	}
	failing.Store(false)
	if st, body, h := present("/r/b", b.voucher(2*batchClaimPrice)); st != http.StatusOK || charged(h) != fmt.Sprint(2*batchClaimPrice) {
		t.Fatalf("the next voucher for /r/b: %d %q; want 200 at %d", st, body, 2*batchClaimPrice)
	}
	earlier := b.voucher(batchClaimPrice) // the deposit's voucher, alone
	// For another resource it is refused, with the corrective answer (the channel stands at the second voucher).
	if st, body, _ := present("/r/c", earlier); st != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonBatchCumulativeAmountMismatch) {
		t.Fatalf("the first voucher for another resource: %d %q; want 402 %s", st, body, x402.ReasonBatchCumulativeAmountMismatch)
	}
	before := calls.Load()
	st, body, h := present("/r/a", earlier)
	if st != http.StatusOK || body != "paid /r/a" {
		t.Fatalf("the first voucher presented again for /r/a after the next was accepted: %d %q; want its response", st, body)
	}
	if got := charged(h); got != fmt.Sprint(batchClaimPrice) {
		t.Errorf("its PAYMENT-RESPONSE names cumulative %s; want its own, %d (charged once)", got, batchClaimPrice)
	}
	if calls.Load() != before+1 {
		t.Errorf("the upstream ran %d times for it; want once", calls.Load()-before)
	}
	if st, body, _ := present("/r/a", earlier); st != http.StatusPaymentRequired || strings.Contains(body, "paid /r/a") {
		t.Fatalf("the first voucher once served: %d %q; want 402", st, body)
	}
	// Nothing more was charged: the channel stands at the second voucher, and takes the third after it.
	if st, body, h := present("/r/d", b.voucher(3*batchClaimPrice)); st != http.StatusOK || charged(h) != fmt.Sprint(3*batchClaimPrice) {
		t.Fatalf("the third voucher: %d %q; want 200 at %d", st, body, 3*batchClaimPrice)
	}
	// A voucher of an amount the channel never accepted, below its last, is refused (no record: never accepted).
	if st, body, _ := present("/r/e", b.voucher(batchClaimPrice+batchClaimPrice/2)); st != http.StatusPaymentRequired {
		t.Fatalf("a voucher below the channel's amount that was never accepted: %d %q; want 402", st, body)
	}
}

// Our payer whose request's upstream failed (a 404 for good: the voucher was accepted, its response never comes)
// goes on paying for other resources of the route: the voucher it signs again for the next request is refused as
// used (accepted for the other resource), so it counts it as charged and pays that request by the next one. Before,
// it signed the same voucher again for every request, each refused, and the channel paid for nothing more. Found
// by review.
func TestOurPayerGoesOnPayingAfterAVoucherWhoseResponseNeverCame(t *testing.T) {
	w := newBatchRouteWorld(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/r/missing" {
			http.NotFound(w, r)
			return
		}
		io.WriteString(w, "paid "+r.URL.Path)
	}))
	p, err := payer.New(w.c.Payers[0].Key, payer.Options{RPC: w.c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: x402.EIP155(w.c.ChainID.Uint64()), PerRequest: big.NewInt(batchClaimPrice),
		Total: big.NewInt(100 * batchClaimPrice)}}}
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	var last http.Header
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := client.Get(w.url + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		last = resp.Header
		return resp.StatusCode, string(body)
	}
	if st, body := get("/r/missing"); st != http.StatusNotFound {
		t.Fatalf("/r/missing: %d %q; want the upstream's 404", st, body)
	}
	for _, path := range []string{"/r/x", "/r/y", "/r/z"} {
		if st, body := get(path); st != http.StatusOK || body != "paid "+path {
			t.Fatalf("%s after the 404: %d %.300q; want its response", path, st, body)
		}
	}
	// Four vouchers were accepted (the 404's and the three served), each charged once.
	s, err := x402.DecodeBatchSettleResponse(last.Get(x402.HeaderPaymentResponse))
	if err != nil || s.Extra == nil || s.Extra.ChannelState == nil || s.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(4*batchClaimPrice) {
		t.Fatalf("the last answer's PAYMENT-RESPONSE %+v (%v); want the channel at %d", s, err, 4*batchClaimPrice)
	}
}

// A voucher accepted whose response was not delivered is served when presented again for its resource after a
// reload that renumbered its route (a gate configured alike added before it; a gateway of a cluster configured
// with one more), as a payment of the exact scheme is: the route sells the resource at the terms the voucher was
// accepted under, so it is judged by them. Both ways a voucher comes again: at the channel's amount, and below it
// once the channel's next voucher was accepted. Before, it was refused as "accepted for another resource", its
// payer charged for a response it never got. Found by the money-invariant run once its batch lanes met an upstream
// that fails a path's first request (seed 1795993010961594377, three).
func TestAVoucherWhoseResponseFailedIsServedAfterAReloadRenumberedItsRoute(t *testing.T) {
	var failing atomic.Bool
	w := newBatchRouteWorld(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() && r.URL.Path == "/r/a" {
			http.Error(w, "not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "paid "+r.URL.Path)
	}))
	b := w.b
	added := `
	handle /added/* {
		x402 {
			scheme batch
			amount ` + fmt.Sprint(3*batchClaimPrice) + `
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e19
		}
		respond "added"
	}`
	charged := func(h http.Header) string { t.Helper(); return chargedCumulative(t, h) }

	// At the channel's amount: accepted, its upstream failing; the reload; presented again.
	failing.Store(true)
	first := b.deposit(t, 10*batchClaimPrice, batchClaimPrice)
	if st, body, _ := w.present(t, "/r/a", first); st != http.StatusInternalServerError {
		t.Fatalf("the deposit and its voucher for /r/a, the upstream failing: %d %q; want its 500", st, body)
	}
	w.srv.load(w.config(added))
	failing.Store(false)
	if st, body, h := w.present(t, "/r/a", b.voucher(batchClaimPrice)); st != http.StatusOK || body != "paid /r/a" || charged(h) != fmt.Sprint(batchClaimPrice) {
		t.Fatalf("the voucher presented again for /r/a after the reload: %d %q; want its response at %d", st, body, batchClaimPrice)
	}

	// Below it: accepted, failing; the reload back; the channel's next voucher; presented again.
	failing.Store(true)
	if st, body, _ := w.present(t, "/r/a", b.voucher(2*batchClaimPrice)); st != http.StatusInternalServerError {
		t.Fatalf("the second voucher for /r/a, the upstream failing: %d %q; want its 500", st, body)
	}
	w.srv.load(w.config(""))
	failing.Store(false)
	if st, body, h := w.present(t, "/r/b", b.voucher(3*batchClaimPrice)); st != http.StatusOK || charged(h) != fmt.Sprint(3*batchClaimPrice) {
		t.Fatalf("the third voucher for /r/b: %d %q; want 200 at %d", st, body, 3*batchClaimPrice)
	}
	if st, body, h := w.present(t, "/r/a", b.voucher(2*batchClaimPrice)); st != http.StatusOK || body != "paid /r/a" || charged(h) != fmt.Sprint(2*batchClaimPrice) {
		t.Fatalf("the second voucher presented again for /r/a after the reload and the third: %d %q; want its response at %d", st, body, 2*batchClaimPrice)
	}
	// Judged by the route's terms, not by the record's: where the route sells the resource at another price now, a
	// voucher is refused, with nothing served, whatever price its payment names; back at its route, it is served.
	failing.Store(true)
	if st, body, _ := w.present(t, "/r/a", b.voucher(4*batchClaimPrice)); st != http.StatusInternalServerError {
		t.Fatalf("the fourth voucher for /r/a, the upstream failing: %d %q; want its 500", st, body)
	}
	failing.Store(false)
	if st, body, _ := w.present(t, "/r/b", b.voucher(5*batchClaimPrice)); st != http.StatusOK {
		t.Fatalf("the fifth voucher for /r/b: %d %q; want 200", st, body)
	}
	failing.Store(true)
	if st, body, _ := w.present(t, "/r/a", b.voucher(6*batchClaimPrice)); st != http.StatusInternalServerError {
		t.Fatalf("the sixth voucher for /r/a, the upstream failing: %d %q; want its 500", st, body)
	}
	failing.Store(false)
	dearer := strings.Replace(w.config(added), "amount "+fmt.Sprint(batchClaimPrice), "amount "+fmt.Sprint(2*batchClaimPrice), 1)
	w.srv.load(dearer)
	at := func(req x402.BatchRequest, price int64) x402.BatchRequest {
		req.PaymentPayload.Accepted.Amount, req.PaymentRequirements.Amount = fmt.Sprint(price), fmt.Sprint(price)
		return req
	}
	for _, c := range []struct {
		name   string
		req    x402.BatchRequest
		reason string
	}{
		{"the sixth, at the channel's amount, naming the price it was charged", b.voucher(6 * batchClaimPrice), x402.ReasonValueMismatch},
		{"the sixth, naming the route's price now", at(b.voucher(6*batchClaimPrice), 2*batchClaimPrice), x402.ReasonPaymentAlreadyUsed},
		{"the fourth, below the channel's amount, naming the route's price now", at(b.voucher(4*batchClaimPrice), 2*batchClaimPrice), x402.ReasonBatchCumulativeAmountMismatch},
	} {
		if st, body, _ := w.present(t, "/r/a", c.req); st != http.StatusPaymentRequired || !strings.Contains(body, c.reason) || strings.Contains(body, "paid /r/a") {
			t.Errorf("%s at a renumbered route of another price: %d %.300q; want 402 %s", c.name, st, body, c.reason)
		}
	}
	w.srv.load(w.config(""))
	for _, cum := range []int64{4, 6} {
		if st, body, h := w.present(t, "/r/a", b.voucher(cum*batchClaimPrice)); st != http.StatusOK || body != "paid /r/a" || charged(h) != fmt.Sprint(cum*batchClaimPrice) {
			t.Errorf("voucher %d presented again at its route: %d %q; want its response", cum, st, body)
		}
	}
}
