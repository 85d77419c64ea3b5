package caddymodule_test

import (
	"cmp"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment buys one resource: the method and URL it was first presented for. A response cut short leaves its
// payment good to present again (a payer is never stranded by a broken connection), but only for that resource.
// These tests serve files with Caddy's file_server behind the gate: a large one, past max_buffer (it streams), and
// a small one at the same price, and cut the large one short as a client that never lets a response finish does.

const (
	// resourceBigSize is the large file's size: 32 times max_buffer, and more than the socket buffers and HTTP/2
	// flow-control window can hold once the client stops reading, so that the gate sees the response broken.
	resourceBigSize = 32 << 20
	// resourceSmall is the small file's content.
	resourceSmall = "small file at the same price"
)

// resourceSetup says how the gate of a resource test is configured.
type resourceSetup struct {
	settle string // the gate's settle mode; "" for the default (after)
	h2c    bool   // the site speaks HTTP/2 without TLS (h2c) beside HTTP/1.1
}

// startResourceGate starts a Caddy whose gate (max_buffer 1MiB, settle s.settle) is in front of file_server
// serving /big.bin and /small.txt, with its journal in a bbolt file, and returns its Caddyfile (to restart with).
func startResourceGate(t *testing.T, s resourceSetup) (*gateEnv, string) {
	t.Helper()
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	root := t.TempDir()
	big, err := os.Create(filepath.Join(root, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if err := writeBigBody(big, resourceBigSize, func(int) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := big.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "small.txt"), []byte(resourceSmall), 0o644); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	var servers, settle string
	if s.h2c {
		servers = "\tservers {\n\t\tprotocols h1 h2c\n\t}\n"
	}
	if s.settle != "" {
		settle = "\t\tsettle " + s.settle + "\n"
	}
	caddyfile := fmt.Sprintf(`{
	log {
		output file {{DATA}}/caddy.log
		format json
		level INFO
	}
%s	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	x402 {
		pay_to %s
		amount %d
		asset %s
		network %s
		max_buffer 1MiB
%s	}
	root * %s
	file_server
}
`, servers, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), env.payTo.Hex(), gatePrice, env.c.Token.Hex(), env.net, settle, root)
	env.srv = startCaddy(t, caddyfile)
	return env, caddyfile
}

// resourceClient is a client that speaks HTTP/2 without TLS when h2c says so (HTTP/1.1 otherwise), with a small
// socket receive buffer, so that a response it stops reading cannot all be written into the kernel's buffers.
func resourceClient(t *testing.T, h2c bool) *http.Client {
	d := &net.Dialer{Control: smallReceiveBuffer}
	tr := &http.Transport{DialContext: d.DialContext}
	if h2c {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		tr.Protocols = &p
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// fetched is an answer with its body read (the large file's only counted and summed).
type fetched struct {
	proto  string
	status int
	header http.Header
	n      int64
	sum    [32]byte
	body   string // the first 4 KiB
	err    error
}

// paymentError is the error text of the answer's PAYMENT-REQUIRED, "" without one.
func (f fetched) paymentError() string {
	pr, err := x402.DecodePaymentRequired(f.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		return ""
	}
	return pr.Error
}

func (f fetched) String() string {
	return fmt.Sprintf("%s %d, %d bytes %q, payment error %q, error %v", f.proto, f.status, f.n, f.body[:min(len(f.body), 200)], f.paymentError(), f.err)
}

// fetch GETs path with the payment header (none when ""), reading at most limit bytes of the body (all when
// limit < 0) and then hanging up: over HTTP/1.1 the connection is closed, over HTTP/2 the stream is reset.
func (env *gateEnv) fetch(client *http.Client, path, header string, limit int64) fetched {
	req, err := http.NewRequest(http.MethodGet, env.srv.URL+path, nil)
	if err != nil {
		return fetched{err: err}
	}
	if header != "" {
		req.Header.Set(x402.HeaderPaymentSignature, header)
	}
	resp, err := client.Do(req)
	if err != nil {
		return fetched{err: err}
	}
	defer resp.Body.Close()
	var body io.Reader = resp.Body
	if limit >= 0 {
		body = io.LimitReader(resp.Body, limit)
	}
	h := sha256.New()
	var start strings.Builder
	n, err := io.Copy(io.MultiWriter(h, &prefixBuilder{b: &start, max: 4 << 10}), body)
	return fetched{proto: resp.Proto, status: resp.StatusCode, header: resp.Header, n: n, sum: [32]byte(h.Sum(nil)), body: start.String(), err: err}
}

// prefixBuilder keeps the first max bytes written to it.
type prefixBuilder struct {
	b   *strings.Builder
	max int
}

func (p *prefixBuilder) Write(b []byte) (int, error) {
	if room := p.max - p.b.Len(); room > 0 {
		p.b.Write(b[:min(room, len(b))])
	}
	return len(b), nil
}

// presentOnceFree presents the payment for path as fetch does, again while the answer is that another request
// is presenting it (the request that was cut short has not finished yet), for up to 10 s.
func (env *gateEnv) presentOnceFree(client *http.Client, path, header string) fetched {
	env.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f := env.fetch(client, path, header, -1)
		if f.status != http.StatusPaymentRequired || !strings.Contains(f.paymentError(), "another request is presenting") || time.Now().After(deadline) {
			return f
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cutShortThenPresentElsewhere pays for /big.bin, reads three quarters of it and hangs up, then presents the same
// payment for /small.txt (refused: it buys /big.bin), for /big.bin (served whole, not charged again) and for
// /big.bin once more (refused: served). restart, when given, runs after the cut.
func cutShortThenPresentElsewhere(t *testing.T, env *gateEnv, client *http.Client, s resourceSetup, restart func()) {
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/big.bin", payer)

	cut := env.fetch(client, "/big.bin", header, resourceBigSize*3/4)
	if cut.status != http.StatusOK || cut.n != resourceBigSize*3/4 {
		t.Fatalf("the paid download of /big.bin: %v; want 200 and three quarters of it read", cut)
	}
	if s.h2c && cut.proto != "HTTP/2.0" {
		t.Fatalf("the paid download went over %s, want HTTP/2.0", cut.proto)
	}
	if restart != nil {
		restart()
	}

	other := env.presentOnceFree(client, "/small.txt", header)
	if other.status != http.StatusPaymentRequired || !strings.HasPrefix(other.paymentError(), x402.ReasonPaymentAlreadyUsed) ||
		!strings.Contains(other.paymentError(), "GET 127.0.0.1/big.bin") {
		t.Fatalf("the payment of the cut-short /big.bin presented for /small.txt: %v; want 402 %s naming GET 127.0.0.1/big.bin, the resource it buys",
			other, x402.ReasonPaymentAlreadyUsed)
	}
	if strings.Contains(other.body, resourceSmall) {
		t.Fatalf("the refusal carries the small file: %q", other.body)
	}

	whole := env.presentOnceFree(client, "/big.bin", header)
	if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
		t.Fatalf("the same payment presented again for /big.bin: %v; want 200 and the whole file", whole)
	}
	if again := env.presentOnceFree(client, "/big.bin", header); again.status != http.StatusPaymentRequired ||
		!strings.HasPrefix(again.paymentError(), x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("presented a third time, after it bought /big.bin whole: %v; want 402 %s", again, x402.ReasonPaymentAlreadyUsed)
	}
	if s.settle == "async" {
		env.waitPaid(payer, before, 1)
	} else {
		env.assertPaid(payer, before, 1)
	}
}

func TestAPaymentWhoseLargeResponseWasCutShortBuysOnlyTheURLItWasFirstPresentedFor(t *testing.T) {
	for _, s := range []resourceSetup{
		{settle: ""},
		{settle: "", h2c: true},
		{settle: "async"},
		{settle: "async", h2c: true},
		{settle: "before", h2c: true},
	} {
		name := "settle " + cmp.Or(s.settle, "after")
		if s.h2c {
			name += " over HTTP/2"
		}
		t.Run(name, func(t *testing.T) {
			env, _ := startResourceGate(t, s)
			cutShortThenPresentElsewhere(t, env, resourceClient(t, s.h2c), s, nil)
		})
	}
}

func TestAPaymentCutShortBeforeARestartBuysOnlyItsURLAfterIt(t *testing.T) {
	for _, s := range []resourceSetup{{settle: ""}, {settle: "async", h2c: true}} {
		t.Run("settle "+cmp.Or(s.settle, "after"), func(t *testing.T) {
			env, caddyfile := startResourceGate(t, s)
			client := resourceClient(t, s.h2c)
			cutShortThenPresentElsewhere(t, env, client, s, func() {
				// Caddy stops (its journal closes, the gate's memory goes) and starts again on the same bbolt file.
				if err := caddy.Stop(); err != nil {
					t.Fatalf("stopping Caddy: %v", err)
				}
				client.CloseIdleConnections()
				env.srv.load(caddyfile)
			})
		})
	}
}
