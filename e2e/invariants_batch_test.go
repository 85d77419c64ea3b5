package e2e

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"math/big"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The money-invariant run's batch-settlement route: every gateway serves /batch/ by scheme batch (its claimer
// keeping the receiver authorizer's key, claiming every few vouchers or seconds), and batch lanes, each a payer
// with a channel of its own, pay it voucher after voucher while the workers pay the other routes, through the
// same faults (SIGKILLs, reloads that change the price, RPC and PostgreSQL faults), at gateways drawn for each
// voucher, in GET and HEAD, some presented at two gateways at once, some delivered ones presented again. Once
// quiet, each channel's vouchers are claimed and the payer's refund of the rest goes through a gateway; the check
// batch-vouchers-claimed-once judges the chain against what the lanes were served.

const (
	// invBatchLanes is how many batch lanes run: payers of their own, after the workers' invPayers.
	invBatchLanes = 2
	// invBatchPrice is the batch route's price in raw units of the dev USDCoin, and invBatchAltPrice after the
	// reload that changes prices: a voucher accepted before it and not yet served is presented again after it.
	invBatchPrice, invBatchAltPrice = 1000, 1500
	// invBatchDeposit is each deposit of a lane: a top-up follows when a voucher would pass what it deposited.
	invBatchDeposit = 400_000
	// invBatchContent is the batch route's response body.
	invBatchContent = "a response bought by a batch voucher"
	// invBatchAuthorizerEnv carries the receiver authorizer's key to the gateways.
	invBatchAuthorizerEnv = "X402_INV_RECEIVER_AUTHORIZER_KEY"
)

// invBatchSeller is the batch route's pay_to: a seller of its own, which no other route pays.
var invBatchSeller = common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75eba7c0001")

// invBatch is the run's batch route and lanes.
type invBatch struct {
	authorizer *ecdsa.PrivateKey
	lanes      []*invBatchLane
	before     map[common.Address]*big.Int // USDCoin balances at the start: the lanes' payers, the seller, the escrow

	mu         sync.Mutex
	violations []invViolation
	summary    string
	// deposits names each deposit a lane signed by the journal id its settlement is recorded and held under.
	deposits map[journal.ID]string
}

// invBatchLane is one payer paying the batch route by voucher, its channel, and what it was served.
type invBatchLane struct {
	n    int
	name string
	key  *ecdsa.PrivateKey
	addr common.Address
	cfg  contracts.ChannelConfig
	id   common.Hash // zero until the first offer is read

	charged   int64 // the cumulative amount of the last voucher whose response was delivered
	deposited int64
	delivered int
	replays   int
	// aheads counts the next vouchers paid while an earlier one had no final answer, before it was presented again.
	aheads  int
	stopped bool // a violation left the channel in a state the lane cannot pay on from
}

// newInvBatch makes the authorizer key and the lanes, payers PayerKeyN(invPayers...).
func newInvBatch() (*invBatch, error) {
	key, err := crypto.GenerateKey()
	if err != nil {
		return nil, err
	}
	b := &invBatch{authorizer: key}
	for i := range invBatchLanes {
		k := devchain.PayerKeyN(invPayers + i)
		b.lanes = append(b.lanes, &invBatchLane{n: i, name: fmt.Sprintf("B%d", i), key: k, addr: crypto.PubkeyToAddress(k.PublicKey)})
	}
	return b, nil
}

// env is what a gateway's environment carries for the batch block.
func (b *invBatch) env() string {
	return invBatchAuthorizerEnv + "=" + hexutil.Encode(crypto.FromECDSA(b.authorizer))[2:]
}

// networkBlock is the gateways' network of the dev chain, as dev_chain would configure it (its RPC, its two
// tokens, the first n wallets), with a batch block: a network block of the dev chain's id takes dev_chain's place.
func (w *invWorld) networkBlock(rpc string, n int) string {
	var keys []string
	for _, k := range devchain.WalletKeys(n) {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
	}
	return fmt.Sprintf(`network %s {
			rpc %s
			asset %s name %q version %s decimals %d
			asset %s name %q version %s decimals %d eip3009
			wallet_keys %s
			receipt_poll 2ms
			approval_sponsoring
			batch {
				receiver_authorizer_key {env.%s}
				claim_every 5
				claim_after 2s
			}
		}`, x402.EIP155(devchain.DefaultChainID), rpc,
		devchain.TokenAddress.Hex(), x402.DefaultTokenName, x402.DefaultTokenVersion, x402.DefaultTokenDecimals,
		devchain.EIP3009TokenAddress.Hex(), contracts.USDCoinName, contracts.USDCoinVersion, contracts.USDCoinDecimals,
		strings.Join(keys, ","), invBatchAuthorizerEnv)
}

// batchRoute is the batch route's handle block in configuration gen (invWorld.gen).
func (w *invWorld) batchRoute(gen int) string {
	price := invBatchPrice
	if gen == invGenOtherPrices {
		price = invBatchAltPrice
	}
	return fmt.Sprintf(`	handle /batch/* {
		x402 {
			scheme batch
			amount %d
			asset %s
			pay_to %s
			max_timeout %s
		}
		@flaky path %[5]s*
		@plain not path %[5]s*
		reverse_proxy @flaky %[6]s
		respond @plain %[7]q
	}
`, price, devchain.EIP3009TokenAddress.Hex(), invBatchSeller.Hex(), invValidity, invBatchFlaky, w.upstreamURL, invBatchContent)
}

// invBatchFlaky is where the batch route's paths are served by the upstream, which fails the first request of each
// (503) and answers the rest with the route's response (invUpstream.flaky): a voucher presented there is accepted
// and its response not delivered, and the lane presents it again (after paying the next voucher, at times).
const invBatchFlaky = "/batch/flaky/"

// flaky answers a request to a path under invBatchFlaky: 503 the first time the path is asked for, the batch
// route's response after.
func (u *invUpstream) flaky(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	if u.flakyAsked == nil {
		u.flakyAsked = map[string]bool{}
	}
	first := !u.flakyAsked[r.URL.Path]
	u.flakyAsked[r.URL.Path] = true
	u.mu.Unlock()
	if first {
		http.Error(w, "the upstream fails the first request of this path", http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("Content-Length", fmt.Sprint(len(invBatchContent)))
	if r.Method != http.MethodHead {
		io.WriteString(w, invBatchContent)
	}
}

// batchHolders are the addresses whose USDCoin the batch check follows.
func (b *invBatch) holders() []common.Address {
	out := []common.Address{invBatchSeller, contracts.BatchSettlementAddress}
	for _, l := range b.lanes {
		out = append(out, l.addr)
	}
	return out
}

func (r *invRun) batchBalances() map[common.Address]*big.Int {
	out := map[common.Address]*big.Int{}
	for _, a := range r.w.batch.holders() {
		out[a] = r.w.dev.balanceOf(devchain.EIP3009TokenAddress, a)
	}
	return out
}

// noteDeposit remembers the journal id of the deposit value of lane l, signed for cumulative cum in action n, so
// that a journal record or funds hold of it left behind is named (see invRun.describeID).
func (b *invBatch) noteDeposit(l *invBatchLane, value string, cum int64, n int) {
	p, err := x402.DecodeBatchPayment(value)
	if err != nil || p.Payload.Deposit == nil || p.Payload.Deposit.Authorization.ERC3009Authorization == nil {
		return
	}
	a := p.Payload.Deposit.Authorization.ERC3009Authorization
	nonce := contracts.ERC3009DepositNonce(l.id, common.HexToHash(a.Salt))
	id := journal.PaymentID(p.Accepted.Network, x402.TransferEIP3009, common.HexToAddress(p.Accepted.Asset).Hex(), l.addr.Hex(), nonce.Hex())
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.deposits == nil {
		b.deposits = map[journal.ID]string{}
	}
	b.deposits[id] = fmt.Sprintf("%s's deposit of %d into channel %s with the voucher for cumulative %d (action #%d)",
		l.name, invBatchDeposit, l.id.Hex()[:10], cum, n)
}

// depositNamed is the description of the lanes' deposit whose journal id is id, "" when no lane signed it.
func (b *invBatch) depositNamed(id journal.ID) string {
	if b == nil {
		return ""
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.deposits[id]
}

// violate notes a violation of the batch check.
func (b *invBatch) violate(format string, args ...any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.violations = append(b.violations, invViolation{what: fmt.Sprintf(format, args...)})
}

// batchLane pays the batch route voucher after voucher until the time is up.
func (r *invRun) batchLane(l *invBatchLane, until time.Time) {
	rng := rand.New(rand.NewPCG(r.seed, 0xba7c+uint64(l.n)))
	for time.Now().Before(until) && !l.stopped {
		if !r.anyGatewayUp() {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		a := r.begin(l.name, "pay by batch voucher")
		r.batchVoucher(l, rng, a, until)
		r.finish(a)
		time.Sleep(40 * time.Millisecond) // the other routes' workers keep their share of the two cores
	}
}

// batchAnswerOf is a presentation's answer and the cumulative amount its PAYMENT-RESPONSE names.
func (r *invRun) presentBatch(gate int, method, path, value string) batchAnswer {
	ctx, cancel := context.WithTimeout(context.Background(), invRequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, r.w.gateways[gate].url+path, nil)
	if err != nil {
		return batchAnswer{err: err}
	}
	req.Header.Set(x402.HeaderPaymentSignature, value)
	resp, err := batchClient.Do(req)
	if err != nil {
		return batchAnswer{err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	a := batchAnswer{status: resp.StatusCode, body: string(body), err: err}
	if h := resp.Header.Get(x402.HeaderPaymentResponse); h != "" {
		if s, err := x402.DecodeBatchSettleResponse(h); err == nil && s.Extra != nil && s.Extra.ChannelState != nil {
			a.cumulative = s.Extra.ChannelState.ChargedCumulativeAmount
		}
	}
	if a.body == "" && a.status == http.StatusPaymentRequired {
		// A HEAD's 402 has no body: its reason is in PAYMENT-REQUIRED.
		if pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired)); err == nil {
			a.body = pr.Error
		}
	}
	return a
}

// deliveredAs reports whether a is the batch route's response (none for HEAD) at cumulative.
func deliveredAs(a batchAnswer, method string, cumulative int64) bool {
	body := invBatchContent
	if method == http.MethodHead {
		body = ""
	}
	return a.err == nil && a.status == http.StatusOK && a.body == body && a.cumulative == fmt.Sprint(cumulative)
}

// batchRetry reports whether a is no final answer: none, a 5xx, another request presenting the voucher, or an
// engine that asks for the voucher again.
func batchRetry(a batchAnswer) bool {
	return a.err != nil || a.status >= 500 ||
		(a.status == http.StatusPaymentRequired && (strings.Contains(a.body, "presenting this voucher right now") ||
			strings.Contains(a.body, x402.ReasonBatchChannelBusy) || strings.Contains(a.body, x402.ReasonUnexpectedSettleError) ||
			strings.Contains(a.body, x402.ReasonBatchRPCReadFailed)))
}

// batchOffer reads the batch requirement of gateway gate's 402.
func (r *invRun) batchOffer(gate int) (x402.BatchRequirements, error) {
	a, err := get(r.w.gateways[gate].url + "/batch/a")
	if err != nil {
		return x402.BatchRequirements{}, err
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil {
		return x402.BatchRequirements{}, fmt.Errorf("unpaid GET /batch/a: %d (%v)", a.status, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Scheme == x402.SchemeBatchSettlement {
			return x402.BatchRequirements{Scheme: rq.Scheme, Network: rq.Network, Amount: rq.Amount, Asset: rq.Asset, PayTo: rq.PayTo,
				MaxTimeoutSeconds: rq.MaxTimeoutSeconds, Extra: x402.BatchExtra{ReceiverAuthorizer: rq.Extra.ReceiverAuthorizer,
					WithdrawDelay: rq.Extra.WithdrawDelay, Name: rq.Extra.Name, Version: rq.Extra.Version, AssetTransferMethod: rq.Extra.AssetTransferMethod}}, nil
		}
	}
	return x402.BatchRequirements{}, fmt.Errorf("the 402 offers no batch-settlement: %d offers", len(pr.Accepts))
}

// channel is the lane's channel under rq, made on its first offer.
func (r *invRun) laneChannel(l *invBatchLane, rq x402.BatchRequirements) *batchChannel {
	if l.id == (common.Hash{}) {
		l.cfg = contracts.ChannelConfig{Payer: l.addr, PayerAuthorizer: l.addr, Receiver: common.HexToAddress(rq.PayTo),
			ReceiverAuthorizer: common.HexToAddress(rq.Extra.ReceiverAuthorizer), Token: common.HexToAddress(rq.Asset),
			WithdrawDelay: uint64(rq.Extra.WithdrawDelay), Salt: common.BigToHash(chaintest.RandomNonce())}
		l.id = chaintest.ChannelID(new(big.Int).SetUint64(devchain.DefaultChainID), l.cfg)
	}
	bw := &batchWorld{t: r.t, d: r.w.dev, chainID: new(big.Int).SetUint64(devchain.DefaultChainID)}
	return &batchChannel{w: bw, key: l.key, rq: rq, cfg: l.cfg, id: l.id}
}

// batchVoucher signs the lane's next voucher (a deposit with it when it would pass what was deposited) under the
// offer of a gateway drawn for it, and presents it until its answer is final.
func (r *invRun) batchVoucher(l *invBatchLane, rng *rand.Rand, a *invAction, until time.Time) {
	b := r.w.batch
	gates := len(r.w.gateways)
	gate := rng.IntN(gates)
	rq, err := r.batchOffer(gate)
	if err != nil {
		a.say("gw%d: %s", gate, shorten(err.Error()))
		time.Sleep(100 * time.Millisecond)
		return
	}
	c := r.laneChannel(l, rq)
	price, err := x402.ParseAmount(rq.Amount)
	if err != nil {
		r.t.Fatalf("the batch offer's amount %q: %v", rq.Amount, err)
	}
	cum := l.charged + price.Int64()
	value, deposit := "", cum > l.deposited
	if deposit {
		value = c.deposit(invBatchDeposit, cum)
		b.noteDeposit(l, value, cum, a.n)
	} else {
		value = c.voucher(cum)
	}
	method, path := http.MethodGet, []string{"/batch/a", "/batch/b"}[rng.IntN(2)]
	if rng.IntN(10) == 0 {
		method = http.MethodHead
	}
	if rng.IntN(5) == 0 {
		// Accepted, and its upstream fails it the first time: presented again, it gets the response.
		path = fmt.Sprintf("%s%s-%d", invBatchFlaky, l.name, cum)
	}
	giveUp := until.Add(2 * time.Minute)
	paidAhead := false
	for attempt := 0; ; attempt++ {
		var answers []batchAnswer
		asked := []int{gate}
		if attempt == 0 && rng.IntN(6) == 0 {
			// Presented twice at once, at two gateways of a cluster: one response at most.
			asked = append(asked, (gate+1+rng.IntN(max(gates-1, 1)))%gates)
			var wg sync.WaitGroup
			answers = make([]batchAnswer, 2)
			for i, g := range asked {
				wg.Add(1)
				go func() {
					defer wg.Done()
					answers[i] = r.presentBatch(g, method, path, value)
				}()
			}
			wg.Wait()
		} else {
			answers = []batchAnswer{r.presentBatch(gate, method, path, value)}
		}
		served, final := 0, batchAnswer{}
		retry := false
		for i, ans := range answers {
			a.say("gw%d %s %s cumulative %d%s → %s", asked[i], method, path, cum, map[bool]string{true: " with a deposit"}[deposit], ans)
			switch {
			case deliveredAs(ans, method, cum):
				served++
			case batchRetry(ans):
				retry = true
			default:
				final = ans
			}
		}
		switch {
		case served > 1:
			b.violate("%s: the voucher for cumulative %d of channel %s was served %d times when presented at two gateways at once (action #%d)", l.name, cum, l.id.Hex()[:10], served, a.n)
			l.stopped = true
			return
		case served == 1:
			// (A next voucher paid ahead of this one, delivered, stands above it.)
			l.charged, l.delivered = max(l.charged, cum), l.delivered+1
			if deposit {
				l.deposited += invBatchDeposit
			}
			if rng.IntN(8) == 0 {
				r.replayBatch(l, rng, a, value, method, path)
			}
			return
		case retry:
			// One of two presentations at once has no final answer: the voucher may have been accepted there (at a
			// gateway a reload had not reached yet, while the other refused its terms), so it is presented again
			// until its answer is final.
		case final.status != 0 && (strings.Contains(final.body, x402.ReasonValueMismatch) || strings.Contains(final.body, x402.ReasonInvalidPaymentRequirements)):
			// A reload changed the price since the offer was read: nothing was charged for this voucher, which
			// the next offer's price replaces.
			a.say("the terms changed under it; signing again from the next offer")
			return
		case final.status != 0 && deposit && !strings.Contains(final.body, x402.ReasonPaymentAlreadyUsed) &&
			!strings.Contains(final.body, x402.ReasonBatchCumulativeAmountMismatch):
			// A deposit refused (its transaction refused by the node, say) charged nothing: a new one follows.
			a.say("the deposit was refused; a new one follows")
			time.Sleep(200 * time.Millisecond)
			return
		case final.status != 0:
			b.violate("%s: an honest voucher for cumulative %d of channel %s (action #%d) was answered %s: its response was never delivered",
				l.name, cum, l.id.Hex()[:10], a.n, final)
			l.stopped = true
			return
		}
		if !retry || time.Now().After(giveUp) {
			b.violate("%s: the voucher for cumulative %d of channel %s (action #%d) had no final answer by the end of quiescence", l.name, cum, l.id.Hex()[:10], a.n)
			l.stopped = true
			return
		}
		if next := cum + price.Int64(); !paidAhead && !deposit && next <= l.deposited && rng.IntN(2) == 0 {
			// The voucher may have been accepted and its response lost: the payer pays its next request with the
			// next voucher first, and presents this one again after it, below the channel's amount by then. It is
			// answered from its record, charged nothing more; refused, its payer was charged for nothing.
			paidAhead = true
			r.batchAhead(l, rng, a, c, next, until)
			if l.stopped {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
		gate = (gate + 1) % gates // a cluster's other gateway may answer it
	}
}

// batchAhead pays the next voucher, for cumulative next, while the lane's current one has no final answer, and
// presents it until its answer is final. Delivered, it is the lane's latest; refused, the current voucher was not
// accepted (the channel stands below it, so the next one skips an amount) or the terms changed since the offer.
func (r *invRun) batchAhead(l *invBatchLane, rng *rand.Rand, a *invAction, c *batchChannel, next int64, until time.Time) {
	gates := len(r.w.gateways)
	gate := rng.IntN(gates)
	value := c.voucher(next)
	method, path := http.MethodGet, []string{"/batch/a", "/batch/b"}[rng.IntN(2)]
	for giveUp := until.Add(2 * time.Minute); ; {
		ans := r.presentBatch(gate, method, path, value)
		a.say("ahead of it: gw%d %s %s cumulative %d → %s", gate, method, path, next, ans)
		switch {
		case deliveredAs(ans, method, next):
			l.charged, l.delivered, l.aheads = next, l.delivered+1, l.aheads+1
			return
		case !batchRetry(ans):
			a.say("the next voucher was not accepted; the earlier one is presented again")
			return
		case time.Now().After(giveUp):
			r.w.batch.violate("%s: the voucher for cumulative %d of channel %s, paid ahead of an earlier one (action #%d), had no final answer by the end of quiescence",
				l.name, next, l.id.Hex()[:10], a.n)
			l.stopped = true
			return
		}
		time.Sleep(100 * time.Millisecond)
		gate = (gate + 1) % gates
	}
}

// replayBatch presents a delivered voucher again: it bought its response, so it is refused as used.
func (r *invRun) replayBatch(l *invBatchLane, rng *rand.Rand, a *invAction, value, method, path string) {
	gate := rng.IntN(len(r.w.gateways))
	ans := r.presentBatch(gate, method, path, value)
	a.say("presented again at gw%d → %s", gate, ans)
	l.replays++
	if ans.err == nil && ans.status == http.StatusOK {
		r.w.batch.violate("%s: the voucher for cumulative %d of channel %s, delivered, bought another response when presented again (action #%d)",
			l.name, l.charged, l.id.Hex()[:10], a.n)
	}
}

// settleBatch, once the run is quiet and before the gateways stop, waits for each channel's claims, has each
// payer refund the rest through a gateway, and judges the chain against what the lanes were served.
func (r *invRun) settleBatch() {
	b := r.w.batch
	served := int64(0)
	var parts []string
	for _, l := range b.lanes {
		served += l.charged
		parts = append(parts, fmt.Sprintf("%s %d vouchers delivered (%d raw units), %d presented again, %d paid ahead of an earlier one", l.name, l.delivered, l.charged, l.replays, l.aheads))
		if l.id == (common.Hash{}) {
			continue
		}
		c := r.laneChannel(l, x402.BatchRequirements{})
		deadline := time.Now().Add(90 * time.Second)
		for {
			balance, claimed := c.onChain()
			if claimed == l.charged {
				break
			}
			if time.Now().After(deadline) || claimed > l.charged {
				b.violate("%s: channel %s is claimed %d on chain (balance %d); its delivered vouchers reached %d", l.name, l.id.Hex()[:10], claimed, balance, l.charged)
				break
			}
			time.Sleep(250 * time.Millisecond)
		}
		if l.stopped || l.deposited == l.charged {
			continue
		}
		rq, err := r.batchOffer(0)
		if err != nil {
			b.violate("%s: no offer to refund under: %v", l.name, err)
			continue
		}
		c.rq = rq
		// Presented until final, at the gateways in turn: a gateway of a cluster may hold no wallet free right
		// now (no_available_wallets: try again in a second or two), and a refund sent and not yet mined is
		// answered from its record when presented again.
		var ans batchAnswer
		var s x402.BatchSettleResponse
		for i, giveUp := 0, time.Now().Add(time.Minute); ; i++ {
			ans, s = c.refundAt(r.w.gateways[i%len(r.w.gateways)].url+"/batch/a", l.charged)
			again := batchRetry(ans) || strings.Contains(ans.body, x402.ReasonNoAvailableWallets) || s.ErrorReason == x402.ReasonSettlementPending
			if !again || time.Now().After(giveUp) {
				break
			}
			time.Sleep(time.Second)
		}
		if ans.err != nil || ans.status != http.StatusOK || !s.Success || s.Amount != fmt.Sprint(l.deposited-l.charged) {
			b.violate("%s: the refund of the rest of channel %s (%d): %s %+v", l.name, l.id.Hex()[:10], l.deposited-l.charged, ans, s)
		}
	}
	after := r.batchBalances()
	deposited := int64(0)
	for _, l := range b.lanes {
		deposited += l.deposited
		if got := new(big.Int).Sub(b.before[l.addr], after[l.addr]).Int64(); !l.stopped && got != l.charged {
			b.violate("%s: the payer paid %d in all (deposits less its refund); its delivered vouchers reached %d", l.name, got, l.charged)
		}
	}
	if got := new(big.Int).Sub(after[invBatchSeller], b.before[invBatchSeller]).Int64(); got != served {
		b.violate("the batch route's seller received %d; the lanes' delivered vouchers reached %d", got, served)
	}
	if got := new(big.Int).Sub(after[contracts.BatchSettlementAddress], b.before[contracts.BatchSettlementAddress]).Int64(); got != 0 && !anyStopped(b.lanes) {
		b.violate("the escrow holds %d more than at the start, after every claim and refund", got)
	}
	b.summary = fmt.Sprintf("%s; %d deposited, %d claimed to the seller", strings.Join(parts, "; "), deposited, served)
}

func anyStopped(lanes []*invBatchLane) bool {
	for _, l := range lanes {
		if l.stopped {
			return true
		}
	}
	return false
}

func (r *invRun) checkBatch(*invEnd) ([]invViolation, string) {
	b := r.w.batch
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.violations, b.summary
}
