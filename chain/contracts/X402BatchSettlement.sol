// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {SafeERC20} from "@openzeppelin/contracts/token/ERC20/utils/SafeERC20.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {SignatureChecker} from "@openzeppelin/contracts/utils/cryptography/SignatureChecker.sol";
import {Multicall} from "@openzeppelin/contracts/utils/Multicall.sol";
import {ReentrancyGuardTransient} from "@openzeppelin/contracts/utils/ReentrancyGuardTransient.sol";

/// @notice What X402BatchSettlement asks of a deposit collector: move exactly amount of token from payer to the
///         caller, authorised by whatever collectorData carries (bound to channelId).
interface IDepositCollector {
    function collect(address payer, address token, uint256 amount, bytes32 channelId, bytes calldata collectorData)
        external;
}

/// @title X402BatchSettlement
/// @notice The escrow of the x402 `batch-settlement` scheme: a payer deposits into a channel once, pays each
///         request with a signed cumulative voucher off chain, and the receiver side claims the latest voucher of
///         many channels in one transaction; claimed funds reach the receiver through settle. Unclaimed escrow goes
///         back to the payer through a cooperative refund, or after withdrawDelay through a timed withdrawal.
/// @dev ABI-compatible with the public x402BatchSettlement (the functions, views and events the @x402/evm 2.27 SDK
///      calls and reads). A channel is identified by the EIP-712 hash of its immutable ChannelConfig under the
///      domain {name "x402 Batch Settlement", version "1", chainId, this}. The domain separator is computed from
///      block.chainid and address(this) on every use and the reentrancy guard lives in transient storage, so the
///      runtime code can be placed into a genesis at 0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003.
///
///      Money invariant: the contract holds, of each token, the sum over its channels of balance (deposits less
///      refunds and withdrawals) less what settle has paid out. A claim only moves accounting from a channel's
///      unclaimed part to its receiver's claimed part; refunds and withdrawals take only from the unclaimed part,
///      settle only from the claimed part.
contract X402BatchSettlement is Multicall, ReentrancyGuardTransient {
    using SafeERC20 for IERC20;

    /// @notice The immutable parameters of a channel; their EIP-712 hash is the channel id.
    struct ChannelConfig {
        address payer;
        address payerAuthorizer;
        address receiver;
        address receiverAuthorizer;
        address token;
        uint40 withdrawDelay;
        bytes32 salt;
    }

    /// @notice A channel's escrow: balance (deposits less refunds and withdrawals) and the cumulative claimed part.
    struct ChannelState {
        uint128 balance;
        uint128 totalClaimed;
    }

    /// @notice A timed withdrawal in progress; initiatedAt is zero when none is.
    struct WithdrawalState {
        uint128 amount;
        uint40 initiatedAt;
    }

    /// @notice What a receiver has been credited by claims, and how much of it settle has paid out, per token.
    struct ReceiverState {
        uint128 totalClaimed;
        uint128 totalSettled;
    }

    /// @notice What the payer (or its payerAuthorizer) signs: the channel and a cumulative ceiling.
    struct Voucher {
        ChannelConfig channel;
        uint128 maxClaimableAmount;
    }

    /// @notice One row of a claim: a signed voucher and the cumulative amount the receiver side claims under it.
    struct VoucherClaim {
        Voucher voucher;
        bytes signature;
        uint128 totalClaimed;
    }

    /// @notice The shortest withdrawDelay a channel may have: the receiver's window to claim (15 minutes).
    uint40 public constant MIN_WITHDRAW_DELAY = 900;
    /// @notice The longest withdrawDelay a channel may have, so that a payer's escrow is never trapped (30 days).
    uint40 public constant MAX_WITHDRAW_DELAY = 2_592_000;

    /// @notice EIP-712 typehash of ChannelConfig, whose struct hash under the domain is the channel id.
    bytes32 public constant CHANNEL_CONFIG_TYPEHASH = keccak256(
        "ChannelConfig(address payer,address payerAuthorizer,address receiver,address receiverAuthorizer,address token,uint40 withdrawDelay,bytes32 salt)"
    );
    /// @notice EIP-712 typehash of the payer's cumulative voucher.
    bytes32 public constant VOUCHER_TYPEHASH = keccak256("Voucher(bytes32 channelId,uint128 maxClaimableAmount)");
    /// @notice EIP-712 typehash of the receiverAuthorizer's refund authorisation.
    bytes32 public constant REFUND_TYPEHASH = keccak256("Refund(bytes32 channelId,uint256 nonce,uint128 amount)");
    /// @notice EIP-712 typehash of one row of a claim batch.
    bytes32 public constant CLAIM_ENTRY_TYPEHASH =
        keccak256("ClaimEntry(bytes32 channelId,uint128 maxClaimableAmount,uint128 totalClaimed)");
    /// @notice EIP-712 typehash of the receiverAuthorizer's authorisation of a claim batch.
    bytes32 public constant CLAIM_BATCH_TYPEHASH = keccak256(
        "ClaimBatch(ClaimEntry[] claims)ClaimEntry(bytes32 channelId,uint128 maxClaimableAmount,uint128 totalClaimed)"
    );

    bytes32 private constant _DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 private constant _HASHED_NAME = keccak256("x402 Batch Settlement");
    bytes32 private constant _HASHED_VERSION = keccak256("1");

    /// @notice Escrow of each channel.
    mapping(bytes32 channelId => ChannelState) public channels;
    /// @notice The timed withdrawal in progress of each channel.
    mapping(bytes32 channelId => WithdrawalState) public pendingWithdrawals;
    /// @notice The nonce the next refund of each channel must carry; every refund, signed or not, advances it.
    mapping(bytes32 channelId => uint256) public refundNonce;
    /// @notice Claimed and settled totals of each receiver and token.
    mapping(address receiver => mapping(address token => ReceiverState)) public receivers;

    /// @notice A channel with no escrow received a deposit.
    event ChannelCreated(bytes32 indexed channelId, ChannelConfig config);
    /// @notice A channel that was never claimed from has no escrow left.
    event ChannelClosed(bytes32 indexed channelId, ChannelConfig config);
    /// @notice amount was deposited into the channel, whose balance is now newBalance.
    event Deposited(bytes32 indexed channelId, address indexed sender, uint128 amount, uint128 newBalance);
    /// @notice A claim raised the channel's cumulative claimed amount by claimAmount to newTotalClaimed.
    event Claimed(bytes32 indexed channelId, address indexed sender, uint128 claimAmount, uint128 newTotalClaimed);
    /// @notice settle paid amount of token to receiver.
    event Settled(address indexed receiver, address indexed token, address indexed sender, uint128 amount);
    /// @notice amount of the channel's unclaimed escrow went back to the payer.
    event Refunded(bytes32 indexed channelId, address indexed sender, uint128 amount);
    /// @notice The payer started a timed withdrawal of amount, which can finish from finalizeAfter.
    event WithdrawInitiated(bytes32 indexed channelId, uint128 amount, uint40 finalizeAfter);
    /// @notice A timed withdrawal paid amount back to the payer.
    event WithdrawFinalized(bytes32 indexed channelId, address indexed sender, uint128 amount);

    /// @notice The config names no payer, receiver, receiverAuthorizer or token.
    error InvalidChannel();
    /// @notice A deposit of zero.
    error ZeroDeposit();
    /// @notice The deposit would take the channel's balance past uint128.
    error DepositOverflow();
    /// @notice No collector was named.
    error InvalidCollector();
    /// @notice The collector did not bring exactly the deposited amount into the escrow.
    error DepositCollectionFailed();
    /// @notice The config's withdrawDelay is outside [MIN_WITHDRAW_DELAY, MAX_WITHDRAW_DELAY].
    error WithdrawDelayOutOfRange();
    /// @notice A signature (voucher, claim batch or refund) is not the expected signer's.
    error InvalidSignature();
    /// @notice A claim batch has no rows.
    error EmptyBatch();
    /// @notice The caller of claim is neither the receiver nor the receiverAuthorizer of a row's channel.
    error NotAuthorizedToClaim();
    /// @notice A row of a signed claim batch names another receiverAuthorizer than the batch's signer.
    error NotReceiverAuthorizer();
    /// @notice A row claims more than its voucher's maxClaimableAmount.
    error ClaimExceedsCeiling();
    /// @notice A row claims more than the channel's balance.
    error ClaimExceedsBalance();
    /// @notice The caller of refund is neither the receiver nor the receiverAuthorizer.
    error NotAuthorizedToRefund();
    /// @notice A refund of zero.
    error ZeroRefund();
    /// @notice A signed refund carries another nonce than refundNonce(channelId): replayed or out of order.
    error InvalidRefundNonce();
    /// @notice The caller is neither the payer nor the payerAuthorizer.
    error NotPayer();
    /// @notice A withdrawal of zero.
    error NothingToWithdraw();
    /// @notice The withdrawal asks for more than the channel's unclaimed escrow.
    error WithdrawAmountExceedsAvailable();
    /// @notice The channel has a timed withdrawal in progress already.
    error WithdrawalAlreadyPending();
    /// @notice The channel has no timed withdrawal in progress.
    error WithdrawalNotPending();
    /// @notice The channel's withdrawDelay has not passed since the withdrawal was initiated.
    error WithdrawDelayNotElapsed();

    // ---------------------------------------------------------------------------------------------------------
    // Deposits
    // ---------------------------------------------------------------------------------------------------------

    /// @notice Deposits amount into the channel of config, pulled from config.payer by collector with the
    ///         authorisation in collectorData; anyone may send it (the facilitator pays the gas).
    /// @dev The collector is pluggable; the escrow's own token balance must grow by exactly amount, so a
    ///      collector cannot credit more than it brought. The canonical collectors only serve this contract.
    function deposit(ChannelConfig calldata config, uint128 amount, address collector, bytes calldata collectorData)
        external
        nonReentrant
    {
        if (
            config.payer == address(0) || config.receiver == address(0) || config.receiverAuthorizer == address(0)
                || config.token == address(0)
        ) revert InvalidChannel();
        if (config.withdrawDelay < MIN_WITHDRAW_DELAY || config.withdrawDelay > MAX_WITHDRAW_DELAY) {
            revert WithdrawDelayOutOfRange();
        }
        if (amount == 0) revert ZeroDeposit();
        if (collector == address(0)) revert InvalidCollector();

        bytes32 channelId = getChannelId(config);
        ChannelState storage ch = channels[channelId];
        uint128 before = ch.balance;
        if (amount > type(uint128).max - before) revert DepositOverflow();

        IERC20 token = IERC20(config.token);
        uint256 held = token.balanceOf(address(this));
        IDepositCollector(collector).collect(config.payer, config.token, amount, channelId, collectorData);
        if (token.balanceOf(address(this)) != held + amount) revert DepositCollectionFailed();

        ch.balance = before + amount;
        if (before == ch.totalClaimed) emit ChannelCreated(channelId, config);
        emit Deposited(channelId, msg.sender, amount, before + amount);
    }

    // ---------------------------------------------------------------------------------------------------------
    // Claims and settlement
    // ---------------------------------------------------------------------------------------------------------

    /// @notice Applies voucher claims sent by the receiver or receiverAuthorizer of every row's channel.
    function claim(VoucherClaim[] calldata voucherClaims) external nonReentrant {
        if (voucherClaims.length == 0) revert EmptyBatch();
        for (uint256 i; i < voucherClaims.length; ++i) {
            ChannelConfig calldata c = voucherClaims[i].voucher.channel;
            if (msg.sender != c.receiver && msg.sender != c.receiverAuthorizer) revert NotAuthorizedToClaim();
            _applyClaim(voucherClaims[i]);
        }
    }

    /// @notice Applies voucher claims authorised by the EIP-712 ClaimBatch signature of their common
    ///         receiverAuthorizer; anyone may relay it.
    function claimWithSignature(VoucherClaim[] calldata voucherClaims, bytes calldata authorizerSignature)
        external
        nonReentrant
    {
        if (voucherClaims.length == 0) revert EmptyBatch();
        address authorizer = voucherClaims[0].voucher.channel.receiverAuthorizer;
        for (uint256 i = 1; i < voucherClaims.length; ++i) {
            if (voucherClaims[i].voucher.channel.receiverAuthorizer != authorizer) revert NotReceiverAuthorizer();
        }
        if (!SignatureChecker.isValidSignatureNow(authorizer, getClaimBatchDigest(voucherClaims), authorizerSignature))
        {
            revert InvalidSignature();
        }
        for (uint256 i; i < voucherClaims.length; ++i) {
            _applyClaim(voucherClaims[i]);
        }
    }

    /// @notice Pays receiver everything claimed for it in token and not yet paid; anyone may call it.
    function settle(address receiver, address token) external nonReentrant {
        ReceiverState storage rs = receivers[receiver][token];
        uint128 amount = rs.totalClaimed - rs.totalSettled;
        if (amount == 0) return;
        rs.totalSettled = rs.totalClaimed;
        IERC20(token).safeTransfer(receiver, amount);
        emit Settled(receiver, token, msg.sender, amount);
    }

    /// @dev Raises the channel's cumulative claimed amount to the row's totalClaimed. A row at or below what is
    ///      claimed already changes nothing and is skipped without a revert: cumulative amounts make replays
    ///      harmless, and an older batch mined after a newer one must neither undo nor block it.
    function _applyClaim(VoucherClaim calldata row) private {
        ChannelConfig calldata c = row.voucher.channel;
        uint128 target = row.totalClaimed;
        if (target > row.voucher.maxClaimableAmount) revert ClaimExceedsCeiling();
        bytes32 channelId = getChannelId(c);
        ChannelState storage ch = channels[channelId];
        uint128 claimed = ch.totalClaimed;
        if (target <= claimed) return;
        if (target > ch.balance) revert ClaimExceedsBalance();
        if (!_voucherSignedByPayer(c, getVoucherDigest(channelId, row.voucher.maxClaimableAmount), row.signature)) {
            revert InvalidSignature();
        }
        uint128 delta = target - claimed;
        ch.totalClaimed = target;
        receivers[c.receiver][c.token].totalClaimed += delta;
        emit Claimed(channelId, msg.sender, delta, target);
    }

    /// @dev A payerAuthorizer is an EOA committed in the config: plain ECDSA against it, which the server can
    ///      check off chain with no RPC. Without one, the payer itself signs: by its key (ECDSA) whatever code its
    ///      account has, or, for a contract, by ERC-1271. The key's signature is honoured first and regardless of
    ///      code because a server accepted it off chain while the payer had none: an EIP-7702 delegation made
    ///      afterwards (to code that refuses isValidSignature) must not revoke vouchers whose responses were served.
    function _voucherSignedByPayer(ChannelConfig calldata c, bytes32 digest, bytes calldata signature)
        private
        view
        returns (bool)
    {
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecover(digest, signature);
        if (c.payerAuthorizer != address(0)) {
            return err == ECDSA.RecoverError.NoError && signer == c.payerAuthorizer;
        }
        if (err == ECDSA.RecoverError.NoError && signer == c.payer) return true;
        return c.payer.code.length != 0 && SignatureChecker.isValidERC1271SignatureNow(c.payer, digest, signature);
    }

    // ---------------------------------------------------------------------------------------------------------
    // Refunds (receiver side) and timed withdrawals (payer side)
    // ---------------------------------------------------------------------------------------------------------

    /// @notice Returns up to amount of the channel's unclaimed escrow to the payer; only the receiver or the
    ///         receiverAuthorizer may call it.
    function refund(ChannelConfig calldata config, uint128 amount) external nonReentrant {
        if (msg.sender != config.receiver && msg.sender != config.receiverAuthorizer) revert NotAuthorizedToRefund();
        _refund(config, getChannelId(config), amount);
    }

    /// @notice Returns up to amount of the channel's unclaimed escrow to the payer, authorised by the
    ///         receiverAuthorizer's EIP-712 Refund signature for the channel's current refund nonce; anyone may
    ///         relay it, once.
    function refundWithSignature(
        ChannelConfig calldata config,
        uint128 amount,
        uint256 nonce,
        bytes calldata receiverAuthorizerSignature
    ) external nonReentrant {
        bytes32 channelId = getChannelId(config);
        if (nonce != refundNonce[channelId]) revert InvalidRefundNonce();
        if (
            !SignatureChecker.isValidSignatureNow(
                config.receiverAuthorizer, getRefundDigest(channelId, nonce, amount), receiverAuthorizerSignature
            )
        ) revert InvalidSignature();
        _refund(config, channelId, amount);
    }

    /// @dev The nonce advances first, whatever moves, so a signature is good for one refund only. The amount is
    ///      capped at the unclaimed escrow; a pending withdrawal shrinks by what the refund returned, and ends when
    ///      the refund covered it.
    function _refund(ChannelConfig calldata config, bytes32 channelId, uint128 amount) private {
        if (amount == 0) revert ZeroRefund();
        ++refundNonce[channelId];
        ChannelState storage ch = channels[channelId];
        uint128 available = ch.balance - ch.totalClaimed;
        uint128 paid = amount < available ? amount : available;
        if (paid == 0) return;
        ch.balance -= paid;
        WithdrawalState storage ws = pendingWithdrawals[channelId];
        if (ws.initiatedAt != 0) {
            if (paid >= ws.amount) delete pendingWithdrawals[channelId];
            else ws.amount -= paid;
        }
        IERC20(config.token).safeTransfer(config.payer, paid);
        emit Refunded(channelId, msg.sender, paid);
        _closedIfEmpty(config, channelId, ch);
    }

    /// @notice Starts a timed withdrawal of amount of the channel's unclaimed escrow; only the payer or the
    ///         payerAuthorizer may call it. The receiver side keeps withdrawDelay seconds to claim.
    function initiateWithdraw(ChannelConfig calldata config, uint128 amount) external nonReentrant {
        _onlyPayer(config);
        if (amount == 0) revert NothingToWithdraw();
        bytes32 channelId = getChannelId(config);
        WithdrawalState storage ws = pendingWithdrawals[channelId];
        if (ws.initiatedAt != 0) revert WithdrawalAlreadyPending();
        ChannelState storage ch = channels[channelId];
        if (amount > ch.balance - ch.totalClaimed) revert WithdrawAmountExceedsAvailable();
        uint40 now40 = uint40(block.timestamp);
        ws.amount = amount;
        ws.initiatedAt = now40;
        emit WithdrawInitiated(channelId, amount, now40 + config.withdrawDelay);
    }

    /// @notice Finishes a timed withdrawal once withdrawDelay has passed: pays the payer what was asked, capped at
    ///         what is still unclaimed; only the payer or the payerAuthorizer may call it.
    function finalizeWithdraw(ChannelConfig calldata config) external nonReentrant {
        _onlyPayer(config);
        bytes32 channelId = getChannelId(config);
        WithdrawalState memory ws = pendingWithdrawals[channelId];
        if (ws.initiatedAt == 0) revert WithdrawalNotPending();
        if (block.timestamp < uint256(ws.initiatedAt) + config.withdrawDelay) revert WithdrawDelayNotElapsed();
        delete pendingWithdrawals[channelId];
        ChannelState storage ch = channels[channelId];
        uint128 available = ch.balance - ch.totalClaimed;
        uint128 paid = ws.amount < available ? ws.amount : available;
        if (paid > 0) {
            ch.balance -= paid;
            IERC20(config.token).safeTransfer(config.payer, paid);
        }
        emit WithdrawFinalized(channelId, msg.sender, paid);
        if (paid > 0) _closedIfEmpty(config, channelId, ch);
    }

    function _onlyPayer(ChannelConfig calldata config) private view {
        if (msg.sender != config.payer && (config.payerAuthorizer == address(0) || msg.sender != config.payerAuthorizer))
        {
            revert NotPayer();
        }
    }

    function _closedIfEmpty(ChannelConfig calldata config, bytes32 channelId, ChannelState storage ch) private {
        if (ch.balance == 0 && ch.totalClaimed == 0) emit ChannelClosed(channelId, config);
    }

    // ---------------------------------------------------------------------------------------------------------
    // EIP-712
    // ---------------------------------------------------------------------------------------------------------

    /// @notice The EIP-712 domain separator of channel ids, vouchers, refunds and claim batches on this chain.
    // solhint-disable-next-line func-name-mixedcase
    function DOMAIN_SEPARATOR() public view returns (bytes32) {
        return keccak256(abi.encode(_DOMAIN_TYPEHASH, _HASHED_NAME, _HASHED_VERSION, block.chainid, address(this)));
    }

    /// @notice The channel id of config: its EIP-712 typed-data hash under this contract's domain.
    function getChannelId(ChannelConfig calldata config) public view returns (bytes32) {
        return _typedDataHash(
            keccak256(
                abi.encode(
                    CHANNEL_CONFIG_TYPEHASH,
                    config.payer,
                    config.payerAuthorizer,
                    config.receiver,
                    config.receiverAuthorizer,
                    config.token,
                    config.withdrawDelay,
                    config.salt
                )
            )
        );
    }

    /// @notice The digest a payer signs for a voucher of channelId up to maxClaimableAmount.
    function getVoucherDigest(bytes32 channelId, uint128 maxClaimableAmount) public view returns (bytes32) {
        return _typedDataHash(keccak256(abi.encode(VOUCHER_TYPEHASH, channelId, maxClaimableAmount)));
    }

    /// @notice The digest a receiverAuthorizer signs to refund amount of channelId at refund nonce nonce.
    function getRefundDigest(bytes32 channelId, uint256 nonce, uint128 amount) public view returns (bytes32) {
        return _typedDataHash(keccak256(abi.encode(REFUND_TYPEHASH, channelId, nonce, amount)));
    }

    /// @notice The digest a receiverAuthorizer signs to authorise a claim batch: ClaimBatch(ClaimEntry[] claims)
    ///         with one ClaimEntry(channelId, maxClaimableAmount, totalClaimed) per row.
    function getClaimBatchDigest(VoucherClaim[] calldata voucherClaims) public view returns (bytes32) {
        bytes32[] memory entries = new bytes32[](voucherClaims.length);
        for (uint256 i; i < voucherClaims.length; ++i) {
            entries[i] = keccak256(
                abi.encode(
                    CLAIM_ENTRY_TYPEHASH,
                    getChannelId(voucherClaims[i].voucher.channel),
                    voucherClaims[i].voucher.maxClaimableAmount,
                    voucherClaims[i].totalClaimed
                )
            );
        }
        return _typedDataHash(keccak256(abi.encode(CLAIM_BATCH_TYPEHASH, keccak256(abi.encodePacked(entries)))));
    }

    function _typedDataHash(bytes32 structHash) private view returns (bytes32) {
        return keccak256(abi.encodePacked("\x19\x01", DOMAIN_SEPARATOR(), structHash));
    }
}
