package caddymodule_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// adaptGoldenDir holds Caddyfile-to-JSON golden files in Caddy's own format (caddytest/integration/
// caddyfile_adapt): a Caddyfile, a line of ten dashes, then the JSON it adapts to, tab-indented; or, instead of
// JSON, a text the adapt error must contain. X402_UPDATE_ADAPT=1 rewrites the JSON halves from the adapter.
const adaptGoldenDir = "testdata/caddyfile_adapt"

func TestCaddyfilesAdaptToTheirGoldenJSON(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(adaptGoldenDir, "*.caddyfiletest"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files in %s (%v)", adaptGoldenDir, err)
	}
	update := os.Getenv("X402_UPDATE_ADAPT") == "1"
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			caddyfileText, expected, ok := strings.Cut(string(data), "----------")
			if !ok {
				t.Fatalf("%s has no ---------- line between the Caddyfile and the JSON", file)
			}
			caddyfileText = strings.TrimSpace(caddyfileText) + "\n"
			expected = strings.TrimSpace(expected)
			raw, warnings, adaptErr := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), map[string]any{"filename": "Caddyfile"})
			for _, w := range warnings {
				t.Errorf("warning: %s:%d: %s: %s", file, w.Line, w.Directive, w.Message)
			}
			if expected != "" && expected[0] != '{' {
				if adaptErr == nil || !strings.Contains(adaptErr.Error(), expected) {
					t.Fatalf("adapt error = %v, want one containing %q", adaptErr, expected)
				}
				return
			}
			if adaptErr != nil {
				t.Fatalf("adapting: %v", adaptErr)
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, raw, "", "\t"); err != nil {
				t.Fatal(err)
			}
			got := pretty.String()
			if update {
				if err := os.WriteFile(file, []byte(strings.TrimSpace(caddyfileText)+"\n----------\n"+got+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if got != expected {
				t.Fatalf("adapted JSON differs from the golden file\n--- got\n%s\n--- want\n%s", got, expected)
			}
		})
	}
}

func TestBadCaddyfilesAreRefusedNamingTheirLine(t *testing.T) {
	site := func(lines ...string) string {
		return ":8080\n\nhandle_path /facilitator/* {\n" + strings.Join(lines, "\n") + "\n}\n"
	}
	global := func(lines ...string) string {
		return "{\n\tx402 {\n" + strings.Join(lines, "\n") + "\n\t}\n}\n\n:8080\n\nrespond ok\n"
	}
	for _, tc := range []struct {
		name, caddyfile, line, text string
	}{
		{"an unknown facilitator option", site("x402_facilitator {", "kind permit2", "colour blue", "}"), "Caddyfile:6", "unrecognized x402_facilitator option 'colour'"},
		{"an unknown kind", site("x402_facilitator {", "kind upto", "}"), "Caddyfile:5", "unknown kind 'upto'; want permit2, eip3009 or erc2612"},
		{"kind without a value", site("x402_facilitator {", "kind", "}"), "Caddyfile:5", "kind needs one or more of permit2, eip3009 and erc2612"},
		{"a network that is not CAIP-2", site("x402_facilitator {", "networks base-sepolia", "}"), "Caddyfile:5", "malformed CAIP-2"},
		{"networks without a value", site("x402_facilitator {", "networks", "}"), "Caddyfile:5", "networks needs at least one"},
		{"api_key without a key", site("x402_facilitator {", "api_key", "}"), "Caddyfile:5", "api_key needs exactly one key"},
		{"api_key with two keys", site("x402_facilitator {", "api_key a b", "}"), "Caddyfile:5", "api_key needs exactly one key"},
		{"max_body_size above the codec's limit", site("x402_facilitator {", "max_body_size 1MB", "}"), "Caddyfile:5", "max_body_size '1MB' is not a size from 1 to 65536"},
		{"max_body_size that is no size", site("x402_facilitator {", "max_body_size lots", "}"), "Caddyfile:5", "max_body_size 'lots'"},
		{"an argument on the directive line", site("x402_facilitator /a /b"), "Caddyfile:4", "wrong argument count"},
		{"upstream without a URL", site("x402_facilitator {", "upstream", "}"), "Caddyfile:5", "upstream needs the base URL"},
		{"upstream with two URLs", site("x402_facilitator {", "upstream http://a http://b", "}"), "Caddyfile:5", "upstream takes one URL"},
		{"an unknown upstream option", site("x402_facilitator {", "upstream http://a {", "retries 3", "}", "}"), "Caddyfile:6", "unrecognized upstream option 'retries'"},
		{"an upstream timeout that is no duration", site("x402_facilitator {", "upstream http://a {", "timeout soon", "}", "}"), "Caddyfile:6", "timeout 'soon'"},
		{"min_amount of zero", site("x402_facilitator {", "min_amount 0", "}"), "Caddyfile:5", "min_amount '0' is not a whole number of raw token units from 1"},
		{"min_amount as a price", site("x402_facilitator {", "min_amount $0.01", "}"), "Caddyfile:5", "min_amount '$0.01' is not a whole number of raw token units"},
		{"min_amount without a value", site("x402_facilitator {", "min_amount", "}"), "Caddyfile:5", "min_amount needs exactly one amount"},
		{"min_amount with two values", site("x402_facilitator {", "min_amount 1 2", "}"), "Caddyfile:5", "min_amount needs exactly one amount"},
		{"pay_to without an address", site("x402_facilitator {", "pay_to", "}"), "Caddyfile:5", "pay_to needs at least one recipient address"},
		{"pay_to that is no address", site("x402_facilitator {", "pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e1", "}"), "Caddyfile:5", "pay_to: expected an address"},
		{"pay_to of the zero address", site("x402_facilitator {", "pay_to 0x0000000000000000000000000000000000000000", "}"), "Caddyfile:5", "pay_to 0x0000000000000000000000000000000000000000 is the zero address"},
		{"settle_rate_limit without limits", site("x402_facilitator {", "settle_rate_limit {", "}", "}"), "Caddyfile:5", "settle_rate_limit needs per_ip, per_payer or both"},
		{"settle_rate_limit with an argument", site("x402_facilitator {", "settle_rate_limit 10/min", "}"), "Caddyfile:5", "settle_rate_limit takes no arguments"},
		{"settle_rate_limit twice", site("x402_facilitator {", "settle_rate_limit {", "per_ip 1/min", "}", "settle_rate_limit {", "per_payer 1/min", "}", "}"), "Caddyfile:8", "settle_rate_limit is given twice"},
		{"a rate without its unit", site("x402_facilitator {", "settle_rate_limit {", "per_ip 10", "}", "}"), "Caddyfile:6", "per_ip '10': want a rate of calls per minute such as 10/min"},
		{"a rate per second", site("x402_facilitator {", "settle_rate_limit {", "per_payer 5/s", "}", "}"), "Caddyfile:6", "per_payer '5/s': want a rate of calls per minute"},
		{"a rate of zero", site("x402_facilitator {", "settle_rate_limit {", "per_ip 0/min", "}", "}"), "Caddyfile:6", "per_ip '0/min'"},
		{"a rate above the maximum", site("x402_facilitator {", "settle_rate_limit {", "per_ip 60001/min", "}", "}"), "Caddyfile:6", "from 1/min to 60000/min"},
		{"a rate without a value", site("x402_facilitator {", "settle_rate_limit {", "per_payer", "}", "}"), "Caddyfile:6", "per_payer needs one rate such as 10/min"},
		{"an unknown settle_rate_limit option", site("x402_facilitator {", "settle_rate_limit {", "per_key 1/min", "}", "}"), "Caddyfile:6", "unrecognized settle_rate_limit option 'per_key'"},
		{"an IPv6 prefix too long", site("x402_facilitator {", "settle_rate_limit {", "per_ip 1/min ipv6_prefix 129", "}", "}"), "Caddyfile:6", "ipv6_prefix '129' is not a prefix length from 1 to 128"},
		{"an IPv6 prefix without its length", site("x402_facilitator {", "settle_rate_limit {", "per_ip 1/min ipv6_prefix", "}", "}"), "Caddyfile:6", "per_ip needs one rate such as 10/min, and may name the IPv6 prefix"},
		{"an IPv6 prefix on per_payer", site("x402_facilitator {", "settle_rate_limit {", "per_payer 1/min ipv6_prefix 56", "}", "}"), "Caddyfile:6", "per_payer needs one rate such as 10/min"},
		{"verify_rate_limit without a limit", site("x402_facilitator {", "verify_rate_limit {", "}", "}"), "Caddyfile:5", "verify_rate_limit needs per_ip (or write verify_rate_limit off)"},
		{"verify_rate_limit with a rate as argument", site("x402_facilitator {", "verify_rate_limit 10/min", "}"), "Caddyfile:5", "verify_rate_limit takes no arguments but off"},
		{"verify_rate_limit off with a block", site("x402_facilitator {", "verify_rate_limit off {", "per_ip 1/min", "}", "}"), "Caddyfile:6", "verify_rate_limit off takes no block"},
		{"verify_rate_limit per_payer", site("x402_facilitator {", "verify_rate_limit {", "per_payer 1/min", "}", "}"), "Caddyfile:6", "unrecognized verify_rate_limit option 'per_payer'; want per_ip"},
		{"verify_rate_limit twice", site("x402_facilitator {", "verify_rate_limit off", "verify_rate_limit off", "}"), "Caddyfile:6", "verify_rate_limit is given twice"},

		{"an unknown x402 option", global("\t\tcolour blue"), "Caddyfile:3", "unrecognized x402 option 'colour'"},
		{"the x402 option with an argument", "{\n\tx402 extra\n}\n\n:8080\n\nrespond ok\n", "Caddyfile:2", "wrong argument count"},
		{"network without its id", global("\t\tnetwork {", "\t\t}"), "Caddyfile:3", "network needs its CAIP-2 identifier"},
		{"an unknown network option", global("\t\tnetwork eip155:72344 {", "\t\t\tgas_price 1", "\t\t}"), "Caddyfile:4", "unrecognized network option 'gas_price'"},
		{"rpc without a URL", global("\t\tnetwork eip155:72344 {", "\t\t\trpc", "\t\t}"), "Caddyfile:4", "rpc needs at least one URL"},
		{"asset without an address", global("\t\tnetwork eip155:72344 {", "\t\t\tasset", "\t\t}"), "Caddyfile:4", "asset needs the token's contract address"},
		{"an asset property without a value", global("\t\tnetwork eip155:72344 {", "\t\t\tasset 0x1111111111111111111111111111111111111111 name", "\t\t}"), "Caddyfile:4", "asset name needs a value"},
		{"an unknown asset property", global("\t\tnetwork eip155:72344 {", "\t\t\tasset 0x1111111111111111111111111111111111111111 symbol USD", "\t\t}"), "Caddyfile:4", "unrecognized asset property 'symbol'"},
		{"asset decimals that are no number", global("\t\tnetwork eip155:72344 {", "\t\t\tasset 0x1111111111111111111111111111111111111111 decimals six", "\t\t}"), "Caddyfile:4", "asset decimals \"six\""},
		{"wallet_keys without a key", global("\t\tnetwork eip155:72344 {", "\t\t\twallet_keys", "\t\t}"), "Caddyfile:4", "wallet_keys needs at least one key"},
		{"wallet_key_file without a path", global("\t\tnetwork eip155:72344 {", "\t\t\twallet_key_file", "\t\t}"), "Caddyfile:4", "wrong argument count"},
		{"an rpc_timeout that is no duration", global("\t\tnetwork eip155:72344 {", "\t\t\trpc_timeout soon", "\t\t}"), "Caddyfile:4", "rpc_timeout 'soon'"},
		{"a deadline_skew that is no duration", global("\t\tnetwork eip155:72344 {", "\t\t\tdeadline_skew lots", "\t\t}"), "Caddyfile:4", "deadline_skew 'lots'"},
		{"a deadline_skew of zero", global("\t\tnetwork eip155:72344 {", "\t\t\tdeadline_skew 0s", "\t\t}"), "Caddyfile:4", "deadline_skew: want a positive duration"},
		{"an rpc_timeout of zero", global("\t\tnetwork eip155:72344 {", "\t\t\trpc_timeout 0s", "\t\t}"), "Caddyfile:4", "rpc_timeout: want a positive duration"},
		{"a receipt_timeout that is no duration", global("\t\tnetwork eip155:72344 {", "\t\t\treceipt_timeout later", "\t\t}"), "Caddyfile:4", "receipt_timeout"},
		{"a receipt_poll without a value", global("\t\tnetwork eip155:72344 {", "\t\t\treceipt_poll", "\t\t}"), "Caddyfile:4", "wrong argument count"},
		{"a wallet_wait that is no duration", global("\t\tnetwork eip155:72344 {", "\t\t\twallet_wait forever", "\t\t}"), "Caddyfile:4", "wallet_wait"},
		{"a funds_cache that is neither a duration nor off", global("\t\tnetwork eip155:72344 {", "\t\t\tfunds_cache sometimes", "\t\t}"), "Caddyfile:4", "funds_cache: want a positive duration or off"},
		{"a funds_cache of zero", global("\t\tnetwork eip155:72344 {", "\t\t\tfunds_cache 0s", "\t\t}"), "Caddyfile:4", "funds_cache: want a positive duration or off"},
		{"an unknown method", global("\t\tnetwork eip155:72344 {", "\t\t\tmethods upto", "\t\t}"), "Caddyfile:4", "unknown method 'upto'; want permit2, eip3009 or erc2612"},
		{"smart_wallet_factories without an address", global("\t\tnetwork eip155:72344 {", "\t\t\tsmart_wallet_factories", "\t\t}"), "Caddyfile:4", "needs one or more ERC-6492 factory addresses"},
		{"a smart wallet factory that is no address", global("\t\tnetwork eip155:72344 {", "\t\t\tsmart_wallet_factories 0x12", "\t\t}"), "Caddyfile:4", "is not an address"},
		{"approval_sponsoring with an unpaired option", global("\t\tnetwork eip155:72344 {", "\t\t\tapproval_sponsoring max_gas", "\t\t}"), "Caddyfile:4", "approval_sponsoring takes pairs"},
		{"approval_sponsoring with a max_gas below a transfer's", global("\t\tnetwork eip155:72344 {", "\t\t\tapproval_sponsoring max_gas 100", "\t\t}"), "Caddyfile:4", `approval_sponsoring max_gas "100" is not a gas limit`},
		{"approval_sponsoring with a fee cap that is no number", global("\t\tnetwork eip155:72344 {", "\t\t\tapproval_sponsoring max_fee_per_gas 2gwei", "\t\t}"), "Caddyfile:4", `max_fee_per_gas "2gwei" is not a positive number of wei`},
		{"approval_sponsoring with an unknown option", global("\t\tnetwork eip155:72344 {", "\t\t\tapproval_sponsoring max_value 1", "\t\t}"), "Caddyfile:4", "unrecognized option 'max_value'"},
		{"methods without a value", global("\t\tnetwork eip155:72344 {", "\t\t\tmethods", "\t\t}"), "Caddyfile:4", "methods needs one or more of permit2, eip3009 and erc2612"},
		{"legacy_fees with an argument", global("\t\tnetwork eip155:72344 {", "\t\t\tlegacy_fees yes", "\t\t}"), "Caddyfile:4", "wrong argument count"},
		{"max_in_flight_per_wallet of zero", global("\t\tnetwork eip155:72344 {", "\t\t\tmax_in_flight_per_wallet 0", "\t\t}"), "Caddyfile:4", "max_in_flight_per_wallet \"0\" is not a positive number"},
		{"a network min_amount that is negative", global("\t\tnetwork eip155:72344 {", "\t\t\tmin_amount -1", "\t\t}"), "Caddyfile:4", "min_amount '-1' is not a whole number of raw token units"},
		{"a network min_amount without a value", global("\t\tnetwork eip155:72344 {", "\t\t\tmin_amount", "\t\t}"), "Caddyfile:4", "min_amount needs exactly one amount"},
		{"a network pay_to that is no address", global("\t\tnetwork eip155:72344 {", "\t\t\tpay_to 0x5e11 0x1111111111111111111111111111111111111111", "\t\t}"), "Caddyfile:4", "pay_to: expected an address (0x and 40 hex digits), got \"0x5e11\""},
		{"a network pay_to without an address", global("\t\tnetwork eip155:72344 {", "\t\t\tpay_to", "\t\t}"), "Caddyfile:4", "pay_to needs at least one recipient address"},
		{"journal without a path", global("\t\tjournal"), "Caddyfile:3", "wrong argument count"},
		{"dev_chain with an argument", global("\t\tdev_chain yes"), "Caddyfile:3", "wrong argument count"},
		{"an unknown dev_chain option", global("\t\tdev_chain {", "\t\t\tmining on", "\t\t}"), "Caddyfile:4", "unrecognized dev_chain option 'mining'"},
		{"a dev_chain chain_id of zero", global("\t\tdev_chain {", "\t\t\tchain_id 0", "\t\t}"), "Caddyfile:4", "chain_id \"0\" is not a positive number"},
		{"a dev_chain block_time that is no duration", global("\t\tdev_chain {", "\t\t\tblock_time often", "\t\t}"), "Caddyfile:4", "block_time"},
		{"a dev_chain listen without an address", global("\t\tdev_chain {", "\t\t\tlisten", "\t\t}"), "Caddyfile:4", "wrong argument count"},
		{"a dev_chain rpc without a URL", global("\t\tdev_chain {", "\t\t\trpc", "\t\t}"), "Caddyfile:4", "wrong argument count"},
		{"dev_chain wallets without a number", global("\t\tdev_chain {", "\t\t\twallets", "\t\t}"), "Caddyfile:4", "wallets needs one or more wallet numbers"},
		{"dev_chain wallets that are no number", global("\t\tdev_chain {", "\t\t\twallets first", "\t\t}"), "Caddyfile:4", `wallets: "first" is not a wallet number`},
		{"a dev_chain wallets range backwards", global("\t\tdev_chain {", "\t\t\twallets 7-4", "\t\t}"), "Caddyfile:4", `wallets: "7-4" is not a wallet number or a range`},
		{"journal with two paths", global("\t\tjournal a b"), "Caddyfile:3", "wrong argument count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(tc.caddyfile), map[string]any{"filename": "Caddyfile"})
			if err == nil {
				t.Fatalf("adapting succeeded, want an error at %s:\n%s", tc.line, tc.caddyfile)
			}
			if !regexp.MustCompile(regexp.QuoteMeta(tc.line) + `\b`).MatchString(err.Error()) {
				t.Errorf("error %q does not name %s", err, tc.line)
			}
			if !strings.Contains(err.Error(), tc.text) {
				t.Errorf("error %q does not say %q", err, tc.text)
			}
		})
	}
}
