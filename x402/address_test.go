package x402

import (
	"strings"
	"testing"
)

// The vectors of EIP-55 itself, each given in lower and upper case too.
func TestChecksumAddressSpellsAddressesAsEIP55Does(t *testing.T) {
	for _, want := range []string{
		"0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed",
		"0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359",
		"0xdbF03B407c01E7cD3CBea99509d93f8DDDC8C6FB",
		"0xD1220A0cf47c7B9Be7A2E6BA89F429762e7b9aDb",
	} {
		for _, in := range []string{want, "0x" + toLower(want[2:]), "0X" + toUpper(want[2:])} {
			if got := ChecksumAddress(in); got != want {
				t.Errorf("ChecksumAddress(%s) = %s, want %s", in, got, want)
			}
		}
	}
	for _, bad := range []string{"", "0x", "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAe", "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeg", "5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed00"} {
		if got := ChecksumAddress(bad); got != "" {
			t.Errorf("ChecksumAddress(%q) = %q, want \"\" for no address", bad, got)
		}
	}
}

func TestClaimedPayerIsThePayloadsFromInChecksumCaseOrNothing(t *testing.T) {
	const from = "0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359"
	permit2 := VerifyRequest{PaymentPayload: PaymentPayload{Payload: ExactEVMPayload{Permit2Authorization: &Permit2Authorization{From: toLower(from)}}}}
	erc2612 := VerifyRequest{PaymentPayload: PaymentPayload{Payload: ExactEVMPayload{Authorization: &EIP2612Authorization{From: from}}}}
	if got := ClaimedPayer(permit2); got != from {
		t.Errorf("permit2 payer = %q, want %q", got, from)
	}
	if got := ClaimedPayer(erc2612); got != from {
		t.Errorf("erc2612 payer = %q, want %q", got, from)
	}
	if got := ClaimedPayer(VerifyRequest{}); got != "" {
		t.Errorf("payer of a payload without authorization = %q, want \"\"", got)
	}
	bad := VerifyRequest{PaymentPayload: PaymentPayload{Payload: ExactEVMPayload{Authorization: &EIP2612Authorization{From: "me"}}}}
	if got := ClaimedPayer(bad); got != "" {
		t.Errorf("payer named %q = %q, want \"\"", "me", got)
	}
}

func toLower(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

func toUpper(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'a' && c <= 'z' {
			b[i] = c - 'a' + 'A'
		}
	}
	return string(b)
}

func TestCheckAddressRefusesAMixedCaseAddressWhoseChecksumFails(t *testing.T) {
	const good = "0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359"
	for _, ok := range []string{good, toLower(good), "0x" + toUpper(good[2:]), "0X" + toUpper(good[2:]), "0x0000000000000000000000000000000000000001"} {
		if err := CheckAddress(ok); err != nil {
			t.Errorf("CheckAddress(%s) = %v, want nil", ok, err)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{"0xFB6916095ca1df60bB79Ce92cE3Ea74c37c5d359", "EIP-55 checksum"}, // one letter's case changed
		{"0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d358", "EIP-55 checksum"}, // one digit mistyped
		{"0xfB69", "is not an address (0x and 40 hex digits)"},
		{"", "is not an address"},
	} {
		err := CheckAddress(tc.in)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckAddress(%q) = %v, want an error saying %q", tc.in, err, tc.want)
		}
		if err != nil && tc.want == "EIP-55 checksum" && strings.Contains(err.Error(), ChecksumAddress(tc.in)) {
			t.Errorf("CheckAddress(%q) = %v: it offers the checksummed spelling of a mistyped address", tc.in, err)
		}
	}
}
