package caddymodule

import (
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/x402-gateway/caddy-x402/bench"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// newBenchCommand is `caddy x402 bench`.
func newBenchCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench [--dev | --key HEX | --key-file FILE] [--rpc URL] [-c N] [-n N] [-d DURATION] [--method permit2|eip3009] [--http-method GET] [--timeout 60s] [--settle-wait 60s] [--max-failures 0] [--max AMOUNT] [--refund] [--json] <url>",
		Short: "Load-tests a paid (or free) URL with payments signed ahead, and checks the seller was paid for each",
		Long: `
Requests the URL once. When it answers 402 Payment Required, chooses a
requirement as 'caddy x402 pay' does (permit2 first; --method restricts), then
signs N distinct payments a window ahead of their requests (the first window
before the clock starts, the rest during the run, each dated by the chain's
head when signed, so that none expires on a chain whose clock runs ahead), and
sends N requests at concurrency C over kept-alive HTTP/1.1 connections, each
with a payment of its own. A URL that answers 2xx is
benchmarked the same way with plain requests; any other answer stops the run.

-n is the number of requests (default 100); -d, when given, stops sending new
requests after that long, so that -n is then at most what is sent. Latency is
measured from sending a request to the end of its body.

With --rpc (or --dev), the payer's balance and Permit2 allowance are checked
before anything is signed, and the seller's (payTo's) balance of the token is
read before and after the run; after it, bench waits (at most --settle-wait)
for settlements to land, since 'settle async' settles in the background. The
rise must be what the 2xx answers paid: the price for each (exact), or the
amount each PAYMENT-RESPONSE names (upto; a pending answer that names none
counts at the maximum). A mismatch is printed and bench exits non-zero: a
resource served and not paid for fails the run.

A request that got no 2xx answer is a failure; bench exits non-zero when more
than --max-failures (default 0) requests failed, after printing the report, so
that a script or CI never takes a run that served nothing for a result.

A batch-settlement offer (a route of scheme batch) is paid by channel vouchers,
which cannot be signed ahead: each is the cumulative amount the server last
accepted plus the price. Each of the C callers pays from a channel of its own
(the payer's key, a salt of the run's own), whose first request deposits the
caller's share of the run (its requests times the price, the run's deposits in
all bounded by --max) and every later one carries the next voucher; a voucher
refused with a corrective 402 resyncs the channel and is sent once more. The
report counts the deposits, vouchers and refunds sent, and with --rpc the
transactions mined to the escrow and its deposit collectors until the seller's
balance showed the vouchers: the server claims them as its batch block says
(claim_every, claim_amount, claim_after, and at shutdown), so --settle-wait must
cover its claim. --refund asks, after the run, for what the channels hold that no
accepted voucher charges (a run that served every request leaves nothing).

An interrupt (SIGINT, SIGTERM) stops sending new requests: the answers in
flight are waited for, and the run is reported (the seller's balance, the
channels, --refund) as any other; a second interrupt ends bench.

A permit2 payer must have approved Permit2 for N payments: bench sends no
transaction of its own accord, and says what to approve when the allowance is
short. The one exception is --dev on the dev chain, whose demo payer approves
Permit2 once (printed, with the transaction). erc2612 cannot be benchmarked:
its permits take the token's nonces(payer) one after another.

--dev pays as the dev chain's demo payer through its default RPC address
(` + "http://" + devchain.DefaultListen + `); --key, --key-file and --rpc win over it. The key can also
come from X402_PAYER_KEY, and is never printed. --json prints one JSON object on
stdout; the report is otherwise on stdout and progress on stderr.
`,
		Args: cobra.ExactArgs(1),
		RunE: cmdX402Bench,
	}
	f := cmd.Flags()
	f.String("key", "", "Payer private key, hex")
	f.String("key-file", "", "File whose first line is the payer private key, hex")
	f.String("rpc", "", "JSON-RPC URL of the chain the payments settle on: checks the funds and the seller's balance")
	f.Bool("dev", false, "Pay as the dev chain's demo payer through its default RPC address")
	f.IntP("concurrency", "c", 1, "Requests in flight at once")
	f.IntP("requests", "n", 100, "Requests to send, each with a payment of its own")
	f.DurationP("duration", "d", 0, "Stop sending new requests after this long (0: send all -n)")
	f.String("method", "", "Asset transfer method: permit2 or eip3009 (default: the first payable, permit2 first)")
	f.String("http-method", http.MethodGet, "HTTP method of the requests")
	f.Duration("timeout", 60*time.Second, "Give up on one request after this long, body included")
	f.Duration("settle-wait", 60*time.Second, "Wait at most this long after the run for the seller's balance to show the payments")
	f.Int("max-failures", 0, "Exit non-zero when more requests than this got no 2xx answer")
	f.Bool("json", false, "Print one JSON object on stdout")
	f.String("max", "", "Batch-settlement: the most the run's channel deposits may hold in all, in raw token units (default: -n times the price)")
	f.Bool("refund", false, "Batch-settlement: after the run, ask for what the channels hold that no accepted voucher charges")
	return cmd
}

// cmdX402Bench resolves the flags of `caddy x402 bench` and runs it.
func cmdX402Bench(cmd *cobra.Command, args []string) error {
	fs := cmd.Flags()
	keyHex, _ := fs.GetString("key")
	keyFile, _ := fs.GetString("key-file")
	o := bench.Options{URL: args[0]}
	o.Dev, _ = fs.GetBool("dev")
	o.Key, o.KeyErr = loadPayerKey(keyHex, keyFile, os.Getenv(envPayerKey), o.Dev)
	if o.KeyErr != nil && (keyHex != "" || keyFile != "") {
		return o.KeyErr // a key that was given and is wrong is an error even for a free URL
	}
	o.RPC, _ = fs.GetString("rpc")
	o.Concurrency, _ = fs.GetInt("concurrency")
	o.Requests, _ = fs.GetInt("requests")
	o.Duration, _ = fs.GetDuration("duration")
	o.Method, _ = fs.GetString("method")
	o.HTTPMethod, _ = fs.GetString("http-method")
	o.Timeout, _ = fs.GetDuration("timeout")
	o.SettleWait, _ = fs.GetDuration("settle-wait")
	o.JSON, _ = fs.GetBool("json")
	o.MaxFailures, _ = fs.GetInt("max-failures")
	if m, _ := fs.GetString("max"); m != "" {
		v, err := x402.ParseUint256(m)
		if err != nil {
			return fmt.Errorf("--max %q: expected an amount in raw token units: %w", m, err)
		}
		o.Max = v
	}
	o.Refund, _ = fs.GetBool("refund")
	if o.Dev && o.RPC == "" {
		o.RPC = "http://" + devchain.DefaultListen
	}
	// The first interrupt stops sending new requests and the run reports what it sent (and refunds, with
	// --refund); the second ends the process.
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		stop()
	}()
	return bench.Run(ctx, o, cmd.OutOrStdout(), cmd.ErrOrStderr())
}
