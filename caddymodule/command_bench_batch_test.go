package caddymodule_test

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// benchBatchJSON is the batch part of `caddy x402 bench --json`.
type benchBatchJSON struct {
	benchJSON
	Batch *struct {
		Channels           int      `json:"channels"`
		Deposits           int      `json:"deposits"`
		Vouchers           int      `json:"vouchers"`
		Refunds            int      `json:"refunds"`
		Deposited          string   `json:"deposited"`
		Charged            string   `json:"charged"`
		Left               string   `json:"left"`
		Refunded           string   `json:"refunded"`
		RefundErrors       []string `json:"refund_errors"`
		Transactions       *int     `json:"transactions"`
		TransactionsPer100 *float64 `json:"transactions_per_100_requests"`
	} `json:"batch"`
}

// `caddy x402 bench` on a route of scheme batch, in front of a real Caddy and a simulated chain: at concurrency 4
// it opens 4 channels (one a caller, so that 4 requests are in flight at once), each by one deposit of its share
// of the run, and pays every other request by voucher. The run reports 40 of 40 served, 4 deposits, 36 vouchers,
// the transactions the chain mined to the escrow (the deposits and the gate's claims: what the settlement
// wallet sent), and the seller's balance after the claim equal to the 40 prices served. Before, bench signed
// payments ahead with payer.SignBatch, which refuses batch-settlement: the run could not be made.
func TestBenchPaysABatchRouteByVouchersFromAChannelACallerAndTheSellerHoldsWhatWasServedAfterTheClaim(t *testing.T) {
	const price, requests, callers = 1000, 40, 4
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(1))
	usdc := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	receiver, authorizer := chaintest.DeriveAccount("bench merchant", 0), chaintest.DeriveAccount("authorizer", 0)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(authorizer))
	network := x402.EIP155(c.ChainID.Uint64())
	srv := startCaddy(t, `{
	x402 {
		network `+network+` {
			rpc `+c.RPCURL+`
			asset `+usdc.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_every 100000
				claim_after 1s
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle /report {
		x402 {
			scheme batch
			asset `+usdc.Hex()+`
			token_name "`+contracts.USDCoinName+`"
			token_version `+contracts.USDCoinVersion+`
			token_eip3009
			amount `+fmt.Sprint(price)+`
			pay_to `+receiver.Address.Hex()+`
		}
		respond "the paid report"
	}
}
`)
	sentBefore := c.TxCount(c.Wallets[0].Address)
	stdout, stderr, err := caddymodule.RunX402("", "bench", "--key", hexKey(c.Payers[0]), "--rpc", c.RPCURL, "-c", fmt.Sprint(callers),
		"-n", fmt.Sprint(requests), "--settle-wait", "30s", "--json", srv.URL+"/report")
	var out benchBatchJSON
	decodeOneJSONLine(t, stdout, &out)
	if err != nil {
		t.Fatalf("bench: %v\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	if out.Scheme != x402.SchemeBatchSettlement || out.Requests != requests || out.OK != requests || len(out.Failures) != 0 {
		t.Fatalf("scheme %q, %d of %d served, failures %+v; want batch-settlement, all %d", out.Scheme, out.OK, out.Requests, out.Failures, requests)
	}
	b := out.Batch
	if b == nil || b.Channels != callers || b.Deposits != callers || b.Vouchers != requests-callers || b.Refunds != 0 {
		t.Fatalf("batch %+v; want %d channels, %d deposits, %d vouchers, no refund", b, callers, callers, requests-callers)
	}
	if b.Deposited != fmt.Sprint(requests*price) || b.Charged != fmt.Sprint(requests*price) || b.Left != "0" {
		t.Errorf("deposited %s, charged %s, left %s; want %d, %d, 0: each channel's deposit is its share of the run", b.Deposited, b.Charged, b.Left, requests*price, requests*price)
	}
	sent := c.TxCount(c.Wallets[0].Address) - sentBefore
	if b.Transactions == nil || uint64(*b.Transactions) != sent || sent < callers+1 || sent > callers+3 {
		t.Errorf("bench counts %v transactions, the settlement wallet sent %d; want the same, the %d deposits and a claim or few", b.Transactions, sent, callers)
	}
	if got := c.BalanceOf(usdc, receiver.Address); got.Int64() != requests*price {
		t.Errorf("the seller holds %s after the run; want the %d served, %d", got, requests, requests*price)
	}
	if deref(out.SellerDelta) != fmt.Sprint(requests*price) || out.BalanceOK == nil || !*out.BalanceOK {
		t.Errorf("seller_delta %s, balance_ok %v; want %d, true", deref(out.SellerDelta), out.BalanceOK, requests*price)
	}
	if !strings.Contains(stderr, "4 channels (one a caller)") {
		t.Errorf("bench does not say how it pays:\n%s", stderr)
	}
}

// decodeOneJSONLine decodes what `bench --json` printed: one JSON object on one line.
func decodeOneJSONLine(t *testing.T, stdout string, v any) {
	t.Helper()
	if stdout == "" {
		return
	}
	if err := json.Unmarshal([]byte(stdout), v); err != nil || strings.Count(stdout, "\n") != 1 {
		t.Fatalf("bench --json printed %q, want one JSON object on one line (%v)", stdout, err)
	}
}
