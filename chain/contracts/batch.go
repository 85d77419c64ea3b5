package contracts

import (
	"bytes"
	_ "embed"
	"fmt"
	"math/big"

	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
)

// Canonical addresses of the batch-settlement contracts, as the public @x402/evm SDK has them; a dev chain
// places our own ABI-compatible implementations there in genesis.
var (
	// BatchSettlementAddress is the canonical x402BatchSettlement: the escrow of batch-settlement channels and
	// the verifyingContract of their EIP-712 domain.
	BatchSettlementAddress = common.HexToAddress("0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003")
	// ERC3009DepositCollectorAddress is the canonical ERC3009DepositCollector: the payee (`to`) of the payer's
	// ReceiveWithAuthorization in an eip3009 deposit.
	ERC3009DepositCollectorAddress = common.HexToAddress("0x4020806089470a89826cB9fB1f4059150b550004")
	// Permit2DepositCollectorAddress is the canonical Permit2DepositCollector: the spender of the payer's Permit2
	// PermitWitnessTransferFrom in a permit2 deposit.
	Permit2DepositCollectorAddress = common.HexToAddress("0x4020425FAf3B746C082C2f942b4E5159887B0005")
)

// The EIP-712 facts of batch-settlement, the same for the contract, the server, the facilitator and the payer:
// the domain is {name, version, chainId, verifyingContract BatchSettlementAddress}, and each type string is
// what its typehash is the keccak of (referenced types appended in alphabetical order, as EIP-712 encodes them).
const (
	// BatchSettlementDomainName is the EIP-712 domain name of channel ids, vouchers, refunds and claim batches.
	BatchSettlementDomainName = "x402 Batch Settlement"
	// BatchSettlementDomainVersion is the EIP-712 domain version of the same.
	BatchSettlementDomainVersion = "1"
	// ChannelConfigType is the type whose typed-data hash under the domain is the channel id.
	ChannelConfigType = "ChannelConfig(address payer,address payerAuthorizer,address receiver,address receiverAuthorizer,address token,uint40 withdrawDelay,bytes32 salt)"
	// VoucherType is what the payer (or its payerAuthorizer) signs for each request: a cumulative ceiling.
	VoucherType = "Voucher(bytes32 channelId,uint128 maxClaimableAmount)"
	// RefundType is what the receiverAuthorizer signs for refundWithSignature.
	RefundType = "Refund(bytes32 channelId,uint256 nonce,uint128 amount)"
	// ClaimEntryType is one row of a claim batch.
	ClaimEntryType = "ClaimEntry(bytes32 channelId,uint128 maxClaimableAmount,uint128 totalClaimed)"
	// ClaimBatchType is what the receiverAuthorizer signs for claimWithSignature.
	ClaimBatchType = "ClaimBatch(ClaimEntry[] claims)" + ClaimEntryType
	// DepositWitnessType is the witness of a permit2 deposit, binding it to one channel.
	DepositWitnessType = "DepositWitness(bytes32 channelId)"
	// DepositWitnessTypeString is the witness tail the Permit2 deposit collector hands to
	// Permit2.permitWitnessTransferFrom.
	DepositWitnessTypeString = "DepositWitness witness)" + DepositWitnessType + "TokenPermissions(address token,uint256 amount)"
)

// Withdraw delay bounds the contract enforces on a channel's withdrawDelay, in seconds.
const (
	// MinWithdrawDelay is the shortest withdrawDelay (15 minutes).
	MinWithdrawDelay = 900
	// MaxWithdrawDelay is the longest withdrawDelay (30 days).
	MaxWithdrawDelay = 2_592_000
)

var (
	//go:embed build/X402BatchSettlement.abi.json
	batchSettlementABIJSON string
	//go:embed build/X402BatchSettlement.bin
	batchSettlementBin string
	//go:embed build/X402BatchSettlement.bin-runtime
	batchSettlementBinRuntime string

	//go:embed build/ERC3009DepositCollector.abi.json
	erc3009CollectorABIJSON string
	//go:embed build/ERC3009DepositCollector.bin
	erc3009CollectorBin string
	//go:embed build/ERC3009DepositCollector.bin-runtime
	erc3009CollectorBinRuntime string

	//go:embed build/Permit2DepositCollector.abi.json
	permit2CollectorABIJSON string
	//go:embed build/Permit2DepositCollector.bin
	permit2CollectorBin string
	//go:embed build/Permit2DepositCollector.bin-runtime
	permit2CollectorBinRuntime string
)

var (
	// BatchSettlementABI is the ABI of X402BatchSettlement (deposit, claim, claimWithSignature, settle, refund,
	// refundWithSignature, initiateWithdraw, finalizeWithdraw, multicall, the channel views and digests).
	BatchSettlementABI = mustABI("X402BatchSettlement", batchSettlementABIJSON)
	// ERC3009DepositCollectorABI is the ABI of ERC3009DepositCollector (collect, called by the escrow only).
	ERC3009DepositCollectorABI = mustABI("ERC3009DepositCollector", erc3009CollectorABIJSON)
	// Permit2DepositCollectorABI is the ABI of Permit2DepositCollector (collect, called by the escrow only).
	Permit2DepositCollectorABI = mustABI("Permit2DepositCollector", permit2CollectorABIJSON)

	batchSettlementCreation  = mustHex("X402BatchSettlement.bin", batchSettlementBin)
	batchSettlementRuntime   = mustHex("X402BatchSettlement.bin-runtime", batchSettlementBinRuntime)
	erc3009CollectorCreation = mustHex("ERC3009DepositCollector.bin", erc3009CollectorBin)
	erc3009CollectorRuntime  = mustHex("ERC3009DepositCollector.bin-runtime", erc3009CollectorBinRuntime)
	permit2CollectorCreation = mustHex("Permit2DepositCollector.bin", permit2CollectorBin)
	permit2CollectorRuntime  = mustHex("Permit2DepositCollector.bin-runtime", permit2CollectorBinRuntime)
)

// BatchSettlementRuntimeCode returns a copy of X402BatchSettlement's runtime code, placed at BatchSettlementAddress.
func BatchSettlementRuntimeCode() []byte { return bytes.Clone(batchSettlementRuntime) }

// ERC3009DepositCollectorRuntimeCode returns a copy of ERC3009DepositCollector's runtime code, placed at
// ERC3009DepositCollectorAddress.
func ERC3009DepositCollectorRuntimeCode() []byte { return bytes.Clone(erc3009CollectorRuntime) }

// Permit2DepositCollectorRuntimeCode returns a copy of Permit2DepositCollector's runtime code, placed at
// Permit2DepositCollectorAddress.
func Permit2DepositCollectorRuntimeCode() []byte { return bytes.Clone(permit2CollectorRuntime) }

// ChannelConfig is the contract's ChannelConfig: the immutable parameters of a channel, whose EIP-712 hash is
// its id. It is the one parsed form of a channel, for the engine's off-chain checks (chain.ParseChannelConfig
// reads it from the wire's x402.ChannelConfig, chain.ChannelID hashes it) and for the calldata below: plain
// values, so that it compares with == and can key a map.
type ChannelConfig struct {
	Payer              common.Address
	PayerAuthorizer    common.Address
	Receiver           common.Address
	ReceiverAuthorizer common.Address
	Token              common.Address
	WithdrawDelay      uint64 // uint40, in seconds
	Salt               common.Hash
}

// Voucher is the contract's Voucher: a channel and the cumulative ceiling its payer signed.
type Voucher struct {
	Channel            ChannelConfig
	MaxClaimableAmount *big.Int // uint128
}

// VoucherClaim is one row of claim and claimWithSignature: a signed voucher and the cumulative amount claimed
// under it (at most MaxClaimableAmount).
type VoucherClaim struct {
	Voucher      Voucher
	Signature    []byte
	TotalClaimed *big.Int // uint128
}

// channelConfigArg, voucherArg and voucherClaimArg are ChannelConfig, Voucher and VoucherClaim as go-ethereum's
// ABI packer takes them: it maps a uint40 to *big.Int only.
type channelConfigArg struct {
	Payer              common.Address
	PayerAuthorizer    common.Address
	Receiver           common.Address
	ReceiverAuthorizer common.Address
	Token              common.Address
	WithdrawDelay      *big.Int
	Salt               [32]byte
}

type voucherArg struct {
	Channel            channelConfigArg
	MaxClaimableAmount *big.Int
}

type voucherClaimArg struct {
	Voucher      voucherArg
	Signature    []byte
	TotalClaimed *big.Int
}

func (c ChannelConfig) arg() channelConfigArg {
	return channelConfigArg{
		Payer: c.Payer, PayerAuthorizer: c.PayerAuthorizer, Receiver: c.Receiver, ReceiverAuthorizer: c.ReceiverAuthorizer,
		Token: c.Token, WithdrawDelay: new(big.Int).SetUint64(c.WithdrawDelay), Salt: c.Salt,
	}
}

func claimArgs(claims []VoucherClaim) []voucherClaimArg {
	args := make([]voucherClaimArg, len(claims))
	for i, cl := range claims {
		args[i] = voucherClaimArg{
			Voucher:      voucherArg{Channel: cl.Voucher.Channel.arg(), MaxClaimableAmount: cl.Voucher.MaxClaimableAmount},
			Signature:    cl.Signature,
			TotalClaimed: cl.TotalClaimed,
		}
	}
	return args
}

// PackBatchDeposit returns the calldata of batchSettlement.deposit(config, amount, collector, collectorData).
func PackBatchDeposit(config ChannelConfig, amount *big.Int, collector common.Address, collectorData []byte) ([]byte, error) {
	return PackBatchSettlement("deposit", config, amount, collector, collectorData)
}

// PackClaim returns the calldata of batchSettlement.claim(voucherClaims), sent by the receiver or its
// receiverAuthorizer.
func PackClaim(claims []VoucherClaim) ([]byte, error) {
	return PackBatchSettlement("claim", claims)
}

// PackClaimWithSignature returns the calldata of batchSettlement.claimWithSignature(voucherClaims,
// authorizerSignature), which anyone may relay.
func PackClaimWithSignature(claims []VoucherClaim, authorizerSignature []byte) ([]byte, error) {
	return PackBatchSettlement("claimWithSignature", claims, authorizerSignature)
}

// PackBatchSettle returns the calldata of batchSettlement.settle(receiver, token): pays the receiver what was
// claimed for it and not yet paid.
func PackBatchSettle(receiver, token common.Address) ([]byte, error) {
	return PackBatchSettlement("settle", receiver, token)
}

// PackRefund returns the calldata of batchSettlement.refund(config, amount), sent by the receiver or its
// receiverAuthorizer.
func PackRefund(config ChannelConfig, amount *big.Int) ([]byte, error) {
	return PackBatchSettlement("refund", config, amount)
}

// PackRefundWithSignature returns the calldata of batchSettlement.refundWithSignature(config, amount, nonce,
// receiverAuthorizerSignature), which anyone may relay once.
func PackRefundWithSignature(config ChannelConfig, amount, nonce *big.Int, receiverAuthorizerSignature []byte) ([]byte, error) {
	return PackBatchSettlement("refundWithSignature", config, amount, nonce, receiverAuthorizerSignature)
}

// PackInitiateWithdraw returns the calldata of batchSettlement.initiateWithdraw(config, amount), sent by the payer
// or its payerAuthorizer.
func PackInitiateWithdraw(config ChannelConfig, amount *big.Int) ([]byte, error) {
	return PackBatchSettlement("initiateWithdraw", config, amount)
}

// PackFinalizeWithdraw returns the calldata of batchSettlement.finalizeWithdraw(config).
func PackFinalizeWithdraw(config ChannelConfig) ([]byte, error) {
	return PackBatchSettlement("finalizeWithdraw", config)
}

// PackBatchMulticall returns the calldata of batchSettlement.multicall(calls): the calls run in order in one
// transaction, all or none (the SDK's facilitator claims and refunds at once this way).
func PackBatchMulticall(calls [][]byte) ([]byte, error) {
	return PackBatchSettlement("multicall", calls)
}

// PackBatchSettlement returns the calldata of batchSettlement.method(args...), any of its functions and views
// (getChannelId, channels, pendingWithdrawals, refundNonce, ...). A ChannelConfig, Voucher, VoucherClaim or
// []VoucherClaim argument is taken as it is.
func PackBatchSettlement(method string, args ...any) ([]byte, error) {
	packed := make([]any, len(args)) // not args itself: a caller's args... slice stays as it was
	for i, a := range args {
		switch a := a.(type) {
		case ChannelConfig:
			packed[i] = a.arg()
		case Voucher:
			packed[i] = voucherArg{Channel: a.Channel.arg(), MaxClaimableAmount: a.MaxClaimableAmount}
		case VoucherClaim:
			packed[i] = claimArgs([]VoucherClaim{a})[0]
		case []VoucherClaim:
			packed[i] = claimArgs(a)
		default:
			packed[i] = a
		}
	}
	data, err := BatchSettlementABI.Pack(method, packed...)
	if err != nil {
		return nil, fmt.Errorf("packing batch settlement %s: %w", method, err)
	}
	return data, nil
}

var (
	uint256Type, _ = abi.NewType("uint256", "", nil)
	uint8Type, _   = abi.NewType("uint8", "", nil)
	bytes32Type, _ = abi.NewType("bytes32", "", nil)
	bytesType, _   = abi.NewType("bytes", "", nil)
)

// ERC3009DepositNonce returns the EIP-3009 nonce of a deposit into channelID with the payer's salt:
// keccak256(abi.encode(channelId, uint256(salt))), two words, so that the payer's authorization can only fund
// that channel.
func ERC3009DepositNonce(channelID, salt common.Hash) common.Hash {
	return crypto.Keccak256Hash(channelID[:], salt[:])
}

// EncodeERC3009CollectorData returns the collectorData of a deposit through the ERC-3009 collector:
// abi.encode(validAfter, validBefore, salt, signature), the signature being the payer's ReceiveWithAuthorization
// (to ERC3009DepositCollectorAddress, nonce ERC3009DepositNonce(channelId, salt)).
func EncodeERC3009CollectorData(validAfter, validBefore, salt *big.Int, signature []byte) ([]byte, error) {
	data, err := abi.Arguments{{Type: uint256Type}, {Type: uint256Type}, {Type: uint256Type}, {Type: bytesType}}.
		Pack(validAfter, validBefore, salt, signature)
	if err != nil {
		return nil, fmt.Errorf("encoding ERC-3009 collector data: %w", err)
	}
	return data, nil
}

// EncodePermit2CollectorData returns the collectorData of a deposit through the Permit2 collector:
// abi.encode(nonce, deadline, permit2Signature, eip2612PermitData). eip2612PermitData is empty, or
// EncodeEIP2612PermitData's permit of the token approving Permit2.
func EncodePermit2CollectorData(nonce, deadline *big.Int, permit2Signature, eip2612PermitData []byte) ([]byte, error) {
	if eip2612PermitData == nil {
		eip2612PermitData = []byte{}
	}
	data, err := abi.Arguments{{Type: uint256Type}, {Type: uint256Type}, {Type: bytesType}, {Type: bytesType}}.
		Pack(nonce, deadline, permit2Signature, eip2612PermitData)
	if err != nil {
		return nil, fmt.Errorf("encoding Permit2 collector data: %w", err)
	}
	return data, nil
}

// EncodeEIP2612PermitData returns the EIP-2612 segment of Permit2 collector data:
// abi.encode(value, deadline, v, r, s).
func EncodeEIP2612PermitData(p EIP2612Permit) ([]byte, error) {
	data, err := abi.Arguments{{Type: uint256Type}, {Type: uint256Type}, {Type: uint8Type}, {Type: bytes32Type}, {Type: bytes32Type}}.
		Pack(p.Value, p.Deadline, p.V, p.R, p.S)
	if err != nil {
		return nil, fmt.Errorf("encoding EIP-2612 permit data: %w", err)
	}
	return data, nil
}
