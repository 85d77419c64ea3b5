package caddymodule_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// This file holds the tests of what a caller, a log or a crash can see at the edges of a gate and a
// facilitator: redirects of a remote facilitator, API keys in access logs, internal addresses in 502 bodies,
// the cost of /health, and a damaged journal at start-up.

// internalPath is the path under which the tests' remote facilitators live: it must never reach a caller.
const internalPath = "/secret-internal-path"

// frontedFacilitator is a remote facilitator under internalPath: it passes each call to a real one (rf, an
// engine on the simulated chain) unless a fault is set for its endpoint, and records the API keys it saw.
type frontedFacilitator struct {
	URL string // base URL, internalPath included
	rf  *remoteFacilitator

	mu     sync.Mutex
	faults map[string]http.HandlerFunc // endpoint ("/settle") -> answer instead of the real one
	keys   map[string]bool
}

func newFrontedFacilitator(t *testing.T, rf *remoteFacilitator) *frontedFacilitator {
	t.Helper()
	f := &frontedFacilitator{rf: rf, faults: map[string]http.HandlerFunc{}, keys: map[string]bool{}}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	f.URL = srv.URL + internalPath
	return f
}

func (f *frontedFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	endpoint, ok := strings.CutPrefix(r.URL.Path, internalPath)
	if !ok {
		http.NotFound(w, r)
		return
	}
	f.mu.Lock()
	f.keys[r.Header.Get(x402.HeaderAPIKey)] = true
	fault := f.faults[endpoint]
	f.mu.Unlock()
	if fault != nil {
		fault(w, r)
		return
	}
	r2 := r.Clone(r.Context())
	r2.URL.Path = endpoint
	f.rf.ServeHTTP(w, r2)
}

// fail makes endpoint answer with answer; nil lets it through again.
func (f *frontedFacilitator) fail(endpoint string, answer http.HandlerFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults[endpoint] = answer
}

// hangUp closes the connection without an answer, as a facilitator that died or a cut line would.
func hangUp(w http.ResponseWriter, _ *http.Request) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		conn.Close()
	}
}

// newFrontedGateEnv starts a gate whose remote facilitator is reached through a frontedFacilitator.
func newFrontedGateEnv(t *testing.T, s gateSetup) (*gateEnv, *frontedFacilitator) {
	t.Helper()
	c := chaintest.New(t, chaintest.WithHTTP())
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	t.Cleanup(commitPending(t, c))
	env.remote = newRemoteFacilitator(t, c, 2, 0)
	front := newFrontedFacilitator(t, env.remote)
	s.remote, s.facURL = true, front.URL
	env.srv = startCaddy(t, env.caddyfile(s))
	return env, front
}

// decoy is a facilitator a redirect points to: it answers every call with a settlement well formed for the
// payment it was sent (its network, its signed payer, a transaction hash), as a forger would, and records what
// reached it.
type decoy struct {
	URL       string
	calls     atomic.Int64
	gotAPIKey atomic.Bool
}

func newDecoy(t *testing.T) *decoy {
	t.Helper()
	d := &decoy{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.calls.Add(1)
		if r.Header.Get(x402.HeaderAPIKey) != "" {
			d.gotAPIKey.Store(true)
		}
		var req x402.VerifyRequest
		if body, err := io.ReadAll(r.Body); err == nil {
			req, _ = x402.DecodeVerifyRequest(body)
		}
		payer, _ := req.PaymentPayload.Payload.PayerAndNonce()
		// A settlement for /settle, a valid payment for /verify: whichever it is asked.
		gateWriteJSON(w, http.StatusOK, map[string]any{"success": true, "isValid": true, "transaction": "0x" + strings.Repeat("ab", 32),
			"network": req.PaymentRequirements.Network, "payer": payer, "amount": req.PaymentRequirements.Amount})
	}))
	t.Cleanup(srv.Close)
	d.URL = srv.URL
	return d
}

// TestAGateNeverFollowsItsFacilitatorsRedirectNorSendsItsKeyOrTakesASettlementFromThere: a facilitator
// answering /settle (or /verify) with a redirect to another host gets a 502 that says the payment may have
// settled; the other host never hears of the payment or the key, and the payment, presented again once the
// facilitator answers, is served once.
func TestAGateNeverFollowsItsFacilitatorsRedirectNorSendsItsKeyOrTakesASettlementFromThere(t *testing.T) {
	const gateKey = "gate-facilitator-key-31f7"
	for _, endpoint := range []string{"/settle", "/verify"} {
		t.Run("redirect at "+endpoint, func(t *testing.T) {
			env, front := newFrontedGateEnv(t, gateSetup{gate: "\t\tfacilitator_api_key " + gateKey + "\n"})
			elsewhere := newDecoy(t)
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/", payer)

			front.fail(endpoint, func(w http.ResponseWriter, r *http.Request) {
				http.Redirect(w, r, elsewhere.URL+endpoint, http.StatusTemporaryRedirect)
			})
			a := env.get("/", x402.HeaderPaymentSignature, header)
			want := x402.OutcomeSettleUnreachable
			if endpoint == "/verify" {
				want = x402.OutcomeVerifyUnreachable
			}
			var body struct{ Error, Outcome string }
			if a.status != http.StatusBadGateway || json.Unmarshal([]byte(a.body), &body) != nil || body.Outcome != string(want) {
				t.Fatalf("answer with the facilitator redirecting %s = %d %q; want 502 %s", endpoint, a.status, a.body, want)
			}
			if !strings.Contains(body.Error, "redirect") || strings.Contains(a.body, elsewhere.URL) {
				t.Errorf("502 body %q: want it to say the facilitator redirected, without naming where", a.body)
			}
			if a.header.Get(x402.HeaderPaymentResponse) != "" || a.header.Get(x402.HeaderPaymentRequired) != "" {
				t.Errorf("a redirect was answered with a settlement or an offer to pay again: %v", a.header)
			}
			if n := elsewhere.calls.Load(); n != 0 || elsewhere.gotAPIKey.Load() {
				t.Fatalf("the redirect's target got %d calls (API key: %v); want none", n, elsewhere.gotAPIKey.Load())
			}
			front.mu.Lock()
			sawKey := front.keys[gateKey]
			front.mu.Unlock()
			if !sawKey {
				t.Fatalf("the facilitator never saw the gate's API key; the test does not test what it says")
			}

			front.fail(endpoint, nil)
			if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != "paid content" {
				t.Fatalf("the same payment presented again = %d %q, want it served", a.status, a.body)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// assertNamesNoAddress fails when text names any of the internal addresses.
func assertNamesNoAddress(t *testing.T, what, text string, addresses ...string) {
	t.Helper()
	for _, a := range addresses {
		if a != "" && strings.Contains(text, a) {
			t.Errorf("%s %q names %q; internal addresses belong in logs, not in answers", what, text, a)
		}
	}
}

// TestTheGates502NamesNeitherTheFacilitatorsAddressNorItsPath: a facilitator that hangs up at /verify or at
// /settle gets the caller a 502 that says what kind of failure it was, never where the facilitator lives.
func TestTheGates502NamesNeitherTheFacilitatorsAddressNorItsPath(t *testing.T) {
	env, front := newFrontedGateEnv(t, gateSetup{})
	hostPort := strings.TrimPrefix(strings.TrimSuffix(front.URL, internalPath), "http://")
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	for _, tc := range []struct{ endpoint, outcome string }{
		{"/verify", string(x402.OutcomeVerifyUnreachable)},
		{"/settle", string(x402.OutcomeSettleUnreachable)},
	} {
		header := env.permit2Header("/", payer)
		front.fail(tc.endpoint, hangUp)
		a := env.get("/", x402.HeaderPaymentSignature, header)
		front.fail(tc.endpoint, nil)
		if a.status != http.StatusBadGateway || !strings.Contains(a.body, tc.outcome) {
			t.Fatalf("facilitator hanging up at %s: %d %q, want 502 %s", tc.endpoint, a.status, a.body, tc.outcome)
		}
		assertNamesNoAddress(t, "502 body", a.body, hostPort, internalPath, "127.0.0.1")
		if !strings.Contains(a.body, "no answer came") {
			t.Errorf("502 body %q: want it to say that no answer came", a.body)
		}
	}
	env.assertPaid(payer, before, 0)
}

// handRequest is a well-formed permit2 VerifyRequest body, for a facilitator that never gets to check it.
func handRequest(t *testing.T) []byte {
	t.Helper()
	const (
		payer = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"
		token = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
		payTo = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
	)
	rq := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: x402.NetworkTestnet, Amount: "10000", Asset: token,
		PayTo: payTo, MaxTimeoutSeconds: 60, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
	return mustJSON(t, x402.VerifyRequest{
		X402Version: x402.Version2,
		PaymentPayload: x402.PaymentPayload{X402Version: x402.Version2, Accepted: rq, Payload: x402.ExactEVMPayload{
			Signature: "0x" + strings.Repeat("11", 64) + "1b",
			Permit2Authorization: &x402.Permit2Authorization{From: payer, Permitted: x402.TokenPermissions{Token: token, Amount: "10000"},
				Spender: "0x402085c248EeA27D92E8b30b2C58ed07f9E20001", Nonce: "7", Deadline: "1767225660",
				Witness: x402.Permit2Witness{To: payTo, ValidAfter: "1767225000"}},
		}},
		PaymentRequirements: rq,
	})
}

// TestTheMiddlewares502NamesNoUpstreamAddress: a facilitator in middleware mode whose upstreams cannot be
// reached answers every endpoint with 502 (503 for /health) saying what failed, and never where an upstream
// lives: not its host and port, not its path.
func TestTheMiddlewares502NamesNoUpstreamAddress(t *testing.T) {
	first, second := freeAddr(t), freeAddr(t)
	srv := startCaddy(t, `{{ADDR}} {
	handle_path /one/* {
		x402_facilitator {
			upstream http://`+first+internalPath+` {
				timeout 2s
			}
		}
	}
	handle_path /two/* {
		x402_facilitator {
			upstream http://`+first+internalPath+` {
				timeout 2s
			}
			upstream http://`+second+`/other-internal-path {
				timeout 2s
			}
		}
	}
}
`)
	body := handRequest(t)
	for _, route := range []string{"/one", "/two"} {
		for _, tc := range []struct {
			method, endpoint string
			status           int
		}{
			{http.MethodGet, "supported", http.StatusBadGateway},
			{http.MethodPost, "verify", http.StatusBadGateway},
			{http.MethodPost, "settle", http.StatusBadGateway},
			{http.MethodGet, "health", http.StatusServiceUnavailable},
		} {
			var rd *bytes.Reader
			if tc.method == http.MethodPost {
				rd = bytes.NewReader(body)
			} else {
				rd = bytes.NewReader(nil)
			}
			req, _ := http.NewRequest(tc.method, srv.URL+route+"/"+tc.endpoint, rd)
			a, err := gateDo(req)
			if err != nil {
				t.Fatal(err)
			}
			if a.status != tc.status {
				t.Fatalf("%s %s/%s with the upstreams down = %d %q, want %d", tc.method, route, tc.endpoint, a.status, a.body, tc.status)
			}
			assertNamesNoAddress(t, route+"/"+tc.endpoint+" answer", a.body, first, second, internalPath, "other-internal-path", "127.0.0.1")
			if !strings.Contains(a.body, "no connection could be made") {
				t.Errorf("%s/%s answer %q: want it to say what failed", route, tc.endpoint, a.body)
			}
		}
	}
}

// TestTheFacilitatorKeepsTheAPIKeyOutOfCaddysAccessLog: Caddy logs request headers as they came and blanks
// only its own list of credentials; the facilitator's x-api-key, right or wrong, is written REDACTED, and the
// entries are still there.
func TestTheFacilitatorKeepsTheAPIKeyOutOfCaddysAccessLog(t *testing.T) {
	const rightKey, wrongKey = "facilitator-key-in-the-log-test-6b0e", "someone-elses-key-8c4d"
	srv := startCaddy(t, `{{ADDR}} {
	log {
		output file {{DATA}}/access.log
	}
	handle_path /facilitator/* {
		x402_facilitator {
			api_key `+rightKey+`
			upstream http://`+freeAddr(t)+` {
				timeout 2s
			}
		}
	}
}
`)
	logPath := filepath.Join(srv.dir, "access.log")
	requests := []struct {
		method, path, key string
		status            int
	}{
		{http.MethodGet, "/facilitator/health", rightKey, http.StatusServiceUnavailable},
		{http.MethodPost, "/facilitator/verify", rightKey, http.StatusBadGateway},
		{http.MethodGet, "/facilitator/supported", wrongKey, http.StatusUnauthorized},
	}
	for _, rq := range requests {
		var body []byte
		if rq.method == http.MethodPost {
			body = handRequest(t)
		}
		req, _ := http.NewRequest(rq.method, srv.URL+rq.path, bytes.NewReader(body))
		req.Header.Set("x-api-key", rq.key)
		a, err := gateDo(req)
		if err != nil {
			t.Fatal(err)
		}
		if a.status != rq.status {
			t.Fatalf("%s %s = %d %q, want %d", rq.method, rq.path, a.status, a.body, rq.status)
		}
	}

	type entry struct {
		Msg     string `json:"msg"`
		Logger  string `json:"logger"`
		Status  int    `json:"status"`
		Request struct {
			Method  string              `json:"method"`
			URI     string              `json:"uri"`
			Headers map[string][]string `json:"headers"`
		} `json:"request"`
	}
	var entries []entry
	var raw []byte
	deadline := time.Now().Add(5 * time.Second)
	for {
		raw, _ = os.ReadFile(logPath)
		entries = entries[:0]
		sc := bufio.NewScanner(bytes.NewReader(raw))
		for sc.Scan() {
			var e entry
			if json.Unmarshal(sc.Bytes(), &e) == nil && e.Msg == "handled request" {
				entries = append(entries, e)
			}
		}
		if len(entries) >= len(requests) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, key := range []string{rightKey, wrongKey} {
		if bytes.Contains(raw, []byte(key)) {
			t.Fatalf("the access log holds the API key %q:\n%s", key, raw)
		}
	}
	if len(entries) != len(requests) {
		t.Fatalf("the access log holds %d request entries, want %d (one per request):\n%s", len(entries), len(requests), raw)
	}
	// An entry is written as its handler returns, which may be after its response reached the client: the next
	// request's entry can come first (seen under -race), so each request's entry is looked for wherever it is.
	for _, rq := range requests {
		i := slices.IndexFunc(entries, func(e entry) bool { return e.Request.Method == rq.method && e.Request.URI == rq.path })
		if i < 0 {
			t.Errorf("no access log entry of %s %s:\n%s", rq.method, rq.path, raw)
			continue
		}
		if e := entries[i]; e.Status != rq.status || !strings.HasPrefix(e.Logger, "http.log.access") || strings.Join(e.Request.Headers["X-Api-Key"], ",") != "REDACTED" {
			t.Errorf("entry %d = %+v; want %s %s %d by Caddy's access logger with X-Api-Key REDACTED", i, e, rq.method, rq.path, rq.status)
		}
	}
}

// TestHealthCallsWithinAFewSecondsShareOneRoundOfChainReads: /health reads the head and every settlement
// wallet's balance; callers within its cache window, concurrent or one after another, share one such round,
// and a caller after the window gets a fresh one.
func TestHealthCallsWithinAFewSecondsShareOneRoundOfChainReads(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	proxy := chaintest.NewFaultProxy(t, c.RPCURL)
	var balanceReads atomic.Int64
	proxy.SetDecide(func(method string) chaintest.Fault {
		if method == "eth_getBalance" {
			balanceReads.Add(1)
		}
		return chaintest.Pass
	})
	e := startFacilitatorEnvOn(t, c, proxy.URL)
	const wallets = 2 // the env's settlement wallets: one balance read each per round
	health := func() {
		a := e.do(http.MethodGet, "/facilitator/health", e.key, nil)
		if a.status != http.StatusOK || a.json(t)["status"] != x402.HealthOK {
			t.Errorf("health = %d %s, want 200 ok", a.status, a.body)
		}
	}

	start := balanceReads.Load()
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(health)
	}
	wg.Wait()
	for range 10 {
		health()
	}
	if got := balanceReads.Load() - start; got != wallets {
		t.Fatalf("30 health calls within the cache window read wallet balances %d times, want one round of %d", got, wallets)
	}
	time.Sleep(2500 * time.Millisecond) // past the cache window
	health()
	if got := balanceReads.Load() - start; got != 2*wallets {
		t.Fatalf("a health call after the cache window: %d balance reads in all, want a second round (%d)", got, 2*wallets)
	}
}

// TestCaddyRefusesToStartOnADamagedJournalNamingTheFile: a journal file found empty (its claims lost) or cut
// short (bbolt panics or faults on it) stops the config from loading, with an error that names the file,
// rather than starting with the served payments forgotten or taking the process down.
func TestCaddyRefusesToStartOnADamagedJournalNamingTheFile(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	// A whole journal with claims in it, to cut short.
	whole := filepath.Join(t.TempDir(), "whole.db")
	st, err := journal.OpenBolt(whole, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 200 {
		id := journal.PaymentID(x402.NetworkTestnet, x402.TransferPermit2, c.Token.Hex(), c.Payers[0].Address.Hex(), strconv.Itoa(i))
		if _, _, err := st.Claim(t.Context(), journal.Record{ID: id, Network: x402.NetworkTestnet, Payer: c.Payers[0].Address.Hex(),
			Asset: c.Token.Hex(), Amount: "1", PayTo: c.Payers[1].Address.Hex(), Request: []byte(`{}`), Owner: "earlier-run"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(whole)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		keep int
	}{
		{"empty", 0},
		{"cut after its meta pages", 2 * os.Getpagesize()},
		{"cut in half", len(data) / 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "journal.db")
			if err := os.WriteFile(path, data[:tc.keep], 0o600); err != nil {
				t.Fatal(err)
			}
			text := `{
	x402 {
		network ` + x402.EIP155(c.ChainID.Uint64()) + ` {
			rpc ` + c.RPCURL + `
			asset ` + c.Token.Hex() + ` name "Stable Coin" version 1 decimals 6
			wallet_keys ` + hexKey(c.Wallets[0]) + `
		}
		journal ` + path + `
	}
}

http://` + freeAddr(t) + ` {
	x402_facilitator {
		open
	}
}
`
			caddyMu.Lock()
			defer caddyMu.Unlock()
			err := caddy.Load(adaptCaddyfile(t, text, dir), true)
			if err == nil {
				_ = caddy.Stop()
				t.Fatalf("Caddy started on the %s journal file; want it to refuse", tc.name)
			}
			if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "damaged") {
				t.Fatalf("load error = %v; want it to say the journal %s is damaged", err, path)
			}
			if got, _ := os.ReadFile(path); len(got) != tc.keep {
				t.Fatalf("the damaged journal is %d bytes after the refusal, was %d: it must be left for the operator", len(got), tc.keep)
			}
		})
	}
}
