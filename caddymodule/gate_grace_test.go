package caddymodule_test

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/gate"
)

// price_grace's memory of the offers 402s made: what it is keyed by, and how much of it there may be.

func TestThePriceGraceMemoryOfManyLongDistinctURLsStaysWithinItsByteCap(t *testing.T) {
	env, _ := newPricesEnv(t, "$0.01", "1m")
	const n, long = 10_000, 16 << 10
	path := "/" + strings.Repeat("u", long)
	client := &http.Client{}
	t.Cleanup(client.CloseIdleConnections)
	if a := env.get("/warm-up"); a.status != http.StatusPaymentRequired {
		t.Fatalf("an unpaid request = %d, want 402", a.status)
	}
	base := liveHeap()
	for i := range n {
		resp, err := client.Get(env.srv.URL + path + strconv.Itoa(i))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusPaymentRequired {
			t.Fatalf("unpaid request %d for a %d KiB URL = %d, want 402", i, long>>10, resp.StatusCode)
		}
	}
	grew := int64(liveHeap()) - int64(base)
	t.Logf("%d unpaid 402s of distinct %d KiB URLs: the live heap grew by %.1f MiB, the offer memory accounts %.1f MiB",
		n, long>>10, float64(grew)/(1<<20), float64(caddymodule.OfferMemoryBytes())/(1<<20))
	// Kept whole, the URLs alone would be 156 MiB; the memory is full well before the last.
	if grew > 2*gate.DefaultOfferMemoryBytes {
		t.Errorf("the live heap grew by %.1f MiB, want the offer memory within its cap of %d MiB", float64(grew)/(1<<20), gate.DefaultOfferMemoryBytes>>20)
	}
	if b := caddymodule.OfferMemoryBytes(); b < gate.DefaultOfferMemoryBytes*9/10 || b > gate.DefaultOfferMemoryBytes {
		t.Errorf("the offer memory accounts %d bytes, want it full to its cap %d and no more", b, gate.DefaultOfferMemoryBytes)
	}
}
