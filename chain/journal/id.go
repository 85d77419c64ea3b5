package journal

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math/big"
	"strings"
)

// ID identifies one payment in the journal: a SHA-256 over the canonical form of what makes a payment unique
// on chain. It is the same for every retry of the same signed payment, whichever replica computes it.
type ID [32]byte

// idDomain separates journal ids from any other hash of the same fields; bump it only with a migration, since
// a new domain makes every journalled payment look new.
const idDomain = "x402-journal/payment-id/v1"

// PaymentID returns the journal id of a payment: network (CAIP-2, e.g. "eip155:8453"), the asset transfer
// method ("permit2", "erc2612", ...), the token, the payer and the payer's authorization nonce.
//
// Addresses are compared as 20-byte values, so their case does not matter. The nonce is read as an integer
// (decimal, or hex with a 0x prefix) and written in decimal without leading zeros, so "0x05", "005" and "5" are
// one nonce; a nonce that is not an integer, which verification refuses before settlement, is hashed as
// trimmed text under its own tag so it can never collide with a numeric one. The transfer method is part of
// the id because an erc2612 nonce (the token's counter) and a permit2 nonce (Permit2's bitmap) of one payer
// are different authorizations even when their numbers are equal.
func PaymentID(network, transferMethod, asset, payer, nonce string) ID {
	h := sha256.New()
	var lenBuf [binary.MaxVarintLen64]byte
	// Every field is length-prefixed, so no choice of field contents can make two different tuples encode
	// to the same bytes.
	for _, field := range []string{
		idDomain,
		strings.TrimSpace(network),
		strings.ToLower(strings.TrimSpace(transferMethod)),
		canonicalAddress(asset),
		canonicalAddress(payer),
		canonicalNonce(nonce),
	} {
		n := binary.PutUvarint(lenBuf[:], uint64(len(field)))
		h.Write(lenBuf[:n])
		h.Write([]byte(field))
	}
	var id ID
	h.Sum(id[:0])
	return id
}

// canonicalAddress lowercases an address and adds the 0x prefix a bare 40-digit hex string lacks.
func canonicalAddress(a string) string {
	a = strings.ToLower(strings.TrimSpace(a))
	if len(a) == 40 && !strings.HasPrefix(a, "0x") {
		if _, err := hex.DecodeString(a); err == nil {
			return "0x" + a
		}
	}
	return a
}

// canonicalNonce writes an integer nonce as "n:<decimal>" and anything else as "s:<text>".
func canonicalNonce(s string) string {
	s = strings.TrimSpace(s)
	if plainDecimal(s) {
		return "n:" + s // what the big.Int round trip below would write, without it
	}
	digits, base := s, 10
	if rest, ok := strings.CutPrefix(strings.ToLower(s), "0x"); ok {
		digits, base = rest, 16
	}
	var n big.Int
	// big.Int alone would also accept signs; a nonce is an unsigned integer, so anything else is text.
	if digits == "" || strings.ContainsAny(digits, "+-") {
		return "s:" + s
	}
	if _, ok := n.SetString(digits, base); !ok {
		return "s:" + s
	}
	return "n:" + n.String()
}

// plainDecimal reports whether s is a decimal integer written as big.Int writes it: digits, no leading zero.
func plainDecimal(s string) bool {
	if s == "" || (s[0] == '0' && len(s) > 1) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// parseID reads an id written by ID.String: 64 hex digits, with or without a 0x prefix.
func parseID(s string) (ID, error) {
	var id ID
	raw := s
	if len(raw) >= 2 && raw[0] == '0' && (raw[1] == 'x' || raw[1] == 'X') {
		raw = raw[2:] // one prefix, not "0x0X"
	}
	if len(raw) != 2*len(id) {
		return ID{}, fmt.Errorf("journal id %q: want %d hex digits, got %d", s, 2*len(id), len(raw))
	}
	if _, err := hex.Decode(id[:], []byte(raw)); err != nil {
		return ID{}, fmt.Errorf("journal id %q: %w", s, err)
	}
	return id, nil
}

// String returns the id as 0x-prefixed lowercase hex.
func (id ID) String() string { return "0x" + hex.EncodeToString(id[:]) }

// IsZero reports whether the id is unset; PaymentID never returns it.
func (id ID) IsZero() bool { return id == ID{} }

// MarshalText writes the id as String does, so records read well as JSON.
func (id ID) MarshalText() ([]byte, error) { return []byte(id.String()), nil }

// UnmarshalText reads what MarshalText wrote.
func (id *ID) UnmarshalText(b []byte) error {
	parsed, err := parseID(string(b))
	if err != nil {
		return err
	}
	*id = parsed
	return nil
}

// batchEscrow is the batch-settlement escrow every voucher id names (chain/contracts' BatchSettlementAddress, the
// public SDK's canonical address): part of the id as the engine first wrote it.
const batchEscrow = "0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003"

// BatchVoucherID is the journal id of a batch-settlement voucher: channel channelID (bytes32 hex, any case) on
// network, at cumulative amount cumulative (decimal). The engine writes the voucher's answer under it as it
// accepts it, and a gate marks it served there once the response it bought is delivered; the cumulative amount
// only grows, so each voucher of a channel has an id of its own.
func BatchVoucherID(network, channelID, cumulative string) ID {
	return PaymentID(network, "batch-voucher", batchEscrow, strings.ToLower(strings.TrimSpace(channelID)), cumulative)
}
