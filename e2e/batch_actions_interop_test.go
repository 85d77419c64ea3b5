package e2e

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// An @x402/hono server selling a route by the public SDK's batch-settlement scheme settles through OUR facilitator
// (the engine behind facilitatorserver, over real HTTP) on the dev chain with the real escrow: our facilitator
// sends the payer's deposit, verifies the vouchers the server does not judge itself and the payer's refund, and
// performs the server's claim, settle and refund, signing them with the receiverAuthorizer key it advertises. Our
// payer.Transport pays. On chain: the payer is down exactly what its requests cost, the receiver up exactly that,
// the escrow back where it was, and the facilitator's wallet sent four transactions (deposit, claim, settle,
// refund).
func TestTheSDKsBatchSettlementServerClaimsSettlesAndRefundsThroughOurFacilitator(t *testing.T) {
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

	funder := devchain.PayerKey()
	payerKey, walletKey, receiverKey, authorizerKey := devchain.PayerKeyN(21), devchain.PayerKeyN(22), devchain.PayerKeyN(23), devchain.PayerKeyN(24)
	payerAddr, receiver := crypto.PubkeyToAddress(payerKey.PublicKey), crypto.PubkeyToAddress(receiverKey.PublicKey)
	wallet := crypto.PubkeyToAddress(walletKey.PublicKey)
	d.send(funder, wallet, big.NewInt(1e18), nil)
	d.send(funder, usdc, nil, callToken(t, "transfer", payerAddr, big.NewInt(1_000_000)))

	// Our facilitator: the engine on the dev chain, holding the receiverAuthorizer key it advertises, and claiming
	// nothing of its own accord (the server's vouchers are the server's to claim).
	rpc, err := chain.DialRPC(ctx, chainURL)
	if err != nil {
		t.Fatal(err)
	}
	j, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { j.Close() })
	engine, err := chain.New(ctx, chain.Config{Journal: j, Networks: []chain.NetworkConfig{{Network: dev.Network(), Backend: rpc,
		Keys:                    []*ecdsa.PrivateKey{walletKey},
		Assets:                  []chain.AssetConfig{{Address: usdc, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		BatchReceiverAuthorizer: authorizerKey, BatchClaimEvery: 1_000_000, BatchClaimAfter: time.Hour}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { engine.Close() })
	srv, err := facilitatorserver.New(engine, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	fac := httptest.NewServer(srv)
	t.Cleanup(fac.Close)

	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	hono := startProgram(t, "the @x402/hono batch-settlement server", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+fac.URL, "X402_NETWORK="+dev.Network(), "X402_ASSET="+usdc.Hex(), "X402_PAY_TO="+receiver.Hex(),
		fmt.Sprintf("X402_BATCH_AMOUNT=%d", price), "X402_BATCH_TOKEN_NAME="+contracts.USDCoinName, "X402_BATCH_TOKEN_VERSION="+contracts.USDCoinVersion),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from /batch", 60*time.Second, answersWith(honoURL+"/batch", 402))

	payerBefore, receiverBefore, escrowBefore := d.balanceOf(usdc, payerAddr), d.balanceOf(usdc, receiver), d.balanceOf(usdc, contracts.BatchSettlementAddress)
	sentBefore := sentFrom(t, d, wallet)
	p, err := payer.New(payerKey, payer.Options{RPC: chainURL})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: dev.Network(), Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100_000)}}}
	client := &http.Client{Transport: tr, Timeout: time.Minute}
	for k := 1; k <= requests; k++ {
		resp, err := client.Get(honoURL + "/batch")
		if err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "batch-settled content") {
			t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s)", k, resp.Status, body, resp.Header.Get(x402.HeaderPaymentRequired))
		}
	}
	if got := delta(escrowBefore, d.balanceOf(usdc, contracts.BatchSettlementAddress)); got.Int64() != 10*price {
		t.Fatalf("the escrow holds %s more, want the deposit, %d", got, 10*price)
	}

	// The server claims its vouchers and settles them to the receiver, through our facilitator.
	resp, err := http.Post(honoURL+"/batch-claim", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var claimed struct {
		Claims []struct {
			Vouchers    int    `json:"vouchers"`
			Transaction string `json:"transaction"`
		} `json:"claims"`
		Settle struct {
			Transaction string `json:"transaction"`
			Error       string `json:"error"`
		} `json:"settle"`
	}
	if err := json.Unmarshal(raw, &claimed); err != nil || len(claimed.Claims) != 1 || claimed.Claims[0].Transaction == "" || claimed.Settle.Transaction == "" {
		t.Fatalf("the server's claim and settle: %s (%v)", raw, err)
	}
	if got := delta(receiverBefore, d.balanceOf(usdc, receiver)); got.Int64() != requests*price {
		t.Fatalf("after the claim and settle the receiver got %s, want %d", got, requests*price)
	}

	// The payer's refund of what is left: the server has our facilitator verify it, then refund it.
	after, answer, err := p.Refund(ctx, nil, honoURL+"/batch", nil)
	if err != nil {
		t.Fatalf("refund: %v", err)
	}
	if !answer.Success || answer.Transaction == "" || after.Left().Sign() != 0 || after.Balance.Int64() != requests*price {
		t.Errorf("the refund %+v leaves the payer's channel at balance %s, %s left; want %d and 0", answer, after.Balance, after.Left(), requests*price)
	}

	if got := delta(d.balanceOf(usdc, payerAddr), payerBefore); got.Int64() != requests*price {
		t.Errorf("the payer paid %s in all, want %d requests at %d", got, requests, price)
	}
	if got := delta(receiverBefore, d.balanceOf(usdc, receiver)); got.Int64() != requests*price {
		t.Errorf("the receiver got %s, want %d", got, requests*price)
	}
	if got := delta(escrowBefore, d.balanceOf(usdc, contracts.BatchSettlementAddress)); got.Sign() != 0 {
		t.Errorf("the escrow holds %s more than before, want 0", got)
	}
	if got := sentFrom(t, d, wallet) - sentBefore; got != 4 {
		t.Errorf("our facilitator sent %d transactions, want 4: the deposit, the claim, the settle and the refund", got)
	}
	if eth := d.ether(payerAddr); eth.Sign() != 0 {
		t.Errorf("the payer holds %s wei: it was to pay no gas and hold none", eth)
	}
}

// sentFrom is how many transactions addr has sent (its nonce at the head).
func sentFrom(t *testing.T, d *devChain, addr common.Address) uint64 {
	t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	n, err := d.client.NonceAt(ctx, addr, nil)
	if err != nil {
		t.Fatalf("reading the nonce of %s: %v", addr.Hex(), err)
	}
	return n
}
