package gate

import (
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// testOffer is a permit2 offer of amount raw units to payTo.
func testOffer(amount, payTo string) offer {
	return offer{req: x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: x402.NetworkTestnet, Asset: testAsset,
		PayTo: payTo, Amount: amount, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2}}}
}

func amountsOf(terms []offeredTerms) string {
	var out []string
	for _, t := range terms {
		out = append(out, t.offer.req.Amount)
	}
	return strings.Join(out, " ")
}

func TestTheOfferMemoryRecallsWhatAResourceWasOfferedWithinTheGrace(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	const grace = 2 * time.Second
	cheap, dear := "GET http://shop/cheap/x", "GET http://shop/dear/x"
	m := NewOfferMemory(100)
	m.remember(cheap, []offer{testOffer("1000", testPayTo)}, t0, grace)
	m.remember(dear, []offer{testOffer("5000", testPayTo)}, t0, grace)
	m.remember(cheap, []offer{testOffer("2000", testPayTo)}, t0.Add(time.Second), grace)
	// Offered again: the same terms, a later time.
	m.remember(cheap, []offer{testOffer("2000", testPayTo)}, t0.Add(1500*time.Millisecond), grace)
	for _, tc := range []struct {
		name, resource string
		at             time.Duration
		want           string
	}{
		{"both prices of the cheap resource within the grace of each", cheap, 1900 * time.Millisecond, "1000 2000"},
		{"the first price at the very end of its grace", cheap, 2 * time.Second, "1000 2000"},
		{"the first price past its grace, the second (offered again) within", cheap, 3400 * time.Millisecond, "2000"},
		{"every price past its grace", cheap, 3600 * time.Millisecond, ""},
		{"another resource's price is its own", dear, time.Second, "5000"},
		{"the same URL by another method was never offered", "POST http://shop/cheap/x", time.Second, ""},
		{"nothing was offered before it was offered", cheap, -time.Second, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := amountsOf(m.recall(tc.resource, t0.Add(tc.at), grace)); got != tc.want {
				t.Errorf("recalled %q, want %q", got, tc.want)
			}
		})
	}
	if m.Len() != 3 {
		t.Errorf("the memory holds %d terms, want 3 (the same terms offered twice are one)", m.Len())
	}
}

func TestTheOfferMemoryForgetsExpiredTermsAndTheResourcesOfferedLongestAgoWhenFull(t *testing.T) {
	t0 := time.Unix(1_700_000_000, 0)
	const grace = time.Second
	m := NewOfferMemory(3)
	m.remember("a", []offer{testOffer("1", testPayTo), testOffer("2", testPayTo)}, t0, grace)
	m.remember("b", []offer{testOffer("3", testPayTo)}, t0.Add(time.Millisecond), grace)
	m.remember("a", []offer{testOffer("1", testPayTo)}, t0.Add(2*time.Millisecond), grace) // a is the newest
	m.remember("c", []offer{testOffer("4", testPayTo)}, t0.Add(3*time.Millisecond), grace)
	if got := amountsOf(m.recall("b", t0.Add(4*time.Millisecond), grace)); got != "" {
		t.Errorf("b, offered longest ago, still recalls %q past the limit", got)
	}
	if got := amountsOf(m.recall("a", t0.Add(4*time.Millisecond), grace)); got != "1 2" {
		t.Errorf("a recalls %q, want 1 2", got)
	}
	if m.Len() != 3 {
		t.Errorf("the memory holds %d terms, want its limit 3", m.Len())
	}
	// Offered again past the grace of its other terms, a resource keeps only what is still within it.
	m.remember("a", []offer{testOffer("5", testPayTo)}, t0.Add(5*time.Second), grace)
	if got := amountsOf(m.recall("a", t0.Add(5*time.Second), time.Hour)); got != "5" {
		t.Errorf("a recalls %q after its old terms expired, want 5", got)
	}
	if m.Len() != 2 {
		t.Errorf("the memory holds %d terms, want 2 (c's 4 and a's 5)", m.Len())
	}
}

func TestTheKeyOfPricedOffersCoversEveryFieldOfAnOffer(t *testing.T) {
	// A field pricedKey leaves out would let two different ways to pay share one offer set.
	base := testSpec("")
	key := pricedKey([]Offer{base})
	v := reflect.ValueOf(&base).Elem()
	for i := 0; i < v.NumField(); i++ {
		changed := base
		f := reflect.ValueOf(&changed).Elem().Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(f.String() + "x")
		case reflect.Bool:
			f.SetBool(!f.Bool())
		case reflect.Uint8, reflect.Uint, reflect.Uint64:
			f.SetUint(f.Uint() + 1)
		case reflect.Int, reflect.Int64:
			f.SetInt(f.Int() + 1)
		default:
			t.Fatalf("Offer.%s is a %s: teach this test and pricedKey about it", v.Type().Field(i).Name, f.Kind())
		}
		if pricedKey([]Offer{changed}) == key {
			t.Errorf("pricedKey does not change with Offer.%s", v.Type().Field(i).Name)
		}
	}
	if pricedKey([]Offer{base, base}) == key {
		t.Error("pricedKey does not count the offers")
	}
}
