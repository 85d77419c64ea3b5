package e2e

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha1"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The world of the money-invariant run: one `caddy x402 devchain` process, a fault proxy between every Caddy and
// the chain's RPC, an upstream in the test process, two remote facilitator Caddys (one failover set), the
// gateways (one on a bbolt journal, or three on one PostgreSQL), and the routes every gateway serves. A route
// kind is a row of invRoutes: adding a kind of route to the run is adding a row.

// Settlement wallets of the dev chain, by who settles from them: the gateways share the first invGatewayWallets
// (by leases, in the cluster), and each remote facilitator member has two of its own after them.
const (
	invGatewayWallets = 12
	invWalletsPerFac  = 2
	invFacilitators   = 2
	invPayers         = 12
)

// invValidity is how long the gates' offers (max_timeout) and the payers' payments are valid.
const invValidity = 24 * time.Hour

// invBriefValidity is the max_timeout of the routes whose payments are valid briefly (routeKind.validity).
const invBriefValidity = 40 * time.Second

// invMaxBuffer is the gates' max_buffer: a larger response streams, and only a streamed response can be cut
// short by its client before the gate has written all of it.
const invMaxBuffer = 64 << 10

// How a route serves its resources.
const (
	serveUpstream  = "upstream"  // reverse_proxy to the test's upstream, which names upto charges
	serveFiles     = "files"     // file_server over invFiles
	serveWebSocket = "websocket" // reverse_proxy to the upstream's WebSocket echo
	serveMCP       = "mcp"       // the gate's mcp mode before the upstream's MCP tools (invariants_mcp_test.go)
)

// routeKind is one paid route of every gateway: its terms, how it serves, and the resources under it.
type routeKind struct {
	name   string   // names the route in reports
	prefix string   // the path prefix it serves, such as /p2/
	paths  []string // its resources, the paths a client asks for
	scheme string   // exact or upto
	method string   // the asset transfer method its offers name, and the client pays by
	settle string   // before, after or async
	asset  common.Address
	// price is the gate's price option (price or amount, placeholders allowed: a price set per request)
	// before and after a reload that changes prices; altPrice "" keeps it.
	price, altPrice string
	defaultAmount   string // upto: max or zero
	serve           string
	remote          bool   // settled through the remote facilitators' failover set
	grace           string // price_grace
	payTo           common.Address
	// access: what a settled payment grants its payer by sign-in-with-x (the gate's access directive), over
	// every path of the route; nil for none (invariants_siwx_test.go).
	access *invAccess
	// gasSponsoring is the gate's gas_sponsoring option; a route with one is paid by the payers without a Permit2
	// allowance (invariants_approval_test.go).
	gasSponsoring string
	// validity is the route's max_timeout when it is brief (0: invValidity): its payments' deadlines pass during
	// the run, in chain time, while faults hold their settlements, and they are presented again past them.
	validity time.Duration
}

// validFor is how long the route's offers, and the payments signed from them, are valid.
func (rk *routeKind) validFor() time.Duration {
	if rk.validity != 0 {
		return rk.validity
	}
	return invValidity
}

// invSeller is the pay_to of route i: a seller of its own, so that the chain shows what each route was paid.
func invSeller(i int) common.Address {
	return common.HexToAddress(fmt.Sprintf("0x5e11e75e11e75e11e75e11e75e11e75e11e7%04x", i+1))
}

// invFiles are the files of the file_server routes: two larger than any socket buffer (a client that reads a
// part and hangs up surely cuts the gate's writing short) and two small ones (one above max_buffer).
var invFiles = []struct {
	name string
	size int
}{
	{"big1.bin", 8 << 20},
	{"big2.bin", 10 << 20},
	{"small1.txt", 2 << 10},
	{"small2.txt", 100 << 10},
}

// invBigFile is the size from which a file's response can be cut short for sure: more than a loopback
// socket's send buffer (4 MiB at most) and an HTTP/2 stream window (4 MiB) beyond what the client read.
const invBigFile = 8 << 20

// invRoutes builds the route kinds of the run.
func invRoutes() []*routeKind {
	upstreamPaths := func(prefix string) []string {
		return []string{prefix + "a", prefix + "b", prefix + "c/d"}
	}
	var filePaths = func(prefix string) []string {
		var out []string
		for _, f := range invFiles {
			out = append(out, prefix+f.name)
		}
		return out
	}
	routes := []*routeKind{
		{name: "exact permit2, settle after", prefix: "/p2/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.01", altPrice: "price $0.012", serve: serveUpstream},
		{name: "exact eip3009, settle before", prefix: "/e3009/", scheme: x402.SchemeExact, method: x402.TransferEIP3009,
			settle: "before", asset: devchain.EIP3009TokenAddress, price: "price $0.004", serve: serveUpstream},
		{name: "exact erc2612, settle after", prefix: "/e2612/", scheme: x402.SchemeExact, method: x402.TransferERC2612,
			settle: "after", price: "price $0.003", serve: serveUpstream},
		{name: "exact permit2, settle async", prefix: "/async/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "async", price: "price $0.002", serve: serveUpstream},
		{name: "upto (default max), settle after", prefix: "/upto-max/", scheme: x402.SchemeUpto, method: x402.TransferPermit2,
			settle: "after", price: "price $0.01", defaultAmount: "max", serve: serveUpstream},
		{name: "upto (default zero), settle async", prefix: "/upto-zero/", scheme: x402.SchemeUpto, method: x402.TransferPermit2,
			settle: "async", price: "price $0.01", defaultAmount: "zero", serve: serveUpstream},
		// The price is the path's second segment, in raw units; after the reload, that with a 5 after it. A price
		// with a grace may depend on the request's method and URL only.
		{name: "price set per request, price_grace", prefix: "/priced/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "amount {http.request.uri.path.1}", altPrice: "amount {http.request.uri.path.1}5", grace: "10s", serve: serveUpstream},
		{name: "file_server, settle after", prefix: "/files/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.005", serve: serveFiles},
		{name: "file_server, settle async", prefix: "/afiles/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "async", price: "price $0.006", serve: serveFiles},
		{name: "WebSocket upstream", prefix: "/ws/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.007", serve: serveWebSocket},
		{name: "remote facilitators (failover), settle after", prefix: "/remote/", scheme: x402.SchemeExact,
			method: x402.TransferPermit2, settle: "after", price: "price $0.008", serve: serveUpstream, remote: true},
		// Sign-in-with-x: a grant of 3 requests that outlasts the run, and one of any number that ends 4 s after
		// its payment's response (the run signs in past that).
		{name: "access for 3 requests, settle after", prefix: "/siwx/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.009", serve: serveUpstream, access: &invAccess{For: time.Hour, Requests: 3}},
		{name: "access for 4 s, settle before", prefix: "/siwx-brief/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "before", price: "price $0.0011", serve: serveUpstream, access: &invAccess{For: 4 * time.Second}},
		// Payers without a Permit2 allowance and without gas, paying by their own signed approval, whose gas the
		// gateway's engine funds (erc20ApprovalGasSponsoring; invariants_approval_test.go).
		{name: "exact permit2, a sponsored approval, settle after", prefix: "/approve/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.0017", serve: serveUpstream, gasSponsoring: "erc20_approval"},
		// MCP tool calls priced per tool (invariants_mcp_test.go): two tools of one price, so that a payment made
		// for one is presented for the other; price is the mcp block's tool lines.
		{name: "MCP tools, settle after", prefix: "/mcp/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: mcpToolPrices("$0.0013"), altPrice: mcpToolPrices("$0.0014"), serve: serveMCP},
		{name: "MCP tools, settle async", prefix: "/amcp/", scheme: x402.SchemeExact, method: x402.TransferEIP3009,
			settle: "async", asset: devchain.EIP3009TokenAddress, price: mcpToolPrices("$0.0015"), serve: serveMCP},
		// Payments valid briefly (invBriefValidity of chain time, a few seconds of the wall clock under the run's
		// load): their deadlines pass while a fault holds their settlement (a node that drops or refuses
		// transactions, a killed gateway whose records are reconciled, a paused one), and they are presented again
		// past them. A settle async route with a max_timeout this short settles every payment before serving it
		// (README, "expires too soon to be settled after serving").
		{name: "exact permit2, valid briefly, settle after", prefix: "/brief/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.0019", serve: serveUpstream, validity: invBriefValidity},
		{name: "exact eip3009, valid briefly, settle before", prefix: "/brief3009/", scheme: x402.SchemeExact, method: x402.TransferEIP3009,
			settle: "before", asset: devchain.EIP3009TokenAddress, price: "price $0.0021", serve: serveUpstream, validity: invBriefValidity},
		{name: "exact permit2, valid briefly, settle async", prefix: "/brief-async/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "async", price: "price $0.0023", serve: serveUpstream, validity: invBriefValidity},
		{name: "upto, valid briefly, settle after", prefix: "/brief-upto/", scheme: x402.SchemeUpto, method: x402.TransferPermit2,
			settle: "after", price: "price $0.0025", defaultAmount: "max", serve: serveUpstream, validity: invBriefValidity},
		{name: "remote facilitators (failover), valid briefly, settle after", prefix: "/brief-remote/", scheme: x402.SchemeExact,
			method: x402.TransferPermit2, settle: "after", price: "price $0.0027", serve: serveUpstream, remote: true, validity: invBriefValidity},
		{name: "exact permit2, a sponsored approval, valid briefly, settle after", prefix: "/brief-approve/", scheme: x402.SchemeExact, method: x402.TransferPermit2,
			settle: "after", price: "price $0.0029", serve: serveUpstream, gasSponsoring: "erc20_approval", validity: invBriefValidity},
	}
	for i, rk := range routes {
		rk.payTo = invSeller(i)
		if rk.asset == (common.Address{}) {
			rk.asset = devchain.TokenAddress
		}
		switch rk.serve {
		case serveFiles:
			rk.paths = filePaths(rk.prefix)
		case serveWebSocket:
			rk.paths = []string{rk.prefix + "echo", rk.prefix + "chat"}
		case serveMCP:
			rk.paths = mcpPaths(rk.prefix)
		default:
			rk.paths = upstreamPaths(rk.prefix)
		}
		if strings.Contains(rk.price, "{") {
			rk.paths = []string{rk.prefix + "1000/a", rk.prefix + "1000/b", rk.prefix + "20000/a"}
		}
	}
	return routes
}

// caddy is the route's handle block in a gateway's Caddyfile, in configuration gen (invWorld.gen).
func (rk *routeKind) caddy(w *invWorld, gen int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\thandle %s* {\n", rk.prefix)
	price := rk.price
	if gen == invGenOtherPrices && rk.altPrice != "" {
		price = rk.altPrice
	}
	if rk.serve == serveMCP {
		price = "mcp {\n\t\t\t\t" + strings.ReplaceAll(price, "\n", "\n\t\t\t\t") + "\n\t\t\t}"
	}
	fmt.Fprintf(&b, "\t\tx402 {\n\t\t\t%s\n\t\t\tpay_to %s\n\t\t\tscheme %s\n\t\t\tasset %s\n", price, rk.payTo.Hex(), rk.scheme, rk.asset.Hex())
	fmt.Fprintf(&b, "\t\t\tasset_transfer_method %s\n\t\t\tsettle %s\n\t\t\tmax_timeout %s\n\t\t\tmax_buffer %d\n", rk.method, rk.settle, rk.validFor(), invMaxBuffer)
	if rk.defaultAmount != "" {
		fmt.Fprintf(&b, "\t\t\tdefault_amount %s\n", rk.defaultAmount)
	}
	if rk.grace != "" {
		fmt.Fprintf(&b, "\t\t\tprice_grace %s\n", rk.grace)
	}
	if rk.remote {
		fmt.Fprintf(&b, "\t\t\tfacilitator http %s\n", strings.Join(w.facilitatorURLs(), " "))
	}
	if rk.gasSponsoring != "" {
		fmt.Fprintf(&b, "\t\t\tgas_sponsoring %s\n", rk.gasSponsoring)
	}
	if gen == invGenOtherPrices && browserRoute(rk, "") {
		// The reload changes the paywall too: a page read before it is paid after it, and the other way round.
		fmt.Fprintf(&b, "\t\t\tpaywall {\n\t\t\t\ttitle \"%s\"\n\t\t\t}\n", invReloadedTitle)
	}
	if a := rk.access; a != nil {
		fmt.Fprintf(&b, "\t\t\taccess %s {\n\t\t\t\tpaths %s*\n", a.For, rk.prefix)
		if a.Requests > 0 {
			fmt.Fprintf(&b, "\t\t\t\trequests %d\n", a.Requests)
		}
		b.WriteString("\t\t\t}\n")
	}
	b.WriteString("\t\t}\n")
	switch rk.serve {
	case serveFiles:
		fmt.Fprintf(&b, "\t\troot * %s\n\t\tfile_server\n", w.filesDir)
	default:
		fmt.Fprintf(&b, "\t\treverse_proxy %s\n", w.upstreamURL)
	}
	b.WriteString("\t}\n")
	return b.String()
}

// route returns the route kind serving path, or nil.
func (w *invWorld) route(path string) *routeKind {
	for _, rk := range w.routes {
		if strings.HasPrefix(path, rk.prefix) {
			return rk
		}
	}
	return nil
}

// invWorld is every process and server of one topology's run.
type invWorld struct {
	t    *testing.T
	topo invTopology
	dir  string

	chain       *process
	facts       devchainFacts
	dev         *devChain
	proxy       *faultProxy
	upstream    *invUpstream
	upstreamURL string
	filesDir    string
	files       map[string][]byte // by path under filesDir ("/files/big1.bin")

	pg  *pgtest.Server
	dsn string // never logged
	// pgProxies are the TCP proxies each gateway of the cluster reaches PostgreSQL through (by gateway), which
	// the fault "PostgreSQL hangs" makes hang.
	pgProxies []*pgProxy

	facilitators []*invProc
	gateways     []*invProc
	routes       []*routeKind
	payers       []*invPayer
	sponsored    []*invPayer // payers without a Permit2 allowance, nor gas: those of the routes with gasSponsoring

	gatewayWallets, facilitatorWallets []common.Address
	startBlock                         uint64
	batch                              *invBatch // the batch route's lanes (invariants_batch_test.go)

	mu  sync.Mutex
	gen int // the configuration the gateways run: invGenFirst, invGenOtherPrices or invGenGatesAdded
}

// The configurations a reload of the run moves the gateways between (invWorld.gen).
const (
	// invGenFirst is the run's configuration, as the gateways start.
	invGenFirst = 0
	// invGenOtherPrices changes the prices of the routes with an altPrice, the batch route's and the paywall's
	// title: an honest payment signed before it may be refused for its terms, and nothing charged.
	invGenOtherPrices = 1
	// invGenGatesAdded is invGenFirst with a paid gate of each kind the routes are (settled before, after and async,
	// MCP, batch) added before them all, so that every gate configured alike after one has another ordinal, and
	// its route another name (caddymodule/gate_route.go); the reload back removes them. Nothing the run's routes
	// sell changes: an honest payment is never refused for its terms across it, and a payment taken before it is
	// never judged by another route's record, nor a grant of access honoured at another route.
	invGenGatesAdded = 2
)

// invPayer is a funded demo payer of the dev chain, signing with the public payer package.
type invPayer struct {
	n    int
	addr common.Address
	p    *payer.Payer
}

// invProc is a Caddy process of the run that faults stop and start again: a gateway or a facilitator member.
type invProc struct {
	w      *invWorld
	n      int
	name   string
	url    string // the site
	admin  string // the admin API, "" when off
	file   string // its Caddyfile
	ready  string // a URL that answers readyStatus once the process serves
	status int
	config func(gen int) string
	env    []string
	// journal is the bbolt journal file of the process, "" on PostgreSQL.
	journal string

	mu     sync.Mutex
	proc   *process
	starts int
}

// startWorld starts everything a topology's run needs and returns once every gateway answers 402 and, in the
// cluster, the gateways share the wallets.
func startWorld(t *testing.T, topo invTopology) *invWorld {
	t.Helper()
	started := time.Now()
	w := &invWorld{t: t, topo: topo, dir: t.TempDir(), routes: invRoutes()}

	pgReady := make(chan struct{})
	if topo.postgres {
		pgtest.Need(t) // here, in the test's goroutine, where a test may be skipped
		go func() {
			defer close(pgReady)
			w.pg = pgtest.Start(t)
		}()
	} else {
		close(pgReady)
	}
	var err error
	if w.batch, err = newInvBatch(); err != nil {
		t.Fatal(err)
	}
	wallets := w.gatewayWalletCount() + invFacilitators*invWalletsPerFac
	w.chain, w.facts = startDevchain(t, w.dir, "--wallets", fmt.Sprint(wallets), "--payers", fmt.Sprint(invPayers+invBatchLanes))
	if len(w.facts.Wallets) != wallets || len(w.facts.Payers) != invPayers+invBatchLanes {
		t.Fatalf("the chain funded %d wallets and %d payers, want %d and %d", len(w.facts.Wallets), len(w.facts.Payers), wallets, invPayers+invBatchLanes)
	}
	w.dev = dialChain(t, w.facts.RPC)
	for i, a := range w.facts.Wallets {
		if i < w.gatewayWalletCount() {
			w.gatewayWallets = append(w.gatewayWallets, common.HexToAddress(a))
		} else {
			w.facilitatorWallets = append(w.facilitatorWallets, common.HexToAddress(a))
		}
	}
	for i := range invPayers {
		key := devchain.PayerKeyN(i)
		// Valid as long as the gates' offers say (max_timeout 24h): with a block per transaction the chain's
		// time runs ahead of the wall clock, a second a block, and a payment cut short early in the run is
		// presented again at its end.
		p, err := payer.New(key, payer.Options{RPC: w.facts.RPC, MaxValidity: invValidity})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		if p.Address() != common.HexToAddress(w.facts.Payers[i]) {
			t.Fatalf("demo payer %d is %s on the chain, %s by devchain.PayerKeyN", i, w.facts.Payers[i], p.Address())
		}
		w.payers = append(w.payers, &invPayer{n: i, addr: p.Address(), p: p})
		w.dev.approvePermit2(key, devchain.TokenAddress)
	}

	w.fundSponsoredPayers()

	w.proxy = startFaultProxy(t, w.facts.RPC)
	w.upstream = &invUpstream{runs: map[string]int{}}
	up := httptest.NewServer(w.upstream)
	t.Cleanup(up.Close)
	w.upstreamURL = up.URL
	w.writeFiles()

	for i := range invFacilitators {
		first := w.gatewayWalletCount() + i*invWalletsPerFac
		f := &invProc{w: w, n: i, name: fmt.Sprintf("facilitator %c", 'A'+i), env: childEnv(t), status: http.StatusOK,
			url: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)), journal: filepath.Join(w.dir, fmt.Sprintf("facilitator%d.db", i))}
		f.file, f.ready = filepath.Join(w.dir, fmt.Sprintf("facilitator%d.Caddyfile", i)), f.url+"/supported"
		f.config = func(int) string {
			return fmt.Sprintf("{\n\tadmin off\n\tx402 {\n\t\tdev_chain {\n\t\t\trpc %s\n\t\t\twallets %d-%d\n\t\t}\n\t\tjournal %s\n\t}\n}\n\n%s {\n\tbind 127.0.0.1\n\tx402_facilitator\n}\n",
				w.proxy.url, first, first+invWalletsPerFac-1, f.journal, f.url)
		}
		w.facilitators = append(w.facilitators, f)
	}
	for _, f := range w.facilitators {
		f.start()
	}

	<-pgReady
	if topo.postgres {
		if w.pg == nil {
			t.Fatal("PostgreSQL did not start")
		}
		w.dsn = w.pg.DSN()
	}
	for i := range topo.gateways {
		g := &invProc{w: w, n: i, name: fmt.Sprintf("gateway %d", i), env: childEnv(t, w.batch.env()), status: http.StatusPaymentRequired,
			url: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)), admin: fmt.Sprintf("127.0.0.1:%d", freePort(t))}
		g.file, g.ready = filepath.Join(w.dir, fmt.Sprintf("gateway%d.Caddyfile", i)), g.url+w.routes[0].paths[0]
		journal := w.dsn
		if topo.postgres {
			proxy := startPgProxy(t, w.dsn)
			w.pgProxies = append(w.pgProxies, proxy)
			journal = proxy.dsn
		} else {
			g.journal = filepath.Join(w.dir, fmt.Sprintf("gateway%d.db", i))
			journal = g.journal
		}
		g.config = func(gen int) string { return w.gatewayConfig(g, journal, gen) }
		w.gateways = append(w.gateways, g)
	}
	for _, g := range w.gateways {
		g.launch()
	}
	for _, g := range w.gateways {
		g.awaitReady()
	}
	if topo.postgres {
		w.waitLeases("the wallets shared out by the gateways", 60*time.Second)
	}
	w.checkOffers()
	w.startBlock = w.dev.head()
	t.Logf("%s: the world is up in %v: a dev chain, a fault proxy before its RPC, an upstream, %d remote facilitators, %d gateway(s)%s, %d routes, %d payers",
		topo.name, time.Since(started).Round(100*time.Millisecond), len(w.facilitators), len(w.gateways),
		map[bool]string{true: " on one PostgreSQL", false: " on bbolt"}[topo.postgres], len(w.routes), len(w.payers))
	return w
}

// checkOffers makes sure, before the run starts, that every route of the first gateway offers the way to pay the
// run pays it by: a route that offers none would be a run that never pays it.
func (w *invWorld) checkOffers() {
	for _, rk := range w.routes {
		var err error
		// With fewer wallets than gateways, a gateway that holds none offers no payment bound to a wallet (upto,
		// erc2612): some gateway must.
		for _, g := range w.gateways {
			var a answer
			if rk.serve == serveMCP {
				var offer payer.Offer
				if offer, err = mcpOffer(context.Background(), http.DefaultClient, g.url, rk.paths[0]); err == nil {
					_, err = offerIndex(offer, rk)
				}
				if err == nil {
					break
				}
				continue
			}
			if a, err = get(g.url + rk.paths[0]); err != nil {
				w.t.Fatal(err)
			}
			offer, rerr := payer.ReadOffer(a.header, []byte(a.body))
			if rerr != nil {
				// A route whose every offer names a wallet has none to make here: not a 402.
				err = fmt.Errorf("%s answered %s with %d and no offer: %w", g.name, rk.paths[0], a.status, rerr)
				continue
			}
			if _, err = offerIndex(offer, rk); err == nil {
				break
			}
		}
		if err != nil {
			w.t.Fatalf("%s: %v", rk.name, err)
		}
	}
}

// gatewayConfig is a gateway's Caddyfile: the dev chain's network through the fault proxy (with its batch block),
// the journal, every route, the batch route, and the facilitator handler at /x402/ (for its /health: the journal
// backlog).
func (w *invWorld) gatewayConfig(g *invProc, journal string, gen int) string {
	var routes strings.Builder
	if gen == invGenGatesAdded {
		routes.WriteString(w.addedGates())
	}
	for _, rk := range w.routes {
		routes.WriteString(rk.caddy(w, gen))
	}
	routes.WriteString(w.batchRoute(gen))
	return fmt.Sprintf(`{
	admin %s
	servers {
		protocols h1 h2 h2c
	}
	x402 {
		%s
		journal %s
	}
}

%s {
	bind 127.0.0.1
%s	handle_path /x402/* {
		x402_facilitator {
			open
		}
	}
	handle {
		respond "no route of the run" 404
	}
}
`, g.admin, w.networkBlock(w.proxy.url, w.gatewayWalletCount()), journal, g.url, routes.String())
}

// addedGates are the gates invGenGatesAdded puts before every route of the run: one configured alike with each
// kind of the run's gates, each paying a seller of its own, at a path no action of the run requests.
func (w *invWorld) addedGates() string {
	var b strings.Builder
	for i, settle := range []string{"before", "after", "async"} {
		fmt.Fprintf(&b, "\thandle /added-%s/* {\n\t\tx402 {\n\t\t\tprice $0.0019\n\t\t\tpay_to %s\n\t\t\tscheme %s\n\t\t\tasset %s\n", settle,
			invSeller(90+i).Hex(), x402.SchemeExact, devchain.TokenAddress.Hex())
		fmt.Fprintf(&b, "\t\t\tasset_transfer_method %s\n\t\t\tsettle %s\n\t\t\tmax_timeout %s\n\t\t\tmax_buffer %d\n\t\t}\n\t\trespond \"added\"\n\t}\n",
			x402.TransferPermit2, settle, invValidity, invMaxBuffer)
	}
	fmt.Fprintf(&b, "\thandle /added-mcp/* {\n\t\tx402 {\n\t\t\tmcp {\n\t\t\t\ttool search $0.0019\n\t\t\t}\n\t\t\tpay_to %s\n\t\t\tscheme %s\n\t\t\tasset %s\n",
		invSeller(93).Hex(), x402.SchemeExact, devchain.TokenAddress.Hex())
	fmt.Fprintf(&b, "\t\t\tasset_transfer_method %s\n\t\t\tsettle after\n\t\t\tmax_timeout %s\n\t\t\tmax_buffer %d\n\t\t}\n\t\trespond \"added\"\n\t}\n",
		x402.TransferPermit2, invValidity, invMaxBuffer)
	fmt.Fprintf(&b, "\thandle /added-batch/* {\n\t\tx402 {\n\t\t\tscheme batch\n\t\t\tamount %d\n\t\t\tasset %s\n\t\t\tpay_to %s\n\t\t\tmax_timeout %s\n\t\t}\n\t\trespond \"added\"\n\t}\n",
		invBatchPrice, devchain.EIP3009TokenAddress.Hex(), invSeller(94).Hex(), invValidity)
	return b.String()
}

// gatewayWalletCount is how many settlement wallets the gateways share.
func (w *invWorld) gatewayWalletCount() int { return cmp.Or(w.topo.wallets, invGatewayWallets) }

// waitLeases waits until the gateways of the cluster share out their wallets: evenly, each held, by as many
// gateways as there are wallets when there are fewer.
func (w *invWorld) waitLeases(what string, timeout time.Duration) {
	w.t.Helper()
	waitLeasesShared(w.t, w.dsn, w.gatewayWalletCount(), min(len(w.gateways), w.gatewayWalletCount()), what, timeout)
}

// wallets are every settlement wallet of the run: the gateways', then the facilitators'.
func (w *invWorld) wallets() []common.Address {
	return append(append([]common.Address(nil), w.gatewayWallets...), w.facilitatorWallets...)
}

// facilitatorURLs are the remote facilitator members, in failover order.
func (w *invWorld) facilitatorURLs() []string {
	var out []string
	for _, f := range w.facilitators {
		out = append(out, f.url+"/")
	}
	return out
}

// writeFiles writes the file_server routes' files, the same bytes under each route's prefix.
func (w *invWorld) writeFiles() {
	w.filesDir = filepath.Join(w.dir, "www")
	w.files = map[string][]byte{}
	for _, rk := range w.routes {
		if rk.serve != serveFiles {
			continue
		}
		if err := os.MkdirAll(filepath.Join(w.filesDir, rk.prefix), 0o755); err != nil {
			w.t.Fatal(err)
		}
		for i, f := range invFiles {
			content := make([]byte, f.size)
			rng := rand.New(rand.NewPCG(uint64(i), 402))
			for j := range content {
				content[j] = byte('a' + rng.IntN(26))
			}
			path := rk.prefix + f.name
			if err := os.WriteFile(filepath.Join(w.filesDir, path), content, 0o644); err != nil {
				w.t.Fatal(err)
			}
			w.files[path] = content
		}
	}
}

// generation returns the configuration the gateways run (invWorld.gen).
func (w *invWorld) generation() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gen
}

// start starts the process and waits until it serves.
func (p *invProc) start() {
	p.w.t.Helper()
	p.launch()
	p.awaitReady()
}

// launch writes the process's Caddyfile for the current configuration (invWorld.gen) and starts it.
func (p *invProc) launch() {
	t := p.w.t
	t.Helper()
	if err := os.WriteFile(p.file, []byte(p.config(p.w.generation())), 0o600); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.starts++
	name := p.name
	if p.starts > 1 {
		name = fmt.Sprintf("%s, start %d", p.name, p.starts)
	}
	p.proc = startProcess(t, name, p.w.dir, p.env, "run", "--adapter", "caddyfile", "--config", p.file)
}

// awaitReady waits until the launched process serves: a gateway's paid route answers 402, a facilitator's
// /supported 200.
func (p *invProc) awaitReady() {
	p.w.t.Helper()
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	proc.waitUntil("its first answer", 90*time.Second, answersWith(p.ready, p.status))
}

// running reports whether the process is up.
func (p *invProc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.proc != nil && p.proc.running()
}

// kill SIGKILLs the process.
func (p *invProc) kill() {
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if proc != nil {
		proc.kill()
	}
}

// signal sends sig to the process, if it runs.
func (p *invProc) signal(sig os.Signal) {
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if proc != nil && proc.running() {
		_ = proc.cmd.Process.Signal(sig)
	}
}

// stopGracefully sends sig (SIGINT or SIGTERM) and waits at most bound for the process to exit; past that it is
// SIGKILLed. It reports whether the process exited by itself, and its exit error then: one that had exited before
// the signal is an error too.
func (p *invProc) stopGracefully(sig os.Signal, bound time.Duration) (exited bool, err error) {
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if !proc.running() {
		return true, fmt.Errorf("it had exited before the signal: %v", proc.err)
	}
	if p.admin != "" {
		// A stop that hangs leaves every goroutine's stack in the gateway's output (kept whole under
		// X402_E2E_LOGS), read from Caddy's admin endpoint, which stays up until the apps stopped.
		proc.beforeKill = func() {
			c := http.Client{Timeout: 3 * time.Second}
			resp, err := c.Get("http://" + p.admin + "/debug/pprof/goroutine?debug=2")
			if err != nil {
				fmt.Fprintf(proc.out, "\n--- goroutines of the hung stop: %v\n", err)
				return
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
			fmt.Fprintf(proc.out, "\n--- goroutines of the hung stop (%s):\n%s\n", resp.Status, body)
			// The test's log keeps the goroutines in this project's code (CI shows only the last lines of an
			// output).
			var ours []string
			for _, g := range strings.Split(string(body), "\n\n") {
				if strings.Contains(g, "caddy-x402") {
					ours = append(ours, g)
				}
			}
			proc.t.Logf("%s: the graceful stop hung; its goroutines in caddy-x402's code (%d):\n%s", p.name, len(ours), lastLines(strings.Join(ours, "\n\n"), 400))
		}
	}
	return proc.stopWithin(sig, bound)
}

// stop stops the process cleanly (SIGINT), if it runs.
func (p *invProc) stop() {
	p.mu.Lock()
	proc := p.proc
	p.mu.Unlock()
	if proc != nil && proc.running() {
		proc.stop()
	}
}

// reload loads the Caddyfile of configuration gen (invWorld.gen) through the admin API, as `caddy reload` does.
func (p *invProc) reload(gen int) error {
	config := p.config(gen)
	if err := os.WriteFile(p.file, []byte(config), 0o600); err != nil {
		return err
	}
	req, err := http.NewRequest(http.MethodPost, "http://"+p.admin+"/load", strings.NewReader(config))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := httpClient.Do(req)
	if err != nil {
		return fmt.Errorf("reloading %s: %w", p.name, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reloading %s: %d %s", p.name, resp.StatusCode, shorten(string(body)))
	}
	return nil
}

// The upstream's protocol with the run's client: request headers that say which payment a request presents
// and what the upstream should name as its charge.
const (
	invPaymentHeader = "X-Invariant-Payment" // the run's number of the payment presented
	invUseHeader     = "X-Invariant-Use"     // what the upstream names in Settlement-Overrides (see overrideFor)
)

// overrideFor is the Settlement-Overrides an upstream names for use: "" for none (no header).
func overrideFor(use string) string {
	switch use {
	case "", "none":
		return ""
	case "malformed":
		return `4321 units, roughly`
	}
	return fmt.Sprintf(`{"amount":%q}`, use)
}

// invUpstream is the resource server behind the upstream routes: it answers every request 200 with a body that
// names the method, the path and the size of the request body, names the charge the client asked for in
// Settlement-Overrides whatever the request's shape (upgrade headers included: it ignores them), and on /ws/
// speaks WebSocket (the handshake, then echoes what it gets). It counts the requests of each payment. The batch
// route's paths under invBatchFlaky are its too (see flaky).
type invUpstream struct {
	mu         sync.Mutex
	runs       map[string]int  // by payment number: requests the upstream answered
	flakyAsked map[string]bool // the paths under invBatchFlaky asked for (see flaky)
}

// upstreamBody is what the upstream answers to method on path with a request body of n bytes.
func upstreamBody(method, path string, n int) string {
	return fmt.Sprintf("the upstream's answer to %s %s with a body of %d bytes\n", method, path, n)
}

// wsGUID is RFC 6455's key suffix.
const wsGUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

func wsAccept(key string) string {
	h := sha1.Sum([]byte(key + wsGUID))
	return base64.StdEncoding.EncodeToString(h[:])
}

func (u *invUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if strings.HasPrefix(r.URL.Path, invBatchFlaky) {
		u.flaky(w, r)
		return
	}
	u.mu.Lock()
	u.runs[r.Header.Get(invPaymentHeader)]++
	u.mu.Unlock()
	if r.Header.Get(invMCPHeader) != "" {
		mcpUpstream(w, r)
		return
	}
	if strings.EqualFold(r.Header.Get("Upgrade"), "websocket") {
		u.websocket(w, r)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "reading the request body: "+err.Error(), http.StatusBadRequest)
		return
	}
	if v := overrideFor(r.Header.Get(invUseHeader)); v != "" {
		w.Header().Set(x402.HeaderSettlementOverrides, v)
	}
	answer := upstreamBody(r.Method, r.URL.Path, len(body))
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("Content-Length", fmt.Sprint(len(answer)))
	if r.Method != http.MethodHead {
		io.WriteString(w, answer)
	}
}

// websocket answers the handshake and echoes what the client sends until it hangs up.
func (u *invUpstream) websocket(w http.ResponseWriter, r *http.Request) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		http.Error(w, "cannot hijack", http.StatusInternalServerError)
		return
	}
	conn, rw, err := hj.Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	fmt.Fprintf(rw, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n",
		wsAccept(r.Header.Get("Sec-WebSocket-Key")))
	if rw.Flush() != nil {
		return
	}
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	io.Copy(conn, rw.Reader)
}

// runsOf is how many requests of payment n the upstream answered.
func (u *invUpstream) runsOf(n int) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[fmt.Sprint(n)]
}

// Modes of the fault proxy.
const (
	rpcPass = ""     // every request passes
	rpc503  = "503"  // every request is answered 503, the node never sees it
	rpcHang = "hang" // requests are held until the mode changes, then passed on; their callers have usually gone
	rpcLose = "lose" // requests reach the node, and the connection is cut before its answer
	// rpcRefuse: every eth_sendRawTransaction is refused as a node refuses a transaction whose sender cannot pay
	// its gas (JSON-RPC -32000), and never reaches the node; every other request passes.
	rpcRefuse = "refuse"
)

// faultProxy is a reverse proxy between the Caddys and the chain's JSON-RPC, switched between the modes above.
type faultProxy struct {
	target string
	url    string
	client *http.Client

	mu      sync.Mutex
	mode    string
	release chan struct{} // closed when a hang ends
	counts  map[string]int
}

func startFaultProxy(t *testing.T, target string) *faultProxy {
	f := &faultProxy{target: target, client: &http.Client{Timeout: 30 * time.Second}, release: make(chan struct{}), counts: map[string]int{}}
	srv := httptest.NewServer(f)
	t.Cleanup(func() {
		f.set(rpcPass)
		srv.Close()
	})
	f.url = srv.URL
	return f
}

// set switches the proxy to mode; the requests a hang held go on.
func (f *faultProxy) set(mode string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mode == rpcHang && mode != rpcHang {
		close(f.release)
		f.release = make(chan struct{})
	}
	f.mode = mode
}

func (f *faultProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	f.mu.Lock()
	mode, release := f.mode, f.release
	f.counts[mode]++
	f.mu.Unlock()
	if mode == rpcRefuse && bytes.Contains(body, []byte(`"eth_sendRawTransaction"`)) {
		var probe struct {
			ID json.RawMessage `json:"id"`
		}
		_ = json.Unmarshal(body, &probe)
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"jsonrpc":"2.0","id":` + cmp.Or(string(probe.ID), "1") + `,"error":{"code":-32000,"message":"insufficient funds for gas * price + value"}}`))
		return
	}
	switch mode {
	case rpc503:
		http.Error(w, "the fault proxy answers 503", http.StatusServiceUnavailable)
		return
	case rpcHang:
		<-release
	}
	// Passed on whatever became of the caller: a node gets what was sent to it.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.target, bytes.NewReader(body))
	if err != nil {
		return
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.client.Do(req)
	if err != nil {
		http.Error(w, "the fault proxy could not reach the node: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(resp.Body)
	if mode == rpcLose || err != nil {
		panic(http.ErrAbortHandler) // the connection is cut: the node did it, the caller never learns what
	}
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.WriteHeader(resp.StatusCode)
	w.Write(answer)
}

// tally says how many requests each mode saw.
func (f *faultProxy) tally() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var parts []string
	for _, m := range []string{rpcPass, rpc503, rpcHang, rpcLose, rpcRefuse} {
		name := m
		if m == rpcPass {
			name = "passed"
		}
		parts = append(parts, fmt.Sprintf("%s %d", name, f.counts[m]))
	}
	return strings.Join(parts, ", ")
}
