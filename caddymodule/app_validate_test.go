package caddymodule_test

import (
	"encoding/hex"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// TestValidatingAConfigStartsNoChainDialsNoRPCAndOpensNoJournal checks with caddy.Validate, which provisions
// every module as `caddy validate` does, a config with a dev chain on a port another server holds, a real
// network block whose RPC endpoint counts calls, a journal file, a gate on the embedded facilitator and a
// facilitator route: validation passes, the RPC endpoint hears nothing, no journal file appears and the port
// is left to its holder.
func TestValidatingAConfigStartsNoChainDialsNoRPCAndOpensNoJournal(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	var calls atomic.Int64
	rpc := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		http.Error(w, "counted", http.StatusServiceUnavailable)
	}))
	defer rpc.Close()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	journalPath := filepath.Join(dir, "journal.db")
	cfg := adaptCaddyfile(t, `{
	x402 {
		dev_chain {
			listen `+held.Addr().String()+`
		}
		network eip155:723487 {
			rpc `+rpc.URL+`/with/a/key
			asset 0x69c1c4280cd64e46F1525c67AA9e5F784d09cB4C name "Stable Coin" version 1 decimals 6
			wallet_keys `+hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))+`
		}
		journal `+journalPath+`
	}
}
127.0.0.1:`+freePortOf(t)+` {
	handle /paid/* {
		x402 $0.01 {
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
			network eip155:723487
		}
		respond "paid"
	}
	handle /dev/* {
		x402 $0.01 {
			pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
		}
		respond "paid on the dev chain"
	}
	handle_path /facilitator/* {
		x402_facilitator {
			open
		}
	}
}`, dir)
	if err := caddy.Validate(mustConfig(t, cfg)); err != nil {
		t.Fatalf("caddy.Validate: %v", err)
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("validation made %d calls to the network's RPC endpoint, want none", n)
	}
	if _, err := os.Stat(journalPath); !os.IsNotExist(err) {
		t.Errorf("validation created the journal %s (stat: %v)", journalPath, err)
	}
	// The listener is still the only one on its port: it accepts.
	go func() {
		if c, err := held.Accept(); err == nil {
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", held.Addr().String())
	if err != nil {
		t.Fatalf("the held port stopped answering: %v", err)
	}
	c.Close()
}

func TestValidatingDevChainRPCAndWalletsRefusesWhatCannotWork(t *testing.T) {
	for _, tc := range []struct {
		name, options, want string
	}{
		{"rpc and the options of a chain the app starts", "rpc http://127.0.0.1:8545\n\t\t\tlisten 127.0.0.1:8546", "leave them out"},
		{"rpc and a data dir", "rpc http://127.0.0.1:8545\n\t\t\tdata_dir /tmp/x", "leave them out"},
		{"a wallet the embedded chain does not fund", "wallets 2-4", "funds wallets 0 to 3, not 4"},
		{"a wallet listed twice", "rpc http://127.0.0.1:8545\n\t\t\twallets 4-6 5", "wallet 5 is listed twice"},
		{"nothing wrong: wallets of a chain running elsewhere", "rpc http://127.0.0.1:8545\n\t\t\tchain_id 1337\n\t\t\twallets 8-9", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adaptCaddyfile(t, "{\n\tx402 {\n\t\tdev_chain {\n\t\t\t"+tc.options+"\n\t\t}\n\t}\n}\n\nhttp://127.0.0.1:"+freePortOf(t)+
				" {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t}\n\trespond paid\n}\n", t.TempDir())
			err := caddy.Validate(mustConfig(t, cfg))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("caddy.Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("caddy.Validate = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

// mustConfig decodes a JSON Caddy config.
func mustConfig(t *testing.T, raw []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

// freePortOf is freeAddr's port.
func freePortOf(t *testing.T) string {
	_, port, _ := net.SplitHostPort(freeAddr(t))
	return port
}

// dev_chain's batch block is the dev chain's network's: its receiver authorizer key is resolved as a network's
// is (an unset variable refused, naming it), and beside a network block that names the dev chain's network
// itself, which takes its own batch block, it is refused rather than ignored.
func TestValidatingDevChainBatchGivesItToTheDevNetworkOrRefusesIt(t *testing.T) {
	route := "http://127.0.0.1:" + freePortOf(t) + " {\n\tx402 $0.01 {\n\t\tpay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11\n\t}\n\trespond paid\n}\n"
	for _, tc := range []struct {
		name, x402, want string
	}{
		{"a key from an unset variable", "dev_chain {\n\t\t\trpc http://127.0.0.1:8545\n\t\t\tbatch {\n\t\t\t\treceiver_authorizer_key {env.X402_TEST_UNSET_BATCH_KEY}\n\t\t\t}\n\t\t}",
			"batch: receiver_authorizer_key: {env.X402_TEST_UNSET_BATCH_KEY} is empty"},
		{"beside the dev chain's network named itself", "network eip155:72344 {\n\t\t\trpc http://127.0.0.1:8545\n\t\t}\n\t\tdev_chain {\n\t\t\trpc http://127.0.0.1:8545\n\t\t\tbatch {\n\t\t\t\treceiver_authorizer_key " +
			strings.Repeat("11", 32) + "\n\t\t\t}\n\t\t}", "dev_chain: batch: the config names the dev chain's network eip155:72344 itself"},
		{"nothing wrong", "dev_chain {\n\t\t\trpc http://127.0.0.1:8545\n\t\t\tbatch {\n\t\t\t\treceiver_authorizer_key " + strings.Repeat("11", 32) + "\n\t\t\t\tclaim_after 2s\n\t\t\t}\n\t\t}", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adaptCaddyfile(t, "{\n\tx402 {\n\t\t"+tc.x402+"\n\t}\n}\n\n"+route, t.TempDir())
			if !strings.Contains(string(cfg), `"batch":{`) {
				t.Fatalf("the adapted config carries no batch block: %s", cfg)
			}
			err := caddy.Validate(mustConfig(t, cfg))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("caddy.Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("caddy.Validate = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}
