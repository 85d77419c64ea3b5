package caddymodule_test

import (
	"context"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestABatchVoucherAcceptedUnservedIsJudgedByItsRecordOnlyAtItsOwnRouteAndResource: a voucher accepted (charged)
// at a route whose upstream then failed is on record as accepted and not served. After a reload that changes
// that route's price it is served there when presented again (judged by its record, charged once); but presented
// at another route of the same seller at another price, or for another resource of its route, it buys nothing:
// its record binds it to the resource it was accepted for, at its route or at a route that sells that resource at
// the price it was charged (TestAVoucherWhoseResponseFailedIsServedAfterAReloadRenumberedItsRoute). About 2 s.
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

// TestABatchVoucherAcceptedWithNoRecordIsServedAfterAReloadChangedThePrice: on a PostgreSQL journal, a voucher
// the channel's row accepted with no record written (an engine SIGKILLed between the row's compare-and-set and
// the voucher's record: here the test takes the step as that engine did), then a reload that changes the route's
// price. Presented again, the voucher is served at its cumulative amount and charged once, then refused as used;
// not refused for the new price while the claimer claims it. About 3 s.
func TestABatchVoucherAcceptedWithNoRecordIsServedAfterAReloadChangedThePrice(t *testing.T) {
	dsn := pgtest.Shared(t)
	t.Setenv("X402_TEST_JOURNAL_DSN", dsn)
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	token := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	b := newBatchChannel(c, token)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(b.authorizer))
	network := x402.EIP155(c.ChainID.Uint64())
	caddyfile := func(price int) string {
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
		journal {env.X402_TEST_JOURNAL_DSN}
	}
}

{{ADDR}} {
	x402 {
		scheme batch
		amount ` + fmt.Sprint(price) + `
		pay_to ` + b.receiver.Address.Hex() + `
	}
	respond "the paid report"
}
`
	}
	srv := startCaddy(t, caddyfile(batchClaimPrice))
	present := func(req x402.BatchRequest) (int, string) {
		t.Helper()
		h, err := x402.EncodeHeader(req.PaymentPayload)
		if err != nil {
			t.Fatal(err)
		}
		r, err := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
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
	if status, body := present(b.deposit(t, 10*batchClaimPrice, batchClaimPrice)); status != http.StatusOK {
		t.Fatalf("the deposit and first voucher: %d %s", status, body)
	}

	// The second voucher's step, taken as an engine would that was SIGKILLed before writing its record.
	second := b.voucher(2 * batchClaimPrice)
	st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	sig, err := chain.ParseSignature(second.PaymentPayload.Payload.Voucher.Signature)
	if err != nil {
		t.Fatal(err)
	}
	digest := chain.VoucherDigest(chain.BatchDomainSeparator(c.ChainID), b.id, big.NewInt(2*batchClaimPrice))
	key := journal.ChannelKey{Network: network, Escrow: contracts.BatchSettlementAddress.Hex(), ID: b.id.Hex()}
	if _, err := st.AcceptVoucher(context.Background(), key, big.NewInt(batchClaimPrice), big.NewInt(2*batchClaimPrice),
		journal.Voucher{Signature: sig[:], Digest: digest[:], By: "an engine SIGKILLed before the record"}); err != nil {
		t.Fatal(err)
	}

	srv.load(caddyfile(2 * batchClaimPrice))
	if status, body := present(second); status != http.StatusOK || body != "the paid report" {
		t.Fatalf("the voucher the row accepted with no record, presented after the reload changed the price: %d %s; want its response", status, body)
	}
	if status, body := present(second); status != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %d %s; want 402 %s", status, body, x402.ReasonPaymentAlreadyUsed)
	}
}
