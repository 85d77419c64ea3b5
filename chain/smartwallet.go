package chain

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// maxSignatureBytes bounds a payer's signature: an ERC-6492 signature carries its wallet's deployment calldata,
// a few hundred bytes in practice; anything this large is no wallet's.
const maxSignatureBytes = 8 << 10

// minSignatureBytes is the shortest signature taken to the chain: an EIP-2098 compact ECDSA signature, which
// contract wallets accept too. Anything shorter is no signature worth a chain call.
const minSignatureBytes = 64

// counterfactual is the deployment an ERC-6492 signature carries: the factory and the calldata that deploy the
// payer's wallet.
type counterfactual struct {
	factory common.Address
	data    []byte
}

// contractSignature reads a signature that is not an EOA's signature of the payment: the raw bytes, unwrapped
// from ERC-6492 when wrapped, kept for the chain to judge (the payer may be a contract wallet, ERC-1271, or one
// yet to be deployed, ERC-6492). It returns the refusal of a signature that cannot be any wallet's.
func (p *payment) contractSignature(sig string, reason string, eoaRefusal *refusal) *refusal {
	raw, err := hexutil.Decode(sig)
	if err != nil || len(raw) == 0 {
		return refuse(reason, "payload.signature must be 0x-prefixed hex: %v", err)
	}
	if len(raw) < minSignatureBytes {
		return refuse(x402.ReasonInvalidPayload, "payload.signature is %d bytes; a signature has at least %d (65 for an EOA)", len(raw), minSignatureBytes)
	}
	if len(raw) > maxSignatureBytes {
		return refuse(reason, "payload.signature is %d bytes; no wallet's signature is longer than %d", len(raw), maxSignatureBytes)
	}
	factory, data, inner, wrapped, err := contracts.UnwrapERC6492(raw)
	switch {
	case err != nil:
		return refuse(reason, "payload.signature: %v", err)
	case wrapped:
		p.wallet = &counterfactual{factory: factory, data: data}
		raw = inner
	}
	p.sigBytes, p.contractSig, p.sigReason, p.eoaRefusal = raw, true, reason, eoaRefusal
	return nil
}

// checkContractSignature asks the chain whether a contract-wallet signature is the payer's: a deployed wallet
// by ERC-1271 isValidSignature; an undeployed one whose ERC-6492 signature names an allowed factory by the same
// call made after deploying it within an eth_call (DeployThenCall). It leaves p.undeployed set when the
// settlement must deploy the wallet first. The error is for a chain that could not be asked.
func (p *payment) checkContractSignature(ctx context.Context, reason string) (*refusal, error) {
	n := p.net
	code, err := n.backend.CodeAt(ctx, p.payer, nil)
	if err != nil {
		return nil, fmt.Errorf("reading the code of payer %s: %w", p.payer.Hex(), err)
	}
	check, err := contracts.SmartWalletABI.Pack("isValidSignature", p.digest, p.sigBytes)
	if err != nil {
		return nil, err
	}
	p.undeployed = false
	var ret []byte
	switch {
	case len(code) > 0:
		// Asked as the settlement asks it (see execution): a wallet must not answer the engine otherwise than
		// the mined transaction.
		out, err := p.call(ctx, &p.payer, check, walletCheckGas)
		if err != nil && !failsOnChain(err) {
			return nil, err
		}
		ret = out
	case p.wallet == nil:
		if p.eoaRefusal != nil {
			return p.eoaRefusal, nil
		}
		return refuse(reason, "the signature is not %s's: the payer has no code (it is no contract wallet) and the signature carries no ERC-6492 deployment", p.payer.Hex()), nil
	case !slices.Contains(n.factories, p.wallet.factory):
		return refuse(x402.ReasonEIP6492FactoryNotAllowed, "the payer %s is not deployed and its ERC-6492 signature names factory %s, which this facilitator does not deploy wallets through", p.payer.Hex(), p.wallet.factory.Hex()), nil
	default:
		res, err := p.afterDeploy(ctx, contracts.Call{To: p.payer, Data: check})
		if err != nil || res == nil {
			return deployRefusal(p, err)
		}
		p.undeployed = true
		ret = res[0].Return
	}
	if len(ret) < 4 || !bytes.Equal(ret[:4], contracts.ERC1271MagicValue[:]) {
		return refuse(reason, "the contract wallet %s does not accept the signature (isValidSignature answered 0x%x)", p.payer.Hex(), ret), nil
	}
	return nil, nil
}

// errDeployFailed is the revert of DeployThenCall when the factory does not deploy the wallet.
var errDeployFailed = fmt.Errorf("the factory did not deploy the wallet")

// afterDeploy makes calls in an eth_call where p's counterfactual wallet has been deployed by its factory, as
// the settlement's transactions run (see execution: their sender, fees and block; the gas of the deployment
// and a settlement call). A nil result with a nil error means the deployment failed (errDeployFailed is
// returned then).
func (p *payment) afterDeploy(ctx context.Context, calls ...contracts.Call) ([]contracts.CallResult, error) {
	data, err := contracts.PackDeployThenCall(p.payer, p.wallet.factory, p.wallet.data, calls)
	if err != nil {
		return nil, err
	}
	out, err := p.call(ctx, nil, data, walletDeployGas+uint64(len(calls))*settleWithPermitGas)
	if err != nil {
		if failsOnChain(err) {
			return nil, fmt.Errorf("%w: %s", errDeployFailed, revertReason(err))
		}
		return nil, err
	}
	res, err := contracts.UnpackDeployThenCall(out)
	if err != nil {
		return nil, err
	}
	if len(res) != len(calls) {
		return nil, fmt.Errorf("DeployThenCall answered %d results for %d calls", len(res), len(calls))
	}
	return res, nil
}

// deployRefusal turns a failed afterDeploy into a refusal (the factory would not deploy the wallet) or the
// error of a chain that could not be asked.
func deployRefusal(p *payment, err error) (*refusal, error) {
	if err == nil || !errors.Is(err, errDeployFailed) {
		return nil, err
	}
	return refuse(x402.ReasonSmartWalletDeploymentFailed, "deploying the payer's wallet %s through factory %s fails: %v", p.payer.Hex(), p.wallet.factory.Hex(), err), nil
}

// verifySigner checks that the payment's signature is its payer's. An EOA's signature recovers to the payer
// here, with no chain call. One that recovers to another address, or is not 65 bytes, may be a contract
// wallet's (permit2 and eip3009 only: their contracts ask the wallet): it is kept for the chain to judge
// (checkWallet), and refused then with describe's words if the payer turns out to be no wallet.
func (p *payment) verifySigner(sig string, parsed error, reason string, contracts bool, describe func(common.Address, error) *refusal) *refusal {
	if parsed == nil {
		got, err := RecoverSigner(p.digest, p.sig)
		if err == nil && got == p.payer {
			p.sigBytes = p.sig[:]
			return nil
		}
		if err != nil || !contracts {
			return describe(got, err)
		}
		return p.contractSignature(sig, reason, describe(got, err))
	}
	if !contracts || !errors.Is(parsed, errSignatureLength) {
		return refuse(x402.ReasonInvalidPayload, "payload.signature: %v", parsed)
	}
	return p.contractSignature(sig, reason, nil)
}

// checkWallet runs the chain's half of a contract wallet's signature check (see verifySigner); nothing for an
// EOA's.
func (p *payment) checkWallet(ctx context.Context) (*refusal, error) {
	if !p.contractSig {
		return nil, nil
	}
	return p.checkContractSignature(ctx, p.sigReason)
}

// CheckMessageSignature reports whether signer's contract wallet on network accepts sig as its signature of
// digest: by ERC-1271 isValidSignature where it is deployed, or, undeployed, where its ERC-6492 signature names
// a factory this facilitator deploys wallets through, by the same call after deploying it within an eth_call. It
// is the check a payment's contract-wallet signature gets, for a gate's sign-in (gate.MessageSignatureChecker).
// Nothing is sent. The error is for a chain that could not be asked.
func (f *Facilitator) CheckMessageSignature(ctx context.Context, network string, signer common.Address, digest [32]byte, sig []byte) (bool, error) {
	n := f.networks[network]
	if n == nil {
		return false, nil
	}
	p := &payment{net: n, payer: signer, digest: digest}
	if r := p.contractSignature(hexutil.Encode(sig), x402.ReasonInvalidPayload, nil); r != nil {
		return false, nil
	}
	r, err := p.checkContractSignature(ctx, x402.ReasonInvalidPayload)
	if err != nil {
		return false, fmt.Errorf("asking the contract wallet %s on %s: %w", signer.Hex(), network, err)
	}
	return r == nil, nil
}
