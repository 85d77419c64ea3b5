package contracts

import (
	"bytes"
	"encoding/hex"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"
)

func TestUSDCoinSelectorsAreUSDCs(t *testing.T) {
	// Selectors of FiatToken v2.2, which EIP-3009 clients and facilitators call.
	want := map[string]string{
		"transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)": "e3ee160e",
		"transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)":                 "cf092995",
		"receiveWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)":  "ef55bec6",
		"authorizationState(address,bytes32)":                                                              "e94a0102",
		"permit(address,address,uint256,uint256,uint8,bytes32,bytes32)":                                    "d505accf",
		"version()": "54fd4d50",
	}
	got := map[string]string{}
	for _, m := range USDCoinABI.Methods {
		got[m.Sig] = hex.EncodeToString(m.ID)
	}
	for sig, sel := range want {
		if got[sig] != sel {
			t.Errorf("USDCoin %s selector = %q, want %s", sig, got[sig], sel)
		}
	}
}

func TestERC6492SignaturesRoundTrip(t *testing.T) {
	factory := common.HexToAddress("0x00000000000000000000000000000000000000f1")
	data, err := PackCreateAccount(SmartWalletAccount{Owner: common.HexToAddress("0x01"), Salt: big.NewInt(7)})
	if err != nil {
		t.Fatal(err)
	}
	inner := bytes.Repeat([]byte{0xab}, 65)
	wrapped, err := WrapERC6492(factory, data, inner)
	if err != nil {
		t.Fatal(err)
	}
	f, d, s, ok, err := UnwrapERC6492(wrapped)
	if err != nil || !ok || f != factory || !bytes.Equal(d, data) || !bytes.Equal(s, inner) {
		t.Fatalf("UnwrapERC6492 = %s, %x, %x, %v, %v; want the wrapped parts", f, d, s, ok, err)
	}
	if _, _, _, ok, err := UnwrapERC6492(inner); ok || err != nil {
		t.Errorf("a plain signature read as ERC-6492 (ok %v, err %v)", ok, err)
	}
	bad := append(bytes.Repeat([]byte{0xff}, 40), erc6492MagicSuffix...)
	if _, _, _, ok, err := UnwrapERC6492(bad); !ok || err == nil {
		t.Errorf("a malformed ERC-6492 signature gave ok %v, err %v; want ok and an error", ok, err)
	}
}

// UnwrapERC6492 reads signatures from strangers: it must never panic, must say "not wrapped" for anything
// without the magic suffix, and what it unwraps must wrap back to the same bytes when it was canonical.
func FuzzUnwrapERC6492(f *testing.F) {
	wrapped, err := WrapERC6492(common.HexToAddress("0xf1"), []byte{1, 2, 3}, bytes.Repeat([]byte{7}, 65))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(wrapped)
	f.Add(bytes.Repeat([]byte{1}, 65))
	f.Add(append([]byte{0xff}, erc6492MagicSuffix...))
	f.Fuzz(func(t *testing.T, sig []byte) {
		factory, data, inner, ok, err := UnwrapERC6492(sig)
		if !bytes.HasSuffix(sig, erc6492MagicSuffix) {
			if ok || err != nil {
				t.Fatalf("a signature without the suffix read as ERC-6492 (ok %v, err %v)", ok, err)
			}
			return
		}
		if !ok {
			t.Fatal("a signature with the suffix read as plain")
		}
		if err != nil {
			return
		}
		again, err := WrapERC6492(factory, data, inner)
		if err != nil {
			t.Fatalf("re-wrapping what was unwrapped: %v", err)
		}
		f2, d2, i2, ok2, err2 := UnwrapERC6492(again)
		if !ok2 || err2 != nil || f2 != factory || !bytes.Equal(d2, data) || !bytes.Equal(i2, inner) {
			t.Fatalf("unwrap(wrap(unwrap(sig))) differs from unwrap(sig)")
		}
	})
}
