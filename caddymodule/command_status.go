package caddymodule

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// statusTimeout bounds `caddy x402 status`: the admin API reads each network's head and each wallet's balance.
const statusTimeout = 30 * time.Second

// maxStatusBytes bounds the status document read from the admin API.
const maxStatusBytes = 4 << 20

// newStatusCommand is `caddy x402 status`.
func newStatusCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status [--address localhost:2019] [--config FILE [--adapter NAME]] [--json]",
		Short: "Shows a running Caddy's x402 state: networks, wallets, journal, refusals",
		Long: `
Asks a running Caddy's admin API (GET /x402/status) what its x402 app's
embedded facilitator says of itself, the same as an x402_facilitator's /health,
and prints it for a person: per network, whether the RPC answers and how old
the latest block is, each settlement wallet's native balance and settlements
in flight, the journal's backlog (payments not final) and pending settlements
(claimed or broadcast); then the payments refused since Caddy started, counted
by network and reason, and the latest of them. RPC URLs are shown without
their path or query (where API keys live); no key, payment or header is shown.

The admin API is found as 'caddy stop' finds it: --address, else the admin
address of --config (with --adapter), else localhost:2019.

--json prints the status document itself. The exit status is 0 when the state
is ok or degraded, and 1 when it is down or could not be had.
`,
		Args: cobra.NoArgs,
		RunE: cmdX402Status,
	}
	fs := cmd.Flags()
	fs.String("address", "", "Address of the running Caddy's admin API (default: from --config, else localhost:2019)")
	fs.StringP("config", "c", "", "Configuration file to read the admin address from, if --address is not given")
	fs.StringP("adapter", "a", "", "Name of the config adapter of --config")
	fs.Bool("json", false, "Print the status document as JSON")
	return cmd
}

// cmdX402Status resolves the flags of `caddy x402 status` and runs it.
func cmdX402Status(cmd *cobra.Command, _ []string) error {
	fs := cmd.Flags()
	address, _ := fs.GetString("address")
	configFile, _ := fs.GetString("config")
	adapter, _ := fs.GetString("adapter")
	asJSON, _ := fs.GetBool("json")
	addr, err := caddycmd.DetermineAdminAPIAddress(address, nil, configFile, adapter)
	if err != nil {
		return fmt.Errorf("finding the admin API's address: %w", err)
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), statusTimeout)
	defer cancel()
	return runStatus(ctx, addr, asJSON, cmd.OutOrStdout())
}

// runStatus reads the status from the admin API at addr and prints it.
func runStatus(ctx context.Context, addr string, asJSON bool, stdout io.Writer) error {
	status, body, err := fetchStatus(ctx, addr)
	if err != nil {
		return err
	}
	doc, err := facilitatorserver.ReadHealth(body)
	if err != nil || (doc.Status == "" && doc.Error == "") {
		return fmt.Errorf("the admin API at %s answered HTTP %d without an x402 status (%s)", addr, status, snippet(body))
	}
	if asJSON {
		if _, err := stdout.Write(body); err != nil {
			return err
		}
	} else if err := printStatus(stdout, addr, doc, time.Now()); err != nil {
		return err
	}
	if doc.Status != x402.HealthOK && doc.Status != x402.HealthDegraded {
		return fmt.Errorf("x402 status: %s (HTTP %d)", cmp.Or(doc.Status, "unknown"), status)
	}
	return nil
}

// fetchStatus GETs the status from the admin API at addr (host:port, unix/path or any address Caddy's admin
// listens on), and returns the HTTP status and body, whatever the status: a down facilitator's 503 carries the
// document that says why.
func fetchStatus(ctx context.Context, addr string) (int, []byte, error) {
	na, err := caddy.ParseNetworkAddress(addr)
	if err != nil || na.PortRangeSize() > 1 {
		return 0, nil, fmt.Errorf("the admin API's address %q is not one address: %v", addr, cmp.Or(err, errors.New("a port range")))
	}
	dialAddr := na.JoinHostPort(0)
	origin := "http://" + dialAddr
	if na.IsUnixNetwork() || na.IsFdNetwork() {
		origin = "http://127.0.0.1"                 // any host: the socket is what is dialled; the admin API wants a local one
		dialAddr, _, _ = strings.Cut(dialAddr, "|") // a unix socket's file mode rides after '|'
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, origin+adminStatusPath, nil)
	if err != nil {
		return 0, nil, fmt.Errorf("asking the admin API at %s: %w", addr, err)
	}
	req.Header.Set("Accept", "application/json")
	if !na.IsUnixNetwork() && !na.IsFdNetwork() {
		req.Header.Set("Origin", origin) // the admin API checks the origin of what reaches it over TCP
	}
	client := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, na.Network, dialAddr)
	}}}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, fmt.Errorf("asking the admin API at %s (is Caddy running, with its admin API there? --address names another): %w", addr, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxStatusBytes))
	if err != nil {
		return 0, nil, fmt.Errorf("reading the admin API's answer: %w", err)
	}
	if resp.StatusCode == http.StatusNotFound {
		var e struct {
			Error string `json:"error"`
		}
		if json.Unmarshal(body, &e) == nil && e.Error != "" {
			return 0, nil, fmt.Errorf("the admin API at %s: %s", addr, e.Error)
		}
		return 0, nil, fmt.Errorf("the admin API at %s has no %s: is this Caddy built with the x402 modules?", addr, adminStatusPath)
	}
	return resp.StatusCode, body, nil
}

// snippet is the start of an answer, for an error.
func snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return fmt.Sprintf("%q", s)
}

// printStatus prints the status for a person: a block per network, then the refusals.
func printStatus(out io.Writer, addr string, doc facilitatorserver.HealthDoc, now time.Time) error {
	var b strings.Builder
	fmt.Fprintf(&b, "x402 status: %s   (admin API %s, %s)\n", cmp.Or(doc.Status, "unknown"), addr, now.UTC().Format("2006-01-02 15:04:05 UTC"))
	if doc.Error != "" {
		fmt.Fprintf(&b, "error: %s\n", doc.Error)
	}
	for _, n := range doc.Networks {
		fmt.Fprintf(&b, "\nnetwork %s: %s\n", n.Network, cmp.Or(n.Status, "unknown"))
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		if n.Error != "" {
			fmt.Fprintf(tw, "  error\t%s\n", n.Error)
		}
		if n.RPCReachable {
			fmt.Fprintf(tw, "  head\tblock %d, %s\n", n.HeadBlock, facilitatorserver.FormatHeadAge(n.HeadAgeSeconds))
		} else {
			fmt.Fprintf(tw, "  head\tunknown: the RPC is not reachable\n")
		}
		fmt.Fprintf(tw, "  journal backlog\t%d not final\n", n.JournalBacklog)
		pending := fmt.Sprint(n.PendingSettlements)
		if n.OldestPendingSeconds > 0 {
			pending += ", the oldest claimed " + facilitatorserver.FormatAge(n.OldestPendingSeconds) + " ago"
		}
		fmt.Fprintf(tw, "  pending settlements\t%s\n", pending)
		for _, e := range n.Extra {
			fmt.Fprintf(tw, "  %s\t%s\n", e.Name, e.Value)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(n.Wallets) > 0 {
			tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "  WALLET\tBALANCE (NATIVE)\tIN FLIGHT\n")
			for _, w := range n.Wallets {
				low := ""
				if w.Low {
					low = "  LOW"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%d%s\n", w.Address, facilitatorserver.FormatNative(w.Balance), w.InFlight, low)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}
	}
	if r := doc.Refusals; r != nil {
		fmt.Fprintf(&b, "\nrefused since start: %d\n", r.Total)
		tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		if len(r.Counts) > 0 {
			fmt.Fprintf(tw, "  NETWORK\tREASON\tCOUNT\n")
			for _, c := range r.Counts {
				fmt.Fprintf(tw, "  %s\t%s\t%d\n", c.Network, c.Reason, c.Count)
			}
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if len(r.Recent) > 0 {
			fmt.Fprintf(&b, "latest:\n")
			tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "  WHEN (UTC)\tCALL\tNETWORK\tREASON\tPAYER\n")
			for _, one := range r.Recent {
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", one.At.UTC().Format("2006-01-02 15:04:05"), one.Op, one.Network, one.Reason, cmp.Or(one.Payer, "-"))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}
	}
	_, err := io.WriteString(out, b.String())
	return err
}
