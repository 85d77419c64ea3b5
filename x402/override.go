package x402

import (
	"errors"
	"fmt"
	"math/big"
	"strings"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// HeaderSettlementOverrides is the response header through which a resource server's handler tells the gate what
// to settle of an upto payment, as the public server SDKs read it: JSON {"amount": "..."}.
const HeaderSettlementOverrides = "Settlement-Overrides"

// maxOverrideLen bounds the header value read: an amount and its JSON need a few dozen bytes.
const maxOverrideLen = 512

// ErrOverrideAboveMaximum is wrapped by ParseSettlementOverride for an amount above the authorized maximum.
var ErrOverrideAboveMaximum = errors.New("the override is above the authorized maximum")

// ParseSettlementOverride reads a Settlement-Overrides header value, {"amount": A}, and returns the amount to
// settle in raw units of a token with the given decimals. A is a string, in one of the forms the public server
// SDKs accept: raw token units ("1234"), dollars ("$0.0123", truncated to the token's precision as the SDKs do),
// or a percentage of the authorized maximum with up to two decimals ("12.5%", rounded down). An amount above
// max is returned with an error wrapping ErrOverrideAboveMaximum, so the caller can say what was asked; any other
// error means the value says nothing usable. Unknown members are ignored, as peers add fields.
func ParseSettlementOverride(value string, max *big.Int, decimals uint8) (*big.Int, error) {
	if len(value) > maxOverrideLen {
		return nil, fmt.Errorf("%s: %d bytes, at most %d expected", HeaderSettlementOverrides, len(value), maxOverrideLen)
	}
	var doc struct {
		Amount jsontext.Value `json:"amount"`
	}
	if err := jsonv2.Unmarshal([]byte(value), &doc); err != nil {
		return nil, fmt.Errorf("%s %s: expected a JSON object such as {\"amount\":\"1234\"}: %v", HeaderSettlementOverrides, quoteInput(value), err)
	}
	if doc.Amount == nil {
		return nil, fmt.Errorf("%s %s: no \"amount\" member", HeaderSettlementOverrides, quoteInput(value))
	}
	if doc.Amount.Kind() != '"' {
		return nil, fmt.Errorf("%s %s: amount must be a string (\"1234\" raw units, \"$0.01\" or \"50%%\"), got %s", HeaderSettlementOverrides, quoteInput(value), doc.Amount)
	}
	var text string
	if err := jsonv2.Unmarshal(doc.Amount, &text); err != nil {
		return nil, fmt.Errorf("%s %s: %v", HeaderSettlementOverrides, quoteInput(value), err)
	}
	n, err := overrideAmount(text, max, decimals)
	if err != nil {
		return nil, fmt.Errorf("%s amount %s: %w", HeaderSettlementOverrides, quoteInput(text), err)
	}
	if max != nil && n.Cmp(max) > 0 {
		return n, fmt.Errorf("%s amount %s is %s raw units: %w of %s", HeaderSettlementOverrides, quoteInput(text), n, ErrOverrideAboveMaximum, max)
	}
	return n, nil
}

// overrideAmount turns the amount of an override into raw units.
func overrideAmount(s string, max *big.Int, decimals uint8) (*big.Int, error) {
	switch {
	case strings.HasSuffix(s, "%"):
		if max == nil {
			return nil, errors.New("a percentage needs the authorized maximum")
		}
		whole, frac, _ := strings.Cut(strings.TrimSuffix(s, "%"), ".")
		if whole == "" || !allDigits(whole) || !allDigits(frac) || len(frac) > 2 || len(whole) > 6 {
			return nil, errors.New("a percentage has digits and at most two decimals, such as \"12.5%\"")
		}
		hundredths, _ := new(big.Int).SetString(whole+frac+strings.Repeat("0", 2-len(frac)), 10)
		n := new(big.Int).Mul(max, hundredths)
		return n.Quo(n, big.NewInt(10000)), nil
	case strings.HasPrefix(s, "$"):
		whole, frac, hasPoint := strings.Cut(s[1:], ".")
		if whole == "" || !allDigits(whole) || !allDigits(frac) || (hasPoint && frac == "") {
			return nil, errors.New("a dollar amount has digits on both sides of any decimal point, such as \"$0.0123\"")
		}
		if len(frac) > int(decimals) {
			frac = frac[:decimals] // truncated, as the public SDKs convert it
		}
		digits := strings.TrimLeft(whole+frac+strings.Repeat("0", int(decimals)-len(frac)), "0")
		if digits == "" {
			digits = "0"
		}
		return parseUint256(digits)
	}
	return parseUint256(s)
}

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}
