package payer_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// signInOffer is a 402 of https://shop.example/reports/q3 declaring the challenge info on chains.
func signInOffer(t *testing.T, info x402.SignInWithXInfo, chains ...x402.SignInWithXChain) payer.Offer {
	t.Helper()
	b, err := json.Marshal(x402.NewSignInWithXDeclaration(info, chains))
	if err != nil {
		t.Fatal(err)
	}
	return payer.Offer{Version: 2, Required: x402.PaymentRequired{X402Version: 2,
		Extensions: map[string]json.RawMessage{x402.ExtensionSignInWithX: b}}}
}

func TestThePayerSignsInOnlyWhereTheChallengeCameFrom(t *testing.T) {
	p := newPayer(t)
	evm := x402.SignInWithXChain{ChainID: "eip155:84532", Type: x402.SignatureTypeEIP191}
	good := x402.SignInWithXInfo{Domain: "shop.example", URI: "https://shop.example/reports/q3", Version: "1",
		Nonce: "0123456789abcdef", IssuedAt: "2026-11-27T12:00:00.000Z", Resources: []string{"https://shop.example/reports/q3"}}
	const resource = "https://shop.example/reports/q3"

	header, ok, err := p.SignIn(signInOffer(t, good, evm), resource)
	if err != nil || !ok {
		t.Fatalf("SignIn = %v, %v; want a header", ok, err)
	}
	s, err := x402.DecodeSignInWithX(header)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := s.Message(s.Address)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := hexutil.Decode(s.Signature)
	if err != nil || len(sig) != 65 {
		t.Fatalf("signature %q: %v", s.Signature, err)
	}
	sig[64] -= 27
	pub, err := crypto.SigToPub(accounts.TextHash([]byte(msg)), sig)
	if err != nil || crypto.PubkeyToAddress(*pub) != p.Address() || s.Address != p.Address().Hex() || s.Nonce != good.Nonce || s.ChainID != evm.ChainID {
		t.Fatalf("the sign-in %+v is not the payer's signature of the challenge (%v)", s, err)
	}

	for _, c := range []struct {
		name string
		edit func(*x402.SignInWithXInfo)
		want string
	}{
		{"another domain", func(i *x402.SignInWithXInfo) { i.Domain = "evil.example" }, "domain"},
		{"a uri of another host", func(i *x402.SignInWithXInfo) { i.URI = "https://evil.example/reports/q3" }, "uri"},
		{"a uri of another scheme", func(i *x402.SignInWithXInfo) { i.URI = "http://shop.example/reports/q3" }, "uri"},
	} {
		t.Run(c.name, func(t *testing.T) {
			info := good
			c.edit(&info)
			if _, ok, err := p.SignIn(signInOffer(t, info, evm), resource); ok || err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("SignIn = %v, %v; want it refused naming the %s", ok, err, c.want)
			}
		})
	}
	if _, ok, err := p.SignIn(signInOffer(t, good, x402.SignInWithXChain{ChainID: "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp", Type: "ed25519"}), resource); ok || err != nil {
		t.Errorf("a challenge on no EVM chain: SignIn = %v, %v; want nothing signed", ok, err)
	}
	if _, ok, err := p.SignIn(payer.Offer{Version: 2}, resource); ok || err != nil {
		t.Errorf("a 402 without a challenge: SignIn = %v, %v; want nothing signed", ok, err)
	}
}
