package chain_test

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// remoteWorld is a channel funded on a simulated chain, our facilitator (the engine holding the receiver
// authorizer key) over real HTTP behind a proxy that counts claims and can lose a claim's answer after the claim
// was made, and a client of it.
type remoteWorld struct {
	c        *chaintest.Chain
	rq       x402.BatchRequirements
	cfg      contracts.ChannelConfig
	id       common.Hash
	payer    *chaintest.Account
	token    common.Address
	receiver common.Address
	client   *facilitatorclient.Client
	// loseClaimAnswers is how many claims are made and their answer lost (the connection cut after).
	loseClaimAnswers atomic.Int32
	// dropClaims is how many claims are cut before the facilitator saw them (the connection cut once sent).
	dropClaims atomic.Int32
	// dropSettles is how many settles of the receiver are cut before the facilitator saw them.
	dropSettles atomic.Int32
	claims      atomic.Int32
	// settles counts the settles of the receiver that reached the facilitator's door.
	settles atomic.Int32
	// holdRefund, when set, runs before a refund's /settle reaches the facilitator.
	holdRefund func()
}

const remotePrice = 1000

func newRemoteWorld(t *testing.T, deposit int64) *remoteWorld {
	t.Helper()
	c := chaintest.New(t, chaintest.WithPromptCommit())
	w := &remoteWorld{c: c, payer: c.Payers[0], receiver: chaintest.DeriveAccount("remote-seller", 0).Address}
	w.token = c.DeployUSDCoin(big.NewInt(1_000_000_000))
	network := x402.EIP155(c.ChainID.Uint64())
	authorizer := chaintest.DeriveAccount("authorizer", 2)
	nc := chain.NetworkConfig{Network: network, Backend: c.Client, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: w.token, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		Keys:   []*ecdsa.PrivateKey{c.Wallets[0].Key}, BatchReceiverAuthorizer: authorizer.Key, BatchClaimEvery: 1_000_000, BatchClaimAfter: time.Hour}
	engine, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { engine.Close() })
	h, err := facilitatorserver.New(engine, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	fac := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		if r.URL.Path == "/settle" && strings.Contains(string(body), `"type":"refund"`) && w.holdRefund != nil {
			w.holdRefund()
		}
		if r.URL.Path == "/settle" && strings.Contains(string(body), `"type":"settle"`) {
			w.settles.Add(1)
			if w.dropSettles.Add(-1) >= 0 {
				panic(http.ErrAbortHandler)
			}
		}
		if r.URL.Path == "/settle" && strings.Contains(string(body), `"type":"claim"`) {
			w.claims.Add(1)
			if w.dropClaims.Add(-1) >= 0 {
				panic(http.ErrAbortHandler)
			}
			if w.loseClaimAnswers.Add(-1) >= 0 {
				// The claim is made, on chain, whatever the client's wait (a loaded machine may outlast it),
				h.ServeHTTP(httptest.NewRecorder(), r.WithContext(context.WithoutCancel(r.Context())))
				panic(http.ErrAbortHandler) // and its answer lost
			}
		}
		h.ServeHTTP(rw, r)
	}))
	t.Cleanup(fac.Close)
	if w.client, err = facilitatorclient.New(fac.URL); err != nil {
		t.Fatal(err)
	}
	w.rq = x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: network, Amount: fmt.Sprint(remotePrice), Asset: w.token.Hex(),
		PayTo: w.receiver.Hex(), MaxTimeoutSeconds: 300, Extra: x402.BatchExtra{ReceiverAuthorizer: authorizer.Address.Hex(),
			WithdrawDelay: contracts.MinWithdrawDelay, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion}}
	w.cfg = contracts.ChannelConfig{Payer: w.payer.Address, PayerAuthorizer: w.payer.Address, Receiver: w.receiver,
		ReceiverAuthorizer: authorizer.Address, Token: w.token, WithdrawDelay: contracts.MinWithdrawDelay}
	w.cfg.Salt[31] = 9
	w.id = chaintest.ChannelID(c.ChainID, w.cfg)
	// Funded on chain by the payer's deposit, sent by the deployer.
	salt := chaintest.RandomNonce()
	validBefore := new(big.Int).SetUint64(c.HeadTime() + 3600)
	nonce := contracts.ERC3009DepositNonce(w.id, common.BigToHash(salt))
	sig := c.SignTypedData(w.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, c.ChainID,
		w.token, w.payer.Address, big.NewInt(deposit), big.NewInt(0), validBefore, nonce))
	data, err := contracts.EncodeERC3009CollectorData(big.NewInt(0), validBefore, salt, sig)
	if err != nil {
		t.Fatal(err)
	}
	call, err := contracts.PackBatchDeposit(w.cfg, big.NewInt(deposit), contracts.ERC3009DepositCollectorAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transact(context.Background(), c.Deployer, contracts.BatchSettlementAddress, call); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	return w
}

// server is a gateway's batch server on store, not started: the test drives its claims.
func (w *remoteWorld) server(t *testing.T, store journal.Store, probeAfter time.Duration) *chain.RemoteBatch {
	t.Helper()
	rb, err := chain.NewRemoteBatch(chain.RemoteBatchConfig{Remote: w.client, Supported: w.client.Supported, Journal: store,
		Networks: []string{w.rq.Network}, ClaimEvery: 1_000_000, ClaimAfter: time.Hour, ProbeAfter: probeAfter})
	if err != nil {
		t.Fatal(err)
	}
	return rb
}

// voucher is the payer's voucher for cumulative prices.
func (w *remoteWorld) voucher(n int64) x402.BatchRequest {
	cumulative := big.NewInt(n * remotePrice)
	sig := w.c.SignVoucher(w.payer, w.id, cumulative)
	p := x402.BatchPayment{X402Version: 2, Accepted: w.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher,
		ChannelConfig: &x402.ChannelConfig{Payer: w.cfg.Payer.Hex(), PayerAuthorizer: w.cfg.PayerAuthorizer.Hex(), Receiver: w.cfg.Receiver.Hex(),
			ReceiverAuthorizer: w.cfg.ReceiverAuthorizer.Hex(), Token: w.cfg.Token.Hex(), WithdrawDelay: int64(w.cfg.WithdrawDelay), Salt: hexutil.Encode(w.cfg.Salt[:])},
		Voucher: &x402.BatchVoucherFields{ChannelID: w.id.Hex(), MaxClaimableAmount: cumulative.String(), Signature: hexutil.Encode(sig)}}}
	return x402.BatchRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: w.rq}
}

func (w *remoteWorld) settle(t *testing.T, rb *chain.RemoteBatch, n int64) x402.BatchSettleResponse {
	t.Helper()
	resp, err := rb.SettleBatch(context.Background(), w.voucher(n))
	if err != nil {
		t.Fatalf("the voucher at %d prices: %v", n, err)
	}
	return resp
}

func (w *remoteWorld) waitForSeller(t *testing.T, want int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for w.c.BalanceOf(w.token, w.receiver).Int64() != want {
		if time.Now().After(deadline) {
			t.Fatalf("the seller holds %s; want exactly %d", w.c.BalanceOf(w.token, w.receiver), want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestTwoGatewaysOnOnePostgreSQLJournalNeverAcceptVouchersAboveTheDepositThroughARemoteFacilitator: two
// gateways' batch servers in front of one remote facilitator share a PostgreSQL journal, one row per channel.
// The channel holds 3 prices: the vouchers at 1, 2 and 3 prices are accepted, alternately, by one and the other;
// the voucher at 4 is refused by either (above the deposit), as is the voucher at 3 presented to the other as a
// new one at a stale base; both claim at once, and one claim is sent: the seller is paid exactly 3 prices.
func TestTwoGatewaysOnOnePostgreSQLJournalNeverAcceptVouchersAboveTheDepositThroughARemoteFacilitator(t *testing.T) {
	pgtest.Need(t)
	w := newRemoteWorld(t, 3*remotePrice)
	dsn := pgtest.Shared(t)
	var gw [2]*chain.RemoteBatch
	for i := range gw {
		store, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
		gw[i] = w.server(t, store, time.Hour)
	}
	for n := int64(1); n <= 3; n++ {
		if resp := w.settle(t, gw[n%2], n); !resp.Success || resp.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(n*remotePrice) {
			t.Fatalf("the voucher at %d prices on gateway %d: %+v; want it accepted", n, n%2, resp)
		}
	}
	for i, rb := range gw {
		if resp := w.settle(t, rb, 4); resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeExceedsBalance {
			t.Fatalf("the voucher at 4 prices, above the deposit of 3, on gateway %d: %+v; want %s", i, resp, x402.ReasonBatchCumulativeExceedsBalance)
		}
	}
	var wg sync.WaitGroup
	for _, rb := range gw {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rb.ClaimNow(context.Background()); err != nil {
				t.Errorf("claiming: %v", err)
			}
		}()
	}
	wg.Wait()
	w.waitForSeller(t, 3*remotePrice)
	if got := w.claims.Load(); got != 1 {
		t.Errorf("the two gateways sent %d claims; want 1", got)
	}
}

// TestAClaimWhoseAnswerIsLostIsNeverClaimedTwiceAcrossARestartAndIsSettledOnceLookedUp: the facilitator makes a
// claim and its answer is lost (the connection cut). The gateway restarts on its journal: the claim is in
// flight, and the new server's claims send nothing while it waits; once it is old enough, a /verify of the
// channel's last voucher shows it landed, it is marked so and the receiver settled: one claim, the seller paid
// exactly what was accepted.
func TestAClaimWhoseAnswerIsLostIsNeverClaimedTwiceAcrossARestartAndIsSettledOnceLookedUp(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	path := filepath.Join(t.TempDir(), "journal.db")
	store, err := journal.OpenBolt(path, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rb := w.server(t, store, time.Hour)
	for n := int64(1); n <= 4; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	w.loseClaimAnswers.Store(1)
	if err := rb.ClaimNow(context.Background()); err == nil || !strings.Contains(err.Error(), "no answer") {
		t.Fatalf("the claim whose answer is lost: %v; want an error saying no answer came", err)
	}
	store.Close() // the gateway stops: its claim is in flight in the journal

	store, err = journal.OpenBolt(path, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	const probeAfter = 2 * time.Second
	rb = w.server(t, store, probeAfter)
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.claims.Load(); got != 1 {
		t.Fatalf("after the restart %d claims were sent; want 1: the claim in flight is not sent again", got)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 0 {
		t.Fatalf("the seller holds %d before the receiver is settled; want 0 (claimed in the escrow)", got)
	}
	time.Sleep(probeAfter)
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.waitForSeller(t, 4*remotePrice)
	if got := w.claims.Load(); got != 1 {
		t.Errorf("%d claims were sent; want 1", got)
	}
	var chs journal.Channels = store
	rows, err := chs.ClaimsInFlight(context.Background(), w.rq.Network)
	if err != nil || len(rows) != 0 {
		t.Errorf("claims in flight after the look-up: %d (%v); want none", len(rows), err)
	}
	// A new voucher is accepted on the channel, and claimed alone.
	if resp := w.settle(t, rb, 5); !resp.Success {
		t.Fatalf("the voucher at 5 prices: %+v", resp)
	}
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.waitForSeller(t, 5*remotePrice)
}

// TestAClaimCutBeforeTheFacilitatorMadeItIsClaimedAgainOnceLookedUp: the claim reaches the facilitator's door
// and the connection is cut before it is made: no answer. The look-up (a /verify of the channel's last voucher)
// shows it did not land; its channels are offered again and claimed, once on chain: the seller is paid exactly
// what was accepted, by one claim transaction and one settle.
func TestAClaimCutBeforeTheFacilitatorMadeItIsClaimedAgainOnceLookedUp(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	store, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	const probeAfter = time.Second
	rb := w.server(t, store, probeAfter)
	for n := int64(1); n <= 3; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	w.dropClaims.Store(1)
	if err := rb.ClaimNow(context.Background()); err == nil || !strings.Contains(err.Error(), "no answer") {
		t.Fatalf("the claim cut before it was made: %v; want an error saying no answer came", err)
	}
	if err := rb.ClaimNow(context.Background()); err != nil || w.claims.Load() != 1 {
		t.Fatalf("a pass before the look-up is due: %v, %d claims; want nothing sent again", err, w.claims.Load())
	}
	time.Sleep(probeAfter)
	// Looked up: not landed, freed, and claimed again in the same pass (not left to the next one).
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 3*remotePrice {
		t.Fatalf("after the pass that looked the claim up the seller holds %d; want %d", got, 3*remotePrice)
	}
	if got := w.claims.Load(); got != 2 {
		t.Errorf("%d claims reached the facilitator; want 2: the one cut and the one made", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 2 {
		t.Errorf("the facilitator sent %d transactions; want 2: one claim and the settle", sent)
	}
}

// TestAReceiverWhoseSettleFailedAfterItsClaimIsSettledAtTheNextPass: the claim lands and the settle of the
// receiver that follows is cut: the seller's money is claimed in the escrow. The next pass, with nothing new to
// claim, settles the receiver: the seller is paid exactly what was accepted, by one claim and one settle.
func TestAReceiverWhoseSettleFailedAfterItsClaimIsSettledAtTheNextPass(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	rb := w.server(t, journal.NewMemory(journal.Options{}), time.Hour)
	for n := int64(1); n <= 2; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	w.dropSettles.Store(1)
	if err := rb.ClaimNow(context.Background()); err == nil || !strings.Contains(err.Error(), "settling") {
		t.Fatalf("the pass whose settle was cut: %v; want an error saying settling the receiver failed", err)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 0 {
		t.Fatalf("the seller holds %d with its settle cut; want 0 (claimed in the escrow)", got)
	}
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 2*remotePrice {
		t.Fatalf("after the next pass the seller holds %d; want %d", got, 2*remotePrice)
	}
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.claims.Load(); got != 1 {
		t.Errorf("%d claims reached the facilitator; want 1", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 2 {
		t.Errorf("the facilitator sent %d transactions; want 2: one claim and one settle", sent)
	}
}

// TestAReceiverWhoseSettleFailedAfterItsClaimIsSettledByTheNextStartAfterACrash: the claim lands and the settle
// of the receiver that follows is cut; the gateway then dies (no last pass) with the seller's money claimed in the
// escrow. The next start, on the same journal (bbolt, PostgreSQL), settles the receiver by itself: the seller is
// paid exactly what was claimed, by one settle transaction; a start after that asks the facilitator nothing and
// sends nothing.
func TestAReceiverWhoseSettleFailedAfterItsClaimIsSettledByTheNextStartAfterACrash(t *testing.T) {
	t.Run("bbolt", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "journal.db")
		testOwedSettleAcrossACrash(t, func() journal.Store {
			store, err := journal.OpenBolt(path, journal.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return store
		})
	})
	t.Run("PostgreSQL", func(t *testing.T) {
		pgtest.Need(t)
		dsn := pgtest.Shared(t)
		testOwedSettleAcrossACrash(t, func() journal.Store {
			store, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return store
		})
	})
}

func testOwedSettleAcrossACrash(t *testing.T, open func() journal.Store) {
	w := newRemoteWorld(t, 10*remotePrice)
	store := open()
	rb := w.server(t, store, time.Hour)
	for n := int64(1); n <= 3; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	w.dropSettles.Store(1)
	if err := rb.ClaimNow(context.Background()); err == nil || !strings.Contains(err.Error(), "settling") {
		t.Fatalf("the pass whose settle was cut: %v; want an error saying settling the receiver failed", err)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 0 {
		t.Fatalf("the seller holds %d with its settle cut; want 0 (claimed in the escrow)", got)
	}
	store.Close() // the gateway dies: rb is never closed, its claimer makes no last pass

	sentBefore := w.c.TxCount(w.c.Wallets[0].Address)
	store = open()
	rb = w.server(t, store, time.Hour)
	rb.Start()
	w.waitForSeller(t, 3*remotePrice)
	if err := rb.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	store.Close()
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 1 {
		t.Errorf("the start after the crash had the facilitator send %d transactions; want 1: the settle", sent)
	}

	settles, sentBefore := w.settles.Load(), w.c.TxCount(w.c.Wallets[0].Address)
	store = open()
	defer store.Close()
	rb = w.server(t, store, time.Hour)
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.settles.Load() - settles; got != 0 {
		t.Errorf("the start after the settle asked the facilitator for %d settles; want none", got)
	}
	if sent := w.c.TxCount(w.c.Wallets[0].Address) - sentBefore; sent != 0 {
		t.Errorf("the start after the settle had the facilitator send %d transactions; want none", sent)
	}
	if got := w.c.BalanceOf(w.token, w.receiver).Int64(); got != 3*remotePrice {
		t.Errorf("the seller holds %d; want exactly %d", got, 3*remotePrice)
	}
	if got := w.claims.Load(); got != 1 {
		t.Errorf("%d claims reached the facilitator; want 1", got)
	}
	if n, err := store.Backlog(context.Background()); err != nil || n != 0 {
		t.Errorf("the journal holds %d records not final (%v); want none: the settle owed was deleted once paid", n, err)
	}
}

// refund is the payer's refund request of what is left, naming its last voucher at n prices.
func (w *remoteWorld) refund(n int64) x402.BatchRequest {
	req := w.voucher(n)
	req.PaymentPayload.Payload.Type = x402.BatchRefund
	return req
}

// TestARefundThroughARemoteFacilitatorClaimsTheLastVoucherAndReturnsTheRest: the channel holds 10 prices and 3
// vouchers were accepted; the payer's refund naming its last voucher is sent through the facilitator's /settle
// refund action with the claim of that voucher: the payer gets exactly the 7 prices left, the seller the 3
// (settled after), the escrow keeps nothing of the channel, no claim is sent besides, and the refund presented
// again is refused with nothing left to refund. A refund naming an earlier voucher is refused before any call.
func TestARefundThroughARemoteFacilitatorClaimsTheLastVoucherAndReturnsTheRest(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	store, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	rb := w.server(t, store, time.Hour)
	for n := int64(1); n <= 3; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	payerBefore, escrowBefore := w.c.BalanceOf(w.token, w.payer.Address), w.c.BalanceOf(w.token, contracts.BatchSettlementAddress)
	if resp, err := rb.SettleBatch(context.Background(), w.refund(2)); err != nil || resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Fatalf("a refund naming the voucher at 2 of 3 prices: %+v (%v); want %s", resp, err, x402.ReasonBatchCumulativeAmountMismatch)
	}
	resp, err := rb.SettleBatch(context.Background(), w.refund(3))
	if err != nil || !resp.Success || resp.Transaction == "" {
		t.Fatalf("the refund: %+v (%v); want it made", resp, err)
	}
	if got := new(big.Int).Sub(w.c.BalanceOf(w.token, w.payer.Address), payerBefore); got.Int64() != 7*remotePrice {
		t.Errorf("the payer got %s back; want the 7 prices left, %d", got, 7*remotePrice)
	}
	if got := new(big.Int).Sub(escrowBefore, w.c.BalanceOf(w.token, contracts.BatchSettlementAddress)); got.Int64() != 10*remotePrice {
		t.Errorf("the escrow gave out %s; want the whole deposit, %d", got, 10*remotePrice)
	}
	w.waitForSeller(t, 3*remotePrice)
	if err := rb.ClaimNow(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := w.claims.Load(); got != 0 {
		t.Errorf("%d claims were sent; want none, the refund claimed the vouchers", got)
	}
	if resp, err := rb.SettleBatch(context.Background(), w.refund(3)); err != nil || resp.Success {
		t.Fatalf("the refund presented again: %+v (%v); want it refused", resp, err)
	}
}

// TestTheLastVoucherPresentedAgainOnceItsRecordWasPrunedIsRefusedAsUsed: a journal no engine prunes keeps a
// voucher's answer as long as the gates keep final records (gate.RecordsKept). The channel's row still stands at
// its last voucher when that record is gone; presented again then, the voucher is refused as used, not taken for
// one whose record a crash lost and answered (and served) again.
func TestTheLastVoucherPresentedAgainOnceItsRecordWasPrunedIsRefusedAsUsed(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	store, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	var skew atomic.Int64
	rb, err := chain.NewRemoteBatch(chain.RemoteBatchConfig{Remote: w.client, Supported: w.client.Supported, Journal: store,
		Networks: []string{w.rq.Network}, ClaimEvery: 1_000_000, ClaimAfter: time.Hour, Retention: gate.RecordsKept,
		Now: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }})
	if err != nil {
		t.Fatal(err)
	}
	for n := int64(1); n <= 2; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	last := chain.BatchVoucherID(w.rq.Network, w.id, big.NewInt(2*remotePrice))
	if err := store.MarkServed(context.Background(), last, time.Now()); err != nil {
		t.Fatal(err)
	}
	// The gates' pruning, past RecordsKept.
	skew.Store(int64(gate.RecordsKept + time.Minute))
	if n, err := store.Prune(context.Background(), time.Now().Add(time.Minute)); err != nil || n == 0 {
		t.Fatalf("pruning: %d records (%v)", n, err)
	}
	resp := w.settle(t, rb, 2)
	if resp.Success || resp.ErrorReason != x402.ReasonPaymentAlreadyUsed {
		t.Fatalf("the last voucher presented again once its record was pruned: %+v; want %s", resp, x402.ReasonPaymentAlreadyUsed)
	}
}

// TestAnEarlierVoucherAcceptedThroughARemoteFacilitatorIsAnsweredFromItsRecordAfterTheNext: the gate's row keeps
// only its channel's last voucher; an earlier one it accepted, whose response was not delivered, presented again
// after the next was accepted, is answered from its record (charged once, at its own amount) until it is served,
// then refused. An amount below the row's that was never accepted is refused.
func TestAnEarlierVoucherAcceptedThroughARemoteFacilitatorIsAnsweredFromItsRecordAfterTheNext(t *testing.T) {
	w := newRemoteWorld(t, 10*remotePrice)
	store := journal.NewMemory(journal.Options{})
	rb := w.server(t, store, 0)
	for n := int64(1); n <= 2; n++ {
		if resp := w.settle(t, rb, n); !resp.Success {
			t.Fatalf("the voucher at %d prices: %+v", n, resp)
		}
	}
	resp := w.settle(t, rb, 1)
	if !resp.Success || resp.Extra == nil || resp.Extra.ChannelState == nil || resp.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(remotePrice) {
		t.Fatalf("the first voucher presented again after the second: %+v; want its answer at %d", resp, remotePrice)
	}
	if err := store.MarkServed(context.Background(), chain.BatchVoucherID(w.rq.Network, w.id, big.NewInt(remotePrice)), time.Now()); err != nil {
		t.Fatal(err)
	}
	if resp := w.settle(t, rb, 1); resp.Success {
		t.Fatalf("the first voucher once served: %+v; want a refusal", resp)
	}
	if resp := w.settle(t, rb, 3); !resp.Success || resp.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(3*remotePrice) {
		t.Fatalf("the third voucher: %+v; want it accepted at %d: nothing more was charged", resp, 3*remotePrice)
	}
	other := w.voucher(1)
	sig := w.c.SignVoucher(w.payer, w.id, big.NewInt(remotePrice+1))
	other.PaymentPayload.Payload.Voucher.MaxClaimableAmount, other.PaymentPayload.Payload.Voucher.Signature = fmt.Sprint(remotePrice+1), hexutil.Encode(sig)
	if resp, err := rb.SettleBatch(context.Background(), other); err != nil || resp.Success {
		t.Fatalf("a voucher below the channel's amount that was never accepted: %+v, %v; want a refusal", resp, err)
	}
}
