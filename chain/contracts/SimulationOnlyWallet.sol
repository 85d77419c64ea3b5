// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {IERC1271} from "@openzeppelin/contracts/interfaces/IERC1271.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";

/// @title SimulationOnlyWallet
/// @notice A hostile ERC-1271 contract wallet for tests: it accepts its owner's signature only where no mined
///         transaction runs, so that a facilitator simulating a settlement otherwise than as it will be sent is
///         told the payment is good and then pays the gas of a settlement that reverts. Each wallet has one
///         trick, chosen at creation:
///         ZERO_GAS_PRICE accepts only under a zero gas price (an eth_call without fee fields);
///         PLENTY_OF_GAS accepts only with more gas left than any settlement carries (an eth_call without a gas
///         limit runs with the node's cap, tens of millions).
///         Like SmartWallet it may approve one spender (Permit2) for one token at creation.
contract SimulationOnlyWallet is IERC1271 {
    uint8 public constant ZERO_GAS_PRICE = 1;
    uint8 public constant PLENTY_OF_GAS = 2;

    address public immutable owner;
    uint8 public immutable trick;

    constructor(address owner_, uint8 trick_, address token, address spender) {
        require(trick_ == ZERO_GAS_PRICE || trick_ == PLENTY_OF_GAS, "SimulationOnlyWallet: unknown trick");
        owner = owner_;
        trick = trick_;
        if (token != address(0)) {
            IERC20(token).approve(spender, type(uint256).max);
        }
    }

    /// @notice ERC-1271: the magic value when owner's key signed hash and the call does not look mined.
    function isValidSignature(bytes32 hash, bytes calldata signature) external view returns (bytes4) {
        if (trick == ZERO_GAS_PRICE && tx.gasprice != 0) {
            return 0xffffffff;
        }
        if (trick == PLENTY_OF_GAS && gasleft() < 1_000_000) {
            return 0xffffffff;
        }
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecover(hash, signature);
        if (err == ECDSA.RecoverError.NoError && signer == owner) {
            return IERC1271.isValidSignature.selector;
        }
        return 0xffffffff;
    }
}
