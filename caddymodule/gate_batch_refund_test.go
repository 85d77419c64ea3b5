package caddymodule_test

import (
	"bytes"
	"encoding/json"
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

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// answerRecorder is a RoundTripper that keeps the last answer to a request carrying a payment header: its status,
// headers and body.
type answerRecorder struct {
	mu      sync.Mutex
	payment string
	status  int
	header  http.Header
	body    []byte
}

func (a *answerRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	v := r.Header.Get(x402.HeaderPaymentSignature)
	if err != nil || v == "" {
		return resp, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	a.mu.Lock()
	a.payment, a.status, a.header, a.body = v, resp.StatusCode, resp.Header.Clone(), body
	a.mu.Unlock()
	return resp, nil
}

// present sends payment value to url as is.
func present(t *testing.T, url, value string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, value)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}

// TestOurPayerRefundsTheRestOfItsChannelThroughTheGateOnceAndBalancesAreExact: a batch route behind a real Caddy
// with the embedded engine on a simulated chain; payer.Transport opens a channel (one deposit of 20 prices) and
// pays 10 requests by voucher, none claimed yet. Refused before any gas, each with the SDK's reason: another
// payer's refund of the channel, and a refund of more than is left. The payer's refund is answered as the SDK's
// server answers one (200, a JSON body acknowledging it and naming the channel, PAYMENT-RESPONSE the refund's
// settlement with the channel's charged amount), the upstream not run; one transaction claims the 10 vouchers,
// pays the seller and returns the rest. On chain: the seller up exactly 10 prices, the payer down exactly 10
// prices, the escrow back where it was. Presented again, the refund gets the same answer and nothing is sent; the
// last voucher presented again is refused as used.
func TestOurPayerRefundsTheRestOfItsChannelThroughTheGateOnceAndBalancesAreExact(t *testing.T) {
	const price, requests = 1000, 10
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	receiver, authorizer := chaintest.DeriveAccount("merchant", 0), chaintest.DeriveAccount("authorizer", 0)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(authorizer))
	var upstreamCalls atomic.Int64
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		upstreamCalls.Add(1)
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
				claim_every 1000
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
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")+`
	}
}
`)
	payerBefore, sellerBefore, escrowBefore := c.BalanceOf(usdc, c.Payers[0].Address), c.BalanceOf(usdc, receiver.Address), c.BalanceOf(usdc, contracts.BatchSettlementAddress)
	p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL, DepositRequests: 2 * requests})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	rec := &answerRecorder{}
	tr := &payer.Transport{Payer: p, Base: rec, Limits: []payer.Limit{{Network: network, Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100 * price)}}}
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	var channel string
	for k := 1; k <= requests; k++ {
		resp, err := client.Get(srv.URL + "/report")
		if err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != "the paid report" {
			t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s)", k, resp.Status, body, resp.Header.Get(x402.HeaderPaymentRequired))
		}
		s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if err != nil || s.Extra == nil || s.Extra.ChannelState == nil {
			t.Fatalf("request %d: PAYMENT-RESPONSE %+v (%v)", k, s, err)
		}
		channel = s.Extra.ChannelState.ChannelID
	}
	rec.mu.Lock()
	lastVoucher := rec.payment
	rec.mu.Unlock()
	sent := c.TxCount(c.Wallets[0].Address)
	served := upstreamCalls.Load()

	// Another payer's refund of this channel: the payer's voucher at 10 prices, signed by someone else.
	forged, err := x402.DecodeBatchPayment(lastVoucher)
	if err != nil {
		t.Fatal(err)
	}
	forged.Payload.Type, forged.Payload.Deposit = x402.BatchRefund, nil
	sig, err := chain.SignVoucher(c.Payers[1].Key, chain.BatchDomainSeparator(c.ChainID), common.HexToHash(channel), big.NewInt(requests*price))
	if err != nil {
		t.Fatal(err)
	}
	forged.Payload.Voucher.Signature = sig.String()
	value, err := x402.EncodeHeader(forged)
	if err != nil {
		t.Fatal(err)
	}
	resp, body := present(t, srv.URL+"/report", value)
	if s, _ := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse)); resp.StatusCode != http.StatusPaymentRequired ||
		s.Success || s.ErrorReason != x402.ReasonBatchInvalidVoucherSignature {
		t.Fatalf("another payer's refund: %s %s (PAYMENT-RESPONSE %+v); want 402 %s", resp.Status, body, s, x402.ReasonBatchInvalidVoucherSignature)
	}
	// More than is left.
	if _, _, err := p.Refund(t.Context(), &http.Client{Transport: rec}, srv.URL+"/report", big.NewInt(requests*price+1)); err == nil ||
		!strings.Contains(err.Error(), x402.ReasonBatchRefundAmountInvalid) {
		t.Fatalf("a refund of %d of the %d left: %v; want %s", requests*price+1, requests*price, err, x402.ReasonBatchRefundAmountInvalid)
	}
	if got := c.TxCount(c.Wallets[0].Address); got != sent {
		t.Fatalf("refused refunds sent %d transactions", got-sent)
	}

	st, answer, err := p.Refund(t.Context(), &http.Client{Transport: rec}, srv.URL+"/report", nil)
	if err != nil {
		t.Fatalf("the refund: %v", err)
	}
	rec.mu.Lock()
	refund, status, header, ack := rec.payment, rec.status, rec.header, rec.body
	rec.mu.Unlock()
	var got struct{ Message, ChannelID string }
	if status != http.StatusOK || json.Unmarshal(ack, &got) != nil || got.Message != "Refund acknowledged" || !strings.EqualFold(got.ChannelID, channel) ||
		!strings.HasPrefix(header.Get("Content-Type"), "application/json") {
		t.Fatalf("the refund's answer: %d %s %q; want 200, a JSON body acknowledging the refund of channel %s", status, header.Get("Content-Type"), ack, channel)
	}
	if !answer.Success || answer.Transaction == "" || answer.Amount != fmt.Sprint(requests*price) || answer.Extra == nil || answer.Extra.ChannelState == nil ||
		answer.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(requests*price) || answer.Extra.ChannelState.Balance != fmt.Sprint(requests*price) {
		t.Fatalf("the refund's PAYMENT-RESPONSE %+v; want the %d left returned and the channel at %d charged of %d", answer, requests*price, requests*price, requests*price)
	}
	if st.Left().Sign() != 0 || st.Charged.Int64() != requests*price {
		t.Errorf("the payer keeps %+v after the refund; want nothing left of %d charged", st, requests*price)
	}
	if got := upstreamCalls.Load(); got != served {
		t.Errorf("the upstream ran %d times for the refunds; a refund buys no response", got-served)
	}
	if got := c.TxCount(c.Wallets[0].Address) - sent; got != 1 {
		t.Fatalf("the refund sent %d transactions; want 1 (claim, settle and refund)", got)
	}
	payerAfter, sellerAfter, escrowAfter := c.BalanceOf(usdc, c.Payers[0].Address), c.BalanceOf(usdc, receiver.Address), c.BalanceOf(usdc, contracts.BatchSettlementAddress)
	if d := new(big.Int).Sub(payerBefore, payerAfter); d.Int64() != requests*price {
		t.Errorf("the payer paid %s in all; want %d", d, requests*price)
	}
	if d := new(big.Int).Sub(sellerAfter, sellerBefore); d.Int64() != requests*price {
		t.Errorf("the seller got %s; want %d", d, requests*price)
	}
	if d := new(big.Int).Sub(escrowAfter, escrowBefore); d.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before; want 0", d)
	}

	// Presented again: the same answer, nothing sent, the upstream not run.
	resp, body = present(t, srv.URL+"/report", refund)
	again, _ := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
	if resp.StatusCode != http.StatusOK || !again.Success || again.Transaction != answer.Transaction {
		t.Fatalf("the refund presented again: %s %s (PAYMENT-RESPONSE %+v); want 200 and transaction %s", resp.Status, body, again, answer.Transaction)
	}
	// The last voucher presented again bought its response already.
	if resp, body := present(t, srv.URL+"/report", lastVoucher); resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the last voucher presented again: %s %s; want 402 %s", resp.Status, body, x402.ReasonPaymentAlreadyUsed)
	}
	if got := c.TxCount(c.Wallets[0].Address) - sent; got != 1 {
		t.Fatalf("presenting again sent %d transactions more", got-1)
	}
	if got := upstreamCalls.Load(); got != served {
		t.Errorf("the upstream ran %d times after the vouchers", got-served)
	}
}

// TestCaddyX402PayPaysABatchRouteRunAfterRunAndItsRefundReturnsTheRestBalancesExact: `caddy x402 pay` against a
// batch route behind a real Caddy, the embedded engine on a simulated chain claiming each voucher as it comes
// (claim_every 1). Each run is a new payer that knows its channel only from the escrow (--rpc): the first opens it
// with a deposit, the next two pay by voucher from what the escrow shows claimed, and `pay --refund` gets the
// rest back. On chain: the payer down exactly 3 prices, the seller up exactly 3 prices, the escrow back where it
// was; the settlement wallet sent the deposit, three claims and the refund.
func TestCaddyX402PayPaysABatchRouteRunAfterRunAndItsRefundReturnsTheRestBalancesExact(t *testing.T) {
	const price, runs = 1000, 3
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(1))
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
			asset `+usdc.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_every 1
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
		respond "the paid report at {http.x402.cumulative}"
	}
}
`)
	payerBefore, sellerBefore, escrowBefore := c.BalanceOf(usdc, c.Payers[0].Address), c.BalanceOf(usdc, receiver.Address), c.BalanceOf(usdc, contracts.BatchSettlementAddress)
	sentBefore := c.TxCount(c.Wallets[0].Address)
	key := hexKey(c.Payers[0])
	for k := 1; k <= runs; k++ {
		stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", c.RPCURL, "--max", "10000", srv.URL+"/report")
		if err != nil || !strings.Contains(stdout, fmt.Sprintf("the paid report at %d", k*price)) {
			t.Fatalf("pay run %d: %v\n%s\n%s", k, err, stdout, stderr)
		}
		// The claimer claims the voucher (and pays the seller) before the next run reads the escrow.
		deadline := time.Now().Add(20 * time.Second)
		for new(big.Int).Sub(c.BalanceOf(usdc, receiver.Address), sellerBefore).Int64() != int64(k*price) {
			if time.Now().After(deadline) {
				t.Fatalf("after run %d the seller got %s; want %d claimed", k, new(big.Int).Sub(c.BalanceOf(usdc, receiver.Address), sellerBefore), k*price)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", c.RPCURL, "--refund", srv.URL+"/report")
	if err != nil || !strings.Contains(stderr, fmt.Sprintf("cumulative %d charged, balance %d, left 0", runs*price, runs*price)) {
		t.Fatalf("pay --refund: %v\n%s\n%s", err, stdout, stderr)
	}
	if d := new(big.Int).Sub(payerBefore, c.BalanceOf(usdc, c.Payers[0].Address)); d.Int64() != runs*price {
		t.Errorf("the payer paid %s in all; want %d", d, runs*price)
	}
	if d := new(big.Int).Sub(c.BalanceOf(usdc, receiver.Address), sellerBefore); d.Int64() != runs*price {
		t.Errorf("the seller got %s; want %d", d, runs*price)
	}
	if d := new(big.Int).Sub(c.BalanceOf(usdc, contracts.BatchSettlementAddress), escrowBefore); d.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before; want 0", d)
	}
	if sent := c.TxCount(c.Wallets[0].Address) - sentBefore; sent != 1+runs+1 {
		t.Errorf("the settlement wallet sent %d transactions; want %d: the deposit, %d claims, the refund", sent, 2+runs, runs)
	}
}

// TestANewPayerRunCarriesOnFromTheGatesCorrective402AndRefundsVouchersNotYetClaimed: payer.Transport pays a batch
// route 5 times, nothing claimed yet (claim_every 1000). A new run of caddy x402 pay knows the channel only from
// the escrow (nothing claimed): its voucher at 1000 is answered by the gate's corrective 402 (error
// invalid_batch_settlement_evm_cumulative_amount_mismatch, the requirement naming the channel at 5000 and the
// payer's own voucher of 5000), it carries on from there and pays at 6000; another run's pay --refund likewise
// signs its refund at 6000 after the corrective 402. The refund claims the 6 vouchers and returns the rest: payer
// down exactly 6 prices, seller up exactly 6, escrow back where it was, the deposit and the refund the only
// transactions.
func TestANewPayerRunCarriesOnFromTheGatesCorrective402AndRefundsVouchersNotYetClaimed(t *testing.T) {
	const price, requests = 1000, 5
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(1))
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
			asset `+usdc.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_every 1000
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
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		respond "the paid report at {http.x402.cumulative}"
	}
}
`)
	payerBefore, sellerBefore, escrowBefore := c.BalanceOf(usdc, c.Payers[0].Address), c.BalanceOf(usdc, receiver.Address), c.BalanceOf(usdc, contracts.BatchSettlementAddress)
	sentBefore := c.TxCount(c.Wallets[0].Address)
	p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL, DepositRequests: 4 * requests})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: network, Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100 * price)}}}}
	for k := 1; k <= requests; k++ {
		resp, err := client.Get(srv.URL + "/report")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s", k, resp.Status)
		}
	}
	key := hexKey(c.Payers[0])
	stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", key, "--rpc", c.RPCURL, "--max", "100000", srv.URL+"/report")
	if err != nil || !strings.Contains(stdout, fmt.Sprintf("the paid report at %d", (requests+1)*price)) {
		t.Fatalf("a new run of pay: %v\n%s\n%s", err, stdout, stderr)
	}
	stdout, stderr, err = caddymodule.RunX402("", "pay", "--key", key, "--rpc", c.RPCURL, "--refund", srv.URL+"/report")
	if err != nil || !strings.Contains(stderr, fmt.Sprintf("cumulative %d charged", (requests+1)*price)) {
		t.Fatalf("a new run of pay --refund: %v\n%s\n%s", err, stdout, stderr)
	}
	const paid = (requests + 1) * price
	if d := new(big.Int).Sub(payerBefore, c.BalanceOf(usdc, c.Payers[0].Address)); d.Int64() != paid {
		t.Errorf("the payer paid %s in all; want %d", d, paid)
	}
	if d := new(big.Int).Sub(c.BalanceOf(usdc, receiver.Address), sellerBefore); d.Int64() != paid {
		t.Errorf("the seller got %s; want %d", d, paid)
	}
	if d := new(big.Int).Sub(c.BalanceOf(usdc, contracts.BatchSettlementAddress), escrowBefore); d.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before; want 0", d)
	}
	if sent := c.TxCount(c.Wallets[0].Address) - sentBefore; sent != 2 {
		t.Errorf("the settlement wallet sent %d transactions; want 2: the deposit and the refund", sent)
	}
}
