package x402

import (
	"strings"
	"testing"
)

func TestParsePriceTurnsDollarPricesIntoRawUnitsExactly(t *testing.T) {
	tests := []struct {
		in       string
		decimals uint8
		want     string
	}{
		{"$0.01", 6, "10000"},
		{"0.01 USD", 6, "10000"},
		{"0.01USD", 6, "10000"},
		{"0.01 usd", 6, "10000"},
		{"  $1  ", 6, "1000000"},
		{"$1.5", 6, "1500000"},
		{"$0.000001", 6, "1"},
		{"$0.0000010000", 6, "1"}, // trailing zeros beyond the precision are harmless
		{"$0.1", 18, "100000000000000000"},
		{"$12345678.123456", 6, "12345678123456"},
		{"$0", 6, "0"},
		{"$0.29", 6, "290000"}, // 0.29 is not exact in binary floating point
		{"$3", 0, "3"},
		{"$007.5", 1, "75"},
	}
	for _, tt := range tests {
		got, err := ParsePrice(tt.in, tt.decimals)
		if err != nil || got.String() != tt.want {
			t.Errorf("ParsePrice(%q, %d) = %v, %v; want %s", tt.in, tt.decimals, got, err, tt.want)
		}
	}
}

func TestParsePriceRefusesWhatItCannotChargeExactly(t *testing.T) {
	tests := []struct {
		in       string
		decimals uint8
		want     string // part of the error message
	}{
		{"", 6, "empty"},
		{"   ", 6, "empty"},
		{"$", 6, "no number"},
		{"USD", 6, "no number"},
		{"-0.01", 6, "negative"},
		{"$-0.01", 6, "negative"},
		{"-$0.01", 6, "negative"},
		{"+0.01", 6, "no sign"},
		{"$0.0000001", 6, "7 decimal places but the token has only 6"},
		{"$0.5", 0, "1 decimal places but the token has only 0"},
		{"1e-2", 6, "unexpected"},
		{"1,000.00", 6, "unexpected"},
		{"$ 1", 6, "unexpected"},
		{"0.01 EUR", 6, "unexpected"},
		{".5", 6, "both sides of the decimal point"},
		{"5.", 6, "both sides of the decimal point"},
		{"1.2.3", 6, "unexpected"},
		{"$" + strings.Repeat("9", 200), 6, "longer than"},
		// A bare number says neither dollars nor raw units: "10000" is $10,000 or a hundredth of a token.
		{"10000", 6, `price "10000" is a bare number: write "$10000" for dollars, or amount 10000 for raw token units`},
		{" 0.01 ", 6, `price " 0.01 " is a bare number: write "$0.01" (or "0.01 USD") for dollars`},
		{"0", 6, "bare number"},
		{"$" + strings.Repeat("9", 80), 6, "256 bits"},
	}
	for _, tt := range tests {
		got, err := ParsePrice(tt.in, tt.decimals)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParsePrice(%q, %d) = %v, %v; want an error mentioning %q", tt.in, tt.decimals, got, err, tt.want)
		}
	}
}

func TestTokenAmountsAreShownAsDecimalTokens(t *testing.T) {
	for raw, want := range map[string]string{"10000": "0.01", "1000000": "1", "1": "0.000001", "12345678": "12.345678", "0": "0", "x": "x"} {
		if got := FormatTokenAmount(raw, 6); got != want {
			t.Errorf("FormatTokenAmount(%q, 6) = %q, want %q", raw, got, want)
		}
	}
}
