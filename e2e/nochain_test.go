package e2e

import (
	"fmt"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Caddy starts while its chain's RPC refuses connections: the free route serves, the paid route answers its 402 (the
// offers its configuration makes) without a payment and 502 verify-unreachable with Retry-After with one (present
// the same payment again), /health says which network
// is down since when, and once `caddy x402 devchain` listens on the configured port a payment settles on chain
// within seconds, with no restart.
func TestCaddyStartsWithItsRPCDownAndSettlesOnceTheChainComesUp(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	rpcPort, free, paid := freePort(t), fmt.Sprintf("http://127.0.0.1:%d", freePort(t)), fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	rpc := fmt.Sprintf("http://127.0.0.1:%d", rpcPort)
	file := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			rpc %s
			wallets 0-1
		}
		journal %s/journal.db
	}
}

%s {
	bind 127.0.0.1
	handle /free {
		respond "free"
	}
	handle_path /facilitator/* {
		x402_facilitator
	}
}

%s {
	bind 127.0.0.1
	x402 $0.01 {
		pay_to %s
	}
	respond "paid content"
}
`, rpc, dir, free, paid, seller.Hex()))
	gw := startProcess(t, "the gateway", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", file)
	gw.waitUntil("a 402 from the paid route", 90*time.Second, answersWith(paid+"/", 402))

	if a, err := get(free + "/free"); err != nil || a.status != 200 || a.body != "free" {
		t.Fatalf("the free route with the RPC down = %+v, %v; want 200 free", a, err)
	}
	a, err := get(paid + "/")
	if err != nil || a.status != 402 {
		t.Fatalf("the paid route without payment, RPC down = %+v, %v; want 402 with the offers the configuration makes", a, err)
	}
	if pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired)); err != nil || len(pr.Accepts) == 0 {
		t.Fatalf("the 402 with the RPC down = %+v (%v), want what to pay", pr, err)
	}
	a, err = get(paid+"/", x402.HeaderPaymentSignature, "eyJ4NDAyVmVyc2lvbiI6Mn0=")
	if err != nil || a.status != 502 || a.header.Get("Retry-After") == "" || !strings.Contains(a.body, string(x402.OutcomeVerifyUnreachable)) {
		t.Fatalf("the paid route with a payment, RPC down = %+v, %v; want 502 verify-unreachable with Retry-After", a, err)
	}
	h, err := get(free + "/facilitator/health")
	if err != nil || !strings.Contains(h.body, `"status":"down"`) || !strings.Contains(h.body, "no RPC endpoint answered since") {
		t.Fatalf("/health with the RPC down = %+v, %v; want down, saying no RPC endpoint answered since when", h, err)
	}
	if !strings.Contains(gw.out.String(), `"level":"error"`) || !strings.Contains(gw.out.String(), "starting without the chain") {
		t.Errorf("the log does not say loudly that Caddy started without its chain:\n%s", gw.out.String())
	}

	// The chain comes up on the configured port.
	_, facts := startDevchain(t, dir, "--listen", fmt.Sprintf("127.0.0.1:%d", rpcPort))
	if facts.RPC != rpc {
		t.Fatalf("the dev chain listens at %s, want %s", facts.RPC, rpc)
	}
	up := time.Now()
	dev := dialChain(t, facts.RPC)
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))
	before := dev.balance(seller)
	header := signPayment(t, facts.RPC, paid+"/")
	// Until the engine is up the payment is answered 502 with Retry-After, "present the same payment again": so
	// the client does, and is served once.
	for {
		a, err := get(paid+"/", x402.HeaderPaymentSignature, header)
		if err == nil && a.status == 502 && a.header.Get("Retry-After") != "" && time.Since(up) < 30*time.Second {
			time.Sleep(200 * time.Millisecond)
			continue
		}
		if err != nil || a.status != 200 || a.body != "paid content" {
			t.Fatalf("a payment once the chain answers = %+v, %v; want 200 paid content", a, err)
		}
		break
	}
	t.Logf("a payment was served %v after the chain came up", time.Since(up).Round(time.Millisecond))
	if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 {
		t.Errorf("the seller's balance moved by %s, want %d: one payment", d, asyncPrice)
	}
}
