package chain_test

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// crashChildEnv makes the test binary act as a facilitator process that the crash test kills.
const crashChildEnv = "X402_CRASH_CHILD"

type crashJob struct {
	RPC      string               `json:"rpc"`
	Network  string               `json:"network"`
	Token    string               `json:"token"`
	Keys     []string             `json:"keys"`
	Journal  string               `json:"journal"`
	Requests []x402.VerifyRequest `json:"requests"`
}

func TestSettlementSurvivesSIGKILLAtRandomPointsExactlyOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills child processes")
	}
	racepass.Once(t, "its 40 facilitator processes, each killed or run to the end, are what it checks; the engine's code in them runs under -race in the package's other tests")
	rounds, perRound := 20, 6
	// Settlements wait in the pool as they did on a slower chain, so that the kills land mid-settlement.
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithHTTP()}, pendingBlockPace: true})
	fx.approvePermit2(fx.c.Payers...)
	dir := t.TempDir()
	job := crashJob{RPC: fx.c.RPCURL, Network: fx.net, Token: fx.c.Token.Hex(), Journal: filepath.Join(dir, "journal.db")}
	for _, w := range fx.c.Wallets[:2] {
		job.Keys = append(job.Keys, hex.EncodeToString(crypto.FromECDSA(w.Key)))
	}
	r := rand.New(rand.NewPCG(7, 11))
	sellerBefore := fx.c.TokenBalance(fx.payTo)
	kills := 0
	for round := range rounds {
		job.Requests = nil
		for i := range perRound {
			payer := fx.c.Payers[i%len(fx.c.Payers)]
			if i == perRound-1 && round < len(fx.c.Payers) {
				// One erc2612 payment a round for the first rounds: two transactions to lose.
				job.Requests = append(job.Requests, fx.erc2612(fx.c.Payers[round], fx.requirements(x402.TransferERC2612), chain.ERC2612Options{}))
				continue
			}
			job.Requests = append(job.Requests, fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{}))
		}
		jobFile := filepath.Join(dir, fmt.Sprintf("job-%d.json", round))
		b, _ := json.Marshal(job)
		if err := os.WriteFile(jobFile, b, 0o600); err != nil {
			t.Fatal(err)
		}
		// First life: killed at a random moment of its work.
		killAfter := time.Duration(1+r.IntN(300)) * time.Millisecond
		if settled := runCrashChild(t, jobFile, killAfter); settled < perRound {
			kills++
			t.Logf("round %d: killed %v into settlement with %d of %d payments answered", round, killAfter, settled, perRound)
		}
		// Second life: reconciles the journal, then finishes what is left.
		if settled := runCrashChild(t, jobFile, 0); settled != perRound {
			t.Fatalf("round %d: the restarted facilitator settled %d of %d payments", round, settled, perRound)
		}
		want := big.NewInt(int64((round + 1) * perRound * price))
		if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(want) != 0 {
			t.Fatalf("after round %d (killed after %v) the seller received %s, want exactly %s", round, killAfter, got, want)
		}
	}
	if n := fx.c.CountTokenTransfers(zeroAddr, fx.payTo); n != rounds*perRound {
		t.Fatalf("%d transfers reached the seller, want %d", n, rounds*perRound)
	}
	t.Logf("%d rounds, %d killed before finishing, %d payments each settled exactly once", rounds, kills, rounds*perRound)
	if kills < rounds/2 {
		t.Fatalf("only %d of %d kills landed mid-settlement: the kill points do not exercise the crash paths", kills, rounds)
	}
}

// runCrashChild runs the test binary as a facilitator on jobFile. With killAfter > 0 it is SIGKILLed after that
// long (if still running). It returns how many payments the child reported settled.
func runCrashChild(t *testing.T, jobFile string, killAfter time.Duration) int {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChildProcess$", "-test.v")
	cmd.Env = append(os.Environ(), crashChildEnv+"="+jobFile)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var timer *time.Timer
	settled := 0
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		switch {
		case sc.Text() == "READY" && killAfter > 0:
			// The kill clock starts when the facilitator accepts work, so every kill lands in settlement.
			timer = time.AfterFunc(killAfter, func() { _ = cmd.Process.Signal(syscall.SIGKILL) })
		case strings.HasPrefix(sc.Text(), "SETTLED "):
			settled++
		}
	}
	err = cmd.Wait()
	if timer != nil {
		timer.Stop()
	}
	if killAfter == 0 && err != nil {
		t.Fatalf("the restarted facilitator failed: %v", err)
	}
	return settled
}

// TestCrashChildProcess is the facilitator process of the crash test; it does nothing in a normal run.
func TestCrashChildProcess(t *testing.T) {
	jobFile := os.Getenv(crashChildEnv)
	if jobFile == "" {
		t.Skip("run by the crash test only")
	}
	b, err := os.ReadFile(jobFile)
	if err != nil {
		t.Fatal(err)
	}
	var job crashJob
	if err := json.Unmarshal(b, &job); err != nil {
		t.Fatal(err)
	}
	client, err := ethclient.Dial(job.RPC)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := chain.ParsePrivateKeys(strings.Join(job.Keys, ","))
	if err != nil {
		t.Fatal(err)
	}
	store, err := journal.OpenBolt(job.Journal, journal.Options{OpenTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	f, err := chain.New(context.Background(), chain.Config{Journal: store, ReconcileEvery: 100 * time.Millisecond, ReconcileGrace: 200 * time.Millisecond,
		Networks: []chain.NetworkConfig{{Network: job.Network, Backend: client, Keys: keys, ReceiptTimeout: 2 * time.Second, ReceiptPoll: 2 * time.Millisecond,
			Assets: []chain.AssetConfig{{Address: common.HexToAddress(job.Token), Name: "Stable Coin", Version: "1", Decimals: 6}}}}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fmt.Println("READY")
	var wg sync.WaitGroup
	var mu sync.Mutex
	deadline := time.Now().Add(30 * time.Second)
	for i, req := range job.Requests {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, _ := settleUntilFinal(t, f, req, deadline)
			mu.Lock()
			defer mu.Unlock()
			if resp.Success {
				fmt.Printf("SETTLED %d %s\n", i, resp.Transaction)
			}
		}()
	}
	wg.Wait()
}

func TestStartUpReleasesItsOwnStaleClaimsAndLeavesOtherRecordsOfTheJournalAlone(t *testing.T) {
	store := journal.NewMemory(journal.Options{})
	fx := newFixture(t, fixtureOpts{journal: store})
	payer := fx.c.Payers[0]
	req := fx.payment(x402.TransferPermit2, payer)
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	a := req.PaymentPayload.Payload.Permit2Authorization
	ownID := journal.PaymentID(fx.net, x402.TransferPermit2, fx.c.Token.Hex(), a.From, a.Nonce)
	gateID := journal.PaymentID(fx.net, "gate/"+x402.TransferPermit2, fx.c.Token.Hex(), a.From, a.Nonce)
	ctx := context.Background()
	for _, id := range []journal.ID{ownID, gateID} {
		if _, _, err := store.Claim(ctx, journal.Record{ID: id, State: journal.StateClaimed, Network: fx.net, Request: body, Owner: "a process that died"}); err != nil {
			t.Fatal(err)
		}
	}
	// A second engine on the same journal starts, as after a restart.
	newReplica(t, fx, store)
	if _, ok, err := store.Get(ctx, ownID); err != nil || ok {
		t.Fatalf("the engine's stale claim is still there (%v): a payment that sent nothing could never be retried", err)
	}
	if _, ok, err := store.Get(ctx, gateID); err != nil || !ok {
		t.Fatalf("start-up removed a gate's record (%v): reconciliation must touch settlements only", err)
	}
}
