package x402

import (
	"errors"
	"fmt"
	"math/big"
	"strings"
)

// maxPriceLen bounds the price text so a configuration typo cannot make the parser do unbounded big-number work.
const maxPriceLen = 120

// ParsePrice turns a dollar price from configuration ("$0.01", "0.01 USD") into raw units of a token with the
// given decimals, using exact decimal arithmetic: "$0.01" with 6 decimals is 10000.
//
// It refuses an empty, negative or malformed price, a bare number ("10000": dollars, or raw token units meant
// as an amount? a price says which by its "$" or "USD"), and a price with more precision than the token has
// ("$0.0000001" with 6 decimals): rounding would charge something other than what was configured. Trailing
// zeros beyond the token's precision are fine. A zero price parses as zero; callers that gate a resource should
// refuse it, since the settlement proxy reverts on amount 0.
func ParsePrice(s string, decimals uint8) (*big.Int, error) {
	intPart, frac, err := priceDigits(s)
	if err != nil {
		return nil, err
	}
	if excess := strings.TrimRight(frac, "0"); len(excess) > int(decimals) {
		return nil, fmt.Errorf("price %s has %d decimal places but the token has only %d; use a price that is a whole number of token units",
			quoteInput(s), len(excess), decimals)
	}
	frac = strings.TrimRight(frac, "0")
	digits := intPart + frac + strings.Repeat("0", int(decimals)-len(frac))
	n, ok := new(big.Int).SetString(digits, 10)
	if !ok {
		return nil, fmt.Errorf("price %s: not a decimal number", quoteInput(s))
	}
	if n.BitLen() > 256 {
		return nil, fmt.Errorf("price %s: %w", quoteInput(s), ErrNumberRange)
	}
	return n, nil
}

// CheckPrice checks a dollar price as ParsePrice does, for a token whose decimals are not known yet: everything
// but its precision and its range in the token's units. zero reports a price of nothing.
func CheckPrice(s string) (zero bool, err error) {
	intPart, frac, err := priceDigits(s)
	if err != nil {
		return false, err
	}
	return strings.Trim(intPart+frac, "0") == "", nil
}

// priceDigits reads a price's number as the digits before and after its decimal point.
func priceDigits(s string) (intPart, frac string, err error) {
	num, err := priceNumber(s)
	if err != nil {
		return "", "", err
	}
	intPart, frac, hasPoint := strings.Cut(num, ".")
	if intPart == "" || (hasPoint && frac == "") {
		return "", "", fmt.Errorf("price %s: expected digits on both sides of the decimal point, such as \"$0.50\"", quoteInput(s))
	}
	if i := strings.IndexFunc(intPart+frac, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		return "", "", fmt.Errorf("price %s: unexpected %q, expected a dollar amount such as \"$0.01\" or \"0.01 USD\" (no thousands separators or exponents)",
			quoteInput(s), (intPart + frac)[i])
	}
	return intPart, frac, nil
}

// priceNumber strips the currency decoration of a price and returns the bare number. A price must wear one:
// "price 10000" could be meant as ten thousand dollars or as 10000 raw units (a hundredth of a 6-decimal
// token), and the two are a million times apart.
func priceNumber(s string) (string, error) {
	if len(s) > maxPriceLen {
		return "", fmt.Errorf("price %s: longer than %d characters", quoteInput(s), maxPriceLen)
	}
	t := strings.TrimSpace(s)
	if t == "" {
		return "", errors.New("price is empty: expected a dollar amount such as \"$0.01\", \"0.01 USD\" or \"0.01\"")
	}
	bare := true
	if len(t) >= 3 && strings.EqualFold(t[len(t)-3:], "USD") {
		t, bare = strings.TrimSpace(t[:len(t)-3]), false
	}
	if rest, ok := strings.CutPrefix(t, "$"); ok {
		t, bare = rest, false
	}
	switch {
	case t == "":
		return "", fmt.Errorf("price %s has no number", quoteInput(s))
	case t[0] == '-':
		return "", fmt.Errorf("price %s is negative, expected zero or more", quoteInput(s))
	case t[0] == '+':
		return "", fmt.Errorf("price %s: expected no sign", quoteInput(s))
	case !bare:
	case isDigits(t):
		return "", fmt.Errorf("price %s is a bare number: write \"$%s\" for dollars, or amount %s for raw token units", quoteInput(s), t, t)
	case strings.Count(t, ".") == 1 && isDigits(strings.Replace(t, ".", "", 1)) && t[0] != '.' && t[len(t)-1] != '.':
		return "", fmt.Errorf("price %s is a bare number: write \"$%s\" (or \"%s USD\") for dollars", quoteInput(s), t, t)
	}
	// A bare text that is no number at all is refused for what is wrong with it, by the caller.
	return t, nil
}

// FormatTokenAmount writes raw units as a decimal number of tokens, for people: "10000" with 6 decimals is
// "0.01". A raw amount that is not a decimal number is returned as it is.
func FormatTokenAmount(raw string, decimals uint8) string {
	n, ok := new(big.Int).SetString(raw, 10)
	if !ok {
		return raw
	}
	unit := new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(decimals)), nil)
	whole, frac := new(big.Int).QuoRem(n, unit, new(big.Int))
	if frac.Sign() == 0 {
		return whole.String()
	}
	fs := frac.String()
	fs = strings.Repeat("0", int(decimals)-len(fs)) + fs
	return whole.String() + "." + strings.TrimRight(fs, "0")
}

// isDigits reports whether s is one or more decimal digits.
func isDigits(s string) bool { return s != "" && allBytes(s, isDigit) }
