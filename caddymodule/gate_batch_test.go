package caddymodule_test

import (
	"context"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// headerRecorder is a RoundTripper that keeps the payment header of every request it sends.
type headerRecorder struct {
	mu       sync.Mutex
	payments []string
}

func (h *headerRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	if v := r.Header.Get(x402.HeaderPaymentSignature); v != "" {
		h.mu.Lock()
		h.payments = append(h.payments, v)
		h.mu.Unlock()
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestOurPayerPaysABatchRouteWithOneDepositAndVouchersAndTheSellerIsPaidExactlyWhatWasServed: a route of scheme
// batch behind a real Caddy and the embedded engine on a simulated chain, paid by payer.Transport: the first
// request opens the channel with one deposit (one transaction), the next 50 pay by voucher (no transaction each),
// every response names the channel at its cumulative amount, and so do the {http.x402.channel} and
// {http.x402.cumulative} placeholders. Once the
// claimer has claimed (claim_every 51), the seller holds exactly the 51 prices served. The last voucher presented
// again is refused as used: served once.
func TestOurPayerPaysABatchRouteWithOneDepositAndVouchersAndTheSellerIsPaidExactlyWhatWasServed(t *testing.T) {
	const price, requests = 1000, 51
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	receiver, authorizer := chaintest.DeriveAccount("merchant", 0), chaintest.DeriveAccount("authorizer", 0)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(authorizer))
	network := x402.EIP155(c.ChainID.Uint64())
	srv := startCaddy(t, `{
	x402 {
		network `+network+` {
			rpc `+c.RPCURL+`
			asset `+c.Token.Hex()+` name "Stable Coin" version 1 decimals 6
			asset `+usdc.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_every `+fmt.Sprint(requests)+`
				claim_after 1h
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle /report {
		x402 {
			scheme batch
			asset `+usdc.Hex()+`
			token_name "`+contracts.USDCoinName+`"
			token_version `+contracts.USDCoinVersion+`
			token_eip3009
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		respond "the paid report of channel {http.x402.channel} at {http.x402.cumulative}"
	}
}
`)
	p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL, DepositRequests: 2 * requests})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	rec := &headerRecorder{}
	tr := &payer.Transport{Payer: p, Base: rec, Limits: []payer.Limit{{Network: network, Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100 * price)}}}
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	sentBefore := c.TxCount(c.Wallets[0].Address)
	var channel string
	for k := 1; k <= requests; k++ {
		resp, err := client.Get(srv.URL + "/report")
		if err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(string(body), "the paid report") {
			t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s)", k, resp.Status, body, resp.Header.Get(x402.HeaderPaymentRequired))
		}
		s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if err != nil || !s.Success || s.Extra == nil || s.Extra.ChannelState == nil {
			t.Fatalf("request %d: PAYMENT-RESPONSE %+v (%v) names no channel", k, s, err)
		}
		cs := s.Extra.ChannelState
		if cs.ChargedCumulativeAmount != fmt.Sprint(k*price) || !strings.EqualFold(string(body), "the paid report of channel "+cs.ChannelID+" at "+cs.ChargedCumulativeAmount) {
			t.Fatalf("request %d: the channel %s stands at %s, the response (its placeholders) says %q; want %d",
				k, cs.ChannelID, cs.ChargedCumulativeAmount, body, k*price)
		}
		channel = cs.ChannelID
	}
	if sent := c.TxCount(c.Wallets[0].Address) - sentBefore; sent != 1 {
		t.Fatalf("the settlement wallet sent %d transactions for %d requests; want 1, the deposit", sent, requests)
	}

	// The last voucher presented again bought its response already.
	rec.mu.Lock()
	last := rec.payments[len(rec.payments)-1]
	rec.mu.Unlock()
	again, err := http.NewRequest(http.MethodGet, srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
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

	deadline := time.Now().Add(20 * time.Second)
	for c.BalanceOf(usdc, receiver.Address).Int64() != requests*price {
		if time.Now().After(deadline) {
			t.Fatalf("the seller holds %s after the claim; want exactly the %d served", c.BalanceOf(usdc, receiver.Address), requests*price)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if sent := c.TxCount(c.Wallets[0].Address) - sentBefore; sent != 2 {
		t.Fatalf("the settlement wallet sent %d transactions; want 2: the deposit and one claim", sent)
	}
	if st, ok := p.Channel(common.HexToHash(channel)); !ok || st.Charged.Int64() != requests*price {
		t.Fatalf("the payer keeps %+v (known %v); want %d charged", st, ok, requests*price)
	}

	// The payer withdraws what is left: asked for, then, past the channel's withdrawDelay, finalized. A voucher of
	// the channel is refused at each step with the SDK's reason, the route's response not served, nothing charged
	// (the same voucher presented again is refused the same, never as used) and nothing sent.
	pay, err := x402.DecodeBatchPayment(last)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := chain.ParseChannelConfig(*pay.Payload.ChannelConfig)
	if err != nil {
		t.Fatal(err)
	}
	escrow := func(data []byte, what string) {
		t.Helper()
		if _, err := c.Transact(context.Background(), c.Payers[0], contracts.BatchSettlementAddress, data); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	next := func() string {
		v := pay
		v.Payload.Voucher = &x402.BatchVoucherFields{ChannelID: channel, MaxClaimableAmount: fmt.Sprint((requests + 1) * price),
			Signature: hexutil.Encode(c.SignVoucher(c.Payers[0], common.HexToHash(channel), big.NewInt((requests+1)*price)))}
		h, err := x402.EncodeHeader(v)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	refusedWithdrawn := func(when string) {
		t.Helper()
		sent := c.TxCount(c.Wallets[0].Address)
		for range 2 {
			req, err := http.NewRequest(http.MethodGet, srv.URL+"/report", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set(x402.HeaderPaymentSignature, next())
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusPaymentRequired || strings.Contains(string(body), "the paid report") ||
				!strings.Contains(string(body), "invalid_batch_settlement_evm_") || strings.Contains(string(body), x402.ReasonPaymentAlreadyUsed) {
				t.Fatalf("a voucher of a channel %s: %s %s; want 402 with the SDK's reason, nothing served or charged", when, resp.Status, body)
			}
		}
		if got := c.TxCount(c.Wallets[0].Address) - sent; got != 0 {
			t.Fatalf("the vouchers of a channel %s sent %d transactions", when, got)
		}
		if got := c.BalanceOf(usdc, receiver.Address).Int64(); got != requests*price {
			t.Fatalf("the seller holds %d after the vouchers of a channel %s; want %d", got, when, requests*price)
		}
	}
	view, _ := contracts.PackBatchSettlement("channels", common.HexToHash(channel))
	raw, err := c.Call(context.Background(), c.Payers[0].Address, contracts.BatchSettlementAddress, view)
	if err != nil {
		t.Fatal(err)
	}
	state, err := contracts.BatchSettlementABI.Unpack("channels", raw)
	if err != nil || len(state) != 2 {
		t.Fatalf("reading the channel: %v", err)
	}
	left := new(big.Int).Sub(state[0].(*big.Int), state[1].(*big.Int))
	data, _ := contracts.PackInitiateWithdraw(cfg, left)
	escrow(data, "initiateWithdraw")
	c.AdjustTime(time.Duration(contracts.MinWithdrawDelay+60) * time.Second)
	// Another payer's first request: its deposit shows the engine the chain's time now, as the blocks it reads in
	// service do (here the chain's clock jumped, the engine's did not).
	p2, err := payer.New(c.Payers[1].Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	tr2 := &payer.Transport{Payer: p2, Limits: []payer.Limit{{Network: network, Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100 * price)}}}
	if resp, err := (&http.Client{Transport: tr2, Timeout: time.Minute}).Get(srv.URL + "/report"); err != nil {
		t.Fatal(err)
	} else if resp.Body.Close(); resp.StatusCode != http.StatusOK {
		t.Fatalf("another payer's request: %s", resp.Status)
	}
	refusedWithdrawn("whose withdrawal was asked for longer ago than its delay")
	data, _ = contracts.PackFinalizeWithdraw(cfg)
	escrow(data, "finalizeWithdraw")
	refusedWithdrawn("withdrawn")
}

// TestABatchVoucherWhoseResponseFailedIsServedWhenPresentedAgainAndChargedOnce: the upstream fails the first time:
// the voucher (here the channel's deposit and first voucher) was accepted, but bought nothing yet. Presented
// again it gets the response, its answer the same cumulative amount (charged once, no second deposit), and a
// third time it is refused as used.
func TestABatchVoucherWhoseResponseFailedIsServedWhenPresentedAgainAndChargedOnce(t *testing.T) {
	const price = 1000
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	receiver, authorizer := chaintest.DeriveAccount("merchant", 0), chaintest.DeriveAccount("authorizer", 0)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(authorizer))
	var calls sync.Map
	var served atomic.Int32
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		if _, again := calls.LoadOrStore("called", true); !again {
			http.Error(w, "the report is not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "the paid report")
	}))
	t.Cleanup(upstream.Close)
	network := x402.EIP155(c.ChainID.Uint64())
	srv := startCaddy(t, `{
	x402 {
		network `+network+` {
			rpc `+c.RPCURL+`
			asset `+usdc.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle /report {
		x402 {
			scheme batch
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")+`
	}
	handle /other {
		x402 {
			scheme batch
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")+`
	}
}
`)
	p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	rec := &headerRecorder{}
	tr := &payer.Transport{Payer: p, Base: rec, Limits: []payer.Limit{{Network: network, Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100 * price)}}}
	resp, err := (&http.Client{Transport: tr, Timeout: time.Minute}).Get(srv.URL + "/report")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("the first request: %s; want the upstream's 500 passed on", resp.Status)
	}
	sent := c.TxCount(c.Wallets[0].Address)
	rec.mu.Lock()
	first := rec.payments[len(rec.payments)-1]
	rec.mu.Unlock()
	presentAt := func(path string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set(x402.HeaderPaymentSignature, first)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp, string(body)
	}
	present := func() (*http.Response, string) { return presentAt("/report") }
	// A payment buys the response it was made for: the unserved voucher of /report, presented at /other (the same
	// terms), is refused there, and the upstream is not asked.
	before := served.Load()
	if resp, body := presentAt("/other"); resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the unserved voucher of /report presented at /other: %s %s; want 402 %s", resp.Status, body, x402.ReasonPaymentAlreadyUsed)
	}
	if got := served.Load() - before; got != 0 {
		t.Fatalf("the voucher of /report presented at /other reached the upstream %d times; want none", got)
	}
	resp, body := present()
	if resp.StatusCode != http.StatusOK || body != "the paid report" {
		t.Fatalf("the voucher presented again after the upstream failed: %s %q; want the response", resp.Status, body)
	}
	s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
	if err != nil || !s.Success || s.Extra == nil || s.Extra.ChannelState == nil || s.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(price) {
		t.Fatalf("PAYMENT-RESPONSE %+v (%v); want the channel at %d: charged once", s, err, price)
	}
	if got := c.TxCount(c.Wallets[0].Address); got != sent {
		t.Fatalf("presenting the deposit again sent %d transactions; want none", got-sent)
	}
	if resp, body := present(); resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %s %s; want 402 %s", resp.Status, body, x402.ReasonPaymentAlreadyUsed)
	}
}
