// Package needs lets a test say what it needs of the machine beyond Go (a PostgreSQL server, npm, Chromium,
// Prometheus) and what to install to have it. On a machine without it the test is skipped with one line saying
// so, printed to the terminal as well (go test ./... shows a passing package's output to no one), once per
// package and need; with CI set, where a skipped test would prove nothing, the test fails instead.
package needs

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
)

// told remembers the needs already reported to the terminal by this test binary.
var told sync.Map

// InCI reports whether the tests run under CI (CI set to anything but "" or "false"), where nothing may skip.
func InCI() bool {
	v := strings.ToLower(os.Getenv("CI"))
	return v != "" && v != "false" && v != "0"
}

// Missing ends the test because the machine lacks what, naming how to install it: a skip with one line on a
// developer's machine, a failure under CI.
func Missing(t testing.TB, what, install string) {
	t.Helper()
	line := fmt.Sprintf("needs %s: %s", what, install)
	if InCI() {
		t.Fatalf("%s (CI is set, so this test may not skip)", line)
	}
	if _, dup := told.LoadOrStore(what, true); !dup {
		tellTerminal(fmt.Sprintf("skipped (%s) tests that %s", pkg(), line))
	}
	t.Skip("skipped: " + line)
}

// Command returns the path of the named program, or ends the test as Missing does, naming what to install.
func Command(t testing.TB, name, install string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, name, install)
	}
	return p
}

// tellTerminal writes line to the controlling terminal, when there is one: go test ./... keeps a passing
// package's output to itself, and a skip nobody sees is a silent one.
func tellTerminal(line string) {
	tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0)
	if err != nil {
		return
	}
	defer tty.Close()
	fmt.Fprintln(tty, "caddy-x402: "+line)
}

// pkg names the test binary's package the way go test does (the binary is "<pkg>.test").
func pkg() string {
	name := os.Args[0]
	if i := strings.LastIndexByte(name, '/'); i >= 0 {
		name = name[i+1:]
	}
	return strings.TrimSuffix(name, ".test")
}
