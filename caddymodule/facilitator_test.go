package caddymodule_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
)

// facilitatorPrice is what every payment of these tests is for, in raw token units (0.01 token).
const facilitatorPrice = 10_000

// facilitatorKeyEnv carries the embedded facilitator's API key into the Caddyfile as {env.…}, as an operator
// would pass it.
const facilitatorKeyEnv = "X402_TEST_FACILITATOR_KEY"

// middlewareKey is the API key of the middleware-mode route, written into the Caddyfile itself.
const middlewareKey = "middleware-key-7f3a"

// facilitatorEnv is a real Caddy serving x402_facilitator routes in front of the x402 app's embedded engine on
// a simulated chain:
//
//	/facilitator/*  the embedded engine, api_key from the environment
//	/middleware/*   middleware mode: upstream /facilitator/* with its key, its own api_key
//	/erc2612/*      the embedded engine, kind erc2612 only, no key
//	/mainnet/*      middleware mode serving only eip155:723487 (which the engine does not settle)
//	/failover/*     middleware mode over a dead facilitator, then /erc2612/*
//	/small/*        the embedded engine, max_body_size 1KiB
//	/metrics        Caddy's metrics handler
type facilitatorEnv struct {
	t         *testing.T
	c         *chaintest.Chain
	srv       *caddyServer
	caddyfile string
	key       string
	payTo     common.Address
	network   string
	rpc       string // the x402 app's RPC URL where it is not the chain's own (limits env)
}

func startFacilitatorEnv(t *testing.T) *facilitatorEnv {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(8))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	return startFacilitatorEnvOn(t, c, c.RPCURL)
}

// startFacilitatorEnvOn starts the Caddy of a facilitatorEnv whose x402 app reaches chain c through rpc.
func startFacilitatorEnvOn(t *testing.T, c *chaintest.Chain, rpc string) *facilitatorEnv {
	t.Helper()
	e := &facilitatorEnv{
		t: t, c: c, key: "embedded-key-41c9",
		payTo:   common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		network: x402.EIP155(c.ChainID.Uint64()),
	}
	t.Setenv(facilitatorKeyEnv, e.key)
	e.caddyfile = `{
	x402 {
		network ` + e.network + ` {
			rpc ` + rpc + `
			asset ` + c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(c.Wallets[0]) + ` ` + hexKey(c.Wallets[1]) + `
			receipt_poll 5ms
			receipt_timeout 20s
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle_path /facilitator/* {
		x402_facilitator {
			api_key {env.` + facilitatorKeyEnv + `}
		}
	}
	handle_path /middleware/* {
		x402_facilitator {
			api_key ` + middlewareKey + `
			upstream {{ADDR}}/facilitator {
				api_key {env.` + facilitatorKeyEnv + `}
				timeout 20s
			}
		}
	}
	handle_path /erc2612/* {
		x402_facilitator {
			open
			kind erc2612
		}
	}
	handle_path /mainnet/* {
		x402_facilitator {
			networks eip155:723487
			upstream {{ADDR}}/facilitator {
				api_key {env.` + facilitatorKeyEnv + `}
			}
		}
	}
	handle_path /failover/* {
		x402_facilitator {
			upstream http://` + freeAddr(t) + `/facilitator {
				timeout 2s
			}
			upstream {{ADDR}}/erc2612
		}
	}
	handle_path /small/* {
		x402_facilitator {
			api_key {env.` + facilitatorKeyEnv + `}
			max_body_size 1KiB
		}
	}
	handle /metrics {
		metrics
	}
}
`
	e.srv = startCaddy(t, e.caddyfile)
	return e
}

// requirements is what a gate would offer for one payment by method.
func (e *facilitatorEnv) requirements(method string) x402.PaymentRequirements {
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: e.network, Amount: big.NewInt(facilitatorPrice).String(),
		Asset: e.c.Token.Hex(), PayTo: e.payTo.Hex(), MaxTimeoutSeconds: 600,
		Extra: x402.Extra{AssetTransferMethod: method, Name: "Stable Coin", Version: "1"},
	}
	if method == x402.TransferERC2612 {
		rq.Extra.Spender = e.c.Wallets[0].Address.Hex()
	}
	return rq
}

// permit2 signs a permit2 payment of payer, who approves Permit2 first.
func (e *facilitatorEnv) permit2(payer *chaintest.Account) x402.VerifyRequest {
	e.t.Helper()
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	e.c.Approve(payer, contracts.Permit2Address, max)
	rq := e.requirements(x402.TransferPermit2)
	p, err := chain.SignPermit2Payment(payer.Key, rq, e.c.ChainID, chain.Permit2Options{Now: e.chainNow()})
	if err != nil {
		e.t.Fatalf("signing a permit2 payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

// erc2612 signs an erc2612 payment of payer with the token's current nonce.
func (e *facilitatorEnv) erc2612(payer *chaintest.Account) x402.VerifyRequest {
	e.t.Helper()
	rq := e.requirements(x402.TransferERC2612)
	p, err := chain.SignERC2612Payment(payer.Key, rq, e.c.ChainID, chain.ERC2612Options{Now: e.chainNow(), TokenNonce: e.c.TokenNonce(payer.Address)})
	if err != nil {
		e.t.Fatalf("signing an erc2612 payment: %v", err)
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

// chainNow is the head block's time, the clock the facilitator judges deadlines by.
func (e *facilitatorEnv) chainNow() time.Time { return time.Unix(int64(e.c.HeadTime()), 0) }

// balances are the token balances of payer and seller.
func (e *facilitatorEnv) balances(payer common.Address) (*big.Int, *big.Int) {
	return e.c.TokenBalance(payer), e.c.TokenBalance(e.payTo)
}

// assertPaidOnce checks that exactly the price moved from payer to the seller since the balances were taken.
func (e *facilitatorEnv) assertPaidOnce(payer common.Address, payerBefore, sellerBefore *big.Int) {
	e.t.Helper()
	payerAfter, sellerAfter := e.balances(payer)
	if got := new(big.Int).Sub(payerBefore, payerAfter); got.Cmp(big.NewInt(facilitatorPrice)) != 0 {
		e.t.Errorf("the payer paid %s, want %d", got, facilitatorPrice)
	}
	if got := new(big.Int).Sub(sellerAfter, sellerBefore); got.Cmp(big.NewInt(facilitatorPrice)) != 0 {
		e.t.Errorf("the seller received %s, want %d", got, facilitatorPrice)
	}
	if n := e.c.CountTokenTransfers(payer, e.payTo); n != 1 {
		e.t.Errorf("%d token transfers from the payer to the seller, want 1", n)
	}
}

// rawFacilitator calls the facilitator endpoints with net/http, as a client nobody here wrote would, and
// insists on HTTP 200 with a JSON body.
type rawFacilitator struct {
	base, key string
}

func (f rawFacilitator) call(ctx context.Context, method, endpoint string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, f.base+"/"+endpoint, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if f.key != "" {
		req.Header.Set("X-Api-Key", f.key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
		return fmt.Errorf("%s /%s = %d (%s) %s", method, endpoint, resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	return json.Unmarshal(b, out)
}

func (f rawFacilitator) Supported(ctx context.Context) (r x402.SupportedResponse, err error) {
	return r, f.call(ctx, http.MethodGet, "supported", nil, &r)
}

func (f rawFacilitator) Verify(ctx context.Context, req x402.VerifyRequest) (r x402.VerifyResponse, err error) {
	return r, f.call(ctx, http.MethodPost, "verify", req, &r)
}

func (f rawFacilitator) Settle(ctx context.Context, req x402.SettleRequest) (r x402.SettleResponse, err error) {
	return r, f.call(ctx, http.MethodPost, "settle", req, &r)
}

func (f rawFacilitator) Health(ctx context.Context) (r x402.HealthResponse, err error) {
	return r, f.call(ctx, http.MethodGet, "health", nil, &r)
}

// facilitatorCallers are the two ways the tests call a facilitator route: base URL and key in, caller out.
var facilitatorCallers = []struct {
	name string
	dial func(t *testing.T, base, key string) x402.Facilitator
}{
	{"raw HTTP", func(_ *testing.T, base, key string) x402.Facilitator { return rawFacilitator{base, key} }},
	{"facilitatorclient", func(t *testing.T, base, key string) x402.Facilitator {
		c, err := facilitatorclient.New(base, facilitatorclient.WithAPIKey(key))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}},
}

func TestFacilitatorServesSupportedVerifySettleAndHealthToEachCallerEmbeddedAndAsMiddleware(t *testing.T) {
	e := startFacilitatorEnv(t)
	routes := []struct{ name, path, key string }{
		{"embedded", "/facilitator", e.key},
		{"middleware", "/middleware", middlewareKey},
	}
	payer := 0
	for _, caller := range facilitatorCallers {
		for _, route := range routes {
			t.Run(caller.name+" to "+route.name, func(t *testing.T) {
				e.t = t
				f := caller.dial(t, e.srv.URL+route.path, route.key)
				ctx := context.Background()

				sup, err := f.Supported(ctx)
				if err != nil {
					t.Fatalf("supported: %v", err)
				}
				assertKinds(t, sup, []string{"permit2 v2", "upto permit2 v2", "eip3009 v1", "eip3009 v2", "erc2612 v1", "erc2612 v2", "batch-settlement eip3009 v2"}, e.network)
				if len(sup.Signers[e.network]) != 2 || !strings.EqualFold(sup.Signers[e.network][0], e.c.Wallets[0].Address.Hex()) {
					t.Errorf("signers = %v, want the two settlement wallets", sup.Signers)
				}
				if len(sup.Extensions) != 1 || sup.Extensions[0] != x402.ExtensionEIP2612GasSponsoring {
					t.Errorf("extensions = %v, want [%s]", sup.Extensions, x402.ExtensionEIP2612GasSponsoring)
				}

				for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
					p := e.c.Payers[payer]
					payer++
					var req x402.VerifyRequest
					if method == x402.TransferPermit2 {
						req = e.permit2(p)
					} else {
						req = e.erc2612(p)
					}
					payerBefore, sellerBefore := e.balances(p.Address)
					v, err := f.Verify(ctx, req)
					if err != nil || !v.IsValid || v.Payer != p.Address.Hex() {
						t.Fatalf("%s verify = %+v, %v; want valid for %s", method, v, err, p.Address.Hex())
					}
					s, err := f.Settle(ctx, req)
					if err != nil || !s.Success || s.Transaction == "" || s.Network != e.network || s.Payer != p.Address.Hex() {
						t.Fatalf("%s settle = %+v, %v; want success on %s", method, s, err, e.network)
					}
					e.assertPaidOnce(p.Address, payerBefore, sellerBefore)
					again, err := f.Settle(ctx, req)
					if err != nil || !again.Success || again.Transaction != s.Transaction {
						t.Fatalf("%s settle again = %+v, %v; want the first answer with transaction %s", method, again, err, s.Transaction)
					}
					e.assertPaidOnce(p.Address, payerBefore, sellerBefore)
				}

				h, err := f.Health(ctx)
				if err != nil || h.Status != x402.HealthOK || len(h.Networks) != 1 {
					t.Fatalf("health = %+v, %v; want ok with one network", h, err)
				}
				n := h.Networks[0]
				if n.Network != e.network || !n.RPCReachable || n.HeadBlock == 0 || len(n.Wallets) != 2 || n.Wallets[0].Low {
					t.Errorf("network health = %+v, want %s reachable with two wallets that are not low", n, e.network)
				}
			})
		}
	}
}

// assertKinds checks that sup lists exactly the kinds ("<method> v<version>", with the scheme before it when it is
// not exact: "upto ", "batch-settlement ") on network.
func assertKinds(t *testing.T, sup x402.SupportedResponse, want []string, network string) {
	t.Helper()
	var got []string
	for _, k := range sup.Kinds {
		if k.Network != network || !(x402.IsScheme(k.Scheme) || k.Scheme == x402.SchemeBatchSettlement) {
			t.Errorf("kind %+v is not exact, upto or batch-settlement on %s", k, network)
		}
		kind := fmt.Sprintf("%s v%d", k.Extra.AssetTransferMethod, k.X402Version)
		if k.Scheme != x402.SchemeExact {
			kind = k.Scheme + " " + kind
		}
		got = append(got, kind)
	}
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("kinds = [%s], want [%s]", strings.Join(got, ", "), strings.Join(want, ", "))
	}
}

// facilitatorAnswer is a raw answer of a facilitator route.
type facilitatorAnswer struct {
	status int
	header http.Header
	body   []byte
}

// json decodes the answer into a map, failing the test when it is not a JSON object.
func (a facilitatorAnswer) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(a.body, &m); err != nil {
		t.Fatalf("answer %d is not a JSON object: %q", a.status, a.body)
	}
	return m
}

// do sends a raw request to a facilitator route, with the API key when given.
func (e *facilitatorEnv) do(method, path, key string, body []byte) facilitatorAnswer {
	e.t.Helper()
	var header map[string]string
	if key != "" {
		header = map[string]string{"X-Api-Key": key}
	}
	return e.doFrom(method, path, body, header)
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFacilitatorRefusesUnauthorisedMalformedOversizedAndMisroutedRequests(t *testing.T) {
	e := startFacilitatorEnv(t)
	valid := mustJSON(t, e.permit2(e.c.Payers[0]))
	withAmount := func(amount any) []byte {
		var m map[string]any
		if err := json.Unmarshal(valid, &m); err != nil {
			t.Fatal(err)
		}
		rq := m["paymentRequirements"].(map[string]any)
		if amount == nil {
			delete(rq, "amount")
		} else {
			rq["amount"] = amount
		}
		return mustJSON(t, m)
	}
	noAmount, numericAmount := withAmount(nil), withAmount(facilitatorPrice)
	huge := append(bytes.TrimSuffix(valid, []byte("}")), []byte(`,"padding":"`+strings.Repeat("x", 70<<10)+`"}`)...)
	padded := append(bytes.TrimSuffix(valid, []byte("}")), []byte(`,"padding":"`+strings.Repeat("x", 2<<10)+`"}`)...)

	for _, tc := range []struct {
		name, method, path, key string
		body                    []byte
		status                  int
		text, field, allow      string
	}{
		{"no API key", "POST", "/facilitator/verify", "", valid, 401, "x-api-key", "", ""},
		{"a wrong API key", "POST", "/facilitator/verify", "wrong", valid, 401, "x-api-key", "", ""},
		{"the upstream's key at the middleware", "GET", "/middleware/supported", e.key, nil, 401, "x-api-key", "", ""},
		{"no API key even for health", "GET", "/facilitator/health", "", nil, 401, "x-api-key", "", ""},
		{"GET of verify", "GET", "/facilitator/verify", e.key, nil, 405, "use POST", "", "POST"},
		{"POST of supported", "POST", "/facilitator/supported", e.key, valid, 405, "use GET", "", "GET, HEAD"},
		{"an unknown endpoint", "GET", "/facilitator/kinds", e.key, nil, 404, "GET /supported, POST /verify", "", ""},
		{"the facilitator root", "GET", "/facilitator/", e.key, nil, 404, "no facilitator endpoint", "", ""},
		{"an empty body", "POST", "/facilitator/verify", e.key, nil, 400, "the body is empty", "", ""},
		{"a body that is not JSON", "POST", "/facilitator/settle", e.key, []byte(`{"x402Version":2,`), 400, "not-json", "", ""},
		{"a missing requirements amount", "POST", "/facilitator/verify", e.key, noAmount, 400, "paymentRequirements.amount", "paymentRequirements.amount", ""},
		{"an amount sent as a number", "POST", "/facilitator/settle", e.key, numericAmount, 400, "wrong-type", "paymentRequirements.amount", ""},
		{"an unsupported version", "POST", "/facilitator/verify", e.key, bytes.Replace(valid, []byte(`{"x402Version":2`), []byte(`{"x402Version":3`), 1), 400, "x402Version", "x402Version", ""},
		{"a body over the 64KiB default", "POST", "/facilitator/verify", e.key, huge, 413, "at most 65536", "", ""},
		{"a body over the middleware's limit", "POST", "/middleware/settle", middlewareKey, huge, 413, "at most 65536", "", ""},
		{"a body over a max_body_size of 1KiB", "POST", "/small/verify", e.key, padded, 413, "at most 1024", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.t = t
			a := e.do(tc.method, tc.path, tc.key, tc.body)
			if a.status != tc.status {
				t.Fatalf("%s %s = %d %s, want %d", tc.method, tc.path, a.status, a.body, tc.status)
			}
			if ct := a.header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type = %q, want application/json", ct)
			}
			m := a.json(t)
			msg, _ := m["error"].(string)
			if !strings.Contains(msg, tc.text) {
				t.Errorf("error = %q, want it to say %q", msg, tc.text)
			}
			if field, _ := m["field"].(string); field != tc.field {
				t.Errorf("field = %q, want %q", field, tc.field)
			}
			if got := a.header.Get("Allow"); got != tc.allow {
				t.Errorf("Allow = %q, want %q", got, tc.allow)
			}
			for _, secret := range []string{e.key, middlewareKey} {
				if bytes.Contains(a.body, []byte(secret)) {
					t.Errorf("the answer carries an API key: %s", a.body)
				}
			}
		})
	}

	t.Run("facilitatorclient with a wrong key", func(t *testing.T) {
		c, err := facilitatorclient.New(e.srv.URL+"/facilitator", facilitatorclient.WithAPIKey("wrong"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = c.Verify(context.Background(), e.permit2(e.c.Payers[1]))
		var fe *x402.FacilitatorError
		if !errors.As(err, &fe) || fe.Kind != x402.FailureRejected || fe.Status != http.StatusUnauthorized {
			t.Fatalf("verify with a wrong key: %v, want a rejection with HTTP 401", err)
		}
	})
}

func TestFacilitatorRefusesKindsAndNetworksItDoesNotServeWithAFullAnswer(t *testing.T) {
	e := startFacilitatorEnv(t)
	erc2612 := rawFacilitator{base: e.srv.URL + "/erc2612"}
	ctx := context.Background()

	sup, err := erc2612.Supported(ctx)
	if err != nil {
		t.Fatal(err)
	}
	assertKinds(t, sup, []string{"erc2612 v1", "erc2612 v2"}, e.network)
	if len(sup.Extensions) != 0 {
		t.Errorf("extensions = %v, want none: gas sponsoring is a permit2 extension", sup.Extensions)
	}

	payer := e.c.Payers[0]
	permit2 := e.permit2(payer)
	before, sellerBefore := e.balances(payer.Address)
	v, err := erc2612.Verify(ctx, permit2)
	if err != nil || v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements ||
		!strings.Contains(v.InvalidMessage, "does not settle permit2") || v.Payer != payer.Address.Hex() {
		t.Fatalf("verify of permit2 at an erc2612 facilitator = %+v, %v; want a refusal naming permit2 and the payer", v, err)
	}
	s, err := erc2612.Settle(ctx, permit2)
	if err != nil || s.Success || s.ErrorReason != x402.ReasonInvalidPaymentRequirements || s.Network != e.network ||
		s.Payer != payer.Address.Hex() || s.Transaction != "" || s.ErrorMessage == "" {
		t.Fatalf("settle of permit2 at an erc2612 facilitator = %+v, %v; want a full refusal", s, err)
	}
	if after, sellerAfter := e.balances(payer.Address); after.Cmp(before) != 0 || sellerAfter.Cmp(sellerBefore) != 0 {
		t.Errorf("balances moved on a refused payment: payer %s -> %s, seller %s -> %s", before, after, sellerBefore, sellerAfter)
	}

	// The same payment is good where permit2 is served: the refusal was the route's, not the payment's.
	if v, err := (rawFacilitator{e.srv.URL + "/facilitator", e.key}).Verify(ctx, permit2); err != nil || !v.IsValid {
		t.Fatalf("verify at the full facilitator = %+v, %v; want valid", v, err)
	}

	mainnet := rawFacilitator{base: e.srv.URL + "/mainnet"}
	if sup, err := mainnet.Supported(ctx); err != nil || len(sup.Kinds) != 0 || len(sup.Signers) != 0 {
		t.Fatalf("supported of a mainnet-only facilitator over a testnet engine = %+v, %v; want no kinds and no signers", sup, err)
	}
	v, err = mainnet.Verify(ctx, permit2)
	if err != nil || v.IsValid || v.InvalidReason != x402.ReasonInvalidNetwork || !strings.Contains(v.InvalidMessage, e.network) {
		t.Fatalf("verify on an unserved network = %+v, %v; want %s naming %s", v, err, x402.ReasonInvalidNetwork, e.network)
	}
}

// version1Body is the version 1 form of an erc2612 request: the payment names scheme and network, the
// requirement carries maxAmountRequired and the resource, and the network is the version 1 name.
func version1Body(t *testing.T, req x402.VerifyRequest, network string) []byte {
	t.Helper()
	rq := req.PaymentRequirements
	return mustJSON(t, map[string]any{
		"x402Version": 1,
		"paymentPayload": x402.PaymentPayloadV1{
			X402Version: 1, Scheme: rq.Scheme, Network: network, Payload: req.PaymentPayload.Payload,
		},
		"paymentRequirements": x402.PaymentRequirementsV1{
			Scheme: rq.Scheme, Network: network, MaxAmountRequired: rq.Amount, Resource: "https://shop.example/article",
			Description: "an article", MimeType: "text/html", PayTo: rq.PayTo, MaxTimeoutSeconds: rq.MaxTimeoutSeconds,
			Asset: rq.Asset, Extra: &rq.Extra,
		},
	})
}

func TestFacilitatorVerifiesAndSettlesVersion1ERC2612BodiesEmbeddedAndAsMiddleware(t *testing.T) {
	e := startFacilitatorEnv(t)
	for _, route := range []struct {
		name, path, key string
		payer           int
		noMethod        bool // the requirement's extra names no assetTransferMethod, as version 1 clients send it
	}{
		{"embedded", "/facilitator", e.key, 0, false},
		{"middleware", "/middleware", middlewareKey, 1, false},
		{"embedded, no assetTransferMethod", "/facilitator", e.key, 4, true},
		// A failover set routes by the transfer method; without the field, by the one the payload implies.
		{"failover middleware, no assetTransferMethod", "/failover", "", 5, true},
	} {
		t.Run(route.name, func(t *testing.T) {
			e.t = t
			payer := e.c.Payers[route.payer]
			req := e.erc2612(payer)
			if route.noMethod {
				req.PaymentRequirements.Extra.AssetTransferMethod = ""
			}
			body := version1Body(t, req, x402.V1NameTestnet)
			before, sellerBefore := e.balances(payer.Address)

			a := e.do("POST", route.path+"/verify", route.key, body)
			var v x402.VerifyResponse
			if a.status != 200 || json.Unmarshal(a.body, &v) != nil || !v.IsValid || v.Payer != payer.Address.Hex() {
				t.Fatalf("version 1 verify = %d %s, want valid", a.status, a.body)
			}
			a = e.do("POST", route.path+"/settle", route.key, body)
			var s x402.SettleResponse
			if a.status != 200 || json.Unmarshal(a.body, &s) != nil || !s.Success || s.Transaction == "" {
				t.Fatalf("version 1 settle = %d %s, want success", a.status, a.body)
			}
			if s.Network != x402.V1NameTestnet {
				t.Errorf("settle network = %q, want the version 1 name %q", s.Network, x402.V1NameTestnet)
			}
			e.assertPaidOnce(payer.Address, before, sellerBefore)
		})
	}

	t.Run("a version 1 permit2 payment", func(t *testing.T) {
		e.t = t
		req := e.permit2(e.c.Payers[2])
		a := e.do("POST", "/facilitator/verify", e.key, version1Body(t, req, x402.V1NameTestnet))
		var v x402.VerifyResponse
		if a.status != 200 || json.Unmarshal(a.body, &v) != nil || v.IsValid || v.InvalidReason != x402.ReasonInvalidX402Version {
			t.Fatalf("version 1 permit2 verify = %d %s, want %s", a.status, a.body, x402.ReasonInvalidX402Version)
		}
	})

	for _, tc := range []struct {
		name, network, field string
		edit                 func(map[string]any)
	}{
		{"without maxAmountRequired", x402.V1NameTestnet, "paymentRequirements.maxAmountRequired", func(m map[string]any) {
			delete(m["paymentRequirements"].(map[string]any), "maxAmountRequired")
		}},
		{"with a payload signature that is a number", x402.V1NameTestnet, "paymentPayload.payload.signature", func(m map[string]any) {
			m["paymentPayload"].(map[string]any)["payload"].(map[string]any)["signature"] = 65
		}},
		{"without a payment", x402.V1NameTestnet, "paymentPayload", func(m map[string]any) { delete(m, "paymentPayload") }},
		{"on a network version 1 does not name", "base-sepolia", "paymentRequirements.network", func(map[string]any) {}},
	} {
		t.Run("a version 1 body "+tc.name, func(t *testing.T) {
			e.t = t
			var m map[string]any
			if err := json.Unmarshal(version1Body(t, e.erc2612(e.c.Payers[3]), tc.network), &m); err != nil {
				t.Fatal(err)
			}
			tc.edit(m)
			a := e.do("POST", "/facilitator/verify", e.key, mustJSON(t, m))
			if a.status != 400 {
				t.Fatalf("verify = %d %s, want 400", a.status, a.body)
			}
			if got := a.json(t)["field"]; got != tc.field {
				t.Errorf("field = %v, want %q (%s)", got, tc.field, a.body)
			}
		})
	}
}

func TestFacilitatorFailoverSettlesACompatiblePaymentAtTheLiveMemberAndRefusesAnIncompatibleOne(t *testing.T) {
	e := startFacilitatorEnv(t)
	failover := rawFacilitator{base: e.srv.URL + "/failover"}
	ctx := context.Background()

	payer := e.c.Payers[0]
	req := e.erc2612(payer)
	before, sellerBefore := e.balances(payer.Address)
	v, err := failover.Verify(ctx, req)
	if err != nil || !v.IsValid {
		t.Fatalf("verify through the failover set = %+v, %v; want valid from the live member", v, err)
	}
	s, err := failover.Settle(ctx, req)
	if err != nil || !s.Success || s.Transaction == "" {
		t.Fatalf("settle through the failover set = %+v, %v; want success", s, err)
	}
	e.assertPaidOnce(payer.Address, before, sellerBefore)
	if sup, err := failover.Supported(ctx); err != nil {
		t.Fatalf("supported with one member down = %v, want the live member's kinds", err)
	} else {
		assertKinds(t, sup, []string{"erc2612 v1", "erc2612 v2"}, e.network)
	}

	other := e.c.Payers[1]
	permit2 := e.permit2(other)
	before, sellerBefore = e.balances(other.Address)
	for _, endpoint := range []string{"verify", "settle"} {
		a := e.do("POST", "/failover/"+endpoint, "", mustJSON(t, permit2))
		if a.status != http.StatusBadGateway {
			t.Fatalf("%s of permit2 with only an erc2612 member alive = %d %s, want 502", endpoint, a.status, a.body)
		}
		msg, _ := a.json(t)["error"].(string)
		if !strings.Contains(msg, "permit2") || !strings.Contains(msg, "no facilitator") {
			t.Errorf("%s error = %q, want it to say that no facilitator took the permit2 payment", endpoint, msg)
		}
		if endpoint == "settle" && !strings.Contains(msg, "may have settled") {
			t.Errorf("settle error = %q, want the warning that the payment may have settled", msg)
		}
	}
	if after, sellerAfter := e.balances(other.Address); after.Cmp(before) != 0 || sellerAfter.Cmp(sellerBefore) != 0 {
		t.Errorf("balances moved on a payment no member could take")
	}
}

func TestFacilitatorAnswers502And503WhenTheChainCannotBeReached(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	proxy := chaintest.NewFaultProxy(t, c.RPCURL)
	// Node providers put their API key in the URL; it must not reach answers.
	const rpcSecret = "rpc-provider-key-5d1e"
	e := startFacilitatorEnvOn(t, c, proxy.URL+"/v3/"+rpcSecret)
	req := e.permit2(c.Payers[0])
	f := rawFacilitator{e.srv.URL + "/facilitator", e.key}
	if v, err := f.Verify(context.Background(), req); err != nil || !v.IsValid {
		t.Fatalf("verify with the node up = %+v, %v; want valid", v, err)
	}
	// A payer whose funds were just read may be verified from that read (funds_cache); another payer's
	// payment needs the node.
	req = e.permit2(c.Payers[1])

	proxy.SetDecide(func(string) chaintest.Fault { return chaintest.Drop })
	for _, tc := range []struct {
		method, endpoint string
		status           int
		text             string
	}{
		{"POST", "verify", http.StatusBadGateway, "unreachable"},
		// The node could not be asked what the settlement needs: surely nothing was sent, and the answer says so.
		{"POST", "settle", http.StatusServiceUnavailable, "nothing was sent"},
		{"GET", "health", http.StatusServiceUnavailable, ""},
	} {
		a := e.do(tc.method, "/facilitator/"+tc.endpoint, e.key, mustJSON(t, req))
		if a.status != tc.status {
			t.Fatalf("%s with the node down = %d %s, want %d", tc.endpoint, a.status, a.body, tc.status)
		}
		if bytes.Contains(a.body, []byte(rpcSecret)) || !bytes.Contains(a.body, []byte(strings.TrimPrefix(proxy.URL, "http://"))) {
			t.Errorf("%s answer = %s, want the RPC node named by its host only", tc.endpoint, a.body)
		}
		m := a.json(t)
		if tc.endpoint == "health" {
			if m["status"] != x402.HealthDown {
				t.Errorf("health = %s, want status down", a.body)
			}
			continue
		}
		if sent, ok := m["sent"].(bool); tc.endpoint == "settle" && (!ok || sent || a.header.Get("Retry-After") == "") {
			t.Errorf("settle with the node down = %s (Retry-After %q); want \"sent\": false and a Retry-After", a.body, a.header.Get("Retry-After"))
		}
		if msg, _ := m["error"].(string); !strings.Contains(msg, tc.text) {
			t.Errorf("%s error = %q, want it to say %q", tc.endpoint, msg, tc.text)
		}
	}
	// A middleware over it answers the same for an upstream that answers 5xx.
	a := e.do("GET", "/middleware/health", middlewareKey, nil)
	if a.status != http.StatusServiceUnavailable || a.json(t)["status"] != x402.HealthDown {
		t.Fatalf("middleware health over a down facilitator = %d %s, want 503 down", a.status, a.body)
	}

	proxy.SetDecide(nil)
	if v, err := f.Verify(context.Background(), req); err != nil || !v.IsValid {
		t.Fatalf("verify with the node back = %+v, %v; want valid", v, err)
	}
}

// scrape reads Caddy's metrics endpoint into "name{labels}" -> value, labels as Prometheus writes them.
func (e *facilitatorEnv) scrape() map[string]string {
	e.t.Helper()
	a := e.do("GET", "/metrics", "", nil)
	if a.status != 200 {
		e.t.Fatalf("GET /metrics = %d %s", a.status, a.body)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(a.body), "\n") {
		if strings.HasPrefix(line, "caddy_x402_") {
			if i := strings.LastIndexByte(line, ' '); i > 0 {
				out[line[:i]] = line[i+1:]
			}
		}
	}
	return out
}

func TestFacilitatorMetricsShowOnCaddysMetricsEndpointAndSurviveAReload(t *testing.T) {
	e := startFacilitatorEnv(t)
	ctx := context.Background()
	f := rawFacilitator{e.srv.URL + "/facilitator", e.key}
	req := e.permit2(e.c.Payers[0])
	if v, err := f.Verify(ctx, req); err != nil || !v.IsValid {
		t.Fatalf("verify = %+v, %v", v, err)
	}
	if s, err := f.Settle(ctx, req); err != nil || !s.Success {
		t.Fatalf("settle = %+v, %v", s, err)
	}
	if v, err := (rawFacilitator{base: e.srv.URL + "/erc2612"}).Verify(ctx, req); err != nil || v.IsValid {
		t.Fatalf("verify of permit2 at the erc2612 route = %+v, %v; want a refusal", v, err)
	}
	e.do("POST", "/facilitator/verify", "wrong-key", mustJSON(t, req))

	got := e.scrape()
	for name, want := range map[string]string{
		`caddy_x402_facilitator_requests_total{code="200",endpoint="verify"}`:                            "2",
		`caddy_x402_facilitator_requests_total{code="200",endpoint="settle"}`:                            "1",
		`caddy_x402_facilitator_requests_total{code="401",endpoint="verify"}`:                            "1",
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="valid"}`:                        "1",
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="invalid_payment_requirements"}`: "1",
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="settled"}`:                      "1",
		`caddy_x402_verify_duration_seconds_count{handler="facilitator"}`:                                "1",
		`caddy_x402_settle_duration_seconds_count{handler="facilitator"}`:                                "1",
		`caddy_x402_wallets{network="` + e.network + `"}`:                                                "2",
		`caddy_x402_wallets_in_use{network="` + e.network + `"}`:                                         "0",
	} {
		if got[name] != want {
			t.Errorf("%s = %q, want %q", name, got[name], want)
		}
	}

	// A reload gives the new config a fresh registry; the handlers register again and the engine, kept in
	// the app's pool, still settles.
	e.srv.load(e.caddyfile)
	if _, err := f.Supported(ctx); err != nil {
		t.Fatalf("supported after the reload: %v", err)
	}
	other := e.c.Payers[1]
	req = e.erc2612(other)
	before, sellerBefore := e.balances(other.Address)
	if s, err := f.Settle(ctx, req); err != nil || !s.Success {
		t.Fatalf("settle after the reload = %+v, %v", s, err)
	}
	e.assertPaidOnce(other.Address, before, sellerBefore)
	got = e.scrape()
	for name, want := range map[string]string{
		`caddy_x402_facilitator_requests_total{code="200",endpoint="supported"}`: "1",
		`caddy_x402_facilitator_requests_total{code="200",endpoint="settle"}`:    "1",
		`caddy_x402_wallets{network="` + e.network + `"}`:                        "2",
	} {
		if got[name] != want {
			t.Errorf("after the reload %s = %q, want %q", name, got[name], want)
		}
	}
}

func TestFacilitatorServesTheDevChainWhenNothingElseIsConfigured(t *testing.T) {
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			listen 127.0.0.1:0
		}
	}
}

{{ADDR}} {
	handle_path /facilitator/* {
		x402_facilitator
	}
}
`)
	f := rawFacilitator{base: srv.URL + "/facilitator"}
	sup, err := f.Supported(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	assertKinds(t, sup, []string{"permit2 v2", "upto permit2 v2", "eip3009 v1", "eip3009 v2", "erc2612 v1", "erc2612 v2", "batch-settlement eip3009 v2"}, x402.NetworkTestnet)
	if n := len(sup.Signers[x402.NetworkTestnet]); n != 4 {
		t.Errorf("%d signers on the dev chain, want its 4 settlement wallets", n)
	}
	h, err := f.Health(context.Background())
	if err != nil || len(h.Networks) != 1 || !h.Networks[0].RPCReachable {
		t.Fatalf("health = %+v, %v; want the dev chain reachable", h, err)
	}
}

func TestFacilitatorRefusesToStartWithNothingToServe(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	erc2612Only := `{
	x402 {
		network eip155:72344 {
			rpc ` + c.RPCURL + `
			asset ` + c.Token.Hex() + `
			wallet_keys ` + hexKey(c.Wallets[0]) + `
			methods erc2612
		}
		journal {{DATA}}/journal.db
	}
}
`
	for _, tc := range []struct{ name, global, handler, want string }{
		{"without a network or an upstream", "", "x402_facilitator", "configure a network in the x402 global option"},
		{"for a network the app does not settle on", erc2612Only, "x402_facilitator {\n\t\tnetworks eip155:723487\n\t}",
			"network eip155:723487 is not configured in the x402 app"},
		{"for a kind the app does not offer", erc2612Only, "x402_facilitator {\n\t\tkind permit2\n\t\topen\n\t}", "leave nothing to serve"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			text := "http://" + freeAddr(t) + " {\n\t" + tc.handler + "\n}\n"
			if tc.global != "" {
				text = strings.ReplaceAll(tc.global, "{{DATA}}", dir) + "\n" + text
			}
			caddyMu.Lock()
			defer caddyMu.Unlock()
			err := caddy.Load(adaptCaddyfile(t, text, dir), true)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("Caddy started, want it to refuse:\n%s", text)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("load error = %v, want it to say %q", err, tc.want)
			}
		})
	}
}
