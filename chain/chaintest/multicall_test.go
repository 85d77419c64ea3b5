package chaintest

import (
	"bytes"
	"context"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// sdkChannelReads are the reads the public @x402/evm 2.27 batch-settlement facilitator makes of a deposit's
// channel in one tryAggregate (its verify of a deposit): channels(id), the token's balanceOf(payer),
// pendingWithdrawals(id), refundNonce(id), here followed by a call that reverts (finalizeWithdraw, which only
// the payer may send: from Multicall3 it reverts NotPayer()).
func sdkChannelReads(t *testing.T, fx *batchFixture) []contracts.MulticallCall {
	t.Helper()
	pack := func(method string, args ...any) []byte {
		data, err := contracts.PackBatchSettlement(method, args...)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	balanceOf, err := contracts.StableCoinABI.Pack("balanceOf", fx.payer.Address)
	if err != nil {
		t.Fatal(err)
	}
	return []contracts.MulticallCall{
		{Target: contracts.BatchSettlementAddress, CallData: pack("channels", fx.id)},
		{Target: fx.token, CallData: balanceOf},
		{Target: contracts.BatchSettlementAddress, CallData: pack("pendingWithdrawals", fx.id)},
		{Target: contracts.BatchSettlementAddress, CallData: pack("refundNonce", fx.id)},
		{Target: contracts.BatchSettlementAddress, CallData: pack("finalizeWithdraw", fx.cfg)},
	}
}

// The SDK's batch-settlement facilitator reads a channel through Multicall3's tryAggregate(false, calls) in one
// eth_call: each read answers what the escrow's own view does, and the call that reverts is one failed row
// (its revert data kept), not a failed read. With requireSuccess, or in aggregate3 without allowFailure on
// that row, the whole reverts.
func TestMulticall3AnswersTheSDKsReadsOfAChannelInOneCall(t *testing.T) {
	fx := newBatchFixture(t)
	fx.deposited(t, 10_000)
	fx.mustSend(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, fx.payer, 2_500, 2_500)), "claim")
	withdraw, _ := contracts.PackInitiateWithdraw(fx.cfg, big.NewInt(3_000))
	fx.mustSend(t, fx.payer, withdraw, "initiateWithdraw")
	initiatedAt := new(big.Int).SetUint64(fx.c.HeadTime())
	ctx := context.Background()
	calls := sdkChannelReads(t, fx)

	data, err := contracts.PackTryAggregate(false, calls)
	if err != nil {
		t.Fatal(err)
	}
	ret, err := fx.c.Call(ctx, common.Address{}, contracts.Multicall3Address, data)
	if err != nil {
		t.Fatalf("tryAggregate(false, the SDK's reads): %v", err)
	}
	results, err := contracts.UnpackMulticallResults("tryAggregate", ret)
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != len(calls) {
		t.Fatalf("%d results for %d calls", len(results), len(calls))
	}
	for i, r := range results[:4] {
		if !r.Success {
			t.Fatalf("read %d failed: %x", i, r.ReturnData)
		}
	}
	unpack := func(method string, raw []byte) []any {
		out, err := contracts.BatchSettlementABI.Unpack(method, raw)
		if err != nil {
			t.Fatalf("decoding %s as the SDK does: %v", method, err)
		}
		return out
	}
	ch := unpack("channels", results[0].ReturnData)
	if ch[0].(*big.Int).Int64() != 10_000 || ch[1].(*big.Int).Int64() != 2_500 {
		t.Errorf("channels: balance %v, totalClaimed %v, want 10000 and 2500", ch[0], ch[1])
	}
	if got := new(big.Int).SetBytes(results[1].ReturnData); got.Int64() != fx.balance(fx.payer.Address) {
		t.Errorf("balanceOf(payer) %s, the token says %d", got, fx.balance(fx.payer.Address))
	}
	wd := unpack("pendingWithdrawals", results[2].ReturnData)
	if wd[0].(*big.Int).Int64() != 3_000 || wd[1].(*big.Int).Cmp(initiatedAt) != 0 {
		t.Errorf("pendingWithdrawals: %v at %v, want 3000 at %s", wd[0], wd[1], initiatedAt)
	}
	if nonce := unpack("refundNonce", results[3].ReturnData)[0].(*big.Int); nonce.Sign() != 0 {
		t.Errorf("refundNonce %s, want 0", nonce)
	}
	if results[4].Success {
		t.Errorf("finalizeWithdraw from Multicall3 succeeded")
	} else if why, _ := contracts.DecodeRevert(results[4].ReturnData); why != "NotPayer()" {
		t.Errorf("the failed row's return data says %q, want the escrow's NotPayer()", why)
	}

	// Failure not allowed: the whole call reverts, naming the row.
	data, _ = contracts.PackTryAggregate(true, calls)
	if _, err := fx.c.Call(ctx, common.Address{}, contracts.Multicall3Address, data); RevertReason(err) != "CallFailed(4)" {
		t.Errorf("tryAggregate(true) with a failing call: %v (%q), want a CallFailed(4) revert", err, RevertReason(err))
	}
	calls3 := make([]contracts.MulticallCall3, len(calls))
	for i, c := range calls {
		calls3[i] = contracts.MulticallCall3{Target: c.Target, CallData: c.CallData, AllowFailure: i == 4}
	}
	data, _ = contracts.PackAggregate3(calls3)
	ret, err = fx.c.Call(ctx, common.Address{}, contracts.Multicall3Address, data)
	if err != nil {
		t.Fatalf("aggregate3 with allowFailure on the failing call: %v", err)
	}
	results3, err := contracts.UnpackMulticallResults("aggregate3", ret)
	if err != nil {
		t.Fatal(err)
	}
	for i := range results {
		if results3[i].Success != results[i].Success || !bytes.Equal(results3[i].ReturnData, results[i].ReturnData) {
			t.Errorf("aggregate3 row %d: %v %x, tryAggregate's %v %x", i, results3[i].Success, results3[i].ReturnData, results[i].Success, results[i].ReturnData)
		}
	}
	calls3[4].AllowFailure = false
	data, _ = contracts.PackAggregate3(calls3)
	if _, err := fx.c.Call(ctx, common.Address{}, contracts.Multicall3Address, data); RevertReason(err) != "CallFailed(4)" {
		t.Errorf("aggregate3 without allowFailure on a failing call: %v (%q), want a CallFailed(4) revert", err, RevertReason(err))
	}
}

// The SDK simulates a counterfactual wallet's deposit as tryAggregate(false, [factory call, deposit]): the
// second call must see the wallet the first one created, within the one eth_call, and nothing stays after it.
func TestMulticall3CallsSeeWhatTheCallsBeforeThemChanged(t *testing.T) {
	c := New(t)
	factory := c.DeploySmartWalletFactory()
	owner := c.Payers[0]
	a := contracts.SmartWalletAccount{Owner: owner.Address, Salt: big.NewInt(7)}
	wallet := c.SmartWalletAddress(factory, a)
	create, err := contracts.PackCreateAccount(a)
	if err != nil {
		t.Fatal(err)
	}
	ownerOf, err := contracts.SmartWalletABI.Pack("owner")
	if err != nil {
		t.Fatal(err)
	}
	data, err := contracts.PackTryAggregate(false, []contracts.MulticallCall{{Target: factory, CallData: create}, {Target: wallet, CallData: ownerOf}})
	if err != nil {
		t.Fatal(err)
	}
	ret, err := c.Call(context.Background(), common.Address{}, contracts.Multicall3Address, data)
	if err != nil {
		t.Fatal(err)
	}
	results, err := contracts.UnpackMulticallResults("tryAggregate", ret)
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != 2 || !results[0].Success || !results[1].Success || common.BytesToAddress(results[1].ReturnData) != owner.Address {
		t.Fatalf("the wallet created by the first call answers the second with %+v, want its owner %s", results, owner.Address)
	}
	if code, err := c.Client.CodeAt(context.Background(), wallet, nil); err != nil || len(code) != 0 {
		t.Errorf("the wallet has %d bytes of code after the eth_call (%v), want none", len(code), err)
	}
}

func TestMulticall3SitsAtItsCanonicalAddress(t *testing.T) {
	c := New(t)
	code, err := c.Client.CodeAt(context.Background(), contracts.Multicall3Address, nil)
	if err != nil || !bytes.Equal(code, contracts.Multicall3RuntimeCode()) {
		t.Errorf("code at %s: %d bytes (%v), want Multicall3's runtime code", contracts.Multicall3Address, len(code), err)
	}
}
