package payer

import (
	"encoding/json"
	"fmt"
	"net/url"
	"strings"

	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/x402"
)

// SignIn answers the sign-in-with-x challenge of offer, a 402 of resource (the URL the request was sent to):
// the SIGN-IN-WITH-X header value, the payer's wallet's EIP-191 signature of the SIWE message the challenge makes
// with its address, on the first EVM chain the challenge offers. ok is false when the 402 declares no challenge
// or offers no EVM chain. A challenge for another host or origin than resource's is refused, as the SDK's
// clients refuse it: signed, it would sign the payer in elsewhere. Signing in costs nothing and moves nothing.
func (p *Payer) SignIn(offer Offer, resource string) (header string, ok bool, err error) {
	raw, declared := offer.Required.Extensions[x402.ExtensionSignInWithX]
	if !declared {
		return "", false, nil
	}
	var decl x402.SignInWithXDeclaration
	if err := json.Unmarshal(raw, &decl); err != nil {
		return "", false, fmt.Errorf("extensions.%s: %w", x402.ExtensionSignInWithX, err)
	}
	var chain *x402.SignInWithXChain
	for i, c := range decl.SupportedChains {
		if c.Type == x402.SignatureTypeEIP191 && strings.HasPrefix(c.ChainID, "eip155:") {
			chain = &decl.SupportedChains[i]
			break
		}
	}
	if chain == nil {
		return "", false, nil
	}
	info := decl.Info
	u, err := url.Parse(resource)
	if err != nil {
		return "", false, fmt.Errorf("the resource %q is no URL: %w", resource, err)
	}
	if info.Domain != u.Host {
		return "", false, fmt.Errorf("the sign-in challenge is for domain %q, not %q, where it came from", info.Domain, u.Host)
	}
	if cu, err := url.Parse(info.URI); err != nil || cu.Scheme != u.Scheme || cu.Host != u.Host {
		return "", false, fmt.Errorf("the sign-in challenge's uri %q is not of %s://%s, where it came from", info.URI, u.Scheme, u.Host)
	}
	s := x402.SignInWithX{Domain: info.Domain, Address: p.address.Hex(), URI: info.URI, Version: info.Version,
		ChainID: chain.ChainID, Type: chain.Type, Nonce: info.Nonce, IssuedAt: info.IssuedAt,
		ExpirationTime: info.ExpirationTime, NotBefore: info.NotBefore, RequestID: info.RequestID, Resources: info.Resources}
	if info.Statement != "" {
		s.Statement = &info.Statement
	}
	msg, err := s.Message(s.Address)
	if err != nil {
		return "", false, err
	}
	sig, err := crypto.Sign(accounts.TextHash([]byte(msg)), p.key)
	if err != nil {
		return "", false, fmt.Errorf("signing in: %w", err)
	}
	sig[64] += 27
	s.Signature = hexutil.Encode(sig)
	header, err = x402.EncodeSignInWithX(s)
	if err != nil {
		return "", false, err
	}
	return header, true, nil
}
