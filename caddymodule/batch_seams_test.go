package caddymodule_test

import (
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestABatchVoucherAcceptedUnservedIsJudgedByItsRecordOnlyAtItsOwnRouteAndResource: a voucher accepted (charged)
// at a route whose upstream then failed is on record as accepted and not served. After a reload that changes
// that route's price it is served there when presented again (judged by its record, charged once); but presented
// at another route of the same seller at another price, or for another resource of its route, it buys nothing:
// its record binds it to the route and resource it was accepted for. About 2 s.
func TestABatchVoucherAcceptedUnservedIsJudgedByItsRecordOnlyAtItsOwnRouteAndResource(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	token := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	b := newBatchChannel(c, token)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(b.authorizer))
	var failing atomic.Bool
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(w, "the report is not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(w, "the paid report of "+r.URL.Path)
	}))
	t.Cleanup(upstream.Close)
	network := x402.EIP155(c.ChainID.Uint64())
	caddyfile := func(cheap int) string {
		return `{
	x402 {
		network ` + network + ` {
			rpc ` + c.RPCURL + `
			asset ` + token.Hex() + ` name "` + contracts.USDCoinName + `" version ` + contracts.USDCoinVersion + ` decimals 6 eip3009
			wallet_keys ` + hexKey(c.Wallets[0]) + `
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_after 1h
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle /cheap/* {
		x402 {
			scheme batch
			amount ` + fmt.Sprint(cheap) + `
			pay_to ` + b.receiver.Address.Hex() + `
		}
		reverse_proxy ` + strings.TrimPrefix(upstream.URL, "http://") + `
	}
	handle /dear/* {
		x402 {
			scheme batch
			amount ` + fmt.Sprint(5*batchClaimPrice) + `
			pay_to ` + b.receiver.Address.Hex() + `
		}
		reverse_proxy ` + strings.TrimPrefix(upstream.URL, "http://") + `
	}
}
`
	}
	srv := startCaddy(t, caddyfile(batchClaimPrice))
	present := func(path string, req x402.BatchRequest) (int, string) {
		t.Helper()
		h, err := x402.EncodeHeader(req.PaymentPayload)
		if err != nil {
			t.Fatal(err)
		}
		r, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		r.Header.Set(x402.HeaderPaymentSignature, h)
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}

	failing.Store(true)
	first := b.deposit(t, 10*batchClaimPrice, batchClaimPrice)
	if status, body := present("/cheap/a", first); status != http.StatusInternalServerError {
		t.Fatalf("the deposit and first voucher while the upstream fails: %d %s; want the upstream's 500", status, body)
	}
	failing.Store(false)
	srv.load(caddyfile(2 * batchClaimPrice))

	for _, path := range []string{"/dear/a", "/cheap/b"} {
		if status, body := present(path, first); status != http.StatusPaymentRequired || strings.Contains(body, "the paid report") {
			t.Errorf("the voucher accepted for /cheap/a presented for %s: %d %s; want 402 and nothing served", path, status, body)
		}
	}
	if status, body := present("/cheap/a", first); status != http.StatusOK || body != "the paid report of /cheap/a" {
		t.Fatalf("the voucher presented again for /cheap/a after the reload changed its price: %d %s; want its response", status, body)
	}
	if status, body := present("/cheap/a", first); status != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %d %s; want 402 %s", status, body, x402.ReasonPaymentAlreadyUsed)
	}
}
