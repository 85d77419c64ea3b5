// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20} from "@openzeppelin/contracts/token/ERC20/IERC20.sol";
import {IERC1271} from "@openzeppelin/contracts/interfaces/IERC1271.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";

/// @title SmartWallet
/// @notice A minimal ERC-1271 contract wallet for tests: one owner key signs for it. At creation it may approve
///         one spender (Permit2) for one token, as smart wallets batch an approval into their first operation.
contract SmartWallet is IERC1271 {
    address public immutable owner;

    constructor(address owner_, address token, address spender) {
        owner = owner_;
        if (token != address(0)) {
            IERC20(token).approve(spender, type(uint256).max);
        }
    }

    /// @notice ERC-1271: the magic value when owner's key signed hash, 0xffffffff otherwise.
    function isValidSignature(bytes32 hash, bytes calldata signature) external view returns (bytes4) {
        (address signer, ECDSA.RecoverError err,) = ECDSA.tryRecover(hash, signature);
        if (err == ECDSA.RecoverError.NoError && signer == owner) {
            return IERC1271.isValidSignature.selector;
        }
        return 0xffffffff;
    }

    /// @notice Runs a call from the wallet; only the owner may.
    function execute(address target, bytes calldata data) external returns (bytes memory) {
        require(msg.sender == owner, "SmartWallet: only the owner");
        (bool ok, bytes memory ret) = target.call(data);
        if (!ok) {
            assembly {
                revert(add(ret, 32), mload(ret))
            }
        }
        return ret;
    }
}

/// @title SmartWalletFactory
/// @notice Creates SmartWallets at CREATE2 addresses known before they exist: the counterfactual wallets whose
///         signatures ERC-6492 wraps with this factory and the createAccount calldata.
contract SmartWalletFactory {
    /// @notice Creates the wallet, or returns it when it exists already.
    function createAccount(address owner, address token, address spender, uint256 salt) external returns (address) {
        address wallet = accountAddress(owner, token, spender, salt);
        if (wallet.code.length > 0) {
            return wallet;
        }
        return address(new SmartWallet{salt: bytes32(salt)}(owner, token, spender));
    }

    /// @notice The address createAccount gives for these arguments.
    function accountAddress(address owner, address token, address spender, uint256 salt)
        public
        view
        returns (address)
    {
        bytes32 codeHash = keccak256(abi.encodePacked(type(SmartWallet).creationCode, abi.encode(owner, token, spender)));
        return address(uint160(uint256(keccak256(abi.encodePacked(bytes1(0xff), address(this), bytes32(salt), codeHash)))));
    }
}
