package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The acceptance test of offers in a cluster: three gateways share four settlement wallets by leases, two one
// and one two, and their routes bind a payment to one wallet (upto, whose witness names the wallet that alone
// may settle it; erc2612, whose permit names its spender). A 402 names only a wallet its gateway sends from.

// offersRoutes are the routes of the offers test's gateways (a clusterSetup.routes format, the upstream's URL
// filled in): upto settled after the upstream and in the background, behind an upstream that names each
// request's charge; erc2612 only; and the cluster's permit2 route at /.
func offersRoutes(upstream string) string {
	return strings.ReplaceAll(`	handle /upto/* {
		x402 {
			scheme upto
			price $0.01
			pay_to %[1]s
			max_timeout 24h
		}
		reverse_proxy UPSTREAM
	}
	handle /upto-async/* {
		x402 {
			scheme upto
			price $0.01
			pay_to %[1]s
			max_timeout 24h
			settle async
		}
		reverse_proxy UPSTREAM
	}
	handle /erc2612/* {
		x402 {
			price $0.01
			pay_to %[1]s
			max_timeout 24h
			asset_transfer_method erc2612
		}
		respond %[2]q
	}
	handle {
		x402 $0.01 {
			pay_to %[1]s
			max_timeout 24h
		}
		respond %[2]q
	}`, "UPSTREAM", upstream)
}

// uptoCharge is what the upstream names as the charge of the upto request whose path ends in n.
func uptoCharge(n int) int64 { return 1000 + 100*int64(n) }

// chargingUpstream answers every request with the cluster's content and, in Settlement-Overrides, the charge
// its path's last segment names (uptoCharge); it counts the requests that reached it by path.
type chargingUpstream struct {
	mu   sync.Mutex
	hits map[string]int
}

func (u *chargingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.hits[r.URL.Path]++
	u.mu.Unlock()
	if n, err := strconv.Atoi(path.Base(r.URL.Path)); err == nil {
		w.Header().Set(x402.HeaderSettlementOverrides, fmt.Sprintf(`{"amount":"%d"}`, uptoCharge(n)))
	}
	fmt.Fprint(w, clusterContent)
}

func (u *chargingUpstream) hitsOf(p string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hits[p]
}

// instanceOf is the instance token of gateway g's journal: as its log of the leases it took names it, or else
// the holder the database names of a lease g's log says it took at the same fence; "" when neither says.
func (c *cluster) instanceOf(g *clusterGate) string {
	c.t.Helper()
	type took struct {
		Instance string `json:"instance"`
		Wallet   string `json:"wallet"`
		Fence    uint64 `json:"fence"`
	}
	var tooks []took
	for _, line := range strings.Split(g.proc.out.String(), "\n") {
		var e took
		if !strings.Contains(line, "took the lease of a settlement wallet") || json.Unmarshal([]byte(line), &e) != nil {
			continue
		}
		if e.Instance != "" {
			return e.Instance
		}
		tooks = append(tooks, e)
	}
	owner := ""
	err := c.query(func(ctx context.Context, conn *pgx.Conn) error {
		for _, e := range tooks {
			var o string
			err := conn.QueryRow(ctx, `SELECT owner FROM x402_leases WHERE name LIKE '%' || $1 AND fence = $2`,
				common.HexToAddress(e.Wallet).Hex(), int64(e.Fence)).Scan(&o)
			if err == nil && o != "" {
				owner = o
				return nil
			}
		}
		return nil
	})
	if err != nil {
		c.t.Fatal(err)
	}
	return owner
}

// required is the requirement of scheme and method in the 402 gateway gate answers url with.
func (c *cluster) required(gate int, url, scheme, method string) x402.PaymentRequirements {
	c.t.Helper()
	a, err := get(url)
	if err != nil {
		c.t.Fatalf("unpaid GET %s from gateway %d: %v", url, gate, err)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil {
		c.t.Fatalf("unpaid GET %s from gateway %d = %d %q (%v); want 402 with PAYMENT-REQUIRED", url, gate, a.status, a.body, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Scheme == scheme && rq.Extra.AssetTransferMethod == method {
			return rq
		}
	}
	c.t.Fatalf("gateway %d offers no %s %s requirement for %s: %+v", gate, scheme, method, url, pr.Accepts)
	return x402.PaymentRequirements{}
}

// boundWallet is the wallet a requirement binds its payment to: the upto facilitatorAddress, the erc2612 spender.
func boundWallet(rq x402.PaymentRequirements) common.Address {
	if rq.Scheme == x402.SchemeUpto {
		return common.HexToAddress(rq.Extra.FacilitatorAddress)
	}
	return common.HexToAddress(rq.Extra.Spender)
}

// offerRoutes are the routes whose offers bind a payment to a wallet, with the requirement each is paid by.
var offerRoutes = []struct{ path, scheme, method string }{
	{"/upto/", x402.SchemeUpto, x402.TransferPermit2},
	{"/upto-async/", x402.SchemeUpto, x402.TransferPermit2},
	{"/erc2612/", x402.SchemeExact, x402.TransferERC2612},
}

// checkOffers asks each live gateway of gates rounds times for each route's 402, reading the leases from the
// database before and after, and fails the test for every 402 that names a wallet its gateway held the lease
// of at neither moment.
func (c *cluster) checkOffers(gates []int, rounds int) {
	c.t.Helper()
	asked, wrong := 0, []string{}
	for r := range rounds {
		for _, i := range gates {
			g := c.gates[i]
			token := c.instanceOf(g)
			for _, rt := range offerRoutes {
				before, err := c.leases()
				if err != nil {
					c.t.Fatal(err)
				}
				named := boundWallet(c.required(i, fmt.Sprintf("%s%sr%d", g.url, rt.path, r), rt.scheme, rt.method))
				after, err := c.leases()
				if err != nil {
					c.t.Fatal(err)
				}
				asked++
				if !slices.Contains(before[token], named) && !slices.Contains(after[token], named) {
					wrong = append(wrong, fmt.Sprintf("gateway %d's %s 402 names %s; it holds the leases of %v (before) and %v (after)",
						i, rt.path, named.Hex(), before[token], after[token]))
				}
			}
		}
	}
	listFirst(c.t, "402s named a wallet the answering gateway did not hold the lease of", wrong, asked)
	if len(wrong) == 0 {
		c.t.Logf("%d 402s of gateways %v each named a wallet the answering gateway held the lease of", asked, gates)
	}
}

// tokenNonce reads the dev token's EIP-2612 nonces(holder).
func (c *cluster) tokenNonce(holder common.Address) *big.Int {
	c.t.Helper()
	data, err := contracts.StableCoinABI.Pack("nonces", holder)
	if err != nil {
		c.t.Fatal(err)
	}
	ctx, cancel := rpcContext()
	defer cancel()
	out, err := c.dev.client.CallContract(ctx, ethereum.CallMsg{To: &devchain.TokenAddress, Data: data}, nil)
	if err != nil {
		c.t.Fatalf("nonces(%s): %v", holder, err)
	}
	vals, err := contracts.StableCoinABI.Unpack("nonces", out)
	if err != nil || len(vals) != 1 {
		c.t.Fatalf("nonces(%s): %d bytes (%v)", holder, len(out), err)
	}
	return vals[0].(*big.Int)
}

// boundPayment is one payment bound to a wallet, signed against one gateway's 402 and presented to it.
type boundPayment struct {
	gate   int
	url    string
	async  bool
	charge int64
	answer answer
	err    error
}

// payBound signs a payment of payer against gateway gate's 402 for url (upto, or erc2612 with the payer's next
// token nonce) and presents it to that gateway.
func (c *cluster) payBound(gate, payer int, url string, rq x402.PaymentRequirements) (answer, error) {
	key := c.payers[payer]
	now := c.chainTime()
	var p x402.PaymentPayload
	var err error
	if rq.Extra.AssetTransferMethod == x402.TransferERC2612 {
		p, err = chain.SignERC2612Payment(key, rq, c.chainID, chain.ERC2612Options{Now: now, TokenNonce: c.tokenNonce(crypto.PubkeyToAddress(key.PublicKey))})
	} else {
		p, err = chain.SignPermit2Payment(key, rq, c.chainID, chain.Permit2Options{Now: now})
	}
	if err != nil {
		return answer{}, err
	}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		return answer{}, err
	}
	return get(url, x402.HeaderPaymentSignature, h)
}

// payUptoSpread pays n upto payments, payment i to gateway gates[i mod len], settled after the upstream or in the
// background by turns, each signed against the 402 that gateway answered its URL with, at concurrency workers.
// It fails the test for every payment not answered 200 (with a settlement naming its charge, when synchronous),
// and returns what the payments were charged.
func (c *cluster) payUptoSpread(tag string, gates []int, n, workers int) int64 {
	c.t.Helper()
	payments := make([]*boundPayment, n)
	for i := range payments {
		g := gates[i%len(gates)]
		async := (i/len(gates))%2 == 1
		route := "/upto/"
		if async {
			route = "/upto-async/"
		}
		payments[i] = &boundPayment{gate: g, async: async, charge: uptoCharge(i), url: fmt.Sprintf("%s%s%s/%d", c.gates[g].url, route, tag, i)}
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				p := payments[i]
				a, err := get(p.url)
				var pr x402.PaymentRequired
				if err == nil {
					pr, err = x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
				}
				if err == nil && (len(pr.Accepts) == 0 || pr.Accepts[0].Scheme != x402.SchemeUpto) {
					err = fmt.Errorf("the 402 of %s offers %+v, not upto", p.url, pr.Accepts)
				}
				if err == nil {
					p.answer, err = c.payBound(p.gate, w%len(c.payers), p.url, pr.Accepts[0])
				}
				p.err = err
			}
		}()
	}
	wg.Wait()
	var total int64
	var wrong []string
	counts := map[string]int{}
	for i, p := range payments {
		total += p.charge
		key := fmt.Sprint(p.answer.status)
		if p.answer.status != http.StatusOK {
			pr, _ := x402.DecodePaymentRequired(p.answer.header.Get(x402.HeaderPaymentRequired))
			key += " " + firstWords(pr.Error, 6)
		}
		counts[key]++
		s, serr := x402.DecodeSettleResponse(p.answer.header.Get(x402.HeaderPaymentResponse))
		switch {
		case p.err != nil:
			wrong = append(wrong, fmt.Sprintf("payment %d to gateway %d: %v", i, p.gate, p.err))
		case p.answer.status != http.StatusOK || p.answer.body != clusterContent:
			pr, _ := x402.DecodePaymentRequired(p.answer.header.Get(x402.HeaderPaymentRequired))
			wrong = append(wrong, fmt.Sprintf("payment %d to gateway %d (%s) = %d %s %s", i, p.gate, p.url, p.answer.status, shorten(p.answer.body), pr.Error))
		case p.async && (serr != nil || !s.Pending()):
			wrong = append(wrong, fmt.Sprintf("async payment %d to gateway %d: PAYMENT-RESPONSE %+v (%v), want settlement_pending", i, p.gate, s, serr))
		case !p.async && (serr != nil || !s.Success || s.Amount != strconv.FormatInt(p.charge, 10) || s.Transaction == ""):
			wrong = append(wrong, fmt.Sprintf("payment %d to gateway %d: PAYMENT-RESPONSE %+v (%v), want settled for %d", i, p.gate, s, serr, p.charge))
		}
	}
	c.t.Logf("%d upto payments over gateways %v (%s): %s", n, gates, tag, describeCounts(counts))
	listFirst(c.t, "upto payments, each signed against its gateway's 402 and presented to it, were not served as paid", wrong, n)
	return total
}

// TestClusterOffersNameOnlyWalletsTheAnsweringGatewayHoldsAndEveryBoundPaymentSettles runs three gateways on one
// PostgreSQL journal sharing four settlement wallets, with upto routes (settled after the upstream and in the
// background, behind an upstream that names each request's charge) and an erc2612 route. The four wallets are
// shared two, one and one (a share rounded up for everyone used to leave the last gateway none). Every 402's
// upto facilitatorAddress and erc2612 spender is a wallet the answering gateway holds the lease of, as the
// database says just before and after the 402 (they used to rotate over all four wallets). 60 upto payments
// spread over the three gateways, and 12 erc2612 payments, each signed against a gateway's 402 and presented to
// it, are all served and settle: none is answered no_available_wallets, the seller receives exactly the charges
// the upstream named plus the erc2612 prices, and nothing is left pending. A payment signed against gateway 0's
// 402 and presented to gateway 1 is refused with 402 before gateway 1's upstream runs, and still buys its
// response at gateway 0. Then gateway 2 is SIGKILLed: once the living two have taken its wallets, their 402s
// name those too, and 12 more upto payments to them settle.
func TestClusterOffersNameOnlyWalletsTheAnsweringGatewayHoldsAndEveryBoundPaymentSettles(t *testing.T) {
	up := &chargingUpstream{hits: map[string]int{}}
	upstream := httptest.NewServer(up)
	t.Cleanup(upstream.Close)
	c := startClusterWith(t, clusterSetup{payers: 6, wallets: 4, routes: offersRoutes(upstream.URL), anyShares: true})
	leases, err := c.leases()
	if err != nil {
		t.Fatal(err)
	}
	var shares []int
	for _, g := range c.gates {
		shares = append(shares, len(leases[c.instanceOf(g)]))
	}
	t.Logf("the three gateways hold %v of the four wallets", shares)
	for i, k := range shares {
		if k < 1 || k > 2 {
			t.Errorf("gateway %d holds %d of the four wallets; want one or two (the wallets shared evenly)", i, k)
		}
	}
	sellerBefore := c.dev.balance(seller)
	all := []int{0, 1, 2}

	c.checkOffers(all, 4)
	paid := c.payUptoSpread("a", all, 60, 6)

	// erc2612: each payer pays at one gateway only, one payment after another (its token nonce).
	var ercWrong []string
	for k := range 12 {
		g := k % 3
		url := fmt.Sprintf("%s/erc2612/%d", c.gates[g].url, k)
		a, err := c.payBound(g, 3+g, url, c.required(g, url, x402.SchemeExact, x402.TransferERC2612))
		s, serr := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
		if err != nil || a.status != http.StatusOK || serr != nil || !s.Success {
			pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			ercWrong = append(ercWrong, fmt.Sprintf("erc2612 payment %d to gateway %d = %d %s (%v) settlement %+v", k, g, a.status, pr.Error, err, s))
			continue
		}
		paid += clusterPrice
	}
	listFirst(t, "erc2612 payments, each signed against its gateway's 402 and presented to it, were not served and settled", ercWrong, 12)

	// Signed against gateway 0's 402, presented to gateway 1: refused before gateway 1's upstream runs.
	url0, url1 := c.gates[0].url+"/upto/x/77", c.gates[1].url+"/upto/x/77"
	rq := c.required(0, url0, x402.SchemeUpto, x402.TransferPermit2)
	p, err := chain.SignPermit2Payment(c.payers[0], rq, c.chainID, chain.Permit2Options{Now: c.chainTime()})
	if err != nil {
		t.Fatal(err)
	}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		t.Fatal(err)
	}
	a, err := get(url1, x402.HeaderPaymentSignature, h)
	pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || a.status != http.StatusPaymentRequired || !strings.HasPrefix(pr.Error, x402.ReasonUptoFacilitatorMismatch) {
		t.Errorf("a payment bound to gateway 0's wallet %s, presented to gateway 1 = %d %q (%v); want 402 %s",
			boundWallet(rq).Hex(), a.status, pr.Error, err, x402.ReasonUptoFacilitatorMismatch)
	}
	if n := up.hitsOf("/upto/x/77"); n != 0 {
		t.Errorf("the upstream ran %d times for a payment gateway 1 cannot settle", n)
	}
	if a, err := get(url0, x402.HeaderPaymentSignature, h); err != nil || a.status != http.StatusOK {
		t.Errorf("the same payment presented to gateway 0 = %d %q (%v); want 200", a.status, shorten(a.body), err)
	} else {
		paid += uptoCharge(77)
	}

	c.drain(new(big.Int).Add(sellerBefore, big.NewInt(paid)))
	if got := delta(sellerBefore, c.dev.balance(seller)); got.Cmp(big.NewInt(paid)) != 0 {
		t.Errorf("the seller received %s; want exactly %d: the charges named and the erc2612 prices", got, paid)
	}
	t.Logf("the gateways logged: %s", c.logged("background settlement: no settlement wallet here", "took over a served async payment bound to",
		"an async payment was served but"))

	// Gateway 2 goes: its wallets pass to the living two, whose offers then name them too.
	victim := c.gates[2]
	victim.dead.Store(true)
	victim.proc.kill()
	killed := time.Now()
	leases = c.waitLeases("the dead gateway's wallets taken over by the living two", 60*time.Second, clusterGateways-1)
	t.Logf("%v after the kill the living hold: %s", time.Since(killed).Round(100*time.Millisecond), describeLeases(leases))
	deadline := time.Now().Add(10 * time.Second)
	for c.instanceOf(c.gates[0]) == "" || len(leases[c.instanceOf(c.gates[0])]) != 2 || len(leases[c.instanceOf(c.gates[1])]) != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the living two hold %s; want two wallets each", describeLeases(leases))
		}
		time.Sleep(200 * time.Millisecond)
		leases, _ = c.leases()
	}
	c.checkOffers([]int{0, 1}, 3)
	more := c.payUptoSpread("b", []int{0, 1}, 12, 4)
	c.drain(new(big.Int).Add(sellerBefore, big.NewInt(paid+more)))
	for _, g := range c.gates[:2] {
		g.proc.stop()
	}
}
