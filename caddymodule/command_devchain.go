package caddymodule

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ethereum/go-ethereum/crypto"
	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// devchainStartTimeout bounds the dev chain's startup: the node, and the deployments and mints of a fresh chain.
const devchainStartTimeout = 2 * time.Minute

// newDevchainCommand is `caddy x402 devchain`.
func newDevchainCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "devchain [--listen 127.0.0.1:8545] [--data-dir DIR] [--block-time 0] [--wallets 4] [--payers 1] [--chain-id N] [--alloc FILE] [--json]",
		Short: "Runs the dev chain on its own, for several Caddy processes to share",
		Long: `
Runs the dev chain that the x402 app's dev_chain option runs inside Caddy: the
same genesis, the Stable Coin and the USDC-like USD Coin at the same addresses,
Permit2 and the x402 proxy, the same funded settlement wallets and demo payers,
all with the same well-known keys. It runs until SIGINT or SIGTERM, then stops
cleanly (with --data-dir, the chain is there at the next start).

It prints where the chain is and what lives on it: the RPC URL, chain id and
network, the tokens, the settlement wallets' addresses and the demo payer's
address and key. With --json, those go to stderr and stdout gets one JSON object
on one line: {"rpc", "chainId", "network", "tokens", "wallets", "payers"}.

A Caddy settles on this chain, with its wallets and tokens and no keys written
out, by the global option

    x402 {
        dev_chain {
            rpc http://127.0.0.1:8545
            wallets 0-3
        }
    }

and starts no chain of its own. Caddy processes sharing the chain must each
settle with wallets of their own (fund more with --wallets).

--listen with port 0 picks a free port; the printed RPC URL has the real one.
The dev chain's keys are public: anyone who reaches its RPC can spend its funds,
so listen on loopback only. It is for development and tests, never for value.
`,
		Args: cobra.NoArgs,
		RunE: cmdX402Devchain,
	}
	fs := cmd.Flags()
	fs.String("listen", devchain.DefaultListen, "host:port of the JSON-RPC endpoint; port 0 picks a free port")
	fs.String("data-dir", "", "Keep the chain in this directory across restarts (default: a fresh chain each start)")
	fs.Duration("block-time", 0, "0: a block as soon as transactions arrive; whole seconds such as 1s: a block on that period")
	fs.Int("wallets", devchain.DefaultWallets, "Number of funded settlement wallets")
	fs.Int("payers", 1, "Number of funded demo payers")
	fs.Uint64("chain-id", devchain.DefaultChainID, "Chain ID")
	fs.String("alloc", "", "JSON file of extra genesis accounts (geth's genesis alloc format)")
	fs.Bool("json", false, "Print the chain's facts as one JSON line on stdout, the report on stderr")
	return cmd
}

// cmdX402Devchain resolves the flags of `caddy x402 devchain` and runs the chain until SIGINT or SIGTERM.
func cmdX402Devchain(cmd *cobra.Command, _ []string) error {
	fs := cmd.Flags()
	var cfg devchain.Config
	cfg.Listen, _ = fs.GetString("listen")
	cfg.DataDir, _ = fs.GetString("data-dir")
	cfg.BlockTime, _ = fs.GetDuration("block-time")
	cfg.Wallets, _ = fs.GetInt("wallets")
	cfg.Payers, _ = fs.GetInt("payers")
	cfg.ChainID, _ = fs.GetUint64("chain-id")
	cfg.AllocFile, _ = fs.GetString("alloc")
	asJSON, _ := fs.GetBool("json")
	if cfg.Wallets < 1 || cfg.Payers < 1 {
		return fmt.Errorf("--wallets and --payers must be at least 1, got %d and %d", cfg.Wallets, cfg.Payers)
	}
	if cfg.ChainID == 0 {
		return fmt.Errorf("--chain-id must be a positive number")
	}

	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		// Once asked to stop, a second Ctrl-C ends the process at once.
		<-ctx.Done()
		stop()
	}()
	return runDevchain(ctx, cfg, asJSON, cmd.OutOrStdout(), cmd.ErrOrStderr())
}

// runDevchain starts the dev chain of cfg, prints its report (and with asJSON its facts as one JSON line on
// stdout, the report going to stderr), and runs it until ctx ends. Warnings go to stderr either way.
func runDevchain(ctx context.Context, cfg devchain.Config, asJSON bool, stdout, stderr io.Writer) error {
	report := stdout
	if asJSON {
		report = stderr
	}
	// The chain's own startup report, the one Caddy logs for dev_chain, printed for a person to read.
	cfg.Logger = zap.New(&reportCore{mu: new(sync.Mutex), out: report, warn: stderr})

	startCtx, cancel := context.WithTimeout(ctx, devchainStartTimeout)
	c, err := devchain.Start(startCtx, cfg)
	cancel()
	if err != nil {
		return err
	}
	if asJSON {
		b, err := json.Marshal(devchainFactsOf(c))
		if err == nil {
			_, err = fmt.Fprintf(stdout, "%s\n", b)
		}
		if err != nil {
			c.Close()
			return fmt.Errorf("printing the dev chain's facts: %w", err)
		}
	}
	fmt.Fprint(report, devchainUsage(c))

	<-ctx.Done()
	fmt.Fprintln(report, "dev chain stopping")
	if err := c.Close(); err != nil {
		return err
	}
	fmt.Fprintln(report, "dev chain stopped")
	return nil
}

// devchainFacts is what `caddy x402 devchain --json` prints: what a script needs to use the chain.
type devchainFacts struct {
	// RPC is the JSON-RPC URL, with the port actually bound.
	RPC     string `json:"rpc"`
	ChainID uint64 `json:"chainId"`
	// Network is the CAIP-2 identifier, eip155:<chainId>.
	Network string `json:"network"`
	// Tokens are the dev chain's tokens as the x402 app's assets: the Stable Coin, then the USD Coin (eip3009).
	Tokens []*Asset `json:"tokens"`
	// Wallets are the settlement wallets' addresses, in the order dev_chain's wallets numbers them.
	Wallets []string `json:"wallets"`
	// Payers are the demo payers' addresses; the first is the one `caddy x402 pay --dev` pays as.
	Payers []string `json:"payers"`
}

func devchainFactsOf(c *devchain.Chain) devchainFacts {
	f := devchainFacts{RPC: c.RPCURL(), ChainID: c.ChainID(), Network: c.Network(), Tokens: devChainAssets()}
	for _, k := range c.WalletKeys() {
		f.Wallets = append(f.Wallets, crypto.PubkeyToAddress(k.PublicKey).Hex())
	}
	for _, k := range c.Payers() {
		f.Payers = append(f.Payers, crypto.PubkeyToAddress(k.PublicKey).Hex())
	}
	return f
}

// devchainUsage says, a line each, how Caddy and `caddy x402 pay` use the running chain c.
func devchainUsage(c *devchain.Chain) string {
	chainID := ""
	if c.ChainID() != devchain.DefaultChainID {
		chainID = fmt.Sprintf("      chain_id %d\n", c.ChainID())
	}
	n := len(c.WalletKeys())
	wallets := "0"
	if n > 1 {
		wallets = fmt.Sprintf("0-%d", n-1)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Caddy settles on this chain, with its tokens and wallets %s (their keys are the dev chain's well-known keys), given the global option:\n", wallets)
	fmt.Fprintf(&b, "  x402 {\n    dev_chain {\n      rpc %s\n%s      wallets %s\n    }\n  }\n", c.RPCURL(), chainID, wallets)
	fmt.Fprintf(&b, "Caddy processes sharing the chain each need wallets of their own, such as wallets 0-1 and 2-3 (--wallets funds more).\n")
	fmt.Fprintf(&b, "Pay as the demo payer: caddy x402 pay --dev --rpc %s <url>\n", c.RPCURL())
	fmt.Fprintf(&b, "DEV CHAIN ONLY: every key of this chain is public; never use them elsewhere. Ctrl-C stops it.\n")
	return b.String()
}

// reportCore writes log entries as a report a person reads: the message on a line, then each field on a line
// of its own, indented, a list one item a line. Warnings and errors go to warn, headed WARNING.
type reportCore struct {
	mu        *sync.Mutex
	out, warn io.Writer
	fields    []zapcore.Field
}

func (c *reportCore) Enabled(l zapcore.Level) bool { return l >= zapcore.InfoLevel }

func (c *reportCore) With(fields []zapcore.Field) zapcore.Core {
	with := *c
	with.fields = append(c.fields[:len(c.fields):len(c.fields)], fields...)
	return &with
}

func (c *reportCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c *reportCore) Write(e zapcore.Entry, fields []zapcore.Field) error {
	fields = append(c.fields[:len(c.fields):len(c.fields)], fields...)
	width := 0
	for _, f := range fields {
		width = max(width, len(f.Key))
	}
	var b strings.Builder
	w := c.out
	if e.Level >= zapcore.WarnLevel {
		w = c.warn
		b.WriteString("WARNING: ")
	}
	b.WriteString(e.Message + "\n")
	for _, f := range fields {
		enc := zapcore.NewMapObjectEncoder()
		f.AddTo(enc)
		switch v := enc.Fields[f.Key].(type) {
		case []any:
			fmt.Fprintf(&b, "  %s:\n", f.Key)
			for _, item := range v {
				fmt.Fprintf(&b, "    %v\n", item)
			}
		default:
			fmt.Fprintf(&b, "  %-*s %v\n", width+1, f.Key+":", v)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_, err := io.WriteString(w, b.String())
	return err
}

func (c *reportCore) Sync() error { return nil }

// Interface guards
var _ zapcore.Core = (*reportCore)(nil)
