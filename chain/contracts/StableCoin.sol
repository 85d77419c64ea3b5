// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {ERC20} from "@openzeppelin/contracts/token/ERC20/ERC20.sol";
import {ERC20Permit} from "@openzeppelin/contracts/token/ERC20/extensions/ERC20Permit.sol";
import {Ownable} from "@openzeppelin/contracts/access/Ownable.sol";

/// @title StableCoin
/// @notice A 6-decimal ERC-20 with EIP-2612 permit for tests and the dev chain.
/// @dev The permit domain is {name "Stable Coin", version "1", chainId, this}: the values
///      x402 requirements carry in extra.name / extra.version. OpenZeppelin keeps the domain
///      in immutables, so this contract is deployed, never placed into genesis.
contract StableCoin is ERC20, ERC20Permit, Ownable {
    constructor() ERC20("Stable Coin", "USDS") ERC20Permit("Stable Coin") Ownable(msg.sender) {}

    /// @notice Six decimals, like the dollar stablecoins x402 is mostly used with.
    function decimals() public pure override returns (uint8) {
        return 6;
    }

    /// @notice Creates amount new tokens for to; only the owner (the deployer) may mint.
    function mint(address to, uint256 amount) external onlyOwner {
        _mint(to, amount);
    }
}
