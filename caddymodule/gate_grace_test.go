package caddymodule_test

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// price_grace's memory of the offers 402s made: what it is keyed by, and how much of it there may be.

func TestThePriceGraceMemoryOfManyLongDistinctURLsStaysWithinItsByteCap(t *testing.T) {
	racepass.Once(t, "10,000 requests one after another, each with a 16 KiB URL: its time is their CPU, eight times as much under -race (81 s), "+
		"and the price grace memory they fill runs under -race in the package's other price_grace tests")
	env, _ := newPricesEnv(t, "$0.01", "1m")
	const n, long = 10_000, 16 << 10
	path := "/" + strings.Repeat("u", long)
	client := &http.Client{}
	t.Cleanup(client.CloseIdleConnections)
	if a := env.get("/warm-up"); a.status != http.StatusPaymentRequired {
		t.Fatalf("an unpaid request = %d, want 402", a.status)
	}
	base := liveHeap()
	for i := range n {
		resp, err := client.Get(env.srv.URL + path + strconv.Itoa(i))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusPaymentRequired {
			t.Fatalf("unpaid request %d for a %d KiB URL = %d, want 402", i, long>>10, resp.StatusCode)
		}
	}
	grew := int64(liveHeap()) - int64(base)
	t.Logf("%d unpaid 402s of distinct %d KiB URLs: the live heap grew by %.1f MiB, the offer memory accounts %.1f MiB",
		n, long>>10, float64(grew)/(1<<20), float64(caddymodule.OfferMemoryBytes())/(1<<20))
	// Kept whole, the URLs alone would be 156 MiB; the memory is full well before the last.
	if grew > 2*gate.DefaultOfferMemoryBytes {
		t.Errorf("the live heap grew by %.1f MiB, want the offer memory within its cap of %d MiB", float64(grew)/(1<<20), gate.DefaultOfferMemoryBytes>>20)
	}
	if b := caddymodule.OfferMemoryBytes(); b < gate.DefaultOfferMemoryBytes*9/10 || b > gate.DefaultOfferMemoryBytes {
		t.Errorf("the offer memory accounts %d bytes, want it full to its cap %d and no more", b, gate.DefaultOfferMemoryBytes)
	}
}

// tierCaddyfile is a Caddy whose price is mapped from the X-Tier header (gold members pay $0.001, everyone else
// $0.01), with price_grace grace, in front of up.
func (env *gateEnv) tierCaddyfile(grace string, up *testUpstream) string {
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	return fmt.Sprintf(`{
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
	map {http.request.header.X-Tier} {price} {
		gold 0.001
		default $0.01
	}
	x402 {
		price {price}
		pay_to %s
		price_grace %s
	}
	reverse_proxy %s
}
`, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), env.payTo.Hex(), grace, up.Addr)
}

// A price that depends on a header, a user or the client's address cannot have price_grace: its memory is keyed
// by method and URL, so the gold member's cheap offer would be payable by anyone asking for the same URL. The
// configuration is refused where the Caddyfile says price_grace.
func TestPriceGraceOverAPriceMappedFromAHeaderIsRefusedForItWouldSellOneClientsCheapOfferToAll(t *testing.T) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	up := newTestUpstream(t)
	caddyfile := env.tierCaddyfile("1m", up)
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(strings.ReplaceAll(caddyfile, "{{ADDR}}", "http://127.0.0.1:"+freePortOf(t))),
		map[string]any{"filename": "Caddyfile"})
	if err != nil {
		for _, want := range []string{"price_grace", "{price}", "method and URL", "Caddyfile:21"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("the refusal %q does not say %q", err, want)
			}
		}
		return
	}
	t.Errorf("a Caddyfile with price_grace over a price mapped from a header was adapted; want it refused at its price_grace line")

	// Loaded, as on main: what the grace then does.
	env.srv = startCaddy(t, caddyfile)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	var gold x402.PaymentRequirements
	for _, rq := range env.offer2("/report", "X-Tier", "gold").Accepts {
		if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
			gold = rq
		}
	}
	if gold.Amount != fmt.Sprint(cheapAmount) {
		t.Fatalf("the gold member is offered %q, want %d", gold.Amount, cheapAmount)
	}
	before := env.balances(payer)
	a := env.get("/report", x402.HeaderPaymentSignature, gateEncode(t, env.signPermit2(payer, gold)))
	if a.status == http.StatusOK {
		t.Errorf("a client without the gold header paid the gold price (%d raw units, the offer %d) and was served: %d %q",
			cheapAmount, defaultAmount, a.status, a.body)
	}
	env.assertMoved(payer, before, 0, 0)
}

// offer2 is offer with request headers (name, value pairs).
func (env *gateEnv) offer2(path string, headers ...string) x402.PaymentRequired {
	env.t.Helper()
	a := env.get(path, headers...)
	if a.status != http.StatusPaymentRequired {
		env.t.Fatalf("unpaid GET %s = %d %q, want 402", path, a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		env.t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
	}
	return pr
}

func TestPriceGraceIsTakenOnlyWhereTheTermsDependOnTheMethodAndURLAlone(t *testing.T) {
	const good = "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11"
	t.Setenv("X402_TEST_PRICE", "$0.02")
	for _, tc := range []struct {
		name, site, gate, want string
	}{
		{"a fixed price", "", "price $0.01\n\t\tpay_to " + good, ""},
		{"a price from an environment variable", "", "price {env.X402_TEST_PRICE}\n\t\tpay_to " + good, ""},
		{"an amount from the path", "", "amount {http.request.uri.path.1}\n\t\tpay_to " + good, ""},
		{"an amount from the query, the host and the method", "", "amount {http.request.uri.query.n}{http.request.host}{http.request.method}\n\t\tpay_to " + good, ""},
		{"a price mapped from the path", "map {path} {price} {\n\t\tdefault $0.01\n\t}\n\t", "price {price}\n\t\tpay_to " + good, "price {price}"},
		{"a price from a header", "", "price {http.request.header.X-Price}\n\t\tpay_to " + good, "{http.request.header.X-Price}"},
		{"a recipient from the client's address", "", "price $0.01\n\t\tpay_to {http.request.remote.host}", "pay_to {http.request.remote.host}"},
		{"an accept block's amount from vars", "", "price $0.01\n\t\tpay_to " + good + "\n\t\taccept {\n\t\t\tamount {vars.amount}\n\t\t}", "accept block 1's amount {http.vars.amount}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			site := func(grace string) string {
				return "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\trpc http://127.0.0.1:1\n" +
					"\t\t\tasset 0x69c1c4280cd64e46F1525c67AA9e5F784d09cB4C name \"Stable Coin\" version 1 decimals 6\n" +
					"\t\t\twallet_keys 4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318\n\t\t}\n\t}\n}\n\n" +
					"http://127.0.0.1:" + freePortOf(t) + " {\n\t" + tc.site + "x402 {\n\t\t" + tc.gate + grace + "\n\t}\n\trespond paid\n}\n"
			}
			// Written in a Caddyfile: refused where it says price_grace.
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(site("\n\t\tprice_grace 1m")), map[string]any{"filename": "Caddyfile"})
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("adapting: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "price_grace") ||
				!strings.Contains(err.Error(), "Caddyfile:")):
				t.Fatalf("adapting = %v, want an error naming %q, price_grace and its Caddyfile line", err, tc.want)
			}
			// Given as JSON: refused when the config loads.
			cfg := string(adaptCaddyfile(t, site(""), t.TempDir()))
			if !strings.Contains(cfg, `"handler":"x402"`) {
				t.Fatalf("no x402 handler in %s", cfg)
			}
			cfg = strings.Replace(cfg, `"handler":"x402"`, `"handler":"x402","price_grace":60000000000`, 1)
			err = caddy.Validate(mustConfig(t, []byte(cfg)))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("caddy.Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "price_grace")):
				t.Fatalf("caddy.Validate = %v, want an error naming %q and price_grace", err, tc.want)
			}
		})
	}
}
