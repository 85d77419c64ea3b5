package facilitatorclient

import (
	"context"
	"testing"
)

// BenchmarkClientVerify is one /verify round trip to a facilitator on 127.0.0.1 that answers at once: the
// client's own cost plus loopback HTTP.
func BenchmarkClientVerify(b *testing.B) {
	f := newFakeFacilitator(b, permit2Supported(mainnet))
	c, err := New(f.URL())
	if err != nil {
		b.Fatal(err)
	}
	req := permit2Request(mainnet)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := c.Verify(context.Background(), req); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// BenchmarkFailoverRoute is the routing cost of a Failover whose compatible member is the third, with every
// /supported cached: what a failover set adds to each payment.
func BenchmarkFailoverRoute(b *testing.B) {
	members := []*fakeFacilitator{
		newFakeFacilitator(b, erc2612Supported(walletA, mainnet, testnet)),
		newFakeFacilitator(b, permit2Supported(testnet)),
		newFakeFacilitator(b, permit2Supported(mainnet)),
	}
	fo := &Failover{}
	for _, m := range members {
		c, err := New(m.URL())
		if err != nil {
			b.Fatal(err)
		}
		if _, err := c.Supported(context.Background()); err != nil {
			b.Fatal(err)
		}
		fo.members = append(fo.members, c)
	}
	req := permit2Request(mainnet)
	w := wantOf(req)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		r := routing{op: opVerify, want: w}
		n := 0
		r.route(context.Background(), fo.members, func(*Client) bool { n++; return true })
		if n != 1 {
			b.Fatalf("%d members tried, want 1", n)
		}
	}
}
