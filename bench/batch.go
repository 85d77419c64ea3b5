package bench

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A batch-settlement offer is paid by channel vouchers, which cannot be signed ahead: each is the cumulative
// amount the server last accepted on its channel plus the price, and the server takes only that one, so the
// vouchers of one channel go one at a time, each after the answer to the one before. A run at concurrency C opens
// C channels, one a caller: the same payer key, each channel with a salt of its own (a channel's id is the hash
// of its payer, payer authorizer, receiver, receiver authorizer, token, withdrawal delay and salt), so that C
// requests are in flight at once as they would be from C payers. One channel paid by C callers would send one
// request at a time whatever C is, and measure nothing but the round trip.
//
// Each caller sends its share of -n requests, and its channel's first request deposits what the share costs (a
// deposit is a transaction the facilitator sends: one a channel, not one a request); every request after it pays
// by voucher. The deposits in all are the run's cost, bounded by --max. A voucher refused mid-run with a
// corrective 402 (the server holds another cumulative amount) resyncs the channel and is sent once more, as
// payer.Transport does; another refusal is a failed request, and the run goes on.

// batchSaltDomain makes the channels' salts a bench's own: the salt of caller w of a run is the hash of this, the
// run's start and w, so that no two runs of a payer share a channel and each run's deposits are its own.
const batchSaltDomain = "caddy x402 bench channel"

// batchRun is the paid side of a batch-settlement run: the offer, a channel (its own Payer and Transport) per
// caller, and what was sent.
type batchRun struct {
	offer    payer.Offer
	index    int
	req      x402.PaymentRequirements
	price    *big.Int
	channels []*batchCaller
	base     http.RoundTripper // the connections every caller sends on, counting the payments
	// deposits, vouchers and refunds count the payments sent, by the payload's type (a deposit carries its
	// channel's first voucher and counts as a deposit only).
	deposits, vouchers, refunds atomic.Int64
}

// batchCaller is one caller's channel.
type batchCaller struct {
	p      *payer.Payer
	tr     *payer.Transport
	client *http.Client
	quota  int // how many requests this caller sends
}

// prepareBatch opens (in memory: nothing is signed yet) a channel a caller for the batch-settlement requirement i
// of offer, each with a budget of its share of the run's cost, and checks the payer holds the deposits.
func prepareBatch(ctx context.Context, o Options, p *payer.Payer, offer payer.Offer, i int, client *http.Client, stderr io.Writer) (*batchRun, error) {
	req := offer.Required.Accepts[i]
	price, err := x402.ParseUint256(req.Amount)
	if err != nil || price.Sign() == 0 {
		return nil, fmt.Errorf("the 402 offers the batch-settlement amount %q: expected a positive amount", req.Amount)
	}
	// Each caller's deposit is its share of the requests at the price, or the offer's minDeposit when that is more.
	var minDeposit *big.Int
	if br, ok := offer.Batch(i); ok && br.Extra.MinDeposit != "" {
		if minDeposit, err = x402.ParseUint256(br.Extra.MinDeposit); err != nil {
			return nil, fmt.Errorf("the 402 offers the minDeposit %q: %w", br.Extra.MinDeposit, err)
		}
	}
	quotas, deposits, cost := make([]int, o.Concurrency), make([]*big.Int, o.Concurrency), new(big.Int)
	for w := range o.Concurrency {
		quotas[w] = o.Requests / o.Concurrency
		if w < o.Requests%o.Concurrency {
			quotas[w]++
		}
		deposits[w] = new(big.Int).Mul(price, big.NewInt(int64(quotas[w])))
		if minDeposit != nil && minDeposit.Cmp(deposits[w]) > 0 {
			deposits[w].Set(minDeposit)
		}
		cost.Add(cost, deposits[w])
	}
	max := o.Max
	if max == nil {
		max = cost
	}
	if max.Cmp(cost) < 0 {
		return nil, fmt.Errorf("--max %s: the run's %d requests at %s each, from %d channels (one a caller), need deposits of %s in all; give a --max of at least that, or fewer requests or callers",
			max, o.Requests, price, o.Concurrency, cost)
	}
	fmt.Fprintf(stderr, "paying %s of %s to %s on %s by batch-settlement vouchers as %s, %d times: %d channels (one a caller), each opened by a deposit of its share\n",
		req.Amount, req.Asset, req.PayTo, req.Network, p.Address().Hex(), o.Requests, o.Concurrency)
	if o.RPC != "" {
		if err := checkFunds(ctx, o, p, req, cost, stderr); err != nil {
			return nil, err
		}
	} else {
		fmt.Fprintln(stderr, "no --rpc: the payer's balance is not checked, and the seller's balance and the transactions will not be")
	}
	run := &batchRun{offer: offer, index: i, req: req, price: price}
	started := time.Now().UnixNano()
	base := &countingTransport{base: client.Transport, run: run}
	run.base = base
	for w, quota := range quotas {
		cp, err := payer.New(o.Key, payer.Options{RPC: o.RPC, Method: o.Method, Scheme: x402.SchemeBatchSettlement,
			DepositRequests: quota, ChannelSalt: batchSalt(started, w)})
		if err != nil {
			run.close()
			return nil, err
		}
		// The caller's budget: its share of --max, at least its deposit.
		total := new(big.Int).Mul(max, deposits[w])
		total.Quo(total, cost)
		tr := &payer.Transport{Payer: cp, Base: base,
			Limits: []payer.Limit{{Network: req.Network, Asset: req.Asset, PerRequest: price, Total: total}}}
		c := &http.Client{Transport: offerTransport{tr: tr, offer: offer}, Timeout: client.Timeout, CheckRedirect: client.CheckRedirect}
		run.channels = append(run.channels, &batchCaller{p: cp, tr: tr, client: c, quota: quota})
	}
	return run, nil
}

// batchSalt is the salt of caller w's channel in the run started at started (Unix nanoseconds).
func batchSalt(started int64, w int) common.Hash {
	var b [len(batchSaltDomain) + 16]byte
	copy(b[:], batchSaltDomain)
	binary.BigEndian.PutUint64(b[len(batchSaltDomain):], uint64(started))
	binary.BigEndian.PutUint64(b[len(batchSaltDomain)+8:], uint64(w))
	return sha256.Sum256(b[:])
}

func (run *batchRun) close() {
	for _, c := range run.channels {
		c.p.Close()
	}
}

// offerTransport pays every request for the offer the run's first 402 made, without asking again.
type offerTransport struct {
	tr    *payer.Transport
	offer payer.Offer
}

func (t offerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	return t.tr.PayOffer(r, t.offer)
}

// countingTransport counts the batch-settlement payments sent, by type.
type countingTransport struct {
	base http.RoundTripper
	run  *batchRun
}

func (t *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if v := r.Header.Get(x402.HeaderPaymentSignature); v != "" {
		// The payer's own payment, as it encodes it: its type is found in the JSON without decoding it all, which
		// would cost the client as much again as the voucher's signature, inside the latency measured.
		if raw, err := base64.StdEncoding.DecodeString(v); err == nil {
			switch {
			case bytes.Contains(raw, []byte(`"type":"`+x402.BatchDeposit+`"`)):
				t.run.deposits.Add(1)
			case bytes.Contains(raw, []byte(`"type":"`+x402.BatchVoucher+`"`)):
				t.run.vouchers.Add(1)
			case bytes.Contains(raw, []byte(`"type":"`+x402.BatchRefund+`"`)):
				t.run.refunds.Add(1)
			}
		}
	}
	return t.base.RoundTrip(r)
}

// BatchReport is what a batch-settlement run sent and what its channels hold after it. Amounts are raw units in
// decimal strings.
type BatchReport struct {
	// Channels is how many channels the run paid from: one a caller.
	Channels int `json:"channels"`
	// Deposits, Vouchers and Refunds count the payments sent by type (a deposit carries its channel's first
	// voucher, and counts only as a deposit).
	Deposits int `json:"deposits"`
	Vouchers int `json:"vouchers"`
	Refunds  int `json:"refunds"`
	// Deposited is what the channels' deposits hold, Charged what the servers' answers say the accepted vouchers
	// charge, Left the rest (refunded when Refunded says so).
	Deposited string `json:"deposited"`
	Charged   string `json:"charged"`
	Left      string `json:"left"`
	// Refunded is what the refunds returned (with --refund), RefundErrors why any refund failed.
	Refunded     string   `json:"refunded,omitempty"`
	RefundErrors []string `json:"refund_errors,omitempty"`
	// Transactions is how many transactions to the batch-settlement escrow and its deposit collectors the chain
	// mined from the run's start until the seller's balance showed the claims (with --rpc; null without):
	// the deposits and the gate's claims. FromBlock and ToBlock are the blocks read.
	Transactions       *int     `json:"transactions"`
	TransactionsPer100 *float64 `json:"transactions_per_100_requests"`
	FromBlock          uint64   `json:"from_block,omitempty"`
	ToBlock            uint64   `json:"to_block,omitempty"`
}

// channelsTotals sums what the callers' payers know of their channels.
func (run *batchRun) channelsTotals() (deposited, charged, left *big.Int) {
	deposited, charged, left = new(big.Int), new(big.Int), new(big.Int)
	for _, c := range run.channels {
		id, err := c.p.ChannelID(mustBatch(run.offer, run.index))
		if err != nil {
			continue
		}
		st, ok := c.p.Channel(id)
		if !ok {
			continue
		}
		deposited.Add(deposited, st.Balance)
		charged.Add(charged, st.Charged)
		left.Add(left, st.Left())
	}
	return deposited, charged, left
}

func mustBatch(offer payer.Offer, i int) x402.BatchRequirements {
	br, _ := offer.Batch(i)
	return br
}

// refund asks the server for what is left in each channel that has any left, and returns what came back.
func (run *batchRun) refund(ctx context.Context, u string) (*big.Int, []string) {
	back := new(big.Int)
	var errs []string
	for _, c := range run.channels {
		id, err := c.p.ChannelID(mustBatch(run.offer, run.index))
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		st, ok := c.p.Channel(id)
		if !ok || st.Left().Sign() == 0 {
			continue
		}
		left := st.Left()
		after, _, err := c.p.Refund(ctx, &http.Client{Transport: run.base, Timeout: c.client.Timeout}, u, nil)
		if err != nil {
			errs = append(errs, fmt.Sprintf("channel %s (%s left): %v", id.Hex(), left, err))
			continue
		}
		back.Add(back, new(big.Int).Sub(left, after.Left()))
	}
	return back, errs
}

// chainCounter counts the transactions a batch run made on chain: those to the escrow and its deposit collectors.
type chainCounter struct {
	c    *ethclient.Client
	from uint64
}

func startChainCounter(ctx context.Context, rpc string) (*chainCounter, error) {
	c, err := ethclient.DialContext(ctx, rpc)
	if err != nil {
		return nil, fmt.Errorf("dialing the RPC to count the run's transactions: %w", err)
	}
	head, err := c.BlockNumber(ctx)
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("reading the head block before the run: %w", err)
	}
	return &chainCounter{c: c, from: head}, nil
}

// count reads the blocks after the one the counter started at, up to the head, and counts the transactions to the
// batch-settlement contracts in them.
func (cc *chainCounter) count(ctx context.Context) (n int, to uint64, err error) {
	to, err = cc.c.BlockNumber(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("reading the head block after the run: %w", err)
	}
	watched := map[common.Address]bool{contracts.BatchSettlementAddress: true, contracts.ERC3009DepositCollectorAddress: true,
		contracts.Permit2DepositCollectorAddress: true}
	for b := cc.from + 1; b <= to; b++ {
		blk, err := cc.c.BlockByNumber(ctx, new(big.Int).SetUint64(b))
		if err != nil {
			return 0, 0, fmt.Errorf("reading block %d: %w", b, err)
		}
		for _, tx := range blk.Transactions() {
			if tx.To() != nil && watched[*tx.To()] {
				n++
			}
		}
	}
	return n, to, nil
}

func (cc *chainCounter) close() { cc.c.Close() }
