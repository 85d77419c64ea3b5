package x402

import (
	"encoding/hex"
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

// ClaimedPayer is the payer a payment's payload names, in EIP-55 case, for answers about payments that were not
// (or not yet) verified, and to count a payer's calls as one whatever the case it is written in; "" when the
// payload names no address.
func ClaimedPayer(req VerifyRequest) string {
	from, _ := req.PaymentPayload.Payload.PayerAndNonce()
	return ChecksumAddress(from)
}
