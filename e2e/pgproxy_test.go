package e2e

import (
	"errors"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"
)

// pgProxy is a TCP proxy of the test's own between a gateway and PostgreSQL that can hang: while hung it accepts
// connections and reads nothing from them and writes nothing to them, nor to the server, as a database behind a
// network that drops packets does (no refusal, no reset: the callers wait on their own timeouts). Resumed, it
// passes on what it held and everything after.
type pgProxy struct {
	dsn    string // the database's DSN with the proxy's address; never logged
	target string // the server's host:port
	ln     net.Listener

	mu     sync.Mutex
	resume chan struct{} // non-nil while hung: closed when the hang ends
	conns  map[net.Conn]bool
	closed bool
}

// startPgProxy starts a proxy to the server of dsn on a free port of 127.0.0.1; it stops when the test ends.
func startPgProxy(t *testing.T, dsn string) *pgProxy {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("the journal's DSN does not parse as a URL")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pgProxy{target: u.Host, ln: ln, conns: map[net.Conn]bool{}}
	u.Host = ln.Addr().String()
	p.dsn = u.String()
	go p.accept()
	t.Cleanup(p.close)
	return p
}

// hang stops the proxy forwarding anything until resume.
func (p *pgProxy) hang() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resume == nil {
		p.resume = make(chan struct{})
	}
}

// resume ends a hang: what was held goes on.
func (p *pgProxy) resumeForwarding() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.resume != nil {
		close(p.resume)
		p.resume = nil
	}
}

// wait returns once the proxy is not hung, held whether it was.
func (p *pgProxy) wait() (held bool) {
	p.mu.Lock()
	ch := p.resume
	p.mu.Unlock()
	if ch != nil {
		<-ch
	}
	return ch != nil
}

func (p *pgProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = true
	return true
}

func (p *pgProxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(client) {
			return
		}
		go p.serve(client)
	}
}

func (p *pgProxy) serve(client net.Conn) {
	defer client.Close()
	held := p.wait() // a connection made during a hang reaches nothing until it ends
	// A connection its client gave up on during the hang never reaches the server, as a connection attempt that
	// timed out behind a network dropping packets does not: forwarded, the hang's abandoned attempts would all
	// start a server backend at once when it ends, a herd a real outage does not send.
	var early []byte
	if held {
		var gone bool
		if early, gone = p.heldFrom(client); gone {
			return
		}
	}
	server, err := net.Dial("tcp", p.target)
	if err != nil || !p.track(server) {
		return
	}
	defer server.Close()
	if len(early) > 0 {
		if _, err := server.Write(early); err != nil {
			return
		}
	}
	done := make(chan struct{}, 2)
	go func() { p.pump(server, client); done <- struct{}{} }()
	go func() { p.pump(client, server); done <- struct{}{} }()
	<-done // one side ended: so does the other
}

// heldFrom reads what client sent while its connection was held, until it sends nothing more for a moment (the
// client waits for the server's answer: it is still there) or closes (gone: it gave up).
func (p *pgProxy) heldFrom(client net.Conn) (held []byte, gone bool) {
	defer client.SetReadDeadline(time.Time{})
	buf := make([]byte, 32<<10)
	for {
		client.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		n, err := client.Read(buf)
		held = append(held, buf[:n]...)
		var ne net.Error
		switch {
		case errors.As(err, &ne) && ne.Timeout():
			return held, false
		case err != nil:
			return nil, true
		}
	}
}

// pump copies from src to dst, holding each read's bytes, and the next read, while the proxy is hung.
func (p *pgProxy) pump(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		p.wait()
		n, err := src.Read(buf)
		if n > 0 {
			p.wait()
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return // io.EOF or a broken connection: either way, this side is done
		}
	}
}

func (p *pgProxy) close() {
	p.resumeForwarding()
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = map[net.Conn]bool{}
	p.mu.Unlock()
	p.ln.Close()
	for c := range conns {
		c.Close()
	}
}
