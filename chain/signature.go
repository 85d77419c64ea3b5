package chain

import (
	"bytes"
	"crypto/ecdsa"
	"errors"
	"fmt"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
)

// Errors of signature parsing and recovery. They are wrapped with detail; test with errors.Is. A verifier
// answers all of them with an invalid-signature reason, but logs and tests need to tell them apart.
var (
	// errSignatureLength means the signature is not 65 bytes (r, s, v). Smart-wallet signatures
	// (EIP-1271, EIP-6492) are longer and end here too.
	errSignatureLength = errors.New("signature is not 65 bytes")
	// errSignatureHighS means s lies in the upper half of the curve order: a malleated copy of a valid
	// signature, which the permit contracts (OpenZeppelin ECDSA) refuse.
	errSignatureHighS = errors.New("signature s is in the upper half of the curve order")
	// errSignatureV means the recovery byte v is not 0, 1, 27 or 28.
	errSignatureV = errors.New("signature v is not 0, 1, 27 or 28")
	// errSignatureInvalid means the signature is not hex, r or s is out of range, or no key recovers from it.
	errSignatureInvalid = errors.New("invalid signature")
)

// Signature is a 65-byte secp256k1 signature r || s || v, with v normalised to 27 or 28 as contracts and
// clients expect it.
type Signature [65]byte

// secp256k1 group order n, and n/2: the largest s that is not malleable.
var (
	secp256k1N     = [32]byte(common.FromHex("0xfffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141"))
	secp256k1HalfN = [32]byte(common.FromHex("0x7fffffffffffffffffffffffffffffff5d576e7357a4501ddfe92f46681b20a0"))
)

// ParseSignature parses a 0x-prefixed hex signature of exactly 65 bytes. It accepts v as 0, 1, 27 or 28 and
// normalises it to 27 or 28. It does not check r and s: RecoverSigner does.
func ParseSignature(s string) (Signature, error) {
	var sig Signature
	if len(s) < 2 || s[0] != '0' || (s[1] != 'x' && s[1] != 'X') {
		return sig, fmt.Errorf("%w: expected 0x-prefixed hex, got %q", errSignatureInvalid, truncate(s))
	}
	h := s[2:]
	if len(h) != 2*len(sig) {
		return sig, fmt.Errorf("%w: expected 130 hex digits (65 bytes) after 0x, got %d", errSignatureLength, len(h))
	}
	for i := range sig {
		hi, ok1 := fromHexChar(h[2*i])
		lo, ok2 := fromHexChar(h[2*i+1])
		if !ok1 || !ok2 {
			return Signature{}, fmt.Errorf("%w: expected hex digits, got %q at offset %d", errSignatureInvalid, h[2*i:2*i+2], 2+2*i)
		}
		sig[i] = hi<<4 | lo
	}
	v, err := normaliseV(sig[64])
	if err != nil {
		return Signature{}, err
	}
	sig[64] = v + 27
	return sig, nil
}

// RecoverSigner returns the address whose key signed digest. It accepts v as 0, 1, 27 or 28, and refuses
// malleable (high-s) signatures and r or s out of range, so that one payment has exactly one valid signature.
func RecoverSigner(digest common.Hash, sig Signature) (common.Address, error) {
	v, err := normaliseV(sig[64])
	if err != nil {
		return common.Address{}, err
	}
	r, s := sig[0:32], sig[32:64]
	if isZero(r) || bytes.Compare(r, secp256k1N[:]) >= 0 {
		return common.Address{}, fmt.Errorf("%w: r is not in [1, n-1]", errSignatureInvalid)
	}
	if isZero(s) {
		return common.Address{}, fmt.Errorf("%w: s is zero", errSignatureInvalid)
	}
	if bytes.Compare(s, secp256k1HalfN[:]) > 0 {
		return common.Address{}, fmt.Errorf("%w: s = 0x%x exceeds n/2; expected the low-s form n - s", errSignatureHighS, s)
	}
	// Ecrecover wants v as the recovery id 0 or 1.
	sig[64] = v
	pub, err := crypto.Ecrecover(digest[:], sig[:])
	if err != nil {
		return common.Address{}, fmt.Errorf("%w: no public key recovers from it: %v", errSignatureInvalid, err)
	}
	// Hashing the 64-byte point directly spares the unmarshal and curve check SigToPub would do; secp256k1
	// only returns points on the curve.
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	copy(h.buf[:64], pub[1:])
	hash := h.sum(64)
	return common.BytesToAddress(hash[12:]), nil
}

// splitSignature returns v (27 or 28), r and s as the on-chain permit(owner, spender, value, deadline, v, r, s)
// takes them.
func splitSignature(sig Signature) (v uint8, r, s [32]byte) {
	v = sig[64]
	if v < 27 {
		v += 27
	}
	copy(r[:], sig[0:32])
	copy(s[:], sig[32:64])
	return v, r, s
}

// signDigest signs an EIP-712 digest with key. The result has low s and v of 27 or 28.
func signDigest(key *ecdsa.PrivateKey, digest common.Hash) (Signature, error) {
	var sig Signature
	raw, err := crypto.Sign(digest[:], key)
	if err != nil {
		return sig, fmt.Errorf("signing digest %s: %w", digest, err)
	}
	copy(sig[:], raw)
	sig[64] += 27
	return sig, nil
}

// hex returns the signature as 0x-prefixed lower-case hex, the wire form.
func (sig Signature) hex() string {
	const digits = "0123456789abcdef"
	var b [2 + 2*len(sig)]byte
	b[0], b[1] = '0', 'x'
	for i, c := range sig {
		b[2+2*i] = digits[c>>4]
		b[3+2*i] = digits[c&0x0f]
	}
	return string(b[:])
}

// String returns the signature as hex.
func (sig Signature) String() string { return sig.hex() }

func normaliseV(v byte) (byte, error) {
	switch v {
	case 0, 1:
		return v, nil
	case 27, 28:
		return v - 27, nil
	}
	return 0, fmt.Errorf("%w: got %d", errSignatureV, v)
}

func isZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

func fromHexChar(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// truncate shortens untrusted input quoted in an error message.
func truncate(s string) string {
	const max = 80
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}
