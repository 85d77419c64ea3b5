package caddymodule_test

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A Caddy settling on a dev chain another process runs (dev_chain rpc) keeps its journal in memory unless one is
// set: the chain outlives Caddy's restarts, the journal does not. Caddy says so as it starts; with a journal set it
// does not, and an upto payment charged zero (nothing reaches the chain for it) is refused after a restart.
func TestDevChainRPCWithoutAJournalWarnsAtStartThatARestartForgetsWhatTheChainRemembers(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0")
	for _, tc := range []struct {
		name, journal string
	}{
		{"without a journal", ""},
		{"with a journal", "\t\tjournal {{DATA}}/journal.db\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			caddyfile := `{
	log {
		output file {{DATA}}/caddy.log
		format json
		level INFO
	}
	x402 {
		dev_chain {
			rpc ` + d.facts.RPC + `
		}
` + tc.journal + `	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to ` + devchainSeller.Hex() + `
		scheme upto
		default_amount zero
	}
	respond "used nothing"
}
`
			srv := startCaddy(t, caddyfile)
			waitFor402(t, srv.URL+"/")
			warned := logHas(t, srv, `"level":"warn"`, "the settlement journal is in memory", "dev_chain rpc", "upto payment charged zero",
				"set journal <path>")
			if warned != (tc.journal == "") {
				t.Errorf("Caddy warned at start that its journal forgets what the dev chain remembers: %t, want %t", warned, tc.journal == "")
			}

			header, stderr, err := caddymodule.RunX402("", "pay", "--dev", "--rpc", d.facts.RPC, "--sign-only", srv.URL+"/")
			if err != nil {
				t.Fatalf("signing an upto payment: %v\n%s", err, stderr)
			}
			header = strings.TrimSpace(header)
			if a := presentTo(t, srv.URL+"/", header); a.status != http.StatusOK || a.body != "used nothing" {
				t.Fatalf("the upto payment = %d %q, want 200 \"used nothing\"", a.status, a.body)
			}
			// Caddy stops and starts again: the dev chain runs on, with nothing of the zero charge on it.
			if err := caddy.Stop(); err != nil {
				t.Fatal(err)
			}
			http.DefaultClient.CloseIdleConnections()
			srv.load(caddyfile)
			waitFor402(t, srv.URL+"/")
			again := presentTo(t, srv.URL+"/", header)
			if tc.journal == "" {
				t.Logf("without a journal, the zero-charged upto payment presented after the restart: %d (the risk the warning names)", again.status)
				return
			}
			if again.status != http.StatusPaymentRequired {
				t.Errorf("with a journal, the zero-charged upto payment presented after the restart = %d %q, want 402", again.status, again.body)
			}
		})
	}
}

// waitFor402 waits until url answers 402: the x402 app starts after the site listens.
func waitFor402(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusPaymentRequired {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not answer 402 within 30 s (%v)", url, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// presentTo GETs url with the payment.
func presentTo(t *testing.T, url, header string) gateAnswer {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, header)
	a, err := gateDo(req)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// logHas reports whether a line of the Caddy's log (caddy.log in its data folder) holds every one of parts,
// waiting up to 2 s for it to be written.
func logHas(t *testing.T, srv *caddyServer, parts ...string) bool {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(srv.dir, "caddy.log"))
		for _, line := range strings.Split(string(b), "\n") {
			found := true
			for _, p := range parts {
				found = found && strings.Contains(line, p)
			}
			if found {
				return true
			}
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}
