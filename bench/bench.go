// Package bench is the load tester of `caddy x402 bench`, without Caddy: it requests a URL once, signs as many
// distinct payments as the run sends when it answers 402, sends them at a concurrency over kept-alive
// connections, and checks on chain that the seller was paid for what was served. caddymodule parses the flags.
package bench

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/ethereum/go-ethereum/common"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
	"io"
	"math"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// MaxRequests bounds -n.
	MaxRequests = 1_000_000
	// minSignWindow and maxSignWindow bound how many signed payments wait for their requests (see signWindow).
	minSignWindow, maxSignWindow = 16, 512
	// settleStable is how long the seller's balance must stay the same, short of what was expected, before
	// the wait for settlement gives up early.
	settleStable = 5 * time.Second
	// settlePoll is how often the seller's balance is read while settlements land.
	settlePoll = 200 * time.Millisecond
	// maxFirstBody caps how much of the first (unpaid) answer's body is read: a 402's offers.
	maxFirstBody = 32 << 20
	// maxFailureBody caps how much of a failed answer's body is read for its reason.
	maxFailureBody = 64 << 10
)

// Options is what a run is asked to do: the flags of `caddy x402 bench`.
type Options struct {
	// URL is the resource to benchmark.
	URL string
	// Key is the payer's private key; nil when none was given, which only a paid URL needs.
	Key *ecdsa.PrivateKey
	// KeyErr says why Key is nil.
	KeyErr error
	// Dev lets the dev chain's demo payer approve Permit2 when its allowance is short.
	Dev bool
	// RPC is a JSON-RPC URL of the chain the payments settle on; "" when none was given.
	RPC string
	// Concurrency is how many requests are in flight at once.
	Concurrency int
	// Requests is how many requests are sent (at most, with Duration).
	Requests int
	// Duration, when positive, stops sending new requests after it.
	Duration time.Duration
	// Method is the asset transfer method to pay by; "" picks one.
	Method string
	// HTTPMethod is the method of every request.
	HTTPMethod string
	// Timeout bounds one request, its body included.
	Timeout time.Duration
	// SettleWait bounds the wait for the seller's balance after the run.
	SettleWait time.Duration
	// JSON prints the report as one JSON object.
	JSON bool
	// MaxFailures is how many requests may fail (no 2xx answer) before the run fails.
	MaxFailures int
	// Max bounds what a batch-settlement run deposits in all; nil is the run's cost (-n times the price).
	Max *big.Int
	// Refund asks, after a batch-settlement run, for what its channels hold that no accepted voucher charges.
	Refund bool
}

// check says what is wrong with the options, before anything is sent.
func (o Options) check() (*url.URL, error) {
	switch {
	case o.Concurrency < 1:
		return nil, fmt.Errorf("-c: expected at least 1 request in flight, got %d", o.Concurrency)
	case o.Requests < 1 || o.Requests > MaxRequests:
		return nil, fmt.Errorf("-n: expected 1 to %d requests, got %d", MaxRequests, o.Requests)
	case o.Duration < 0:
		return nil, fmt.Errorf("-d: expected a duration of 0 (no bound) or more, got %s", o.Duration)
	case o.Timeout <= 0:
		return nil, fmt.Errorf("--timeout: expected a positive duration, got %s", o.Timeout)
	case o.SettleWait < 0:
		return nil, fmt.Errorf("--settle-wait: expected a duration of 0 or more, got %s", o.SettleWait)
	case o.MaxFailures < 0:
		return nil, fmt.Errorf("--max-failures: expected 0 or more failed requests, got %d", o.MaxFailures)
	case o.Max != nil && o.Max.Sign() <= 0:
		return nil, fmt.Errorf("--max: expected a positive amount in raw token units, got %s", o.Max)
	}
	switch o.Method {
	case "", x402.TransferPermit2, x402.TransferEIP3009:
	case x402.TransferERC2612:
		return nil, errors.New("--method erc2612 cannot be benchmarked: each EIP-2612 permit signs the token's nonces(payer), which rises by one as each payment settles, so payments cannot be signed ahead or sent at once; use permit2 or eip3009")
	default:
		return nil, fmt.Errorf("--method: expected %s or %s, got %q", x402.TransferPermit2, x402.TransferEIP3009, o.Method)
	}
	if o.HTTPMethod == "" || strings.ContainsAny(o.HTTPMethod, " \t\r\n") {
		return nil, fmt.Errorf("--http-method: expected an HTTP method such as GET, got %q", o.HTTPMethod)
	}
	target, err := url.Parse(o.URL)
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return nil, fmt.Errorf("expected an http:// or https:// URL to benchmark, got %q", o.URL)
	}
	return target, nil
}

// client is one HTTP/1.1 client whose connections stay open between the requests of c callers, and that
// follows no redirect (a 3xx is an answer, and a payment goes only where it was asked for).
func client(c int, timeout time.Duration) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 2 * c
	tr.MaxIdleConnsPerHost = 2 * c
	tr.DisableCompression = true
	tr.ForceAttemptHTTP2 = false
	tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	return &http.Client{Transport: tr, Timeout: timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// Latency is a latency summary in milliseconds.
type Latency struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// Failure is one kind of answer that was not 2xx: its HTTP status (0 when there was no answer) and the
// x402 reason it gave, with how many requests got it.
type Failure struct {
	Status int    `json:"status"`
	Reason string `json:"reason"`
	Count  int    `json:"count"`
}

// Report is what `caddy x402 bench` measured, as --json prints it. Token amounts are raw units in
// decimal strings (as x402 writes amounts), null where they were not read.
type Report struct {
	URL             string    `json:"url"`
	HTTPMethod      string    `json:"http_method"`
	Paid            bool      `json:"paid"`
	Scheme          string    `json:"scheme"`
	Method          string    `json:"method"`
	Network         string    `json:"network,omitempty"`
	Asset           string    `json:"asset,omitempty"`
	PayTo           string    `json:"pay_to,omitempty"`
	Amount          string    `json:"amount,omitempty"`
	Concurrency     int       `json:"concurrency"`
	Requests        int       `json:"requests"`
	OK              int       `json:"ok"`
	OKPerSecond     float64   `json:"ok_per_second"`
	DurationSeconds float64   `json:"duration_seconds"`
	LatencyMS       Latency   `json:"latency_ms"`
	LatencyAllMS    Latency   `json:"latency_all_ms"`
	Failures        []Failure `json:"failures"`
	Failed          int       `json:"failed"`
	MaxFailures     int       `json:"max_failures"`
	SellerBefore    *string   `json:"seller_before"`
	SellerAfter     *string   `json:"seller_after"`
	SellerDelta     *string   `json:"seller_delta"`
	ExpectedDelta   *string   `json:"expected_delta"`
	BalanceOK       *bool     `json:"balance_ok"`
	// Batch is what a batch-settlement run sent, and its channels; absent for other runs.
	Batch *BatchReport `json:"batch,omitempty"`
	Notes []string     `json:"notes,omitempty"`
}

// tally is what the callers gathered, each its own until they are merged.
type tally struct {
	okLatency, allLatency []time.Duration
	failures              map[Failure]int // Count unused in the key
	ok                    int
	expected              *big.Int // what the paid answers should have moved to the seller
	uncertain             *big.Int // what answers that may have settled (settle-unreachable) would add
	uncertainCount        int
	atMax                 int // upto answers that named no amount, counted at the maximum
	paidNon2xx            int // non-2xx answers whose PAYMENT-RESPONSE says they were paid
}

func newTally(capacity int) *tally {
	return &tally{okLatency: make([]time.Duration, 0, capacity), allLatency: make([]time.Duration, 0, capacity),
		failures: map[Failure]int{}, expected: new(big.Int), uncertain: new(big.Int)}
}

func (t *tally) merge(o *tally) {
	t.okLatency = append(t.okLatency, o.okLatency...)
	t.allLatency = append(t.allLatency, o.allLatency...)
	for k, n := range o.failures {
		t.failures[k] += n
	}
	t.ok += o.ok
	t.expected.Add(t.expected, o.expected)
	t.uncertain.Add(t.uncertain, o.uncertain)
	t.uncertainCount += o.uncertainCount
	t.atMax += o.atMax
	t.paidNon2xx += o.paidNon2xx
}

// paidRun is the paid side of a run: the requirement paid, and its payments as they are signed.
//
// A payment is valid for the offer's maxTimeoutSeconds (at most payer.DefaultMaxValidity) of chain time from its
// signing, and a dev chain that seals a block per transaction burst moves its clock a second a block, hundreds of
// seconds a wall second under load: payments all signed before a long run expired during it, the last ones
// refused or, settled at their deadline, reverted. So only the first window is signed before the clock starts,
// and the rest by a goroutine of their own as the requests take them, a chunk at a time, each chunk dated by the
// chain's head when it is signed; at most a window of signed payments waits (see signWindow).
type paidRun struct {
	req    x402.PaymentRequirements
	amount *big.Int
	header string
	values chan string // the payments' header values, each sent once; closed when all are signed or signing stopped
	// err is why signing stopped short of the run's payments; read once values is closed.
	err error
	// signing is how long the signing during the run took, in all (its chunks, one after another).
	signing time.Duration
	stop    context.CancelFunc // stops the signing once the run ends
	done    chan struct{}      // closed when the signing goroutine returned
}

// signWindow is how many signed payments may wait for their requests at concurrency c, of payments valid for
// validity: enough that the callers seldom wait for a signature (a chunk is a quarter of it), few enough that on a
// chain sealing a block per transaction, a second each, a payment waits a quarter of its validity at most behind
// the others (the rest is for the requests in flight and the engine's margin).
func signWindow(c int, validity time.Duration) int {
	return max(min(4*c, maxSignWindow, int(validity/time.Second)/4), min(minSignWindow, int(validity/time.Second)/4), 1)
}

// runBench benchmarks o.URL and prints the report; see the `bench` command's help. The error is non-nil when
// the run could not be made, or when the seller's balance did not rise by what the paid answers paid (after
// the report is printed).
func Run(ctx context.Context, o Options, stdout, stderr io.Writer) error {
	target, err := o.check()
	if err != nil {
		return err
	}
	o.Concurrency = min(o.Concurrency, o.Requests)
	client := client(o.Concurrency, o.Timeout)
	defer client.CloseIdleConnections()

	first, firstBody, err := payer.Fetch(ctx, client, o.HTTPMethod, target.String(), "", "", maxFirstBody) // the first request, unpaid
	if err != nil {
		return err
	}
	rep := Report{URL: target.Redacted(), HTTPMethod: o.HTTPMethod, Concurrency: o.Concurrency, Failures: []Failure{}}
	var (
		paid  *paidRun
		batch *batchRun
		p     *payer.Payer
		req   x402.PaymentRequirements
	)
	switch {
	case first.StatusCode == http.StatusPaymentRequired:
		if o.Key == nil {
			return fmt.Errorf("%s asks for payment: %w", target.Redacted(), o.KeyErr)
		}
		if p, err = payer.New(o.Key, payer.Options{RPC: o.RPC, Method: o.Method}); err != nil {
			return err
		}
		defer p.Close()
		if paid, batch, err = preparePayments(ctx, o, p, first, firstBody, client, stderr); err != nil {
			return err
		}
		if paid != nil {
			defer paid.finish()
			req = paid.req
		} else {
			defer batch.close()
			req = batch.req
		}
		rep.Paid, rep.Scheme, rep.Method = true, req.Scheme, payer.TransferMethod(req)
		rep.Network, rep.Asset, rep.PayTo, rep.Amount = req.Network, req.Asset, req.PayTo, req.Amount
	case first.StatusCode >= 200 && first.StatusCode < 300:
		fmt.Fprintf(stderr, "%s answered %s without asking for payment: benchmarking it as a free URL\n", target.Redacted(), first.Status)
	default:
		return fmt.Errorf("%s answered %s, neither 402 Payment Required nor 2xx: nothing to benchmark (is the URL right?)", target.Redacted(), first.Status)
	}

	var seller, asset common.Address
	var before *big.Int
	var counter *chainCounter
	if rep.Paid && o.RPC != "" {
		seller, asset = common.HexToAddress(req.PayTo), common.HexToAddress(req.Asset)
		if before, err = p.TokenBalance(ctx, asset, seller); err != nil {
			return fmt.Errorf("reading the seller's balance before the run: %w", err)
		}
		if batch != nil {
			if counter, err = startChainCounter(ctx, o.RPC); err != nil {
				return err
			}
			defer counter.close()
		}
	}

	sendURL := first.Request.URL.String()
	fmt.Fprintf(stderr, "sending %d requests at concurrency %d%s\n", o.Requests, o.Concurrency, durationNote(o.Duration))
	tally, wall := send(ctx, o, client, sendURL, paid, batch, stderr)
	// Interrupted (SIGINT), the run stops sending and reports what it sent: the seller's balance, the channels
	// and the refund asked for are read and sent as after any run (a second interrupt ends the process).
	interrupted := ctx.Err() != nil
	if interrupted {
		ctx = context.WithoutCancel(ctx)
	}
	var signErr error
	if paid != nil {
		if signErr = paid.finish(); signErr == nil {
			fmt.Fprintf(stderr, "signing the payments after the first window took %s during the run\n", paid.signing.Round(time.Millisecond))
		}
	}

	rep.Requests = len(tally.allLatency)
	rep.OK = tally.ok
	rep.DurationSeconds = wall.Seconds()
	if wall > 0 {
		rep.OKPerSecond = float64(tally.ok) / wall.Seconds()
	}
	rep.LatencyMS, rep.LatencyAllMS = latencySummary(tally.okLatency), latencySummary(tally.allLatency)
	if interrupted {
		rep.Notes = append(rep.Notes, fmt.Sprintf("interrupted: %d of the %d requests were sent, and the answers in flight waited for", rep.Requests, o.Requests))
	}
	rep.Failures = groupFailures(tally.failures)
	rep.Failed, rep.MaxFailures = rep.Requests-rep.OK, o.MaxFailures
	var failed error
	if rep.Failed > o.MaxFailures {
		failed = fmt.Errorf("%d of %d requests failed, more than --max-failures %d: FAILED", rep.Failed, rep.Requests, o.MaxFailures)
	}

	var mismatch, refundErr error
	if batch != nil {
		b := &BatchReport{Channels: len(batch.channels), Deposits: int(batch.deposits.Load()), Vouchers: int(batch.vouchers.Load())}
		if o.Refund {
			fmt.Fprintln(stderr, "asking for what is left in the channels")
			back, errs := batch.refund(ctx, sendURL)
			b.Refunded, b.RefundErrors = back.String(), errs
			if len(errs) > 0 {
				refundErr = fmt.Errorf("%d of the channels' refunds failed: REFUND FAILED: %s", len(errs), strings.Join(errs, "; "))
			}
		}
		b.Refunds = int(batch.refunds.Load())
		deposited, charged, left := batch.channelsTotals()
		b.Deposited, b.Charged, b.Left = deposited.String(), charged.String(), left.String()
		if left.Sign() > 0 && !o.Refund {
			rep.Notes = append(rep.Notes, fmt.Sprintf("the channels hold %s that no accepted voucher charges: --refund asks for it after a run; the payer can also withdraw it from the escrow after the withdrawal delay", left))
		}
		rep.Batch = b
	}
	if rep.Paid {
		rep.ExpectedDelta = bigString(tally.expected)
		if tally.atMax > 0 {
			rep.Notes = append(rep.Notes, fmt.Sprintf("%d paid answers named no amount in PAYMENT-RESPONSE: counted at the maximum, %s each", tally.atMax, req.Amount))
		}
		if tally.paidNon2xx > 0 {
			rep.Notes = append(rep.Notes, fmt.Sprintf("%d answers that were not 2xx say in PAYMENT-RESPONSE that they were paid: counted as paid", tally.paidNon2xx))
		}
		if tally.uncertainCount > 0 {
			rep.Notes = append(rep.Notes, fmt.Sprintf("%d answers said their payment may have settled (%s in all): the seller may have received up to that much more", tally.uncertainCount, tally.uncertain))
		}
		if before != nil {
			if batch != nil {
				fmt.Fprintf(stderr, "waiting up to %s for the seller's balance to show the vouchers: the server claims them on chain as its policy says (a number of vouchers, an amount, a time, and at its shutdown)\n", o.SettleWait)
			} else {
				fmt.Fprintf(stderr, "waiting up to %s for the seller's balance to show the payments\n", o.SettleWait)
			}
			after, err := waitSellerBalance(ctx, p, asset, seller, before, tally.expected, tally.uncertain, o.SettleWait)
			if err != nil {
				return fmt.Errorf("reading the seller's balance after the run: %w", err)
			}
			delta := new(big.Int).Sub(after, before)
			ok := balanceMatches(delta, tally.expected, tally.uncertain)
			rep.SellerBefore, rep.SellerAfter, rep.SellerDelta, rep.BalanceOK = bigString(before), bigString(after), bigString(delta), &ok
			if !ok {
				mismatch = fmt.Errorf("the seller's balance rose by %s, and the %d paid answers paid %s: MISMATCH", delta, tally.ok+tally.paidNon2xx, tally.expected)
				if batch != nil {
					rep.Notes = append(rep.Notes, "a batch-settlement seller is paid when the server claims its vouchers: a claim policy slower than --settle-wait shows as a mismatch here; the claim at the server's shutdown pays the rest")
				}
			}
			if counter != nil {
				n, to, err := counter.count(ctx)
				if err != nil {
					return err
				}
				per100 := 0.0
				if rep.Requests > 0 {
					per100 = float64(n) * 100 / float64(rep.Requests)
				}
				rep.Batch.Transactions, rep.Batch.TransactionsPer100, rep.Batch.FromBlock, rep.Batch.ToBlock = &n, &per100, counter.from+1, to
			}
		} else {
			rep.Notes = append(rep.Notes, "no --rpc: the seller's balance was not checked")
		}
	}

	if o.JSON {
		b, err := json.Marshal(rep)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintf(stdout, "%s\n", b); err != nil {
			return err
		}
	} else if err := printReport(stdout, rep); err != nil {
		return err
	}
	return errors.Join(signErr, mismatch, refundErr, failed)
}

// preparePayments chooses the requirement to pay, checks the payer can pay o.Requests of it, and signs
// that many payments, or, for a batch-settlement requirement, prepares the channels that pay it (prepareBatch).
func preparePayments(ctx context.Context, o Options, p *payer.Payer, first *http.Response, body []byte, client *http.Client, stderr io.Writer) (*paidRun, *batchRun, error) {
	offer, err := payer.ReadOffer(first.Header, body)
	if err != nil {
		return nil, nil, err
	}
	i, err := p.Choose(ctx, offer)
	if err != nil {
		return nil, nil, err
	}
	if offer.Required.Accepts[i].Scheme == x402.SchemeBatchSettlement {
		batch, err := prepareBatch(ctx, o, p, offer, i, client, stderr)
		return nil, batch, err
	}
	paid, err := prepareSigned(ctx, o, p, offer, i, stderr)
	return paid, nil, err
}

// prepareSigned checks the payer can pay o.Requests of offer's requirement i, and signs the first window of them.
func prepareSigned(ctx context.Context, o Options, p *payer.Payer, offer payer.Offer, i int, stderr io.Writer) (*paidRun, error) {
	req := offer.Required.Accepts[i]
	method := payer.TransferMethod(req)
	if method == x402.TransferERC2612 {
		return nil, errors.New("the only way to pay this URL is erc2612, which cannot be benchmarked: each EIP-2612 permit signs the token's nonces(payer), which rises by one as each payment settles")
	}
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return nil, fmt.Errorf("the 402 offers the amount %q: %w", req.Amount, err)
	}
	validity, err := p.Validity(req)
	if err != nil {
		return nil, err
	}
	total := new(big.Int).Mul(amount, big.NewInt(int64(o.Requests)))
	upTo := ""
	if req.Scheme == x402.SchemeUpto {
		upTo = "up to "
	}
	fmt.Fprintf(stderr, "paying %s%s of %s to %s on %s by %s as %s, %d times\n",
		upTo, req.Amount, req.Asset, req.PayTo, req.Network, method, p.Address().Hex(), o.Requests)
	if o.RPC != "" {
		if err := checkFunds(ctx, o, p, req, total, stderr); err != nil {
			return nil, err
		}
	} else {
		fmt.Fprintln(stderr, "no --rpc: the payer's balance and Permit2 allowance are not checked, and the seller's balance will not be")
	}

	window := min(signWindow(o.Concurrency, validity), o.Requests)
	start := time.Now()
	signed, err := p.SignBatch(ctx, offer, i, window)
	if err != nil {
		return nil, err
	}
	runCtx, stop := context.WithCancel(ctx)
	paid := &paidRun{req: req, amount: amount, values: make(chan string, window), stop: stop, done: make(chan struct{})}
	for _, pay := range signed {
		paid.header = pay.Header
		paid.values <- pay.Value
	}
	fmt.Fprintf(stderr, "signed %d payments in %s; the rest are signed during the run, at most %d waiting\n", window, time.Since(start).Round(time.Millisecond), window)
	go paid.signRest(runCtx, p, offer, i, o.Requests-window, max(window/4, 1))
	return paid, nil
}

// signRest signs n more payments, chunk at a time, as the run takes them; it closes values when done or stopped.
func (paid *paidRun) signRest(ctx context.Context, p *payer.Payer, offer payer.Offer, i, n, chunk int) {
	defer close(paid.done)
	defer close(paid.values)
	for n > 0 {
		k := min(chunk, n)
		at := time.Now()
		pays, err := p.SignBatch(ctx, offer, i, k)
		paid.signing += time.Since(at)
		if err != nil {
			if ctx.Err() == nil {
				paid.err = fmt.Errorf("signing payments during the run: %w", err)
			}
			return
		}
		for _, pay := range pays {
			select {
			case paid.values <- pay.Value:
			case <-ctx.Done():
				return
			}
		}
		n -= k
	}
}

// finish stops the signing and waits for it; it returns why signing stopped short, if it did.
func (paid *paidRun) finish() error {
	paid.stop()
	<-paid.done
	return paid.err
}

// checkFunds refuses a run the payer cannot pay for: a balance short of total, or, for permit2, a Permit2
// allowance short of it. Only the dev chain's demo payer with --dev approves Permit2 itself, and says so.
func checkFunds(ctx context.Context, o Options, p *payer.Payer, req x402.PaymentRequirements, total *big.Int, stderr io.Writer) error {
	asset := common.HexToAddress(req.Asset)
	balance, err := p.TokenBalance(ctx, asset, p.Address())
	if err != nil {
		return err
	}
	if balance.Cmp(total) < 0 {
		return fmt.Errorf("the payer %s holds %s of the token %s, and %d payments of %s need %s", p.Address().Hex(), balance, req.Asset, o.Requests, req.Amount, total)
	}
	if payer.TransferMethod(req) != x402.TransferPermit2 {
		return nil
	}
	allowance, err := p.Permit2Allowance(ctx, req)
	if err != nil {
		return err
	}
	if allowance.Cmp(total) >= 0 {
		return nil
	}
	permit2 := contracts.Permit2Address.Hex()
	if req.Extra.Permit2Address != "" {
		permit2 = req.Extra.Permit2Address
	}
	if o.Dev && p.Address() == devchain.PayerAddress && req.Network == x402.EIP155(devchain.DefaultChainID) {
		maxUint := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
		tx, err := p.ApprovePermit2(ctx, req, maxUint)
		if err != nil {
			return fmt.Errorf("approving Permit2 for the dev chain's demo payer: %w", err)
		}
		fmt.Fprintf(stderr, "the dev chain's demo payer had approved Permit2 (%s) for %s of the token %s, and the run needs %s: approved it for any amount (transaction %s)\n",
			permit2, allowance, req.Asset, total, tx.Hex())
		return nil
	}
	return fmt.Errorf("the payer %s lets Permit2 (%s) move %s of the token %s, and %d payments of %s need %s: approve Permit2 for the token from the payer's account first (approve(%s, amount)); bench sends no transaction for you, and the gas-sponsoring permit 'pay' adds covers one payment at a time",
		p.Address().Hex(), permit2, allowance, req.Asset, o.Requests, req.Amount, total, permit2)
}

// send sends the requests at o.Concurrency and tallies them; wall is the time from the first request sent
// to the last answer read. A batch-settlement run's callers each send their share, from their own channel.
func send(ctx context.Context, o Options, client *http.Client, u string, paid *paidRun, batch *batchRun, stderr io.Writer) (*tally, time.Duration) {
	var next, done atomic.Int64
	tallies := make([]*tally, o.Concurrency)
	start := time.Now()
	var stopAt time.Time
	if o.Duration > 0 {
		stopAt = start.Add(o.Duration)
	}
	progressDone := make(chan struct{})
	go progress(&done, o.Requests, start, progressDone, stderr)
	var wg sync.WaitGroup
	for w := range o.Concurrency {
		tallies[w] = newTally(o.Requests/o.Concurrency + 1)
		wg.Add(1)
		var charge func(*x402.SettleResponse, *tally) *big.Int
		var fixed *big.Int
		c := client
		quota := o.Requests
		switch {
		case paid != nil:
			charge = func(s *x402.SettleResponse, t *tally) *big.Int { return paidAmount(paid, s, t) }
		case batch != nil:
			// The gate charges a voucher-paid answer the price (the channel's checks of the answers are the payer's).
			charge = func(*x402.SettleResponse, *tally) *big.Int { return batch.price }
			fixed = batch.price
			c, quota = batch.channels[w].client, batch.channels[w].quota
		}
		c, timeout := deadlineByContext(c)
		go func(t *tally) {
			defer wg.Done()
			for sent := 0; ctx.Err() == nil && sent < quota; sent++ {
				k := int(next.Add(1)) - 1
				if k >= o.Requests || (!stopAt.IsZero() && time.Now().After(stopAt)) {
					return
				}
				var name, value string
				if paid != nil {
					var ok bool
					if value, ok = <-paid.values; !ok {
						return // signing stopped short (its error is the run's)
					}
					name = paid.header
				}
				// A request sent runs to its answer when the run is interrupted: a payment whose answer was not
				// read may have been charged, and the run's count must hold what the seller received.
				one(context.WithoutCancel(ctx), c, timeout, o.HTTPMethod, u, name, value, charge, fixed, t)
				done.Add(1)
			}
		}(tallies[w])
	}
	wg.Wait()
	wall := time.Since(start)
	close(progressDone)
	all := newTally(o.Requests)
	for _, t := range tallies {
		all.merge(t)
	}
	return all, wall
}

// progress prints how many requests are done every five seconds, until stop is closed.
func progress(done *atomic.Int64, total int, start time.Time, stop <-chan struct{}, stderr io.Writer) {
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			fmt.Fprintf(stderr, "%d of %d requests done in %s\n", done.Load(), total, time.Since(start).Round(time.Second))
		}
	}
}

// deadlineByContext is c, and the timeout each of its requests' contexts is to carry: c's own Timeout, moved to the
// contexts, when its RoundTripper is one net/http does not know (the payer's), for which Timeout costs two
// goroutines a request (its legacy cancellation), each woken once: a cost the free route's client does not pay,
// inside the latency measured. Else c as it is, and 0.
func deadlineByContext(c *http.Client) (*http.Client, time.Duration) {
	if _, known := c.Transport.(*http.Transport); known || c.Timeout <= 0 {
		return c, 0
	}
	plain := *c
	plain.Timeout = 0
	return &plain, c.Timeout
}

// one sends one request (within timeout, when not 0) and tallies its answer; charge says what a paid answer moved
// to the seller (nil: the URL is free), and fixed, when not nil, what every 2xx answer moved whatever its
// PAYMENT-RESPONSE says (a voucher-paid one: the price), whose PAYMENT-RESPONSE is then not decoded a second time
// (the payer's transport decoded it already), inside the latency measured.
func one(ctx context.Context, client *http.Client, timeout time.Duration, method, u, name, value string, charge func(*x402.SettleResponse, *tally) *big.Int, fixed *big.Int, t *tally) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	r, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		t.failures[Failure{Reason: err.Error()}]++
		t.allLatency = append(t.allLatency, 0)
		return
	}
	if name != "" {
		r.Header.Set(name, value)
	}
	sent := time.Now()
	resp, err := client.Do(r)
	if err != nil {
		t.allLatency = append(t.allLatency, time.Since(sent))
		t.failures[Failure{Reason: transportReason(err)}]++
		return
	}
	ok := resp.StatusCode >= 200 && resp.StatusCode < 300
	var body []byte
	if ok {
		_, err = io.Copy(io.Discard, resp.Body)
	} else {
		var buf bytes.Buffer
		_, err = io.Copy(&buf, io.LimitReader(resp.Body, maxFailureBody))
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
		}
		body = buf.Bytes()
	}
	resp.Body.Close()
	latency := time.Since(sent)
	t.allLatency = append(t.allLatency, latency)
	if err != nil {
		t.failures[Failure{Status: resp.StatusCode, Reason: "body cut short: " + transportReason(err)}]++
		return
	}
	if ok && fixed != nil {
		t.ok++
		t.okLatency = append(t.okLatency, latency)
		t.expected.Add(t.expected, fixed)
		return
	}
	settled, _ := payer.Settlement(resp)
	if ok {
		t.ok++
		t.okLatency = append(t.okLatency, latency)
		if charge != nil {
			t.expected.Add(t.expected, charge(settled, t))
		}
		return
	}
	t.failures[Failure{Status: resp.StatusCode, Reason: failureReason(resp, body, settled)}]++
	if charge == nil || settled == nil {
		return
	}
	switch {
	case settled.Success:
		t.paidNon2xx++
		t.expected.Add(t.expected, charge(settled, t))
	case settled.Pending():
		t.uncertainCount++
		t.uncertain.Add(t.uncertain, charge(settled, t))
	}
}

// paidAmount is what a paid answer moved to the seller: the price of an exact requirement, or the amount an
// upto PAYMENT-RESPONSE names (the maximum, counted in t, when it names none).
func paidAmount(paid *paidRun, settled *x402.SettleResponse, t *tally) *big.Int {
	if paid.req.Scheme != x402.SchemeUpto {
		return paid.amount
	}
	if settled != nil && settled.Amount != "" {
		if a, err := x402.ParseUint256(settled.Amount); err == nil && a.Cmp(paid.amount) <= 0 {
			return a
		}
	}
	t.atMax++
	return paid.amount
}

// failureReason is the x402 reason of an answer that was not 2xx: the PAYMENT-RESPONSE errorReason, else the
// reason code the 402's PAYMENT-REQUIRED error starts with, else the outcome (or reason) of a JSON body, as
// the gate's 502 and 429 answers carry it. "" when the answer gives none, as an upstream's own error does not.
func failureReason(resp *http.Response, body []byte, settled *x402.SettleResponse) string {
	if settled != nil && settled.ErrorReason != "" {
		return settled.ErrorReason
	}
	if h := resp.Header.Get(x402.HeaderPaymentRequired); h != "" {
		if p, err := x402.DecodePaymentRequired(h); err == nil && p.Error != "" {
			return reasonCode(p.Error)
		}
	}
	var b struct {
		Reason  string `json:"reason"`
		Outcome string `json:"outcome"`
		Error   string `json:"error"`
	}
	if json.Unmarshal(body, &b) == nil {
		switch {
		case b.Reason != "":
			return b.Reason
		case b.Outcome != "":
			return b.Outcome
		case b.Error != "" && resp.StatusCode == http.StatusPaymentRequired:
			return reasonCode(b.Error) // a version 1 offer's error
		}
	}
	return ""
}

// reasonCode is the part of an x402 error text that names the reason ("invalid_exact_evm_...: the message"
// gives the code), so that answers differing only in their message group together.
func reasonCode(s string) string {
	code, _, _ := strings.Cut(s, ": ")
	return code
}

// transportReason names a request that got no answer, in words that do not vary from one request to the next.
func transportReason(err error) string {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return err.Error()
}

// groupFailures lists the failures, the most frequent first.
func groupFailures(m map[Failure]int) []Failure {
	out := make([]Failure, 0, len(m))
	for k, n := range m {
		k.Count = n
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Count != out[j].Count {
			return out[i].Count > out[j].Count
		}
		if out[i].Status != out[j].Status {
			return out[i].Status < out[j].Status
		}
		return out[i].Reason < out[j].Reason
	})
	return out
}

// latencySummary is the p50, p90, p99 and maximum of ds (nearest rank), in milliseconds; it sorts ds.
func latencySummary(ds []time.Duration) Latency {
	if len(ds) == 0 {
		return Latency{}
	}
	slices.Sort(ds)
	return Latency{P50: ms(percentile(ds, 50)), P90: ms(percentile(ds, 90)), P99: ms(percentile(ds, 99)), Max: ms(ds[len(ds)-1])}
}

// percentile is the nearest-rank p-th percentile of sorted: the smallest value at least p% of them are at or
// below.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/float64(time.Microsecond)) / 1000 }

// waitSellerBalance reads the seller's balance until it has risen by expected (or by up to uncertain more), has
// stopped changing for settleStable, or wait has passed; it returns the last balance read.
func waitSellerBalance(ctx context.Context, p *payer.Payer, asset, seller common.Address, before, expected, uncertain *big.Int, wait time.Duration) (*big.Int, error) {
	deadline := time.Now().Add(wait)
	stable := min(settleStable, wait)
	var last *big.Int
	lastChange := time.Now()
	for {
		b, err := p.TokenBalance(ctx, asset, seller)
		if err != nil {
			return nil, err
		}
		if last == nil || b.Cmp(last) != 0 {
			last, lastChange = b, time.Now()
		}
		delta := new(big.Int).Sub(b, before)
		if delta.Cmp(expected) == 0 && uncertain.Sign() == 0 {
			return b, nil
		}
		if delta.Cmp(new(big.Int).Add(expected, uncertain)) == 0 {
			return b, nil
		}
		now := time.Now()
		if now.After(deadline) || now.Sub(lastChange) >= stable {
			return b, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(settlePoll):
		}
	}
}

// balanceMatches says whether the seller received what the paid answers paid: expected, and at most uncertain
// more for payments whose settlement the server could not confirm.
func balanceMatches(delta, expected, uncertain *big.Int) bool {
	return delta.Cmp(expected) >= 0 && delta.Cmp(new(big.Int).Add(expected, uncertain)) <= 0
}

func bigString(n *big.Int) *string {
	s := n.String()
	return &s
}

func durationNote(d time.Duration) string {
	if d <= 0 {
		return ""
	}
	return ", for at most " + d.String()
}

// printReport prints the report for a person.
func printReport(w io.Writer, r Report) error {
	var b strings.Builder
	if r.Paid {
		upTo := ""
		if r.Scheme == x402.SchemeUpto {
			upTo = "up to "
		}
		fmt.Fprintf(&b, "%s %s: %s, %s%s of %s to %s on %s by %s\n", r.HTTPMethod, r.URL, r.Scheme, upTo, r.Amount, r.Asset, r.PayTo, r.Network, r.Method)
	} else {
		fmt.Fprintf(&b, "%s %s: free (no payment asked)\n", r.HTTPMethod, r.URL)
	}
	fmt.Fprintf(&b, "requests:    %d at concurrency %d in %.3f s\n", r.Requests, r.Concurrency, r.DurationSeconds)
	fmt.Fprintf(&b, "ok (2xx):    %d, %.1f/s\n", r.OK, r.OKPerSecond)
	fmt.Fprintf(&b, "latency ok:  %s\n", r.LatencyMS)
	fmt.Fprintf(&b, "latency all: %s\n", r.LatencyAllMS)
	if len(r.Failures) == 0 {
		fmt.Fprintln(&b, "failures:    none")
	} else {
		fmt.Fprintln(&b, "failures:")
		for _, f := range r.Failures {
			status, reason := "no answer", f.Reason
			if f.Status != 0 {
				status = fmt.Sprintf("%d %s", f.Status, http.StatusText(f.Status))
			}
			if reason == "" {
				reason = "(no x402 reason)"
			}
			fmt.Fprintf(&b, "  %6d  %s: %s\n", f.Count, status, reason)
		}
	}
	switch {
	case r.BalanceOK == nil && r.Paid:
		fmt.Fprintf(&b, "seller:      not checked (no --rpc); the paid answers paid %s\n", *r.ExpectedDelta)
	case r.BalanceOK != nil && *r.BalanceOK:
		fmt.Fprintf(&b, "seller:      %s, expected %s: OK\n", signed(*r.SellerDelta), signed(*r.ExpectedDelta))
	case r.BalanceOK != nil:
		fmt.Fprintf(&b, "seller:      %s, expected %s: MISMATCH\n", signed(*r.SellerDelta), signed(*r.ExpectedDelta))
	}
	if c := r.Batch; c != nil {
		fmt.Fprintf(&b, "channels:    %d (one a caller): %d deposits, %d vouchers, %d refunds; deposited %s, charged %s, left %s\n",
			c.Channels, c.Deposits, c.Vouchers, c.Refunds, c.Deposited, c.Charged, c.Left)
		if c.Refunded != "" {
			fmt.Fprintf(&b, "refunded:    %s\n", c.Refunded)
		}
		for _, e := range c.RefundErrors {
			fmt.Fprintf(&b, "  refund failed: %s\n", e)
		}
		if c.Transactions != nil {
			fmt.Fprintf(&b, "on chain:    %d transactions to the escrow and its collectors in blocks %d to %d, %.2f per 100 requests\n",
				*c.Transactions, c.FromBlock, c.ToBlock, *c.TransactionsPer100)
		}
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "note:        %s\n", n)
	}
	if r.Failed > r.MaxFailures {
		fmt.Fprintf(&b, "result:      FAILED: %d of %d requests failed (--max-failures %d)\n", r.Failed, r.Requests, r.MaxFailures)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// signed writes a decimal change with its sign: +500, -20, +0.
func signed(n string) string {
	if strings.HasPrefix(n, "-") {
		return n
	}
	return "+" + n
}

// String prints a latency summary on one line.
func (l Latency) String() string {
	return fmt.Sprintf("p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  max %.3f ms", l.P50, l.P90, l.P99, l.Max)
}
