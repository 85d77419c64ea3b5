package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// adversaryEnv is a public facilitator (no API key) hosted by a real Caddy, whose x402 app settles on two
// simulated chains: a and b, with chain IDs of their own.
type adversaryEnv struct {
	*facilitatorEnv
	b        *chaintest.Chain
	networkB string
}

func startAdversaryEnv(t *testing.T) *adversaryEnv {
	t.Helper()
	a := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(8))
	b := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(8), chaintest.WithChainID(72345))
	for _, c := range []*chaintest.Chain{a, b} {
		t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	}
	env := &adversaryEnv{b: b, networkB: x402.EIP155(b.ChainID.Uint64())}
	env.facilitatorEnv = &facilitatorEnv{
		t: t, c: a, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(a.ChainID.Uint64()),
	}
	network := func(c *chaintest.Chain) string {
		return `		network ` + x402.EIP155(c.ChainID.Uint64()) + ` {
			rpc ` + c.RPCURL + `
			asset ` + c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(c.Wallets[0]) + ` ` + hexKey(c.Wallets[1]) + `
			receipt_poll 5ms
			receipt_timeout 20s
		}
`
	}
	env.caddyfile = `{
	x402 {
` + network(a) + network(b) + `		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle_path /facilitator/* {
		x402_facilitator {
			min_amount ` + big.NewInt(adversaryMinAmount).String() + `
			pay_to ` + env.payTo.Hex() + `
		}
	}
	handle_path /limited/* {
		x402_facilitator {
			open
			settle_rate_limit {
				per_ip 2/min
			}
		}
	}
}
`
	env.srv = startCaddy(t, env.caddyfile)
	return env
}

// adversaryMinAmount is the public route's min_amount, below the price of the honest payments of the table.
const adversaryMinAmount = facilitatorPrice / 2

// sent is how many transactions the settlement wallets of both chains have sent, those in the pool included.
func (e *adversaryEnv) sent() uint64 {
	return walletsSent(e.t, e.c, e.c.Wallets[:2]) + walletsSent(e.t, e.b, e.b.Wallets[:2])
}

// An adversarial table for a public facilitator's /verify and /settle, over HTTP through Caddy: each payment is
// refused by both with HTTP 200, the reason code that names what is wrong, and no transaction sent on either
// chain.
func TestAPublicFacilitatorRefusesAdversarialPaymentsWithoutSpendingGas(t *testing.T) {
	e := startAdversaryEnv(t)
	payers := e.c.Payers
	rows := []struct {
		name   string
		reason string
		// build prepares the chain and returns the payment to present; it may send transactions of its own
		// (a first, honest settlement), counted before the table looks.
		build func(t *testing.T) x402.VerifyRequest
	}{{
		name: "a Permit2 nonce the payer spent", reason: x402.ReasonPermit2InvalidNonce,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[0]
			// Two payments of the payer verified first: its funds are then read, and fresh, and a later payment
			// could be answered from that read alone, which knows nothing of nonces.
			for range 2 {
				if a := e.do(http.MethodPost, "/facilitator/verify", "", mustJSON(t, e.permit2(payer))); a.json(t)["isValid"] != true {
					t.Fatalf("an honest payment of the payer: %d %s", a.status, a.body)
				}
			}
			req := e.permit2(payer)
			nonce, _ := new(big.Int).SetString(req.PaymentPayload.Payload.Permit2Authorization.Nonce, 10)
			word, bit := new(big.Int).Rsh(nonce, 8), new(big.Int).And(nonce, big.NewInt(0xff))
			data, err := contracts.Permit2ABI.Pack("invalidateUnorderedNonces", word, new(big.Int).Lsh(big.NewInt(1), uint(bit.Uint64())))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := e.c.Transact(context.Background(), payer, contracts.Permit2Address, data); err != nil {
				t.Fatal(err)
			}
			return req
		},
	}, {
		name: "a deadline a day beyond maxTimeoutSeconds", reason: x402.ReasonValidBefore,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[1]
			e.c.Approve(payer, contracts.Permit2Address, big.NewInt(1e12))
			rq := e.requirements(x402.TransferPermit2)
			p, err := chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{
				Now: e.chainNow(), Deadline: big.NewInt(e.chainNow().Add(24 * time.Hour).Unix())})
			if err != nil {
				t.Fatal(err)
			}
			return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
		},
	}, {
		name: "a gas-sponsoring permit another payment already spent", reason: x402.ReasonInvalidEIP2612ExtensionFormat,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[2] // has not approved Permit2: the sponsoring permit is what pays
			rq := e.requirements(x402.TransferPermit2)
			var reqs [2]x402.VerifyRequest
			for i := range reqs {
				p, err := chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: e.chainNow()})
				if err != nil {
					t.Fatal(err)
				}
				reqs[i] = x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
			}
			if err := chain.AddGasSponsoring(&reqs[0].PaymentPayload, payer.Key, e.c.ChainID, "", "", e.c.TokenNonce(payer.Address)); err != nil {
				t.Fatal(err)
			}
			reqs[1].PaymentPayload.Extensions = reqs[0].PaymentPayload.Extensions
			first := e.do(http.MethodPost, "/facilitator/settle", "", mustJSON(t, reqs[0]))
			if m := first.json(t); first.status != http.StatusOK || m["success"] != true {
				t.Fatalf("the first payment with the sponsoring permit: %d %s; want settled", first.status, first.body)
			}
			return reqs[1]
		},
	}, {
		name: "a payment settled on one network replayed on another", reason: x402.ReasonPermit2InvalidSignature,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := e.b.Payers[3]
			e.b.Approve(payer, contracts.Permit2Address, big.NewInt(1e12))
			e.c.Approve(e.c.Payers[3], contracts.Permit2Address, big.NewInt(1e12)) // the same key has funds here too
			rq := e.requirements(x402.TransferPermit2)
			rq.Network, rq.Asset = e.networkB, e.b.Token.Hex()
			p, err := chain.SignPermit2Payment(payer.Key, rq, e.b.ChainID, chain.Permit2Options{Now: time.Unix(int64(e.b.HeadTime()), 0)})
			if err != nil {
				t.Fatal(err)
			}
			onB := x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
			if a := e.do(http.MethodPost, "/facilitator/settle", "", mustJSON(t, onB)); a.status != http.StatusOK || a.json(t)["success"] != true {
				t.Fatalf("the payment on its own network: %d %s; want settled", a.status, a.body)
			}
			replay := onB
			replay.PaymentRequirements = e.requirements(x402.TransferPermit2)
			replay.PaymentRequirements.Asset = e.c.Token.Hex()
			replay.PaymentPayload.Accepted = replay.PaymentRequirements
			return replay
		},
	}, {
		name: "a permit signed for another chain id", reason: x402.ReasonInvalidSignature,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[4]
			rq := e.requirements(x402.TransferERC2612)
			mainnet := rq
			mainnet.Network = "eip155:1" // the domain's chainId is 1; the payment then claims this chain
			p, err := chain.SignERC2612Payment(payer.Key, mainnet, big.NewInt(1), chain.ERC2612Options{Now: e.chainNow(), TokenNonce: e.c.TokenNonce(payer.Address)})
			if err != nil {
				t.Fatal(err)
			}
			p.Accepted = rq
			return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
		},
	}, {
		name: "a payTo the facilitator does not settle for", reason: x402.ReasonInvalidPaymentRequirements,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[5]
			e.c.Approve(payer, contracts.Permit2Address, big.NewInt(1e12))
			rq := e.requirements(x402.TransferPermit2)
			rq.PayTo = payer.Address.Hex() // a stranger paying itself, on the facilitator's gas
			return e.signPermit2(t, payer, rq)
		},
	}, {
		name: "an amount below min_amount", reason: x402.ReasonInvalidPaymentRequirements,
		build: func(t *testing.T) x402.VerifyRequest {
			payer := payers[6]
			e.c.Approve(payer, contracts.Permit2Address, big.NewInt(1e12))
			rq := e.requirements(x402.TransferPermit2)
			rq.Amount = "1"
			return e.signPermit2(t, payer, rq)
		},
	}}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			req := row.build(t)
			time.Sleep(50 * time.Millisecond) // what build sent is mined (blocks every 5 ms)
			before := e.sent()
			v := e.do(http.MethodPost, "/facilitator/verify", "", mustJSON(t, req))
			if m := v.json(t); v.status != http.StatusOK || m["isValid"] != false || m["invalidReason"] != row.reason || m["invalidMessage"] == "" {
				t.Errorf("/verify: %d %s; want 200, isValid false, invalidReason %s with a message", v.status, v.body, row.reason)
			}
			s := e.do(http.MethodPost, "/facilitator/settle", "", mustJSON(t, x402.SettleRequest(req)))
			if m := s.json(t); s.status != http.StatusOK || m["success"] != false || m["errorReason"] != row.reason || m["transaction"] != "" {
				t.Errorf("/settle: %d %s; want 200, success false, errorReason %s, no transaction", s.status, s.body, row.reason)
			}
			time.Sleep(50 * time.Millisecond)
			if n := e.sent() - before; n != 0 {
				t.Errorf("the settlement wallets sent %d transactions for a refused payment", n)
			}
		})
	}
}

// signPermit2 signs a permit2 payment of payer for rq at chain time.
func (e *adversaryEnv) signPermit2(t *testing.T, payer *chaintest.Account, rq x402.PaymentRequirements) x402.VerifyRequest {
	t.Helper()
	p, err := chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: e.chainNow()})
	if err != nil {
		t.Fatal(err)
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

// A client past a route's settle_rate_limit gets 429 with Retry-After, and nothing is sent for its settlement;
// /verify is not limited (it costs reads, not gas).
func TestAPublicFacilitatorPastItsRateLimitAnswers429AndSendsNothing(t *testing.T) {
	e := startAdversaryEnv(t)
	payer := e.c.Payers[7]
	// Two calls a minute: two refused payments (no gas) use the budget up.
	for i := range 2 {
		junk := e.signPermit2(t, payer, e.requirements(x402.TransferPermit2)) // not approved: refused
		if a := e.do(http.MethodPost, "/limited/settle", "", mustJSON(t, junk)); a.status != http.StatusOK {
			t.Fatalf("settle call %d within the limit: %d %s", i+1, a.status, a.body)
		}
	}
	e.c.Approve(payer, contracts.Permit2Address, big.NewInt(1e12))
	time.Sleep(50 * time.Millisecond)
	honest := e.signPermit2(t, payer, e.requirements(x402.TransferPermit2))
	before := e.sent()
	if v := e.do(http.MethodPost, "/limited/verify", "", mustJSON(t, honest)); v.status != http.StatusOK || v.json(t)["isValid"] != true {
		t.Errorf("/verify past the settle limit: %d %s; want 200, valid", v.status, v.body)
	}
	s := e.do(http.MethodPost, "/limited/settle", "", mustJSON(t, honest))
	if s.status != http.StatusTooManyRequests || s.header.Get("Retry-After") == "" {
		t.Errorf("/settle past the limit: %d, Retry-After %q, %s; want 429 with Retry-After", s.status, s.header.Get("Retry-After"), s.body)
	}
	time.Sleep(50 * time.Millisecond)
	if n := e.sent() - before; n != 0 {
		t.Errorf("the settlement wallets sent %d transactions past the rate limit", n)
	}
}
