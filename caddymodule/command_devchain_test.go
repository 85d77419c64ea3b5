package caddymodule_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// devchainSeller is who the standalone dev chain's tests sell to.
var devchainSeller = common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e11")

// devchainPrice is what their paid route costs: $0.01 of the Stable Coin, 6 decimals.
const devchainPrice = 10_000

// standaloneDevchain is `caddy x402 devchain ... --json` running in this process.
type standaloneDevchain struct {
	facts struct {
		RPC     string `json:"rpc"`
		ChainID uint64 `json:"chainId"`
		Network string `json:"network"`
		Tokens  []struct {
			Address  string `json:"address"`
			Name     string `json:"name"`
			Version  string `json:"version"`
			Decimals uint8  `json:"decimals"`
			EIP3009  bool   `json:"eip3009"`
		} `json:"tokens"`
		Wallets []string `json:"wallets"`
		Payers  []string `json:"payers"`
	}
	stdout, stderr *syncBuffer
	cancel         context.CancelFunc
	done           chan struct{}
	err            error // the command's result, once done is closed
}

// startDevchainCommand runs `caddy x402 devchain <args> --json` in a goroutine and waits for its JSON line.
// The command is stopped when the test ends, if the test has not stopped it.
func startDevchainCommand(t *testing.T, args ...string) *standaloneDevchain {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	d := &standaloneDevchain{stdout: new(syncBuffer), stderr: new(syncBuffer), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		d.err = caddymodule.RunX402Context(ctx, d.stdout, d.stderr, append(append([]string{"devchain"}, args...), "--json")...)
	}()
	t.Cleanup(func() {
		cancel()
		<-d.done
	})
	deadline := time.After(time.Minute)
	for !strings.Contains(d.stdout.String(), "\n") {
		select {
		case <-d.done:
			t.Fatalf("caddy x402 devchain exited before printing its JSON line: %v\nstderr:\n%s", d.err, d.stderr)
		case <-deadline:
			t.Fatalf("caddy x402 devchain printed no JSON line within a minute\nstderr:\n%s", d.stderr)
		case <-time.After(10 * time.Millisecond):
		}
	}
	line := d.stdout.String()
	if err := json.Unmarshal([]byte(line), &d.facts); err != nil || strings.Count(line, "\n") != 1 {
		t.Fatalf("caddy x402 devchain --json printed %q on stdout, want one JSON object on one line (%v)", line, err)
	}
	return d
}

// stop cancels the command's context, as SIGINT does, and returns its result.
func (d *standaloneDevchain) stop(t *testing.T) error {
	t.Helper()
	d.cancel()
	select {
	case <-d.done:
		return d.err
	case <-time.After(30 * time.Second):
		t.Fatal("caddy x402 devchain did not exit within 30 s of being stopped")
		return nil
	}
}

// dial connects to the chain's RPC; the client closes when the test ends.
func (d *standaloneDevchain) dial(t *testing.T) *chain.RPCClient {
	t.Helper()
	c, err := chain.DialRPC(context.Background(), d.facts.RPC)
	if err != nil {
		t.Fatalf("dialling %s: %v", d.facts.RPC, err)
	}
	t.Cleanup(c.Close)
	return c
}

// tokenBalanceAt reads holder's balance of token through c.
func tokenBalanceAt(t *testing.T, c *chain.RPCClient, token, holder common.Address) *big.Int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := chain.CallTokenUint(ctx, c, token, "balanceOf", holder)
	if err != nil {
		t.Fatalf("reading the %s balance of %s: %v", token, holder, err)
	}
	return n
}

func TestTheDevchainCommandServesTheDevChainOnAFreePortAndStopsCleanly(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0")

	u, err := url.Parse(d.facts.RPC)
	if err != nil || u.Hostname() != "127.0.0.1" || u.Port() == "" || u.Port() == "0" {
		t.Fatalf("rpc %q, want http://127.0.0.1:<the port picked>", d.facts.RPC)
	}
	if d.facts.ChainID != devchain.DefaultChainID || d.facts.Network != "eip155:72344" {
		t.Errorf("chainId %d, network %q; want 72344, eip155:72344", d.facts.ChainID, d.facts.Network)
	}
	if len(d.facts.Tokens) != 2 || !strings.EqualFold(d.facts.Tokens[0].Address, devchain.TokenAddress.Hex()) || d.facts.Tokens[0].EIP3009 ||
		!strings.EqualFold(d.facts.Tokens[1].Address, devchain.EIP3009TokenAddress.Hex()) || !d.facts.Tokens[1].EIP3009 {
		t.Errorf("tokens %+v, want the Stable Coin at %s, then the USD Coin (eip3009) at %s", d.facts.Tokens, devchain.TokenAddress, devchain.EIP3009TokenAddress)
	}
	var wallets []string
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		wallets = append(wallets, crypto.PubkeyToAddress(k.PublicKey).Hex())
	}
	if !slices.Equal(d.facts.Wallets, wallets) || !slices.Equal(d.facts.Payers, []string{devchain.PayerAddress.Hex()}) {
		t.Errorf("wallets %v and payers %v; want %v and [%s]", d.facts.Wallets, d.facts.Payers, wallets, devchain.PayerAddress.Hex())
	}
	report := d.stderr.String()
	for _, want := range []string{"dev chain started", "rpc:", d.facts.RPC, "eip155:72344", devchain.TokenAddress.Hex(),
		devchain.EIP3009TokenAddress.Hex(), wallets[3], devchain.PayerAddress.Hex(), "rpc " + d.facts.RPC, "DEV CHAIN ONLY"} {
		if !strings.Contains(report, want) {
			t.Errorf("the report on stderr lacks %q:\n%s", want, report)
		}
	}
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		if hexKey := common.Bytes2Hex(crypto.FromECDSA(k)); strings.Contains(report, hexKey) {
			t.Errorf("the report prints a settlement wallet's key:\n%s", report)
		}
	}

	c := d.dial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if id, err := c.ChainID(ctx); err != nil || id.Uint64() != devchain.DefaultChainID {
		t.Errorf("the RPC answers chain id %v (%v), want 72344", id, err)
	}
	for _, token := range []common.Address{devchain.TokenAddress, devchain.EIP3009TokenAddress} {
		if code, err := c.CodeAt(ctx, token, nil); err != nil || len(code) == 0 {
			t.Errorf("no code at the token %s (%v)", token, err)
		}
		if b := tokenBalanceAt(t, c, token, devchain.PayerAddress); b.Sign() <= 0 {
			t.Errorf("the demo payer holds %s of the token %s, want some", b, token)
		}
	}

	if err := d.stop(t); err != nil {
		t.Fatalf("caddy x402 devchain returned %v when stopped, want a clean exit", err)
	}
	if !strings.Contains(d.stderr.String(), "dev chain stopped") {
		t.Errorf("the report does not say the chain stopped:\n%s", d.stderr)
	}
	if _, err := c.ChainID(ctx); err == nil {
		t.Error("the RPC still answers after the command stopped")
	}
}

func TestTheDevchainCommandWarnsLoudlyWhenItListensBeyondLoopback(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "0.0.0.0:0")
	if report := d.stderr.String(); !strings.Contains(report, "WARNING: dev chain JSON-RPC listens beyond loopback") {
		t.Errorf("no warning on stderr for listening on 0.0.0.0:\n%s", report)
	}
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}
}

func TestTheDevchainCommandRefusesFlagsThatMakeNoChain(t *testing.T) {
	for _, args := range [][]string{
		{"devchain", "--wallets", "0"},
		{"devchain", "--payers", "0"},
		{"devchain", "--chain-id", "0"},
		{"devchain", "--listen", "localhost"},
		{"devchain", "--block-time", "1500ms"},
	} {
		_, _, err := caddymodule.RunX402("", args...)
		if err == nil {
			t.Errorf("caddy x402 %s started a chain, want an error", strings.Join(args, " "))
		}
	}
}

// sellOnDevchain starts Caddy with a $0.01 route to devchainSeller that settles on the dev chain at rpc by
// dev_chain rpc (and wallets, when given), pays it once as the demo payer, and checks the answer.
func sellOnDevchain(t *testing.T, rpc, wallets string) {
	t.Helper()
	opts := "\t\t\trpc " + rpc + "\n"
	if wallets != "" {
		opts += "\t\t\twallets " + wallets + "\n"
	}
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
`+opts+`		}
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to `+devchainSeller.Hex()+`
	}
	respond "paid"
}`)
	payDevchainRoute(t, rpc, srv.URL+"/")
}

// payDevchainRoute pays url as the dev chain's demo payer through rpc, at most the route's price, and fails the
// test unless it answers 200 "paid" with a settlement; it returns the paid response (body read and closed).
func payDevchainRoute(t *testing.T, rpc, url string) (*http.Response, *x402.SettleResponse) {
	t.Helper()
	p, err := payer.New(devchain.PayerKey(), payer.Options{RPC: rpc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{PerRequest: big.NewInt(devchainPrice)}}}}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("paying %s: %v", url, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	settled, err := payer.Settlement(resp)
	if resp.StatusCode != 200 || string(body) != "paid" || err != nil || settled == nil || !settled.Success {
		t.Fatalf("paid GET: %d %q, settlement %+v (%v); want 200 \"paid\", settled", resp.StatusCode, body, settled, err)
	}
	return resp, settled
}

func TestCaddySettlesOnAStandaloneDevChainThroughDevChainRPCWithTheWalletsItNames(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0", "--wallets", "6")
	c := d.dial(t)
	before := tokenBalanceAt(t, c, devchain.TokenAddress, devchainSeller)

	sellOnDevchain(t, d.facts.RPC, "4-5")

	if got := new(big.Int).Sub(tokenBalanceAt(t, c, devchain.TokenAddress, devchainSeller), before); got.Int64() != devchainPrice {
		t.Errorf("the seller's balance rose by %s, want %d", got, devchainPrice)
	}
	app := x402App(t)
	if len(app.Networks) != 1 || !slices.Equal(app.Networks[0].RPC, []string{d.facts.RPC}) {
		t.Errorf("the app settles on %+v, want only the standalone chain at %s", app.Networks, d.facts.RPC)
	}
	got := app.Facilitator().Wallets("eip155:72344")
	want := []common.Address{common.HexToAddress(d.facts.Wallets[4]), common.HexToAddress(d.facts.Wallets[5])}
	if !slices.Equal(got, want) {
		t.Errorf("Caddy settles with wallets %v, want dev wallets 4 and 5 %v", got, want)
	}
}

func TestAStandaloneDevChainWithADataDirKeepsAPaymentAcrossARestart(t *testing.T) {
	dir := t.TempDir()
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0", "--data-dir", dir)
	sellOnDevchain(t, d.facts.RPC, "")
	c := d.dial(t)
	paid := tokenBalanceAt(t, c, devchain.TokenAddress, devchainSeller)
	payerLeft := tokenBalanceAt(t, c, devchain.TokenAddress, devchain.PayerAddress)
	if paid.Int64() != devchainPrice {
		t.Fatalf("the seller holds %s after the payment, want %d", paid, devchainPrice)
	}
	if err := d.stop(t); err != nil {
		t.Fatalf("stopping the chain: %v", err)
	}

	again := startDevchainCommand(t, "--listen", "127.0.0.1:0", "--data-dir", dir)
	c = again.dial(t)
	if got := tokenBalanceAt(t, c, devchain.TokenAddress, devchainSeller); got.Cmp(paid) != 0 {
		t.Errorf("after the restart the seller holds %s, want the %s paid before", got, paid)
	}
	if got := tokenBalanceAt(t, c, devchain.TokenAddress, devchain.PayerAddress); got.Cmp(payerLeft) != 0 {
		t.Errorf("after the restart the payer holds %s, want the %s left before (no second mint)", got, payerLeft)
	}
	if err := again.stop(t); err != nil {
		t.Fatal(err)
	}
}

// syncBuffer is a bytes.Buffer a command writes to while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func TestDevChainRPCAtAnotherChainFailsToStartNamingTheCommand(t *testing.T) {
	// A node of chain 1 where the dev chain should be: the engine refuses it at once.
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			ID json.RawMessage `json:"id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%s,"result":"0x1"}`, req.ID)
	}))
	defer other.Close()
	caddyMu.Lock()
	defer caddyMu.Unlock()
	cfg := adaptCaddyfile(t, `{
	x402 {
		dev_chain {
			rpc `+other.URL+`
		}
	}
}

http://127.0.0.1:`+freePortOf(t)+` {
	respond "free"
}
`, t.TempDir())
	err := caddy.Load(cfg, true)
	_ = caddy.Stop()
	if err == nil || !strings.Contains(err.Error(), "is `caddy x402 devchain` running there?") || !strings.Contains(err.Error(), "serves chain 1") {
		t.Fatalf("loading a config whose dev_chain rpc is a node of chain 1: %v; want an error naming caddy x402 devchain and chain 1", err)
	}
}
