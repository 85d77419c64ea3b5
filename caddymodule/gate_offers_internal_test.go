package caddymodule

import (
	"strings"
	"testing"
)

func TestParseCostTakesExactlyOnePositivePrice(t *testing.T) {
	for _, tc := range []struct {
		amount, price, want, err string
	}{
		{"10000", "", "10000", ""},
		{"", "$0.01", "10000", ""},
		{"", "0.5 USD", "500000", ""},
		{"10000", "$0.01", "", "both"},
		{"", "", "", "no price"},
		{"0", "", "", "zero"},
		{"", "$0", "", "zero"},
		{"-1", "", "", "amount"},
		{"1.5", "", "", "amount"},
		{"", "$0.0000001", "", "decimal places"},
	} {
		n, err := parseCost(tc.amount, tc.price, 6)
		switch {
		case tc.err == "" && (err != nil || n.String() != tc.want):
			t.Errorf("parseCost(%q, %q) = %v, %v; want %s", tc.amount, tc.price, n, err, tc.want)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("parseCost(%q, %q) error = %v, want one containing %q", tc.amount, tc.price, err, tc.err)
		}
	}
}
