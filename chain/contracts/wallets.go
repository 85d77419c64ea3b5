package contracts

import (
	_ "embed"
	"fmt"
	"math/big"

	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
)

// Token metadata of USDCoin, the USDC-like token with EIP-3009, as x402 requirements carry it in extra.name /
// extra.version.
const (
	// USDCoinName is the token name and its EIP-712 domain name, as USDC's.
	USDCoinName = "USD Coin"
	// USDCoinVersion is the EIP-712 domain version of the token's permits and authorizations, as USDC's.
	USDCoinVersion = "2"
	// USDCoinSymbol is the token symbol.
	USDCoinSymbol = "USDC"
	// USDCoinDecimals is the number of decimals of the token.
	USDCoinDecimals = 6
)

// ERC1271MagicValue is what isValidSignature returns for a valid signature (its own selector).
var ERC1271MagicValue = [4]byte{0x16, 0x26, 0xba, 0x7e}

// erc6492MagicSuffix ends every ERC-6492 signature: abi.encode(factory, factoryCalldata, signature) ++ suffix.
var erc6492MagicSuffix = common.FromHex("0x6492649264926492649264926492649264926492649264926492649264926492")

var (
	//go:embed build/USDCoin.abi.json
	usdCoinABIJSON string
	//go:embed build/USDCoin.bin
	usdCoinBin string

	//go:embed build/SmartWallet.abi.json
	smartWalletABIJSON string
	//go:embed build/SmartWalletFactory.abi.json
	smartWalletFactoryABIJSON string
	//go:embed build/SmartWalletFactory.bin
	smartWalletFactoryBin string

	//go:embed build/DeployThenCall.abi.json
	deployThenCallABIJSON string
	//go:embed build/DeployThenCall.bin
	deployThenCallBin string

	//go:embed build/SimulationOnlyWallet.abi.json
	simulationOnlyWalletABIJSON string
	//go:embed build/SimulationOnlyWallet.bin
	simulationOnlyWalletBin string
)

var (
	// USDCoinABI is the ABI of USDCoin (ERC-20, EIP-2612 and EIP-3009 in both signature forms, mint, version).
	USDCoinABI = mustABI("USDCoin", usdCoinABIJSON)
	// SmartWalletABI is the ABI of the test ERC-1271 wallet (owner, isValidSignature, execute).
	SmartWalletABI = mustABI("SmartWallet", smartWalletABIJSON)
	// SmartWalletFactoryABI is the ABI of its CREATE2 factory (createAccount, accountAddress).
	SmartWalletFactoryABI = mustABI("SmartWalletFactory", smartWalletFactoryABIJSON)
	// deployThenCallABI is the ABI of DeployThenCall: its constructor and WalletDeploymentFailed error.
	deployThenCallABI = mustABI("DeployThenCall", deployThenCallABIJSON)
	// simulationOnlyWalletABI is the ABI of the hostile test wallet SimulationOnlyWallet (its constructor).
	simulationOnlyWalletABI = mustABI("SimulationOnlyWallet", simulationOnlyWalletABIJSON)

	usdCoinCreation            = mustHex("USDCoin.bin", usdCoinBin)
	smartWalletFactoryCreation = mustHex("SmartWalletFactory.bin", smartWalletFactoryBin)
	deployThenCallCreation     = mustHex("DeployThenCall.bin", deployThenCallBin)
	simulationOnlyCreation     = mustHex("SimulationOnlyWallet.bin", simulationOnlyWalletBin)

	deployThenCallResult = abi.Arguments{{Type: mustType("bool[]")}, {Type: mustType("bytes[]")}}
)

func mustType(t string) abi.Type {
	typ, err := abi.NewType(t, "", nil)
	if err != nil {
		panic(fmt.Sprintf("contracts: abi type %s: %v", t, err))
	}
	return typ
}

// USDCoinCreationCode returns a copy of USDCoin's creation code (its constructor takes no arguments).
func USDCoinCreationCode() []byte { return append([]byte(nil), usdCoinCreation...) }

// Call is one call DeployThenCall makes.
type Call struct {
	To   common.Address
	Data []byte
}

// PackDeployThenCall returns the data of an eth_call with no `to` that deploys wallet through factory (unless
// factory is zero or the wallet has code) and then makes calls, each from DeployThenCall's own address.
func PackDeployThenCall(wallet, factory common.Address, factoryData []byte, calls []Call) ([]byte, error) {
	targets := make([]common.Address, len(calls))
	data := make([][]byte, len(calls))
	for i, c := range calls {
		targets[i], data[i] = c.To, c.Data
	}
	args, err := deployThenCallABI.Pack("", wallet, factory, factoryData, targets, data)
	if err != nil {
		return nil, fmt.Errorf("packing DeployThenCall: %w", err)
	}
	return append(append([]byte(nil), deployThenCallCreation...), args...), nil
}

// CallResult is the outcome of one call DeployThenCall made.
type CallResult struct {
	OK     bool
	Return []byte // the return data, or the revert data when !OK
}

// UnpackDeployThenCall reads what DeployThenCall returned: one result per call, in order.
func UnpackDeployThenCall(out []byte) ([]CallResult, error) {
	vals, err := deployThenCallResult.Unpack(out)
	if err != nil {
		return nil, fmt.Errorf("unpacking DeployThenCall's answer: %w", err)
	}
	oks, rets := vals[0].([]bool), vals[1].([][]byte)
	if len(oks) != len(rets) {
		return nil, fmt.Errorf("unpacking DeployThenCall's answer: %d results but %d return values", len(oks), len(rets))
	}
	res := make([]CallResult, len(oks))
	for i := range oks {
		res[i] = CallResult{OK: oks[i], Return: rets[i]}
	}
	return res, nil
}

// WrapERC6492 wraps a counterfactual wallet's signature as ERC-6492 does: abi.encode(factory, factoryData,
// signature) followed by the magic suffix.
func WrapERC6492(factory common.Address, factoryData, signature []byte) ([]byte, error) {
	args := abi.Arguments{{Type: mustType("address")}, {Type: mustType("bytes")}, {Type: mustType("bytes")}}
	enc, err := args.Pack(factory, factoryData, signature)
	if err != nil {
		return nil, fmt.Errorf("packing an ERC-6492 signature: %w", err)
	}
	return append(enc, erc6492MagicSuffix...), nil
}

// UnwrapERC6492 reads an ERC-6492 signature: the factory, its calldata and the inner signature. ok is false
// when sig does not end with the magic suffix (it is then a plain signature); err when it does but the rest
// is not abi.encode(address, bytes, bytes).
func UnwrapERC6492(sig []byte) (factory common.Address, factoryData, inner []byte, ok bool, err error) {
	n := len(erc6492MagicSuffix)
	if len(sig) < n || string(sig[len(sig)-n:]) != string(erc6492MagicSuffix) {
		return common.Address{}, nil, nil, false, nil
	}
	args := abi.Arguments{{Type: mustType("address")}, {Type: mustType("bytes")}, {Type: mustType("bytes")}}
	vals, err := args.Unpack(sig[:len(sig)-n])
	if err != nil {
		return common.Address{}, nil, nil, true, fmt.Errorf("an ERC-6492 signature must be abi.encode(address factory, bytes factoryCalldata, bytes signature) before its magic suffix: %w", err)
	}
	return vals[0].(common.Address), vals[1].([]byte), vals[2].([]byte), true, nil
}

// SmartWalletAccount is what SmartWalletFactory.createAccount takes: the wallet's owner key, the token it
// approves spender for at creation (zero for none), and a salt.
type SmartWalletAccount struct {
	Owner   common.Address
	Token   common.Address
	Spender common.Address
	Salt    *big.Int
}

// PackCreateAccount returns the calldata of factory.createAccount(owner, token, spender, salt): the factory
// calldata of an ERC-6492 signature.
func PackCreateAccount(a SmartWalletAccount) ([]byte, error) {
	data, err := SmartWalletFactoryABI.Pack("createAccount", a.Owner, a.Token, a.Spender, a.Salt)
	if err != nil {
		return nil, fmt.Errorf("packing createAccount: %w", err)
	}
	return data, nil
}

// transferWithAuthorizationVRS and transferWithAuthorizationBytes are USDC's two overloads (go-ethereum names
// overloads by their order in the ABI, so they are found by signature).
var (
	transferWithAuthorizationVRS   = methodBySig(USDCoinABI, "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)")
	transferWithAuthorizationBytes = methodBySig(USDCoinABI, "transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)")
)

func methodBySig(parsed abi.ABI, sig string) abi.Method {
	for _, m := range parsed.Methods {
		if m.Sig == sig {
			return m
		}
	}
	panic("contracts: no method " + sig)
}

// EIP3009Transfer is the EIP-3009 TransferWithAuthorization a payer signed.
type EIP3009Transfer struct {
	From, To                       common.Address
	Value, ValidAfter, ValidBefore *big.Int
	Nonce                          [32]byte
}

// PackTransferWithAuthorization returns the calldata of token.transferWithAuthorization(from, to, value,
// validAfter, validBefore, nonce, v, r, s): the form every EIP-3009 token has.
func PackTransferWithAuthorization(t EIP3009Transfer, v uint8, r, s [32]byte) ([]byte, error) {
	args, err := transferWithAuthorizationVRS.Inputs.Pack(t.From, t.To, t.Value, t.ValidAfter, t.ValidBefore, t.Nonce, v, r, s)
	if err != nil {
		return nil, fmt.Errorf("packing transferWithAuthorization: %w", err)
	}
	return append(append([]byte(nil), transferWithAuthorizationVRS.ID...), args...), nil
}

// PackTransferWithAuthorizationBytes returns the calldata of the overload that takes the signature as bytes
// (USDC v2.2 and later), which contract wallets' ERC-1271 signatures need.
func PackTransferWithAuthorizationBytes(t EIP3009Transfer, signature []byte) ([]byte, error) {
	args, err := transferWithAuthorizationBytes.Inputs.Pack(t.From, t.To, t.Value, t.ValidAfter, t.ValidBefore, t.Nonce, signature)
	if err != nil {
		return nil, fmt.Errorf("packing transferWithAuthorization: %w", err)
	}
	return append(append([]byte(nil), transferWithAuthorizationBytes.ID...), args...), nil
}

// SmartWalletFactoryCreationCode returns a copy of SmartWalletFactory's creation code.
func SmartWalletFactoryCreationCode() []byte {
	return append([]byte(nil), smartWalletFactoryCreation...)
}

// The tricks of SimulationOnlyWallet, the hostile ERC-1271 test wallet that accepts its owner's signature only
// where no mined transaction runs.
const (
	// TrickZeroGasPrice accepts only under a zero gas price: an eth_call without fee fields.
	TrickZeroGasPrice uint8 = 1
	// TrickPlentyOfGas accepts only with more than 1,000,000 gas left: an eth_call without a gas limit.
	TrickPlentyOfGas uint8 = 2
)

// SimulationOnlyWalletCreationCode returns the creation code of a SimulationOnlyWallet of owner playing trick,
// which approves spender for token at creation (token zero: no approval).
func SimulationOnlyWalletCreationCode(owner common.Address, trick uint8, token, spender common.Address) ([]byte, error) {
	args, err := simulationOnlyWalletABI.Pack("", owner, trick, token, spender)
	if err != nil {
		return nil, fmt.Errorf("packing the SimulationOnlyWallet constructor: %w", err)
	}
	return append(append([]byte(nil), simulationOnlyCreation...), args...), nil
}
