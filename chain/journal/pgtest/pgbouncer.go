package pgtest

import (
	"bytes"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// PgBouncer is a PgBouncer of a test's own in front of a PostgreSQL server, pooling in transaction mode, as
// production PostgreSQL is often reached: a client's session lasts one transaction on a server connection, so
// prepared statements, LISTEN, SET and advisory locks held by a session do not carry over to its next
// transaction, which may run on another client's server connection.
type PgBouncer struct {
	port     int
	dir      string
	upstream *pgconn.Config
	cmd      *exec.Cmd
	exited   chan struct{}
	log      *syncBuffer
}

// PgBouncerPoolSize is the number of server connections the test PgBouncer keeps per database and user: fewer
// than the clients of a test with two or three stores (each a pool of up to 16 connections), so that their
// transactions take turns on the same server connections, as they do behind a production pooler.
const PgBouncerPoolSize = 8

// StartPgBouncer starts a PgBouncer of the test's own in front of the server dsn names, in transaction pooling
// mode (pool_mode = transaction, PgBouncerPoolSize server connections per database), listening on 127.0.0.1 on
// a free port, with trust authentication of dsn's user (and dsn's password, if any, for its logins to the
// server). Any database of that server is reached through it by its name (Through). It stops when the test ends,
// and a watchdog stops it if the test binary dies first. Debian installs pgbouncer in /usr/sbin, outside a
// user's PATH: it is looked for there too, unless X402_TEST_POSTGRES_PATH_ONLY is set. A machine without it ends
// the test as internal/needs says.
func StartPgBouncer(t testing.TB, dsn string) *PgBouncer {
	t.Helper()
	bin := findPgBouncer(t)
	up, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("pgtest: the upstream DSN does not parse: %v", redact(err))
	}
	cred, err := serverCredential()
	if err != nil {
		t.Fatal(err)
	}
	b := &PgBouncer{upstream: up, exited: make(chan struct{}), log: &syncBuffer{}}
	if b.dir, err = os.MkdirTemp("", "pgbouncer-"); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(b.dir) })
	if cred != nil {
		if err := os.Chown(b.dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
	}
	if b.port, err = freePort(); err != nil {
		t.Fatal(err)
	}
	server := fmt.Sprintf("host=%s port=%d", up.Host, up.Port)
	if up.Password != "" {
		// Logins to the server as the client's user with its password; the client itself is trusted.
		server += fmt.Sprintf(" user=%s password=%s", connQuote(up.User), connQuote(up.Password))
	}
	ini := fmt.Sprintf(`[databases]
* = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 2000
; A server that refused a login (down, restarting) is tried again after a second, not the default 15: a test
; restarting PostgreSQL wants it back as soon as it is.
server_login_retry = 1
; A client waits this long for a server connection before it is told the server is unavailable.
query_wait_timeout = 30
logfile = %s
pidfile = %s
`, server, b.port, filepath.Join(b.dir, "users.txt"), PgBouncerPoolSize, filepath.Join(b.dir, "log"), filepath.Join(b.dir, "pid"))
	files := map[string]string{
		"pgbouncer.ini": ini,
		"users.txt":     authFileQuote(up.User) + ` ""` + "\n",
	}
	for name, content := range files {
		path := filepath.Join(b.dir, name)
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
		if cred != nil {
			if err := os.Chown(path, int(cred.Uid), int(cred.Gid)); err != nil {
				t.Fatalf("pgtest: %v", err)
			}
		}
	}
	b.cmd = exec.Command(bin, filepath.Join(b.dir, "pgbouncer.ini"))
	b.cmd.Dir = b.dir
	b.cmd.Stdout, b.cmd.Stderr = b.log, b.log
	if cred != nil {
		// PgBouncer refuses to run as root.
		b.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	if err := b.cmd.Start(); err != nil {
		t.Fatalf("pgtest: start pgbouncer: %v", err)
	}
	go func() { b.cmd.Wait(); close(b.exited) }()
	// The watchdog kills only the process of this PgBouncer's pidfile, which the test's own ending removes with
	// the directory: a recycled process id is never killed.
	pidfile := filepath.Join(b.dir, "pid")
	if err := watchdog(cred, fmt.Sprintf(`p=$(cat %[1]s 2>/dev/null) && grep -q %[2]s /proc/"$p"/cmdline 2>/dev/null && kill -9 "$p"
rm -rf %[2]s`, shellQuote(pidfile), shellQuote(b.dir))); err != nil {
		b.cmd.Process.Kill()
		t.Fatal(err)
	}
	t.Cleanup(b.stop)
	if err := b.waitListening(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	return b
}

// Port returns the port PgBouncer listens on.
func (b *PgBouncer) Port() int { return b.port }

// DSN returns the DSN of the upstream DSN's database, through this PgBouncer.
func (b *PgBouncer) DSN() string { return b.Through(b.upstream.Database) }

// Through returns the DSN of database on the upstream server, through this PgBouncer, as the upstream DSN's
// user: postgres://user@127.0.0.1:port/database?sslmode=disable.
func (b *PgBouncer) Through(database string) string {
	u := url.URL{Scheme: "postgres", User: url.User(b.upstream.User), Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)),
		Path: "/" + database, RawQuery: "sslmode=disable"}
	return u.String()
}

// Log returns what PgBouncer has logged so far.
func (b *PgBouncer) Log() string {
	log, _ := os.ReadFile(filepath.Join(b.dir, "log"))
	return string(log) + b.log.String()
}

// stop ends PgBouncer at once (SIGTERM: immediate shutdown), killing it if it lingers.
func (b *PgBouncer) stop() {
	b.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-b.exited:
	case <-time.After(5 * time.Second):
		b.cmd.Process.Kill()
		<-b.exited
	}
}

// waitListening waits until PgBouncer accepts connections on its port, or has exited.
func (b *PgBouncer) waitListening(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-b.exited:
			return fmt.Errorf("pgtest: pgbouncer exited at start: %v\n%s", b.cmd.ProcessState, tail([]byte(b.Log()), 2000))
		default:
		}
		c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)), time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pgtest: pgbouncer does not listen on port %d after %v: %v\n%s", b.port, timeout, err, tail([]byte(b.Log()), 2000))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// findPgBouncer finds the pgbouncer binary: in PATH, else in /usr/sbin (Debian's place for it, outside a user's
// PATH) unless X402_TEST_POSTGRES_PATH_ONLY is set; a machine without it ends the test as internal/needs says.
func findPgBouncer(t testing.TB) string {
	t.Helper()
	const install = "apt-get install pgbouncer"
	if _, err := exec.LookPath("pgbouncer"); err != nil && os.Getenv(EnvPathOnly) == "" {
		if fi, err := os.Stat("/usr/sbin/pgbouncer"); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return "/usr/sbin/pgbouncer"
		}
	}
	return needs.Command(t, "pgbouncer", install)
}

// authFileQuote quotes a user name of PgBouncer's auth_file.
func authFileQuote(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// connQuote quotes a value of a libpq connection string, as PgBouncer's [databases] reads them.
func connQuote(s string) string {
	return `'` + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + `'`
}

// syncBuffer is a bytes.Buffer safe for a process's output and a test's reads at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
