package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/x402"
)

// paidInBatches is what e2e/interop/pay-batch.mjs prints.
type paidInBatches struct {
	Payer     string `json:"payer"`
	ChannelID string `json:"channelId"`
	Requests  []struct {
		Status int    `json:"status"`
		Body   string `json:"body"`
		Error  string `json:"error"`
		Sent   *struct {
			Type               string  `json:"type"`
			MaxClaimableAmount string  `json:"maxClaimableAmount"`
			Deposit            *string `json:"deposit"`
		} `json:"sent"`
		PaymentResponse *x402.BatchSettleResponse `json:"paymentResponse"`
	} `json:"requests"`
	LastPayment   string                    `json:"lastPayment"`
	Claimed       string                    `json:"claimed"`
	Refund        *x402.BatchSettleResponse `json:"refund"`
	RefundPayment string                    `json:"refundPayment"`
}

// The public TypeScript client (@x402/fetch with @x402/evm's batch-settlement client scheme) pays our gate's
// batch route, a real Caddy with the embedded engine, on the dev chain: one deposit with the first request, 29
// requests by voucher with no transaction each, our claimer's claim once the 30th voucher is accepted
// (claim_every 30), then the client's refund of the rest. On chain: the payer down exactly 30 prices, the seller
// up exactly 30 prices, the escrow back where it was, the settlement wallet three transactions (deposit, claim,
// refund), the payer no ether. The last voucher presented again is refused as used; the refund presented again is
// answered with its transaction and sends nothing.
// batchGate is a real Caddy selling a route by scheme batch through the embedded engine, on an in-process dev
// chain, and a payer holding USD Coin and no ether, for the public TypeScript client to pay.
type batchGate struct {
	sdk, node, url, network string
	d                       *devChain
	chainURL                string
	usdc, payer, receiver   common.Address
	payerKey                string
	wallet                  common.Address
}

// startBatchGate starts the dev chain and Caddy, whose claimer claims every claimEvery vouchers.
func startBatchGate(t *testing.T, price, claimEvery int) *batchGate {
	t.Helper()
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dev, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("closing the dev chain: %v", err)
		}
	})
	chainURL := dev.RPCURL()
	d := dialChain(t, chainURL)
	usdc := devchain.EIP3009TokenAddress

	funder := devchain.PayerKey()
	payerKey, authorizerKey, receiverKey := devchain.PayerKeyN(31), devchain.PayerKeyN(32), devchain.PayerKeyN(33)
	payerAddr, receiver := crypto.PubkeyToAddress(payerKey.PublicKey), crypto.PubkeyToAddress(receiverKey.PublicKey)
	wallet := devchain.WalletKeys(1)[0]
	d.send(funder, usdc, nil, callToken(t, "transfer", payerAddr, big.NewInt(1_000_000)))

	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		network %s {
			rpc %s
			asset %s name "%s" version %s decimals 6 eip3009
			wallet_keys {env.X402_E2E_WALLET_KEY}
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_E2E_AUTHORIZER_KEY}
				claim_every %d
				claim_after 1h
			}
		}
		journal %s/journal.db
	}
}

%s {
	bind 127.0.0.1
	x402 {
		scheme batch
		amount %d
		pay_to %s
	}
	respond "batch content at {http.x402.cumulative}"
}
`, dev.Network(), chainURL, usdc.Hex(), contracts.USDCoinName, contracts.USDCoinVersion, claimEvery, dir, gateURL, price, receiver.Hex()))
	caddy := startProcess(t, "Caddy with a batch route", dir, childEnv(t,
		"X402_E2E_WALLET_KEY="+strings.TrimPrefix(hexutil.Encode(crypto.FromECDSA(wallet)), "0x"),
		"X402_E2E_AUTHORIZER_KEY="+strings.TrimPrefix(hexutil.Encode(crypto.FromECDSA(authorizerKey)), "0x")),
		"run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the batch route", 60*time.Second, answersWith(gateURL+"/", 402))
	return &batchGate{sdk: sdk, node: node, url: gateURL + "/", network: dev.Network(), d: d, chainURL: chainURL, usdc: usdc,
		payer: payerAddr, receiver: receiver, payerKey: hexutil.Encode(crypto.FromECDSA(payerKey)), wallet: crypto.PubkeyToAddress(wallet.PublicKey)}
}

// pay runs pay-batch.mjs for requests requests with the given extra environment, and returns what it printed.
func (g *batchGate) pay(t *testing.T, requests, price int, env ...string) (paidInBatches, result) {
	t.Helper()
	env = append(append(os.Environ(), "X402_PAYER_KEY="+g.payerKey, "X402_RPC_URL="+g.chainURL,
		"X402_ASSET="+g.usdc.Hex(), "X402_NETWORK="+g.network, fmt.Sprintf("X402_MAX_AMOUNT=%d", price)), env...)
	r := runCommand(t, 4*time.Minute, g.sdk, env, g.node, "pay-batch.mjs", g.url, fmt.Sprint(requests))
	var got paidInBatches
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
		t.Fatalf("pay-batch.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
	}
	return got, r
}

func TestThePublicTypeScriptClientPaysOurBatchRouteClaimedThenRefundedBalancesExact(t *testing.T) {
	const price, requests = 1000, 30
	g := startBatchGate(t, price, requests)
	d, usdc, payerAddr, receiver, walletAddr, gateURL := g.d, g.usdc, g.payer, g.receiver, g.wallet, strings.TrimSuffix(g.url, "/")
	payerBefore, receiverBefore, escrowBefore := d.balanceOf(usdc, payerAddr), d.balanceOf(usdc, receiver), d.balanceOf(usdc, contracts.BatchSettlementAddress)
	sentBefore := sentFrom(t, d, walletAddr)
	got, r := g.pay(t, requests, price, fmt.Sprintf("X402_DEPOSIT_MULTIPLIER=%d", 2*requests))
	if len(got.Requests) != requests {
		t.Fatalf("the client made %d requests, want %d; the last: %+v\nstderr:\n%s", len(got.Requests), requests, got.Requests[len(got.Requests)-1], r.stderr)
	}
	for k, q := range got.Requests {
		want := fmt.Sprint((k + 1) * price)
		if q.Status != http.StatusOK || q.Body != "batch content at "+want || q.PaymentResponse == nil || !q.PaymentResponse.Success ||
			q.PaymentResponse.Extra == nil || q.PaymentResponse.Extra.ChannelState == nil || q.PaymentResponse.Extra.ChannelState.ChargedCumulativeAmount != want {
			t.Fatalf("request %d: status %d, body %q, error %q, PAYMENT-RESPONSE %+v; want 200 at cumulative %s", k+1, q.Status, q.Body, q.Error, q.PaymentResponse, want)
		}
		wantType := x402.BatchVoucher
		if k == 0 {
			wantType = x402.BatchDeposit
		}
		if q.Sent == nil || q.Sent.Type != wantType || q.Sent.MaxClaimableAmount != want {
			t.Fatalf("request %d: the client sent %+v; want a %s at %s", k+1, q.Sent, wantType, want)
		}
	}
	deposit, _ := new(big.Int).SetString(*got.Requests[0].Sent.Deposit, 10)
	if got.Claimed != fmt.Sprint(requests*price) {
		t.Fatalf("the escrow had %s claimed when the client asked its refund; want %d: the claimer's claim (claim_every %d)", got.Claimed, requests*price, requests)
	}
	if r.code != 0 || got.Refund == nil || !got.Refund.Success || got.Refund.Transaction == "" ||
		got.Refund.Amount != new(big.Int).Sub(deposit, big.NewInt(requests*price)).String() {
		t.Fatalf("the refund (exit %d): %+v, want the %s left of the deposit of %s returned\nstdout:\n%s\nstderr:\n%s", r.code, got.Refund, new(big.Int).Sub(deposit, big.NewInt(requests*price)), deposit, r.stdout, r.stderr)
	}
	if got.Refund.Extra == nil || got.Refund.Extra.ChannelState == nil || got.Refund.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(requests*price) {
		t.Errorf("the refund's PAYMENT-RESPONSE names the channel %+v; want it charged %d", got.Refund.Extra, requests*price)
	}
	if n := sentFrom(t, d, walletAddr) - sentBefore; n != 3 {
		t.Errorf("the settlement wallet sent %d transactions for %d requests and a refund; want 3: the deposit, one claim, the refund", n, requests)
	}
	if got := delta(d.balanceOf(usdc, payerAddr), payerBefore); got.Int64() != requests*price {
		t.Errorf("the payer paid %s in all; want %d", got, requests*price)
	}
	if got := delta(receiverBefore, d.balanceOf(usdc, receiver)); got.Int64() != requests*price {
		t.Errorf("the seller got %s; want %d", got, requests*price)
	}
	if got := delta(escrowBefore, d.balanceOf(usdc, contracts.BatchSettlementAddress)); got.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before; want 0", got)
	}
	if eth := d.ether(payerAddr); eth.Sign() != 0 {
		t.Errorf("the payer holds %s wei: it was to pay no gas", eth)
	}

	// Presented again: the last voucher bought its response already; the refund is answered from its record.
	sent := sentFrom(t, d, walletAddr)
	a, err := get(gateURL+"/", x402.HeaderPaymentSignature, got.LastPayment)
	if err != nil {
		t.Fatal(err)
	}
	if a.status != http.StatusPaymentRequired || !strings.Contains(a.body, x402.ReasonPaymentAlreadyUsed) {
		t.Errorf("the last voucher presented again: %d %s; want 402 %s", a.status, a.body, x402.ReasonPaymentAlreadyUsed)
	}
	a, err = get(gateURL+"/", x402.HeaderPaymentSignature, got.RefundPayment)
	if err != nil {
		t.Fatal(err)
	}
	again, derr := x402.DecodeBatchSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
	if a.status != http.StatusOK || derr != nil || !again.Success || !strings.EqualFold(again.Transaction, got.Refund.Transaction) {
		t.Errorf("the refund presented again: %d %s (PAYMENT-RESPONSE %+v, %v); want 200 and transaction %s", a.status, a.body, again, derr, got.Refund.Transaction)
	}
	if n := sentFrom(t, d, walletAddr) - sent; n != 0 {
		t.Errorf("presenting the voucher and the refund again sent %d transactions", n)
	}
	if !strings.EqualFold(got.ChannelID, common.HexToHash(got.ChannelID).Hex()) {
		t.Errorf("the channel id %q is no bytes32", got.ChannelID)
	}
}

// A new run of the public TypeScript client (its channels in memory, so it knows the channel only from the
// escrow, where nothing is claimed yet) pays our batch route after an earlier run's 5 vouchers: its voucher at
// 1000 is answered by the gate's corrective 402, the SDK's client checks the voucher there is its own, carries on
// and pays at 6000, then its refund returns the rest, claiming the 6 vouchers on the way. On chain: the payer down
// exactly 6 prices, the seller up exactly 6, the escrow back where it was; the deposit and the refund the only
// transactions.
func TestANewRunOfThePublicTypeScriptClientIsCorrectedByOurBatchRouteAndRefunds(t *testing.T) {
	const price, requests = 1000, 5
	g := startBatchGate(t, price, 1000)
	d := g.d
	payerBefore, receiverBefore, escrowBefore := d.balanceOf(g.usdc, g.payer), d.balanceOf(g.usdc, g.receiver), d.balanceOf(g.usdc, contracts.BatchSettlementAddress)
	sentBefore := sentFrom(t, d, g.wallet)
	first, r := g.pay(t, requests, price, "X402_DEPOSIT_MULTIPLIER=20", "X402_REFUND=0")
	if r.code != 0 || len(first.Requests) != requests {
		t.Fatalf("the first run (exit %d): %+v\nstderr:\n%s", r.code, first, r.stderr)
	}
	deposit, _ := new(big.Int).SetString(*first.Requests[0].Sent.Deposit, 10)
	second, r := g.pay(t, 1, price, "X402_CLAIM_WAIT_SECONDS=0")
	const paid = (requests + 1) * price
	if len(second.Requests) != 1 || second.Requests[0].Status != http.StatusOK || second.Requests[0].Body != fmt.Sprintf("batch content at %d", paid) {
		t.Fatalf("the new run's request: %+v\nstdout:\n%s\nstderr:\n%s", second.Requests, r.stdout, r.stderr)
	}
	if s := second.Requests[0].Sent; s == nil || s.Type != x402.BatchVoucher || s.MaxClaimableAmount != fmt.Sprint(paid) {
		t.Fatalf("the new run sent %+v; want a voucher at %d after the corrective 402", s, paid)
	}
	left := new(big.Int).Sub(deposit, big.NewInt(paid))
	if r.code != 0 || second.Refund == nil || !second.Refund.Success || second.Refund.Amount != left.String() {
		t.Fatalf("the new run's refund (exit %d): %+v; want the %s left\nstdout:\n%s\nstderr:\n%s", r.code, second.Refund, left, r.stdout, r.stderr)
	}
	if got := delta(d.balanceOf(g.usdc, g.payer), payerBefore); got.Int64() != paid {
		t.Errorf("the payer paid %s in all; want %d", got, paid)
	}
	if got := delta(receiverBefore, d.balanceOf(g.usdc, g.receiver)); got.Int64() != paid {
		t.Errorf("the seller got %s; want %d", got, paid)
	}
	if got := delta(escrowBefore, d.balanceOf(g.usdc, contracts.BatchSettlementAddress)); got.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before; want 0", got)
	}
	if n := sentFrom(t, d, g.wallet) - sentBefore; n != 2 {
		t.Errorf("the settlement wallet sent %d transactions; want 2: the deposit and the refund", n)
	}
}
