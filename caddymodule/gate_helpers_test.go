package caddymodule_test

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
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
	"github.com/x402-gateway/caddy-x402/x402"
)

// gatePrice is what every gated test resource costs, in raw units (0.01 token).
const gatePrice = 10_000

// gateEnv is a simulated chain, a seller, and a Caddy whose gate settles on that chain, either through the
// x402 app's embedded engine or through a remote facilitator served over loopback HTTP.
type gateEnv struct {
	t      *testing.T
	c      *chaintest.Chain
	srv    *caddyServer
	payTo  common.Address
	net    string
	remote *remoteFacilitator // nil for the embedded engine
}

// gateSetup says how a gate test's Caddy is configured.
type gateSetup struct {
	remote   bool   // settle through a remote facilitator instead of the embedded engine
	gate     string // extra lines inside the x402 directive block
	site     string // the handler after the gate; default respond "paid content"
	network  string // extra lines inside the app's network block
	global   string // extra lines inside the global x402 block
	noCommit bool   // do not seal blocks automatically
	journal  string // journal path; default {{DATA}}/journal.db
	wallets  int    // settlement wallets; default 2
	rpc      string // the embedded engine's RPC URL; default the chain's
	// facURL is the remote gate's facilitator URL; default the test's remote facilitator. Set, the gate is
	// remote (whatever remote says) and no remote facilitator of the test's is started.
	facURL string
	sites  string // further site blocks, after the gate's
	// receiptTimeout is how long a settlement waits for its receipt before answering settlement_pending.
	receiptTimeout time.Duration
	chainOpts      []chaintest.Option
	// logFile sends Caddy's log to caddy.log in the data folder, for logged to read.
	logFile bool
}

// facilitatorKinds are the two ways a gate reaches its facilitator; outcome tests run for both.
var facilitatorKinds = []struct {
	name   string
	remote bool
}{{"embedded", false}, {"remote", true}}

func newGateEnv(t *testing.T, s gateSetup) *gateEnv {
	t.Helper()
	c := chaintest.New(t, append([]chaintest.Option{chaintest.WithHTTP()}, s.chainOpts...)...)
	if !s.noCommit {
		t.Cleanup(commitPending(t, c))
	}
	return startGateOn(t, c, s)
}

// startGateOn starts the Caddy of a gateEnv on a chain the test made (and seals blocks of) itself.
func startGateOn(t *testing.T, c *chaintest.Chain, s gateSetup) *gateEnv {
	t.Helper()
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"),
		net: x402.EIP155(c.ChainID.Uint64())}
	env.srv = startCaddy(t, env.caddyfile(s))
	return env
}

// caddyfile renders the configuration of s for this chain.
func (env *gateEnv) caddyfile(s gateSetup) string {
	wallets := s.wallets
	if wallets == 0 {
		wallets = 2
	}
	var keys []string
	for _, w := range env.c.Wallets[:wallets] {
		keys = append(keys, hexKey(w))
	}
	journalPath := s.journal
	if journalPath == "" {
		journalPath = "{{DATA}}/journal.db"
	}
	var global, gate string
	if s.remote || s.facURL != "" {
		facURL := s.facURL
		if facURL == "" {
			if env.remote == nil {
				env.remote = newRemoteFacilitator(env.t, env.c, wallets, s.receiptTimeout)
			}
			facURL = env.remote.URL
		}
		global = fmt.Sprintf("\tx402 {\n\t\tjournal %s\n%s\t}\n", journalPath, s.global)
		gate = "\t\tnetwork " + env.net + "\n\t\tfacilitator " + facURL + "\n"
	} else {
		network := s.network
		if s.receiptTimeout > 0 {
			network += fmt.Sprintf("\t\t\treceipt_timeout %s\n", s.receiptTimeout)
		}
		global = fmt.Sprintf(`	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
%s		}
		journal %s
%s	}
`, env.net, cmp.Or(s.rpc, env.c.RPCURL), env.c.Token.Hex(), strings.Join(keys, ","), network, journalPath, s.global)
		gate = "\t\tnetwork " + env.net + "\n"
	}
	site := s.site
	if site == "" {
		site = `respond "paid content"`
	}
	if s.logFile {
		global = "\tlog {\n\t\toutput file {{DATA}}/caddy.log\n\t\tformat json\n\t\tlevel INFO\n\t}\n" + global
	}
	return fmt.Sprintf(`{
%s}

{{ADDR}} {
	x402 {
		pay_to %s
		amount %d
		asset %s
%s%s	}
	%s
}
%s`, global, env.payTo.Hex(), gatePrice, env.c.Token.Hex(), gate, s.gate, site, s.sites)
}

// reload loads the configuration of s into the running Caddy.
func (env *gateEnv) reload(s gateSetup) { env.srv.load(env.caddyfile(s)) }

// gateAnswer is a response with its body read.
type gateAnswer struct {
	status int
	header http.Header
	body   string
}

// get requests path with the given headers (name, value pairs).
func (env *gateEnv) get(path string, headers ...string) gateAnswer {
	env.t.Helper()
	req, err := http.NewRequest(http.MethodGet, env.srv.URL+path, nil)
	if err != nil {
		env.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	return env.do(req)
}

func (env *gateEnv) do(req *http.Request) gateAnswer {
	env.t.Helper()
	a, err := gateDo(req)
	if err != nil {
		env.t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	return a
}

// gateDo is do without the test, for goroutines.
func gateDo(req *http.Request) (gateAnswer, error) {
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return gateAnswer{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return gateAnswer{status: resp.StatusCode, header: resp.Header, body: string(body)}, err
}

// offer asks for the resource without paying and returns what the gate offers.
func (env *gateEnv) offer(path string) x402.PaymentRequired {
	env.t.Helper()
	a := env.get(path)
	if a.status != http.StatusPaymentRequired {
		env.t.Fatalf("unpaid GET %s = %d %q, want 402", path, a.status, a.body)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		env.t.Fatalf("decoding PAYMENT-REQUIRED: %v", err)
	}
	return pr
}

// requirement returns the offer of the given method.
func (env *gateEnv) requirement(path, method string) x402.PaymentRequirements {
	env.t.Helper()
	for _, rq := range env.offer(path).Accepts {
		if rq.Extra.AssetTransferMethod == method {
			return rq
		}
	}
	env.t.Fatalf("the gate offers no %s requirement", method)
	return x402.PaymentRequirements{}
}

// chainNow is the head block's time, which payers must sign by: chain time runs ahead of wall time.
func (env *gateEnv) chainNow() time.Time { return time.Unix(int64(env.c.HeadTime()), 0) }

// approvePermit2 lets Permit2 move the payer's tokens.
func (env *gateEnv) approvePermit2(payer *chaintest.Account) {
	max := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	env.c.Approve(payer, contracts.Permit2Address, max)
}

// signPermit2 signs a permit2 payment of rq.
func (env *gateEnv) signPermit2(payer *chaintest.Account, rq x402.PaymentRequirements) x402.PaymentPayload {
	env.t.Helper()
	p, err := chain.SignPermit2Payment(payer.Key, rq, env.c.ChainID, chain.Permit2Options{Now: env.chainNow()})
	if err != nil {
		env.t.Fatalf("signing a permit2 payment: %v", err)
	}
	return p
}

// signERC2612 signs an erc2612 payment of rq with the payer's current token nonce.
func (env *gateEnv) signERC2612(payer *chaintest.Account, rq x402.PaymentRequirements) x402.PaymentPayload {
	env.t.Helper()
	p, err := chain.SignERC2612Payment(payer.Key, rq, env.c.ChainID,
		chain.ERC2612Options{Now: env.chainNow(), TokenNonce: env.c.TokenNonce(payer.Address)})
	if err != nil {
		env.t.Fatalf("signing an erc2612 payment: %v", err)
	}
	return p
}

// permit2Header is a signed permit2 payment for path, ready for PAYMENT-SIGNATURE.
func (env *gateEnv) permit2Header(path string, payer *chaintest.Account) string {
	env.t.Helper()
	return gateEncode(env.t, env.signPermit2(payer, env.requirement(path, x402.TransferPermit2)))
}

func gateEncode(t testing.TB, v any) string {
	t.Helper()
	h, err := x402.EncodeHeader(v)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// balances is what a payer and the seller hold, to compare before and after.
type balances struct {
	payer, seller *big.Int
	transfers     int // token transfers from payer to seller
}

func (env *gateEnv) balances(payer *chaintest.Account) balances {
	return balances{env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo), env.c.CountTokenTransfers(payer.Address, env.payTo)}
}

// assertPaid checks that exactly n payments of gatePrice went from payer to the seller since before.
func (env *gateEnv) assertPaid(payer *chaintest.Account, before balances, n int64) {
	env.t.Helper()
	after := env.balances(payer)
	want := big.NewInt(gatePrice * n)
	if got := new(big.Int).Sub(before.payer, after.payer); got.Cmp(want) != 0 {
		env.t.Errorf("payer balance fell by %s, want %s", got, want)
	}
	if got := new(big.Int).Sub(after.seller, before.seller); got.Cmp(want) != 0 {
		env.t.Errorf("seller balance rose by %s, want %s", got, want)
	}
	if got := after.transfers - before.transfers; int64(got) != n {
		env.t.Errorf("%d token transfers from payer to seller, want %d", got, n)
	}
}

// waitPaid waits until the seller holds what before says plus n payments, for background settlement.
func (env *gateEnv) waitPaid(payer *chaintest.Account, before balances, n int64) {
	env.t.Helper()
	want := new(big.Int).Add(before.seller, big.NewInt(gatePrice*n))
	deadline := time.Now().Add(20 * time.Second)
	for env.c.TokenBalance(env.payTo).Cmp(want) < 0 {
		if time.Now().After(deadline) {
			env.t.Fatalf("the seller's balance did not reach %s in time (it is %s)", want, env.c.TokenBalance(env.payTo))
		}
		time.Sleep(10 * time.Millisecond)
	}
	env.assertPaid(payer, before, n)
}

// settleResponse decodes the PAYMENT-RESPONSE of an gateAnswer.
func settleResponse(t testing.TB, a gateAnswer) x402.SettleResponse {
	t.Helper()
	v := a.header.Get(x402.HeaderPaymentResponse)
	if v == "" {
		t.Fatalf("the gateAnswer (%d %q) has no PAYMENT-RESPONSE", a.status, a.body)
	}
	resp, err := x402.DecodeSettleResponse(v)
	if err != nil {
		t.Fatalf("decoding PAYMENT-RESPONSE: %v", err)
	}
	return resp
}

// requiredError decodes the PAYMENT-REQUIRED of an gateAnswer and returns its error text.
func requiredError(t testing.TB, a gateAnswer) string {
	t.Helper()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		t.Fatalf("decoding PAYMENT-REQUIRED of %d %q: %v", a.status, a.body, err)
	}
	return pr.Error
}

// remoteFacilitator is a facilitator over loopback HTTP: an embedded engine of its own (with its own
// journal) behind the four endpoints, counting calls, with switches that make it fail.
type remoteFacilitator struct {
	URL string
	f   *chain.Facilitator
	srv *httptest.Server

	verifies, settles atomic.Int64
	// settleFault, when set, decides how /settle fails: "down" answers 503 without settling, "lose-gateAnswer"
	// settles and then answers 500 without a body (the gateAnswer is lost on the way back).
	mu          sync.Mutex
	settleFault string
}

func newRemoteFacilitator(t *testing.T, c *chaintest.Chain, wallets int, receiptTimeout time.Duration) *remoteFacilitator {
	t.Helper()
	return newRemoteFacilitatorOf(t, c, c.Wallets[:wallets], receiptTimeout)
}

// newRemoteFacilitatorOf is newRemoteFacilitator settling from the given wallets.
func newRemoteFacilitatorOf(t *testing.T, c *chaintest.Chain, wallets []*chaintest.Account, receiptTimeout time.Duration) *remoteFacilitator {
	t.Helper()
	nc := chain.NetworkConfig{
		Network: x402.EIP155(c.ChainID.Uint64()), Backend: c.Client,
		Assets:      []chain.AssetConfig{{Address: c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
		ReceiptPoll: 2 * time.Millisecond, ReceiptTimeout: receiptTimeout,
	}
	for _, w := range wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatalf("starting the remote facilitator's engine: %v", err)
	}
	rf := &remoteFacilitator{f: f}
	rf.srv = httptest.NewServer(rf)
	rf.URL = rf.srv.URL
	t.Cleanup(func() {
		rf.srv.Close()
		f.Close()
	})
	return rf
}

func (rf *remoteFacilitator) setSettleFault(fault string) {
	rf.mu.Lock()
	defer rf.mu.Unlock()
	rf.settleFault = fault
}

func (rf *remoteFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	switch r.URL.Path {
	case "/supported":
		resp, _ := rf.f.Supported(ctx)
		gateWriteJSON(w, http.StatusOK, resp)
	case "/health":
		resp, _ := rf.f.Health(ctx)
		gateWriteJSON(w, http.StatusOK, resp)
	case "/verify", "/settle":
		body, _ := io.ReadAll(r.Body)
		req, err := x402.DecodeVerifyRequest(body)
		if err != nil {
			gateWriteJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		if r.URL.Path == "/verify" {
			rf.verifies.Add(1)
			resp, err := rf.f.Verify(ctx, req)
			if err != nil {
				http.Error(w, "", http.StatusBadGateway)
				return
			}
			gateWriteJSON(w, http.StatusOK, resp)
			return
		}
		rf.settles.Add(1)
		rf.mu.Lock()
		fault := rf.settleFault
		rf.mu.Unlock()
		if fault == "down" {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		resp, err := rf.f.Settle(ctx, req)
		if err != nil || fault == "lose-gateAnswer" {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		gateWriteJSON(w, http.StatusOK, resp)
	default:
		http.NotFound(w, r)
	}
}

func gateWriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// testUpstream is the origin behind the gate (reverse_proxy to its Addr). It answers with a settable status,
// records what it saw, and can hold each request until the test lets it go, so the test can act on the
// chain while the gate waits for the upstream.
type testUpstream struct {
	Addr  string
	calls atomic.Int64

	mu      sync.Mutex
	status  int
	header  http.Header // headers of the last request
	entered chan struct{}
	release chan struct{}
	onCall  func() // runs in the handler (must not call t.Fatal)
}

func newTestUpstream(t *testing.T) *testUpstream {
	t.Helper()
	u := &testUpstream{status: http.StatusOK}
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	u.Addr = strings.TrimPrefix(srv.URL, "http://")
	return u
}

func (u *testUpstream) setStatus(status int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.status = status
}

// hold makes the next requests wait in the handler; entered receives once per request that arrives.
func (u *testUpstream) hold() (entered <-chan struct{}, release func()) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.entered, u.release = make(chan struct{}, 16), make(chan struct{})
	ch := u.release
	var once sync.Once
	return u.entered, func() { once.Do(func() { close(ch) }) }
}

// unhold lets requests through at once again.
func (u *testUpstream) unhold() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.entered, u.release = nil, nil
}

func (u *testUpstream) lastHeader() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.header
}

func (u *testUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.calls.Add(1)
	u.mu.Lock()
	u.header = r.Header.Clone()
	status, entered, release, onCall := u.status, u.entered, u.release, u.onCall
	u.mu.Unlock()
	if entered != nil {
		entered <- struct{}{}
		<-release
	}
	if onCall != nil {
		onCall()
	}
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("X-Upstream", "yes")
	w.WriteHeader(status)
	fmt.Fprintf(w, "upstream says %d", status)
}

// getAsync sends a request from a goroutine; the gateAnswer arrives on the channel.
func (env *gateEnv) getAsync(path string, headers ...string) <-chan gateAnswer {
	return env.getAsyncCtx(context.Background(), path, headers...)
}

// getAsyncCtx is getAsync with a context: cancelling it makes the client go away, and the answer then has
// status -1 and the client's error as its body.
func (env *gateEnv) getAsyncCtx(ctx context.Context, path string, headers ...string) <-chan gateAnswer {
	ch := make(chan gateAnswer, 1)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, env.srv.URL+path, nil)
	if err != nil {
		env.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	go func() {
		a, err := gateDo(req)
		if err != nil {
			a = gateAnswer{status: -1, body: err.Error()}
		}
		ch <- a
	}()
	return ch
}

// gateWait waits for a value from ch, failing the test after a while.
func gateWait[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	var zero T
	return zero
}

// commitPending seals a block whenever a settlement wallet has a transaction waiting, asking the pool for the
// wallets' pending nonces: chaintest's AutoCommit asks for the pending block, which go-ethereum's miner caches
// for two seconds, so each settlement would wait up to two seconds for its block.
func commitPending(t testing.TB, c *chaintest.Chain) (stop func()) {
	return commitPendingUnless(c, nil)
}

// commitPendingUnless is commitPending that seals nothing while paused (when given) is true.
func commitPendingUnless(c *chaintest.Chain, paused *atomic.Bool) (stop func()) {
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		ctx := context.Background()
		for {
			select {
			case <-done:
				return
			case <-time.After(2 * time.Millisecond):
			}
			if paused != nil && paused.Load() {
				continue
			}
			for _, w := range c.Wallets {
				pending, err1 := c.Client.PendingNonceAt(ctx, w.Address)
				mined, err2 := c.Client.NonceAt(ctx, w.Address, nil)
				if err1 == nil && err2 == nil && pending > mined {
					c.Commit()
					break
				}
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-finished }) }
}
