package e2e

import (
	"encoding/json"
	"fmt"
	"math/big"
	"net"
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

// quickstartReady is how long Caddyfile.example's Caddy gets to answer a paid route's 402.
const quickstartReady = 60 * time.Second

// quickstart is Caddyfile.example as a test runs it: the same file with its fixed ports (the site's 8080, the
// legacy app's 8081, the dev chain's 8545 and the admin API's 2019) moved to free ones, so that a test never
// depends on what else runs on the machine, such as the README's main job.
type quickstart struct {
	site   string // the site's URL, http://localhost:<port>
	rpc    string // the dev chain's JSON-RPC URL, http://127.0.0.1:<port>
	admin  string // the admin API's address, localhost:<port>
	config string // the rewritten file, named Caddyfile.example so that Caddy reads it as a Caddyfile
	ports  map[int]int
}

// newQuickstart writes Caddyfile.example, on free ports, to a temporary folder. The file is run from the
// repository's root, as the README runs it (its paths, such as examples/site, are relative to it). A rewrite
// that no longer finds what it replaces fails the test: the example changed, and this must follow it.
func newQuickstart(t *testing.T) *quickstart {
	t.Helper()
	q := &quickstart{ports: map[int]int{8080: freePort(t), 8081: freePort(t), 8545: freePort(t), 2019: freePort(t)}}
	q.site = fmt.Sprintf("http://localhost:%d", q.ports[8080])
	q.rpc = fmt.Sprintf("http://127.0.0.1:%d", q.ports[8545])
	q.admin = fmt.Sprintf("localhost:%d", q.ports[2019])
	b, err := os.ReadFile(filepath.Join(repoRoot, "Caddyfile.example"))
	if err != nil {
		t.Fatal(err)
	}
	config := string(b)
	for _, r := range []struct{ old, new string }{
		{"\tadmin localhost:2019\n", fmt.Sprintf("\tadmin %s\n", q.admin)},
		{"\n:8080 {\n", fmt.Sprintf("\n:%d {\n", q.ports[8080])},
		{"\n:8081 {\n", fmt.Sprintf("\n:%d {\n", q.ports[8081])},
		{"reverse_proxy localhost:8081 {", fmt.Sprintf("reverse_proxy localhost:%d {", q.ports[8081])},
		// The dev chain listens on 127.0.0.1:8545 unless told otherwise.
		{"\t\tdev_chain {\n", fmt.Sprintf("\t\tdev_chain {\n\t\t\tlisten 127.0.0.1:%d\n", q.ports[8545])},
	} {
		if n := strings.Count(config, r.old); n != 1 {
			t.Fatalf("Caddyfile.example holds %q %d times, want once: the example changed, update newQuickstart", r.old, n)
		}
		config = strings.Replace(config, r.old, r.new, 1)
	}
	q.config = writeFile(t, t.TempDir(), "Caddyfile.example", config)
	return q
}

// start runs `caddy run --config Caddyfile.example` from the repository's root and waits for a paid route's 402:
// Caddy starts its apps in no fixed order, so the free route may answer before the x402 app (the dev chain with
// it) has started.
func (q *quickstart) start(t *testing.T) *process {
	t.Helper()
	caddy := startProcess(t, "caddy run --config Caddyfile.example", repoRoot, childEnv(t), "run", "--config", q.config)
	caddy.waitUntil("a 402 on "+q.site+"/paid/index.html", quickstartReady, answersWith(q.site+"/paid/index.html", 402))
	return caddy
}

// rewrite moves the example's fixed addresses in a command line (the README's, Caddyfile.example's comments) to
// this quickstart's ports, and points `caddy x402 pay --dev` and `bench --dev`, which look for the dev chain on
// 127.0.0.1:8545, at its chain.
func (q *quickstart) rewrite(line string) string {
	line = strings.NewReplacer(
		"localhost:8080", fmt.Sprintf("localhost:%d", q.ports[8080]),
		"localhost:8081", fmt.Sprintf("localhost:%d", q.ports[8081]),
		"127.0.0.1:8545", fmt.Sprintf("127.0.0.1:%d", q.ports[8545]),
		"localhost:2019", q.admin,
	).Replace(line)
	for _, cmd := range []string{"x402 pay --dev", "x402 bench --dev"} {
		if strings.Contains(line, cmd) && !strings.Contains(line, "--rpc") {
			line = strings.Replace(line, cmd, cmd+" --rpc "+q.rpc, 1)
		}
	}
	return line
}

// holdExamplePorts listens on Caddyfile.example's fixed ports, where they are free, until the test ends, as the
// README's main job would: a test on the example must not need them.
func holdExamplePorts(t *testing.T) {
	t.Helper()
	for _, port := range []int{8080, 8081, 8545, 2019} {
		if l, err := net.Listen("tcp", fmt.Sprintf(":%d", port)); err == nil {
			t.Cleanup(func() { l.Close() })
		}
		if portTaken(port) == "" {
			t.Fatalf("port %d is free after holdExamplePorts", port)
		}
	}
}

// txHashPattern is a transaction hash as PAYMENT-RESPONSE carries it.
var txHashPattern = regexp.MustCompile(`^0x[0-9a-fA-F]{64}$`)

// TestQuickstartSellsThePaidRoutesToCaddyX402PayDev runs the README's quick start as a user would, with the
// built binary: `caddy run --config Caddyfile.example` from the repository root, then
// `caddy x402 pay --dev` for a paid file, the paid legacy API and (--method eip3009) the route paid in the
// USD Coin. Each pay exits 0 with the content and a
// settled PAYMENT-RESPONSE naming a transaction, and the dev chain's balances moved by exactly the prices. The
// example's own ports are held by the test meanwhile, as the README's main job holds them: it runs on free ones.
func TestQuickstartSellsThePaidRoutesToCaddyX402PayDev(t *testing.T) {
	needBinary(t)
	// The README's main job may be running: the test holds the example's own ports and runs on others.
	holdExamplePorts(t)
	q := newQuickstart(t)

	start := time.Now()
	caddy := q.start(t)
	t.Logf("Caddy with the dev chain answered %s after %s (the test's go build took %s)",
		q.site, time.Since(start).Round(time.Millisecond), buildTime.Round(time.Millisecond))
	dev := dialChain(t, q.rpc)

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
		unpaid, err := get(q.site + r.path)
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
		args := []string{"x402", "pay", "--dev", "--rpc", q.rpc, q.site + r.path}
		if r.method != "" {
			args = append(args[:5], "--method", r.method, args[5])
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
