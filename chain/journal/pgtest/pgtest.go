// Package pgtest starts throwaway PostgreSQL servers for tests: Start gives a test a server of its own, which
// it may stop and restart (a database outage mid-load), and Shared gives every test of a binary a fresh
// database on one server started once, so that a suite of many tests stays fast.
//
// The server is the machine's own PostgreSQL (initdb, pg_ctl and postgres from PATH, else the highest version
// in /usr/lib/postgresql/*/bin, unless X402_TEST_POSTGRES_PATH_ONLY is set), its data and sockets in a
// temporary directory, listening on 127.0.0.1 on a free port with trust authentication. Run as root (CI
// containers), it runs as the postgres system user, for initdb refuses root. When the binaries are missing the
// test ends as internal/needs says: skipped with one line naming what to install on a machine with only Go, failed
// under CI. X402_TEST_POSTGRES_DSN, when set, names a running server to use instead (its user must be allowed to
// create databases); a test that needs to stop the server is then skipped. X402_TEST_POSTGRES_PATH_ONLY (any
// value) looks for the binaries in PATH alone, so that hiding them from PATH hides PostgreSQL from the tests, as
// scripts/go-only-check.sh does to show what a machine with only Go runs.
//
// A watchdog process stops every server started here, and removes its directory, once the test binary is gone,
// whether it ended normally, timed out or was killed, so no server outlives its tests.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// EnvDSN names the environment variable that points the tests at an existing server instead.
const EnvDSN = "X402_TEST_POSTGRES_DSN"

// EnvPathOnly names the environment variable that, set, has the binaries looked for in PATH alone, without the
// fallback to /usr/lib/postgresql/*/bin (Debian installs them there, outside PATH).
const EnvPathOnly = "X402_TEST_POSTGRES_PATH_ONLY"

// errNoServer is findBin's answer on a machine without PostgreSQL's server binaries.
var errNoServer = errors.New("pgtest: no PostgreSQL server binaries (initdb, pg_ctl, postgres)")

// Need ends the test, as internal/needs does, when it can have no server: neither X402_TEST_POSTGRES_DSN nor
// PostgreSQL's binaries. Start and Shared call it; a test that starts a server in a goroutine of its own calls
// it first, for a test may only be skipped from its own goroutine.
func Need(t testing.TB) {
	t.Helper()
	if os.Getenv(EnvDSN) != "" {
		return
	}
	if _, err := findBin(); errors.Is(err, errNoServer) {
		needs.Missing(t, "PostgreSQL's initdb", "apt-get install postgresql (or set "+EnvDSN+")")
	}
}

// superuser is the role initdb makes; trust authentication lets it in without a password.
const superuser = "postgres"

// Server is a PostgreSQL server for tests.
type Server struct {
	dsn      string // of the server's default database for tests
	external bool   // EnvDSN's server: it cannot be stopped or restarted here

	bin   string // directory of initdb, pg_ctl and postgres
	base  string // temporary directory: data/, sock/, log
	port  int
	cred  *syscall.Credential // the postgres user's, when the tests run as root
	mu    sync.Mutex
	up    bool
	admin string // DSN of the server's postgres database, for CREATE DATABASE
}

// Start starts a server of the test's own with one database, and stops it when the test ends. With
// X402_TEST_POSTGRES_DSN set it gives the test a fresh database on that server instead.
func Start(t testing.TB) *Server {
	t.Helper()
	Need(t)
	if dsn := os.Getenv(EnvDSN); dsn != "" {
		s := &Server{external: true, admin: dsn}
		s.dsn = s.CreateDatabase(t)
		return s
	}
	s, err := start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.halt("immediate"); os.RemoveAll(s.base) })
	s.dsn = s.CreateDatabase(t)
	return s
}

var (
	sharedOnce sync.Once
	shared     *Server
	sharedErr  error
)

// Shared returns the DSN of a fresh, empty database on a server shared by every test of the binary, started
// at the first call (or on X402_TEST_POSTGRES_DSN's server). The server runs until the binary exits.
func Shared(t testing.TB) string {
	t.Helper()
	Need(t)
	sharedOnce.Do(func() {
		if dsn := os.Getenv(EnvDSN); dsn != "" {
			shared = &Server{external: true, admin: dsn}
			return
		}
		shared, sharedErr = start()
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared.CreateDatabase(t)
}

// DSN returns the DSN of the server's database for this test:
// postgres://postgres@127.0.0.1:port/db?sslmode=disable.
func (s *Server) DSN() string { return s.dsn }

// Port returns the port the server listens on; 0 for an external server.
func (s *Server) Port() int { return s.port }

var dbSeq atomic.Int64

// CreateDatabase creates a new, empty database on the server and returns its DSN. On an external server the
// database is dropped when the test ends; a server started here takes its databases with it.
func (s *Server) CreateDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("test_%d", dbSeq.Add(1))
	if s.external {
		name = fmt.Sprintf("x402_test_%d_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6, dbSeq.Add(1))
	}
	if err := s.exec("CREATE DATABASE " + pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create database %s: %v", name, err)
	}
	if s.external {
		t.Cleanup(func() { s.exec("DROP DATABASE IF EXISTS " + pgx.Identifier{name}.Sanitize() + " WITH (FORCE)") })
	}
	u, err := url.Parse(s.admin)
	if err != nil {
		t.Fatalf("pgtest: %s does not parse as a URL: %v", EnvDSN, redact(err))
	}
	u.Path = "/" + name
	return u.String()
}

// exec runs one statement on the server's postgres database.
func (s *Server) exec(sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.admin)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

// Stop stops the server (fast shutdown: connections are closed); the test goes on without it until Restart.
func (s *Server) Stop(t testing.TB) {
	t.Helper()
	s.needOwn(t)
	if err := s.halt("fast"); err != nil {
		t.Fatal(err)
	}
}

// Crash stops the server as a crash would (immediate shutdown: no checkpoint, the next start recovers from the
// WAL); the test goes on without it until Restart.
func (s *Server) Crash(t testing.TB) {
	t.Helper()
	s.needOwn(t)
	if err := s.halt("immediate"); err != nil {
		t.Fatal(err)
	}
}

// Restart stops the server if it runs and starts it again on the same data and port.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.needOwn(t)
	if err := s.halt("fast"); err != nil {
		t.Fatal(err)
	}
	// Another process may have bound the port while the server was down (a client connection's local port, a
	// test's listener): wait a while for it to be let go.
	var err error
	for deadline := time.Now().Add(restartWait); ; time.Sleep(200 * time.Millisecond) {
		if err = s.run(); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
}

// restartWait is how long Restart waits for the server's port to be free again.
const restartWait = 30 * time.Second

func (s *Server) needOwn(t testing.TB) {
	t.Helper()
	if s.external {
		t.Skipf("pgtest: this test stops the server, and %s names a server it may not stop", EnvDSN)
	}
}

// start makes and starts a new server in a new temporary directory, with a watchdog that stops it and removes
// the directory once this process is gone.
func start() (*Server, error) {
	bin, err := findBin()
	if err != nil {
		return nil, err
	}
	s := &Server{bin: bin}
	if s.cred, err = serverCredential(); err != nil {
		return nil, err
	}
	if s.base, err = os.MkdirTemp("", "pgtest-"); err != nil {
		return nil, fmt.Errorf("pgtest: %w", err)
	}
	fail := func(err error) (*Server, error) {
		os.RemoveAll(s.base)
		return nil, err
	}
	if err := os.Mkdir(filepath.Join(s.base, "sock"), 0o700); err != nil {
		return fail(fmt.Errorf("pgtest: %w", err))
	}
	if s.cred != nil {
		for _, dir := range []string{s.base, filepath.Join(s.base, "sock")} {
			if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
				return fail(fmt.Errorf("pgtest: %w", err))
			}
		}
	}
	out, err := s.command("initdb", "-D", s.data(), "-U", superuser, "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync").CombinedOutput()
	if err != nil {
		return fail(fmt.Errorf("pgtest: initdb: %v\n%s", err, out))
	}
	if err := s.watchdog(); err != nil {
		return fail(err)
	}
	for attempt := 0; ; attempt++ {
		if s.port, err = freePort(); err != nil {
			return nil, err
		}
		if err = s.run(); err == nil || attempt == 2 {
			break // another process may have taken the port between freePort and the server's bind: try another
		}
	}
	if err != nil {
		return nil, err
	}
	s.admin = fmt.Sprintf("postgres://%s@127.0.0.1:%d/postgres?sslmode=disable", superuser, s.port)
	return s, nil
}

func (s *Server) data() string { return filepath.Join(s.base, "data") }

// command returns a command running the server binary name as the server's user.
func (s *Server) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = s.base
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	return cmd
}

// run starts the server on its port and waits until it accepts connections.
func (s *Server) run() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	opts := fmt.Sprintf("-c listen_addresses=127.0.0.1 -p %d -c unix_socket_directories=%s -c max_connections=300 -c fsync=on",
		s.port, filepath.Join(s.base, "sock"))
	// -l sends the server's output to a file: it must not hold this process's pipes open.
	cmd := s.command("pg_ctl", "-D", s.data(), "-l", filepath.Join(s.base, "log"), "-w", "-t", "60", "-o", opts, "start")
	if out, err := cmd.CombinedOutput(); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.base, "log"))
		return fmt.Errorf("pgtest: pg_ctl start on port %d: %v\n%s\nserver log:\n%s", s.port, err, out, tail(log, 2000))
	}
	s.up = true
	return nil
}

// halt stops the server if it runs: mode "fast" closes connections cleanly, "immediate" kills them.
func (s *Server) halt(mode string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.up {
		return nil
	}
	if out, err := s.command("pg_ctl", "-D", s.data(), "-m", mode, "-w", "-t", "60", "stop").CombinedOutput(); err != nil {
		return fmt.Errorf("pgtest: pg_ctl stop: %v\n%s", err, out)
	}
	s.up = false
	return nil
}

// watchdog makes sure the server is stopped and its directory removed once this process is gone.
func (s *Server) watchdog() error {
	return watchdog(s.cred, fmt.Sprintf("%s -D %s -m immediate -w stop >/dev/null 2>&1\nrm -rf %s",
		shellQuote(filepath.Join(s.bin, "pg_ctl")), shellQuote(s.data()), shellQuote(s.base)))
}

// serverCredential is the credential that servers started here run as: the postgres system user's when the
// tests run as root (initdb, postgres and pgbouncer refuse to run as root), nil otherwise.
func serverCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgtest: running as root, the server must run as the postgres system user, and there is none (%v); "+
			"the Debian package postgresql creates it", err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// watchdog starts a shell, in its own session and as cred's user (nil: this process's), that waits for this
// process to go and then runs script, which stops what a test started.
func watchdog(cred *syscall.Credential, script string) error {
	pid := os.Getpid()
	script = fmt.Sprintf("while [ -d /proc/%[1]d ] || kill -0 %[1]d 2>/dev/null; do sleep 1; done\n%[2]s", pid, script)
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: cred}
	// No stdin, stdout or stderr: go test waits for the pipes of its test binary to close.
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgtest: start the watchdog: %w", err)
	}
	go cmd.Wait() // reaped if it ends first (it does not, unless killed)
	return nil
}

// findBin finds the directory holding initdb, pg_ctl and postgres.
func findBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil && hasServer(filepath.Dir(real)) {
			return filepath.Dir(real), nil
		}
		if hasServer(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	if os.Getenv(EnvPathOnly) != "" {
		return "", fmt.Errorf("%w in PATH (%s is set: /usr/lib/postgresql is not looked in)", errNoServer, EnvPathOnly)
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return version(dirs[i]) > version(dirs[j]) })
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	return "", fmt.Errorf("%w in PATH or /usr/lib/postgresql/*/bin: install Debian's postgresql package (apt-get install postgresql), "+
		"or set %s to a server the tests may create databases on", errNoServer, EnvDSN)
}

func hasServer(dir string) bool {
	for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.IsDir() {
			return false
		}
	}
	return true
}

// version reads the major version of /usr/lib/postgresql/<version>/bin.
func version(dir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(dir)), 64)
	return v
}

// freePort finds a port free now for a server, below the range the system draws the local ports of outgoing
// connections and of listeners on port 0 from (ephemeralLow): a server stopped and started again by a test
// (Restart) must find its port free again, and a port of that range can be taken meanwhile by any connection
// of any process. It falls back to a port of the system's choosing.
func freePort() (int, error) {
	if low := ephemeralLow(); low > 20000 {
		for range 50 {
			port := 16384 + rand.IntN(low-16384)
			if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
				l.Close()
				return port, nil
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgtest: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ephemeralLow is the lowest local port the system gives outgoing connections (Linux); 0 when unknown.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.Atoi(f[0])
	return n
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// redact keeps a URL parse error from repeating the DSN, which may hold a password.
func redact(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
