package caddymodule_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment header is a bearer value, and Caddy's error log (http.log.error) copies the request's headers as they
// arrived, just as its access log does, redacting only its own list of credentials. A paid request that ends in
// a handler's error (the upstream down: reverse_proxy's 502; the gate's own 502 handed to handle_errors; a price
// that does not resolve: 500) is in the error log, at the level Caddy would log it (ERROR without error routes,
// DEBUG with them), with its method, URI and remote address and the payment header REDACTED, never its value:
// the payment was not settled and stays presentable by whoever reads the log. The client's answer is Caddy's:
// the status and no body, or the site's own error page.
func TestAFailedPaidRequestIsInCaddysErrorLogWithoutItsPaymentHeader(t *testing.T) {
	const errorPage = "\n\thandle_errors {\n\t\trespond \"the site's own error page: {err.status_code}\" {err.status_code}\n\t}"
	cases := []struct {
		name   string
		start  func(t *testing.T) (env *gateEnv, header string)
		path   string
		status int
		body   string
		level  string
		msg    string // a part of the error entry's message
	}{{
		name: "the upstream is down", path: "/", status: http.StatusBadGateway, level: "error", msg: "connection refused",
		start: func(t *testing.T) (*gateEnv, string) {
			env := newGateEnv(t, gateSetup{logFile: true, site: `reverse_proxy 127.0.0.1:1`})
			return env, env.payment("/")
		},
	}, {
		name: "the upstream is down, with handle_errors, logging at debug", path: "/", status: http.StatusBadGateway,
		body: "the site's own error page: 502", level: "debug", msg: "connection refused",
		start: func(t *testing.T) (*gateEnv, string) {
			env := startGateAtDebug(t, gateSetup{site: `reverse_proxy 127.0.0.1:1` + errorPage})
			return env, env.payment("/")
		},
	}, {
		name: "the facilitator is gone, with handle_errors, logging at debug", path: "/", status: http.StatusBadGateway,
		body: "the site's own error page: 502", level: "debug", msg: "verify-unreachable",
		start: func(t *testing.T) (*gateEnv, string) {
			env := startGateAtDebug(t, gateSetup{remote: true, site: `respond "paid content"` + errorPage})
			header := env.payment("/")
			env.remote.srv.Close()
			return env, header
		},
	}, {
		name: "the price does not resolve", path: "/broken", status: http.StatusInternalServerError, level: "error", msg: "$abc",
		start: func(t *testing.T) (*gateEnv, string) {
			env, _ := newPricesEnv(t, "{price}", "")
			return env, env.payment("/other")
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env, header := tc.start(t)
			a := env.get(tc.path, x402.HeaderPaymentSignature, header)
			if a.status != tc.status || a.body != tc.body {
				t.Fatalf("the paid request = %d %q, want %d %q", a.status, a.body, tc.status, tc.body)
			}
			e, ok := env.errorLogEntry(tc.level, tc.msg)
			if !ok {
				t.Fatalf("no %s entry of Caddy's error logger whose message holds %q", tc.level, tc.msg)
			}
			rq := e.Request
			if rq.Method != http.MethodGet || rq.URI != tc.path || rq.RemoteIP != "127.0.0.1" || e.Status != tc.status ||
				strings.Join(rq.Headers[http.CanonicalHeaderKey(x402.HeaderPaymentSignature)], ",") != "REDACTED" {
				t.Errorf("the error entry %+v, want GET %s from 127.0.0.1, status %d, with the payment header REDACTED", e, tc.path, tc.status)
			}
			env.assertLogHoldsNo(header)
		})
	}
}

// The payment header is the gate's to read, and nobody's after it: the upstream never receives it (its own logs
// are outside the gate's reach), and reverse_proxy's debug log of the request it sends ("upstream roundtrip",
// with every header) does not show it, whichever header carried the payment. Who paid reaches the upstream
// through the gate's placeholders.
func TestNeitherTheUpstreamNorReverseProxysDebugLogSeesThePaymentHeader(t *testing.T) {
	up := newTestUpstream(t)
	env := startGateAtDebug(t, gateSetup{site: `reverse_proxy ` + up.Addr + ` {
		header_up X-Payer {http.x402.payer}
	}`})
	payer := env.c.Payers[0]
	for _, name := range []string{x402.HeaderPaymentSignature, x402.HeaderXPayment} {
		header := env.payment("/")
		if a := env.get("/", name, header); a.status != http.StatusOK {
			t.Fatalf("a payment in %s = %d %q, want 200", name, a.status, a.body)
		}
		h := up.lastHeader()
		for _, sent := range []string{x402.HeaderPaymentSignature, x402.HeaderXPayment} {
			if v := h.Get(sent); v != "" {
				t.Errorf("paid in %s: the upstream received %s: %.64s", name, sent, v)
			}
		}
		if !x402.SameAddress(h.Get("X-Payer"), payer.Address.Hex()) {
			t.Errorf("paid in %s: the upstream saw payer %q, want %s", name, h.Get("X-Payer"), payer.Address.Hex())
		}
		if !env.logged("upstream roundtrip") {
			t.Fatal("reverse_proxy logged no round trip at debug level")
		}
		env.assertLogHoldsNo(header)
	}
}

// startGateAtDebug starts the gate of s with Caddy's log in caddy.log at level DEBUG.
func startGateAtDebug(t *testing.T, s gateSetup) *gateEnv {
	t.Helper()
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	s.logFile = true
	env.srv = startCaddy(t, strings.Replace(env.caddyfile(s), "level INFO", "level DEBUG", 1))
	return env
}

// payment is a permit2 payment of the first payer for path, ready for a payment header.
func (env *gateEnv) payment(path string) string {
	env.t.Helper()
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	return gateEncode(env.t, env.signPermit2(payer, env.requirement(path, x402.TransferPermit2)))
}

// errorLogEntry is an entry of Caddy's error logger in caddy.log.
type errorLogEntry struct {
	Level   string `json:"level"`
	Logger  string `json:"logger"`
	Msg     string `json:"msg"`
	Status  int    `json:"status"`
	Request struct {
		RemoteIP string              `json:"remote_ip"`
		Method   string              `json:"method"`
		URI      string              `json:"uri"`
		Headers  map[string][]string `json:"headers"`
	} `json:"request"`
}

// errorLogEntry finds, waiting a moment for it, the entry of Caddy's error logger at level whose message holds msg.
func (env *gateEnv) errorLogEntry(level, msg string) (errorLogEntry, bool) {
	env.t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(env.srv.dir, "caddy.log"))
		for _, line := range bytes.Split(b, []byte("\n")) {
			var e errorLogEntry
			if json.Unmarshal(line, &e) == nil && strings.HasPrefix(e.Logger, "http.log.error") && e.Level == level &&
				strings.Contains(e.Msg, msg) {
				return e, true
			}
		}
		if time.Now().After(deadline) {
			env.t.Logf("Caddy's log:\n%.6000s", b)
			return errorLogEntry{}, false
		}
	}
}

// assertLogHoldsNo fails the test for each line of caddy.log that holds a part of the bearer value v.
func (env *gateEnv) assertLogHoldsNo(v string) {
	env.t.Helper()
	b, _ := os.ReadFile(filepath.Join(env.srv.dir, "caddy.log"))
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, v[:64]) || strings.Contains(line, v[len(v)-64:]) {
			env.t.Errorf("Caddy's log holds a bearer value:\n%.600s", line)
		}
	}
}

// The facilitator's x-api-key is a bearer value too: a /settle that gets no answer from the facilitator behind
// (502, "may have settled") is answered by the handler itself, never returned to Caddy as an error, so no log
// of Caddy's holds the key, even at debug level; its access log entry shows it REDACTED.
func TestAFacilitatorsFailedSettlementLeavesItsAPIKeyOutOfCaddysLogs(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	// From the environment, as an operator passes it: a key written into the Caddyfile is in the configuration,
	// which Caddy itself logs at debug level.
	const key = "facilitator-key-0b8e2d7c5a914f36a1d0c9e8b7f6a5d4"
	t.Setenv(facilitatorKeyEnv, key)
	srv := startCaddy(t, `{
	log {
		output file {{DATA}}/caddy.log
		format json
		level DEBUG
	}
}

{{ADDR}} {
	log {
		output file {{DATA}}/caddy.log
		format json
	}
	x402_facilitator {
		api_key {env.`+facilitatorKeyEnv+`}
		upstream http://`+freeAddr(t)+` {
			timeout 2s
		}
	}
}
`)
	fe := &facilitatorEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), network: x402.EIP155(c.ChainID.Uint64())}
	body, err := json.Marshal(fe.permit2(c.Payers[0]))
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/settle", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderAPIKey, key)
	req.Header.Set("Content-Type", "application/json")
	a, err := gateDo(req)
	if err != nil {
		t.Fatal(err)
	}
	if a.status < 500 {
		t.Fatalf("/settle with the facilitator behind gone = %d %q, want a 5xx", a.status, a.body)
	}
	env := &gateEnv{t: t, srv: srv}
	if !env.logged(`"logger":"http.log.access`, `"X-Api-Key":["REDACTED"]`) {
		t.Error("no access log entry of the /settle with its key REDACTED")
	}
	b, _ := os.ReadFile(filepath.Join(srv.dir, "caddy.log"))
	if bytes.Contains(b, []byte(key)) {
		t.Errorf("Caddy's log holds the facilitator's API key:\n%.3000s", b)
	}
}
