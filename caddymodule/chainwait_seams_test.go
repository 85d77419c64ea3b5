package caddymodule_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// restartWithTheChainDownAt stops Caddy, as a process exit does, and starts the same site again on the same
// journal with its RPC at a free port nobody listens on yet, which it returns.
func (env *gateEnv) restartWithTheChainDownAt() string {
	env.t.Helper()
	if err := caddy.Stop(); err != nil {
		env.t.Fatal(err)
	}
	http.DefaultClient.CloseIdleConnections()
	addr := freeAddr(env.t)
	env.srv.load(env.caddyfile(gateSetup{rpc: "http://" + addr}))
	return addr
}

// proxyChainAt makes the simulated chain answer at addr: the RPC address a Caddy was given while nothing listened.
// It returns the count of the requests it passed on.
func proxyChainAt(t testing.TB, c *chaintest.Chain, addr string) *atomic.Int64 {
	t.Helper()
	target, _ := url.Parse(c.RPCURL)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	proxy, count := httputil.NewSingleHostReverseProxy(target), new(atomic.Int64)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		count.Add(1)
		proxy.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return count
}

// awaitNot502 presents the payment header at path until the answer is not the chain-down 502 (15 s at most).
func (env *gateEnv) awaitNot502(path, header string) gateAnswer {
	env.t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		a := env.get(path, x402.HeaderPaymentSignature, header)
		if a.status != http.StatusBadGateway || time.Now().After(deadline) {
			return a
		}
	}
}

// A payment that bought its response before a restart, presented again while the chain is down, is not told
// anything that could be false: not "not settled" (it settled), not "pay again". It gets 502 verify-unreachable
// with Retry-After, saying to present the same payment again; once the chain is back, that same payment gets the
// journal's true answer (402 already used), and the payer was charged once.
//
// Left open (issue 29's note): the gate could answer from its journal while the chain is down; it waits for the
// engine before it reads the journal.
func TestAPaymentServedBeforeARestartIsNotToldItWasNotSettledWhileTheChainIsDown(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)
	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusOK {
		t.Fatalf("paying = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)

	rpc := env.restartWithTheChainDownAt()
	a := env.get("/", x402.HeaderPaymentSignature, header)
	assertChainDownAnswerIsTrue(t, a)

	proxyChainAt(t, env.c, rpc)
	a = env.awaitNot502("/", header)
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(requiredError(t, a), x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the same payment once the chain is back = %d %q, want 402 %s", a.status, a.body, x402.ReasonPaymentAlreadyUsed)
	}
	env.assertPaid(payer, before, 1)
}

// A payment that settled before a restart whose response was cut short (the client left) has bought a response it
// did not get. Presented again while the chain is down, it is not told it was not settled; presented again once the
// chain is back, it is served from the journal's settlement, and the payer was charged once.
func TestAPaymentSettledButNotServedBeforeARestartIsServedWhileTheChainIsDown(t *testing.T) {
	env := newGateEnv(t, gateSetup{noCommit: true})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)
	env.leaveWhileSettling("/", header)
	t.Cleanup(commitPending(t, env.c))
	env.waitOutcomes(x402.OutcomeSettled, 1)
	env.assertPaid(payer, before, 1)

	rpc := env.restartWithTheChainDownAt()
	a := env.get("/", x402.HeaderPaymentSignature, header)
	assertChainDownAnswerIsTrue(t, a)

	proxyChainAt(t, env.c, rpc)
	a = env.awaitNot502("/", header)
	if a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the payment settled (not served) before the restart, presented again once the chain is back = %d %q, "+
			"want 200 paid content served from the journal's settlement", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// assertChainDownAnswerIsTrue checks the answer to a payment while the chain is down says only what stays true.
func assertChainDownAnswerIsTrue(t *testing.T, a gateAnswer) {
	t.Helper()
	if a.status != http.StatusBadGateway || a.header.Get("Retry-After") == "" {
		t.Fatalf("a payment presented with the chain down = %d (Retry-After %q) %q, want 502 with Retry-After", a.status, a.header.Get("Retry-After"), a.body)
	}
	for _, lie := range []string{"not settled", "not charged", "pay again", "new payment"} {
		if strings.Contains(a.body, lie) {
			t.Errorf("the answer with the chain down says %q, which may be false for a payment of an earlier run: %s", lie, a.body)
		}
	}
	if !strings.Contains(a.body, "same payment again") {
		t.Errorf("the answer with the chain down does not say to present the same payment again: %s", a.body)
	}
}

// An RPC URL carrying an API key in its path and a user and password (basic auth, as some providers take it) must
// not reach /health or the log while the chain is down: the probe's error quotes the URL as Go's HTTP client
// writes it (user:***@...), which the app's redactor does not know.
func TestAnRPCURLWithCredentialsStaysOutOfHealthAndLogWhileTheChainIsDown(t *testing.T) {
	const secret = "provider-path-key-7c1f"
	env := newStoppedGateEnv(t)
	side := freeAddr(t)
	rpc := "http://user:pass@" + freeAddr(t) + "/v2/" + secret
	env.srv = startCaddy(t, env.caddyfile(gateSetup{rpc: rpc, logFile: true,
		sites: "http://" + side + " {\n\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\topen\n\t\t}\n\t}\n}\n"}))
	a := env.get("/")
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("paid route with the chain down = %d %q, want its 402 made from the configuration", a.status, a.body)
	}
	req, _ := http.NewRequest(http.MethodGet, "http://"+side+"/facilitator/health", nil)
	h := env.do(req)
	if strings.Contains(h.body, secret) {
		t.Errorf("/health with the chain down holds the RPC URL's key: %s", h.body)
	}
	log, err := os.ReadFile(filepath.Join(env.srv.dir, "caddy.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, secret) {
			t.Errorf("the log holds the RPC URL's key: %s", line)
		}
	}
}

// Reloads while the engine waits for its chain are refused (the old config keeps serving) and leave nothing
// running behind them: no second waiter, no goroutine per reload.
func TestReloadsWhileTheChainIsDownLeaveNoGoroutinesBehind(t *testing.T) {
	racepass.Once(t, "8 s of sleeps for the waiter's probes to end before goroutines are counted; reloads beside the waiter run under -race in TestAReloadWithTheChainDownKeepsTheOldConfigServing and TestAWaitingEngineRacingAReloadAsTheChainComesUpLeaksNoEngine")
	env := newStoppedGateEnv(t)
	down := gateSetup{rpc: "http://" + freeAddr(t)}
	env.srv = startCaddy(t, env.caddyfile(down))
	if a := env.get("/"); a.status != http.StatusPaymentRequired {
		t.Fatalf("paid route with the chain down = %d %q, want its 402 made from the configuration", a.status, a.body)
	}
	time.Sleep(time.Second)
	base := runtime.NumGoroutine()
	for i := range 5 {
		s := down
		s.site = fmt.Sprintf("respond \"config %d\"", i)
		if err := caddy.Load(env.srv.adapt(env.caddyfile(s)), true); err == nil {
			t.Fatalf("reload %d with the chain down was taken, want it refused", i)
		}
	}
	http.DefaultClient.CloseIdleConnections()
	time.Sleep(7 * time.Second) // a probe under way ends within 5 s
	if n := runtime.NumGoroutine(); n > base+5 {
		buf := make([]byte, 1<<20)
		t.Fatalf("%d goroutines after 5 refused reloads, %d before:\n%s", n, base, buf[:runtime.Stack(buf, true)])
	}
	if a := env.get("/"); a.status != http.StatusPaymentRequired || a.header.Get(x402.HeaderPaymentRequired) == "" {
		t.Fatalf("paid route after the refused reloads = %d %q, want the old config's 402", a.status, a.body)
	}
}

// An engine waiting for its chain when a reload comes as the chain comes up: the process ends with one engine,
// held once by the config that runs, a payment settles once, and nothing is held after Stop.
func TestAWaitingEngineRacingAReloadAsTheChainComesUpLeaksNoEngine(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	rpcAddr := freeAddr(t)
	setup := gateSetup{rpc: "http://" + rpcAddr}
	env := startGateOn(t, c, setup)
	if a := env.get("/"); a.status != http.StatusPaymentRequired {
		t.Fatalf("paid route with the chain down = %d %q, want its 402 made from the configuration", a.status, a.body)
	}
	proxyChainAt(t, c, rpcAddr)
	s := setup
	s.site = `respond "paid content"` + "\n\theader X-Config new"
	for deadline := time.Now().Add(15 * time.Second); ; {
		if err := caddy.Load(env.srv.adapt(env.caddyfile(s)), true); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no reload was taken 15 s after the RPC came up")
		}
	}
	http.DefaultClient.CloseIdleConnections()
	env.srv.waitForOldSocket()
	time.Sleep(6 * time.Second) // the old waiter's try ends
	if n, refs := caddymodule.EnginesHeld(); n != 1 || refs != 1 {
		t.Errorf("after the reload: %d engines, %d references, want 1 engine held once", n, refs)
	}
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK || a.header.Get("X-Config") != "new" {
		t.Fatalf("paying after the reload = %d %q, want 200 from the new config", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	if n, refs := caddymodule.EnginesHeld(); n != 0 || refs != 0 {
		t.Errorf("after Stop: %d engines, %d references, want none", n, refs)
	}
}

// A gateway of a cluster (PostgreSQL journal) whose chain is down must not flicker in and out of the cluster's
// live instances: the others size their share of the settlement wallets by how many instances are live, and give
// up wallets past it. Each try to start the engine opens the journal (a new instance) and closes it on failure.
func TestAGatewayWaitingForItsChainDoesNotFlickerAmongTheClustersInstances(t *testing.T) {
	racepass.Once(t, "12 s of sampling the cluster's live-instance count while one gateway waits for its chain; the waiter's tries run under -race in the package's other chain-down tests")
	dsn := pgtest.Shared(t)
	t.Setenv("X402_TEST_JOURNAL_DSN", dsn)
	env := newStoppedGateEnv(t)
	observer, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer observer.Close()
	env.srv = startCaddy(t, env.caddyfile(gateSetup{rpc: "http://" + freeAddr(t), journal: "{env.X402_TEST_JOURNAL_DSN}"}))
	if a := env.get("/"); a.status != http.StatusPaymentRequired {
		t.Fatalf("paid route with the chain down = %d %q, want its 402 made from the configuration", a.status, a.body)
	}
	seen := map[int]int{}
	for end := time.Now().Add(12 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		live, _, err := observer.Instances(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		seen[live]++
	}
	if len(seen) > 1 {
		t.Errorf("the live instances another gateway counts, sampled every 20 ms for 12 s while this one waits for its chain: %v "+
			"(count: samples); want one steady count", seen)
	}
}

// flakyChainAt serves the chain's RPC at addr after a spell of 503s: every request that arrives in the first
// 2 s after the first one is held until 2.2 s, then answered 503; later ones reach the chain. A client giving up
// within its 2 s of tries (the engine's Failover) is down throughout, and a client asking right after (the app's
// probe) finds the chain up.
func flakyChainAt(t testing.TB, c *chaintest.Chain, addr string) {
	t.Helper()
	target, _ := url.Parse(c.RPCURL)
	proxy := httputil.NewSingleHostReverseProxy(target)
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var first time.Time
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		if first.IsZero() {
			first = time.Now()
		}
		since := time.Since(first)
		mu.Unlock()
		if since < 2*time.Second {
			time.Sleep(2200*time.Millisecond - since)
			http.Error(w, "the node is down for a moment", http.StatusServiceUnavailable)
			return
		}
		proxy.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
}

// A chain down through every try of the engine's start and up again an instant later, when the app asks whether
// it is down: the site starts all the same (it failed to start: the engine's failure said no endpoint answered,
// but the probe after it found one), and the engine, started in the background, settles a payment.
func TestASiteStartsWhenItsChainIsBackJustAfterTheEngineGaveUp(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	rpcAddr := freeAddr(t)
	flakyChainAt(t, c, rpcAddr)
	env := startGateOn(t, c, gateSetup{rpc: "http://" + rpcAddr})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.awaitNot502("/", env.permit2Header("/", payer)); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("paid request once the engine is up = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}
