package caddymodule_test

import (
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// offered lists a 402's requirements as "<asset>:<method>" in order, the asset as the test names it.
func offered(t *testing.T, a gateAnswer, names map[common.Address]string) []string {
	t.Helper()
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("unpaid request answered %d %q, want 402", a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
	}
	var out []string
	for _, rq := range pr.Accepts {
		out = append(out, names[common.HexToAddress(rq.Asset)]+":"+rq.Extra.AssetTransferMethod)
	}
	return out
}

// A token the app marks as EIP-3009-capable is offered by eip3009 after permit2, with its own EIP-712 domain;
// other tokens are not. `caddy x402 pay --method eip3009` pays it: one transferWithAuthorization moves exactly
// the price.
func TestTheGateOffersEIP3009ForAnEIP3009TokenAndThePayCommandPaysIt(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	env := startGateOn(t, c, gateSetup{
		network: fmt.Sprintf("\t\t\tasset %s name %q version %s decimals 6 eip3009\n", usdc.Hex(), contracts.USDCoinName, contracts.USDCoinVersion),
		gate:    "\t\taccept {\n\t\t\tasset " + usdc.Hex() + "\n\t\t}\n",
	})
	names := map[common.Address]string{c.Token: "stable", usdc: "usdc"}
	got := strings.Join(offered(t, env.get("/"), names), " ")
	if want := "stable:permit2 stable:erc2612 usdc:permit2 usdc:eip3009 usdc:erc2612"; got != want {
		t.Fatalf("offers = %s, want %s", got, want)
	}

	payer := c.Payers[0]
	before, sellerBefore := c.BalanceOf(usdc, payer.Address), c.BalanceOf(usdc, env.payTo)
	stdout, stderr, err := caddymodule.RunX402("", "pay", "--key", fmt.Sprintf("%x", crypto.FromECDSA(payer.Key)), "--rpc", c.RPCURL, "--method", "eip3009", env.srv.URL+"/")
	if err != nil || !strings.Contains(stdout, "paid content") {
		t.Fatalf("pay --method eip3009 = %v\nstdout: %s\nstderr: %s", err, stdout, stderr)
	}
	if !strings.Contains(stderr, "by eip3009") {
		t.Fatalf("the progress line does not name eip3009: %s", stderr)
	}
	if got := new(big.Int).Sub(before, c.BalanceOf(usdc, payer.Address)); got.Int64() != gatePrice {
		t.Fatalf("payer's USDC fell by %s, want %d", got, gatePrice)
	}
	if got := new(big.Int).Sub(c.BalanceOf(usdc, env.payTo), sellerBefore); got.Int64() != gatePrice {
		t.Fatalf("seller's USDC rose by %s, want %d", got, gatePrice)
	}
}

// A facilitator whose /supported lists the public SDKs' standard kind (no assetTransferMethod) serves permit2
// and EIP-3009: the gate offers permit2 for every token and eip3009 for one it is told has EIP-3009, and never
// erc2612, which such a facilitator would read as an EIP-3009 authorization.
func TestAGateInFrontOfAStandardFacilitatorOffersPermit2AndEIP3009NeverERC2612(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	usdc := common.HexToAddress("0x00000000000000000000000000000000000000c0")
	network := x402.EIP155(c.ChainID.Uint64())
	standard := serveTest(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/supported" {
			http.NotFound(w, r)
			return
		}
		writeAnswer(w, http.StatusOK, []byte(`{"kinds":[{"x402Version":2,"scheme":"exact","network":"`+network+`"},{"x402Version":1,"scheme":"exact","network":"`+network+`"}],"extensions":[],"signers":{"eip155:*":["0x00000000000000000000000000000000000000fa"]}}`))
	}))
	env := startGateOn(t, c, gateSetup{
		facURL: standard,
		gate:   "\t\taccept {\n\t\t\tasset " + usdc.Hex() + "\n\t\t\ttoken_name \"USD Coin\"\n\t\t\ttoken_version 2\n\t\t\ttoken_eip3009\n\t\t}\n",
	})
	got := strings.Join(offered(t, env.get("/"), map[common.Address]string{c.Token: "stable", usdc: "usdc"}), " ")
	if want := "stable:permit2 usdc:permit2 usdc:eip3009"; got != want {
		t.Fatalf("offers = %s, want %s", got, want)
	}
}
