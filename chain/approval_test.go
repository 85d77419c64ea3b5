package chain_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/rpc"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// approvalFixture is a facilitator that takes erc20ApprovalGasSponsoring with its default bounds.
func approvalFixture(t *testing.T) *fixture {
	return newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(3)}, tune: func(_ *fixture, nc *chain.NetworkConfig) {
		nc.ApprovalSponsoring = &chain.ApprovalSponsoring{}
	}})
}

// approvalFees are fees an approval signed now pays in the next block: a tip of 1 gwei over twice the head's
// base fee.
func (fx *fixture) approvalFees() chain.ApprovalTx {
	fx.t.Helper()
	head, err := fx.c.Client.HeaderByNumber(context.Background(), nil)
	if err != nil {
		fx.t.Fatal(err)
	}
	tip := big.NewInt(1_000_000_000)
	return chain.ApprovalTx{Gas: 70_000, TipCap: tip, FeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)}
}

// sponsoredPermit2 is a permit2 payment of payer carrying its own approval of Permit2 (first nonce, approvalFees'
// fees), and those fees.
func (fx *fixture) sponsoredPermit2(payer *chaintest.Account) (x402.VerifyRequest, chain.ApprovalTx) {
	fx.t.Helper()
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	fees := fx.approvalFees()
	if err := chain.AddApprovalSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, fees); err != nil {
		fx.t.Fatal(err)
	}
	return req, fees
}

// approvalOf is the signed approval a payment's erc20ApprovalGasSponsoring extension carries.
func approvalOf(t *testing.T, req x402.VerifyRequest) *types.Transaction {
	t.Helper()
	info, ok, err := req.PaymentPayload.ApprovalSponsoring()
	if !ok || err != nil {
		t.Fatalf("the payment carries no approval (%v)", err)
	}
	tx := new(types.Transaction)
	if err := tx.UnmarshalBinary(hexutil.MustDecode(info.SignedTransaction)); err != nil {
		t.Fatal(err)
	}
	return tx
}

func TestAPayerWithoutPermit2AllowanceOrGasPaysThroughItsSponsoredApproval(t *testing.T) {
	fx := approvalFixture(t)
	payer, wallet := fx.c.PayerNoGas, fx.c.Wallets[0].Address
	if fx.c.ETHBalance(payer.Address).Sign() != 0 || fx.c.Allowance(payer.Address, contracts.Permit2Address).Sign() != 0 {
		t.Fatal("the gas-less payer must start with no ETH and no Permit2 allowance")
	}
	sup, err := fx.f.Supported(context.Background())
	if err != nil || !slices.Contains(sup.Extensions, x402.ExtensionERC20ApprovalGasSponsoring) {
		t.Fatalf("/supported extensions = %v (%v), want %s among them", sup.Extensions, err, x402.ExtensionERC20ApprovalGasSponsoring)
	}
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	walletTxs := fx.c.TxCount(wallet) + fx.c.TxCount(fx.c.Wallets[1].Address)

	req, fees := fx.sponsoredPermit2(payer)
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify with the approval = %+v, want valid", v)
	}
	if fx.c.ETHBalance(payer.Address).Sign() != 0 || fx.f.ApprovalFunding(fx.net).Sign() != 0 {
		t.Fatal("verification funded the payer")
	}
	s := fx.settle(req)
	if !s.Success {
		t.Fatalf("settle = %+v, want success", s)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)

	// The facilitator sent the payer exactly the approval's gas limit at its fee cap, the payer's approval mined
	// (setting the allowance it signed), and the payer keeps what the gas did not use.
	approval := approvalOf(t, req)
	receipt, err := fx.c.Client.TransactionReceipt(context.Background(), approval.Hash())
	if err != nil || receipt.Status != types.ReceiptStatusSuccessful {
		t.Fatalf("the payer's approval: receipt %+v, %v; want mined and successful", receipt, err)
	}
	funded := new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap)
	if got := fx.f.ApprovalFunding(fx.net); got.Cmp(funded) != 0 {
		t.Fatalf("ApprovalFunding = %s wei, want %s (gas limit x fee cap)", got, funded)
	}
	spent := new(big.Int).Mul(new(big.Int).SetUint64(receipt.GasUsed), receipt.EffectiveGasPrice)
	if got, want := fx.c.ETHBalance(payer.Address), new(big.Int).Sub(funded, spent); got.Cmp(want) != 0 {
		t.Fatalf("payer ETH = %s, want the funding less the approval's gas, %s", got, want)
	}
	if got := fx.c.Allowance(payer.Address, contracts.Permit2Address); got.Cmp(new(big.Int).SetBytes(approval.Data()[36:68])) != 0 {
		t.Fatalf("Permit2 allowance = %s, want the max the approval set (a max allowance is never spent down)", got)
	}
	if got := fx.c.TxCount(wallet) + fx.c.TxCount(fx.c.Wallets[1].Address) - walletTxs; got != 2 {
		t.Fatalf("the settlement wallets sent %d transactions, want 2 (the payer's gas money, the settlement)", got)
	}
	if fx.c.TxCount(payer.Address) != 1 {
		t.Fatalf("the payer sent %d transactions, want 1 (its approval)", fx.c.TxCount(payer.Address))
	}

	// Presented again: answered from the journal, nothing sent or funded again.
	if again := fx.settle(req); again.Transaction != s.Transaction || !again.Success {
		t.Fatalf("settle again = %+v, want the first answer %+v", again, s)
	}
	// A second payment carrying the same approval (replayed): the allowance covers it, so the approval is not
	// sent again and nothing is funded.
	second := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	second.PaymentPayload.Extensions = req.PaymentPayload.Extensions
	if s2 := fx.settle(second); !s2.Success {
		t.Fatalf("second settle = %+v, want success", s2)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 2)
	if got := fx.f.ApprovalFunding(fx.net); got.Cmp(funded) != 0 {
		t.Fatalf("ApprovalFunding after a payment whose allowance covered = %s, want still %s", got, funded)
	}
}

// A payer whose approval's gas money arrived already (the funding mined before a crash, or another gateway sent
// it) is sent nothing more; one whose approval mined already (the settlement never sent) is settled without it.
func TestASponsoredApprovalIsNeverFundedOrSentTwice(t *testing.T) {
	fx := approvalFixture(t)
	ctx := context.Background()
	t.Run("funded already", func(t *testing.T) {
		payer := fx.c.PayersNoGas[0]
		req, fees := fx.sponsoredPermit2(payer)
		fx.c.SendETH(fx.c.Payers[2], payer.Address, new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap))
		if s := fx.settle(req); !s.Success {
			t.Fatalf("settle = %+v, want success", s)
		}
		if got := fx.f.ApprovalFunding(fx.net); got.Sign() != 0 {
			t.Fatalf("ApprovalFunding = %s, want 0: the payer had the gas money", got)
		}
	})
	t.Run("approval mined already", func(t *testing.T) {
		payer := fx.c.PayersNoGas[1]
		req, fees := fx.sponsoredPermit2(payer)
		approval := approvalOf(t, req)
		fx.c.SendETH(fx.c.Payers[2], payer.Address, new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap))
		if err := fx.c.SendSigned(ctx, approval); err != nil {
			t.Fatal(err)
		}
		fx.c.Commit()
		payerTxs := fx.c.TxCount(payer.Address)
		if s := fx.settle(req); !s.Success {
			t.Fatalf("settle = %+v, want success", s)
		}
		if fx.c.TxCount(payer.Address) != payerTxs || fx.f.ApprovalFunding(fx.net).Sign() != 0 {
			t.Fatal("the approval was sent or funded again")
		}
	})
}

// rawApproval is a signed approval transaction and the extension info that carries it, each field free to be
// made wrong.
type rawApproval struct {
	key                    *chaintest.Account
	chainID                *big.Int
	nonce, gas             uint64
	tip, feeCap            *big.Int
	to, spender            common.Address
	amount                 *big.Int
	data                   []byte // replaces the approve calldata when set
	from, asset, infoSpend common.Address
	rawHex                 string // replaces the signed transaction when set
}

func (a rawApproval) attach(t *testing.T, req *x402.VerifyRequest) {
	t.Helper()
	data := a.data
	if data == nil {
		var err error
		if data, err = contracts.StableCoinABI.Pack("approve", a.spender, a.amount); err != nil {
			t.Fatal(err)
		}
	}
	tx, err := types.SignNewTx(a.key.Key, types.LatestSignerForChainID(a.chainID), &types.DynamicFeeTx{
		ChainID: a.chainID, Nonce: a.nonce, GasTipCap: a.tip, GasFeeCap: a.feeCap, Gas: a.gas, To: &a.to, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := tx.MarshalBinary()
	hexTx := hexutil.Encode(raw)
	if a.rawHex != "" {
		hexTx = a.rawHex
	}
	ext, _ := json.Marshal(map[string]x402.ERC20ApprovalGasSponsoringInfo{"info": {
		From: a.from.Hex(), Asset: a.asset.Hex(), Spender: a.infoSpend.Hex(), Amount: a.amount.String(), SignedTransaction: hexTx, Version: "1"}})
	req.PaymentPayload.Extensions = map[string]json.RawMessage{x402.ExtensionERC20ApprovalGasSponsoring: ext}
}

// Every approval the facilitator would not pay for, or that would not give Permit2 the payment's allowance from
// the payer, is refused at verification and at settlement before anything is sent: no gas money, no approval, no
// settlement.
func TestASponsoredApprovalThatIsNotThePayersApprovalOfPermit2IsRefusedBeforeAnyGasIsSpent(t *testing.T) {
	fx := approvalFixture(t)
	payer, other := fx.c.PayersNoGas[2], fx.c.Payers[0]
	fees := fx.approvalFees()
	maxU := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	good := rawApproval{key: payer, chainID: fx.c.ChainID, gas: fees.Gas, tip: fees.TipCap, feeCap: fees.FeeCap,
		to: fx.c.Token, spender: contracts.Permit2Address, amount: maxU, from: payer.Address, asset: fx.c.Token, infoSpend: contracts.Permit2Address}
	transfer, _ := contracts.StableCoinABI.Pack("transfer", contracts.Permit2Address, maxU)
	stranger := common.HexToAddress("0x5700000000000000000000000000000000000057")
	// nearDeadline is a deadline that leaves the settlement room for one block but not for the three a sponsored
	// approval takes (the payer's gas money, its approval, then the settlement).
	nearDeadline := func() chain.Permit2Options {
		next, err := fx.f.NextBlockTime(context.Background(), fx.net)
		if err != nil {
			t.Fatal(err)
		}
		return chain.Permit2Options{Deadline: big.NewInt(next.Unix() + deadlineMargin + 1)}
	}
	cases := []struct {
		name   string
		change func(*rawApproval)
		reason string
		opts   func() chain.Permit2Options // the payment's; nil: the fixture's defaults
	}{
		{"signed by another key", func(a *rawApproval) { a.key = other }, x402.ReasonERC20ApprovalTxSignerMismatch, nil},
		{"info from another owner", func(a *rawApproval) { a.from = other.Address }, x402.ReasonERC20ApprovalFromMismatch, nil},
		{"approves another spender", func(a *rawApproval) { a.spender = stranger }, x402.ReasonERC20ApprovalTxWrongSpender, nil},
		{"info names another spender", func(a *rawApproval) { a.infoSpend = stranger }, x402.ReasonERC20ApprovalSpenderNotPermit2, nil},
		{"calls another token", func(a *rawApproval) { a.to = stranger }, x402.ReasonERC20ApprovalTxWrongTarget, nil},
		{"info names another token", func(a *rawApproval) { a.asset = stranger }, x402.ReasonERC20ApprovalAssetMismatch, nil},
		{"approves less than the payment", func(a *rawApproval) { a.amount = big.NewInt(price - 1) }, x402.ReasonERC20ApprovalTxInvalidCalldata, nil},
		{"calls transfer, not approve", func(a *rawApproval) { a.data = transfer }, x402.ReasonERC20ApprovalTxWrongSelector, nil},
		{"a stale nonce", func(a *rawApproval) { a.nonce = 7 }, x402.ReasonERC20ApprovalTxWrongNonce, nil},
		{"an oversized transaction", func(a *rawApproval) { a.rawHex = "0x" + strings.Repeat("ab", 600) }, x402.ReasonInvalidERC20ApprovalExtensionFormat, nil},
		{"not a transaction", func(a *rawApproval) { a.rawHex = "0x02c0ffee" }, x402.ReasonERC20ApprovalTxParseFailed, nil},
		{"a gas limit above the bound", func(a *rawApproval) { a.gas = 200_000 }, x402.ReasonERC20ApprovalTxFeesNotSponsored, nil},
		{"a fee cap above the bound", func(a *rawApproval) { a.feeCap = big.NewInt(11_000_000_000) }, x402.ReasonERC20ApprovalTxFeesNotSponsored, nil},
		{"a fee cap under the base fee", func(a *rawApproval) { a.feeCap, a.tip = big.NewInt(1), big.NewInt(1) }, x402.ReasonERC20ApprovalTxFeesNotSponsored, nil},
		{"another chain", func(a *rawApproval) { a.chainID = big.NewInt(1) }, x402.ReasonERC20ApprovalTxWrongChain, nil},
		// Within max_fee_per_gas (10 gwei) but several times what the approval pays on a chain of low base fee: the
		// gas money (its gas limit at its fee cap) would be mostly the payer's to keep.
		{"a fee cap far above twice the base fee and the tip", func(a *rawApproval) { a.feeCap = big.NewInt(10_000_000_000) }, x402.ReasonERC20ApprovalTxFeesNotSponsored, nil},
		{"a deadline that covers one block, not three", func(*rawApproval) {}, x402.ReasonPermit2DeadlineExpired, nearDeadline},
	}
	wallets := func() uint64 { return fx.c.TxCount(fx.c.Wallets[0].Address) + fx.c.TxCount(fx.c.Wallets[1].Address) }
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := good
			tc.change(&a)
			var opts chain.Permit2Options
			if tc.opts != nil {
				opts = tc.opts()
			}
			req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), opts)
			a.attach(t, &req)
			sent := wallets()
			if v := fx.verify(req); v.IsValid || v.InvalidReason != tc.reason {
				t.Fatalf("verify = %+v, want %s", v, tc.reason)
			}
			if s := fx.settle(req); s.Success || s.ErrorReason != tc.reason || s.Transaction != "" {
				t.Fatalf("settle = %+v, want %s with no transaction", s, tc.reason)
			}
			if wallets() != sent || fx.c.ETHBalance(payer.Address).Sign() != 0 || fx.c.TxCount(payer.Address) != 0 || fx.f.ApprovalFunding(fx.net).Sign() != 0 {
				t.Fatal("something was sent or funded")
			}
		})
	}
	// The good one settles: the table's refusals are the changes', not the fixture's.
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	good.attach(t, &req)
	if s := fx.settle(req); !s.Success {
		t.Fatalf("the unchanged approval: settle = %+v, want success", s)
	}
}

// A facilitator that does not take the extension neither declares it nor acts on it: the payer is told to
// approve Permit2.
func TestAFacilitatorWithoutApprovalSponsoringIgnoresTheApproval(t *testing.T) {
	fx := newFixture(t, fixtureOpts{})
	sup, err := fx.f.Supported(context.Background())
	if err != nil || slices.Contains(sup.Extensions, x402.ExtensionERC20ApprovalGasSponsoring) {
		t.Fatalf("/supported extensions = %v (%v), want no %s", sup.Extensions, err, x402.ExtensionERC20ApprovalGasSponsoring)
	}
	payer := fx.c.PayerNoGas
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if err := chain.AddApprovalSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, fx.approvalFees()); err != nil {
		t.Fatal(err)
	}
	if v := fx.verify(req); v.IsValid || v.InvalidReason != x402.ReasonPermit2AllowanceRequired {
		t.Fatalf("verify = %+v, want %s", v, x402.ReasonPermit2AllowanceRequired)
	}
}

// An engine that stops after sending the payer's gas money, before the approval went out (no block sealed it),
// leaves the three transactions in its journal; the engine that restarts on the journal sends the approval once
// the gas money mined, and the settlement once the approval mined: the payment settles once, by the recorded
// settlement, and the payer is funded once.
func TestASponsoredApprovalInterruptedAfterItsFundingSettlesOnceAfterARestart(t *testing.T) {
	store := journal.NewMemory(journal.Options{})
	fx := newFixture(t, fixtureOpts{journal: store, autoCommit: -1, receiptTimeout: 200 * time.Millisecond,
		chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune:      func(_ *fixture, nc *chain.NetworkConfig) { nc.ApprovalSponsoring = &chain.ApprovalSponsoring{} }})
	payer := fx.c.PayerNoGas
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	sent := fx.c.TxCount(fx.c.Wallets[0].Address) + fx.c.TxCount(fx.c.Wallets[1].Address)
	req, fees := fx.sponsoredPermit2(payer)
	s := fx.settle(req)
	if s.Success || s.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("settle with no block sealed = %+v, want settlement_pending", s)
	}
	fx.f.Close()

	again, err := chain.New(context.Background(), chain.Config{Journal: store, ReconcileEvery: 20 * time.Millisecond, ReconcileGrace: time.Millisecond,
		Networks: []chain.NetworkConfig{{
			// A minute to see the three transactions mined one after another through reconciliation: about 6 s
			// here, and past 20 s in CI's plain pass beside the e2e package (the final check of this stop).
			Network: fx.net, Backend: fx.c.EthClient, ReceiptTimeout: time.Minute, ReceiptPoll: 2 * time.Millisecond,
			Assets:             []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
			Keys:               chaintestKeys(fx.c),
			ApprovalSponsoring: &chain.ApprovalSponsoring{},
		}}})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	t.Cleanup(fx.c.AutoCommit(5 * time.Millisecond))
	final, err := again.Settle(context.Background(), req)
	if err != nil || !final.Success || final.Transaction != s.Transaction {
		t.Fatalf("after the restart the payment answered %+v, %v; want settled by the recorded %s", final, err, s.Transaction)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
	if got := fx.c.TxCount(fx.c.Wallets[0].Address) + fx.c.TxCount(fx.c.Wallets[1].Address) - sent; got != 2 {
		t.Fatalf("the settlement wallets sent %d transactions, want 2 (the gas money once, the settlement once)", got)
	}
	receipt, err := fx.c.Client.TransactionReceipt(context.Background(), approvalOf(t, req).Hash())
	if err != nil || receipt.Status != types.ReceiptStatusSuccessful {
		t.Fatalf("the payer's approval: %+v, %v; want mined and successful", receipt, err)
	}
	funded := new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap)
	spent := new(big.Int).Mul(new(big.Int).SetUint64(receipt.GasUsed), receipt.EffectiveGasPrice)
	if got, want := fx.c.ETHBalance(payer.Address), new(big.Int).Sub(funded, spent); got.Cmp(want) != 0 {
		t.Fatalf("payer ETH = %s, want one funding less the approval's gas, %s", got, want)
	}
}

// sealsBeforeSimulating is a node on which a block is sealed between the facilitator reading the head and its
// eth_simulateV1: as a busy chain's does, one block in every few.
type sealsBeforeSimulating struct {
	*ethclient.Client
	seal func()
	n    atomic.Int64
}

func (b *sealsBeforeSimulating) SimulateV1(ctx context.Context, opts ethclient.SimulateOptions, block *rpc.BlockNumberOrHash) ([]ethclient.SimulateBlockResult, error) {
	b.n.Add(1)
	b.seal()
	return b.Client.SimulateV1(ctx, opts, block)
}

// TestASponsoredApprovalIsSimulatedOnTheHeadItsNextBlockFollows: the approval and the settlement are simulated in
// the next block, whose number and time the facilitator sets from the head it read. When a block is sealed
// between that read and the simulation, a simulation based on "latest" names a block before its base, which the
// node refuses ("block numbers must be in order: 4 <= 4"): the payment was refused, nothing wrong with it
// (TestASponsoredApprovalIsNeverFundedOrSentTwice failed so now and then under load). Based on the head read, it
// verifies and settles.
func TestASponsoredApprovalIsSimulatedOnTheHeadItsNextBlockFollows(t *testing.T) {
	var node *sealsBeforeSimulating
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(3)}, tune: func(fx *fixture, nc *chain.NetworkConfig) {
		nc.ApprovalSponsoring = &chain.ApprovalSponsoring{}
		node = &sealsBeforeSimulating{Client: fx.c.EthClient, seal: func() { fx.c.Commit() }}
		nc.Backend = node
	}})
	payer := fx.c.PayerNoGas
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	req, _ := fx.sponsoredPermit2(payer)
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify with the approval, a block sealed before its simulation = %+v; want valid", v)
	}
	if s := fx.settle(req); !s.Success {
		t.Fatalf("settle with the approval, a block sealed before its simulation = %+v; want success", s)
	}
	if node.n.Load() == 0 {
		t.Fatal("the approval was never simulated")
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}

// approvalWithheld is the chain's client, but the receipt of the approval it is told of is withheld until the
// receipt of the payer's next transaction (after) exists: the engine sees the approval mined only once what the
// payer did next has mined too, whichever block each went in.
type approvalWithheld struct {
	*ethclient.Client
	mu              sync.Mutex
	approval, after common.Hash
}

func (b *approvalWithheld) TransactionReceipt(ctx context.Context, h common.Hash) (*types.Receipt, error) {
	b.mu.Lock()
	approval, after := b.approval, b.after
	b.mu.Unlock()
	if h == approval {
		if r, err := b.Client.TransactionReceipt(ctx, after); err != nil || r == nil {
			return nil, ethereum.NotFound
		}
	}
	return b.Client.TransactionReceipt(ctx, h)
}

// A payer that revokes its approval with its next transaction, which mines with or after the approval and before
// the settlement would go, does not make the facilitator send a settlement that reverts: the settlement is
// simulated again once the approval mined, and the payment is refused with nothing more sent.
func TestASponsoredApprovalRevokedBeforeItsSettlementIsNotFollowedByASettlementThatReverts(t *testing.T) {
	var withheld *approvalWithheld
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)}, tune: func(fx *fixture, nc *chain.NetworkConfig) {
		withheld = &approvalWithheld{Client: fx.c.EthClient}
		nc.Backend, nc.ApprovalSponsoring = withheld, &chain.ApprovalSponsoring{}
	}})
	ctx := context.Background()
	payer := fx.c.PayerNoGas
	fees := fx.approvalFees()
	fees.Nonce = 0
	// The payer holds the gas for its approval and its revocation: nothing is funded, and the payer pays both.
	fx.c.SendETH(fx.c.Payers[2], payer.Address, new(big.Int).Mul(big.NewInt(2*int64(fees.Gas)), fees.FeeCap))
	req := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if err := chain.AddApprovalSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, fees); err != nil {
		t.Fatal(err)
	}
	if v := fx.verify(req); !v.IsValid {
		t.Fatalf("verify = %+v, want valid", v)
	}
	// The revocation, approve(Permit2, 0) with the nonce after the approval's, waits in the pool for the approval.
	data, _ := contracts.StableCoinABI.Pack("approve", contracts.Permit2Address, new(big.Int))
	revoke, err := types.SignNewTx(payer.Key, types.LatestSignerForChainID(fx.c.ChainID), &types.DynamicFeeTx{
		ChainID: fx.c.ChainID, Nonce: 1, GasTipCap: fees.TipCap, GasFeeCap: fees.FeeCap, Gas: fees.Gas, To: &fx.c.Token, Data: data})
	if err != nil {
		t.Fatal(err)
	}
	if err := fx.c.SendSigned(ctx, revoke); err != nil {
		t.Fatal(err)
	}
	withheld.mu.Lock()
	withheld.approval, withheld.after = approvalOf(t, req).Hash(), revoke.Hash()
	withheld.mu.Unlock()

	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	wallets := fx.c.TxCount(fx.c.Wallets[0].Address) + fx.c.TxCount(fx.c.Wallets[1].Address)
	s := fx.settle(req)
	if s.Success || s.ErrorReason != x402.ReasonPermit2SimulationFailed || s.Transaction != "" || !strings.Contains(s.ErrorMessage, "spent") {
		t.Fatalf("settle = %+v, want %s with no transaction, saying the approval's gas is spent", s, x402.ReasonPermit2SimulationFailed)
	}
	if got := fx.c.TxCount(fx.c.Wallets[0].Address) + fx.c.TxCount(fx.c.Wallets[1].Address) - wallets; got != 0 {
		t.Fatalf("the settlement wallets sent %d transactions, want none (no funding was needed, no settlement sent)", got)
	}
	if fx.c.TxCount(payer.Address) != 2 || fx.c.Allowance(payer.Address, contracts.Permit2Address).Sign() != 0 {
		t.Fatal("the payer's approval and revocation did not both mine")
	}
	if fx.c.TokenBalance(payer.Address).Cmp(before) != 0 || fx.c.TokenBalance(fx.payTo).Cmp(sellerBefore) != 0 {
		t.Fatal("tokens moved")
	}
}

// TestASponsoredApprovalIsSimulatedOnAFreshHeadBeforeItsGasMoneyIsSent: the approval and the settlement after it were
// simulated in the block after the head the time check read, which the shared head read (HeadCacheTTL) may leave
// blocks behind. A payer whose tokens left in between (taken by another account under a permit it signed, its own
// account nonce, the approval's, untouched) passed that simulation: the gas money and the approval went out and
// were spent, and only the settlement's simulation once the approval mined refused it. Both are simulated on a head
// read right before the gas money is sent now: refused there, nothing is sent.
func TestASponsoredApprovalIsSimulatedOnAFreshHeadBeforeItsGasMoneyIsSent(t *testing.T) {
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)}, tune: func(_ *fixture, nc *chain.NetworkConfig) {
		nc.ApprovalSponsoring = &chain.ApprovalSponsoring{}
		nc.HeadCacheTTL = time.Hour
	}})
	ctx := context.Background()
	payer := fx.c.PayersNoGas[0]
	req, _ := fx.sponsoredPermit2(payer)
	// The shared head read is taken now, verifying another payer's payment...
	other := fx.c.Payers[0]
	fx.approvePermit2(other)
	if v := fx.verify(fx.permit2(other, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})); !v.IsValid {
		t.Fatalf("verify = %+v; want valid", v)
	}
	// ...and the payer's tokens leave after it.
	taker := fx.c.Payers[1]
	balance := fx.c.TokenBalance(payer.Address)
	permit := fx.c.SignERC2612Permit(payer, taker.Address, balance, fx.c.HeadTime()+3600)
	sig := permit.ProxyPermit()
	for _, call := range [][]any{{"permit", payer.Address, taker.Address, balance, permit.Deadline, sig.V, sig.R, sig.S}, {"transferFrom", payer.Address, taker.Address, balance}} {
		data, err := contracts.StableCoinABI.Pack(call[0].(string), call[1:]...)
		if err != nil {
			t.Fatal(err)
		}
		if r, err := fx.c.Transact(ctx, taker, fx.c.Token, data); err != nil || r.Status != types.ReceiptStatusSuccessful {
			t.Fatalf("%s: %+v, %v", call[0], r, err)
		}
	}
	if got := fx.c.TokenBalance(payer.Address); got.Sign() != 0 {
		t.Fatalf("the payer's token balance = %s; want 0", got)
	}
	sent := fx.walletTxs()
	if s := fx.settle(req); s.Success || s.ErrorReason != x402.ReasonPermit2SimulationFailed {
		t.Fatalf("settle of a payer whose tokens left = %+v; want %s", s, x402.ReasonPermit2SimulationFailed)
	}
	if got := fx.f.ApprovalFunding(fx.net); got.Sign() != 0 {
		t.Fatalf("ApprovalFunding = %s wei; want 0: nothing is sent for a settlement that would revert", got)
	}
	if n := fx.c.TxCount(payer.Address); n != 0 {
		t.Fatalf("the payer's approval went out (%d transactions); want none", n)
	}
	if total, _ := fx.sentSince(sent); total != 0 {
		t.Fatalf("the settlement wallets sent %d transactions; want none", total)
	}
}

// A payer prices its approval from the base fee it read when it signed (twice it, and the tip); by the time the
// payment is settled the base fee may have fallen by half (six blocks of a chain sealing a block per
// transaction: the money-invariant run's scarce topology refused such a payment at its first presentation,
// erc20_approval_tx_fees_not_sponsored). The bound on the fee cap looks at the highest base fee of the recent
// blocks, so the payment settles; a fee cap ten times any recent base fee is still refused, before anything is
// spent.
func TestASponsoredApprovalSignedBeforeTheBaseFeeFellByHalfSettlesAndAFeeCapTenTimesOverIsRefused(t *testing.T) {
	fx := approvalFixture(t)
	ctx := context.Background()
	head := func() *types.Header {
		h, err := fx.c.Client.HeaderByNumber(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	read := head().BaseFee
	if read.Cmp(big.NewInt(100_000_000)) < 0 {
		t.Fatalf("the simulated chain's base fee is %s wei: it must be well above the bound's 0.01 gwei floor for this test to judge the bound", read)
	}
	payer := fx.c.PayersNoGas[0]
	req, _ := fx.sponsoredPermit2(payer)
	for i := 0; head().BaseFee.Cmp(new(big.Int).Div(read, big.NewInt(2))) > 0; i++ {
		if i == 20 {
			t.Fatalf("the base fee did not halve in 20 empty blocks: %s from %s", head().BaseFee, read)
		}
		fx.c.Commit()
	}
	if s := fx.settle(req); !s.Success {
		t.Fatalf("settle after the base fee fell from %s to %s = %+v, want success", read, head().BaseFee, s)
	}
	if r, err := fx.c.Client.TransactionReceipt(ctx, approvalOf(t, req).Hash()); err != nil || r.Status != types.ReceiptStatusSuccessful {
		t.Fatalf("the payer's approval: %+v, %v; want mined", r, err)
	}

	// Ten times the highest recent base fee (the one the first payer read), under the facilitator's 10 gwei cap.
	greedy := fx.c.PayersNoGas[1]
	over := fx.permit2(greedy, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	tip := big.NewInt(1_000_000_000)
	feeCap := new(big.Int).Add(new(big.Int).Mul(read, big.NewInt(10)), tip)
	if feeCap.Cmp(big.NewInt(10_000_000_000)) > 0 {
		t.Fatalf("ten times the base fee and the tip, %s wei, is above the facilitator's 10 gwei cap: the test would not judge the bound", feeCap)
	}
	if err := chain.AddApprovalSponsoring(&over.PaymentPayload, greedy.Key, fx.c.ChainID, chain.ApprovalTx{Gas: 70_000, TipCap: tip, FeeCap: feeCap}); err != nil {
		t.Fatal(err)
	}
	funded := fx.f.ApprovalFunding(fx.net)
	if s := fx.settle(over); s.Success || s.ErrorReason != x402.ReasonERC20ApprovalTxFeesNotSponsored || !strings.Contains(s.ErrorMessage, "highest base fee") {
		t.Fatalf("settle of a fee cap ten times the highest recent base fee = %+v, want refused %s by the bound", s, x402.ReasonERC20ApprovalTxFeesNotSponsored)
	}
	if v := fx.verify(over); v.IsValid || v.InvalidReason != x402.ReasonERC20ApprovalTxFeesNotSponsored {
		t.Fatalf("verify of a fee cap ten times the highest recent base fee = %+v, want invalid %s", v, x402.ReasonERC20ApprovalTxFeesNotSponsored)
	}
	if fx.c.ETHBalance(greedy.Address).Sign() != 0 || fx.c.TxCount(greedy.Address) != 0 || fx.f.ApprovalFunding(fx.net).Cmp(funded) != 0 {
		t.Fatal("the refused approval was funded or sent")
	}
}

// losesFundings is a node that takes the payer's gas money from the engine and loses it (answers as if it took
// it, and never mines it) while lose is set: the engine's funding is in its journal, not on chain, as after a
// crash between the journal's write and the broadcast, or a node that dropped it from its pool. Given the
// approval whose hash minesOnSend holds, it mines it and then answers as a node does to a transaction whose
// nonce is spent: the approval mined between the engine's look for its receipt and its send.
type losesFundings struct {
	*ethclient.Client
	c           *chaintest.Chain
	payer       common.Address
	lose        atomic.Bool
	lost        atomic.Int64
	minesOnSend atomic.Pointer[common.Hash]
	minedOnSend atomic.Bool
	holdBack    atomic.Pointer[common.Hash] // a transaction lost too while set (the recorded approval)
}

func (b *losesFundings) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	if b.lose.Load() && tx.To() != nil && *tx.To() == b.payer && tx.Value().Sign() > 0 {
		b.lost.Add(1)
		return nil
	}
	if h := b.holdBack.Load(); h != nil && *h == tx.Hash() {
		return nil
	}
	if h := b.minesOnSend.Load(); h != nil && *h == tx.Hash() {
		if err := b.Client.SendTransaction(ctx, tx); err != nil {
			return err // the node's pool has not seen the payer's funds yet: the next pass sends it again
		}
		b.minesOnSend.Store(nil)
		if _, err := b.c.CommitUntilIncluded(context.Background(), tx.Hash()); err != nil {
			return err
		}
		b.minedOnSend.Store(true)
		return fmt.Errorf("nonce too low: address %s, tx: %d state: %d", b.payer, tx.Nonce(), tx.Nonce()+1)
	}
	return b.Client.SendTransaction(ctx, tx)
}

// lostFunding is a sponsored settlement answered settlement_pending whose payer's gas money the node lost.
type lostFunding struct {
	fx                   *fixture
	node                 *losesFundings
	payer                *chaintest.Account
	wallet               common.Address
	req                  x402.VerifyRequest
	approval             *types.Transaction
	cost                 *big.Int // the approval's gas limit at its fee cap: the gas money recorded
	before, sellerBefore *big.Int
	walletTxs            uint64
}

func settleWithItsFundingLost(t *testing.T) *lostFunding {
	l := &lostFunding{}
	fx := newFixture(t, fixtureOpts{receiptTimeout: 300 * time.Millisecond, wallets: 1,
		chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			l.node = &losesFundings{Client: fx.c.EthClient, c: fx.c, payer: fx.c.PayerNoGas.Address}
			l.node.lose.Store(true)
			nc.Backend, nc.ApprovalSponsoring = l.node, &chain.ApprovalSponsoring{}
		},
		configure: func(c *chain.Config) { c.ReconcileEvery, c.ReconcileGrace = 20*time.Millisecond, time.Millisecond }})
	l.fx, l.payer, l.wallet = fx, fx.c.PayerNoGas, fx.c.Wallets[0].Address
	l.before, l.sellerBefore = fx.c.TokenBalance(l.payer.Address), fx.c.TokenBalance(fx.payTo)
	l.walletTxs = fx.c.TxCount(l.wallet)
	var fees chain.ApprovalTx
	l.req, fees = fx.sponsoredPermit2(l.payer)
	l.approval = approvalOf(t, l.req)
	l.cost = new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap)
	if s := fx.settle(l.req); s.Success || s.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("settle with its gas money lost = %+v, want settlement_pending", s)
	}
	if l.node.lost.Load() == 0 {
		t.Fatal("the node never got the payer's gas money to lose")
	}
	return l
}

// settledOnceUnfunded asserts the payment settles once it is presented again, and that the recorded gas money
// never went out: the payer holds what it got elsewhere less its approval's gas, and the settlement wallet sent
// two transactions (a zero-value transfer to itself in the funding's nonce, the settlement).
func (l *lostFunding) settledOnceUnfunded(t *testing.T) { l.settledOnceUnfundedAfter(t, l.approval, 2) }

// settledOnceUnfundedAfter is settledOnceUnfunded with approval the payer's transaction that mined at the recorded
// approval's nonce (the recorded one, or another approval of the payer's), and walletTxs what the settlement wallet
// sent.
func (l *lostFunding) settledOnceUnfundedAfter(t *testing.T, approval *types.Transaction, walletTxs uint64) {
	t.Helper()
	fx := l.fx
	receipt, err := fx.c.Client.TransactionReceipt(context.Background(), approval.Hash())
	if err != nil || receipt.Status != types.ReceiptStatusSuccessful {
		t.Fatalf("the payer's approval: %+v, %v; want mined", receipt, err)
	}
	final := fx.settle(l.req)
	for deadline := time.Now().Add(30 * time.Second); !final.Success && time.Now().Before(deadline); final = fx.settle(l.req) {
		if final.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("presented again = %+v, want settled (or pending until reconciliation sent it)", final)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !final.Success {
		t.Fatalf("presented again = %+v, want settled by reconciliation", final)
	}
	assertMoved(t, fx, l.payer.Address, l.before, l.sellerBefore, 1)
	spent := new(big.Int).Mul(new(big.Int).SetUint64(receipt.GasUsed), receipt.EffectiveGasPrice)
	if got, want := fx.c.ETHBalance(l.payer.Address), new(big.Int).Sub(l.cost, spent); got.Cmp(want) != 0 {
		t.Fatalf("payer ETH = %s, want what it got elsewhere less its approval's gas, %s: the engine sent the recorded gas money after an approval of its nonce mined", got, want)
	}
	if n := fx.c.TxCount(l.payer.Address); n != 1 {
		t.Fatalf("the payer's transactions = %d, want one approval", n)
	}
	if got := fx.c.TxCount(l.wallet) - l.walletTxs; got != walletTxs {
		t.Fatalf("the settlement wallet sent %d transactions, want %d (zero-value transfers to itself in the nonces of what never went, the settlement)", got, walletTxs)
	}
}

// A settlement whose gas money for the payer's approval is recorded but never reached the chain, while the
// approval mined without it (another payment carrying the same approval was settled with gas money of its own,
// at another gateway or after a restart): reconciliation sends the settlement once, and the recorded gas money
// never, for the payer needs it no more; the wallet's nonce it held goes to a zero-value transfer to itself.
// The money-invariant run (scarce, seed 1795824846132738674, a SIGKILL and a database restart) saw a payer sent
// gas money twice for one approval.
func TestARecordedFundingOfASponsoredApprovalThatMinedWithoutItIsNeverSent(t *testing.T) {
	l := settleWithItsFundingLost(t)
	fx := l.fx
	// The approval mines without the recorded gas money: the payer got ether elsewhere and sent it.
	fx.c.SendETH(fx.c.Payers[2], l.payer.Address, l.cost)
	// Reconciliation may send the payer's signed approval itself once the payer holds the gas for it: the node
	// then knows it already (CI, 8246960), the same transaction either way.
	if err := fx.c.SendSigned(context.Background(), l.approval); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.c.CommitUntilIncluded(context.Background(), l.approval.Hash()); err != nil {
		t.Fatal(err)
	}
	l.node.lose.Store(false)
	l.settledOnceUnfunded(t)
}

// The same, but what mined at the approval's nonce is another approval of the payer's (signed for another payment,
// sent by the payer or a settlement elsewhere): the recorded approval can never mine, and its gas money is never
// sent either; the payment settles with the allowance the other set.
func TestARecordedFundingOfASponsoredApprovalWhoseNonceAnotherApprovalTookIsNeverSent(t *testing.T) {
	l := settleWithItsFundingLost(t)
	fx := l.fx
	// Reconciliation would send the recorded approval itself once the payer holds its gas: the other mines first.
	recorded := l.approval.Hash()
	l.node.holdBack.Store(&recorded)
	fx.c.SendETH(fx.c.Payers[2], l.payer.Address, l.cost)
	fees := fx.approvalFees()
	other := fx.permit2(l.payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if err := chain.AddApprovalSponsoring(&other.PaymentPayload, l.payer.Key, fx.c.ChainID, fees); err != nil {
		t.Fatal(err)
	}
	approval := approvalOf(t, other)
	if approval.Hash() == l.approval.Hash() || approval.Nonce() != l.approval.Nonce() {
		t.Fatal("the other approval must be another transaction of the same nonce")
	}
	if err := fx.c.SendSigned(context.Background(), approval); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.c.CommitUntilIncluded(context.Background(), approval.Hash()); err != nil {
		t.Fatal(err)
	}
	l.node.lose.Store(false)
	l.node.holdBack.Store(nil)
	// Three: the recorded approval can never mine, so the payment is settled again at another nonce, and the
	// nonces of its recorded gas money and settlement are filled.
	l.settledOnceUnfundedAfter(t, approval, 3)
}

// The same, the approval mining while reconciliation sends it (sent by the payer, or by a settlement at another
// gateway, between reconciliation's look for its receipt and its own send): the node refuses it for a nonce
// spent by the approval itself, and the settlement recorded is sent, not settled again at another nonce, which
// left the recorded one's nonce a hole to fill with a third transaction (CI, eafd324: the wallet sent 3).
func TestASponsoredApprovalMinedWhileReconciliationSendsItLetsTheRecordedSettlementGo(t *testing.T) {
	l := settleWithItsFundingLost(t)
	h := l.approval.Hash()
	l.node.minesOnSend.Store(&h)
	l.fx.c.SendETH(l.fx.c.Payers[2], l.payer.Address, l.cost)
	deadline := time.Now().Add(10 * time.Second)
	for !l.node.minedOnSend.Load() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !l.node.minedOnSend.Load() {
		t.Fatal("reconciliation never sent the payer's approval once the payer held its gas")
	}
	l.node.lose.Store(false)
	l.settledOnceUnfunded(t)
}

// readsFundsThen is a node that runs then, once, when the facilitator first reads a balance at a block (the funds
// read of a payment's checks, between the look for another payment's hold of its approval and its own hold).
type readsFundsThen struct {
	*ethclient.Client
	then atomic.Pointer[func()]
	// onSimulate runs then at the onSimulate-th eth_simulateV1 instead (a sponsored approval's checks simulate
	// it with the settlement, and its settlement once more right before it sends; one engine with nothing else
	// held reads no balance). 0: at a balance read.
	onSimulate int32
	simulated  atomic.Int32
}

func (b *readsFundsThen) SimulateV1(ctx context.Context, opts ethclient.SimulateOptions, block *rpc.BlockNumberOrHash) ([]ethclient.SimulateBlockResult, error) {
	if b.onSimulate > 0 && b.then.Load() != nil && b.simulated.Add(1) == b.onSimulate {
		if then := b.then.Swap(nil); then != nil {
			(*then)()
		}
	}
	return b.Client.SimulateV1(ctx, opts, block)
}

func (b *readsFundsThen) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	if block != nil && b.onSimulate == 0 && len(msg.Data) >= 4 && hexutil.Encode(msg.Data[:4]) == "0x70a08231" { // balanceOf
		if then := b.then.Swap(nil); then != nil {
			(*then)()
		}
	}
	return b.Client.CallContract(ctx, msg, block)
}

// Two payments of one payer carrying the same sponsored approval, verified for a gate at two engines sharing a
// PostgreSQL journal at once (the second's checks run while the first's do): only one is held and served; the
// other is refused until the first settled, and then pays with the allowance the approval set. Both held, both
// settlements would fund the payer, each seeing no gas money on its way (the money-invariant run: a payer sent gas
// money twice for one approval, payments presented at several gateways at once).
func TestTwoPaymentsCarryingOneSponsoredApprovalVerifiedAtOnceAtTwoGatewaysAreNotBothHeld(t *testing.T) {
	var node *readsFundsThen
	fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 2, 3*time.Second, fixtureOpts{wallets: 4, receiptTimeout: time.Minute,
		chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			node = &readsFundsThen{Client: fx.c.EthClient}
			nc.Backend, nc.ApprovalSponsoring = node, &chain.ApprovalSponsoring{}
		}})
	waitLeases(t, fx, engines, 2, 2)
	ctx := context.Background()
	payer := fx.c.PayerNoGas
	first, _ := fx.sponsoredPermit2(payer)
	second := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	second.PaymentPayload.Extensions = first.PaymentPayload.Extensions

	var v1 x402.VerifyResponse
	var err1 error
	during := func() { v1, err1 = engines[0].VerifyAndHold(ctx, first) }
	node.then.Store(&during)
	v2, err2 := engines[1].VerifyAndHold(ctx, second)
	if node.then.Load() != nil {
		t.Fatal("the second payment's checks never read the payer's balance: the test did not run the first's in between")
	}
	if err1 != nil || err2 != nil {
		t.Fatalf("verify: %v, %v", err1, err2)
	}
	if !v1.IsValid {
		t.Fatalf("the first payment, held first = %+v, want valid", v1)
	}
	if v2.IsValid || v2.InvalidReason != x402.ReasonERC20ApprovalTxWrongNonce {
		t.Fatalf("the second payment, carrying the approval the first holds = %+v, want refused %s", v2, x402.ReasonERC20ApprovalTxWrongNonce)
	}
	if s, err := engines[0].Settle(ctx, first); err != nil || !s.Success {
		t.Fatalf("settle of the first = %+v, %v; want success", s, err)
	}
	funded := new(big.Int).Add(engines[0].ApprovalFunding(fx.net), engines[1].ApprovalFunding(fx.net))
	if v, err := engines[1].VerifyAndHold(ctx, second); err != nil || !v.IsValid {
		t.Fatalf("the second payment once the first settled = %+v, %v; want valid (the allowance its approval set pays it)", v, err)
	}
	if s, err := engines[1].Settle(ctx, second); err != nil || !s.Success {
		t.Fatalf("settle of the second = %+v, %v; want success", s, err)
	}
	if got := new(big.Int).Add(engines[0].ApprovalFunding(fx.net), engines[1].ApprovalFunding(fx.net)); got.Cmp(funded) != 0 || fx.c.TxCount(payer.Address) != 1 {
		t.Fatalf("the second payment funded the payer (%s wei, then %s) or sent the approval again (%d transactions of the payer's)", funded, got, fx.c.TxCount(payer.Address))
	}
}

// A payer whose first approval is on its way (funded, in the node's pool) signs its next payment with an approval
// of its next nonce. Funded too, the payer would be paid for a second approval the first makes needless, and that
// the node refuses all the same (its pool wants the balance to hold both approvals' gas at their fee caps, and the
// second's gas money was judged against the balance the first leaves): the money-invariant run saw a payer sent
// gas money twice for one approval mined, the second funding odd wei. The second payment is refused at
// verification and not settled while the first approval is pending, nothing sent; once it mined, the second pays
// with the allowance it set, funded nothing.
func TestAPaymentWhoseApprovalWaitsBehindThePayersPendingApprovalIsNotFunded(t *testing.T) {
	behindPendingApproval(t, func(first *types.Transaction, fees chain.ApprovalTx) chain.ApprovalTx {
		fees.Nonce = first.Nonce() + 1 // signed as payer.Transport signs it: at the account's pending nonce
		return fees
	}, func(t *testing.T, v x402.VerifyResponse, s x402.SettleResponse, err error) {
		if v.IsValid || v.InvalidReason != x402.ReasonERC20ApprovalTxWrongNonce {
			t.Fatalf("verify while the first approval is pending = %+v, want refused %s", v, x402.ReasonERC20ApprovalTxWrongNonce)
		}
		if err == nil && s.Success {
			t.Fatalf("settle while the first approval is pending = %+v, want not settled", s)
		}
	})
}

// The same, but the second payment's approval has the nonce of the first, which is on its way (two first payments
// of a payer signed at once, each with its own approval of the account's first nonce): the second is refused at
// verification as waiting behind it (erc20_approval_tx_wrong_nonce, saying to present it again once that mined:
// the money-invariant run judged "sign it again with the account's pending nonce" a refusal of an honest payment,
// and its advice was wrong), its settlement sends nothing and says so, and once the first approval mined it pays
// with the allowance that set, funded nothing.
func TestAPaymentWhoseApprovalsNonceAnotherApprovalOnItsWayTakesWaitsForIt(t *testing.T) {
	behindPendingApproval(t, func(_ *types.Transaction, fees chain.ApprovalTx) chain.ApprovalTx {
		fees.FeeCap = new(big.Int).Add(fees.FeeCap, big.NewInt(1)) // another approval of the first's nonce
		return fees
	}, func(t *testing.T, v x402.VerifyResponse, s x402.SettleResponse, err error) {
		if v.IsValid || v.InvalidReason != x402.ReasonERC20ApprovalTxWrongNonce || !strings.Contains(v.InvalidMessage, "on its way") || !strings.Contains(v.InvalidMessage, "present the payment again") {
			t.Fatalf("verify while the first approval is on its way = %+v, want refused %s, waiting behind it", v, x402.ReasonERC20ApprovalTxWrongNonce)
		}
		if err == nil || s.Success || s.ErrorReason != "" || !strings.Contains(err.Error(), "nothing was sent") {
			t.Fatalf("settle while the first approval is on its way = %+v, %v; want nothing sent and an error saying so, no refusal", s, err)
		}
	})
}

// behindPendingApproval runs the two tests above: a payer's first payment settled with no block sealed (pending),
// its gas money mined and its approval sent to the node's pool; a second payment carrying an approval signed with
// the fees second makes of the first's, verified and settled while the first approval is pending (judged by
// whilePending), funding nothing; and, once the first approval mined, settled with the allowance it set, funding
// nothing and sending no approval.
func behindPendingApproval(t *testing.T, second func(first *types.Transaction, fees chain.ApprovalTx) chain.ApprovalTx,
	whilePending func(t *testing.T, v x402.VerifyResponse, s x402.SettleResponse, err error)) {
	t.Helper()
	fx := newFixture(t, fixtureOpts{autoCommit: -1, receiptTimeout: 300 * time.Millisecond,
		chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune:      func(_ *fixture, nc *chain.NetworkConfig) { nc.ApprovalSponsoring = &chain.ApprovalSponsoring{} }})
	ctx := context.Background()
	payer := fx.c.PayerNoGas
	first, fees := fx.sponsoredPermit2(payer)
	if s := fx.settle(first); s.Success || s.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("settle with no block sealed = %+v, want settlement_pending", s)
	}
	fx.c.Commit() // the first's gas money mines
	cost := new(big.Int).Mul(big.NewInt(int64(fees.Gas)), fees.FeeCap)
	if got := fx.c.ETHBalance(payer.Address); got.Cmp(cost) != 0 {
		t.Fatalf("payer ETH after the first's gas money = %s, want %s", got, cost)
	}
	approval := approvalOf(t, first)
	if err := fx.c.SendSigned(ctx, approval); err != nil {
		t.Fatal(err)
	}
	next := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	if err := chain.AddApprovalSponsoring(&next.PaymentPayload, payer.Key, fx.c.ChainID, second(approval, fees)); err != nil {
		t.Fatal(err)
	}
	if approvalOf(t, next).Hash() == approval.Hash() {
		t.Fatal("the second payment must carry another approval than the first's")
	}
	funded := fx.f.ApprovalFunding(fx.net)
	v := fx.verify(next)
	s, err := fx.f.Settle(ctx, next)
	whilePending(t, v, s, err)
	if got := fx.f.ApprovalFunding(fx.net); got.Cmp(funded) != 0 {
		t.Fatalf("ApprovalFunding = %s, want still %s: the payer was funded for a second approval", got, funded)
	}
	t.Cleanup(fx.c.AutoCommit(5 * time.Millisecond))
	if _, err := fx.c.CommitUntilIncluded(ctx, approval.Hash()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); {
		if s, err = fx.f.Settle(ctx, next); err == nil && (s.Success || s.ErrorReason != x402.ReasonSettlementPending) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !s.Success {
		t.Fatalf("settle of the second once the first approval mined = %+v, want success", s)
	}
	if got := fx.f.ApprovalFunding(fx.net); got.Cmp(funded) != 0 || fx.c.TxCount(payer.Address) != 1 {
		t.Fatalf("the second payment funded the payer (%s wei, then %s) or sent its approval (%d transactions of the payer's)", funded, got, fx.c.TxCount(payer.Address))
	}
}

// headLagsReceipts is a node that serves the payer's approval's receipt before its head moves to the block that
// mined it, as geth does for a moment (it indexes a block's transactions before it writes its head): for the
// next few reads of the head, the head and the latest state are the block before.
type headLagsReceipts struct {
	*ethclient.Client
	approval atomic.Pointer[common.Hash]
	lag      atomic.Int64
}

func (b *headLagsReceipts) TransactionReceipt(ctx context.Context, h common.Hash) (*types.Receipt, error) {
	r, err := b.Client.TransactionReceipt(ctx, h)
	if a := b.approval.Load(); err == nil && a != nil && *a == h && b.approval.CompareAndSwap(a, nil) {
		b.lag.Store(3)
	}
	return r, err
}

func (b *headLagsReceipts) behind(ctx context.Context) (*big.Int, error) {
	head, err := b.Client.HeaderByNumber(ctx, nil)
	if err != nil {
		return nil, err
	}
	return new(big.Int).Sub(head.Number, big.NewInt(1)), nil
}

func (b *headLagsReceipts) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	if n == nil && b.lag.Add(-1) >= 0 {
		prev, err := b.behind(ctx)
		if err != nil {
			return nil, err
		}
		return b.Client.HeaderByNumber(ctx, prev)
	}
	return b.Client.HeaderByNumber(ctx, n)
}

func (b *headLagsReceipts) CallContract(ctx context.Context, msg ethereum.CallMsg, n *big.Int) ([]byte, error) {
	if n == nil && b.lag.Load() > 0 {
		prev, err := b.behind(ctx)
		if err != nil {
			return nil, err
		}
		return b.Client.CallContract(ctx, msg, prev)
	}
	return b.Client.CallContract(ctx, msg, n)
}

// The settlement of a sponsored approval is simulated again once the approval mined, on a head that holds the
// approval's block: a node that serves the approval's receipt before its head moves would otherwise answer from
// the state before it, without the allowance, and the payment be refused permit2_simulation_failed
// (ERC20InsufficientAllowance) after the payer's gas money and its approval were spent (the money-invariant run's
// scarce topology: an honest payment refused so).
func TestASponsoredApprovalsSettlementIsSimulatedAgainOnAHeadThatHoldsTheApproval(t *testing.T) {
	var node *headLagsReceipts
	fx := newFixture(t, fixtureOpts{chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			node = &headLagsReceipts{Client: fx.c.EthClient}
			nc.Backend, nc.ApprovalSponsoring = node, &chain.ApprovalSponsoring{}
		}})
	payer := fx.c.PayerNoGas
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	req, _ := fx.sponsoredPermit2(payer)
	h := approvalOf(t, req).Hash()
	node.approval.Store(&h)
	if s := fx.settle(req); !s.Success {
		t.Fatalf("settle = %+v, want success", s)
	}
	if node.approval.Load() != nil {
		t.Fatal("the approval's receipt was never read: the test did not lag the head")
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}

// settleWhileApprovalHeld makes two payments of one payer carrying the same sponsored approval, of amount each ("":
// the fixture's price), verifies the second while nothing holds the approval, holds the first, and settles the
// second: it must send nothing, fund nothing and be no refusal (an error saying nothing was sent). It returns the
// fixture, both payments and the approval funding before the second's settlement.
func settleWhileApprovalHeld(t *testing.T, amount func(*fixture) string) (*fixture, x402.VerifyRequest, x402.VerifyRequest, *big.Int) {
	t.Helper()
	fx := newFixture(t, fixtureOpts{receiptTimeout: time.Minute,
		chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
		tune:      func(_ *fixture, nc *chain.NetworkConfig) { nc.ApprovalSponsoring = &chain.ApprovalSponsoring{} }})
	ctx := context.Background()
	payer := fx.c.PayerNoGas
	rq := fx.requirements(x402.TransferPermit2)
	if amount != nil {
		rq.Amount = amount(fx)
	}
	sponsored := func() x402.VerifyRequest {
		req := fx.permit2(payer, rq, chain.Permit2Options{})
		if err := chain.AddApprovalSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, fx.approvalFees()); err != nil {
			t.Fatal(err)
		}
		return req
	}
	first, second := sponsored(), sponsored()
	if v := fx.verify(second); !v.IsValid {
		t.Fatalf("verify of the second while nothing holds its approval = %+v, want valid", v)
	}
	if v, err := fx.f.VerifyAndHold(ctx, first); err != nil || !v.IsValid {
		t.Fatalf("verify and hold of the first = %+v, %v; want valid", v, err)
	}
	funded := fx.f.ApprovalFunding(fx.net)
	s, err := fx.f.Settle(ctx, second)
	if err == nil || s.Success || s.ErrorReason != "" || !strings.Contains(err.Error(), "nothing was sent") {
		t.Fatalf("settle of the second while the first holds its approval = %+v, %v; want nothing sent and an error saying so, no refusal", s, err)
	}
	if got := fx.f.ApprovalFunding(fx.net); got.Cmp(funded) != 0 || fx.c.TxCount(payer.Address) != 0 {
		t.Fatalf("the second's settlement funded the payer (%s wei, then %s) or sent its approval (%d transactions of the payer's)", funded, got, fx.c.TxCount(payer.Address))
	}
	if s, err := fx.f.Settle(ctx, first); err != nil || !s.Success {
		t.Fatalf("settle of the first = %+v, %v; want success", s, err)
	}
	return fx, first, second, funded
}

// A payment verified while nothing held its sponsored approval, settled after another payment carrying the same
// approval was held, with a balance that covers one of them only (a gate settling after its upstream; the
// money-invariant run: two payments of one payer presented at once after an RPC fault): the settlement sends
// nothing and is no refusal (the payer was told 402 after its upstream had run), since the payment may still be
// good once the other settled. Nothing is funded or sent for it.
func TestASettlementMeetingItsApprovalHeldByAnotherPaymentSendsNothingAndIsNoRefusal(t *testing.T) {
	// Each payment takes more than half the payer's balance: the two cannot both be held.
	settleWhileApprovalHeld(t, func(fx *fixture) string {
		return new(big.Int).Add(new(big.Int).Div(fx.c.TokenBalance(fx.c.PayerNoGas.Address), big.NewInt(2)), big.NewInt(1)).String()
	})
}

// The same with a balance that covers both payments: the settlement of the second, while the first holds the
// approval both carry, still sends nothing (before, the funds covered it and it funded the payer and sent the
// approval the first sends: the money-invariant run, scarce, saw a payer sent gas money twice for one approval).
// Once the first settled, the second pays with the allowance its approval set.
func TestASettlementMeetingItsApprovalHeldByAnotherPaymentFundsNothingWhenTheBalanceCoversBoth(t *testing.T) {
	fx, _, second, funded := settleWhileApprovalHeld(t, nil)
	if s, err := fx.f.Settle(context.Background(), second); err != nil || !s.Success {
		t.Fatalf("settle of the second once the first settled = %+v, %v; want success with the allowance the first's approval set", s, err)
	}
	if got := fx.f.ApprovalFunding(fx.net); fx.c.TxCount(fx.c.PayerNoGas.Address) != 1 || got.Cmp(funded) <= 0 {
		t.Fatalf("after both: the payer sent %d transactions (want its one approval), funding %s then %s", fx.c.TxCount(fx.c.PayerNoGas.Address), funded, got)
	}
}

// Two payments of one payer, each carrying its own signed approval of Permit2 at the payer's first nonce (a payer
// that signed two first payments at once), settled without a hold from a verification (a gate that settles after
// its upstream verifies without holding): the first settles whole (gas money, approval, settlement) while the
// second's checks run, after they read the chain. The second must fund nothing and send no approval: the payer
// has its allowance by then, and its approval's nonce is spent. Before, the second sent the payer gas money again
// and then had its approval refused "nonce too low" (erc20_approval_broadcast_failed): the money-invariant run,
// three gateways, saw exactly that.
func TestTwoFirstPaymentsOfAPayerEachWithItsOwnApprovalFundThePayerOnce(t *testing.T) {
	run := func(t *testing.T, fx *fixture, node *readsFundsThen, one, two *chain.Facilitator) {
		t.Helper()
		ctx := context.Background()
		payer := fx.c.PayerNoGas
		sellerBefore, payerBefore := fx.c.TokenBalance(fx.payTo), fx.c.TokenBalance(payer.Address)
		first, fees := fx.sponsoredPermit2(payer)
		second := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
		fees.FeeCap = new(big.Int).Add(fees.FeeCap, big.NewInt(1)) // another approval of the same nonce
		if err := chain.AddApprovalSponsoring(&second.PaymentPayload, payer.Key, fx.c.ChainID, fees); err != nil {
			t.Fatal(err)
		}
		if approvalOf(t, first).Hash() == approvalOf(t, second).Hash() || approvalOf(t, first).Nonce() != approvalOf(t, second).Nonce() {
			t.Fatal("the two payments must carry two approvals of one nonce")
		}
		var s1 x402.SettleResponse
		var err1 error
		during := func() { s1, err1 = one.Settle(ctx, first) }
		node.then.Store(&during)
		s2, err2 := two.Settle(ctx, second)
		if node.then.Load() != nil {
			t.Fatal("the second settlement's checks never read the payer's balance nor simulated its approval: the first did not run in between")
		}
		if err1 != nil || !s1.Success {
			t.Fatalf("settle of the first = %+v, %v; want success", s1, err1)
		}
		if s2.ErrorReason != "" || (err2 == nil && !s2.Success) {
			t.Fatalf("settle of the second, checked before the first settled = %+v, %v; want success, or nothing sent and an error saying so, never a refusal", s2, err2)
		}
		if !s2.Success {
			if !strings.Contains(err2.Error(), "nothing was sent") {
				t.Fatalf("settle of the second = %v; want an error saying nothing was sent", err2)
			}
			if s2, err2 = two.Settle(ctx, second); err2 != nil || !s2.Success {
				t.Fatalf("settle of the second presented again = %+v, %v; want success with the allowance the first's approval set", s2, err2)
			}
		}
		funded := one.ApprovalFunding(fx.net)
		if two != one {
			funded.Add(funded, two.ApprovalFunding(fx.net))
		}
		if cost := new(big.Int).Mul(big.NewInt(int64(fees.Gas)), new(big.Int).Sub(fees.FeeCap, big.NewInt(1))); funded.Cmp(cost) != 0 {
			t.Fatalf("the payer was sent %s wei of gas money; want %s, the first approval's gas once", funded, cost)
		}
		if n := fx.c.TxCount(payer.Address); n != 1 {
			t.Fatalf("the payer's transactions on chain = %d; want its one approval", n)
		}
		assertMoved(t, fx, payer.Address, payerBefore, sellerBefore, 2)
	}
	t.Run("one engine", func(t *testing.T) {
		var node *readsFundsThen
		fx := newFixture(t, fixtureOpts{wallets: 2, receiptTimeout: time.Minute,
			chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
			tune: func(fx *fixture, nc *chain.NetworkConfig) {
				node = &readsFundsThen{Client: fx.c.EthClient, onSimulate: 1}
				nc.Backend, nc.ApprovalSponsoring = node, &chain.ApprovalSponsoring{}
			}})
		run(t, fx, node, fx.f, fx.f)
	})
	cluster := func(t *testing.T, onSimulate int32) {
		var node *readsFundsThen
		fx, engines, _ := sharedEnginesOn(t, pgtest.Shared(t), 2, 3*time.Second, fixtureOpts{wallets: 4, receiptTimeout: time.Minute,
			chainOpts: []chaintest.Option{chaintest.WithPayersNoGas(1)},
			tune: func(fx *fixture, nc *chain.NetworkConfig) {
				node = &readsFundsThen{Client: fx.c.EthClient, onSimulate: onSimulate}
				nc.Backend, nc.ApprovalSponsoring = node, &chain.ApprovalSponsoring{}
			}})
		waitLeases(t, fx, engines, 2, 2)
		run(t, fx, node, engines[0], engines[1])
	}
	t.Run("two engines on one PostgreSQL journal", func(t *testing.T) { cluster(t, 0) })
	// The first settles whole after the second read the payer again right before it sends (its last simulation):
	// the second's hold, written with its signed transactions, meets the first's, which carries the same approval
	// nonce, and is refused; its checks run again, and find the allowance.
	t.Run("two engines, the first settling as the second sends", func(t *testing.T) { cluster(t, 2) })
}
