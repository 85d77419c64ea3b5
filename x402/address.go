package x402

import (
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/sha3"
)

// ChecksumAddress is the EIP-55 mixed-case spelling of s, a well-formed address (IsHexAddress), or "" when s is
// not one. Answers name addresses this way, however the peer spelled them, so that one address is one string.
func ChecksumAddress(s string) string {
	if !IsHexAddress(s) {
		return ""
	}
	lower := strings.ToLower(s[2:])
	h := sha3.NewLegacyKeccak256()
	h.Write([]byte(lower))
	sum := hex.EncodeToString(h.Sum(nil))
	out := []byte("0x" + lower)
	for i := range lower {
		// A letter is upper case where the matching nibble of the hash of the lower-case hex is 8 or more.
		if c := out[2+i]; c >= 'a' && c <= 'f' && sum[i] >= '8' {
			out[2+i] = c - 'a' + 'A'
		}
	}
	return string(out)
}

// ErrAddressChecksum is the error of CheckAddress for an address in mixed case whose EIP-55 checksum fails.
var ErrAddressChecksum = errors.New("its mixed case fails the EIP-55 checksum, so a character of it is mistyped")

// CheckAddress says why s cannot name an address in configuration, nil when it can: "0x" and 40 hex digits, in
// one case, or in mixed case whose EIP-55 checksum holds. Mixed case is a checksum: one that fails says the
// address was mistyped (or its case edited), and tokens sent to a mistyped address are gone. Its error never
// offers the checksummed spelling of what came: that would be the right case of a wrong address.
func CheckAddress(s string) error {
	if !IsHexAddress(s) {
		return fmt.Errorf("%s is not an address (0x and 40 hex digits)", quoteInput(s))
	}
	hexPart := s[2:]
	if hexPart == strings.ToLower(hexPart) || hexPart == strings.ToUpper(hexPart) {
		return nil
	}
	if ChecksumAddress(s)[2:] != hexPart {
		return fmt.Errorf("%s: %w; check it against where it came from (an address in one case, all lower or all upper, carries no checksum)",
			quoteInput(s), ErrAddressChecksum)
	}
	return nil
}

// ClaimedPayer is the payer a payment's payload names, in EIP-55 case, for answers about payments that were not
// (or not yet) verified, and to count a payer's calls as one whatever the case it is written in; "" when the
// payload names no address.
func ClaimedPayer(req VerifyRequest) string {
	from, _ := req.PaymentPayload.Payload.PayerAndNonce()
	return ChecksumAddress(from)
}
