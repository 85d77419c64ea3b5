package e2e

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"math/big"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// drillPrice is the price of both drilled routes in raw units of the 6-decimal dev token ($0.01).
const drillPrice = 10000

// The shape of the drill. Every wait is generous: the drill runs on a loaded two-core machine, and no
// assertion is about time.
const (
	drillKills   = 20
	drillWorkers = 8
	// The clients pay for a random time in [drillMinLoad, drillMaxLoad) before each SIGKILL.
	drillMinLoad = 150 * time.Millisecond
	drillMaxLoad = 2 * time.Second
	// drillResolveWait bounds how long the payments cut by a kill are presented again after the restart; any
	// still without a final answer are presented again after the next restart.
	drillResolveWait = time.Minute
	// drillRetryPause is the pause before presenting again a payment whose answer was not final (502, no answer).
	drillRetryPause = 250 * time.Millisecond
	// drillDrainWait bounds how long the background settlements get to drain after the last kill.
	drillDrainWait = 2 * time.Minute
	// drillRequestTimeout is longer than the gate's own settlement timeout (2 minutes): a client that gives
	// up first would leave the gate working on a payment the drill then presents again.
	drillRequestTimeout = 3 * time.Minute
)

// drillSeedEnv replays a drill's kill points (the load before each kill); the seed is logged at the start.
const drillSeedEnv = "X402_DRILL_SEED"

// drillRoute is a paid route of the drilled gate.
type drillRoute struct {
	path, settle, content string
}

var drillRoutes = []drillRoute{
	{"/after", "after", "content of a payment settled before it left"},
	{"/async", "async", "content of a payment settled in the background"},
}

// TestEveryPaymentSettledThroughSIGKILLsBuysExactlyOneDeliveredResponse is a crash drill of the gate. A client
// pays from eight workers at once, each with its own freshly signed permit2 payments, alternating a `settle
// after` route and a `settle async` route, while the gate's Caddy is SIGKILLed twenty times at random moments
// (seeded: $X402_DRILL_SEED replays the kill points) and restarted on the same journal. After each restart,
// every payment whose client got no 200 is presented again until its answer is final: 200 with the content, or
// 402. The chain runs in a separate Caddy process that outlives the kills.
//
// In the end, once the background settlements have drained: the seller received the price once for each
// payment whose client got its content, to the unit, and the payer paid exactly that; no payment was answered
// payment_already_used unless its client had had its response; and presenting once more a payment that bought
// its response charges nothing more.
func TestEveryPaymentSettledThroughSIGKILLsBuysExactlyOneDeliveredResponse(t *testing.T) {
	runKillDrill(t, drillShape{})
}

// TestTheKillDrillThroughADryWalletAndNodeRestarts is the kill drill with the faults of the world around the
// gate: it settles from one wallet of its own, which the drill empties of gas money once the payments of one
// kill point are resolved, and funds again at the next, while the gate is down (every settlement in between is refused before it is sent, or
// waits), and the chain's node is SIGKILLed and restarted mid-load at every fifth kill point, which drops its
// transaction pool. The end is the same: what the seller received and the payer paid is, to the unit, the price of the
// responses delivered, and no refusal the payer was told of was ever charged.
func TestTheKillDrillThroughADryWalletAndNodeRestarts(t *testing.T) {
	runKillDrill(t, drillShape{ownWallet: true, dryAt: 6, fundAt: 7, restartNodeEvery: 5})
}

// drillShape says which faults of the world around the gate a kill drill adds to its SIGKILLs.
type drillShape struct {
	// ownWallet: the gate settles from one fresh wallet the drill funds, instead of the dev chain's wallets.
	ownWallet bool
	// dryAt and fundAt are the kill points at which the drill empties the own wallet of gas money (once the
	// payments that kill cut are resolved) and funds it again (while the gate is down).
	dryAt, fundAt int
	// restartNodeEvery > 0 restarts the chain's Caddy (the node, on its data_dir) in the middle of the load of
	// every kill point it divides.
	restartNodeEvery int
}

func runKillDrill(t *testing.T, shape drillShape) {
	needBinary(t)
	seed := drillSeed(t)
	rng := rand.New(rand.NewPCG(seed, seed))
	dir := t.TempDir()

	// block_time 0 seals a block per transaction, so settlements take milliseconds and each kill point finds
	// payments at every stage. Chain time then runs ahead of the wall clock, a second per block: the gate
	// offers payments valid for a day, and the client signs them at chain time.
	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	chainFile := writeFile(t, dir, "chain.Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
			data_dir %s
		}
	}
}
`, strings.TrimPrefix(chainURL, "http://"), filepath.Join(dir, "chain-data")))
	chainEnv := childEnv(t)
	chainProc := startProcess(t, "the dev chain's Caddy", dir, chainEnv, "run", "--adapter", "caddyfile", "--config", chainFile)
	dev := dialChain(t, chainURL)
	chainProc.waitUntil("the dev token minted to the demo payer", 60*time.Second, func() error {
		b, err := dev.tokenBalance(devchain.PayerAddress)
		if err == nil && b.Sign() == 0 {
			err = fmt.Errorf("the demo payer holds no token yet")
		}
		return err
	})
	// The payer approves Permit2 once, as a returning client has: its payments settle without gas sponsoring,
	// so its token balance moves by the prices alone.
	dev.approvePermit2(devchain.PayerKey(), devchain.TokenAddress)

	walletKeys := devchain.WalletKeys(devchain.DefaultWallets)
	if shape.ownWallet {
		own, err := crypto.GenerateKey()
		if err != nil {
			t.Fatal(err)
		}
		walletKeys = []*ecdsa.PrivateKey{own}
		dev.send(devchain.PayerKey(), crypto.PubkeyToAddress(own.PublicKey), drillWalletFunds, nil)
	}
	var keys []string
	var wallets []common.Address
	for _, k := range walletKeys {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
		wallets = append(wallets, crypto.PubkeyToAddress(k.PublicKey))
	}
	journalPath := filepath.Join(dir, "journal.db")
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	routes := ""
	for _, r := range drillRoutes {
		routes += fmt.Sprintf(`
	handle %s {
		x402 {
			price $0.01
			pay_to %s
			max_timeout 24h
			settle %s
		}
		respond %q
	}
`, r.path, seller.Hex(), r.settle, r.content)
	}
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
%s}
`, devchain.DefaultChainID, chainURL, devchain.TokenAddress.Hex(), strings.Join(keys, ","), journalPath, gateURL, routes))
	gateEnv := childEnv(t)
	startGate := func(name string) *process {
		p := startProcess(t, name, dir, gateEnv, "run", "--adapter", "caddyfile", "--config", gateFile)
		p.waitUntil("a 402 from the gate", 90*time.Second, answersWith(gateURL+drillRoutes[0].path, 402))
		return p
	}
	gate := startGate("the gate's Caddy")

	d := newDrill(t, dev, gateURL)
	d.wallets = wallets
	firstBlock := dev.head()
	payerStart, sellerStart := dev.balance(devchain.PayerAddress), dev.balance(seller)

	for k := 1; k <= drillKills; k++ {
		load := drillMinLoad + time.Duration(rng.Int64N(int64(drillMaxLoad-drillMinLoad)))
		stop := make(chan struct{})
		done := d.pay(k, d.chainTime(), stop)
		time.Sleep(load)
		nodeRestart := ""
		if shape.restartNodeEvery > 0 && k%shape.restartNodeEvery == 0 {
			// The node goes away under load and comes back with its blocks and an empty transaction pool.
			// SIGKILLed: a node on a data_dir keeps every block it sealed. (Not stopped with SIGINT: go-ethereum's
			// simulated beacon can panic sealing a block while the node shuts down under load, see the notes.)
			before, how := dev.head(), "SIGKILLed"
			started := time.Now()
			chainProc.kill()
			chainProc = startProcess(t, fmt.Sprintf("the dev chain's Caddy, restart at kill %d", k), dir, chainEnv,
				"run", "--adapter", "caddyfile", "--config", chainFile)
			chainProc.waitUntil("the restarted node's head", 60*time.Second, func() error {
				ctx, cancel := rpcContext()
				defer cancel()
				h, err := dev.client.BlockNumber(ctx)
				if err == nil && h < before {
					t.Fatalf("the node restarted at block %d, below the %d it had sealed", h, before)
				}
				return err
			})
			nodeRestart = fmt.Sprintf("; the node %s and restarted mid-load in %v", how, time.Since(started).Round(100*time.Millisecond))
		}
		close(stop)
		gate.kill()
		<-done
		if d.failed() {
			t.FailNow()
		}
		cut := d.tally(func(p *drillPayment) bool { return p.round == k })
		if shape.ownWallet && k == shape.fundAt {
			// Before the restart, so the payments the dry wallet left waiting resolve after it.
			nodeRestart += "; " + d.setWalletFunds(walletKeys[0], drillWalletFunds)
		}

		started := time.Now()
		gate = startGate(fmt.Sprintf("the gate's Caddy, restart %d", k))
		restart := time.Since(started)
		d.transport.CloseIdleConnections() // they led to the killed process
		again := d.resolve(drillResolveWait)
		t.Logf("kill %2d/%d after %v of load: %s%s; restarted in %v; presented again: %s", k, drillKills,
			load.Round(time.Millisecond), cut.load(), nodeRestart, restart.Round(100*time.Millisecond), again)
		if again.unresolved > 0 {
			// More kills would only pile up payments the gate does not answer; the end shows what became of them.
			t.Errorf("kill %d: %d payments got no final answer within %v of the restart; the drill stops killing", k, again.unresolved, drillResolveWait)
			break
		}
		if shape.ownWallet && k == shape.dryAt {
			// After the payments this kill cut were resolved, so none of them waits on a dry wallet: the next
			// load runs dry, and the next kill funds the wallet before its payments are presented again.
			t.Logf("after kill %d: %s", k, d.setWalletFunds(walletKeys[0], big.NewInt(0)))
		}
	}
	if final := d.resolve(2 * drillResolveWait); final.todo > 0 {
		t.Logf("after the last kill, presented again: %s", final)
	}

	delivered := d.count(func(p *drillPayment) bool { return p.delivered > 0 })
	total := d.tally(func(*drillPayment) bool { return true })
	t.Logf("in all: %s", total.load())
	price := big.NewInt(drillPrice)
	owed := new(big.Int).Mul(price, big.NewInt(int64(delivered)))
	drained := d.drain(new(big.Int).Add(sellerStart, owed))
	t.Logf("the background settlements drained: %s", drained)

	// Every payment that bought its response is presented once more, before the last balances are read. The
	// answer is payment_already_used, or its response once more when a kill came after the response was written
	// out and before it was recorded as served: the gate records a payment as served only once its response is
	// out, so that a crash never leaves a payer charged with nothing; the price is that such a payment, presented
	// again, is served again. Never charged again: the balances below would show it.
	again := d.presentDeliveredAgain()

	gate.stop()
	sellerGot, payerPaid := delta(sellerStart, dev.balance(seller)), new(big.Int).Neg(delta(payerStart, dev.balance(devchain.PayerAddress)))
	transfers := dev.transfers(devchain.PayerAddress, seller, firstBlock)
	charged := d.chargesInJournal(journalPath, transfers)
	t.Logf("%d payments, %d delivered a 200 with the content: owed %s; the seller received %s in %d transfers, the payer paid %s (chain time ran %v ahead of the wall clock)",
		len(d.payments), delivered, owed, sellerGot, len(transfers), payerPaid, time.Until(d.chainTime()).Round(time.Second))

	if sellerGot.Cmp(owed) != 0 {
		t.Errorf("the seller received %s, want exactly %s: %d payments delivered their response at %s each", sellerGot, owed, delivered, price)
	}
	if payerPaid.Cmp(owed) != 0 {
		t.Errorf("the payer paid %s, want exactly %s", payerPaid, owed)
	}
	for _, l := range transfers {
		if transferAmount(l).Cmp(price) != 0 {
			t.Errorf("transfer in %s moved %s, want %s", l.TxHash, transferAmount(l), price)
		}
	}
	d.report("were answered payment_already_used although their client never had a 200", func(p *drillPayment) bool {
		return p.used > 0 && p.delivered == 0
	})
	d.report("were charged on chain although their client never had a 200", func(p *drillPayment) bool {
		return charged[p] && p.delivered == 0
	})
	d.report("delivered their response but were never charged on chain", func(p *drillPayment) bool {
		return !charged[p] && p.delivered > 0
	})
	d.report("have no final answer", func(p *drillPayment) bool { return !p.done })
	if len(again) > 0 {
		t.Logf("%d of %d payments that had bought their response were served it again when presented once more at the end "+
			"(written out, then killed before recorded as served): #%s", len(again), delivered, strings.Join(again, ", #"))
	}
	chainProc.stop()
}

// drillSeed returns the seed of the kill points: $X402_DRILL_SEED, or a fresh one, logged for a replay.
func drillSeed(t *testing.T) uint64 { return seedFromEnv(t, drillSeedEnv, "kill points") }

// drill is the paying client of the drill and what it saw of every payment.
type drill struct {
	t         *testing.T
	dev       *devChain
	gateURL   string
	payer     *ecdsa.PrivateKey
	chainID   *big.Int
	offers    map[string]x402.PaymentRequirements // each route's permit2 requirement, by path
	transport *http.Transport
	client    *http.Client

	wallets []common.Address // the gate's settlement wallets

	mu       sync.Mutex
	payments []*drillPayment
	problem  error // a worker could not go on (signing failed); the test stops at the next kill
}

// drillPayment is one signed payment and every answer its presentations got. Only one goroutine presents a
// payment at a time, and the phases hand payments over through WaitGroups.
type drillPayment struct {
	n      int
	route  drillRoute
	header string
	from   string
	nonce  string
	round  int // the kill point during whose load it was first presented

	answers   []string // one line per presentation
	delivered int      // 200s with the route's content
	used      int      // 402 payment_already_used
	done      bool     // the last answer was final: 200 or 402
}

func (p *drillPayment) String() string {
	return fmt.Sprintf("payment #%d (%s, first presented before kill %d, nonce %s): %s", p.n, p.route.path, p.round,
		p.nonce, strings.Join(p.answers, "; "))
}

func newDrill(t *testing.T, dev *devChain, gateURL string) *drill {
	t.Helper()
	tr := &http.Transport{MaxIdleConnsPerHost: 2 * drillWorkers}
	t.Cleanup(tr.CloseIdleConnections)
	d := &drill{
		t: t, dev: dev, gateURL: gateURL, payer: devchain.PayerKey(),
		chainID: new(big.Int).SetUint64(devchain.DefaultChainID), offers: map[string]x402.PaymentRequirements{},
		transport: tr, client: &http.Client{Transport: tr, Timeout: drillRequestTimeout},
	}
	for _, r := range drillRoutes {
		d.offers[r.path] = permit2Offer(t, gateURL+r.path)
	}
	return d
}

// permit2Offer reads the permit2 requirement of url's 402, as a client does before it signs.
func permit2Offer(t *testing.T, url string) x402.PaymentRequirements {
	t.Helper()
	a, err := get(url)
	if err != nil {
		t.Fatal(err)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != 402 || err != nil {
		t.Fatalf("unpaid GET %s: status %d, PAYMENT-REQUIRED %v; want 402 with an offer", url, a.status, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
			return rq
		}
	}
	t.Fatalf("%s offers no permit2 requirement: %+v", url, pr.Accepts)
	return x402.PaymentRequirements{}
}

// chainTime is the time of the chain's head block, which the client signs by.
func (d *drill) chainTime() time.Time {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	h, err := d.dev.client.HeaderByNumber(ctx, nil)
	if err != nil {
		d.t.Fatalf("reading the chain's head: %v", err)
	}
	return time.Unix(int64(h.Time), 0)
}

// sign signs a new payment for route, dated now.
func (d *drill) sign(route drillRoute, round int, now time.Time) (*drillPayment, error) {
	// Each payment draws a random Permit2 nonce: one payer signs any number of distinct payments.
	pl, err := chain.SignPermit2Payment(d.payer, d.offers[route.path], d.chainID, chain.Permit2Options{Now: now})
	if err != nil {
		return nil, fmt.Errorf("signing a payment for %s: %w", route.path, err)
	}
	header, err := x402.EncodeHeader(pl)
	if err != nil {
		return nil, err
	}
	a := pl.Payload.Permit2Authorization
	d.mu.Lock()
	defer d.mu.Unlock()
	p := &drillPayment{n: len(d.payments) + 1, route: route, header: header, from: a.From, nonce: a.Nonce, round: round}
	d.payments = append(d.payments, p)
	return p, nil
}

// pay starts the workers, each paying new payments one after another, alternating the routes, until stop is
// closed. The returned channel is closed once every worker has returned.
func (d *drill) pay(round int, now time.Time, stop <-chan struct{}) <-chan struct{} {
	var wg sync.WaitGroup
	for w := range drillWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				p, err := d.sign(drillRoutes[i%len(drillRoutes)], round, now)
				if err != nil {
					d.mu.Lock()
					d.problem = err
					d.mu.Unlock()
					d.t.Error(err)
					return
				}
				d.present(context.Background(), p)
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}

func (d *drill) failed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.problem != nil
}

// present sends the payment to its route once and records the answer; it reports whether the answer is
// final: a 200 with the content, or a 402.
func (d *drill) present(ctx context.Context, p *drillPayment) bool {
	answer, final := d.ask(ctx, p)
	p.answers = append(p.answers, answer)
	p.done = final
	return final
}

func (d *drill) ask(ctx context.Context, p *drillPayment) (string, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.gateURL+p.route.path, nil)
	if err != nil {
		return err.Error(), false
	}
	req.Header.Set(x402.HeaderPaymentSignature, p.header)
	resp, err := d.client.Do(req)
	if err != nil {
		// A GET cut on a kept-alive connection is replayed by the transport, as any Go client's is: the error
		// is then the replay's (connection refused), though the killed gate did receive the payment.
		return "no answer (" + shorten(err.Error()) + ")", false
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		framing := fmt.Sprintf("Content-Length %d", resp.ContentLength)
		if len(resp.TransferEncoding) > 0 {
			framing = "Transfer-Encoding " + strings.Join(resp.TransferEncoding, ", ")
		}
		return fmt.Sprintf("%d, its body cut after %d bytes (%s; %s)", resp.StatusCode, len(body), framing, shorten(err.Error())), false
	case resp.StatusCode == http.StatusOK && string(body) == p.route.content:
		p.delivered++
		return "200", true
	case resp.StatusCode == http.StatusOK:
		d.t.Errorf("payment #%d: 200 with body %q, want the content of %s", p.n, shorten(string(body)), p.route.path)
		return fmt.Sprintf("200 with body %q", shorten(string(body))), false
	case resp.StatusCode == http.StatusPaymentRequired:
		pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			d.t.Errorf("payment #%d: a 402 without a readable PAYMENT-REQUIRED: %v", p.n, err)
			return "402 without PAYMENT-REQUIRED", false
		}
		if strings.HasPrefix(pr.Error, x402.ReasonPaymentAlreadyUsed) {
			p.used++
		}
		return "402 " + shorten(pr.Error), true
	default:
		return fmt.Sprintf("%d %s", resp.StatusCode, shorten(string(body))), false
	}
}

// shorten keeps an answer's text short enough to list many of them.
func shorten(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > 160 {
		s = s[:160] + "..."
	}
	return s
}

// resolve presents again, at the client's concurrency, every payment without a final answer, each until its
// answer is final or wait has passed.
func (d *drill) resolve(wait time.Duration) drillTally {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var todo []*drillPayment
	d.mu.Lock()
	for _, p := range d.payments {
		if !p.done {
			todo = append(todo, p)
		}
	}
	d.mu.Unlock()
	before := make(map[*drillPayment]drillPayment, len(todo))
	for _, p := range todo {
		before[p] = *p
	}

	queue := make(chan *drillPayment)
	var wg sync.WaitGroup
	for range drillWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range queue {
				for ctx.Err() == nil && !d.present(ctx, p) {
					select {
					case <-ctx.Done():
					case <-time.After(drillRetryPause):
					}
				}
			}
		}()
	}
	for _, p := range todo {
		queue <- p
	}
	close(queue)
	wg.Wait()

	tl := drillTally{todo: len(todo)}
	for _, p := range todo {
		was := before[p]
		switch {
		case !p.done:
			tl.unresolved++
		case p.delivered > was.delivered:
			tl.delivered++
		case p.used > was.used:
			tl.used++
		default:
			tl.refused++
			tl.reasons = append(tl.reasons, p.answers[len(p.answers)-1])
		}
	}
	return tl
}

// drillTally counts what became of a set of payments.
type drillTally struct {
	byRoute   map[string]int
	presented int
	delivered int
	// After a restart: how many payments were presented again, and their final answers.
	todo, refused, used, unresolved int
	reasons                         []string
}

func (tl drillTally) load() string {
	var routes []string
	for _, r := range drillRoutes {
		routes = append(routes, fmt.Sprintf("%s %d", r.path, tl.byRoute[r.path]))
	}
	return fmt.Sprintf("%d payments presented (%s), %d answered 200, %d without a 200", tl.presented,
		strings.Join(routes, ", "), tl.delivered, tl.presented-tl.delivered)
}

func (tl drillTally) String() string {
	s := fmt.Sprintf("%d payments: %d delivered, %d refused with 402, %d payment_already_used, %d unresolved",
		tl.todo, tl.delivered, tl.refused, tl.used, tl.unresolved)
	if len(tl.reasons) > 0 {
		s += " (refused: " + strings.Join(tl.reasons, "; ") + ")"
	}
	return s
}

// tally counts the payments that match, and how many delivered their response.
func (d *drill) tally(match func(*drillPayment) bool) drillTally {
	d.mu.Lock()
	defer d.mu.Unlock()
	tl := drillTally{byRoute: map[string]int{}}
	for _, p := range d.payments {
		if match(p) {
			tl.presented++
			tl.byRoute[p.route.path]++
			if p.delivered > 0 {
				tl.delivered++
			}
		}
	}
	return tl
}

func (d *drill) count(match func(*drillPayment) bool) int {
	return d.tally(match).presented
}

// report fails the test with the payments that match, listing the first few with their answers.
func (d *drill) report(what string, match func(*drillPayment) bool) {
	d.t.Helper()
	var found []*drillPayment
	d.mu.Lock()
	for _, p := range d.payments {
		if match(p) {
			found = append(found, p)
		}
	}
	d.mu.Unlock()
	if len(found) == 0 {
		return
	}
	var lines []string
	for i, p := range found {
		if i == 10 {
			lines = append(lines, fmt.Sprintf("... and %d more", len(found)-i))
			break
		}
		lines = append(lines, "  "+p.String())
	}
	d.t.Errorf("%d of %d payments %s:\n%s", len(found), len(d.payments), what, strings.Join(lines, "\n"))
}

// drain waits until the seller holds want and no settlement wallet has a transaction waiting, or, when the
// seller already holds more than want, until the balance has stopped moving; at most drillDrainWait.
func (d *drill) drain(want *big.Int) string {
	start := time.Now()
	var last *big.Int
	changed := start
	for {
		b, err := d.dev.tokenBalance(seller)
		if err == nil {
			if last == nil || b.Cmp(last) != 0 {
				last, changed = b, time.Now()
			}
			switch c := b.Cmp(want); {
			case c == 0 && d.walletsIdle():
				return fmt.Sprintf("the seller holds the %s owed, after %v", want, time.Since(start).Round(100*time.Millisecond))
			case c > 0 && time.Since(changed) > 15*time.Second && d.walletsIdle():
				return fmt.Sprintf("the seller holds %s, more than the %s owed, unchanged for 15s", b, want)
			}
		}
		if time.Since(start) > drillDrainWait {
			return fmt.Sprintf("not within %v: the seller holds %s (%v), %s owed", drillDrainWait, last, err, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// walletsIdle reports whether no settlement wallet has a transaction sent and not mined.
func (d *drill) walletsIdle() bool { return d.dev.walletsIdle(d.wallets) }

// presentDeliveredAgain presents once more every payment that bought its response; the answer must be 402
// payment_already_used or the response again. It returns the numbers of the payments served again.
func (d *drill) presentDeliveredAgain() []string {
	var delivered []*drillPayment
	d.mu.Lock()
	for _, p := range d.payments {
		if p.delivered > 0 {
			delivered = append(delivered, p)
		}
	}
	d.mu.Unlock()
	queue := make(chan *drillPayment)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var twice []string
	for range drillWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range queue {
				ctx, cancel := context.WithTimeout(context.Background(), drillRequestTimeout)
				before := p.delivered
				d.present(ctx, p)
				cancel()
				if p.delivered > before {
					mu.Lock()
					twice = append(twice, strconv.Itoa(p.n))
					mu.Unlock()
				} else if p.used == 0 {
					d.t.Errorf("payment #%d presented once more after its 200: %s; want 402 %s or the response again", p.n,
						p.answers[len(p.answers)-1], x402.ReasonPaymentAlreadyUsed)
				}
			}
		}()
	}
	for _, p := range delivered {
		queue <- p
	}
	close(queue)
	wg.Wait()
	return twice
}

// chargesInJournal opens the journal the gates left and finds which payments the transfers on chain charged,
// by the settlement transactions the journal recorded for each. Every transfer must belong to one payment,
// and no settlement may be left pending.
func (d *drill) chargesInJournal(path string, transfers []types.Log) map[*drillPayment]bool {
	d.t.Helper()
	onChain := map[common.Hash]bool{}
	for _, l := range transfers {
		onChain[l.TxHash] = true
	}
	store, err := journal.OpenBolt(path, journal.Options{})
	if err != nil {
		d.t.Fatalf("opening the journal the gate left: %v", err)
	}
	defer store.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pending, err := store.Pending(ctx)
	if err != nil {
		d.t.Fatal(err)
	}
	// The engine's record of a payment and the gate's, the same id with the method marked as the gate's.
	methods := []string{x402.TransferPermit2, "gate/" + x402.TransferPermit2}
	ids := map[journal.ID]string{}
	for _, p := range d.payments {
		rq := d.offers[p.route.path]
		for _, m := range methods {
			ids[journal.PaymentID(rq.Network, m, rq.Asset, p.from, p.nonce)] = fmt.Sprintf("the %s record of payment #%d", m, p.n)
		}
	}
	var unsettled []string
	leftClaimed := 0
	for _, r := range pending {
		if r.State == journal.StateClaimed && !r.Async && r.Served && r.Response != nil && r.Response.Success {
			// A gate record claimed, never made final, then settled and served when presented again: its
			// payment is done, only the record's state lags.
			leftClaimed++
			continue
		}
		if len(unsettled) == 10 {
			unsettled = append(unsettled, "...")
			break
		}
		unsettled = append(unsettled, fmt.Sprintf("  %s: %s, async %v, served %v, tx %q, response %+v", cmp.Or(ids[r.ID], r.ID.String()),
			r.State, r.Async, r.Served, r.TxHash, r.Response))
	}
	if len(unsettled) > 0 {
		d.t.Errorf("after the drain, the journal still holds payments whose settlement is not final:\n%s", strings.Join(unsettled, "\n"))
	}
	if leftClaimed > 0 {
		d.t.Logf("note: the journal lists %d served and settled payments as pending: their gate record stayed %s", leftClaimed, journal.StateClaimed)
	}
	charged := map[*drillPayment]bool{}
	claimed := map[common.Hash]*drillPayment{}
	for _, p := range d.payments {
		rq := d.offers[p.route.path]
		for _, method := range methods {
			rec, found, err := store.Get(ctx, journal.PaymentID(rq.Network, method, rq.Asset, p.from, p.nonce))
			if err != nil {
				d.t.Fatalf("reading payment #%d from the journal: %v", p.n, err)
			}
			if !found {
				continue
			}
			candidates := append([]string{rec.TxHash}, rec.ReplacedTxHashes...)
			if rec.Response != nil {
				candidates = append(candidates, rec.Response.Transaction)
			}
			for _, h := range candidates {
				tx := common.HexToHash(h)
				if h == "" || !onChain[tx] {
					continue
				}
				if other := claimed[tx]; other != nil && other != p {
					d.t.Errorf("transaction %s is recorded as the settlement of payments #%d and #%d", tx, other.n, p.n)
				}
				claimed[tx], charged[p] = p, true
			}
		}
	}
	for tx := range onChain {
		if claimed[tx] == nil {
			d.t.Errorf("transfer %s to the seller belongs to no payment the journal knows", tx)
		}
	}
	return charged
}

// drillWalletFunds is the gas money of the drill's own settlement wallet: far more than the drill spends.
var drillWalletFunds = new(big.Int).Mul(big.NewInt(10), big.NewInt(1e18))

// setWalletFunds moves the own settlement wallet's ETH balance to want (0: all it can spare, leaving it unable
// to pay for a settlement), from or to the demo payer, and says what it did. The gate is down meanwhile; the
// wallet may have settlements waiting in the node's pool, which a dry wallet then cannot pay for either.
func (d *drill) setWalletFunds(key *ecdsa.PrivateKey, want *big.Int) string {
	d.t.Helper()
	w := crypto.PubkeyToAddress(key.PublicKey)
	have := d.dev.ether(w)
	if want.Sign() > 0 {
		if have.Cmp(want) < 0 {
			d.dev.send(devchain.PayerKey(), w, new(big.Int).Sub(want, have), nil)
		}
		return fmt.Sprintf("the settlement wallet funded again (%s wei)", d.dev.ether(w))
	}
	// All but the transfer's own fee: a plain transfer of 21,000 gas at twice the base fee plus a 1 gwei tip,
	// signed here rather than by send, whose gas estimate wants the whole balance free.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Settlements the gate sent may still wait in the pool, and the pool counts their cost against the balance:
	// read it once none has been waiting for half a second (the background settlements have drained).
	for idleSince := time.Now(); time.Since(idleSince) < 500*time.Millisecond; time.Sleep(20 * time.Millisecond) {
		if ctx.Err() != nil {
			d.t.Fatalf("the settlement wallet still has transactions waiting after 30s")
		}
		if !d.walletsIdle() {
			idleSince = time.Now()
		}
	}
	have = d.dev.ether(w)
	head, err := d.dev.client.HeaderByNumber(ctx, nil)
	if err != nil {
		d.t.Fatalf("reading the head block: %v", err)
	}
	nonce, err := d.dev.client.PendingNonceAt(ctx, w)
	if err != nil {
		d.t.Fatalf("reading the nonce of %s: %v", w, err)
	}
	tip := big.NewInt(1_000_000_000)
	feeCap := new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)
	spare := new(big.Int).Sub(have, new(big.Int).Mul(feeCap, big.NewInt(21_000)))
	if spare.Sign() > 0 {
		to := crypto.PubkeyToAddress(d.payer.PublicKey)
		tx, err := types.SignNewTx(key, types.LatestSignerForChainID(d.chainID), &types.DynamicFeeTx{
			ChainID: d.chainID, Nonce: nonce, GasTipCap: tip, GasFeeCap: feeCap, Gas: 21_000, To: &to, Value: spare,
		})
		if err != nil {
			d.t.Fatalf("signing the transfer that empties the settlement wallet: %v", err)
		}
		d.dev.sendSigned(ctx, tx, "that empties the settlement wallet")
	}
	return fmt.Sprintf("the settlement wallet emptied (%s wei left)", d.dev.ether(w))
}
