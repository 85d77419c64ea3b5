package caddymodule_test

import (
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	neturl "net/url"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Verification and settlement judge a deadline by the same rule, "at least 6 s after the earliest time of the
// next block". A settle async payment is served at verification and settled afterwards, so a payer who signs a
// deadline just past that rule (the payer chooses it; only a maximum is enforced) would pass verification, be
// served, and have its settlement refused as expiring a moment later: served, never settled, and the payer's
// funds free for the next payment. A payment whose deadline leaves its settlement less than a minute of room is
// settled before it is served, as settle after does: served paid, or not served. Here the background
// settlement is held for the seconds a backlog (or the wall clock crossing a second, with a deadline signed to
// the second) puts between serving and settling; with either facilitator (a remote one is judged by the gate's
// clock). With the embedded engine the room is judged by chain time, the next block's, which a dev chain
// sealing a block per transaction runs ahead of the wall clock under load.
func TestASettleAsyncPaymentSignedToExpireSoonAfterVerificationIsSettledBeforeItIsServed(t *testing.T) {
	upstream := overridingUpstream(t)
	cases := []struct {
		name    string
		remote  bool
		method  string        // the payment's transfer method
		upto    bool          // an upto payment, charged what its upstream names
		ahead   time.Duration // chain time ahead of the wall clock
		left    int64         // seconds of validity the payment is signed with, past the next block's earliest time
		backlog time.Duration // how long the background settlement would have waited
	}{
		{name: "embedded", method: x402.TransferPermit2, left: 6 + 3, backlog: 8 * time.Second},
		{name: "remote", remote: true, method: x402.TransferPermit2, left: 6 + 3, backlog: 8 * time.Second},
		{name: "embedded, chain time ahead", method: x402.TransferPermit2, ahead: 2 * time.Minute, left: 30, backlog: 30 * time.Second},
		{name: "embedded, erc2612", method: x402.TransferERC2612, left: 6 + 3, backlog: 8 * time.Second},
		{name: "remote, upto", remote: true, method: x402.TransferPermit2, upto: true, left: 6 + 3, backlog: 8 * time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			setup, path, content, charged := gateSetup{remote: tc.remote, gate: "\t\tsettle async\n", logFile: true}, "/", "paid content", int64(gatePrice)
			if tc.upto {
				setup.gate += "\t\tscheme upto\n"
				setup.site = "reverse_proxy " + strings.TrimPrefix(upstream.URL, "http://")
				path, content, charged = "/metered?use="+neturl.QueryEscape(`{"amount":"1234"}`), "metered content", 1234
			}
			env := newGateEnv(t, setup)
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			paid := func(when string) {
				t.Helper()
				after := env.balances(payer)
				if lost, gained := new(big.Int).Sub(before.payer, after.payer), new(big.Int).Sub(after.seller, before.seller); lost.Int64() != charged || gained.Int64() != charged {
					t.Errorf("%s: the payer lost %s and the seller gained %s, want %d each", when, lost, gained, charged)
				}
			}
			env.c.AdjustTime(tc.ahead)

			rq := env.requirement(path, tc.method)
			mineAt := max(int64(env.c.HeadTime())+1, time.Now().Unix())
			deadline := big.NewInt(mineAt + tc.left)
			var p x402.PaymentPayload
			var err error
			if tc.method == x402.TransferERC2612 {
				p, err = chain.SignERC2612Payment(payer.Key, rq, env.c.ChainID, chain.ERC2612Options{Now: env.chainNow(), Deadline: deadline,
					TokenNonce: env.c.TokenNonce(payer.Address)})
			} else {
				p, err = chain.SignPermit2Payment(payer.Key, rq, env.c.ChainID, chain.Permit2Options{Now: env.chainNow(), Deadline: deadline})
			}
			if err != nil {
				t.Fatal(err)
			}
			resume := caddymodule.PauseBackgroundSettlement()
			defer func() {
				if resume != nil {
					resume()
				}
			}()
			a := env.get(path, x402.HeaderPaymentSignature, gateEncode(t, p))
			if a.status != http.StatusOK || a.body != content {
				t.Fatalf("the payment = %d %q, want served", a.status, a.body)
			}
			if resp := settleResponse(t, a); !resp.Success || resp.Transaction == "" {
				t.Errorf("PAYMENT-RESPONSE = %+v, want settled (with its transaction) before the response was served", resp)
			}
			if n := samples(t)["caddy_x402_gate_async_backlog{}"]; n != 0 {
				t.Errorf("%v payments wait for the background settlement, want 0: it was settled before it was served", n)
			}
			paid("as served")

			env.c.AdjustTime(tc.backlog)
			time.Sleep(1100 * time.Millisecond)
			resume()
			resume = nil
			waitBacklog(t, 0)
			time.Sleep(200 * time.Millisecond)
			if env.loggedNow("went unpaid") {
				t.Errorf("the payment was served, then its settlement refused: the resource went unpaid")
			}
			if !env.loggedNow("expires too soon to be settled after serving") {
				t.Errorf("the log does not say why the payment was settled before it was served")
			}
			paid("once quiet")
		})
	}
}

// The payments this project's own payer signs from a settle async gate's offers (valid for the offer's
// max_timeout, 5 minutes by default, from the later of chain time and its clock) are served before they are
// settled, by every transfer method and either facilitator, also while chain time runs ahead of the wall clock
// (a dev chain sealing a block per transaction under load): the room a settle async payment must leave its
// settlement is far inside what they sign.
func TestOurOwnPayerIsServedBeforeSettlementBySettleAsyncWhateverTheChainClock(t *testing.T) {
	for _, kind := range facilitatorKinds {
		t.Run(kind.name, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{remote: kind.remote, gate: "\t\tsettle async\n"})
			who := env.c.Payers[0]
			before := env.balances(who)
			paid := int64(0)
			for _, ahead := range []time.Duration{0, 2 * time.Minute} {
				env.c.AdjustTime(ahead)
				time.Sleep(300 * time.Millisecond) // the engine shares one read of the head block for 250 ms
				for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
					p, err := payer.New(who.Key, payer.Options{RPC: env.c.RPCURL, Method: method})
					if err != nil {
						t.Fatal(err)
					}
					client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{PerRequest: big.NewInt(gatePrice)}}}}
					resp, err := client.Get(env.srv.URL + "/")
					if err != nil {
						t.Fatalf("%s, chain %s ahead: %v", method, ahead, err)
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					a := gateAnswer{status: resp.StatusCode, header: resp.Header, body: string(body)}
					where := fmt.Sprintf("%s, chain time %s ahead", method, ahead)
					if a.status != http.StatusOK || a.body != "paid content" {
						t.Fatalf("%s: %d %q, want served", where, a.status, a.body)
					}
					if sr := settleResponse(t, a); sr.ErrorReason != x402.ReasonSettlementPending {
						t.Errorf("%s: PAYMENT-RESPONSE = %+v, want %s (served before it settled)", where, sr, x402.ReasonSettlementPending)
					}
					paid++
					env.waitPaid(who, before, paid)
					// Settled: a remote facilitator's gate serves a payer one unsettled payment at a time.
					waitBacklog(t, 0)
				}
			}
		})
	}
}

// A payer who never approved Permit2 pays through the eip2612GasSponsoring extension, whose EIP-2612 permit the
// settlement applies first: the payment can be settled only while that permit is valid too. One whose permit2
// deadline leaves minutes but whose sponsor permit expires seconds after verification is settled before it is
// served, not served and then refused as expiring.
func TestASettleAsyncPaymentWhoseGasSponsoringPermitExpiresSoonIsSettledBeforeItIsServed(t *testing.T) {
	env := newGateEnv(t, gateSetup{gate: "\t\tsettle async\n", logFile: true})
	payer := env.c.Payers[0]
	if got := env.c.Allowance(payer.Address, contracts.Permit2Address); got.Sign() != 0 {
		t.Fatalf("the payer has approved Permit2 for %s; the test needs a payer who did not", got)
	}
	before := env.balances(payer)
	rq := env.requirement("/", x402.TransferPermit2)
	p := env.signPermit2(payer, rq)
	mineAt := max(int64(env.c.HeadTime())+1, time.Now().Unix())
	permit := chain.Permit{Owner: payer.Address, Spender: contracts.Permit2Address, Value: big.NewInt(gatePrice),
		Nonce: env.c.TokenNonce(payer.Address), Deadline: big.NewInt(mineAt + 6 + 3)}
	digest := chain.PermitDigest(chain.PermitDomainSeparator(contracts.StableCoinName, contracts.StableCoinVersion, env.c.ChainID, env.c.Token), permit)
	sig, err := crypto.Sign(digest[:], payer.Key)
	if err != nil {
		t.Fatal(err)
	}
	sig[64] += 27
	raw, err := json.Marshal(map[string]x402.EIP2612GasSponsoringInfo{"info": {
		From: payer.Address.Hex(), Asset: env.c.Token.Hex(), Spender: contracts.Permit2Address.Hex(), Amount: permit.Value.String(),
		Nonce: permit.Nonce.String(), Deadline: permit.Deadline.String(), Signature: hexutil.Encode(sig), Version: "1"}})
	if err != nil {
		t.Fatal(err)
	}
	p.Extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: raw}

	resume := caddymodule.PauseBackgroundSettlement()
	defer func() {
		if resume != nil {
			resume()
		}
	}()
	a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p))
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the payment = %d %q, want served", a.status, a.body)
	}
	if resp := settleResponse(t, a); !resp.Success || resp.Transaction == "" {
		t.Errorf("PAYMENT-RESPONSE = %+v, want settled (with its transaction) before the response was served", resp)
	}
	env.c.AdjustTime(8 * time.Second) // the seconds a backlog of the async ledger takes
	time.Sleep(1100 * time.Millisecond)
	resume()
	resume = nil
	waitBacklog(t, 0)
	time.Sleep(200 * time.Millisecond)
	if env.loggedNow("went unpaid") {
		t.Errorf("the payment was served, then its settlement refused: the resource went unpaid")
	}
	env.assertPaid(payer, before, 1)
}
