// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20Permit} from "@openzeppelin/contracts/token/ERC20/extensions/IERC20Permit.sol";

import {Permit2} from "./Permit2.sol";

/// @title Permit2DepositCollector
/// @notice Pulls a batch-settlement deposit through Permit2 with the payer's PermitWitnessTransferFrom (spender this
///         collector, witness DepositWitness(bytes32 channelId)) straight into X402BatchSettlement, which alone may
///         call it.
/// @dev ABI-compatible with the public Permit2DepositCollector as the @x402/evm 2.27 SDK drives it: collectorData is
///      abi.encode(uint256 nonce, uint256 deadline, bytes permit2Signature, bytes eip2612PermitData), the last
///      empty or abi.encode(uint256 value, uint256 deadline, uint8 v, bytes32 r, bytes32 s), a permit of the token
///      approving Permit2 that is tried first (a failing one is tolerated: the allowance may be there already).
///      Only the escrow may call collect: the payer's signature binds the channel, not the destination, which is
///      the caller. No immutables, so the runtime code can be placed into a genesis at
///      0x4020425FAf3B746C082C2f942b4E5159887B0005.
contract Permit2DepositCollector {
    /// @notice The only caller: the canonical X402BatchSettlement.
    address public constant BATCH_SETTLEMENT = 0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003;
    /// @notice The canonical Permit2 this collector spends through.
    Permit2 public constant PERMIT2 = Permit2(0x000000000022D473030F116dDEE9F6B43aC78BA3);
    /// @notice The witness tail handed to Permit2; types after the primary type are in alphabetical order.
    string public constant WITNESS_TYPE_STRING =
        "DepositWitness witness)DepositWitness(bytes32 channelId)TokenPermissions(address token,uint256 amount)";
    /// @notice The EIP-712 typehash of DepositWitness.
    bytes32 public constant WITNESS_TYPEHASH = keccak256("DepositWitness(bytes32 channelId)");

    /// @notice collect was called by someone other than X402BatchSettlement.
    error OnlyBatchSettlement();

    /// @notice Moves amount of token from payer to the caller (the escrow) under the payer's Permit2 signature.
    function collect(address payer, address token, uint256 amount, bytes32 channelId, bytes calldata collectorData)
        external
    {
        if (msg.sender != BATCH_SETTLEMENT) revert OnlyBatchSettlement();
        (uint256 nonce, uint256 deadline, bytes memory signature, bytes memory permitData) =
            abi.decode(collectorData, (uint256, uint256, bytes, bytes));
        if (permitData.length > 0) _tryPermit(payer, token, permitData);
        PERMIT2.permitWitnessTransferFrom(
            Permit2.PermitTransferFrom({
                permitted: Permit2.TokenPermissions({token: token, amount: amount}),
                nonce: nonce,
                deadline: deadline
            }),
            Permit2.SignatureTransferDetails({to: msg.sender, requestedAmount: amount}),
            payer,
            keccak256(abi.encode(WITNESS_TYPEHASH, channelId)),
            WITNESS_TYPE_STRING,
            signature
        );
    }

    /// @dev Submits the payer's EIP-2612 permit approving Permit2. A failing one (used already, front-run, a token
    ///      without EIP-2612) is tolerated: the transfer still succeeds if the allowance suffices.
    function _tryPermit(address payer, address token, bytes memory permitData) private {
        (uint256 value, uint256 deadline, uint8 v, bytes32 r, bytes32 s) =
            abi.decode(permitData, (uint256, uint256, uint8, bytes32, bytes32));
        try IERC20Permit(token).permit(payer, address(PERMIT2), value, deadline, v, r, s) {} catch {}
    }
}
