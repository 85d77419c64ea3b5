// Package racepass lets a long drill run once in CI instead of twice. .ci/run runs the tests twice: `go test
// ./...`, then `go test -race` on the money paths with X402_RACE_PASS=1. A test whose second run adds nothing the
// race detector can find (its time goes to child processes, a compiler or a server it starts, or to waiting out a
// timer the other tests of its package already run under -race) calls Once, and is skipped in that second pass
// only: it ran, with every assertion, in the first.
//
// The skip needs both the variable and a binary built with -race, so a plain `go test` never skips, whatever the
// environment says, and `go test -race` on a developer's machine (without the variable) runs everything.
package racepass

import (
	"os"
	"testing"
)

// Env is the variable .ci/run sets for its -race pass.
const Env = "X402_RACE_PASS"

// Active reports whether this test binary runs in CI's race pass: built with -race, with X402_RACE_PASS=1.
func Active() bool {
	return raceBuilt && os.Getenv(Env) == "1"
}

// Once skips t in CI's race pass, saying why its run there would add nothing: the test ran in the plain pass.
func Once(t testing.TB, why string) {
	t.Helper()
	if Active() {
		t.Skipf("run once, in .ci/run's plain pass (%s=1 under -race): %s", Env, why)
	}
}
