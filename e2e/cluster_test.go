package e2e

import (
	"cmp"
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The acceptance tests of several Caddy gateways sharing one PostgreSQL journal: one `caddy x402 devchain`
// process, one PostgreSQL server of the test's own, and three Caddy processes with the same Caddyfile (the
// same twelve dev wallets, the same journal DSN, one paid route). What they assert is judged on chain: token
// balances and Transfer logs, to the unit.

const (
	// clusterGateways is the number of Caddy processes sharing the journal.
	clusterGateways = 3
	// clusterWallets is the number of settlement wallets every gateway is configured with; the gateways share
	// them by leases, four each while three are alive.
	clusterWallets = 12
	// clusterPrice is the paid route's price in raw units of the 6-decimal dev token ($0.01).
	clusterPrice = 10000
	// clusterContent is the paid route's response body.
	clusterContent = "paid"
	// clusterRequestTimeout is longer than the gate's own settlement timeout (2 minutes).
	clusterRequestTimeout = 3 * time.Minute
	// clusterRetryFor bounds how long a client presents again a payment whose answer was not final (no answer,
	// a 5xx, or another instance presenting it): long enough for a dead instance's in-flight marks (instance TTL
	// 10 s) and wallet leases (15 s) to pass on.
	clusterRetryFor = 90 * time.Second
	// clusterDrainWait bounds how long the settlements get to drain at the end.
	clusterDrainWait = 90 * time.Second
)

// cluster is the dev chain, the database and the gateways of one test, and the client that pays them.
type cluster struct {
	t        *testing.T
	dir      string
	dev      *devChain
	chainURL string
	chainID  *big.Int
	wallets  []common.Address
	pg       *pgtest.Server
	dsn      string // the gateways' journal DSN (through bouncer, when there is one); never logged
	bouncer  *pgtest.PgBouncer
	gates    []*clusterGate
	offer    x402.PaymentRequirements
	payers   []*ecdsa.PrivateKey
	setup    clusterSetup
	// price is the paid route's price as its Caddyfile says it ("$0.01" unless a test reloads another).
	price string

	transport *http.Transport
	client    *http.Client

	mu       sync.Mutex
	payments []*clusterPayment
}

// clusterGate is one Caddy process of the cluster.
type clusterGate struct {
	n    int
	name string
	url  string
	proc *process
	dead atomic.Bool // SIGKILLed by the test

	file     string      // its Caddyfile
	dsn      string      // the journal's DSN it uses: the database's, or its journal proxy's; never logged
	rpc      string      // the chain's RPC it uses: the chain's, or its fault proxy's
	admin    string      // its admin API's address, "" when off
	pgProxy  *pgProxy    // with clusterSetup.journalProxies
	rpcProxy *faultProxy // with clusterSetup.chainProxies
}

// clusterSetup is what a cluster test changes of the defaults.
type clusterSetup struct {
	payers  int
	wallets int // the settlement wallets every gateway is configured with (clusterWallets by default)
	// routes, when set, are the site's routes in place of the one paid route at /: a format taking the seller
	// (%[1]s) and the content (%[2]q).
	routes string
	// anyShares: start once every wallet is leased, however they are shared out (the test looks at that).
	anyShares bool
	// noLeaseWait: start as soon as every gateway answers its paid route, the leases still being shared out.
	noLeaseWait bool
	// async: the paid route settles async; its 200s say the settlement is pending, and the test reads each
	// payment's settlement from the journal (asyncSettlements).
	async bool
	// admin: each gateway's admin API listens on a port of its own (clusterGate.admin), for reloads.
	admin bool
	// journalProxies: each gateway reaches PostgreSQL through a TCP proxy of the test's own (clusterGate.pgProxy),
	// which the test can make hang.
	journalProxies bool
	// chainProxies: each gateway reaches the chain's RPC through a fault proxy of its own (clusterGate.rpcProxy).
	chainProxies bool
	// retryNoWallets: a 402 no_available_wallets (the spec's "retry in 1 to 2 seconds") is not final: the
	// payment is presented again, as a client told so does.
	retryNoWallets bool
	// pgbouncer: the gateways reach the journal through a PgBouncer of the test's own in transaction pooling
	// mode (c.bouncer), as production PostgreSQL often is; the test's own reads of the journal go through it too.
	// Stopping and restarting c.pg leaves PgBouncer up.
	pgbouncer bool
}

// startCluster starts the dev chain with payers funded demo payers (each approves Permit2 once, so that its
// token balance moves by the prices alone), the database and the three gateways, and waits until the wallet
// leases are shared out: four wallets held by each gateway.
func startCluster(t *testing.T, payers int) *cluster {
	t.Helper()
	return startClusterWith(t, clusterSetup{payers: payers})
}

// startClusterWith is startCluster as s says.
func startClusterWith(t *testing.T, s clusterSetup) *cluster {
	t.Helper()
	needBinary(t)
	started := time.Now()
	s.wallets = cmp.Or(s.wallets, clusterWallets)
	payers := s.payers
	c := &cluster{t: t, dir: t.TempDir(), chainID: new(big.Int).SetUint64(devchain.DefaultChainID), setup: s, price: "$0.01"}

	// The database starts while the chain does; a machine without PostgreSQL ends the test here, in its own
	// goroutine, where a test may be skipped.
	pgtest.Need(t)
	pgReady := make(chan struct{})
	var pgErr any
	go func() {
		defer close(pgReady)
		defer func() { pgErr = recover() }()
		c.pg = pgtest.Start(t)
	}()

	_, facts := startDevchain(t, c.dir, "--wallets", fmt.Sprint(s.wallets), "--payers", fmt.Sprint(payers))
	if len(facts.Wallets) != s.wallets || len(facts.Payers) != payers {
		t.Fatalf("the chain funded %d wallets and %d payers, want %d and %d", len(facts.Wallets), len(facts.Payers), s.wallets, payers)
	}
	c.chainURL = facts.RPC
	c.dev = dialChain(t, c.chainURL)
	for _, w := range facts.Wallets {
		c.wallets = append(c.wallets, common.HexToAddress(w))
	}
	for i := range payers {
		key := devchain.PayerKeyN(i)
		if got := crypto.PubkeyToAddress(key.PublicKey); got != common.HexToAddress(facts.Payers[i]) {
			t.Fatalf("demo payer %d is %s on the chain, %s by devchain.PayerKeyN", i, facts.Payers[i], got)
		}
		c.payers = append(c.payers, key)
		c.dev.approvePermit2(key, devchain.TokenAddress)
	}

	<-pgReady
	if pgErr != nil {
		t.Fatalf("starting PostgreSQL: %v", pgErr)
	}
	c.dsn = c.pg.DSN()
	if s.pgbouncer {
		c.bouncer = pgtest.StartPgBouncer(t, c.dsn)
		c.dsn = c.bouncer.DSN()
	}

	for i := range clusterGateways {
		g := &clusterGate{n: i, name: fmt.Sprintf("gateway %d", i), url: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
			dsn: c.dsn, rpc: c.chainURL}
		if s.admin {
			g.admin = fmt.Sprintf("127.0.0.1:%d", freePort(t))
		}
		if s.journalProxies {
			g.pgProxy = startPgProxy(t, c.dsn)
			g.dsn = g.pgProxy.dsn
		}
		if s.chainProxies {
			g.rpcProxy = startFaultProxy(t, c.chainURL)
			g.rpc = g.rpcProxy.url
		}
		g.file = writeFile(t, c.dir, fmt.Sprintf("gateway%d.Caddyfile", i), c.gateCaddyfile(g))
		g.proc = startProcess(t, g.name, c.dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", g.file)
		c.gates = append(c.gates, g)
	}
	t.Cleanup(c.keepLogs)
	for _, g := range c.gates {
		g.proc.waitUntil("a 402 from the gateway", 90*time.Second, answersWith(g.url+"/", 402))
	}
	switch {
	case s.noLeaseWait:
	case s.anyShares:
		c.waitSettledLeases(60 * time.Second)
	default:
		c.waitLeases("the wallets shared out by the three gateways", 60*time.Second, clusterGateways)
	}
	c.offer = permit2Offer(t, c.gates[0].url+"/")
	if c.offer.MaxTimeoutSeconds < 3600 {
		t.Fatalf("the offer's maxTimeoutSeconds is %d; the test needs the max_timeout 24h it configured", c.offer.MaxTimeoutSeconds)
	}

	c.transport = &http.Transport{MaxIdleConnsPerHost: 64}
	t.Cleanup(c.transport.CloseIdleConnections)
	c.client = &http.Client{Transport: c.transport, Timeout: clusterRequestTimeout}
	t.Logf("the cluster is up in %v: a dev chain, PostgreSQL, %d gateways sharing %d wallets, %d payers",
		time.Since(started).Round(100*time.Millisecond), clusterGateways, s.wallets, payers)
	return c
}

// caddyfile is a gateway's Caddyfile: the dev chain's wallets (twelve by default), the journal (a DSN or a file)
// and the paid route at siteURL (or the setup's routes).
func (c *cluster) caddyfile(journal, siteURL string) string {
	return c.caddyfileWith(journal, siteURL, c.chainURL, "")
}

// gateCaddyfile is gateway g's Caddyfile: its journal DSN, chain RPC and admin API, and the cluster's price now.
func (c *cluster) gateCaddyfile(g *clusterGate) string {
	return c.caddyfileWith(g.dsn, g.url, g.rpc, g.admin)
}

// caddyfileWith is caddyfile with the chain's RPC at rpc and the admin API at admin ("": off).
func (c *cluster) caddyfileWith(journal, siteURL, rpc, admin string) string {
	settle := ""
	if c.setup.async {
		settle = "\n\t\tsettle async"
	}
	routes := fmt.Sprintf(`	x402 %s {
		pay_to %s
		max_timeout 24h%s
	}
	respond %q`, c.price, seller.Hex(), settle, clusterContent)
	if c.setup.routes != "" {
		routes = fmt.Sprintf(c.setup.routes, seller.Hex(), clusterContent)
	}
	return fmt.Sprintf(`{
	admin %s
	x402 {
		dev_chain {
			rpc %s
			wallets 0-%d
		}
		journal %s
	}
}

%s {
	bind 127.0.0.1
%s
}
`, cmp.Or(admin, "off"), rpc, c.setup.wallets-1, journal, siteURL, routes)
}

// clusterLogsEnv names a directory where a failed cluster test leaves the whole output of each gateway.
const clusterLogsEnv = "X402_CLUSTER_LOGS"

// keepLogs writes each gateway's whole output to $X402_CLUSTER_LOGS when the test failed.
func (c *cluster) keepLogs() {
	dir := os.Getenv(clusterLogsEnv)
	if dir == "" || !c.t.Failed() {
		return
	}
	for _, g := range c.gates {
		path := filepath.Join(dir, fmt.Sprintf("%s-gateway%d.log", c.t.Name(), g.n))
		if err := os.WriteFile(path, []byte(g.proc.out.String()), 0o644); err != nil {
			c.t.Logf("keeping the log of %s: %v", g.name, err)
			continue
		}
		c.t.Logf("the whole output of %s is in %s", g.name, path)
	}
}

// logged counts, over the gateways' output, the log lines whose message starts with each of msgs, and says so.
func (c *cluster) logged(msgs ...string) string {
	var parts []string
	for _, m := range msgs {
		n := 0
		for _, g := range c.gates {
			n += strings.Count(g.proc.out.String(), `"msg":"`+m)
		}
		parts = append(parts, fmt.Sprintf("%d× %q", n, m))
	}
	return strings.Join(parts, ", ")
}

// query runs fn on a fresh connection to the journal's database.
func (c *cluster) query(fn func(ctx context.Context, conn *pgx.Conn) error) error {
	return queryPostgres(c.dsn, fn)
}

// queryPostgres runs fn on a fresh connection to the database at dsn, which no error quotes. The connection
// prepares no statement (the simple protocol), so it works through a connection pooler too.
func queryPostgres(dsn string, fn func(ctx context.Context, conn *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return fmt.Errorf("the journal's DSN does not parse: %w", errors.New(strings.ReplaceAll(err.Error(), dsn, "<dsn>")))
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connecting to the journal's database: %w", errors.New(strings.ReplaceAll(err.Error(), dsn, "<dsn>")))
	}
	defer conn.Close(ctx)
	return fn(ctx, conn)
}

// leases reads the live wallet leases: instance token -> wallets.
func (c *cluster) leases() (map[string][]common.Address, error) { return readLeases(c.dsn) }

// readLeases reads the live wallet leases of the journal at dsn: instance token -> wallets.
func readLeases(dsn string) (map[string][]common.Address, error) {
	out := map[string][]common.Address{}
	err := queryPostgres(dsn, func(ctx context.Context, conn *pgx.Conn) error {
		rows, err := conn.Query(ctx, `SELECT owner, name FROM x402_leases WHERE owner <> '' AND expires_at > now() ORDER BY name`)
		if err != nil {
			return err
		}
		for rows.Next() {
			var owner, name string
			if err := rows.Scan(&owner, &name); err != nil {
				return err
			}
			out[owner] = append(out[owner], common.HexToAddress(name[strings.LastIndex(name, ":")+1:]))
		}
		return rows.Err()
	})
	return out, err
}

// waitLeases waits until every wallet's lease is held, by exactly holders instances, evenly; with holders 0,
// however they are shared out.
func (c *cluster) waitLeases(what string, timeout time.Duration, holders int) map[string][]common.Address {
	c.t.Helper()
	return waitLeasesShared(c.t, c.dsn, c.setup.wallets, holders, what, timeout)
}

// waitLeasesShared waits until the leases of the journal at dsn share out all of wallets, evenly among exactly
// holders instances (with holders 0, however they are shared out), and fails t after timeout.
func waitLeasesShared(t *testing.T, dsn string, wallets, holders int, what string, timeout time.Duration) map[string][]common.Address {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		l, err := readLeases(dsn)
		if err == nil {
			n := 0
			even := len(l) == holders || holders == 0
			for _, ws := range l {
				n += len(ws)
				even = even && (holders == 0 || len(ws) == (wallets+holders-1)/holders || len(ws) == wallets/holders)
			}
			if even && n == wallets {
				return l
			}
			err = fmt.Errorf("the leases held: %s", describeLeases(l))
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s within %v: %v", what, timeout, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitSettledLeases waits until every wallet is leased, every gateway's instance is alive, and the leases have
// stayed as they are for a few seconds (several passes of every gateway's lease loop), however they are shared.
func (c *cluster) waitSettledLeases(timeout time.Duration) map[string][]common.Address {
	c.t.Helper()
	const still = 4 * time.Second
	deadline := time.Now().Add(timeout)
	var last string
	since := time.Now()
	for {
		l, err := c.leases()
		var live int
		if err == nil {
			err = c.query(func(ctx context.Context, conn *pgx.Conn) error {
				return conn.QueryRow(ctx, `SELECT count(*) FROM x402_instances WHERE expires_at > now()`).Scan(&live)
			})
		}
		if err == nil {
			n := 0
			for _, ws := range l {
				n += len(ws)
			}
			now := fmt.Sprint(l)
			if n != c.setup.wallets || live != len(c.gates) || now != last {
				last, since = now, time.Now()
			} else if time.Since(since) >= still {
				return l
			}
			err = fmt.Errorf("%d live instances, the leases held: %s", live, describeLeases(l))
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("the wallet leases did not settle within %v: %v", timeout, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func describeLeases(l map[string][]common.Address) string {
	var parts []string
	for owner, ws := range l {
		parts = append(parts, fmt.Sprintf("instance %s holds %d", shortToken(owner), len(ws)))
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func shortToken(s string) string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}

// pendingRecords counts the journal's records whose settlement is not final.
func (c *cluster) pendingRecords() (int, error) {
	var n int
	err := c.query(func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT count(*) FROM x402_records WHERE pending`).Scan(&n)
	})
	return n, err
}

// describePending lists the journal's records that are not final, read through the journal package. Opening
// the store adds an instance to the cluster: only for a test that is failing already.
func (c *cluster) describePending() string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := journal.OpenPostgres(ctx, c.dsn, journal.Options{})
	if err != nil {
		return fmt.Sprintf("(the journal could not be opened to list them: %v)", err)
	}
	defer st.Close()
	recs, err := st.Pending(ctx)
	if err != nil {
		return fmt.Sprintf("(listing them: %v)", err)
	}
	var lines []string
	for i, r := range recs {
		if i == 15 {
			lines = append(lines, fmt.Sprintf("  ... and %d more", len(recs)-i))
			break
		}
		lines = append(lines, fmt.Sprintf("  %s: payer %s, state %s, async %v, served %v, owner %s, wallet %s nonce %d, tx %q, response %+v",
			r.ID, r.Payer, r.State, r.Async, r.Served, shortToken(r.Owner), r.Wallet, r.TxNonce, r.TxHash, r.Response))
	}
	return strings.Join(lines, "\n")
}

// heldWallets reads from a gateway's log the wallets whose leases it took and, of those, the ones it still
// holds (not given up or lost since).
func (g *clusterGate) heldWallets() (took, holds map[common.Address]bool) {
	took, holds = map[common.Address]bool{}, map[common.Address]bool{}
	for _, line := range strings.Split(g.proc.out.String(), "\n") {
		if !strings.HasPrefix(line, "{") || !strings.Contains(line, "lease of a settlement wallet") {
			continue
		}
		var e struct {
			Msg    string `json:"msg"`
			Wallet string `json:"wallet"`
		}
		if json.Unmarshal([]byte(line), &e) != nil || !common.IsHexAddress(e.Wallet) {
			continue
		}
		w := common.HexToAddress(e.Wallet)
		switch {
		case strings.HasPrefix(e.Msg, "took the lease"):
			took[w], holds[w] = true, true
		case strings.HasPrefix(e.Msg, "gave up the lease"), strings.HasPrefix(e.Msg, "lost the lease"):
			delete(holds, w)
		}
	}
	return took, holds
}

// chainTime is the time of the chain's head block, which the client signs by: with block time 0 the chain
// runs ahead of the wall clock, a second per block.
func (c *cluster) chainTime() time.Time {
	c.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	h, err := c.dev.client.HeaderByNumber(ctx, nil)
	if err != nil {
		c.t.Fatalf("reading the chain's head: %v", err)
	}
	return time.Unix(int64(h.Time), 0)
}

// clusterPayment is one signed payment and every answer its presentations got.
type clusterPayment struct {
	n      int
	payer  int
	header string
	nonce  string
	price  int64 // what it pays, in raw units

	mu      sync.Mutex
	answers []clusterAnswer
	paid    int    // 200s with the content
	tx      string // the transaction of the (first) 200's PAYMENT-RESPONSE
	refused string // a final answer other than 200, when there was one
}

// clusterAnswer is one presentation of a payment to one gateway.
type clusterAnswer struct {
	gate       int
	sent, got  time.Time
	status     int    // 0: no answer
	text       string // the error, the 402's reason or the body
	tx         string // a 200's settlement transaction
	final      bool   // 200, or a refusal that presenting again cannot change
	presenting bool   // 402: another request is presenting the payment right now
}

func (a clusterAnswer) String() string {
	s := fmt.Sprintf("gw%d ", a.gate)
	switch {
	case a.status == 0:
		s += "no answer (" + a.text + ")"
	case a.status == http.StatusOK:
		s += "200 tx " + a.tx
	default:
		s += fmt.Sprintf("%d %s", a.status, a.text)
	}
	return s
}

func (p *clusterPayment) String() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var as []string
	for _, a := range p.answers {
		as = append(as, a.String())
	}
	return fmt.Sprintf("payment #%d (payer %d, nonce %s): %s", p.n, p.payer, p.nonce, strings.Join(as, "; "))
}

// sign signs a new payment of payer for the route, dated now (chain time).
func (c *cluster) sign(payer int, now time.Time) *clusterPayment {
	c.t.Helper()
	pl, err := chain.SignPermit2Payment(c.payers[payer], c.offer, c.chainID, chain.Permit2Options{Now: now})
	if err != nil {
		c.t.Fatalf("signing a payment: %v", err)
	}
	header, err := x402.EncodeHeader(pl)
	if err != nil {
		c.t.Fatal(err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	price, ok := new(big.Int).SetString(c.offer.Amount, 10)
	if !ok || !price.IsInt64() {
		c.t.Fatalf("the offer's amount %q is no price in raw units", c.offer.Amount)
	}
	p := &clusterPayment{n: len(c.payments) + 1, payer: payer, header: header, nonce: pl.Payload.Permit2Authorization.Nonce,
		price: price.Int64()}
	c.payments = append(c.payments, p)
	return p
}

// signMany signs n payments, spread over the payers in turn.
func (c *cluster) signMany(n int) []*clusterPayment {
	c.t.Helper()
	now := c.chainTime()
	out := make([]*clusterPayment, n)
	for i := range out {
		out[i] = c.sign(i%len(c.payers), now)
	}
	return out
}

// present sends p to gateway gate once and records the answer.
func (c *cluster) present(ctx context.Context, p *clusterPayment, gate int) clusterAnswer {
	a := c.ask(ctx, p, gate)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.answers = append(p.answers, a)
	switch {
	case a.status == http.StatusOK:
		p.paid++
		if p.tx == "" {
			p.tx = a.tx
		}
	case a.final:
		p.refused = a.String()
	}
	return a
}

func (c *cluster) ask(ctx context.Context, p *clusterPayment, gate int) clusterAnswer {
	a := clusterAnswer{gate: gate, sent: time.Now()}
	defer func() { a.got = time.Now() }()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.gates[gate].url+"/", nil)
	if err != nil {
		a.text = err.Error()
		return a
	}
	req.Header.Set(x402.HeaderPaymentSignature, p.header)
	resp, err := c.client.Do(req)
	if err != nil {
		a.text = shorten(err.Error())
		a.got = time.Now()
		return a
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	a.got = time.Now()
	a.status = resp.StatusCode
	switch {
	case err != nil:
		a.text = fmt.Sprintf("its body cut after %d bytes (%s)", len(body), shorten(err.Error()))
		if a.status == http.StatusOK {
			a.status = 0 // a 200 the client could not read is no response bought
		}
	case resp.StatusCode == http.StatusOK:
		s, err := x402.DecodeSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		switch {
		case string(body) != clusterContent:
			c.t.Errorf("payment #%d: 200 from gateway %d with body %q, want %q", p.n, gate, shorten(string(body)), clusterContent)
		case c.setup.async && err == nil && s.Pending():
			// Settled in the background: asyncSettlements reads its transaction from the journal.
		case err != nil || !s.Success || s.Transaction == "":
			c.t.Errorf("payment #%d: 200 from gateway %d with PAYMENT-RESPONSE %+v (%v), want a settled transaction", p.n, gate, s, err)
		}
		a.tx, a.final = strings.ToLower(s.Transaction), true
	case resp.StatusCode == http.StatusPaymentRequired:
		pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			a.text = "without a readable PAYMENT-REQUIRED"
			a.final = true
			break
		}
		a.text = shorten(pr.Error)
		a.presenting = strings.HasPrefix(pr.Error, x402.ReasonPaymentAlreadyUsed) && strings.Contains(pr.Error, "another request is presenting")
		noWallets := c.setup.retryNoWallets && strings.HasPrefix(pr.Error, x402.ReasonNoAvailableWallets)
		a.final = !a.presenting && !noWallets
	default:
		a.text = shorten(string(body))
		a.final = resp.StatusCode < 500
	}
	return a
}

// settle presents p to gateway first, then, while the answer is not final (no answer, a 5xx, another request
// presenting it), again to the next gateway not known dead, with a growing pause, for at most retryFor.
func (c *cluster) settle(p *clusterPayment, first int, retryFor time.Duration) {
	deadline := time.Now().Add(retryFor)
	pause := 100 * time.Millisecond
	gate := first
	for {
		ctx, cancel := context.WithTimeout(context.Background(), clusterRequestTimeout)
		a := c.present(ctx, p, gate)
		cancel()
		if a.final || time.Now().After(deadline) {
			return
		}
		time.Sleep(pause)
		pause = min(2*pause, 2*time.Second)
		for range c.gates {
			gate = (gate + 1) % len(c.gates)
			if !c.gates[gate].dead.Load() {
				break
			}
		}
	}
}

// loadInBackground starts c.load of payments at concurrency workers, each presented first to the gateways in
// turn and again to the next on no answer, and returns at once: the count of the payments finished, a channel
// closed when the load ends, and when it started.
func (c *cluster) loadInBackground(payments []*clusterPayment, workers int) (done *atomic.Int64, loaded <-chan struct{}, start time.Time) {
	done, start = new(atomic.Int64), time.Now()
	end := make(chan struct{})
	go func() {
		defer close(end)
		c.load(payments, workers, clusterRetryFor, roundRobin, done)
	}()
	return done, end, start
}

// load settles payments at concurrency workers, payment i first presented to gateway pick(i), and counts
// the payments finished in done.
func (c *cluster) load(payments []*clusterPayment, workers int, retryFor time.Duration, pick func(i int) int, done *atomic.Int64) {
	queue := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range queue {
				c.settle(payments[i], pick(i), retryFor)
				done.Add(1)
			}
		}()
	}
	for i := range payments {
		queue <- i
	}
	close(queue)
	wg.Wait()
}

// roundRobin presents payment i first to gateway i mod 3.
func roundRobin(i int) int { return i % clusterGateways }

// waitDone waits until n payments are finished, at most timeout.
func (c *cluster) waitDone(done *atomic.Int64, n int64, timeout time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for done.Load() < n {
		if time.Now().After(deadline) {
			c.t.Fatalf("only %d payments finished within %v, waiting for %d", done.Load(), timeout, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// chainLedger is what the chain shows of the payments to the seller since a block.
type chainLedger struct {
	transfers []types.Log
	byTx      map[string]types.Log // lower-case hash -> the transfer to the seller
	perPayer  []int                // transfers from each payer
}

func (c *cluster) chainLedger(fromBlock uint64) chainLedger {
	c.t.Helper()
	l := chainLedger{byTx: map[string]types.Log{}, perPayer: make([]int, len(c.payers))}
	for i, k := range c.payers {
		for _, tr := range c.dev.transfers(crypto.PubkeyToAddress(k.PublicKey), seller, fromBlock) {
			if _, dup := l.byTx[strings.ToLower(tr.TxHash.Hex())]; dup {
				c.t.Errorf("transaction %s moved tokens to the seller twice", tr.TxHash)
			}
			l.transfers = append(l.transfers, tr)
			l.byTx[strings.ToLower(tr.TxHash.Hex())] = tr
			l.perPayer[i]++
		}
	}
	return l
}

// balances are the seller's and the payers' token balances.
type balances struct {
	seller *big.Int
	payers []*big.Int
}

func (c *cluster) balances() balances {
	c.t.Helper()
	b := balances{seller: c.dev.balance(seller)}
	for _, k := range c.payers {
		b.payers = append(b.payers, c.dev.balance(crypto.PubkeyToAddress(k.PublicKey)))
	}
	return b
}

// nonces reads every settlement wallet's mined nonce.
func (c *cluster) nonces() map[common.Address]uint64 {
	c.t.Helper()
	out := map[common.Address]uint64{}
	for _, w := range c.wallets {
		ctx, cancel := rpcContext()
		n, err := c.dev.client.NonceAt(ctx, w, nil)
		cancel()
		if err != nil {
			c.t.Fatalf("reading the nonce of %s: %v", w, err)
		}
		out[w] = n
	}
	return out
}

// checkAccounts asserts, for the payments given, that each got exactly one 200, that every 200's transaction
// is a transfer of the price to the seller on chain and no transfer since fromBlock belongs to no 200, that the
// seller received exactly 200s x price and each payer paid exactly its 200s x price. It returns the ledger.
func (c *cluster) checkAccounts(payments []*clusterPayment, before balances, fromBlock uint64) chainLedger {
	c.t.Helper()
	after := c.balances()
	ledger := c.chainLedger(fromBlock)
	paid := 0
	paidBy := make([]int, len(c.payers))
	owed, owedBy := new(big.Int), make([]int64, len(c.payers))
	txs := map[string]*clusterPayment{}
	var notOne, notOnChain []string
	for _, p := range payments {
		if p.paid != 1 {
			notOne = append(notOne, p.String())
		}
		if p.paid == 0 {
			continue
		}
		paid++
		paidBy[p.payer]++
		if other := txs[p.tx]; other != nil {
			c.t.Errorf("payments #%d and #%d were answered with the same settlement transaction %s", other.n, p.n, p.tx)
		}
		txs[p.tx] = p
		owed.Add(owed, big.NewInt(p.price))
		owedBy[p.payer] += p.price
		tr, ok := ledger.byTx[p.tx]
		switch {
		case !ok:
			notOnChain = append(notOnChain, p.String())
		case common.BytesToAddress(tr.Topics[1].Bytes()) != crypto.PubkeyToAddress(c.payers[p.payer].PublicKey):
			c.t.Errorf("payment #%d of payer %d was settled by %s, a transfer from %s", p.n, p.payer, p.tx, common.BytesToAddress(tr.Topics[1].Bytes()))
		case transferAmount(tr).Cmp(big.NewInt(p.price)) != 0:
			c.t.Errorf("payment #%d was settled by %s, a transfer of %s to the seller; it pays %d", p.n, p.tx, transferAmount(tr), p.price)
		}
	}
	for h := range ledger.byTx {
		if txs[h] == nil {
			c.t.Errorf("transfer %s to the seller belongs to no payment answered 200", h)
		}
	}
	listFirst(c.t, "payments were not answered 200 exactly once", notOne, len(payments))
	listFirst(c.t, "payments were answered 200 with a transaction that moved nothing to the seller on chain", notOnChain, len(payments))

	if got := delta(before.seller, after.seller); got.Cmp(owed) != 0 {
		c.t.Errorf("the seller received %s, want exactly %s: what the %d payments answered 200 pay", got, owed, paid)
	}
	if len(ledger.transfers) != paid {
		c.t.Errorf("%d transfers to the seller on chain, want %d: one per payment answered 200", len(ledger.transfers), paid)
	}
	for i := range c.payers {
		want := big.NewInt(-owedBy[i])
		if got := delta(before.payers[i], after.payers[i]); got.Cmp(want) != 0 {
			c.t.Errorf("payer %d's balance moved by %s, want %s: %d payments of it answered 200", i, got, want, paidBy[i])
		}
		if ledger.perPayer[i] != paidBy[i] {
			c.t.Errorf("payer %d: %d transfers on chain, %d payments answered 200", i, ledger.perPayer[i], paidBy[i])
		}
	}
	c.t.Logf("%d payments, %d answered 200; the seller received %s (%d transfers on chain), the payers paid %s",
		len(payments), paid, delta(before.seller, after.seller), len(ledger.transfers), describePaid(before, after))
	return ledger
}

func describePaid(before, after balances) string {
	var parts []string
	for i := range before.payers {
		parts = append(parts, new(big.Int).Neg(delta(before.payers[i], after.payers[i])).String())
	}
	return strings.Join(parts, ", ")
}

// listFirst fails t with a list of what went wrong, the first few items of it.
func listFirst(t *testing.T, what string, items []string, of int) {
	t.Helper()
	if len(items) == 0 {
		return
	}
	shown := items
	if len(shown) > 10 {
		shown = append(slices.Clone(shown[:10]), fmt.Sprintf("... and %d more", len(items)-10))
	}
	t.Errorf("%d of %d %s:\n  %s", len(items), of, what, strings.Join(shown, "\n  "))
}

// drain waits until no journal record is pending and the seller holds want, at most clusterDrainWait, and
// fails the test with the records left otherwise.
func (c *cluster) drain(want *big.Int) {
	c.t.Helper()
	start := time.Now()
	for {
		n, err := c.pendingRecords()
		b, berr := c.dev.tokenBalance(seller)
		if err == nil && berr == nil && n == 0 && b.Cmp(want) == 0 {
			c.t.Logf("drained in %v: no journal record pending, the seller holds %s", time.Since(start).Round(100*time.Millisecond), b)
			return
		}
		if time.Since(start) > clusterDrainWait {
			c.t.Errorf("not drained within %v: %d journal records pending (%v), the seller holds %s (%v), want %s:\n%s",
				clusterDrainWait, n, err, b, berr, want, c.describePending())
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// countAnswers tallies answers by status and reason.
func countAnswers(payments []*clusterPayment, keep func(clusterAnswer) bool) map[string]int {
	out := map[string]int{}
	for _, p := range payments {
		p.mu.Lock()
		for _, a := range p.answers {
			if keep != nil && !keep(a) {
				continue
			}
			k := fmt.Sprint(a.status)
			switch {
			case a.status == 0:
				k = "no answer"
			case a.presenting:
				k = "402 another request is presenting"
			case a.status == http.StatusPaymentRequired:
				k = "402 " + firstWords(a.text, 12)
			case a.status != http.StatusOK:
				k = fmt.Sprintf("%d %s", a.status, firstWords(a.text, 8))
			}
			out[k]++
		}
		p.mu.Unlock()
	}
	return out
}

func firstWords(s string, n int) string {
	f := strings.Fields(s)
	if len(f) > n {
		f = append(f[:n], "...")
	}
	return strings.Join(f, " ")
}

func describeCounts(m map[string]int) string {
	var keys []string
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%d× %s", m[k], k))
	}
	return strings.Join(parts, "; ")
}

// TestClusterServesOneSignatureOnceWhenAllThreeGatewaysGetItAtOnce signs a payment and presents the same
// PAYMENT-SIGNATURE to the three gateways at the same moment, twenty times over with twenty payments. Each
// payment is answered 200 by exactly one gateway; the other two refuse it with 402 payment_already_used
// (another request is presenting it, or it bought its response already). On chain: exactly one transfer to
// the seller per payment, the one the 200 named, and the seller's balance moved by 20 x the price.
func TestClusterServesOneSignatureOnceWhenAllThreeGatewaysGetItAtOnce(t *testing.T) {
	c := startCluster(t, 1)
	const rounds = 20
	before, firstBlock := c.balances(), c.dev.head()
	payments := c.signMany(rounds)
	for _, p := range payments {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for g := range c.gates {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				ctx, cancel := context.WithTimeout(context.Background(), clusterRequestTimeout)
				defer cancel()
				c.present(ctx, p, g)
			}()
		}
		close(start)
		wg.Wait()
	}
	counts := countAnswers(payments, nil)
	t.Logf("answers to %d payments, each presented to the %d gateways at once: %s", rounds, clusterGateways, describeCounts(counts))
	winners := make([]int, clusterGateways)
	for _, p := range payments {
		for _, a := range p.answers {
			switch {
			case a.status == http.StatusOK:
				winners[a.gate]++
			case a.status == http.StatusPaymentRequired && strings.HasPrefix(a.text, x402.ReasonPaymentAlreadyUsed):
			default:
				t.Errorf("payment #%d: gateway %d answered %s; want 200 or 402 %s", p.n, a.gate, a, x402.ReasonPaymentAlreadyUsed)
			}
		}
	}
	t.Logf("the 200s by gateway: %v", winners)
	c.checkAccounts(payments, before, firstBlock)
	c.drain(new(big.Int).Add(before.seller, big.NewInt(rounds*clusterPrice)))
	for _, g := range c.gates {
		g.proc.stop()
	}
}

// settlementsBy reads the sender of every 200's settlement transaction among payments, and checks that it is
// one of the cluster's wallets and that the gateway that answered 200 had taken that wallet's lease. It returns
// the wallets each gateway settled from, and all the wallets used.
func (c *cluster) settlementsBy(payments []*clusterPayment) (perGate []map[common.Address]int, used map[common.Address]int) {
	c.t.Helper()
	ours := map[common.Address]bool{}
	for _, w := range c.wallets {
		ours[w] = true
	}
	perGate, used = make([]map[common.Address]int, len(c.gates)), map[common.Address]int{}
	took := make([]map[common.Address]bool, len(c.gates))
	for i, g := range c.gates {
		perGate[i] = map[common.Address]int{}
		took[i], _ = g.heldWallets()
	}
	for _, p := range payments {
		for _, a := range p.answers {
			if a.status != http.StatusOK {
				continue
			}
			from := c.dev.sender(common.HexToHash(a.tx))
			if !ours[from] {
				c.t.Errorf("payment #%d was settled by gateway %d from %s, none of the cluster's wallets", p.n, a.gate, from)
			}
			if !took[a.gate][from] {
				c.t.Errorf("payment #%d was settled by gateway %d from wallet %s, whose lease its log never says it took", p.n, a.gate, from)
			}
			perGate[a.gate][from]++
			used[from]++
		}
	}
	return perGate, used
}

func describeWallets(m map[common.Address]int) string {
	var parts []string
	for w, n := range m {
		parts = append(parts, fmt.Sprintf("%s…:%d", w.Hex()[:6], n))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// TestClusterSettles600PaymentsSpreadOverThreeGatewaysEachOnce pays 600 distinct payments of six payers at
// concurrency 24, payment i to gateway i mod 3, each presented once. Every payment is answered 200 with a
// transaction of its own (600 distinct hashes), the chain shows 600 transfers to the seller, the seller's
// balance moved by exactly 600 x the price and each payer's by exactly its payments. Each gateway settled only
// from wallets whose leases it took; the three used all twelve wallets between them, and the wallets' nonces
// moved by 600 in all: every settlement transaction was mined and none was lost to a nonce collision.
func TestClusterSettles600PaymentsSpreadOverThreeGatewaysEachOnce(t *testing.T) {
	c := startCluster(t, 6)
	const n, workers = 600, 24
	payments := c.signMany(n)
	before, firstBlock, noncesBefore := c.balances(), c.dev.head(), c.nonces()
	start := time.Now()
	var done atomic.Int64
	c.load(payments, workers, 0, roundRobin, &done)
	elapsed := time.Since(start)
	t.Logf("%d payments at concurrency %d in %v (%.0f/s): %s", n, workers, elapsed.Round(10*time.Millisecond),
		float64(n)/elapsed.Seconds(), describeCounts(countAnswers(payments, nil)))

	ledger := c.checkAccounts(payments, before, firstBlock)
	txs := map[string]bool{}
	for _, p := range payments {
		if p.tx != "" {
			txs[p.tx] = true
		}
	}
	if len(txs) != n || len(ledger.transfers) != n {
		t.Errorf("%d distinct settlement transactions in the 200s and %d transfers on chain, want %d of each", len(txs), len(ledger.transfers), n)
	}
	perGate, used := c.settlementsBy(payments)
	for i := range c.gates {
		t.Logf("gateway %d settled from %d wallets: %s", i, len(perGate[i]), describeWallets(perGate[i]))
	}
	if len(used) != clusterWallets {
		t.Errorf("the gateways settled from %d wallets, want all %d", len(used), clusterWallets)
	}
	for w := range used {
		var by []int
		for i := range c.gates {
			if perGate[i][w] > 0 {
				by = append(by, i)
			}
		}
		if len(by) > 1 {
			// Leases did not move during the load: no wallet should serve two instances.
			t.Errorf("wallet %s settled for gateways %v: its lease moved during a load with every gateway alive", w, by)
		}
	}
	noncesAfter, sent := c.nonces(), uint64(0)
	for _, w := range c.wallets {
		sent += noncesAfter[w] - noncesBefore[w]
	}
	if sent != n {
		t.Errorf("the settlement wallets' nonces moved by %d in all, want %d: one mined transaction per payment", sent, n)
	}
	c.drain(new(big.Int).Add(before.seller, big.NewInt(n*clusterPrice)))
	if l, err := c.leases(); err != nil || len(l) != clusterGateways {
		t.Errorf("after the load, the leases held: %s (%v); want each gateway to hold 4", describeLeases(l), err)
	}
	for _, g := range c.gates {
		g.proc.stop()
	}
}

// TestClusterSIGKILLOfOneGatewayMidLoadLosesAndDoublesNothing pays 300 distinct payments of six payers over the
// three gateways at concurrency 12 and SIGKILLs one gateway after the first 100 have finished. A client whose
// request got no answer, a 5xx, or "another request is presenting this payment" (the dead gateway's in-flight
// mark, until its instance expires) presents THE SAME payment to the next live gateway, with a growing pause,
// for up to 90 s. Then, once the living have taken the dead one's wallet leases, 60 more payments go to the
// living two. In the end every payment got exactly one 200; the seller's balance moved by exactly 200s x the
// price and each payer's by its own 200s; the dead gateway's wallets settled payments for the living after
// the kill; and, once drained, no journal record is left pending.
func TestClusterSIGKILLOfOneGatewayMidLoadLosesAndDoublesNothing(t *testing.T) {
	c := startCluster(t, 6)
	const n, workers, killAfter, afterKill = 300, 12, 100, 60
	payments := c.signMany(n)
	before, firstBlock := c.balances(), c.dev.head()
	victim := c.gates[2]

	done, loaded, start := c.loadInBackground(payments, workers)
	c.waitDone(done, killAfter, 2*time.Minute)
	_, victimWallets := victim.heldWallets()
	victim.dead.Store(true)
	victim.proc.kill()
	killedAt := time.Now()
	t.Logf("SIGKILLed gateway %d after %v, %d payments finished; it held the leases of %d wallets", victim.n,
		killedAt.Sub(start).Round(10*time.Millisecond), done.Load(), len(victimWallets))
	<-loaded
	t.Logf("the load of %d payments finished %v after the kill: %s", n, time.Since(killedAt).Round(10*time.Millisecond),
		describeCounts(countAnswers(payments, nil)))

	// The payments the kill cut: in the dead gateway's hands when it was killed, without an answer.
	cut, refused := 0, 0
	for _, p := range payments {
		for _, a := range p.answers {
			switch {
			case a.gate == victim.n && a.status == 0 && a.sent.Before(killedAt):
				cut++
			case a.gate == victim.n && a.status == 0:
				refused++
			}
		}
	}
	t.Logf("the kill cut %d requests in flight at the dead gateway; %d more were sent to it after and found nobody; after the kill the "+
		"living answered: %s", cut, refused, describeCounts(countAnswers(payments, func(a clusterAnswer) bool { return a.sent.After(killedAt) })))

	leases := c.waitLeases("the dead gateway's wallets taken over by the living two", 60*time.Second, clusterGateways-1)
	t.Logf("%v after the kill, the living hold the leases: %s", time.Since(killedAt).Round(100*time.Millisecond), describeLeases(leases))

	more := c.signMany(afterKill)
	c.load(more, workers, clusterRetryFor, func(i int) int { return i % (clusterGateways - 1) }, done)
	t.Logf("%d payments to the living two after the takeover: %s", afterKill, describeCounts(countAnswers(more, nil)))
	perGate, _ := c.settlementsBy(more)
	reused := map[common.Address]int{}
	for i := range clusterGateways - 1 {
		for w, k := range perGate[i] {
			if victimWallets[w] {
				reused[w] += k
			}
		}
	}
	t.Logf("the living settled %d payments from %d of the dead gateway's %d wallets: %s", sumCounts(reused), len(reused),
		len(victimWallets), describeWallets(reused))
	if len(reused) == 0 {
		t.Errorf("none of the dead gateway's wallets (%d) settled any of the %d payments after the takeover", len(victimWallets), afterKill)
	}

	all := append(slices.Clone(payments), more...)
	paid := 0
	for _, p := range all {
		paid += min(p.paid, 1)
	}
	c.drain(new(big.Int).Add(before.seller, big.NewInt(int64(paid*clusterPrice))))
	c.checkAccounts(all, before, firstBlock)
	t.Logf("the living logged: %s", c.logged("took over a settlement of an instance that is gone",
		"released a settlement claim left by an earlier process", "took over a served async payment", "took the lease of a settlement wallet"))
	for _, g := range c.gates[:clusterGateways-1] {
		g.proc.stop()
	}
}

func sumCounts(m map[common.Address]int) int {
	s := 0
	for _, k := range m {
		s += k
	}
	return s
}

// TestClusterPostgreSQLRestartMidLoadLosesAndDoublesNothing pays 300 distinct payments of six payers over the
// three gateways at concurrency 12, and after the first 80 have finished stops the journal's PostgreSQL server
// (fast shutdown: every connection cut) for three seconds, then starts it again on the same data and port.
// Clients present the same payment again after an error (no answer, a 5xx, or another request presenting it),
// for up to 90 s. Every answer to a request sent while the database was down is a 502 or 503 (or "another request
// is presenting it", a retry's answer while its first request waits on the database); every 200 names a
// transfer of the price to the seller on chain; no payment is refused for good; every payment ends with exactly
// one 200, the seller's balance moved by exactly 200s x the price, each payer's by its own; the three gateways
// share the wallets again afterwards; and, once drained, no journal record is left pending.
func TestClusterPostgreSQLRestartMidLoadLosesAndDoublesNothing(t *testing.T) {
	postgresOutageMidLoad(t, clusterSetup{payers: 6}, 3*time.Second)
}

// TestClusterPostgreSQLDownLongerThanTheHeartbeatLosesAndDoublesNothing is the same with the database down for
// 12 s, past the instances' heartbeat TTL (10 s): when it comes back, every gateway's heartbeat has lapsed and
// each may look dead to the others, which take over its in-flight marks and settlement claims while it still
// works on them. Nothing may be lost or doubled all the same.
func TestClusterPostgreSQLDownLongerThanTheHeartbeatLosesAndDoublesNothing(t *testing.T) {
	postgresOutageMidLoad(t, clusterSetup{payers: 6}, 12*time.Second)
}

// postgresOutageMidLoad is the two tests above, on a cluster set up as s says, with the database down for outage.
func postgresOutageMidLoad(t *testing.T, s clusterSetup, outage time.Duration) {
	c := startClusterWith(t, s)
	const n, workers, stopAfter = 300, 12, 80
	payments := c.signMany(n)
	before, firstBlock := c.balances(), c.dev.head()

	done, loaded, start := c.loadInBackground(payments, workers)
	c.waitDone(done, stopAfter, 2*time.Minute)
	stopping := time.Now()
	c.pg.Stop(t)
	down := time.Now()
	time.Sleep(outage)
	restarting := time.Now()
	c.pg.Restart(t)
	up := time.Now()
	t.Logf("PostgreSQL stopped %v into the load (%d payments finished; the stop took %v), down for %v, restarted in %v",
		stopping.Sub(start).Round(10*time.Millisecond), stopAfter, down.Sub(stopping).Round(10*time.Millisecond),
		restarting.Sub(down).Round(10*time.Millisecond), up.Sub(restarting).Round(10*time.Millisecond))
	<-loaded
	t.Logf("the load of %d payments finished %v after the restart: %s", n, time.Since(up).Round(10*time.Millisecond),
		describeCounts(countAnswers(payments, nil)))

	during := func(a clusterAnswer) bool { return a.sent.After(down) && a.got.Before(restarting) }
	t.Logf("answers to the requests sent and answered while the database was down: %s", describeCounts(countAnswers(payments, during)))
	var wrong []string
	for _, p := range payments {
		for _, a := range p.answers {
			// "Another request is presenting it" comes from the gateway's own in-flight mark, not the journal: a
			// client's retry of a payment whose first request still waits on the database (the hang's crossing
			// takes it too). It is no refusal: the client presents the payment again, as after a 5xx.
			if during(a) && a.status != http.StatusBadGateway && a.status != http.StatusServiceUnavailable && !a.presenting {
				wrong = append(wrong, fmt.Sprintf("payment #%d: %s", p.n, a))
			}
		}
	}
	listFirst(t, "answers while the database was down were neither 502, 503 nor \"another request is presenting it\"", wrong, countAnswersTotal(payments, during))
	var refused []string
	for _, p := range payments {
		if p.refused != "" {
			refused = append(refused, p.String())
		}
	}
	listFirst(t, "payments were refused for good (a payment the payer was told not to count on)", refused, n)

	paid := 0
	for _, p := range payments {
		paid += min(p.paid, 1)
	}
	c.drain(new(big.Int).Add(before.seller, big.NewInt(int64(paid*clusterPrice))))
	c.checkAccounts(payments, before, firstBlock)
	leases := c.waitLeases("the wallets shared by the three gateways after the restart", 60*time.Second, clusterGateways)
	t.Logf("after the restart the leases held: %s; the gateways logged: %s", describeLeases(leases), c.logged(
		"released a settlement claim that its settlement could not release", "releasing a settlement claim that sent nothing",
		"clearing the journal's in-flight mark", "keeping the settlement wallet leases", "lost the lease of a settlement wallet"))
	for _, g := range c.gates {
		g.proc.stop()
	}
}

func countAnswersTotal(payments []*clusterPayment, keep func(clusterAnswer) bool) int {
	n := 0
	for _, k := range countAnswers(payments, keep) {
		n += k
	}
	return n
}
