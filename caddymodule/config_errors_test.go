package caddymodule_test

import (
	"encoding/hex"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// badChecksum is the EIP-55 address 0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359 with the case of one letter
// changed: what a mistyped mixed-case address looks like.
const badChecksum = "0xFB6916095ca1df60bB79Ce92cE3Ea74c37c5d359"

// goodChecksum, lowerCase and upperCase are addresses as configuration may write them.
const (
	goodChecksum = "0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359"
	lowerCase    = "0xfb6916095ca1df60bb79ce92ce3ea74c37c5d359"
	upperCase    = "0xFB6916095CA1DF60BB79CE92CE3EA74C37C5D359"
)

// adaptError adapts caddyfile and checks that the error names line of the file Caddyfile and says every text.
func adaptError(t *testing.T, caddyfile, line string, texts ...string) error {
	t.Helper()
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err == nil {
		t.Fatalf("adapting succeeded, want an error at %s:\n%s", line, caddyfile)
	}
	if !regexp.MustCompile(regexp.QuoteMeta(line) + `\b`).MatchString(err.Error()) {
		t.Errorf("error %q does not name %s", err, line)
	}
	for _, text := range texts {
		if !strings.Contains(err.Error(), text) {
			t.Errorf("error %q does not say %q", err, text)
		}
	}
	return err
}

// Prices, amounts, addresses and networks are refused as the Caddyfile is read, naming its line, where today
// Provision refused some of them behind "route 0: position 0: ..." and took others (a bare number as dollars,
// a mixed-case address whose checksum fails).
func TestBadPricesAmountsAddressesAndNetworksAreRefusedNamingTheirCaddyfileLine(t *testing.T) {
	gate := func(lines ...string) string {
		return ":8080\n\nhandle /paid/* {\n\tx402 {\n\t\tpay_to " + lowerCase + "\n" + strings.Join(lines, "\n") + "\n\t}\n\trespond paid\n}\n"
	}
	global := func(lines ...string) string {
		return "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n" + strings.Join(lines, "\n") + "\n\t\t}\n\t}\n}\n\n:8080\n\nrespond ok\n"
	}
	facilitator := func(lines ...string) string {
		return ":8080\n\nhandle_path /facilitator/* {\n\tx402_facilitator {\n" + strings.Join(lines, "\n") + "\n\t}\n}\n"
	}
	for _, tc := range []struct {
		name, caddyfile, line string
		texts                 []string
	}{
		{"a bare number as the gate's price", ":8080\n\nx402 /paid/* 10000 {\n\tpay_to " + lowerCase + "\n}\n", "Caddyfile:3",
			[]string{`price "10000" is a bare number: write "$10000" for dollars, or amount 10000 for raw token units`}},
		{"a bare number as price", gate("\t\tprice 10000"), "Caddyfile:6", []string{`price "10000" is a bare number`, `"$10000"`, "amount 10000"}},
		{"a bare decimal as price", gate("\t\tprice 0.01"), "Caddyfile:6", []string{`price "0.01" is a bare number: write "$0.01"`}},
		{"a price of zero", gate("\t\tprice $0"), "Caddyfile:6", []string{"the price is zero"}},
		{"a price with an exponent", gate("\t\tprice $1e3"), "Caddyfile:6", []string{`price "$1e3": unexpected 'e'`}},
		{"a negative price", gate("\t\tprice -$1"), "Caddyfile:6", []string{"negative"}},
		{"an amount of zero", gate("\t\tamount 0"), "Caddyfile:6", []string{"the price is zero"}},
		{"an amount in dollars", gate("\t\tamount $0.01"), "Caddyfile:6", []string{`amount: not a canonical unsigned decimal integer: "$0.01"`}},
		{"a pay_to that is no address", ":8080\n\nx402 /paid/* $0.01 {\n\tpay_to 0x5e11\n}\n", "Caddyfile:4", []string{`pay_to "0x5e11" is not an address (0x and 40 hex digits)`}},
		{"a pay_to whose checksum fails", ":8080\n\nx402 /paid/* $0.01 {\n\tpay_to " + badChecksum + "\n}\n", "Caddyfile:4", []string{`pay_to "` + badChecksum + `": its mixed case fails the EIP-55 checksum`}},
		{"a pay_to of the zero address", ":8080\n\nx402 /paid/* $0.01 {\n\tpay_to 0x0000000000000000000000000000000000000000\n}\n", "Caddyfile:4", []string{"pay_to is the zero address"}},
		{"an asset whose checksum fails", gate("\t\tprice $0.01", "\t\tasset "+badChecksum), "Caddyfile:7", []string{`asset "` + badChecksum + `": its mixed case fails the EIP-55 checksum`}},
		{"a network that is not CAIP-2", gate("\t\tprice $0.01", "\t\tnetwork base-sepolia"), "Caddyfile:7", []string{"network: ", "base-sepolia"}},
		{"a network of another namespace", gate("\t\tprice $0.01", "\t\tnetwork solana:mainnet"), "Caddyfile:7", []string{"network: ", "solana:mainnet"}},
		{"a bare number as an accept block's price", gate("\t\tprice $0.01", "\t\taccept {", "\t\t\tnetwork eip155:723487", "\t\t\tprice 5", "\t\t}"), "Caddyfile:9", []string{`price "5" is a bare number`}},
		{"an accept block's pay_to whose checksum fails", gate("\t\tprice $0.01", "\t\taccept {", "\t\t\tpay_to "+badChecksum, "\t\t}"), "Caddyfile:8", []string{"EIP-55 checksum"}},
		{"an accept block's amount of zero", gate("\t\tprice $0.01", "\t\taccept {", "\t\t\tamount 0", "\t\t}"), "Caddyfile:8", []string{"the price is zero"}},

		{"a network asset whose checksum fails", global("\t\t\tasset " + badChecksum + " decimals 6"), "Caddyfile:4", []string{`asset "` + badChecksum + `": its mixed case fails the EIP-55 checksum`}},
		{"a network pay_to whose checksum fails", global("\t\t\tpay_to " + lowerCase + " " + badChecksum), "Caddyfile:4", []string{`pay_to "` + badChecksum + `": its mixed case fails the EIP-55 checksum`}},
		{"a smart wallet factory whose checksum fails", global("\t\t\tsmart_wallet_factories " + badChecksum), "Caddyfile:4", []string{`smart_wallet_factories: "` + badChecksum + `": its mixed case fails`}},
		{"a network min_amount as a price", global("\t\t\tmin_amount $1"), "Caddyfile:4", []string{"min_amount '$1' is not a whole number of raw token units"}},

		{"a facilitator pay_to whose checksum fails", facilitator("\t\tpay_to " + badChecksum), "Caddyfile:5", []string{`pay_to "` + badChecksum + `": its mixed case fails the EIP-55 checksum`}},
		{"a facilitator min_amount as a price", facilitator("\t\tmin_amount $0.01"), "Caddyfile:5", []string{"min_amount '$0.01' is not a whole number"}},
		{"a facilitator network that is not CAIP-2", facilitator("\t\tnetworks base"), "Caddyfile:5", []string{"networks: "}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := adaptError(t, tc.caddyfile, tc.line, tc.texts...)
			if strings.Contains(err.Error(), "route 0: position") {
				t.Errorf("error %q is Provision's, not the Caddyfile's", err)
			}
		})
	}
}

// An address in one case carries no checksum and is taken as it is; so is one whose checksum holds.
func TestAddressesInOneCaseOrWithAGoodChecksumAreTaken(t *testing.T) {
	for _, addr := range []string{goodChecksum, lowerCase, upperCase} {
		cfg := "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\tasset " + addr + "\n\t\t\tpay_to " + addr + "\n\t\t\tsmart_wallet_factories " + addr +
			"\n\t\t}\n\t}\n}\n\n:8080\n\nx402 /paid/* $0.01 {\n\tpay_to " + addr + "\n\tasset " + addr + "\n}\nhandle_path /f/* {\n\tx402_facilitator {\n\t\tpay_to " + addr + "\n\t}\n}\n"
		if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(cfg), map[string]any{"filename": "Caddyfile"}); err != nil {
			t.Errorf("adapting with %s: %v", addr, err)
		}
	}
}

// A JSON config has no lines: Provision refuses the same values in the same words, so that a JSON price of a
// bare number is no more $10,000 than a Caddyfile one.
func TestAJSONConfigsBadPricesAndAddressesAreRefusedByProvision(t *testing.T) {
	key := hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))
	network := `{"network":"eip155:723487","rpc":["http://127.0.0.1:1"],"assets":[{"address":"ASSET"}],"wallet_keys":["` + key + `"]PAYTO}`
	for _, tc := range []struct {
		name, asset, payTo, gate, want string
	}{
		{"a bare number as a gate's price", lowerCase, "", `"price":"10000","pay_to":"` + lowerCase + `"`, `price "10000" is a bare number`},
		{"a gate pay_to whose checksum fails", lowerCase, "", `"price":"$0.01","pay_to":"` + badChecksum + `"`, "EIP-55 checksum"},
		{"a gate asset whose checksum fails", lowerCase, "", `"price":"$0.01","pay_to":"` + lowerCase + `","asset":"` + badChecksum + `"`, "EIP-55 checksum"},
		{"a network asset whose checksum fails", badChecksum, "", `"price":"$0.01","pay_to":"` + lowerCase + `"`, "EIP-55 checksum"},
		{"a network pay_to whose checksum fails", lowerCase, `,"pay_to":["` + badChecksum + `"]`, `"price":"$0.01","pay_to":"` + lowerCase + `"`, "EIP-55 checksum"},
		{"nothing wrong", upperCase, `,"pay_to":["` + goodChecksum + `"]`, `"price":"$0.01","pay_to":"` + goodChecksum + `"`, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := strings.NewReplacer("ASSET", tc.asset, "PAYTO", tc.payTo).Replace(network)
			cfg := `{"admin":{"disabled":true},"apps":{"x402":{"networks":[` + n + `]},"http":{"servers":{"s":{"listen":["127.0.0.1:` + freePortOf(t) +
				`"],"routes":[{"handle":[{"handler":"x402",` + tc.gate + `},{"handler":"static_response","body":"paid"}]}]}}}}}`
			err := caddy.Validate(mustConfig(t, []byte(cfg)))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("caddy.Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("caddy.Validate = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

// walletKeyEnv sets the environment variable name to keys: a good key then a malformed one, whose characters
// are returned so that a test can look for any part of them in what Caddy says.
func walletKeyEnv(t *testing.T, name string) (good, bad string) {
	t.Helper()
	good = hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))
	bad = "0x" + strings.Repeat("c0ffee", 10) + "zz" // 62 hex digits and two that are not
	t.Setenv(name, good+","+bad)
	return good, bad
}

// leaksKey reports whether text holds a key or a part of it as long as 8 characters.
func leaksKey(text string, keys ...string) bool {
	for _, k := range keys {
		k = strings.TrimPrefix(k, "0x")
		for i := 0; i+8 <= len(k); i++ {
			if strings.Contains(text, k[i:i+8]) {
				return true
			}
		}
	}
	return false
}

// walletKeysCaddyfile is a config whose one network takes its wallet keys from keys.
func walletKeysCaddyfile(t *testing.T, keys string) string {
	return "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\trpc http://127.0.0.1:1\n\t\t\tasset " + lowerCase + "\n\t\t\twallet_keys " + keys +
		"\n\t\t}\n\t}\n}\n\nhttp://127.0.0.1:" + freePortOf(t) + " {\n\tx402 $0.01 {\n\t\tpay_to " + lowerCase + "\n\t}\n\trespond paid\n}\n"
}

// A malformed key read from {env.NAME} is found by `caddy validate` (caddy.Validate provisions as it does,
// talking to no chain), and by a run (caddy.Load) before anything starts; both name the variable and the key's
// position, and never the key or any part of it.
func TestAMalformedWalletKeyFromTheEnvironmentIsNamedByItsVariableAtValidate(t *testing.T) {
	good, bad := walletKeyEnv(t, "X402_TEST_WALLET_KEYS")
	cfg := mustConfig(t, adaptCaddyfile(t, walletKeysCaddyfile(t, "{env.X402_TEST_WALLET_KEYS}"), t.TempDir()))
	const want = "wallet_keys: {env.X402_TEST_WALLET_KEYS}: key 2 of 2 is not 32 bytes of hex"
	err := caddy.Validate(cfg)
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("caddy.Validate = %v, want an error saying %q", err, want)
	}
	if leaksKey(err.Error(), good, bad) {
		t.Fatalf("caddy.Validate's error holds a part of a key: %v", err)
	}
	caddyMu.Lock()
	err = caddy.Load(adaptCaddyfile(t, walletKeysCaddyfile(t, "{env.X402_TEST_WALLET_KEYS}"), t.TempDir()), true)
	_ = caddy.Stop()
	caddyMu.Unlock()
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("caddy.Load = %v, want an error saying %q", err, want)
	}
	if leaksKey(err.Error(), good, bad) {
		t.Fatalf("caddy.Load's error holds a part of a key: %v", err)
	}

	t.Setenv("X402_TEST_WALLET_KEYS", "")
	err = caddy.Validate(mustConfig(t, adaptCaddyfile(t, walletKeysCaddyfile(t, "{env.X402_TEST_WALLET_KEYS}"), t.TempDir())))
	if want := "wallet_keys: {env.X402_TEST_WALLET_KEYS} is empty; is the environment variable set?"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("caddy.Validate with the variable empty = %v, want an error saying %q", err, want)
	}
}

// A key written out, or put in by {$NAME} as the Caddyfile is read, is checked with the Caddyfile's line.
func TestAMalformedWalletKeyInTheCaddyfileIsRefusedNamingItsLine(t *testing.T) {
	good, bad := walletKeyEnv(t, "X402_TEST_WALLET_KEYS")
	for _, keys := range []string{good + "," + bad, "{$X402_TEST_WALLET_KEYS}", good + " " + bad} {
		caddyfile := walletKeysCaddyfile(t, keys)
		var err error
		if keys == good+" "+bad {
			err = adaptError(t, caddyfile, "Caddyfile:6", "wallet_keys: entry 2 of 2: key 1 of 1 is not 32 bytes of hex")
		} else {
			err = adaptError(t, caddyfile, "Caddyfile:6", "wallet_keys: the keys written out: key 2 of 2 is not 32 bytes of hex")
		}
		if leaksKey(err.Error(), good, bad) {
			t.Errorf("the error holds a part of a key: %v", err)
		}
	}
}

// wallet_key_file is read and checked by Provision, so `caddy validate` finds a malformed file.
func TestAMalformedWalletKeyFileIsFoundAtValidate(t *testing.T) {
	_, bad := walletKeyEnv(t, "X402_TEST_UNUSED")
	path := t.TempDir() + "/keys.txt"
	if err := os.WriteFile(path, []byte("# settlement wallets\n"+strings.Repeat("ab", 32)+"\n"+bad+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	caddyfile := strings.Replace(walletKeysCaddyfile(t, "X"), "wallet_keys X", "wallet_key_file "+path, 1)
	err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, caddyfile, t.TempDir())))
	if want := "settlement key file " + path + ": key 2 of 2 is not 32 bytes of hex"; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("caddy.Validate = %v, want an error saying %q", err, want)
	}
	if leaksKey(err.Error(), bad, strings.Repeat("ab", 32)) {
		t.Fatalf("the error holds a part of a key: %v", err)
	}
}

// A facilitator route serving the embedded engine on a real network whose batch block holds the receiver
// authorizer's key is refused at its line without an api_key: open, pay_to or min_amount let any caller have the key
// sign a refund of a channel's rest without the claim of its vouchers. One on the dev chain, or closed by an api_key,
// is taken.
func TestAFacilitatorHoldingTheReceiverAuthorizerKeyOnARealNetworkNeedsAnAPIKey(t *testing.T) {
	key := hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))
	config := func(network, route string) string {
		return "{\n\tx402 {\n\t\tdev_chain\n\t\tnetwork " + network + " {\n\t\t\trpc http://127.0.0.1:1\n\t\t\tasset " + lowerCase + "\n\t\t\twallet_keys " + key +
			"\n\t\t\tbatch {\n\t\t\t\treceiver_authorizer_key " + key + "\n\t\t\t}\n\t\t}\n\t}\n}\n\nhttp://127.0.0.1:" + freePortOf(t) +
			" {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n" + route + "\t\t}\n\t}\n}\n"
	}
	for _, tc := range []struct {
		name, network, route string
		refused              bool
	}{
		{"open", "eip155:723487", "\t\t\topen\n", true},
		{"a pay_to list and a min_amount", "eip155:723487", "\t\t\tpay_to " + lowerCase + "\n\t\t\tmin_amount 1000\n", true},
		{"an api_key", "eip155:723487", "\t\t\tapi_key {env.X402_TEST_FACILITATOR_KEY}\n", false},
		{"the dev chain's network", "eip155:72344", "\t\t\topen\n", false},
		{"another network only", "eip155:723487", "\t\t\topen\n\t\t\tnetworks eip155:72344\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("X402_TEST_FACILITATOR_KEY", "k")
			caddyfile := config(tc.network, tc.route)
			if !tc.refused {
				if err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, caddyfile, t.TempDir()))); err != nil {
					t.Fatalf("caddy.Validate: %v", err)
				}
				return
			}
			err := adaptError(t, caddyfile, "Caddyfile:17", "would sign batch-settlement claims and refunds for anyone on eip155:723487", "api_key <key>")
			if leaksKey(err.Error(), key) {
				t.Fatalf("the error holds a part of the key: %v", err)
			}
		})
	}
}

// A facilitator route serving the embedded engine on a real network, with nothing that keeps strangers from
// making its wallets pay gas, is refused at its line unless it says open; one on the dev chain is taken.
func TestAnOpenFacilitatorOnARealNetworkIsRefusedUnlessItSaysSo(t *testing.T) {
	key := hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))
	config := func(network, route string) string {
		return "{\n\tx402 {\n\t\tdev_chain\n\t\tnetwork eip155:723487 {\n\t\t\trpc http://127.0.0.1:1\n\t\t\tasset " + lowerCase + "\n\t\t\twallet_keys " + key +
			network + "\n\t\t}\n\t}\n}\n\nhttp://127.0.0.1:" + freePortOf(t) + " {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n" + route + "\t\t}\n\t}\n}\n"
	}
	for _, tc := range []struct {
		name, network, route string
		refused              bool
	}{
		{"no api_key, no pay_to, no min_amount", "", "", true},
		{"only the real network, named", "", "\t\t\tnetworks eip155:723487\n", true},
		{"open", "", "\t\t\topen\n", false},
		{"an api_key", "", "\t\t\tapi_key {env.X402_TEST_FACILITATOR_KEY}\n", false},
		{"a pay_to list", "", "\t\t\tpay_to " + lowerCase + "\n", false},
		{"a min_amount", "", "\t\t\tmin_amount 1000\n", false},
		{"the network's min_amount", "\n\t\t\tmin_amount 1000", "", false},
		{"the network's pay_to list", "\n\t\t\tpay_to " + lowerCase, "", false},
		{"only the dev chain", "", "\t\t\tnetworks eip155:72344\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("X402_TEST_FACILITATOR_KEY", "k")
			caddyfile := config(tc.network, tc.route)
			if !tc.refused {
				cfg := adaptCaddyfile(t, caddyfile, t.TempDir())
				if err := caddy.Validate(mustConfig(t, cfg)); err != nil {
					t.Fatalf("caddy.Validate: %v", err)
				}
				return
			}
			adaptError(t, caddyfile, "Caddyfile:14", "would let anyone make its settlement wallets pay gas on eip155:723487",
				"api_key <key>", "pay_to <address>", "min_amount <raw units>", "write open")
			// JSON has no line: Provision refuses it in the same words.
			json := adaptCaddyfile(t, strings.Replace(caddyfile, "x402_facilitator {", "x402_facilitator {\n\t\t\topen", 1), t.TempDir())
			json = []byte(strings.Replace(string(json), `"open":true`, `"open":false`, 1))
			err := caddy.Validate(mustConfig(t, json))
			if err == nil || !strings.Contains(err.Error(), "would let anyone make its settlement wallets pay gas on eip155:723487") {
				t.Fatalf("caddy.Validate of the JSON = %v, want the route refused", err)
			}
		})
	}
}

// The example site's facilitator route, on the dev chain alone, stays as it is.
func TestTheDevChainsOpenFacilitatorIsTaken(t *testing.T) {
	caddyfile := "{\n\tx402 {\n\t\tdev_chain\n\t}\n}\n\nhttp://127.0.0.1:" + freePortOf(t) + " {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator\n\t}\n}\n"
	if err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, caddyfile, t.TempDir()))); err != nil {
		t.Fatalf("caddy.Validate: %v", err)
	}
}

// A reload to a config these checks refuse (a key from the environment that is malformed, a facilitator route
// open on a real network) fails before anything of it starts, and the running config keeps serving its 402.
func TestAReloadToARefusedConfigLeavesTheRunningOneServing(t *testing.T) {
	const good = `{
	x402 {
		dev_chain {
			listen 127.0.0.1:0
		}
	}
}
{{ADDR}} {
	handle /paid/* {
		x402 $0.01 {
			pay_to ` + lowerCase + `
		}
		respond "paid"
	}
}`
	srv := startCaddy(t, good)
	get := func() int {
		t.Helper()
		resp, err := http.Get(srv.URL + "/paid/x")
		if err != nil {
			t.Fatalf("GET /paid/x: %v", err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if status := get(); status != http.StatusPaymentRequired {
		t.Fatalf("before the reload: status %d, want 402", status)
	}
	goodKey, badKey := walletKeyEnv(t, "X402_TEST_WALLET_KEYS")
	network := "\t\tnetwork eip155:723487 {\n\t\t\trpc http://127.0.0.1:1\n\t\t\tasset " + lowerCase + "\n\t\t\twallet_keys {env.X402_TEST_WALLET_KEYS}\n\t\t}\n"
	for _, tc := range []struct{ name, config, want string }{
		{"a malformed key", strings.Replace(good, "\t\tdev_chain {", network+"\t\tdev_chain {", 1), "wallet_keys: {env.X402_TEST_WALLET_KEYS}: key 2 of 2"},
		{"a facilitator open on a real network", strings.Replace(strings.Replace(good, "\t\tdev_chain {", network+"\t\tdev_chain {", 1),
			"handle /paid/* {", "handle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\tnetworks eip155:723487\n\t\t}\n\t}\n\thandle /paid/* {", 1), "would let anyone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.want == "would let anyone" {
				// The Caddyfile refuses it as it is read; JSON reaches Provision, as a reload by the admin API would.
				t.Setenv("X402_TEST_WALLET_KEYS", goodKey)
				adaptError(t, srv.expand(tc.config), "Caddyfile:15", tc.want)
				tc.config = strings.Replace(tc.config, "networks eip155:723487", "networks eip155:723487\n\t\t\topen", 1)
			}
			cfg := srv.adapt(tc.config)
			cfg = []byte(strings.Replace(string(cfg), `"open":true`, `"open":false`, 1))
			err := caddy.Load(cfg, true)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("reload = %v, want it refused saying %q", err, tc.want)
			}
			if leaksKey(err.Error(), goodKey, badKey) {
				t.Fatalf("the reload's error holds a part of a key: %v", err)
			}
			http.DefaultClient.CloseIdleConnections()
			if status := get(); status != http.StatusPaymentRequired {
				t.Fatalf("after the refused reload: status %d, want the running config's 402", status)
			}
		})
	}
}

// A price finer than the token it is paid in is refused at its line, by the decimals the x402 option gives the
// token (6 when it names none), wherever the way to pay takes its token from.
func TestAPriceFinerThanItsTokenIsRefusedAtItsLine(t *testing.T) {
	global := "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\tasset " + lowerCase + " decimals 18\n\t\t}\n\t\tnetwork eip155:8453 {\n\t\t\tasset " + upperCase + "\n\t\t}\n\t}\n}\n\n"
	gate := func(lines ...string) string {
		return global + ":8080\n\nx402 {\n\tpay_to " + lowerCase + "\n" + strings.Join(lines, "\n") + "\n}\n"
	}
	for _, tc := range []struct{ name, caddyfile, line string }{
		{"of the default 6-decimal token, no x402 option", ":8080\n\nx402 /paid/* $0.0000001 {\n\tpay_to " + lowerCase + "\n\tnetwork eip155:723487\n\tasset " + lowerCase + "\n}\n", "Caddyfile:3"},
		{"of the network's 6-decimal token", gate("\tnetwork eip155:8453", "\tprice $0.0000001"), "Caddyfile:17"},
		{"inherited by an accept block on the 6-decimal token", gate("\tprice $0.0000001", "\taccept {", "\t\tnetwork eip155:8453", "\t}"), "Caddyfile:16"},
		{"of an accept block's own", gate("\tprice $0.01", "\taccept {", "\t\tnetwork eip155:8453", "\t\tprice $0.00000001", "\t}"), "Caddyfile:19"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			adaptError(t, tc.caddyfile, tc.line, "decimal places but the token has only 6")
		})
	}
	// The first network's 18-decimal token takes it.
	if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(gate("\tprice $0.0000001")), map[string]any{"filename": "Caddyfile"}); err != nil {
		t.Fatalf("a price of 7 decimal places in an 18-decimal token: %v", err)
	}
}

// An API key from an environment variable that is not set is named by its placeholder (which holds no secret:
// the key is empty), at validate.
func TestAnAPIKeyFromAnUnsetVariableIsNamedByItsPlaceholder(t *testing.T) {
	for _, tc := range []struct{ name, site, want string }{
		{"a facilitator route's api_key", "handle_path /f/* {\n\t\tx402_facilitator {\n\t\t\tupstream http://127.0.0.1:9\n\t\t\tapi_key {env.X402_TEST_UNSET_KEY}\n\t\t}\n\t}",
			"api_key #1, {env.X402_TEST_UNSET_KEY}, is empty once its placeholders are replaced"},
		{"an upstream's api_key", "handle_path /f/* {\n\t\tx402_facilitator {\n\t\t\tupstream http://127.0.0.1:9 {\n\t\t\t\tapi_key {env.X402_TEST_UNSET_KEY}\n\t\t\t}\n\t\t}\n\t}",
			"the api_key of upstream #1, {env.X402_TEST_UNSET_KEY}, is empty"},
		{"a gate's facilitator_api_key", "x402 $0.01 {\n\t\tpay_to " + lowerCase + "\n\t\tnetwork eip155:723487\n\t\tasset " + lowerCase +
			"\n\t\tfacilitator http://127.0.0.1:9\n\t\tfacilitator_api_key {env.X402_TEST_UNSET_KEY}\n\t}\n\trespond paid", "{env.X402_TEST_UNSET_KEY}, is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adaptCaddyfile(t, "http://127.0.0.1:"+freePortOf(t)+" {\n\t"+tc.site+"\n}\n", t.TempDir())
			err := caddy.Validate(mustConfig(t, cfg))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("caddy.Validate = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}

// approval_sponsoring is taken on the dev chain's network only: elsewhere a payer could keep the gas money the
// engine sends (it sends max_gas times the approval's fee cap, whatever the approval costs) or have the settlement
// revert at the facilitator's cost. The refusal names the network and the option; the dev chain's network, named
// by a network block or by dev_chain, is taken.
func TestApprovalSponsoringIsTakenOnTheDevChainOnly(t *testing.T) {
	key := hex.EncodeToString(crypto.FromECDSA(devchain.WalletKeys(1)[0]))
	config := func(network string) string {
		return "{\n\tx402 {\n\t\tnetwork " + network + " {\n\t\t\trpc http://127.0.0.1:1\n\t\t\tasset " + lowerCase + "\n\t\t\twallet_keys " + key +
			"\n\t\t\tapproval_sponsoring\n\t\t}\n\t}\n}\n\nhttp://127.0.0.1:" + freePortOf(t) + " {\n\trespond ok\n}\n"
	}
	if err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, config("eip155:72344"), t.TempDir()))); err != nil {
		t.Fatalf("approval_sponsoring on the dev chain's network: caddy.Validate: %v", err)
	}
	err := caddy.Validate(mustConfig(t, adaptCaddyfile(t, config("eip155:8453"), t.TempDir())))
	if err == nil || !strings.Contains(err.Error(), "network #1 (eip155:8453): approval_sponsoring is taken on the dev chain only") {
		t.Fatalf("approval_sponsoring on eip155:8453: caddy.Validate = %v; want the network and the option named", err)
	}
	if leaksKey(err.Error(), key) {
		t.Fatalf("the error holds a part of the key: %v", err)
	}
}
