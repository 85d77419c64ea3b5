package payer_test

import (
	"context"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAPayerOnAQuietChainDatesItsPaymentsFromTheLaterOfItsClockAndTheHead: a chain that seals only when
// transactions come can sit idle for minutes; its head is that old, and its next block, where the settlement
// lands, is stamped with the wall clock. A payer with an RPC whose clock is ten minutes past the head dates its
// payments from its clock (deadline = clock + maxTimeoutSeconds), by Sign and by SignBatch, by permit2 and by
// eip3009: dated from the head they were born expired. A payer whose clock lags the head (a chain running
// ahead of the wall clock) dates them from the head, as before.
func TestAPayerOnAQuietChainDatesItsPaymentsFromTheLaterOfItsClockAndTheHead(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	head := time.Unix(int64(c.HeadTime()), 0)
	for _, tc := range []struct {
		name string
		now  time.Time
		want time.Time // what the payments are dated from
	}{
		{"a clock ten minutes past the head", head.Add(10 * time.Minute), head.Add(10 * time.Minute)},
		{"a clock a minute behind the head", head.Add(-time.Minute), head},
	} {
		for _, method := range []string{x402.TransferPermit2, x402.TransferEIP3009} {
			t.Run(tc.name+", "+method, func(t *testing.T) {
				p, err := payer.New(c.Payers[0].Key, payer.Options{RPC: c.RPCURL, Method: method, Now: func() time.Time { return tc.now }})
				if err != nil {
					t.Fatal(err)
				}
				defer p.Close()
				offer := batchOffer(method, c.Token.Hex())
				signed, err := p.Sign(context.Background(), offer, 0)
				if err != nil {
					t.Fatal(err)
				}
				batch, err := p.SignBatch(context.Background(), offer, 0, 2)
				if err != nil {
					t.Fatal(err)
				}
				want := tc.want.Add(time.Duration(offer.Required.Accepts[0].MaxTimeoutSeconds) * time.Second)
				for _, pay := range append(batch, signed) {
					if got := pay.Payload.Payload.Deadline(); !got.Equal(want) {
						t.Fatalf("the payment's deadline is %s; want %s (dated from %s, the head is at %s)", got.UTC(), want.UTC(), tc.want.UTC(), head.UTC())
					}
				}
			})
		}
	}
}
