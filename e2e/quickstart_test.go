package e2e

import (
	"encoding/json"
	"math/big"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The fixed addresses of Caddyfile.example and of `caddy x402 pay --dev`.
const (
	quickstartSite  = "http://localhost:8080"
	quickstartRPC   = "http://127.0.0.1:8545"
	quickstartReady = 60 * time.Second
)

// txHashPattern is a transaction hash as PAYMENT-RESPONSE carries it.
var txHashPattern = regexp.MustCompile(`^0x[0-9a-fA-F]{64}$`)

// TestQuickstartSellsThePaidRoutesToCaddyX402PayDev runs the README's quick start as a user would, with the
// built binary: `caddy run --config Caddyfile.example` from the repository root, then
// `caddy x402 pay --dev` for a paid file, the paid legacy API and (--method eip3009) the route paid in the
// USD Coin. Each pay exits 0 with the content and a
// settled PAYMENT-RESPONSE naming a transaction, and the dev chain's balances moved by exactly the prices.
func TestQuickstartSellsThePaidRoutesToCaddyX402PayDev(t *testing.T) {
	needBinary(t)
	for _, port := range []int{8080, 8081, 8545, 2019} {
		if why := portTaken(port); why != "" {
			t.Skipf("skipped: port %d is taken (%s); Caddyfile.example needs 8080, 8081, 8545 and the admin port 2019", port, why)
		}
	}

	start := time.Now()
	caddy := startProcess(t, "caddy run --config Caddyfile.example", repoRoot, childEnv(t), "run", "--config", "Caddyfile.example")
	caddy.skipOnPortConflict = true
	// A paid route answers once the x402 app (the dev chain with it) has started: Caddy starts its apps in no
	// fixed order, so the free route may answer before.
	caddy.waitUntil("a 402 on "+quickstartSite+"/paid/index.html", quickstartReady, answersWith(quickstartSite+"/paid/index.html", 402))
	t.Logf("Caddy with the dev chain answered %s after %s (the test's go build took %s)",
		quickstartSite, time.Since(start).Round(time.Millisecond), buildTime.Round(time.Millisecond))
	dev := dialChain(t, quickstartRPC)

	page, err := os.ReadFile(filepath.Join(repoRoot, "examples", "site", "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	// The USD Coin route is paid as its comment says, by EIP-3009.
	routes := []struct {
		path     string
		amount   int64
		wantBody string
		token    common.Address
		method   string // --method, when the route's comment names one
	}{
		{"/paid/index.html", 10000, string(page), devchain.TokenAddress, ""},
		{"/api/hello", 1000, `"paid_by": "` + devchain.PayerAddress.Hex() + `"`, devchain.TokenAddress, ""},
		{"/usdc/", 10000, "paid in USD Coin", devchain.EIP3009TokenAddress, x402.TransferEIP3009},
	}

	for _, r := range routes {
		unpaid, err := get(quickstartSite + r.path)
		if err != nil {
			t.Fatal(err)
		}
		if unpaid.status != 402 {
			t.Fatalf("unpaid GET %s: status %d, want 402; body %q", r.path, unpaid.status, unpaid.body)
		}
		required, err := x402.DecodePaymentRequired(unpaid.header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			t.Fatalf("unpaid GET %s: the %s header does not decode: %v", r.path, x402.HeaderPaymentRequired, err)
		}
		if len(required.Accepts) == 0 || required.Accepts[0].Amount != big.NewInt(r.amount).String() ||
			!strings.EqualFold(required.Accepts[0].PayTo, seller.Hex()) || required.Accepts[0].Network != "eip155:72344" {
			t.Fatalf("unpaid GET %s: offers %+v, want first an offer of %d to %s on eip155:72344", r.path, required.Accepts, r.amount, seller.Hex())
		}
	}

	for _, r := range routes {
		payerBefore, sellerBefore := dev.balanceOf(r.token, devchain.PayerAddress), dev.balanceOf(r.token, seller)
		args := []string{"x402", "pay", "--dev", quickstartSite + r.path}
		if r.method != "" {
			args = append(args[:3], "--method", r.method, args[3])
		}
		pay := runCommand(t, 2*time.Minute, repoRoot, childEnv(t), caddyBin, args...)
		if pay.code != 0 {
			t.Fatalf("caddy %s exited %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), pay.code, pay.stdout, pay.stderr)
		}
		if r.method != "" && !strings.Contains(pay.stderr, " by "+r.method+" as ") {
			t.Errorf("caddy %s did not say it paid by %s:\n%s", strings.Join(args, " "), r.method, pay.stderr)
		}
		if !strings.HasPrefix(pay.stdout, "HTTP/1.1 200 OK\n") {
			t.Errorf("pay %s: expected the final answer 200 OK first, got:\n%s", r.path, pay.stdout)
		}
		if !strings.Contains(pay.stdout, r.wantBody) {
			t.Errorf("pay %s: the printed body lacks %q:\n%s", r.path, r.wantBody, pay.stdout)
		}
		settled := printedSettlement(t, pay.stdout)
		want := big.NewInt(r.amount)
		if !settled.Success || !txHashPattern.MatchString(settled.Transaction) || settled.Network != "eip155:72344" ||
			!strings.EqualFold(settled.Payer, devchain.PayerAddress.Hex()) || settled.Amount != want.String() {
			t.Errorf("pay %s: PAYMENT-RESPONSE %+v, want success with a transaction, eip155:72344, payer %s, amount %s",
				r.path, settled, devchain.PayerAddress.Hex(), want)
		}

		// The transaction it names is the transfer, and the balances moved by the price, once.
		if txHashPattern.MatchString(settled.Transaction) {
			if !receiptTransfersOf(dev, r.token, common.HexToHash(settled.Transaction), devchain.PayerAddress, seller, want) {
				t.Errorf("pay %s: transaction %s holds no Transfer of %s from the payer to the seller", r.path, settled.Transaction, want)
			}
		}
		if d := delta(payerBefore, dev.balanceOf(r.token, devchain.PayerAddress)); d.Cmp(new(big.Int).Neg(want)) != 0 {
			t.Errorf("pay %s: the payer's balance moved by %s, want -%s", r.path, d, want)
		}
		if d := delta(sellerBefore, dev.balanceOf(r.token, seller)); d.Cmp(want) != 0 {
			t.Errorf("pay %s: the seller's balance moved by %s, want +%s", r.path, d, want)
		}
	}
	caddy.stop()
}

// printedSettlement reads the PAYMENT-RESPONSE JSON that `caddy x402 pay` prints after the body.
func printedSettlement(t *testing.T, stdout string) x402.SettleResponse {
	t.Helper()
	const label = "\n" + x402.HeaderPaymentResponse + ":\n"
	i := strings.LastIndex(stdout, label)
	if i < 0 {
		t.Fatalf("the output has no %q section:\n%s", strings.TrimSpace(label), stdout)
	}
	var s x402.SettleResponse
	if err := json.NewDecoder(strings.NewReader(stdout[i+len(label):])).Decode(&s); err != nil {
		t.Fatalf("the printed %s is not JSON: %v\n%s", x402.HeaderPaymentResponse, err, stdout[i:])
	}
	return s
}

// receiptTransfersOf reports whether transaction tx succeeded and moved amount of token from one address to
// another.
func receiptTransfersOf(dev *devChain, token common.Address, tx common.Hash, from, to common.Address, amount *big.Int) bool {
	r := dev.receipt(tx)
	if r.Status != 1 {
		return false
	}
	for _, l := range r.Logs {
		if l.Address == token && len(l.Topics) == 3 && l.Topics[0] == transferTopic &&
			common.BytesToAddress(l.Topics[1].Bytes()) == from && common.BytesToAddress(l.Topics[2].Bytes()) == to &&
			transferAmount(*l).Cmp(amount) == 0 {
			return true
		}
	}
	return false
}
