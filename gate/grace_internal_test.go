package gate

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/internal/racepass"
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
	m := NewOfferMemory(DefaultOfferMemoryBytes)
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
	// Room for three resources of one offer each and a second offer of one, but no more.
	limit := 3*offeredResourceBytes + 3*int64(len("a")) + 4*offeredTermsBytes
	m := NewOfferMemory(limit)
	m.remember("a", []offer{testOffer("1", testPayTo), testOffer("2", testPayTo)}, t0, grace)
	m.remember("b", []offer{testOffer("3", testPayTo)}, t0.Add(time.Millisecond), grace)
	m.remember("a", []offer{testOffer("1", testPayTo)}, t0.Add(2*time.Millisecond), grace) // a is the newest
	m.remember("c", []offer{testOffer("4", testPayTo)}, t0.Add(3*time.Millisecond), grace)
	m.remember("d", []offer{testOffer("6", testPayTo)}, t0.Add(3*time.Millisecond), grace)
	if got := amountsOf(m.recall("b", t0.Add(4*time.Millisecond), grace)); got != "" {
		t.Errorf("b, offered longest ago, still recalls %q past the limit", got)
	}
	if got := amountsOf(m.recall("a", t0.Add(4*time.Millisecond), grace)); got != "1 2" {
		t.Errorf("a recalls %q, want 1 2", got)
	}
	if m.Len() != 4 || m.Bytes() > limit {
		t.Errorf("the memory holds %d terms in %d bytes, want 4 (a's two, c's and d's) within its limit %d", m.Len(), m.Bytes(), limit)
	}
	// Offered again past the grace of its other terms, a resource keeps only what is still within it.
	m.remember("a", []offer{testOffer("5", testPayTo)}, t0.Add(5*time.Second), grace)
	if got := amountsOf(m.recall("a", t0.Add(5*time.Second), time.Hour)); got != "5" {
		t.Errorf("a recalls %q after its old terms expired, want 5", got)
	}
	if m.Len() != 3 {
		t.Errorf("the memory holds %d terms, want 3 (c's 4, d's 6 and a's 5)", m.Len())
	}
}

func TestTheOfferMemoryCountsTheBytesOfLongURLsAndNeverHoldsMoreThanItsLimit(t *testing.T) {
	racepass.Once(t, "one goroutine, and the offer memory starts none, filling it with 64 MiB of URLs: the race detector has no second goroutine to compare it with, and its checks make the copying slow")
	t0 := time.Unix(1_700_000_000, 0)
	const limit = 1 << 20
	m := NewOfferMemory(limit)
	long := strings.Repeat("u", 64<<10)
	for i := range 1000 {
		m.remember(fmt.Sprintf("GET http://shop/%s%d", long, i), []offer{testOffer("1", testPayTo)}, t0, time.Minute)
		if b := m.Bytes(); b > limit {
			t.Fatalf("after %d resources of 64 KiB URLs the memory counts %d bytes, past its limit %d", i+1, b, limit)
		}
	}
	if n := m.Len(); n < 10 || n > limit/(64<<10) {
		t.Errorf("the memory holds %d resources of 64 KiB, want the most recent that fit in %d bytes", n, limit)
	}
	if got := amountsOf(m.recall(fmt.Sprintf("GET http://shop/%s%d", long, 999), t0, time.Minute)); got != "1" {
		t.Errorf("the last resource recalls %q, want 1", got)
	}
	// A resource that alone would not fit is not remembered, and pushes nothing out.
	before := m.Len()
	m.remember("GET http://shop/"+strings.Repeat("v", limit), []offer{testOffer("1", testPayTo)}, t0, time.Minute)
	if m.Bytes() > limit || m.Len() > before {
		t.Errorf("a resource larger than the memory: %d terms in %d bytes, want at most %d terms within %d", m.Len(), m.Bytes(), before, limit)
	}
	// Forgetting gives back every byte.
	for i := range 1000 {
		m.remember(fmt.Sprintf("GET http://shop/short/%d", i), nil, t0, time.Minute)
	}
	if want := int64(m.lru.Len()) * (offeredResourceBytes + int64(len("GET http://shop/short/000"))); m.Len() != 0 || m.Bytes() > want {
		t.Errorf("after the long URLs were pushed out: %d terms, %d bytes, want none and at most %d", m.Len(), m.Bytes(), want)
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

func TestTheOfferMemoryKeysARequestByItsMethodItsURLAndTheURIARewriteMadeOfIt(t *testing.T) {
	g := &Gate{cfg: Config{OriginalURI: func(r *http.Request) string { return "/report?v=1" }}}
	r := httptest.NewRequest(http.MethodGet, "http://shop.example/report?v=1", nil)
	x := &exchange{g: g, r: r}
	if got := x.offeredKey(); got != "GET http://shop.example/report?v=1" {
		t.Errorf("offeredKey of an unrewritten request = %q", got)
	}
	// A rewrite (which the request's URI placeholders read) is part of what the offer depended on.
	r.URL.Path = "/gold/report"
	if got := x.offeredKey(); got != "GET http://shop.example/report?v=1 /gold/report?v=1" {
		t.Errorf("offeredKey of a rewritten request = %q", got)
	}
	r.URL.Path = "/" + strings.Repeat("r", 8<<10)
	if got := x.offeredKey(); len(got) > maxResourceLen {
		t.Errorf("offeredKey of a long URI has %d bytes, want at most %d", len(got), maxResourceLen)
	}
}
