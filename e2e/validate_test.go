package e2e

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// checkConfig runs `caddy validate` and `caddy adapt --validate` on config in a process of their own, as an
// operator checks a file beside a running server; both must exit 0.
func checkConfig(t *testing.T, dir string, env []string, config string) {
	t.Helper()
	for _, args := range [][]string{
		{"validate", "--adapter", "caddyfile", "--config", config},
		{"adapt", "--adapter", "caddyfile", "--config", config, "--validate"},
	} {
		r := runCommand(t, time.Minute, dir, env, caddyBin, args...)
		if r.code != 0 {
			t.Errorf("caddy %s exited %d beside the running server\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
		}
	}
}

// TestCaddyValidateBesideTheRunningQuickstartTouchesNoChainJournalOrPort starts Caddyfile.example as the
// quick start does, then checks the same file with `caddy validate` and `caddy adapt --validate` from a second
// process. Both exit 0, and they start no dev chain and bind no port: the first process's chain is the one
// still answering on its port with the same head block, and its gate still sells a page for a settled payment.
func TestCaddyValidateBesideTheRunningQuickstartTouchesNoChainJournalOrPort(t *testing.T) {
	needBinary(t)
	holdExamplePorts(t) // as the README's main job would
	q := newQuickstart(t)
	caddy := q.start(t)
	dev := dialChain(t, q.rpc)
	head := dev.head()
	sellerBefore := dev.balance(seller)

	checkConfig(t, repoRoot, childEnv(t), q.config)

	if !caddy.running() {
		t.Fatal("the running Caddy exited while its config was validated")
	}
	if h := dev.head(); h != head {
		t.Errorf("the dev chain's head moved from %d to %d while nothing was paid: validation sent transactions", head, h)
	}
	pay := runCommand(t, 2*time.Minute, repoRoot, childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", q.rpc, q.site+"/paid/index.html")
	if pay.code != 0 || !strings.HasPrefix(pay.stdout, "HTTP/1.1 200 OK\n") {
		t.Fatalf("paying the running gate after validation: exit %d\nstdout:\n%s\nstderr:\n%s", pay.code, pay.stdout, pay.stderr)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Int64() != 10000 {
		t.Errorf("the seller's balance moved by %s after one paid page, want 10000", d)
	}
	caddy.stop()
}

// TestCaddyValidateOfARealNetworkConfigMakesNoRPCCallAndOpensNoJournal runs a gate on a real network block
// (an RPC URL, wallet keys, a bbolt journal file) and checks the same Caddyfile from a second process whose
// environment points the network at a counting JSON-RPC server: validation exits 0 having made no RPC call,
// leaves the running gate's journal (which that gate holds locked) as it was, and, for a config naming a journal
// that does not exist yet, creates no file.
func TestCaddyValidateOfARealNetworkConfigMakesNoRPCCallAndOpensNoJournal(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	chainAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	siteAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	var keys []string
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
	}
	// The dev chain serves the network the gate settles on, through the network block's own RPC URL.
	config := func(journalPath string) string {
		return writeFile(t, dir, filepath.Base(journalPath)+".Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
		}
		network eip155:72344 {
			rpc {env.X402_TEST_RPC}
			asset %s
			wallet_keys {env.X402_TEST_WALLET_KEYS}
		}
		journal %s
	}
}

http://%s {
	x402 $0.01 {
		pay_to %s
	}
	respond "paid" 200
}
`, chainAddr, devchain.TokenAddress.Hex(), journalPath, siteAddr, seller.Hex()))
	}
	journalPath := filepath.Join(dir, "journal.db")
	running := config(journalPath)
	keysEnv := "X402_TEST_WALLET_KEYS=" + strings.Join(keys, ",")
	caddy := startProcess(t, "the gate on a network block", dir, childEnv(t, "X402_TEST_RPC=http://"+chainAddr, keysEnv),
		"run", "--adapter", "caddyfile", "--config", running)
	caddy.waitUntil("the gate answers 402", 60*time.Second, answersWith("http://"+siteAddr+"/", 402))
	journalBefore := fileState(t, journalPath)

	var calls atomic.Int64
	rpc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		http.Error(w, "this RPC endpoint counts calls and answers none", http.StatusServiceUnavailable)
	}))
	defer rpc.Close()
	checkEnv := childEnv(t, "X402_TEST_RPC="+rpc.URL, keysEnv)

	checkConfig(t, dir, checkEnv, running)
	fresh := filepath.Join(dir, "fresh-journal.db")
	checkConfig(t, dir, checkEnv, config(fresh))

	if n := calls.Load(); n != 0 {
		t.Errorf("validation made %d calls to the network's RPC endpoint, want none", n)
	}
	if _, err := os.Stat(fresh); !os.IsNotExist(err) {
		t.Errorf("validation of a config naming the journal %s created it (stat: %v)", fresh, err)
	}
	if after := fileState(t, journalPath); after != journalBefore {
		t.Errorf("the running gate's journal changed while its config was validated: %s, then %s", journalBefore, after)
	}
	if !caddy.running() {
		t.Fatal("the running Caddy exited while its config was validated")
	}
	// The running gate still has its chain, its port and its journal: it sells a response.
	dev := dialChain(t, "http://"+chainAddr)
	sellerBefore := dev.balance(seller)
	pay := runCommand(t, 2*time.Minute, dir, childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", "http://"+chainAddr, "http://"+siteAddr+"/")
	if pay.code != 0 || !strings.HasPrefix(pay.stdout, "HTTP/1.1 200 OK\n") {
		t.Fatalf("paying the running gate after validation: exit %d\nstdout:\n%s\nstderr:\n%s", pay.code, pay.stdout, pay.stderr)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Int64() != 10000 {
		t.Errorf("the seller's balance moved by %s after one paid response, want 10000", d)
	}
	caddy.stop()
}

// fileState is a file's size and modification time, to tell whether anything wrote it.
func fileState(t *testing.T, path string) string {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("the journal %s: %v", path, err)
	}
	return fmt.Sprintf("%d bytes, modified %s", fi.Size(), fi.ModTime().Format(time.RFC3339Nano))
}

// TestAMalformedWalletKeyFromTheEnvironmentStopsValidateAndRunNamingTheVariableNotTheKey checks with the built
// binary what an operator meets: `caddy validate` (which talks to no chain) and `caddy run` both refuse a config
// whose {env.X402_TEST_WALLET_KEYS} holds a malformed second key, both name the variable and the key's position,
// and neither prints any part of either key.
func TestAMalformedWalletKeyFromTheEnvironmentStopsValidateAndRunNamingTheVariableNotTheKey(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	good := hexutil.Encode(crypto.FromECDSA(devchain.WalletKeys(1)[0]))[2:]
	bad := strings.Repeat("c0ffee", 10) + "zz"
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		network eip155:723487 {
			rpc http://127.0.0.1:1
			asset %s
			wallet_keys {env.X402_TEST_WALLET_KEYS}
		}
	}
}

http://127.0.0.1:%d {
	x402 $0.01 {
		pay_to %s
	}
	respond "paid" 200
}
`, devchain.TokenAddress.Hex(), freePort(t), seller.Hex()))
	env := childEnv(t, "X402_TEST_WALLET_KEYS="+good+","+bad)
	const want = "wallet_keys: {env.X402_TEST_WALLET_KEYS}: key 2 of 2 is not 32 bytes of hex"
	for _, args := range [][]string{
		{"validate", "--adapter", "caddyfile", "--config", config},
		{"run", "--adapter", "caddyfile", "--config", config},
	} {
		r := runCommand(t, time.Minute, dir, env, caddyBin, args...)
		out := r.stdout + r.stderr
		if r.code == 0 || !strings.Contains(out, want) {
			t.Errorf("caddy %s exited %d, want a failure saying %q\nstdout:\n%s\nstderr:\n%s", args[0], r.code, want, r.stdout, r.stderr)
		}
		for _, key := range []string{good, bad} {
			for i := 0; i+8 <= len(key); i++ {
				if strings.Contains(out, key[i:i+8]) {
					t.Fatalf("caddy %s printed a part of a wallet key (%q)\nstdout:\n%s\nstderr:\n%s", args[0], key[i:i+8], r.stdout, r.stderr)
				}
			}
		}
	}
}
