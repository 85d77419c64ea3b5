package chain

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchChain is a route's batch-settlement terms on a simulated chain with the escrow in its genesis, and one
// payer's channel to it (the payer signs its own vouchers as payerAuthorizer).
type batchChain struct {
	c                           *chaintest.Chain
	token                       common.Address
	payer, receiver, authorizer *chaintest.Account
	relayer                     *chaintest.Account
	rq                          x402.BatchRequirements
	terms                       *BatchTerms
	cfg                         contracts.ChannelConfig
	id                          common.Hash
}

func newBatchChain(t *testing.T) *batchChain {
	t.Helper()
	c := chaintest.New(t)
	b := &batchChain{c: c, token: c.DeployUSDCoin(big.NewInt(1_000_000_000)), payer: c.Payers[0],
		receiver: chaintest.DeriveAccount("merchant", 0), authorizer: chaintest.DeriveAccount("authorizer", 0), relayer: c.Wallets[0]}
	b.rq = x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: fmt.Sprintf("eip155:%d", c.ChainID), Amount: "1000",
		Asset: b.token.Hex(), PayTo: b.receiver.Address.Hex(), MaxTimeoutSeconds: 300,
		Extra: x402.BatchExtra{ReceiverAuthorizer: b.authorizer.Address.Hex(), WithdrawDelay: contracts.MinWithdrawDelay,
			Name: contracts.USDCoinName, Version: contracts.USDCoinVersion}}
	terms, err := NewBatchTerms(b.rq, c.ChainID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	b.terms = terms
	b.cfg = contracts.ChannelConfig{Payer: b.payer.Address, PayerAuthorizer: b.payer.Address, Receiver: b.receiver.Address,
		ReceiverAuthorizer: b.authorizer.Address, Token: b.token, WithdrawDelay: contracts.MinWithdrawDelay}
	b.cfg.Salt[31] = 0x5a
	b.id = chaintest.ChannelID(c.ChainID, b.cfg)
	return b
}

// wireConfig is the channel's configuration as a payment carries it.
func (b *batchChain) wireConfig() *x402.ChannelConfig {
	return &x402.ChannelConfig{Payer: b.cfg.Payer.Hex(), PayerAuthorizer: b.cfg.PayerAuthorizer.Hex(), Receiver: b.cfg.Receiver.Hex(),
		ReceiverAuthorizer: b.cfg.ReceiverAuthorizer.Hex(), Token: b.cfg.Token.Hex(), WithdrawDelay: int64(b.cfg.WithdrawDelay),
		Salt: hexutil.Encode(b.cfg.Salt[:])}
}

// voucher is the payer's voucher payment for cumulative.
func (b *batchChain) voucher(cumulative int64) *x402.BatchPayment {
	return b.voucherBy(b.payer, cumulative)
}

// voucherBy is a voucher payment for cumulative signed by signer's key.
func (b *batchChain) voucherBy(signer *chaintest.Account, cumulative int64) *x402.BatchPayment {
	sig := b.c.SignVoucher(signer, b.id, big.NewInt(cumulative))
	return &x402.BatchPayment{X402Version: 2, Accepted: b.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: b.wireConfig(),
		Voucher: &x402.BatchVoucherFields{ChannelID: b.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative), Signature: hexutil.Encode(sig)}}}
}

// send sends calldata from sender to the escrow and returns the revert reason, "" when it was mined.
func (b *batchChain) send(t *testing.T, sender *chaintest.Account, data []byte) string {
	t.Helper()
	ctx := context.Background()
	if _, err := b.c.Call(ctx, sender.Address, contracts.BatchSettlementAddress, data); err != nil {
		if why := chaintest.RevertReason(err); why != "" {
			return why
		}
		t.Fatal(err)
	}
	if _, err := b.c.Transact(ctx, sender, contracts.BatchSettlementAddress, data); err != nil {
		t.Fatal(err)
	}
	return ""
}

// deposit deposits amount into the channel through the ERC-3009 collector, as a facilitator does.
func (b *batchChain) deposit(t *testing.T, amount int64) {
	t.Helper()
	salt := chaintest.RandomNonce()
	validBefore := new(big.Int).SetUint64(b.c.HeadTime() + 3600)
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, b.c.ChainID,
		b.token, b.payer.Address, big.NewInt(amount), new(big.Int), validBefore, contracts.ERC3009DepositNonce(b.id, common.BigToHash(salt))))
	collectorData, err := contracts.EncodeERC3009CollectorData(new(big.Int), validBefore, salt, sig)
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.PackBatchDeposit(b.cfg, big.NewInt(amount), contracts.ERC3009DepositCollectorAddress, collectorData)
	if err != nil {
		t.Fatal(err)
	}
	if why := b.send(t, b.relayer, data); why != "" {
		t.Fatalf("deposit reverted: %s", why)
	}
}

// read is the channel as the engine reads it from the chain: balance, claimed, and the head block's time.
func (b *batchChain) read(t *testing.T) ChannelView {
	t.Helper()
	data, _ := contracts.BatchSettlementABI.Pack("channels", b.id)
	raw, err := b.c.Call(context.Background(), b.relayer.Address, contracts.BatchSettlementAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := contracts.BatchSettlementABI.Unpack("channels", raw)
	if err != nil {
		t.Fatal(err)
	}
	return ChannelView{Balance: out[0].(*big.Int), TotalClaimed: out[1].(*big.Int), Charged: new(big.Int), ReadAt: b.now()}
}

func (b *batchChain) now() time.Time { return time.Unix(int64(b.c.HeadTime()), 0) }

// claim sends the receiver authorizer's claim of an accepted voucher, as the engine will: the accepted signature,
// the cumulative amount claimed in full. It returns the revert reason, "" when the claim was mined.
func (b *batchChain) claim(t *testing.T, av AcceptedVoucher) string {
	t.Helper()
	return b.claimSigned(t, av.Cumulative, av.Signature[:])
}

// claimSigned sends the receiver authorizer's claim of cumulative under the voucher signature sig.
func (b *batchChain) claimSigned(t *testing.T, cumulative *big.Int, sig []byte) string {
	t.Helper()
	rows := []contracts.VoucherClaim{{Voucher: contracts.Voucher{Channel: b.cfg, MaxClaimableAmount: cumulative},
		Signature: sig, TotalClaimed: cumulative}}
	data, err := contracts.PackClaimWithSignature(rows, b.c.SignClaimBatch(b.authorizer, rows))
	if err != nil {
		t.Fatal(err)
	}
	return b.send(t, b.relayer, data)
}

// A view of the channel read before the payer asked to withdraw cannot vouch for the deposit once the withdrawal
// could have been finalized: the payer withdraws everything, then pays with a voucher the gateway would accept
// against the old read and whose claim the escrow refuses (a response served unpaid).
func TestCheckVoucherRefusesAChannelReadLongerAgoThanTheWithdrawDelay(t *testing.T) {
	b := newBatchChain(t)
	b.deposit(t, 10_000)
	view := b.read(t)
	if _, err := b.terms.CheckVoucher(b.voucher(1000), view, b.now()); err != nil {
		t.Fatalf("the first voucher against a fresh read: %v", err)
	}

	// Unseen by the gateway, the payer withdraws it all after the delay.
	data, _ := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(10_000))
	if why := b.send(t, b.payer, data); why != "" {
		t.Fatalf("initiateWithdraw: %s", why)
	}
	b.c.AdjustTime(contracts.MinWithdrawDelay * time.Second)
	data, _ = contracts.PackFinalizeWithdraw(b.cfg)
	if why := b.send(t, b.payer, data); why != "" {
		t.Fatalf("finalizeWithdraw: %s", why)
	}

	av, err := b.terms.CheckVoucher(b.voucher(1000), view, b.now())
	if err == nil {
		why := b.claim(t, av)
		t.Fatalf("a voucher checked against a read %s old was accepted; its claim: %q", b.now().Sub(view.ReadAt), why)
	}
	if !IsStaleChannelView(err) {
		t.Fatalf("got %v, want the stale-view error", err)
	}
	// Read again, the channel is empty: the payer is refused.
	var r *BatchRefusal
	if _, err := b.terms.CheckVoucher(b.voucher(1000), b.read(t), b.now()); !errors.As(err, &r) || r.Reason != x402.ReasonBatchChannelNotFound {
		t.Fatalf("against a fresh read: %v, want %s", err, x402.ReasonBatchChannelNotFound)
	}
}

// A voucher accepted against a read inside its window is claimable until the ClaimBy it carries, even when the
// payer asks to withdraw right after the read.
func TestAnAcceptedVoucherIsClaimableUntilItsClaimBy(t *testing.T) {
	b := newBatchChain(t)
	b.deposit(t, 10_000)
	view := b.read(t)
	data, _ := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(10_000))
	if why := b.send(t, b.payer, data); why != "" {
		t.Fatalf("initiateWithdraw: %s", why)
	}
	b.c.AdjustTime(contracts.MinWithdrawDelay*time.Second - 2*b.terms.ClaimMargin)
	av, err := b.terms.CheckVoucher(b.voucher(1000), view, b.now())
	if err != nil {
		t.Fatalf("a voucher inside the read's window: %v", err)
	}
	if want := view.ReadAt.Add(contracts.MinWithdrawDelay * time.Second); !av.ClaimBy.Equal(want) {
		t.Fatalf("ClaimBy %s, want %s (the read plus the withdraw delay)", av.ClaimBy, want)
	}
	if why := b.claim(t, av); why != "" {
		t.Fatalf("claim before ClaimBy: %s", why)
	}
}

// An ERC-3009 deposit is checked under the route's token domain, not under the one the payment's accepted names:
// a payer who signs under a domain of its choosing and names it in accepted.extra gets a deposit the token
// refuses on chain.
func TestCheckDepositAuthorizationUsesTheRoutesTokenDomain(t *testing.T) {
	b := newBatchChain(t)
	salt := chaintest.RandomNonce()
	validBefore := new(big.Int).SetUint64(uint64(time.Now().Unix()) + 3600)
	amount := big.NewInt(10_000)
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData("Not The Token", "9", b.c.ChainID,
		b.token, b.payer.Address, amount, new(big.Int), validBefore, contracts.ERC3009DepositNonce(b.id, common.BigToHash(salt))))
	p := b.voucher(1000)
	p.Payload.Type = x402.BatchDeposit
	p.Accepted.Extra.Name, p.Accepted.Extra.Version = "Not The Token", "9"
	p.Payload.Deposit = &x402.BatchDepositFields{Amount: amount.String(), Authorization: x402.BatchDepositAuthorization{
		ERC3009Authorization: &x402.BatchERC3009Authorization{ValidAfter: "0", ValidBefore: validBefore.String(),
			Salt: hexutil.Encode(common.BigToHash(salt).Bytes()), Signature: hexutil.Encode(sig)}}}

	r := b.terms.CheckDepositAuthorization(p, time.Now())
	if r == nil {
		collectorData, _ := contracts.EncodeERC3009CollectorData(new(big.Int), validBefore, salt, sig)
		data, _ := contracts.PackBatchDeposit(b.cfg, amount, contracts.ERC3009DepositCollectorAddress, collectorData)
		t.Fatalf("a deposit signed under the payer's own domain passed; on chain it reverts: %q", b.send(t, b.relayer, data))
	}
	if r.Reason != x402.ReasonBatchInvalidReceiveAuthorization {
		t.Fatalf("got %v, want %s", r, x402.ReasonBatchInvalidReceiveAuthorization)
	}
	// A deposit into a channel of another token is refused by name.
	other := *p.Payload.ChannelConfig
	other.Token = b.receiver.Address.Hex()
	p.Payload.ChannelConfig = &other
	if r := b.terms.CheckDepositAuthorization(p, time.Now()); r == nil || r.Reason != x402.ReasonBatchTokenMismatch {
		t.Fatalf("a channel of another token: %v, want %s", r, x402.ReasonBatchTokenMismatch)
	}
}

// A channel naming no payerAuthorizer whose payer is a contract is paid with vouchers the payer's code judges
// (ERC-1271) when the claim runs, and code can answer otherwise then than when the gateway asked: here an account
// delegated (EIP-7702) to a wallet whose owner key signs the vouchers, which re-delegates once served. Such a voucher
// is refused off chain; the payer names a payerAuthorizer (a key, checked by plain ECDSA on chain) instead.
func TestCheckVoucherRefusesAVoucherTheChannelsContractPayerJudges(t *testing.T) {
	b := newBatchChain(t)
	b.payer = b.c.Payers[1]
	b.cfg.Payer, b.cfg.PayerAuthorizer = b.payer.Address, common.Address{}
	b.id = chaintest.ChannelID(b.c.ChainID, b.cfg)
	b.deposit(t, 10_000)
	owner := chaintest.DeriveAccount("wallet owner", 0)
	wallet := b.c.CreateSmartWallet(b.c.DeploySmartWalletFactory(), contracts.SmartWalletAccount{Owner: owner.Address, Salt: big.NewInt(1)})
	b.c.Delegate(b.payer, wallet)
	view := b.read(t)
	view.PayerHasCode = b.c.HasCode(b.payer.Address)
	p := b.voucherBy(owner, 1000)

	// Right now the payer's code takes the owner's voucher: a claim would go through.
	sig := common.FromHex(p.Payload.Voucher.Signature)
	rows := []contracts.VoucherClaim{{Voucher: contracts.Voucher{Channel: b.cfg, MaxClaimableAmount: big.NewInt(1000)}, Signature: sig, TotalClaimed: big.NewInt(1000)}}
	data, _ := contracts.PackClaimWithSignature(rows, b.c.SignClaimBatch(b.authorizer, rows))
	if _, err := b.c.Call(context.Background(), b.relayer.Address, contracts.BatchSettlementAddress, data); err != nil {
		t.Fatalf("the wallet's voucher does not claim even now: %v", err)
	}
	_, err := b.terms.CheckVoucher(p, view, b.now())
	var r *BatchRefusal
	if !errors.As(err, &r) || r.Reason != x402.ReasonBatchInvalidVoucherSignature {
		t.Fatalf("a voucher the payer's code judges: %v, want a refusal %s", err, x402.ReasonBatchInvalidVoucherSignature)
	}
	// Once served, the payer changes its code, and the same claim reverts.
	b.c.Delegate(b.payer, b.token)
	if why := b.claimSigned(t, big.NewInt(1000), sig); why != "InvalidSignature()" {
		t.Fatalf("the claim after the payer changed its code: %q, want InvalidSignature()", why)
	}
}

// The terms bind vouchers to the chain they are claimed on and leave a claim time to land: a route naming another
// network than the chain, or a claim margin of nothing (or of a whole withdrawDelay), is a configuration error.
func TestNewBatchTermsRefusesAnotherChainAndAMarginNoClaimFits(t *testing.T) {
	rq := x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: "eip155:72344", Amount: "1000",
		Asset: "0x5FbDB2315678afecb367f032d93F642f64180aa3", PayTo: "0x70997970C51812dc3A010C7d01b50e0d17dc79C8", MaxTimeoutSeconds: 300,
		Extra: x402.BatchExtra{ReceiverAuthorizer: "0x90F79bf6EB2c4f870365E785982E1f101E93b906"}}
	if _, err := NewBatchTerms(rq, big.NewInt(72344), time.Minute); err != nil {
		t.Fatalf("the route's own chain: %v", err)
	}
	for _, tc := range []struct {
		name    string
		network string
		chainID *big.Int
		margin  time.Duration
	}{
		{"another chain than the network names", "eip155:72344", big.NewInt(8453), time.Minute},
		{"no chain", "eip155:72344", nil, time.Minute},
		{"a network of no chain", "solana:mainnet", big.NewInt(72344), time.Minute},
		{"no claim margin", "eip155:72344", big.NewInt(72344), 0},
		{"a negative claim margin", "eip155:72344", big.NewInt(72344), -time.Second},
		{"a margin as long as the shortest withdrawDelay", "eip155:72344", big.NewInt(72344), contracts.MinWithdrawDelay * time.Second},
	} {
		rq := rq
		rq.Network = tc.network
		if _, err := NewBatchTerms(rq, tc.chainID, tc.margin); err == nil {
			t.Errorf("%s: accepted", tc.name)
		}
	}
}

// ClaimBy is when the voucher's claim must have landed: the pending withdrawal's finalization while the whole
// balance counts, else the read plus the withdrawDelay (a withdrawal asked for after the read, or after a pending
// one is finalized, cannot be finalized sooner).
func TestAcceptedVoucherClaimByIsTheEarliestAWithdrawalCouldTakeItsCover(t *testing.T) {
	f := newBatchFixture(t)
	read := time.Unix(1_800_000_000, 0)
	now := read.Add(10 * time.Second)
	delay := 900 * time.Second
	for _, tc := range []struct {
		name        string
		requestedAt time.Time
		amount      *big.Int
		want        time.Time
	}{
		{"no withdrawal pending", time.Time{}, nil, read.Add(delay)},
		{"a withdrawal pending, the whole balance counting", read.Add(-100 * time.Second), nil, read.Add(-100*time.Second + delay)},
		{"a finalizable withdrawal leaving enough", read.Add(-delay), big.NewInt(7000), read.Add(delay)},
	} {
		view := ChannelView{Balance: big.NewInt(10_000), TotalClaimed: new(big.Int), Charged: big.NewInt(2000), ReadAt: read,
			WithdrawRequestedAt: tc.requestedAt, WithdrawAmount: tc.amount}
		av, err := f.terms.CheckVoucher(f.voucher(t, f.cfg, f.authKey, 3000), view, now)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if !av.ClaimBy.Equal(tc.want) {
			t.Errorf("%s: ClaimBy %s, want %s", tc.name, av.ClaimBy.UTC(), tc.want.UTC())
		}
	}
}
