package payer

import (
	"errors"
	"math/big"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestChoosePrefersPermit2AndSaysWhyNothingElseCanBePaid(t *testing.T) {
	req := func(scheme, network, method, spender string) x402.PaymentRequirements {
		return x402.PaymentRequirements{Scheme: scheme, Network: network, Extra: x402.Extra{AssetTransferMethod: method, Spender: spender}}
	}
	spender := "0x1111111111111111111111111111111111111111"
	erc := req("exact", "eip155:72344", "erc2612", spender)
	p2 := req("exact", "eip155:72344", "permit2", "")
	onChain := &chainReader{chainID: big.NewInt(72344), name: "http://127.0.0.1:1"}
	for _, tc := range []struct {
		name    string
		version int
		accepts []x402.PaymentRequirements
		method  string
		rpc     *chainReader
		want    int
		errs    []string
	}{
		{name: "permit2 wins over an erc2612 listed first", version: 2, accepts: []x402.PaymentRequirements{erc, p2}, rpc: onChain, want: 1},
		{name: "the method erc2612 takes erc2612", version: 2, accepts: []x402.PaymentRequirements{p2, erc}, method: "erc2612", rpc: onChain, want: 1},
		{name: "without an RPC erc2612 is skipped", version: 2, accepts: []x402.PaymentRequirements{erc, p2}, want: 1},
		{name: "version 1 cannot pay permit2", version: 1, accepts: []x402.PaymentRequirements{p2, erc}, rpc: onChain, want: 1},
		{name: "other schemes and networks are skipped", version: 2, accepts: []x402.PaymentRequirements{req("upto", "eip155:72344", "permit2", ""), req("exact", "solana:abc", "permit2", ""), p2}, want: 2},
		{
			name: "nothing payable", version: 2, rpc: onChain,
			accepts: []x402.PaymentRequirements{req("exact", "eip155:1", "permit2", ""), req("exact", "eip155:72344", "upto", ""), req("exact", "eip155:72344", "erc2612", "")},
			errs:    []string{"none of the 3", "accepts[0]", "the RPC http://127.0.0.1:1 serves chain 72344", "accepts[1]", `"upto"`, "accepts[2]", "extra.spender"},
		},
		{name: "erc2612 without an RPC", version: 2, accepts: []x402.PaymentRequirements{erc}, errs: []string{"no RPC URL"}},
		{name: "an empty offer", version: 2, errs: []string{"accepts is empty"}},
		// The public SDKs' standard requirement names no method and is paid by EIP-3009.
		{name: "a requirement naming no method is paid by eip3009", version: 2, accepts: []x402.PaymentRequirements{req("exact", "eip155:72344", "", "")}, method: "eip3009", want: 0},
		{name: "permit2 wins over eip3009", version: 2, accepts: []x402.PaymentRequirements{req("exact", "eip155:72344", "eip3009", ""), p2}, want: 1},
		{name: "a method other than the payer's is skipped", version: 2, accepts: []x402.PaymentRequirements{p2}, method: "eip3009", errs: []string{"not the method eip3009"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			offer := Offer{Version: tc.version, Required: x402.PaymentRequired{X402Version: tc.version, Accepts: tc.accepts}}
			got, err := (&Payer{opts: Options{Method: tc.method}}).choose(offer, tc.rpc, nil)
			if tc.errs != nil {
				if err == nil {
					t.Fatalf("chose accepts[%d], want an error", got)
				}
				for _, w := range tc.errs {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not say %q", err, w)
					}
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("chose accepts[%d], %v; want accepts[%d]", got, err, tc.want)
			}
		})
	}
}

const (
	tokenA = "0xaAaAaAaaAaAaAaaAaAAAAAAAAaaaAaAaAaaAaaAa"
	tokenB = "0xbBbBBBBbbBBBbbbBbbBbbbbBBbBbbbbBbBbbBBbB"
)

// offerOf is a version 2 offer of one permit2 requirement per amount, in tokenA on eip155:72344.
func offerOf(amounts ...string) Offer {
	o := Offer{Version: x402.Version2, Required: x402.PaymentRequired{X402Version: x402.Version2}}
	for _, a := range amounts {
		o.Required.Accepts = append(o.Required.Accepts, x402.PaymentRequirements{
			Scheme: x402.SchemeExact, Network: "eip155:72344", Amount: a, Asset: tokenA,
			PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 60,
			Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2},
		})
	}
	return o
}

func TestTheLimitRefusesWhatIsOverItAndNamesTheAmountAndTheLimit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		limits []Limit
		spent  int64 // already paid in tokenA
		offer  Offer
		want   int      // the requirement chosen, when errs is nil
		errs   []string // in the LimitError
	}{
		{name: "within the limit per request", limits: []Limit{{PerRequest: big.NewInt(10_000)}}, offer: offerOf("10000"), want: 0},
		{name: "over the limit per request", limits: []Limit{{PerRequest: big.NewInt(9_999)}}, offer: offerOf("10000"),
			errs: []string{"asks 10000 of asset " + tokenA, "limit of 9999 per request", "not paid"}},
		{name: "within the total", limits: []Limit{{Total: big.NewInt(30_000)}}, spent: 20_000, offer: offerOf("10000"), want: 0},
		{name: "over the total", limits: []Limit{{Total: big.NewInt(30_000)}}, spent: 20_001, offer: offerOf("10000"),
			errs: []string{"asks 10000", "total budget of 30000", "20001 is spent"}},
		{name: "no limit covers the asset", limits: []Limit{{Asset: tokenB, PerRequest: big.NewInt(1 << 40)}}, offer: offerOf("1"),
			errs: []string{"asks 1 of asset " + tokenA, "no spending limit covers"}},
		{name: "no limits at all pay nothing", offer: offerOf("1"), errs: []string{"no spending limit covers"}},
		{name: "the first limit that covers the asset applies", limits: []Limit{{Asset: strings.ToLower(tokenA), PerRequest: big.NewInt(5)}, {PerRequest: big.NewInt(1 << 40)}},
			offer: offerOf("6"), errs: []string{"limit of 5 per request"}},
		{name: "a limit on another network does not cover it", limits: []Limit{{Network: "eip155:1"}}, offer: offerOf("1"), errs: []string{"no spending limit covers"}},
		{name: "a requirement within the limit is paid rather than one over it", limits: []Limit{{PerRequest: big.NewInt(10)}}, offer: offerOf("11", "10"), want: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &Transport{Limits: tc.limits}
			if tc.spent > 0 {
				tr.spent = map[string]*big.Int{spentKey("eip155:72344", tokenA): big.NewInt(tc.spent)}
			}
			got, err := (&Payer{}).choose(tc.offer, nil, func(r x402.PaymentRequirements) error { return tr.check("http://seller/report", r, false) })
			if tc.errs == nil {
				if err != nil || got != tc.want {
					t.Fatalf("chose accepts[%d], %v; want accepts[%d]", got, err, tc.want)
				}
				return
			}
			var le *LimitError
			if !errors.As(err, &le) {
				t.Fatalf("chose accepts[%d], %v; want a *LimitError", got, err)
			}
			for _, w := range append(tc.errs, "http://seller/report") {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

func TestTheTotalIsReservedPerAssetAndReleasedWhenNothingWasSent(t *testing.T) {
	tr := &Transport{Limits: []Limit{{Total: big.NewInt(15)}}}
	a := offerOf("10").Required.Accepts[0]
	b := a
	b.Asset = tokenB
	if err := tr.check("u", a, true); err != nil {
		t.Fatal(err)
	}
	if err := tr.check("u", a, true); err == nil {
		t.Fatal("a second payment of 10 passed a total of 15")
	}
	if err := tr.check("u", b, true); err != nil {
		t.Fatalf("the total of another asset was spent by the first: %v", err)
	}
	if got := tr.Spent("eip155:72344", strings.ToLower(tokenA)); got.Cmp(big.NewInt(10)) != 0 {
		t.Fatalf("spent %s of token A, want 10", got)
	}
	tr.release(a)
	if got := tr.Spent("eip155:72344", tokenA); got.Sign() != 0 {
		t.Fatalf("spent %s of token A after the release, want 0", got)
	}
}
