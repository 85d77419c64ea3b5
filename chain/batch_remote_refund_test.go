package chain_test

import (
	"context"
	"math/big"
	"path/filepath"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// TestARefundThroughARemoteFacilitatorClosesItsChannelToThisGatewaysVouchersUntilAnswered: vouchers presented
// to the gateway while a payer's refund is on its way to the remote facilitator are refused (channel busy), and
// after it the channel holds only what was charged. Before the fence, all seven were accepted and served while
// the refund returned the 7000 they charged: the seller was paid 3000 for ten responses.
func TestARefundThroughARemoteFacilitatorClosesItsChannelToThisGatewaysVouchersUntilAnswered(t *testing.T) {
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
	accepted := 0
	w.holdRefund = func() {
		for n := int64(4); n <= 10; n++ {
			resp, err := rb.SettleBatch(context.Background(), w.voucher(n))
			if err == nil && resp.Success {
				accepted++
			} else {
				t.Logf("voucher %d during the refund: %+v %v", n, resp, err)
				break
			}
		}
	}
	payerBefore := w.c.BalanceOf(w.token, w.payer.Address)
	resp, err := rb.SettleBatch(context.Background(), w.refund(3))
	if err != nil || !resp.Success {
		t.Fatalf("the refund: %+v (%v)", resp, err)
	}
	got := new(big.Int).Sub(w.c.BalanceOf(w.token, w.payer.Address), payerBefore)
	t.Logf("vouchers accepted while the refund was on its way: %d; payer refunded %s (of 10 deposited, 3 charged before)", accepted, got)
	w.waitForSeller(t, 3*remotePrice)
	if accepted > 0 {
		t.Errorf("%d vouchers (%d units) were accepted (served) during the refund; the payer got %s back and the seller only %d", accepted, accepted*remotePrice, got, 3*remotePrice)
	}
	if got.Cmp(big.NewInt(7*remotePrice)) != 0 {
		t.Errorf("the payer got %s back; want the 7000 left", got)
	}
	if resp, err := rb.SettleBatch(context.Background(), w.voucher(4)); err == nil && resp.Success {
		t.Errorf("a voucher after the refund, past what the channel holds, was accepted: %+v", resp)
	}
}
