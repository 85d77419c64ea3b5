package chain

import (
	"encoding/json"
	"errors"
	"math/big"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

var (
	testChainID = big.NewInt(72344)
	testNow     = time.Unix(1_800_000_000, 0)
	testAsset   = common.HexToAddress("0x5FbDB2315678afecb367f032d93F642f64180aa3")
	testWallet  = common.HexToAddress("0x70997970C51812dc3A010C7d01b50e0d17dc79C8")
)

// testRequirements is a permit2 offer whose payTo is written in lower case, as servers may, while payloads
// carry checksum case.
func testRequirements() x402.PaymentRequirements {
	return x402.PaymentRequirements{
		Scheme:            x402.SchemeExact,
		Network:           "eip155:72344",
		Amount:            "1000",
		Asset:             testAsset.Hex(),
		PayTo:             "0x3c44cdddb6a900fa2b585dd299e03d12fa4293bc",
		MaxTimeoutSeconds: 60,
		Extra:             x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"},
	}
}

// overTheWire encodes and decodes a payload as JSON, so tests see what a verifier would receive.
func overTheWire(t *testing.T, p x402.PaymentPayload) x402.PaymentPayload {
	t.Helper()
	raw, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	var out x402.PaymentPayload
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// recoverWithReference recovers the signer of sigHex over a digest computed by go-ethereum's apitypes.
func recoverWithReference(t *testing.T, digest common.Hash, sigHex string) common.Address {
	t.Helper()
	sig, err := ParseSignature(sigHex)
	if err != nil {
		t.Fatalf("payload signature: %v", err)
	}
	got, err := RecoverSigner(digest, sig)
	if err != nil {
		t.Fatalf("recovering payload signature: %v", err)
	}
	return got
}

func TestSignPermit2PaymentRecoversThePayerUnderReferenceHashing(t *testing.T) {
	key := testKey(t)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	req := testRequirements()
	p, err := SignPermit2Payment(key, req, testChainID, Permit2Options{Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	p = overTheWire(t, p)
	a := p.Payload.Permit2Authorization
	if a == nil || p.Payload.Authorization != nil {
		t.Fatalf("payload = %+v, want only permit2Authorization", p.Payload)
	}

	checks := []struct{ field, got, want string }{
		{"from", a.From, payer.Hex()},
		{"permitted.token", a.Permitted.Token, testAsset.Hex()},
		{"permitted.amount", a.Permitted.Amount, "1000"},
		{"spender (the proxy)", a.Spender, "0x402085c248EeA27D92E8b30b2C58ed07f9E20001"},
		{"deadline (now + maxTimeoutSeconds)", a.Deadline, "1800000060"},
		{"witness.to (payTo in checksum case)", a.Witness.To, "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"},
		{"witness.validAfter (now - 600)", a.Witness.ValidAfter, "1799999400"},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %q, want %q", c.field, c.got, c.want)
		}
	}
	if p.X402Version != x402.Version2 {
		t.Errorf("x402Version = %d, want 2", p.X402Version)
	}
	if p.Accepted != req {
		t.Errorf("accepted = %+v, want the requirements echoed %+v", p.Accepted, req)
	}

	digest := referenceDigest(t, chaintest.Permit2WitnessTypedData(testChainID, canonicalPermit2,
		a.Permitted.Token, a.Permitted.Amount, a.Spender, a.Nonce, a.Deadline, a.Witness.To, a.Witness.ValidAfter))
	if got := recoverWithReference(t, digest, p.Payload.Signature); got != payer {
		t.Fatalf("signature recovers %s under apitypes hashing, want payer %s", got, payer)
	}
}

func TestSignPermit2PaymentDrawsAFreshFullWidthNonceEachTime(t *testing.T) {
	key := testKey(t)
	seen := map[string]bool{}
	wide := false
	for range 8 {
		p, err := SignPermit2Payment(key, testRequirements(), testChainID, Permit2Options{Now: testNow})
		if err != nil {
			t.Fatal(err)
		}
		n := p.Payload.Permit2Authorization.Nonce
		if seen[n] {
			t.Fatalf("nonce %s drawn twice", n)
		}
		seen[n] = true
		x, _ := new(big.Int).SetString(n, 10)
		wide = wide || x.BitLen() > 200
	}
	if !wide {
		t.Error("eight random nonces all below 2^200: the nonce is not drawn from 256 bits")
	}
}

func TestSignPermit2PaymentHonoursExplicitOptions(t *testing.T) {
	key := testKey(t)
	permit2 := common.HexToAddress("0x00000000000000000000000000000000000000aa")
	proxy := common.HexToAddress("0x00000000000000000000000000000000000000bb")
	opts := Permit2Options{
		Nonce:      big.NewInt(42),
		ValidAfter: big.NewInt(0),
		Deadline:   big.NewInt(1_900_000_000),
		Now:        testNow,
		permit2:    permit2,
		Proxy:      proxy,
	}
	p, err := SignPermit2Payment(key, testRequirements(), testChainID, opts)
	if err != nil {
		t.Fatal(err)
	}
	a := p.Payload.Permit2Authorization
	if a.Nonce != "42" || a.Witness.ValidAfter != "0" || a.Deadline != "1900000000" || a.Spender != proxy.Hex() {
		t.Fatalf("authorization = %+v, want nonce 42, validAfter 0, deadline 1900000000, spender %s", a, proxy.Hex())
	}
	digest := referenceDigest(t, chaintest.Permit2WitnessTypedData(testChainID, permit2,
		a.Permitted.Token, a.Permitted.Amount, a.Spender, a.Nonce, a.Deadline, a.Witness.To, a.Witness.ValidAfter))
	if got := recoverWithReference(t, digest, p.Payload.Signature); got != crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatalf("signature over the custom Permit2 domain recovers %s", got)
	}
}

func TestSignPermit2PaymentUsesContractsNamedInRequirements(t *testing.T) {
	key := testKey(t)
	req := testRequirements()
	req.Extra.Permit2Address = "0x00000000000000000000000000000000000000cc"
	req.Extra.X402Permit2ProxyAddress = "0x00000000000000000000000000000000000000dd"
	p, err := SignPermit2Payment(key, req, testChainID, Permit2Options{Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	a := p.Payload.Permit2Authorization
	if want := common.HexToAddress(req.Extra.X402Permit2ProxyAddress).Hex(); a.Spender != want {
		t.Errorf("spender = %s, want the proxy from extra %s", a.Spender, want)
	}
	digest := referenceDigest(t, chaintest.Permit2WitnessTypedData(testChainID, common.HexToAddress(req.Extra.Permit2Address),
		a.Permitted.Token, a.Permitted.Amount, a.Spender, a.Nonce, a.Deadline, a.Witness.To, a.Witness.ValidAfter))
	if got := recoverWithReference(t, digest, p.Payload.Signature); got != crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatalf("signature is not over the Permit2 named in extra (recovers %s)", got)
	}
}

func TestSignPermit2PaymentNeverDatesValidAfterBeforeZero(t *testing.T) {
	p, err := SignPermit2Payment(testKey(t), testRequirements(), testChainID, Permit2Options{Now: time.Unix(100, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Payload.Permit2Authorization.Witness.ValidAfter; got != "0" {
		t.Fatalf("validAfter at t=100 s = %s, want 0", got)
	}
}

func TestSignPermit2PaymentRefusesUnusableRequirements(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(*x402.PaymentRequirements, *Permit2Options)
		want   string
	}{
		{"asset not an address", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Asset = "USDC" }, "requirements.asset"},
		{"payTo too short", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.PayTo = "0x3c44" }, "requirements.payTo"},
		{"fractional amount", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Amount = "1.5" }, "requirements.amount"},
		{"another chain", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Network = "eip155:1" }, "signing for chain 72344"},
		{"another method", func(r *x402.PaymentRequirements, _ *Permit2Options) {
			r.Extra.AssetTransferMethod = x402.TransferERC2612
		}, "assetTransferMethod"},
		{"another scheme", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Scheme = "stream" }, "requirements.scheme"},
		{"upto without a facilitator", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Scheme = x402.SchemeUpto }, "facilitatorAddress"},
		{"no timeout and no deadline", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.MaxTimeoutSeconds = 0 }, "maxTimeoutSeconds"},
		{"negative nonce", func(_ *x402.PaymentRequirements, o *Permit2Options) { o.Nonce = big.NewInt(-1) }, "nonce"},
		{"bad proxy in extra", func(r *x402.PaymentRequirements, _ *Permit2Options) { r.Extra.X402Permit2ProxyAddress = "proxy" }, "x402Permit2ProxyAddress"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req, opts := testRequirements(), Permit2Options{Now: testNow}
			c.mutate(&req, &opts)
			_, err := SignPermit2Payment(testKey(t), req, testChainID, opts)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error = %v, want one mentioning %q", err, c.want)
			}
		})
	}
}

func TestSigningRefusesAMaxTimeoutWhoseDeadlineWrapsAroundInsteadOfSigningOneValidForever(t *testing.T) {
	// A hostile 402 asks for math.MaxInt64 seconds: now + that wraps below zero in int64, and signed as it wrapped
	// the deadline would be a uint256 near 2^256, a permit valid forever.
	for _, method := range []string{x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612} {
		t.Run(method, func(t *testing.T) {
			req := testRequirements()
			req.Extra.AssetTransferMethod = method
			req.Extra.Spender = testWallet.Hex()
			req.MaxTimeoutSeconds = 9223372036854775807
			var (
				p   x402.PaymentPayload
				err error
			)
			switch method {
			case x402.TransferPermit2:
				p, err = SignPermit2Payment(testKey(t), req, testChainID, Permit2Options{Now: testNow})
			case x402.TransferEIP3009:
				p, err = SignEIP3009Payment(testKey(t), req, testChainID, EIP3009Options{Now: testNow})
			case x402.TransferERC2612:
				p, err = SignERC2612Payment(testKey(t), req, testChainID, ERC2612Options{Now: testNow, TokenNonce: big.NewInt(0)})
			}
			if err == nil || !strings.Contains(err.Error(), "requirements.maxTimeoutSeconds") || !strings.Contains(err.Error(), "never expire") {
				raw, _ := json.Marshal(p.Payload)
				t.Fatalf("signing with maxTimeoutSeconds 2^63-1: %v; want a refusal naming requirements.maxTimeoutSeconds; signed %s", err, raw)
			}
		})
	}
}

func erc2612Requirements() x402.PaymentRequirements {
	req := testRequirements()
	req.Extra.AssetTransferMethod = x402.TransferERC2612
	req.Extra.Spender = strings.ToLower(testWallet.Hex())
	return req
}

func TestSignERC2612PaymentRecoversThePayerUnderReferenceHashing(t *testing.T) {
	key := testKey(t)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	p, err := SignERC2612Payment(key, erc2612Requirements(), testChainID, ERC2612Options{TokenNonce: big.NewInt(3), Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	p = overTheWire(t, p)
	a := p.Payload.Authorization
	if a == nil || p.Payload.Permit2Authorization != nil {
		t.Fatalf("payload = %+v, want only authorization", p.Payload)
	}
	want := x402.EIP2612Authorization{
		From: payer.Hex(), To: testWallet.Hex(), Value: "1000",
		ValidAfter: "1799999400", ValidBefore: "1800000060", Nonce: "3",
	}
	if *a != want {
		t.Fatalf("authorization = %+v, want %+v", *a, want)
	}
	digest := referenceDigest(t, chaintest.PermitTypedData("Stable Coin", "1", testChainID, testAsset, a.From, a.To, a.Value, a.Nonce, a.ValidBefore))
	if got := recoverWithReference(t, digest, p.Payload.Signature); got != payer {
		t.Fatalf("signature recovers %s under apitypes hashing, want payer %s", got, payer)
	}
}

func TestSignERC2612PaymentSignsOverTheTokenDomainOfTheRequirements(t *testing.T) {
	key := testKey(t)
	req := erc2612Requirements()
	req.Extra.Name, req.Extra.Version = "USD Coin", "2"
	p, err := SignERC2612Payment(key, req, testChainID, ERC2612Options{TokenNonce: big.NewInt(0), Spender: testWallet, Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	a := p.Payload.Authorization
	digest := referenceDigest(t, chaintest.PermitTypedData("USD Coin", "2", testChainID, testAsset, a.From, a.To, a.Value, a.Nonce, a.ValidBefore))
	if got := recoverWithReference(t, digest, p.Payload.Signature); got != crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatalf("signature is not over the USD Coin / 2 domain (recovers %s)", got)
	}
}

func TestSignERC2612PaymentNeedsANonceAndASpender(t *testing.T) {
	key := testKey(t)
	if _, err := SignERC2612Payment(key, erc2612Requirements(), testChainID, ERC2612Options{Now: testNow}); err == nil || !strings.Contains(err.Error(), "TokenNonce") {
		t.Errorf("without TokenNonce: error = %v, want one naming TokenNonce", err)
	}
	req := erc2612Requirements()
	req.Extra.Spender = ""
	if _, err := SignERC2612Payment(key, req, testChainID, ERC2612Options{TokenNonce: big.NewInt(0), Now: testNow}); err == nil || !strings.Contains(err.Error(), "spender") {
		t.Errorf("without spender: error = %v, want one naming the spender", err)
	}
}

func TestAddGasSponsoringAddsAPermitToPermit2ThatVerifiesOverTheTokenDomain(t *testing.T) {
	key := testKey(t)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	p, err := SignPermit2Payment(key, testRequirements(), testChainID, Permit2Options{Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	// The server declared the extension with a schema; the payer echoes it and adds info.
	p.Extensions = map[string]json.RawMessage{
		x402.ExtensionEIP2612GasSponsoring: json.RawMessage(`{"info":{"description":"sponsored","version":"1"},"schema":{"type":"object"}}`),
	}
	if err := AddGasSponsoring(&p, key, testChainID, "", "", big.NewInt(5)); err != nil {
		t.Fatal(err)
	}
	p = overTheWire(t, p)

	var ext struct {
		Info   x402.EIP2612GasSponsoringInfo `json:"info"`
		Schema json.RawMessage               `json:"schema"`
	}
	if err := json.Unmarshal(p.Extensions[x402.ExtensionEIP2612GasSponsoring], &ext); err != nil {
		t.Fatalf("extension is not {info, schema}: %v", err)
	}
	if string(ext.Schema) != `{"type":"object"}` {
		t.Errorf("schema = %s, want the server's schema kept", ext.Schema)
	}
	var declared struct {
		Info map[string]any `json:"info"`
	}
	if err := json.Unmarshal(p.Extensions[x402.ExtensionEIP2612GasSponsoring], &declared); err != nil || declared.Info["description"] != "sponsored" {
		t.Errorf("info = %v (%v), want the server's description kept beside the payer's fields (a server checks the echo)", declared.Info, err)
	}
	info := ext.Info
	want := x402.EIP2612GasSponsoringInfo{
		From: payer.Hex(), Asset: testAsset.Hex(), Spender: canonicalPermit2.Hex(), Amount: "1000", Nonce: "5",
		Deadline: p.Payload.Permit2Authorization.Deadline, Signature: info.Signature, Version: "1",
	}
	if info != want {
		t.Fatalf("info = %+v, want %+v", info, want)
	}
	digest := referenceDigest(t, chaintest.PermitTypedData("Stable Coin", "1", testChainID, testAsset, info.From, info.Spender, info.Amount, info.Nonce, info.Deadline))
	if got := recoverWithReference(t, digest, info.Signature); got != payer {
		t.Fatalf("gas sponsoring permit recovers %s under the token domain, want payer %s", got, payer)
	}

	permit, token, err := permitFromGasSponsoring(&info)
	if err != nil {
		t.Fatal(err)
	}
	if token != testAsset || permit.Owner != payer || permit.Spender != canonicalPermit2 || permit.Value.Int64() != 1000 || permit.Nonce.Int64() != 5 {
		t.Fatalf("parsed permit %+v token %s, want the signed values", permit, token)
	}
	if PermitDigest(PermitDomainSeparator("Stable Coin", "1", testChainID, token), permit) != digest {
		t.Fatal("the permit parsed back from the info does not hash to the signed digest")
	}
}

func TestAddGasSponsoringRefusesAnotherKeyOrAPayloadWithoutPermit2(t *testing.T) {
	key := testKey(t)
	p, err := SignPermit2Payment(key, testRequirements(), testChainID, Permit2Options{Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	other, _ := crypto.GenerateKey()
	if err := AddGasSponsoring(&p, other, testChainID, "", "", big.NewInt(0)); err == nil || !strings.Contains(err.Error(), "is from") {
		t.Errorf("with another key: error = %v, want a from mismatch", err)
	}
	if p.Extensions != nil {
		t.Errorf("a refused call changed the extensions: %v", p.Extensions)
	}
	if err := AddGasSponsoring(&x402.PaymentPayload{}, key, testChainID, "", "", big.NewInt(0)); err == nil {
		t.Error("a payload without permit2Authorization was sponsored")
	}
}

func TestPermit2TransferFromPayloadRebuildsTheSignedMessage(t *testing.T) {
	key := testKey(t)
	opts := Permit2Options{Now: testNow}
	p, err := SignPermit2Payment(key, testRequirements(), testChainID, opts)
	if err != nil {
		t.Fatal(err)
	}
	transfer, owner, err := permit2TransferFromPayload(overTheWire(t, p).Payload.Permit2Authorization)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := ParseSignature(p.Payload.Signature)
	if err != nil {
		t.Fatal(err)
	}
	got, err := RecoverSigner(permit2Digest(permit2DomainSeparator(testChainID, canonicalPermit2), transfer), sig)
	if err != nil || got != owner || owner != crypto.PubkeyToAddress(key.PublicKey) {
		t.Fatalf("recovered %s (%v), claimed owner %s, payer %s", got, err, owner, crypto.PubkeyToAddress(key.PublicKey))
	}
}

func TestPermitFromAuthorizationRebuildsTheSignedMessage(t *testing.T) {
	key := testKey(t)
	p, err := SignERC2612Payment(key, erc2612Requirements(), testChainID, ERC2612Options{TokenNonce: big.NewInt(9), Now: testNow})
	if err != nil {
		t.Fatal(err)
	}
	permit, err := PermitFromAuthorization(overTheWire(t, p).Payload.Authorization)
	if err != nil {
		t.Fatal(err)
	}
	sig, _ := ParseSignature(p.Payload.Signature)
	got, err := RecoverSigner(PermitDigest(PermitDomainSeparator("Stable Coin", "1", testChainID, testAsset), permit), sig)
	if err != nil || got != permit.Owner || permit.Spender != testWallet || permit.Deadline.Int64() != 1800000060 {
		t.Fatalf("recovered %s (%v) from permit %+v", got, err, permit)
	}
}

func validPermit2Authorization() x402.Permit2Authorization {
	return x402.Permit2Authorization{
		From:      "0x2c7536E3605D9C16a7a3D7b1898e529396a65c23",
		Permitted: x402.TokenPermissions{Token: testAsset.Hex(), Amount: "1000"},
		Spender:   canonicalProxy.Hex(),
		Nonce:     "115792089237316195423570985008687907853269984665640564039457584007913129639935",
		Deadline:  "1800000060",
		Witness:   x402.Permit2Witness{To: "0x3c44cdddb6a900fa2b585dd299e03d12fa4293bc", ValidAfter: "0"},
	}
}

func TestPermit2TransferFromPayloadNamesTheMalformedField(t *testing.T) {
	cases := []struct {
		field  string
		mutate func(*x402.Permit2Authorization)
	}{
		{"permit2Authorization.from", func(a *x402.Permit2Authorization) { a.From = "0x2c7536E3605D9C16a7a3D7b1898e529396a65c2" }},
		{"permit2Authorization.from", func(a *x402.Permit2Authorization) { a.From = "2c7536E3605D9C16a7a3D7b1898e529396a65c2300" }},
		{"permit2Authorization.permitted.token", func(a *x402.Permit2Authorization) { a.Permitted.Token = "0x5FbDB2315678afecb367f032d93F642f64180aG3" }},
		{"permit2Authorization.permitted.amount", func(a *x402.Permit2Authorization) { a.Permitted.Amount = "-1" }},
		{"permit2Authorization.permitted.amount", func(a *x402.Permit2Authorization) { a.Permitted.Amount = "0x3e8" }},
		{"permit2Authorization.permitted.amount", func(a *x402.Permit2Authorization) { a.Permitted.Amount = "" }},
		{"permit2Authorization.spender", func(a *x402.Permit2Authorization) { a.Spender = "" }},
		{"permit2Authorization.nonce", func(a *x402.Permit2Authorization) {
			a.Nonce = "115792089237316195423570985008687907853269984665640564039457584007913129639936" // 2^256
		}},
		{"permit2Authorization.deadline", func(a *x402.Permit2Authorization) { a.Deadline = " 1800000060" }},
		{"permit2Authorization.witness.to", func(a *x402.Permit2Authorization) { a.Witness.To = "0x" }},
		{"permit2Authorization.witness.validAfter", func(a *x402.Permit2Authorization) { a.Witness.ValidAfter = "+0" }},
	}
	for _, c := range cases {
		a := validPermit2Authorization()
		c.mutate(&a)
		_, _, err := permit2TransferFromPayload(&a)
		var fe *fieldError
		if !errors.As(err, &fe) || fe.Field != c.field {
			t.Errorf("%+v: error = %v, want a fieldError on %s", a, err, c.field)
		}
	}
	a := validPermit2Authorization()
	if _, _, err := permit2TransferFromPayload(&a); err != nil {
		t.Fatalf("the valid authorization is refused: %v", err)
	}
	if _, _, err := permit2TransferFromPayload(nil); err == nil {
		t.Fatal("a missing authorization is accepted")
	}
}

func TestPermitFromAuthorizationRefusesTheEIP3009LookAlike(t *testing.T) {
	// What a client that does not know erc2612 sends: a TransferWithAuthorization with a 32-byte hex nonce.
	a := x402.EIP2612Authorization{
		From: "0x2c7536E3605D9C16a7a3D7b1898e529396a65c23", To: "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC",
		Value: "1000", ValidAfter: "0", ValidBefore: "1800000060",
		Nonce: "0x4bd0aa8a46ed54dfc89b5dcf1ee1a96c25b3b1a5cbe4d7cb1e1ec4c2e4a9b6f1",
	}
	_, err := PermitFromAuthorization(&a)
	var fe *fieldError
	if !errors.As(err, &fe) || fe.Field != "authorization.nonce" || !strings.Contains(err.Error(), "decimal") {
		t.Fatalf("error = %v, want a fieldError saying authorization.nonce is not decimal", err)
	}
}

func TestNumberFieldsFollowX402RulesAndNameTheField(t *testing.T) {
	max := "115792089237316195423570985008687907853269984665640564039457584007913129639935"
	cases := []struct {
		in   string
		want string // "" means refused
		kind error
	}{
		{"0", "0", nil},
		{"1000", "1000", nil},
		{"18446744073709551615", "18446744073709551615", nil}, // max uint64: the fast path's edge
		{"18446744073709551616", "18446744073709551616", nil},
		{max, max, nil},
		{"115792089237316195423570985008687907853269984665640564039457584007913129639936", "", x402.ErrNumberRange}, // 2^256
		{"0" + max, "", x402.ErrNumberRange},
		{"007", "", x402.ErrNumberSyntax}, // one amount, one spelling
		{"", "", x402.ErrNumberSyntax},
		{"-1", "", x402.ErrNumberSyntax},
		{"+1", "", x402.ErrNumberSyntax},
		{"1e3", "", x402.ErrNumberSyntax},
		{"1_000", "", x402.ErrNumberSyntax},
		{"0x10", "", x402.ErrNumberSyntax},
		{"１", "", x402.ErrNumberSyntax}, // a full-width digit
		{"1 ", "", x402.ErrNumberSyntax},
	}
	for _, c := range cases {
		got, err := parseNumber("permit2Authorization.nonce", c.in)
		if c.want != "" {
			if err != nil || got.String() != c.want {
				t.Errorf("parseNumber(%q) = %v, %v; want %s", c.in, got, err, c.want)
			}
			continue
		}
		var fe *fieldError
		if !errors.As(err, &fe) || fe.Field != "permit2Authorization.nonce" || !errors.Is(err, c.kind) {
			t.Errorf("parseNumber(%q) error = %v, want a fieldError on permit2Authorization.nonce wrapping %v", c.in, err, c.kind)
		}
	}
}

// addressGrammar is what ParseAddress accepts, written independently of it.
var addressGrammar = regexp.MustCompile(`^0[xX][0-9a-fA-F]{40}$`)

// ParseAddress accepts exactly 0x and 40 hex digits, as x402.IsHexAddress does, reads them as go-ethereum does,
// and refuses anything else with a short fieldError naming the field.
func FuzzParseAddress(f *testing.F) {
	for _, s := range []string{testAsset.Hex(), strings.ToLower(testAsset.Hex()), "0X" + strings.ToUpper(testAsset.Hex()[2:]), testAsset.Hex()[2:],
		testAsset.Hex() + "0", testAsset.Hex()[:41], "", "0x", "0x" + strings.Repeat("g", 40), " " + testAsset.Hex(), "0x" + strings.Repeat("0", 64)} {
		f.Add(s)
	}
	const field = "paymentRequirements.payTo"
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParseAddress(field, s)
		if (err == nil) != addressGrammar.MatchString(s) || (err == nil) != x402.IsHexAddress(s) {
			t.Fatalf("ParseAddress(%q) = %v; the grammar says %v, x402.IsHexAddress %v", s, err, addressGrammar.MatchString(s), x402.IsHexAddress(s))
		}
		if err != nil {
			var fe *fieldError
			if !errors.As(err, &fe) || fe.Field != field || !strings.Contains(err.Error(), field) || len(err.Error()) > 600 || a != (common.Address{}) {
				t.Fatalf("ParseAddress(%q) = %s, %v: want the zero address and a short fieldError naming %s", s, a, err, field)
			}
			return
		}
		if a != common.HexToAddress(s) || !strings.EqualFold(a.Hex()[2:], s[2:]) {
			t.Fatalf("ParseAddress(%q) = %s; go-ethereum reads %s", s, a, common.HexToAddress(s))
		}
	})
}
