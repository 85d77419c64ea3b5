package caddymodule

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// commandPrice is what the test resource costs, in raw token units (0.01 token).
const commandPrice = 10_000

// runX402 runs `caddy x402 args...` as the binary would, flags included, and returns what it printed.
func runX402(t *testing.T, stdin string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	return RunX402(stdin, args...)
}

// payFixture is a simulated chain, a facilitator on it, and a resource server that sells one URL through it
// as a gate would: 402 with the offer, then verify, settle and 200 with the settlement response.
type payFixture struct {
	t        *testing.T
	c        *chaintest.Chain
	f        *chain.Facilitator
	payTo    common.Address
	required x402.PaymentRequired
	srv      *httptest.Server
	url      string

	mu       sync.Mutex
	requests int
	payments []x402.PaymentPayload // as the facilitator was asked to verify them
	settled  []x402.SettleResponse
}

// newPayFixture starts the chain, the facilitator and a resource server of x402 version 1 or 2.
func newPayFixture(t *testing.T, version int) *payFixture {
	t.Helper()
	racepass.Once(t, "caddy x402 pay run in-process, one payment at a time against a test server settling on a simulated chain: its time is the chain's blocks; the engine settling under it runs under -race in the package's concurrent gate tests")
	c := chaintest.New(t, chaintest.WithHTTP())
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	net := x402.EIP155(c.ChainID.Uint64())
	nc := chain.NetworkConfig{
		Network: net, Backend: c.Client,
		Assets:      []chain.AssetConfig{{Address: c.Token, Name: contracts.StableCoinName, Version: contracts.StableCoinVersion, Decimals: 6}},
		ReceiptPoll: 2 * time.Millisecond,
	}
	for _, w := range c.Wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}})
	if err != nil {
		t.Fatalf("starting the facilitator: %v", err)
	}
	t.Cleanup(func() { f.Close() })

	fx := &payFixture{t: t, c: c, f: f, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e11")}
	base := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: net, Amount: big.NewInt(commandPrice).String(), Asset: c.Token.Hex(),
		PayTo: fx.payTo.Hex(), MaxTimeoutSeconds: 300,
		Extra: x402.Extra{Name: contracts.StableCoinName, Version: contracts.StableCoinVersion},
	}
	permit2, erc2612 := base, base
	permit2.Extra.AssetTransferMethod = x402.TransferPermit2
	erc2612.Extra.AssetTransferMethod = x402.TransferERC2612
	erc2612.Extra.Spender = c.Wallets[0].Address.Hex()
	fx.required = x402.PaymentRequired{
		X402Version: x402.Version2,
		Accepts:     []x402.PaymentRequirements{permit2, erc2612},
		Extensions: map[string]json.RawMessage{
			x402.ExtensionEIP2612GasSponsoring: json.RawMessage(`{"info":{"description":"the facilitator approves Permit2 for you","version":"1"},"schema":{"type":"object"}}`),
		},
	}
	if version == x402.Version1 {
		fx.required.X402Version = x402.Version1
		fx.required.Accepts = []x402.PaymentRequirements{erc2612}
		fx.required.Extensions = nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/report", func(w http.ResponseWriter, r *http.Request) {
		fx.mu.Lock()
		fx.requests++
		fx.mu.Unlock()
		if version == x402.Version1 {
			fx.serveV1(w, r)
		} else {
			fx.serveV2(w, r)
		}
	})
	fx.srv = httptest.NewServer(mux)
	t.Cleanup(fx.srv.Close)
	fx.url = fx.srv.URL + "/report"
	fx.required.Resource = x402.ResourceInfo{URL: fx.url, Description: "a report", MimeType: "text/plain"}
	return fx
}

func (fx *payFixture) serveV2(w http.ResponseWriter, r *http.Request) {
	h := r.Header.Get(x402.HeaderPaymentSignature)
	if h == "" {
		fx.askV2(w, "")
		return
	}
	p, err := x402.DecodePaymentPayload(h)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	for _, offered := range fx.required.Accepts {
		// Clients echo the requirement they pay verbatim.
		if reflect.DeepEqual(offered, p.Accepted) {
			fx.settle(w, r, x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: offered}, x402.HeaderPaymentResponse, fx.askV2)
			return
		}
	}
	fx.askV2(w, "accepted is none of the offered requirements")
}

func (fx *payFixture) askV2(w http.ResponseWriter, reason string) {
	p := fx.required
	p.Error = reason
	h, err := x402.EncodeHeader(p)
	if err != nil {
		fx.t.Errorf("encoding PAYMENT-REQUIRED: %v", err)
	}
	w.Header().Set(x402.HeaderPaymentRequired, h)
	w.WriteHeader(http.StatusPaymentRequired)
	fmt.Fprintln(w, "payment required")
}

func (fx *payFixture) serveV1(w http.ResponseWriter, r *http.Request) {
	h := r.Header.Get(x402.HeaderXPayment)
	if h == "" {
		fx.askV1(w, "")
		return
	}
	p, err := x402.DecodePaymentPayloadV1(h)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	offered := fx.required.Accepts[0]
	v2, err := x402.NewRegistry().PaymentPayloadFromV1(p, offered)
	if err != nil {
		fx.askV1(w, err.Error())
		return
	}
	fx.settle(w, r, x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: v2, PaymentRequirements: offered}, x402.HeaderXPaymentResponse, fx.askV1)
}

func (fx *payFixture) askV1(w http.ResponseWriter, reason string) {
	p := fx.required
	p.Error = reason
	v1, err := x402.NewRegistry().PaymentRequiredToV1(p)
	if err != nil {
		fx.t.Errorf("converting the offer to version 1: %v", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusPaymentRequired)
	json.NewEncoder(w).Encode(v1)
}

// settle verifies and settles req as a gate would and answers with the settlement response in header.
func (fx *payFixture) settle(w http.ResponseWriter, r *http.Request, req x402.VerifyRequest, header string, ask func(http.ResponseWriter, string)) {
	fx.mu.Lock()
	fx.payments = append(fx.payments, req.PaymentPayload)
	fx.mu.Unlock()
	v, err := fx.f.Verify(r.Context(), req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	if !v.IsValid {
		ask(w, v.InvalidReason+": "+v.InvalidMessage)
		return
	}
	s, err := fx.f.Settle(r.Context(), req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	fx.mu.Lock()
	fx.settled = append(fx.settled, s)
	fx.mu.Unlock()
	h, err := x402.EncodeHeader(s)
	if err != nil {
		fx.t.Errorf("encoding the settlement response: %v", err)
	}
	w.Header().Set(header, h)
	if !s.Success {
		ask(w, s.ErrorReason)
		return
	}
	fmt.Fprintln(w, "the paid report")
}

// seen returns the payments the server received and the settlements it made.
func (fx *payFixture) seen() ([]x402.PaymentPayload, []x402.SettleResponse, int) {
	fx.mu.Lock()
	defer fx.mu.Unlock()
	return append([]x402.PaymentPayload(nil), fx.payments...), append([]x402.SettleResponse(nil), fx.settled...), fx.requests
}

// balances returns the token balances of payer and the seller.
func (fx *payFixture) balances(payer common.Address) (payerBal, sellerBal *big.Int) {
	return fx.c.TokenBalance(payer), fx.c.TokenBalance(fx.payTo)
}

// assertPaidOnce checks that exactly one payment of the price moved from payer to the seller, and that the
// output shows the 200, the body and the settlement response with its transaction.
func (fx *payFixture) assertPaidOnce(payer common.Address, payerBefore, sellerBefore *big.Int, stdout, responseHeader string) x402.PaymentPayload {
	fx.t.Helper()
	payments, settled, _ := fx.seen()
	if len(payments) != 1 || len(settled) != 1 || !settled[0].Success {
		fx.t.Fatalf("the server saw %d payments and made %d settlements (%+v), want one successful", len(payments), len(settled), settled)
	}
	payerAfter, sellerAfter := fx.balances(payer)
	if got := new(big.Int).Sub(payerBefore, payerAfter); got.Cmp(big.NewInt(commandPrice)) != 0 {
		fx.t.Errorf("payer balance fell by %s, want %d", got, commandPrice)
	}
	if got := new(big.Int).Sub(sellerAfter, sellerBefore); got.Cmp(big.NewInt(commandPrice)) != 0 {
		fx.t.Errorf("seller balance rose by %s, want %d", got, commandPrice)
	}
	for _, want := range []string{"200 OK", "the paid report", responseHeader + ":", `"transaction": "` + settled[0].Transaction + `"`, `"success": true`} {
		if !strings.Contains(stdout, want) {
			fx.t.Errorf("output lacks %q:\n%s", want, stdout)
		}
	}
	return payments[0]
}

func TestPayWithPermit2PaysThePriceAndPrintsTheSettlement(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.Payers[0]
	fx.c.Approve(payer, contracts.Permit2Address, big.NewInt(commandPrice))
	payerBefore, sellerBefore := fx.balances(payer.Address)

	stdout, stderr, err := runX402(t, "", "pay", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url)
	if err != nil {
		t.Fatalf("pay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	p := fx.assertPaidOnce(payer.Address, payerBefore, sellerBefore, stdout, x402.HeaderPaymentResponse)
	if p.Payload.Permit2Authorization == nil || p.Extensions != nil {
		t.Errorf("payment = %+v, want a permit2 payment without gas sponsoring (the payer approved Permit2)", p)
	}
	if p.Resource == nil || p.Resource.URL != fx.url {
		t.Errorf("payment resource = %+v, want the offer's %s", p.Resource, fx.url)
	}
	if strings.Contains(stdout+stderr, accountHex(payer)[8:]) {
		t.Error("the output shows the payer key")
	}
}

func TestPayWithoutPermit2AllowanceAddsGasSponsoringSoThePayerNeedsNoGas(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.PayerNoGas
	payerBefore, sellerBefore := fx.balances(payer.Address)

	stdout, stderr, err := runX402(t, "", "pay", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url)
	if err != nil {
		t.Fatalf("pay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	p := fx.assertPaidOnce(payer.Address, payerBefore, sellerBefore, stdout, x402.HeaderPaymentResponse)
	var ext struct {
		Info   x402.EIP2612GasSponsoringInfo `json:"info"`
		Schema json.RawMessage               `json:"schema"`
	}
	if err := json.Unmarshal(p.Extensions[x402.ExtensionEIP2612GasSponsoring], &ext); err != nil {
		t.Fatalf("the payment carries no readable %s extension: %v", x402.ExtensionEIP2612GasSponsoring, err)
	}
	if !x402.SameAddress(ext.Info.From, payer.Address.Hex()) || !x402.SameAddress(ext.Info.Spender, contracts.Permit2Address.Hex()) || ext.Schema == nil {
		t.Errorf("gas sponsoring = %+v, want a permit from the payer to Permit2 that keeps the server's schema", ext)
	}
	if fx.c.ETHBalance(payer.Address).Sign() != 0 {
		t.Error("the payer paid gas")
	}
	if !strings.Contains(stderr, "gas sponsored") {
		t.Errorf("the progress line does not say the payment is gas sponsored: %q", stderr)
	}
}

func TestPayWithMethodERC2612PaysByAPermitToTheNamedSpender(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.Payers[1]
	payerBefore, sellerBefore := fx.balances(payer.Address)

	stdout, stderr, err := runX402(t, "", "pay", "--key", "0x"+accountHex(payer), "--rpc", fx.c.RPCURL, "--method", "erc2612", fx.url)
	if err != nil {
		t.Fatalf("pay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	p := fx.assertPaidOnce(payer.Address, payerBefore, sellerBefore, stdout, x402.HeaderPaymentResponse)
	if a := p.Payload.Authorization; a == nil || !x402.SameAddress(a.To, fx.c.Wallets[0].Address.Hex()) || p.Accepted.Extra.AssetTransferMethod != x402.TransferERC2612 {
		t.Errorf("payment = %+v, want an erc2612 permit to %s", p, fx.c.Wallets[0].Address.Hex())
	}
}

func TestPayToAVersion1ServerSendsXPaymentAndPrintsXPaymentResponse(t *testing.T) {
	fx := newPayFixture(t, x402.Version1)
	payer := fx.c.Payers[2]
	payerBefore, sellerBefore := fx.balances(payer.Address)

	stdout, stderr, err := runX402(t, "", "pay", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url)
	if err != nil {
		t.Fatalf("pay: %v\nstdout:\n%s\nstderr:\n%s", err, stdout, stderr)
	}
	fx.assertPaidOnce(payer.Address, payerBefore, sellerBefore, stdout, x402.HeaderXPaymentResponse)
}

func TestPaySignOnlyPrintsAPaymentThatVerifiesAndSendsNothing(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.Payers[3]
	fx.c.Approve(payer, contracts.Permit2Address, big.NewInt(commandPrice))
	payerBefore, sellerBefore := fx.balances(payer.Address)

	stdout, stderr, err := runX402(t, "", "pay", "--sign-only", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url)
	if err != nil {
		t.Fatalf("pay --sign-only: %v\nstderr:\n%s", err, stderr)
	}
	payments, _, requests := fx.seen()
	if len(payments) != 0 || requests != 1 {
		t.Fatalf("the server saw %d requests and %d payments, want only the unpaid request", requests, len(payments))
	}
	if a, s := fx.balances(payer.Address); a.Cmp(payerBefore) != 0 || s.Cmp(sellerBefore) != 0 {
		t.Fatalf("balances moved: payer %s -> %s, seller %s -> %s", payerBefore, a, sellerBefore, s)
	}
	if strings.Count(stdout, "\n") != 1 {
		t.Fatalf("output = %q, want the header value alone on one line", stdout)
	}
	p, err := x402.DecodePaymentPayload(strings.TrimSpace(stdout))
	if err != nil {
		t.Fatalf("the printed value is no PAYMENT-SIGNATURE: %v", err)
	}
	v, err := fx.f.Verify(context.Background(), x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: fx.required.Accepts[0]})
	if err != nil || !v.IsValid || !x402.SameAddress(v.Payer, payer.Address.Hex()) {
		t.Fatalf("verifying the printed payment = %+v, %v; want valid for %s", v, err, payer.Address.Hex())
	}
}

func TestPayExitsNonZeroWithTheServersReasonWhenThePaymentIsRefused(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	broke, err := crypto.GenerateKey() // holds no tokens
	if err != nil {
		t.Fatal(err)
	}
	stdout, _, err := runX402(t, "", "pay", "--key", hex.EncodeToString(crypto.FromECDSA(broke)), "--rpc", fx.c.RPCURL, fx.url)
	if err == nil || !strings.Contains(err.Error(), "402") || !strings.Contains(err.Error(), x402.ReasonInsufficientFunds) {
		t.Fatalf("pay by a payer without tokens = %v, want an error naming 402 and %s", err, x402.ReasonInsufficientFunds)
	}
	if !strings.HasPrefix(stdout, "HTTP/1.1 402 ") {
		t.Fatalf("output = %q, want the final 402 printed", stdout)
	}
	if payments, settled, _ := fx.seen(); len(payments) != 1 || len(settled) != 0 {
		t.Fatalf("the server saw %d payments and settled %d, want 1 and 0", len(payments), len(settled))
	}
}

func TestPayOfAFreeURLPrintsItAndFailsOnlyWhenTheStatusIsNot2xx(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/free" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, "free content")
	}))
	defer srv.Close()
	key := hex.EncodeToString(crypto.FromECDSA(devchain.PayerKey()))

	stdout, _, err := runX402(t, "", "pay", "--key", key, srv.URL+"/free")
	if err != nil || !strings.Contains(stdout, "200 OK") || !strings.Contains(stdout, "free content") {
		t.Fatalf("pay of a free URL = %v, output %q; want success with the body", err, stdout)
	}
	stdout, _, err = runX402(t, "", "pay", "--key", key, srv.URL+"/missing")
	if err == nil || !strings.Contains(stdout, "404 Not Found") {
		t.Fatalf("pay of a missing URL = %v, output %q; want an error after the 404 is printed", err, stdout)
	}
	if _, _, err = runX402(t, "", "pay", "--sign-only", "--key", key, srv.URL+"/free"); err == nil || !strings.Contains(err.Error(), "nothing to sign") {
		t.Fatalf("pay --sign-only of a free URL = %v, want an error saying there is nothing to sign", err)
	}
}

func TestPayPaysWhereRedirectsLedAndFollowsNoRedirectWithThePayment(t *testing.T) {
	var mu sync.Mutex
	var paidAt []string
	stolen := 0
	thief := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if r.Header.Get(x402.HeaderPaymentSignature) != "" {
			stolen++
		}
	}))
	defer thief.Close()
	offer, err := x402.EncodeHeader(x402.PaymentRequired{X402Version: 2, Resource: x402.ResourceInfo{URL: "/report"}, Accepts: []x402.PaymentRequirements{{
		Scheme: x402.SchemeExact, Network: x402.NetworkTestnet, Amount: "1", Asset: devchain.TokenAddress.Hex(),
		PayTo: devchain.PayerAddress.Hex(), MaxTimeoutSeconds: 60, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path == "/start":
			http.Redirect(w, r, "/report", http.StatusFound)
		case r.Header.Get(x402.HeaderPaymentSignature) == "":
			w.Header().Set(x402.HeaderPaymentRequired, offer)
			w.WriteHeader(http.StatusPaymentRequired)
		default:
			mu.Lock()
			paidAt = append(paidAt, r.URL.Path)
			mu.Unlock()
			http.Redirect(w, r, thief.URL+"/elsewhere", http.StatusTemporaryRedirect)
		}
	}))
	defer srv.Close()

	stdout, _, err := runX402(t, "", "pay", "--key", hex.EncodeToString(crypto.FromECDSA(devchain.PayerKey())), "--max", "1", srv.URL+"/start")
	if err == nil || !strings.Contains(err.Error(), "307") || !strings.Contains(stdout, "307 Temporary Redirect") {
		t.Fatalf("pay = %v, output %q; want the 307 printed and an error", err, stdout)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(paidAt) != 1 || paidAt[0] != "/report" {
		t.Fatalf("payments arrived at %v, want one at /report, where the unpaid request was redirected", paidAt)
	}
	if stolen != 0 {
		t.Fatalf("the payment followed the redirect to another host %d times", stolen)
	}
}

func TestPayRefusesBadInputBeforeSendingAnything(t *testing.T) {
	t.Setenv(envPayerKey, "")
	var mu sync.Mutex
	requests := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		requests++
		mu.Unlock()
		w.WriteHeader(http.StatusPaymentRequired)
	}))
	defer srv.Close()
	secret := "ab" + strings.Repeat("cd", 31)
	good := hex.EncodeToString(crypto.FromECDSA(devchain.PayerKey()))

	for _, tc := range []struct {
		name string
		args []string
		want []string // in the error
	}{
		{"a key that is not hex", []string{"--key", strings.Repeat("zz", 32)}, []string{"--key", "64 hex digits", "not a hex digit"}},
		{"a key that is too short", []string{"--key", secret[:40]}, []string{"--key", "64 hex digits", "got 40 characters"}},
		{"a key of zero", []string{"--key", strings.Repeat("0", 64)}, []string{"--key", "not a valid secp256k1 private key"}},
		{"no key at all", nil, []string{"no payer key", "--key-file", envPayerKey}},
		{"both --key and --key-file", []string{"--key", good, "--key-file", "/nonexistent"}, []string{"both --key and --key-file"}},
		{"erc2612 without an RPC", []string{"--key", good, "--method", "erc2612"}, []string{"--method erc2612 needs --rpc"}},
		{"an unknown method", []string{"--key", good, "--method", "upto"}, []string{"--method", "permit2", "erc2612", "eip3009", "upto"}},
		{"a URL that is not http", []string{"--key", good, "ftp://example.com/x"}, []string{"http:// or https:// URL"}},
		{"a --max that is no amount", []string{"--key", good, "--max", "ten cents"}, []string{"--max", "raw token units", "dollar amount"}},
		{"a negative --max", []string{"--key", good, "--max", "-5"}, []string{"--max", "negative"}},
		{"a --max-validity below a second", []string{"--key", good, "--max-validity", "10ms"}, []string{"--max-validity", "a second or more"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"pay"}, tc.args...)
			if !strings.HasPrefix(args[len(args)-1], "ftp:") {
				args = append(args, srv.URL+"/report")
			}
			_, _, err := runX402(t, "", args...)
			if err == nil {
				t.Fatal("pay succeeded, want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
			if strings.Contains(err.Error(), secret[:40]) || strings.Contains(err.Error(), "zzzz") {
				t.Errorf("error %q quotes the key", err)
			}
		})
	}
	mu.Lock()
	defer mu.Unlock()
	if requests != 0 {
		t.Fatalf("the server saw %d requests, want none", requests)
	}
}

func TestLoadPayerKeyTakesTheFirstSourceGiven(t *testing.T) {
	a, b := chaintest.DeriveAccount("cmd", 0), chaintest.DeriveAccount("cmd", 1)
	dir := t.TempDir()
	file := filepath.Join(dir, "key")
	if err := os.WriteFile(file, []byte("0x"+accountHex(b)+"\n# the rest is ignored\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name          string
		key, file     string
		env           string
		dev           bool
		want          common.Address
		wantErrSubstr string
	}{
		{name: "--key", key: accountHex(a), env: accountHex(b), dev: true, want: a.Address},
		{name: "--key-file, first line", file: file, env: accountHex(a), want: b.Address},
		{name: "--dev", dev: true, env: accountHex(a), want: devchain.PayerAddress},
		{name: "the environment", env: " " + accountHex(a) + "\n", want: a.Address},
		{name: "a missing key file", file: filepath.Join(dir, "none"), wantErrSubstr: "reading --key-file"},
		{name: "a bad environment key", env: "0x1234", wantErrSubstr: "$" + envPayerKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k, err := loadPayerKey(tc.key, tc.file, tc.env, tc.dev)
			if tc.wantErrSubstr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErrSubstr) {
					t.Fatalf("err = %v, want one naming %q", err, tc.wantErrSubstr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := crypto.PubkeyToAddress(k.PublicKey); got != tc.want {
				t.Fatalf("key of %s, want %s", got.Hex(), tc.want.Hex())
			}
		})
	}
}

func TestKeygenPrintsAFreshKeyAndItsAddress(t *testing.T) {
	keys := map[string]bool{}
	for range 2 {
		stdout, stderr, err := runX402(t, "", "keygen")
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSpace(stdout), "\n")
		if len(lines) != 2 {
			t.Fatalf("output = %q, want two lines", stdout)
		}
		keyHex, ok1 := strings.CutPrefix(lines[0], "private key: 0x")
		addr, ok2 := strings.CutPrefix(lines[1], "address:")
		if !ok1 || !ok2 {
			t.Fatalf("output = %q, want labelled lines", stdout)
		}
		key, err := crypto.HexToECDSA(keyHex)
		if err != nil {
			t.Fatalf("the printed key does not parse: %v", err)
		}
		if got := crypto.PubkeyToAddress(key.PublicKey).Hex(); got != strings.TrimSpace(addr) {
			t.Fatalf("the key's address is %s, the printed one %s", got, strings.TrimSpace(addr))
		}
		if !strings.Contains(stderr, "secret") {
			t.Errorf("stderr = %q, want a note to keep the key secret", stderr)
		}
		keys[keyHex] = true
	}
	if len(keys) != 2 {
		t.Fatal("two runs printed the same key")
	}
}

func TestDecodeTellsEveryHeaderByItsShapeAndPrintsItsJSON(t *testing.T) {
	key := devchain.PayerKey()
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: x402.NetworkTestnet, Amount: "10000", Asset: devchain.TokenAddress.Hex(),
		PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 60,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"},
	}
	p2, err := chain.SignPermit2Payment(key, rq, big.NewInt(72344), chain.Permit2Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := chain.AddGasSponsoring(&p2, key, big.NewInt(72344), "", "", big.NewInt(0)); err != nil {
		t.Fatal(err)
	}
	erc := rq
	erc.Extra = x402.Extra{AssetTransferMethod: x402.TransferERC2612, Spender: "0x1111111111111111111111111111111111111111"}
	e2, err := chain.SignERC2612Payment(key, erc, big.NewInt(72344), chain.ERC2612Options{TokenNonce: big.NewInt(3)})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		doc     any
		header  string
		version int
	}{
		{"payment required", x402.PaymentRequired{X402Version: 2, Resource: x402.ResourceInfo{URL: "https://example.com/r"}, Accepts: []x402.PaymentRequirements{rq, erc},
			Extensions: map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: json.RawMessage(`{"info":{"version":"1"}}`)}}, x402.HeaderPaymentRequired, 2},
		{"permit2 payment with gas sponsoring", p2, x402.HeaderPaymentSignature, 2},
		{"erc2612 payment", e2, x402.HeaderPaymentSignature, 2},
		{"version 1 payment", x402.PaymentPayloadV1{X402Version: 1, Scheme: "exact", Network: "testnet", Payload: e2.Payload}, x402.HeaderXPayment, 1},
		{"settlement response", x402.SettleResponse{Success: true, Transaction: "0x" + strings.Repeat("ab", 32), Network: x402.NetworkTestnet, Payer: devchain.PayerAddress.Hex()}, x402.HeaderPaymentResponse, 0},
		{"failed settlement response", x402.SettleResponse{ErrorReason: x402.ReasonInsufficientFunds, Network: x402.NetworkTestnet}, x402.HeaderPaymentResponse, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			value, err := x402.EncodeHeader(tc.doc)
			if err != nil {
				t.Fatal(err)
			}
			d, err := decodeHeaderValue(value)
			if err != nil {
				t.Fatal(err)
			}
			if d.Name != tc.header || d.Version != tc.version {
				t.Fatalf("decoded as %s version %d, want %s version %d", d.Name, d.Version, tc.header, tc.version)
			}
			// The printed JSON is the document: read back into its type, it encodes to the same header.
			back := reflect.New(reflect.TypeOf(tc.doc))
			if err := json.Unmarshal(d.JSON, back.Interface()); err != nil {
				t.Fatalf("the printed JSON does not read back: %v\n%s", err, d.JSON)
			}
			if again, _ := x402.EncodeHeader(back.Elem().Interface()); again != value {
				t.Fatalf("the printed JSON reads back as a different document:\n%s", d.JSON)
			}
			if !bytes.Contains(d.JSON, []byte("\n  ")) {
				t.Errorf("the JSON is not indented:\n%s", d.JSON)
			}
		})
	}
}

func TestDecodeReadsAWholeHeaderLineAsTheHeaderItNames(t *testing.T) {
	value, err := x402.EncodeHeader(x402.SettleResponse{Success: true, Network: x402.NetworkTestnet})
	if err != nil {
		t.Fatal(err)
	}
	d, err := decodeHeaderValue("x-payment-response: " + value)
	if err != nil || d.Name != x402.HeaderXPaymentResponse {
		t.Fatalf("decoded as %q, %v; want %s", d.Name, err, x402.HeaderXPaymentResponse)
	}
	// Named as the wrong header, the value is checked as that header and the missing field named.
	_, err = decodeHeaderValue("PAYMENT-SIGNATURE: " + value)
	var de *x402.DecodeError
	if !errors.As(err, &de) || de.Kind != x402.DecodeMissingField || !strings.Contains(err.Error(), x402.HeaderPaymentSignature) {
		t.Fatalf("a settlement response given as PAYMENT-SIGNATURE = %v, want a missing-field error naming the header", err)
	}
}

func TestDecodeSaysPreciselyWhatIsWrongWithGarbage(t *testing.T) {
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	for _, tc := range []struct {
		name  string
		value string
		kind  x402.DecodeErrorKind // "" when the error is not a DecodeError
		field string
		want  []string
	}{
		{name: "empty", value: "  ", kind: x402.DecodeNotBase64},
		{name: "not base64", value: "%%%not base64%%%", kind: x402.DecodeNotBase64},
		{name: "not JSON", value: b64("hello"), kind: x402.DecodeNotJSON},
		{name: "a JSON array", value: b64(`[1,2]`), kind: x402.DecodeWrongType},
		{name: "an object of no known shape", value: b64(`{"foo":1,"bar":2}`), want: []string{"accepts", "payload", "success", "[bar, foo]"}},
		{name: "a payment without a signature", value: b64(`{"x402Version":2,"accepted":{},"payload":{"authorization":{}}}`), kind: x402.DecodeMissingField},
		{name: "a payment of version 3", value: b64(`{"x402Version":3,"payload":{}}`), kind: x402.DecodeUnsupportedVersion},
		{name: "an offer whose amount is a number", value: b64(`{"x402Version":2,"resource":{"url":"u"},"accepts":[{"scheme":"exact","network":"eip155:1","amount":5,"asset":"a","payTo":"p","maxTimeoutSeconds":1,"extra":{}}]}`),
			kind: x402.DecodeWrongType, field: "accepts[0].amount"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeHeaderValue(tc.value)
			if err == nil {
				t.Fatal("decoded garbage")
			}
			var de *x402.DecodeError
			if tc.kind != "" && (!errors.As(err, &de) || de.Kind != tc.kind) {
				t.Fatalf("err = %v, want a %s DecodeError", err, tc.kind)
			}
			if tc.field != "" && de.Field != tc.field {
				t.Errorf("error names field %q, want %q", de.Field, tc.field)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

func TestDecodeCommandPrintsJSONOnStdoutAndTheHeaderNameOnStderr(t *testing.T) {
	value, err := x402.EncodeHeader(x402.SettleResponse{Success: true, Transaction: "0xabc", Network: x402.NetworkTestnet})
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"decode", value}, {"decode", "-"}} {
		stdout, stderr, err := runX402(t, value+"\n", args...)
		if err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		var s x402.SettleResponse
		if err := json.Unmarshal([]byte(stdout), &s); err != nil || s.Transaction != "0xabc" {
			t.Fatalf("%v printed %q (%v), want the settlement response's JSON", args[:1], stdout, err)
		}
		if strings.TrimSpace(stderr) != x402.HeaderPaymentResponse {
			t.Fatalf("stderr = %q, want %s", stderr, x402.HeaderPaymentResponse)
		}
	}
	if _, _, err := runX402(t, "", "decode", "garbage!"); err == nil {
		t.Fatal("decode of garbage succeeded")
	}
}

// accountHex is the private key of a test account as a user would pass it to --key.
func accountHex(a *chaintest.Account) string { return hex.EncodeToString(crypto.FromECDSA(a.Key)) }

// headerNames are the headers `caddy x402 decode` reads, in a fixed order for the fuzz target to pick from.
var headerNames = []string{x402.HeaderPaymentRequired, x402.HeaderPaymentSignature, x402.HeaderXPayment, x402.HeaderPaymentResponse,
	x402.HeaderXPaymentResponse}

// `caddy x402 decode` reads any input (bare, Base64, or a whole header line) as one of the five headers, only when
// that header's strict decoder accepts it, prints the document it carries, and otherwise says it is not an x402
// header value in a message that grows at most linearly with the input.
func FuzzDecodeHeaderValue(f *testing.F) {
	for _, name := range []string{"v2-payment-required.json", "v2-payload-permit2.json", "v1-payload.json", "settle-response-success.json"} {
		doc, err := os.ReadFile(filepath.Join("..", "x402", "testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, doc); err != nil {
			f.Fatal(err)
		}
		f.Add(compact.String(), uint8(0))
	}
	for _, s := range []string{"", "hello", "[1,2]", `{"foo":1,"bar":2}`, `{"x402Version":2,"accepted":{},"payload":{"authorization":{}}}`,
		`{"x402Version":3,"payload":{}}`, `{"success":true}`, `{"success":true,"accepts":null,"payload":1}`, "PAYMENT-SIGNATURE: e30=", "x-payment-response:eyJzdWNjZXNzIjpmYWxzZX0="} {
		f.Add(s, uint8(3))
	}
	f.Fuzz(func(t *testing.T, s string, pick uint8) {
		name := headerNames[int(pick)%len(headerNames)]
		value := base64.StdEncoding.EncodeToString([]byte(s))
		checkDecodedHeader(t, s, "")
		checkDecodedHeader(t, value, "")
		checkDecodedHeader(t, strings.ToLower(name)+": "+value, name)
	})
}

// checkDecodedHeader checks what decodeHeaderValue makes of in; named is the header in names, or "" for a bare value.
func checkDecodedHeader(t *testing.T, in, named string) {
	t.Helper()
	d, err := decodeHeaderValue(in)
	if err != nil {
		msg := err.Error()
		if !strings.HasPrefix(msg, "not an x402 header value") && !strings.HasPrefix(msg, "not a valid ") || len(msg) > len(in)+600 {
			t.Fatalf("decodeHeaderValue(%q) error %q: want one saying what is not valid, at most linear in the input", in, msg)
		}
		return
	}
	if named != "" && d.Name != named {
		t.Fatalf("decodeHeaderValue(%q) read it as %s, the line names %s", in, d.Name, named)
	}
	value := strings.TrimSpace(in)
	if n, rest, ok := strings.Cut(value, ":"); ok && slices.Contains(headerNames, strings.ToUpper(strings.TrimSpace(n))) {
		value = strings.TrimSpace(rest)
	}
	// The strict decoder of the header it was read as accepts it, with the version reported.
	var version int
	switch d.Name {
	case x402.HeaderPaymentRequired:
		p, derr := x402.DecodePaymentRequired(value)
		err, version = derr, p.X402Version
	case x402.HeaderPaymentSignature:
		p, derr := x402.DecodePaymentPayload(value)
		err, version = derr, p.X402Version
	case x402.HeaderXPayment:
		p, derr := x402.DecodePaymentPayloadV1(value)
		err, version = derr, p.X402Version
	case x402.HeaderPaymentResponse, x402.HeaderXPaymentResponse:
		_, err = x402.DecodeSettleResponse(value)
	default:
		t.Fatalf("decodeHeaderValue(%q) read it as %q, no header it knows", in, d.Name)
	}
	if err != nil || version != d.Version {
		t.Fatalf("decodeHeaderValue(%q) read it as %s version %d, whose decoder says version %d, %v", in, d.Name, d.Version, version, err)
	}
	// What it prints is the document the header carries, indented.
	doc, err := x402.HeaderJSON(value)
	if err != nil {
		t.Fatalf("HeaderJSON refuses a value decodeHeaderValue accepted: %v", err)
	}
	var want, got bytes.Buffer
	if json.Compact(&want, doc) != nil || json.Compact(&got, d.JSON) != nil || !bytes.Equal(want.Bytes(), got.Bytes()) {
		t.Fatalf("decodeHeaderValue(%q) printed\n%s\nnot the document\n%s", in, d.JSON, doc)
	}
}
