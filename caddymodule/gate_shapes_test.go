package caddymodule_test

import (
	"bufio"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Request and response shapes at an upto gate in front of reverse_proxy: whatever the shape of the request
// (upgrade headers, HEAD) or of the answer (a 101 and its tunnel, a 103 before the answer, a trailer), the
// charge is what the upstream named in the header block of its answer, and Settlement-Overrides never
// reaches the client.

// shapesUpstream is a metered app behind reverse_proxy that names its charge in every shape an HTTP answer
// can carry a header in. Each path is one shape:
//
//	/ignore   ignores upgrade headers and answers 200, charging 700
//	/accept   accepts an upgrade ("echo"): 101 charging 300, then echoes lines on the connection
//	/early    sends 103 Early Hints (with a Link and a charge of 400), then 200 charging 400
//	/trailer  answers 200 and names a charge of 600 only in a trailer
//	/long     as /trailer, with a body larger than the gate's max_buffer
//	/refuse   refuses an upgrade: 403
type shapesUpstream struct {
	*httptest.Server
}

const shapesLongBody = 3 << 20 // larger than the max_buffer of 1MiB the gate below is given

func newShapesUpstream(t *testing.T) *shapesUpstream {
	t.Helper()
	u := &shapesUpstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/ignore":
			w.Header().Set(x402.HeaderSettlementOverrides, `{"amount":"700"}`)
			fmt.Fprint(w, "metered content")
		case "/accept":
			conn, rw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				return
			}
			defer conn.Close()
			fmt.Fprintf(rw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n%s: {\"amount\":\"300\"}\r\n\r\n",
				x402.HeaderSettlementOverrides)
			rw.Flush()
			for {
				line, err := rw.ReadString('\n')
				if err != nil {
					return
				}
				fmt.Fprint(rw, "echo: "+line)
				rw.Flush()
			}
		case "/early":
			w.Header().Set("Link", "</style.css>; rel=preload; as=style")
			w.Header().Set(x402.HeaderSettlementOverrides, `{"amount":"400"}`)
			w.WriteHeader(http.StatusEarlyHints)
			fmt.Fprint(w, "metered content")
		case "/trailer", "/long":
			w.Header().Set("Trailer", x402.HeaderSettlementOverrides)
			if r.URL.Path == "/long" {
				_, _ = w.Write([]byte(strings.Repeat("x", shapesLongBody)))
			} else {
				fmt.Fprint(w, "metered content")
			}
			w.Header().Set(x402.HeaderSettlementOverrides, `{"amount":"600"}`)
		case "/refuse":
			http.Error(w, "no such protocol here", http.StatusForbidden)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(u.Close)
	return u
}

// rawRequest sends request (a request head without its final blank line) on a new connection and reads the
// answer's head; the caller reads the rest from br.
func (env *gateEnv) rawRequest(request string) (resp *http.Response, br *bufio.Reader, conn net.Conn) {
	env.t.Helper()
	conn, err := net.Dial("tcp", env.srv.Addr)
	if err != nil {
		env.t.Fatal(err)
	}
	env.t.Cleanup(func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	fmt.Fprintf(conn, "%s\r\n", request)
	br = bufio.NewReader(conn)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		env.t.Fatalf("reading the answer to %q: %v", strings.SplitN(request, "\r\n", 2)[0], err)
	}
	return resp, br, conn
}

// assertCharged checks that the answer's PAYMENT-RESPONSE is a success naming charged, that exactly charged
// moved from payer to seller since before, and that the answer carries no Settlement-Overrides.
func (env *gateEnv) assertCharged(what string, h http.Header, payer balances, charged int64) {
	env.t.Helper()
	if v := h.Values(x402.HeaderSettlementOverrides); len(v) != 0 {
		env.t.Errorf("%s: the client got the upstream's Settlement-Overrides %q", what, v)
	}
	resp, err := x402.DecodeSettleResponse(h.Get(x402.HeaderPaymentResponse))
	if err != nil || !resp.Success || resp.Amount != big.NewInt(charged).String() {
		env.t.Errorf("%s: PAYMENT-RESPONSE = %+v (%v), want a success naming amount %d", what, resp, err, charged)
	}
	seller := new(big.Int).Sub(env.c.TokenBalance(env.payTo), payer.seller)
	if seller.Int64() != charged {
		env.t.Errorf("%s: the seller gained %s on chain, want the %d the upstream named", what, seller, charged)
	}
}

// An upto route, default_amount zero: a request with upgrade headers whose upstream ignores them and answers
// 200 naming a charge is charged that charge (it was settled before the upstream, for nothing); an upstream
// that accepts the upgrade is paid the charge its 101 names before the tunnel opens; HEAD is charged as GET.
func TestAnUptoRouteChargesWhatTheUpstreamNamesWhateverTheRequestsShape(t *testing.T) {
	up := newShapesUpstream(t)
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{gate: "\t\tscheme upto\n\t\tdefault_amount zero\n\t\tsettle " + mode + "\n",
				site: "reverse_proxy " + strings.TrimPrefix(up.URL, "http://")})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			settled := func(before balances, want int64) {
				t.Helper()
				if mode == "async" {
					env.waitSeller(before, want)
				}
			}

			t.Run("upgrade headers the upstream ignores", func(t *testing.T) {
				before := env.balances(payer)
				resp, _, _ := env.rawRequest(fmt.Sprintf("GET /ignore HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: x\r\n%s: %s\r\n",
					env.srv.Addr, x402.HeaderPaymentSignature, env.permit2Header("/ignore", payer)))
				body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
				if resp.StatusCode != http.StatusOK || string(body) != "metered content" {
					t.Fatalf("= %d %q, want the upstream's 200", resp.StatusCode, body)
				}
				settled(before, 700)
				if mode == "after" {
					env.assertCharged("upgrade headers ignored", resp.Header, before, 700)
				} else {
					env.assertSellerGained("upgrade headers ignored", resp.Header, before, 700)
				}
			})

			t.Run("an upgrade the upstream accepts", func(t *testing.T) {
				before := env.balances(payer)
				resp, br, conn := env.rawRequest(fmt.Sprintf("GET /accept HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n",
					env.srv.Addr, x402.HeaderPaymentSignature, env.permit2Header("/accept", payer)))
				if resp.StatusCode != http.StatusSwitchingProtocols {
					body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
					t.Fatalf("= %d %q, want 101", resp.StatusCode, body)
				}
				// Paid before the tunnel opened, in every settle mode: the seller holds the charge already.
				env.assertCharged("the 101", resp.Header, before, 300)
				fmt.Fprint(conn, "hello\n")
				if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
					t.Fatalf("through the tunnel: %q, %v; want the echo", line, err)
				}
			})

			t.Run("HEAD", func(t *testing.T) {
				before := env.balances(payer)
				req, _ := http.NewRequest(http.MethodHead, env.srv.URL+"/ignore", nil)
				req.Header.Set(x402.HeaderPaymentSignature, env.permit2Header("/ignore", payer))
				a := env.do(req)
				if a.status != http.StatusOK {
					t.Fatalf("HEAD = %d, want 200", a.status)
				}
				settled(before, 700)
				if mode == "after" {
					env.assertCharged("HEAD", a.header, before, 700)
				} else {
					env.assertSellerGained("HEAD", a.header, before, 700)
				}
			})
		})
	}
}

// waitSeller waits until the seller holds want more than before, for background settlement.
func (env *gateEnv) waitSeller(before balances, want int64) {
	env.t.Helper()
	target := new(big.Int).Add(before.seller, big.NewInt(want))
	deadline := time.Now().Add(20 * time.Second)
	for env.c.TokenBalance(env.payTo).Cmp(target) < 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // and no more than that arrives
}

// assertSellerGained is assertCharged for settle async, whose answer says the settlement is pending.
func (env *gateEnv) assertSellerGained(what string, h http.Header, before balances, charged int64) {
	env.t.Helper()
	if v := h.Values(x402.HeaderSettlementOverrides); len(v) != 0 {
		env.t.Errorf("%s: the client got the upstream's Settlement-Overrides %q", what, v)
	}
	if seller := new(big.Int).Sub(env.c.TokenBalance(env.payTo), before.seller); seller.Int64() != charged {
		env.t.Errorf("%s: the seller gained %s on chain, want the %d the upstream named", what, seller, charged)
	}
}

// Settlement-Overrides is for the gate only, in whatever header block the upstream puts it: a 103 before the
// answer goes out without it (and its charge stands in the answer), and a charge named in a trailer, which
// arrives after the gate decided (or would have to wait for the whole body), is not used: default_amount is
// charged, and the trailer does not reach the client either.
func TestSettlementOverridesReachesTheClientInNoHeaderBlockAndATrailerNamesNoCharge(t *testing.T) {
	up := newShapesUpstream(t)
	env := newGateEnv(t, gateSetup{gate: "\t\tscheme upto\n\t\tdefault_amount zero\n\t\tmax_buffer 1MiB\n",
		site: "reverse_proxy " + strings.TrimPrefix(up.URL, "http://")})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)

	t.Run("103 Early Hints", func(t *testing.T) {
		before := env.balances(payer)
		var mu sync.Mutex
		var early []textproto.MIMEHeader
		req, _ := http.NewRequest(http.MethodGet, env.srv.URL+"/early", nil)
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
				mu.Lock()
				defer mu.Unlock()
				if code == http.StatusEarlyHints {
					early = append(early, h)
				}
				return nil
			},
		}))
		req.Header.Set(x402.HeaderPaymentSignature, env.permit2Header("/early", payer))
		a := env.do(req)
		if a.status != http.StatusOK || a.body != "metered content" {
			t.Fatalf("= %d %q, want the upstream's 200", a.status, a.body)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(early) != 1 || early[0].Get("Link") == "" {
			t.Fatalf("the client got 103s %v, want one with its Link", early)
		}
		if v := early[0].Values(x402.HeaderSettlementOverrides); len(v) != 0 {
			t.Errorf("the 103 carried the upstream's Settlement-Overrides %q to the client", v)
		}
		env.assertCharged("the answer after a 103", a.header, before, 400)
	})

	for _, path := range []string{"/trailer", "/long"} {
		t.Run("a trailer "+path, func(t *testing.T) {
			before := env.balances(payer)
			req, _ := http.NewRequest(http.MethodGet, env.srv.URL+path, nil)
			req.Header.Set(x402.HeaderPaymentSignature, env.permit2Header(path, payer))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			n, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || err != nil || n == 0 {
				t.Fatalf("= %d, %d bytes (%v), want the upstream's 200", resp.StatusCode, n, err)
			}
			// (The client lists a trailer the answer announced in resp.Trailer, with its value once the body is read.)
			if v, ok := resp.Trailer[x402.HeaderSettlementOverrides]; ok {
				t.Errorf("the client got the upstream's Settlement-Overrides as a trailer (announced, value %q)", v)
			}
			env.assertCharged("a charge named in a trailer", resp.Header, before, 0)
		})
	}
}

// An exact route that settles after (or async): a request with upgrade headers is no reason to settle before
// the upstream. An upstream that refuses the upgrade (403) is passed on and not paid for, as any error is, and
// the payment still buys the resource.
func TestAnExactRouteDoesNotChargeForAnUpgradeTheUpstreamRefuses(t *testing.T) {
	up := newShapesUpstream(t)
	for _, mode := range []string{"after", "async"} {
		t.Run(mode, func(t *testing.T) {
			env := newGateEnv(t, gateSetup{gate: "\t\tsettle " + mode + "\n", site: "reverse_proxy " + strings.TrimPrefix(up.URL, "http://")})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			header := env.permit2Header("/refuse", payer)
			resp, _, _ := env.rawRequest(fmt.Sprintf("GET /refuse HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n",
				env.srv.Addr, x402.HeaderPaymentSignature, header))
			if resp.StatusCode != http.StatusForbidden {
				t.Fatalf("= %d, want the upstream's 403", resp.StatusCode)
			}
			time.Sleep(200 * time.Millisecond) // an async settlement would have been sent by now
			if gained := new(big.Int).Sub(env.c.TokenBalance(env.payTo), before.seller); gained.Sign() != 0 {
				t.Fatalf("the seller gained %s for the upstream's 403, want nothing", gained)
			}
			a := env.get("/ignore", x402.HeaderPaymentSignature, header)
			if a.status != http.StatusOK {
				t.Fatalf("the same payment, presented again without upgrade headers = %d %q, want 200", a.status, a.body)
			}
			env.waitPaid(payer, before, 1)
		})
	}
}
