package e2e

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment buys one resource, the one it was first presented for, through a SIGKILL of its gateway and on
// another gateway sharing its PostgreSQL journal: Caddy processes serve a large file (past max_buffer, so it
// streams) and a small one at the same price with file_server, and a client cuts the large one short.

const (
	// cutBigSize is the large file's size: more than the socket buffers and the HTTP/2 window hold once the
	// client stops reading.
	cutBigSize = 32 << 20
	// cutSmall is the small file's content.
	cutSmall = "small file at the same price"
)

func TestAPaymentCutShortBuysOnlyItsURLAfterASIGKILLAndOnAnotherGatewayOfItsCluster(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()
	pgtest.Need(t) // here, in the test's goroutine, where a test may be skipped
	pgReady := make(chan *pgtest.Server, 1)
	go func() { pgReady <- pgtest.Start(t) }()

	chainProc := startProcess(t, "caddy x402 devchain", dir, childEnv(t), "x402", "devchain", "--listen", "127.0.0.1:0", "--json", "--wallets", "6")
	var facts struct {
		RPC string `json:"rpc"`
	}
	chainProc.waitUntil("the JSON line of the chain's facts", 90*time.Second, func() error {
		for _, line := range strings.Split(chainProc.out.String(), "\n") {
			if strings.HasPrefix(line, `{"rpc":`) {
				return json.Unmarshal([]byte(line), &facts)
			}
		}
		return fmt.Errorf("no JSON line yet")
	})
	dev := dialChain(t, facts.RPC)
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))

	root := filepath.Join(dir, "files")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	bigFile, err := os.Create(filepath.Join(root, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	bigSum := sha256.New()
	piece := make([]byte, 1<<20)
	for off := 0; off < cutBigSize; off += len(piece) {
		for i := range piece {
			piece[i] = byte(off>>20 + i*7 + i>>8)
		}
		_, _ = bigSum.Write(piece)
		if _, err := bigFile.Write(piece); err != nil {
			t.Fatal(err)
		}
	}
	if err := bigFile.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "small.txt"), []byte(cutSmall), 0o644); err != nil {
		t.Fatal(err)
	}
	c := &cutClient{client: cutShortClient(t, false), sum: [32]byte(bigSum.Sum(nil))}

	// A site of a gateway: max_buffer 1MiB, the settle mode given, file_server over the two files.
	site := func(url, settle string) string {
		return fmt.Sprintf(`
%s {
	bind 127.0.0.1
	x402 $0.01 {
		pay_to %s
		max_buffer 1MiB
		settle %s
	}
	root * %s
	file_server
}
`, url, seller.Hex(), settle, root)
	}
	gateway := func(name, wallets, journal, servers string, sites ...string) string {
		return writeFile(t, dir, name+".Caddyfile", fmt.Sprintf(`{
	admin off
%s	x402 {
		dev_chain {
			rpc %s
			wallets %s
		}
		journal %s
	}
}
%s`, servers, facts.RPC, wallets, journal, strings.Join(sites, "")))
	}

	t.Run("a bbolt journal, the gateway killed and started again", func(t *testing.T) {
		url := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
		file := gateway("bolt", "0-1", filepath.Join(dir, "journal.db"), "", site(url, "after"))
		env := childEnv(t)
		start := func() *process {
			p := startProcess(t, "the gateway on bbolt", dir, env, "run", "--adapter", "caddyfile", "--config", file)
			p.waitUntil("a 402 from the gateway", 90*time.Second, answersWith(url+"/small.txt", 402))
			return p
		}
		gw := start()
		before := dev.balance(seller)
		header := signPayment(t, facts.RPC, url+"/big.bin")
		c.cut(t, url+"/big.bin", header)
		gw.kill()
		start()
		c.refusedFor(t, url+"/small.txt", header)
		c.servedWhole(t, url+"/big.bin", header)
		c.usedUp(t, url+"/big.bin", header)
		if d := delta(before, dev.balance(seller)); d.Cmp(big.NewInt(asyncPrice)) != 0 {
			t.Errorf("the seller's balance moved by %s, want %d: one payment", d, asyncPrice)
		}
	})

	t.Run("a PostgreSQL journal shared by two gateways, over HTTP/2", func(t *testing.T) {
		pg := <-pgReady
		c.client = cutShortClient(t, true)
		var async, before [2]string
		for i := range 2 {
			async[i] = fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
			before[i] = fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
		}
		for i, wallets := range []string{"2-3", "4-5"} {
			file := gateway(fmt.Sprintf("pg%d", i), wallets, pg.DSN(), "\tservers {\n\t\tprotocols h1 h2c\n\t}\n",
				site(async[i], "async"), site(before[i], "before"))
			p := startProcess(t, fmt.Sprintf("gateway %d on PostgreSQL", i), dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", file)
			p.waitUntil("a 402 from the gateway", 90*time.Second, answersWith(async[i]+"/small.txt", 402))
		}
		for _, mode := range []struct {
			settle string
			urls   [2]string
		}{{"async", async}, {"before", before}} {
			sellerBefore := dev.balance(seller)
			header := signPayment(t, facts.RPC, mode.urls[0]+"/big.bin")
			c.cut(t, mode.urls[0]+"/big.bin", header)
			c.refusedFor(t, mode.urls[1]+"/small.txt", header)
			c.servedWhole(t, mode.urls[1]+"/big.bin", header)
			c.usedUp(t, mode.urls[0]+"/big.bin", header)
			want := new(big.Int).Add(sellerBefore, big.NewInt(asyncPrice))
			if !waitForBalance(dev, seller, want, 30*time.Second) || dev.balance(seller).Cmp(want) != 0 {
				t.Errorf("settle %s: the seller's balance moved by %s, want %d: one payment", mode.settle, delta(sellerBefore, dev.balance(seller)), asyncPrice)
			}
		}
	})
}

// cutClient pays as a client that never lets a large response finish: it reads three quarters and hangs up.
type cutClient struct {
	client *http.Client
	sum    [32]byte // of the large file
}

// cutShortClient is a client with a small socket receive buffer, speaking HTTP/2 without TLS (h2c) when h2 says
// so: a response it stops reading cannot be written whole into the kernel's buffers or the stream's window.
func cutShortClient(t *testing.T, h2 bool) *http.Client {
	tr := &http.Transport{DialContext: (&net.Dialer{Control: smallReceiveBuffer}).DialContext}
	if h2 {
		var p http.Protocols
		p.SetUnencryptedHTTP2(true)
		tr.Protocols = &p
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 2 * time.Minute}
}

// cutAnswer is an answer with as much of its body as was read.
type cutAnswer struct {
	proto  string
	status int
	header http.Header
	n      int64
	sum    [32]byte
	start  string
	err    error
}

func (a cutAnswer) paymentError() string {
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		return ""
	}
	return pr.Error
}

func (a cutAnswer) String() string {
	return fmt.Sprintf("%s %d, %d bytes %q, payment error %q, error %v", a.proto, a.status, a.n, shorten(a.start), a.paymentError(), a.err)
}

// fetch GETs url with the payment, reading at most limit bytes (all when limit < 0), then hangs up.
func (c *cutClient) fetch(url, header string, limit int64) cutAnswer {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return cutAnswer{err: err}
	}
	req.Header.Set(x402.HeaderPaymentSignature, header)
	resp, err := c.client.Do(req)
	if err != nil {
		return cutAnswer{err: err}
	}
	defer resp.Body.Close()
	var body io.Reader = resp.Body
	if limit >= 0 {
		body = io.LimitReader(resp.Body, limit)
	}
	h := sha256.New()
	start := make([]byte, 512)
	k, _ := io.ReadFull(body, start)
	h.Write(start[:k])
	n, err := io.Copy(h, body)
	return cutAnswer{proto: resp.Proto, status: resp.StatusCode, header: resp.Header, n: n + int64(k), sum: [32]byte(h.Sum(nil)), start: string(start[:k]), err: err}
}

// present is fetch of the whole answer, again while another request is presenting the payment (the request cut
// short has not ended yet on its gateway), for up to 20 s.
func (c *cutClient) present(url, header string) cutAnswer {
	deadline := time.Now().Add(20 * time.Second)
	for {
		a := c.fetch(url, header, -1)
		if a.status != http.StatusPaymentRequired || !strings.Contains(a.paymentError(), "another request is presenting") || time.Now().After(deadline) {
			return a
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cut pays for url and hangs up after three quarters of it.
func (c *cutClient) cut(t *testing.T, url, header string) {
	t.Helper()
	a := c.fetch(url, header, cutBigSize*3/4)
	if a.status != http.StatusOK || a.n != cutBigSize*3/4 {
		t.Fatalf("the paid download of %s: %v; want 200 and three quarters of it read", url, a)
	}
}

// refusedFor checks that the payment of the cut-short /big.bin buys nothing at url.
func (c *cutClient) refusedFor(t *testing.T, url, header string) {
	t.Helper()
	a := c.present(url, header)
	if a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.paymentError(), x402.ReasonPaymentAlreadyUsed) ||
		!strings.Contains(a.paymentError(), "GET 127.0.0.1/big.bin") || strings.Contains(a.start, cutSmall) {
		t.Fatalf("the payment of the cut-short /big.bin presented for %s: %v; want 402 %s naming GET 127.0.0.1/big.bin",
			url, a, x402.ReasonPaymentAlreadyUsed)
	}
}

// servedWhole checks that the payment presented again for url gets the whole large file.
func (c *cutClient) servedWhole(t *testing.T, url, header string) {
	t.Helper()
	if a := c.present(url, header); a.status != http.StatusOK || a.n != cutBigSize || a.sum != c.sum || a.err != nil {
		t.Fatalf("the payment presented again for %s: %v; want 200 and the whole file", url, a)
	}
}

// usedUp checks that the payment, once it bought its response, buys nothing more.
func (c *cutClient) usedUp(t *testing.T, url, header string) {
	t.Helper()
	if a := c.present(url, header); a.status != http.StatusPaymentRequired || !strings.HasPrefix(a.paymentError(), x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the payment presented for %s after it bought its response: %v; want 402 %s", url, a, x402.ReasonPaymentAlreadyUsed)
	}
}
