package caddymodule_test

import (
	"fmt"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Prices set per request (a map from path to price) and price_grace, with a real Caddy, real HTTP and a
// simulated chain settled by the embedded engine.

// The prices of the map, in raw units of the 6-decimal token.
const (
	cheapAmount   = 1_000  // $0.001
	dearAmount    = 50_000 // $0.05
	defaultAmount = 10_000 // $0.01
)

// newPricesEnv starts a Caddy whose gate takes price from a map of the path, with price_grace grace ("" for
// none), in front of an upstream that counts its calls.
func newPricesEnv(t *testing.T, price, grace string) (*gateEnv, *testUpstream) {
	t.Helper()
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	up := newTestUpstream(t)
	env.srv = startCaddy(t, env.pricesCaddyfile(price, grace, up))
	return env, up
}

// pricesCaddyfile is the configuration of newPricesEnv: Caddy's log goes to caddy.log in the data folder.
func (env *gateEnv) pricesCaddyfile(price, grace string, up *testUpstream) string {
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	var graceLine string
	if grace != "" {
		graceLine = "\t\tprice_grace " + grace + "\n"
	}
	return fmt.Sprintf(`{
	log {
		output file {{DATA}}/caddy.log
		format json
		level INFO
	}
	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	map {path} {price} {
		~^/cheap/ "0.001 USD"
		~^/dear/ $$0.05
		/broken $abc
		default $0.01
	}
	x402 {
		price %s
		pay_to %s
%s	}
	reverse_proxy %s
}
`, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), price, env.payTo.Hex(), graceLine, up.Addr)
}

// assertMoved checks that exactly amount went from payer to the seller since before, in transfers transfers.
func (env *gateEnv) assertMoved(payer *chaintest.Account, before balances, amount int64, transfers int) {
	env.t.Helper()
	after := env.balances(payer)
	want := big.NewInt(amount)
	if got := new(big.Int).Sub(before.payer, after.payer); got.Cmp(want) != 0 {
		env.t.Errorf("payer balance fell by %s, want %s", got, want)
	}
	if got := new(big.Int).Sub(after.seller, before.seller); got.Cmp(want) != 0 {
		env.t.Errorf("seller balance rose by %s, want %s", got, want)
	}
	if got := after.transfers - before.transfers; got != transfers {
		env.t.Errorf("%d token transfers from payer to seller, want %d", got, transfers)
	}
}

// logged reports whether a line of Caddy's log holds every one of parts, waiting up to 5 s for it to be
// written (the file is written in the background).
func (env *gateEnv) logged(parts ...string) bool {
	env.t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(env.srv.dir, "caddy.log"))
		for _, line := range strings.Split(string(b), "\n") {
			found := true
			for _, p := range parts {
				found = found && strings.Contains(line, p)
			}
			if found {
				return true
			}
		}
		if time.Now().After(deadline) {
			env.t.Logf("Caddy's log:\n%s", b)
			return false
		}
	}
}

// refusedForValue checks that a is a 402 refusing a payment for its amount.
func refusedForValue(t *testing.T, a gateAnswer, what string) {
	t.Helper()
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("%s = %d %q, want 402", what, a.status, a.body)
	}
	if msg := requiredError(t, a); !strings.HasPrefix(msg, x402.ReasonValueMismatch) {
		t.Fatalf("%s: the 402 says %q, want %s", what, msg, x402.ReasonValueMismatch)
	}
}

func TestAMapFromPathToPriceOffersEachPathItsPriceAndAPaymentBuysOnlyThePathItWasSignedFor(t *testing.T) {
	env, up := newPricesEnv(t, "{price}", "")
	for path, want := range map[string]int64{"/cheap/report": cheapAmount, "/dear/report": dearAmount, "/other": defaultAmount} {
		pr := env.offer(path)
		if len(pr.Accepts) == 0 {
			t.Fatalf("%s offers nothing", path)
		}
		for _, rq := range pr.Accepts {
			if rq.Amount != fmt.Sprint(want) {
				t.Errorf("%s offers %s raw units by %s, want %d", path, rq.Amount, rq.Extra.AssetTransferMethod, want)
			}
		}
	}
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	cheap := gateEncode(t, env.signPermit2(payer, env.requirement("/cheap/report", x402.TransferPermit2)))
	before := env.balances(payer)

	refusedForValue(t, env.get("/dear/report", x402.HeaderPaymentSignature, cheap), "the cheap path's payment on the dear path")
	env.assertMoved(payer, before, 0, 0)
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times for a refused payment", n)
	}

	a := env.get("/cheap/report", x402.HeaderPaymentSignature, cheap)
	if a.status != http.StatusOK || a.body != "upstream says 200" {
		t.Fatalf("the cheap path's payment on the cheap path = %d %q, want 200 from the upstream", a.status, a.body)
	}
	if resp := settleResponse(t, a); !resp.Success || resp.Amount != fmt.Sprint(cheapAmount) {
		t.Errorf("PAYMENT-RESPONSE %+v, want a settlement of %d", resp, cheapAmount)
	}
	env.assertMoved(payer, before, cheapAmount, 1)
}

func TestAMapPriceThatResolvesToGarbageIs500LoggedAndNeverServed(t *testing.T) {
	env, up := newPricesEnv(t, "{price}", "")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	// A payment as good as any: signed for the default price, and said to be for it.
	payment := gateEncode(t, env.signPermit2(payer, env.requirement("/other", x402.TransferPermit2)))
	before := env.balances(payer)
	for _, headers := range [][]string{nil, {x402.HeaderPaymentSignature, payment}} {
		a := env.get("/broken", headers...)
		if a.status != http.StatusInternalServerError {
			t.Fatalf("a request whose price resolves to $abc (payment header: %t) = %d %q, want 500", headers != nil, a.status, a.body)
		}
		if a.header.Get(x402.HeaderPaymentRequired) != "" || a.header.Get(x402.HeaderPaymentResponse) != "" {
			t.Errorf("the 500 carries payment headers: %v", a.header)
		}
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times", n)
	}
	env.assertMoved(payer, before, 0, 0)
	if !env.logged(`"logger":"http.handlers.x402"`, `"option":"price"`, `"template":"{price}"`, `"value":"$abc"`) {
		t.Errorf("no log line of the gate names the option, the template and the value")
	}
}

// graceReload signs two payments for /report at $0.001, then reloads Caddy with $0.002 (both with price_grace
// grace), and returns the payments and when the old price was last offered.
func graceReload(t *testing.T, grace string) (env *gateEnv, up *testUpstream, first, second string, lastOffered time.Time) {
	env, up = newPricesEnv(t, "$0.001", grace)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := env.requirement("/report", x402.TransferPermit2)
	lastOffered = time.Now()
	if rq.Amount != fmt.Sprint(cheapAmount) {
		t.Fatalf("offered %s, want %d", rq.Amount, cheapAmount)
	}
	first, second = gateEncode(t, env.signPermit2(payer, rq)), gateEncode(t, env.signPermit2(payer, rq))
	env.srv.load(env.pricesCaddyfile("$0.002", grace, up))
	if rq := env.requirement("/report", x402.TransferPermit2); rq.Amount != "2000" {
		t.Fatalf("offered %s after the reload, want 2000", rq.Amount)
	}
	return env, up, first, second, lastOffered
}

func TestWithinPriceGraceAPaymentSignedBeforeAReloadChangedThePriceIsTakenAndPastItRefused(t *testing.T) {
	const grace = 2 * time.Second
	env, up, first, second, lastOffered := graceReload(t, grace.String())
	payer := env.c.Payers[0]
	before := env.balances(payer)

	a := env.get("/report", x402.HeaderPaymentSignature, first)
	if a.status != http.StatusOK {
		t.Fatalf("the payment at the old price within the grace = %d %q, want 200", a.status, a.body)
	}
	env.assertMoved(payer, before, cheapAmount, 1)
	if !env.logged(`"level":"info"`, "accepted within price_grace", `"amount":"1000"`) {
		t.Errorf("no info line says a payment was accepted within price_grace")
	}

	time.Sleep(time.Until(lastOffered.Add(grace + 100*time.Millisecond)))
	before = env.balances(payer)
	refusedForValue(t, env.get("/report", x402.HeaderPaymentSignature, second), "the payment at the old price past the grace")
	env.assertMoved(payer, before, 0, 0)
	if n := up.calls.Load(); n != 1 {
		t.Errorf("the upstream was called %d times, want once (for the payment within the grace)", n)
	}
}

func TestWithoutPriceGraceAPaymentSignedBeforeAReloadChangedThePriceIsRefused(t *testing.T) {
	env, up, first, _, _ := graceReload(t, "")
	payer := env.c.Payers[0]
	before := env.balances(payer)
	refusedForValue(t, env.get("/report", x402.HeaderPaymentSignature, first), "the payment at the old price after the reload")
	env.assertMoved(payer, before, 0, 0)
	if n := up.calls.Load(); n != 0 {
		t.Errorf("the upstream was called %d times", n)
	}
}

func TestOptionsWithoutRequestPlaceholdersAreStillCheckedWhenTheConfigLoads(t *testing.T) {
	const good = "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11"
	t.Setenv("X402_TEST_PRICE", "$0.02")
	for _, tc := range []struct {
		name, gate, want string
	}{
		{"a price set per request and a good recipient", "price {price}\n\t\tpay_to " + good, ""},
		{"a recipient set per request and a good price", "price $0.01\n\t\tpay_to {http.request.header.X-Seller}", ""},
		{"a description set per request", "price $0.01\n\t\tpay_to " + good + "\n\t\tdescription \"Report {path}\"", ""},
		{"a price set per request beside a recipient that is no address", "price {price}\n\t\tpay_to 0x5e11", `pay_to "0x5e11" is not an address`},
		{"a recipient set per request beside a price with a typo", "price $0.0x1\n\t\tpay_to {vars.seller}", "price"},
		{"a recipient set per request beside a zero amount", "amount 0\n\t\tpay_to {vars.seller}", "the price is zero"},
		{"an accept block's price set per request beside a bad network", "price $0.01\n\t\tpay_to " + good + "\n\t\taccept {\n\t\t\tnetwork base\n\t\t\tprice {price}\n\t\t}", "network"},
		{"a price from an environment variable", "price {env.X402_TEST_PRICE}\n\t\tpay_to " + good, ""},
		{"a price from an unset environment variable", "price {env.X402_TEST_UNSET_PRICE}\n\t\tpay_to " + good, "no price"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			caddyfile := "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\trpc http://127.0.0.1:1\n" +
				"\t\t\tasset 0x69c1c4280cd64e46F1525c67AA9e5F784d09cB4C name \"Stable Coin\" version 1 decimals 6\n" +
				"\t\t\twallet_keys 4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318\n\t\t}\n\t}\n}\n\n" +
				"http://127.0.0.1:" + freePortOf(t) + " {\n\tx402 {\n\t\t" + tc.gate + "\n\t}\n\trespond paid\n}\n"
			// A value without placeholders is refused as the Caddyfile is read, naming its line; the rest when
			// the config is provisioned.
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
			if err != nil && !strings.Contains(err.Error(), "Caddyfile:") {
				t.Errorf("the Caddyfile's error %q names no line", err)
			}
			if err == nil {
				err = caddy.Validate(mustConfig(t, adaptCaddyfile(t, caddyfile, t.TempDir())))
			}
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("caddy.Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("caddy.Validate = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}
