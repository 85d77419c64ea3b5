package caddymodule

import (
	"bytes"
	"context"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/x402-gateway/caddy-x402/facilitatorclient"
)

// PauseBackgroundSettlement holds the background settlements of settle-async gates until resume is called.
func PauseBackgroundSettlement() (resume func()) { return gateLedgers.PauseBackgroundSettlement() }

// OfferMemoryBytes is how many bytes the process's price_grace memory counts, 0 when no gate has one.
func OfferMemoryBytes() int64 {
	var n int64
	offerMemories.Range(func(_, v any) bool {
		n += v.(offerMemory).Bytes()
		return true
	})
	return n
}

// ForgetSentPayments gives the process a new, empty memory of the failover member each payment's /settle was sent
// to, as a restarted process starts with; failover sets provisioned from then on use it.
func ForgetSentPayments() { sentPayments = facilitatorclient.NewSentPayments() }

// PruneGateJournals runs the gates' periodic journal prune now, as if the clock read now (see
// gate.Ledgers.PruneJournals).
func PruneGateJournals(now time.Time) (int, error) { return gateLedgers.PruneJournals(now) }

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

// RunX402Context runs `caddy x402 <args>` in this process until it returns or ctx ends (which a long-running
// command such as devchain takes as SIGINT), writing its output as it goes.
func RunX402Context(ctx context.Context, stdout, stderr io.Writer, args ...string) error {
	cmd := &cobra.Command{Use: "x402", SilenceUsage: true}
	addX402Commands(cmd)
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	cmd.SetIn(strings.NewReader(""))
	cmd.SetArgs(args)
	return cmd.ExecuteContext(ctx)
}

// EnginesHeld is how many embedded engines the process holds, and the references to them (for the review of
// the chain-down start: none leaked by a waiter).
func EnginesHeld() (engineCount, refs int) {
	engines.Range(func(k, _ any) bool {
		engineCount++
		r, _ := engines.References(k)
		refs += r
		return true
	})
	return engineCount, refs
}

// ChainRetryMax is the longest pause between two tries of an engine waiting for its chain.
const ChainRetryMax = chainRetryMax
