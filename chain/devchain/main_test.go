package devchain

import (
	"log/slog"
	"os"
	"testing"

	gethlog "github.com/ethereum/go-ethereum/log"
)

// TestMain has go-ethereum's own errors written to stderr. Its logger discards everything by default, and its
// log.Crit exits the process with status 1 after logging: a node that met a fatal error (a database written after
// it closed, say) ended this package's test binary with "exit status 1" and not a word (the race pass of a CI
// run, once). Errors only: the node's ordinary chatter stays out of the test output.
func TestMain(m *testing.M) {
	gethlog.SetDefault(gethlog.NewLogger(gethlog.NewTerminalHandlerWithLevel(os.Stderr, slog.LevelError, false)))
	os.Exit(m.Run())
}
