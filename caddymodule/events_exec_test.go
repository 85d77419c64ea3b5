package caddymodule_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// x402_exec, subscribed to payment_settled, runs its command once per sale with the event's placeholders as
// arguments (one argument each, whatever they hold), after the paid request was answered; a payment refused
// when presented again runs nothing.
func TestX402ExecRunsItsCommandForEachSettledPayment(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	dir := t.TempDir()
	sales := filepath.Join(dir, "sales")
	script := filepath.Join(dir, "notify-sale.sh")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nprintf '%s|' \"$@\" >> \""+sales+"\"\necho >> \""+sales+"\"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	events := fmt.Sprintf("{\n\tevents {\n\t\ton payment_settled x402_exec %s {event.name} {event.data.payer} {event.data.amount} {event.data.transaction} \"two words\"\n\t}\n", script)
	env.srv = startCaddy(t, strings.Replace(env.caddyfile(gateSetup{}), "{\n", events, 1))

	payer := c.Payers[0]
	env.approvePermit2(payer)
	header := env.permit2Header("/", payer)
	a := env.get("/", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK {
		t.Fatalf("paid GET = %d %q, want 200", a.status, a.body)
	}
	tx := settleResponse(t, a).Transaction
	want := fmt.Sprintf("payment_settled|%s|10000|%s|two words|\n", payer.Address.Hex(), tx)
	deadline := time.Now().Add(10 * time.Second)
	var got []byte
	for time.Now().Before(deadline) {
		// The script writes its line in two writes (the arguments, then the newline): read until the line ends.
		if got, _ = os.ReadFile(sales); len(got) > 0 && got[len(got)-1] == '\n' {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.EqualFold(string(got), want) {
		t.Fatalf("the command was run with %q, want %q", got, want)
	}

	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status == http.StatusOK {
		t.Fatalf("the same payment presented again was served: %d", a.status)
	}
	time.Sleep(200 * time.Millisecond)
	if again, _ := os.ReadFile(sales); string(again) != string(got) {
		t.Errorf("a refused payment ran the command: the file holds %q", again)
	}
}
