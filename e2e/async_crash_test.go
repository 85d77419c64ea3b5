package e2e

import (
	"context"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// asyncPrice is the gate's price in the crash test, in raw units of the 6-decimal dev token ($0.01).
const asyncPrice = 10000

// asyncSettleWait bounds how long a restarted gate may take to settle a payment its predecessor served.
const asyncSettleWait = 45 * time.Second

// TestAsyncSettlementSurvivesSIGKILLBetweenServingAndSettling serves payments with `settle async` and
// SIGKILLs the gate's Caddy right after the 200, at three points of the background settlement: as soon as
// the answer arrives, while the settlement transaction waits for the next block, and as it is mined. The
// chain runs in a separate Caddy process (blocks every second) that outlives the kills. After each restart
// on the same journal, the payment is settled exactly once (the payer paid the price once, one Transfer on
// chain) and presenting the same payment again is refused with payment_already_used, never served twice.
func TestAsyncSettlementSurvivesSIGKILLBetweenServingAndSettling(t *testing.T) {
	needBinary(t)
	dir := t.TempDir()

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	chainFile := writeFile(t, dir, "chain.Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 1s
		}
	}
}
`, strings.TrimPrefix(chainURL, "http://")))
	chainProc := startProcess(t, "the dev chain's Caddy", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", chainFile)
	dev := dialChain(t, chainURL)
	chainProc.waitUntil("the dev token minted to the demo payer", 60*time.Second, func() error {
		b, err := dev.tokenBalance(devchain.PayerAddress)
		if err == nil && b.Sign() == 0 {
			err = fmt.Errorf("the demo payer holds no token yet")
		}
		return err
	})

	var keys []string
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
	}
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateFile := writeFile(t, dir, "gate.Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		network eip155:%d {
			rpc %s
			asset %s
			wallet_keys %s
		}
		journal %s
	}
}

%s {
	bind 127.0.0.1
	x402 {
		price $0.01
		pay_to %s
		settle async
	}
	respond "paid"
}
`, devchain.DefaultChainID, chainURL, devchain.TokenAddress.Hex(), strings.Join(keys, ","), filepath.Join(dir, "journal.db"), gateURL, seller.Hex()))
	gateEnv := childEnv(t)
	startGate := func(name string) *process {
		p := startProcess(t, name, dir, gateEnv, "run", "--adapter", "caddyfile", "--config", gateFile)
		p.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
		return p
	}
	gate := startGate("the gate's Caddy")

	firstBlock := dev.head()
	payerStart, sellerStart := dev.balance(devchain.PayerAddress), dev.balance(seller)
	price := big.NewInt(asyncPrice)

	killPoints := []struct {
		name string
		// wait returns once it is time to kill, and says what it saw.
		wait func(sellerBefore *big.Int) string
	}{
		{"as soon as the 200 arrives", func(*big.Int) string { return "killed at once" }},
		{"while the settlement waits for the next block", func(sellerBefore *big.Int) string {
			return waitForPendingSettlement(t, dev, sellerBefore)
		}},
		{"as the settlement is mined", func(sellerBefore *big.Int) string {
			return waitForCredit(t, dev, sellerBefore)
		}},
	}
	var headers []string
	for i, kp := range killPoints {
		payerBefore, sellerBefore := dev.balance(devchain.PayerAddress), dev.balance(seller)

		header := signPayment(t, chainURL, gateURL+"/")
		paid, err := get(gateURL+"/", x402.HeaderPaymentSignature, header)
		if err != nil {
			t.Fatalf("payment %d: %v", i+1, err)
		}
		if paid.status != 200 || paid.body != "paid" {
			t.Fatalf("payment %d: status %d body %q, want 200 \"paid\"", i+1, paid.status, paid.body)
		}
		if s, err := x402.DecodeSettleResponse(paid.header.Get(x402.HeaderPaymentResponse)); err != nil || !s.Pending() {
			t.Errorf("payment %d: PAYMENT-RESPONSE %+v (%v), want settlement_pending: async answers before settling", i+1, s, err)
		}
		saw := kp.wait(sellerBefore)
		gate.kill()
		t.Logf("payment %d: SIGKILL %s (%s)", i+1, kp.name, saw)
		headers = append(headers, header)

		gate = startGate(fmt.Sprintf("the gate's Caddy, restart %d", i+1))
		// A kill that lands between the response going out and the gate recording it as delivered leaves the
		// payment good for one more response (the gate cannot know the first reached the client); never two.
		again, err := get(gateURL+"/", x402.HeaderPaymentSignature, header)
		if err != nil {
			t.Fatalf("payment %d after the restart: %v", i+1, err)
		}
		if again.status == 200 {
			t.Logf("payment %d: served once more after the restart (killed before its delivery was recorded)", i+1)
		}
		assertRefusedAgain(t, gateURL+"/", header, fmt.Sprintf("payment %d after the restart", i+1))
		credited := waitForBalance(dev, seller, new(big.Int).Add(sellerBefore, price), asyncSettleWait)
		if !credited {
			t.Fatalf("payment %d (killed %s): the seller was not paid within %s of the restart; balance %s, want %s",
				i+1, kp.name, asyncSettleWait, dev.balance(seller), new(big.Int).Add(sellerBefore, price))
		}
		if d := delta(payerBefore, dev.balance(devchain.PayerAddress)); d.Cmp(new(big.Int).Neg(price)) != 0 {
			t.Errorf("payment %d: the payer's balance moved by %s, want -%s", i+1, d, price)
		}
	}

	// Two more blocks: a second settlement of any payment would show by now.
	settledAt := dev.head()
	waitForBlock(t, dev, settledAt+2)
	total := new(big.Int).Mul(price, big.NewInt(int64(len(killPoints))))
	if d := delta(sellerStart, dev.balance(seller)); d.Cmp(total) != 0 {
		t.Errorf("the seller received %s in all, want exactly %s (%d payments of %s)", d, total, len(killPoints), price)
	}
	if d := delta(payerStart, dev.balance(devchain.PayerAddress)); d.Cmp(new(big.Int).Neg(total)) != 0 {
		t.Errorf("the payer paid %s in all, want exactly %s", new(big.Int).Neg(d), total)
	}
	logs := dev.transfers(devchain.PayerAddress, seller, firstBlock)
	txs := map[string]bool{}
	for _, l := range logs {
		txs[l.TxHash.Hex()] = true
		if transferAmount(l).Cmp(price) != 0 {
			t.Errorf("transfer in %s moved %s, want %s", l.TxHash, transferAmount(l), price)
		}
	}
	if len(logs) != len(killPoints) || len(txs) != len(killPoints) {
		t.Errorf("%d Transfer logs payer -> seller in %d transactions, want %d: one per payment", len(logs), len(txs), len(killPoints))
	}
	for i, h := range headers {
		assertRefusedAgain(t, gateURL+"/", h, fmt.Sprintf("payment %d at the end", i+1))
	}
	gate.stop()
	assertJournalSettled(t, filepath.Join(dir, "journal.db"), headers, txs)
	chainProc.stop()
}

// assertJournalSettled opens the journal the gates left and checks that nothing is pending and that each
// payment's gate record is final, settled by one of the transactions seen on chain.
func assertJournalSettled(t *testing.T, path string, headers []string, txs map[string]bool) {
	t.Helper()
	store, err := journal.OpenBolt(path, journal.Options{})
	if err != nil {
		t.Fatalf("opening the journal the gate left: %v", err)
	}
	defer store.Close()
	ctx, cancel := rpcContext()
	defer cancel()
	pending, err := store.Pending(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range pending {
		t.Errorf("the journal still holds payment %s in state %s (async %v): every payment should have settled", r.ID, r.State, r.Async)
	}
	for i, h := range headers {
		p, err := x402.DecodePaymentPayload(h)
		if err != nil || p.Payload.Permit2Authorization == nil {
			t.Fatalf("payment %d: the header does not decode to a permit2 payment: %v", i+1, err)
		}
		a := p.Payload.Permit2Authorization
		// The gate's record of a payment: the engine's id of the same payment with the method marked as the gate's.
		id := journal.PaymentID(p.Accepted.Network, "gate/"+x402.TransferPermit2, p.Accepted.Asset, a.From, a.Nonce)
		rec, found, err := store.Get(ctx, id)
		switch {
		case err != nil || !found:
			t.Errorf("payment %d: no gate record %s in the journal (%v)", i+1, id, err)
		case rec.State != journal.StateFinal || !rec.Async || !rec.Served || rec.Response == nil || !rec.Response.Success:
			t.Errorf("payment %d: gate record state %s async %v served %v response %+v; want final, async, served and settled",
				i+1, rec.State, rec.Async, rec.Served, rec.Response)
		case !txs[common.HexToHash(rec.Response.Transaction).Hex()]:
			t.Errorf("payment %d: settled by %s, which is none of the transfers seen on chain", i+1, rec.Response.Transaction)
		}
	}
}

// signPayment signs a payment for url as the dev chain's demo payer with the binary's own client, at the
// chain's time, and returns the PAYMENT-SIGNATURE value; nothing is sent.
func signPayment(t *testing.T, rpcURL, url string) string {
	t.Helper()
	r := runCommand(t, time.Minute, t.TempDir(), childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", rpcURL, "--sign-only", url)
	if r.code != 0 {
		t.Fatalf("caddy x402 pay --sign-only exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	return strings.TrimSpace(r.stdout)
}

// assertRefusedAgain presents a payment that bought its response again: it must be refused as used, with no
// second response.
func assertRefusedAgain(t *testing.T, url, header, when string) {
	t.Helper()
	again, err := get(url, x402.HeaderPaymentSignature, header)
	if err != nil {
		t.Fatalf("%s: %v", when, err)
	}
	if again.status != 402 {
		t.Fatalf("%s: presenting the same payment again answered %d %q; want 402 payment_already_used", when, again.status, again.body)
	}
	required, err := x402.DecodePaymentRequired(again.header.Get(x402.HeaderPaymentRequired))
	if err != nil || !strings.HasPrefix(required.Error, x402.ReasonPaymentAlreadyUsed) {
		t.Errorf("%s: presenting the same payment again: error %q (%v), want %s", when, required.Error, err, x402.ReasonPaymentAlreadyUsed)
	}
}

// waitForPendingSettlement waits until a settlement wallet has a transaction in the chain's pool (sent, not
// mined), or the seller was credited first.
func waitForPendingSettlement(t *testing.T, dev *devChain, sellerBefore *big.Int) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
			w := crypto.PubkeyToAddress(k.PublicKey)
			pending, err1 := dev.client.PendingNonceAt(ctx, w)
			mined, err2 := dev.client.NonceAt(ctx, w, nil)
			if err1 == nil && err2 == nil && pending > mined {
				return fmt.Sprintf("wallet %s had transaction %d in the pool", w, mined)
			}
		}
		if b, err := dev.tokenBalance(seller); err == nil && b.Cmp(sellerBefore) > 0 {
			return "the settlement was mined before it was seen in the pool"
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatal("no settlement transaction reached the chain within 10s of the 200")
	return ""
}

// waitForCredit waits until the seller's balance rose above sellerBefore: the settlement is mined.
func waitForCredit(t *testing.T, dev *devChain, sellerBefore *big.Int) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if b, err := dev.tokenBalance(seller); err == nil && b.Cmp(sellerBefore) > 0 {
			return fmt.Sprintf("the seller was credited in block %d", dev.head())
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatal("the settlement was not mined within 10s of the 200")
	return ""
}

// waitForBalance waits until holder's token balance is want, and reports whether it got there within timeout.
func waitForBalance(dev *devChain, holder common.Address, want *big.Int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if b, err := dev.tokenBalance(holder); err == nil && b.Cmp(want) == 0 {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// waitForBlock waits until the chain's head reaches block n.
func waitForBlock(t *testing.T, dev *devChain, n uint64) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for dev.head() < n {
		if time.Now().After(deadline) {
			t.Fatalf("the chain did not reach block %d within 15s (head %d)", n, dev.head())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// writeFile writes content to dir/name and returns the path.
func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
