// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

/// @title Multicall3
/// @notice Our own implementation of the two batch-read functions of the canonical Multicall3
/// (0xcA11bde05977b3631167028862bE2a173976CA11), ABI-compatible with it: tryAggregate, which the public
/// TypeScript x402 SDK's facilitators call (through eth_call) to read a channel's state, a payer's balance and
/// diagnostics in one request, and aggregate3, which viem's multicall sends. A dev chain places its runtime code
/// at the canonical address in genesis.
/// @dev Each call is a plain CALL from this contract, in order, value 0: a call sees what the calls before it
/// changed (the SDK simulates a counterfactual wallet's deployment, then its deposit, in one eth_call). No
/// storage and no immutables, so the runtime code can go into a genesis.
contract Multicall3 {
    struct Call {
        address target;
        bytes callData;
    }

    struct Call3 {
        address target;
        bool allowFailure;
        bytes callData;
    }

    struct Result {
        bool success;
        bytes returnData;
    }

    /// @notice Call index reverted where its failure was not allowed. (A call to an account without code
    /// succeeds with nothing returned, as in the canonical contract: the caller's decoding tells.)
    error CallFailed(uint256 index);

    /// @notice Runs every call; with requireSuccess, any failing call reverts the whole, else each result
    /// says whether its call succeeded and carries what it returned (its revert data when it failed).
    function tryAggregate(bool requireSuccess, Call[] calldata calls)
        external
        payable
        returns (Result[] memory returnData)
    {
        returnData = new Result[](calls.length);
        for (uint256 i = 0; i < calls.length; i++) {
            (bool success, bytes memory ret) = calls[i].target.call(calls[i].callData);
            if (requireSuccess && !success) revert CallFailed(i);
            returnData[i] = Result(success, ret);
        }
    }

    /// @notice Runs every call; a failing call reverts the whole unless its allowFailure is set.
    function aggregate3(Call3[] calldata calls) external payable returns (Result[] memory returnData) {
        returnData = new Result[](calls.length);
        for (uint256 i = 0; i < calls.length; i++) {
            (bool success, bytes memory ret) = calls[i].target.call(calls[i].callData);
            if (!success && !calls[i].allowFailure) revert CallFailed(i);
            returnData[i] = Result(success, ret);
        }
    }
}
