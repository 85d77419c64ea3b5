package caddymodule_test

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/x402-gateway/caddy-x402/caddymodule"
)

// caddyMu serialises Caddy instances: Caddy runs one config per process.
var caddyMu sync.Mutex

// caddyServer is a real Caddy running in this process from a Caddyfile, on free loopback ports, with its admin
// endpoint off and its storage in a temporary folder.
type caddyServer struct {
	// URL is http://127.0.0.1:<port>, the site addressed {{ADDR}} in the Caddyfile (plain HTTP: tests never
	// make certificates or touch the system's trust store).
	URL  string
	Addr string
	t    *testing.T
	dir  string
}

// freeAddr returns a loopback address with a port nobody listens on.
func freeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// startCaddy adapts caddyfile (where {{ADDR}} is replaced by a free loopback address, and {{DATA}} by a
// temporary folder) and loads it into Caddy. Caddy stops when the test ends.
func startCaddy(t *testing.T, caddyfile string) *caddyServer {
	t.Helper()
	caddyMu.Lock()
	s := &caddyServer{t: t, Addr: freeAddr(t), dir: t.TempDir()}
	s.URL = "http://" + s.Addr
	t.Setenv("XDG_DATA_HOME", filepath.Join(s.dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(s.dir, "config"))
	t.Cleanup(func() {
		_ = caddy.Stop()
		caddyMu.Unlock()
	})
	s.load(caddyfile)
	return s
}

// load replaces the running config, as a config reload does.
func (s *caddyServer) load(caddyfile string) {
	s.t.Helper()
	cfg := s.adapt(caddyfile)
	if err := caddy.Load(cfg, true); err != nil {
		s.t.Fatalf("loading the Caddy config: %v\n%s", err, cfg)
	}
	// A reload closes the old servers' connections: a kept-alive one reused by the next request would
	// answer EOF.
	http.DefaultClient.CloseIdleConnections()
	s.waitForOldSocket()
}

// waitForOldSocket waits until the replaced config's listening socket is closed. On a reload Caddy binds a
// new socket beside the old one (SO_REUSEPORT), and its Load returns once the old server's shutdown has
// started, not finished: a connection the kernel queues on the old socket in between is reset when it
// closes, and a test's next request fails with EOF or "connection reset by peer". Real clients retry;
// a test must not, so it waits (Linux only: elsewhere it reads nothing and returns at once).
func (s *caddyServer) waitForOldSocket() {
	s.t.Helper()
	_, port, _ := net.SplitHostPort(s.Addr)
	p, _ := strconv.Atoi(port)
	suffix := fmt.Sprintf(":%04X", p)
	deadline := time.Now().Add(5 * time.Second)
	for listeningSockets(suffix) > 1 {
		if time.Now().After(deadline) {
			s.t.Fatalf("the replaced config still listens on %s 5 s after the reload", s.Addr)
		}
		time.Sleep(time.Millisecond)
	}
}

// listeningSockets counts the TCP sockets listening on the port whose /proc/net hex form ends local
// addresses with suffix.
func listeningSockets(suffix string) int {
	n := 0
	for _, name := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		table, err := os.ReadFile(name)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(table), "\n") {
			f := strings.Fields(line)
			if len(f) > 3 && f[3] == "0A" && strings.HasSuffix(f[1], suffix) {
				n++
			}
		}
	}
	return n
}

// adapt turns the Caddyfile into the JSON Caddy runs, with admin off and storage in the test's folder.
func (s *caddyServer) adapt(caddyfile string) []byte {
	s.t.Helper()
	return adaptCaddyfile(s.t, s.expand(caddyfile), s.dir)
}

func (s *caddyServer) expand(caddyfile string) string {
	caddyfile = strings.ReplaceAll(caddyfile, "{{ADDR}}", s.URL)
	return strings.ReplaceAll(caddyfile, "{{DATA}}", s.dir)
}

func adaptCaddyfile(t testing.TB, caddyfile, dir string) []byte {
	t.Helper()
	adapter := caddyconfig.GetAdapter("caddyfile")
	raw, warns, err := adapter.Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		t.Fatalf("adapting the Caddyfile: %v", err)
	}
	for _, w := range warns {
		t.Logf("Caddyfile warning: %s", w.String())
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["admin"] = map[string]any{"disabled": true, "config": map[string]any{"persist": false}}
	cfg["storage"] = map[string]any{"module": "file_system", "root": filepath.Join(dir, "storage")}
	if _, ok := cfg["logging"]; !ok && os.Getenv("X402_TEST_CADDY_LOGS") == "" {
		cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}}
	}
	out, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestMain(m *testing.M) {
	// Caddy's default data folder must never be the developer's own.
	dir, err := os.MkdirTemp("", "caddy-x402-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	os.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}
