package chaintest

import (
	"math/big"
	"strconv"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/common/math"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// The batch-settlement typed data below is what the public @x402/evm 2.27 client, server and facilitator sign,
// as go-ethereum's reference EIP-712 implementation (apitypes) sees it. It signs for the tests; the product's
// own signing and verification live outside chaintest.

// batchDomain is the EIP-712 domain of channel ids, vouchers, refunds and claim batches on chainID.
func batchDomain(chainID *big.Int) apitypes.TypedDataDomain {
	return apitypes.TypedDataDomain{
		Name:              contracts.BatchSettlementDomainName,
		Version:           contracts.BatchSettlementDomainVersion,
		ChainId:           (*math.HexOrDecimal256)(new(big.Int).Set(chainID)),
		VerifyingContract: contracts.BatchSettlementAddress.Hex(),
	}
}

var channelConfigFields = []apitypes.Type{
	{Name: "payer", Type: "address"},
	{Name: "payerAuthorizer", Type: "address"},
	{Name: "receiver", Type: "address"},
	{Name: "receiverAuthorizer", Type: "address"},
	{Name: "token", Type: "address"},
	{Name: "withdrawDelay", Type: "uint40"},
	{Name: "salt", Type: "bytes32"},
}

// ChannelConfigTypedData is the ChannelConfig whose typed-data hash is the channel id.
func ChannelConfigTypedData(chainID *big.Int, cfg contracts.ChannelConfig) apitypes.TypedData {
	return apitypes.TypedData{
		Types:       apitypes.Types{"EIP712Domain": tokenDomainType, "ChannelConfig": channelConfigFields},
		PrimaryType: "ChannelConfig",
		Domain:      batchDomain(chainID),
		Message: apitypes.TypedDataMessage{
			"payer":              cfg.Payer.Hex(),
			"payerAuthorizer":    cfg.PayerAuthorizer.Hex(),
			"receiver":           cfg.Receiver.Hex(),
			"receiverAuthorizer": cfg.ReceiverAuthorizer.Hex(),
			"token":              cfg.Token.Hex(),
			"withdrawDelay":      strconv.FormatUint(cfg.WithdrawDelay, 10),
			"salt":               hexutil.Encode(cfg.Salt[:]),
		},
	}
}

// ChannelID returns the channel id of cfg on chainID: its EIP-712 typed-data hash under the batch domain.
func ChannelID(chainID *big.Int, cfg contracts.ChannelConfig) common.Hash {
	hash, _, err := apitypes.TypedDataAndHash(ChannelConfigTypedData(chainID, cfg))
	if err != nil {
		panic("chaintest: hashing a channel config: " + err.Error()) // fixed, well-formed types
	}
	return common.BytesToHash(hash)
}

// VoucherTypedData is the payer's Voucher(bytes32 channelId,uint128 maxClaimableAmount).
func VoucherTypedData(chainID *big.Int, channelID common.Hash, maxClaimable *big.Int) apitypes.TypedData {
	return apitypes.TypedData{
		Types: apitypes.Types{"EIP712Domain": tokenDomainType, "Voucher": {
			{Name: "channelId", Type: "bytes32"},
			{Name: "maxClaimableAmount", Type: "uint128"},
		}},
		PrimaryType: "Voucher",
		Domain:      batchDomain(chainID),
		Message:     apitypes.TypedDataMessage{"channelId": channelID.Hex(), "maxClaimableAmount": maxClaimable.String()},
	}
}

// RefundTypedData is the receiverAuthorizer's Refund(bytes32 channelId,uint256 nonce,uint128 amount).
func RefundTypedData(chainID *big.Int, channelID common.Hash, nonce, amount *big.Int) apitypes.TypedData {
	return apitypes.TypedData{
		Types: apitypes.Types{"EIP712Domain": tokenDomainType, "Refund": {
			{Name: "channelId", Type: "bytes32"},
			{Name: "nonce", Type: "uint256"},
			{Name: "amount", Type: "uint128"},
		}},
		PrimaryType: "Refund",
		Domain:      batchDomain(chainID),
		Message:     apitypes.TypedDataMessage{"channelId": channelID.Hex(), "nonce": nonce.String(), "amount": amount.String()},
	}
}

// ClaimBatchTypedData is the receiverAuthorizer's ClaimBatch(ClaimEntry[] claims), one entry per claim row.
func ClaimBatchTypedData(chainID *big.Int, claims []contracts.VoucherClaim) apitypes.TypedData {
	entries := make([]any, len(claims))
	for i, cl := range claims {
		entries[i] = map[string]any{
			"channelId":          ChannelID(chainID, cl.Voucher.Channel).Hex(),
			"maxClaimableAmount": cl.Voucher.MaxClaimableAmount.String(),
			"totalClaimed":       cl.TotalClaimed.String(),
		}
	}
	return apitypes.TypedData{
		Types: apitypes.Types{
			"EIP712Domain": tokenDomainType,
			"ClaimBatch":   {{Name: "claims", Type: "ClaimEntry[]"}},
			"ClaimEntry": {
				{Name: "channelId", Type: "bytes32"},
				{Name: "maxClaimableAmount", Type: "uint128"},
				{Name: "totalClaimed", Type: "uint128"},
			},
		},
		PrimaryType: "ClaimBatch",
		Domain:      batchDomain(chainID),
		Message:     apitypes.TypedDataMessage{"claims": entries},
	}
}

// ReceiveAuthorizationTypedData is the EIP-3009 ReceiveWithAuthorization a payer signs for an eip3009 deposit,
// under the token's domain: to the ERC-3009 deposit collector, nonce bound to the channel.
func ReceiveAuthorizationTypedData(name, version string, chainID *big.Int, token, from common.Address, value, validAfter, validBefore *big.Int, nonce [32]byte) apitypes.TypedData {
	td := TransferAuthorizationTypedData(name, version, chainID, token, from.Hex(), contracts.ERC3009DepositCollectorAddress.Hex(),
		value.String(), validAfter.String(), validBefore.String(), hexutil.Encode(nonce[:]))
	td.Types["ReceiveWithAuthorization"] = td.Types["TransferWithAuthorization"]
	delete(td.Types, "TransferWithAuthorization")
	td.PrimaryType = "ReceiveWithAuthorization"
	return td
}

// DepositPermit2TypedData is Permit2's PermitWitnessTransferFrom with the deposit witness {channelId}, the
// spender being the Permit2 deposit collector.
func DepositPermit2TypedData(chainID *big.Int, token common.Address, amount, nonce, deadline *big.Int, channelID common.Hash) apitypes.TypedData {
	td := Permit2WitnessTypedData(chainID, contracts.Permit2Address, token.Hex(), amount.String(),
		contracts.Permit2DepositCollectorAddress.Hex(), nonce.String(), deadline.String(), "", "")
	delete(td.Types, "Witness")
	td.Types["DepositWitness"] = []apitypes.Type{{Name: "channelId", Type: "bytes32"}}
	td.Types["PermitWitnessTransferFrom"][4] = apitypes.Type{Name: "witness", Type: "DepositWitness"}
	td.Message["witness"] = map[string]any{"channelId": channelID.Hex()}
	return td
}

// SignVoucher signs a voucher of channelID up to maxClaimable with signer (the payerAuthorizer, or the payer).
func (c *Chain) SignVoucher(signer *Account, channelID common.Hash, maxClaimable *big.Int) []byte {
	c.tb.Helper()
	return c.SignTypedData(signer, VoucherTypedData(c.ChainID, channelID, maxClaimable))
}

// SignClaimBatch signs the ClaimBatch of claims with the receiverAuthorizer.
func (c *Chain) SignClaimBatch(authorizer *Account, claims []contracts.VoucherClaim) []byte {
	c.tb.Helper()
	return c.SignTypedData(authorizer, ClaimBatchTypedData(c.ChainID, claims))
}

// SignRefund signs a Refund of amount at nonce of channelID with the receiverAuthorizer.
func (c *Chain) SignRefund(authorizer *Account, channelID common.Hash, nonce, amount *big.Int) []byte {
	c.tb.Helper()
	return c.SignTypedData(authorizer, RefundTypedData(c.ChainID, channelID, nonce, amount))
}
