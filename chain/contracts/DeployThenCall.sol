// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

/// @title DeployThenCall
/// @notice Never deployed: the facilitator runs its creation code in an eth_call with no `to`, and reads the
///         constructor's return data. It first deploys a counterfactual (ERC-6492) wallet through its factory,
///         when the wallet has no code yet, then makes each call and returns abi.encode(bool[] ok, bytes[] ret):
///         a signature check (isValidSignature) or a settlement simulated in the state where the wallet exists.
/// @dev The calls come from this contract's own address; the settlement functions it simulates
///      (transferWithAuthorization, the proxy's settle) do not depend on the caller.
contract DeployThenCall {
    error WalletDeploymentFailed(bytes reason);

    constructor(address wallet, address factory, bytes memory factoryData, address[] memory targets, bytes[] memory data) {
        if (factory != address(0) && wallet.code.length == 0) {
            (bool deployed, bytes memory reason) = factory.call(factoryData);
            if (!deployed || wallet.code.length == 0) {
                revert WalletDeploymentFailed(reason);
            }
        }
        bool[] memory oks = new bool[](targets.length);
        bytes[] memory rets = new bytes[](targets.length);
        for (uint256 i = 0; i < targets.length; i++) {
            (oks[i], rets[i]) = targets[i].call(data[i]);
        }
        bytes memory out = abi.encode(oks, rets);
        assembly {
            return(add(out, 32), mload(out))
        }
    }
}
