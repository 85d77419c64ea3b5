package caddymodule_test

import (
	"bytes"
	"cmp"
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The terms of the limits environment: the app's network settles payments of at least appMinAmount to payTo or
// partner; the /terms routes pass on only payments of at least routeMinAmount to payTo.
const (
	appMinAmount   = 5_000
	routeMinAmount = facilitatorPrice
)

// partner is the second recipient the app's network allows.
var partner = common.HexToAddress("0xbeefbeefbeefbeefbeefbeefbeefbeefbeefbeef")

// limitsCaddyfile is a real Caddy with the x402 app's engine on a simulated chain, min_amount and pay_to on its
// network, and x402_facilitator routes:
//
//	/open/*            no terms or limits of its own: the engine's terms apply
//	/terms/*           min_amount and pay_to of its own over the engine
//	/upstream-terms/*  the same terms in middleware mode, over an upstream nobody listens on
//	/per-payer/*       settle_rate_limit per_payer 2/min
//	/per-ip/*          settle_rate_limit per_ip 3/min
//
// global is added to the global options block (trusted_proxies, say).
func limitsCaddyfile(t *testing.T, e *facilitatorEnv, global string) string {
	return `{
	` + global + `
	x402 {
		network ` + e.network + ` {
			rpc ` + cmp.Or(e.rpc, e.c.RPCURL) + `
			asset ` + e.c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(e.c.Wallets[0]) + ` ` + hexKey(e.c.Wallets[1]) + `
			receipt_poll 5ms
			receipt_timeout 20s
			min_amount ` + strconv.Itoa(appMinAmount) + `
			pay_to ` + e.payTo.Hex() + ` ` + partner.Hex() + `
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle_path /open/* {
		x402_facilitator {
			open
		}
	}
	handle_path /terms/* {
		x402_facilitator {
			min_amount ` + strconv.Itoa(routeMinAmount) + `
			pay_to ` + e.payTo.Hex() + `
		}
	}
	handle_path /upstream-terms/* {
		x402_facilitator {
			min_amount ` + strconv.Itoa(routeMinAmount) + `
			pay_to ` + e.payTo.Hex() + `
			upstream http://` + freeAddr(t) + `/facilitator {
				timeout 2s
			}
		}
	}
	handle_path /per-payer/* {
		x402_facilitator {
			open
			settle_rate_limit {
				per_payer 2/min
			}
		}
	}
	handle_path /per-ip/* {
		x402_facilitator {
			open
			settle_rate_limit {
				per_ip 3/min
			}
		}
	}
}
`
}

func startLimitsEnv(t *testing.T) *facilitatorEnv {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(6))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	e := &facilitatorEnv{
		t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(c.ChainID.Uint64()),
	}
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	for _, p := range c.Payers {
		c.Approve(p, contracts.Permit2Address, max)
	}
	e.caddyfile = limitsCaddyfile(t, e, "")
	e.srv = startCaddy(t, e.caddyfile)
	return e
}

// pay signs a payment of payer by method for amount to payTo (the payer has approved Permit2).
func (e *facilitatorEnv) pay(method string, payer *chaintest.Account, amount int64, payTo common.Address) x402.VerifyRequest {
	e.t.Helper()
	rq := e.requirements(method)
	rq.Amount, rq.PayTo = strconv.FormatInt(amount, 10), payTo.Hex()
	var p x402.PaymentPayload
	var err error
	if method == x402.TransferPermit2 {
		p, err = chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: e.chainNow()})
	} else {
		p, err = chain.SignERC2612Payment(payer.Key, rq, e.c.ChainID, chain.ERC2612Options{Now: e.chainNow(), TokenNonce: e.c.TokenNonce(payer.Address)})
	}
	if err != nil {
		e.t.Fatalf("signing a %s payment: %v", method, err)
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

// sent is how many transactions the settlement wallets have sent, those still in the node's pool included.
func (e *facilitatorEnv) sent() uint64 {
	e.t.Helper()
	return walletsSent(e.t, e.c, e.c.Wallets)
}

// doFrom sends a raw request to a facilitator route with the given extra headers.
func (e *facilitatorEnv) doFrom(method, path string, body []byte, header map[string]string) facilitatorAnswer {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+path, bytes.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return facilitatorAnswer{resp.StatusCode, resp.Header, b}
}

// settleAt posts req to path's /settle and decodes the 200 SettleResponse.
func (e *facilitatorEnv) settleAt(path string, req x402.VerifyRequest, header map[string]string) x402.SettleResponse {
	e.t.Helper()
	a := e.doFrom("POST", path+"/settle", mustJSON(e.t, req), header)
	var s x402.SettleResponse
	if a.status != http.StatusOK || json.Unmarshal(a.body, &s) != nil {
		e.t.Fatalf("POST %s/settle = %d %s, want 200 with a SettleResponse", path, a.status, a.body)
	}
	return s
}

// verifyAt posts req to path's /verify and decodes the 200 VerifyResponse.
func (e *facilitatorEnv) verifyAt(path string, req x402.VerifyRequest) x402.VerifyResponse {
	e.t.Helper()
	a := e.doFrom("POST", path+"/verify", mustJSON(e.t, req), nil)
	var v x402.VerifyResponse
	if a.status != http.StatusOK || json.Unmarshal(a.body, &v) != nil {
		e.t.Fatalf("POST %s/verify = %d %s, want 200 with a VerifyResponse", path, a.status, a.body)
	}
	return v
}

// assertTooManySettlements checks a 429 answer: a Retry-After of 1 to maxWait seconds, and a JSON error saying text.
func assertTooManySettlements(t *testing.T, a facilitatorAnswer, maxWait int, text string) {
	t.Helper()
	if a.status != http.StatusTooManyRequests {
		t.Fatalf("status = %d %s, want 429", a.status, a.body)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	if wait, err := strconv.Atoi(a.header.Get("Retry-After")); err != nil || wait < 1 || wait > maxWait {
		t.Errorf("Retry-After = %q, want 1 to %d seconds", a.header.Get("Retry-After"), maxWait)
	}
	msg, _ := a.json(t)["error"].(string)
	if !strings.Contains(msg, text) || !strings.Contains(msg, "nothing was sent") {
		t.Errorf("error = %q, want it to say %q and that nothing was sent", msg, text)
	}
}

// A route's min_amount and pay_to refuse a payment outside them at /verify and /settle with a full 200 answer
// (invalid_payment_requirements, a message naming the amount or recipient), before the facilitator behind is
// called: the embedded engine, which accepts the same payment at another route, and an upstream nobody listens
// on (which would answer 502). No transaction is sent and no token moves.
func TestAFacilitatorRoutesMinAmountAndPayToRefuseBeforeTheFacilitatorBehindIsAsked(t *testing.T) {
	e := startLimitsEnv(t)
	payer := e.c.Payers[0]
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		for _, tc := range []struct {
			name   string
			amount int64
			payTo  common.Address
			text   string
		}{
			{"below the route's min_amount", routeMinAmount - 1, e.payTo, "paymentRequirements.amount 9999 is below min_amount 10000"},
			{"to a recipient the route does not allow", routeMinAmount, partner, "paymentRequirements.payTo " + partner.Hex() + " is not among the allowed recipients"},
		} {
			t.Run(method+", "+tc.name, func(t *testing.T) {
				e.t = t
				req := e.pay(method, payer, tc.amount, tc.payTo)
				// The engine itself takes the payment: the refusals below are the route's.
				if v := e.verifyAt("/open", req); !v.IsValid {
					t.Fatalf("verify at /open = %+v, want valid (within the app's terms)", v)
				}
				txs := e.sent()
				payerBefore, sellerBefore := e.c.TokenBalance(payer.Address), e.c.TokenBalance(tc.payTo)
				for _, route := range []string{"/terms", "/upstream-terms"} {
					v := e.verifyAt(route, req)
					if v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(v.InvalidMessage, tc.text) || v.Payer != payer.Address.Hex() {
						t.Errorf("verify at %s = %+v; want %s saying %q", route, v, x402.ReasonInvalidPaymentRequirements, tc.text)
					}
					s := e.settleAt(route, req, nil)
					if s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(s.ErrorMessage, tc.text) ||
						s.Transaction != "" || s.Network != e.network || s.Payer != payer.Address.Hex() {
						t.Errorf("settle at %s = %+v; want a full %s answer saying %q", route, s, x402.ReasonInvalidPaymentRequirements, tc.text)
					}
				}
				if n := e.sent() - txs; n != 0 {
					t.Errorf("the settlement wallets sent %d transactions for refused payments", n)
				}
				if e.c.TokenBalance(payer.Address).Cmp(payerBefore) != 0 || e.c.TokenBalance(tc.payTo).Cmp(sellerBefore) != 0 {
					t.Error("tokens moved for a refused payment")
				}
			})
		}
	}
}

// The app's network min_amount and pay_to bind the embedded engine at every route, one with no terms of its
// own included: a 1-unit payment, or one to a stranger, is refused at /verify and /settle with
// invalid_payment_requirements and nothing is sent; a payment within them settles.
func TestTheAppsNetworkMinAmountAndPayToRefuseAtAFacilitatorRouteWithNoTermsOfItsOwn(t *testing.T) {
	e := startLimitsEnv(t)
	stranger := common.HexToAddress("0x5742a9e45742a9e45742a9e45742a9e45742a9e4")
	for i, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		payer := e.c.Payers[i]
		for _, tc := range []struct {
			name   string
			amount int64
			payTo  common.Address
			text   string
		}{
			{"one unit", 1, e.payTo, "paymentRequirements.amount 1 is below min_amount 5000"},
			{"to a recipient the network does not allow", appMinAmount, stranger, "paymentRequirements.payTo " + stranger.Hex() + " is not among the allowed recipients"},
		} {
			t.Run(method+", "+tc.name, func(t *testing.T) {
				e.t = t
				req := e.pay(method, payer, tc.amount, tc.payTo)
				txs := e.sent()
				payerBefore := e.c.TokenBalance(payer.Address)
				v := e.verifyAt("/open", req)
				if v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(v.InvalidMessage, tc.text) || !strings.Contains(v.InvalidMessage, e.network) {
					t.Errorf("verify = %+v; want %s saying %q on %s", v, x402.ReasonInvalidPaymentRequirements, tc.text, e.network)
				}
				s := e.settleAt("/open", req, nil)
				if s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(s.ErrorMessage, tc.text) || s.Transaction != "" || s.Payer != payer.Address.Hex() {
					t.Errorf("settle = %+v; want a full %s answer saying %q", s, x402.ReasonInvalidPaymentRequirements, tc.text)
				}
				if n := e.sent() - txs; n != 0 {
					t.Errorf("the settlement wallets sent %d transactions for refused payments", n)
				}
				if e.c.TokenBalance(payer.Address).Cmp(payerBefore) != 0 {
					t.Error("the payer's tokens moved for a refused payment")
				}
			})
		}
		t.Run(method+", exactly the minimum to the other allowed recipient", func(t *testing.T) {
			e.t = t
			if s := e.settleAt("/open", e.pay(method, payer, appMinAmount, partner), nil); !s.Success || s.Transaction == "" {
				t.Fatalf("settle = %+v, want success", s)
			}
		})
	}
}

// settle_rate_limit per_payer 2/min: a payer's third settlement within the minute gets 429 with Retry-After and
// nothing reaches the engine (no transaction, the payment still unsettled and good elsewhere); other payers are
// not held up. Settle calls refused before anything was sent (here: below the app's min_amount) do not count,
// so a payload that only names a payer cannot use up that payer's settlements.
func TestASettleRateLimitPerPayerAnswers429BeforeTheEngineIsAsked(t *testing.T) {
	e := startLimitsEnv(t)
	payer, other := e.c.Payers[0], e.c.Payers[1]
	for i := 0; i < 3; i++ {
		if s := e.settleAt("/per-payer", e.pay(x402.TransferPermit2, payer, 1, e.payTo), nil); s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements {
			t.Fatalf("settle of a 1-unit payment = %+v, want a refusal", s)
		}
	}
	for i := 0; i < 2; i++ {
		if s := e.settleAt("/per-payer", e.pay(x402.TransferPermit2, payer, facilitatorPrice, e.payTo), nil); !s.Success || s.Transaction == "" {
			t.Fatalf("settlement %d of the payer = %+v, want success (refusals that sent nothing do not count)", i+1, s)
		}
	}

	third := e.pay(x402.TransferPermit2, payer, facilitatorPrice, e.payTo)
	txs := e.sent()
	payerBefore, sellerBefore := e.balances(payer.Address)
	a := e.doFrom("POST", "/per-payer/settle", mustJSON(t, third), nil)
	assertTooManySettlements(t, a, 30, "payer "+payer.Address.Hex()+" has had more than 2 settlements in the last minute (settle_rate_limit per_payer)")
	if n := e.sent() - txs; n != 0 {
		t.Errorf("the settlement wallets sent %d transactions for a rate-limited settlement", n)
	}
	if payerAfter, sellerAfter := e.balances(payer.Address); payerAfter.Cmp(payerBefore) != 0 || sellerAfter.Cmp(sellerBefore) != 0 {
		t.Error("tokens moved for a rate-limited settlement")
	}

	if s := e.settleAt("/per-payer", e.pay(x402.TransferPermit2, other, facilitatorPrice, e.payTo), nil); !s.Success {
		t.Errorf("another payer's settlement = %+v, want success: the limit is per payer", s)
	}
	// The limited payment never reached the engine: it settles, once, where no limit applies.
	if s := e.settleAt("/open", third, nil); !s.Success {
		t.Errorf("the rate-limited payment at /open = %+v, want it settled", s)
	}
	if payerAfter, _ := e.balances(payer.Address); new(big.Int).Sub(payerBefore, payerAfter).Cmp(big.NewInt(facilitatorPrice)) != 0 {
		t.Errorf("the payer paid %s for the payment settled at /open, want %d", new(big.Int).Sub(payerBefore, payerAfter), facilitatorPrice)
	}
}

// settle_rate_limit per_ip 3/min: every /settle call of a client IP counts, malformed and refused ones too,
// /verify none; the fourth gets 429 with Retry-After and nothing is sent. The client IP is Caddy's: an
// X-Forwarded-For from a peer that is not a trusted proxy changes nothing, and behind trusted_proxies each
// forwarded client has a limit of its own.
func TestASettleRateLimitPerClientIPCountsEverySettleCallOfCaddysClientIP(t *testing.T) {
	e := startLimitsEnv(t)
	for i := 0; i < 5; i++ {
		if v := e.verifyAt("/per-ip", e.pay(x402.TransferPermit2, e.c.Payers[0], facilitatorPrice, e.payTo)); !v.IsValid {
			t.Fatalf("verify %d = %+v, want valid: /verify is not limited", i+1, v)
		}
	}
	if s := e.settleAt("/per-ip", e.pay(x402.TransferPermit2, e.c.Payers[0], facilitatorPrice, e.payTo), nil); !s.Success {
		t.Fatalf("the first settlement = %+v, want success", s)
	}
	if a := e.doFrom("POST", "/per-ip/settle", []byte(`{"x402Version":2,`), nil); a.status != http.StatusBadRequest {
		t.Fatalf("a malformed settle = %d %s, want 400", a.status, a.body)
	}
	if s := e.settleAt("/per-ip", e.pay(x402.TransferPermit2, e.c.Payers[1], 1, e.payTo), nil); s.Success {
		t.Fatalf("settle of a 1-unit payment = %+v, want a refusal", s)
	}

	fourth := e.pay(x402.TransferPermit2, e.c.Payers[2], facilitatorPrice, e.payTo)
	txs := e.sent()
	before := e.c.TokenBalance(e.c.Payers[2].Address)
	for _, header := range []map[string]string{nil, {"X-Forwarded-For": "203.0.113.7"}} {
		a := e.doFrom("POST", "/per-ip/settle", mustJSON(t, fourth), header)
		assertTooManySettlements(t, a, 20, "client IP 127.0.0.1 has made more than 3 /settle calls in the last minute (settle_rate_limit per_ip)")
	}
	if n := e.sent() - txs; n != 0 {
		t.Errorf("the settlement wallets sent %d transactions for rate-limited settlements", n)
	}
	if e.c.TokenBalance(e.c.Payers[2].Address).Cmp(before) != 0 {
		t.Error("the payer's tokens moved for a rate-limited settlement")
	}

	// Behind a trusted proxy (here: every loopback peer), the client is the one the proxy names. The reload
	// starts the counts afresh.
	e.srv.load(limitsCaddyfile(t, e, "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}"))
	client := map[string]string{"X-Forwarded-For": "203.0.113.7"}
	for i := 0; i < 3; i++ {
		if s := e.settleAt("/per-ip", e.pay(x402.TransferPermit2, e.c.Payers[3], 1, e.payTo), client); s.Success {
			t.Fatalf("settle of a 1-unit payment = %+v, want a refusal", s)
		}
	}
	txs = e.sent()
	a := e.doFrom("POST", "/per-ip/settle", mustJSON(t, fourth), client)
	assertTooManySettlements(t, a, 20, "client IP 203.0.113.7 has made more than 3")
	if n := e.sent() - txs; n != 0 {
		t.Errorf("the settlement wallets sent %d transactions for a rate-limited settlement", n)
	}
	if s := e.settleAt("/per-ip", fourth, map[string]string{"X-Forwarded-For": "203.0.113.8"}); !s.Success {
		t.Errorf("another forwarded client's settlement = %+v, want success", s)
	}
}

// Concurrent /settle calls of one client IP are counted exactly: of ten at once under per_ip 3/min, three
// reach the engine and seven get 429.
func TestASettleRateLimitHoldsUnderConcurrentCalls(t *testing.T) {
	e := startLimitsEnv(t)
	body := mustJSON(t, e.pay(x402.TransferPermit2, e.c.Payers[0], 1, e.payTo)) // refused by the engine: sends nothing
	var wg sync.WaitGroup
	statuses := make([]int, 10)
	for i := range statuses {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", e.srv.URL+"/per-ip/settle", bytes.NewReader(body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		}()
	}
	wg.Wait()
	count := map[int]int{}
	for _, s := range statuses {
		count[s]++
	}
	if count[http.StatusOK] != 3 || count[http.StatusTooManyRequests] != 7 {
		t.Fatalf("statuses = %v, want 3 x 200 and 7 x 429", count)
	}
}

// trustLoopback is the global option that makes Caddy take the client a loopback peer names in
// X-Forwarded-For: the tests' stand-in for many clients behind a proxy Caddy trusts.
const trustLoopback = "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}"

// forwardedFor is the header naming client ip to a Caddy that trusts the loopback peer.
func forwardedFor(ip string) map[string]string { return map[string]string{"X-Forwarded-For": ip} }

// settle_rate_limit per_ip counts an IPv6 client by its /64: one /64 holds 2^64 addresses, any one of which its
// owner may send from, so four addresses of one /64 share the limit of three calls, and the fourth is answered
// 429 naming the network. Another /64 has a limit of its own, and an IPv4-mapped IPv6 address is its IPv4 client.
func TestASettleRateLimitPerIPCountsAnIPv6ClientByItsSlash64(t *testing.T) {
	e := startLimitsEnv(t)
	e.srv.load(limitsCaddyfile(t, e, trustLoopback))
	refused := e.pay(x402.TransferPermit2, e.c.Payers[0], 1, e.payTo) // below the app's min_amount: sends nothing
	for _, ip := range []string{"2001:db8:7:1::1", "2001:db8:7:1::2", "2001:db8:7:1:ffff:ffff:ffff:fffe"} {
		if s := e.settleAt("/per-ip", refused, forwardedFor(ip)); s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements {
			t.Fatalf("settle from %s = %+v, want the engine's refusal", ip, s)
		}
	}
	a := e.doFrom("POST", "/per-ip/settle", mustJSON(t, refused), forwardedFor("2001:db8:7:1:8000::9"))
	assertTooManySettlements(t, a, 20, "client network 2001:db8:7:1::/64 has made more than 3 /settle calls in the last minute (settle_rate_limit per_ip)")

	if s := e.settleAt("/per-ip", refused, forwardedFor("2001:db8:7:2::1")); s.ErrorReason != x402.ReasonInvalidPaymentRequirements {
		t.Errorf("settle from another /64 = %+v, want it let through to the engine's refusal", s)
	}
	for range 3 {
		e.settleAt("/per-ip", refused, forwardedFor("203.0.113.50"))
	}
	a = e.doFrom("POST", "/per-ip/settle", mustJSON(t, refused), forwardedFor("::ffff:203.0.113.50"))
	assertTooManySettlements(t, a, 20, "client IP 203.0.113.50 has made more")
}

// ipv6Caddyfile is the limits Caddy's x402 app (rpc through the test's proxy when e.rpc is set) with routes of
// the limits written in this syntax:
//
//	/v6-56/*      settle_rate_limit per_ip 2/min ipv6_prefix 56
//	/verify-5/*   verify_rate_limit per_ip 5/min
//	/verify-off/* verify_rate_limit off
func ipv6Caddyfile(t *testing.T, e *facilitatorEnv) string {
	text := limitsCaddyfile(t, e, trustLoopback)
	return strings.Replace(text, "\thandle_path /open/* {", `	handle_path /v6-56/* {
		x402_facilitator {
			open
			settle_rate_limit {
				per_ip 2/min ipv6_prefix 56
			}
		}
	}
	handle_path /verify-5/* {
		x402_facilitator {
			open
			verify_rate_limit {
				per_ip 5/min
			}
		}
	}
	handle_path /verify-off/* {
		x402_facilitator {
			open
			verify_rate_limit off
		}
	}
	handle_path /open/* {`, 1)
}

// ipv6_prefix 56 makes every address of a /56 one client: two /64s of one /56 share per_ip 2/min, another /56
// does not.
func TestAnIPv6PrefixOf56CountsEveryAddressOfTheSlash56AsOneClient(t *testing.T) {
	e := startLimitsEnv(t)
	e.srv.load(ipv6Caddyfile(t, e))
	refused := e.pay(x402.TransferPermit2, e.c.Payers[0], 1, e.payTo)
	e.settleAt("/v6-56", refused, forwardedFor("2001:db8:7:100::1"))
	e.settleAt("/v6-56", refused, forwardedFor("2001:db8:7:1ff::1"))
	a := e.doFrom("POST", "/v6-56/settle", mustJSON(t, refused), forwardedFor("2001:db8:7:142::1"))
	assertTooManySettlements(t, a, 40, "client network 2001:db8:7:100::/56 has made more than 2 /settle calls")
	if s := e.settleAt("/v6-56", refused, forwardedFor("2001:db8:7:200::1")); s.ErrorReason != x402.ReasonInvalidPaymentRequirements {
		t.Errorf("settle from another /56 = %+v, want it let through to the engine's refusal", s)
	}
}

// rpcCounter counts the JSON-RPC calls a FaultProxy passes to the chain, by method ("" for a batch).
type rpcCounter struct {
	mu    sync.Mutex
	calls map[string]int
}

func countRPC(p *chaintest.FaultProxy) *rpcCounter {
	c := &rpcCounter{calls: map[string]int{}}
	p.SetDecide(func(method string) chaintest.Fault {
		c.mu.Lock()
		c.calls[method]++
		c.mu.Unlock()
		return chaintest.Pass
	})
	return c
}

func (c *rpcCounter) count(method string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[method]
}

// startCountedLimitsEnv is the limits environment with the x402 app's chain reached through a proxy that counts
// the calls, and the routes of ipv6Caddyfile when configured is set (else limitsCaddyfile's, which today's main
// parses too).
func startCountedLimitsEnv(t *testing.T, configured bool) (*facilitatorEnv, *rpcCounter) {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(6))
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	proxy := chaintest.NewFaultProxy(t, c.RPCURL)
	rpc := countRPC(proxy)
	e := &facilitatorEnv{
		t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(c.ChainID.Uint64()), rpc: proxy.URL,
	}
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	for _, p := range c.Payers {
		c.Approve(p, contracts.Permit2Address, max)
	}
	e.caddyfile = limitsCaddyfile(t, e, trustLoopback)
	if configured {
		e.caddyfile = ipv6Caddyfile(t, e)
	}
	e.srv = startCaddy(t, e.caddyfile)
	return e, rpc
}

// forged is a payment in payer's name signed by someone else: the signature recovers to another address, so the
// engine must ask the chain whether the payer is a contract wallet (eth_getCode) before it can refuse it.
func (e *facilitatorEnv) forged(payer, signer *chaintest.Account) x402.VerifyRequest {
	e.t.Helper()
	req := e.pay(x402.TransferPermit2, signer, facilitatorPrice, e.payTo)
	req.PaymentPayload.Payload.Permit2Authorization.From = payer.Address.Hex()
	return req
}

// verifyBurst posts bodies to path's /verify from client ip, eight at a time, and counts the answers by status.
func (e *facilitatorEnv) verifyBurst(path, ip string, bodies [][]byte) map[int]int {
	e.t.Helper()
	var mu sync.Mutex
	count := map[int]int{}
	work := make(chan []byte)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for body := range work {
				req, _ := http.NewRequest("POST", e.srv.URL+path+"/verify", bytes.NewReader(body))
				req.Header.Set("X-Forwarded-For", ip)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					e.t.Error(err)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				count[resp.StatusCode]++
				mu.Unlock()
			}
		})
	}
	for _, b := range bodies {
		work <- b
	}
	close(work)
	wg.Wait()
	return count
}

// defaultVerifyPerIP is the verify rate limit of a route that sets none (caddymodule.DefaultVerifyPerIP).
const defaultVerifyPerIP = 600

// A route with no verify_rate_limit of its own limits /verify all the same: a client's forged payments (each
// costing the engine an eth_getCode) are answered until 600 were refused within the minute, then 429 with
// Retry-After, before the engine is asked: the chain sees no more reads of them. Another client is not held back.
func TestForgedVerificationsAreRateLimitedByDefaultAndStopCostingChainReads(t *testing.T) {
	e, rpc := startCountedLimitsEnv(t, false)
	payer, signer := e.c.Payers[0], e.c.Payers[1]
	forged := mustJSON(t, e.forged(payer, signer))
	if a := e.doFrom("POST", "/open/verify", forged, forwardedFor("198.51.100.1")); a.status != http.StatusOK || a.json(t)["invalidReason"] != x402.ReasonPermit2InvalidSignature {
		t.Fatalf("a forged payment = %d %s, want 200 refusing its signature", a.status, a.body)
	}
	reads := rpc.count("eth_getCode")
	if reads == 0 {
		t.Fatal("the forged payment cost no eth_getCode; the test would show nothing")
	}

	bodies := make([][]byte, defaultVerifyPerIP+99)
	for i := range bodies {
		bodies[i] = forged
	}
	start := time.Now()
	count := e.verifyBurst("/open", "198.51.100.1", bodies)
	// The bucket refills at ten a second while the burst runs.
	allowed := defaultVerifyPerIP - 1 + int(time.Since(start).Seconds()*defaultVerifyPerIP/60) + 1
	if count[http.StatusOK] < defaultVerifyPerIP-1 || count[http.StatusOK] > allowed || count[http.StatusOK]+count[http.StatusTooManyRequests] != len(bodies) {
		t.Fatalf("statuses of %d forged verifications after one = %v, want %d to %d x 200 and the rest 429", len(bodies), count, defaultVerifyPerIP-1, allowed)
	}
	if got := rpc.count("eth_getCode") - reads; got > allowed*reads {
		t.Errorf("%d eth_getCode calls for the burst, want at most %d (the 429s cost none)", got, allowed*reads)
	}
	a := e.doFrom("POST", "/open/verify", forged, forwardedFor("198.51.100.1"))
	assertTooManyVerifications(t, a, "client IP 198.51.100.1 has had more than 600 /verify calls refused or failed in the last minute")
	if a := e.doFrom("POST", "/open/verify", forged, forwardedFor("198.51.100.2")); a.status != http.StatusOK {
		t.Errorf("another client's verification = %d %s, want 200", a.status, a.body)
	}
}

// assertTooManyVerifications checks a 429 /verify answer: Retry-After, and a VerifyResponse refusing nothing for
// good (unexpected_verify_error) whose message, also its error, says text.
func assertTooManyVerifications(t *testing.T, a facilitatorAnswer, text string) {
	t.Helper()
	if a.status != http.StatusTooManyRequests {
		t.Fatalf("status = %d %s, want 429", a.status, a.body)
	}
	if wait, err := strconv.Atoi(a.header.Get("Retry-After")); err != nil || wait < 1 || wait > 60 {
		t.Errorf("Retry-After = %q, want 1 to 60 seconds", a.header.Get("Retry-After"))
	}
	m := a.json(t)
	msg, _ := m["invalidMessage"].(string)
	if m["isValid"] != false || m["invalidReason"] != x402.ReasonUnexpectedVerifyError || !strings.Contains(msg, text) || m["error"] != msg {
		t.Errorf("answer = %s, want isValid false, %s and a message saying %q", a.body, x402.ReasonUnexpectedVerifyError, text)
	}
}

// verify_rate_limit per_ip 5/min: valid payments cost nothing against it; of forty forged ones at once, five
// reach the engine and thirty-five get 429, and the chain is read for five. The client's next verification, a
// valid one too, waits for its bucket; another /64 is not held back; verify_rate_limit off limits nothing.
func TestAVerifyRateLimitChargesRefusalsNotValidPayments(t *testing.T) {
	e, rpc := startCountedLimitsEnv(t, true)
	payer, signer := e.c.Payers[0], e.c.Payers[1]
	const client = "2001:db8:9:1::1"
	for i := range 10 {
		if v := e.doFrom("POST", "/verify-5/verify", mustJSON(t, e.pay(x402.TransferPermit2, payer, facilitatorPrice, e.payTo)), forwardedFor(client)); v.status != http.StatusOK || v.json(t)["isValid"] != true {
			t.Fatalf("valid payment %d = %d %s, want 200 valid: valid payments cost nothing against the limit", i+1, v.status, v.body)
		}
	}
	forged := mustJSON(t, e.forged(payer, signer))
	reads := rpc.count("eth_getCode")
	bodies := make([][]byte, 40)
	for i := range bodies {
		bodies[i] = forged
	}
	count := e.verifyBurst("/verify-5", "2001:db8:9:1:ab::7", bodies) // the same /64
	if count[http.StatusOK] != 5 || count[http.StatusTooManyRequests] != 35 {
		t.Fatalf("statuses of 40 forged verifications = %v, want 5 x 200 and 35 x 429", count)
	}
	if got := rpc.count("eth_getCode") - reads; got == 0 || got > 5 {
		t.Errorf("%d eth_getCode calls for the burst, want 1 to 5: one per verification let through", got)
	}
	a := e.doFrom("POST", "/verify-5/verify", mustJSON(t, e.pay(x402.TransferPermit2, payer, facilitatorPrice, e.payTo)), forwardedFor(client))
	assertTooManyVerifications(t, a, "client network 2001:db8:9:1::/64 has had more than 5 /verify calls refused or failed")
	if a := e.doFrom("POST", "/verify-5/verify", forged, forwardedFor("2001:db8:9:2::1")); a.status != http.StatusOK {
		t.Errorf("a client of another /64 = %d %s, want 200", a.status, a.body)
	}
	if count := e.verifyBurst("/verify-off", client, bodies); count[http.StatusOK] != len(bodies) {
		t.Errorf("statuses with verify_rate_limit off = %v, want every one 200", count)
	}
}

// payUpto signs an upto payment of payer of at most max to the seller, naming the app's first settlement wallet
// as the one that may settle it.
func (e *facilitatorEnv) payUpto(payer *chaintest.Account, max int64) x402.VerifyRequest {
	e.t.Helper()
	rq := e.requirements(x402.TransferPermit2)
	rq.Scheme, rq.Amount, rq.Extra.FacilitatorAddress = x402.SchemeUpto, strconv.FormatInt(max, 10), e.c.Wallets[0].Address.Hex()
	p, err := chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: e.chainNow()})
	if err != nil {
		e.t.Fatalf("signing an upto payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

// charging is an upto payment presented for settlement of amount: the requirements name the charge, the payload
// stays as signed.
func charging(req x402.VerifyRequest, amount int64) x402.VerifyRequest {
	req.PaymentRequirements.Amount = strconv.FormatInt(amount, 10)
	return req
}

// A route's min_amount judges what an upto payment authorizes, its maximum, at /verify and /settle, and not the
// charge the resource server settles once its upstream has done the work: an upto settlement of nothing is
// answered success with no transaction (as the engine answers it), and one below min_amount is settled for
// exactly that. A maximum below min_amount is refused at both, its settlement for nothing too.
func TestARoutesMinAmountJudgesAnUptoPaymentsMaximumNotItsCharge(t *testing.T) {
	e := startLimitsEnv(t)
	payer := e.c.Payers[0]

	zero := e.payUpto(payer, 2*routeMinAmount)
	if v := e.verifyAt("/terms", zero); !v.IsValid {
		t.Fatalf("verify of an upto payment of at most %d = %+v, want valid", 2*routeMinAmount, v)
	}
	txs := e.sent()
	payerBefore, sellerBefore := e.balances(payer.Address)
	if s := e.settleAt("/terms", charging(zero, 0), nil); !s.Success || s.Transaction != "" || s.Payer != payer.Address.Hex() || s.Network != e.network {
		t.Errorf("settle of the upto payment for nothing = %+v, want success with no transaction", s)
	}
	if n := e.sent() - txs; n != 0 {
		t.Errorf("the settlement wallets sent %d transactions for a settlement of nothing", n)
	}
	if p, s := e.balances(payer.Address); p.Cmp(payerBefore) != 0 || s.Cmp(sellerBefore) != 0 {
		t.Error("tokens moved for a settlement of nothing")
	}

	const charge = appMinAmount + 1_000 // within the app's terms, below the route's min_amount
	below := e.payUpto(payer, 2*routeMinAmount)
	if s := e.settleAt("/terms", charging(below, charge), nil); !s.Success || s.Transaction == "" || s.Amount != strconv.Itoa(charge) {
		t.Fatalf("settle of the upto payment for %d = %+v, want it settled for that", charge, s)
	}
	if p, s := e.balances(payer.Address); new(big.Int).Sub(payerBefore, p).Int64() != charge || new(big.Int).Sub(s, sellerBefore).Int64() != charge {
		t.Errorf("the payer paid %s and the seller got %s, want %d each", new(big.Int).Sub(payerBefore, p), new(big.Int).Sub(s, sellerBefore), charge)
	}

	small := e.payUpto(payer, routeMinAmount-1)
	const text = "the upto maximum permit2Authorization.permitted.amount 9999 is below min_amount 10000"
	for _, route := range []string{"/terms", "/upstream-terms"} {
		if v := e.verifyAt(route, small); v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(v.InvalidMessage, text) {
			t.Errorf("verify at %s of an upto payment of at most %d = %+v, want %s saying %q", route, routeMinAmount-1, v, x402.ReasonInvalidPaymentRequirements, text)
		}
		if s := e.settleAt(route, charging(small, 0), nil); s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements || !strings.Contains(s.ErrorMessage, text) {
			t.Errorf("settle at %s of it for nothing = %+v, want %s saying %q", route, s, x402.ReasonInvalidPaymentRequirements, text)
		}
	}
}
