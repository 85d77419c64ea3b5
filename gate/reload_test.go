package gate_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment charged for a response that broke off is served when presented again for the same resource, judged by
// its journal record, at a gateway of the cluster whose terms differ (a rolling reload: one gateway has the new
// price, the other the old one). A record that does not describe its resource is judged by the route's offers, as
// before, and a payment never journalled gets no help.

// brokenBodySize is the body the breaking upstream streams: four times the gates' max_buffer.
const brokenBodySize = 4 << 10

// breakingUpstream streams a body larger than the gate's max_buffer; while breakOff is set, it fails halfway: the
// response a payment bought breaks off after it began to stream, and the payment stays unserved.
type breakingUpstream struct {
	breakOff atomic.Bool
	calls    atomic.Int64
}

func (u *breakingUpstream) ServeHTTP(w http.ResponseWriter, _ *http.Request) error {
	u.calls.Add(1)
	if u.breakOff.Load() {
		if _, err := w.Write(bytes.Repeat([]byte("x"), brokenBodySize/2)); err != nil {
			return err
		}
		return errors.New("the upstream broke off")
	}
	_, err := w.Write(bytes.Repeat([]byte("x"), brokenBodySize))
	return err
}

// pricedAt sets up a gate that settles as settle, sells at amount, streams past 1 KiB, in front of up.
func pricedAt(settle string, amount int64, up *breakingUpstream) setup {
	return setup{settle: settle, upstream: up.ServeHTTP, config: func(c *gate.Config) {
		c.MaxBuffer = 1 << 10
		c.Offers[0].Amount = fmt.Sprint(amount)
	}}
}

// refusedWith checks that a is a 402 whose PAYMENT-REQUIRED error begins with reason.
func refusedWith(t *testing.T, a answer, reason, what string) {
	t.Helper()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil || !strings.HasPrefix(pr.Error, reason) {
		t.Fatalf("%s = %d %q (PAYMENT-REQUIRED error %q, %v), want 402 %s", what, a.status, a.body, pr.Error, err, reason)
	}
}

// breakOffCharged presents a payment of payer signed at gw's price to gw while its upstream breaks off, and waits
// until the payment is charged (settle async: in the background).
func breakOffCharged(t *testing.T, gw *env, up *breakingUpstream, header string, before [2]*big.Int, amount int64) {
	t.Helper()
	up.breakOff.Store(true)
	a := gw.get(x402.HeaderPaymentSignature, header)
	up.breakOff.Store(false)
	if a.status != http.StatusOK || strings.Count(a.body, "x") >= brokenBodySize {
		t.Fatalf("the paid request while the upstream breaks off = %d with %d bytes, want 200 and part of the body", a.status, len(a.body))
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, gained := gw.paid(gw.c.Payers[0], before); gained.Int64() >= amount {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the payment whose response broke off was not charged in time")
		}
	}
}

func TestAChargedPaymentThatBrokeOffIsServedByItsRecordAtAGatewayOfTheClusterWhosePriceDiffers(t *testing.T) {
	for _, settle := range []string{gate.SettleAfter, gate.SettleBefore, gate.SettleAsync} {
		t.Run(settle, func(t *testing.T) {
			var ups [2]breakingUpstream
			gws := gatewaysOf(t, []setup{pricedAt(settle, price, &ups[0]), pricedAt(settle, 2*price, &ups[1])})
			payer := gws[0].c.Payers[0]
			header := gws[0].permit2(payer)
			unsent := gws[0].permit2(payer)
			before := gws[0].balances(payer)
			breakOffCharged(t, gws[0], &ups[0], header, before, price)

			// At the gateway that sells at twice the price now, the payment never presented there is refused for
			// its terms, and the charged one served whole, once, on its record.
			refusedWith(t, gws[1].get(x402.HeaderPaymentSignature, unsent), x402.ReasonValueMismatch,
				"a payment at the old price, never presented, at the gateway of the new price")
			a := gws[1].get(x402.HeaderPaymentSignature, header)
			if a.status != http.StatusOK || a.body != strings.Repeat("x", brokenBodySize) {
				pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
				t.Fatalf("the charged payment presented again at the gateway of the new price = %d with %d bytes (payment error %q), want 200 and the whole body",
					a.status, len(a.body), pr.Error)
			}
			if settle != gate.SettleAsync {
				if resp := mustSettleResponse(t, a); !resp.Success || resp.Amount != fmt.Sprint(price) {
					t.Errorf("PAYMENT-RESPONSE %+v, want the settlement of %d it was charged", resp, price)
				}
			}
			for i, gw := range gws {
				refusedWith(t, gw.get(x402.HeaderPaymentSignature, header), x402.ReasonPaymentAlreadyUsed,
					fmt.Sprintf("the payment presented once more, at gateway %d, after it bought its response", i))
			}
			refusedWith(t, gws[1].get(x402.HeaderPaymentSignature, unsent), x402.ReasonValueMismatch,
				"the payment at the old price, refused once for its terms, presented again")
			time.Sleep(100 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
			if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
				t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
			}
			if n := gws[0].c.CountTokenTransfers(payer.Address, gws[0].payTo); n != 1 {
				t.Errorf("%d token transfers from the payer to the seller, want 1", n)
			}
		})
	}
}

func TestARecordThatDoesNotDescribeItsResourceIsJudgedByTheRoutesOffersAsBefore(t *testing.T) {
	var ups [2]breakingUpstream
	gws := gatewaysOf(t, []setup{pricedAt(gate.SettleAfter, price, &ups[0]), pricedAt(gate.SettleAfter, 2*price, &ups[1])})
	payer := gws[0].c.Payers[0]
	header := gws[0].permit2(payer)
	before := gws[0].balances(payer)
	breakOffCharged(t, gws[0], &ups[0], header, before, price)

	// As a gateway of a release before records described their resource would have written it.
	p, err := x402.DecodePaymentPayload(header)
	if err != nil {
		t.Fatal(err)
	}
	from, nonce := p.Payload.PayerAndNonce()
	id := journal.PaymentID(p.Accepted.Network, "gate/"+x402.TransferMethod(p.Accepted, p.Payload), p.Accepted.Asset, from, nonce)
	if _, err := gws[0].store.Update(context.Background(), id, func(r *journal.Record) error {
		if r.Described == "" || r.Resource == "" {
			return fmt.Errorf("the gate's record names resource %q described %q; want both", r.Resource, r.Described)
		}
		r.Described = ""
		return nil
	}); err != nil {
		t.Fatalf("taking the description out of the payment's record: %v", err)
	}

	refusedWith(t, gws[1].get(x402.HeaderPaymentSignature, header), x402.ReasonValueMismatch,
		"the payment of a record that does not describe its resource, at the gateway of the new price")
	if a := gws[0].get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != strings.Repeat("x", brokenBodySize) {
		t.Fatalf("the same payment at the gateway whose offer it matches = %d with %d bytes, want 200 and the whole body", a.status, len(a.body))
	}
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
	}
}

// A payment whose response broke off at one route is judged by its record only at that route: at another route of
// the same resource that describes it alike (here: another gate of the same journal, described the same way, at
// twice the price), or when its record names no route (written by a release before records did, or by a gate
// without one), it must match the route's offers, and is refused for its terms. Its own route serves it whole,
// once.
func TestAPaymentThatBrokeOffIsJudgedByItsRecordOnlyAtTheRouteItWasFirstPresentedAt(t *testing.T) {
	for _, tc := range []struct{ name, route string }{
		{"another route that describes the resource alike", "the cheap route"},
		{"a record that names no route", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ups [2]breakingUpstream
			cheap, premium := pricedAt(gate.SettleAfter, price, &ups[0]), pricedAt(gate.SettleAfter, 2*price, &ups[1])
			priced := cheap.config
			cheap.config = func(c *gate.Config) { priced(c); c.Route = tc.route }
			gws := gatewaysOf(t, []setup{cheap, premium})
			if gws[0].cfg.Description != gws[1].cfg.Description || gws[1].cfg.Route == "" {
				t.Fatalf("the two gates describe their resource as %q and %q, the second at route %q; want alike, and a route",
					gws[0].cfg.Description, gws[1].cfg.Description, gws[1].cfg.Route)
			}
			payer := gws[0].c.Payers[0]
			header := gws[0].permit2(payer)
			before := gws[0].balances(payer)
			breakOffCharged(t, gws[0], &ups[0], header, before, price)

			refusedWith(t, gws[1].get(x402.HeaderPaymentSignature, header), x402.ReasonValueMismatch,
				"the cheap route's payment, its response broken off, at the route of twice the price")
			if n := ups[1].calls.Load(); n != 0 {
				t.Errorf("the upstream of the route of twice the price ran %d times, want never", n)
			}
			if a := gws[0].get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != strings.Repeat("x", brokenBodySize) {
				t.Fatalf("the payment presented again at its own route = %d with %d bytes, want 200 and the whole body", a.status, len(a.body))
			}
			time.Sleep(100 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
			if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
				t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
			}
		})
	}
}

// mustSettleResponse decodes a's PAYMENT-RESPONSE.
func mustSettleResponse(t *testing.T, a answer) x402.SettleResponse {
	t.Helper()
	resp, err := x402.DecodeSettleResponse(a.header.Get(x402.HeaderPaymentResponse))
	if err != nil {
		t.Fatalf("decoding PAYMENT-RESPONSE of %d %q: %v", a.status, a.body, err)
	}
	return resp
}
