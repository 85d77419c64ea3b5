package devchain

import (
	"bufio"
	"context"
	"fmt"
	"math/big"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/rawdb"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/ethdb/pebble"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
)

// devCrashChildEnv makes the test binary act as a dev chain process that the crash test kills; its value is
// the data dir.
const devCrashChildEnv = "X402_DEVCHAIN_CRASH_DATADIR"

// devCrashBlocks is how many blocks the killed dev chain must have sealed and reported before the kill.
const devCrashBlocks = 50

var (
	devCrashTokenRecipient = common.HexToAddress("0xc0ffee0001")
	devCrashEthRecipient   = common.HexToAddress("0xc0ffee0002")
)

// devCrashReport is what the child says after each block it sealed: the head and the balances it expects
// there, which it checked against the chain before saying so.
type devCrashReport struct {
	head                         uint64
	recipientTokens, payerTokens *big.Int
	recipientWei                 *big.Int
}

func (r devCrashReport) String() string {
	return fmt.Sprintf("sealed %d %s %s %s", r.head, r.recipientTokens, r.payerTokens, r.recipientWei)
}

func parseDevCrashReport(line string) (devCrashReport, bool) {
	var r devCrashReport
	var tokens, payer, wei string
	if _, err := fmt.Sscanf(line, "sealed %d %s %s %s", &r.head, &tokens, &payer, &wei); err != nil {
		return r, false
	}
	var ok1, ok2, ok3 bool
	r.recipientTokens, ok1 = new(big.Int).SetString(tokens, 10)
	r.payerTokens, ok2 = new(big.Int).SetString(payer, 10)
	r.recipientWei, ok3 = new(big.Int).SetString(wei, 10)
	return r, ok1 && ok2 && ok3
}

func TestDevChainOnADataDirKeepsEverySealedBlockThroughASIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills a child process")
	}
	racepass.Once(t, "a child process SIGKILLed and a data dir reopened: what it checks is the database on disk")
	dir := t.TempDir()
	last := devRunCrashChild(t, dir)
	if last.head < devCrashBlocks {
		t.Fatalf("the child reported head %d before it was killed, want at least %d", last.head, devCrashBlocks)
	}

	start := time.Now()
	d := devStart(t, Config{Listen: "127.0.0.1:0", DataDir: dir})
	t.Logf("restarted on the data dir in %s", time.Since(start))
	client := d.Client()
	ctx := devContext(t)
	head := devBlockNumber(t, client)
	if head < last.head {
		t.Fatalf("restarted at block %d after a SIGKILL, want at least %d, the last block the killed chain sealed and reported", head, last.head)
	}
	at := new(big.Int).SetUint64(last.head)
	got := devCrashReport{head: last.head,
		recipientTokens: devTokenBalanceAt(t, client, devCrashTokenRecipient, at),
		payerTokens:     devTokenBalanceAt(t, client, PayerAddress, at),
	}
	var err error
	if got.recipientWei, err = client.BalanceAt(ctx, devCrashEthRecipient, at); err != nil {
		t.Fatalf("reading the ETH recipient's balance at block %d: %v", last.head, err)
	}
	if got.String() != last.String() {
		t.Fatalf("after restart, block %d holds %q, the killed chain reported %q", last.head, got, last)
	}
	// The child may have sealed one more block after its last report; nothing may have gone backwards.
	if now := devTokenBalanceAt(t, client, devCrashTokenRecipient, nil); now.Cmp(last.recipientTokens) < 0 {
		t.Errorf("the token recipient holds %s at the head, less than the %s reported at block %d", now, last.recipientTokens, last.head)
	}
	// And it goes on from there.
	receipt := devWaitMined(t, client, devSendTransfer(t, client, d.Payer(), devCrashTokenRecipient, big.NewInt(1), 0).Hash())
	if receipt.BlockNumber.Uint64() != head+1 {
		t.Errorf("the first transfer after the restart landed in block %d, want %d", receipt.BlockNumber, head+1)
	}
	t.Logf("killed at reported head %d, restarted at head %d with the reported balances", last.head, head)
}

// devRunCrashChild runs a dev chain on dir in a child process, SIGKILLs it once it reported sealing block
// devCrashBlocks, and returns its last report.
func devRunCrashChild(t *testing.T, dir string) devCrashReport {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestDevChainHelperProcessSealsUntilKilled$")
	cmd.Env = append(os.Environ(), devCrashChildEnv+"="+dir)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var last devCrashReport
	var other []string
	var kill *time.Timer
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		r, ok := parseDevCrashReport(sc.Text())
		if !ok {
			other = append(other, sc.Text())
			continue
		}
		last = r
		if r.head >= devCrashBlocks && kill == nil {
			// No clean shutdown: whatever the chain keeps in memory dies with it. The child goes on sealing
			// until then, so the kill lands anywhere in sending, sealing or reporting the next transfers.
			kill = time.AfterFunc(time.Duration(rand.IntN(30))*time.Millisecond, func() { _ = cmd.Process.Kill() })
		}
	}
	_ = cmd.Wait()
	if kill == nil {
		t.Fatalf("the child stopped after reporting head %d, before it was killed; it printed %q", last.head, other)
	}
	if last.head == 0 {
		t.Fatalf("the child reported no sealed block; it printed %q", other)
	}
	return last
}

// TestDevChainHelperProcessSealsUntilKilled is not a test: run by
// TestDevChainOnADataDirKeepsEverySealedBlockThroughASIGKILL in a child process, it starts a dev chain on a data
// dir and seals a block per transfer, alternating tokens and ETH, reporting each block and the balances
// after it until it is killed.
func TestDevChainHelperProcessSealsUntilKilled(t *testing.T) {
	dir := os.Getenv(devCrashChildEnv)
	if dir == "" {
		t.Skip("helper process for TestDevChainOnADataDirKeepsEverySealedBlockThroughASIGKILL")
	}
	fail := func(format string, args ...any) {
		fmt.Printf("error "+format+"\n", args...)
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a parent that died leaves no orphan
	defer cancel()
	d, err := Start(ctx, Config{Listen: "127.0.0.1:0", DataDir: dir})
	if err != nil {
		fail("starting: %v", err)
	}
	client := d.Client()
	chainID := new(big.Int).SetUint64(d.ChainID())
	signer := types.LatestSignerForChainID(chainID)
	nonce, err := client.PendingNonceAt(ctx, PayerAddress)
	if err != nil {
		fail("payer nonce: %v", err)
	}
	want := devCrashReport{recipientTokens: new(big.Int), payerTokens: big.NewInt(mintPerPayer), recipientWei: new(big.Int)}
	tokenStep, weiStep := big.NewInt(1_000), big.NewInt(1_000_000_007)
	for i := 0; ; i++ {
		head, err := client.HeaderByNumber(ctx, nil)
		if err != nil {
			fail("head: %v", err)
		}
		tip := big.NewInt(1e9)
		inner := &types.DynamicFeeTx{ChainID: chainID, Nonce: nonce, GasTipCap: tip,
			GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)}
		if i%2 == 0 {
			data, err := contracts.StableCoinABI.Pack("transfer", devCrashTokenRecipient, tokenStep)
			if err != nil {
				fail("encoding the transfer: %v", err)
			}
			inner.To, inner.Gas, inner.Data = &TokenAddress, 100_000, data
			want.recipientTokens.Add(want.recipientTokens, tokenStep)
			want.payerTokens.Sub(want.payerTokens, tokenStep)
		} else {
			inner.To, inner.Gas, inner.Value = &devCrashEthRecipient, 21_000, weiStep
			want.recipientWei.Add(want.recipientWei, weiStep)
		}
		tx, err := types.SignNewTx(d.Payer(), signer, inner)
		if err != nil {
			fail("signing: %v", err)
		}
		if err := client.SendTransaction(ctx, tx); err != nil {
			fail("sending: %v", err)
		}
		nonce++
		receipt, err := d.waitReceipt(ctx, tx.Hash())
		if err != nil || receipt.Status != types.ReceiptStatusSuccessful {
			fail("transfer %d: receipt %v, %v", i, receipt, err)
		}
		want.head = receipt.BlockNumber.Uint64()
		got, err := devCrashBalances(ctx, client, receipt.BlockNumber)
		if err != nil {
			fail("reading balances at block %d: %v", want.head, err)
		}
		got.head = want.head
		if got.String() != want.String() {
			fail("block %d holds %q, want %q", want.head, got, want)
		}
		fmt.Println(want)
	}
}

// devCrashBalances reads the balances the crash test follows at block.
func devCrashBalances(ctx context.Context, client *ethclient.Client, block *big.Int) (devCrashReport, error) {
	var r devCrashReport
	var err error
	if r.recipientTokens, err = tokenBalanceAt(ctx, client, devCrashTokenRecipient, block); err != nil {
		return r, err
	}
	if r.payerTokens, err = tokenBalanceAt(ctx, client, PayerAddress, block); err != nil {
		return r, err
	}
	r.recipientWei, err = client.BalanceAt(ctx, devCrashEthRecipient, block)
	return r, err
}

func devTokenBalanceAt(t *testing.T, client *ethclient.Client, holder common.Address, block *big.Int) *big.Int {
	t.Helper()
	bal, err := tokenBalanceAt(devContext(t), client, holder, block)
	if err != nil {
		t.Fatalf("reading the token balance of %s at block %v: %v", holder, block, err)
	}
	return bal
}

// tokenBalanceAt reads the dev token balance of holder at block (nil: the head).
func tokenBalanceAt(ctx context.Context, client *ethclient.Client, holder common.Address, block *big.Int) (*big.Int, error) {
	data, err := contracts.StableCoinABI.Pack("balanceOf", holder)
	if err != nil {
		return nil, err
	}
	out, err := client.CallContract(ctx, ethereum.CallMsg{To: &TokenAddress, Data: data}, block)
	if err != nil {
		return nil, err
	}
	return new(big.Int).SetBytes(out), nil
}

func TestDevChainOnADataDirOfAnEarlierVersionKeepsItsPebbleDatabaseAndWarnsThatACrashLosesBlocks(t *testing.T) {
	dir := t.TempDir()
	// Earlier versions created the chain database with go-ethereum's default, Pebble.
	db, err := pebble.New(filepath.Join(dir, "x402-devchain", "chaindata"), 16, 16, "", false)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	obs, logs := observer.New(zapcore.WarnLevel)
	d := devStart(t, Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: zap.New(obs)})
	client := d.Client()
	devWaitMined(t, client, devSendTransfer(t, client, d.Payer(), devCrashTokenRecipient, big.NewInt(5), 0).Hash())
	if got := devTokenBalanceAt(t, client, devCrashTokenRecipient, nil); got.Int64() != 5 {
		t.Errorf("recipient holds %s, want 5", got)
	}
	if n := logs.FilterMessageSnippet("start on an empty data dir to keep every sealed block").Len(); n != 1 {
		t.Errorf("%d warnings that a crash loses blocks, want 1; logs: %v", n, logs.All())
	}
	if kind := rawdb.PreexistingDatabase(filepath.Join(dir, "x402-devchain", "chaindata")); kind != rawdb.DBPebble {
		t.Errorf("the data dir holds a %q database now, want the pebble one it had", kind)
	}
}
