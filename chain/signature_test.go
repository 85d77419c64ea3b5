package chain

import (
	"crypto/ecdsa"
	"encoding/hex"
	"errors"
	"math/big"
	"regexp"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
)

// testKey is a fixed payer key: its address is stable across runs, which keeps failures reproducible.
func testKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := crypto.HexToECDSA("4c0883a69102937d6231471b5dbb6204fe5129617082792ae468d01a3f362318")
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func signed(t testing.TB, key *ecdsa.PrivateKey, digest common.Hash) Signature {
	t.Helper()
	sig, err := signDigest(key, digest)
	if err != nil {
		t.Fatal(err)
	}
	return sig
}

// malleate returns the other valid signature of the same digest: s' = n - s with the recovery bit flipped.
func malleate(sig Signature) Signature {
	n := crypto.S256().Params().N
	s := new(big.Int).SetBytes(sig[32:64])
	new(big.Int).Sub(n, s).FillBytes(sig[32:64])
	sig[64] = 27 + 28 - sig[64] // flip the recovery bit: 27 <-> 28
	return sig
}

func TestCurveOrderConstantsMatchSecp256k1(t *testing.T) {
	n := crypto.S256().Params().N
	if new(big.Int).SetBytes(secp256k1N[:]).Cmp(n) != 0 {
		t.Errorf("secp256k1N = %x, want %x", secp256k1N, n)
	}
	if half := new(big.Int).Rsh(n, 1); new(big.Int).SetBytes(secp256k1HalfN[:]).Cmp(half) != 0 {
		t.Errorf("secp256k1HalfN = %x, want %x", secp256k1HalfN, half)
	}
}

func TestSignedDigestsRecoverTheSigner(t *testing.T) {
	for i := range 50 {
		key, err := crypto.GenerateKey()
		if err != nil {
			t.Fatal(err)
		}
		digest := crypto.Keccak256Hash(big.NewInt(int64(i)).Bytes())
		sig := signed(t, key, digest)
		if v := sig[64]; v != 27 && v != 28 {
			t.Fatalf("signature v = %d, want 27 or 28", v)
		}
		got, err := RecoverSigner(digest, sig)
		if err != nil {
			t.Fatalf("recovering a fresh signature: %v", err)
		}
		if want := crypto.PubkeyToAddress(key.PublicKey); got != want {
			t.Fatalf("recovered %s, signer %s", got, want)
		}
	}
}

func TestRecoverSignerAcceptsVAsRecoveryID(t *testing.T) {
	key := testKey(t)
	digest := crypto.Keccak256Hash([]byte("v as 0 or 1"))
	sig := signed(t, key, digest)
	sig[64] -= 27
	got, err := RecoverSigner(digest, sig)
	if err != nil {
		t.Fatalf("v = %d refused: %v", sig[64], err)
	}
	if want := crypto.PubkeyToAddress(key.PublicKey); got != want {
		t.Fatalf("recovered %s, signer %s", got, want)
	}
}

func TestRecoverSignerRefusesTheMalleatedHighSTwin(t *testing.T) {
	key := testKey(t)
	digest := crypto.Keccak256Hash([]byte("malleable"))
	twin := malleate(signed(t, key, digest))

	// The twin is a valid signature by the same key: only our check stands between it and acceptance.
	raw := twin
	raw[64] -= 27
	pub, err := crypto.Ecrecover(digest[:], raw[:])
	if err != nil {
		t.Fatalf("the high-s twin does not recover at all (%v), so this test would prove nothing", err)
	}
	if got := common.BytesToAddress(crypto.Keccak256(pub[1:])[12:]); got != crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatalf("the high-s twin recovers %s, not the signer, so this test would prove nothing", got)
	}

	if _, err := RecoverSigner(digest, twin); !errors.Is(err, errSignatureHighS) {
		t.Fatalf("RecoverSigner(high-s twin) error = %v, want errSignatureHighS", err)
	}
}

func TestRecoverSignerRefusesBadSignatures(t *testing.T) {
	key := testKey(t)
	digest := crypto.Keccak256Hash([]byte("bad signatures"))
	good := signed(t, key, digest)
	with := func(f func(*Signature)) Signature {
		s := good
		f(&s)
		return s
	}
	cases := []struct {
		name string
		sig  Signature
		want error
	}{
		{"v of 2", with(func(s *Signature) { s[64] = 2 }), errSignatureV},
		{"v of 29", with(func(s *Signature) { s[64] = 29 }), errSignatureV},
		{"v of 255", with(func(s *Signature) { s[64] = 255 }), errSignatureV},
		{"r of zero", with(func(s *Signature) { clear(s[0:32]) }), errSignatureInvalid},
		{"r equal to n", with(func(s *Signature) { copy(s[0:32], secp256k1N[:]) }), errSignatureInvalid},
		{"s of zero", with(func(s *Signature) { clear(s[32:64]) }), errSignatureInvalid},
		{"s equal to n", with(func(s *Signature) { copy(s[32:64], secp256k1N[:]) }), errSignatureHighS},
		{"s just above n/2", with(func(s *Signature) {
			new(big.Int).Add(new(big.Int).SetBytes(secp256k1HalfN[:]), big.NewInt(1)).FillBytes(s[32:64])
		}), errSignatureHighS},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := RecoverSigner(digest, c.sig); !errors.Is(err, c.want) {
				t.Fatalf("error = %v, want %v", err, c.want)
			}
		})
	}
}

func TestRecoverSignerAcceptsSExactlyHalfTheOrder(t *testing.T) {
	// n/2 is the largest low s. Whether a key recovers is up to the curve; the point is that the s check
	// does not refuse the boundary.
	sig := signed(t, testKey(t), crypto.Keccak256Hash([]byte("boundary")))
	copy(sig[32:64], secp256k1HalfN[:])
	if _, err := RecoverSigner(crypto.Keccak256Hash([]byte("boundary")), sig); errors.Is(err, errSignatureHighS) {
		t.Fatalf("s = n/2 refused as high: %v", err)
	}
}

func TestRecoverSignerOfAnotherDigestIsAnotherAddress(t *testing.T) {
	key := testKey(t)
	sig := signed(t, key, crypto.Keccak256Hash([]byte("signed")))
	got, err := RecoverSigner(crypto.Keccak256Hash([]byte("presented")), sig)
	if err == nil && got == crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatal("a signature over one digest recovered its signer for another digest")
	}
}

func TestParseSignature(t *testing.T) {
	key := testKey(t)
	sig := signed(t, key, crypto.Keccak256Hash([]byte("parse")))
	body := sig.hex()[2:130] // r and s
	cases := []struct {
		name  string
		in    string
		wantV byte
		err   error
	}{
		{"v 27 lower case", "0x" + body + "1b", 27, nil},
		{"v 28 upper-case hex", "0X" + strings.ToUpper(body) + "1C", 28, nil},
		{"v 0 normalised", "0x" + body + "00", 27, nil},
		{"v 1 normalised", "0x" + body + "01", 28, nil},
		{"v 2", "0x" + body + "02", 0, errSignatureV},
		{"v 29", "0x" + body + "1d", 0, errSignatureV},
		{"64 bytes", "0x" + body, 0, errSignatureLength},
		{"66 bytes", "0x" + body + "1b00", 0, errSignatureLength},
		{"odd length", "0x" + body + "1", 0, errSignatureLength},
		{"empty", "", 0, errSignatureInvalid},
		{"no 0x", body + "1b00", 0, errSignatureInvalid},
		{"non-hex digit", "0x" + body[:10] + "zz" + body[12:] + "1b", 0, errSignatureInvalid},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseSignature(c.in)
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("error = %v, want %v", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if got[64] != c.wantV {
				t.Errorf("v = %d, want %d", got[64], c.wantV)
			}
			if got.hex()[:130] != "0x"+body {
				t.Errorf("r||s = %s, want 0x%s", got.hex()[:130], body)
			}
		})
	}
}

func TestParsedSignatureRoundTripsThroughHex(t *testing.T) {
	sig := signed(t, testKey(t), crypto.Keccak256Hash([]byte("round trip")))
	got, err := ParseSignature(sig.hex())
	if err != nil {
		t.Fatal(err)
	}
	if got != sig {
		t.Fatalf("ParseSignature(Hex()) = %s, want %s", got, sig)
	}
}

func TestSplitSignatureGivesPermitArguments(t *testing.T) {
	sig := signed(t, testKey(t), crypto.Keccak256Hash([]byte("split")))
	for _, rawV := range []byte{sig[64], sig[64] - 27} {
		s := sig
		s[64] = rawV
		v, r, ss := splitSignature(s)
		if v != sig[64] {
			t.Errorf("v from raw %d = %d, want %d", rawV, v, sig[64])
		}
		if common.Hash(r) != common.BytesToHash(sig[0:32]) || common.Hash(ss) != common.BytesToHash(sig[32:64]) {
			t.Errorf("r, s = %x, %x; want %x, %x", r, ss, sig[0:32], sig[32:64])
		}
	}
}

// sigGrammar is what ParseSignature accepts, written independently of it: 0x and 130 hex digits whose last byte,
// v, is 0, 1, 27 or 28.
var sigGrammar = regexp.MustCompile(`^0[xX][0-9a-fA-F]{128}(00|01|1[bB]|1[cC])$`)

// ParseSignature accepts exactly 65 bytes of hex with a known v, keeps r and s and normalises v; RecoverSigner
// agrees with go-ethereum's own checks and recovery, and never accepts both a signature and its malleated twin.
// The fuzzer mutates a signature both as text (s) and as 65 raw bytes (raw).
func FuzzParseSignature(f *testing.F) {
	key := testKey(f)
	sig := signed(f, key, fuzzDigest)
	body := sig.hex()[2:130]
	for _, s := range []string{sig.hex(), "0X" + strings.ToUpper(body) + "1C", "0x" + body + "00", "0x" + body + "1d", "0x" + body, "0x" + body + "1b00",
		"", "0x", body + "1b", "0x" + body[:10] + "zz" + body[12:] + "1b", malleate(sig).hex()} {
		f.Add(s, sig[:])
	}
	high := malleate(sig)
	var zero Signature
	zero[64] = 27
	for _, raw := range [][]byte{high[:], zero[:], append(sig[:64:64], 0), append(sig[:64:64], 2)} {
		f.Add(sig.hex(), raw)
	}
	halfN := new(big.Int).Rsh(crypto.S256().Params().N, 1)
	f.Fuzz(func(t *testing.T, s string, raw []byte) {
		checkParsedSignature(t, s)
		if sig, ok := checkParsedSignature(t, "0x"+hex.EncodeToString(raw)); ok {
			checkRecovery(t, sig, halfN)
		}
	})
}

// fuzzDigest is the digest the signature fuzz target signs and recovers.
var fuzzDigest = crypto.Keccak256Hash([]byte("fuzz"))

func checkParsedSignature(t *testing.T, s string) (Signature, bool) {
	t.Helper()
	sig, err := ParseSignature(s)
	if (err == nil) != sigGrammar.MatchString(s) {
		t.Fatalf("ParseSignature(%q) = %v; the grammar says %v", s, err, sigGrammar.MatchString(s))
	}
	if err != nil {
		if sig != (Signature{}) || len(err.Error()) > 300 || !(errors.Is(err, errSignatureInvalid) || errors.Is(err, errSignatureLength) || errors.Is(err, errSignatureV)) {
			t.Fatalf("ParseSignature(%q) = %s, %v: want the zero signature and a short error of a known kind", s, sig, err)
		}
		return sig, false
	}
	if sig[64] != 27 && sig[64] != 28 {
		t.Fatalf("ParseSignature(%q) has v %d, want 27 or 28", s, sig[64])
	}
	if got := sig.hex(); got[:130] != strings.ToLower("0x"+s[2:130]) {
		t.Fatalf("ParseSignature(%q) wrote back r||s as %s", s, got[:130])
	}
	if again, err := ParseSignature(sig.hex()); err != nil || again != sig {
		t.Fatalf("ParseSignature(Hex()) = %s, %v; want %s", again, err, sig)
	}
	return sig, true
}

// checkRecovery compares RecoverSigner with go-ethereum: its checks of r, s and v (low s as after Homestead) and
// its recovery of the public key.
func checkRecovery(t *testing.T, sig Signature, halfN *big.Int) {
	t.Helper()
	got, err := RecoverSigner(fuzzDigest, sig)
	v := sig[64] - 27
	r, s := new(big.Int).SetBytes(sig[:32]), new(big.Int).SetBytes(sig[32:64])
	rsv := append(sig[:64:64], v)
	pub, refErr := crypto.SigToPub(fuzzDigest[:], rsv)
	refOK := crypto.ValidateSignatureValues(v, r, s, true) && refErr == nil
	if (err == nil) != refOK {
		t.Fatalf("RecoverSigner(%s) = %s, %v; go-ethereum says valid = %v (%v)", sig, got, err, refOK, refErr)
	}
	if err != nil {
		if !errors.Is(err, errSignatureInvalid) && !errors.Is(err, errSignatureHighS) {
			t.Fatalf("RecoverSigner(%s) error %v is of no known kind", sig, err)
		}
		return
	}
	if want := crypto.PubkeyToAddress(*pub); got != want {
		t.Fatalf("RecoverSigner(%s) = %s, go-ethereum recovers %s", sig, got, want)
	}
	if s.Cmp(halfN) > 0 {
		t.Fatalf("RecoverSigner accepted a high-s signature %s", sig)
	}
	if twin, err := RecoverSigner(fuzzDigest, malleate(sig)); !errors.Is(err, errSignatureHighS) {
		t.Fatalf("RecoverSigner accepted %s and its malleated twin (%s, %v)", sig, twin, err)
	}
}
