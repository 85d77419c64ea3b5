package e2e

import (
	"context"
	"fmt"
	"io"
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
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Our payer.Transport pays an @x402/hono server selling a route by the public SDK's batch-settlement scheme,
// settling through the TypeScript reference facilitator, on the dev chain with the real escrow and ERC-3009
// collector: one deposit (the facilitator sends it, the payer pays no gas), N requests by voucher with no
// transaction, a refund of what is left, and the server's claim and settle. On chain: the payer is down
// exactly N prices, the receiver up exactly N prices, the escrow holds nothing more than before.
func TestOurPayerPaysTheSDKsBatchSettlementServerDepositVouchersAndRefund(t *testing.T) {
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
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
	const price, requests = 1000, 7

	// A fresh payer holding USD Coin and no ether (the facilitator sends the deposit); the facilitator's key
	// gets gas money; the receiver is a fresh address.
	funder := devchain.PayerKey()
	payerKey, facKey, receiverKey := devchain.PayerKeyN(11), devchain.PayerKeyN(12), devchain.PayerKeyN(13)
	payerAddr, receiver := crypto.PubkeyToAddress(payerKey.PublicKey), crypto.PubkeyToAddress(receiverKey.PublicKey)
	d.send(funder, crypto.PubkeyToAddress(facKey.PublicKey), big.NewInt(1e18), nil)
	d.send(funder, usdc, nil, callToken(t, "transfer", payerAddr, big.NewInt(1_000_000)))

	facURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	fac := startProgram(t, "the TypeScript reference facilitator with batch-settlement", sdk, append(os.Environ(),
		"X402_FACILITATOR_KEY="+hexutil.Encode(crypto.FromECDSA(facKey)), "X402_RPC_URL="+chainURL, "X402_NETWORK="+dev.Network(), "X402_BATCH=1"),
		node, "facilitator.mjs", portOf(t, facURL))
	fac.waitUntil("its /supported", 60*time.Second, answersWith(facURL+"/supported", 200))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	hono := startProgram(t, "the @x402/hono batch-settlement server", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+facURL, "X402_NETWORK="+dev.Network(), "X402_ASSET="+usdc.Hex(), "X402_PAY_TO="+receiver.Hex(),
		fmt.Sprintf("X402_BATCH_AMOUNT=%d", price), "X402_BATCH_TOKEN_NAME="+contracts.USDCoinName, "X402_BATCH_TOKEN_VERSION="+contracts.USDCoinVersion),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from /batch", 60*time.Second, answersWith(honoURL+"/batch", 402))

	payerBefore, receiverBefore, escrowBefore := d.balanceOf(usdc, payerAddr), d.balanceOf(usdc, receiver), d.balanceOf(usdc, contracts.BatchSettlementAddress)
	p, err := payer.New(payerKey, payer.Options{RPC: chainURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: dev.Network(), Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100_000)}}}
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	var channel string
	for k := 1; k <= requests; k++ {
		resp, err := client.Get(honoURL + "/batch")
		if err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "batch-settled content") {
			t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s, PAYMENT-RESPONSE %s)", k, resp.Status, body,
				resp.Header.Get(x402.HeaderPaymentRequired), resp.Header.Get(x402.HeaderPaymentResponse))
		}
		s, err := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if err != nil || !s.Success || s.Extra == nil || s.Extra.ChannelState == nil {
			t.Fatalf("request %d: the settlement %+v (%v) names no channel", k, s, err)
		}
		if got := s.Extra.ChannelState.ChargedCumulativeAmount; got != fmt.Sprint(k*price) {
			t.Errorf("request %d: the server stands at %s, want %d", k, got, k*price)
		}
		channel = s.Extra.ChannelState.ChannelID
	}
	id := common.HexToHash(channel)
	st, ok := p.Channel(id)
	if !ok || st.Charged.Int64() != requests*price || st.Balance.Int64() != 10*price {
		t.Fatalf("the payer keeps %+v (known %v), want %d charged of a deposit of %d", st, ok, requests*price, 10*price)
	}
	if got := tr.Spent(dev.Network(), usdc.Hex()); got.Int64() != 10*price {
		t.Errorf("the Transport counts %s spent, want the deposit, %d", got, 10*price)
	}
	if got := d.balanceOf(usdc, contracts.BatchSettlementAddress); delta(escrowBefore, got).Int64() != 10*price {
		t.Errorf("the escrow holds %s more, want the deposit, %d", delta(escrowBefore, got), 10*price)
	}

	// The same key in a new run (a second Payer, no memory, an RPC): it finds the channel in the escrow
	// (10000 deposited, nothing claimed), signs the voucher at 1000, is answered by the server's corrective
	// 402 with its last voucher (7000, signed by this key), and pays at 8000 with no new deposit.
	p2, err := payer.New(payerKey, payer.Options{RPC: chainURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	tr2 := &payer.Transport{Payer: p2, Limits: tr.Limits}
	resp, err := (&http.Client{Transport: tr2, Timeout: time.Minute}).Get(honoURL + "/batch")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the new run's request: %s (PAYMENT-REQUIRED %s)", resp.Status, resp.Header.Get(x402.HeaderPaymentRequired))
	}
	const paid = (requests + 1) * price
	if st, ok := p2.Channel(id); !ok || st.Charged.Int64() != paid || st.Balance.Int64() != 10*price {
		t.Fatalf("the new run keeps %+v (known %v), want %d charged of 10000", st, ok, paid)
	}
	// It counts the voucher it signed first (1000, above nothing it had counted) and what the one at 8000 adds
	// above the 7000 its key had signed: never the deposit of the earlier run, never the 7000 again.
	if got := tr2.Spent(dev.Network(), usdc.Hex()); got.Int64() != 2*price {
		t.Errorf("the new run's Transport counts %s spent, want %d", got, 2*price)
	}

	after, answer, err := p2.Refund(ctx, nil, honoURL+"/batch", nil)
	if err != nil {
		t.Fatalf("refund: %v", err)
	}
	if after.Left().Sign() != 0 || after.Balance.Int64() != paid {
		t.Errorf("after the refund (transaction %s) the payer keeps balance %s, left %s; want %d and 0", answer.Transaction, after.Balance, after.Left(), paid)
	}

	// The server claims what its vouchers charge (the refund already claimed them on chain) and settles it to
	// the receiver.
	resp, err = http.Post(honoURL+"/batch-claim", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	claimed, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("the server's claim and settle: %s", claimed)

	payerAfter, receiverAfter, escrowAfter := d.balanceOf(usdc, payerAddr), d.balanceOf(usdc, receiver), d.balanceOf(usdc, contracts.BatchSettlementAddress)
	if got := delta(payerAfter, payerBefore); got.Int64() != paid {
		t.Errorf("the payer paid %s in all, want %d requests at %d", got, requests+1, price)
	}
	if got := delta(receiverBefore, receiverAfter); got.Int64() != paid {
		t.Errorf("the receiver got %s, want %d", got, paid)
	}
	if got := delta(escrowBefore, escrowAfter); got.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before, want 0", got)
	}
	if eth := d.ether(payerAddr); eth.Sign() != 0 {
		t.Errorf("the payer holds %s wei: it was to pay no gas and hold none", eth)
	}
}
