package x402

import (
	"errors"
	"math/big"
	"strings"
	"testing"
)

func TestASettlementOverrideIsReadInEachFormThePublicServerSDKsAccept(t *testing.T) {
	max := big.NewInt(1_000_000)
	for _, tc := range []struct {
		value string
		want  string
	}{
		{`{"amount":"250000"}`, "250000"},
		{`{"amount":"0"}`, "0"},
		{`{"amount":"1000000"}`, "1000000"},
		{`{"amount":"$0.25"}`, "250000"},
		{`{"amount":"$0.0123"}`, "12300"},
		{`{"amount":"$0.0000019"}`, "1"}, // truncated to the token's six decimals, as the SDKs do
		{`{"amount":"$0"}`, "0"},
		{`{"amount":"50%"}`, "500000"},
		{`{"amount":"12.5%"}`, "125000"},
		{`{"amount":"0.01%"}`, "100"},
		{`{"amount":"100%"}`, "1000000"},
		{` { "amount" : "7" , "note": {"x": [1]} } `, "7"}, // unknown members are ignored
	} {
		got, err := ParseSettlementOverride(tc.value, max, 6)
		if err != nil || got.String() != tc.want {
			t.Errorf("%s: got %v, %v; want %s", tc.value, got, err, tc.want)
		}
	}
}

func TestASettlementOverrideAboveTheMaximumIsReturnedWithAnErrorSayingSo(t *testing.T) {
	max := big.NewInt(1_000_000)
	for _, v := range []string{`{"amount":"1000001"}`, `{"amount":"$1.01"}`, `{"amount":"100.01%"}`, `{"amount":"250%"}`} {
		got, err := ParseSettlementOverride(v, max, 6)
		if !errors.Is(err, ErrOverrideAboveMaximum) || got == nil || got.Cmp(max) <= 0 {
			t.Errorf("%s: got %v, %v; want the amount and ErrOverrideAboveMaximum", v, got, err)
		}
	}
}

func TestAMalformedSettlementOverrideIsAnErrorThatNamesTheProblem(t *testing.T) {
	max := big.NewInt(1_000_000)
	for _, tc := range []struct{ value, says string }{
		{``, "expected a JSON object"},
		{`250000`, "expected a JSON object"},
		{`"$0.01"`, "expected a JSON object"},
		{`{"amount":250000}`, "amount must be a string"},
		{`{"amount":null}`, "amount must be a string"},
		{`{}`, `no "amount" member`},
		{`{"amount":"1","amount":"2"}`, "duplicate"},
		{`{"amount":"-5"}`, "expected only digits"},
		{`{"amount":"0x10"}`, "expected only digits"},
		{`{"amount":"1e6"}`, "expected only digits"},
		{`{"amount":"007"}`, "leading zero"},
		{`{"amount":"$"}`, "dollar amount"},
		{`{"amount":"$1."}`, "dollar amount"},
		{`{"amount":"$.5"}`, "dollar amount"},
		{`{"amount":"$-1"}`, "dollar amount"},
		{`{"amount":"%"}`, "percentage"},
		{`{"amount":"1.234%"}`, "percentage"},
		{`{"amount":"ten"}`, "expected only digits"},
		{`{"amount":"` + strings.Repeat("9", 80) + `"}`, "fit in 256 bits"},
		{`{"amount":"1"} trailing`, "expected a JSON object"},
		{strings.Repeat(" ", 600), "at most 512"},
	} {
		got, err := ParseSettlementOverride(tc.value, max, 6)
		if err == nil || errors.Is(err, ErrOverrideAboveMaximum) || got != nil {
			t.Errorf("%q: got %v, %v; want a malformed-override error", tc.value, got, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%q: error %q does not say %q", tc.value, err, tc.says)
		}
	}
}

func FuzzParseSettlementOverride(f *testing.F) {
	for _, s := range []string{`{"amount":"1"}`, `{"amount":"$0.01"}`, `{"amount":"5%"}`, `{"amount":1}`, `{`, `{"amount":"99.99%"}`} {
		f.Add(s, uint8(6))
	}
	max := big.NewInt(1_000_000)
	f.Fuzz(func(t *testing.T, value string, decimals uint8) {
		n, err := ParseSettlementOverride(value, max, decimals%40)
		switch {
		case err == nil && (n == nil || n.Sign() < 0 || n.Cmp(max) > 0):
			t.Fatalf("%q: accepted %v, outside [0, max]", value, n)
		case err != nil && errors.Is(err, ErrOverrideAboveMaximum) && (n == nil || n.Cmp(max) <= 0):
			t.Fatalf("%q: above-maximum error with %v", value, n)
		case err != nil && !errors.Is(err, ErrOverrideAboveMaximum) && n != nil:
			t.Fatalf("%q: an amount (%v) beside the error %v", value, n, err)
		}
	})
}
