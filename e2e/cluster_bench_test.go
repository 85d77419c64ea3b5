package e2e

import (
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

// clusterBenchEnv, set to a number of payments, runs TestClusterBenchmarkThreeOnPostgresAgainstOneOnBolt: a load
// run, not a test, so CI leaves it out.
const clusterBenchEnv = "X402_CLUSTER_BENCH"

// TestClusterBenchmarkThreeOnPostgresAgainstOneOnBolt measures, in one run on one dev chain, paid requests per
// second (each settled before it is served: one settlement per 200) of the three gateways on one PostgreSQL
// journal, twelve wallets shared by leases (four each), against one gateway on a bbolt journal with the same
// twelve wallets. The load comes from this test process over HTTP, spread round-robin over the three; each
// round signs $X402_CLUSTER_BENCH payments beforehand and sends them at concurrency $X402_CLUSTER_BENCH_C
// (default 24). Rounds alternate, cluster first, $X402_CLUSTER_BENCH_ROUNDS times (default 2), so the ratio
// is taken over the same minutes of a noisy machine.
func TestClusterBenchmarkThreeOnPostgresAgainstOneOnBolt(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv(clusterBenchEnv))
	if n <= 0 {
		t.Skipf("a load run: set %s to a number of payments per round", clusterBenchEnv)
	}
	workers := envInt(clusterBenchEnv+"_C", 24)
	rounds := envInt(clusterBenchEnv+"_ROUNDS", 2)
	c := startCluster(t, 6)
	threeGates := c.gates

	// The single gateway: a bbolt journal, the same twelve wallets. It starts once the cluster has stopped, and
	// stops before the cluster starts again, so that no wallet is settled from by two processes at once.
	port := freePort(t)
	single := &clusterGate{n: 9, name: "the single gateway", url: fmt.Sprintf("http://127.0.0.1:%d", port)}
	boltFile := writeFile(t, c.dir, "single.Caddyfile", c.caddyfile(filepath.Join(c.dir, "single-journal.db"), single.url))

	type result struct {
		what    string
		elapsed time.Duration
		ok      int
	}
	var results []result
	run := func(what string, pick func(int) int) {
		payments := c.signMany(n)
		before := c.balances()
		start := time.Now()
		var done atomic.Int64
		c.load(payments, workers, 0, pick, &done)
		elapsed := time.Since(start)
		ok := 0
		for _, p := range payments {
			if p.paid == 1 {
				ok++
			}
		}
		after := c.balances()
		if got := new(big.Int).Sub(after.seller, before.seller); got.Cmp(big.NewInt(int64(ok)*clusterPrice)) != 0 {
			t.Errorf("%s: the seller's balance moved by %s for %d paid answers, want %d", what, got, ok, int64(ok)*clusterPrice)
		}
		t.Logf("%s: %d of %d payments paid in %v at concurrency %d: %.0f settled and served/s; answers: %s", what, ok, n,
			elapsed.Round(10*time.Millisecond), workers, float64(ok)/elapsed.Seconds(), describeCounts(countAnswers(payments, nil)))
		results = append(results, result{what, elapsed, ok})
	}
	for round := range rounds {
		if round > 0 {
			c.gates = threeGates
			for _, g := range c.gates {
				g.proc = startProcess(t, g.name, c.dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", filepath.Join(c.dir, fmt.Sprintf("gateway%d.Caddyfile", g.n)))
			}
			for _, g := range c.gates {
				g.proc.waitUntil("a 402 from the gateway", 90*time.Second, answersWith(g.url+"/", 402))
			}
			c.waitLeases("the wallets shared out by the three gateways", 60*time.Second, clusterGateways)
		}
		run(fmt.Sprintf("round %d, three gateways, PostgreSQL journal, 4 leased wallets each", round+1), roundRobin)
		// The same journal with one gateway left: what PostgreSQL costs apart from three processes on the cores.
		for _, g := range c.gates[1:] {
			g.proc.stop()
		}
		c.gates = c.gates[:1]
		c.waitLeases("the wallets held by the gateway left", 60*time.Second, 1)
		run(fmt.Sprintf("round %d, one gateway, PostgreSQL journal, 12 leased wallets", round+1), func(int) int { return 0 })
		c.gates[0].proc.stop()

		single.proc = startProcess(t, single.name, c.dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", boltFile)
		single.proc.waitUntil("a 402 from the gateway", 90*time.Second, answersWith(single.url+"/", 402))
		c.gates = []*clusterGate{single}
		run(fmt.Sprintf("round %d, one gateway, bbolt journal, 12 wallets", round+1), func(int) int { return 0 })
		single.proc.stop()
	}
	rate := func(r result) float64 { return float64(r.ok) / r.elapsed.Seconds() }
	for i := 0; i+2 < len(results); i += 3 {
		three, onePG, oneBolt := results[i], results[i+1], results[i+2]
		t.Logf("round %d: three on PostgreSQL %.0f/s, one on PostgreSQL %.0f/s, one on bbolt %.0f/s: three/bbolt %.2f, one PostgreSQL/bbolt %.2f",
			i/3+1, rate(three), rate(onePG), rate(oneBolt), rate(three)/rate(oneBolt), rate(onePG)/rate(oneBolt))
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
