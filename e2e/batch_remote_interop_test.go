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

// Our gate's scheme batch in front of a remote facilitator, on the dev chain with the real escrow and ERC-3009
// collector: one Caddy runs two batch routes, /ts whose facilitator_url is the TypeScript reference facilitator
// (@x402/evm's batch-settlement facilitator, its own key the receiver authorizer), and /ours whose
// facilitator_url is our x402_facilitator in another Caddy. Our payer.Transport pays each route 12 requests: a
// deposit (sent by the facilitator), then 11 vouchers the gate accepts off chain; at the 12th (claim_every 12)
// the gate claims them through the facilitator's /settle claim action and settles them to the receiver. On
// chain, for each route: the payer down exactly the deposit, the escrow holding the deposit less the 12 prices,
// the receiver up exactly the 12 prices, and the facilitator's key three transactions (deposit, claim, settle).
func TestOurGateServesBatchRoutesThroughTheTypeScriptFacilitatorAndOurFacilitatorInAnotherCaddy(t *testing.T) {
	needBinary(t)
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
	const price, requests, depositRequests = 1000, 12, 20

	funder := devchain.PayerKey()
	tsFacKey, ourWalletKey, ourAuthorizerKey := devchain.PayerKeyN(31), devchain.PayerKeyN(32), devchain.PayerKeyN(33)
	tsPayerKey, ourPayerKey := devchain.PayerKeyN(34), devchain.PayerKeyN(35)
	tsReceiver, ourReceiver := crypto.PubkeyToAddress(devchain.PayerKeyN(36).PublicKey), crypto.PubkeyToAddress(devchain.PayerKeyN(37).PublicKey)
	tsFacAddr, ourWallet := crypto.PubkeyToAddress(tsFacKey.PublicKey), crypto.PubkeyToAddress(ourWalletKey.PublicKey)
	d.send(funder, tsFacAddr, big.NewInt(1e18), nil)
	d.send(funder, ourWallet, big.NewInt(1e18), nil)
	for _, k := range []common.Address{crypto.PubkeyToAddress(tsPayerKey.PublicKey), crypto.PubkeyToAddress(ourPayerKey.PublicKey)} {
		d.send(funder, usdc, nil, callToken(t, "transfer", k, big.NewInt(1_000_000)))
	}

	tsFacURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	tsFac := startProgram(t, "the TypeScript reference facilitator with batch-settlement", sdk, append(os.Environ(),
		"X402_FACILITATOR_KEY="+hexutil.Encode(crypto.FromECDSA(tsFacKey)), "X402_RPC_URL="+chainURL, "X402_NETWORK="+dev.Network(), "X402_BATCH=1"),
		node, "facilitator.mjs", portOf(t, tsFacURL))

	// Our facilitator, in a Caddy of its own: it holds the receiver authorizer key it lists in /supported and
	// claims nothing of its own accord (the gate's vouchers are the gate's to claim).
	facDir := t.TempDir()
	ourFacURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	facConfig := writeFile(t, facDir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		network %[1]s {
			rpc %[2]s
			asset %[3]s name "%[4]s" version %[5]s decimals 6 eip3009
			wallet_keys %[6]s
			batch {
				receiver_authorizer_key %[7]s
				claim_every 1000000
				claim_after 1h
			}
		}
		journal %[8]s/journal.db
	}
}

%[9]s {
	bind 127.0.0.1
	x402_facilitator {
		open
	}
}
`, dev.Network(), chainURL, usdc.Hex(), contracts.USDCoinName, contracts.USDCoinVersion, hexutil.Encode(crypto.FromECDSA(ourWalletKey))[2:],
		hexutil.Encode(crypto.FromECDSA(ourAuthorizerKey))[2:], facDir, ourFacURL))
	facCaddy := startProcess(t, "Caddy with our x402_facilitator", facDir, childEnv(t), "run", "--adapter", "caddyfile", "--config", facConfig)

	tsFac.waitUntil("its /supported", 60*time.Second, answersWith(tsFacURL+"/supported", 200))
	facCaddy.waitUntil("our facilitator's /supported listing batch-settlement", 60*time.Second, func() error {
		a, err := get(ourFacURL + "/supported")
		if err != nil {
			return err
		}
		if a.status != 200 || !strings.Contains(a.body, x402.SchemeBatchSettlement) {
			return fmt.Errorf("%d %s", a.status, a.body)
		}
		return nil
	})

	gateDir := t.TempDir()
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	route := func(path string, receiver common.Address, facURL string) string {
		return fmt.Sprintf(`	handle %[1]s {
		x402 {
			scheme batch
			network %[2]s
			asset %[3]s
			token_name "%[4]s"
			token_version %[5]s
			token_eip3009
			amount %[6]d
			pay_to %[7]s
			facilitator_url %[8]s
			batch {
				claim_every %[9]d
				claim_after 1h
			}
		}
		respond "paid by voucher at {http.x402.cumulative}"
	}
`, path, dev.Network(), usdc.Hex(), contracts.USDCoinName, contracts.USDCoinVersion, price, receiver.Hex(), facURL, requests)
	}
	gateConfig := writeFile(t, gateDir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		journal %[1]s/journal.db
	}
}

%[2]s {
	bind 127.0.0.1
%[3]s%[4]s}
`, gateDir, gateURL, route("/ts", tsReceiver, tsFacURL), route("/ours", ourReceiver, ourFacURL)))
	gate := startProcess(t, "Caddy with the batch routes through remote facilitators", gateDir, childEnv(t), "run", "--adapter", "caddyfile", "--config", gateConfig)
	gate.waitUntil("a 402 from /ts", 60*time.Second, answersWith(gateURL+"/ts", 402))
	gate.waitUntil("a 402 from /ours", 60*time.Second, answersWith(gateURL+"/ours", 402))

	for _, c := range []struct {
		name     string
		path     string
		receiver common.Address
		sender   common.Address
	}{
		{"the TypeScript reference facilitator", "/ts", tsReceiver, tsFacAddr},
		{"our facilitator in another Caddy", "/ours", ourReceiver, ourWallet},
	} {
		t.Run(c.path, func(t *testing.T) {
			key := tsPayerKey
			if c.path == "/ours" {
				key = ourPayerKey
			}
			payerAddr := crypto.PubkeyToAddress(key.PublicKey)
			payerBefore, escrowBefore, receiverBefore := d.balanceOf(usdc, payerAddr), d.balanceOf(usdc, contracts.BatchSettlementAddress), d.balanceOf(usdc, c.receiver)
			sentBefore := sentFrom(t, d, c.sender)
			p, err := payer.New(key, payer.Options{RPC: chainURL, DepositRequests: depositRequests})
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: dev.Network(), Asset: usdc.Hex(), PerRequest: big.NewInt(price), Total: big.NewInt(100_000)}}}
			client := &http.Client{Transport: tr, Timeout: time.Minute}
			for k := 1; k <= requests; k++ {
				resp, err := client.Get(gateURL + c.path)
				if err != nil {
					t.Fatalf("request %d: %v", k, err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || string(body) != fmt.Sprintf("paid by voucher at %d", k*price) {
					t.Fatalf("request %d: %s %q (PAYMENT-REQUIRED %s)", k, resp.Status, body, resp.Header.Get(x402.HeaderPaymentRequired))
				}
			}
			deadline := time.Now().Add(60 * time.Second)
			for delta(receiverBefore, d.balanceOf(usdc, c.receiver)).Int64() != requests*price {
				if time.Now().After(deadline) {
					t.Fatalf("the receiver got %s through %s; want the %d prices served", delta(receiverBefore, d.balanceOf(usdc, c.receiver)), c.name, requests)
				}
				time.Sleep(100 * time.Millisecond)
			}
			time.Sleep(3 * time.Second) // a second claim or settle would have come by now
			if got := delta(receiverBefore, d.balanceOf(usdc, c.receiver)); got.Int64() != requests*price {
				t.Errorf("the receiver got %s; want exactly %d", got, requests*price)
			}
			if got := delta(d.balanceOf(usdc, payerAddr), payerBefore); got.Int64() != depositRequests*price {
				t.Errorf("the payer paid %s; want the deposit, %d", got, depositRequests*price)
			}
			if got := delta(escrowBefore, d.balanceOf(usdc, contracts.BatchSettlementAddress)); got.Int64() != (depositRequests-requests)*price {
				t.Errorf("the escrow holds %s more; want the deposit less what was claimed, %d", got, (depositRequests-requests)*price)
			}
			if got := sentFrom(t, d, c.sender) - sentBefore; got != 3 {
				t.Errorf("%s sent %d transactions for %d requests; want 3: the deposit, the claim and the settle", c.name, got, requests)
			}
		})
	}
}
