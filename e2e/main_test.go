package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Set by TestMain for every test of the package.
var (
	// repoRoot is the module root: the working directory of the quickstart, where Caddyfile.example lives.
	repoRoot string
	// caddyBin is ./cmd/caddy built once for this test run.
	caddyBin string
	// buildTime is how long that build took, for the quickstart's report.
	buildTime time.Duration
	// afterAll is what TestMain does once every test has run: remove what tests share, such as the installed
	// TypeScript SDK.
	afterAll []func()
)

// prebuiltEnv names a binary to test instead of building ./cmd/caddy, such as one built by xcaddy.
const prebuiltEnv = "X402_E2E_CADDY"

// TestMain builds the binary the tests run (or takes the one $X402_E2E_CADDY names). A failed build fails the
// whole package with the compiler's words; -short skips it and every test here.
func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		fmt.Println("e2e: skipped under -short: these tests build the binary and run it as real processes")
		os.Exit(m.Run())
	}
	code, err := buildAndRun(m)
	for _, f := range afterAll {
		f()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func buildAndRun(m *testing.M) (int, error) {
	root, err := filepath.Abs("..")
	if err != nil {
		return 0, err
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		return 0, fmt.Errorf("expected the module root (with go.mod) above e2e/, at %s: %w", root, err)
	}
	if bin := os.Getenv(prebuiltEnv); bin != "" {
		if bin, err = filepath.Abs(bin); err != nil {
			return 0, err
		}
		if _, err := os.Stat(bin); err != nil {
			return 0, fmt.Errorf("$%s names no binary: %w", prebuiltEnv, err)
		}
		repoRoot, caddyBin = root, bin
		return m.Run(), nil
	}
	dir, err := os.MkdirTemp("", "caddy-x402-e2e-")
	if err != nil {
		return 0, err
	}
	defer os.RemoveAll(dir)

	bin := filepath.Join(dir, "caddy")
	start := time.Now()
	build := exec.Command("go", "build", "-o", bin, "./cmd/caddy")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		return 0, fmt.Errorf("go build ./cmd/caddy in %s: %w\n%s", root, err, out)
	}
	repoRoot, caddyBin, buildTime = root, bin, time.Since(start)
	return m.Run(), nil
}

// needBinary skips a test when TestMain built nothing (under -short).
func needBinary(t *testing.T) {
	t.Helper()
	if caddyBin == "" {
		t.Skip("skipped under -short: the e2e tests build and run the binary")
	}
}
