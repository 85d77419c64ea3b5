package journal

import (
	"math/big"
	"regexp"
	"strings"
	"testing"
)

const (
	testNetwork = "eip155:84532"
	testAsset   = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
	testPayer   = "0x857b06519E91e3A54538791bDbb0E22373e36b66"
)

func TestPaymentIDIsTheSameForEquivalentSpellings(t *testing.T) {
	base := PaymentID(testNetwork, "permit2", testAsset, testPayer, "5")
	for _, tc := range []struct {
		name                             string
		network, method, asset, payer, n string
	}{
		{"lowercase addresses", testNetwork, "permit2", strings.ToLower(testAsset), strings.ToLower(testPayer), "5"},
		{"uppercase hex digits", testNetwork, "permit2", "0x" + strings.ToUpper(testAsset[2:]), testPayer, "5"},
		{"addresses without 0x", testNetwork, "permit2", testAsset[2:], testPayer[2:], "5"},
		{"leading zeros in the nonce", testNetwork, "permit2", testAsset, testPayer, "0005"},
		{"hex nonce", testNetwork, "permit2", testAsset, testPayer, "0x05"},
		{"hex nonce in capitals", testNetwork, "permit2", testAsset, testPayer, "0X5"},
		{"method in capitals", testNetwork, "PERMIT2", testAsset, testPayer, "5"},
		{"surrounding spaces", " " + testNetwork, "permit2 ", testAsset + " ", " " + testPayer, " 5 "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := PaymentID(tc.network, tc.method, tc.asset, tc.payer, tc.n); got != base {
				t.Fatalf("PaymentID = %s, want %s", got, base)
			}
		})
	}
}

func TestPaymentIDDiffersWhenAnyFieldDiffers(t *testing.T) {
	base := PaymentID(testNetwork, "permit2", testAsset, testPayer, "5")
	other := "0x0000000000000000000000000000000000000001"
	for _, tc := range []struct {
		name                             string
		network, method, asset, payer, n string
	}{
		{"network", "eip155:8453", "permit2", testAsset, testPayer, "5"},
		{"transfer method with the same nonce", testNetwork, "erc2612", testAsset, testPayer, "5"},
		{"asset", testNetwork, "permit2", other, testPayer, "5"},
		{"payer", testNetwork, "permit2", testAsset, other, "5"},
		{"nonce", testNetwork, "permit2", testAsset, testPayer, "6"},
		{"decimal 10 against hex 0x10", testNetwork, "permit2", testAsset, testPayer, "0x10"},
		{"numeric against text nonce", testNetwork, "permit2", testAsset, testPayer, "s:5"},
		{"negative nonce is text, not 5", testNetwork, "permit2", testAsset, testPayer, "-5"},
		// Shifting characters between adjacent fields must not produce the same bytes to hash.
		{"field boundary shifted", testNetwork + "p", "ermit2", testAsset, testPayer, "5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := PaymentID(tc.network, tc.method, tc.asset, tc.payer, tc.n); got == base {
				t.Fatalf("PaymentID with a different %s = %s, the same as the base id", tc.name, got)
			}
		})
	}
}

func TestPaymentIDReadsA256BitNonce(t *testing.T) {
	dec := "115792089237316195423570985008687907853269984665640564039457584007913129639935" // 2^256-1
	hex := "0x" + strings.Repeat("f", 64)
	if PaymentID(testNetwork, "permit2", testAsset, testPayer, dec) != PaymentID(testNetwork, "permit2", testAsset, testPayer, hex) {
		t.Fatal("decimal and hex spellings of 2^256-1 gave different ids")
	}
}

func TestIDStringRoundTripsThroughParseIDAndText(t *testing.T) {
	id := PaymentID(testNetwork, "erc2612", testAsset, testPayer, "7")
	s := id.String()
	if len(s) != 66 || !strings.HasPrefix(s, "0x") {
		t.Fatalf("String = %q, want 0x and 64 hex digits", s)
	}
	for _, in := range []string{s, s[2:], strings.ToUpper(s[2:])} {
		got, err := parseID(in)
		if err != nil || got != id {
			t.Fatalf("parseID(%q) = %s, %v; want %s", in, got, err, id)
		}
	}
	text, _ := id.MarshalText()
	var back ID
	if err := back.UnmarshalText(text); err != nil || back != id {
		t.Fatalf("UnmarshalText(MarshalText) = %s, %v; want %s", back, err, id)
	}
}

func TestParseIDRefusesWhatIsNotAnID(t *testing.T) {
	// Two prefixes were read as one (FuzzParseID's grammar check, seeded with them).
	for _, in := range []string{"", "0x", "0x1234", strings.Repeat("z", 64), "0x" + strings.Repeat("a", 66), "0x0X" + strings.Repeat("a", 64),
		"0x0x" + strings.Repeat("a", 62)} {
		if _, err := parseID(in); err == nil {
			t.Errorf("parseID(%q) succeeded, want an error", in)
		}
	}
}

// The shortcut for nonces already written as big.Int writes them gives the same canonical form as the full
// parse, for every shape of decimal input (and only takes plain decimals).
func FuzzCanonicalNonceShortcutMatchesTheFullParse(f *testing.F) {
	for _, s := range []string{"0", "7", "007", "10", "115792089237316195423570985008687907853269984665640564039457584007913129639935", "", "1a", "-1", "+1", " 5 "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got := canonicalNonce(s)
		var n big.Int
		trimmed := strings.TrimSpace(s)
		if plainDecimal(trimmed) {
			if _, ok := n.SetString(trimmed, 10); !ok || got != "n:"+n.String() {
				t.Fatalf("canonicalNonce(%q) = %q, want n:%s", s, got, n.String())
			}
		}
	})
}

// idGrammar is what parseID documents it reads, written independently of it: 64 hex digits, with or without one
// 0x prefix.
var idGrammar = regexp.MustCompile(`^(0[xX])?[0-9a-fA-F]{64}$`)

// parseID reads exactly the spellings of an id it documents and no other, and what it reads is written back by
// String and read again as the same id.
func FuzzParseID(f *testing.F) {
	id := PaymentID(testNetwork, "permit2", testAsset, testPayer, "7")
	for _, s := range []string{id.String(), id.String()[2:], "0X" + strings.ToUpper(id.String()[2:]), id.String()[:65], id.String() + "0",
		"", "0x", "0x" + strings.Repeat("g", 64), " " + id.String(), "0x0X" + id.String()[2:]} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := parseID(s)
		if (err == nil) != idGrammar.MatchString(s) {
			t.Fatalf("parseID(%q) = %s, %v; want it to succeed exactly for 64 hex digits after an optional 0x", s, got, err)
		}
		if err != nil {
			if got != (ID{}) || !strings.Contains(err.Error(), "journal id") {
				t.Fatalf("parseID(%q) = %s, %v; want the zero id and an error naming a journal id", s, got, err)
			}
			return
		}
		if want := "0x" + strings.ToLower(s[len(s)-64:]); got.String() != want {
			t.Fatalf("parseID(%q).String() = %s, want %s", s, got, want)
		}
		var back ID
		text, _ := got.MarshalText()
		if err := back.UnmarshalText(text); err != nil || back != got {
			t.Fatalf("UnmarshalText(MarshalText(%s)) = %s, %v", got, back, err)
		}
	})
}
