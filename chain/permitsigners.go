package chain

import (
	"fmt"
	"math/big"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// PermitSigners recovers the signers of erc2612 permits (x402.PermitSigners): the gate matches a version 1
// payment to its offer with it, knowing no EIP-712 itself.
type PermitSigners struct{}

var _ x402.PermitSigners = PermitSigners{}

// PermitSigner is the address that signed p's permit under the EIP-712 domain of rq's token.
func (PermitSigners) PermitSigner(rq x402.PaymentRequirements, p x402.ExactEVMPayload) (string, error) {
	if !common.IsHexAddress(rq.Asset) {
		return "", fmt.Errorf("recovering a permit's signer: asset %q is not an address", rq.Asset)
	}
	chainID, err := x402.ChainID(rq.Network)
	if err != nil {
		return "", fmt.Errorf("recovering a permit's signer: %w", err)
	}
	permit, err := PermitFromAuthorization(p.Authorization)
	if err != nil {
		return "", fmt.Errorf("recovering a permit's signer: %w", err)
	}
	sig, err := ParseSignature(p.Signature)
	if err != nil {
		return "", fmt.Errorf("recovering a permit's signer: %w", err)
	}
	domain := PermitDomainSeparator(rq.Extra.Name, rq.Extra.Version, new(big.Int).SetUint64(chainID), common.HexToAddress(rq.Asset))
	signer, err := RecoverSigner(PermitDigest(domain, permit), sig)
	if err != nil {
		return "", fmt.Errorf("recovering a permit's signer: %w", err)
	}
	return signer.Hex(), nil
}
