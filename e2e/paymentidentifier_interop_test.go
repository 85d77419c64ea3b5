package e2e

import (
	"encoding/json"
	"fmt"
	"math/big"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// The public TypeScript client with @x402/extensions' payment-identifier pays our gate declaring it, on the dev
// chain: the payment names the client's id and is settled once, for exactly the price; the client paying again
// under the same id signs another payment, which the gate answers 409 with nothing moved on chain; and `caddy x402
// pay --payment-id` names its payment the same way.
func TestThePublicTypeScriptClientNamesItsPaymentAndAnotherPaymentOfTheIdIs409(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
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
		payment_identifier
	}
	respond "named content"
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain and a gate declaring payment-identifier", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)

	key := devchain.PayerKeyN(2)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	dev.send(devchain.PayerKey(), payer, big.NewInt(1e18), nil)
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", payer, big.NewInt(1_000_000)))
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	dev.send(key, devchain.TokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))

	const id = "pay_from_the_typescript_sdk_0001"
	pay := func() (paidByTypeScript, int) {
		t.Helper()
		env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
			"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
			"X402_METHOD=permit2", "X402_PAYMENT_ID="+id)
		r := runCommand(t, 2*time.Minute, sdk, env, node, "pay.mjs", gateURL+"/")
		var got paidByTypeScript
		if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
			t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
		}
		return got, r.code
	}

	payerBefore, sellerBefore, from := dev.balance(payer), dev.balance(seller), dev.head()+1
	got, code := pay()
	if code != 0 || got.Status != 200 || got.Body != "named content" || got.PaymentResponse == nil || !got.PaymentResponse.Success {
		t.Fatalf("the TypeScript client naming its payment got exit %d, status %d, body %q, error %q, payment response %+v",
			code, got.Status, got.Body, got.Error, got.PaymentResponse)
	}
	if got.Sent == nil || got.Sent.PaymentIdentifier != id {
		t.Fatalf("the client sent %+v, want its payment named %s", got.Sent, id)
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payer, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}

	// Paying again under the same id, the client signs a new payment: the gate refuses it (409), nothing moves.
	payerBefore, sellerBefore, from = dev.balance(payer), dev.balance(seller), dev.head()+1
	got, code = pay()
	if code == 0 || got.Status != 409 || !strings.Contains(got.Body, id) {
		t.Fatalf("another payment under the same id got exit %d, status %d, body %q, error %q; want 409 naming the id", code, got.Status, got.Body, got.Error)
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Sign() != 0 {
		t.Errorf("the payer's balance moved by %s for a refused payment", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Sign() != 0 {
		t.Errorf("the seller's balance moved by %s for a refused payment", d)
	}
	if dev.head() >= from && len(dev.transfers(payer, seller, from)) != 0 {
		t.Error("a Transfer went from the payer to the seller for a refused payment")
	}
}
