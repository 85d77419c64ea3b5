package chaintest

import (
	"crypto/rand"
	"math/big"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/math"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// Permit2Authorization is a payer's signed PermitWitnessTransferFrom for the x402 proxy:
// everything proxy.settle needs.
type Permit2Authorization struct {
	Owner     common.Address
	Permit    contracts.PermitTransferFrom
	Spender   common.Address
	Witness   contracts.Witness
	Signature []byte
}

// SettleCalldata returns the calldata of proxy.settle for the authorization.
func (a *Permit2Authorization) SettleCalldata() ([]byte, error) {
	return contracts.PackSettle(a.Permit, a.Owner, a.Witness, a.Signature)
}

// SettleWithPermitCalldata returns the calldata of proxy.settleWithPermit for the
// authorization and an EIP-2612 permit to Permit2.
func (a *Permit2Authorization) SettleWithPermitCalldata(permit *ERC2612Permit) ([]byte, error) {
	return contracts.PackSettleWithPermit(permit.ProxyPermit(), a.Permit, a.Owner, a.Witness, a.Signature)
}

// ERC2612Permit is an owner's signed EIP-2612 Permit on the token.
type ERC2612Permit struct {
	Owner     common.Address
	Spender   common.Address
	Value     *big.Int
	Nonce     *big.Int
	Deadline  *big.Int
	Signature []byte
}

// ProxyPermit splits the signature into the proxy's EIP2612Permit struct.
func (p *ERC2612Permit) ProxyPermit() contracts.EIP2612Permit {
	out := contracts.EIP2612Permit{Value: p.Value, Deadline: p.Deadline, V: p.Signature[64]}
	copy(out.R[:], p.Signature[:32])
	copy(out.S[:], p.Signature[32:64])
	return out
}

// Permit2TypedData returns the EIP-712 PermitWitnessTransferFrom a payer signs for the proxy,
// with the domain {name "Permit2", chainId, verifyingContract Permit2} (no version).
func (c *Chain) Permit2TypedData(permit contracts.PermitTransferFrom, spender common.Address, witness contracts.Witness) apitypes.TypedData {
	return Permit2WitnessTypedData(c.ChainID, contracts.Permit2Address, permit.Permitted.Token.Hex(), permit.Permitted.Amount.String(),
		spender.Hex(), permit.Nonce.String(), permit.Deadline.String(), witness.To.Hex(), witness.ValidAfter.String())
}

// ERC2612TypedData returns the EIP-712 Permit of the token with the domain
// {name "Stable Coin", version "1", chainId, verifyingContract token}.
func (c *Chain) ERC2612TypedData(owner, spender common.Address, value, nonce, deadline *big.Int) apitypes.TypedData {
	return PermitTypedData(contracts.StableCoinName, contracts.StableCoinVersion, c.ChainID, c.Token,
		owner.Hex(), spender.Hex(), value.String(), nonce.String(), deadline.String())
}

// PermitTypedData is an EIP-2612 Permit as go-ethereum's reference EIP-712 implementation (apitypes) sees it,
// with the values as the strings a wire payload carries.
func PermitTypedData(name, version string, chainID *big.Int, token common.Address, owner, spender, value, nonce, deadline string) apitypes.TypedData {
	return apitypes.TypedData{
		Types: apitypes.Types{
			"EIP712Domain": tokenDomainType,
			"Permit": {
				{Name: "owner", Type: "address"},
				{Name: "spender", Type: "address"},
				{Name: "value", Type: "uint256"},
				{Name: "nonce", Type: "uint256"},
				{Name: "deadline", Type: "uint256"},
			},
		},
		PrimaryType: "Permit",
		Domain:      tokenDomain(name, version, chainID, token),
		Message: apitypes.TypedDataMessage{
			"owner":    owner,
			"spender":  spender,
			"value":    value,
			"nonce":    nonce,
			"deadline": deadline,
		},
	}
}

// Permit2WitnessTypedData is Permit2's PermitWitnessTransferFrom with the x402 witness {to, validAfter} as
// apitypes sees it, with the domain {name "Permit2", chainId, verifyingContract permit2} (no version).
func Permit2WitnessTypedData(chainID *big.Int, permit2 common.Address, token, amount, spender, nonce, deadline, to, validAfter string) apitypes.TypedData {
	return apitypes.TypedData{
		Types: apitypes.Types{
			"EIP712Domain": {
				{Name: "name", Type: "string"},
				{Name: "chainId", Type: "uint256"},
				{Name: "verifyingContract", Type: "address"},
			},
			"PermitWitnessTransferFrom": {
				{Name: "permitted", Type: "TokenPermissions"},
				{Name: "spender", Type: "address"},
				{Name: "nonce", Type: "uint256"},
				{Name: "deadline", Type: "uint256"},
				{Name: "witness", Type: "Witness"},
			},
			"TokenPermissions": {
				{Name: "token", Type: "address"},
				{Name: "amount", Type: "uint256"},
			},
			"Witness": {
				{Name: "to", Type: "address"},
				{Name: "validAfter", Type: "uint256"},
			},
		},
		PrimaryType: "PermitWitnessTransferFrom",
		Domain: apitypes.TypedDataDomain{
			Name:              "Permit2",
			ChainId:           (*math.HexOrDecimal256)(new(big.Int).Set(chainID)),
			VerifyingContract: permit2.Hex(),
		},
		Message: apitypes.TypedDataMessage{
			"permitted": map[string]any{"token": token, "amount": amount},
			"spender":   spender,
			"nonce":     nonce,
			"deadline":  deadline,
			"witness":   map[string]any{"to": to, "validAfter": validAfter},
		},
	}
}

// SignTypedData signs EIP-712 typed data and returns r || s || v with v in {27, 28}.
func (c *Chain) SignTypedData(signer *Account, td apitypes.TypedData) []byte {
	c.tb.Helper()
	hash, _, err := apitypes.TypedDataAndHash(td)
	if err != nil {
		c.tb.Fatalf("chaintest: hashing %s typed data: %v", td.PrimaryType, err)
	}
	sig, err := crypto.Sign(hash, signer.Key)
	if err != nil {
		c.tb.Fatalf("chaintest: signing %s: %v", td.PrimaryType, err)
	}
	sig[64] += 27
	return sig
}

// SignPermit2 signs a PermitWitnessTransferFrom of owner for spender.
func (c *Chain) SignPermit2(owner *Account, permit contracts.PermitTransferFrom, spender common.Address, witness contracts.Witness) *Permit2Authorization {
	c.tb.Helper()
	return &Permit2Authorization{
		Owner:     owner.Address,
		Permit:    permit,
		Spender:   spender,
		Witness:   witness,
		Signature: c.SignTypedData(owner, c.Permit2TypedData(permit, spender, witness)),
	}
}

// NewPermit2Authorization signs what an x402 client signs for a permit2 payment: amount of
// the chain's token to `to` through the proxy, with a random unordered nonce.
func (c *Chain) NewPermit2Authorization(owner *Account, to common.Address, amount *big.Int, validAfter, deadline uint64) *Permit2Authorization {
	c.tb.Helper()
	permit := contracts.PermitTransferFrom{
		Permitted: contracts.TokenPermissions{Token: c.Token, Amount: new(big.Int).Set(amount)},
		Nonce:     RandomNonce(),
		Deadline:  new(big.Int).SetUint64(deadline),
	}
	witness := contracts.Witness{To: to, ValidAfter: new(big.Int).SetUint64(validAfter)}
	return c.SignPermit2(owner, permit, contracts.ProxyAddress, witness)
}

// UptoAuthorization is a payer's signed PermitWitnessTransferFrom for the x402 upto proxy: at most
// Permit.Permitted.Amount, to Witness.To, settled only by Witness.Facilitator.
type UptoAuthorization struct {
	Owner     common.Address
	Permit    contracts.PermitTransferFrom
	Spender   common.Address
	Witness   contracts.UptoWitness
	Signature []byte
}

// SettleCalldata returns the calldata of uptoProxy.settle moving amount under the authorization.
func (a *UptoAuthorization) SettleCalldata(amount *big.Int) ([]byte, error) {
	return contracts.PackUptoSettle(a.Permit, amount, a.Owner, a.Witness, a.Signature)
}

// SettleWithPermitCalldata returns the calldata of uptoProxy.settleWithPermit moving amount under the
// authorization, applying an EIP-2612 permit to Permit2 first.
func (a *UptoAuthorization) SettleWithPermitCalldata(permit *ERC2612Permit, amount *big.Int) ([]byte, error) {
	return contracts.PackUptoSettleWithPermit(permit.ProxyPermit(), a.Permit, amount, a.Owner, a.Witness, a.Signature)
}

// UptoWitnessTypedData is Permit2's PermitWitnessTransferFrom with the x402 upto witness {to, facilitator,
// validAfter} as apitypes sees it (the type definitions of the public TypeScript client's
// uptoPermit2WitnessTypes), with the domain {name "Permit2", chainId, verifyingContract permit2} (no version).
func UptoWitnessTypedData(chainID *big.Int, permit2 common.Address, token, amount, spender, nonce, deadline, to, facilitator, validAfter string) apitypes.TypedData {
	td := Permit2WitnessTypedData(chainID, permit2, token, amount, spender, nonce, deadline, to, validAfter)
	td.Types["Witness"] = []apitypes.Type{
		{Name: "to", Type: "address"},
		{Name: "facilitator", Type: "address"},
		{Name: "validAfter", Type: "uint256"},
	}
	td.Message["witness"] = map[string]any{"to": to, "facilitator": facilitator, "validAfter": validAfter}
	return td
}

// SignUpto signs an upto PermitWitnessTransferFrom of owner for spender.
func (c *Chain) SignUpto(owner *Account, permit contracts.PermitTransferFrom, spender common.Address, witness contracts.UptoWitness) *UptoAuthorization {
	c.tb.Helper()
	td := UptoWitnessTypedData(c.ChainID, contracts.Permit2Address, permit.Permitted.Token.Hex(), permit.Permitted.Amount.String(),
		spender.Hex(), permit.Nonce.String(), permit.Deadline.String(), witness.To.Hex(), witness.Facilitator.Hex(), witness.ValidAfter.String())
	return &UptoAuthorization{Owner: owner.Address, Permit: permit, Spender: spender, Witness: witness, Signature: c.SignTypedData(owner, td)}
}

// NewUptoAuthorization signs what an x402 client signs for an upto payment: at most max of the chain's token
// to `to` through the upto proxy, settled by facilitator only, with a random unordered nonce.
func (c *Chain) NewUptoAuthorization(owner *Account, to, facilitator common.Address, max *big.Int, validAfter, deadline uint64) *UptoAuthorization {
	c.tb.Helper()
	permit := contracts.PermitTransferFrom{
		Permitted: contracts.TokenPermissions{Token: c.Token, Amount: new(big.Int).Set(max)},
		Nonce:     RandomNonce(),
		Deadline:  new(big.Int).SetUint64(deadline),
	}
	witness := contracts.UptoWitness{To: to, Facilitator: facilitator, ValidAfter: new(big.Int).SetUint64(validAfter)}
	return c.SignUpto(owner, permit, contracts.UptoProxyAddress, witness)
}

// SignERC2612Permit signs an EIP-2612 permit of owner for spender with the owner's current token nonce.
func (c *Chain) SignERC2612Permit(owner *Account, spender common.Address, value *big.Int, deadline uint64) *ERC2612Permit {
	c.tb.Helper()
	p := &ERC2612Permit{
		Owner:    owner.Address,
		Spender:  spender,
		Value:    new(big.Int).Set(value),
		Nonce:    c.TokenNonce(owner.Address),
		Deadline: new(big.Int).SetUint64(deadline),
	}
	p.Signature = c.SignTypedData(owner, c.ERC2612TypedData(p.Owner, p.Spender, p.Value, p.Nonce, p.Deadline))
	return p
}

// RandomNonce draws a 256-bit Permit2 nonce the way wallets do.
func RandomNonce() *big.Int {
	b := make([]byte, 32)
	rand.Read(b) // never fails (Go 1.24+ crashes the program instead)
	return new(big.Int).SetBytes(b)
}

// tokenDomainType is the EIP-712 domain of a token's permits and authorizations.
var tokenDomainType = []apitypes.Type{
	{Name: "name", Type: "string"},
	{Name: "version", Type: "string"},
	{Name: "chainId", Type: "uint256"},
	{Name: "verifyingContract", Type: "address"},
}

// tokenDomain is the EIP-712 domain of token.
func tokenDomain(name, version string, chainID *big.Int, token common.Address) apitypes.TypedDataDomain {
	return apitypes.TypedDataDomain{Name: name, Version: version, ChainId: (*math.HexOrDecimal256)(new(big.Int).Set(chainID)), VerifyingContract: token.Hex()}
}

// TransferAuthorizationTypedData is the EIP-3009 TransferWithAuthorization a payer signs for an eip3009
// payment, under the token's domain.
func TransferAuthorizationTypedData(name, version string, chainID *big.Int, token common.Address, from, to, value, validAfter, validBefore, nonce string) apitypes.TypedData {
	return apitypes.TypedData{
		Types: apitypes.Types{
			"EIP712Domain": tokenDomainType,
			"TransferWithAuthorization": {
				{Name: "from", Type: "address"},
				{Name: "to", Type: "address"},
				{Name: "value", Type: "uint256"},
				{Name: "validAfter", Type: "uint256"},
				{Name: "validBefore", Type: "uint256"},
				{Name: "nonce", Type: "bytes32"},
			},
		},
		PrimaryType: "TransferWithAuthorization",
		Domain:      tokenDomain(name, version, chainID, token),
		Message: apitypes.TypedDataMessage{
			"from":        from,
			"to":          to,
			"value":       value,
			"validAfter":  validAfter,
			"validBefore": validBefore,
			"nonce":       nonce,
		},
	}
}
