package chain_test

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"math/big"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchPrice is the price of one request of the batch routes below.
const batchPrice = 1000

// batchRoute is an engine on a simulated chain with the batch-settlement escrow in its genesis, a route paid by
// voucher, and one payer's channel to it, funded on chain. The engine's clock is chain time.
type batchRoute struct {
	fx                          *fixture
	c                           *chaintest.Chain
	token                       common.Address
	payer, receiver, authorizer *chaintest.Account
	rq                          x402.BatchRequirements
	cfg                         contracts.ChannelConfig
	id                          common.Hash
}

func newBatchRoute(t *testing.T, o fixtureOpts) *batchRoute {
	t.Helper()
	if o.autoCommit == 0 {
		o.autoCommit = -1 // the tests commit by hand, unless the engine is to send
	}
	configure := o.configure
	var c *chaintest.Chain
	o.configure = func(cfg *chain.Config) {
		cfg.Now = func() time.Time { return time.Unix(int64(c.HeadTime()), 0) }
		if configure != nil {
			configure(cfg)
		}
	}
	tune := o.tune
	var token common.Address
	o.tune = func(fx *fixture, nc *chain.NetworkConfig) {
		c = fx.c
		// The route's token is an ERC-3009 one, which the engine settles deposits in.
		token = c.DeployUSDCoin(big.NewInt(1_000_000_000))
		nc.Assets = append(nc.Assets, chain.AssetConfig{Address: token, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6})
		if tune != nil {
			tune(fx, nc)
		}
	}
	fx := newFixture(t, o)
	b := &batchRoute{fx: fx, c: fx.c, token: token, payer: fx.c.Payers[0],
		receiver: chaintest.DeriveAccount("merchant", 0), authorizer: chaintest.DeriveAccount("authorizer", 0)}
	b.rq = b.route(b.receiver)
	b.cfg = contracts.ChannelConfig{Payer: b.payer.Address, PayerAuthorizer: b.payer.Address, Receiver: b.receiver.Address,
		ReceiverAuthorizer: b.authorizer.Address, Token: b.token, WithdrawDelay: contracts.MinWithdrawDelay}
	// A salt of its own: tests share a PostgreSQL database, and every simulated chain has one id.
	b.cfg.Salt = common.BigToHash(chaintest.RandomNonce())
	b.id = chaintest.ChannelID(b.c.ChainID, b.cfg)
	return b
}

// route is the batch-settlement requirement of a route paid to receiver.
func (b *batchRoute) route(receiver *chaintest.Account) x402.BatchRequirements {
	return x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: b.fx.net, Amount: fmt.Sprint(batchPrice),
		Asset: b.token.Hex(), PayTo: receiver.Address.Hex(), MaxTimeoutSeconds: 300,
		Extra: x402.BatchExtra{ReceiverAuthorizer: b.authorizer.Address.Hex(), WithdrawDelay: contracts.MinWithdrawDelay,
			Name: contracts.USDCoinName, Version: contracts.USDCoinVersion}}
}

// escrow sends calldata to the escrow from sender (the deployer, who is no settlement wallet), mined.
func (b *batchRoute) escrow(t *testing.T, sender *chaintest.Account, data []byte, what string) {
	t.Helper()
	if _, err := b.c.Transact(context.Background(), sender, contracts.BatchSettlementAddress, data); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// deposit funds the channel with amount on chain, as any facilitator's deposit would.
func (b *batchRoute) deposit(t *testing.T, amount int64) {
	t.Helper()
	salt := chaintest.RandomNonce()
	validBefore := new(big.Int).SetUint64(b.c.HeadTime() + 3600)
	nonce := contracts.ERC3009DepositNonce(b.id, common.BigToHash(salt))
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, b.c.ChainID,
		b.token, b.payer.Address, big.NewInt(amount), big.NewInt(0), validBefore, nonce))
	collectorData, err := contracts.EncodeERC3009CollectorData(big.NewInt(0), validBefore, salt, sig)
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.PackBatchDeposit(b.cfg, big.NewInt(amount), contracts.ERC3009DepositCollectorAddress, collectorData)
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.c.Deployer, data, "depositing")
}

// depositRequest is the batch request of the payer's deposit of amount, with its voucher for the first request.
func (b *batchRoute) depositRequest(t *testing.T, amount int64) x402.BatchRequest {
	t.Helper()
	salt := common.BigToHash(chaintest.RandomNonce())
	validBefore := new(big.Int).SetUint64(b.c.HeadTime() + 240)
	nonce := contracts.ERC3009DepositNonce(b.id, salt)
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, b.c.ChainID,
		b.token, b.payer.Address, big.NewInt(amount), big.NewInt(0), validBefore, nonce))
	req := b.voucher(b.rq, batchPrice)
	pl := &req.PaymentPayload.Payload
	pl.Type = x402.BatchDeposit
	pl.Deposit = &x402.BatchDepositFields{Amount: fmt.Sprint(amount), Authorization: x402.BatchDepositAuthorization{
		ERC3009Authorization: &x402.BatchERC3009Authorization{ValidAfter: "0", ValidBefore: validBefore.String(), Salt: salt.Hex(), Signature: hexutil.Encode(sig)}}}
	return req
}

// channelOnChain is the channel's balance and total claimed in the escrow.
func (b *batchRoute) channelOnChain(t *testing.T) (balance, claimed int64) {
	t.Helper()
	data, err := contracts.PackBatchSettlement("channels", b.id)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := b.c.Call(context.Background(), b.c.Deployer.Address, contracts.BatchSettlementAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := contracts.BatchSettlementABI.Unpack("channels", raw)
	if err != nil {
		t.Fatal(err)
	}
	return out[0].(*big.Int).Int64(), out[1].(*big.Int).Int64()
}

// voucher is the batch request of the payer's voucher for cumulative, to route rq.
func (b *batchRoute) voucher(rq x402.BatchRequirements, cumulative int64) x402.BatchRequest {
	sig := b.c.SignVoucher(b.payer, b.id, big.NewInt(cumulative))
	wire := &x402.ChannelConfig{Payer: b.cfg.Payer.Hex(), PayerAuthorizer: b.cfg.PayerAuthorizer.Hex(), Receiver: b.cfg.Receiver.Hex(),
		ReceiverAuthorizer: b.cfg.ReceiverAuthorizer.Hex(), Token: b.cfg.Token.Hex(), WithdrawDelay: int64(b.cfg.WithdrawDelay),
		Salt: hexutil.Encode(b.cfg.Salt[:])}
	p := x402.BatchPayment{X402Version: 2, Accepted: rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: wire,
		Voucher: &x402.BatchVoucherFields{ChannelID: b.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative), Signature: hexutil.Encode(sig)}}}
	return x402.BatchRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: rq}
}

// row is the journal's row of the channel.
func (b *batchRoute) row(t *testing.T, j journal.Store) journal.Channel {
	t.Helper()
	row, ok, err := j.(journal.Channels).Channel(context.Background(), journal.ChannelKey{Network: b.fx.net,
		Escrow: contracts.BatchSettlementAddress.Hex(), ID: b.id.Hex()})
	if err != nil || !ok {
		t.Fatalf("reading the channel's row: ok %v, %v", ok, err)
	}
	return row
}

func settleBatch(t *testing.T, f *chain.Facilitator, req x402.BatchRequest) x402.BatchSettleResponse {
	t.Helper()
	resp, err := f.SettleBatch(context.Background(), req)
	if err != nil {
		t.Fatalf("settling: %v", err)
	}
	return resp
}

func boltJournal(t *testing.T) journal.Store {
	t.Helper()
	st, err := journal.OpenBolt(filepath.Join(t.TempDir(), "journal.db"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// rpcCounter counts the engine's calls to the chain.
type rpcCounter struct {
	chain.Backend
	calls atomic.Int64
}

func (b *rpcCounter) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	b.calls.Add(1)
	return b.Backend.CallContract(ctx, msg, block)
}

func (b *rpcCounter) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	b.calls.Add(1)
	return b.Backend.HeaderByNumber(ctx, n)
}

func (b *rpcCounter) CodeAt(ctx context.Context, a common.Address, n *big.Int) ([]byte, error) {
	b.calls.Add(1)
	return b.Backend.CodeAt(ctx, a, n)
}

func TestBatchVouchersAreAcceptedOffChainEachOnceAndAnsweredByTheirCommitment(t *testing.T) {
	var rpc *rpcCounter
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), tune: func(_ *fixture, nc *chain.NetworkConfig) {
		rpc = &rpcCounter{Backend: nc.Backend}
		nc.Backend = rpc
	}})
	b.deposit(t, 200*batchPrice)
	head := b.c.HeadNumber()
	for i := int64(1); i <= 200; i++ {
		if i == 2 {
			rpc.calls.Store(0) // the first voucher read the channel; the rest read nothing
		}
		req := b.voucher(b.rq, i*batchPrice)
		if v, err := b.fx.f.VerifyBatch(context.Background(), req); err != nil || !v.IsValid {
			t.Fatalf("voucher %d: verify %+v, %v", i, v, err)
		}
		resp := settleBatch(t, b.fx.f, req)
		want := fmt.Sprintf("%s@%d", hexutil.Encode(b.id[:]), i*batchPrice)
		if !resp.Success || resp.Commitment() != want || resp.Amount != fmt.Sprint(batchPrice) || resp.Transaction != "" {
			t.Fatalf("voucher %d: %+v (commitment %q), want success naming %s, charged %d, no transaction", i, resp, resp.Commitment(), want, batchPrice)
		}
	}
	row := b.row(t, b.fx.journal)
	if row.Charged.Int64() != 200*batchPrice || row.Vouchers != 200 {
		t.Fatalf("row charged %s by %d vouchers, want %d by 200", row.Charged, row.Vouchers, 200*batchPrice)
	}
	if got := b.c.HeadNumber(); got != head {
		t.Fatalf("the chain moved from block %d to %d: vouchers send nothing", head, got)
	}
	if n := rpc.calls.Load(); n != 0 {
		t.Fatalf("199 vouchers on a fresh channel read made %d calls to the chain, want none", n)
	}
	// The 201st is above the deposit.
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 201*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeExceedsBalance {
		t.Fatalf("a voucher above the deposit: %+v", resp)
	}
}

func TestBatchVoucherPresentedAgainAfterItsResponseWasLostIsServedOnceNotChargedTwice(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t)})
	b.deposit(t, 10*batchPrice)
	first := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice))
	if !first.Success {
		t.Fatalf("first voucher: %+v", first)
	}
	// Its response never got out: presented again, it is answered as before and charged nothing more.
	again := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice))
	if !again.Success || again.Commitment() != first.Commitment() || again.Amount != first.Amount {
		t.Fatalf("presented again before its response was delivered: %+v, want %+v", again, first)
	}
	if v, err := b.fx.f.VerifyBatch(context.Background(), b.voucher(b.rq, batchPrice)); err != nil || !v.IsValid {
		t.Fatalf("verify of the voucher presented again: %+v, %v", v, err)
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != batchPrice || row.Vouchers != 1 {
		t.Fatalf("row charged %s by %d vouchers, want %d by 1", row.Charged, row.Vouchers, batchPrice)
	}
	// The gate delivered it: the voucher is spent.
	if err := b.fx.journal.MarkServed(context.Background(), chain.BatchVoucherID(b.fx.net, b.id, big.NewInt(batchPrice)), time.Now()); err != nil {
		t.Fatal(err)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonPaymentAlreadyUsed {
		t.Fatalf("presented again after its response was delivered: %+v, want %s", resp, x402.ReasonPaymentAlreadyUsed)
	}
	if v, _ := b.fx.f.VerifyBatch(context.Background(), b.voucher(b.rq, batchPrice)); v.IsValid || v.InvalidReason != x402.ReasonPaymentAlreadyUsed {
		t.Fatalf("verify after delivery: %+v", v)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 2*batchPrice)); !resp.Success || resp.Amount != fmt.Sprint(batchPrice) {
		t.Fatalf("the next voucher: %+v", resp)
	}
}

func TestBatchVoucherRefusals(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t)})
	b.deposit(t, 5*batchPrice)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice)); !resp.Success {
		t.Fatalf("first voucher: %+v", resp)
	}
	other := b.route(chaintest.DeriveAccount("other merchant", 0))
	for _, tc := range []struct {
		name   string
		req    x402.BatchRequest
		reason string
	}{
		{"below the last accepted", b.voucher(b.rq, batchPrice/2), x402.ReasonBatchCumulativeAmountMismatch},
		{"a step of two prices", b.voucher(b.rq, 3*batchPrice), x402.ReasonBatchCumulativeAmountMismatch},
		{"above the deposit", b.voucher(b.rq, 6*batchPrice), x402.ReasonBatchCumulativeExceedsBalance},
		{"another receiver's route", b.voucher(other, 2*batchPrice), x402.ReasonBatchReceiverMismatch},
		{"the accepted voucher at another receiver's route", b.voucher(other, batchPrice), x402.ReasonBatchReceiverMismatch},
		{"naming another channel", func() x402.BatchRequest {
			req := b.voucher(b.rq, 2*batchPrice)
			req.PaymentPayload.Payload.Voucher.ChannelID = hexutil.Encode(common.BigToHash(big.NewInt(7)).Bytes())
			return req
		}(), x402.ReasonBatchChannelIDMismatch},
		{"signed by another key", func() x402.BatchRequest {
			req := b.voucher(b.rq, 2*batchPrice)
			req.PaymentPayload.Payload.Voucher.Signature = hexutil.Encode(b.c.SignVoucher(b.c.Payers[1], b.id, big.NewInt(2*batchPrice)))
			return req
		}(), x402.ReasonBatchInvalidVoucherSignature},
	} {
		resp := settleBatch(t, b.fx.f, tc.req)
		if resp.Success || resp.ErrorReason != tc.reason {
			t.Errorf("%s: %+v, want %s", tc.name, resp, tc.reason)
		}
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != batchPrice || row.Vouchers != 1 {
		t.Fatalf("refusals changed the row: charged %s by %d vouchers", row.Charged, row.Vouchers)
	}
}

func TestBatchVoucherAfterAStaleReadSeesAWithdrawalAskedForSince(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t)})
	b.deposit(t, 5*batchPrice)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice)); !resp.Success {
		t.Fatalf("first voucher: %+v", resp)
	}
	// The payer asks to withdraw everything just after the engine's read, and waits until the read no longer
	// vouches for the deposit: a voucher then must not be judged by the old read.
	data, err := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(5*batchPrice))
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.payer, data, "initiating the withdrawal")
	b.c.AdjustTime(11 * time.Minute)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 2*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeExceedsBalance {
		t.Fatalf("a voucher after a withdrawal of all the deposit, read stale: %+v", resp)
	}
	if row := b.row(t, b.fx.journal); row.WithdrawRequestedAt.IsZero() || row.Charged.Int64() != batchPrice {
		t.Fatalf("the row after the re-read: %+v", row)
	}
	// Finalized, the channel is empty.
	b.c.AdjustTime(5 * time.Minute)
	data, err = contracts.PackFinalizeWithdraw(b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.payer, data, "finalizing the withdrawal")
	b.c.AdjustTime(11 * time.Minute)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 2*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonBatchChannelNotFound {
		t.Fatalf("a voucher of a withdrawn channel: %+v, want %s", resp, x402.ReasonBatchChannelNotFound)
	}
}

func TestBatchTwoEnginesOnOnePostgresAcceptEachStepOnceAndNeverAboveTheDeposit(t *testing.T) {
	dsn := pgtest.Shared(t)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn)})
	b.deposit(t, 10*batchPrice)
	second, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{{Network: b.fx.net, Backend: b.c.EthClient,
		Assets: []chain.AssetConfig{{Address: b.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}}, Keys: []*ecdsa.PrivateKey{b.c.Wallets[0].Key}}},
		Journal: openPostgres(t, dsn), Now: func() time.Time { return time.Unix(int64(b.c.HeadTime()), 0) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { second.Close() })
	engines := []*chain.Facilitator{b.fx.f, second}
	// Both engines are given every voucher of the channel, 1 to 12, at once: 10 fit the deposit.
	var mu sync.Mutex
	charged := map[string]int{}
	var wg sync.WaitGroup
	for _, f := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int64(1); i <= 12; i++ {
				resp, err := f.SettleBatch(context.Background(), b.voucher(b.rq, i*batchPrice))
				if err != nil {
					t.Error(err)
					return
				}
				if resp.Success {
					mu.Lock()
					charged[resp.Commitment()]++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	row := b.row(t, b.fx.journal)
	if row.Charged.Int64() != 10*batchPrice || row.Vouchers != 10 {
		t.Fatalf("row charged %s by %d vouchers, want %d by 10", row.Charged, row.Vouchers, 10*batchPrice)
	}
	for i := int64(1); i <= 12; i++ {
		key := fmt.Sprintf("%s@%d", hexutil.Encode(b.id[:]), i*batchPrice)
		if i > 10 && charged[key] != 0 {
			t.Errorf("voucher %d above the deposit answered success %d times", i, charged[key])
		}
	}
}

func openPostgres(t *testing.T, dsn string) journal.Store {
	t.Helper()
	st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func TestBatchDepositIsSentOnceThroughTheEngineAndItsVoucherAccepted(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second})
	const amount = 50 * batchPrice
	before := b.c.BalanceOf(b.token, b.payer.Address).Int64()
	req := b.depositRequest(t, amount)
	if v, err := b.fx.f.VerifyBatch(context.Background(), req); err != nil || !v.IsValid {
		t.Fatalf("verify of the deposit: %+v, %v", v, err)
	}
	resp := settleBatch(t, b.fx.f, req)
	want := fmt.Sprintf("%s@%d", hexutil.Encode(b.id[:]), batchPrice)
	if !resp.Success || resp.Transaction == "" || resp.Commitment() != want || resp.Amount != fmt.Sprint(batchPrice) {
		t.Fatalf("settle of the deposit: %+v (commitment %q), want success with its transaction, committing %s", resp, resp.Commitment(), want)
	}
	if bal, _ := b.channelOnChain(t); bal != amount {
		t.Fatalf("the channel holds %d on chain, want %d", bal, amount)
	}
	if got := b.c.BalanceOf(b.token, b.payer.Address).Int64(); got != before-amount {
		t.Fatalf("the payer holds %d, want %d", got, before-amount)
	}
	row := b.row(t, b.fx.journal)
	if row.Deposit.Int64() != amount || row.Charged.Int64() != batchPrice || row.Vouchers != 1 {
		t.Fatalf("row: deposit %s, charged %s by %d vouchers; want %d, %d by 1", row.Deposit, row.Charged, row.Vouchers, amount, batchPrice)
	}
	// Its answer lost, the deposit is presented again: the same transaction, nothing sent, nothing charged.
	again := settleBatch(t, b.fx.f, req)
	if !again.Success || again.Transaction != resp.Transaction || again.Commitment() != want {
		t.Fatalf("the deposit presented again: %+v, want %+v", again, resp)
	}
	if bal, _ := b.channelOnChain(t); bal != amount {
		t.Fatalf("the channel holds %d on chain after the deposit was presented again, want %d", bal, amount)
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != batchPrice || row.Vouchers != 1 {
		t.Fatalf("row after the deposit was presented again: charged %s by %d vouchers", row.Charged, row.Vouchers)
	}
	// Vouchers follow, off chain.
	for i := int64(2); i <= 5; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
}

func TestBatchDepositRefusedBeforeAnythingIsSent(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second})
	head := b.c.HeadNumber()
	for _, tc := range []struct {
		name   string
		req    func() x402.BatchRequest
		reason string
	}{
		{"more than the payer holds", func() x402.BatchRequest { return b.depositRequest(t, 2_000_000_000) }, x402.ReasonBatchInsufficientBalance},
		{"a voucher above the deposit", func() x402.BatchRequest {
			req := b.depositRequest(t, batchPrice/2)
			return req
		}, x402.ReasonBatchCumulativeExceedsBalance},
		{"signed by another key", func() x402.BatchRequest {
			req := b.depositRequest(t, 10*batchPrice)
			a := req.PaymentPayload.Payload.Deposit.Authorization.ERC3009Authorization
			a.Signature = hexutil.Encode(b.c.SignVoucher(b.c.Payers[1], b.id, big.NewInt(1)))
			return req
		}, x402.ReasonBatchInvalidReceiveAuthorization},
	} {
		req := tc.req()
		if v, err := b.fx.f.VerifyBatch(context.Background(), req); err != nil || v.IsValid || v.InvalidReason != tc.reason {
			t.Errorf("%s: verify %+v, %v; want %s", tc.name, v, err, tc.reason)
		}
		if resp := settleBatch(t, b.fx.f, req); resp.Success || resp.ErrorReason != tc.reason || resp.Transaction != "" {
			t.Errorf("%s: settle %+v; want %s, nothing sent", tc.name, resp, tc.reason)
		}
	}
	if bal, _ := b.channelOnChain(t); bal != 0 {
		t.Fatalf("the channel holds %d after refused deposits", bal)
	}
	_ = head
}

// batchEngine starts one more engine on the route's chain and journal j, as another process would: the
// settlement wallets given, the receiver authorizer's key when claims is set (claimed only when asked).
func (b *batchRoute) engine(t *testing.T, j journal.Store, wallets []*chaintest.Account, claims bool, receiptTimeout time.Duration) *chain.Facilitator {
	t.Helper()
	nc := chain.NetworkConfig{Network: b.fx.net, Backend: b.c.EthClient, ReceiptTimeout: receiptTimeout, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: b.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6},
			{Address: b.token, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}}}
	for _, w := range wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	if claims {
		claimsWhenAsked(&nc, b.authorizer)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: j,
		Now: func() time.Time { return time.Unix(int64(b.c.HeadTime()), 0) }, ReconcileEvery: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// claimsWhenAsked gives an engine the receiver authorizer's key, with a policy that claims only when the test
// asks (ClaimBatches) or the engine closes.
func claimsWhenAsked(nc *chain.NetworkConfig, authorizer *chaintest.Account) {
	nc.BatchReceiverAuthorizer, nc.BatchClaimEvery, nc.BatchClaimAfter = authorizer.Key, 1_000_000, time.Hour
}

// sentBy is how many transactions the wallets have sent.
func (b *batchRoute) sentBy(t *testing.T, wallets []*chaintest.Account) uint64 {
	t.Helper()
	var sum uint64
	for _, w := range wallets {
		n, err := b.c.EthClient.PendingNonceAt(context.Background(), w.Address)
		if err != nil {
			t.Fatal(err)
		}
		sum += n
	}
	return sum
}

func TestBatchClaimerClaimsEveryAcceptedVoucherOnceInOneTransaction(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 300*batchPrice)
	for i := int64(1); i <= 200; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 200*batchPrice {
		t.Fatalf("the receiver holds %d after the claim, want exactly the %d accepted", got, 200*batchPrice)
	}
	if _, claimed := b.channelOnChain(t); claimed != 200*batchPrice {
		t.Fatalf("the channel's total claimed is %d on chain, want %d", claimed, 200*batchPrice)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("the claim took %d transactions, want 1", got)
	}
	if row := b.row(t, b.fx.journal); row.Claimed.Cmp(row.Charged) != 0 || row.ClaimTx != "" {
		t.Fatalf("row after the claim: claimed %s of %s, claim in flight %q", row.Claimed, row.Charged, row.ClaimTx)
	}
	// Nothing left to claim: nothing is sent, nothing paid twice.
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("a claim with nothing to claim sent %d transactions", got-1)
	}
	// Vouchers accepted since are claimed by the next claim, and only they.
	for i := int64(201); i <= 210; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 210*batchPrice {
		t.Fatalf("the receiver holds %d after the second claim, want %d", got, 210*batchPrice)
	}
}

func TestBatchClaimInFlightAcrossARestartIsClaimedOnce(t *testing.T) {
	dsn := pgtest.Shared(t)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 3})
	b.deposit(t, 100*batchPrice)
	for i := int64(1); i <= 30; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	// Another process claims; its claim is broadcast, and it is gone before the claim is mined.
	wallets := b.c.Wallets[:3] // every process is configured with the same wallets, and leases its share
	first := b.engine(t, openPostgres(t, dsn), wallets, true, 50*time.Millisecond)
	claimBatches(t, first)
	if row := b.row(t, b.fx.journal); row.ClaimTx == "" {
		t.Fatalf("the claim is not in flight: %+v", row)
	}
	b.c.Commit()
	// A new process finds the claim in flight, mined: the receiver is paid once, and nothing is claimed again.
	next := b.engine(t, openPostgres(t, dsn), wallets, true, 5*time.Second)
	claimBatches(t, next)
	b.c.Commit()
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 30*batchPrice {
		t.Fatalf("the receiver holds %d, want exactly the %d accepted", got, 30*batchPrice)
	}
	if got := b.sentBy(t, wallets); got != 1 {
		t.Fatalf("the claimers sent %d transactions, want 1", got)
	}
	if row := b.row(t, b.fx.journal); row.Claimed.Int64() != 30*batchPrice || row.ClaimTx != "" {
		t.Fatalf("row: claimed %s, claim in flight %q", row.Claimed, row.ClaimTx)
	}
}

// claimBatches asks f to claim, while the wallets' leases settle between the processes sharing the journal.
func claimBatches(t *testing.T, f *chain.Facilitator) {
	t.Helper()
	var err error
	for range 20 {
		if err = f.ClaimBatches(context.Background()); err == nil || !strings.Contains(err.Error(), x402.MessageNoAvailableWallets) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// acceptAsACrashedEngine takes the channel's step to cumulative as an engine would that crashed right after its
// compare-and-set, before the voucher's record was written.
func (b *batchRoute) acceptAsACrashedEngine(t *testing.T, from, cumulative int64) {
	t.Helper()
	req := b.voucher(b.rq, cumulative)
	sig, err := chain.ParseSignature(req.PaymentPayload.Payload.Voucher.Signature)
	if err != nil {
		t.Fatal(err)
	}
	digest := chain.VoucherDigest(chain.BatchDomainSeparator(b.c.ChainID), b.id, big.NewInt(cumulative))
	key := journal.ChannelKey{Network: b.fx.net, Escrow: contracts.BatchSettlementAddress.Hex(), ID: b.id.Hex()}
	if _, err := b.fx.journal.(journal.Channels).AcceptVoucher(context.Background(), key, big.NewInt(from), big.NewInt(cumulative),
		journal.Voucher{Signature: sig[:], Digest: digest[:], By: "a crashed engine"}); err != nil {
		t.Fatal(err)
	}
}

func TestBatchVoucherAcceptedByAnEngineThatCrashedBeforeItsRecordIsServedOnceThenTakenAsUsed(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), configure: func(cfg *chain.Config) { cfg.Retention = time.Hour }})
	b.deposit(t, 10*batchPrice)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice)); !resp.Success {
		t.Fatalf("first voucher: %+v", resp)
	}
	// Accepted, its answer never written nor its response sent: presented again, it is answered, charged once.
	b.acceptAsACrashedEngine(t, batchPrice, 2*batchPrice)
	resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 2*batchPrice))
	if !resp.Success || resp.Amount != fmt.Sprint(batchPrice) || resp.Commitment() != fmt.Sprintf("%s@%d", hexutil.Encode(b.id[:]), 2*batchPrice) {
		t.Fatalf("the voucher the crashed engine accepted, presented again: %+v", resp)
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != 2*batchPrice || row.Vouchers != 2 {
		t.Fatalf("row charged %s by %d vouchers, want %d by 2", row.Charged, row.Vouchers, 2*batchPrice)
	}
	// One accepted so long ago that its record would be pruned by now is taken as used, never served again.
	b.acceptAsACrashedEngine(t, 2*batchPrice, 3*batchPrice)
	b.c.AdjustTime(2 * time.Hour)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 3*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonPaymentAlreadyUsed {
		t.Fatalf("a voucher accepted past the retention, presented again: %+v, want %s", resp, x402.ReasonPaymentAlreadyUsed)
	}
}

func TestBatchDepositRecordStillReadsAsASettlementAfterItsAuthorizationExpired(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second})
	req := b.depositRequest(t, 10*batchPrice)
	if resp := settleBatch(t, b.fx.f, req); !resp.Success {
		t.Fatalf("the deposit: %+v", resp)
	}
	a := req.PaymentPayload.Payload.Deposit.Authorization.ERC3009Authorization
	id := journal.PaymentID(b.fx.net, x402.TransferEIP3009, b.token.Hex(), b.payer.Address.Hex(),
		contracts.ERC3009DepositNonce(b.id, common.HexToHash(a.Salt)).Hex())
	rec, ok, err := b.fx.journal.Get(context.Background(), id)
	if err != nil || !ok || rec.TxHash == "" {
		t.Fatalf("the deposit's record: %+v, %v, %v", rec, ok, err)
	}
	// Reconciliation reads a record back long after the payer's window closed (a restart, a takeover): it must
	// still be this engine's settlement, or a broadcast deposit would be left unfinished.
	b.c.AdjustTime(10 * time.Minute)
	got, refused, err := b.fx.f.RecordedPaymentIDForTest(rec.Request)
	if err != nil || refused != "" || got != id {
		t.Fatalf("the deposit's record read back after its validBefore: id %s, refused %q, %v; want %s", got, refused, err, id)
	}
}

// ofPayer is the route with payer i's channel in place of the first payer's.
func (b *batchRoute) ofPayer(i int) *batchRoute {
	o := *b
	o.payer = b.c.Payers[i]
	o.cfg.Payer, o.cfg.PayerAuthorizer = o.payer.Address, o.payer.Address
	o.id = chaintest.ChannelID(b.c.ChainID, o.cfg)
	return &o
}

func TestBatchClaimLeavesOutAChannelWhoseClaimWouldRevertAndClaimsTheOthers(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	gone := b.ofPayer(1)
	for _, r := range []*batchRoute{b, gone} {
		r.deposit(t, 5*batchPrice)
		for i := int64(1); i <= 3; i++ {
			if resp := settleBatch(t, b.fx.f, r.voucher(r.rq, i*batchPrice)); !resp.Success {
				t.Fatalf("voucher %d: %+v", i, resp)
			}
		}
	}
	// The second payer withdraws everything before any claim lands: its vouchers can no longer be claimed.
	data, err := contracts.PackInitiateWithdraw(gone.cfg, big.NewInt(5*batchPrice))
	if err != nil {
		t.Fatal(err)
	}
	gone.escrow(t, gone.payer, data, "initiating the withdrawal")
	b.c.AdjustTime(16 * time.Minute)
	if data, err = contracts.PackFinalizeWithdraw(gone.cfg); err != nil {
		t.Fatal(err)
	}
	gone.escrow(t, gone.payer, data, "finalizing the withdrawal")
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.c.BalanceOf(b.token, b.receiver.Address).Int64(); got != 3*batchPrice {
		t.Fatalf("the receiver holds %d, want the %d of the channel still claimable", got, 3*batchPrice)
	}
	if row := gone.row(t, b.fx.journal); row.ClaimTx != "" || row.Claimed.Sign() != 0 {
		t.Fatalf("the withdrawn channel's row: claimed %s, claim in flight %q", row.Claimed, row.ClaimTx)
	}
}

// An earlier voucher of a channel (below the row's amount) is answered again only for the route and resource its
// record was noted for: one settled without a note (through the facilitator's /settle, at whatever price its caller
// named) buys nothing at a gate's route, and gets the corrective refusal of any voucher below the row (found by
// review: it was answered, at its record's price).
func TestAnEarlierVoucherSettledWithoutANoteBuysNothingAtAGatesRoute(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t)})
	b.deposit(t, 10*batchPrice)
	for n := int64(1); n <= 2; n++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, n*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d without a note: %+v", n, resp)
		}
	}
	ctx := journal.WithRecordNote(context.Background(), journal.RecordNote{Route: "a route", Resource: "GET /r/a"})
	resp, err := b.fx.f.SettleBatch(ctx, b.voucher(b.rq, batchPrice))
	if err != nil || resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Fatalf("the first voucher, settled without a note, presented at a gate's route: %+v, %v; want %s", resp, err, x402.ReasonBatchCumulativeAmountMismatch)
	}
	// Noted at acceptance, it is answered again there, and nowhere else.
	noted := journal.WithRecordNote(context.Background(), journal.RecordNote{Route: "a route", Resource: "GET /r/c"})
	if resp, err := b.fx.f.SettleBatch(noted, b.voucher(b.rq, 3*batchPrice)); err != nil || !resp.Success {
		t.Fatalf("the third voucher, noted: %+v, %v", resp, err)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); !resp.Success {
		t.Fatalf("the fourth voucher: %+v", resp)
	}
	if resp, err := b.fx.f.SettleBatch(noted, b.voucher(b.rq, 3*batchPrice)); err != nil || !resp.Success || resp.Amount != fmt.Sprint(batchPrice) {
		t.Fatalf("the third voucher presented again for its resource after the fourth: %+v, %v; want its answer", resp, err)
	}
	if resp, err := b.fx.f.SettleBatch(ctx, b.voucher(b.rq, 3*batchPrice)); err != nil || resp.Success {
		t.Fatalf("the third voucher at another resource: %+v, %v; want a refusal", resp, err)
	}
}

// A claim's broadcast record that no channel's mark names any more (its process stopped between the broadcast and
// the receipt, and the channels were claimed again since) is finished by the next claim pass all the same: mined,
// it is final; its nonce mined by another transaction, it goes. Before, claim passes found claims only through the
// channels' marks, and such a record stayed in the journal's backlog for good (the money-invariant run, after a
// graceful stop).
func TestAClaimRecordNoChannelNamesIsFinishedByTheNextClaimPass(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{})
	j := journal.NewMemory(journal.Options{})
	w := b.c.Wallets[0]
	eng := b.engine(t, j, []*chaintest.Account{w}, true, time.Second)
	ctx := context.Background()
	record := func(tx *types.Transaction) journal.ID {
		t.Helper()
		raw, err := tx.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		id := chain.ClaimRecordID(b.fx.net, tx.Hash())
		if _, _, err := j.Claim(ctx, journal.Record{ID: id, State: journal.StateClaimed, Network: b.fx.net, Owner: "a process that stopped",
			Asset: contracts.BatchSettlementAddress.Hex()}); err != nil {
			t.Fatal(err)
		}
		if _, err := j.Update(ctx, id, func(r *journal.Record) error {
			r.State, r.Wallet, r.TxNonce, r.TxHash, r.RawTx = journal.StateBroadcast, w.Address.Hex(), tx.Nonce(), tx.Hash().Hex(), raw
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// A transaction of the wallet's that mined (standing for the claim), and one signed at a nonce another took.
	receipt := b.c.SendETH(w, b.receiver.Address, big.NewInt(1))
	minedTx, _, err := b.c.EthClient.TransactionByHash(ctx, receipt.TxHash)
	if err != nil {
		t.Fatal(err)
	}
	mined := record(minedTx)
	stale, err := types.SignNewTx(w.Key, types.LatestSignerForChainID(b.c.ChainID), &types.LegacyTx{Nonce: minedTx.Nonce(), GasPrice: big.NewInt(2e9), Gas: 21000, To: &b.receiver.Address, Value: big.NewInt(2)})
	if err != nil {
		t.Fatal(err)
	}
	never := record(stale)
	// Past the records' age, a claim pass: neither is named by a channel's mark.
	b.c.AdjustTime(30 * time.Second)
	b.c.Commit()
	claimBatches(t, eng)
	if rec, ok, err := j.Get(ctx, mined); err != nil || !ok || rec.State != journal.StateFinal || rec.Response == nil || !rec.Response.Success {
		t.Fatalf("the mined claim's record: %+v (found %v, %v); want final and successful", rec, ok, err)
	}
	if rec, ok, err := j.Get(ctx, never); err != nil || (ok && rec.State != journal.StateFinal) {
		t.Fatalf("the record of a claim whose nonce another transaction took: %+v (found %v, %v); want it gone", rec, ok, err)
	}
}
