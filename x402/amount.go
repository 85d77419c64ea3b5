package x402

import (
	"errors"
	"fmt"
	"math/big"
)

// MaxUint256Digits is the number of decimal digits of 2^256-1, the longest number an EVM word holds.
const MaxUint256Digits = 78

// Errors of the number parsers, wrapped with the offending input; test with errors.Is.
var (
	// ErrNumberSyntax: the text is not a canonical unsigned decimal integer.
	ErrNumberSyntax = errors.New("not a canonical unsigned decimal integer")
	// ErrNumberRange: the number does not fit in 256 bits.
	ErrNumberRange = errors.New("number does not fit in 256 bits")
)

// ParseAmount parses an amount of raw token units: a decimal string of digits only, no sign, no exponent, no
// spaces, no leading zeros ("0" itself is fine), at most 78 digits and at most 2^256-1.
//
// Leading zeros ("007") are refused: public clients never send them, and accepting them would give one amount
// two spellings, which matters wherever an amount or nonce is compared or hashed as text (the journal id).
func ParseAmount(s string) (*big.Int, error) {
	n, err := parseUint256(s)
	if err != nil {
		return nil, fmt.Errorf("amount: %w", err)
	}
	return n, nil
}

// ParseUint256 parses a decimal-string field such as a nonce, deadline, validAfter or validBefore with the same
// rules as ParseAmount; validBefore may be 2^256-1 ("never expires").
func ParseUint256(s string) (*big.Int, error) {
	return parseUint256(s)
}

// maxUint256 returns 2^256-1. A function, not a package variable, so no caller can mutate a shared value.
func maxUint256() *big.Int {
	return new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
}

// MaxUint256 returns a fresh 2^256-1, the "no deadline" value of validBefore.
func MaxUint256() *big.Int { return maxUint256() }

func parseUint256(s string) (*big.Int, error) {
	if err := checkDecimal(s); err != nil {
		return nil, err
	}
	// Up to 19 digits always fit a uint64: skip big.Int's general parser on the common path.
	if len(s) <= 19 {
		var v uint64
		for i := 0; i < len(s); i++ {
			v = v*10 + uint64(s[i]-'0')
		}
		return new(big.Int).SetUint64(v), nil
	}
	n, ok := new(big.Int).SetString(s, 10)
	if !ok { // unreachable after checkDecimal; kept so a future change cannot return nil silently
		return nil, fmt.Errorf("%w: %s", ErrNumberSyntax, quoteInput(s))
	}
	if n.BitLen() > 256 {
		return nil, fmt.Errorf("%w: %s is larger than 2^256-1", ErrNumberRange, quoteInput(s))
	}
	return n, nil
}

// checkDecimal enforces the canonical decimal spelling and the digit limit, naming the first problem found.
func checkDecimal(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: empty string, expected digits such as \"10000\"", ErrNumberSyntax)
	case len(s) > MaxUint256Digits:
		return fmt.Errorf("%w: %d digits, at most %d fit in 256 bits", ErrNumberRange, len(s), MaxUint256Digits)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < '0' || c > '9' {
			return fmt.Errorf("%w: %s has %q at position %d, expected only digits 0-9 (no sign, decimal point, exponent, spaces or 0x prefix)",
				ErrNumberSyntax, quoteInput(s), c, i)
		}
	}
	if len(s) > 1 && s[0] == '0' {
		return fmt.Errorf("%w: %s has a leading zero, expected the canonical form without one", ErrNumberSyntax, quoteInput(s))
	}
	return nil
}

// quoteInput quotes untrusted input for an error message, cut short so a huge header cannot bloat a log line.
func quoteInput(s string) string {
	const max = 100
	if len(s) > max {
		return fmt.Sprintf("%q... (%d bytes)", s[:max], len(s))
	}
	return fmt.Sprintf("%q", s)
}
