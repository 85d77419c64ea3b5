package chain

import (
	"errors"
	"fmt"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The hot-path benchmarks measure what an embedded verifier does per request before any chain read: decode
// the PAYMENT-SIGNATURE header, parse the authorization strictly, run the cheap checks against the
// requirements, compute the digest under a cached domain and recover the signer. The goal is to stay within
// 1.25x of a bare Ecrecover, which is the floor.

// offer is a configured requirement, parsed once when the gate is provisioned.
type offer struct {
	chainID *big.Int
	asset   common.Address
	payTo   common.Address
	amount  *big.Int
	spender common.Address // the proxy (permit2) or our wallet (erc2612)
	permit2 common.Address
	name    string
	version string
}

var errHotPath = errors.New("payment refused")

// decodeHeader is the gate's decoding of the PAYMENT-SIGNATURE header, by the x402 codec.
func decodeHeader(header string) (x402.PaymentPayload, error) {
	return x402.DecodePaymentPayload(header)
}

func verifyHotPathPermit2(header string, o *offer, domains *domainCache) (common.Address, error) {
	p, err := decodeHeader(header)
	if err != nil {
		return common.Address{}, err
	}
	return verifyPayloadPermit2(&p, o, domains)
}

// verifyPayloadPermit2 is the part of the hot path an embedded facilitator's Verify runs: the gate has
// decoded the header already.
func verifyPayloadPermit2(p *x402.PaymentPayload, o *offer, domains *domainCache) (common.Address, error) {
	t, owner, err := permit2TransferFromPayload(p.Payload.Permit2Authorization)
	if err != nil {
		return common.Address{}, err
	}
	if t.To != o.payTo || t.Spender != o.spender || t.Amount.Cmp(o.amount) != 0 || t.Token != o.asset {
		return common.Address{}, errHotPath
	}
	sig, err := ParseSignature(p.Payload.Signature)
	if err != nil {
		return common.Address{}, err
	}
	signer, err := RecoverSigner(permit2Digest(domains.Permit2(o.chainID, o.permit2), t), sig)
	if err != nil {
		return common.Address{}, err
	}
	if signer != owner {
		return common.Address{}, errHotPath
	}
	return signer, nil
}

func verifyHotPathERC2612(header string, o *offer, domains *domainCache) (common.Address, error) {
	p, err := decodeHeader(header)
	if err != nil {
		return common.Address{}, err
	}
	return verifyPayloadERC2612(&p, o, domains)
}

// verifyPayloadERC2612 is the part of the hot path an embedded facilitator's Verify runs.
func verifyPayloadERC2612(p *x402.PaymentPayload, o *offer, domains *domainCache) (common.Address, error) {
	permit, err := PermitFromAuthorization(p.Payload.Authorization)
	if err != nil {
		return common.Address{}, err
	}
	if permit.Spender != o.spender || permit.Value.Cmp(o.amount) != 0 {
		return common.Address{}, errHotPath
	}
	sig, err := ParseSignature(p.Payload.Signature)
	if err != nil {
		return common.Address{}, err
	}
	signer, err := RecoverSigner(PermitDigest(domains.Permit(o.name, o.version, o.chainID, o.asset), permit), sig)
	if err != nil {
		return common.Address{}, err
	}
	if signer != permit.Owner {
		return common.Address{}, errHotPath
	}
	return signer, nil
}

func verifyHotPathEIP3009(header string, o *offer, domains *domainCache) (common.Address, error) {
	p, err := decodeHeader(header)
	if err != nil {
		return common.Address{}, err
	}
	return verifyPayloadEIP3009(&p, o, domains)
}

// verifyPayloadEIP3009 is the part of the hot path an embedded facilitator's Verify runs for eip3009.
func verifyPayloadEIP3009(p *x402.PaymentPayload, o *offer, domains *domainCache) (common.Address, error) {
	a, err := transferAuthorizationFromPayload(p.Payload.Authorization)
	if err != nil {
		return common.Address{}, err
	}
	if a.To != o.payTo || a.Value.Cmp(o.amount) != 0 {
		return common.Address{}, errHotPath
	}
	sig, err := ParseSignature(p.Payload.Signature)
	if err != nil {
		return common.Address{}, err
	}
	signer, err := RecoverSigner(transferAuthorizationDigest(domains.Permit(o.name, o.version, o.chainID, o.asset), a), sig)
	if err != nil {
		return common.Address{}, err
	}
	if signer != a.From {
		return common.Address{}, errHotPath
	}
	return signer, nil
}

func benchOffer(method string) (*offer, x402.PaymentRequirements) {
	req := testRequirements()
	req.Extra.AssetTransferMethod = method
	o := &offer{
		chainID: testChainID,
		asset:   testAsset,
		payTo:   common.HexToAddress(req.PayTo),
		amount:  big.NewInt(1000),
		spender: canonicalProxy,
		permit2: canonicalPermit2,
		name:    x402.DefaultTokenName,
		version: x402.DefaultTokenVersion,
	}
	if method == x402.TransferERC2612 {
		req.Extra.Spender = testWallet.Hex()
		o.spender = testWallet
	}
	return o, req
}

func encodeHeader(tb testing.TB, p x402.PaymentPayload) string {
	tb.Helper()
	// A realistic header carries the resource too.
	p.Resource = &x402.ResourceInfo{URL: "https://api.example.com/weather?city=lisbon", Description: "Weather report", MimeType: "application/json"}
	h, err := x402.EncodeHeader(p)
	if err != nil {
		tb.Fatal(err)
	}
	return h
}

func BenchmarkEcrecover(b *testing.B) {
	digest := crypto.Keccak256Hash([]byte("bench"))
	sig := signed(b, testKey(b), digest)
	sig[64] -= 27
	b.ReportAllocs()
	for b.Loop() {
		if _, err := crypto.Ecrecover(digest[:], sig[:]); err != nil {
			b.Fatal(err)
		}
	}
}

// The hot-path benchmarks run twice: "header" is the whole path from the PAYMENT-SIGNATURE header, "payload"
// starts from the decoded payload, as chain's Verify does when the gate has decoded the header.

func BenchmarkVerifyHotPathPermit2(b *testing.B) {
	o, req := benchOffer(x402.TransferPermit2)
	p, err := SignPermit2Payment(testKey(b), req, testChainID, Permit2Options{Now: testNow})
	if err != nil {
		b.Fatal(err)
	}
	benchHotPath(b, encodeHeader(b, p), o, verifyHotPathPermit2, verifyPayloadPermit2)
}

func BenchmarkVerifyHotPathERC2612(b *testing.B) {
	o, req := benchOffer(x402.TransferERC2612)
	p, err := SignERC2612Payment(testKey(b), req, testChainID, ERC2612Options{TokenNonce: big.NewInt(0), Now: testNow})
	if err != nil {
		b.Fatal(err)
	}
	benchHotPath(b, encodeHeader(b, p), o, verifyHotPathERC2612, verifyPayloadERC2612)
}

func BenchmarkVerifyHotPathEIP3009(b *testing.B) {
	o, req := benchOffer(x402.TransferEIP3009)
	p, err := SignEIP3009Payment(testKey(b), req, testChainID, EIP3009Options{Now: testNow})
	if err != nil {
		b.Fatal(err)
	}
	benchHotPath(b, encodeHeader(b, p), o, verifyHotPathEIP3009, verifyPayloadEIP3009)
}

func benchHotPath(b *testing.B, header string, o *offer,
	fromHeader func(string, *offer, *domainCache) (common.Address, error),
	fromPayload func(*x402.PaymentPayload, *offer, *domainCache) (common.Address, error),
) {
	want := crypto.PubkeyToAddress(testKey(b).PublicKey)
	b.Run("header", func(b *testing.B) {
		var domains domainCache
		b.SetBytes(int64(len(header)))
		b.ReportAllocs()
		for b.Loop() {
			got, err := fromHeader(header, o, &domains)
			if err != nil || got != want {
				b.Fatal(fmt.Sprintf("verify = %s, %v; want %s", got, err, want))
			}
		}
	})
	b.Run("payload", func(b *testing.B) {
		var domains domainCache
		p, err := decodeHeader(header)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			got, err := fromPayload(&p, o, &domains)
			if err != nil || got != want {
				b.Fatal(fmt.Sprintf("verify = %s, %v; want %s", got, err, want))
			}
		}
	})
}

// BenchmarkDecodePaymentSignatureHeader isolates the header decoding the "header" hot path pays on top of
// "payload": x402.DecodePaymentPayload.
func BenchmarkDecodePaymentSignatureHeader(b *testing.B) {
	_, req := benchOffer(x402.TransferPermit2)
	p, err := SignPermit2Payment(testKey(b), req, testChainID, Permit2Options{Now: testNow})
	if err != nil {
		b.Fatal(err)
	}
	header := encodeHeader(b, p)
	b.SetBytes(int64(len(header)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeHeader(header); err != nil {
			b.Fatal(err)
		}
	}
}
