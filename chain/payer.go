package chain

import (
	"crypto/ecdsa"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// validAfterSkew is how far before now payers date validAfter, as public clients do, so that a chain whose
// clock lags the payer's still accepts the payment at once.
const validAfterSkew = 600 * time.Second

// Permit2Options tunes SignPermit2Payment. The zero value signs as public clients do.
type Permit2Options struct {
	// Nonce is the unordered Permit2 nonce; nil draws a random 256-bit one.
	Nonce *big.Int
	// ValidAfter defaults to Now - 600 s (never below 0).
	ValidAfter *big.Int
	// Deadline defaults to Now + requirements.maxTimeoutSeconds.
	Deadline *big.Int
	// Now is the signing time the defaults derive from; zero means time.Now().
	Now time.Time
	// permit2 defaults to requirements.extra.permit2Address, else the canonical deployment.
	permit2 common.Address
	// Proxy, the Permit2 spender, defaults to requirements.extra.x402Permit2ProxyAddress, else the canonical
	// x402ExactPermit2Proxy (x402UptoPermit2Proxy for an upto requirement).
	Proxy common.Address
	// Facilitator (upto) is the settlement wallet the witness names, the only one that can settle the payment;
	// defaults to requirements.extra.facilitatorAddress, and one of the two is required.
	Facilitator common.Address
}

// ERC2612Options tunes SignERC2612Payment.
type ERC2612Options struct {
	// Spender is the facilitator wallet that will submit the permit; defaults to requirements.extra.spender.
	Spender common.Address
	// TokenNonce is the token's nonces(payer); required, as only the chain knows it.
	TokenNonce *big.Int
	// ValidAfter defaults to Now - 600 s (never below 0).
	ValidAfter *big.Int
	// Deadline, the permit deadline (validBefore), defaults to Now + requirements.maxTimeoutSeconds.
	Deadline *big.Int
	// Now is the signing time the defaults derive from; zero means time.Now().
	Now time.Time
}

// EIP3009Options tunes SignEIP3009Payment. The zero value signs as public clients do.
type EIP3009Options struct {
	// Nonce is the authorization's 32-byte nonce; zero draws a random one.
	Nonce common.Hash
	// ValidAfter defaults to Now - 600 s (never below 0).
	ValidAfter *big.Int
	// ValidBefore defaults to Now + requirements.maxTimeoutSeconds.
	ValidBefore *big.Int
	// Now is the signing time the defaults derive from; zero means time.Now().
	Now time.Time
}

// payerTerms are the parts of requirements every payment method signs over.
type payerTerms struct {
	asset      common.Address
	payTo      common.Address
	amount     *big.Int
	validAfter *big.Int
	deadline   *big.Int
}

// SignPermit2Payment builds and signs a version 2 permit2 payment for req: a Permit2 PermitWitnessTransferFrom
// that lets the x402 proxy move exactly req.Amount of req.Asset to req.PayTo. The payer must have approved
// Permit2 on the token, or the caller adds AddGasSponsoring.
//
// An upto requirement (req.Scheme "upto") is signed as the public UptoEvmScheme client signs it: req.Amount is
// the most the upto proxy may move, and the witness (to, facilitator, validAfter) names the facilitator wallet
// that alone may settle it, requirements.extra.facilitatorAddress.
func SignPermit2Payment(key *ecdsa.PrivateKey, req x402.PaymentRequirements, chainID *big.Int, opts Permit2Options) (x402.PaymentPayload, error) {
	if err := checkMethod(req, x402.TransferPermit2); err != nil {
		return x402.PaymentPayload{}, err
	}
	t, err := parseTerms(req, chainID, opts.Now, opts.ValidAfter, opts.Deadline)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	permit2, err := contractAddress(opts.permit2, req.Extra.Permit2Address, "requirements.extra.permit2Address", canonicalPermit2)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	upto := req.Scheme == x402.SchemeUpto
	defaultProxy := canonicalProxy
	if upto {
		defaultProxy = canonicalUptoProxy
	}
	proxy, err := contractAddress(opts.Proxy, req.Extra.X402Permit2ProxyAddress, "requirements.extra.x402Permit2ProxyAddress", defaultProxy)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	var facilitator common.Address
	if upto {
		if opts.Facilitator == (common.Address{}) && req.Extra.FacilitatorAddress == "" {
			return x402.PaymentPayload{}, errors.New("an upto payment names the facilitator wallet that may settle it, and requirements.extra.facilitatorAddress is missing: the server takes it from its facilitator's /supported upto kind (or set Permit2Options.Facilitator)")
		}
		if facilitator, err = contractAddress(opts.Facilitator, req.Extra.FacilitatorAddress, "requirements.extra.facilitatorAddress", common.Address{}); err != nil {
			return x402.PaymentPayload{}, err
		}
	}
	nonce := opts.Nonce
	if nonce == nil {
		var b [32]byte
		if _, err := rand.Read(b[:]); err != nil {
			return x402.PaymentPayload{}, fmt.Errorf("drawing a Permit2 nonce: %w", err)
		}
		nonce = new(big.Int).SetBytes(b[:])
	} else if err := checkUint256("nonce", nonce); err != nil {
		return x402.PaymentPayload{}, err
	}

	p := permit2Transfer{
		Token:       t.asset,
		Amount:      t.amount,
		Spender:     proxy,
		Nonce:       nonce,
		Deadline:    t.deadline,
		To:          t.payTo,
		Facilitator: facilitator,
		ValidAfter:  t.validAfter,
	}
	digest := permit2Digest(permit2DomainSeparator(chainID, permit2), p)
	witness := x402.Permit2Witness{To: p.To.Hex(), ValidAfter: p.ValidAfter.String()}
	if upto {
		digest = uptoDigest(permit2DomainSeparator(chainID, permit2), p)
		witness.Facilitator = p.Facilitator.Hex()
	}
	sig, err := signDigest(key, digest)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	return x402.PaymentPayload{
		X402Version: x402.Version2,
		Accepted:    req,
		Payload: x402.ExactEVMPayload{
			Signature: sig.hex(),
			Permit2Authorization: &x402.Permit2Authorization{
				From:      crypto.PubkeyToAddress(key.PublicKey).Hex(),
				Permitted: x402.TokenPermissions{Token: p.Token.Hex(), Amount: p.Amount.String()},
				Spender:   p.Spender.Hex(),
				Nonce:     p.Nonce.String(),
				Deadline:  p.Deadline.String(),
				Witness:   witness,
			},
		},
	}, nil
}

// SignERC2612Payment builds and signs a version 2 erc2612 payment for req: an EIP-2612 permit of req.Amount
// to the facilitator wallet that will pull the funds and pay req.PayTo. The token domain is
// requirements.extra name and version (default "Stable Coin" / "1"), verifying contract req.Asset.
func SignERC2612Payment(key *ecdsa.PrivateKey, req x402.PaymentRequirements, chainID *big.Int, opts ERC2612Options) (x402.PaymentPayload, error) {
	if err := checkMethod(req, x402.TransferERC2612); err != nil {
		return x402.PaymentPayload{}, err
	}
	t, err := parseTerms(req, chainID, opts.Now, opts.ValidAfter, opts.Deadline)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	if opts.TokenNonce == nil {
		return x402.PaymentPayload{}, errors.New("erc2612 payment needs TokenNonce: read the token's nonces(payer) first")
	}
	if err := checkUint256("token nonce", opts.TokenNonce); err != nil {
		return x402.PaymentPayload{}, err
	}
	spender := opts.Spender
	if spender == (common.Address{}) {
		if req.Extra.Spender == "" {
			return x402.PaymentPayload{}, errors.New("erc2612 payment needs a spender: set ERC2612Options.Spender to a facilitator wallet (see /supported signers) or requirements.extra.spender")
		}
		if spender, err = ParseAddress("requirements.extra.spender", req.Extra.Spender); err != nil {
			return x402.PaymentPayload{}, err
		}
	}

	from := crypto.PubkeyToAddress(key.PublicKey)
	p := Permit{Owner: from, Spender: spender, Value: t.amount, Nonce: opts.TokenNonce, Deadline: t.deadline}
	name, version := tokenDomain(req.Extra.Name, req.Extra.Version)
	sig, err := signDigest(key, PermitDigest(PermitDomainSeparator(name, version, chainID, t.asset), p))
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	return x402.PaymentPayload{
		X402Version: x402.Version2,
		Accepted:    req,
		Payload: x402.ExactEVMPayload{
			Signature: sig.hex(),
			Authorization: &x402.EIP2612Authorization{
				From:        from.Hex(),
				To:          spender.Hex(),
				Value:       p.Value.String(),
				ValidAfter:  t.validAfter.String(),
				ValidBefore: p.Deadline.String(),
				Nonce:       p.Nonce.String(),
			},
		},
	}, nil
}

// SignEIP3009Payment builds and signs a version 2 eip3009 payment for req: an EIP-3009
// TransferWithAuthorization of exactly req.Amount of req.Asset to req.PayTo, which any facilitator wallet can
// submit. The token domain is requirements.extra name and version (default "Stable Coin" / "1"), verifying
// contract req.Asset. A requirement naming no method is signed this way, as the public clients do.
func SignEIP3009Payment(key *ecdsa.PrivateKey, req x402.PaymentRequirements, chainID *big.Int, opts EIP3009Options) (x402.PaymentPayload, error) {
	if err := checkMethod(req, x402.TransferEIP3009); err != nil {
		return x402.PaymentPayload{}, err
	}
	t, err := parseTerms(req, chainID, opts.Now, opts.ValidAfter, opts.ValidBefore)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	nonce := opts.Nonce
	if nonce == (common.Hash{}) {
		if _, err := rand.Read(nonce[:]); err != nil {
			return x402.PaymentPayload{}, fmt.Errorf("drawing an EIP-3009 nonce: %w", err)
		}
	}
	a := transferAuthorization{From: crypto.PubkeyToAddress(key.PublicKey), To: t.payTo, Value: t.amount,
		ValidAfter: t.validAfter, ValidBefore: t.deadline, Nonce: nonce}
	name, version := tokenDomain(req.Extra.Name, req.Extra.Version)
	sig, err := signDigest(key, transferAuthorizationDigest(PermitDomainSeparator(name, version, chainID, t.asset), a))
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	return x402.PaymentPayload{
		X402Version: x402.Version2,
		Accepted:    req,
		Payload: x402.ExactEVMPayload{
			Signature: sig.hex(),
			Authorization: &x402.EIP2612Authorization{
				From:        a.From.Hex(),
				To:          a.To.Hex(),
				Value:       a.Value.String(),
				ValidAfter:  a.ValidAfter.String(),
				ValidBefore: a.ValidBefore.String(),
				Nonce:       a.Nonce.Hex(),
			},
		},
	}, nil
}

// AddGasSponsoring adds to a signed permit2 payment the eip2612GasSponsoring extension: the payer's EIP-2612
// permit of the payment amount to Permit2, valid until the Permit2 deadline, so that the facilitator can make
// the one-time Permit2 approval for the payer. tokenName and tokenVersion default to the payload's
// accepted.extra, then to "Stable Coin" / "1"; Permit2 is accepted.extra.permit2Address or the canonical one.
// tokenNonce is the token's nonces(payer). A schema the server declared under the extension is kept.
func AddGasSponsoring(p *x402.PaymentPayload, key *ecdsa.PrivateKey, chainID *big.Int, tokenName, tokenVersion string, tokenNonce *big.Int) error {
	if p == nil || p.Payload.Permit2Authorization == nil {
		return errors.New("gas sponsoring needs a signed permit2 payment; the payload has no permit2Authorization")
	}
	if tokenNonce == nil {
		return errors.New("gas sponsoring needs the token's nonces(payer); got nil")
	}
	if err := checkUint256("token nonce", tokenNonce); err != nil {
		return err
	}
	t, owner, err := permit2TransferFromPayload(p.Payload.Permit2Authorization)
	if err != nil {
		return err
	}
	from := crypto.PubkeyToAddress(key.PublicKey)
	if owner != from {
		return fmt.Errorf("gas sponsoring key is %s but the permit2 payment is from %s", from.Hex(), owner.Hex())
	}
	permit2, err := contractAddress(common.Address{}, p.Accepted.Extra.Permit2Address, "accepted.extra.permit2Address", canonicalPermit2)
	if err != nil {
		return err
	}
	if tokenName == "" {
		tokenName = p.Accepted.Extra.Name
	}
	if tokenVersion == "" {
		tokenVersion = p.Accepted.Extra.Version
	}
	name, version := tokenDomain(tokenName, tokenVersion)

	permit := Permit{Owner: from, Spender: permit2, Value: t.Amount, Nonce: tokenNonce, Deadline: t.Deadline}
	sig, err := signDigest(key, PermitDigest(PermitDomainSeparator(name, version, chainID, t.Token), permit))
	if err != nil {
		return err
	}
	info := x402.EIP2612GasSponsoringInfo{
		From:      from.Hex(),
		Asset:     t.Token.Hex(),
		Spender:   permit2.Hex(),
		Amount:    permit.Value.String(),
		Nonce:     permit.Nonce.String(),
		Deadline:  permit.Deadline.String(),
		Signature: sig.hex(),
		Version:   "1",
	}

	raw, err := json.Marshal(map[string]x402.EIP2612GasSponsoringInfo{"info": info})
	if err != nil {
		return fmt.Errorf("encoding gas sponsoring info: %w", err)
	}
	// Merged into what the server declared (schema, and info's description and version), as the public
	// clients do: a server that checks the echo finds its declaration unchanged.
	rawExt, err := x402.MergeExtension(p.Extensions[x402.ExtensionEIP2612GasSponsoring], raw)
	if err != nil {
		rawExt = raw // a declaration that is not JSON is not worth echoing
	}
	if p.Extensions == nil {
		p.Extensions = map[string]json.RawMessage{}
	}
	p.Extensions[x402.ExtensionEIP2612GasSponsoring] = rawExt
	return nil
}

// ApprovalTx is what a payer's sponsored approval transaction carries besides its call: the account nonce (the
// node's pending one), the gas limit and the EIP-1559 fees.
type ApprovalTx struct {
	Nonce          uint64
	Gas            uint64   // 0: 70,000, as the public SDK signs
	TipCap, FeeCap *big.Int // nil: 0.1 gwei and 1 gwei, the public SDK's defaults
}

// AddApprovalSponsoring adds to a signed permit2 payment the erc20ApprovalGasSponsoring extension: the payer's own
// signed EIP-1559 transaction approve(Permit2, max uint256) on the payment's token, as the public SDK signs it, for
// a facilitator that declares the extension to fund, broadcast and mine before the settlement. Nothing is sent.
// Permit2 is accepted.extra.permit2Address or the canonical one. A schema the server declared is kept.
func AddApprovalSponsoring(p *x402.PaymentPayload, key *ecdsa.PrivateKey, chainID *big.Int, tx ApprovalTx) error {
	if p == nil || p.Payload.Permit2Authorization == nil {
		return errors.New("approval sponsoring needs a signed permit2 payment; the payload has no permit2Authorization")
	}
	t, owner, err := permit2TransferFromPayload(p.Payload.Permit2Authorization)
	if err != nil {
		return err
	}
	from := crypto.PubkeyToAddress(key.PublicKey)
	if owner != from {
		return fmt.Errorf("approval sponsoring key is %s but the permit2 payment is from %s", from.Hex(), owner.Hex())
	}
	permit2, err := contractAddress(common.Address{}, p.Accepted.Extra.Permit2Address, "accepted.extra.permit2Address", canonicalPermit2)
	if err != nil {
		return err
	}
	if tx.Gas == 0 {
		tx.Gas = 70_000
	}
	if tx.TipCap == nil {
		tx.TipCap = big.NewInt(100_000_000)
	}
	if tx.FeeCap == nil {
		tx.FeeCap = big.NewInt(1_000_000_000)
	}
	amount := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	data, err := contracts.StableCoinABI.Pack("approve", permit2, amount)
	if err != nil {
		return err
	}
	signed, err := types.SignNewTx(key, types.LatestSignerForChainID(chainID), &types.DynamicFeeTx{
		ChainID: chainID, Nonce: tx.Nonce, GasTipCap: tx.TipCap, GasFeeCap: tx.FeeCap, Gas: tx.Gas, To: &t.Token, Data: data,
	})
	if err != nil {
		return fmt.Errorf("signing the approval: %w", err)
	}
	rawTx, err := signed.MarshalBinary()
	if err != nil {
		return err
	}
	info := x402.ERC20ApprovalGasSponsoringInfo{
		From: from.Hex(), Asset: t.Token.Hex(), Spender: permit2.Hex(), Amount: amount.String(),
		SignedTransaction: hexutil.Encode(rawTx), Version: "1",
	}
	raw, err := json.Marshal(map[string]x402.ERC20ApprovalGasSponsoringInfo{"info": info})
	if err != nil {
		return fmt.Errorf("encoding approval sponsoring info: %w", err)
	}
	rawExt, err := x402.MergeExtension(p.Extensions[x402.ExtensionERC20ApprovalGasSponsoring], raw)
	if err != nil {
		rawExt = raw
	}
	if p.Extensions == nil {
		p.Extensions = map[string]json.RawMessage{}
	}
	p.Extensions[x402.ExtensionERC20ApprovalGasSponsoring] = rawExt
	return nil
}

// permit2TransferFromPayload parses a permit2 authorization strictly (addresses 0x + 40 hex digits, numbers
// decimal uint256 as x402.ParseUint256 reads them) into the message its signature signs, and the payer it claims. Errors are *fieldError.
func permit2TransferFromPayload(a *x402.Permit2Authorization) (permit2Transfer, common.Address, error) {
	if a == nil {
		return permit2Transfer{}, common.Address{}, &fieldError{Field: "permit2Authorization", Want: "an object", Got: "nothing"}
	}
	f := fields{prefix: "permit2Authorization."}
	owner := f.address("from", a.From)
	p := permit2Transfer{
		Token:    f.address("permitted.token", a.Permitted.Token),
		Amount:   f.number("permitted.amount", a.Permitted.Amount),
		Spender:  f.address("spender", a.Spender),
		Nonce:    f.number("nonce", a.Nonce),
		Deadline: f.number("deadline", a.Deadline),
		To:       f.address("witness.to", a.Witness.To),
	}
	if a.Witness.Facilitator != "" {
		// An upto witness; whether the scheme wants one the verifier says.
		p.Facilitator = f.address("witness.facilitator", a.Witness.Facilitator)
	}
	p.ValidAfter = f.number("witness.validAfter", a.Witness.ValidAfter)
	return p, owner, f.err
}

// PermitFromAuthorization parses an erc2612 authorization strictly into the EIP-2612 Permit its signature
// signs: owner = from, spender = to, deadline = validBefore. validAfter is checked for form too, though the
// permit does not sign it. Errors are *fieldError.
func PermitFromAuthorization(a *x402.EIP2612Authorization) (Permit, error) {
	if a == nil {
		return Permit{}, &fieldError{Field: "authorization", Want: "an object", Got: "nothing"}
	}
	f := fields{prefix: "authorization."}
	p := Permit{
		Owner:   f.address("from", a.From),
		Spender: f.address("to", a.To),
		Value:   f.number("value", a.Value),
	}
	f.number("validAfter", a.ValidAfter)
	p.Deadline = f.number("validBefore", a.ValidBefore)
	p.Nonce = f.number("nonce", a.Nonce)
	return p, f.err
}

// transferAuthorizationFromPayload parses an eip3009 authorization strictly into the EIP-3009
// TransferWithAuthorization its signature signs; the nonce must be 0x and 64 hex digits. Errors are *fieldError.
func transferAuthorizationFromPayload(a *x402.EIP2612Authorization) (transferAuthorization, error) {
	if a == nil {
		return transferAuthorization{}, &fieldError{Field: "authorization", Want: "an object", Got: "nothing"}
	}
	f := fields{prefix: "authorization."}
	t := transferAuthorization{
		From:        f.address("from", a.From),
		To:          f.address("to", a.To),
		Value:       f.number("value", a.Value),
		ValidAfter:  f.number("validAfter", a.ValidAfter),
		ValidBefore: f.number("validBefore", a.ValidBefore),
	}
	if f.err == nil {
		if !x402.IsBytes32(a.Nonce) {
			f.err = &fieldError{Field: "authorization.nonce", Want: "0x and 64 hex digits (a 32-byte EIP-3009 nonce)", Got: truncate(a.Nonce)}
		} else {
			t.Nonce = common.HexToHash(a.Nonce)
		}
	}
	return t, f.err
}

// permitFromGasSponsoring parses an eip2612GasSponsoring info strictly into the EIP-2612 Permit its signature
// signs and the token whose domain it is signed over. It does not judge the values (spender = Permit2, from =
// payer): the verifier does. Errors are *fieldError.
func permitFromGasSponsoring(info *x402.EIP2612GasSponsoringInfo) (Permit, common.Address, error) {
	if info == nil {
		return Permit{}, common.Address{}, &fieldError{Field: "eip2612GasSponsoring.info", Want: "an object", Got: "nothing"}
	}
	f := fields{prefix: "eip2612GasSponsoring.info."}
	p := Permit{Owner: f.address("from", info.From)}
	token := f.address("asset", info.Asset)
	p.Spender = f.address("spender", info.Spender)
	p.Value = f.number("amount", info.Amount)
	p.Nonce = f.number("nonce", info.Nonce)
	p.Deadline = f.number("deadline", info.Deadline)
	return p, token, f.err
}

// fields parses the fields of one payload object in order and keeps the first error: once a field fails, the
// later ones are not read, and the error names the field as its path under prefix.
type fields struct {
	prefix string
	err    error
}

func (f *fields) address(name, s string) common.Address {
	if f.err != nil {
		return common.Address{}
	}
	a, err := ParseAddress(f.prefix+name, s)
	f.err = err
	return a
}

func (f *fields) number(name, s string) *big.Int {
	if f.err != nil {
		return nil
	}
	n, err := parseNumber(f.prefix+name, s)
	f.err = err
	return n
}

// fieldError says which field of a payload or requirement does not have the expected form, and what came.
type fieldError struct {
	// Field is the JSON path of the field, such as "permit2Authorization.witness.to".
	Field string
	// Want describes the expected form.
	Want string
	// Got is the value that came, shortened.
	Got string
	// Err is the parser's own error, if any (such as x402.ErrNumberSyntax).
	Err error
}

// Error names the field, what was expected and what came.
func (e *fieldError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s: expected %s: %v", e.Field, e.Want, e.Err)
	}
	return fmt.Sprintf("%s: expected %s, got %q", e.Field, e.Want, e.Got)
}

// Unwrap returns the parser's error, so errors.Is sees x402.ErrNumberSyntax and x402.ErrNumberRange.
func (e *fieldError) Unwrap() error { return e.Err }

// ParseAddress parses an address strictly: 0x followed by exactly 40 hex digits, any case (the checksum case
// is not enforced, as clients and servers write addresses differently). field names it in errors.
func ParseAddress(field, s string) (common.Address, error) {
	var a common.Address
	if len(s) != 42 || s[0] != '0' || (s[1] != 'x' && s[1] != 'X') {
		return a, &fieldError{Field: field, Want: "an address (0x and 40 hex digits)", Got: truncate(s)}
	}
	for i := range a {
		hi, ok1 := fromHexChar(s[2+2*i])
		lo, ok2 := fromHexChar(s[3+2*i])
		if !ok1 || !ok2 {
			return common.Address{}, &fieldError{Field: field, Want: "an address (0x and 40 hex digits)", Got: truncate(s)}
		}
		a[i] = hi<<4 | lo
	}
	return a, nil
}

// parseNumber parses a decimal uint256 field with x402's strict rules (digits only, no leading zeros, below
// 2^256), naming the field in the error.
func parseNumber(field, s string) (*big.Int, error) {
	x, err := x402.ParseUint256(s)
	if err != nil {
		return nil, &fieldError{Field: field, Want: "a decimal uint256", Got: truncate(s), Err: err}
	}
	return x, nil
}

// parseTerms reads what every payment method signs from req, and fills the validity window.
func parseTerms(req x402.PaymentRequirements, chainID *big.Int, now time.Time, validAfter, deadline *big.Int) (payerTerms, error) {
	var (
		t   payerTerms
		err error
	)
	if req.Scheme != "" && !x402.IsScheme(req.Scheme) {
		return t, fmt.Errorf("requirements.scheme: expected %q or %q, got %q", x402.SchemeExact, x402.SchemeUpto, req.Scheme)
	}
	if err := checkChainID(req.Network, chainID); err != nil {
		return t, err
	}
	if t.asset, err = ParseAddress("requirements.asset", req.Asset); err != nil {
		return t, err
	}
	if t.payTo, err = ParseAddress("requirements.payTo", req.PayTo); err != nil {
		return t, err
	}
	if t.amount, err = parseNumber("requirements.amount", req.Amount); err != nil {
		return t, err
	}
	if now.IsZero() {
		now = time.Now()
	}
	if t.validAfter = validAfter; t.validAfter == nil {
		t.validAfter = big.NewInt(max(0, now.Add(-validAfterSkew).Unix()))
	} else if err := checkUint256("validAfter", t.validAfter); err != nil {
		return t, err
	}
	if t.deadline = deadline; t.deadline == nil {
		if req.MaxTimeoutSeconds <= 0 {
			return t, fmt.Errorf("requirements.maxTimeoutSeconds: expected a positive number to derive the deadline from, got %d; or set Deadline", req.MaxTimeoutSeconds)
		}
		if unix := now.Unix(); unix < 0 || req.MaxTimeoutSeconds > math.MaxInt64-unix {
			// Added as it is, it would wrap and be signed as a uint256 near 2^256: a payment valid forever.
			return t, fmt.Errorf("requirements.maxTimeoutSeconds: %d seconds after the signing time does not fit a 64-bit clock: a payment that would never expire; not signed", req.MaxTimeoutSeconds)
		}
		t.deadline = big.NewInt(now.Unix() + req.MaxTimeoutSeconds)
	} else if err := checkUint256("deadline", t.deadline); err != nil {
		return t, err
	}
	return t, nil
}

// checkChainID refuses to sign for a chain other than the one the requirements name, as the signature would
// be valid there and useless here.
func checkChainID(network string, chainID *big.Int) error {
	if chainID == nil || chainID.Sign() <= 0 || chainID.BitLen() > 256 {
		return fmt.Errorf("chain ID: expected a positive uint256, got %v", chainID)
	}
	ref, ok := strings.CutPrefix(network, "eip155:")
	if !ok {
		return nil
	}
	n, good := new(big.Int).SetString(ref, 10)
	if !good || n.Cmp(chainID) != 0 {
		return fmt.Errorf("requirements.network is %q but signing for chain %s", network, chainID)
	}
	return nil
}

// checkMethod refuses requirements that name a different asset transfer method; none named is fine. The upto
// scheme is paid by permit2 only.
func checkMethod(req x402.PaymentRequirements, method string) error {
	if req.Scheme == x402.SchemeUpto && method != x402.TransferPermit2 {
		return fmt.Errorf("requirements.scheme is %q, which is paid by %s only; this signs a %s payment", req.Scheme, x402.TransferPermit2, method)
	}
	if m := req.Extra.AssetTransferMethod; m != "" && m != method {
		return fmt.Errorf("requirements.extra.assetTransferMethod is %q; this signs a %s payment", m, method)
	}
	return nil
}

func checkUint256(what string, x *big.Int) error {
	if x.Sign() < 0 || x.BitLen() > 256 {
		return fmt.Errorf("%s: expected a uint256, got %s", what, x)
	}
	return nil
}

// contractAddress picks an explicit address, else the one the requirements name, else the canonical one.
func contractAddress(explicit common.Address, fromExtra, field string, canonical common.Address) (common.Address, error) {
	if explicit != (common.Address{}) {
		return explicit, nil
	}
	if fromExtra != "" {
		return ParseAddress(field, fromExtra)
	}
	return canonical, nil
}

func tokenDomain(name, version string) (string, string) {
	if name == "" {
		name = x402.DefaultTokenName
	}
	if version == "" {
		version = x402.DefaultTokenVersion
	}
	return name, version
}
