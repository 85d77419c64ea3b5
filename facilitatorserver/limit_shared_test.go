package facilitatorserver_test

import (
	"bytes"
	"context"
	"encoding/json"
	"math/big"
	"net/http"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// openInstance opens the journal of one more instance of a cluster on dsn.
func openInstance(t *testing.T, dsn string) *journal.PostgresStore {
	t.Helper()
	st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// sharedIn is an Options.SharedCounts of st.
func sharedIn(st *journal.PostgresStore) func() facilitatorserver.SharedCounts {
	return func() facilitatorserver.SharedCounts { return st }
}

// postSettle posts req to base's /settle as the client ip (by the ClientIP the test servers read) and returns the
// status, Retry-After and the settlement when there is one.
func postSettle(t *testing.T, base, ip string, req x402.VerifyRequest) (int, string, x402.SettleResponse) {
	t.Helper()
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	hr, err := http.NewRequest(http.MethodPost, base+"/settle", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set("X-Test-Client", ip)
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sr x402.SettleResponse
	if resp.StatusCode == http.StatusOK {
		if err := json.NewDecoder(resp.Body).Decode(&sr); err != nil {
			t.Fatal(err)
		}
	}
	return resp.StatusCode, resp.Header.Get("Retry-After"), sr
}

// testClientIP names the client by the X-Test-Client header, as a server behind a trusted proxy would.
func testClientIP(r *http.Request) string { return r.Header.Get("X-Test-Client") }

// Two servers (two instances of a cluster, each with its own open of one PostgreSQL journal) in front of a real
// engine enforce one settle_rate_limit: per_ip 3/min allows a client three settlements over both, and the fourth,
// on either, is 429 with the wait until the next, and sends nothing; per_payer likewise counts a payer's
// settlements over both.
func TestTwoServersOnOneDatabaseEnforceOneSettleRateLimit(t *testing.T) {
	c, f, network := engine(t)
	dsn := pgtest.Shared(t)
	var bases []string
	for range 2 {
		srv, err := facilitatorserver.New(f, facilitatorserver.Options{
			SettleRateLimit: facilitatorserver.RateLimit{PerIP: 3, PerPayer: 2},
			ClientIP:        testClientIP, SharedCounts: sharedIn(openInstance(t, dsn)),
		})
		if err != nil {
			t.Fatal(err)
		}
		_, base := serve(t, srv, "")
		bases = append(bases, base)
	}
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: network, Amount: big.NewInt(price).String(), Asset: c.Token.Hex(),
		PayTo: seller.Hex(), MaxTimeoutSeconds: 3600,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"},
	}
	maxApproval := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	sign := func(payer int) x402.VerifyRequest {
		t.Helper()
		pl, err := chain.SignPermit2Payment(c.Payers[payer].Key, rq, c.ChainID, chain.Permit2Options{Now: time.Unix(int64(c.HeadTime()), 0)})
		if err != nil {
			t.Fatal(err)
		}
		return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: pl, PaymentRequirements: rq}
	}
	for _, p := range c.Payers[:4] {
		c.Approve(p, contracts.Permit2Address, maxApproval)
	}
	sellerBefore := c.TokenBalance(seller)

	// per_ip: client 198.51.100.7 pays as three payers, on server 0, 1, 0; its fourth call, on server 1, is refused.
	for i, server := range []int{0, 1, 0} {
		status, _, sr := postSettle(t, bases[server], "198.51.100.7", sign(i))
		if status != http.StatusOK || !sr.Success {
			t.Fatalf("settlement %d of the client on server %d = HTTP %d %+v; want settled", i+1, server, status, sr)
		}
	}
	sent := walletTxs(c)
	status, retry, _ := postSettle(t, bases[1], "198.51.100.7", sign(3))
	if secs, _ := strconv.Atoi(retry); status != http.StatusTooManyRequests || secs < 1 || secs > 20 {
		t.Fatalf("the client's 4th settlement, on the other server = HTTP %d, Retry-After %q; want 429 and at most 20 s "+
			"(3/min over both servers: the cluster allows the limit once, not once per server)", status, retry)
	}

	// per_payer: payer 0 settled once above (server 0); its second settlement, from another client on server 1, is
	// allowed, its third, on server 0, refused.
	if status, _, sr := postSettle(t, bases[1], "203.0.113.1", sign(0)); status != http.StatusOK || !sr.Success {
		t.Fatalf("payer 0's 2nd settlement = HTTP %d %+v; want settled", status, sr)
	}
	if status, retry, _ := postSettle(t, bases[0], "203.0.113.2", sign(0)); status != http.StatusTooManyRequests || retry == "" {
		t.Fatalf("payer 0's 3rd settlement = HTTP %d, Retry-After %q; want 429 with Retry-After (per_payer 2/min over both servers)", status, retry)
	}
	time.Sleep(50 * time.Millisecond) // blocks keep coming: a refused call's transaction would be mined by now
	if got := walletTxs(c) - sent; got != 1 {
		t.Fatalf("%d transactions after the client's three settlements; want 1 (payer 0's second), the refused calls sending none", got)
	}
	if got := new(big.Int).Sub(c.TokenBalance(seller), sellerBefore); got.Int64() != 4*price {
		t.Fatalf("the seller got %s, want the 4 settled payments' %d", got, 4*price)
	}
}

// With its database down, a server of a cluster neither refuses every call nor lets every call through: it
// counts in memory, each server on its own, and warns that it does.
func TestWithTheDatabaseDownEachServerEnforcesTheSettleRateLimitOnItsOwn(t *testing.T) {
	pg := pgtest.Start(t)
	behind := &countingFacilitator{}
	core, logs := observer.New(zap.WarnLevel)
	var bases []string
	for range 2 {
		srv, err := facilitatorserver.New(behind, facilitatorserver.Options{
			SettleRateLimit: facilitatorserver.RateLimit{PerIP: 2},
			ClientIP:        testClientIP, SharedCounts: sharedIn(openInstance(t, pg.DSN())), Logger: zap.New(core),
		})
		if err != nil {
			t.Fatal(err)
		}
		_, base := serve(t, srv, "")
		bases = append(bases, base)
	}
	req := payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo)
	// Shared: two calls over both servers, then refused.
	for i, base := range bases {
		if status, _, _ := postSettle(t, base, "198.51.100.9", req); status != http.StatusOK {
			t.Fatalf("call %d = HTTP %d, want 200", i+1, status)
		}
	}
	if status, _, _ := postSettle(t, bases[0], "198.51.100.9", req); status != http.StatusTooManyRequests {
		t.Fatalf("3rd call over both servers = HTTP %d, want 429", status)
	}

	pg.Stop(t)
	for server, base := range bases {
		for i := range 2 {
			start := time.Now()
			status, _, _ := postSettle(t, base, "198.51.100.10", req)
			if status != http.StatusOK {
				t.Fatalf("with the database down, call %d on server %d = HTTP %d; want 200 (each server allows the limit)", i+1, server, status)
			}
			if took := time.Since(start); took > 3*time.Second {
				t.Fatalf("a call with the database down took %v; want the shared count given up within a second", took)
			}
		}
		status, retry, _ := postSettle(t, base, "198.51.100.10", req)
		if status != http.StatusTooManyRequests || retry == "" {
			t.Fatalf("with the database down, call 3 on server %d = HTTP %d, Retry-After %q; want 429: the limit still holds per server", server, status, retry)
		}
	}
	if _, settled := behind.payments(); settled != 2+4 {
		t.Fatalf("the facilitator behind settled %d times; want 2 with the database up, 2 a server with it down", settled)
	}
	if n := logs.FilterMessageSnippet("each instance counts in memory").Len(); n == 0 {
		t.Fatal("counting in memory was not logged as a warning")
	}
}
