package caddymodule_test

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// remoteBatchWorld is a simulated chain with USD Coin, our facilitator (the engine, holding the receiver
// authorizer key it lists in /supported, claiming nothing of its own accord) served over real HTTP behind a
// switch that can take it down or refuse its claims, and a Caddy whose batch route points facilitator_url at it.
type remoteBatchWorld struct {
	c        *chaintest.Chain
	usdc     string
	token    common.Address
	network  string
	receiver *chaintest.Account
	srv      *caddyServer
	fac      *httptest.Server
	// cut drops every connection to the facilitator once its request is in; refuseClaims answers that many
	// claims with a refusal.
	cut          atomic.Bool
	refuseClaims atomic.Int32
	claims       atomic.Int32
	verifies     atomic.Int32
	// holdClaims holds each claim this long before the facilitator makes it.
	holdClaims atomic.Int64
	caddyfile  string
}

const remotePrice = 1000

func newRemoteBatchWorld(t *testing.T, batchBlock string) *remoteBatchWorld {
	t.Helper()
	w := &remoteBatchWorld{c: chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))}
	c := w.c
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	w.usdc, w.token = usdc.Hex(), usdc
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	w.receiver = chaintest.DeriveAccount("merchant", 1)
	authorizer := chaintest.DeriveAccount("authorizer", 1)
	w.network = x402.EIP155(c.ChainID.Uint64())
	nc := chain.NetworkConfig{Network: w.network, Backend: c.Client, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: usdc, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		Keys:   []*ecdsa.PrivateKey{c.Wallets[0].Key}, BatchReceiverAuthorizer: authorizer.Key, BatchClaimEvery: 1_000_000, BatchClaimAfter: time.Hour}
	engine, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { engine.Close() })
	h, err := facilitatorserver.New(engine, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	fac := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if w.cut.Load() {
			panic(http.ErrAbortHandler) // the connection is cut once the request is in: no answer
		}
		if r.URL.Path == "/verify" {
			w.verifies.Add(1)
		}
		if r.URL.Path == "/settle" {
			body, _ := io.ReadAll(r.Body)
			if strings.Contains(string(body), `"type":"claim"`) {
				w.claims.Add(1)
				time.Sleep(time.Duration(w.holdClaims.Load()))
				if w.refuseClaims.Add(-1) >= 0 {
					rw.Header().Set("Content-Type", "application/json")
					fmt.Fprintf(rw, `{"success":false,"transaction":"","network":%q,"errorReason":%q,"errorMessage":"refused by the test"}`,
						w.network, x402.ReasonBatchClaimSimulationFailed)
					return
				}
			}
			r.Body = io.NopCloser(strings.NewReader(string(body)))
		}
		h.ServeHTTP(rw, r)
	}))
	t.Cleanup(fac.Close)
	w.fac = fac
	w.caddyfile = `{
	x402 {
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle /report {
		x402 {
			scheme batch
			network ` + w.network + `
			asset ` + w.usdc + `
			token_name "` + contracts.USDCoinName + `"
			token_version ` + contracts.USDCoinVersion + `
			token_eip3009
			amount ` + fmt.Sprint(remotePrice) + `
			pay_to ` + w.receiver.Address.Hex() + `
			facilitator_url ` + fac.URL + `
			` + batchBlock + `
		}
		respond "the paid report of channel {http.x402.channel} at {http.x402.cumulative}"
	}
}
`
	w.srv = startCaddy(t, w.caddyfile)
	return w
}

// takeDown stops the facilitator's listener (a connection to it is refused) and returns what starts it again
// at the same address.
func (w *remoteBatchWorld) takeDown(t *testing.T) func() {
	t.Helper()
	addr := w.fac.Listener.Addr().String()
	w.fac.Listener.Close()
	w.fac.CloseClientConnections()     // the kept-alive ones too: a facilitator that is down answers on none
	time.Sleep(100 * time.Millisecond) // and the gate's client sees them closed before it asks again
	return func() {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatalf("listening again at %s: %v", addr, err)
		}
		srv := &http.Server{Handler: w.fac.Config.Handler}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
	}
}

// pay makes n paid requests with client, the k-th of which must stand the channel at (from+k) prices.
func (w *remoteBatchWorld) pay(t *testing.T, client *http.Client, from, n int) {
	t.Helper()
	for k := from + 1; k <= from+n; k++ {
		resp, err := client.Get(w.srv.URL + "/report")
		if err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(string(body), "the paid report") {
			t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s)", k, resp.Status, body, resp.Header.Get(x402.HeaderPaymentRequired))
		}
		s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if err != nil || !s.Success || s.Extra == nil || s.Extra.ChannelState == nil || s.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(k*remotePrice) {
			t.Fatalf("request %d: PAYMENT-RESPONSE %+v (%v); want the channel at %d", k, s, err, k*remotePrice)
		}
	}
}

func (w *remoteBatchWorld) payer(t *testing.T, rec http.RoundTripper) *http.Client {
	t.Helper()
	p, err := payer.New(w.c.Payers[0].Key, payer.Options{RPC: w.c.RPCURL, DepositRequests: 100})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	tr := &payer.Transport{Payer: p, Base: rec, Limits: []payer.Limit{{Network: w.network, Asset: w.usdc, PerRequest: big.NewInt(remotePrice), Total: big.NewInt(1000 * remotePrice)}}}
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// waitForSeller waits until the seller holds want, and fails the test when it does not within 20 s.
func (w *remoteBatchWorld) waitForSeller(t *testing.T, want int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for w.c.BalanceOf(w.token, w.receiver.Address).Int64() != want {
		if time.Now().After(deadline) {
			t.Fatalf("the seller holds %s; want exactly %d", w.c.BalanceOf(w.token, w.receiver.Address), want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestOurGateServesABatchRouteThroughOurFacilitatorOverHTTP: a batch route whose facilitator_url is our
// facilitator in another server: the first request's deposit is verified and sent by the facilitator (one
// transaction), the next 19 vouchers are accepted by the gate off chain (no transaction, no call to the
// facilitator), and at the 20th (claim_every 20) the gate claims them through the facilitator's /settle claim
// action, then settles them to the receiver: three transactions in all, the seller paid exactly the 20 prices
// served, the payer down exactly the deposit, the escrow holding the rest. The last voucher presented again is
// refused as used.
func TestOurGateServesABatchRouteThroughOurFacilitatorOverHTTP(t *testing.T) {
	const requests = 20
	w := newRemoteBatchWorld(t, "batch {\n\t\t\t\tclaim_every 20\n\t\t\t\tclaim_after 1h\n\t\t\t}")
	payerBefore, escrowBefore := w.c.BalanceOf(w.token, w.c.Payers[0].Address), w.c.BalanceOf(w.token, contracts.BatchSettlementAddress)
	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	rec := &headerRecorder{}
	w.pay(t, w.payer(t, rec), 0, requests)
	w.waitForSeller(t, requests*remotePrice)
	if got := w.claims.Load(); got != 1 {
		t.Errorf("the gate sent %d claims; want 1", got)
	}
	if got := w.verifies.Load(); got != 1 {
		t.Errorf("the gate asked the facilitator's /verify %d times; want once, for the deposit (the vouchers are checked off chain)", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 3 {
		t.Errorf("the facilitator sent %d transactions for %d requests; want 3: the deposit, the claim and the settle", sent, requests)
	}
	deposit := new(big.Int).Sub(payerBefore, w.c.BalanceOf(w.token, w.c.Payers[0].Address))
	escrow := new(big.Int).Sub(w.c.BalanceOf(w.token, contracts.BatchSettlementAddress), escrowBefore)
	if deposit.Int64() != 100*remotePrice || escrow.Int64() != 100*remotePrice-requests*remotePrice {
		t.Errorf("the payer paid %s into the escrow, which holds %s more; want the deposit %d, and %d left after the claim", deposit, escrow, 100*remotePrice, 100*remotePrice-requests*remotePrice)
	}

	rec.mu.Lock()
	last := rec.payments[len(rec.payments)-1]
	rec.mu.Unlock()
	again, _ := http.NewRequest(http.MethodGet, w.srv.URL+"/report", nil)
	again.Header.Set(x402.HeaderPaymentSignature, last)
	resp, err := http.DefaultClient.Do(again)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(string(body), x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the last voucher presented again: %s %s; want 402 %s", resp.Status, body, x402.ReasonPaymentAlreadyUsed)
	}
}

// TestABatchRouteThroughAFacilitatorThatIsDownTakesVouchersAndClaimsThemOnceItIsBack: the channel is open and
// the facilitator goes down: the next vouchers are still accepted (the gate's row of the channel, read from the
// facilitator's answer to the deposit, vouches for them, and no call is made), the claims due meanwhile wait, and
// once it is back they are claimed, once: the seller holds exactly what was served.
func TestABatchRouteThroughAFacilitatorThatIsDownTakesVouchersAndClaimsThemOnceItIsBack(t *testing.T) {
	w := newRemoteBatchWorld(t, "batch {\n\t\t\t\tclaim_every 5\n\t\t\t\tclaim_after 1h\n\t\t\t}")
	client := w.payer(t, nil)
	w.pay(t, client, 0, 2)
	restart := w.takeDown(t)
	w.pay(t, client, 2, 8) // 10 accepted: a claim is due, and cannot be sent
	time.Sleep(2 * time.Second)
	if got := w.c.BalanceOf(w.token, w.receiver.Address).Int64(); got != 0 {
		t.Fatalf("the seller holds %d while the facilitator is down; want 0", got)
	}
	restart()
	w.waitForSeller(t, 10*remotePrice)
	time.Sleep(2 * time.Second) // a second claim of the same vouchers would have come by now
	if got := w.c.BalanceOf(w.token, w.receiver.Address).Int64(); got != 10*remotePrice {
		t.Fatalf("the seller holds %d; want exactly the %d served", got, 10*remotePrice)
	}
	if got := w.claims.Load(); got != 1 {
		t.Errorf("the gate sent %d claims; want 1, once the facilitator was back", got)
	}
}

// TestABatchClaimTheFacilitatorRefusesStaysClaimableAndIsClaimedOnce: the facilitator refuses the first claim
// (before any gas): the vouchers are not lost, the next pass claims them, and nothing is claimed twice.
func TestABatchClaimTheFacilitatorRefusesStaysClaimableAndIsClaimedOnce(t *testing.T) {
	w := newRemoteBatchWorld(t, "batch {\n\t\t\t\tclaim_every 5\n\t\t\t\tclaim_after 1h\n\t\t\t}")
	w.refuseClaims.Store(1)
	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	w.pay(t, w.payer(t, nil), 0, 5)
	w.waitForSeller(t, 5*remotePrice)
	time.Sleep(2 * time.Second)
	if got := w.c.BalanceOf(w.token, w.receiver.Address).Int64(); got != 5*remotePrice {
		t.Fatalf("the seller holds %d; want exactly the %d served", got, 5*remotePrice)
	}
	if got := w.claims.Load(); got != 2 {
		t.Errorf("the gate sent %d claims; want 2: the refused one and the one that landed", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 3 {
		t.Errorf("the facilitator sent %d transactions; want 3: the deposit, one claim and the settle", sent)
	}
}

// A batch route through facilitator_url validates; its batch block takes the claim policy only (the receiver
// authorizer is the facilitator's), and a batch block on a gate with no scheme batch is refused, each with an
// error naming what is wrong.
func TestABatchRouteThroughARemoteFacilitatorValidatesAndItsBatchBlockIsChecked(t *testing.T) {
	route := func(scheme, block string) string {
		return "http://127.0.0.1:" + freePortOf(t) + " {\n\tx402 {\n\t\tscheme " + scheme + "\n\t\tnetwork eip155:72344\n" +
			"\t\tasset 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\ttoken_eip3009\n\t\tamount 1000\n" +
			"\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t\tfacilitator_url http://127.0.0.1:" + freePortOf(t) + "\n" + block + "\t}\n\trespond paid\n}\n"
	}
	if err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, route("batch", "\t\tbatch {\n\t\t\tclaim_every 10\n\t\t\tclaim_after 30s\n\t\t}\n"), t.TempDir()))); err != nil {
		t.Fatalf("caddy.Validate of a batch route through facilitator_url = %v; want it valid", err)
	}
	if err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, route("exact", "\t\tbatch {\n\t\t\tclaim_every 10\n\t\t}\n"), t.TempDir()))); err == nil ||
		!strings.Contains(err.Error(), "no way to pay here is scheme batch") {
		t.Fatalf("caddy.Validate of a batch block on an exact route = %v; want it refused", err)
	}
	adaptError(t, route("batch", "\t\tbatch {\n\t\t\treceiver_authorizer_key 0x01\n\t\t}\n"), "Caddyfile:11", "the facilitator's own")
}

// A batch route whose facilitator's /supported lists no batch-settlement kind cannot be paid: it answers 503
// with an error naming the batch-settlement kind and the network, not a 402 nobody can pay (and the gate logs
// the facilitator at its start).
func TestABatchRouteThroughAFacilitatorWithoutBatchSettlementSaysSo(t *testing.T) {
	fac := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		fmt.Fprint(rw, `{"kinds":[{"x402Version":2,"scheme":"exact","network":"eip155:72344"}],"extensions":[],"signers":{}}`)
	}))
	t.Cleanup(fac.Close)
	srv := startCaddy(t, `{{ADDR}} {
	x402 {
		scheme batch
		network eip155:72344
		asset 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
		token_eip3009
		amount 1000
		pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
		facilitator_url `+fac.URL+`
	}
	respond paid
}
`)
	resp, err := http.Get(srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("%s %s", resp.Status, body)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "batch-settlement kind") || !strings.Contains(string(body), "eip155:72344") {
		t.Fatalf("a batch route through a facilitator without batch-settlement: %s %q; want 503 naming the batch-settlement kind and the network", resp.Status, body)
	}
}

// TestABatchClaimInFlightWhileTheGateReloadsIsClaimedOnce: the claim is on its way (the facilitator takes 3 s to
// make it) when the config is reloaded: the old gate's last pass and the new gate's claimer find the channel
// claimed by it, and send nothing more; the seller is paid exactly what was served, by one claim.
func TestABatchClaimInFlightWhileTheGateReloadsIsClaimedOnce(t *testing.T) {
	w := newRemoteBatchWorld(t, "batch {\n\t\t\t\tclaim_every 5\n\t\t\t\tclaim_after 1h\n\t\t\t}")
	w.holdClaims.Store(int64(3 * time.Second))
	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	client := w.payer(t, nil)
	w.pay(t, client, 0, 5)
	deadline := time.Now().Add(10 * time.Second)
	for w.claims.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no claim was sent after 5 vouchers with claim_every 5")
		}
		time.Sleep(10 * time.Millisecond)
	}
	w.srv.load(strings.Replace(w.caddyfile, "the paid report", "the paid report (reloaded)", 1))
	w.holdClaims.Store(0)
	w.waitForSeller(t, 5*remotePrice)
	time.Sleep(3 * time.Second) // a second claim would have come by now
	if got := w.c.BalanceOf(w.token, w.receiver.Address).Int64(); got != 5*remotePrice {
		t.Fatalf("the seller holds %d; want exactly the %d served", got, 5*remotePrice)
	}
	if got := w.claims.Load(); got != 1 {
		t.Errorf("%d claims were sent; want 1", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 3 {
		t.Errorf("the facilitator sent %d transactions; want 3: the deposit, one claim and the settle", sent)
	}
	// The reloaded gate takes the channel's next voucher.
	resp, err := client.Get(w.srv.URL + "/report")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "(reloaded)") || !strings.HasSuffix(string(body), fmt.Sprint(6*remotePrice)) {
		t.Fatalf("the next voucher after the reload: %s %q; want 200 at %d", resp.Status, body, 6*remotePrice)
	}
}

// TestABatchVoucherThroughARemoteFacilitatorWhoseResponseFailedIsServedWhenPresentedAgainAndChargedOnce: the
// upstream fails the voucher's first response: the voucher was accepted (recorded in the gate's journal), but
// bought nothing yet. Presented again it gets the response at the same cumulative amount, with no call to the
// facilitator (charged once: the channel still stands at it); a third time it is refused as used.
func TestABatchVoucherThroughARemoteFacilitatorWhoseResponseFailedIsServedWhenPresentedAgainAndChargedOnce(t *testing.T) {
	w := newRemoteBatchWorld(t, "batch {\n\t\t\t\tclaim_every 1000\n\t\t\t\tclaim_after 1h\n\t\t\t}")
	var fail atomic.Bool
	upstream := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if fail.CompareAndSwap(true, false) {
			http.Error(rw, "the report is not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(rw, "the paid report")
	}))
	t.Cleanup(upstream.Close)
	w.srv.load(strings.Replace(w.caddyfile, `respond "the paid report of channel {http.x402.channel} at {http.x402.cumulative}"`, "reverse_proxy "+upstream.URL, 1))
	rec := &headerRecorder{}
	client := w.payer(t, rec)
	get := func(header string) (*http.Response, string) {
		t.Helper()
		var resp *http.Response
		var err error
		if header == "" {
			resp, err = client.Get(w.srv.URL + "/report")
		} else {
			req, _ := http.NewRequest(http.MethodGet, w.srv.URL+"/report", nil)
			req.Header.Set(x402.HeaderPaymentSignature, header)
			resp, err = http.DefaultClient.Do(req)
		}
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(body)
	}
	cumulative := func(resp *http.Response) string {
		s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if err != nil || s.Extra == nil || s.Extra.ChannelState == nil {
			return ""
		}
		return s.Extra.ChannelState.ChargedCumulativeAmount
	}
	if resp, body := get(""); resp.StatusCode != http.StatusOK || cumulative(resp) != fmt.Sprint(remotePrice) {
		t.Fatalf("the deposit: %s %q at %q", resp.Status, body, cumulative(resp))
	}
	fail.Store(true)
	if resp, body := get(""); resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("the voucher whose upstream failed: %s %q; want the upstream's 500", resp.Status, body)
	}
	rec.mu.Lock()
	voucher := rec.payments[len(rec.payments)-1]
	rec.mu.Unlock()
	verifies := w.verifies.Load()
	if resp, body := get(voucher); resp.StatusCode != http.StatusOK || body != "the paid report" || cumulative(resp) != fmt.Sprint(2*remotePrice) {
		t.Fatalf("the voucher presented again: %s %q at %q; want 200 at %d", resp.Status, body, cumulative(resp), 2*remotePrice)
	}
	if got := w.verifies.Load() - verifies; got != 0 {
		t.Errorf("the voucher presented again asked the facilitator %d times; want none", got)
	}
	if resp, body := get(voucher); resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %s %q; want 402 %s", resp.Status, body, x402.ReasonPaymentAlreadyUsed)
	}
}
