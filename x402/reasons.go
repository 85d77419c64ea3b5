package x402

// Reason codes for VerifyResponse.invalidReason and SettleResponse.errorReason, spelled as public
// facilitators spell them so existing clients understand us (x402-wire-facts.md section 6).
const (
	ReasonInsufficientFunds             = "insufficient_funds"
	ReasonInvalidNetwork                = "invalid_network"
	ReasonInvalidPayload                = "invalid_payload"
	ReasonInvalidPaymentRequirements    = "invalid_payment_requirements"
	ReasonInvalidScheme                 = "invalid_scheme"
	ReasonUnsupportedScheme             = "unsupported_scheme"
	ReasonInvalidX402Version            = "invalid_x402_version"
	ReasonInvalidSignature              = "invalid_exact_evm_payload_signature"
	ReasonRecipientMismatch             = "invalid_exact_evm_payload_recipient_mismatch"
	ReasonValueMismatch                 = "invalid_exact_evm_payload_authorization_value_mismatch"
	ReasonValidAfter                    = "invalid_exact_evm_payload_authorization_valid_after"
	ReasonValidBefore                   = "invalid_exact_evm_payload_authorization_valid_before"
	ReasonNonceAlreadyUsed              = "invalid_exact_evm_nonce_already_used"
	ReasonSimulationFailed              = "invalid_exact_evm_transaction_simulation_failed"
	ReasonFailedToGetReceipt            = "invalid_exact_evm_failed_to_get_receipt"
	ReasonTransactionFailed             = "invalid_exact_evm_transaction_failed"
	ReasonPermit2InvalidSpender         = "invalid_permit2_spender"
	ReasonPermit2RecipientMismatch      = "invalid_permit2_recipient_mismatch"
	ReasonPermit2InvalidSignature       = "invalid_permit2_signature"
	ReasonPermit2DeadlineExpired        = "permit2_deadline_expired"
	ReasonPermit2NotYetValid            = "permit2_not_yet_valid"
	ReasonPermit2AmountMismatch         = "permit2_amount_mismatch"
	ReasonPermit2TokenMismatch          = "permit2_token_mismatch"
	ReasonPermit2AllowanceRequired      = "permit2_allowance_required"
	ReasonPermit2InsufficientBalance    = "permit2_insufficient_balance"
	ReasonPermit2InvalidNonce           = "permit2_invalid_nonce"
	ReasonPermit2ProxyNotDeployed       = "permit2_proxy_not_deployed"
	ReasonPermit2EIP2612AmountMismatch  = "permit2_2612_amount_mismatch"
	ReasonPermit2SimulationFailed       = "permit2_simulation_failed"
	ReasonInvalidEIP2612ExtensionFormat = "invalid_eip2612_extension_format"
	ReasonEIP2612FromMismatch           = "eip2612_from_mismatch"
	ReasonEIP2612AssetMismatch          = "eip2612_asset_mismatch"
	ReasonEIP2612SpenderNotPermit2      = "eip2612_spender_not_permit2"
	ReasonEIP2612DeadlineExpired        = "eip2612_deadline_expired"
	// The erc20ApprovalGasSponsoring extension's reasons, as the public SDK words them; the last three are this
	// facilitator's: the approval's gas, fees or nonce are not what it pays for or what the chain takes next.
	ReasonInvalidERC20ApprovalExtensionFormat = "invalid_erc20_approval_extension_format"
	ReasonERC20ApprovalFromMismatch           = "erc20_approval_from_mismatch"
	ReasonERC20ApprovalAssetMismatch          = "erc20_approval_asset_mismatch"
	ReasonERC20ApprovalSpenderNotPermit2      = "erc20_approval_spender_not_permit2"
	ReasonERC20ApprovalTxWrongTarget          = "erc20_approval_tx_wrong_target"
	ReasonERC20ApprovalTxWrongSelector        = "erc20_approval_tx_wrong_selector"
	ReasonERC20ApprovalTxWrongSpender         = "erc20_approval_tx_wrong_spender"
	ReasonERC20ApprovalTxInvalidCalldata      = "erc20_approval_tx_invalid_calldata"
	ReasonERC20ApprovalTxSignerMismatch       = "erc20_approval_tx_signer_mismatch"
	ReasonERC20ApprovalTxInvalidSignature     = "erc20_approval_tx_invalid_signature"
	ReasonERC20ApprovalTxParseFailed          = "erc20_approval_tx_parse_failed"
	ReasonERC20ApprovalTxFailed               = "erc20_approval_tx_failed"
	ReasonERC20ApprovalBroadcastFailed        = "erc20_approval_broadcast_failed"
	ReasonERC20ApprovalTxWrongChain           = "erc20_approval_tx_wrong_chain"
	ReasonERC20ApprovalTxFeesNotSponsored     = "erc20_approval_tx_fees_not_sponsored"
	ReasonERC20ApprovalTxWrongNonce           = "erc20_approval_tx_wrong_nonce"
	ReasonUnexpectedVerifyError               = "unexpected_verify_error"
	ReasonUnexpectedSettleError               = "unexpected_settle_error"
	ReasonSettlementPending                   = "settlement_pending"
	ReasonNoAvailableWallets                  = "no_available_wallets"
	ReasonPaymentAlreadyUsed                  = "payment_already_used"
)

// Reason codes of eip3009 payments, as the public SDKs' exact EVM scheme names them for EIP-3009
// (valid_before, valid_after, nonce_already_used and transaction_simulation_failed are shared with erc2612).
const (
	ReasonEIP3009InvalidSignature     = "invalid_exact_evm_signature"
	ReasonEIP3009RecipientMismatch    = "invalid_exact_evm_recipient_mismatch"
	ReasonEIP3009AuthorizationValue   = "invalid_exact_evm_authorization_value"
	ReasonEIP3009InsufficientBalance  = "invalid_exact_evm_insufficient_balance"
	ReasonEIP3009NotSupported         = "invalid_exact_evm_eip3009_not_supported"
	ReasonEIP3009TokenNameMismatch    = "invalid_exact_evm_token_name_mismatch"
	ReasonEIP3009TokenVersionMismatch = "invalid_exact_evm_token_version_mismatch"
)

// Reason codes of upto payments, as the public SDKs' upto EVM scheme names them.
const (
	// ReasonUptoFacilitatorMismatch: the witness names a facilitator address that is not one of this
	// facilitator's settlement wallets.
	ReasonUptoFacilitatorMismatch = "upto_facilitator_mismatch"
	// ReasonUptoSettlementExceedsAmount: the settlement asks for more than the payer permitted.
	ReasonUptoSettlementExceedsAmount = "invalid_upto_evm_payload_settlement_exceeds_amount"
	// ReasonUptoTransactionFailed: the upto settlement transaction was mined but reverted.
	ReasonUptoTransactionFailed = "invalid_upto_evm_transaction_failed"
)

// Reason codes of smart-wallet payers, as the public SDKs name them.
const (
	// ReasonEIP6492FactoryNotAllowed refuses an undeployed wallet whose ERC-6492 factory the facilitator does
	// not deploy through.
	ReasonEIP6492FactoryNotAllowed = "eip6492_factory_not_allowed"
	// ReasonSmartWalletDeploymentFailed refuses an undeployed wallet its factory would not deploy.
	ReasonSmartWalletDeploymentFailed = "smart_wallet_deployment_failed"
)

// Texts the service spec names, used as the human message of the matching failures.
const (
	MessageNoAvailableWallets = "No available wallets in pool"
	MessagePermitExpired      = "Permit expired"
)

// Reason codes of batch-settlement payments, as the public SDK's batch-settlement EVM scheme names them (npm
// @x402/evm 2.27, batch-settlement/errors).
const (
	ReasonBatchChannelNotFound               = "invalid_batch_settlement_evm_channel_not_found"
	ReasonBatchTokenMismatch                 = "invalid_batch_settlement_evm_token_mismatch"
	ReasonBatchInvalidVoucherSignature       = "invalid_batch_settlement_evm_voucher_signature"
	ReasonBatchCumulativeExceedsBalance      = "invalid_batch_settlement_evm_cumulative_exceeds_balance"
	ReasonBatchCumulativeBelowClaimed        = "invalid_batch_settlement_evm_cumulative_below_claimed"
	ReasonBatchInsufficientBalance           = "invalid_batch_settlement_evm_insufficient_balance"
	ReasonBatchDepositTransactionFailed      = "invalid_batch_settlement_evm_deposit_transaction_failed"
	ReasonBatchClaimTransactionFailed        = "invalid_batch_settlement_evm_claim_transaction_failed"
	ReasonBatchSettleTransactionFailed       = "invalid_batch_settlement_evm_settle_transaction_failed"
	ReasonBatchInvalidScheme                 = "invalid_batch_settlement_evm_scheme"
	ReasonBatchNetworkMismatch               = "invalid_batch_settlement_evm_network_mismatch"
	ReasonBatchMissingEIP712Domain           = "invalid_batch_settlement_evm_missing_eip712_domain"
	ReasonBatchValidBefore                   = "invalid_batch_settlement_evm_payload_authorization_valid_before"
	ReasonBatchValidAfter                    = "invalid_batch_settlement_evm_payload_authorization_valid_after"
	ReasonBatchInvalidReceiveAuthorization   = "invalid_batch_settlement_evm_receive_authorization_signature"
	ReasonBatchERC3009AuthorizationRequired  = "invalid_batch_settlement_evm_erc3009_authorization_required"
	ReasonBatchRefundTransactionFailed       = "invalid_batch_settlement_evm_refund_transaction_failed"
	ReasonBatchInvalidPayloadType            = "invalid_batch_settlement_evm_payload_type"
	ReasonBatchWithdrawDelayOutOfRange       = "invalid_batch_settlement_evm_withdraw_delay_out_of_range"
	ReasonBatchChannelIDMismatch             = "invalid_batch_settlement_evm_channel_id_mismatch"
	ReasonBatchChannelIDInvalid              = "invalid_batch_settlement_evm_channel_id_invalid"
	ReasonBatchReceiverMismatch              = "invalid_batch_settlement_evm_receiver_mismatch"
	ReasonBatchReceiverAuthorizerMismatch    = "invalid_batch_settlement_evm_receiver_authorizer_mismatch"
	ReasonBatchWithdrawDelayMismatch         = "invalid_batch_settlement_evm_withdraw_delay_mismatch"
	ReasonBatchAuthorizerAddressMismatch     = "invalid_batch_settlement_evm_authorizer_address_mismatch"
	ReasonBatchAuthorizerNotConfigured       = "invalid_batch_settlement_evm_authorizer_not_configured"
	ReasonBatchDepositSimulationFailed       = "invalid_batch_settlement_evm_deposit_simulation_failed"
	ReasonBatchDepositBelowMinDeposit        = "invalid_batch_settlement_evm_deposit_below_min_deposit"
	ReasonBatchFactoryNotAllowed             = "invalid_batch_settlement_evm_eip6492_factory_not_allowed"
	ReasonBatchSmartWalletDeploymentFailed   = "invalid_batch_settlement_evm_smart_wallet_deployment_failed"
	ReasonBatchClaimSimulationFailed         = "invalid_batch_settlement_evm_claim_simulation_failed"
	ReasonBatchSettleSimulationFailed        = "invalid_batch_settlement_evm_settle_simulation_failed"
	ReasonBatchNothingToSettle               = "invalid_batch_settlement_evm_nothing_to_settle"
	ReasonBatchRefundPayload                 = "invalid_batch_settlement_evm_refund_payload"
	ReasonBatchRefundSimulationFailed        = "invalid_batch_settlement_evm_refund_simulation_failed"
	ReasonBatchRPCReadFailed                 = "invalid_batch_settlement_evm_rpc_read_failed"
	ReasonBatchPermit2AuthorizationRequired  = "invalid_batch_settlement_evm_permit2_authorization_required"
	ReasonBatchPermit2InvalidSpender         = "invalid_batch_settlement_evm_permit2_invalid_spender"
	ReasonBatchPermit2AmountMismatch         = "invalid_batch_settlement_evm_permit2_amount_mismatch"
	ReasonBatchPermit2DeadlineExpired        = "invalid_batch_settlement_evm_permit2_deadline_expired"
	ReasonBatchPermit2InvalidSignature       = "invalid_batch_settlement_evm_permit2_invalid_signature"
	ReasonBatchPermit2AllowanceRequired      = "invalid_batch_settlement_evm_permit2_allowance_required"
	ReasonBatchEIP2612AmountMismatch         = "invalid_batch_settlement_evm_eip2612_amount_mismatch"
	ReasonBatchEIP2612OwnerMismatch          = "invalid_batch_settlement_evm_eip2612_owner_mismatch"
	ReasonBatchEIP2612AssetMismatch          = "invalid_batch_settlement_evm_eip2612_asset_mismatch"
	ReasonBatchEIP2612SpenderMismatch        = "invalid_batch_settlement_evm_eip2612_spender_mismatch"
	ReasonBatchEIP2612DeadlineExpired        = "invalid_batch_settlement_evm_eip2612_deadline_expired"
	ReasonBatchERC20ApprovalUnavailable      = "invalid_batch_settlement_evm_erc20_approval_unavailable"
	ReasonBatchCumulativeAmountMismatch      = "invalid_batch_settlement_evm_cumulative_amount_mismatch"
	ReasonBatchChannelBusy                   = "invalid_batch_settlement_evm_channel_busy"
	ReasonBatchVerificationStateUnavailable  = "invalid_batch_settlement_evm_verification_state_unavailable"
	ReasonBatchChargeExceedsSignedCumulative = "invalid_batch_settlement_evm_charge_exceeds_signed_cumulative"
	ReasonBatchMissingChannel                = "invalid_batch_settlement_evm_missing_channel"
	ReasonBatchRefundNoBalance               = "invalid_batch_settlement_evm_refund_no_balance"
	ReasonBatchRefundAmountInvalid           = "invalid_batch_settlement_evm_refund_amount_invalid"
)

// reasons are the reason codes above, every one (TestReasonsNamesEveryReasonCode keeps it so).
var reasons = []string{
	ReasonInsufficientFunds, ReasonInvalidNetwork, ReasonInvalidPayload, ReasonInvalidPaymentRequirements,
	ReasonInvalidScheme, ReasonUnsupportedScheme, ReasonInvalidX402Version, ReasonInvalidSignature,
	ReasonRecipientMismatch, ReasonValueMismatch, ReasonValidAfter, ReasonValidBefore, ReasonNonceAlreadyUsed,
	ReasonSimulationFailed, ReasonFailedToGetReceipt, ReasonTransactionFailed, ReasonPermit2InvalidSpender,
	ReasonPermit2RecipientMismatch, ReasonPermit2InvalidSignature, ReasonPermit2DeadlineExpired,
	ReasonPermit2NotYetValid, ReasonPermit2AmountMismatch, ReasonPermit2TokenMismatch, ReasonPermit2AllowanceRequired,
	ReasonPermit2InsufficientBalance, ReasonPermit2InvalidNonce, ReasonPermit2ProxyNotDeployed,
	ReasonPermit2EIP2612AmountMismatch, ReasonPermit2SimulationFailed, ReasonInvalidEIP2612ExtensionFormat,
	ReasonEIP2612FromMismatch, ReasonEIP2612AssetMismatch, ReasonEIP2612SpenderNotPermit2,
	ReasonEIP2612DeadlineExpired, ReasonInvalidERC20ApprovalExtensionFormat, ReasonERC20ApprovalFromMismatch,
	ReasonERC20ApprovalAssetMismatch, ReasonERC20ApprovalSpenderNotPermit2, ReasonERC20ApprovalTxWrongTarget,
	ReasonERC20ApprovalTxWrongSelector, ReasonERC20ApprovalTxWrongSpender, ReasonERC20ApprovalTxInvalidCalldata,
	ReasonERC20ApprovalTxSignerMismatch, ReasonERC20ApprovalTxInvalidSignature, ReasonERC20ApprovalTxParseFailed,
	ReasonERC20ApprovalTxFailed, ReasonERC20ApprovalBroadcastFailed, ReasonERC20ApprovalTxWrongChain,
	ReasonERC20ApprovalTxFeesNotSponsored, ReasonERC20ApprovalTxWrongNonce, ReasonUnexpectedVerifyError, ReasonUnexpectedSettleError, ReasonSettlementPending,
	ReasonNoAvailableWallets, ReasonPaymentAlreadyUsed, ReasonEIP3009InvalidSignature, ReasonEIP3009RecipientMismatch,
	ReasonEIP3009AuthorizationValue, ReasonEIP3009InsufficientBalance, ReasonEIP3009NotSupported,
	ReasonEIP3009TokenNameMismatch, ReasonEIP3009TokenVersionMismatch, ReasonUptoFacilitatorMismatch,
	ReasonUptoSettlementExceedsAmount, ReasonUptoTransactionFailed, ReasonEIP6492FactoryNotAllowed,
	ReasonSmartWalletDeploymentFailed, ReasonBatchChannelNotFound, ReasonBatchTokenMismatch,
	ReasonBatchInvalidVoucherSignature, ReasonBatchCumulativeExceedsBalance, ReasonBatchCumulativeBelowClaimed,
	ReasonBatchInsufficientBalance, ReasonBatchDepositTransactionFailed, ReasonBatchClaimTransactionFailed,
	ReasonBatchSettleTransactionFailed, ReasonBatchInvalidScheme, ReasonBatchNetworkMismatch,
	ReasonBatchMissingEIP712Domain, ReasonBatchValidBefore, ReasonBatchValidAfter,
	ReasonBatchInvalidReceiveAuthorization, ReasonBatchERC3009AuthorizationRequired,
	ReasonBatchRefundTransactionFailed, ReasonBatchInvalidPayloadType, ReasonBatchWithdrawDelayOutOfRange,
	ReasonBatchChannelIDMismatch, ReasonBatchChannelIDInvalid, ReasonBatchReceiverMismatch,
	ReasonBatchReceiverAuthorizerMismatch, ReasonBatchWithdrawDelayMismatch, ReasonBatchAuthorizerAddressMismatch,
	ReasonBatchAuthorizerNotConfigured, ReasonBatchDepositSimulationFailed, ReasonBatchDepositBelowMinDeposit,
	ReasonBatchFactoryNotAllowed, ReasonBatchSmartWalletDeploymentFailed, ReasonBatchClaimSimulationFailed,
	ReasonBatchSettleSimulationFailed, ReasonBatchNothingToSettle, ReasonBatchRefundPayload,
	ReasonBatchRefundSimulationFailed, ReasonBatchRPCReadFailed, ReasonBatchPermit2AuthorizationRequired,
	ReasonBatchPermit2InvalidSpender, ReasonBatchPermit2AmountMismatch, ReasonBatchPermit2DeadlineExpired,
	ReasonBatchPermit2InvalidSignature, ReasonBatchPermit2AllowanceRequired, ReasonBatchEIP2612AmountMismatch,
	ReasonBatchEIP2612OwnerMismatch, ReasonBatchEIP2612AssetMismatch, ReasonBatchEIP2612SpenderMismatch,
	ReasonBatchEIP2612DeadlineExpired, ReasonBatchERC20ApprovalUnavailable, ReasonBatchCumulativeAmountMismatch,
	ReasonBatchChannelBusy, ReasonBatchVerificationStateUnavailable, ReasonBatchChargeExceedsSignedCumulative,
	ReasonBatchMissingChannel, ReasonBatchRefundNoBalance, ReasonBatchRefundAmountInvalid,
}

// Reasons returns every reason code this package names: what a metric may give a label value of its own.
func Reasons() []string { return append([]string(nil), reasons...) }
