package caddymodule

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/bench"
	"github.com/x402-gateway/caddy-x402/x402"
)

// benchReport decodes what `bench --json` printed.
func benchReport(t *testing.T, stdout string) bench.Report {
	t.Helper()
	var r bench.Report
	if err := json.Unmarshal([]byte(stdout), &r); err != nil || r.Batch == nil {
		t.Fatalf("bench --json printed %q (%v), want a batch-settlement report", stdout, err)
	}
	return r
}

// A batch run's deposit is the offer's minDeposit when the caller's share costs less: what no voucher charges is
// left in the channel, said in the report, and --refund asks for it after the run, at the last cumulative amount.
func TestBenchRefundsWhatIsLeftInTheRunsChannelsOnlyOnRequest(t *testing.T) {
	key, _ := crypto.GenerateKey()
	keyHex := hexutil.Encode(crypto.FromECDSA(key))

	b, srv := newBatchRoute(t) // price 1000, minDeposit 4000
	stdout, stderr, err := runX402(t, "", "bench", "--key", keyHex, "-n", "3", "--json", srv.URL+"/report")
	if err != nil {
		t.Fatalf("bench: %v\n%s\n%s", err, stdout, stderr)
	}
	r := benchReport(t, stdout)
	if r.OK != 3 || r.Batch.Deposits != 1 || r.Batch.Vouchers != 2 || r.Batch.Refunds != 0 || r.Batch.Deposited != "4000" || r.Batch.Charged != "3000" || r.Batch.Left != "1000" {
		t.Errorf("ok %d, batch %+v; want 3 served, 1 deposit of 4000, 2 vouchers, 3000 charged, 1000 left, no refund", r.OK, *r.Batch)
	}
	if !strings.Contains(strings.Join(r.Notes, "\n"), "the channels hold 1000 that no accepted voucher charges: --refund asks for it") {
		t.Errorf("the report does not say what is left: %q", r.Notes)
	}
	if got := strings.Join(b.payloads, ","); got != "deposit@1000,voucher@2000,voucher@3000" {
		t.Errorf("the server got %s, want deposit@1000,voucher@2000,voucher@3000", got)
	}

	b, srv = newBatchRoute(t)
	stdout, stderr, err = runX402(t, "", "bench", "--key", keyHex, "-n", "3", "--refund", "--json", srv.URL+"/report")
	if err != nil {
		t.Fatalf("bench --refund: %v\n%s\n%s", err, stdout, stderr)
	}
	r = benchReport(t, stdout)
	if r.OK != 3 || r.Batch.Refunds != 1 || r.Batch.Refunded != "1000" || r.Batch.Left != "0" || len(r.Batch.RefundErrors) != 0 {
		t.Errorf("ok %d, batch %+v; want 3 served, one refund of 1000, nothing left", r.OK, *r.Batch)
	}
	if got := strings.Join(b.payloads, ","); got != "deposit@1000,voucher@2000,voucher@3000,refund@3000" {
		t.Errorf("the server got %s, want the run's payments and a refund at 3000", got)
	}
	if strings.Contains(stdout+stderr, strings.TrimPrefix(keyHex, "0x")) {
		t.Error("bench printed the payer's key")
	}

	// A --max below what the run's deposits need is refused before anything is signed.
	b, srv = newBatchRoute(t)
	_, _, err = runX402(t, "", "bench", "--key", keyHex, "-c", "2", "-n", "3", "--max", "7999", srv.URL+"/report")
	if err == nil || !strings.Contains(err.Error(), "--max 7999: the run's 3 requests at 1000 each, from 2 channels (one a caller), need deposits of 8000 in all") {
		t.Errorf("bench --max 7999 of a run needing 8000: %v; want it refused, saying why", err)
	}
	if len(b.payloads) != 0 {
		t.Errorf("the server got %v, want nothing", b.payloads)
	}
}

// A voucher refused in the middle of a run is a failed request, not the end of the run: the next request carries
// the voucher the channel's confirmed answers call for, and the server takes it.
func TestBenchGoesOnAfterAVoucherIsRefusedMidRun(t *testing.T) {
	key, _ := crypto.GenerateKey()
	keyHex := hexutil.Encode(crypto.FromECDSA(key))
	b, srv := newBatchRoute(t)
	refused := false
	b.refuse = func(turn int) string {
		if turn == 2 && !refused {
			refused = true
			return x402.ReasonBatchCumulativeAmountMismatch // with no channel state to resync from
		}
		return ""
	}
	stdout, stderr, err := runX402(t, "", "bench", "--key", keyHex, "-n", "6", "--max-failures", "1", "--json", srv.URL+"/report")
	if err != nil {
		t.Fatalf("bench: %v\n%s\n%s", err, stdout, stderr)
	}
	r := benchReport(t, stdout)
	if r.Requests != 6 || r.OK != 5 || len(r.Failures) != 1 || r.Failures[0].Status != 402 || r.Failures[0].Reason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Errorf("requests %d, ok %d, failures %+v; want 6, 5 and the one refusal", r.Requests, r.OK, r.Failures)
	}
	if r.Batch.Charged != "5000" || r.Batch.Deposited != "6000" || r.Batch.Left != "1000" {
		t.Errorf("batch %+v; want 5000 charged of a 6000 deposit, 1000 left", *r.Batch)
	}
	if got := strings.Join(b.payloads, ","); got != "deposit@1000,voucher@2000,voucher@3000,voucher@3000,voucher@4000,voucher@5000" {
		t.Errorf("the server got %s; want the refused voucher's amount sent again on the next request", got)
	}
}

// An interrupted run stops sending, waits for the answers in flight, and reports what it sent: every request
// sent served (none cut off after its voucher may have been charged), the rest of the deposit said to be left,
// and --refund asks for it. Before, an interrupt ended bench at once, with no report and the run's deposits
// left in channels of salts nobody printed.
func TestBenchInterruptedStopsSendingAndReportsAndRefundsWhatItSent(t *testing.T) {
	key, _ := crypto.GenerateKey()
	b, srv := newBatchRoute(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b.refuse = func(turn int) string {
		if turn == 4 {
			cancel() // the interrupt, while the fifth payment is in flight
		}
		return ""
	}
	var stdout, stderr bytes.Buffer
	err := bench.Run(ctx, bench.Options{URL: srv.URL + "/report", Key: key, Concurrency: 1, Requests: 20, HTTPMethod: http.MethodGet,
		Timeout: time.Minute, Refund: true, JSON: true}, &stdout, &stderr)
	if err != nil {
		t.Fatalf("bench interrupted: %v\n%s\n%s", err, stdout.String(), stderr.String())
	}
	r := benchReport(t, stdout.String())
	if r.Requests != 5 || r.OK != 5 || r.Failed != 0 {
		t.Errorf("requests %d, ok %d, failed %d; want 5 sent, the one in flight at the interrupt served too", r.Requests, r.OK, r.Failed)
	}
	if r.Batch.Deposits != 1 || r.Batch.Refunds != 1 || r.Batch.Deposited != "5000" || r.Batch.Charged != "5000" || r.Batch.Refunded != "15000" || r.Batch.Left != "0" {
		t.Errorf("batch %+v; want one deposit of 20000, 5000 charged, one refund of the 15000 left: the channel holds 5000", *r.Batch)
	}
	if !strings.Contains(strings.Join(r.Notes, "\n"), "interrupted: 5 of the 20 requests were sent") {
		t.Errorf("the report does not say the run was interrupted: %q", r.Notes)
	}
}
