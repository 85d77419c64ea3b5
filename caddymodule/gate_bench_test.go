package caddymodule_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Load of the gate benchmarks: concurrent callers per figure. The load generator shares the machine (and its
// cores) with Caddy and the dev chain, so these are what one box does end to end, not the server alone.
const (
	benchRouteCallers   = 32 // free, paid-async and paid-sync
	benchVerifyCallers  = 8  // the issue's /verify figure is at 8 concurrent callers
	benchLatencyCallers = 1  // paid-sync-latency: one payment at a time, so latency is the gate's, not a queue's
	benchVerifyPool     = 64 // distinct valid payments /verify cycles through (verify consumes nothing)
)

// Sellers of the two paid routes: separate, so that each route's settlements can be counted on chain.
const (
	benchAsyncSeller = "0xa5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5"
	benchSyncSeller  = "0x5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c"
)

// benchCaddyfile is the benchmarked site on the embedded dev chain, which seals a block as soon as a transaction
// arrives (block_time 0: an instantly mining chain). Chain time moves a second per block, so payments are valid
// for a day rather than the default five minutes: thousands of settlements must not outrun their deadlines.
const benchCaddyfile = `{
	x402 {
		dev_chain {
			listen 127.0.0.1:0
		}
	}
}

{{ADDR}} {
	handle /free {
		respond "free content"
	}
	handle /async {
		x402 {
			pay_to ` + benchAsyncSeller + `
			amount 10000
			asset_transfer_method permit2
			max_timeout 24h
			settle async
		}
		respond "paid content"
	}
	handle /sync {
		x402 {
			pay_to ` + benchSyncSeller + `
			amount 10000
			asset_transfer_method permit2
			max_timeout 24h
		}
		respond "paid content"
	}
	handle_path /facilitator/* {
		x402_facilitator
	}
}
`

// BenchmarkGate measures, in one process and one Caddy so that the figures compare: requests per second through
// Caddy for a free route, a paid route settling in the background (settle async) and a paid route that settles
// before it answers (the default: settle after the upstream), all at 32 callers; valid POST /verify calls per
// second at 8 callers; and the latency of a paid request that settles before it answers, at one caller. Each
// figure also reports CPU time per request (the whole process: Caddy, the dev chain and the load generator) and
// p50/p90/p99 latency; paid-async also how fast its backlog settled and the CPU a payment cost in all.
//
// Every paid request carries its own pre-signed permit2 payment from the dev chain's payer, who approved Permit2
// once; payments are signed before the timer starts, since signing is the client's cost. A non-200 answer fails
// the benchmark, and after each run the seller's balance must have risen by exactly the payments made.
//
//	go test ./caddymodule -run '^$' -bench BenchmarkGate -benchtime 2000x -count 3
func BenchmarkGate(b *testing.B) {
	env := newBenchEnv(b)

	b.Run("free", func(b *testing.B) {
		b.ReportAllocs()
		env.hammer(b, benchRouteCallers, func(int) error { return env.get("/free", "") })
	})

	b.Run("paid-async", func(b *testing.B) {
		headers := env.payments(b, "/async", b.N)
		before := env.balance(b, benchAsyncSeller)
		run := env.hammer(b, benchRouteCallers, func(i int) error { return env.get("/async", headers[i]) })
		// The backlog must settle, outside the timer, before the next figure shares the machine with it.
		settledIn := env.waitBalance(b, "/async", benchAsyncSeller, before, b.N, run.start)
		b.ReportMetric(float64(b.N)/settledIn.Seconds(), "settled/s")
		// The CPU a payment costs in all, serving and settling, not just what was spent while the timer ran.
		b.ReportMetric(float64((processCPU(b)-run.cpu).Microseconds())/float64(b.N), "cpu-us/settled")
	})

	// The same route with its background settlements held back until every request was served: what serving a
	// paid request costs the gate (verification, journal, upstream), apart from the settling that shares these
	// cores with it in the figure above because the dev chain runs in this process. Settlement then runs, outside
	// the timer, and must pay the seller exactly.
	b.Run("paid-async-serve-only", func(b *testing.B) {
		headers := env.payments(b, "/async", b.N)
		before := env.balance(b, benchAsyncSeller)
		resume := caddymodule.PauseBackgroundSettlement()
		env.hammer(b, benchRouteCallers, func(i int) error { return env.get("/async", headers[i]) })
		resume()
		env.waitBalance(b, "/async", benchAsyncSeller, before, b.N, time.Now())
	})

	b.Run("paid-sync", func(b *testing.B) {
		headers := env.payments(b, "/sync", b.N)
		before := env.balance(b, benchSyncSeller)
		env.hammer(b, benchRouteCallers, func(i int) error { return env.get("/sync", headers[i]) })
		env.assertSettled(b, "/sync", benchSyncSeller, before, b.N)
	})

	b.Run("verify", func(b *testing.B) {
		bodies := env.verifyBodies(b, min(b.N, benchVerifyPool))
		env.hammer(b, benchVerifyCallers, func(i int) error { return env.verify(bodies[i%len(bodies)]) })
	})

	b.Run("paid-sync-latency", func(b *testing.B) {
		headers := env.payments(b, "/sync", b.N)
		before := env.balance(b, benchSyncSeller)
		env.hammer(b, benchLatencyCallers, func(i int) error { return env.get("/sync", headers[i]) })
		env.assertSettled(b, "/sync", benchSyncSeller, before, b.N)
	})
}

// benchEnv is a running Caddy with the benchmarked routes, a client of its dev chain and the payer's keys.
type benchEnv struct {
	url     string
	client  *http.Client
	eth     *chain.RPCClient
	chainID *big.Int
	token   common.Address
	payer   *ecdsa.PrivateKey
	offers  map[string]x402.PaymentRequirements // the permit2 requirement of each paid route
}

func newBenchEnv(b *testing.B) *benchEnv {
	b.Helper()
	env := &benchEnv{
		url: startBenchCaddy(b, benchCaddyfile),
		// Every caller keeps its connection: the figures are of requests, not of TCP handshakes.
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * benchRouteCallers, DisableCompression: true}},
		payer:  devchain.PayerKeyN(0),
		offers: map[string]x402.PaymentRequirements{},
	}
	b.Cleanup(env.client.CloseIdleConnections)

	nets := x402App(b).Networks
	if len(nets) != 1 || len(nets[0].RPC) == 0 || len(nets[0].Assets) == 0 {
		b.Fatalf("the dev chain configured networks %v, want exactly its own with an RPC URL and an asset", nets)
	}
	id, err := x402.ChainID(nets[0].Network)
	if err != nil {
		b.Fatal(err)
	}
	env.chainID, env.token = new(big.Int).SetUint64(id), common.HexToAddress(nets[0].Assets[0].Address)
	if env.eth, err = chain.DialRPC(context.Background(), nets[0].RPC[0]); err != nil {
		b.Fatalf("dialling the dev chain: %v", err)
	}
	b.Cleanup(env.eth.Close)

	// With Permit2 approved, payments settle with the proxy's plain settle, as a returning payer's do.
	env.approvePermit2(b)
	for _, path := range []string{"/async", "/sync"} {
		env.offers[path] = env.offer(b, path)
	}
	return env
}

// startBenchCaddy is startCaddy for a benchmark: it loads caddyfile ({{ADDR}} replaced by a free loopback
// address) into this process's Caddy, which stops when the benchmark ends, and returns the site's base URL.
func startBenchCaddy(b *testing.B, caddyfile string) string {
	b.Helper()
	caddyMu.Lock()
	dir := b.TempDir()
	url := "http://" + freeAddr(b)
	b.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	b.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	b.Cleanup(func() {
		_ = caddy.Stop()
		caddyMu.Unlock()
	})
	cfg := adaptCaddyfile(b, strings.ReplaceAll(caddyfile, "{{ADDR}}", url), dir)
	if err := caddy.Load(cfg, true); err != nil {
		b.Fatalf("loading the Caddy config: %v\n%s", err, cfg)
	}
	return url
}

// benchRun is one timed load: when it began, the process's CPU time then, and how long each request took.
type benchRun struct {
	start     time.Time
	cpu       time.Duration
	latencies []time.Duration
}

// processCPU is the CPU time this process has used so far, user and system. Caddy, the dev chain and the load
// generator all run in it, so CPU time per request is the whole cost of a request on this box, and unlike
// requests per second it hardly moves when other processes compete for the cores.
func processCPU(b *testing.B) time.Duration {
	b.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatalf("reading the process's CPU time: %v", err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// hammer sends b.N requests from callers concurrent goroutines, do(i) sending the i-th, and reports requests per
// second, CPU time per request and latency percentiles. Only the requests are timed. Any failed request fails
// the benchmark.
func (env *benchEnv) hammer(b *testing.B, callers int, do func(i int) error) benchRun {
	b.Helper()
	run := benchRun{latencies: make([]time.Duration, b.N)}
	var next atomic.Int64
	var failure atomic.Pointer[error]
	var wg sync.WaitGroup
	b.ResetTimer()
	run.start, run.cpu = time.Now(), processCPU(b)
	for range min(callers, b.N) {
		wg.Go(func() {
			for failure.Load() == nil {
				i := int(next.Add(1) - 1)
				if i >= b.N {
					return
				}
				t0 := time.Now()
				if err := do(i); err != nil {
					err = fmt.Errorf("request %d of %d: %w", i+1, b.N, err)
					failure.CompareAndSwap(nil, &err)
					return
				}
				run.latencies[i] = time.Since(t0)
			}
		})
	}
	wg.Wait()
	elapsed, cpu := time.Since(run.start), processCPU(b)-run.cpu
	b.StopTimer()
	if err := failure.Load(); err != nil {
		b.Fatal(*err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-us/op")
	sorted := slices.Clone(run.latencies)
	slices.Sort(sorted)
	for _, p := range []int{50, 90, 99} {
		b.ReportMetric(percentile(sorted, p).Seconds()*1e3, fmt.Sprintf("p%d-ms", p))
	}
	return run
}

// percentile is the nearest-rank p-th percentile of sorted.
func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := (p*len(sorted) + 99) / 100
	return sorted[max(rank, 1)-1]
}

// get requests path, paying with the payment header when it is not empty, and wants 200.
func (env *benchEnv) get(path, payment string) error {
	req, err := http.NewRequest(http.MethodGet, env.url+path, nil)
	if err != nil {
		return err
	}
	if payment != "" {
		req.Header.Set(x402.HeaderPaymentSignature, payment)
	}
	return env.do(req, nil)
}

// verify posts a /verify body and wants 200 with isValid true.
func (env *benchEnv) verify(body []byte) error {
	req, err := http.NewRequest(http.MethodPost, env.url+"/facilitator/verify", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	return env.do(req, []byte(`"isValid":true`))
}

// do sends req and wants 200 and, when want is set, a body containing it.
func (env *benchEnv) do(req *http.Request, want []byte) error {
	resp, err := env.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", req.Method, req.URL.Path, err)
	}
	if resp.StatusCode != http.StatusOK || (want != nil && !bytes.Contains(body, want)) {
		return fmt.Errorf("%s %s = %d %q (PAYMENT-REQUIRED %q), want 200", req.Method, req.URL.Path, resp.StatusCode,
			body, resp.Header.Get(x402.HeaderPaymentRequired))
	}
	return nil
}

// offer asks path for its price unpaid and returns its permit2 requirement.
func (env *benchEnv) offer(b *testing.B, path string) x402.PaymentRequirements {
	b.Helper()
	resp, err := env.client.Get(env.url + path)
	if err != nil {
		b.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusPaymentRequired {
		b.Fatalf("unpaid GET %s = %d, want 402", path, resp.StatusCode)
	}
	pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		b.Fatalf("decoding the PAYMENT-REQUIRED of %s: %v", path, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
			return rq
		}
	}
	b.Fatalf("%s offers no permit2 requirement: %+v", path, pr.Accepts)
	return x402.PaymentRequirements{}
}

// signed returns n distinct permit2 payments of path's requirement, dated by chain time: the dev chain runs
// ahead of the wall clock under load.
func (env *benchEnv) signed(b *testing.B, path string, n int) []x402.PaymentPayload {
	b.Helper()
	head, err := env.eth.HeaderByNumber(context.Background(), nil)
	if err != nil {
		b.Fatalf("reading the dev chain's head: %v", err)
	}
	now := time.Unix(int64(head.Time), 0)
	out := make([]x402.PaymentPayload, n)
	for i := range out {
		// Each payment draws a random Permit2 nonce, so one payer signs any number of distinct payments.
		if out[i], err = chain.SignPermit2Payment(env.payer, env.offers[path], env.chainID, chain.Permit2Options{Now: now}); err != nil {
			b.Fatalf("signing a permit2 payment for %s: %v", path, err)
		}
	}
	return out
}

// payments returns n distinct payments for path as PAYMENT-SIGNATURE values.
func (env *benchEnv) payments(b *testing.B, path string, n int) []string {
	b.Helper()
	out := make([]string, n)
	for i, p := range env.signed(b, path, n) {
		out[i] = gateEncode(b, p)
	}
	return out
}

// verifyBodies returns n distinct valid POST /verify bodies.
func (env *benchEnv) verifyBodies(b *testing.B, n int) [][]byte {
	b.Helper()
	out := make([][]byte, n)
	for i, p := range env.signed(b, "/sync", n) {
		body, err := json.Marshal(x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: env.offers["/sync"]})
		if err != nil {
			b.Fatal(err)
		}
		out[i] = body
	}
	return out
}

// approvePermit2 has the payer approve Permit2 for every token it holds, in a mined transaction.
func (env *benchEnv) approvePermit2(b *testing.B) {
	b.Helper()
	ctx := context.Background()
	from := crypto.PubkeyToAddress(env.payer.PublicKey)
	maxUint := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	data, err := contracts.StableCoinABI.Pack("approve", contracts.Permit2Address, maxUint)
	if err != nil {
		b.Fatal(err)
	}
	nonce, err := env.eth.PendingNonceAt(ctx, from)
	if err != nil {
		b.Fatalf("reading the payer's nonce: %v", err)
	}
	head, err := env.eth.HeaderByNumber(ctx, nil)
	if err != nil {
		b.Fatalf("reading the dev chain's head: %v", err)
	}
	tip := big.NewInt(1e9)
	tx, err := types.SignNewTx(env.payer, types.LatestSignerForChainID(env.chainID), &types.DynamicFeeTx{
		ChainID: env.chainID, Nonce: nonce, GasTipCap: tip, GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip),
		Gas: 100_000, To: &env.token, Data: data,
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := env.eth.SendTransaction(ctx, tx); err != nil {
		b.Fatalf("sending the payer's Permit2 approval: %v", err)
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if r, err := env.eth.TransactionReceipt(ctx, tx.Hash()); err == nil {
			if r.Status != types.ReceiptStatusSuccessful {
				b.Fatalf("the payer's Permit2 approval %s reverted", tx.Hash())
			}
			return
		}
	}
	b.Fatalf("the payer's Permit2 approval %s was not mined in 30s", tx.Hash())
}

// balance is what seller holds of the token, in raw units.
func (env *benchEnv) balance(b *testing.B, seller string) *big.Int {
	b.Helper()
	data, err := contracts.StableCoinABI.Pack("balanceOf", common.HexToAddress(seller))
	if err != nil {
		b.Fatal(err)
	}
	out, err := env.eth.CallContract(context.Background(), ethereum.CallMsg{To: &env.token, Data: data}, nil)
	if err != nil {
		b.Fatalf("reading the balance of %s: %v", seller, err)
	}
	return new(big.Int).SetBytes(out)
}

// paidBalance is what a seller holds after n payments of path's price on top of before.
func (env *benchEnv) paidBalance(b *testing.B, path string, before *big.Int, n int) *big.Int {
	b.Helper()
	price, ok := new(big.Int).SetString(env.offers[path].Amount, 10)
	if !ok {
		b.Fatalf("%s offers the amount %q, want a number", path, env.offers[path].Amount)
	}
	return new(big.Int).Add(before, new(big.Int).Mul(price, big.NewInt(int64(n))))
}

// assertSettled fails unless seller holds exactly n more payments than before: a payment served unsettled,
// or settled twice, would make the figures a lie.
func (env *benchEnv) assertSettled(b *testing.B, path, seller string, before *big.Int, n int) {
	b.Helper()
	if got, want := env.balance(b, seller), env.paidBalance(b, path, before, n); got.Cmp(want) != 0 {
		b.Fatalf("after %d paid requests seller %s holds %s, want %s", n, seller, got, want)
	}
}

// waitBalance waits until seller holds n more payments than before and returns how long after start that was.
func (env *benchEnv) waitBalance(b *testing.B, path, seller string, before *big.Int, n int, start time.Time) time.Duration {
	b.Helper()
	want := env.paidBalance(b, path, before, n)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		got := env.balance(b, seller)
		switch c := got.Cmp(want); {
		case c == 0:
			return time.Since(start)
		case c > 0:
			b.Fatalf("after %d paid requests seller %s holds %s, more than the %s they paid", n, seller, got, want)
		case time.Now().After(deadline):
			b.Fatalf("after %d paid requests seller %s holds %s, want %s: background settlements did not finish in 2m", n, seller, got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
