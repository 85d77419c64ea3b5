package chain

import (
	"math/big"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// depositValidityMargin is how long before a deposit authorization's end it is refused: the public SDK's
// facilitator refuses one that ends within 6 seconds, too soon for its transaction to be mined.
const depositValidityMargin = 6

// CheckDepositAuthorization runs the off-chain checks of a deposit payment's authorization (the payload's
// voucher is CheckVoucher's, given a view whose balance counts this deposit): its form, its terms (the
// collector, the route's token and transfer method, the amount, the channel it funds) and its time window at now,
// and that the payer's key signed it under the domain the token checks it under (the route's token name and
// version, never the payment's accepted, which the payer writes). The chain checks what is left (the payer's
// balance and allowance, and, for a payer that is a contract, its signature, by simulating the deposit).
func (t *BatchTerms) CheckDepositAuthorization(p *x402.BatchPayment, now time.Time) *BatchRefusal {
	pl := &p.Payload
	if pl.Type != x402.BatchDeposit || pl.Deposit == nil || pl.ChannelConfig == nil || pl.Voucher == nil {
		return refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload is not a deposit with channelConfig, voucher and deposit")
	}
	ch, err := ParseChannelConfig(*pl.ChannelConfig)
	if err != nil {
		return refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	if !x402.IsBytes32(pl.Voucher.ChannelID) {
		return refuseBatch(x402.ReasonBatchChannelIDInvalid, "payload.voucher.channelId is not a bytes32 (0x and 64 hex digits)")
	}
	channelID := common.HexToHash(pl.Voucher.ChannelID)
	amount, err := x402.ParseAmount(pl.Deposit.Amount)
	if err != nil || amount.Sign() == 0 || amount.Cmp(maxUint128) > 0 {
		return refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.amount %q is not a positive uint128 amount", truncate(pl.Deposit.Amount))
	}
	// The collector moves the channel's token, which must be the route's.
	if ch.Token != t.Token {
		return refuseBatch(x402.ReasonBatchTokenMismatch, "the channel's token is %s, this route is paid in %s", ch.Token.Hex(), t.Token.Hex())
	}
	token, method, chainID := t.Token, t.TransferMethod, t.ChainID
	auth := pl.Deposit.Authorization
	switch {
	case method == x402.TransferPermit2 && auth.Permit2Authorization == nil:
		return refuseBatch(x402.ReasonBatchPermit2AuthorizationRequired, "the requirement's transfer method is permit2, but the deposit carries no permit2Authorization")
	case method == x402.TransferPermit2:
		return checkPermit2Deposit(auth.Permit2Authorization, ch, channelID, token, amount, chainID, now)
	case auth.ERC3009Authorization == nil:
		return refuseBatch(x402.ReasonBatchERC3009AuthorizationRequired, "the requirement's transfer method is eip3009, but the deposit carries no erc3009Authorization")
	}
	a := auth.ERC3009Authorization
	if t.TokenName == "" || t.TokenVersion == "" {
		return refuseBatch(x402.ReasonBatchMissingEIP712Domain, "the route's requirement names no token name and version (extra.name, extra.version), which an ERC-3009 deposit signs under")
	}
	validAfter, err1 := x402.ParseUint256(a.ValidAfter)
	validBefore, err2 := x402.ParseUint256(a.ValidBefore)
	switch {
	case err1 != nil:
		return refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.authorization.erc3009Authorization.validAfter: %v", err1)
	case err2 != nil:
		return refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.authorization.erc3009Authorization.validBefore: %v", err2)
	case !x402.IsBytes32(a.Salt):
		return refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.authorization.erc3009Authorization.salt is not a bytes32")
	case validBefore.Cmp(big.NewInt(now.Unix()+depositValidityMargin)) < 0:
		return refuseBatch(x402.ReasonBatchValidBefore, "the deposit's authorization is valid before %s, too soon to be mined", validBefore)
	case validAfter.Cmp(big.NewInt(now.Unix())) > 0:
		return refuseBatch(x402.ReasonBatchValidAfter, "the deposit's authorization is valid only after %s", validAfter)
	}
	sig, err := ParseSignature(a.Signature)
	if err != nil {
		return refuseBatch(x402.ReasonBatchInvalidReceiveAuthorization, "payload.deposit.authorization.erc3009Authorization.signature: %v", err)
	}
	domain := PermitDomainSeparator(t.TokenName, t.TokenVersion, chainID, token)
	nonce := contracts.ERC3009DepositNonce(channelID, common.HexToHash(a.Salt))
	digest := ReceiveAuthorizationDigest(domain, ch.Payer, contracts.ERC3009DepositCollectorAddress, amount, validAfter, validBefore, nonce)
	if got, err := RecoverSigner(digest, sig); err != nil || got != ch.Payer {
		return refuseBatch(x402.ReasonBatchInvalidReceiveAuthorization, "the deposit's ReceiveWithAuthorization is not signed by the channel's payer %s", ch.Payer.Hex())
	}
	return nil
}

// checkPermit2Deposit checks a deposit's Permit2 authorization: from the payer, spent by the Permit2 deposit
// collector, of the route's token, for the deposit's amount, witnessing its channel, not expiring too soon,
// and signed by the payer.
func checkPermit2Deposit(a *x402.BatchPermit2Authorization, ch contracts.ChannelConfig, channelID common.Hash, token common.Address, amount, chainID *big.Int, now time.Time) *BatchRefusal {
	const at = "payload.deposit.authorization.permit2Authorization"
	permitted, err1 := x402.ParseAmount(a.Permitted.Amount)
	nonce, err2 := x402.ParseUint256(a.Nonce)
	deadline, err3 := x402.ParseUint256(a.Deadline)
	switch {
	case !x402.IsHexAddress(a.From) || common.HexToAddress(a.From) != ch.Payer:
		return refuseBatch(x402.ReasonBatchPermit2InvalidSignature, "%s.from is %q, not the channel's payer %s", at, truncate(a.From), ch.Payer.Hex())
	case !x402.IsHexAddress(a.Spender) || common.HexToAddress(a.Spender) != contracts.Permit2DepositCollectorAddress:
		return refuseBatch(x402.ReasonBatchPermit2InvalidSpender, "%s.spender is %q, expected the Permit2 deposit collector %s", at, truncate(a.Spender), contracts.Permit2DepositCollectorAddress.Hex())
	case !x402.IsHexAddress(a.Permitted.Token) || common.HexToAddress(a.Permitted.Token) != token:
		return refuseBatch(x402.ReasonBatchTokenMismatch, "%s.permitted.token is %q, this route is paid in %s", at, truncate(a.Permitted.Token), token.Hex())
	case err1 != nil || permitted.Cmp(amount) != 0:
		return refuseBatch(x402.ReasonBatchPermit2AmountMismatch, "%s.permitted.amount is %q, the deposit is %s", at, truncate(a.Permitted.Amount), amount)
	case !x402.IsBytes32(a.Witness.ChannelID) || common.HexToHash(a.Witness.ChannelID) != channelID:
		return refuseBatch(x402.ReasonBatchChannelIDMismatch, "%s.witness.channelId is %q, the voucher's channel is %s", at, truncate(a.Witness.ChannelID), channelID.Hex())
	case err2 != nil:
		return refuseBatch(x402.ReasonInvalidPayload, "%s.nonce: %v", at, err2)
	case err3 != nil:
		return refuseBatch(x402.ReasonInvalidPayload, "%s.deadline: %v", at, err3)
	case deadline.Cmp(big.NewInt(now.Unix()+depositValidityMargin)) < 0:
		return refuseBatch(x402.ReasonBatchPermit2DeadlineExpired, "%s.deadline %s has passed or is too soon to be mined", at, deadline)
	}
	sig, err := ParseSignature(a.Signature)
	if err != nil {
		return refuseBatch(x402.ReasonBatchPermit2InvalidSignature, "%s.signature: %v", at, err)
	}
	digest := DepositPermit2Digest(chainID, token, amount, nonce, deadline, channelID)
	if got, err := RecoverSigner(digest, sig); err != nil || got != ch.Payer {
		return refuseBatch(x402.ReasonBatchPermit2InvalidSignature, "the deposit's Permit2 authorization is not signed by the channel's payer %s", ch.Payer.Hex())
	}
	return nil
}
