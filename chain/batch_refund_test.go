package chain_test

import (
	"context"
	"fmt"
	"math/big"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// slowActionRoute is actionRoute on a chain that mines every 300 ms: a refund's transaction is sent and not yet
// mined long enough for a voucher to arrive meanwhile.
func slowActionRoute(t *testing.T, j journal.Store) *batchRoute {
	return newBatchRoute(t, fixtureOpts{journal: j, autoCommit: 300 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
}

// A voucher of a channel whose payer's refund is on its way (checked, its transaction sent and not yet mined) is
// refused as channel busy and charges nothing: accepted, it would buy a response with money the refund hands
// back (the refund claims only up to the voucher before it, and returns the rest). After the refund the channel
// holds what was claimed, and the voucher is still refused.
func TestBatchVoucherOfAChannelBeingRefundedIsRefusedAndNothingServedGoesUnclaimed(t *testing.T) {
	j := boltJournal(t)
	b := slowActionRoute(t, j)
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	refunded := make(chan x402.BatchSettleResponse, 1)
	go func() {
		resp, err := b.fx.f.SettleBatch(context.Background(), b.payerRefund(b.payer, 3*batchPrice))
		if err != nil {
			resp.ErrorMessage = err.Error()
		}
		refunded <- resp
	}()
	// The refund's own record is claimed once it is checked and about to be sent.
	action := journal.PaymentID(b.fx.net, "batch-refund-action", contracts.BatchSettlementAddress.Hex(), b.id.Hex(), "0")
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok, err := j.Get(context.Background(), action); err != nil {
			t.Fatal(err)
		} else if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the refund was never sent: %+v", <-refunded)
		}
		time.Sleep(200 * time.Microsecond)
	}
	during := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice))
	refund := <-refunded
	if !refund.Success || refund.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("the refund: %+v", refund)
	}
	if during.Success || during.ErrorReason != x402.ReasonBatchChannelBusy {
		t.Fatalf("a voucher presented while the refund was on its way: %+v; want %s", during, x402.ReasonBatchChannelBusy)
	}
	if balance, claimed := b.channelOnChain(t); balance != 3*batchPrice || claimed != 3*batchPrice {
		t.Fatalf("after the refund the channel holds %d, %d claimed; want 3000 and 3000", balance, claimed)
	}
	if row := b.row(t, j); row.Charged.Int64() != 3*batchPrice {
		t.Fatalf("the journal's row stands at %s after the refund; want 3000: a voucher was accepted that nothing can claim", row.Charged)
	}
	if after := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); after.Success {
		t.Fatalf("a voucher after the refund was accepted: %+v", after)
	}
}

// A refund of more than is left is refused before any gas: the escrow would return only what is left, and the
// payer would be answered with a refund it did not ask for.
func TestBatchPayersRefundOfMoreThanIsLeftIsRefusedBeforeAnyGas(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	req := b.payerRefund(b.payer, 3*batchPrice)
	req.PaymentPayload.Payload.Amount = fmt.Sprint(7*batchPrice + 1)
	if resp := settleBatch(t, b.fx.f, req); resp.Success || resp.ErrorReason != x402.ReasonBatchRefundAmountInvalid {
		t.Fatalf("a refund of 7001 of the 7000 left: %+v; want %s", resp, x402.ReasonBatchRefundAmountInvalid)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("the refused refund sent %d transactions", got)
	}
	// Exactly what is left is fine.
	req.PaymentPayload.Payload.Amount = fmt.Sprint(7 * batchPrice)
	if resp := settleBatch(t, b.fx.f, req); !resp.Success || resp.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("a refund of the 7000 left: %+v", resp)
	}
}

// A refund of part of what is left, presented again (its answer lost), is answered from the refund it was: one
// transaction, whatever is left after it.
func TestBatchPayersPartialRefundPresentedAgainIsAnsweredFromItsRecord(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	payer0, _ := b.balances(t)
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	req := b.payerRefund(b.payer, 3*batchPrice)
	req.PaymentPayload.Payload.Amount = fmt.Sprint(2 * batchPrice)
	first := settleBatch(t, b.fx.f, req)
	if !first.Success || first.Amount != fmt.Sprint(2*batchPrice) || first.Extra == nil || first.Extra.ChannelState == nil ||
		first.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(3*batchPrice) {
		t.Fatalf("the refund of 2000: %+v", first)
	}
	again := settleBatch(t, b.fx.f, req)
	if !again.Success || again.Transaction != first.Transaction {
		t.Fatalf("the refund presented again: %+v; want the answer of %s", again, first.Transaction)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("the refund and its presenting again sent %d transactions; want 1", got)
	}
	if balance, claimed := b.channelOnChain(t); balance != 8*batchPrice || claimed != 3*batchPrice {
		t.Fatalf("the channel holds %d, %d claimed; want 8000 and 3000", balance, claimed)
	}
	if payer, _ := b.balances(t); payer != payer0-8*batchPrice {
		t.Fatalf("the payer holds %d; want %d (10000 deposited, 2000 refunded)", payer, payer0-8*batchPrice)
	}
	// Another voucher goes on from the channel as the refund left it.
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); !resp.Success {
		t.Fatalf("a voucher after the partial refund: %+v", resp)
	}
}

// A payer's refund and the claimer's claim of the same channel, sent at once (the claimer takes no action lock:
// it marks its claim in the channel's row): both claim the same last voucher, which the escrow takes once and
// skips the second time, so in either order the receiver is paid exactly what was charged and the payer gets
// exactly the rest.
func TestBatchPayersRefundWhileTheClaimerClaimsTheChannelPaysEachSideExactly(t *testing.T) {
	b := slowActionRoute(t, boltJournal(t))
	payer0, _ := b.balances(t)
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	claimed := make(chan error, 1)
	go func() { claimed <- b.fx.f.ClaimBatches(context.Background()) }()
	refund := settleBatch(t, b.fx.f, b.payerRefund(b.payer, 3*batchPrice))
	if err := <-claimed; err != nil {
		t.Fatalf("the claimer: %v", err)
	}
	if !refund.Success || refund.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("the refund: %+v", refund)
	}
	if payer, receiver := b.balances(t); payer != payer0-3*batchPrice || receiver != 3*batchPrice {
		t.Fatalf("the payer holds %d (want %d), the receiver %d (want %d)", payer, payer0-3*batchPrice, receiver, 3*batchPrice)
	}
	if balance, claimedOnChain := b.channelOnChain(t); balance != 3*batchPrice || claimedOnChain != 3*batchPrice {
		t.Fatalf("the channel holds %d, %d claimed; want 3000 and 3000", balance, claimedOnChain)
	}
	t.Logf("%d transactions: the refund, and the claim unless the refund's was mined before the claimer read the channel", b.sentBy(t, b.c.Wallets)-sent)
}

// A payer's refund answered pending (sent, not mined within the receipt wait) keeps its channel closed to
// vouchers until it is mined, then the channel's row is read again: a voucher meanwhile is refused as channel
// busy, and after, above what the channel holds.
func TestBatchPayersRefundAnsweredPendingKeepsItsChannelClosedToVouchersUntilMined(t *testing.T) {
	j := boltJournal(t)
	b := newBatchRoute(t, fixtureOpts{journal: j, autoCommit: 800 * time.Millisecond, receiptTimeout: 50 * time.Millisecond,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	refund := settleBatch(t, b.fx.f, b.payerRefund(b.payer, 3*batchPrice))
	if refund.ErrorReason != x402.ReasonSettlementPending || refund.Transaction == "" {
		t.Fatalf("the refund: %+v; want it sent and pending", refund)
	}
	if during := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); during.Success || during.ErrorReason != x402.ReasonBatchChannelBusy {
		t.Fatalf("a voucher while the refund is pending: %+v; want %s", during, x402.ReasonBatchChannelBusy)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if balance, _ := b.channelOnChain(t); balance == 3*batchPrice {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the refund was never mined")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for {
		after := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice))
		if after.Success {
			t.Fatalf("a voucher after the refund was mined was accepted: %+v", after)
		}
		if after.ErrorReason != x402.ReasonBatchChannelBusy {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the channel stayed closed after its refund was mined: %+v", after)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if row := b.row(t, j); row.Charged.Int64() != 3*batchPrice || row.Deposit.Int64() != 3*batchPrice {
		t.Fatalf("the row stands at %s of a deposit of %s; want 3000 of 3000", row.Charged, row.Deposit)
	}
}

// A payer's refund of a channel its payer withdrew (the engine claimed what it accepted first, the withdrawal
// took the rest) is refused before any gas as nothing to refund (refund_no_balance). Coverage of a seam: it
// passed before the gate served refunds, the engine's refund being what the gate calls.
func TestBatchPayersRefundOfAWithdrawnChannelIsRefusedBeforeAnyGas(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 4; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	initiate, err := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(6*batchPrice))
	if err != nil {
		t.Fatal(err)
	}
	finalize, err := contracts.PackFinalizeWithdraw(b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.payer, initiate, "initiating the withdrawal")
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	b.c.AdjustTime(time.Duration(contracts.MinWithdrawDelay+1) * time.Second)
	b.escrow(t, b.payer, finalize, "finalizing the withdrawal")
	sent := b.sentBy(t, b.c.Wallets)
	if resp := settleBatch(t, b.fx.f, b.payerRefund(b.payer, 4*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonBatchRefundNoBalance {
		t.Fatalf("a refund of the withdrawn channel: %+v; want %s", resp, x402.ReasonBatchRefundNoBalance)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("the refused refund sent %d transactions", got)
	}
	if balance, claimed := b.channelOnChain(t); balance != 4*batchPrice || claimed != 4*batchPrice {
		t.Fatalf("the channel holds %d with %d claimed; want 4000 and 4000", balance, claimed)
	}
}
