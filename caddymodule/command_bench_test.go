package caddymodule_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// benchJSON is what `caddy x402 bench --json` prints.
type benchJSON struct {
	URL             string  `json:"url"`
	Paid            bool    `json:"paid"`
	Scheme          string  `json:"scheme"`
	Method          string  `json:"method"`
	Concurrency     int     `json:"concurrency"`
	Requests        int     `json:"requests"`
	OK              int     `json:"ok"`
	OKPerSecond     float64 `json:"ok_per_second"`
	DurationSeconds float64 `json:"duration_seconds"`
	LatencyMS       struct {
		P50, P90, P99, Max float64
	} `json:"latency_ms"`
	Failures []struct {
		Status int    `json:"status"`
		Reason string `json:"reason"`
		Count  int    `json:"count"`
	} `json:"failures"`
	SellerBefore  *string `json:"seller_before"`
	SellerAfter   *string `json:"seller_after"`
	SellerDelta   *string `json:"seller_delta"`
	ExpectedDelta *string `json:"expected_delta"`
	BalanceOK     *bool   `json:"balance_ok"`
	Failed        int     `json:"failed"`
	MaxFailures   int     `json:"max_failures"`
}

// runBench runs `caddy x402 bench args... --json` and decodes its JSON line; err is the command's result.
func runBench(t *testing.T, args ...string) (benchJSON, string, error) {
	t.Helper()
	stdout, stderr, err := caddymodule.RunX402("", append(append([]string{"bench"}, args...), "--json")...)
	var out benchJSON
	if stdout != "" {
		if jerr := json.Unmarshal([]byte(stdout), &out); jerr != nil || strings.Count(stdout, "\n") != 1 {
			t.Fatalf("bench --json printed %q, want one JSON object on one line (%v)\nstderr:\n%s", stdout, jerr, stderr)
		}
	}
	return out, stderr, err
}

func TestBenchRefusesFlagsThatMakeNoRunAndSaysWhy(t *testing.T) {
	notFound := httptest.NewServer(http.NotFoundHandler())
	defer notFound.Close()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-c", "0", "http://127.0.0.1:1/"}, "-c: expected at least 1"},
		{[]string{"-n", "0", "http://127.0.0.1:1/"}, "-n: expected 1 to"},
		{[]string{"-n", "2000000", "http://127.0.0.1:1/"}, "-n: expected 1 to"},
		{[]string{"-d", "-1s", "http://127.0.0.1:1/"}, "-d: expected a duration of 0"},
		{[]string{"--timeout", "0s", "http://127.0.0.1:1/"}, "--timeout: expected a positive duration"},
		{[]string{"--max-failures", "-1", "http://127.0.0.1:1/"}, "--max-failures: expected 0 or more"},
		{[]string{"--method", "erc2612", "http://127.0.0.1:1/"}, "--method erc2612 cannot be benchmarked: each EIP-2612 permit signs the token's nonces(payer)"},
		{[]string{"--method", "cash", "http://127.0.0.1:1/"}, `--method: expected permit2 or eip3009, got "cash"`},
		{[]string{"ftp://example.com/"}, "expected an http:// or https:// URL"},
		{[]string{notFound.URL + "/nothing"}, "answered 404 Not Found, neither 402 Payment Required nor 2xx: nothing to benchmark"},
	} {
		_, _, err := caddymodule.RunX402("", append([]string{"bench"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("bench %s: %v; want an error containing %q", strings.Join(c.args, " "), err, c.want)
		}
	}
}

// fakeSeller answers 402 with a permit2 offer of its network and token to payTo, and each paid request with what
// answer says for the request's turn (0, 1, ...), recording the payment headers it got. It settles nothing.
type fakeSeller struct {
	t        *testing.T
	offer    x402.PaymentRequired
	answer   func(turn int, w http.ResponseWriter)
	mu       sync.Mutex
	paid     []string
	probes   int
	srv      *httptest.Server
	resource string
}

func newFakeSeller(t *testing.T, token, payTo string, answer func(turn int, w http.ResponseWriter)) *fakeSeller {
	f := &fakeSeller{t: t, answer: answer}
	f.srv = httptest.NewServer(f)
	t.Cleanup(f.srv.Close)
	f.resource = f.srv.URL + "/report"
	f.offer = x402.PaymentRequired{X402Version: x402.Version2, Resource: x402.ResourceInfo{URL: f.resource},
		Accepts: []x402.PaymentRequirements{{Scheme: x402.SchemeExact, Network: x402.EIP155(devchain.DefaultChainID), Amount: "10000",
			Asset: token, PayTo: payTo, MaxTimeoutSeconds: 300,
			Extra: x402.Extra{Name: "Stable Coin", Version: "1", AssetTransferMethod: x402.TransferPermit2}}}}
	return f
}

func (f *fakeSeller) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := r.Header.Get(x402.HeaderPaymentSignature)
	f.mu.Lock()
	turn := len(f.paid)
	if h == "" {
		f.probes++
	} else {
		f.paid = append(f.paid, h)
	}
	f.mu.Unlock()
	if h == "" {
		v, err := x402.EncodeHeader(f.offer)
		if err != nil {
			f.t.Error(err)
		}
		w.Header().Set(x402.HeaderPaymentRequired, v)
		w.WriteHeader(http.StatusPaymentRequired)
		return
	}
	f.answer(turn, w)
}

func TestBenchSendsEachPaymentOnceAndGroupsFailuresByStatusAndX402Reason(t *testing.T) {
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	hexKey := common.Bytes2Hex(crypto.FromECDSA(key))
	var f *fakeSeller
	f = newFakeSeller(t, devchain.TokenAddress.Hex(), devchainSeller.Hex(), func(turn int, w http.ResponseWriter) {
		switch turn % 4 {
		case 0:
			fmt.Fprint(w, "paid")
		case 1:
			http.Error(w, "the upstream broke", http.StatusInternalServerError)
		case 2:
			// As the gate answers a payment that does not verify: the reason code, then a message of its own.
			pr := f.offer
			pr.Error = fmt.Sprintf("%s: signature %d is wrong", x402.ReasonInvalidSignature, turn)
			v, _ := x402.EncodeHeader(pr)
			w.Header().Set(x402.HeaderPaymentRequired, v)
			w.WriteHeader(http.StatusPaymentRequired)
		case 3:
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprint(w, `{"error":"the facilitator did not answer","outcome":"settle-unreachable","retry":"..."}`)
		}
	})

	// 15 of the 20 fail: a run allowed 15 failures passes, and the default of none fails after its report.
	stdout, stderr, err := caddymodule.RunX402("", "bench", "--key", hexKey, "-c", "4", "-n", "20", "--json", "--max-failures", "15", f.resource)
	if err != nil {
		t.Fatalf("bench: %v\nstderr:\n%s", err, stderr)
	}
	strictSeller := newFakeSeller(t, devchain.TokenAddress.Hex(), devchainSeller.Hex(), f.answer)
	strict, _, strictErr := runBench(t, "--key", hexKey, "-c", "4", "-n", "8", strictSeller.resource)
	if strictErr == nil || !strings.Contains(strictErr.Error(), "6 of 8 requests failed, more than --max-failures 0: FAILED") || strict.Failed != 6 || strict.MaxFailures != 0 {
		t.Errorf("bench with 6 of 8 failing and no --max-failures: %v, failed %d; want a non-zero exit saying 6 of 8 failed", strictErr, strict.Failed)
	}
	if strings.Contains(stdout+stderr, hexKey) {
		t.Fatal("bench printed the payer's key")
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal([]byte(stdout), &fields); err != nil {
		t.Fatalf("bench --json printed %q: %v", stdout, err)
	}
	for _, name := range []string{"requests", "ok", "ok_per_second", "latency_ms", "failures", "seller_before", "seller_after",
		"seller_delta", "expected_delta", "balance_ok", "duration_seconds", "concurrency", "url", "scheme", "method"} {
		if _, ok := fields[name]; !ok {
			t.Errorf("the JSON lacks %q: %s", name, stdout)
		}
	}
	var latency map[string]float64
	if err := json.Unmarshal(fields["latency_ms"], &latency); err != nil || len(latency) != 4 || latency["p50"] <= 0 || latency["max"] < latency["p99"] {
		t.Errorf("latency_ms %s, want p50, p90, p99 and max, positive and in order (%v)", fields["latency_ms"], err)
	}
	var out benchJSON
	if err := json.Unmarshal([]byte(stdout), &out); err != nil {
		t.Fatal(err)
	}
	if out.Requests != 20 || out.OK != 5 || out.Concurrency != 4 || out.Scheme != "exact" || out.Method != "permit2" || !out.Paid {
		t.Errorf("requests %d, ok %d, concurrency %d, scheme %q, method %q, paid %v; want 20, 5, 4, exact, permit2, true", out.Requests, out.OK, out.Concurrency, out.Scheme, out.Method, out.Paid)
	}
	got := map[string]int{}
	for _, fl := range out.Failures {
		got[fmt.Sprintf("%d %s", fl.Status, fl.Reason)] = fl.Count
	}
	want := map[string]int{"500 ": 5, "402 " + x402.ReasonInvalidSignature: 5, "502 settle-unreachable": 5}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("failures %v, want %v", got, want)
	}
	if out.ExpectedDelta == nil || *out.ExpectedDelta != "50000" || out.BalanceOK != nil || out.SellerDelta != nil {
		t.Errorf("expected_delta %v, balance_ok %v, seller_delta %v; want 50000 (5 x 10000) and, with no --rpc, no balance", out.ExpectedDelta, out.BalanceOK, out.SellerDelta)
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	if f.probes != 1 || len(f.paid) != 20 {
		t.Errorf("the seller got %d requests without payment and %d with; want 1 (the probe) and 20", f.probes, len(f.paid))
	}
	distinct := slices.Compact(slices.Sorted(slices.Values(f.paid)))
	if len(distinct) != 20 {
		t.Errorf("%d distinct payments in 20 requests, want each payment sent once", len(distinct))
	}
}

func TestBenchPrintsAReportForAPerson(t *testing.T) {
	free := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "free") }))
	defer free.Close()
	stdout, stderr, err := caddymodule.RunX402("", "bench", "-n", "10", "-c", "2", free.URL+"/")
	if err != nil {
		t.Fatalf("bench of a free URL without a key: %v\n%s", err, stderr)
	}
	for _, want := range []string{"GET " + free.URL + "/: free", "requests:    10 at concurrency 2", "ok (2xx):    10,", "latency ok:  p50 ", "failures:    none"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("the report lacks %q:\n%s", want, stdout)
		}
	}
	if !strings.Contains(stderr, "without asking for payment") {
		t.Errorf("stderr does not say the URL is free:\n%s", stderr)
	}
}

// cmdBench...Seller are the payees of the bench self-test's routes, fresh so that each route's takings are its own.
var (
	cmdBenchSyncSeller   = common.HexToAddress("0x5e11000000000000000000000000000000000001")
	cmdBenchAsyncSeller  = common.HexToAddress("0x5e11000000000000000000000000000000000002")
	cmdBenchBrokenSeller = common.HexToAddress("0x5e11000000000000000000000000000000000003")
	cmdBenchUnpaidSeller = common.HexToAddress("0x5e11000000000000000000000000000000000004")
	cmdBenchUptoSeller   = common.HexToAddress("0x5e11000000000000000000000000000000000005")
)

func TestBenchOnTheDevChainShowsTheSellerPaidExactlyForEachAnswerServed(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0", "--payers", "2")
	c := d.dial(t)
	// The upto route's upstream says each request used a quarter of the maximum.
	usedQuarter := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Settlement-Overrides", `{"amount":"2500"}`)
		fmt.Fprint(w, "paid a quarter")
	}))
	defer usedQuarter.Close()
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			rpc `+d.facts.RPC+`
		}
	}
}

{{ADDR}} {
	handle /sync {
		x402 $0.01 {
			pay_to `+cmdBenchSyncSeller.Hex()+`
		}
		respond "paid"
	}
	handle /async {
		x402 $0.01 {
			pay_to `+cmdBenchAsyncSeller.Hex()+`
			settle async
		}
		respond "paid"
	}
	handle /upto {
		x402 $0.01 {
			pay_to `+cmdBenchUptoSeller.Hex()+`
			scheme upto
		}
		reverse_proxy `+strings.TrimPrefix(usedQuarter.URL, "http://")+`
	}
	handle /broken {
		x402 $0.01 {
			pay_to `+cmdBenchBrokenSeller.Hex()+`
		}
		respond "the upstream broke" 500
	}
	respond "free"
}
`)
	price := big.NewInt(devchainPrice)
	twenty := new(big.Int).Mul(price, big.NewInt(20))

	bench := func(t *testing.T, path string, seller common.Address, wantDelta *big.Int) (benchJSON, string) {
		t.Helper()
		before := tokenBalanceAt(t, c, devchain.TokenAddress, seller)
		out, stderr, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-c", "4", "-n", "20", srv.URL+path)
		if err != nil {
			t.Fatalf("bench %s: %v\nstderr:\n%s", path, err, stderr)
		}
		if got := new(big.Int).Sub(tokenBalanceAt(t, c, devchain.TokenAddress, seller), before); got.Cmp(wantDelta) != 0 {
			t.Errorf("the chain says the seller of %s received %s, want %s", path, got, wantDelta)
		}
		if out.SellerDelta == nil || *out.SellerDelta != wantDelta.String() || out.ExpectedDelta == nil || *out.ExpectedDelta != wantDelta.String() ||
			out.BalanceOK == nil || !*out.BalanceOK {
			t.Errorf("bench %s says seller_delta %v, expected_delta %v, balance_ok %v; want %s, %s, true", path, deref(out.SellerDelta), deref(out.ExpectedDelta), out.BalanceOK, wantDelta, wantDelta)
		}
		return out, stderr
	}

	t.Run("a payer who has not approved Permit2 is told to, and nothing is sent", func(t *testing.T) {
		other := devchain.PayerKeyN(1)
		hexKey := common.Bytes2Hex(crypto.FromECDSA(other))
		before := tokenBalanceAt(t, c, devchain.TokenAddress, cmdBenchSyncSeller)
		stdout, stderr, err := caddymodule.RunX402("", "bench", "--key", hexKey, "--rpc", d.facts.RPC, "-n", "5", srv.URL+"/sync")
		if err == nil || !strings.Contains(err.Error(), "approve Permit2 for the token from the payer's account first") || !strings.Contains(err.Error(), "bench sends no transaction for you") {
			t.Errorf("bench as a payer without a Permit2 allowance: %v; want an error telling to approve Permit2", err)
		}
		if strings.Contains(stdout+stderr+fmt.Sprint(err), hexKey) {
			t.Error("bench printed the payer's key")
		}
		if a, _ := chain.CallTokenUint(context.Background(), c, devchain.TokenAddress, "allowance", crypto.PubkeyToAddress(other.PublicKey), contracts.Permit2Address); a == nil || a.Sign() != 0 {
			t.Errorf("the payer's Permit2 allowance is %v after the refusal, want 0: bench approved it without --dev", a)
		}
		if got := tokenBalanceAt(t, c, devchain.TokenAddress, cmdBenchSyncSeller); got.Cmp(before) != 0 {
			t.Errorf("the seller's balance moved from %s to %s, want nothing paid", before, got)
		}
	})
	t.Run("a sync route serves 20 of 20 and the seller receives 20 prices", func(t *testing.T) {
		out, stderr := bench(t, "/sync", cmdBenchSyncSeller, twenty)
		if !strings.Contains(stderr, "the dev chain's demo payer had approved Permit2") || !strings.Contains(stderr, "approved it for any amount (transaction 0x") {
			t.Errorf("bench --dev does not say it approved Permit2 for the demo payer:\n%s", stderr)
		}
		if out.Requests != 20 || out.OK != 20 || len(out.Failures) != 0 || out.OKPerSecond <= 0 {
			t.Errorf("requests %d, ok %d, failures %+v, ok/s %v; want 20, 20, none", out.Requests, out.OK, out.Failures, out.OKPerSecond)
		}
	})
	t.Run("a settle async route's seller receives 20 prices once its backlog drains", func(t *testing.T) {
		out, _ := bench(t, "/async", cmdBenchAsyncSeller, twenty)
		if out.Requests != 20 || out.OK != 20 || len(out.Failures) != 0 {
			t.Errorf("requests %d, ok %d, failures %+v; want 20, 20, none", out.Requests, out.OK, out.Failures)
		}
	})
	t.Run("an upto route's seller receives what each PAYMENT-RESPONSE charged", func(t *testing.T) {
		out, _ := bench(t, "/upto", cmdBenchUptoSeller, big.NewInt(20*2500))
		if out.Requests != 20 || out.OK != 20 || out.Scheme != "upto" || len(out.Failures) != 0 {
			t.Errorf("requests %d, ok %d, scheme %q, failures %+v; want 20, 20, upto, none", out.Requests, out.OK, out.Scheme, out.Failures)
		}
	})
	t.Run("a route whose upstream fails serves nothing, charges nothing, and fails the run", func(t *testing.T) {
		// As bench once printed "seller: +0, expected +0: OK" and exited 0 with 0 of 200 served: a run in which
		// every request failed exits non-zero, after its report.
		before := tokenBalanceAt(t, c, devchain.TokenAddress, cmdBenchBrokenSeller)
		out, stderr, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-c", "4", "-n", "20", srv.URL+"/broken")
		if err == nil || !strings.Contains(err.Error(), "20 of 20 requests failed, more than --max-failures 0: FAILED") {
			t.Errorf("bench of a route that served nothing: %v; want a non-zero exit saying 20 of 20 failed\n%s", err, stderr)
		}
		if out.Requests != 20 || out.OK != 0 || out.Failed != 20 || len(out.Failures) != 1 || out.Failures[0].Status != 500 || out.Failures[0].Count != 20 ||
			out.BalanceOK == nil || !*out.BalanceOK || deref(out.SellerDelta) != "0" {
			t.Errorf("requests %d, ok %d, failed %d, failures %+v, balance_ok %v, seller_delta %s; want 20, 0, 20, 500 x 20, true, 0",
				out.Requests, out.OK, out.Failed, out.Failures, out.BalanceOK, deref(out.SellerDelta))
		}
		if got := tokenBalanceAt(t, c, devchain.TokenAddress, cmdBenchBrokenSeller); got.Cmp(before) != 0 {
			t.Errorf("the seller of /broken received %s, want nothing", new(big.Int).Sub(got, before))
		}
		stdout, _, err := caddymodule.RunX402("", "bench", "--dev", "--rpc", d.facts.RPC, "-n", "3", srv.URL+"/broken")
		if err == nil || !strings.Contains(stdout, "result:      FAILED: 3 of 3 requests failed (--max-failures 0)") {
			t.Errorf("the report does not say the run failed (%v):\n%s", err, stdout)
		}
		if _, _, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-n", "3", "--max-failures", "3", srv.URL+"/broken"); err != nil {
			t.Errorf("bench --max-failures 3 of 3 failing: %v, want exit 0", err)
		}
	})
	t.Run("a free route is benchmarked without payment", func(t *testing.T) {
		out, stderr, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-c", "4", "-n", "20", srv.URL+"/free")
		if err != nil || out.Paid || out.Requests != 20 || out.OK != 20 || out.BalanceOK != nil {
			t.Errorf("bench /free: %v; paid %v, requests %d, ok %d, balance_ok %v; want no payment, 20 of 20, no balance\n%s", err, out.Paid, out.Requests, out.OK, out.BalanceOK, stderr)
		}
	})
	t.Run("answers served without settlement are a mismatch and fail the run", func(t *testing.T) {
		f := newFakeSeller(t, devchain.TokenAddress.Hex(), cmdBenchUnpaidSeller.Hex(), func(_ int, w http.ResponseWriter) { fmt.Fprint(w, "served, not paid") })
		out, stderr, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-c", "4", "-n", "20", "--settle-wait", "1s", f.resource)
		if err == nil || !strings.Contains(err.Error(), "MISMATCH") {
			t.Errorf("bench of a seller that settles nothing: %v; want an error saying MISMATCH\n%s", err, stderr)
		}
		if out.OK != 20 || out.BalanceOK == nil || *out.BalanceOK || deref(out.SellerDelta) != "0" || deref(out.ExpectedDelta) != twenty.String() {
			t.Errorf("ok %d, balance_ok %v, seller_delta %s, expected_delta %s; want 20, false, 0, %s", out.OK, out.BalanceOK, deref(out.SellerDelta), deref(out.ExpectedDelta), twenty)
		}
		stdout, _, _ := caddymodule.RunX402("", "bench", "--dev", "--rpc", d.facts.RPC, "-n", "2", "--settle-wait", "1s", f.resource)
		if !strings.Contains(stdout, "seller:      +0, expected +20000: MISMATCH") {
			t.Errorf("the report does not show the mismatch:\n%s", stdout)
		}
	})
}

func deref(s *string) string {
	if s == nil {
		return "<null>"
	}
	return *s
}

func TestBenchStopsSendingNewRequestsAfterD(t *testing.T) {
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(5 * time.Millisecond)
		fmt.Fprint(w, "free")
	}))
	defer slow.Close()
	out, stderr, err := runBench(t, "-c", "2", "-n", "100000", "-d", "200ms", slow.URL+"/")
	if err != nil {
		t.Fatalf("bench -d 200ms: %v\n%s", err, stderr)
	}
	if out.Requests == 0 || out.Requests > 200 || out.OK != out.Requests || out.DurationSeconds < 0.2 || out.DurationSeconds > 2 {
		t.Errorf("requests %d, ok %d in %.3f s; want some, about 200 ms' worth of 2 callers at 5 ms each, all ok", out.Requests, out.OK, out.DurationSeconds)
	}
}

// A run that mines more blocks than its payments are good for, on a dev chain sealing a block per transaction
// burst (a second of chain time a block), answers every request 2xx and pays the seller for each: bench signs its
// payments a window ahead of their requests, not all before the run, and the engine refuses none of them nor
// sends one that would be mined past its deadline. Before, every payment was signed before the clock started,
// valid maxTimeoutSeconds (here 60) of chain time from then: the later ones were refused
// permit2_deadline_expired, or settled as their deadline passed and reverted (invalid_exact_evm_transaction_failed).
func TestBenchKeepsEveryPaymentValidThroughARunLongerThanThePaymentsAreGoodFor(t *testing.T) {
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0", "--payers", "1")
	c := d.dial(t)
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			rpc `+d.facts.RPC+`
		}
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to `+cmdBenchSyncSeller.Hex()+`
		max_timeout 60s
	}
	respond "paid"
}
`)
	headTime := func() uint64 {
		h, err := c.HeaderByNumber(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return h.Time
	}
	const n = 400
	timeBefore := headTime()
	out, stderr, err := runBench(t, "--dev", "--rpc", d.facts.RPC, "-c", "8", "-n", fmt.Sprint(n), srv.URL+"/")
	if moved := headTime() - timeBefore; moved <= 60 {
		t.Fatalf("the run moved chain time %d s, not past the payments' 60 s: it shows nothing", moved)
	}
	if err != nil || out.OK != n || out.Requests != n {
		t.Fatalf("bench: %d of %d requests answered 2xx, failures %+v, %v; want all\nstderr:\n%s", out.OK, out.Requests, out.Failures, err, stderr)
	}
	if out.BalanceOK == nil || !*out.BalanceOK || out.SellerDelta == nil || *out.SellerDelta != big.NewInt(n*devchainPrice).String() {
		t.Errorf("seller_delta %v, balance_ok %v; want %d, true", deref(out.SellerDelta), out.BalanceOK, n*devchainPrice)
	}
}
