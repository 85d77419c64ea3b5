package gate_test

import (
	"cmp"
	"context"
	"errors"
	"io"
	"log"
	"math/big"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// price is what the gated resource costs, in raw units (0.01 token).
const price = 10_000

// env is a gate with the embedded engine on a simulated chain, a journal, and an upstream, served over real
// HTTP without Caddy.
type env struct {
	t       *testing.T
	c       *chaintest.Chain
	fac     *chain.Facilitator
	store   journal.Store
	gate    *gate.Gate
	srv     *httptest.Server
	payTo   common.Address
	net     string
	served  atomic.Int64 // requests that reached the upstream
	failing atomic.Bool  // the upstream answers 503
	vars    *vars
	metrics *countingMetrics
	cfg     gate.Config // the gate's configuration
}

// setup says how a test's gate is configured.
type setup struct {
	settle  string
	journal journal.Store // default: in memory
	// chain is the chain to settle on, shared with another env (a second gateway); default a new one, sealing
	// every 5ms.
	chain *chaintest.Chain
	// scheme is the offer's scheme (default exact) and defaultAmount the gate's upto default.
	scheme, defaultAmount string
	// override, when set, is the Settlement-Overrides header the upstream answers a request with ("" for none).
	override func(r *http.Request) string
	// upstream, when set, is the upstream instead of the one that answers "paid content".
	upstream gate.HandlerFunc
	// serverLog, when set, receives the HTTP server's own log (a panic in a handler is logged there).
	serverLog *log.Logger
	// config, when set, changes the gate's configuration before it is made.
	config func(*gate.Config)
	// network, when set, changes the engine's network configuration before it is made.
	network func(*chain.NetworkConfig)
	// wallets is how many of the chain's wallets the engine settles with (default 2).
	wallets int
	// noGate makes an env of the engine alone, as a process of a cluster that runs no gate: startGate makes
	// its gate later.
	noGate bool
}

// ledgers is what owns the journals' ledgers in these tests, as the Caddy app does in the server: the gates of
// every env share it, so a gate made again on an env's journal (a reload) finds the ledger the first one left.
var ledgers = gate.NewLedgers()

func newEnv(t *testing.T, s setup) *env {
	t.Helper()
	c := s.chain
	if c == nil {
		c = chaintest.New(t, chaintest.WithPromptCommit())
		t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	}
	e := &env{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		net: x402.EIP155(c.ChainID.Uint64()), vars: &vars{m: map[string]string{}}, metrics: &countingMetrics{}}
	e.store = s.journal
	if e.store == nil {
		e.store = journal.NewMemory(journal.Options{})
	}
	nc := chain.NetworkConfig{
		Network: e.net, Backend: c.Client, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
	}
	for _, w := range c.Wallets[:cmp.Or(s.wallets, 2)] {
		nc.Keys = append(nc.Keys, w.Key)
	}
	if s.network != nil {
		s.network(&nc)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: e.store, Owner: "test"})
	if err != nil {
		t.Fatalf("starting the facilitator: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	e.fac = f
	cfg := gate.Config{
		Offers: []gate.Offer{{Network: e.net, Asset: c.Token.Hex(), PayTo: e.payTo.Hex(), Amount: big.NewInt(price).String(),
			TokenName: "Stable Coin", TokenVersion: "1", Decimals: 6, MaxTimeoutSeconds: 300, Scheme: s.scheme}},
		Settle: s.settle, DefaultAmount: s.defaultAmount, Description: "a test resource", Route: "the test route", Embedded: true, EnginePrunes: true, FacilitatorName: "embedded",
		SetVar: e.vars.set, Metrics: e.metrics, Ledgers: ledgers, Permits: chain.PermitSigners{},
	}
	if s.config != nil {
		s.config(&cfg)
	}
	e.cfg = cfg
	if !s.noGate {
		e.startGate()
	}
	var next gate.Handler = s.upstream
	if s.upstream == nil {
		next = gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			e.served.Add(1)
			if s.override != nil {
				if v := s.override(r); v != "" {
					w.Header().Set(x402.HeaderSettlementOverrides, v)
				}
			}
			if e.failing.Load() {
				http.Error(w, "upstream down", http.StatusServiceUnavailable)
				return nil
			}
			_, err := io.WriteString(w, "paid content")
			return err
		})
	}
	e.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := e.gate.ServeHTTP(w, r, next); err != nil {
			status := http.StatusInternalServerError
			var se *gate.StatusError
			if errors.As(err, &se) {
				status = se.Status
			}
			http.Error(w, err.Error(), status)
		}
	}))
	e.srv.Config.ErrorLog = s.serverLog
	e.srv.Start()
	t.Cleanup(e.srv.Close)
	return e
}

// startGate makes and starts the env's gate (see setup.noGate).
func (e *env) startGate() {
	e.t.Helper()
	e.startGateWith(e.fac)
}

// startGateWith makes and starts the env's gate with fac for its facilitator (the env's engine wrapped, say).
func (e *env) startGateWith(fac x402.Facilitator) {
	e.t.Helper()
	g, err := gate.New(e.cfg, fac, e.store, "test")
	if err != nil {
		e.t.Fatalf("gate.New: %v", err)
	}
	if err := g.Start(); err != nil {
		e.t.Fatalf("starting the gate: %v", err)
	}
	e.t.Cleanup(func() { _ = g.Close() })
	e.gate = g
}

// answer is a response with its body read.
type answer struct {
	status int
	header http.Header
	body   string
}

// get requests the resource with the given headers (name, value pairs).
func (e *env) get(headers ...string) answer {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+"/report", nil)
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(body)}
}

// offer is the gate's permit2 requirement, as an unpaid request gets it.
func (e *env) offer() x402.PaymentRequirements {
	e.t.Helper()
	a := e.get()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		e.t.Fatalf("decoding PAYMENT-REQUIRED of %d %q: %v", a.status, a.body, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
			return rq
		}
	}
	e.t.Fatalf("the gate offers no permit2 requirement: %+v", pr.Accepts)
	return x402.PaymentRequirements{}
}

// permit2 is a signed permit2 payment of payer (who approved Permit2), ready for PAYMENT-SIGNATURE.
func (e *env) permit2(payer *chaintest.Account) string {
	e.t.Helper()
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	e.c.Approve(payer, contracts.Permit2Address, max)
	p, err := chain.SignPermit2Payment(payer.Key, e.offer(), e.c.ChainID,
		chain.Permit2Options{Now: time.Unix(int64(e.c.HeadTime()), 0)})
	if err != nil {
		e.t.Fatalf("signing a permit2 payment: %v", err)
	}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		e.t.Fatal(err)
	}
	return h
}

// paid is what the payer lost and the seller gained since before, and the transfers between them.
func (e *env) paid(payer *chaintest.Account, before [2]*big.Int) (lost, gained *big.Int) {
	return new(big.Int).Sub(before[0], e.c.TokenBalance(payer.Address)), new(big.Int).Sub(e.c.TokenBalance(e.payTo), before[1])
}

// waitPaidOnce waits up to within until the payer has paid price once and the seller received it since the
// balances before, and fails the test when either moves by more, or not at all in time.
func (e *env) waitPaidOnce(t *testing.T, payer *chaintest.Account, before [2]*big.Int, price int64, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		lost, gained := e.paid(payer, before)
		if lost.Int64() == price && gained.Int64() == price {
			return
		}
		if time.Now().After(deadline) || lost.Int64() > price {
			t.Fatalf("the payer lost %s and the seller gained %s; want exactly %d once", lost, gained, price)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// wantSettled checks that a is the upstream's content with a PAYMENT-RESPONSE naming the payment's settlement, and
// that it moved exactly the price from payer to the seller since the balances before; it returns the settlement.
func (e *env) wantSettled(a answer, payer *chaintest.Account, before [2]*big.Int) x402.SettleResponse {
	e.t.Helper()
	if a.status != http.StatusOK || a.body != "paid content" {
		e.t.Fatalf("paid request = %d %q, want 200 with the upstream's content", a.status, a.body)
	}
	resp, err := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
	if err != nil || !resp.Success || resp.Transaction == "" {
		e.t.Fatalf("PAYMENT-RESPONSE = %+v (%v), want a successful settlement naming its transaction", resp, err)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		e.t.Errorf("the payer lost %s and the seller gained %s, want exactly %d each", lost, gained, price)
	}
	return resp
}

func (e *env) balances(payer *chaintest.Account) [2]*big.Int {
	return [2]*big.Int{e.c.TokenBalance(payer.Address), e.c.TokenBalance(e.payTo)}
}

// vars records what the gate publishes through SetVar.
type vars struct {
	mu sync.Mutex
	m  map[string]string
}

func (v *vars) set(_ *http.Request, name, value string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.m[name] = value
}

func (v *vars) get(name string) string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.m[name]
}

// countingMetrics counts outcomes by status.
type countingMetrics struct {
	mu       sync.Mutex
	outcomes map[x402.OutcomeStatus]int
	settles  int
}

func (m *countingMetrics) ObserveOutcome(s x402.OutcomeStatus) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.outcomes == nil {
		m.outcomes = map[x402.OutcomeStatus]int{}
	}
	m.outcomes[s]++
}
func (m *countingMetrics) ObserveVerify(time.Duration) {}
func (m *countingMetrics) ObserveSettle(time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.settles++
}

func (m *countingMetrics) outcome(s x402.OutcomeStatus) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.outcomes[s]
}

func TestAnUnpaidRequestIsAnswered402WithWhatToPayInPaymentRequired(t *testing.T) {
	e := newEnv(t, setup{})
	a := e.get()
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("unpaid request = %d %q, want 402", a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
	}
	if len(pr.Accepts) == 0 || pr.Accepts[0].Extra.AssetTransferMethod != x402.TransferPermit2 {
		t.Fatalf("offers = %+v, want permit2 first", pr.Accepts)
	}
	rq := pr.Accepts[0]
	if rq.Amount != "10000" || !x402.SameAddress(rq.PayTo, e.payTo.Hex()) || !x402.SameAddress(rq.Asset, e.c.Token.Hex()) || rq.Network != e.net {
		t.Errorf("offer = %+v, want 10000 raw units of the token to the seller on %s", rq, e.net)
	}
	if !strings.HasSuffix(pr.Resource.URL, "/report") || pr.Resource.Description != "a test resource" {
		t.Errorf("resource = %+v, want the requested URL and the configured description", pr.Resource)
	}
	if e.served.Load() != 0 {
		t.Error("the upstream ran for an unpaid request")
	}
	if e.metrics.outcome(x402.OutcomeNoPayment) != 1 || e.vars.get(gate.VarStatus) != string(x402.OutcomeNoPayment) {
		t.Errorf("the hooks saw outcome %q and %d no-payment counts, want %q once", e.vars.get(gate.VarStatus),
			e.metrics.outcome(x402.OutcomeNoPayment), x402.OutcomeNoPayment)
	}
}

func TestAValidPermit2PaymentIsServedWithPaymentResponseAndMovesExactlyThePriceOnce(t *testing.T) {
	e := newEnv(t, setup{})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)

	resp := e.wantSettled(e.get(x402.HeaderPaymentSignature, header), payer, before)
	if n := e.c.CountTokenTransfers(payer.Address, e.payTo); n != 1 {
		t.Errorf("%d token transfers from payer to seller, want 1", n)
	}
	if e.served.Load() != 1 {
		t.Errorf("the upstream ran %d times, want once", e.served.Load())
	}
	for name, want := range map[string]string{
		gate.VarStatus: string(x402.OutcomeSettled), gate.VarPayer: payer.Address.Hex(), gate.VarNetwork: e.net,
		gate.VarAmount: "10000", gate.VarTransaction: resp.Transaction,
	} {
		if got := e.vars.get(name); got != want {
			t.Errorf("SetVar %s = %q, want %q", name, got, want)
		}
	}
}

func TestTheSamePaymentPresentedAgainIsRefusedAndNotServedTwice(t *testing.T) {
	e := newEnv(t, setup{})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("first presentation = %d %q, want 200", a.status, a.body)
	}

	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("second presentation = %d %q, want 402", a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || !strings.HasPrefix(pr.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the refusal says %q (%v), want %s", pr.Error, err, x402.ReasonPaymentAlreadyUsed)
	}
	if e.served.Load() != 1 {
		t.Errorf("the upstream ran %d times for one payment, want once", e.served.Load())
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s for one payment, want %d", lost, gained, price)
	}
}

func TestAMalformedPaymentHeaderIs400NamingWhatIsWrong(t *testing.T) {
	e := newEnv(t, setup{})
	for _, tc := range []struct{ name, header, says string }{
		{"not base64", "%%%not-base64%%%", "base64"},
		{"base64 of no JSON", "bm90IGpzb24", "not-json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := e.get(x402.HeaderPaymentSignature, tc.header)
			if a.status != http.StatusBadRequest {
				t.Fatalf("malformed header = %d %q, want 400", a.status, a.body)
			}
			pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if err != nil {
				t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
			}
			if !strings.HasPrefix(pr.Error, "invalid payment header: ") || !strings.Contains(pr.Error, tc.says) {
				t.Errorf("the answer says %q, want it to name the problem (%s)", pr.Error, tc.says)
			}
		})
	}
	if e.served.Load() != 0 {
		t.Errorf("the upstream ran %d times for malformed payments", e.served.Load())
	}
}

func TestAnUpstreamFailureIsPassedOnUnchargedAndThePaymentStillBuysTheResource(t *testing.T) {
	e := newEnv(t, setup{settle: gate.SettleAfter})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)

	e.failing.Store(true)
	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusServiceUnavailable || a.header.Get(x402.HeaderPaymentResponse) != "" {
		t.Fatalf("with the upstream down = %d %q (PAYMENT-RESPONSE %q), want its 503 and no settlement",
			a.status, a.body, a.header.Get(x402.HeaderPaymentResponse))
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Fatalf("an upstream error cost the payer %s (the seller gained %s), want nothing", lost, gained)
	}

	e.failing.Store(false)
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the same payment once the upstream is back = %d %q, want 200", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want exactly %d", lost, gained, price)
	}
}

// A payment header is a bearer value, the gate's alone to read: the next handler gets the request without any
// payment header (the gate's own payment_header, PAYMENT-SIGNATURE, X-PAYMENT), whichever carried the payment.
func TestTheNextHandlerGetsTheRequestWithoutItsPaymentHeaders(t *testing.T) {
	var mu sync.Mutex
	var seen http.Header
	e := newEnv(t, setup{
		config: func(c *gate.Config) { c.PaymentHeader = "X-Pay" },
		upstream: func(w http.ResponseWriter, r *http.Request) error {
			mu.Lock()
			seen = r.Header.Clone()
			mu.Unlock()
			_, err := io.WriteString(w, "paid content")
			return err
		},
	})
	payer := e.c.Payers[0]
	a := e.get("X-Pay", e.permit2(payer), x402.HeaderPaymentSignature, "a payment for another gate", x402.HeaderXPayment, "and another")
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("paid in X-Pay = %d %q, want 200", a.status, a.body)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, name := range []string{"X-Pay", x402.HeaderPaymentSignature, x402.HeaderXPayment} {
		if v := seen.Get(name); v != "" {
			t.Errorf("the next handler got %s: %.64s", name, v)
		}
	}
}

func TestACORSPreflightIsAnsweredByTheGateWithoutReachingTheUpstream(t *testing.T) {
	e := newEnv(t, setup{})
	req, _ := http.NewRequest(http.MethodOptions, e.srv.URL+"/report", nil)
	req.Header.Set("Origin", "https://app.example.com")
	req.Header.Set("Access-Control-Request-Method", "GET")
	req.Header.Set("Access-Control-Request-Headers", "payment-signature, x-trace")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	allowed := resp.Header.Get("Access-Control-Allow-Headers")
	if resp.StatusCode != http.StatusNoContent || !strings.Contains(allowed, x402.HeaderPaymentSignature) || !strings.Contains(allowed, "x-trace") {
		t.Fatalf("preflight = %d allowing %q, want 204 allowing the payment header and the asked one", resp.StatusCode, allowed)
	}
	if e.served.Load() != 0 {
		t.Error("a preflight reached the upstream")
	}
}

func TestGatesOfOneJournalShareOneLedgerUntilTheLastCloses(t *testing.T) {
	store, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	e := newEnv(t, setup{journal: store})
	second, err := gate.New(gate.Config{Offers: []gate.Offer{{Network: e.net, Asset: e.c.Token.Hex(), PayTo: e.payTo.Hex(),
		Amount: "20000", TokenName: "Stable Coin", TokenVersion: "1", Decimals: 6, MaxTimeoutSeconds: 300}},
		Embedded: true, Ledgers: e.cfg.Ledgers, Permits: e.cfg.Permits}, e.fac, store, "test")
	if err != nil {
		t.Fatal(err)
	}
	if err := second.Start(); err != nil {
		t.Fatal(err)
	}
	if second.Ledger() != e.gate.Ledger() {
		t.Fatal("two gates of one journal keep two ledgers: a payment in flight at one is not seen by the other")
	}
	if err := second.Close(); err != nil {
		t.Fatal(err)
	}
	// The first gate still serves on the shared ledger.
	payer := e.c.Payers[1]
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("after another gate of the journal closed, a payment = %d %q, want 200", a.status, a.body)
	}
}

func TestASettleAsyncPaymentIsServedAtOnceAndSettlesInTheBackgroundOnce(t *testing.T) {
	e := newEnv(t, setup{settle: gate.SettleAsync})
	payer := e.c.Payers[2]
	header := e.permit2(payer)
	before := e.balances(payer)

	a := e.get(x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("paid request = %d %q, want 200 with the upstream's content", a.status, a.body)
	}
	resp, err := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
	if err != nil || resp.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("PAYMENT-RESPONSE = %+v (%v), want %s", resp, err, x402.ReasonSettlementPending)
	}
	deadline := time.Now().Add(20 * time.Second)
	for e.gate.Ledger().Backlog() > 0 || e.c.TokenBalance(e.payTo).Cmp(new(big.Int).Add(before[1], big.NewInt(price))) < 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the payment did not settle in the background in time (backlog %d)", e.gate.Ledger().Backlog())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want exactly %d", lost, gained, price)
	}
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired || e.served.Load() != 1 {
		t.Errorf("the async payment presented again = %d with the upstream run %d times, want 402 and once", a.status, e.served.Load())
	}
}

// A gate is handed what it cannot know by itself: who owns its journal's ledger, and how to recover a permit's
// signer. Without them it refuses to be made or started, saying which, rather than keep a ledger of its own (which
// would miss the payments in flight at the other gates of its journal) or match version 1 payments blind.
func TestAGateWithoutItsLedgersOrPermitSignersRefusesToStart(t *testing.T) {
	e := newEnv(t, setup{noGate: true})
	cfg := e.cfg
	cfg.Permits = nil
	if _, err := gate.New(cfg, e.fac, e.store, "test"); err == nil || !strings.Contains(err.Error(), "Config.Permits") {
		t.Errorf("gate.New without Permits = %v, want an error naming Config.Permits", err)
	}
	cfg = e.cfg
	cfg.Ledgers = nil
	g, err := gate.New(cfg, e.fac, e.store, "test")
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Start(); err == nil || !strings.Contains(err.Error(), "Config.Ledgers") {
		t.Fatalf("Start without Ledgers = %v, want an error naming Config.Ledgers", err)
	}
	err = g.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/report", nil),
		gate.HandlerFunc(func(http.ResponseWriter, *http.Request) error { t.Error("the upstream ran"); return nil }))
	var se *gate.StatusError
	if !errors.As(err, &se) || se.Status != http.StatusServiceUnavailable {
		t.Fatalf("ServeHTTP after a failed Start = %v, want a 503 StatusError", err)
	}
}

func TestAGateNotStartedYetAnswers503AndCallsNothing(t *testing.T) {
	e := newEnv(t, setup{})
	g, err := gate.New(gate.Config{Offers: []gate.Offer{{Network: e.net, Asset: e.c.Token.Hex(), PayTo: e.payTo.Hex(),
		Amount: "10000", MaxTimeoutSeconds: 300}}, Embedded: true, Ledgers: e.cfg.Ledgers, Permits: e.cfg.Permits}, e.fac, e.store, "test")
	if err != nil {
		t.Fatal(err)
	}
	called := false
	err = g.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/report", nil),
		gate.HandlerFunc(func(http.ResponseWriter, *http.Request) error { called = true; return nil }))
	var se *gate.StatusError
	if !errors.As(err, &se) || se.Status != http.StatusServiceUnavailable || called {
		t.Fatalf("ServeHTTP before Start = %v (upstream called %v), want a 503 StatusError and no upstream", err, called)
	}
}

// noChainTime is the embedded engine whose chain time cannot be read (its node out of reach for the head block).
type noChainTime struct{ *chain.Facilitator }

func (noChainTime) NextBlockTime(context.Context, string) (time.Time, error) {
	return time.Time{}, errors.New("reading the head block: the node answers 503")
}

// TestASettleAsyncPaymentWhoseRoomTheEngineCannotJudgeIsSettledBeforeItIsServed: a settle async gate serves first
// only a payment whose deadline leaves its settlement room, judged by the engine's chain time; when the engine
// cannot tell it, the gate's clock is no substitute (a chain sealing per burst runs minutes ahead of it), and the
// payment is settled before it is served. Before, the gate judged by its clock and served it unsettled.
func TestASettleAsyncPaymentWhoseRoomTheEngineCannotJudgeIsSettledBeforeItIsServed(t *testing.T) {
	e := newEnv(t, setup{settle: gate.SettleAsync, noGate: true})
	e.startGateWith(noChainTime{e.fac})
	payer := e.c.Payers[2]
	header := e.permit2(payer)
	before := e.balances(payer)
	e.wantSettled(e.get(x402.HeaderPaymentSignature, header), payer, before) // settled before it was served
}
