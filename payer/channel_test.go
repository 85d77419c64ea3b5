package payer_test

import (
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchSeller is a batch-settlement resource server as the public SDK's server keeps a channel: it checks each
// payment with the engine's off-chain checks (chain.BatchTerms.CheckVoucher, chain.CheckDepositAuthorization),
// credits a deposit to the channel's balance without a chain, takes a voucher only at exactly the last accepted
// amount plus the price, answers with chargedAmount and the channel's state, and refunds what is left.
type batchSeller struct {
	t          *testing.T
	price      *big.Int
	minDeposit string
	exactToo   bool   // offer exact (permit2) first, then batch-settlement
	method     string // the deposits' asset transfer method: "" (eip3009) or permit2
	terms      *chain.BatchTerms
	authorizer common.Address
	// lie, when set, is the chargedCumulativeAmount the answers name instead of the true one.
	lie string
	// used, when set, is the payment_already_used refusal the next batch payment gets: a voucher is accepted all the
	// same (charged: as a gate that accepted it for another resource), unless the refusal says it is being presented.
	used string

	mu       sync.Mutex
	balances map[string]*big.Int // by channel id
	charges  map[string]*big.Int // by channel id: the last accepted cumulative amount
	vouchers map[string]string   // by channel id: the signature of the last accepted voucher
	payloads []x402.BatchPayload // each batch payment received, in order
	refunded *big.Int
	exact    int // exact payments received
}

func newBatchSeller(t *testing.T, price int64, minDeposit string) (*batchSeller, *httptest.Server) {
	t.Helper()
	s := &batchSeller{t: t, price: big.NewInt(price), minDeposit: minDeposit, balances: map[string]*big.Int{}, charges: map[string]*big.Int{}, vouchers: map[string]string{}, refunded: new(big.Int)}
	key, _ := crypto.GenerateKey()
	s.authorizer = crypto.PubkeyToAddress(key.PublicKey)
	terms, err := chain.NewBatchTerms(s.requirement(), big.NewInt(72344), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	s.terms = terms
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return s, srv
}

func (s *batchSeller) requirement() x402.BatchRequirements {
	return x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: testNetwork, Amount: s.price.String(), Asset: testToken,
		PayTo: testPayTo, MaxTimeoutSeconds: 60, Extra: x402.BatchExtra{ReceiverAuthorizer: s.authorizer.Hex(), WithdrawDelay: 900,
			Name: "Stable Coin", Version: "1", MinDeposit: s.minDeposit, AssetTransferMethod: s.method}}
}

// offer writes the 402's PAYMENT-REQUIRED by hand: PaymentRequired's accepts cannot hold a batch extra.
func (s *batchSeller) offer(w http.ResponseWriter, r *http.Request, reason string) {
	s.offerState(w, r, reason, "")
}

// offerState is offer; with a channel id, a corrective 402: the channel as the server holds it and its last
// voucher, as the SDK's server answers a cumulative amount it does not hold.
func (s *batchSeller) offerState(w http.ResponseWriter, r *http.Request, reason, channel string) {
	type doc struct {
		X402Version int               `json:"x402Version"`
		Error       string            `json:"error,omitempty"`
		Resource    x402.ResourceInfo `json:"resource"`
		Accepts     []any             `json:"accepts"`
	}
	d := doc{X402Version: 2, Error: reason, Resource: x402.ResourceInfo{URL: "http://" + r.Host + r.URL.Path}}
	if s.exactToo {
		d.Accepts = append(d.Accepts, x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: testNetwork, Amount: s.price.String(),
			Asset: testToken, PayTo: testPayTo, MaxTimeoutSeconds: 60, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2}})
	}
	rq := s.requirement()
	if channel != "" && s.charges[channel] != nil {
		rq.Extra.ChannelState = &x402.BatchChannelState{ChannelID: channel, Balance: s.balances[channel].String(), TotalClaimed: "0",
			RefundNonce: "0", ChargedCumulativeAmount: s.charges[channel].String()}
		rq.Extra.VoucherState = &x402.BatchVoucherState{SignedMaxClaimable: s.charges[channel].String(), Signature: s.vouchers[channel]}
	}
	d.Accepts = append(d.Accepts, rq)
	h, err := x402.EncodeHeader(d)
	if err != nil {
		s.t.Errorf("encoding PAYMENT-REQUIRED: %v", err)
	}
	w.Header().Set(x402.HeaderPaymentRequired, h)
	w.WriteHeader(http.StatusPaymentRequired)
}

func (s *batchSeller) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	r := req
	io.Copy(io.Discard, r.Body)
	h := r.Header.Get(x402.HeaderPaymentSignature)
	if h == "" {
		s.offer(w, r, "")
		return
	}
	if any, err := x402.DecodePaymentPayload(h); err == nil && any.Accepted.Scheme == x402.SchemeExact {
		s.mu.Lock()
		s.exact++
		s.mu.Unlock()
		settled, _ := x402.EncodeHeader(x402.SettleResponse{Success: true, Transaction: testTx, Network: testNetwork})
		w.Header().Set(x402.HeaderPaymentResponse, settled)
		fmt.Fprint(w, "paid exactly")
		return
	}
	p, err := x402.DecodeBatchPayment(h)
	if err != nil {
		s.t.Errorf("the payment does not decode as batch-settlement: %v", err)
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.payloads = append(s.payloads, p.Payload)
	id := strings.ToLower(p.Payload.Voucher.ChannelID)
	if s.balances[id] == nil {
		s.balances[id], s.charges[id] = new(big.Int), new(big.Int)
	}
	view := chain.ChannelView{Balance: new(big.Int).Set(s.balances[id]), Charged: new(big.Int).Set(s.charges[id]), TotalClaimed: new(big.Int), ReadAt: time.Unix(1_700_000_000, 0)}
	var deposit *big.Int
	if p.Payload.Type == x402.BatchDeposit {
		if r := s.terms.CheckDepositAuthorization(&p, time.Unix(1_700_000_000, 0)); r != nil {
			s.t.Errorf("the deposit is refused: %v", r)
			s.offer(w, req, r.Reason)
			return
		}
		deposit, _ = x402.ParseAmount(p.Payload.Deposit.Amount)
		view.Balance.Add(view.Balance, deposit)
	}
	av, err := s.terms.CheckVoucher(&p, view, time.Unix(1_700_000_000, 0))
	if err != nil {
		var refusal *chain.BatchRefusal
		if errors.As(err, &refusal) {
			s.offerState(w, r, refusal.Reason, id)
			return
		}
		s.t.Errorf("checking the voucher: %v", err)
		return
	}
	if used := s.used; used != "" {
		s.used = ""
		if !strings.Contains(used, "right now") {
			s.balances[id], s.charges[id], s.vouchers[id] = view.Balance, av.Cumulative, p.Payload.Voucher.Signature
		}
		s.offer(w, req, x402.ReasonPaymentAlreadyUsed+": "+used)
		return
	}
	s.balances[id] = view.Balance
	extra := &x402.BatchResponseExtra{ChargedAmount: av.Charge.String()}
	if p.Payload.Type == x402.BatchRefund {
		left := new(big.Int).Sub(s.balances[id], s.charges[id])
		if p.Payload.Amount != "" {
			left, _ = x402.ParseAmount(p.Payload.Amount)
		}
		s.refunded.Add(s.refunded, left)
		s.balances[id].Sub(s.balances[id], left)
		extra.ChargedAmount = "0"
	}
	s.charges[id] = av.Cumulative
	s.vouchers[id] = p.Payload.Voucher.Signature
	cumulative := av.Cumulative.String()
	if s.lie != "" {
		cumulative = s.lie
	}
	extra.ChannelState = &x402.BatchChannelState{ChannelID: av.ChannelID.Hex(), Balance: s.balances[id].String(), TotalClaimed: "0",
		RefundNonce: "0", ChargedCumulativeAmount: cumulative}
	settled, err := x402.EncodeHeader(x402.BatchSettleResponse{Success: true, Network: testNetwork, Payer: p.Payload.ChannelConfig.Payer, Extra: extra})
	if err != nil {
		s.t.Errorf("encoding the settlement: %v", err)
	}
	w.Header().Set(x402.HeaderPaymentResponse, settled)
	fmt.Fprint(w, "the paid report")
}

// seen returns the batch payments received, and the balance and accepted amount of the first one's channel.
func (s *batchSeller) seen() ([]x402.BatchPayload, *big.Int, *big.Int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	balance, charged := new(big.Int), new(big.Int)
	if len(s.payloads) > 0 {
		id := strings.ToLower(s.payloads[0].Voucher.ChannelID)
		balance.Set(orNew(s.balances[id]))
		charged.Set(orNew(s.charges[id]))
	}
	return append([]x402.BatchPayload(nil), s.payloads...), balance, charged
}

func orNew(x *big.Int) *big.Int {
	if x == nil {
		return new(big.Int)
	}
	return x
}

// batchClient pays through a Transport whose limit of the test token is perRequest per request and total in
// all (nil: none).
func batchClient(p *payer.Payer, perRequest int64, total *big.Int) (*http.Client, *payer.Transport) {
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: testNetwork, Asset: testToken, PerRequest: big.NewInt(perRequest), Total: total}}}
	return &http.Client{Transport: tr}, tr
}

func getBody(t *testing.T, c *http.Client, url string) *http.Response {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp
}

func channelOf(t *testing.T, p *payer.Payer, payloads []x402.BatchPayload) payer.ChannelState {
	t.Helper()
	if len(payloads) == 0 || payloads[0].Voucher == nil {
		t.Fatal("no voucher was sent")
	}
	st, ok := p.Channel(common.HexToHash(payloads[0].Voucher.ChannelID))
	if !ok {
		t.Fatalf("the payer does not know channel %s", payloads[0].Voucher.ChannelID)
	}
	return st
}

func TestTransportDepositsOnceThenPaysEachRequestByTheNextCumulativeVoucher(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	p := newPayer(t)
	c, tr := batchClient(p, 1000, big.NewInt(1_000_000))

	for k := 1; k <= 5; k++ {
		if resp := getBody(t, c, srv.URL+"/report"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s, want 200", k, resp.Status)
		}
	}
	payloads, balance, charged := s.seen()
	if len(payloads) != 5 {
		t.Fatalf("the server saw %d payments, want 5", len(payloads))
	}
	for k, pl := range payloads {
		want := x402.BatchVoucher
		if k == 0 {
			want = x402.BatchDeposit
		}
		if pl.Type != want || pl.Voucher.MaxClaimableAmount != fmt.Sprint(1000*(k+1)) {
			t.Errorf("payment %d is a %s at %s, want a %s at %d", k+1, pl.Type, pl.Voucher.MaxClaimableAmount, want, 1000*(k+1))
		}
	}
	// The deposit is DefaultDepositRequests times the price: the server announced no minDeposit.
	if got := payloads[0].Deposit.Amount; got != "10000" {
		t.Errorf("the deposit is %s, want 10000 (10 requests at 1000)", got)
	}
	if balance.Cmp(big.NewInt(10_000)) != 0 || charged.Cmp(big.NewInt(5000)) != 0 {
		t.Errorf("the server holds balance %s, charged %s; want 10000 and 5000", balance, charged)
	}
	st := channelOf(t, p, payloads)
	if st.Balance.Cmp(big.NewInt(10_000)) != 0 || st.Charged.Cmp(big.NewInt(5000)) != 0 || st.Left().Cmp(big.NewInt(5000)) != 0 {
		t.Errorf("the payer keeps balance %s, charged %s, left %s; want 10000, 5000, 5000", st.Balance, st.Charged, st.Left())
	}
	// The voucher at 6000 is signed ahead for the next request, and is not sent: the payer has signed 5000.
	if st.Signed.Cmp(big.NewInt(5000)) != 0 {
		t.Errorf("the payer says it signed up to %s, want the last voucher sent, 5000", st.Signed)
	}
	// The budget counts the deposit once, when it was signed; the vouchers spend from it.
	if got := tr.Spent(testNetwork, testToken); got.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("Spent is %s, want the deposit, 10000", got)
	}
	if got := tr.Signed(testNetwork, testToken); got.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("Signed is %s, want the deposit, 10000", got)
	}
}

func TestTransportTopsUpAChannelItsVouchersHaveSpentAndCountsTheNewDeposit(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "3000")
	p, err := payer.New(mustKey(t), payer.Options{Now: func() time.Time { return time.Unix(1_700_000_000, 0) }, DepositRequests: 2})
	if err != nil {
		t.Fatal(err)
	}
	c, tr := batchClient(p, 1000, big.NewInt(1_000_000))
	for k := 1; k <= 4; k++ {
		if resp := getBody(t, c, srv.URL+"/report"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s, want 200", k, resp.Status)
		}
	}
	payloads, _, _ := s.seen()
	var kinds []string
	for _, pl := range payloads {
		kinds = append(kinds, pl.Type)
	}
	// minDeposit (3000) is more than 2 requests' worth: 3000 covers three vouchers, the fourth deposits again.
	if got := strings.Join(kinds, ","); got != "deposit,voucher,voucher,deposit" {
		t.Fatalf("the payments are %s, want deposit,voucher,voucher,deposit", got)
	}
	if payloads[0].Deposit.Amount != "3000" || payloads[3].Deposit.Amount != "3000" {
		t.Errorf("the deposits are %s and %s, want the offer's minDeposit, 3000, each", payloads[0].Deposit.Amount, payloads[3].Deposit.Amount)
	}
	if got := tr.Spent(testNetwork, testToken); got.Cmp(big.NewInt(6000)) != 0 {
		t.Errorf("Spent is %s, want both deposits, 6000", got)
	}
	if st := channelOf(t, p, payloads); st.Balance.Cmp(big.NewInt(6000)) != 0 || st.Charged.Cmp(big.NewInt(4000)) != 0 {
		t.Errorf("the payer keeps balance %s, charged %s; want 6000, 4000", st.Balance, st.Charged)
	}
}

func TestTheLimitRefusesADepositThatWouldPassTheTotalAndSendsNothing(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "5000")
	p := newPayer(t)
	c, tr := batchClient(p, 1000, big.NewInt(4999))

	_, err := c.Get(srv.URL + "/report")
	var le *payer.LimitError
	if !errors.As(err, &le) {
		t.Fatalf("got %v, want a *payer.LimitError", err)
	}
	if !le.Deposit || le.Amount.Cmp(big.NewInt(5000)) != 0 || le.Limit.Cmp(big.NewInt(4999)) != 0 {
		t.Errorf("the refusal names deposit %v, amount %s, limit %s; want a deposit of 5000 over 4999", le.Deposit, le.Amount, le.Limit)
	}
	if !strings.Contains(err.Error(), "deposit of at least 5000") {
		t.Errorf("the error %q does not say which deposit", err)
	}
	if payloads, _, _ := s.seen(); len(payloads) != 0 {
		t.Errorf("the server received %d payments, want none", len(payloads))
	}
	if got := tr.Spent(testNetwork, testToken); got.Sign() != 0 {
		t.Errorf("Spent is %s after a refusal, want 0", got)
	}
}

func TestTheDepositShrinksToWhatTheTotalLeavesButNotBelowMinDeposit(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "2000")
	p := newPayer(t) // wants 10 requests' worth, 10000
	c, tr := batchClient(p, 1000, big.NewInt(2500))

	for k := 1; k <= 2; k++ {
		if resp := getBody(t, c, srv.URL+"/report"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s, want 200", k, resp.Status)
		}
	}
	payloads, _, _ := s.seen()
	if payloads[0].Deposit.Amount != "2500" {
		t.Errorf("the deposit is %s, want all the Total leaves, 2500", payloads[0].Deposit.Amount)
	}
	// The third voucher (3000) would need a deposit the Total no longer has room for.
	_, err := c.Get(srv.URL + "/report")
	var le *payer.LimitError
	if !errors.As(err, &le) || !le.Deposit {
		t.Fatalf("the third request: got %v, want a deposit refused by the limit", err)
	}
	if got := tr.Spent(testNetwork, testToken); got.Cmp(big.NewInt(2500)) != 0 {
		t.Errorf("Spent is %s, want 2500", got)
	}
	if payloads, _, _ := s.seen(); len(payloads) != 2 {
		t.Errorf("the server received %d payments, want 2", len(payloads))
	}
}

func TestTheLimitPerRequestBoundsTheBatchPrice(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	c, _ := batchClient(newPayer(t), 999, nil)
	_, err := c.Get(srv.URL + "/report")
	var le *payer.LimitError
	if !errors.As(err, &le) || le.Amount.Cmp(big.NewInt(1000)) != 0 {
		t.Fatalf("got %v, want the price 1000 refused by the limit of 999 per request", err)
	}
	if payloads, _, _ := s.seen(); len(payloads) != 0 {
		t.Errorf("the server received %d payments, want none", len(payloads))
	}
}

func TestAServerCountingAnotherCumulativeAmountDoesNotMoveThePayersCount(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	s.lie = "7000"
	p := newPayer(t)
	c, _ := batchClient(p, 1000, big.NewInt(1_000_000))
	getBody(t, c, srv.URL+"/report")
	payloads, _, _ := s.seen()
	if _, ok := p.Channel(common.HexToHash(payloads[0].Voucher.ChannelID)); ok {
		t.Fatal("the payer took a channel state from an answer whose cumulative amount is not its own count")
	}
}

func TestRefundAsksForWhatIsLeftAtTheLastAcceptedAmount(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	p := newPayer(t)
	c, _ := batchClient(p, 1000, big.NewInt(1_000_000))
	for k := 0; k < 3; k++ {
		getBody(t, c, srv.URL+"/report")
	}
	st, answer, err := p.Refund(t.Context(), nil, srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
	payloads, balance, charged := s.seen()
	last := payloads[len(payloads)-1]
	if last.Type != x402.BatchRefund || last.Voucher.MaxClaimableAmount != "3000" || last.Amount != "" {
		t.Errorf("the refund is a %s at %s for %q, want a refund at 3000 for all", last.Type, last.Voucher.MaxClaimableAmount, last.Amount)
	}
	if !answer.Success || s.refunded.Cmp(big.NewInt(7000)) != 0 || balance.Cmp(big.NewInt(3000)) != 0 || charged.Cmp(big.NewInt(3000)) != 0 {
		t.Errorf("the server refunded %s, holds %s, charged %s; want 7000, 3000, 3000", s.refunded, balance, charged)
	}
	if st.Left().Sign() != 0 || st.Balance.Cmp(big.NewInt(3000)) != 0 {
		t.Errorf("after the refund the payer keeps balance %s, left %s; want 3000, 0", st.Balance, st.Left())
	}
	if _, _, err := p.Refund(t.Context(), nil, srv.URL+"/report", nil); err == nil || !strings.Contains(err.Error(), "nothing left") {
		t.Errorf("a second refund: got %v, want nothing left", err)
	}
}

func TestChooseTakesExactBeforeANewBatchChannelAndTheOpenChannelBeforeExact(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	s.exactToo = true
	p := newPayer(t)
	c, _ := batchClient(p, 1000, big.NewInt(1_000_000))
	getBody(t, c, srv.URL+"/report")
	if payloads, _, _ := s.seen(); s.exact != 1 || len(payloads) != 0 {
		t.Fatalf("with no channel open: %d exact and %d batch payments, want exact only", s.exact, len(payloads))
	}

	// Options.Scheme batch-settlement opens the channel, even with exact offered first.
	only, err := payer.New(mustKey(t), payer.Options{Scheme: x402.SchemeBatchSettlement, Now: func() time.Time { return time.Unix(1_700_000_000, 0) }})
	if err != nil {
		t.Fatal(err)
	}
	c2, _ := batchClient(only, 1000, big.NewInt(1_000_000))
	getBody(t, c2, srv.URL+"/report")
	if payloads, _, _ := s.seen(); s.exact != 1 || len(payloads) != 1 || payloads[0].Type != x402.BatchDeposit {
		t.Fatalf("Options.Scheme batch-settlement: %d exact and %d batch payments, want one deposit", s.exact, len(payloads))
	}

	// A payer with any scheme and a channel open with a deposit left pays by voucher rather than exact.
	s.exactToo = false
	getBody(t, c, srv.URL+"/report") // the only offer: opens p's channel
	s.exactToo = true
	getBody(t, c, srv.URL+"/report")
	payloads, _, _ := s.seen()
	if s.exact != 1 || len(payloads) != 3 || payloads[2].Type != x402.BatchVoucher {
		t.Fatalf("with a channel open: %d exact and %d batch payments, want the third batch payment a voucher", s.exact, len(payloads))
	}
}

func mustKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestAPayerThatLostItsCountCarriesOnFromTheServersLastVoucherItSigned(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	key := mustKey(t)
	clock := payer.Options{Now: func() time.Time { return time.Unix(1_700_000_000, 0) }}
	first, _ := payer.New(key, clock)
	c, _ := batchClient(first, 1000, big.NewInt(1_000_000))
	for k := 0; k < 3; k++ {
		getBody(t, c, srv.URL+"/report")
	}

	// The same key in a new process: it knows nothing, deposits with a voucher at 1000, and the server answers
	// with its own count (3000) and the voucher the key signed for it; the payer pays again from there.
	again, _ := payer.New(key, clock)
	c2, tr2 := batchClient(again, 1000, big.NewInt(1_000_000))
	if resp := getBody(t, c2, srv.URL+"/report"); resp.StatusCode != http.StatusOK {
		t.Fatalf("the new payer's request: %s, want 200 after resyncing", resp.Status)
	}
	payloads, _, charged := s.seen()
	if n := len(payloads); n != 5 || payloads[4].Voucher.MaxClaimableAmount != "4000" {
		t.Fatalf("the server saw %d payments, the last at %s; want 5, the last at 4000", n, payloads[len(payloads)-1].Voucher.MaxClaimableAmount)
	}
	if charged.Cmp(big.NewInt(4000)) != 0 {
		t.Errorf("the server stands at %s, want 4000", charged)
	}
	st := channelOf(t, again, payloads)
	if st.Charged.Cmp(big.NewInt(4000)) != 0 {
		t.Errorf("the new payer counts %s, want 4000", st.Charged)
	}
	// Both deposits it signed count: the first was handed to the server, which could still submit it.
	if got := tr2.Spent(testNetwork, testToken); got.Cmp(big.NewInt(20_000)) != 0 {
		t.Errorf("Spent is %s, want both deposits signed, 20000", got)
	}
}

func TestACorrective402WithAVoucherThePayerDidNotSignIsNotBelieved(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	first, _ := payer.New(mustKey(t), payer.Options{Now: func() time.Time { return time.Unix(1_700_000_000, 0) }})
	c, _ := batchClient(first, 1000, big.NewInt(1_000_000))
	getBody(t, c, srv.URL+"/report")
	payloads, _, _ := s.seen()
	id := strings.ToLower(payloads[0].Voucher.ChannelID)
	// The server claims the channel stands at 9000, with a signature by another key.
	other := mustKey(t)
	sig, err := chain.SignVoucher(other, chain.BatchDomainSeparator(big.NewInt(72344)), common.HexToHash(id), big.NewInt(9000))
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.charges[id], s.vouchers[id] = big.NewInt(9000), sig.String()
	s.mu.Unlock()
	resp := getBody(t, c, srv.URL+"/report")
	if resp.StatusCode != http.StatusPaymentRequired {
		t.Fatalf("got %s, want the server's 402 returned as it is", resp.Status)
	}
	if payloads, _, _ := s.seen(); len(payloads) != 2 {
		t.Errorf("the server saw %d payments, want 2: no retry on a voucher the payer did not sign", len(payloads))
	}
	if st := channelOf(t, first, payloads); st.Charged.Cmp(big.NewInt(1000)) != 0 {
		t.Errorf("the payer counts %s, want its own 1000", st.Charged)
	}
}

func TestConcurrentRequestsOnOneChannelTakeTurnsAndEachPaysTheNextVoucher(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	p := newPayer(t)
	c, tr := batchClient(p, 1000, big.NewInt(1_000_000))
	const n = 8
	var wg sync.WaitGroup
	codes := make([]int, n)
	for k := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.Get(srv.URL + "/report")
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes[k] = resp.StatusCode
		}()
	}
	wg.Wait()
	for k, code := range codes {
		if code != http.StatusOK {
			t.Errorf("request %d: %d, want 200", k, code)
		}
	}
	payloads, _, charged := s.seen()
	deposits := 0
	for k, pl := range payloads {
		if pl.Type == x402.BatchDeposit {
			deposits++
		}
		if pl.Voucher.MaxClaimableAmount != fmt.Sprint(1000*(k+1)) {
			t.Errorf("payment %d is at %s, want %d", k+1, pl.Voucher.MaxClaimableAmount, 1000*(k+1))
		}
	}
	if len(payloads) != n || deposits != 1 || charged.Cmp(big.NewInt(n*1000)) != 0 {
		t.Errorf("%d payments, %d deposits, the server at %s; want %d, 1, %d", len(payloads), deposits, charged, n, n*1000)
	}
	if got := tr.Spent(testNetwork, testToken); got.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("Spent is %s, want the one deposit, 10000", got)
	}
}

func TestAPermit2DepositIsAWitnessTransferToThePermit2CollectorNamingTheChannel(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	s.method = x402.TransferPermit2
	terms, err := chain.NewBatchTerms(s.requirement(), big.NewInt(72344), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	s.terms = terms
	p := newPayer(t)
	c, _ := batchClient(p, 1000, big.NewInt(1_000_000))
	for k := 0; k < 2; k++ {
		if resp := getBody(t, c, srv.URL+"/report"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %s, want 200", k+1, resp.Status)
		}
	}
	payloads, _, _ := s.seen()
	a := payloads[0].Deposit.Authorization
	if a.Permit2Authorization == nil || a.ERC3009Authorization != nil {
		t.Fatalf("the deposit carries %+v, want a permit2Authorization only", a)
	}
	if got := a.Permit2Authorization.Witness.ChannelID; !strings.EqualFold(got, payloads[0].Voucher.ChannelID) {
		t.Errorf("the witness names channel %s, the voucher %s", got, payloads[0].Voucher.ChannelID)
	}
	if payloads[1].Type != x402.BatchVoucher || payloads[1].Voucher.MaxClaimableAmount != "2000" {
		t.Errorf("the second payment is a %s at %s, want a voucher at 2000", payloads[1].Type, payloads[1].Voucher.MaxClaimableAmount)
	}
}

func TestBatchSettlementIsNeitherSignedAheadNorSignedOutsideATransport(t *testing.T) {
	_, srv := newBatchSeller(t, 1000, "")
	resp, err := http.Get(srv.URL + "/report")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	offer, err := payer.ReadOffer(resp.Header, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := newPayer(t)
	i, err := p.Choose(t.Context(), offer)
	if err != nil {
		t.Fatalf("Choose: %v, want the batch-settlement offer", err)
	}
	if _, err := p.SignBatch(t.Context(), offer, i, 3); err == nil || !strings.Contains(err.Error(), "cannot be signed ahead") {
		t.Errorf("SignBatch of a batch-settlement offer: %v, want a refusal", err)
	}
	if _, err := p.Sign(t.Context(), offer, i); err == nil || !strings.Contains(err.Error(), "made by a Transport") {
		t.Errorf("Sign of a batch-settlement offer: %v, want a refusal", err)
	}
}

func TestWithNoTotalAHostileMinDepositIsBoundedByDepositRequestsTimesPerRequest(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "1000000000")
	c, _ := batchClient(newPayer(t), 1000, nil)
	_, err := c.Get(srv.URL + "/report")
	var le *payer.LimitError
	if !errors.As(err, &le) || !le.Deposit || le.Limit.Cmp(big.NewInt(10_000)) != 0 {
		t.Fatalf("got %v, want a deposit of 1000000000 refused over 10 requests at 1000", err)
	}
	if !strings.Contains(err.Error(), "a deposit may be with no Total") {
		t.Errorf("the error %q does not say which bound", err)
	}
	if payloads, _, _ := s.seen(); len(payloads) != 0 {
		t.Errorf("the server received %d payments, want none", len(payloads))
	}
}

// A voucher the server refuses as payment_already_used (it accepted it for another resource whose response never
// came, or delivered it with the answer lost) is counted as charged, and the request is paid once more by the next
// voucher; not when the server says another request is presenting it right now, and never for a deposit.
func TestAVoucherRefusedAsUsedIsCountedAndTheRequestPaidByTheNext(t *testing.T) {
	for _, tc := range []struct {
		name, used string
		deposit    bool  // the refusal meets the channel's deposit
		status     int   // the request's answer
		charged    int64 // what the payer counts after
		sent       int   // batch payments the server saw
	}{
		{"accepted for another resource", "the voucher for cumulative amount 2000 was accepted for another resource", false, http.StatusOK, 3000, 3},
		{"delivered, its answer lost", "the voucher for cumulative amount 2000 bought a response that was delivered", false, http.StatusOK, 3000, 3},
		{"presented by another request right now", "another request is presenting this voucher right now; wait for its answer", false, http.StatusPaymentRequired, 1000, 2},
		{"a deposit", "the deposit was used", true, http.StatusPaymentRequired, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, srv := newBatchSeller(t, 1000, "")
			p, _ := payer.New(mustKey(t), payer.Options{Now: func() time.Time { return time.Unix(1_700_000_000, 0) }})
			c, _ := batchClient(p, 1000, big.NewInt(1_000_000))
			if !tc.deposit {
				if resp := getBody(t, c, srv.URL+"/a"); resp.StatusCode != http.StatusOK {
					t.Fatalf("the deposit: %s", resp.Status)
				}
			}
			s.mu.Lock()
			s.used = tc.used
			s.mu.Unlock()
			if resp := getBody(t, c, srv.URL+"/b"); resp.StatusCode != tc.status {
				t.Fatalf("the request whose voucher is refused as used: %s, want %d", resp.Status, tc.status)
			}
			payloads, _, _ := s.seen()
			if len(payloads) != tc.sent {
				t.Fatalf("the server saw %d batch payments, want %d", len(payloads), tc.sent)
			}
			st, known := p.Channel(common.HexToHash(payloads[0].Voucher.ChannelID))
			if tc.deposit && known && st.Charged.Sign() != 0 {
				t.Errorf("the payer counts %s charged after its deposit was refused, want nothing", st.Charged)
			} else if !tc.deposit && (!known || st.Charged.Cmp(big.NewInt(tc.charged)) != 0) {
				t.Errorf("the payer counts %v charged (known %v), want %d", st.Charged, known, tc.charged)
			}
		})
	}
}
