package caddymodule_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A site whose RPC refuses connections as Caddy starts starts all the same: its free route serves, its paid route
// answers with the offers its configuration alone can make (402: exact by permit2 and eip3009, each as the gate
// offers it once the chain is up) or, with a payment, 502 verify-unreachable with Retry-After;
// x402_facilitator's /health says which network is down since when; and once the RPC answers the engine starts
// by itself and a payment settles on chain.
func TestASiteStartsWithoutItsChainAndSettlesOnceTheRPCAnswers(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	rpcAddr, side := freeAddr(t), freeAddr(t)
	env := startGateOn(t, c, gateSetup{rpc: "http://" + rpcAddr, sites: "http://" + side + " {\n\thandle /free {\n\t\trespond \"free\"\n\t}\n" +
		"\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\topen\n\t\t}\n\t}\n}\n"})

	get := func(u string, headers ...string) gateAnswer {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, u, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		return env.do(req)
	}
	if a := get("http://" + side + "/free"); a.status != http.StatusOK || a.body != "free" {
		t.Fatalf("free route with the chain down = %d %q, want 200 free", a.status, a.body)
	}
	offline := env.offer("/") // 402, or the test fails
	if len(offline.Accepts) == 0 {
		t.Fatal("the 402 with the chain down offers nothing")
	}
	for _, o := range offline.Accepts {
		if o.Scheme != x402.SchemeExact || (o.Extra.AssetTransferMethod != x402.TransferPermit2 && o.Extra.AssetTransferMethod != x402.TransferEIP3009) {
			t.Errorf("the 402 with the chain down offers %s by %s, which names a settlement wallet only the engine knows", o.Scheme, o.Extra.AssetTransferMethod)
		}
	}
	a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, map[string]any{"x402Version": 2}))
	if a.status != http.StatusBadGateway || a.header.Get("Retry-After") == "" || !strings.Contains(a.body, string(x402.OutcomeVerifyUnreachable)) {
		t.Fatalf("paid route with a payment, chain down = %d Retry-After %q %q, want 502 verify-unreachable with Retry-After",
			a.status, a.header.Get("Retry-After"), a.body)
	}
	h := get("http://" + side + "/facilitator/health")
	var health x402.HealthResponse
	if err := json.Unmarshal([]byte(h.body), &health); err != nil || health.Status != x402.HealthDown || len(health.Networks) != 1 ||
		!strings.Contains(health.Networks[0].Error, "network "+env.net+": no RPC endpoint answered since ") ||
		!strings.Contains(health.Networks[0].Error, rpcAddr) {
		t.Fatalf("/health with the chain down = %d %q (%v), want down, naming the network, since when and the endpoint", h.status, h.body, err)
	}

	// The RPC comes up on the configured port.
	proxyChainAt(t, c, rpcAddr)
	up := time.Now()
	for {
		if h := get("http://" + side + "/facilitator/health"); h.status == http.StatusOK && !strings.Contains(h.body, `"status":"down"`) {
			break
		}
		if time.Since(up) > 15*time.Second {
			t.Fatal("the facilitator is still down 15 s after the RPC came up")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Every offer made with the chain down is one the gate makes once it is up, to the byte.
	online := env.offer("/")
	for _, o := range offline.Accepts {
		if !slices.ContainsFunc(online.Accepts, func(p x402.PaymentRequirements) bool { return reflect.DeepEqual(o, p) }) {
			t.Errorf("offered with the chain down, not once it is up: %+v\nonline: %+v", o, online.Accepts)
		}
	}
	payer := c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("paid request once the RPC answers = %d %q, want 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
	for h := get("http://" + side + "/facilitator/health"); !strings.Contains(h.body, `"rpcReachable":true`); h = get("http://" + side + "/facilitator/health") {
		if time.Since(up) > 15*time.Second {
			t.Fatalf("/health 15 s after the RPC came up = %d %q, want the network reachable", h.status, h.body)
		}
		time.Sleep(100 * time.Millisecond) // /health is cached for a moment
	}
}

// A site started while its RPC refused connections, whose RPC then answers for another chain than its network's,
// stops waiting: that is a configuration no retry makes right. Its paid route answers 503 without Retry-After
// (never "present the same payment again"), /health names both chains, and the RPC is asked nothing more.
func TestASiteWhoseChainComesUpAsAnotherChainStopsWaitingAndSaysSo(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	other := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithChainID(chaintest.AltChainID))
	rpcAddr, side := freeAddr(t), freeAddr(t)
	env := startGateOn(t, c, gateSetup{rpc: "http://" + rpcAddr, sites: "http://" + side + " {\n" +
		"\thandle_path /facilitator/* {\n\t\tx402_facilitator {\n\t\t\topen\n\t\t}\n\t}\n}\n"})
	if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, map[string]any{"x402Version": 2})); a.status != http.StatusBadGateway {
		t.Fatalf("paid route with a payment, chain down = %d %q, want 502 verify-unreachable", a.status, a.body)
	}

	asked := proxyChainAt(t, other, rpcAddr)
	wrong := fmt.Sprintf("the RPC node serves chain %d, but the network is configured as %s", chaintest.AltChainID, env.net)
	var a gateAnswer
	for up := time.Now(); ; time.Sleep(100 * time.Millisecond) {
		a = env.get("/", x402.HeaderPaymentSignature, gateEncode(t, map[string]any{"x402Version": 2}))
		if a.status != http.StatusBadGateway {
			break
		}
		if time.Since(up) > 15*time.Second {
			t.Fatalf("15 s after the RPC answered for chain %d, the paid route still answers 502 %q: still waiting for the chain", chaintest.AltChainID, a.body)
		}
	}
	if a.status != http.StatusServiceUnavailable || a.header.Get("Retry-After") != "" || strings.Contains(a.body, "present the same payment again") {
		t.Fatalf("paid route with a payment, the RPC serving another chain = %d Retry-After %q %q, want 503 without Retry-After",
			a.status, a.header.Get("Retry-After"), a.body)
	}
	req, err := http.NewRequest(http.MethodGet, "http://"+side+"/facilitator/health", nil)
	if err != nil {
		t.Fatal(err)
	}
	h := env.do(req)
	if h.status == http.StatusOK || !strings.Contains(h.body, wrong) || strings.Contains(h.body, rpcAddr) {
		t.Fatalf("/health, the RPC serving another chain = %d %q, want a failure saying %q, without the RPC's address", h.status, h.body, wrong)
	}
	// The wait is over: past the longest pause between two tries, nothing more is asked of the RPC.
	before := asked.Load()
	time.Sleep(caddymodule.ChainRetryMax + time.Second)
	if n := asked.Load() - before; n != 0 {
		t.Fatalf("the RPC was asked %d more times after the site said its chain is another: the wait goes on", n)
	}
}

// A reload whose RPC refuses connections fails, as before, and leaves the old config serving and settling.
func TestAReloadWithTheChainDownKeepsTheOldConfigServing(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	bad := env.srv.adapt(env.caddyfile(gateSetup{rpc: "http://" + freeAddr(t), site: `respond "new content"`}))
	if err := caddy.Load(bad, true); err == nil {
		t.Fatal("a reload with its chain down was taken, want it refused")
	}
	http.DefaultClient.CloseIdleConnections()
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("paid request after the refused reload = %d %q, want the old config's 200", a.status, a.body)
	}
	env.assertPaid(payer, before, 1)
}

// With handle_errors routes, the answers given while the chain is down are theirs to write, as the gate's other
// 502s and 503s are, and keep their Retry-After (an upto route: with the chain down it has nothing to offer).
func TestAnswersWithTheChainDownGoToHandleErrors(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	env := startGateOn(t, c, gateSetup{rpc: "http://" + freeAddr(t), gate: "\t\tscheme upto\n",
		site: "respond \"paid content\"\n\thandle_errors {\n\t\trespond \"custom {err.status_code}\"\n\t}"})
	if a := env.get("/"); a.status != http.StatusServiceUnavailable || a.body != "custom 503" || a.header.Get("Retry-After") == "" {
		t.Fatalf("without payment = %d %q Retry-After %q, want handle_errors' 503 with Retry-After", a.status, a.body, a.header.Get("Retry-After"))
	}
	a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, map[string]any{"x402Version": 2}))
	if a.status != http.StatusBadGateway || a.body != "custom 502" || a.header.Get("Retry-After") == "" {
		t.Fatalf("with a payment = %d %q Retry-After %q, want handle_errors' 502 with Retry-After", a.status, a.body, a.header.Get("Retry-After"))
	}
}
