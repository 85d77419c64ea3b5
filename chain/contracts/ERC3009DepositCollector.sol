// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {SafeERC20} from "@openzeppelin/contracts/token/ERC20/utils/SafeERC20.sol";

/// @notice The EIP-3009 receive half a USDC-like token offers (bytes-signature form, as FiatToken v2.2).
interface IERC3009Receive {
    function receiveWithAuthorization(
        address from,
        address to,
        uint256 value,
        uint256 validAfter,
        uint256 validBefore,
        bytes32 nonce,
        bytes memory signature
    ) external;
}

/// @title ERC3009DepositCollector
/// @notice Pulls a batch-settlement deposit with the payer's EIP-3009 ReceiveWithAuthorization (to this collector)
///         and hands it to X402BatchSettlement, which alone may call it.
/// @dev ABI-compatible with the public ERC3009DepositCollector as the @x402/evm 2.27 SDK drives it:
///      collectorData is abi.encode(uint256 validAfter, uint256 validBefore, uint256 salt, bytes signature) and the
///      authorization's nonce is keccak256(abi.encode(channelId, salt)), which binds the signed transfer to one
///      channel. Only the escrow may call collect: the authorization names this collector as its payee, so anyone
///      else calling it with a payer's signature would receive the payer's tokens. No immutables, so the runtime
///      code can be placed into a genesis at 0x4020806089470a89826cB9fB1f4059150b550004.
contract ERC3009DepositCollector {
    using SafeERC20 for IERC20;

    /// @notice The only caller: the canonical X402BatchSettlement.
    address public constant BATCH_SETTLEMENT = 0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003;

    /// @notice collect was called by someone other than X402BatchSettlement.
    error OnlyBatchSettlement();

    /// @notice Moves amount of token from payer to the caller (the escrow) under the payer's ReceiveWithAuthorization.
    function collect(address payer, address token, uint256 amount, bytes32 channelId, bytes calldata collectorData)
        external
    {
        if (msg.sender != BATCH_SETTLEMENT) revert OnlyBatchSettlement();
        (uint256 validAfter, uint256 validBefore, uint256 salt, bytes memory signature) =
            abi.decode(collectorData, (uint256, uint256, uint256, bytes));
        IERC3009Receive(token).receiveWithAuthorization(
            payer, address(this), amount, validAfter, validBefore, keccak256(abi.encode(channelId, salt)), signature
        );
        IERC20(token).safeTransfer(msg.sender, amount);
    }
}
