package caddymodule_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Holes a review found by reading the gate as an attacker would: a payment bought for one route presented to
// another, a CORS preflight walking through, a tunnel opened before it was paid, a response cut short after
// the payment was recorded as served.

// Two sellers behind one Caddy: a cheap route of seller A and a dear one of seller B, both on the embedded
// engine and one journal.
var (
	sellerA = common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1")
	sellerB = common.HexToAddress("0xb0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0")
)

// route is one gated route of a multi-route Caddy.
type route struct {
	path   string // a prefix: "/cheap" serves /cheap and below
	payTo  common.Address
	amount int64
	method string // asset_transfer_method; "" offers every method
	settle string // after, before or async; "" is after
	site   string // the handler behind the gate; default respond "<path> content"
}

// newRoutesEnv starts a Caddy whose site has one gate per route, all settling through the x402 app's embedded
// engine on a simulated chain, with one journal.
func (env *gateEnv) routesCaddyfile(routes []route, networkLines ...string) string {
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	var site strings.Builder
	for _, r := range routes {
		var opts string
		if r.method != "" {
			opts += "\t\t\tasset_transfer_method " + r.method + "\n"
		}
		if r.settle != "" {
			opts += "\t\t\tsettle " + r.settle + "\n"
		}
		handler := r.site
		if handler == "" {
			handler = fmt.Sprintf("respond %q", "content of "+r.path)
		}
		fmt.Fprintf(&site, "\thandle %s* {\n\t\tx402 {\n\t\t\tpay_to %s\n\t\t\tamount %d\n%s\t\t}\n\t\t%s\n\t}\n",
			r.path, r.payTo.Hex(), r.amount, opts, handler)
	}
	return fmt.Sprintf(`{
	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
%s		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
%s}
`, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), strings.Join(networkLines, ""), site.String())
}

// withAccepted is payment p with its accepted requirement replaced by rq: accepted is not signed, so anyone
// holding a payment can rewrite it to name another route's offer.
func withAccepted(t testing.TB, p x402.PaymentPayload, rq x402.PaymentRequirements) string {
	t.Helper()
	p.Accepted = rq
	return gateEncode(t, p)
}

// leaveWhileSettling presents header to path and goes away once the settlement transaction is in the pool,
// before it is mined (the chain must not be committing); it returns after the client is gone.
func (env *gateEnv) leaveWhileSettling(path, header string) {
	env.t.Helper()
	sentBefore := env.sent()
	ctx, leave := context.WithCancel(context.Background())
	answer := env.getAsyncCtx(ctx, path, x402.HeaderPaymentSignature, header)
	for deadline := time.Now().Add(10 * time.Second); env.sent() == sentBefore; {
		if time.Now().After(deadline) {
			env.t.Fatal("the settlement transaction was not sent")
		}
		time.Sleep(5 * time.Millisecond)
	}
	leave()
	if a := gateWait(env.t, answer, "the request of the client that left"); a.status != -1 {
		env.t.Fatalf("the payment was answered (%d %q) before its settlement was mined", a.status, a.body)
	}
}

// waitOutcomes waits until the gates have ended n requests with the given outcome since Caddy started.
func (env *gateEnv) waitOutcomes(status x402.OutcomeStatus, n float64) {
	env.t.Helper()
	name := fmt.Sprintf("caddy_x402_gate_outcomes_total{status=%q}", status)
	for deadline := time.Now().Add(10 * time.Second); samples(env.t)[name] < n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			env.t.Fatalf("%s = %v, want %v", name, samples(env.t)[name], n)
		}
	}
}

func TestAPaymentBoughtForACheapRouteBuysNothingOnADearRouteOfAnotherSeller(t *testing.T) {
	env := newStoppedGateEnv(t)
	routes := []route{
		{path: "/cheap", payTo: sellerA, amount: 10_000, method: x402.TransferPermit2},
		{path: "/dear", payTo: sellerB, amount: 5_000_000, method: x402.TransferPermit2},
	}
	env.srv = startCaddy(t, env.routesCaddyfile(routes))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	aBefore, bBefore := env.c.TokenBalance(sellerA), env.c.TokenBalance(sellerB)

	p := env.signPermit2(payer, env.requirement("/cheap", x402.TransferPermit2))
	header := gateEncode(t, p)
	// The client leaves while the cheap payment's settlement waits in the pool: the journal holds a payment
	// that settled and bought nothing yet, which is what the dear route must not take for its own.
	env.leaveWhileSettling("/cheap", header)
	env.c.Commit()
	env.waitOutcomes(x402.OutcomeSettled, 1)

	dear := env.requirement("/dear", x402.TransferPermit2)
	for name, h := range map[string]string{"as signed": header, "accepted rewritten to the dear offer": withAccepted(t, p, dear)} {
		a := env.get("/dear", x402.HeaderPaymentSignature, h)
		if a.status != http.StatusPaymentRequired || strings.Contains(a.body, "content of /dear") {
			t.Fatalf("the cheap payment (%s) presented to the dear route = %d %q, want 402", name, a.status, a.body)
		}
		t.Logf("%s: %s", name, requiredError(t, a))
	}
	a := env.get("/cheap", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK || a.body != "content of /cheap" {
		t.Fatalf("the cheap payment presented again to its own route = %d %q, want its content", a.status, a.body)
	}
	if got := new(big.Int).Sub(env.c.TokenBalance(sellerA), aBefore); got.Int64() != 10_000 {
		t.Errorf("seller A received %s, want 10000", got)
	}
	if got := new(big.Int).Sub(env.c.TokenBalance(sellerB), bBefore); got.Sign() != 0 {
		t.Errorf("seller B received %s, want nothing", got)
	}
}

func TestACORSPreflightIsAnsweredByTheGateAndNeverReachesTheUpstream(t *testing.T) {
	up := newTestUpstream(t)
	env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr})
	preflight := func(origin string) gateAnswer {
		req, err := http.NewRequest(http.MethodOptions, env.srv.URL+"/", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Origin", origin)
		req.Header.Set("Access-Control-Request-Method", "GET")
		req.Header.Set("Access-Control-Request-Headers", "payment-signature, x-trace-id")
		return env.do(req)
	}
	a := preflight("https://shop.example")
	if a.status != http.StatusNoContent || a.body != "" {
		t.Fatalf("preflight = %d %q, want 204 with no body", a.status, a.body)
	}
	want := map[string][]string{
		"Access-Control-Allow-Origin":   {"*"},
		"Access-Control-Allow-Methods":  {"GET", "POST"},
		"Access-Control-Allow-Headers":  {x402.HeaderPaymentSignature, x402.HeaderXPayment, "x-trace-id"},
		"Access-Control-Expose-Headers": {x402.HeaderPaymentRequired, x402.HeaderPaymentResponse},
		"Access-Control-Max-Age":        {"600"},
	}
	for name, parts := range want {
		got := a.header.Get(name)
		for _, part := range parts {
			if !strings.Contains(strings.ToLower(got), strings.ToLower(part)) {
				t.Errorf("%s = %q, want it to name %s", name, got, part)
			}
		}
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times for a preflight, want 0", n)
	}

	// A real cross-origin request gets the 402 with the origin allowed, so a browser script can read the offer.
	req, _ := http.NewRequest(http.MethodGet, env.srv.URL+"/", nil)
	req.Header.Set("Origin", "https://shop.example")
	if a := env.do(req); a.status != http.StatusPaymentRequired || a.header.Get("Access-Control-Allow-Origin") != "*" {
		t.Errorf("cross-origin GET = %d with Access-Control-Allow-Origin %q, want 402 and *", a.status, a.header.Get("Access-Control-Allow-Origin"))
	}

	// Only the configured origins.
	env.reload(gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tcors_origins https://app.example https://shop.example\n"})
	if a := preflight("https://shop.example"); a.status != http.StatusNoContent || a.header.Get("Access-Control-Allow-Origin") != "https://shop.example" {
		t.Errorf("preflight from an allowed origin = %d, Access-Control-Allow-Origin %q; want 204 naming the origin",
			a.status, a.header.Get("Access-Control-Allow-Origin"))
	}
	if a := preflight("https://evil.example"); a.status != http.StatusForbidden || a.header.Get("Access-Control-Allow-Origin") != "" ||
		!strings.Contains(a.body, "evil.example") {
		t.Errorf("preflight from another origin = %d %q (Access-Control-Allow-Origin %q); want 403 naming the origin, no allow header",
			a.status, a.body, a.header.Get("Access-Control-Allow-Origin"))
	}
	if n := up.calls.Load(); n != 0 {
		t.Fatalf("the upstream was called %d times, want 0", n)
	}
}

func TestAPreflightBehindRespondDoesNotGetThePaidBody(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	req, _ := http.NewRequest(http.MethodOptions, env.srv.URL+"/", nil)
	req.Header.Set("Origin", "https://shop.example")
	req.Header.Set("Access-Control-Request-Method", "GET")
	if a := env.do(req); a.status != http.StatusNoContent || strings.Contains(a.body, "paid content") {
		t.Fatalf("preflight = %d %q, want 204 without the paid body", a.status, a.body)
	}
}

// tunnelUpstream accepts one protocol upgrade per request, answers 101 and echoes lines.
type tunnelUpstream struct {
	Addr  string
	calls atomic.Int64
	// linger, when set, is waited on after the client's end of the tunnel, before the upstream closes its own;
	// clientGone is sent on as the client's end is read.
	linger     chan struct{}
	clientGone chan struct{}
}

func newTunnelUpstream(t *testing.T) *tunnelUpstream {
	u := &tunnelUpstream{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.calls.Add(1)
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprint(rw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		rw.Flush()
		for {
			line, err := rw.ReadString('\n')
			if err != nil {
				if u.linger != nil {
					u.clientGone <- struct{}{}
					<-u.linger
				}
				return
			}
			fmt.Fprint(rw, "echo: "+line)
			rw.Flush()
		}
	}))
	t.Cleanup(srv.Close)
	u.Addr = strings.TrimPrefix(srv.URL, "http://")
	return u
}

// A tunnel is served as it goes, for as long as it stays open: in every settle mode it is paid for before the
// client gets its 101. (The upstream runs first, as settle after and async run it for any request: its answer
// decides what is charged, and the gate holds the 101 until the payment settled.)
func TestATunnelIsPaidForBeforeItOpens(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) {
			env := newStoppedGateEnv(t)
			t.Cleanup(commitPending(t, env.c))
			up := newTunnelUpstream(t)
			env.srv = startCaddy(t, env.caddyfile(gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tsettle " + mode + "\n"}))
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)

			conn, err := net.Dial("tcp", env.srv.Addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n\r\n",
				env.srv.Addr, x402.HeaderPaymentSignature, env.permit2Header("/", payer))
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("reading the upgrade answer: %v", err)
			}
			if resp.StatusCode != http.StatusSwitchingProtocols {
				body, _ := io.ReadAll(resp.Body)
				t.Fatalf("upgrade = %d %q, want 101", resp.StatusCode, body)
			}
			at := env.c.TokenBalance(env.payTo)
			if want := new(big.Int).Add(before.seller, big.NewInt(gatePrice)); at.Cmp(want) != 0 {
				t.Fatalf("the seller held %v when the client got the 101, want %s: the tunnel must be paid for before it opens", at, want)
			}
			if pr := settleResponse(t, gateAnswer{status: resp.StatusCode, header: resp.Header}); !pr.Success || pr.Transaction == "" {
				t.Errorf("the 101's PAYMENT-RESPONSE = %+v, want the settlement", pr)
			}
			fmt.Fprint(conn, "hello\n")
			if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
				t.Fatalf("through the tunnel: %q, %v; want the echo", line, err)
			}
			conn.Close()
			env.assertPaid(payer, before, 1)
			if n := up.calls.Load(); n != 1 {
				t.Errorf("the upstream was called %d times, want 1", n)
			}
		})
	}
}

// readHeadAndHangUp presents header, reads the status line and headers of the answer, and resets the connection
// with the body unread: the gate's writing of the response fails half way.
func (env *gateEnv) readHeadAndHangUp(header string) int {
	env.t.Helper()
	conn, err := net.Dial("tcp", env.srv.Addr)
	if err != nil {
		env.t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\n%s: %s\r\n\r\n", env.srv.Addr, x402.HeaderPaymentSignature, header)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		env.t.Fatalf("reading the answer's head: %v", err)
	}
	_ = conn.(*net.TCPConn).SetLinger(0) // RST: the rest of the body is not read
	return resp.StatusCode
}

func TestAResponseCutShortIsServedAgainWhenItsPaymentIsPresentedAgainWithoutPayingTwice(t *testing.T) {
	const size = 32 << 20 // beyond what loopback socket buffers hold, so the write fails once the client hangs up
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) {
			// Held whole (max_buffer above the size) and written out at once: the write is what breaks.
			env := newGateEnv(t, gateSetup{site: "reverse_proxy " + newBigUpstream(t, size).Addr,
				gate: "\t\tsettle " + mode + "\n\t\tmax_buffer 64MiB\n"})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			sentBefore := env.sent()
			header := env.permit2Header("/", payer)

			if status := env.readHeadAndHangUp(header); status != http.StatusOK {
				t.Fatalf("first presentation = %d, want 200 (then cut short)", status)
			}
			if mode == "async" {
				env.waitPaid(payer, before, 1)
			}
			var a gateAnswer
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				// The gate notices the broken write a moment after the client hung up.
				a = env.get("/", x402.HeaderPaymentSignature, header)
				if a.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, a), "another request is presenting") || time.Now().After(deadline) {
					break
				}
			}
			if a.status != http.StatusOK || len(a.body) != size {
				t.Fatalf("the payment whose response was cut short, presented again = %d (%d bytes) %.200q; want the whole response",
					a.status, len(a.body), a.body)
			}
			if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired ||
				!strings.HasPrefix(requiredError(t, a), x402.ReasonPaymentAlreadyUsed) {
				t.Fatalf("presented a third time = %d, want 402 %s", a.status, x402.ReasonPaymentAlreadyUsed)
			}
			env.assertPaid(payer, before, 1)
			if got := env.sent() - sentBefore; got != 1 {
				t.Errorf("the settlement wallets sent %d transactions, want 1", got)
			}
		})
	}
}

// A tunnel that a reload closes (Caddy closes the old configuration's upgraded connections as it unloads it) was
// cut by the server, not ended by its client or upstream: the payment bought nothing yet, and presented again it
// opens a tunnel without being charged again.
func TestATunnelCutByAReloadIsOpenedAgainWhenItsPaymentIsPresentedAgain(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) { tunnelCutByAReload(t, mode, false) })
	}
}

// TestATunnelItsClientEndedIsServedThoughAReloadComesBeforeItsUpstreamCloses: the client has its echo and hangs
// up, and the upstream lingers (as one waiting for a close frame does) while a reload unloads the configuration, so
// the tunnel's request ends with the configuration unloaded. The payment bought that tunnel, whole: it is marked
// served, and presented again it is refused as used, in every settle mode. Before, any tunnel that ended while its
// configuration was unloaded counted as cut by the server, and the payment opened a second one (the money-invariant
// run, topology scarce, seed 4798048067604851938: one-response-one-resource).
func TestATunnelItsClientEndedIsServedThoughAReloadComesBeforeItsUpstreamCloses(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) { clientEndedTunnelThenUnload(t, mode, false) })
	}
}

// TestATunnelItsClientEndedIsServedThoughAShutdownComesBeforeItsUpstreamCloses is the same with a graceful
// shutdown (the upstream closes its side 300 ms into it) and a restart on the same journal: the journal's close
// waits for a tunnel whose client ended it, which is bound to mark its payment served. Before, the journal closed
// under it (it waited for no open tunnel), the served mark was lost, and after the restart the payment opened a
// second tunnel.
func TestATunnelItsClientEndedIsServedThoughAShutdownComesBeforeItsUpstreamCloses(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) { clientEndedTunnelThenUnload(t, mode, true) })
	}
}

// clientEndedTunnelThenUnload: see the two tests above; restart picks the shutdown.
func clientEndedTunnelThenUnload(t *testing.T, mode string, restart bool) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	up := newTunnelUpstream(t)
	up.linger, up.clientGone = make(chan struct{}), make(chan struct{}, 1)
	setup := gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tsettle " + mode + "\n"}
	env.srv = startCaddy(t, env.caddyfile(setup))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)
	upgrade := func() (net.Conn, *bufio.Reader, *http.Response, string) {
		t.Helper()
		conn, err := net.Dial("tcp", env.srv.Addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
		fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n\r\n",
			env.srv.Addr, x402.HeaderPaymentSignature, header)
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("reading the upgrade answer: %v", err)
		}
		body := ""
		if resp.StatusCode != http.StatusSwitchingProtocols {
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
		}
		return conn, br, resp, body
	}
	conn, br, resp, body := upgrade()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade = %d %.300q, want 101", resp.StatusCode, body)
	}
	fmt.Fprint(conn, "hello\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
		t.Fatalf("through the tunnel: %q, %v; want the echo", line, err)
	}
	conn.Close() // the client has what it paid for, and hangs up
	select {
	case <-up.clientGone:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream never saw the client hang up")
	}
	if restart {
		time.AfterFunc(300*time.Millisecond, func() { close(up.linger) })
		if err := caddy.Stop(); err != nil {
			t.Fatalf("stopping the gateway: %v", err)
		}
		env.srv.load(env.caddyfile(setup))
	} else {
		env.reload(setup) // while the upstream lingers: the tunnel's request ends unloaded
		close(up.linger)
	}
	env.waitPaid(payer, before, 1)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, _, resp, body = upgrade()
		if resp.StatusCode == http.StatusSwitchingProtocols {
			t.Fatalf("the payment whose tunnel its client ended opened another (upstream called %d times): one payment, two tunnels", up.calls.Load())
		}
		// The first tunnel's request may still be ending: its payment is in flight till then.
		if !strings.Contains(body, "another request is presenting this payment") || time.Now().After(deadline) {
			break
		}
	}
	if resp.StatusCode != http.StatusPaymentRequired || !strings.Contains(body, x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the payment presented again = %d %.300q, want 402 %s", resp.StatusCode, body, x402.ReasonPaymentAlreadyUsed)
	}
	env.assertPaid(payer, before, 1)
	if n := up.calls.Load(); n != 1 {
		t.Errorf("the upstream was called %d times, want 1", n)
	}
}

// TestATunnelCutByAShutdownIsOpenedAgainAfterTheRestart is the same with a graceful shutdown (caddy.Stop, as
// `caddy stop` does) in place of the reload, and the same Caddyfile and journal started again: the tunnel the
// shutdown closed is opened again, uncharged, by its payment presented to the restarted gateway.
func TestATunnelCutByAShutdownIsOpenedAgainAfterTheRestart(t *testing.T) {
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) { tunnelCutByAReload(t, mode, true) })
	}
}

// tunnelCutByAReload opens a paid tunnel at a gate settling in mode, has a reload (or, restart, a graceful
// shutdown and a start again) close it, and presents its payment again.
func tunnelCutByAReload(t *testing.T, mode string, restart bool) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	up := newTunnelUpstream(t)
	setup := gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tsettle " + mode + "\n"}
	env.srv = startCaddy(t, env.caddyfile(setup))
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)
	open := func() (net.Conn, *bufio.Reader) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			conn, err := net.Dial("tcp", env.srv.Addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
			fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n\r\n",
				env.srv.Addr, x402.HeaderPaymentSignature, header)
			br := bufio.NewReader(conn)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("reading the upgrade answer: %v", err)
			}
			if resp.StatusCode == http.StatusSwitchingProtocols {
				return conn, br
			}
			body, _ := io.ReadAll(resp.Body)
			conn.Close()
			// The request of the tunnel the reload closed may still be ending: its payment is in flight till then.
			if !strings.Contains(string(body), "another request is presenting this payment") || time.Now().After(deadline) {
				t.Fatalf("upgrade = %d %.300q, want 101", resp.StatusCode, body)
			}
		}
	}
	first, br := open()
	// An echo first: Caddy registers a tunnel's connections, which an unload closes, only once the gate handed the
	// connection over (after its 101 went out), so a reload right after the 101 can miss the tunnel. The echo
	// shows the tunnel is Caddy's to close; and the reads below time out in 10 s, not at the 30 s deadline.
	fmt.Fprint(first, "before\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: before\n" {
		t.Fatalf("through the tunnel: %q, %v; want the echo", line, err)
	}
	_ = first.SetReadDeadline(time.Now().Add(10 * time.Second))
	if restart {
		// The journal does not wait for an open tunnel before it closes (before, the shutdown waited its 30 s
		// for requests at work, and then the tunnel was closed all the same).
		began := time.Now()
		if err := caddy.Stop(); err != nil {
			t.Fatalf("stopping the gateway: %v", err)
		}
		if took := time.Since(began); took > 10*time.Second {
			t.Errorf("the shutdown took %v with a paid tunnel open, want it done in seconds", took.Round(time.Millisecond))
		}
		if line, err := br.ReadString('\n'); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("after the shutdown the tunnel read %q, %v; the test needs the shutdown to close it", line, err)
		}
		env.srv.load(env.caddyfile(setup))
	} else {
		env.reload(setup) // the same configuration: only the unloading of the old one closes the tunnel
		if line, err := br.ReadString('\n'); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("after the reload the tunnel read %q, %v; the test needs the reload to close it", line, err)
		}
	}
	conn, br := open()
	fmt.Fprint(conn, "hello\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
		t.Fatalf("through the tunnel opened again: %q, %v; want the echo", line, err)
	}
	conn.Close()
	env.waitPaid(payer, before, 1)
	env.assertPaid(payer, before, 1)
	if n := up.calls.Load(); n != 2 {
		t.Errorf("the upstream was called %d times, want 2 (the tunnel, then again)", n)
	}
}
