package caddymodule

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

// PauseBackgroundSettlement holds the background settlements of settle-async gates until resume is called, so a
// benchmark can measure what serving paid requests costs apart from settling them on the same cores.
func PauseBackgroundSettlement() (resume func()) {
	ch := make(chan struct{})
	settlementPause.Store(&ch)
	return func() {
		settlementPause.Store(nil)
		close(ch)
	}
}

// PruneGateJournals runs the gates' periodic journal prune now, as if the clock read now, on every journal a
// gate uses, and returns how many records it deleted: the real prune runs every ten minutes.
func PruneGateJournals(now time.Time) (int, error) {
	total := 0
	var errs []error
	ledgers.Range(func(_, v any) bool {
		n, err := v.(*gateLedger).prune(now)
		total += n
		errs = append(errs, err)
		return true
	})
	return total, errors.Join(errs...)
}

// RunX402 runs `caddy x402 <args>` in this process with stdin as its input, as the command line would,
// within a minute.
func RunX402(stdin string, args ...string) (stdout, stderr string, err error) {
	cmd := &cobra.Command{Use: "x402", SilenceUsage: true}
	addX402Commands(cmd)
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetIn(strings.NewReader(stdin))
	cmd.SetArgs(args)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = cmd.ExecuteContext(ctx)
	return out.String(), errOut.String(), err
}
