package payer_test

import (
	"io"
	"math/big"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// countingBase counts the requests a Transport sends.
type countingBase struct{ n atomic.Int64 }

func (c *countingBase) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return http.DefaultTransport.RoundTrip(r)
}

// PayOffer pays an offer read before with one request each time, not two (no unpaid request first), and one key
// with two channel salts pays from two channels, each opened by its own deposit; the zero salt is the channel
// the SDK's client and a Payer with no salt pay from.
func TestPayOfferSendsOneRequestAPaymentAndEachSaltOpensAChannelOfItsOwn(t *testing.T) {
	s, srv := newBatchSeller(t, 1000, "")
	probe, body, err := payer.Fetch(t.Context(), http.DefaultClient, http.MethodGet, srv.URL+"/report", "", "", 1<<20)
	if err != nil || probe.StatusCode != http.StatusPaymentRequired {
		t.Fatalf("the probe: %v %v, want 402", probe, err)
	}
	offer, err := payer.ReadOffer(probe.Header, body)
	if err != nil {
		t.Fatal(err)
	}
	key := mustKey(t)
	now := func() time.Time { return time.Unix(1_700_000_000, 0) }
	ids := map[common.Hash]bool{}
	for _, salt := range []common.Hash{{}, common.BigToHash(big.NewInt(1))} {
		p, err := payer.New(key, payer.Options{Now: now, ChannelSalt: salt})
		if err != nil {
			t.Fatal(err)
		}
		base := &countingBase{}
		tr := &payer.Transport{Payer: p, Base: base, Limits: []payer.Limit{{Network: testNetwork, Asset: testToken, PerRequest: big.NewInt(1000), Total: big.NewInt(1_000_000)}}}
		for k := 1; k <= 3; k++ {
			req, _ := http.NewRequest(http.MethodGet, srv.URL+"/report", nil)
			resp, err := tr.PayOffer(req, offer)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("salt %s, request %d: %s, want 200", salt, k, resp.Status)
			}
		}
		if n := base.n.Load(); n != 3 {
			t.Errorf("salt %s: PayOffer sent %d requests for 3 payments, want 3", salt, n)
		}
		br, _ := offer.Batch(0)
		id, err := p.ChannelID(br)
		if err != nil {
			t.Fatal(err)
		}
		if st, ok := p.Channel(id); !ok || st.Charged.Int64() != 3000 {
			t.Errorf("salt %s: the payer keeps %+v (known %v), want 3000 charged", salt, st, ok)
		}
		ids[id] = true
		if salt == (common.Hash{}) {
			plain, _ := payer.New(key, payer.Options{})
			if other, _ := plain.ChannelID(br); other != id {
				t.Errorf("the zero salt's channel is %s, and a payer with no salt pays from %s", id.Hex(), other.Hex())
			}
		}
	}
	payloads, _, _ := s.seen()
	deposits := 0
	for _, pl := range payloads {
		if pl.Type == x402.BatchDeposit {
			deposits++
		}
	}
	if len(ids) != 2 || len(payloads) != 6 || deposits != 2 {
		t.Errorf("%d channels, %d payments, %d deposits; want 2 channels, 6 payments, a deposit each", len(ids), len(payloads), deposits)
	}
}
