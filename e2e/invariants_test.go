package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The money-invariant run: real Caddy processes on a dev chain, every feature at once, driven by seeded random
// actions and faults, then judged on chain against what the clients saw. See docs/RELIABILITY.md.
//
// Its knobs are environment variables: the seed, how long each topology is driven, which topologies run, which
// faults are drawn (X402_INVARIANT_FAULTS: words, comma-separated; only the faults whose names hold one), and where
// the action log goes. Without them it runs both topologies for a short time with a fresh seed, as CI does.
const (
	invSeedEnv     = "X402_INVARIANT_SEED"
	invDurationEnv = "X402_INVARIANT_DURATION"
	invTopologyEnv = "X402_INVARIANT_TOPOLOGY"
	invLogsEnv     = "X402_INVARIANT_LOGS"
	invFaultsEnv   = "X402_INVARIANT_FAULTS"
)

// invDefaultDuration is how long each topology is driven without X402_INVARIANT_DURATION: the run stays within
// a few minutes of CI on two cores, start-up, quiescence and checks included.
const invDefaultDuration = 30 * time.Second

// invTopology is a shape of the system the run drives.
type invTopology struct {
	name     string
	key      string // what X402_INVARIANT_TOPOLOGY calls it
	gateways int
	postgres bool
	workers  int // paying clients at once
	// wallets is how many settlement wallets the gateways share (invGatewayWallets when 0): fewer than gateways,
	// one of them holds none, and its settlements are handed to those that do.
	wallets int
}

var invTopologies = []invTopology{
	{name: "one gateway on bbolt", key: "one", gateways: 1, workers: 3},
	{name: "three gateways on one PostgreSQL", key: "three", gateways: 3, postgres: true, workers: 4},
	{name: "three gateways on one PostgreSQL sharing two wallets", key: "scarce", gateways: 3, postgres: true, workers: 4, wallets: 2},
}

// TestMoneyInvariantsHoldUnderARandomizedRunOfEveryFeature drives real Caddy processes (one gateway on bbolt,
// then three on one PostgreSQL), on one `caddy x402 devchain`, behind a fault proxy on its RPC, with every kind
// of paid route (exact permit2, eip3009 and erc2612; upto behind an upstream naming its charges; settle before,
// after and async; a price set per request with price_grace; large and small files; a WebSocket upstream; two
// remote facilitators as a failover set; access sold by sign-in-with-x), by seeded random actions (pay; present
// a payment again to the same resource, another of its route, another route, another gateway, several at once; in
// every request shape; sign in with x, past the grant, as a wallet that never paid, for another resource) and
// faults (SIGKILL and restart of a gateway or a facilitator, a graceful stop and restart of a gateway, a reload that changes prices, RPC 503s, hangs and
// lost answers, PostgreSQL stopped). After quiescence it checks the money invariants on chain against the
// clients' own records; a violation names the payments and the actions behind it, and the seed that draws them.
func TestMoneyInvariantsHoldUnderARandomizedRunOfEveryFeature(t *testing.T) {
	needBinary(t)
	seed := seedFromEnv(t, invSeedEnv, "the run's actions and faults")
	duration := invDefaultDuration
	if v := os.Getenv(invDurationEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("$%s=%q: want a positive Go duration such as 2m", invDurationEnv, v)
		}
		duration = d
	}
	topologies := invTopologies
	if v := os.Getenv(invTopologyEnv); v != "" {
		topologies = nil
		for _, topo := range invTopologies {
			if strings.Contains(","+v+",", ","+topo.key+",") {
				topologies = append(topologies, topo)
			}
		}
		if len(topologies) == 0 {
			t.Fatalf("$%s=%q names no topology; want one or more of one, three, scarce (comma-separated)", invTopologyEnv, v)
		}
	}
	for i, topo := range topologies {
		t.Run(topo.key, func(t *testing.T) {
			runInvariants(t, topo, seed+uint64(i), duration)
		})
	}
}

// invRun is one topology's run: its world, its clients, and everything they did and saw.
type invRun struct {
	t        *testing.T
	w        *invWorld
	topo     invTopology
	seed     uint64
	duration time.Duration // of the actions
	began    time.Time     // the topology's start, world start-up included
	start    time.Time     // the first action
	client   *invClient
	logf     *os.File

	transports []*invTransport
	heads      headSampler

	erc2612 sync.Mutex // held while an erc2612 payment is signed: see invWorker.sign

	mu       sync.Mutex
	payments []*invPayment
	actions  []*invAction
	kills    []invEvent // SIGKILLs of gateways
	stops    []invStop  // graceful stops of gateways: no crash (see tunnelCutByStop)
	outages  []invEvent // PostgreSQL down, or the way to it hung, or a gateway paused
	reloads  []invEvent // the gateways ran other prices
	counts   map[string]int

	siwx    invSiwx    // the sign-in-with-x lane (invariants_siwx_test.go)
	browser invBrowser // the paywall pages the browser lane read (invariants_browser_test.go)
}

// invEvent is a fault's span, and the gateway it hit (-1 for none).
type invEvent struct {
	gate     int
	from, to time.Time
}

// invStop is a graceful stop of a gateway (SIGINT or SIGTERM, as an operator's `systemctl stop` sends): its span
// from the signal to the gateway serving again, the fault action that drew it, and how its process went.
type invStop struct {
	invEvent
	action int
	signal string
	exited time.Time // when the process was gone: by itself, or SIGKILLed past invStopBound
	killed bool      // it had not exited within invStopBound and was SIGKILLed (that kill is among r.kills)
	err    error     // its exit error, when it exited by itself (nil: exit status 0)
}

// invAction is one action of a worker (or a fault, or a presentation during quiescence) and what came of it.
type invAction struct {
	n      int
	worker string
	kind   string
	at     time.Duration // since the first action
	mu     sync.Mutex
	lines  []string
}

// say adds a line to the action's record.
func (a *invAction) say(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.lines = append(a.lines, fmt.Sprintf(format, args...))
}

func (a *invAction) String() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return fmt.Sprintf("%8.3fs %-3s #%d %s: %s", a.at.Seconds(), a.worker, a.n, a.kind, strings.Join(a.lines, "; "))
}

func runInvariants(t *testing.T, topo invTopology, seed uint64, duration time.Duration) {
	began := time.Now()
	t.Logf("%s: seed %d, %v of actions (%s=%d %s=%s %s=%s replays the draws)", topo.name, seed, duration,
		invSeedEnv, seed, invTopologyEnv, topo.key, invDurationEnv, duration)
	w := startWorld(t, topo)
	r := &invRun{t: t, w: w, topo: topo, seed: seed, duration: duration, began: began, client: newInvClient(), counts: map[string]int{}}
	t.Cleanup(r.client.closeIdle)
	r.openLog()
	for n := range topo.workers {
		r.transports = append(r.transports, r.newTransport(n))
	}
	startBalances := r.readBalances()
	w.batch.before = r.batchBalances()

	sampling := make(chan struct{})
	go r.heads.run(w.dev, sampling)
	r.start = time.Now()
	until := r.start.Add(duration)
	var wg sync.WaitGroup
	for n := range topo.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.work(n, until)
		}()
	}
	for _, l := range w.batch.lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.batchLane(l, until)
		}()
	}
	progress := make(chan struct{})
	go r.reportProgress(progress)
	r.injectFaults(until, rand.New(rand.NewPCG(seed, 0xfa017)))
	wg.Wait()
	close(progress)
	acted := time.Since(r.start)

	quiet := time.Now()
	resolved := r.quiesce()
	drained := r.drain(invDrainWait)
	r.settleBatch()
	for _, g := range w.gateways {
		g.stop()
	}
	for _, f := range w.facilitators {
		f.stop()
	}
	t.Logf("%s: %d actions in %v (%s); quiescence in %v: %s; %s; the fault proxy saw %s", topo.name, len(r.actions),
		acted.Round(100*time.Millisecond), r.describeCounts(), time.Since(quiet).Round(100*time.Millisecond), resolved, drained, w.proxy.tally())

	close(sampling)
	end := r.readEnd(startBalances)
	end.drained = drained
	r.runChecks(end)
}

// openLog opens the action log: every action is written there as it ends.
func (r *invRun) openLog() {
	dir := os.Getenv(invLogsEnv)
	if dir == "" {
		dir = os.Getenv("X402_E2E_LOGS")
	}
	if dir == "" {
		dir = os.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		r.t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(dir, fmt.Sprintf("invariants-%s-%d.log", r.topo.key, r.seed)))
	if err != nil {
		r.t.Fatal(err)
	}
	r.logf = f
	r.t.Cleanup(func() {
		f.Close()
		if !r.t.Failed() && os.Getenv(invLogsEnv) == "" {
			os.Remove(f.Name())
		}
	})
}

// begin starts an action of worker ("w0".., "F" for faults, "Q" for quiescence).
func (r *invRun) begin(worker, kind string) *invAction {
	r.mu.Lock()
	defer r.mu.Unlock()
	a := &invAction{n: len(r.actions) + 1, worker: worker, kind: kind, at: time.Since(r.start)}
	r.actions = append(r.actions, a)
	r.counts[kind]++
	return a
}

// finish writes the action to the log.
func (r *invRun) finish(a *invAction) {
	fmt.Fprintln(r.logf, a.String())
}

func (r *invRun) describeCounts() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var keys []string
	for k := range r.counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d× %s", r.counts[k], k))
	}
	return strings.Join(parts, ", ")
}

// reportProgress logs where the run is every ten seconds, until done closes.
func (r *invRun) reportProgress(done <-chan struct{}) {
	tick := time.NewTicker(10 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-done:
			return
		case <-tick.C:
			r.mu.Lock()
			n, actions := len(r.payments), len(r.actions)
			r.mu.Unlock()
			delivered := 0
			for _, p := range r.snapshot() {
				if p.delivered() > 0 {
					delivered++
				}
			}
			r.t.Logf("%s: %v: %d actions, %d payments, %d delivered", r.topo.name, time.Since(r.start).Round(time.Second), actions, n, delivered)
		}
	}
}

// snapshot is the payments so far.
func (r *invRun) snapshot() []*invPayment {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*invPayment(nil), r.payments...)
}

// invWorker is one paying client: its own draws, its own payer.Transport.
type invWorker struct {
	r    *invRun
	n    int
	name string
	rng  *rand.Rand
}

// invActionKind is a kind of action a worker draws. Adding one is adding a row.
type invActionKind struct {
	name   string
	weight func(t invTopology) int
	do     func(w *invWorker, a *invAction)
}

func weight(n int) func(invTopology) int { return func(invTopology) int { return n } }

func clusterOnly(n int) func(invTopology) int {
	return func(t invTopology) int {
		if t.gateways > 1 {
			return n
		}
		return 0
	}
}

var invActionKinds = []invActionKind{
	{"pay", weight(30), (*invWorker).pay},
	{"pay through payer.Transport", weight(5), (*invWorker).payThroughTransport},
	{"present again to the same resource", weight(8), (*invWorker).againSame},
	{"present again to another resource of its route", weight(10), (*invWorker).againOtherResource},
	{"present again to another route", weight(3), (*invWorker).againOtherRoute},
	{"present again to another gateway", clusterOnly(6), (*invWorker).againOtherGateway},
	{"present again, several at once", weight(4), (*invWorker).againConcurrently},
	{"sign in with x", weight(8), (*invWorker).signInWithX},
}

// work runs a worker's actions until the time is up.
func (r *invRun) work(n int, until time.Time) {
	w := &invWorker{r: r, n: n, name: fmt.Sprintf("w%d", n), rng: rand.New(rand.NewPCG(r.seed, uint64(n)+1))}
	total := 0
	for _, k := range invActionKinds {
		total += k.weight(r.topo)
	}
	for time.Now().Before(until) {
		if !r.anyGatewayUp() {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		began := time.Now()
		pick := w.rng.IntN(total)
		for _, k := range invActionKinds {
			if pick -= k.weight(r.topo); pick < 0 {
				a := r.begin(w.name, k.name)
				k.do(w, a)
				r.finish(a)
				break
			}
		}
		if time.Since(began) < 5*time.Millisecond {
			// Nothing reached a gateway (it is down): no use drawing actions faster than it comes back.
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// anyGatewayUp reports whether a gateway runs.
func (r *invRun) anyGatewayUp() bool {
	for _, g := range r.w.gateways {
		if g.running() {
			return true
		}
	}
	return false
}

// pickGate draws a gateway.
func (w *invWorker) pickGate() int { return w.rng.IntN(len(w.r.w.gateways)) }

// pickRoute draws a route kind, or one that keep accepts.
func (w *invWorker) pickRoute(keep func(*routeKind) bool) *routeKind {
	var fit []*routeKind
	for _, rk := range w.r.w.routes {
		if keep == nil || keep(rk) {
			fit = append(fit, rk)
		}
	}
	return fit[w.rng.IntN(len(fit))]
}

// pickPayer draws a payer to sign for rk: one of those the workers sign with directly (the last one is the
// payer.Transports'). An erc2612 permit takes the token's next nonce, so a payer with an erc2612 payment that
// has not delivered yet signs no other: nil when every payer has one.
func (w *invWorker) pickPayer(rk *routeKind) *invPayer {
	if rk.gasSponsoring != "" {
		return w.r.w.sponsored[w.rng.IntN(len(w.r.w.sponsored))]
	}
	payers := w.r.w.payers[:len(w.r.w.payers)-1]
	start := w.rng.IntN(len(payers))
	if rk.method != x402.TransferERC2612 {
		return payers[start]
	}
	busy := map[*invPayer]bool{}
	for _, p := range w.r.snapshot() {
		if p.route.method == x402.TransferERC2612 && p.delivered() == 0 {
			busy[p.payer] = true
		}
	}
	for i := range payers {
		if pp := payers[(start+i)%len(payers)]; !busy[pp] {
			return pp
		}
	}
	return nil
}

// pickPayment draws a payment to present again: mostly one that has not delivered its response yet (cut short,
// unanswered, refused), else any; nil when there is none yet.
func (w *invWorker) pickPayment() *invPayment {
	all := w.r.snapshot()
	if len(all) == 0 {
		return nil
	}
	var open []*invPayment
	for _, p := range all {
		if p.delivered() == 0 {
			open = append(open, p)
		}
	}
	if len(open) > 0 && w.rng.IntN(3) < 2 {
		return open[w.rng.IntN(len(open))]
	}
	return all[w.rng.IntN(len(all))]
}

// present sends payment p to gateway gate for res in shape and records the answer with the action.
func (r *invRun) present(a *invAction, p *invPayment, gate int, res invResource, shape string, draw float64) *invAnswer {
	ctx, cancel := context.WithTimeout(context.Background(), invRequestTimeout)
	defer cancel()
	ans := r.send(ctx, p, r.w.gateways[gate].url, res, shape, draw)
	ans.action, ans.gate = a.n, gate
	p.record(ans)
	a.say("payment #%d → %s", p.n, ans)
	return ans
}

// pay signs a new payment for a resource of a route, read from the gateway's 402, and presents it there.
func (w *invWorker) pay(a *invAction) {
	rk := w.pickRoute(nil)
	path := rk.paths[w.rng.IntN(len(rk.paths))]
	shape := pickShape(w.rng, rk, path, "")
	gate, draw, useDraw := w.pickGate(), w.rng.Float64(), rand.New(rand.NewPCG(w.rng.Uint64(), 7))
	res := invResource{shapeMethod(shape), path}
	p, err := w.sign(rk, res, shape, gate, useDraw)
	if err != nil {
		a.say("gw%d %s: %v", gate, res, shorten(err.Error()))
		return
	}
	w.r.present(a, p, gate, res, shape, 0.05+0.35*draw)
}

// sign signs and registers a payment for res of rk at gateway gate, by a payer drawn for it.
func (w *invWorker) sign(rk *routeKind, res invResource, shape string, gate int, useDraw *rand.Rand) (*invPayment, error) {
	r := w.r
	if rk.method == x402.TransferERC2612 {
		// Choosing a payer whose erc2612 payments have all delivered, signing with the token's next nonce and
		// registering the payment go together: two payments signed with one nonce would be a dishonest payer.
		r.erc2612.Lock()
		defer r.erc2612.Unlock()
	}
	pp := w.pickPayer(rk)
	if pp == nil {
		return nil, errors.New("every payer has an erc2612 payment open; nothing signed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	asked := time.Now()
	read := r.readOffer
	if browserShape(shape) {
		read = r.readPageOffer // a browser reads the offer its paywall page embeds
		if shape == shapeBrowserHEAD {
			read = r.readHeadThenPage
		}
	}
	offer, err := read(ctx, r.w.gateways[gate].url, res.path)
	if err != nil {
		return nil, err
	}
	i, err := offerIndex(offer, rk)
	if err != nil {
		return nil, err // a gateway of a cluster that holds no wallet lease offers no upto or erc2612
	}
	pay, err := pp.p.Sign(ctx, offer, i)
	if err != nil {
		return nil, fmt.Errorf("signing: %w", err)
	}
	use := ""
	if rk.scheme == x402.SchemeUpto {
		max, _ := x402.ParseUint256(pay.Requirements.Amount)
		use = pickUse(useDraw, max)
	}
	p, err := r.newPayment(pp, rk, pay.Header, pay.Value, pay.Requirements, pay.Payload, use, -1, res, shape, gate, asked)
	if err == nil {
		p.fromPage = browserShape(shape)
	}
	return p, err
}

// againSame presents a payment again to the resource it bought or was first presented for, at the gateway it
// was first presented to, in a shape of that method.
func (w *invWorker) againSame(a *invAction) {
	p := w.pickPayment()
	if p == nil {
		w.pay(a)
		return
	}
	res := p.home()
	shape := pickShape(w.rng, p.route, res.path, res.method)
	w.r.present(a, p, p.firstGate, res, shape, 0.05+0.35*w.rng.Float64())
}

// againOtherResource presents a payment again to another resource of its route.
func (w *invWorker) againOtherResource(a *invAction) {
	p := w.pickPayment()
	if p == nil {
		w.pay(a)
		return
	}
	home := p.home()
	var others []string
	for _, path := range p.route.paths {
		if path != home.path {
			others = append(others, path)
		}
	}
	path := others[w.rng.IntN(len(others))]
	shape := pickShape(w.rng, p.route, path, "")
	w.r.present(a, p, p.firstGate, invResource{shapeMethod(shape), path}, shape, 0.05+0.35*w.rng.Float64())
}

// againOtherRoute presents a payment again to a resource of another route.
func (w *invWorker) againOtherRoute(a *invAction) {
	p := w.pickPayment()
	if p == nil {
		w.pay(a)
		return
	}
	rk := w.pickRoute(func(rk *routeKind) bool { return rk != p.route })
	path := rk.paths[w.rng.IntN(len(rk.paths))]
	shape := pickShape(w.rng, rk, path, "")
	w.r.present(a, p, p.firstGate, invResource{shapeMethod(shape), path}, shape, 0.05+0.35*w.rng.Float64())
}

// againOtherGateway presents a payment again to the same resource at another gateway.
func (w *invWorker) againOtherGateway(a *invAction) {
	p := w.pickPayment()
	if p == nil {
		w.pay(a)
		return
	}
	gate := (p.firstGate + 1 + w.rng.IntN(len(w.r.w.gateways)-1)) % len(w.r.w.gateways)
	res := p.home()
	shape := pickShape(w.rng, p.route, res.path, res.method)
	w.r.present(a, p, gate, res, shape, 0.05+0.35*w.rng.Float64())
}

// againConcurrently presents one payment two to four times at once: to its resource, another of its route,
// another gateway, in shapes drawn for each.
func (w *invWorker) againConcurrently(a *invAction) {
	p := w.pickPayment()
	if p == nil {
		w.pay(a)
		return
	}
	type target struct {
		gate  int
		res   invResource
		shape string
		draw  float64
	}
	var targets []target
	for range 2 + w.rng.IntN(3) {
		res, gate := p.home(), p.firstGate
		if w.rng.IntN(3) == 0 {
			res.path = p.route.paths[w.rng.IntN(len(p.route.paths))]
			res.method = ""
		}
		if w.rng.IntN(2) == 0 {
			gate = w.pickGate()
		}
		shape := pickShape(w.rng, p.route, res.path, res.method)
		res.method = shapeMethod(shape)
		targets = append(targets, target{gate, res, shape, 0.05 + 0.35*w.rng.Float64()})
	}
	var wg sync.WaitGroup
	for _, tg := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.r.present(a, p, tg.gate, tg.res, tg.shape, tg.draw)
		}()
	}
	wg.Wait()
}

// invTransport is a worker's payer.Transport: its Base sees every request it sends, and registers the paid ones
// as payments of the run.
type invTransport struct {
	r      *invRun
	worker int
	tr     *payer.Transport
	client *http.Client
}

// invTransportLimit is the Transports' budget: far above what a run spends, so that no payment is refused for
// it, while the spent total is still counted.
var invTransportLimit = big.NewInt(1_000_000_000_000)

func (r *invRun) newTransport(worker int) *invTransport {
	it := &invTransport{r: r, worker: worker}
	it.tr = &payer.Transport{Payer: r.w.payers[len(r.w.payers)-1].p, Base: it, Limits: []payer.Limit{{Total: invTransportLimit}}}
	it.client = &http.Client{Transport: it.tr, Timeout: invRequestTimeout}
	return it
}

// transportSlot carries, in a request's context, the payment the Transport signed for it.
type transportSlot struct {
	a     *invAction
	gate  int
	p     *invPayment
	ans   *invAnswer
	asked time.Time // before the Transport's first request, whose 402 it signs from
}

type transportSlotKey struct{}

// RoundTrip is the Transport's Base: it registers each payment the Transport sends, then sends the request.
func (it *invTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	slot, _ := req.Context().Value(transportSlotKey{}).(*transportSlot)
	value := req.Header.Get(x402.HeaderPaymentSignature)
	if value == "" || slot == nil {
		return it.r.client.h1.Transport.RoundTrip(req)
	}
	pl, err := x402.DecodePaymentPayload(value)
	if err != nil {
		return nil, fmt.Errorf("the Transport sent a payment that does not decode: %w", err)
	}
	r := it.r
	res := invResource{req.Method, req.URL.Path}
	p, err := r.newPayment(r.w.payers[len(r.w.payers)-1], r.w.route(res.path), x402.HeaderPaymentSignature, value, pl.Accepted, pl,
		req.Header.Get(invUseHeader), it.worker, res, shapeGET, slot.gate, slot.asked)
	if err != nil {
		return nil, err
	}
	slot.p = p
	slot.ans = &invAnswer{action: slot.a.n, gate: slot.gate, res: res, shape: shapeGET + " through payer.Transport", sent: time.Now(), gen: r.w.generation()}
	req = req.Clone(req.Context())
	req.Header.Set(invPaymentHeader, strconv.Itoa(p.n))
	return it.r.client.h1.Transport.RoundTrip(req)
}

// payThroughTransport fetches a resource of a permit2 or eip3009 route with the worker's payer.Transport, which
// reads the 402, signs within its budget and sends the payment.
func (w *invWorker) payThroughTransport(a *invAction) {
	r := w.r
	rk := w.pickRoute(func(rk *routeKind) bool {
		return rk.serve != serveWebSocket && rk.serve != serveMCP && rk.method != x402.TransferERC2612
	})
	path := rk.paths[w.rng.IntN(len(rk.paths))]
	gate := w.pickGate()
	useDraw := rand.New(rand.NewPCG(w.rng.Uint64(), 7))
	slot := &transportSlot{a: a, gate: gate, asked: time.Now()}
	ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), transportSlotKey{}, slot), invRequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.w.gateways[gate].url+path, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	if rk.scheme == x402.SchemeUpto {
		// The maximum is the route's price: what the upstream names is drawn against it.
		req.Header.Set(invUseHeader, pickUse(useDraw, big.NewInt(10_000)))
	}
	resp, err := r.transports[w.n].client.Do(req)
	if slot.p == nil {
		if err == nil {
			resp.Body.Close()
			a.say("gw%d %s: answered %d without a payment", gate, path, resp.StatusCode)
		} else {
			a.say("gw%d %s: nothing paid: %s", gate, path, shorten(err.Error()))
		}
		return
	}
	r.readAnswer(slot.ans, slot.p, resp, err, -1, 0, 0, 0)
	slot.ans.got = time.Now()
	slot.p.record(slot.ans)
	a.say("payment #%d → %s", slot.p.n, slot.ans)
}

// injectFaults draws faults one after another, each undone before the next, until the time is up; it runs on the
// test's goroutine, so that a fault that cannot be done or undone stops the test.
func (r *invRun) injectFaults(until time.Time, rng *rand.Rand) {
	kinds := drawnFaults(os.Getenv(invFaultsEnv))
	total := 0
	for _, f := range kinds {
		total += f.weight(r.topo)
	}
	if total == 0 {
		r.t.Logf("no fault is drawn (%s=%q)", invFaultsEnv, os.Getenv(invFaultsEnv))
		time.Sleep(time.Until(until))
		return
	}
	for {
		pause := time.Duration(500+rng.IntN(2500)) * time.Millisecond
		if time.Now().Add(pause).After(until) {
			time.Sleep(time.Until(until))
			return
		}
		time.Sleep(pause)
		pick := rng.IntN(total)
		for _, f := range kinds {
			if pick -= f.weight(r.topo); pick < 0 {
				a := r.begin("F", f.name)
				f.do(r, rng, a)
				r.finish(a)
				break
			}
		}
	}
}

// drawnFaults is the fault kinds whose names hold one of the comma-separated words of only; all of them when only
// is empty.
func drawnFaults(only string) []invFaultKind {
	if strings.TrimSpace(only) == "" {
		return invFaultKinds
	}
	var out []invFaultKind
	for _, f := range invFaultKinds {
		for w := range strings.SplitSeq(only, ",") {
			if w = strings.TrimSpace(w); w != "" && strings.Contains(f.name, w) {
				out = append(out, f)
				break
			}
		}
	}
	return out
}

// invFaultKind is a fault the run draws: do injects it, waits its drawn length and undoes it. Adding one is
// adding a row.
type invFaultKind struct {
	name   string
	weight func(t invTopology) int
	do     func(r *invRun, rng *rand.Rand, a *invAction)
}

var invFaultKinds = []invFaultKind{
	{"SIGKILL a gateway, then start it again", weight(4), (*invRun).killGateway},
	{"stop a gateway gracefully (SIGINT or SIGTERM), then start it again", weight(4), (*invRun).stopGateway},
	{"reload the gateways with other prices, then back", weight(2), (*invRun).reloadPrices},
	{"reload the gateways with gates added before every route, then back", weight(2), (*invRun).reloadAddingGates},
	{"RPC answers 503", weight(2), func(r *invRun, rng *rand.Rand, a *invAction) { r.rpcFault(rng, a, rpc503) }},
	{"RPC hangs", weight(2), func(r *invRun, rng *rand.Rand, a *invAction) { r.rpcFault(rng, a, rpcHang) }},
	{"RPC answers lost", weight(1), func(r *invRun, rng *rand.Rand, a *invAction) { r.rpcFault(rng, a, rpcLose) }},
	{"RPC refuses transactions", weight(2), func(r *invRun, rng *rand.Rand, a *invAction) { r.rpcFault(rng, a, rpcRefuse) }},
	{"pause a gateway (SIGSTOP), then continue it (SIGCONT)", clusterOnly(2), (*invRun).pauseGateway},
	{"PostgreSQL stopped, then started", clusterOnly(3), (*invRun).stopPostgres},
	{"PostgreSQL hangs", clusterOnly(2), (*invRun).hangPostgres},
	{"SIGKILL a remote facilitator, then start it again", weight(2), (*invRun).killFacilitator},
}

func (r *invRun) killGateway(rng *rand.Rand, a *invAction) {
	n := rng.IntN(len(r.w.gateways))
	down := time.Duration(rng.IntN(2000)) * time.Millisecond
	g := r.w.gateways[n]
	at := time.Now()
	g.kill()
	time.Sleep(down)
	g.start()
	r.mu.Lock()
	r.kills = append(r.kills, invEvent{gate: n, from: at, to: time.Now()})
	r.mu.Unlock()
	a.say("gateway %d SIGKILLed, down %v, serving again after %v", n, down, time.Since(at).Round(10*time.Millisecond))
}

// invStopBound is how long a gateway stopped gracefully gets to exit. Caddy's grace period is unbounded by default:
// it waits for the requests at work (none of the run's waits long with every fault undone), then closes the tunnels,
// and the x402 app closes the journal after the requests still at work on it wrote their marks (at most 30 s). Past
// the bound the gateway is SIGKILLed, and the stop is a violation of graceful-stop-bounded, not a hang of the run.
const invStopBound = 20 * time.Second

// stopGateway stops a gateway gracefully, as an operator's `systemctl stop` does (SIGINT or SIGTERM, drawn), waits
// at most invStopBound for it to exit, and starts it again 0 to 2 s later on the same Caddyfile and journal, as
// killGateway does. A graceful stop is no crash: the checks excuse by it only a paid tunnel it cut (tunnelCutByStop).
func (r *invRun) stopGateway(rng *rand.Rand, a *invAction) {
	n := rng.IntN(len(r.w.gateways))
	sig, name := os.Signal(syscall.SIGTERM), "SIGTERM"
	if rng.IntN(2) == 0 {
		sig, name = os.Interrupt, "SIGINT"
	}
	down := time.Duration(rng.IntN(2000)) * time.Millisecond
	g := r.w.gateways[n]
	at := time.Now()
	exited, err := g.stopGracefully(sig, invStopBound)
	s := invStop{invEvent: invEvent{gate: n, from: at}, action: a.n, signal: name, exited: time.Now(), killed: !exited, err: err}
	took := s.exited.Sub(at).Round(10 * time.Millisecond)
	switch {
	case !exited:
		a.say("gateway %d did not exit within %v of %s and was SIGKILLed", n, invStopBound, name)
	case err != nil:
		a.say("gateway %d exited %v after %s, not cleanly: %v", n, took, name, err)
	default:
		a.say("gateway %d exited cleanly %v after %s", n, took, name)
	}
	time.Sleep(down)
	g.start()
	s.to = time.Now()
	r.mu.Lock()
	r.stops = append(r.stops, s)
	if s.killed {
		// From the kill on it was a crash, whatever graceful-stop-bounded says of the stop.
		r.kills = append(r.kills, invEvent{gate: n, from: s.exited, to: s.to})
	}
	r.mu.Unlock()
	a.say("down %v, serving again after %v", down, time.Since(at).Round(10*time.Millisecond))
}

// pauseGateway stops a gateway's process (SIGSTOP) and continues it (SIGCONT), as a VM's pause, a long garbage
// collection or a debugger would: mostly briefly, sometimes past the instances' heartbeat TTL (10 s) and the wallet
// leases' (15 s), so that the others take its wallets and its work over while it still believes it holds them, and
// it wakes up with whatever it was doing half done. Its fenced writes must keep it from sending anything with a
// wallet it lost. Counted as an outage: a response it wrote out and had not yet recorded as delivered when the
// others took its payment over may be bought once more, as after a crash.
func (r *invRun) pauseGateway(rng *rand.Rand, a *invAction) {
	n := rng.IntN(len(r.w.gateways))
	hold := time.Duration(500+rng.IntN(2500)) * time.Millisecond
	if rng.IntN(3) == 0 {
		hold = time.Duration(16000+rng.IntN(4000)) * time.Millisecond
	}
	g := r.w.gateways[n]
	from := time.Now()
	g.signal(syscall.SIGSTOP)
	time.Sleep(hold)
	g.signal(syscall.SIGCONT)
	r.mu.Lock()
	r.outages = append(r.outages, invEvent{gate: n, from: from, to: time.Now()})
	r.mu.Unlock()
	a.say("gateway %d paused for %v", n, hold)
}

func (r *invRun) reloadPrices(rng *rand.Rand, a *invAction) {
	span := r.reloadAway(rng, a, invGenOtherPrices, "the other prices")
	r.mu.Lock()
	r.reloads = append(r.reloads, span)
	r.mu.Unlock()
}

// reloadAddingGates reloads the gateways with gates added before every route (invGenGatesAdded), then removes
// them. It is not among r.reloads: the prices stay, so no honest payment may be refused for its terms across it.
func (r *invRun) reloadAddingGates(rng *rand.Rand, a *invAction) {
	r.reloadAway(rng, a, invGenGatesAdded, "gates added before every route")
}

// reloadAway reloads every gateway with configuration gen (what says what it is) for 1 to 5 s, then back to the
// first, and returns the span it ran.
func (r *invRun) reloadAway(rng *rand.Rand, a *invAction, gen int, what string) invEvent {
	hold := time.Duration(1000+rng.IntN(4000)) * time.Millisecond
	from := time.Now()
	r.reloadAll(gen, a)
	time.Sleep(hold)
	r.reloadAll(invGenFirst, a)
	a.say("ran with %s for %v", what, hold)
	return invEvent{gate: -1, from: from, to: time.Now()}
}

// reloadAll reloads every gateway with configuration gen (invWorld.gen).
func (r *invRun) reloadAll(gen int, a *invAction) {
	r.w.mu.Lock()
	r.w.gen = gen
	r.w.mu.Unlock()
	for _, g := range r.w.gateways {
		if err := g.reload(gen); err != nil {
			a.say("%v", err)
			r.t.Errorf("a reload the run needs failed: %v", err)
		}
	}
}

func (r *invRun) rpcFault(rng *rand.Rand, a *invAction, mode string) {
	hold := time.Duration(500+rng.IntN(3500)) * time.Millisecond
	r.w.proxy.set(mode)
	time.Sleep(hold)
	r.w.proxy.set(rpcPass)
	a.say("for %v", hold)
}

func (r *invRun) stopPostgres(rng *rand.Rand, a *invAction) {
	// Mostly short, sometimes past the instances' heartbeat TTL (10 s).
	hold := time.Duration(500+rng.IntN(3000)) * time.Millisecond
	if rng.IntN(4) == 0 {
		hold = time.Duration(8000+rng.IntN(5000)) * time.Millisecond
	}
	from := time.Now()
	r.w.pg.Stop(r.t)
	time.Sleep(hold)
	r.w.pg.Restart(r.t)
	r.mu.Lock()
	r.outages = append(r.outages, invEvent{gate: -1, from: from, to: time.Now()})
	r.mu.Unlock()
	a.say("down for %v", hold)
}

// hangPostgres makes the way to PostgreSQL hang, the gateways' proxies accepting and forwarding nothing: half the
// time every gateway's, half the time one gateway's (which then looks gone to the others while it works on).
// Mostly short, sometimes past the instances' heartbeat TTL (10 s).
func (r *invRun) hangPostgres(rng *rand.Rand, a *invAction) {
	hold := time.Duration(500+rng.IntN(3500)) * time.Millisecond
	if rng.IntN(4) == 0 {
		hold = time.Duration(8000+rng.IntN(5000)) * time.Millisecond
	}
	hung, which := r.w.pgProxies, "every gateway's"
	if rng.IntN(2) == 0 {
		n := rng.IntN(len(hung))
		hung, which = hung[n:n+1], fmt.Sprintf("gateway %d's", n)
	}
	from := time.Now()
	for _, p := range hung {
		p.hang()
	}
	time.Sleep(hold)
	for _, p := range hung {
		p.resumeForwarding()
	}
	r.mu.Lock()
	r.outages = append(r.outages, invEvent{gate: -1, from: from, to: time.Now()})
	r.mu.Unlock()
	a.say("%s way to it hung for %v", which, hold)
}

func (r *invRun) killFacilitator(rng *rand.Rand, a *invAction) {
	n := rng.IntN(len(r.w.facilitators))
	down := time.Duration(rng.IntN(2000)) * time.Millisecond
	f := r.w.facilitators[n]
	f.kill()
	time.Sleep(down)
	f.start()
	a.say("%s SIGKILLed, down %v", f.name, down)
}

// invDrainWait bounds how long the background settlements get to drain once every payment has its answer, and
// invDrainStall how long what is left may stay as it is (a settlement retried without end) before the checks judge it.
const invDrainWait, invDrainStall = time.Minute, 20 * time.Second

// invResolveWait bounds how long quiescence presents again the payments without their response.
const invResolveWait = 3 * time.Minute

// quiesce presents again, at the workers' concurrency, every payment that has not delivered its response, to the
// resource it bought or was first presented for, until it gets it or a final refusal. Every fault is undone
// by now; in the cluster the gateways first share the wallets again.
func (r *invRun) quiesce() string {
	if r.topo.postgres {
		r.w.waitLeases("the wallets shared again after the faults", 90*time.Second)
	}
	r.client.closeIdle()
	deadline := time.Now().Add(invResolveWait)
	var todo []*invPayment
	for _, p := range r.snapshot() {
		if p.delivered() == 0 {
			todo = append(todo, p)
		}
	}
	queue := make(chan *invPayment)
	var wg sync.WaitGroup
	for range r.topo.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range queue {
				r.resolve(p, deadline)
			}
		}()
	}
	for _, p := range todo {
		queue <- p
	}
	close(queue)
	wg.Wait()
	delivered, refused, open := 0, 0, 0
	for _, p := range todo {
		last := p.lastAt(p.home())
		switch {
		case p.delivered() > 0:
			delivered++
		case last != nil && last.final:
			refused++
		default:
			open++
		}
	}
	return fmt.Sprintf("%d payments without their response presented again: %d delivered, %d refused, %d still without a final answer",
		len(todo), delivered, refused, open)
}

// resolve presents p again until its answer is final or deadline passes: for each resource it may have bought
// (homes), until one delivers.
func (r *invRun) resolve(p *invPayment, deadline time.Time) {
	a := r.begin("Q", "present again until the answer is final")
	defer r.finish(a)
	for _, res := range p.homes() {
		shape := plainShape(r.w.route(res.path), res.method, p.firstShape)
		gate := p.firstGate
		pause := 250 * time.Millisecond
		for {
			ans := r.present(a, p, gate, res, shape, 0)
			if ans.whole || time.Now().After(deadline) {
				return
			}
			if ans.final || r.unknownForGood(p, ans) {
				break // refused here, or unknown here for good: it may have bought the next
			}
			time.Sleep(pause)
			pause = min(2*pause, 2*time.Second)
			gate = (gate + 1) % len(r.w.gateways)
		}
	}
}

// unknownForGood reports whether ans leaves p's outcome unknown for good: the gate's 502 "may have settled" to a
// payment through the remote facilitators whose deadline the chain's clock passed, its authorization unspent, so
// that it can never be charged (remoteUnknownPastDeadline says why the gate answers so). Presenting it again would
// get 502 again until the wait is over, while the payments queued behind it wait.
func (r *invRun) unknownForGood(p *invPayment, ans *invAnswer) bool {
	if !p.route.remote || !outcomeUnknown(ans) {
		return false
	}
	ctx, cancel := rpcContext()
	head, err := r.w.dev.client.HeaderByNumber(ctx, nil)
	cancel()
	if err != nil || !pastDeadline(p, time.Unix(int64(head.Time), 0)) {
		return false
	}
	used, err := r.nonceUsed(p) // read after the head: spent by then, it shows
	return err == nil && !used
}

// drain waits until nothing is left to settle: no settlement wallet has a transaction waiting, no gateway an
// async backlog, no journal a backlog (health), no PostgreSQL record pending; at most timeout. It says how it
// went; what is left is judged by the checks.
func (r *invRun) drain(timeout time.Duration) string {
	start, moved, least := time.Now(), time.Now(), -1
	for {
		left, n := r.leftToSettle()
		if left == "" {
			return fmt.Sprintf("drained in %v", time.Since(start).Round(100*time.Millisecond))
		}
		if least < 0 || n < least {
			moved, least = time.Now(), n
		}
		switch {
		case time.Since(start) > timeout:
			return fmt.Sprintf("not drained within %v: %s", timeout, left)
		case time.Since(moved) > invDrainStall:
			return fmt.Sprintf("not drained: nothing settled for %v: %s", invDrainStall, left)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// leftToSettle says what is still waiting to settle, "" when nothing, and counts it.
func (r *invRun) leftToSettle() (string, int) {
	var left []string
	n := 0
	if !r.w.dev.walletsIdle(r.w.wallets()) {
		left = append(left, "a settlement wallet has a transaction waiting")
		n++
	}
	count := func(what string, k int, err error) {
		if err != nil || k > 0 {
			left = append(left, fmt.Sprintf("%s %d (%v)", what, k, err))
			n += max(k, 1)
		}
	}
	for _, g := range r.w.gateways {
		k, err := asyncBacklog(g.admin)
		count(g.name+": async backlog", k, err)
		k, err = journalBacklog(g.url + "/x402/health")
		count(g.name+": journal backlog", k, err)
	}
	for _, f := range r.w.facilitators {
		k, err := journalBacklog(f.url + "/health")
		count(f.name+": journal backlog", k, err)
	}
	return strings.Join(left, "; "), n
}

// asyncBacklog reads caddy_x402_gate_async_backlog from a Caddy's admin /metrics.
func asyncBacklog(admin string) (int, error) {
	a, err := get("http://" + admin + "/metrics")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, line := range strings.Split(a.body, "\n") {
		if !strings.HasPrefix(line, "caddy_x402_gate_async_backlog") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("metrics line %q: %w", line, err)
		}
		n += int(v)
	}
	return n, nil
}

// journalBacklog reads the journal backlog a facilitator's /health reports, over its networks.
func journalBacklog(url string) (int, error) {
	a, err := get(url)
	if err != nil {
		return 0, err
	}
	var h x402.HealthResponse
	if err := json.Unmarshal([]byte(a.body), &h); err != nil {
		return 0, fmt.Errorf("%s answered %d %s: %w", url, a.status, shorten(a.body), err)
	}
	n := 0
	for _, nw := range h.Networks {
		n += nw.JournalBacklog
	}
	return n, nil
}

// headSampler notes the chain's head every 100 ms, so that the checks can tell when (by the wall clock the
// clients' records use) a block was mined.
type headSampler struct {
	mu      sync.Mutex
	samples []headSample
}

type headSample struct {
	at    time.Time
	block uint64
}

func (h *headSampler) run(dev *devChain, done <-chan struct{}) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ctx, cancel := rpcContext()
		n, err := dev.client.BlockNumber(ctx)
		cancel()
		if err == nil {
			h.mu.Lock()
			h.samples = append(h.samples, headSample{time.Now(), n})
			h.mu.Unlock()
		}
		select {
		case <-done:
			return
		case <-tick.C:
		}
	}
}
