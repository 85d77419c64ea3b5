package gate_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"log"
	"math/big"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// syncBuffer is a log sink safe for the server's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A tunnel (an Upgrade the upstream answers 101 and then serves on the hijacked connection, as reverse_proxy
// does) is paid before it opens, and once the upstream hands the connection back the gate writes nothing more
// to the hijacked response: flushing it panicked inside net/http.
func TestAPaidTunnelIsServedAndTheGateTouchesNoHijackedResponseAfterIt(t *testing.T) {
	var serverLog syncBuffer
	e := newEnv(t, setup{serverLog: log.New(&serverLog, "", 0), upstream: func(w http.ResponseWriter, r *http.Request) error {
		e := http.NewResponseController(w)
		conn, rw, err := e.Hijack()
		if err != nil {
			return err
		}
		defer conn.Close()
		fmt.Fprint(rw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n")
		rw.Flush()
		line, err := rw.ReadString('\n')
		if err == nil {
			fmt.Fprint(rw, "echo: "+line)
			rw.Flush()
		}
		// The upstream writes its 101 into the held response too, as reverse_proxy does before hijacking.
		w.WriteHeader(http.StatusSwitchingProtocols)
		return nil
	}})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	addr := strings.TrimPrefix(e.srv.URL, "http://")
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "GET /report HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n\r\n", addr, x402.HeaderPaymentSignature, header)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade = %v, %v; want 101", resp, err)
	}
	fmt.Fprint(conn, "hello\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
		t.Fatalf("through the tunnel: %q, %v", line, err)
	}
	conn.Close()
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d each", lost, gained, price)
	}
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) && !strings.Contains(serverLog.String(), "panic") {
		time.Sleep(20 * time.Millisecond)
	}
	if strings.Contains(serverLog.String(), "panic") {
		t.Fatalf("the server logged a panic after the tunnel:\n%.800s", serverLog.String())
	}
}

// A tunnel whose payment does not settle never opens: the upstream's 101 is held, the settlement is refused
// (the payer spent the funds while the upstream answered), the client gets the refusal instead of the 101,
// and the upstream cannot take the connection.
func TestATunnelWhosePaymentDoesNotSettleNeverOpens(t *testing.T) {
	var e *env
	var hijackErr atomic.Value
	e = newEnv(t, setup{upstream: func(w http.ResponseWriter, r *http.Request) error {
		payer := e.c.Payers[0]
		e.c.TransferToken(payer, common.HexToAddress("0x000000000000000000000000000000000000dEaD"), e.c.TokenBalance(payer.Address))
		w.Header().Set("Upgrade", "echo")
		w.Header().Set("Connection", "Upgrade")
		w.WriteHeader(http.StatusSwitchingProtocols)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
			err = errors.New("none")
		}
		hijackErr.Store(err)
		return nil
	}})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	addr := strings.TrimPrefix(e.srv.URL, "http://")
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "GET /report HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: echo\r\n%s: %s\r\n\r\n", addr, x402.HeaderPaymentSignature, header)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil || resp.StatusCode != http.StatusPaymentRequired {
		t.Fatalf("upgrade = %v, %v; want 402: the payment did not settle", resp, err)
	}
	if err, _ := hijackErr.Load().(error); err == nil || err.Error() == "none" {
		t.Errorf("the upstream's Hijack = %v, want a refusal: the tunnel must not open", err)
	}
	if _, gained := e.paid(payer, before); gained.Sign() != 0 {
		t.Errorf("the seller gained %s, want nothing", gained)
	}
}

// A CONNECT served by an upstream that takes the connection and answers on it itself (a forward proxy): the
// payment has settled by the time the upstream holds the connection.
func TestACONNECTTunnelIsPaidBeforeTheUpstreamHoldsTheConnection(t *testing.T) {
	var e *env
	var sellerAtHijack atomic.Pointer[big.Int]
	e = newEnv(t, setup{upstream: func(w http.ResponseWriter, r *http.Request) error {
		if r.Method != http.MethodConnect {
			return errors.New("not a CONNECT")
		}
		conn, rw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return err
		}
		defer conn.Close()
		sellerAtHijack.Store(e.c.TokenBalance(e.payTo))
		fmt.Fprint(rw, "HTTP/1.1 200 Connection established\r\n\r\n")
		rw.Flush()
		if line, err := rw.ReadString('\n'); err == nil {
			fmt.Fprint(rw, "echo: "+line)
			rw.Flush()
		}
		return nil
	}})
	payer := e.c.Payers[0]
	header := e.permit2(payer)
	before := e.balances(payer)
	addr := strings.TrimPrefix(e.srv.URL, "http://")
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(conn, "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n%s: %s\r\n\r\n", x402.HeaderPaymentSignature, header)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT = %v, %v; want the upstream's 200", resp, err)
	}
	fmt.Fprint(conn, "hello\n")
	if line, err := br.ReadString('\n'); err != nil || line != "echo: hello\n" {
		t.Fatalf("through the tunnel: %q, %v", line, err)
	}
	if at, want := sellerAtHijack.Load(), new(big.Int).Add(before[1], big.NewInt(price)); at == nil || at.Cmp(want) != 0 {
		t.Errorf("the seller held %v when the upstream got the connection, want %s", at, want)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d each", lost, gained, price)
	}
}
