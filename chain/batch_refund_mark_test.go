package chain_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// waitRefundSent waits until the refund of b's channel at refund nonce 0 is checked and about to be sent (its own
// record is claimed), while the refund runs in refunded.
func waitRefundSent(t *testing.T, b *batchRoute, j journal.Store, refunded chan x402.BatchSettleResponse) {
	t.Helper()
	action := journal.PaymentID(b.fx.net, "batch-refund-action", contracts.BatchSettlementAddress.Hex(), b.id.Hex(), "0")
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok, err := j.Get(context.Background(), action); err != nil {
			t.Fatal(err)
		} else if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the refund was never sent: %+v", <-refunded)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// A voucher presented to another gateway of the same PostgreSQL journal while a payer's refund is on its way at
// the first (checked, its transaction sent and not yet mined) is refused as channel busy and charges nothing: the
// refund's mark is on the channel's row, which every gateway's compare-and-set reads. Accepted, it would buy a
// response with money the refund hands back (the refund claims only up to the voucher before it). After the
// refund the channel holds what was claimed, and the row stands where the refund left it.
func TestBatchVoucherAtAnotherGatewayWhileARefundIsOnItsWayIsRefused(t *testing.T) {
	dsn := pgtest.Shared(t)
	ja := openPostgres(t, dsn)
	b := newBatchRoute(t, fixtureOpts{journal: ja, wallets: 2, autoCommit: 300 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	gwB := b.engine(t, openPostgres(t, dsn), b.c.Wallets[1:2], true, 30*time.Second)
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
	waitRefundSent(t, b, ja, refunded)
	during := settleBatch(t, gwB, b.voucher(b.rq, 4*batchPrice))
	refund := <-refunded
	if !refund.Success || refund.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("the refund: %+v", refund)
	}
	if during.Success || during.ErrorReason != x402.ReasonBatchChannelBusy {
		t.Fatalf("a voucher presented to gateway B while gateway A's refund was on its way: %+v; want %s", during, x402.ReasonBatchChannelBusy)
	}
	if balance, claimed := b.channelOnChain(t); balance != 3*batchPrice || claimed != 3*batchPrice {
		t.Fatalf("after the refund the channel holds %d, %d claimed; want 3000 and 3000", balance, claimed)
	}
	row := b.row(t, ja)
	if row.Charged.Int64() != 3*batchPrice || row.RefundMark != "" {
		t.Fatalf("the journal's row stands at %s with refund mark %q after the refund; want 3000 and none", row.Charged, row.RefundMark)
	}
	if after := settleBatch(t, gwB, b.voucher(b.rq, 4*batchPrice)); after.Success || after.ErrorReason != x402.ReasonBatchCumulativeExceedsBalance {
		t.Fatalf("a voucher above what the refund left, at gateway B: %+v; want %s", after, x402.ReasonBatchCumulativeExceedsBalance)
	}
}

// A restart between a refund's broadcast and its mining keeps the channel closed to vouchers: the mark is on the
// row, not in the process. The next process refuses the channel's vouchers until its claimer's pass finds the
// refund mined, reads the channel again and takes the mark off; a voucher then is judged by what the refund left.
func TestBatchRefundMarkOutlivesARestartBeforeTheRefundIsMined(t *testing.T) {
	dsn := pgtest.Shared(t)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 2})
	wallets := b.c.Wallets[:2]
	b.deposit(t, 10*batchPrice)
	first := b.engine(t, openPostgres(t, dsn), wallets, true, 50*time.Millisecond)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, first, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	// The refund is sent, not mined within its wait, and its process is gone.
	resp := settleLeased(first, b.payerRefund(b.payer, 3*batchPrice))
	if resp.ErrorReason != x402.ReasonSettlementPending || resp.Transaction == "" {
		t.Fatalf("the refund, not mined: %+v", resp)
	}
	first.Close()
	jn := openPostgres(t, dsn)
	next := b.engine(t, jn, wallets, true, 5*time.Second)
	if during := settleBatch(t, next, b.voucher(b.rq, 4*batchPrice)); during.Success || during.ErrorReason != x402.ReasonBatchChannelBusy {
		t.Fatalf("a voucher at the next process, the refund not yet mined: %+v; want %s", during, x402.ReasonBatchChannelBusy)
	}
	if row := b.row(t, jn); row.RefundMark == "" || row.Charged.Int64() != 3*batchPrice {
		t.Fatalf("the row after the restart: at %s, mark %q; want 3000, marked", row.Charged, row.RefundMark)
	}
	b.c.Commit()
	if err := next.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	row := b.row(t, jn)
	if row.RefundMark != "" || row.Deposit.Int64() != 3*batchPrice {
		t.Fatalf("the row after the refund mined and the claimer's pass: mark %q, deposit %s; want none and 3000", row.RefundMark, row.Deposit)
	}
	if after := settleBatch(t, next, b.voucher(b.rq, 4*batchPrice)); after.Success || after.ErrorReason != x402.ReasonBatchCumulativeExceedsBalance {
		t.Fatalf("a voucher above what the refund left: %+v; want %s", after, x402.ReasonBatchCumulativeExceedsBalance)
	}
	if balance, claimed := b.channelOnChain(t); balance != 3*batchPrice || claimed != 3*batchPrice {
		t.Fatalf("after the refund the channel holds %d, %d claimed; want 3000 and 3000", balance, claimed)
	}
}

// A payer's refund marks its channel's row, then waits for the channel's lock (another action of the channel sent
// and not yet mined holds it). Meanwhile a claimer's pass takes the mark for a refund never sent (no record after
// a minute) and the channel takes a voucher again. The refund, given the lock, must not go on: it would claim only
// what the row stood at when it was marked and hand the payer back the money of the voucher served since. It is
// refused as channel busy, nothing is sent, and the channel keeps its deposit and the voucher.
func TestBatchRefundWhoseMarkWasTakenOffWhileItWaitedForTheChannelIsRefused(t *testing.T) {
	ja := openPostgres(t, pgtest.Shared(t))
	b := newBatchRoute(t, fixtureOpts{journal: ja, wallets: 2, autoCommit: 300 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	release := b.fx.f.HoldBatchChannelForTest(b.fx.net, b.id)
	refunded := make(chan x402.BatchSettleResponse, 1)
	go func() {
		resp, err := b.fx.f.SettleBatch(context.Background(), b.payerRefund(b.payer, 3*batchPrice))
		if err != nil {
			resp.ErrorMessage = err.Error()
		}
		refunded <- resp
	}()
	var row journal.Channel
	for deadline := time.Now().Add(20 * time.Second); row.RefundMark == ""; time.Sleep(time.Millisecond) {
		if row = b.row(t, ja); time.Now().After(deadline) {
			release()
			t.Fatalf("the refund never marked its channel: %+v", <-refunded)
		}
	}
	// What the claimer's pass does to a mark a minute old with no record of its refund.
	if ok, err := ja.(journal.Channels).ClearRefund(context.Background(), row.Key, row.RefundMark); err != nil || !ok {
		t.Fatalf("taking the mark off as a claimer's pass would: %v, %v", ok, err)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); !resp.Success {
		t.Fatalf("a voucher once the mark is off: %+v", resp)
	}
	release()
	refund := <-refunded
	if refund.Success || refund.ErrorReason != x402.ReasonBatchChannelBusy {
		t.Fatalf("the refund that waited while a voucher was accepted: %+v; want %s and nothing sent", refund, x402.ReasonBatchChannelBusy)
	}
	b.c.Commit()
	if balance, claimed := b.channelOnChain(t); balance != 10*batchPrice || claimed != 0 {
		t.Fatalf("after the refused refund the channel holds %d, %d claimed; want its deposit 10000 and nothing claimed", balance, claimed)
	}
	if row := b.row(t, ja); row.Charged.Int64() != 4*batchPrice || row.RefundMark != "" {
		t.Fatalf("the row after the refused refund: at %s, mark %q; want 4000 and none", row.Charged, row.RefundMark)
	}
}
