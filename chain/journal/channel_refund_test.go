package journal

import (
	"context"
	"errors"
	"math/big"
	"testing"
	"time"
)

// TestChannelsARefundMarkClosesTheChannelToVouchersUntilCleared is the refund's fence on the row, the same table
// on every store: MarkRefund takes the row only at exactly the amount the refund claims to (a voucher accepted
// since moves it, and the mark is refused), and only when no other refund's mark is on it; while the mark is on
// the row (after a reopen too: a refund broadcast before a crash still fences the channel) AcceptVoucher refuses
// every voucher, RefundsInFlight lists the row and PruneChannels keeps it; ClearRefund of the mark opens it again.
func TestChannelsARefundMarkClosesTheChannelToVouchersUntilCleared(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		key, other := chanKey(1), chanKey(2)
		if _, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(0), "refund 0"); !errors.Is(err, ErrChannelNotFound) {
			t.Fatalf("a refund mark on a channel with no row: %v, want ErrChannelNotFound", err)
		}
		mustObserve(t, channelsOf(t, s), depositRead(key, 100, 7))
		mustObserve(t, channelsOf(t, s), depositRead(other, 100, 7))
		accept := func(key ChannelKey, from, to int64) error {
			_, err := channelsOf(t, s).AcceptVoucher(ctx, key, big.NewInt(from), big.NewInt(to), voucherOf(to))
			return err
		}
		if err := accept(key, 0, 10); err != nil {
			t.Fatal(err)
		}
		if _, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(0), "refund 0"); !errors.Is(err, ErrChannelMoved) {
			t.Fatalf("a refund mark at an amount the row passed: %v, want ErrChannelMoved", err)
		}
		for _, bad := range []string{"", " ", "a\x00b"} {
			if _, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(10), bad); !errors.Is(err, ErrInvalidChannel) {
				t.Fatalf("a refund mark %q: %v, want ErrInvalidChannel", bad, err)
			}
		}
		if got := mustChannel(t, channelsOf(t, s), key); got.RefundMark != "" {
			t.Fatalf("refused marks left the mark %q", got.RefundMark)
		}
		clock.Advance(time.Second)
		got, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(10), "refund 0")
		if err != nil || got.RefundMark != "refund 0" || !got.RefundMarkedAt.Equal(clock.Now()) {
			t.Fatalf("MarkRefund at the row's amount: mark %q at %s, %v; want refund 0 now", got.RefundMark, got.RefundMarkedAt, err)
		}
		marked := clock.Now()
		clock.Advance(time.Second)
		if got, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(10), "refund 0"); err != nil || !got.RefundMarkedAt.Equal(marked) {
			t.Fatalf("the same refund marked again: at %s, %v; want taken, as first marked", got.RefundMarkedAt, err)
		}
		if _, err := channelsOf(t, s).MarkRefund(ctx, key, big.NewInt(10), "refund 1"); !errors.Is(err, ErrRefundTaken) {
			t.Fatalf("another refund's mark: %v, want ErrRefundTaken", err)
		}
		if err := accept(key, 10, 20); !errors.Is(err, ErrChannelRefunding) {
			t.Fatalf("a voucher of a channel being refunded: %v, want ErrChannelRefunding", err)
		}
		if err := accept(other, 0, 20); err != nil {
			t.Fatalf("a voucher of another channel: %v", err)
		}
		wantRow(t, channelsOf(t, s), key, 10, 1, 0, "")

		// A crash after the refund left: the mark is still there, and still fences the channel.
		s = h.reopen(t, s)
		if err := accept(key, 10, 20); !errors.Is(err, ErrChannelRefunding) {
			t.Fatalf("after a reopen, a voucher of a channel being refunded: %v, want ErrChannelRefunding", err)
		}
		list, err := channelsOf(t, s).RefundsInFlight(ctx, testNetwork)
		if err != nil || len(list) != 1 || list[0].Key != key || list[0].RefundMark != "refund 0" || !list[0].RefundMarkedAt.Equal(marked) {
			t.Fatalf("RefundsInFlight after a reopen = %+v, %v; want the row of %s marked by refund 0", list, err, key)
		}
		if list, err := channelsOf(t, s).RefundsInFlight(ctx, "eip155:1"); err != nil || len(list) != 0 {
			t.Fatalf("RefundsInFlight of another network = %d rows, %v", len(list), err)
		}
		// Refunded all that was left, and withdrawn: the row is kept while its mark is on it.
		gone := depositRead(key, 10, 9)
		gone.Withdrawn, gone.TotalClaimed = true, big.NewInt(10)
		mustObserve(t, channelsOf(t, s), gone)
		clock.Advance(48 * time.Hour)
		if n, err := channelsOf(t, s).PruneChannels(ctx, clock.Now()); err != nil || n != 0 {
			t.Fatalf("PruneChannels of a marked row = %d, %v; want it kept", n, err)
		}
		if ok, err := channelsOf(t, s).ClearRefund(ctx, key, "refund 1"); ok || err != nil {
			t.Fatalf("ClearRefund of another refund's mark = %v, %v; want nothing cleared", ok, err)
		}
		if ok, err := channelsOf(t, s).ClearRefund(ctx, key, "refund 0"); !ok || err != nil {
			t.Fatalf("ClearRefund = %v, %v", ok, err)
		}
		if ok, err := channelsOf(t, s).ClearRefund(ctx, key, "refund 0"); ok || err != nil {
			t.Fatalf("ClearRefund again = %v, %v; want nothing cleared", ok, err)
		}
		if got := mustChannel(t, channelsOf(t, s), key); got.RefundMark != "" || !got.RefundMarkedAt.IsZero() {
			t.Fatalf("cleared, the row still has the mark %q at %s", got.RefundMark, got.RefundMarkedAt)
		}
		// Deposited into again: vouchers go on.
		mustObserve(t, channelsOf(t, s), depositRead(key, 200, 10))
		if err := accept(key, 10, 20); err != nil {
			t.Fatalf("a voucher once the refund's mark is cleared: %v", err)
		}
	})
}
