package facilitatorserver_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

const (
	apiKey = "sk_test_7d3f0c9b2a"
	price  = 10_000 // raw units: 0.01 of a 6-decimal token
)

// seller is who the test payments are for.
var seller = common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1")

// serve runs srv over HTTP and returns a facilitatorclient of it presenting key ("" for none).
func serve(t *testing.T, srv *facilitatorserver.Server, key string) (*facilitatorclient.Client, string) {
	t.Helper()
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	var opts []facilitatorclient.Option
	if key != "" {
		opts = append(opts, facilitatorclient.WithAPIKey(key))
	}
	c, err := facilitatorclient.New(ts.URL, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return c, ts.URL
}

// engine is the embedded facilitator on a simulated chain, with an in-memory journal.
func engine(t *testing.T) (*chaintest.Chain, *chain.Facilitator, string) {
	t.Helper()
	c := chaintest.New(t, chaintest.WithPromptCommit())
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	network := x402.EIP155(c.ChainID.Uint64())
	nc := chain.NetworkConfig{
		Network: network, Backend: c.Client,
		Assets:      []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		ReceiptPoll: 2 * time.Millisecond,
	}
	for _, w := range c.Wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatalf("starting the engine: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	return c, f, network
}

func TestARealPermit2PaymentVerifiesAndSettlesThroughTheClientAndMovesTheAmountOnce(t *testing.T) {
	c, f, network := engine(t)
	srv, err := facilitatorserver.New(f, facilitatorserver.Options{APIKeys: []string{apiKey}})
	if err != nil {
		t.Fatal(err)
	}
	client, _ := serve(t, srv, apiKey)
	ctx := context.Background()

	supported, err := client.Supported(ctx)
	if err != nil {
		t.Fatalf("supported: %v", err)
	}
	if !slices.ContainsFunc(supported.Kinds, func(k x402.SupportedKind) bool {
		return k.X402Version == x402.Version2 && k.Network == network && k.Extra.AssetTransferMethod == x402.TransferPermit2
	}) {
		t.Fatalf("supported = %+v, want permit2 on %s", supported.Kinds, network)
	}

	payer := c.Payers[0]
	c.Approve(payer, contracts.Permit2Address, new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1)))
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: network, Amount: big.NewInt(price).String(), Asset: c.Token.Hex(),
		PayTo: seller.Hex(), MaxTimeoutSeconds: 3600,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"},
	}
	payload, err := chain.SignPermit2Payment(payer.Key, rq, c.ChainID, chain.Permit2Options{Now: time.Unix(int64(c.HeadTime()), 0)})
	if err != nil {
		t.Fatal(err)
	}
	req := x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: payload, PaymentRequirements: rq}
	payerBefore, sellerBefore := c.TokenBalance(payer.Address), c.TokenBalance(seller)
	sentBefore := walletTxs(c)

	verified, err := client.Verify(ctx, req)
	if err != nil || !verified.IsValid || verified.Payer != payer.Address.Hex() {
		t.Fatalf("verify = %+v, %v; want valid, paid by %s", verified, err, payer.Address.Hex())
	}
	if walletTxs(c) != sentBefore {
		t.Fatal("verifying sent a transaction")
	}
	settled, err := client.Settle(ctx, req)
	if err != nil || !settled.Success || !x402.IsTxHash(settled.Transaction) || settled.Network != network || settled.Payer != payer.Address.Hex() {
		t.Fatalf("settle = %+v, %v; want success with a transaction on %s", settled, err, network)
	}
	if got := new(big.Int).Sub(payerBefore, c.TokenBalance(payer.Address)); got.Int64() != price {
		t.Errorf("the payer paid %s, want %d", got, price)
	}
	if got := new(big.Int).Sub(c.TokenBalance(seller), sellerBefore); got.Int64() != price {
		t.Errorf("the seller got %s, want %d", got, price)
	}
	sent := walletTxs(c)

	// The same payment presented again is answered from the journal: the same transaction, nothing sent.
	again, err := client.Settle(ctx, req)
	if err != nil || again.Transaction != settled.Transaction {
		t.Fatalf("settling again = %+v, %v; want the first answer's transaction %s", again, err, settled.Transaction)
	}
	time.Sleep(50 * time.Millisecond) // blocks keep coming: a second transaction would be mined by now
	if walletTxs(c) != sent {
		t.Errorf("settling again sent %d more transactions, want none", walletTxs(c)-sent)
	}
	if n := c.CountTokenTransfers(payer.Address, seller); n != 1 {
		t.Errorf("%d transfers from the payer to the seller, want 1", n)
	}
	if got := new(big.Int).Sub(payerBefore, c.TokenBalance(payer.Address)); got.Int64() != price {
		t.Errorf("after settling again the payer has paid %s, want %d", got, price)
	}
}

// walletTxs counts the transactions the settlement wallets have sent.
func walletTxs(c *chaintest.Chain) uint64 {
	var n uint64
	for _, w := range c.Wallets {
		n += c.TxCount(w.Address)
	}
	return n
}

// countingFacilitator answers every payment as valid and settled, and counts what it was asked.
type countingFacilitator struct {
	mu                                sync.Mutex
	supported, verify, settle, health int
}

func (f *countingFacilitator) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.supported + f.verify + f.settle + f.health
}

func (f *countingFacilitator) payments() (verified, settled int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.verify, f.settle
}

func (f *countingFacilitator) Supported(context.Context) (x402.SupportedResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.supported++
	return x402.SupportedResponse{Kinds: []x402.SupportedKind{
		{X402Version: 2, Scheme: x402.SchemeExact, Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2}},
		{X402Version: 2, Scheme: x402.SchemeExact, Network: x402.NetworkMainnet, Extra: x402.Extra{AssetTransferMethod: x402.TransferERC2612}},
	}, Extensions: []string{}, Signers: map[string][]string{}}, nil
}

func (f *countingFacilitator) Verify(_ context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.verify++
	return x402.VerifyResponse{IsValid: true, Payer: x402.ClaimedPayer(req)}, nil
}

func (f *countingFacilitator) Settle(_ context.Context, req x402.SettleRequest) (x402.SettleResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle++
	return x402.SettleResponse{Success: true, Transaction: "0x" + strings.Repeat("ab", 32), Network: req.PaymentRequirements.Network, Payer: x402.ClaimedPayer(req)}, nil
}

func (f *countingFacilitator) Health(context.Context) (x402.HealthResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.health++
	return x402.HealthResponse{Status: x402.HealthOK}, nil
}

const (
	payerAddress = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"
	allowedPayTo = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
	otherPayTo   = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"
	minAmount    = "1000"
	maxBody      = 4096
)

// payment is a permit2 payment (its signature unchecked: nothing behind a refusal reads it) on network for
// amount to payTo.
func payment(network, method, amount, payTo string) x402.VerifyRequest {
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: network, Amount: amount, Asset: "0x5FbDB2315678afecb367f032d93F642f64180aa3",
		PayTo: payTo, MaxTimeoutSeconds: 60, Extra: x402.Extra{AssetTransferMethod: method, Name: "Stable Coin", Version: "1"},
	}
	sig := "0x" + strings.Repeat("11", 65)
	pl := x402.ExactEVMPayload{Signature: sig}
	if method == x402.TransferPermit2 {
		pl.Permit2Authorization = &x402.Permit2Authorization{
			From: strings.ToLower(payerAddress), Permitted: x402.TokenPermissions{Token: rq.Asset, Amount: amount},
			Spender: "0x402085c248EeA27D92E8b30b2C58ed07f9E20001", Nonce: "1", Deadline: "1767225660",
			Witness: x402.Permit2Witness{To: payTo, ValidAfter: "1767225000"},
		}
	} else {
		pl.Authorization = &x402.EIP2612Authorization{
			From: strings.ToLower(payerAddress), To: "0x90F79bf6EB2c4f870365E785982E1f101E93b906", Value: amount,
			ValidAfter: "0", ValidBefore: "1767225660", Nonce: "0",
		}
	}
	return x402.VerifyRequest{
		X402Version:         x402.Version2,
		PaymentPayload:      x402.PaymentPayload{X402Version: x402.Version2, Accepted: rq, Payload: pl},
		PaymentRequirements: rq,
	}
}

// refusingServer is a server in front of a counting facilitator that serves permit2 on testnet, for payments of
// at least minAmount to allowedPayTo, to callers with the API key, bodies up to maxBody bytes.
func refusingServer(t *testing.T) (*countingFacilitator, *facilitatorserver.Server) {
	t.Helper()
	terms, err := facilitatorserver.ParseTerms(minAmount, []string{allowedPayTo})
	if err != nil {
		t.Fatal(err)
	}
	behind := &countingFacilitator{}
	srv, err := facilitatorserver.New(behind, facilitatorserver.Options{
		Kinds: []string{x402.TransferPermit2}, Networks: []string{x402.NetworkTestnet},
		APIKeys: []string{apiKey}, MaxBodySize: maxBody, Terms: terms,
	})
	if err != nil {
		t.Fatal(err)
	}
	return behind, srv
}

// Requests the server refuses as requests get the HTTP status that says why, and the facilitator behind is
// never asked.
func TestRequestsTheServerRefusesNeverReachTheFacilitatorBehind(t *testing.T) {
	behind, srv := refusingServer(t)
	_, base := serve(t, srv, apiKey)
	good, err := json.Marshal(payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(good, &doc); err != nil {
		t.Fatal(err)
	}
	delete(doc["paymentRequirements"].(map[string]any), "payTo")
	withoutPayTo, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		method     string
		path       string
		key        string
		body       []byte
		chunked    bool // no Content-Length: the limit must hold while reading
		wantStatus int
		wantAllow  string
		wantField  string // the field a 400 names
		wantInBody string
	}{
		{name: "no API key", method: "POST", path: "/verify", body: good, wantStatus: 401, wantInBody: "x-api-key"},
		{name: "a wrong API key", method: "POST", path: "/settle", key: apiKey + "x", body: good, wantStatus: 401},
		{name: "a wrong API key on /supported", method: "GET", path: "/supported", key: "nope", wantStatus: 401},
		{name: "a body that is no JSON", method: "POST", path: "/verify", key: apiKey, body: []byte("{"), wantStatus: 400},
		{name: "a body without paymentRequirements.payTo", method: "POST", path: "/settle", key: apiKey, body: withoutPayTo, wantStatus: 400, wantField: "paymentRequirements.payTo"},
		{name: "a body over the limit", method: "POST", path: "/verify", key: apiKey, body: padded(good, maxBody+1), wantStatus: 413},
		{name: "a body over the limit without a length", method: "POST", path: "/settle", key: apiKey, body: padded(good, maxBody+1), chunked: true, wantStatus: 413},
		{name: "GET /verify", method: "GET", path: "/verify", key: apiKey, wantStatus: 405, wantAllow: "POST"},
		{name: "PUT /settle", method: "PUT", path: "/settle", key: apiKey, body: good, wantStatus: 405, wantAllow: "POST"},
		{name: "POST /supported", method: "POST", path: "/supported", key: apiKey, body: good, wantStatus: 405, wantAllow: "GET, HEAD"},
		{name: "DELETE /health", method: "DELETE", path: "/health", key: apiKey, wantStatus: 405, wantAllow: "GET, HEAD"},
		{name: "a path that names no endpoint", method: "POST", path: "/verify/", key: apiKey, body: good, wantStatus: 404},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body *bytes.Reader
			if tc.body != nil {
				body = bytes.NewReader(tc.body)
			}
			var r *http.Request
			if body == nil {
				r, err = http.NewRequest(tc.method, base+tc.path, nil)
			} else {
				r, err = http.NewRequest(tc.method, base+tc.path, body)
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.chunked {
				r.ContentLength = -1
				r.Body = io.NopCloser(body)
			}
			if tc.key != "" {
				r.Header.Set("x-api-key", tc.key)
			}
			r.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(r)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var answer struct {
				Error string `json:"error"`
				Field string `json:"field"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
				t.Fatalf("the answer is no JSON error: %v", err)
			}
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("HTTP %d (%s), want %d", resp.StatusCode, answer.Error, tc.wantStatus)
			}
			if got := resp.Header.Get("Allow"); got != tc.wantAllow {
				t.Errorf("Allow = %q, want %q", got, tc.wantAllow)
			}
			if answer.Field != tc.wantField {
				t.Errorf("field = %q (%s), want %q", answer.Field, answer.Error, tc.wantField)
			}
			if answer.Error == "" || !strings.Contains(answer.Error, tc.wantInBody) {
				t.Errorf("error = %q, want one saying %q", answer.Error, tc.wantInBody)
			}
			if strings.Contains(answer.Error, apiKey) {
				t.Errorf("the answer echoes the API key: %q", answer.Error)
			}
			if n := behind.calls(); n != 0 {
				t.Fatalf("the facilitator behind was called %d times, want never", n)
			}
		})
	}
}

// padded is body with spaces added until it is n bytes: still the same JSON document, only too large.
func padded(body []byte, n int) []byte {
	return append(bytes.Repeat([]byte(" "), n-len(body)), body...)
}

// Payments the server does not serve get a full refusal answer through the client, with the payer named, and
// the facilitator behind is never asked; payments it serves are passed on.
func TestPaymentsOutsideTheServedKindsNetworksAndTermsAreRefusedBeforeTheFacilitatorIsAsked(t *testing.T) {
	behind, srv := refusingServer(t)
	client, _ := serve(t, srv, apiKey)
	ctx := context.Background()
	for _, tc := range []struct {
		name       string
		req        x402.VerifyRequest
		wantReason string
		wantInText string
	}{
		{"a network not served", payment(x402.NetworkMainnet, x402.TransferPermit2, "10000", allowedPayTo), x402.ReasonInvalidNetwork, "is not served by this facilitator (it serves " + x402.NetworkTestnet + ")"},
		{"an unknown network", payment("eip155:1", x402.TransferPermit2, "10000", allowedPayTo), x402.ReasonInvalidNetwork, `network "eip155:1"`},
		{"a kind not served", payment(x402.NetworkTestnet, x402.TransferERC2612, "10000", allowedPayTo), x402.ReasonInvalidPaymentRequirements, "does not settle erc2612 payments (it settles permit2)"},
		{"an amount below min_amount", payment(x402.NetworkTestnet, x402.TransferPermit2, "999", allowedPayTo), x402.ReasonInvalidPaymentRequirements, "below min_amount 1000"},
		{"another recipient than pay_to", payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", otherPayTo), x402.ReasonInvalidPaymentRequirements, "is not among the allowed recipients"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			verified, err := client.Verify(ctx, tc.req)
			if err != nil {
				t.Fatalf("verify: %v", err)
			}
			if verified.IsValid || verified.InvalidReason != tc.wantReason || !strings.Contains(verified.InvalidMessage, tc.wantInText) || verified.Payer != payerAddress {
				t.Errorf("verify = %+v, want invalid for %s saying %q, payer %s", verified, tc.wantReason, tc.wantInText, payerAddress)
			}
			settled, err := client.Settle(ctx, tc.req)
			if err != nil {
				t.Fatalf("settle: %v", err)
			}
			if settled.Success || settled.Transaction != "" || settled.ErrorReason != tc.wantReason || !strings.Contains(settled.ErrorMessage, tc.wantInText) ||
				settled.Payer != payerAddress || settled.Network != tc.req.PaymentRequirements.Network {
				t.Errorf("settle = %+v, want failed for %s saying %q, no transaction, network and payer named", settled, tc.wantReason, tc.wantInText)
			}
			if n := behind.calls(); n != 0 {
				t.Fatalf("the facilitator behind was called %d times, want never", n)
			}
		})
	}

	t.Run("a served payment is passed on", func(t *testing.T) {
		req := payment(x402.NetworkTestnet, x402.TransferPermit2, minAmount, strings.ToLower(allowedPayTo))
		if v, err := client.Verify(ctx, req); err != nil || !v.IsValid {
			t.Fatalf("verify = %+v, %v; want valid", v, err)
		}
		if s, err := client.Settle(ctx, req); err != nil || !s.Success {
			t.Fatalf("settle = %+v, %v; want settled", s, err)
		}
		if verified, settled := behind.payments(); verified != 1 || settled != 1 {
			t.Fatalf("the facilitator behind verified %d and settled %d times, want once each", verified, settled)
		}
	})
}

// A client without the key learns that the request was refused, not that the payment was.
func TestAClientWithoutTheAPIKeyIsRefusedAsARequest(t *testing.T) {
	behind, srv := refusingServer(t)
	client, _ := serve(t, srv, "")
	_, err := client.Verify(context.Background(), payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo))
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) || fe.Kind != x402.FailureRejected || fe.Status != http.StatusUnauthorized {
		t.Fatalf("verify without the key = %v, want a rejected request with HTTP 401", err)
	}
	if n := behind.calls(); n != 0 {
		t.Fatalf("the facilitator behind was called %d times, want never", n)
	}
}

// The payer's settle limit counts a payer as one whatever the case its address is written in, answers 429 with
// Retry-After over it, and does not pass the call on.
func TestThePayerLimitCountsAPayerOnceWhateverItsCaseAndStopsTheCallHere(t *testing.T) {
	behind := &countingFacilitator{}
	srv, err := facilitatorserver.New(behind, facilitatorserver.Options{SettleRateLimit: facilitatorserver.RateLimit{PerPayer: 1}})
	if err != nil {
		t.Fatal(err)
	}
	client, base := serve(t, srv, "")
	first := payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo)
	if s, err := client.Settle(context.Background(), first); err != nil || !s.Success {
		t.Fatalf("first settlement = %+v, %v; want settled", s, err)
	}
	second := payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo)
	second.PaymentPayload.Payload.Permit2Authorization.From = "0x" + strings.ToUpper(payerAddress[2:])
	second.PaymentPayload.Payload.Permit2Authorization.Nonce = "2"
	body, err := json.Marshal(second)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(base+"/settle", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("second settlement of the payer = HTTP %d, Retry-After %q; want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if _, settled := behind.payments(); settled != 1 {
		t.Fatalf("the facilitator behind settled %d times, want once", settled)
	}
}

// failingSettle is a facilitator whose settlements fail with err.
type failingSettle struct {
	countingFacilitator
	err error
}

func (f *failingSettle) Settle(context.Context, x402.SettleRequest) (x402.SettleResponse, error) {
	return x402.SettleResponse{}, f.err
}

// A settlement the facilitator behind could not make is answered 502 "the payment may have settled"; one it surely
// sent nothing of (x402.ErrSentNothing) 503 with Retry-After and "sent": false, which the client reads back as
// nothing sent. The settle rate limit's 429 asks nothing of the facilitator behind, and says nothing of what an
// earlier call of the payment did there: no "sent".
func TestASettlementThatSentNothingIsAnsweredSoAndAnyOtherFailureMayHaveSettled(t *testing.T) {
	unreachable := &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: errors.New("node timed out")}
	sentNothing := &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: fmt.Errorf("%w: node refused the transaction", x402.ErrSentNothing)}
	rows := []struct {
		name   string
		err    error
		status int
		sent   string // the error body's "sent", "" when absent
	}{
		{"unreachable", unreachable, http.StatusBadGateway, ""},
		{"sent nothing", sentNothing, http.StatusServiceUnavailable, "false"},
		{"no facilitator error", errors.New("panic-free surprise"), http.StatusInternalServerError, ""},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			srv, err := facilitatorserver.New(&failingSettle{err: row.err}, facilitatorserver.Options{})
			if err != nil {
				t.Fatal(err)
			}
			client, base := serve(t, srv, "")
			body, _ := json.Marshal(payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo))
			resp, err := http.Post(base+"/settle", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			var answer map[string]any
			_ = json.NewDecoder(resp.Body).Decode(&answer)
			resp.Body.Close()
			sent := ""
			if v, ok := answer["sent"]; ok {
				sent = fmt.Sprint(v)
			}
			msg, _ := answer["error"].(string)
			if resp.StatusCode != row.status || sent != row.sent || strings.Contains(msg, "may have settled") == (row.sent == "false") {
				t.Fatalf("/settle = %d %v; want %d, sent %q, \"may have settled\" unless nothing was sent", resp.StatusCode, answer, row.status, row.sent)
			}
			if (resp.Header.Get("Retry-After") != "") != (row.sent == "false") {
				t.Errorf("Retry-After %q; want one exactly when nothing was sent", resp.Header.Get("Retry-After"))
			}
			_, err = client.Settle(context.Background(), payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo))
			if got := errors.Is(err, x402.ErrSentNothing) && errors.Is(err, facilitatorclient.ErrNotSent); got != (row.sent == "false") {
				t.Errorf("the client's error %v: nothing sent = %v", err, got)
			}
		})
	}
	t.Run("over the settle rate limit", func(t *testing.T) {
		srv, err := facilitatorserver.New(&countingFacilitator{}, facilitatorserver.Options{SettleRateLimit: facilitatorserver.RateLimit{PerPayer: 1}})
		if err != nil {
			t.Fatal(err)
		}
		client, _ := serve(t, srv, "")
		if _, err := client.Settle(context.Background(), payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo)); err != nil {
			t.Fatal(err)
		}
		_, err = client.Settle(context.Background(), payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo))
		var fe *x402.FacilitatorError
		if !errors.As(err, &fe) || fe.Status != http.StatusTooManyRequests || errors.Is(err, x402.ErrSentNothing) || errors.Is(err, facilitatorclient.ErrNotSent) {
			t.Fatalf("settlement over the limit: %v; want a 429 that says nothing of whether the payment was sent", err)
		}
	})
}

// slowSettle settles as countingFacilitator, once release is closed (a settlement waiting for its receipt).
type slowSettle struct {
	countingFacilitator
	release chan struct{}
}

func (f *slowSettle) Settle(ctx context.Context, req x402.SettleRequest) (x402.SettleResponse, error) {
	<-f.release
	return f.countingFacilitator.Settle(ctx, req)
}

// A payment whose /settle reached member A from one gateway, its answer lost there (a timeout), is presented again
// through another gateway's failover set, which does not know where it went. A's settle rate limit answers 429: it
// asked nothing of the engine behind, so it must not send the payment to B while A's settlement of it is under way
// (found by review: a 429 that said "sent": false did).
func TestARateLimited429NeverSendsAPaymentToAnotherMemberWhileTheFirstMaySettleIt(t *testing.T) {
	behindA := &slowSettle{release: make(chan struct{})}
	defer close(behindA.release)
	srvA, err := facilitatorserver.New(behindA, facilitatorserver.Options{SettleRateLimit: facilitatorserver.RateLimit{PerPayer: 1}})
	if err != nil {
		t.Fatal(err)
	}
	behindB := &countingFacilitator{}
	srvB, err := facilitatorserver.New(behindB, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, urlA := serve(t, srvA, "")
	_, urlB := serve(t, srvB, "")
	failover := func() *facilitatorclient.Failover {
		var members []*facilitatorclient.Client
		for _, u := range []string{urlA, urlB} {
			c, err := facilitatorclient.New(u, facilitatorclient.WithTimeouts(facilitatorclient.Timeouts{Settle: 300 * time.Millisecond}))
			if err != nil {
				t.Fatal(err)
			}
			members = append(members, c)
		}
		return facilitatorclient.NewFailover(members...)
	}
	req := payment(x402.NetworkTestnet, x402.TransferPermit2, "10000", allowedPayTo)
	if _, err := failover().Settle(context.Background(), req); err == nil || errors.Is(err, facilitatorclient.ErrNotSent) {
		t.Fatalf("the first gateway's settlement: %v; want an unknown outcome (A still settling)", err)
	}
	_, err = failover().Settle(context.Background(), req) // another gateway, or the first after a restart
	if _, settled := behindB.payments(); settled != 0 {
		t.Fatalf("B settled the payment %d times while A's settlement of it is under way (%v)", settled, err)
	}
	if err == nil || !x402.IsUnreachable(err) {
		t.Fatalf("the payment presented again, A over its limit: %v; want an unknown outcome", err)
	}
}
