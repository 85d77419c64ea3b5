package contracts

import (
	"bytes"
	_ "embed"
	"encoding/hex"
	"fmt"
	"math/big"

	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/params"
)

// Canonical addresses. Permit2 and the proxy are the same on every chain x402 clients know;
// a dev chain places them there in genesis.
var (
	// Permit2Address is the canonical Uniswap Permit2 address.
	Permit2Address = common.HexToAddress("0x000000000022D473030F116dDEE9F6B43aC78BA3")
	// ProxyAddress is the canonical x402ExactPermit2Proxy address public clients sign for.
	ProxyAddress = common.HexToAddress("0x402085c248EeA27D92E8b30b2C58ed07f9E20001")
	// UptoProxyAddress is the canonical x402UptoPermit2Proxy address public clients sign upto payments for.
	UptoProxyAddress = common.HexToAddress("0x4020A4f3b7b90ccA423B9fabCc0CE57C6C240002")
)

// Token metadata of StableCoin, as x402 requirements carry it in extra.name / extra.version.
const (
	// StableCoinName is the token name and its EIP-712 domain name.
	StableCoinName = "Stable Coin"
	// StableCoinVersion is the EIP-712 domain version of the token's permit.
	StableCoinVersion = "1"
	// StableCoinSymbol is the token symbol.
	StableCoinSymbol = "USDS"
	// StableCoinDecimals is the number of decimals of the token.
	StableCoinDecimals = 6
)

// witnessTypeString is the witness tail the proxy hands to Permit2.permitWitnessTransferFrom.
const witnessTypeString = "Witness witness)TokenPermissions(address token,uint256 amount)Witness(address to,uint256 validAfter)"

var (
	//go:embed build/StableCoin.abi.json
	stableCoinABIJSON string
	//go:embed build/StableCoin.bin
	stableCoinBin string
	//go:embed build/StableCoin.bin-runtime
	stableCoinBinRuntime string

	//go:embed build/Permit2.abi.json
	permit2ABIJSON string
	//go:embed build/Permit2.bin
	permit2Bin string
	//go:embed build/Permit2.bin-runtime
	permit2BinRuntime string

	//go:embed build/X402ExactPermit2Proxy.abi.json
	proxyABIJSON string
	//go:embed build/X402ExactPermit2Proxy.bin
	proxyBin string
	//go:embed build/X402ExactPermit2Proxy.bin-runtime
	proxyBinRuntime string

	//go:embed build/X402UptoPermit2Proxy.abi.json
	uptoProxyABIJSON string
	//go:embed build/X402UptoPermit2Proxy.bin
	uptoProxyBin string
	//go:embed build/X402UptoPermit2Proxy.bin-runtime
	uptoProxyBinRuntime string
)

// Parsed ABIs and decoded bytecode. They are derived once from the embedded artifacts and
// never change; a parse failure means the build/ folder is corrupt, hence the panic.
var (
	// StableCoinABI is the ABI of StableCoin (ERC-20, EIP-2612, mint, Ownable).
	StableCoinABI = mustABI("StableCoin", stableCoinABIJSON)
	// Permit2ABI is the ABI of Permit2 (SignatureTransfer, nonceBitmap, DOMAIN_SEPARATOR).
	Permit2ABI = mustABI("Permit2", permit2ABIJSON)
	// ProxyABI is the ABI of X402ExactPermit2Proxy (settle, settleWithPermit, PERMIT2).
	ProxyABI = mustABI("X402ExactPermit2Proxy", proxyABIJSON)
	// UptoProxyABI is the ABI of X402UptoPermit2Proxy (settle and settleWithPermit of an amount up to the
	// permitted one, PERMIT2).
	UptoProxyABI = mustABI("X402UptoPermit2Proxy", uptoProxyABIJSON)

	stableCoinCreation = mustHex("StableCoin.bin", stableCoinBin)
	stableCoinRuntime  = mustHex("StableCoin.bin-runtime", stableCoinBinRuntime)
	permit2Creation    = mustHex("Permit2.bin", permit2Bin)
	permit2Runtime     = mustHex("Permit2.bin-runtime", permit2BinRuntime)
	proxyCreation      = mustHex("X402ExactPermit2Proxy.bin", proxyBin)
	proxyRuntime       = mustHex("X402ExactPermit2Proxy.bin-runtime", proxyBinRuntime)
	uptoProxyCreation  = mustHex("X402UptoPermit2Proxy.bin", uptoProxyBin)
	uptoProxyRuntime   = mustHex("X402UptoPermit2Proxy.bin-runtime", uptoProxyBinRuntime)
)

func mustABI(name, s string) abi.ABI {
	parsed, err := abi.JSON(bytes.NewReader([]byte(s)))
	if err != nil {
		panic(fmt.Sprintf("contracts: embedded ABI of %s is corrupt, run go generate: %v", name, err))
	}
	return parsed
}

func mustHex(name, s string) []byte {
	b, err := hex.DecodeString(string(bytes.TrimSpace([]byte(s))))
	if err != nil || len(b) == 0 {
		panic(fmt.Sprintf("contracts: embedded bytecode %s is corrupt, run go generate: %v", name, err))
	}
	return b
}

// StableCoinCreationCode returns a copy of StableCoin's creation code (its constructor takes no arguments).
func StableCoinCreationCode() []byte { return bytes.Clone(stableCoinCreation) }

// permit2CreationCode returns a copy of Permit2's creation code.
func permit2CreationCode() []byte { return bytes.Clone(permit2Creation) }

// Permit2RuntimeCode returns a copy of Permit2's runtime code, the code placed at Permit2Address.
func Permit2RuntimeCode() []byte { return bytes.Clone(permit2Runtime) }

// proxyCreationCode returns a copy of X402ExactPermit2Proxy's creation code.
func proxyCreationCode() []byte { return bytes.Clone(proxyCreation) }

// ProxyRuntimeCode returns a copy of X402ExactPermit2Proxy's runtime code, the code placed at ProxyAddress.
func ProxyRuntimeCode() []byte { return bytes.Clone(proxyRuntime) }

// uptoProxyCreationCode returns a copy of X402UptoPermit2Proxy's creation code.
func uptoProxyCreationCode() []byte { return bytes.Clone(uptoProxyCreation) }

// UptoProxyRuntimeCode returns a copy of X402UptoPermit2Proxy's runtime code, the code placed at UptoProxyAddress.
func UptoProxyRuntimeCode() []byte { return bytes.Clone(uptoProxyRuntime) }

// ChainConfig is the fork set of every chain whose genesis holds GenesisAlloc (the dev chain and the simulated
// chains of the tests): go-ethereum's dev fork set for chainID without the forks v1.17.10 enables before any
// network has (Bogota, Amsterdam), under which gas costs about three times what live networks charge.
func ChainConfig(chainID uint64) *params.ChainConfig {
	cfg := *params.AllDevChainProtocolChanges
	cfg.ChainID = new(big.Int).SetUint64(chainID)
	cfg.BogotaTime = nil
	cfg.AmsterdamTime = nil
	return &cfg
}

// GenesisAlloc returns genesis accounts holding Permit2, the two proxies (exact and upto), the three
// batch-settlement contracts (the escrow and its two deposit collectors) and Multicall3 at their canonical
// addresses. Nonce 1 marks them as deployed contracts (EIP-161), as a CREATE would.
func GenesisAlloc() types.GenesisAlloc {
	return types.GenesisAlloc{
		Permit2Address:                 {Code: Permit2RuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		ProxyAddress:                   {Code: ProxyRuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		UptoProxyAddress:               {Code: UptoProxyRuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		BatchSettlementAddress:         {Code: BatchSettlementRuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		ERC3009DepositCollectorAddress: {Code: ERC3009DepositCollectorRuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		Permit2DepositCollectorAddress: {Code: Permit2DepositCollectorRuntimeCode(), Nonce: 1, Balance: new(big.Int)},
		Multicall3Address:              {Code: Multicall3RuntimeCode(), Nonce: 1, Balance: new(big.Int)},
	}
}

// BatchSettlementAddresses are the genesis accounts of the batch-settlement contracts: a dev chain made before
// they were part of the genesis lacks them.
func BatchSettlementAddresses() []common.Address {
	return []common.Address{BatchSettlementAddress, ERC3009DepositCollectorAddress, Permit2DepositCollectorAddress}
}

// TokenPermissions is Permit2's TokenPermissions(address token,uint256 amount).
type TokenPermissions struct {
	Token  common.Address
	Amount *big.Int
}

// PermitTransferFrom is Permit2's PermitTransferFrom{permitted, nonce, deadline}.
type PermitTransferFrom struct {
	Permitted TokenPermissions
	Nonce     *big.Int
	Deadline  *big.Int
}

// Witness is the proxy's Witness(address to,uint256 validAfter).
type Witness struct {
	To         common.Address
	ValidAfter *big.Int
}

// UptoWitness is the upto proxy's Witness(address to,address facilitator,uint256 validAfter): Facilitator is
// the only address the proxy lets settle the payment.
type UptoWitness struct {
	To          common.Address
	Facilitator common.Address
	ValidAfter  *big.Int
}

// EIP2612Permit is the proxy's EIP2612Permit{value, deadline, r, s, v}: a permit approving Permit2.
type EIP2612Permit struct {
	Value    *big.Int
	Deadline *big.Int
	R        [32]byte
	S        [32]byte
	V        uint8
}

// PackSettle returns the calldata of proxy.settle(permit, owner, witness, signature).
func PackSettle(permit PermitTransferFrom, owner common.Address, witness Witness, signature []byte) ([]byte, error) {
	data, err := ProxyABI.Pack("settle", permit, owner, witness, signature)
	if err != nil {
		return nil, fmt.Errorf("packing settle: %w", err)
	}
	return data, nil
}

// PackSettleWithPermit returns the calldata of proxy.settleWithPermit(permit2612, permit, owner, witness, signature).
func PackSettleWithPermit(permit2612 EIP2612Permit, permit PermitTransferFrom, owner common.Address, witness Witness, signature []byte) ([]byte, error) {
	data, err := ProxyABI.Pack("settleWithPermit", permit2612, permit, owner, witness, signature)
	if err != nil {
		return nil, fmt.Errorf("packing settleWithPermit: %w", err)
	}
	return data, nil
}

// PackUptoSettle returns the calldata of uptoProxy.settle(permit, amount, owner, witness, signature): a
// transfer of amount, at most permit.Permitted.Amount, which only witness.Facilitator may send.
func PackUptoSettle(permit PermitTransferFrom, amount *big.Int, owner common.Address, witness UptoWitness, signature []byte) ([]byte, error) {
	data, err := UptoProxyABI.Pack("settle", permit, amount, owner, witness, signature)
	if err != nil {
		return nil, fmt.Errorf("packing upto settle: %w", err)
	}
	return data, nil
}

// PackUptoSettleWithPermit returns the calldata of uptoProxy.settleWithPermit(permit2612, permit, amount, owner,
// witness, signature); permit2612.Value must be permit.Permitted.Amount.
func PackUptoSettleWithPermit(permit2612 EIP2612Permit, permit PermitTransferFrom, amount *big.Int, owner common.Address, witness UptoWitness, signature []byte) ([]byte, error) {
	data, err := UptoProxyABI.Pack("settleWithPermit", permit2612, permit, amount, owner, witness, signature)
	if err != nil {
		return nil, fmt.Errorf("packing upto settleWithPermit: %w", err)
	}
	return data, nil
}

// DecodeRevert names the custom error or Error(string) in revert data returned by one of
// these contracts (including the OpenZeppelin ERC-20 errors of StableCoin), e.g.
// "PaymentTooEarly()" or "ERC20InsufficientAllowance(0x…, 0, 1000)". ok is false when the
// data matches none of them, or is an Error(string) with an empty string, which names nothing:
// the caller's own error then says more.
func DecodeRevert(data []byte) (reason string, ok bool) {
	if len(data) < 4 {
		return "", false
	}
	if msg, err := abi.UnpackRevert(data); err == nil {
		return msg, msg != ""
	}
	var selector [4]byte
	copy(selector[:], data[:4])
	for _, parsed := range []*abi.ABI{&ProxyABI, &UptoProxyABI, &BatchSettlementABI, &ERC3009DepositCollectorABI, &Permit2DepositCollectorABI, &Multicall3ABI, &Permit2ABI, &StableCoinABI, &USDCoinABI, &deployThenCallABI} {
		e, err := parsed.ErrorByID(selector)
		if err != nil {
			continue
		}
		args, err := e.Unpack(data)
		if err != nil {
			return e.Name + "(?)", true
		}
		values, _ := args.([]any)
		var b bytes.Buffer
		b.WriteString(e.Name)
		b.WriteByte('(')
		for i, v := range values {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprint(&b, v)
		}
		b.WriteByte(')')
		return b.String(), true
	}
	return "", false
}
