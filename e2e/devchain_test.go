package e2e

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// TestTwoCaddysShareOneStandaloneDevChainAndItStopsCleanlyOnSIGINT runs `caddy x402 devchain --listen
// 127.0.0.1:0 --json` as a process of its own, then two Caddy processes whose gates settle on it through
// `dev_chain { rpc ... }`, each with dev wallets of its own and no chain of its own. One payment through each
// gate moves the seller's balance by the price on that chain; then the chain exits 0 on SIGINT.
func TestTwoCaddysShareOneStandaloneDevChainAndItStopsCleanlyOnSIGINT(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	chainProc, facts := startDevchain(t, dir)
	if facts.Network != "eip155:72344" || len(facts.Wallets) != devchain.DefaultWallets || strings.HasSuffix(facts.RPC, ":0") {
		t.Fatalf("the chain's facts %+v, want eip155:72344, %d wallets and the port it picked", facts, devchain.DefaultWallets)
	}
	dev := dialChain(t, facts.RPC)

	var gates []*process
	for i, wallets := range []string{"0-1", "2-3"} {
		gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
		file := writeFile(t, dir, fmt.Sprintf("gate%d.Caddyfile", i), fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			rpc %s
			wallets %s
		}
	}
}

%s {
	bind 127.0.0.1
	x402 $0.01 {
		pay_to %s
	}
	respond "paid"
}
`, facts.RPC, wallets, gateURL, seller.Hex()))
		gate := startProcess(t, fmt.Sprintf("the Caddy with wallets %s", wallets), dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", file)
		gate.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
		gates = append(gates, gate)

		before := dev.balance(seller)
		pay := runCommand(t, time.Minute, dir, childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", facts.RPC, gateURL+"/")
		if pay.code != 0 || !strings.Contains(pay.stdout, "paid") {
			t.Fatalf("caddy x402 pay to the gate with wallets %s exited %d\nstdout:\n%s\nstderr:\n%s", wallets, pay.code, pay.stdout, pay.stderr)
		}
		settled := printedSettlement(t, pay.stdout)
		if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 || !settled.Success {
			t.Fatalf("the gate with wallets %s: settlement %+v, the seller's balance moved by %s; want settled, +%d", wallets, settled, d, asyncPrice)
		}
		// The gate settled from one of its own wallets.
		from := dev.sender(common.HexToHash(settled.Transaction))
		if first := facts.Wallets[2*i]; from != common.HexToAddress(first) && from != common.HexToAddress(facts.Wallets[2*i+1]) {
			t.Errorf("the gate with wallets %s settled from %s, none of its wallets", wallets, from)
		}
	}

	for _, gate := range gates {
		gate.stop()
	}
	chainProc.stop()
	if out := chainProc.out.String(); !strings.Contains(out, "dev chain stopped") {
		t.Errorf("the chain did not say it stopped:\n%s", lastLines(out, 10))
	}
}

// devchainFacts is what `caddy x402 devchain --json` prints on its one line of stdout.
type devchainFacts struct {
	RPC     string   `json:"rpc"`
	Network string   `json:"network"`
	Wallets []string `json:"wallets"`
	Payers  []string `json:"payers"`
}

// startDevchain runs `caddy x402 devchain` on a free loopback port with extra flags (such as --wallets 12
// --payers 6), as a process of its own that outlives the Caddy processes settling on it, and returns it with the
// facts it printed once they are out.
func startDevchain(t *testing.T, dir string, flags ...string) (*process, devchainFacts) {
	t.Helper()
	args := append([]string{"x402", "devchain", "--listen", "127.0.0.1:0", "--json"}, flags...)
	proc := startProcess(t, "caddy x402 devchain", dir, childEnv(t), args...)
	var facts devchainFacts
	proc.waitUntil("the JSON line of the chain's facts", 90*time.Second, func() error {
		for _, line := range strings.Split(proc.out.String(), "\n") {
			if strings.HasPrefix(line, `{"rpc":`) {
				return json.Unmarshal([]byte(line), &facts)
			}
		}
		return fmt.Errorf("no JSON line yet")
	})
	return proc, facts
}
