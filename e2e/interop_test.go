package e2e

import (
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// interopPrice is the interop gate's price in raw units of the dev token ($0.01).
const interopPrice = 10000

// paidByTypeScript is what pay.mjs prints: the final answer and what the client signed.
type paidByTypeScript struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
	Error  string `json:"error"`
	Payer  string `json:"payer"`
	Sent   *struct {
		Method     string   `json:"method"`
		Extensions []string `json:"extensions"`
		Sponsored  bool     `json:"sponsored"`
	} `json:"sent"`
	PaymentResponse *x402.SettleResponse `json:"paymentResponse"`
}

// TestTypeScriptClientPaysTheGateOnTheDevChain pays our gate with the public TypeScript x402 client
// (@x402/fetch with @x402/evm, the versions pinned in e2e/interop/package-lock.json, installed by npm ci):
// the permit2 flow for a payer that approved Permit2 beforehand, and the permit2 flow with
// eip2612GasSponsoring for a payer that never did. Each payment answers 200 with a settled PAYMENT-RESPONSE,
// and the dev chain's balances move by exactly the price.
func TestTypeScriptClientPaysTheGateOnTheDevChain(t *testing.T) {
	needBinary(t)
	npm, err := exec.LookPath("npm")
	if err != nil {
		t.Skip("skipped: npm is not on PATH; the interop test installs the public TypeScript x402 client with npm")
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatalf("npm is on PATH but node is not: %v", err)
	}

	client := installTypeScriptClient(t, npm)

	dir := t.TempDir()
	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
		}
	}
}

%s {
	bind 127.0.0.1
	x402 {
		price $0.01
		pay_to %s
		description "Content for the TypeScript client"
	}
	respond "paid content for the TypeScript client"
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain and the gate", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)

	// Payer #1 starts with nothing: the demo payer gives it gas money and tokens, and it approves Permit2.
	approved := chain.DevPayerKeyN(1)
	approvedAddr := crypto.PubkeyToAddress(approved.PublicKey)
	dev.send(chain.DevPayerKey(), approvedAddr, big.NewInt(1e18), nil)
	dev.send(chain.DevPayerKey(), chain.DevTokenAddress, nil, callToken(t, "transfer", approvedAddr, big.NewInt(1_000_000_000)))
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	dev.send(approved, chain.DevTokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))
	if a := permit2Allowance(t, dev, chain.DevPayerAddress); a.Cmp(big.NewInt(interopPrice)) >= 0 {
		t.Fatalf("the demo payer already allows Permit2 %s; the sponsored case needs a payer without allowance", a)
	}

	cases := []struct {
		name          string
		key           []byte
		payer         common.Address
		wantSponsored bool
	}{
		{"permit2, payer approved Permit2 beforehand", crypto.FromECDSA(approved), approvedAddr, false},
		{"permit2 with eip2612GasSponsoring, payer without allowance", crypto.FromECDSA(chain.DevPayerKey()), chain.DevPayerAddress, true},
	}
	price := big.NewInt(interopPrice)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			payerBefore, sellerBefore := dev.balance(tc.payer), dev.balance(seller)
			env := append(os.Environ(),
				"X402_PAYER_KEY="+hexutil.Encode(tc.key),
				"X402_RPC_URL="+chainURL,
				"X402_ASSET="+chain.DevTokenAddress.Hex(),
				fmt.Sprintf("X402_NETWORK=eip155:%d", chain.DefaultDevChainID),
				"X402_MAX_AMOUNT="+price.String(),
			)
			start := time.Now()
			r := runCommand(t, 2*time.Minute, client, env, node, "pay.mjs", gateURL+"/")
			t.Logf("node pay.mjs took %s", time.Since(start).Round(time.Millisecond))
			var got paidByTypeScript
			if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
				t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
			}
			if r.code != 0 || got.Status != 200 || got.Error != "" {
				t.Fatalf("the TypeScript client did not get the content: exit %d, status %d, error %q, body %q, payment response %+v\nstderr:\n%s",
					r.code, got.Status, got.Error, got.Body, got.PaymentResponse, r.stderr)
			}
			if got.Body != "paid content for the TypeScript client" {
				t.Errorf("body %q, want the gate's content", got.Body)
			}
			if got.Sent == nil || got.Sent.Method != x402.TransferPermit2 || got.Sent.Sponsored != tc.wantSponsored {
				t.Errorf("the client signed %+v; want method permit2 with eip2612GasSponsoring %v", got.Sent, tc.wantSponsored)
			}
			s := got.PaymentResponse
			if s == nil || !s.Success || !txHashPattern.MatchString(s.Transaction) || !strings.EqualFold(s.Payer, tc.payer.Hex()) {
				t.Fatalf("PAYMENT-RESPONSE %+v; want success with a transaction, payer %s", s, tc.payer.Hex())
			}
			if !receiptTransfers(dev, common.HexToHash(s.Transaction), tc.payer, seller, price) {
				t.Errorf("transaction %s holds no Transfer of %s from the payer to the seller", s.Transaction, price)
			}
			if d := delta(payerBefore, dev.balance(tc.payer)); d.Cmp(new(big.Int).Neg(price)) != 0 {
				t.Errorf("the payer's balance moved by %s, want -%s", d, price)
			}
			if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(price) != 0 {
				t.Errorf("the seller's balance moved by %s, want +%s", d, price)
			}
		})
	}
	caddy.stop()
}

// installTypeScriptClient copies e2e/interop to a temporary folder and installs the pinned client there with
// npm ci, and returns the folder.
func installTypeScriptClient(t *testing.T, npm string) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"package.json", "package-lock.json", "pay.mjs"} {
		b, err := os.ReadFile(filepath.Join(repoRoot, "e2e", "interop", name))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, dir, name, string(b))
	}
	start := time.Now()
	r := runCommand(t, 5*time.Minute, dir, os.Environ(), npm, "ci", "--no-audit", "--no-fund", "--prefer-offline")
	if r.code != 0 {
		t.Fatalf("npm ci of the TypeScript x402 client exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	t.Logf("npm ci of the TypeScript x402 client took %s", time.Since(start).Round(time.Millisecond))
	return dir
}

// permit2Allowance reads the dev token's allowance(owner, Permit2).
func permit2Allowance(t *testing.T, dev *devChain, owner common.Address) *big.Int {
	t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	token := chain.DevTokenAddress
	out, err := dev.client.CallContract(ctx, ethereum.CallMsg{To: &token, Data: callToken(t, "allowance", owner, contracts.Permit2Address)}, nil)
	if err != nil {
		t.Fatalf("reading allowance(%s, Permit2): %v", owner, err)
	}
	return new(big.Int).SetBytes(out)
}
