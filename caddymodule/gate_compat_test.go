package caddymodule_test

import (
	"context"
	"encoding/json"
	"math/big"
	"net/http"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Caddy and client integration: version 1 clients, browsers, CORS, placeholders, prices and accept blocks,
// gas sponsoring, reloads.

func TestAVersion1ClientReadsTheV1BodyPaysERC2612WithXPaymentAndGetsXPaymentResponse(t *testing.T) {
	env := newGateEnv(t, gateSetup{gate: "\t\tv1_body\n"})
	payer := env.c.Payers[0]
	before := env.balances(payer)

	a := env.get("/v1")
	var body x402.PaymentRequiredV1
	if err := json.Unmarshal([]byte(a.body), &body); err != nil || a.status != http.StatusPaymentRequired || body.X402Version != 1 {
		t.Fatalf("unpaid answer = %d %q, want 402 with a version 1 body (%v)", a.status, a.body, err)
	}
	if len(body.Accepts) != 1 || body.Accepts[0].Network != x402.V1NameTestnet || body.Accepts[0].MaxAmountRequired != "10000" ||
		body.Accepts[0].Resource != env.srv.URL+"/v1" || body.Accepts[0].Extra == nil || body.Accepts[0].Extra.Spender == "" {
		t.Fatalf("version 1 accepts = %+v, want one erc2612 offer on %q with the resource and a spender", body.Accepts, x402.V1NameTestnet)
	}
	if pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired)); err != nil || pr.X402Version != 2 {
		t.Fatalf("PAYMENT-REQUIRED = %+v (%v), want version 2 beside the version 1 body", pr, err)
	}

	// The client signs what the version 1 body offers and pays in X-PAYMENT.
	reg := x402.NewRegistry()
	rq, _, err := reg.RequirementsFromV1(body.Accepts[0])
	if err != nil {
		t.Fatal(err)
	}
	v2 := env.signERC2612(payer, rq)
	v1, err := reg.PaymentPayloadToV1(v2)
	if err != nil {
		t.Fatal(err)
	}
	paid := env.get("/v1", x402.HeaderXPayment, gateEncode(t, v1))
	if paid.status != http.StatusOK || paid.body != "paid content" {
		t.Fatalf("paid answer = %d %q, want 200", paid.status, paid.body)
	}
	resp, err := x402.DecodeSettleResponse(paid.header.Get(x402.HeaderXPaymentResponse))
	if err != nil || !resp.Success || resp.Network != x402.V1NameTestnet {
		t.Fatalf("X-PAYMENT-RESPONSE = %+v (%v), want success on %q", resp, err, x402.V1NameTestnet)
	}
	env.assertPaid(payer, before, 1)
	// The version 1 answer to a used payment is in version 1 form too.
	again := env.get("/v1", x402.HeaderXPayment, gateEncode(t, v1))
	if err := json.Unmarshal([]byte(again.body), &body); err != nil || again.status != http.StatusPaymentRequired || body.X402Version != 1 ||
		!strings.HasPrefix(body.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("used payment = %d %q, want a version 1 402 saying %s", again.status, again.body, x402.ReasonPaymentAlreadyUsed)
	}
}

func TestABrowserGetsAPaywallPageThatShowsWhatToPayAndHow(t *testing.T) {
	env := newGateEnv(t, gateSetup{gate: "\t\tdescription \"The premium <b>report</b>\"\n"})
	a := env.get("/report", "Accept", "text/html,application/xhtml+xml;q=0.9")
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.header.Get("Content-Type"), "text/html") {
		t.Fatalf("browser answer = %d %s, want a 402 page", a.status, a.header.Get("Content-Type"))
	}
	for _, want := range []string{"0.01 Stable Coin", env.payTo.Hex(), env.net, "permit2", "erc2612", "PAYMENT-SIGNATURE",
		`id="x402-payment-required"`, "The premium &lt;b&gt;report&lt;/b&gt;"} {
		if !strings.Contains(a.body, want) {
			t.Errorf("the paywall page does not show %q", want)
		}
	}
	if strings.Contains(a.body, "<b>report</b>") {
		t.Error("the paywall page does not escape the configured description")
	}
	if a.header.Get(x402.HeaderPaymentRequired) == "" {
		t.Error("the paywall page comes without PAYMENT-REQUIRED")
	}
}

func TestPaidCrossOriginAnswersExposeThePaymentHeadersToTheOrigin(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer), "Origin", "https://app.example")
	if got := a.header.Get("Access-Control-Expose-Headers"); a.status != http.StatusOK || !strings.Contains(got, x402.HeaderPaymentResponse) {
		t.Fatalf("paid answer = %d with Access-Control-Expose-Headers %q, want PAYMENT-RESPONSE exposed", a.status, got)
	}
	if got := a.header.Get("Access-Control-Allow-Origin"); got != "*" {
		t.Errorf("paid answer: Access-Control-Allow-Origin %q, want *", got)
	}
}

func TestPlaceholdersCarryThePaymentToTheUpstreamAndTheOutcomeToTheResponse(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{site: `header >X-Paid-Status {http.x402.status}
	header >X-Paid-Tx {http.x402.transaction}
	reverse_proxy ` + up.Addr + ` {
		header_up X-Payer {http.x402.payer}
		header_up X-Pay-Network {http.x402.network}
		header_up X-Pay-Amount {http.x402.amount}
		header_up X-Pay-Status {http.x402.status}
	}`})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	if a.status != http.StatusOK {
		t.Fatalf("paid answer = %d %q", a.status, a.body)
	}
	h := up.lastHeader()
	if !x402.SameAddress(h.Get("X-Payer"), payer.Address.Hex()) || h.Get("X-Pay-Network") != env.net ||
		h.Get("X-Pay-Amount") != "10000" || h.Get("X-Pay-Status") != "verified" {
		t.Errorf("the upstream saw payer %q, network %q, amount %q, status %q; want the verified payment",
			h.Get("X-Payer"), h.Get("X-Pay-Network"), h.Get("X-Pay-Amount"), h.Get("X-Pay-Status"))
	}
	if a.header.Get("X-Paid-Status") != "settled" || a.header.Get("X-Paid-Tx") != settleResponse(t, a).Transaction {
		t.Errorf("response placeholders: status %q, tx %q; want settled and the settlement transaction",
			a.header.Get("X-Paid-Status"), a.header.Get("X-Paid-Tx"))
	}
	unpaid := env.get("/")
	if unpaid.header.Get("X-Paid-Status") != "no-payment" {
		t.Errorf("unpaid request: {http.x402.status} = %q, want no-payment", unpaid.header.Get("X-Paid-Status"))
	}
}

func TestAPriceInDollarsAndAcceptBlocksBecomeTheOffersAndEachCanBePaid(t *testing.T) {
	env := newGateEnv(t, gateSetup{}) // for the chain and its token; the config follows
	env.srv.load(`{
	x402 {
		network ` + env.net + ` {
			rpc ` + env.c.RPCURL + `
			asset ` + env.c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(env.c.Wallets[0]) + `
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to ` + env.payTo.Hex() + `
		accept {
			price $0.025
			asset_transfer_method erc2612
		}
	}
	respond "paid content"
}
`)
	pr := env.offer("/")
	var got []string
	for _, rq := range pr.Accepts {
		got = append(got, rq.Extra.AssetTransferMethod+"="+rq.Amount)
	}
	if strings.Join(got, " ") != "permit2=10000 erc2612=10000 erc2612=25000" {
		t.Fatalf("offers = %v, want the gate's price for both methods, then the accept block's", got)
	}
	payer := env.c.Payers[0]
	sellerBefore := env.c.TokenBalance(env.payTo)
	a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, env.signERC2612(payer, pr.Accepts[2])))
	if a.status != http.StatusOK {
		t.Fatalf("paying the accept block's offer = %d %q", a.status, a.body)
	}
	if got := new(big.Int).Sub(env.c.TokenBalance(env.payTo), sellerBefore); got.Int64() != 25000 {
		t.Fatalf("the seller received %s, want 25000", got)
	}
}

func TestAPayerWithoutGasOrPermit2AllowancePaysThroughTheGasSponsoringExtension(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	payer := env.c.PayerNoGas
	before := env.balances(payer)
	pr := env.offer("/")
	p := env.signPermit2(payer, pr.Accepts[0])
	p.Extensions = pr.Extensions
	if err := chain.AddGasSponsoring(&p, payer.Key, env.c.ChainID, "", "", env.c.TokenNonce(payer.Address)); err != nil {
		t.Fatal(err)
	}
	a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p))
	if a.status != http.StatusOK || !settleResponse(t, a).Success {
		t.Fatalf("gas-less payer = %d %q, want served and settled", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
	if env.c.ETHBalance(payer.Address).Sign() != 0 {
		t.Error("the gas-less payer paid gas")
	}
}

// A gate whose remote facilitator is down has no way to pay to offer: it answers 503 with Retry-After, not a 402
// with an empty accepts list (which invites a payment no one can make), and Caddy keeps running.
func TestARemoteFacilitatorDownAtStartAnswers503WithRetryAfterNotAnEmptyOffer(t *testing.T) {
	env := newGateEnv(t, gateSetup{remote: true, facURL: "http://" + freeAddr(t)})
	for _, accept := range []string{"application/json", "text/html"} {
		a := env.get("/", "Accept", accept)
		if a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") == "" ||
			a.header.Get(x402.HeaderPaymentRequired) != "" || !strings.Contains(a.body, "facilitator") {
			t.Fatalf("Accept %s: answer = %d Retry-After %q PAYMENT-REQUIRED %q %q, want 503 with Retry-After, no offer, "+
				"and a body naming the facilitator", accept, a.status, a.header.Get("Retry-After"), a.header.Get(x402.HeaderPaymentRequired), a.body)
		}
	}
}

func TestPaymentsServedBeforeAConfigReloadStayServed(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	header := env.permit2Header("/", payer)
	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("paid answer = %d", a.status)
	}
	env.reload(gateSetup{site: `respond "new content"`})
	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
		t.Fatalf("the used payment after a reload = %d %q, want 402", a.status, a.body)
	}
	payer2 := env.c.Payers[1]
	env.approvePermit2(payer2)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer2)); a.status != http.StatusOK || a.body != "new content" {
		t.Fatalf("a new payment after the reload = %d %q, want the new content", a.status, a.body)
	}
}

// A version 1 payment names no asset. With two erc2612 offers at one price in two tokens, the payment pays the
// offer whose token its permit is signed for (the signature recovers to the payer only under that token's
// EIP-712 domain), not the first offer with its price.
func TestAVersion1PaymentPaysTheOfferOfTheTokenItsPermitIsSignedFor(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	second := c.DeployToken(big.NewInt(1_000_000_000))
	env := startGateOn(t, c, gateSetup{
		network: "\t\t\tasset " + second.Hex() + " name \"Stable Coin\" version 1 decimals 6\n",
		gate:    "\t\tv1_body\n\t\taccept {\n\t\t\tasset " + second.Hex() + "\n\t\t\tasset_transfer_method erc2612\n\t\t}\n",
	})
	payer := c.Payers[0]
	a := env.get("/v1")
	var body x402.PaymentRequiredV1
	if err := json.Unmarshal([]byte(a.body), &body); err != nil || a.status != http.StatusPaymentRequired {
		t.Fatalf("unpaid answer = %d %q (%v)", a.status, a.body, err)
	}
	var offer *x402.PaymentRequirementsV1
	for i := range body.Accepts {
		if x402.SameAddress(body.Accepts[i].Asset, second.Hex()) {
			offer = &body.Accepts[i]
		}
	}
	if len(body.Accepts) != 2 || offer == nil {
		t.Fatalf("version 1 accepts = %+v; want two erc2612 offers, one in %s", body.Accepts, second.Hex())
	}
	reg := x402.NewRegistry()
	rq, _, err := reg.RequirementsFromV1(*offer)
	if err != nil {
		t.Fatal(err)
	}
	p, err := chain.SignERC2612Payment(payer.Key, rq, c.ChainID, chain.ERC2612Options{Now: env.chainNow(), TokenNonce: tokenNonce(t, c, second, payer.Address)})
	if err != nil {
		t.Fatal(err)
	}
	v1, err := reg.PaymentPayloadToV1(p)
	if err != nil {
		t.Fatal(err)
	}
	firstBefore, secondBefore := c.TokenBalance(payer.Address), tokenBalance(t, c, second, payer.Address)
	paid := env.get("/v1", x402.HeaderXPayment, gateEncode(t, v1))
	if paid.status != http.StatusOK || paid.body != "paid content" {
		t.Fatalf("a version 1 payment in the second token = %d %q; want 200", paid.status, paid.body)
	}
	if got := new(big.Int).Sub(secondBefore, tokenBalance(t, c, second, payer.Address)); got.Cmp(big.NewInt(gatePrice)) != 0 {
		t.Errorf("the payer paid %s of the second token, want %d", got, gatePrice)
	}
	if got := c.TokenBalance(payer.Address); got.Cmp(firstBefore) != 0 {
		t.Errorf("the payer's first-token balance moved from %s to %s", firstBefore, got)
	}
}

// tokenNonce and tokenBalance read a token other than the chain's default one.
func tokenNonce(t *testing.T, c *chaintest.Chain, token, owner common.Address) *big.Int {
	t.Helper()
	n, err := chain.CallTokenUint(context.Background(), c.Client, token, "nonces", owner)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func tokenBalance(t *testing.T, c *chaintest.Chain, token, owner common.Address) *big.Int {
	t.Helper()
	n, err := chain.CallTokenUint(context.Background(), c.Client, token, "balanceOf", owner)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
