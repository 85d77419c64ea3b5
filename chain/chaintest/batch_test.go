package chaintest

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// batchFixture is one payer's channel to a merchant on a USDC-like token, with the merchant's receiverAuthorizer
// and a relaying facilitator wallet that pays the gas.
type batchFixture struct {
	c          *Chain
	token      common.Address
	payer      *Account
	receiver   *Account
	authorizer *Account
	relayer    *Account
	cfg        contracts.ChannelConfig
	id         common.Hash
}

const batchMint = 1_000_000_000

func newBatchFixture(t *testing.T) *batchFixture {
	c := New(t)
	fx := &batchFixture{
		c:          c,
		token:      c.DeployUSDCoin(big.NewInt(batchMint)),
		payer:      c.Payers[0],
		receiver:   DeriveAccount("merchant", 0),
		authorizer: DeriveAccount("authorizer", 0),
		relayer:    c.Wallets[0],
	}
	fx.cfg = fx.channel(fx.receiver, fx.authorizer)
	fx.id = ChannelID(c.ChainID, fx.cfg)
	// The receiver claims and refunds on its own in some tests.
	c.SendETH(c.Deployer, fx.receiver.Address, big.NewInt(1e18))
	return fx
}

func (fx *batchFixture) channel(receiver, authorizer *Account) contracts.ChannelConfig {
	cfg := contracts.ChannelConfig{
		Payer:              fx.payer.Address,
		PayerAuthorizer:    fx.payer.Address,
		Receiver:           receiver.Address,
		ReceiverAuthorizer: authorizer.Address,
		Token:              fx.token,
		WithdrawDelay:      contracts.MinWithdrawDelay,
	}
	copy(cfg.Salt[:], crypto.Keccak256([]byte("salt")))
	return cfg
}

// send simulates calldata from sender to the escrow, and if it does not revert, sends it; it returns the revert
// reason ("" when it went through) and the receipt.
func (fx *batchFixture) send(t *testing.T, sender *Account, data []byte) (string, *types.Receipt) {
	t.Helper()
	ctx := context.Background()
	if _, err := fx.c.Call(ctx, sender.Address, contracts.BatchSettlementAddress, data); err != nil {
		if why := RevertReason(err); why != "" {
			return why, nil
		}
		t.Fatalf("simulating: %v", err)
	}
	r, err := fx.c.Transact(ctx, sender, contracts.BatchSettlementAddress, data)
	if err != nil {
		t.Fatalf("simulated fine but the transaction failed: %v", err)
	}
	return "", r
}

func (fx *batchFixture) mustSend(t *testing.T, sender *Account, data []byte, what string) *types.Receipt {
	t.Helper()
	why, r := fx.send(t, sender, data)
	if why != "" {
		t.Fatalf("%s reverted: %s", what, why)
	}
	return r
}

// depositERC3009 deposits amount into cfg's channel as the SDK's facilitator does for an eip3009 deposit.
func (fx *batchFixture) depositERC3009Data(t *testing.T, cfg contracts.ChannelConfig, amount *big.Int) []byte {
	t.Helper()
	salt := RandomNonce()
	validBefore := new(big.Int).SetUint64(fx.c.HeadTime() + 3600)
	nonce := contracts.ERC3009DepositNonce(ChannelID(fx.c.ChainID, cfg), common.BigToHash(salt))
	sig := fx.c.SignTypedData(fx.payer, ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, fx.c.ChainID,
		fx.token, fx.payer.Address, amount, big.NewInt(0), validBefore, nonce))
	collectorData, err := contracts.EncodeERC3009CollectorData(big.NewInt(0), validBefore, salt, sig)
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.PackBatchDeposit(cfg, amount, contracts.ERC3009DepositCollectorAddress, collectorData)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func (fx *batchFixture) claimRow(cfg contracts.ChannelConfig, signer *Account, max, total int64) contracts.VoucherClaim {
	return contracts.VoucherClaim{
		Voucher:      contracts.Voucher{Channel: cfg, MaxClaimableAmount: big.NewInt(max)},
		Signature:    fx.c.SignVoucher(signer, ChannelID(fx.c.ChainID, cfg), big.NewInt(max)),
		TotalClaimed: big.NewInt(total),
	}
}

// claimWithSignatureData returns claimWithSignature calldata of rows, signed by authorizer.
func (fx *batchFixture) claimWithSignatureData(t *testing.T, authorizer *Account, rows ...contracts.VoucherClaim) []byte {
	t.Helper()
	data, err := contracts.PackClaimWithSignature(rows, fx.c.SignClaimBatch(authorizer, rows))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func (fx *batchFixture) refundData(t *testing.T, nonce, amount int64) []byte {
	t.Helper()
	sig := fx.c.SignRefund(fx.authorizer, fx.id, big.NewInt(nonce), big.NewInt(amount))
	data, err := contracts.PackRefundWithSignature(fx.cfg, big.NewInt(amount), big.NewInt(nonce), sig)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// channelState reads channels(id): balance and totalClaimed.
func (fx *batchFixture) channelState(t *testing.T, id common.Hash) (balance, claimed int64) {
	t.Helper()
	out := fx.view(t, "channels", id)
	return out[0].(*big.Int).Int64(), out[1].(*big.Int).Int64()
}

func (fx *batchFixture) receiverState(t *testing.T, receiver common.Address) (claimed, settled int64) {
	t.Helper()
	out := fx.view(t, "receivers", receiver, fx.token)
	return out[0].(*big.Int).Int64(), out[1].(*big.Int).Int64()
}

func (fx *batchFixture) view(t *testing.T, method string, args ...any) []any {
	t.Helper()
	data, err := contracts.PackBatchSettlement(method, args...)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := fx.c.Call(context.Background(), fx.relayer.Address, contracts.BatchSettlementAddress, data)
	if err != nil {
		t.Fatalf("%s: %v", method, err)
	}
	out, err := contracts.BatchSettlementABI.Unpack(method, raw)
	if err != nil {
		t.Fatalf("unpacking %s: %v", method, err)
	}
	return out
}

func (fx *batchFixture) balance(addr common.Address) int64 {
	return fx.c.BalanceOf(fx.token, addr).Int64()
}

func (fx *batchFixture) escrowHolds(t *testing.T, want int64) {
	t.Helper()
	if got := fx.balance(contracts.BatchSettlementAddress); got != want {
		t.Errorf("the escrow holds %d, want %d", got, want)
	}
}

// deposited opens fx's channel with amount through the ERC-3009 collector.
func (fx *batchFixture) deposited(t *testing.T, amount int64) {
	t.Helper()
	fx.mustSend(t, fx.relayer, fx.depositERC3009Data(t, fx.cfg, big.NewInt(amount)), "deposit")
}

func TestBatchSettlementContractsSitAtTheSDKAddresses(t *testing.T) {
	c := New(t)
	for addr, want := range map[common.Address][]byte{
		contracts.BatchSettlementAddress:         contracts.BatchSettlementRuntimeCode(),
		contracts.ERC3009DepositCollectorAddress: contracts.ERC3009DepositCollectorRuntimeCode(),
		contracts.Permit2DepositCollectorAddress: contracts.Permit2DepositCollectorRuntimeCode(),
	} {
		code, err := c.Client.CodeAt(context.Background(), addr, nil)
		if err != nil || string(code) != string(want) {
			t.Errorf("code at %s: %d bytes (%v), want the runtime code", addr, len(code), err)
		}
	}
}

func TestBatchChannelIDIsTheSDKsTypedDataHashOnChain(t *testing.T) {
	fx := newBatchFixture(t)
	out := fx.view(t, "getChannelId", fx.cfg)
	if got := common.Hash(out[0].([32]byte)); got != fx.id {
		t.Errorf("getChannelId = %s, the EIP-712 hash of the config is %s", got, fx.id)
	}
	// Another chain gives another channel: the chain id is in the domain.
	if other := ChannelID(big.NewInt(AltChainID), fx.cfg); other == fx.id {
		t.Error("the channel id does not depend on the chain id")
	}
}

func TestBatchDepositThroughTheERC3009CollectorCreditsTheChannel(t *testing.T) {
	fx := newBatchFixture(t)
	r := fx.mustSend(t, fx.relayer, fx.depositERC3009Data(t, fx.cfg, big.NewInt(1_000_000)), "deposit")
	t.Logf("gas: ERC-3009 deposit (first, opens the channel) %d", r.GasUsed)
	if bal, claimed := fx.channelState(t, fx.id); bal != 1_000_000 || claimed != 0 {
		t.Errorf("channel after deposit: balance %d, claimed %d; want 1000000, 0", bal, claimed)
	}
	if got := fx.balance(fx.payer.Address); got != batchMint-1_000_000 {
		t.Errorf("payer holds %d, want %d", got, batchMint-1_000_000)
	}
	fx.escrowHolds(t, 1_000_000)
	if got := fx.balance(contracts.ERC3009DepositCollectorAddress); got != 0 {
		t.Errorf("the collector kept %d", got)
	}
	// A top-up adds to the same channel.
	r = fx.mustSend(t, fx.relayer, fx.depositERC3009Data(t, fx.cfg, big.NewInt(500)), "top-up")
	t.Logf("gas: ERC-3009 deposit (top-up) %d", r.GasUsed)
	if bal, _ := fx.channelState(t, fx.id); bal != 1_000_500 {
		t.Errorf("channel after top-up: balance %d, want 1000500", bal)
	}
}

func TestBatchDepositAuthorizationBindsItsChannel(t *testing.T) {
	fx := newBatchFixture(t)
	// The payer's signed deposit for its channel, replayed into a channel paying someone else.
	data := fx.depositERC3009Data(t, fx.cfg, big.NewInt(1_000))
	args, err := contracts.BatchSettlementABI.Methods["deposit"].Inputs.Unpack(data[4:])
	if err != nil {
		t.Fatal(err)
	}
	other := fx.channel(DeriveAccount("thief", 0), DeriveAccount("thief", 0))
	stolen, err := contracts.PackBatchDeposit(other, big.NewInt(1_000), contracts.ERC3009DepositCollectorAddress, args[3].([]byte))
	if err != nil {
		t.Fatal(err)
	}
	if why, _ := fx.send(t, fx.relayer, stolen); why != "FiatTokenV2: invalid signature" {
		t.Errorf("a deposit authorization replayed into another channel: %q, want the token's invalid signature", why)
	}
	// Nobody but the escrow may drive a collector: the authorization names the collector as payee.
	collect, err := contracts.ERC3009DepositCollectorABI.Pack("collect", fx.payer.Address, fx.token, big.NewInt(1_000), fx.id, args[3].([]byte))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fx.c.Call(context.Background(), fx.relayer.Address, contracts.ERC3009DepositCollectorAddress, collect); RevertReason(err) != "OnlyBatchSettlement()" {
		t.Errorf("collect called directly: %v, want OnlyBatchSettlement()", err)
	}
	if why, _ := fx.send(t, fx.relayer, data); why != "" {
		t.Fatalf("the genuine deposit reverted: %s", why)
	}
	if why, _ := fx.send(t, fx.relayer, data); why != "FiatTokenV2: authorization is used or canceled" {
		t.Errorf("the same deposit again: %q, want the token's used-authorization refusal", why)
	}
	fx.escrowHolds(t, 1_000)
}

func TestBatchDepositThroughThePermit2CollectorCreditsTheChannel(t *testing.T) {
	fx := newBatchFixture(t)
	amount, nonce, deadline := big.NewInt(70_000), RandomNonce(), new(big.Int).SetUint64(fx.c.HeadTime()+3600)
	sign := func() []byte {
		return fx.c.SignTypedData(fx.payer, DepositPermit2TypedData(fx.c.ChainID, fx.token, amount, nonce, deadline, fx.id))
	}
	// No allowance to Permit2 yet: the payer's EIP-2612 permit rides along in the collector data.
	permit := fx.c.signPermitOn(fx.token, fx.payer, contracts.Permit2Address, amount, deadline.Uint64())
	permitData, err := contracts.EncodeEIP2612PermitData(permit.ProxyPermit())
	if err != nil {
		t.Fatal(err)
	}
	collectorData, err := contracts.EncodePermit2CollectorData(nonce, deadline, sign(), permitData)
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.PackBatchDeposit(fx.cfg, amount, contracts.Permit2DepositCollectorAddress, collectorData)
	if err != nil {
		t.Fatal(err)
	}
	r := fx.mustSend(t, fx.relayer, data, "permit2 deposit")
	t.Logf("gas: Permit2 deposit with an EIP-2612 permit %d", r.GasUsed)
	if bal, _ := fx.channelState(t, fx.id); bal != 70_000 {
		t.Errorf("channel after the permit2 deposit: balance %d, want 70000", bal)
	}
	fx.escrowHolds(t, 70_000)
	if why, _ := fx.send(t, fx.relayer, data); why != "InvalidNonce()" {
		t.Errorf("the same permit2 deposit again: %q, want Permit2's InvalidNonce()", why)
	}
	// With the allowance in place, a plain deposit (no permit segment), as the SDK's standard branch sends.
	nonce = RandomNonce()
	collectorData, err = contracts.EncodePermit2CollectorData(nonce, deadline, sign(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if data, err = contracts.PackBatchDeposit(fx.cfg, amount, contracts.Permit2DepositCollectorAddress, collectorData); err != nil {
		t.Fatal(err)
	}
	fx.c.mustTransact(fx.payer, fx.token, contracts.USDCoinABI, "approve", contracts.Permit2Address, amount)
	r = fx.mustSend(t, fx.relayer, data, "plain permit2 deposit")
	t.Logf("gas: Permit2 deposit (top-up, allowance in place) %d", r.GasUsed)
	if bal, _ := fx.channelState(t, fx.id); bal != 140_000 {
		t.Errorf("channel after two permit2 deposits: balance %d, want 140000", bal)
	}
	if got := fx.balance(fx.payer.Address); got != batchMint-140_000 {
		t.Errorf("payer holds %d, want %d", got, batchMint-140_000)
	}
	// A signature for this channel cannot fund another one.
	nonce = RandomNonce()
	collectorData, _ = contracts.EncodePermit2CollectorData(nonce, deadline, sign(), nil)
	other := fx.channel(DeriveAccount("thief", 0), DeriveAccount("thief", 0))
	stolen, _ := contracts.PackBatchDeposit(other, amount, contracts.Permit2DepositCollectorAddress, collectorData)
	if why, _ := fx.send(t, fx.relayer, stolen); why != "InvalidSigner()" {
		t.Errorf("a permit2 deposit replayed into another channel: %q, want Permit2's InvalidSigner()", why)
	}
}

func TestBatchClaimMovesExactlyTheClaimedAmountOnce(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 1_000_000)

	// The payer signs cumulative vouchers of 1000 per request: the first claim takes one request's worth, the next
	// the latest voucher, 100 requests' worth in all (a claim costs the same whatever the number of vouchers).
	r := fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 1_000, 1_000)), "first claim")
	t.Logf("gas: claimWithSignature, one channel, first claim (1 voucher's worth) %d", r.GasUsed)
	if _, claimed := fx.channelState(t, fx.id); claimed != 1_000 {
		t.Errorf("claimed %d after the first claim, want 1000", claimed)
	}
	row := fx.claimRow(fx.cfg, fx.payer, 100_000, 100_000)
	r = fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, row), "claim")
	t.Logf("gas: claimWithSignature, one channel, a later claim (up to 100 vouchers' worth) %d", r.GasUsed)
	if bal, claimed := fx.channelState(t, fx.id); bal != 1_000_000 || claimed != 100_000 {
		t.Errorf("channel after claim: balance %d, claimed %d; want 1000000, 100000", bal, claimed)
	}
	if claimed, settled := fx.receiverState(t, fx.receiver.Address); claimed != 100_000 || settled != 0 {
		t.Errorf("receiver after claim: claimed %d, settled %d; want 100000, 0", claimed, settled)
	}
	// The same cumulative amount again moves nothing.
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, row), "the same claim again")
	if _, claimed := fx.channelState(t, fx.id); claimed != 100_000 {
		t.Errorf("claimed %d after the same claim twice, want 100000", claimed)
	}

	data, _ := contracts.PackBatchSettle(fx.receiver.Address, fx.token)
	r = fx.mustSend(t, fx.relayer, data, "settle")
	t.Logf("gas: settle %d", r.GasUsed)
	if got := fx.balance(fx.receiver.Address); got != 100_000 {
		t.Errorf("receiver holds %d after settle, want 100000", got)
	}
	fx.mustSend(t, fx.relayer, data, "a second settle")
	if got := fx.balance(fx.receiver.Address); got != 100_000 {
		t.Errorf("receiver holds %d after a second settle, want 100000", got)
	}
	fx.escrowHolds(t, 900_000)

	// A later voucher raises the claim by the difference only; the receiver itself may claim without a signature.
	data, _ = contracts.PackClaim([]contracts.VoucherClaim{fx.claimRow(fx.cfg, fx.payer, 101_000, 101_000)})
	r = fx.mustSend(t, fx.receiver, data, "claim by the receiver")
	t.Logf("gas: claim by the receiver, one row %d", r.GasUsed)
	if claimed, _ := fx.receiverState(t, fx.receiver.Address); claimed != 101_000 {
		t.Errorf("receiver claimed %d in all, want 101000", claimed)
	}
}

func TestBatchClaimOfAHundredChannelsInOneTransaction(t *testing.T) {
	fx := newBatchFixture(t)
	var rows []contracts.VoucherClaim
	var deposits []common.Hash
	for i := range 100 {
		cfg := fx.cfg
		copy(cfg.Salt[:], crypto.Keccak256([]byte{byte(i)}))
		tx, err := fx.c.SendTx(context.Background(), fx.relayer, &contracts.BatchSettlementAddress, fx.depositERC3009Data(t, cfg, big.NewInt(10_000)))
		if err != nil {
			t.Fatal(err)
		}
		deposits = append(deposits, tx.Hash())
		rows = append(rows, fx.claimRow(cfg, fx.payer, 1_000, 1_000))
	}
	receipts, err := fx.c.CommitUntilIncluded(context.Background(), deposits...)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range receipts {
		if r.Status != types.ReceiptStatusSuccessful {
			t.Fatalf("a deposit reverted")
		}
	}
	r := fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, rows...), "claim of 100 channels")
	t.Logf("gas: claimWithSignature, 100 channels %d (%d a channel)", r.GasUsed, r.GasUsed/100)
	if claimed, _ := fx.receiverState(t, fx.receiver.Address); claimed != 100_000 {
		t.Errorf("receiver claimed %d over 100 channels, want 100000", claimed)
	}
	data, _ := contracts.PackBatchSettle(fx.receiver.Address, fx.token)
	fx.mustSend(t, fx.relayer, data, "settle")
	if got := fx.balance(fx.receiver.Address); got != 100_000 {
		t.Errorf("receiver holds %d, want 100000", got)
	}
	fx.escrowHolds(t, 100*10_000-100_000)
}

func TestBatchClaimRefusals(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 4_000, 4_000)), "first claim")
	stranger := DeriveAccount("stranger", 0)
	otherReceiver, otherAuthorizer := DeriveAccount("merchant", 1), DeriveAccount("authorizer", 1)

	tests := []struct {
		name   string
		sender *Account
		data   func() []byte
		want   string
	}{
		{"a voucher signed by someone else", fx.relayer, func() []byte {
			return fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, stranger, 5_000, 5_000))
		}, "InvalidSignature()"},
		{"a cumulative amount above the deposit", fx.relayer, func() []byte {
			return fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 10_001, 10_001))
		}, "ClaimExceedsBalance()"},
		{"a claim above its voucher", fx.relayer, func() []byte {
			return fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 5_000, 5_001))
		}, "ClaimExceedsCeiling()"},
		{"a batch signed by another receiver's authorizer", fx.relayer, func() []byte {
			return fx.claimWithSignatureData(t, otherAuthorizer, fx.claimRow(fx.cfg, fx.payer, 5_000, 5_000))
		}, "InvalidSignature()"},
		{"a batch mixing another receiver's channel", fx.relayer, func() []byte {
			return fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 5_000, 5_000),
				fx.claimRow(fx.channel(otherReceiver, otherAuthorizer), fx.payer, 5_000, 5_000))
		}, "NotReceiverAuthorizer()"},
		{"another receiver claiming this channel", otherReceiver, func() []byte {
			data, _ := contracts.PackClaim([]contracts.VoucherClaim{fx.claimRow(fx.cfg, fx.payer, 5_000, 5_000)})
			return data
		}, "NotAuthorizedToClaim()"},
		{"an empty batch", fx.relayer, func() []byte { return fx.claimWithSignatureData(t, fx.authorizer) }, "EmptyBatch()"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if why, _ := fx.send(t, tt.sender, tt.data()); why != tt.want {
				t.Errorf("reverted with %q, want %q", why, tt.want)
			}
		})
	}

	// A claim below what was already claimed changes nothing (and does not block the rest of its batch).
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 3_000, 3_000)), "a stale claim")
	if bal, claimed := fx.channelState(t, fx.id); bal != 10_000 || claimed != 4_000 {
		t.Errorf("channel after a stale claim: balance %d, claimed %d; want 10000, 4000", bal, claimed)
	}
	if claimed, _ := fx.receiverState(t, fx.receiver.Address); claimed != 4_000 {
		t.Errorf("receiver claimed %d after a stale claim, want 4000", claimed)
	}
	fx.escrowHolds(t, 10_000)
	if got := fx.balance(fx.receiver.Address); got != 0 {
		t.Errorf("receiver holds %d before any settle", got)
	}
}

func TestBatchRefundReturnsExactlyTheUnclaimedRestOnce(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 4_000, 4_000)), "claim")
	before := fx.balance(fx.payer.Address)

	// Asked for more than the rest, the refund returns the rest: what was claimed stays the receiver's.
	refund := fx.refundData(t, 0, 1_000_000)
	r := fx.mustSend(t, fx.relayer, refund, "refund")
	t.Logf("gas: refundWithSignature %d", r.GasUsed)
	if got := fx.balance(fx.payer.Address) - before; got != 6_000 {
		t.Errorf("refund returned %d to the payer, want 6000", got)
	}
	if bal, claimed := fx.channelState(t, fx.id); bal != 4_000 || claimed != 4_000 {
		t.Errorf("channel after refund: balance %d, claimed %d; want 4000, 4000", bal, claimed)
	}
	if out := fx.view(t, "refundNonce", fx.id); out[0].(*big.Int).Int64() != 1 {
		t.Errorf("refund nonce %s after one refund, want 1", out[0])
	}
	if why, _ := fx.send(t, fx.relayer, refund); why != "InvalidRefundNonce()" {
		t.Errorf("the refund replayed: %q, want InvalidRefundNonce()", why)
	}
	// A refund signed by someone other than the receiverAuthorizer.
	sig := fx.c.SignRefund(fx.payer, fx.id, big.NewInt(1), big.NewInt(1))
	forged, _ := contracts.PackRefundWithSignature(fx.cfg, big.NewInt(1), big.NewInt(1), sig)
	if why, _ := fx.send(t, fx.relayer, forged); why != "InvalidSignature()" {
		t.Errorf("a refund signed by the payer: %q, want InvalidSignature()", why)
	}
	// Only the receiver side may refund without a signature.
	direct, _ := contracts.PackRefund(fx.cfg, big.NewInt(1))
	if why, _ := fx.send(t, fx.payer, direct); why != "NotAuthorizedToRefund()" {
		t.Errorf("a direct refund by the payer: %q, want NotAuthorizedToRefund()", why)
	}
	// The claimed part still settles in full.
	data, _ := contracts.PackBatchSettle(fx.receiver.Address, fx.token)
	fx.mustSend(t, fx.relayer, data, "settle")
	if got := fx.balance(fx.receiver.Address); got != 4_000 {
		t.Errorf("receiver holds %d, want 4000", got)
	}
	if got := fx.balance(fx.payer.Address) - before; got != 6_000 {
		t.Errorf("payer got %d back in all, want 6000", got)
	}
	fx.escrowHolds(t, 0)
}

func TestBatchWithdrawAfterTheDelayReturnsExactlyTheRest(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 2_500, 2_500)), "claim")
	before := fx.balance(fx.payer.Address)

	initiate := func(amount int64) []byte {
		data, _ := contracts.PackInitiateWithdraw(fx.cfg, big.NewInt(amount))
		return data
	}
	if why, _ := fx.send(t, fx.payer, initiate(7_501)); why != "WithdrawAmountExceedsAvailable()" {
		t.Errorf("withdrawing more than the unclaimed rest: %q, want WithdrawAmountExceedsAvailable()", why)
	}
	if why, _ := fx.send(t, fx.receiver, initiate(7_500)); why != "NotPayer()" {
		t.Errorf("the receiver initiating a withdrawal: %q, want NotPayer()", why)
	}
	fx.mustSend(t, fx.payer, initiate(7_500), "initiateWithdraw")
	if why, _ := fx.send(t, fx.payer, initiate(1)); why != "WithdrawalAlreadyPending()" {
		t.Errorf("a second withdrawal: %q, want WithdrawalAlreadyPending()", why)
	}
	finalize, _ := contracts.PackFinalizeWithdraw(fx.cfg)
	if why, _ := fx.send(t, fx.payer, finalize); why != "WithdrawDelayNotElapsed()" {
		t.Errorf("finalizing before the delay: %q, want WithdrawDelayNotElapsed()", why)
	}
	// During the delay the receiver can still claim what it was signed: the withdrawal then gets the rest only.
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 3_000, 3_000)), "claim during the delay")
	fx.c.AdjustTime(contracts.MinWithdrawDelay * time.Second)
	r := fx.mustSend(t, fx.payer, finalize, "finalizeWithdraw")
	t.Logf("gas: finalizeWithdraw %d", r.GasUsed)
	if got := fx.balance(fx.payer.Address) - before; got != 7_000 {
		t.Errorf("withdrawal returned %d, want 7000 (the deposit less the 3000 claimed)", got)
	}
	if bal, claimed := fx.channelState(t, fx.id); bal != 3_000 || claimed != 3_000 {
		t.Errorf("channel after withdrawal: balance %d, claimed %d; want 3000, 3000", bal, claimed)
	}
	if why, _ := fx.send(t, fx.payer, finalize); why != "WithdrawalNotPending()" {
		t.Errorf("finalizing twice: %q, want WithdrawalNotPending()", why)
	}
	// A voucher above what is left can no longer be claimed.
	if why, _ := fx.send(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 3_001, 3_001))); why != "ClaimExceedsBalance()" {
		t.Errorf("a claim after the withdrawal: %q, want ClaimExceedsBalance()", why)
	}
	data, _ := contracts.PackBatchSettle(fx.receiver.Address, fx.token)
	fx.mustSend(t, fx.relayer, data, "settle")
	if got := fx.balance(fx.receiver.Address); got != 3_000 {
		t.Errorf("receiver holds %d, want 3000", got)
	}
	fx.escrowHolds(t, 0)
}

func TestBatchRefundShrinksAPendingWithdrawal(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	data, _ := contracts.PackInitiateWithdraw(fx.cfg, big.NewInt(8_000))
	fx.mustSend(t, fx.payer, data, "initiateWithdraw")
	fx.mustSend(t, fx.relayer, fx.refundData(t, 0, 5_000), "refund")
	out := fx.view(t, "pendingWithdrawals", fx.id)
	if amount := out[0].(*big.Int).Int64(); amount != 3_000 {
		t.Errorf("pending withdrawal %d after a refund of 5000, want 3000", amount)
	}
	fx.c.AdjustTime(contracts.MinWithdrawDelay * time.Second)
	before := fx.balance(fx.payer.Address)
	finalize, _ := contracts.PackFinalizeWithdraw(fx.cfg)
	fx.mustSend(t, fx.payer, finalize, "finalizeWithdraw")
	if got := fx.balance(fx.payer.Address) - before; got != 3_000 {
		t.Errorf("withdrawal returned %d, want 3000", got)
	}
	fx.escrowHolds(t, 2_000)
}

func TestBatchMulticallClaimsAndRefundsAtOnce(t *testing.T) {
	// The SDK's facilitator sends a refund with the last claim as multicall([claimWithSignature, refundWithSignature]).
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	before := fx.balance(fx.payer.Address)
	data, err := contracts.PackBatchMulticall([][]byte{
		fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 1_234, 1_234)),
		fx.refundData(t, 0, 10_000),
	})
	if err != nil {
		t.Fatal(err)
	}
	fx.mustSend(t, fx.relayer, data, "multicall")
	if got := fx.balance(fx.payer.Address) - before; got != 10_000-1_234 {
		t.Errorf("refund returned %d, want %d", got, 10_000-1_234)
	}
	if claimed, _ := fx.receiverState(t, fx.receiver.Address); claimed != 1_234 {
		t.Errorf("receiver claimed %d, want 1234", claimed)
	}
}

func TestBatchDepositRefusals(t *testing.T) {
	fx := newBatchFixture(t)
	short := fx.cfg
	short.WithdrawDelay = contracts.MinWithdrawDelay - 1
	noAuthorizer := fx.cfg
	noAuthorizer.ReceiverAuthorizer = common.Address{}
	for _, tt := range []struct {
		name string
		cfg  contracts.ChannelConfig
		want string
	}{
		{"a withdraw delay below 15 minutes", short, "WithdrawDelayOutOfRange()"},
		{"no receiver authorizer", noAuthorizer, "InvalidChannel()"},
	} {
		if why, _ := fx.send(t, fx.relayer, fx.depositERC3009Data(t, tt.cfg, big.NewInt(1))); why != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, why, tt.want)
		}
	}
	fx.escrowHolds(t, 0)
}

// signPermitOn signs an EIP-2612 permit of owner for spender on a USDCoin at token.
func (c *Chain) signPermitOn(token common.Address, owner *Account, spender common.Address, value *big.Int, deadline uint64) *ERC2612Permit {
	c.tb.Helper()
	nonce := c.readUint(token, contracts.USDCoinABI, "nonces", owner.Address)
	p := &ERC2612Permit{Owner: owner.Address, Spender: spender, Value: new(big.Int).Set(value), Nonce: nonce, Deadline: new(big.Int).SetUint64(deadline)}
	p.Signature = c.SignTypedData(owner, PermitTypedData(contracts.USDCoinName, contracts.USDCoinVersion, c.ChainID, token,
		owner.Address.Hex(), spender.Hex(), value.String(), nonce.String(), p.Deadline.String()))
	return p
}

func TestBatchTypeStringsAreTheContractsTypehashes(t *testing.T) {
	fx := newBatchFixture(t)
	for method, typ := range map[string]string{
		"CHANNEL_CONFIG_TYPEHASH": contracts.ChannelConfigType,
		"VOUCHER_TYPEHASH":        contracts.VoucherType,
		"REFUND_TYPEHASH":         contracts.RefundType,
		"CLAIM_ENTRY_TYPEHASH":    contracts.ClaimEntryType,
		"CLAIM_BATCH_TYPEHASH":    contracts.ClaimBatchType,
	} {
		if got := common.Hash(fx.view(t, method)[0].([32]byte)); got != crypto.Keccak256Hash([]byte(typ)) {
			t.Errorf("%s = %s, keccak(%q) = %s", method, got, typ, crypto.Keccak256Hash([]byte(typ)))
		}
	}
	data, _ := contracts.Permit2DepositCollectorABI.Pack("WITNESS_TYPE_STRING")
	raw, err := fx.c.Call(context.Background(), fx.relayer.Address, contracts.Permit2DepositCollectorAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := contracts.Permit2DepositCollectorABI.Unpack("WITNESS_TYPE_STRING", raw)
	if err != nil || out[0].(string) != contracts.DepositWitnessTypeString {
		t.Errorf("the Permit2 collector's witness type string %v (%v), want %q", out, err, contracts.DepositWitnessTypeString)
	}
	// The digest the contract checks a voucher against is the one the typed data gives.
	want, _, err := apitypesHash(VoucherTypedData(fx.c.ChainID, fx.id, big.NewInt(42)))
	if err != nil {
		t.Fatal(err)
	}
	if got := common.Hash(fx.view(t, "getVoucherDigest", fx.id, big.NewInt(42))[0].([32]byte)); got != want {
		t.Errorf("getVoucherDigest = %s, the typed data hashes to %s", got, want)
	}
}

func apitypesHash(td apitypes.TypedData) (common.Hash, string, error) {
	hash, raw, err := apitypes.TypedDataAndHash(td)
	return common.BytesToHash(hash), raw, err
}

func TestBatchVoucherWithoutAPayerAuthorizerIsThePayersOwn(t *testing.T) {
	fx := newBatchFixture(t)
	fx.cfg.PayerAuthorizer = common.Address{}
	fx.id = ChannelID(fx.c.ChainID, fx.cfg)
	fx.deposited(t, 10_000)
	// Without a payerAuthorizer the payer itself signs (ECDSA here; ERC-1271 for a contract payer).
	if why, _ := fx.send(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, DeriveAccount("stranger", 0), 500, 500))); why != "InvalidSignature()" {
		t.Errorf("a voucher signed by a stranger: %q, want InvalidSignature()", why)
	}
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 500, 500)), "claim")
	if bal, claimed := fx.channelState(t, fx.id); bal != 10_000 || claimed != 500 {
		t.Errorf("channel after claim: balance %d, claimed %d; want 10000, 500", bal, claimed)
	}
	// The payer alone withdraws: a zero payerAuthorizer authorises nobody.
	data, _ := contracts.PackInitiateWithdraw(fx.cfg, big.NewInt(1))
	if why, _ := fx.send(t, fx.relayer, data); why != "NotPayer()" {
		t.Errorf("a stranger initiating a withdrawal: %q, want NotPayer()", why)
	}
	fx.mustSend(t, fx.payer, data, "initiateWithdraw by the payer")
}
