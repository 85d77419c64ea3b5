package x402

import (
	"errors"
	"strings"
	"testing"
)

const maxUint256Dec = "115792089237316195423570985008687907853269984665640564039457584007913129639935"

func TestParseAmountAcceptsOnlyCanonicalDecimalsThatFitUint256(t *testing.T) {
	tests := []struct {
		in      string
		want    string // decimal; "" when an error is expected
		wantErr error
	}{
		{"0", "0", nil},
		{"1", "1", nil},
		{"10000", "10000", nil},
		{"18446744073709551615", "18446744073709551615", nil}, // 2^64-1: past the uint64 fast path boundary
		{"18446744073709551616", "18446744073709551616", nil},
		{"9999999999999999999", "9999999999999999999", nil}, // 19 digits, fast path
		{maxUint256Dec, maxUint256Dec, nil},
		{"", "", ErrNumberSyntax},
		{"007", "", ErrNumberSyntax},
		{"00", "", ErrNumberSyntax},
		{"-1", "", ErrNumberSyntax},
		{"+1", "", ErrNumberSyntax},
		{"1e6", "", ErrNumberSyntax},
		{"1.0", "", ErrNumberSyntax},
		{" 1", "", ErrNumberSyntax},
		{"1 ", "", ErrNumberSyntax},
		{"0x10", "", ErrNumberSyntax},
		{"1_000", "", ErrNumberSyntax},
		{"１", "", ErrNumberSyntax}, // full-width digit
		{"115792089237316195423570985008687907853269984665640564039457584007913129639936", "", ErrNumberRange}, // 2^256
		{"999999999999999999999999999999999999999999999999999999999999999999999999999999", "", ErrNumberRange}, // 78 nines
		{strings.Repeat("1", 79), "", ErrNumberRange},
	}
	for _, tt := range tests {
		got, err := ParseAmount(tt.in)
		if tt.wantErr != nil {
			if !errors.Is(err, tt.wantErr) {
				t.Errorf("ParseAmount(%q) error = %v, want %v", tt.in, err, tt.wantErr)
			}
			if got != nil {
				t.Errorf("ParseAmount(%q) = %v with an error, want nil", tt.in, got)
			}
			continue
		}
		if err != nil || got.String() != tt.want {
			t.Errorf("ParseAmount(%q) = %v, %v; want %s", tt.in, got, err, tt.want)
		}
	}
}

func TestParseUint256AcceptsMaxUintAsValidBefore(t *testing.T) {
	got, err := ParseUint256(maxUint256Dec)
	if err != nil {
		t.Fatal(err)
	}
	if got.Cmp(MaxUint256()) != 0 || got.BitLen() != 256 {
		t.Errorf("ParseUint256(2^256-1) = %v", got)
	}
}

func TestParseUint256RefusesHexNoncesOfEIP3009LookAlikes(t *testing.T) {
	// A client that signs TransferWithAuthorization sends a 32-byte hex nonce where erc2612 expects decimal.
	_, err := ParseUint256("0x" + strings.Repeat("ab", 32))
	if !errors.Is(err, ErrNumberSyntax) || !strings.Contains(err.Error(), "0x prefix") {
		t.Errorf("error = %v, want a syntax error that mentions the 0x prefix", err)
	}
}

func TestParseErrorsSayWhatIsWrong(t *testing.T) {
	tests := []struct{ in, want string }{
		{"007", "leading zero"},
		{"1e6", "'e' at position 1"},
		{"", "empty"},
		{strings.Repeat("9", 80), "80 digits"},
	}
	for _, tt := range tests {
		_, err := ParseAmount(tt.in)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseAmount(%q) error = %v, want it to mention %q", tt.in, err, tt.want)
		}
	}
}

func TestMaxUint256ReturnsAFreshValueEachTime(t *testing.T) {
	a := MaxUint256()
	a.SetInt64(0)
	if MaxUint256().Sign() == 0 {
		t.Fatal("mutating one MaxUint256 result changed the next")
	}
}

func TestQuoteInputCutsLongInput(t *testing.T) {
	long := strings.Repeat("x", 10_000)
	if q := quoteInput(long); len(q) > 200 || !strings.Contains(q, "10000 bytes") {
		t.Errorf("quoteInput of 10000 bytes = %d bytes: %s", len(q), q[:50])
	}
}
