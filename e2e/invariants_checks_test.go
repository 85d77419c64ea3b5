package e2e

import (
	"context"
	"fmt"
	"math/big"
	"net/http"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/rpc"
	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The checks of the money-invariant run: each is named, says what it means, and reports the payments (and
// through them the actions) that broke it. Adding an invariant is adding a row to invChecks.

// invBalances are the token balances the checks compare: every route's seller, every payer in every token.
type invBalances map[[2]common.Address]*big.Int // by (holder, token)

func (r *invRun) readBalances() invBalances {
	b := invBalances{}
	for _, rk := range r.w.routes {
		b[[2]common.Address{rk.payTo, rk.asset}] = r.w.dev.balanceOf(rk.asset, rk.payTo)
	}
	for _, pp := range r.w.allPayers() {
		for _, token := range []common.Address{devchain.TokenAddress, devchain.EIP3009TokenAddress} {
			b[[2]common.Address{pp.addr, token}] = r.w.dev.balanceOf(token, pp.addr)
		}
	}
	return b
}

// invEnd is what the chain and the journals show once the run is over.
type invEnd struct {
	before, after invBalances
	consumed      map[*invPayment]bool                 // its authorization's nonce is spent on chain
	charged       map[*invPayment]*big.Int             // what the transfers attributed to it moved to its seller
	txs           map[*invPayment]map[common.Hash]bool // the transfers attributed to it
	blockOf       map[common.Hash]uint64               // the block of each transfer
	stray         []string                             // transfers to a seller that belong to no known payment
	settlements   int                                  // transactions the settlement wallets sent
	reverted      []string
	chainNow      time.Time // the head block's time once the run was over
	left          []string  // journal records not final, holds not released
	journals      []string  // what was read
	lagging       []string  // gate records of settled, served payments whose state still says claimed
	drained       string    // how the drain went
}

// readEnd reads the end state: the balances, each payment's nonce, the settlement transactions and their
// receipts, and the journals (the processes are stopped, so the bbolt files can be opened).
func (r *invRun) readEnd(before invBalances) *invEnd {
	t := r.t
	end := &invEnd{before: before, after: r.readBalances(), consumed: map[*invPayment]bool{}, charged: map[*invPayment]*big.Int{},
		txs: map[*invPayment]map[common.Hash]bool{}, blockOf: map[common.Hash]uint64{}}
	payments := r.snapshot()
	end.chainNow = time.Unix(int64(r.w.dev.headTime()), 0)

	// Which payment each settlement transaction belongs to: what the answers said, then what the journals say.
	owner := map[common.Hash]*invPayment{}
	for _, p := range payments {
		for _, a := range p.answers {
			if a.settle != nil && a.settle.Transaction != "" {
				owner[common.HexToHash(a.settle.Transaction)] = p
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stores []journal.Store
	var names []string
	for _, proc := range append(append([]*invProc(nil), r.w.gateways...), r.w.facilitators...) {
		if proc.journal == "" {
			continue
		}
		st, err := journal.OpenBolt(proc.journal, journal.Options{})
		if err != nil {
			t.Errorf("opening the journal %s left: %v", proc.name, err)
			continue
		}
		defer st.Close()
		stores, names = append(stores, st), append(names, proc.name+"'s bbolt journal")
	}
	if r.topo.postgres {
		st, err := journal.OpenPostgres(ctx, r.w.dsn, journal.Options{})
		if err != nil {
			t.Errorf("opening the gateways' PostgreSQL journal: %v", err)
		} else {
			defer st.Close()
			stores, names = append(stores, st), append(names, "the gateways' PostgreSQL journal")
		}
	}
	end.journals = names
	for i, st := range stores {
		for _, p := range payments {
			for _, id := range p.journalIDs() {
				rec, found, err := st.Get(ctx, id)
				if err != nil {
					t.Errorf("reading payment #%d from %s: %v", p.n, names[i], err)
					continue
				}
				if !found {
					continue
				}
				hashes := append([]string{rec.TxHash}, rec.ReplacedTxHashes...)
				if rec.Response != nil {
					hashes = append(hashes, rec.Response.Transaction)
				}
				for _, h := range hashes {
					if h != "" {
						owner[common.HexToHash(h)] = p
					}
				}
			}
		}
		pending, err := st.Pending(ctx)
		if err != nil {
			t.Errorf("listing what %s holds pending: %v", names[i], err)
		}
		for _, rec := range pending {
			if rec.State == journal.StateClaimed && !rec.Async && rec.Served && rec.Response != nil && rec.Response.Success {
				// A gate record that lags its settled, served payment: done, only its state says otherwise.
				end.lagging = append(end.lagging, fmt.Sprintf("%s holds %s claimed, served and settled (tx %s), owner %s, updated %s",
					names[i], r.describeID(rec.ID, payments), rec.Response.Transaction, rec.Owner, rec.UpdatedAt.Format(time.StampMilli)))
				continue
			}
			end.left = append(end.left, fmt.Sprintf("%s holds %s pending: state %s, async %v, served %v, tx %q, response %+v",
				names[i], r.describeID(rec.ID, payments), rec.State, rec.Async, rec.Served, rec.TxHash, rec.Response))
		}
	}
	if r.topo.postgres {
		end.left = append(end.left, r.holdsLeft(payments)...)
	}

	// The transfers to each route's seller, each to the payment whose transaction it is.
	for _, rk := range r.w.routes {
		for _, l := range r.w.dev.tokenTransfers(rk.asset, nil, &rk.payTo, r.w.startBlock) {
			p := owner[l.TxHash]
			from := common.BytesToAddress(l.Topics[1].Bytes())
			if p == nil || p.payer.addr != from {
				end.stray = append(end.stray, fmt.Sprintf("%s from %s to the seller of %q in %s", transferAmount(l), from, rk.name, l.TxHash))
				continue
			}
			if end.charged[p] == nil {
				end.charged[p], end.txs[p] = new(big.Int), map[common.Hash]bool{}
			}
			end.charged[p].Add(end.charged[p], transferAmount(l))
			end.txs[p][l.TxHash] = true
			end.blockOf[l.TxHash] = l.BlockNumber
		}
	}
	for _, p := range payments {
		used, err := r.nonceUsed(p)
		if err != nil {
			t.Errorf("reading whether payment #%d's nonce is spent: %v", p.n, err)
		}
		end.consumed[p] = used
	}
	r.scanSettlements(end, owner)
	for _, it := range r.transports {
		// The Transports learn from the chain what their async and unanswered payments cost, as a client
		// would once the run is over: what they give back is judged by transport-counts-what-it-signed.
		if err := it.tr.Reconcile(ctx); err != nil {
			t.Errorf("worker %d's payer.Transport could not reconcile with the chain: %v", it.worker, err)
		}
	}
	return end
}

// journalIDs are the journal ids a payment may be recorded under: the engine's and the gate's.
func (p *invPayment) journalIDs() []journal.ID {
	from := p.payer.addr.Hex()
	return []journal.ID{
		journal.PaymentID(p.req.Network, p.route.method, p.req.Asset, from, p.nonce),
		journal.PaymentID(p.req.Network, "gate/"+p.route.method, p.req.Asset, from, p.nonce),
	}
}

// describeID names the payment a journal id belongs to: one of the workers', or a batch lane's deposit.
func (r *invRun) describeID(id journal.ID, payments []*invPayment) string {
	for _, p := range payments {
		for _, pid := range p.journalIDs() {
			if pid == id {
				return fmt.Sprintf("payment #%d", p.n)
			}
		}
	}
	if d := r.w.batch.depositNamed(id); d != "" {
		return "payment " + id.String() + " (" + d + ")"
	}
	return "payment " + id.String() + " (of no payment the run signed)"
}

// holdsLeft lists the funds holds the cluster's journal still keeps that no mined settlement released.
func (r *invRun) holdsLeft(payments []*invPayment) []string {
	var out []string
	err := queryPostgres(r.w.dsn, func(ctx context.Context, conn *pgx.Conn) error {
		rows, err := conn.Query(ctx, `SELECT id, amount::text FROM x402_holds WHERE mined = 0`)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id []byte
			var amount string
			if err := rows.Scan(&id, &amount); err != nil {
				return err
			}
			var jid journal.ID
			copy(jid[:], id)
			out = append(out, fmt.Sprintf("a hold of %s for %s, not released and not seen mined", amount, r.describeID(jid, payments)))
		}
		return rows.Err()
	})
	if err != nil {
		out = append(out, fmt.Sprintf("the holds could not be read: %v", err))
	}
	return out
}

// nonceUsed reads from the chain whether the payment's authorization has been spent.
func (r *invRun) nonceUsed(p *invPayment) (bool, error) {
	ctx, cancel := rpcContext()
	defer cancel()
	call := func(to common.Address, data []byte) ([]byte, error) {
		return r.w.dev.client.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
	}
	switch p.route.method {
	case x402.TransferPermit2:
		nonce, ok := new(big.Int).SetString(p.nonce, 10)
		if !ok {
			return false, fmt.Errorf("permit2 nonce %q", p.nonce)
		}
		data, err := contracts.Permit2ABI.Pack("nonceBitmap", p.payer.addr, new(big.Int).Rsh(nonce, 8))
		if err != nil {
			return false, err
		}
		out, err := call(contracts.Permit2Address, data)
		if err != nil {
			return false, err
		}
		bit := new(big.Int).And(nonce, big.NewInt(0xff)).Uint64()
		return new(big.Int).SetBytes(out).Bit(int(bit)) == 1, nil
	case x402.TransferEIP3009:
		data, err := contracts.USDCoinABI.Pack("authorizationState", p.payer.addr, common.HexToHash(p.nonce))
		if err != nil {
			return false, err
		}
		out, err := call(p.route.asset, data)
		if err != nil {
			return false, err
		}
		return new(big.Int).SetBytes(out).Sign() != 0, nil
	case x402.TransferERC2612:
		nonce, ok := new(big.Int).SetString(p.nonce, 10)
		if !ok {
			return false, fmt.Errorf("erc2612 nonce %q", p.nonce)
		}
		data, err := contracts.StableCoinABI.Pack("nonces", p.payer.addr)
		if err != nil {
			return false, err
		}
		out, err := call(p.route.asset, data)
		if err != nil {
			return false, err
		}
		return new(big.Int).SetBytes(out).Cmp(nonce) > 0, nil
	}
	return false, fmt.Errorf("no way to read a %s nonce", p.route.method)
}

// scanSettlements reads every block of the run and the receipt of every transaction a settlement wallet sent.
func (r *invRun) scanSettlements(end *invEnd, owner map[common.Hash]*invPayment) {
	ours := map[common.Address]bool{}
	for _, w := range r.w.wallets() {
		ours[w] = true
	}
	head := r.w.dev.head()
	signer := types.LatestSignerForChainID(new(big.Int).SetUint64(devchain.DefaultChainID))
	for n := r.w.startBlock + 1; n <= head; n++ {
		ctx, cancel := rpcContext()
		blk, err := r.w.dev.client.BlockByNumber(ctx, new(big.Int).SetUint64(n))
		if err != nil {
			cancel()
			r.t.Errorf("reading block %d: %v", n, err)
			return
		}
		var mine []*types.Transaction
		for _, tx := range blk.Transactions() {
			if from, err := types.Sender(signer, tx); err == nil && ours[from] {
				mine = append(mine, tx)
			}
		}
		if len(mine) > 0 {
			receipts, err := r.w.dev.client.BlockReceipts(ctx, rpc.BlockNumberOrHashWithNumber(rpc.BlockNumber(n)))
			if err != nil {
				cancel()
				r.t.Errorf("reading the receipts of block %d: %v", n, err)
				return
			}
			status := map[common.Hash]uint64{}
			for _, rc := range receipts {
				status[rc.TxHash] = rc.Status
			}
			for _, tx := range mine {
				end.settlements++
				if status[tx.Hash()] == types.ReceiptStatusSuccessful {
					continue
				}
				from, _ := types.Sender(signer, tx)
				what := "of no payment the run knows"
				if p := owner[tx.Hash()]; p != nil {
					what = fmt.Sprintf("settling payment #%d", p.n)
				}
				end.reverted = append(end.reverted, fmt.Sprintf("transaction %s from settlement wallet %s in block %d reverted, %s", tx.Hash(), from, n, what))
			}
		}
		cancel()
	}
}

// invViolation is one breach of an invariant: what happened, and the payments it happened to.
type invViolation struct {
	what     string
	payments []*invPayment
}

// invCheck is one money invariant: its name, what it means, and how it is judged from the end state.
type invCheck struct {
	name    string
	meaning string
	judge   func(r *invRun, end *invEnd) (violations []invViolation, summary string)
}

var invChecks = []invCheck{
	{"seller-paid-exactly", "the seller received exactly the charges of the responses delivered whole (upto: what the upstream named, capped at the maximum)", (*invRun).checkSellerPaid},
	{"one-response-one-resource", "each payment delivered at most one whole response, and only for the resource (method and URL) it was first presented for", (*invRun).checkOneResource},
	{"charged-means-delivered", "no payer was charged for nothing: a charged payment without its response got it when presented again", (*invRun).checkChargedDelivered},
	{"payer-charged-once", "no payer was charged twice: each payer paid exactly the charges of its delivered responses", (*invRun).checkPayerCharged},
	{"no-pay-again-after-settling", "no payer waiting for the response it paid for was answered 402 (but as already used) while the chain took its payment: only a later presentation of it may have settled it", (*invRun).checkNoPayAgain},
	{"honest-payment-never-refused", "an honest payment (funded, signed from the offer, presented in time for its own resource) gets its response, or a 5xx to present it again, or a refusal for a reason of its own (terms a reload changed, a request shape not sold, in a cluster a wallet lease the gateway does not hold, refused at verification; valid briefly, its deadline); never a settlement refused after it was verified, nor another 402", (*invRun).checkHonestServed},
	{"nothing-left-pending", "once quiet, nothing is pending: no async backlog, no journal record not final, no funds hold left", (*invRun).checkNothingLeft},
	{"no-reverted-settlement", "no settlement wallet spent gas on a transaction that reverted", (*invRun).checkNoRevert},
	{"graceful-stop-bounded", "a gateway stopped gracefully (SIGINT or SIGTERM) exits by itself, cleanly, within 20 s: it drains the requests at work, closes the tunnels and its journal", (*invRun).checkGracefulStops},
	{"batch-vouchers-claimed-once", "every batch voucher whose response was delivered is claimed once, none twice, nothing left unclaimed: each channel claimed exactly its delivered vouchers, the seller paid their sum, each payer's refund returned the rest, the escrow holds what it held", (*invRun).checkBatch},
	{"access-grant-bounded", "a sign-in-with-x grant serves no more sign-in requests than the payments charged on chain bought (3 a payment on /siwx/), none after it ended (4 s after its payment's response on /siwx-brief/), and each served sign-in gets the resource asked", (*invRun).checkGrantBounded},
	{"unpaid-never-signed-in", "a wallet that never paid is never served by signature, nor a sign-in signed for another path, route or gateway, nor one sign-in header twice", (*invRun).checkUnpaidNeverServed},
	{"paid-wallet-signed-in", "a wallet whose payment on an access route delivered its response is not refused as not paid for, nor as ended, while the grant it bought stands, at any gateway (but for a SIGKILL or database outage during the delivery)", (*invRun).checkPaidSignedIn},
	{"mcp-tool-calls-answered", "a tool call of an MCP route delivered whole carries its settlement in the result's _meta (pending only for settle async), and a refused one is a tool result with isError, as the x402 MCP transport says; the lane ran", (*invRun).checkMCPCalls},
	{"browser-paywall", "every 402 page a browser got is HTML embedding the PaymentRequired of its PAYMENT-REQUIRED header, whose offer, signed, is honoured as any (the honest-payment check judges those payments); a request carrying a payment never gets the paywall page, and a refused one gets the gate's JSON whatever its Accept; the lane ran: a payment signed from a page delivered", (*invRun).checkBrowser},
	{"approval-sponsored-once", "the engines fund a payer's sponsored approval (erc20ApprovalGasSponsoring) at most once, only for an approval that mined, and an approval mines once; the lane ran where its route delivered", (*invRun).checkApprovalSponsored},
	{"brief-payments-ran", "payments valid briefly (invBriefValidity of chain time) ran across the faults, their deadlines passing while faults held them and before they were presented again: at least one delivered", (*invRun).checkBrief},
	{"transport-counts-what-it-signed", "every payer.Transport's spent total is at least what its payments moved on chain plus the whole of those that can still be settled (upto: the maximum), whatever the servers said", (*invRun).checkTransportSpent},
}

func (r *invRun) checkSellerPaid(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	owed := map[common.Address]*big.Int{}
	var delivered int
	for _, p := range r.snapshot() {
		seller := common.HexToAddress(p.req.PayTo)
		if owed[seller] == nil {
			owed[seller] = new(big.Int)
		}
		if p.delivered() == 0 {
			continue
		}
		delivered++
		want := p.charge()
		owed[seller].Add(owed[seller], want)
		got := end.charged[p]
		if got == nil {
			got = new(big.Int)
		}
		if got.Cmp(want) != 0 && (end.charged[p] != nil || !end.consumed[p]) {
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d delivered whole; the chain shows %s charged for it, it owed %s", p.n, got, want), payments: []*invPayment{p}})
		}
	}
	total, totalOwed := new(big.Int), new(big.Int)
	for _, rk := range r.w.routes {
		key := [2]common.Address{rk.payTo, rk.asset}
		got := delta(end.before[key], end.after[key])
		want := owed[rk.payTo]
		if want == nil {
			want = new(big.Int)
		}
		total.Add(total, got)
		totalOwed.Add(totalOwed, want)
		if got.Cmp(want) != 0 {
			out = append(out, invViolation{what: fmt.Sprintf("the seller of %q received %s, and the responses it delivered whole owe it %s", rk.name, got, want)})
		}
	}
	for _, s := range end.stray {
		out = append(out, invViolation{what: "a transfer that belongs to no payment the run made: " + s})
	}
	return out, fmt.Sprintf("%d payments delivered whole owe %s in all; the sellers received %s", delivered, totalOwed, total)
}

func (r *invRun) checkOneResource(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	twiceExcused, tunnelsAgain := 0, 0
	for _, p := range r.snapshot() {
		p.mu.Lock()
		bound, deliveries := p.bound, append([]*invAnswer(nil), p.deliveries...)
		var wrong []*invAnswer
		for _, a := range p.answers {
			if a.wrong {
				wrong = append(wrong, a)
			}
		}
		p.mu.Unlock()
		for _, a := range wrong {
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d was answered %d with what is not the response of %s: %s", p.n, a.status, a.res, a.note), payments: []*invPayment{p}})
		}
		for i, d := range deliveries {
			if bound != nil && d.res != *bound {
				out = append(out, invViolation{what: fmt.Sprintf("payment #%d delivered %s (action #%d), though it was recorded for %s", p.n, d.res, d.action, *bound), payments: []*invPayment{p}})
				continue
			}
			if i == 0 {
				continue
			}
			prev := deliveries[i-1]
			if r.crashBetween(prev.gate, prev.got, d.sent) {
				twiceExcused++
				continue
			}
			if r.tunnelCutByStop(prev, d) != nil {
				tunnelsAgain++
				continue
			}
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d delivered %s again (actions #%d and #%d) with no crash between to excuse it%s",
				p.n, d.res, prev.action, d.action, r.stopsBetween(prev.gate, prev.sent, d.sent)), payments: []*invPayment{p}})
		}
	}
	summary := "every delivery was of the resource its payment bought, once"
	if twiceExcused > 0 {
		summary += fmt.Sprintf(" (%d served again after a SIGKILL or a database outage came between the response and its record as delivered)", twiceExcused)
	}
	if tunnelsAgain > 0 {
		summary += fmt.Sprintf(" (%d paid tunnels open at a graceful stop of their gateway opened again, uncharged, when presented again)", tunnelsAgain)
	}
	return out, summary
}

// invTunnelEndSlack is how long before a graceful stop began a tunnel's client may have ended it (the run's client
// notes the end once it has closed its connection) and the stop still be taken to have cut it: the gate learns of
// the client's end when the read of its connection returns, and from then on the journal waits for its mark.
const invTunnelEndSlack = time.Second

// tunnelCutByStop returns the graceful stop that cut the paid tunnel prev delivered, if next, a later delivery of
// its payment, came after that stop; nil when none did. The one known exception a graceful stop makes (README, paid
// upgrades): a tunnel still open as its gateway stops (opened before the process was gone, its client's end not
// before the signal, within invTunnelEndSlack) is closed by Caddy after the journal closed, so its end marks
// nothing, and its payment presented again after the restart opens another tunnel, uncharged. Nothing else is
// excused by a graceful stop: it is no crash, and a response that is no tunnel is delivered once.
func (r *invRun) tunnelCutByStop(prev, next *invAnswer) *invStop {
	if prev.status != http.StatusSwitchingProtocols {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.stops {
		s := &r.stops[i]
		if s.gate == prev.gate && s.exited.After(prev.sent) && s.from.Before(prev.got.Add(invTunnelEndSlack)) && s.from.Before(next.sent) {
			return s
		}
	}
	return nil
}

// stopsBetween names, for a violation's message, the graceful stops of gateway gate (any gateway: -1) that began
// between from and to: "" when none. A graceful stop is no crash, and excuses nothing but a tunnel it cut.
func (r *invRun) stopsBetween(gate int, from, to time.Time) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var names []string
	for _, s := range r.stops {
		if (gate < 0 || s.gate == gate) && s.from.After(from) && s.from.Before(to) {
			names = append(names, fmt.Sprintf("gateway %d's by %s (action #%d)", s.gate, s.signal, s.action))
		}
	}
	if len(names) == 0 {
		return ""
	}
	return fmt.Sprintf(" (only a graceful stop between, %s, which is no crash)", strings.Join(names, ", "))
}

// checkGracefulStops judges each graceful stop: its gateway exited by itself, with status 0, within invStopBound.
// A stop that hung names the payments presented to its gateway that were at work as it began.
func (r *invRun) checkGracefulStops(end *invEnd) ([]invViolation, string) {
	r.mu.Lock()
	stops := append([]invStop(nil), r.stops...)
	r.mu.Unlock()
	if len(stops) == 0 {
		return nil, "no graceful stop was drawn"
	}
	var out []invViolation
	var longest time.Duration
	signals := map[string]int{}
	for _, s := range stops {
		signals[s.signal]++
		took := s.exited.Sub(s.from)
		longest = max(longest, took)
		switch {
		case s.killed:
			out = append(out, invViolation{what: fmt.Sprintf("gateway %d did not exit within %v of its graceful stop (%s, action #%d) and was SIGKILLed",
				s.gate, invStopBound, s.signal, s.action), payments: r.atWork(s.gate, s.from, 3)})
		case s.err != nil:
			out = append(out, invViolation{what: fmt.Sprintf("gateway %d exited %v after its graceful stop (%s, action #%d), not cleanly: %v",
				s.gate, took.Round(10*time.Millisecond), s.signal, s.action, s.err)})
		}
	}
	// How much each stop had to drain: the presentations at work at its gateway as it began, and what came of them.
	atWork, whole, tunnels := 0, 0, 0
	for _, p := range r.snapshot() {
		p.mu.Lock()
		for _, a := range p.answers {
			for _, s := range stops {
				if a.gate == s.gate && a.sent.Before(s.from) && a.got.After(s.from) {
					atWork++
					if a.whole {
						whole++
					}
					if a.status == http.StatusSwitchingProtocols {
						tunnels++
					}
				}
			}
		}
		p.mu.Unlock()
	}
	return out, fmt.Sprintf("%d graceful stops (%d by SIGINT, %d by SIGTERM), each exited cleanly by itself, the longest in %v; "+
		"%d presentations were at work at the gateway as its stop began: %d delivered whole, %d opened a tunnel",
		len(stops), signals["SIGINT"], signals["SIGTERM"], longest.Round(10*time.Millisecond), atWork, whole, tunnels)
}

// atWork lists at most n payments presented to gateway gate whose answer was still to come at t.
func (r *invRun) atWork(gate int, t time.Time, n int) []*invPayment {
	var out []*invPayment
	for _, p := range r.snapshot() {
		p.mu.Lock()
		busy := slices.ContainsFunc(p.answers, func(a *invAnswer) bool { return a.gate == gate && a.sent.Before(t) && a.got.After(t) })
		p.mu.Unlock()
		if busy && len(out) < n {
			out = append(out, p)
		}
	}
	return out
}

// crashBetween reports whether gateway gate was SIGKILLed, or the cluster's database was down, between from and
// to: a response written out just before may not have been recorded as delivered, and the same payment then
// buys it once more.
func (r *invRun) crashBetween(gate int, from, to time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, k := range r.kills {
		if k.gate == gate && k.from.After(from.Add(-time.Second)) && k.from.Before(to) {
			return true
		}
	}
	for _, o := range r.outages {
		if o.to.After(from.Add(-time.Second)) && o.from.Before(to) {
			return true
		}
	}
	return false
}

func (r *invRun) checkChargedDelivered(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	charged := 0
	for _, p := range r.snapshot() {
		got := end.charged[p]
		if !end.consumed[p] && (got == nil || got.Sign() == 0) {
			continue
		}
		charged++
		if p.delivered() == 0 {
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d was charged (%s on chain, its nonce spent: %v) and never delivered its response, even presented again", p.n, orZero(got), end.consumed[p]), payments: []*invPayment{p}})
		}
	}
	return out, fmt.Sprintf("%d payments charged on chain, each delivered its response", charged)
}

func orZero(n *big.Int) *big.Int {
	if n == nil {
		return new(big.Int)
	}
	return n
}

func (r *invRun) checkPayerCharged(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	owed := map[[2]common.Address]*big.Int{}
	for _, p := range r.snapshot() {
		if len(end.txs[p]) > 1 {
			var hs []string
			for h := range end.txs[p] {
				hs = append(hs, h.Hex())
			}
			sort.Strings(hs)
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d was charged by %d transactions: %s", p.n, len(hs), strings.Join(hs, ", ")), payments: []*invPayment{p}})
		}
		if p.delivered() == 0 {
			continue
		}
		key := [2]common.Address{p.payer.addr, p.route.asset}
		if owed[key] == nil {
			owed[key] = new(big.Int)
		}
		owed[key].Add(owed[key], p.charge())
	}
	paid := new(big.Int)
	for _, pp := range r.w.allPayers() {
		for _, token := range []common.Address{devchain.TokenAddress, devchain.EIP3009TokenAddress} {
			key := [2]common.Address{pp.addr, token}
			got := new(big.Int).Neg(delta(end.before[key], end.after[key]))
			paid.Add(paid, got)
			want := orZero(owed[key])
			if got.Cmp(want) != 0 {
				out = append(out, invViolation{what: fmt.Sprintf("payer %d paid %s of %s, and its delivered responses owe %s", pp.n, got, token, want)})
			}
		}
	}
	return out, fmt.Sprintf("the payers paid %s in all, each exactly what it owed", paid)
}

// alreadyUsed says whether a 402's reason is "this payment was used": not an invitation to pay again.
func alreadyUsed(reason string) bool { return strings.HasPrefix(reason, x402.ReasonPaymentAlreadyUsed) }

func (r *invRun) checkNoPayAgain(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	refusedThenSettled := 0
	for _, p := range r.snapshot() {
		if len(end.txs[p]) == 0 && !end.consumed[p] {
			continue
		}
		// When the chain took the payment: at the latest when the head first reached the block of its first
		// transfer (nonce spent without a transfer, as by an upto charge of zero: the end of the run).
		mined := time.Now()
		for h := range end.txs[p] {
			if at, ok := r.minedBy(end.blockOf[h]); ok && at.Before(mined) {
				mined = at
			}
		}
		home := p.home()
		p.mu.Lock()
		for _, a := range p.answers {
			if a.res != home || a.status != http.StatusPaymentRequired || !a.final || alreadyUsed(a.note) || p.servedBefore(a) {
				continue
			}
			// A refusal is true if nothing was charged until another presentation of the same payment, one still
			// under way when it was sent (at another gateway, whose price_grace may still hold the terms) or a later
			// one, settled it.
			later := false
			for _, c := range p.answers {
				if c != a && (c.sent.After(a.sent) || c.got.After(a.sent)) && c.sent.Before(mined) {
					later = true
				}
			}
			if later {
				refusedThenSettled++
				continue
			}
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d was answered 402 %q (action #%d), and the chain took it with no later presentation of it to explain that",
				p.n, a.note, a.action), payments: []*invPayment{p}})
		}
		p.mu.Unlock()
	}
	return out, fmt.Sprintf("no payment was answered 402 while the chain took it (%d refused, then settled by another presentation under way or later)", refusedThenSettled)
}

// servedBefore says whether the payment had delivered a whole response before a was sent: its payer has what it
// paid for, and whatever a later presentation of the spent payment is answered tells it nothing it could act on
// (a second delivery is one-response-one-resource's to judge). p.mu is held.
func (p *invPayment) servedBefore(a *invAnswer) bool {
	for _, d := range p.deliveries {
		if d.got.Before(a.sent) {
			return true
		}
	}
	return false
}

// minedBy is when the chain's head was first seen at block n or beyond, by the run's head sampler.
func (r *invRun) minedBy(n uint64) (time.Time, bool) {
	r.heads.mu.Lock()
	defer r.heads.mu.Unlock()
	for _, s := range r.heads.samples {
		if s.block >= n {
			return s.at, true
		}
	}
	return time.Time{}, false
}

// leaseReasons are the refusals, at verification, of a payment bound to a settlement wallet (upto's facilitator,
// erc2612's spender) that the answering gateway of a cluster does not hold, or by a gateway that holds none right
// now: before anything runs or is charged, the payment staying good at the gateway that holds its wallet (README,
// "Offers name only wallets the instance sends from").
var leaseReasons = []string{x402.ReasonUptoFacilitatorMismatch, x402.ReasonRecipientMismatch, x402.ReasonNoAvailableWallets}

// remoteUnknownPastDeadline reports whether p, a payment valid briefly settled through the remote facilitators, was
// left with its outcome unknown past its deadline, not charged: last answered 502 (a settlement request that may
// have reached a facilitator, no answer came, and then a refusal for the deadline, which says nothing sure of such a
// payment: a facilitator without a journal refuses the repeat of a settlement it made), its deadline passed by the
// chain's clock and its nonce unspent. A gate with a remote facilitator cannot read the chain, so it never turns
// that into a final 402 (gate/serve.go, the resend case); its payer checks the chain (README). A HEAD's 502 has no
// body to say so: the chain's word is what is judged.
func remoteUnknownPastDeadline(p *invPayment, last *invAnswer, end *invEnd) bool {
	return p.route.remote && p.route.validity != 0 && last != nil && outcomeUnknown(last) && !end.consumed[p] && pastDeadline(p, end.chainNow)
}

// outcomeUnknown reports whether a is the gate's 502 saying a settlement request may have reached the facilitator,
// its outcome not known; a HEAD's 502 has no body to say so, and is taken for it (the chain is judged then).
func outcomeUnknown(a *invAnswer) bool {
	if a.status != http.StatusBadGateway {
		return false
	}
	if a.res.method == http.MethodHead && a.gateError == "" {
		return true
	}
	return a.outcome == string(x402.OutcomeSettleUnreachable) && strings.Contains(a.gateError, "may have")
}

// pastDeadline reports whether p's authorization expired by the chain's clock at now.
func pastDeadline(p *invPayment, now time.Time) bool {
	pl, err := x402.DecodePaymentPayload(p.header)
	return err == nil && pl.Payload.Deadline().Before(now)
}

// deadlineReasons are the refusals of a payment whose deadline passed, or would before its settlement could be
// mined (see deadlineRefusal).
var deadlineReasons = []string{x402.ReasonPermit2DeadlineExpired, x402.ReasonValidBefore}

// deadlineRefusal reports whether note, a 402's reason at verification or at settlement, refuses a payment for its
// deadline passed or too close: not for a deadline signed too far ahead, which shares invalid_exact_evm_payload_
// authorization_valid_before and is the server's reason for a good payment (chain/verify.go checkFarDeadline).
func deadlineRefusal(note string) bool {
	return hasAnyPrefix(strings.TrimPrefix(note, "settlement failed: "), deadlineReasons) && !strings.Contains(note, "lies more than maxTimeoutSeconds")
}

// termsReasons are the refusals of a payment whose terms the resource no longer offers: after a reload that
// changed the price, an honest payment signed before may be refused so (and nothing is charged).
var termsReasons = []string{x402.ReasonValueMismatch, x402.ReasonPermit2AmountMismatch, x402.ReasonEIP3009AuthorizationValue,
	x402.ReasonPaymentAlreadyUsed + ": this payment was made for another resource"}

func (r *invRun) checkHonestServed(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	refusedForTerms, refusedShape, refusedForLeases, refusedSharedApproval, refusedForDeadline, unknownPastDeadline := 0, 0, 0, 0, 0, 0
	for _, p := range r.snapshot() {
		home := p.home()
		delivered := p.delivered() > 0
		var wrong []string
		p.mu.Lock()
		for _, a := range p.answers {
			switch {
			case a.res != home || !a.final || a.whole || p.servedBefore(a):
			case a.status != http.StatusPaymentRequired:
				refusedShape++ // a request shape the route does not sell (4xx), nothing charged: the charge checks say
			case alreadyUsed(a.note) && (delivered || strings.Contains(a.note, "another request is presenting")):
			case alreadyUsed(a.note):
				wrong = append(wrong, fmt.Sprintf("402 %q (action #%d), and it never delivered its response whole", a.note, a.action))
			case r.reloadedSince(p.signed) && hasAnyPrefix(a.note, termsReasons):
				refusedForTerms++
			case a.settle == nil && len(r.w.gateways) > 1 && hasAnyPrefix(a.note, leaseReasons):
				refusedForLeases++ // at verification (no settlement was asked): nothing ran, nothing was charged
			case a.settle == nil && sharesApproval(a.note):
				refusedSharedApproval++ // its approval's nonce is another payment's, held: nothing ran, nothing charged
			case p.route.validity != 0 && deadlineRefusal(a.note):
				// Valid briefly: its deadline passed, or would before a settlement could be mined, while it waited
				// (a fault, the chain's clock running ahead under load), at verification or at settlement. Refused
				// before any transaction was sent (a settle after route's upstream ran); a payment the chain took
				// meanwhile is the no-pay-again and charge checks' to judge.
				refusedForDeadline++
			default:
				wrong = append(wrong, fmt.Sprintf("402 %q (action #%d)", a.note, a.action))
			}
		}
		p.mu.Unlock()
		if len(wrong) > 0 {
			more := ""
			if len(wrong) > 1 {
				more = fmt.Sprintf(", and %d more such answers", len(wrong)-1)
			}
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d, honest, was refused for %s: %s%s", p.n, home, wrong[0], more), payments: []*invPayment{p}})
		}
		switch last := p.lastAt(home); {
		case delivered || last != nil && last.final:
		case remoteUnknownPastDeadline(p, last, end):
			unknownPastDeadline++
		default:
			out = append(out, invViolation{what: fmt.Sprintf("payment #%d has no final answer for %s after quiescence", p.n, home), payments: []*invPayment{p}})
		}
	}
	return out, fmt.Sprintf("no honest payment was refused for a reason of the server's (%d refusals for terms a reload changed, %d of a request's shape, "+
		"%d at verification for a wallet lease the gateway does not hold, %d at verification for an approval another payment of the payer carries, "+
		"%d of a payment valid briefly for its deadline; %d remote payments valid briefly left unknown past their deadline, not charged)",
		refusedForTerms, refusedShape, refusedForLeases, refusedSharedApproval, refusedForDeadline, unknownPastDeadline)
}

// sharesApproval reports whether note is the refusal, at verification, of a payment whose sponsored approval (its
// payer's approve(Permit2) transaction) has the account nonce of the approval another payment of the payer carries,
// held and not settled yet, or on its way to the chain: the sponsored-approval lane's concurrent first payments of
// one payer sign one approval nonce each, and only one payment can carry it (chain/verify.go permitInFlight,
// TestTwoPaymentsCarryingOneSponsoredApprovalVerifiedAtOnceAtTwoGatewaysAreNotBothHeld; chain/approval.go
// checkApproval, TestAPaymentWhoseApprovalWaitsBehindThePayersPendingApprovalIsNotFunded). The refusal comes before
// the upstream runs and charges nothing; the payment is good again once the other's approval mined, and is judged
// by its later presentations (it must still end with a final answer).
func sharesApproval(note string) bool {
	return strings.HasPrefix(note, x402.ReasonERC20ApprovalTxWrongNonce) &&
		(strings.Contains(note, "is carried by another payment") || strings.Contains(note, "whose allowance pays this payment once it mined"))
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// reloadedSince reports whether the gateways ran other prices at some time after t.
func (r *invRun) reloadedSince(t time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.reloads {
		if e.to.After(t) {
			return true
		}
	}
	return false
}

func (r *invRun) checkNothingLeft(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	for _, l := range end.left {
		out = append(out, invViolation{what: l})
	}
	if end.drained != "" && !strings.HasPrefix(end.drained, "drained") {
		out = append(out, invViolation{what: end.drained})
	}
	lag := ""
	if len(end.lagging) > 0 {
		lag = "; records lagging their payment: " + strings.Join(end.lagging, "; ")
	}
	return out, fmt.Sprintf("%s; read %s%s", end.drained, strings.Join(end.journals, ", "), lag)
}

func (r *invRun) checkNoRevert(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	for _, s := range end.reverted {
		out = append(out, invViolation{what: s})
	}
	return out, fmt.Sprintf("%d settlement transactions, none reverted", end.settlements)
}

func (r *invRun) checkTransportSpent(end *invEnd) ([]invViolation, string) {
	// What each Transport's payments cost, as far as the chain can tell: what a spent authorization moved, and
	// the whole of one that can still be settled (its nonce unspent, its deadline not passed by chain time).
	type key struct {
		it    *invTransport
		asset string
	}
	bound, signed := map[key]*big.Int{}, map[key]*big.Int{}
	chainNow := end.chainNow
	for _, p := range r.snapshot() {
		if p.transport < 0 {
			continue
		}
		k := key{r.transports[p.transport], strings.ToLower(p.req.Asset)}
		if bound[k] == nil {
			bound[k], signed[k] = new(big.Int), new(big.Int)
		}
		signed[k].Add(signed[k], p.amount)
		switch pl, err := x402.DecodePaymentPayload(p.header); {
		case end.consumed[p]:
			bound[k].Add(bound[k], orZero(end.charged[p]))
		case err == nil && !pl.Payload.Deadline().After(chainNow):
			// Expired unspent: Permit2 refuses it from now on, so it can move nothing.
		default:
			bound[k].Add(bound[k], p.amount)
		}
	}
	var out []invViolation
	var parts []string
	for k, b := range bound {
		spent, counted := k.it.tr.Spent(r.w.facts.Network, k.asset), k.it.tr.Signed(r.w.facts.Network, k.asset)
		parts = append(parts, fmt.Sprintf("worker %d in %s…: signed %s, moved or can still move %s, counted spent %s", k.it.worker, k.asset[:6], signed[k], b, spent))
		if counted.Cmp(signed[k]) != 0 {
			out = append(out, invViolation{what: fmt.Sprintf("worker %d's payer.Transport sent payments of %s of %s (its Base saw each), and counts %s signed",
				k.it.worker, signed[k], k.asset, counted)})
		}
		if spent.Cmp(b) < 0 {
			out = append(out, invViolation{what: fmt.Sprintf("worker %d's payer.Transport counts %s of %s spent, but its payments signed for %s moved or can still move %s on chain: "+
				"the budget lets it sign more than it can be charged", k.it.worker, spent, k.asset, signed[k], b)})
		}
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return nil, "no payment went through a payer.Transport"
	}
	return out, strings.Join(parts, "; ")
}

// runChecks judges every invariant and reports each: PASS with its figures, or FAIL with the violations, the
// payments' histories, the actions and faults around them, and the seed.
func (r *invRun) runChecks(end *invEnd) {
	failed := 0
	defer func() { r.summarize(end, failed) }()
	for _, c := range invChecks {
		violations, summary := c.judge(r, end)
		if len(violations) == 0 {
			r.t.Logf("%s: check %s PASS: %s", r.topo.name, c.name, summary)
			continue
		}
		failed++
		var b strings.Builder
		fmt.Fprintf(&b, "%s: check %s FAIL (%s): %d violation(s)\n", r.topo.name, c.name, c.meaning, len(violations))
		for i, v := range violations {
			if i == 8 {
				fmt.Fprintf(&b, "  ... and %d more (the action log has every action)\n", len(violations)-i)
				break
			}
			fmt.Fprintf(&b, "  - %s\n", v.what)
			for _, p := range v.payments {
				b.WriteString(r.history(p))
			}
		}
		fmt.Fprintf(&b, "  (%s)\n", summary)
		r.t.Error(b.String())
	}
	if failed > 0 {
		r.t.Errorf("%s: %d of %d checks failed %v after the test began; replay the draws with %s=%d %s=%s %s=%s; the action log is %s",
			r.topo.name, failed, len(invChecks), time.Since(r.began).Round(time.Second), invSeedEnv, r.seed, invTopologyEnv, r.topo.key,
			invDurationEnv, r.duration, r.logf.Name())
	}
}

// summarize logs the run's figures on one line, for scripts/soak to add up.
func (r *invRun) summarize(end *invEnd, failed int) {
	payments := r.snapshot()
	delivered := 0
	for _, p := range payments {
		if p.delivered() > 0 {
			delivered++
		}
	}
	r.mu.Lock()
	actions, faults := 0, 0
	for _, a := range r.actions {
		switch a.worker {
		case "F":
			faults++
		case "Q":
		default:
			actions++
		}
	}
	r.mu.Unlock()
	r.t.Logf("%s: SUMMARY topology=%s seed=%d seconds=%.0f actions=%d faults=%d payments=%d delivered=%d settlements=%d checks_failed=%d/%d",
		r.topo.name, r.topo.key, r.seed, time.Since(r.began).Seconds(), actions, faults, len(payments), delivered, end.settlements, failed, len(invChecks))
}

// history tells a payment's story: its presentations, and the actions and faults of its lifetime.
func (r *invRun) history(p *invPayment) string {
	var b strings.Builder
	fmt.Fprintf(&b, "      %s\n", p)
	if runs := r.w.upstream.runsOf(p.n); runs > 0 {
		fmt.Fprintf(&b, "      the upstream answered %d request(s) of it\n", runs)
	}
	p.mu.Lock()
	first, last := p.signed, p.signed
	acts := map[int]bool{}
	for i, a := range p.answers {
		if i < invShownAnswers-invShownLast || i >= len(p.answers)-invShownLast {
			acts[a.action] = true
		}
		if a.got.After(last) {
			last = a.got
		}
	}
	p.mu.Unlock()
	r.mu.Lock()
	defer r.mu.Unlock()
	faults := 0
	for _, a := range r.actions {
		at := r.start.Add(a.at)
		fault := a.worker == "F" && at.After(first.Add(-2*time.Second)) && at.Before(last)
		if fault {
			if faults++; faults > 8 {
				continue
			}
		}
		if acts[a.n] || fault {
			fmt.Fprintf(&b, "        %s\n", shortenLine(a.String(), 400))
		}
	}
	return b.String()
}

// shortenLine keeps a line of a report at most n bytes.
func shortenLine(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// TestAGracefulStopExcusesOnlyAPaidTunnelOpenAtIt holds the checks to what a graceful stop may excuse: a second
// delivery of a payment whose first was a tunnel still open as its gateway stopped, and nothing else; it is no
// crash. It runs no process.
func TestAGracefulStopExcusesOnlyAPaidTunnelOpenAtIt(t *testing.T) {
	at := time.Now()
	sec := func(s float64) time.Time { return at.Add(time.Duration(s * float64(time.Second))) }
	r := &invRun{stops: []invStop{{invEvent: invEvent{gate: 0, from: sec(0), to: sec(3)}, action: 7, signal: "SIGTERM", exited: sec(1)}}}
	tunnel := func(gate int, sent, got float64) *invAnswer {
		return &invAnswer{gate: gate, status: http.StatusSwitchingProtocols, whole: true, sent: sec(sent), got: sec(got)}
	}
	later := &invAnswer{gate: 0, status: http.StatusSwitchingProtocols, whole: true, sent: sec(4), got: sec(4.1)}
	for _, c := range []struct {
		name    string
		prev    *invAnswer
		next    *invAnswer
		excused bool
	}{
		{"a tunnel open as the stop began", tunnel(0, -0.5, 0.2), later, true},
		{"a tunnel whose client ended just before the signal", tunnel(0, -0.8, -0.5), later, true},
		{"a tunnel opened as the gateway drained", tunnel(0, 0.3, 0.4), later, true},
		{"a response that is no tunnel", &invAnswer{gate: 0, status: http.StatusOK, whole: true, sent: sec(-0.5), got: sec(0.2)}, later, false},
		{"a tunnel its client ended long before the stop", tunnel(0, -3, -2), later, false},
		{"a tunnel of another gateway", tunnel(1, -0.5, 0.2), later, false},
		{"a tunnel opened once the process was gone", tunnel(0, 1.5, 1.6), later, false},
		{"a second delivery before the stop", tunnel(0, -0.5, -0.4), &invAnswer{gate: 0, sent: sec(-0.3)}, false},
	} {
		if got := r.tunnelCutByStop(c.prev, c.next) != nil; got != c.excused {
			t.Errorf("%s: excused %v, want %v", c.name, got, c.excused)
		}
	}
	if r.crashBetween(0, sec(-1), sec(4)) {
		t.Error("a graceful stop was taken for a crash")
	}
	if note := r.stopsBetween(0, sec(-1), sec(4)); !strings.Contains(note, "graceful stop") || !strings.Contains(note, "action #7") {
		t.Errorf("a violation across the stop says %q: want it to name the graceful stop and its action", note)
	}
}
