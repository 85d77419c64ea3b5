package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// stopTimeout is how long a process gets to exit after SIGINT before it is killed.
const stopTimeout = 15 * time.Second

// process is a long-running child process (Caddy), its output kept to show when the test fails.
type process struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	out  *lockedBuffer
	done chan struct{} // closed once the process has exited and err is set
	err  error
	// beforeKill, when set, runs when a graceful stop outlasted its bound, before the kill: to keep what says
	// where it hung (Caddy exits at SIGQUIT without the Go runtime's stack dump).
	beforeKill func()
}

// startProcess starts the built binary with args in dir and env. The process is killed when the test ends
// if it still runs, and its output is logged if the test failed.
func startProcess(t *testing.T, name, dir string, env []string, args ...string) *process {
	t.Helper()
	return startProgram(t, name, dir, env, caddyBin, args...)
}

// startProgram is startProcess for another program: bin with args.
func startProgram(t *testing.T, name, dir string, env []string, bin string, args ...string) *process {
	t.Helper()
	p := &process{t: t, name: name, out: new(lockedBuffer), done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Dir, p.cmd.Env = dir, ownTempDir(t, env)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	p.cmd.SysProcAttr = dieWithParent()
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s (%s %s): %v", name, bin, strings.Join(args, " "), err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		if p.running() {
			p.kill()
		}
		if t.Failed() {
			t.Logf("--- output of %s (pid %d), last lines:\n%s", name, p.cmd.Process.Pid, lastLines(p.out.String(), 60))
			if dir := os.Getenv("X402_E2E_LOGS"); dir != "" {
				keepOutput(t, dir, name, p)
			}
		}
	})
	return p
}

// ownTempDir gives a process a temporary folder of its own (TMPDIR), removed when the test ends, after the
// process is killed: a dev chain's scratch database (hundreds of megabytes) is removed only by a clean stop,
// and a killed process would otherwise leave it in the system's /tmp for good. env nil means this process's.
func ownTempDir(t *testing.T, env []string) []string {
	if env == nil {
		env = os.Environ()
	}
	return append(slices.Clip(env), "TMPDIR="+t.TempDir())
}

// keepOutput writes the whole output of a failed test's process to a file under dir (X402_E2E_LOGS), where the
// last lines logged are not enough to follow one payment through it.
func keepOutput(t *testing.T, dir, name string, p *process) {
	file := filepath.Join(dir, fmt.Sprintf("%s-%s-%d.log", strings.NewReplacer("/", "_", " ", "_").Replace(t.Name()), strings.ReplaceAll(name, " ", "_"), p.cmd.Process.Pid))
	err := os.MkdirAll(dir, 0o755)
	if err == nil {
		err = os.WriteFile(file, []byte(p.out.String()), 0o644)
	}
	if err != nil {
		t.Logf("keeping the whole output of %s: %v", name, err)
		return
	}
	t.Logf("the whole output of %s is in %s", name, file)
}

// running reports whether the process has not exited yet.
func (p *process) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits for the process to be gone: a crash, with no chance to clean up.
func (p *process) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop asks the process to exit with SIGINT, as Ctrl-C would, and fails the test unless it exits cleanly
// within stopTimeout; past that it is killed.
func (p *process) stop() {
	p.t.Helper()
	if !p.running() {
		p.t.Errorf("%s had exited before it was asked to stop: %v", p.name, p.err)
		return
	}
	switch exited, err := p.stopWithin(os.Interrupt, stopTimeout); {
	case !exited:
		p.t.Errorf("%s did not exit within %s of SIGINT and was killed", p.name, stopTimeout)
	case err != nil:
		p.t.Errorf("%s exited with %v after SIGINT; expected a clean exit", p.name, err)
	}
}

// stopWithin sends sig (SIGINT or SIGTERM: a graceful stop) and waits at most bound for the process to exit; past
// that it is killed (after beforeKill, when set). It reports whether the process exited by itself in time, and its exit error then. The caller
// judges: a stop that hangs is something to report, not a test that hangs.
func (p *process) stopWithin(sig os.Signal, bound time.Duration) (exited bool, err error) {
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
		return true, p.err
	case <-time.After(bound):
		if p.beforeKill != nil {
			p.beforeKill()
		}
		p.kill()
		return false, nil
	}
}

// waitUntil polls ready every 50 ms until it returns nil, and fails the test when the process exits first
// or timeout passes, with ready's last error.
func (p *process) waitUntil(what string, timeout time.Duration, ready func() error) {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := ready()
		if err == nil {
			return
		}
		select {
		case <-p.done:
			p.t.Fatalf("%s exited (%v) before %s", p.name, p.err, what)
		default:
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("%s: no %s within %s; last: %v", p.name, what, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// result is the outcome of a short-lived command.
type result struct {
	code           int
	stdout, stderr string
}

// runCommand runs name with args in dir and env and returns its exit code and output; the command is
// killed after timeout (and the test fails).
func runCommand(t *testing.T, timeout time.Duration, dir string, env []string, name string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, ownTempDir(t, env)
	cmd.SysProcAttr = dieWithParent()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := result{stdout: stdout.String(), stderr: stderr.String()}
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("%s %s did not finish within %s\nstdout:\n%s\nstderr:\n%s", filepath.Base(name), strings.Join(args, " "), timeout, r.stdout, r.stderr)
	case errors.As(err, &exit):
		r.code = exit.ExitCode()
	case err != nil:
		t.Fatalf("running %s: %v", name, err)
	}
	return r
}

// childEnv is this process's environment for a child, with HOME and Caddy's XDG folders in a fresh temporary
// folder (a Caddy child writes its data and autosaved config there, never in the user's home) and extra
// NAME=value entries on top. Payer keys of the parent's environment are not passed on.
func childEnv(t *testing.T, extra ...string) []string {
	t.Helper()
	home := t.TempDir()
	set := map[string]string{
		"HOME":            home,
		"XDG_DATA_HOME":   filepath.Join(home, "data"),
		"XDG_CONFIG_HOME": filepath.Join(home, "config"),
		"X402_PAYER_KEY":  "",
	}
	for _, kv := range extra {
		k, v, _ := strings.Cut(kv, "=")
		set[k] = v
	}
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if _, replaced := set[k]; !replaced {
			env = append(env, kv)
		}
	}
	for k, v := range set {
		if v != "" {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	// Below the kernel's ephemeral range (32768 and up on Linux): a port from it (what listening on port 0 gives)
	// can be taken, between this check and the process that binds it, by any outgoing connection on the machine,
	// and the tests make thousands (a Node server exited with EADDRINUSE in CI). Drawn at random, so that two
	// tests rarely draw the same.
	for range 200 {
		port := freePortLow + rand.IntN(freePortHigh-freePortLow)
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			continue
		}
		l.Close()
		return port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// freePortLow and freePortHigh bound the ports freePort draws from.
const freePortLow, freePortHigh = 20000, 32000

// portTaken says why port cannot be listened on (on every interface, as Caddy's ":port" does), or "".
func portTaken(port int) string {
	l, err := net.Listen("tcp", ":"+strconv.Itoa(port))
	if err != nil {
		return err.Error()
	}
	l.Close()
	return ""
}

// httpClient talks to the processes under test; it follows no redirects, so a test sees each answer.
var httpClient = &http.Client{
	Timeout:       30 * time.Second,
	CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
}

// answer is a read HTTP response.
type answer struct {
	status int
	header http.Header
	body   string
}

// get requests url with the given header pairs (name, value, ...).
func get(url string, header ...string) (answer, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return answer{}, err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	var body bytes.Buffer
	if _, err := body.ReadFrom(resp.Body); err != nil {
		return answer{}, fmt.Errorf("reading the answer of %s: %w", url, err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: body.String()}, nil
}

// answersWith returns a readiness probe that passes once url answers with status.
func answersWith(url string, status int) func() error {
	return func() error {
		a, err := get(url)
		if err != nil {
			return err
		}
		if a.status != status {
			return fmt.Errorf("%s answered %d, waiting for %d", url, a.status, status)
		}
		return nil
	}
}

// lockedBuffer is a bytes.Buffer that a process writes to while the test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// lastLines returns the last n lines of s.
func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// seedFromEnv returns the seed of a randomized test: the unsigned integer in $env, or a fresh one; either way
// it is logged, with the line that replays it. what says what the seed draws.
func seedFromEnv(t *testing.T, env, what string) uint64 {
	t.Helper()
	if v := os.Getenv(env); v != "" {
		seed, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("$%s=%q: want an unsigned integer: %v", env, v, err)
		}
		t.Logf("%s seeded by $%s=%d", what, env, seed)
		return seed
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("%s seeded by %d (%s=%d replays them)", what, seed, env, seed)
	return seed
}
