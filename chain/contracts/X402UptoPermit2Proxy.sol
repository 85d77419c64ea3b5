// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

import {IERC20Permit} from "@openzeppelin/contracts/token/ERC20/extensions/IERC20Permit.sol";
import {ReentrancyGuardTransient} from "@openzeppelin/contracts/utils/ReentrancyGuardTransient.sol";

import {Permit2} from "./Permit2.sol";

/// @title X402UptoPermit2Proxy
/// @notice The spender of x402 `upto` Permit2 payments: the payer signs a maximum, and the facilitator the
///         payer named in the signed witness settles any amount up to it, to the address the witness names.
///         Nobody else can submit the settlement, so a resource server's facilitator alone decides the amount
///         within the payer's bound, and neither the recipient nor the bound can change.
/// @dev ABI-compatible with the public x402UptoPermit2Proxy
///      (witness Witness(address to,address facilitator,uint256 validAfter)). Permit2 is a constant and the
///      reentrancy guard lives in transient storage, so the runtime code can be placed into a genesis at
///      0x4020A4f3b7b90ccA423B9fabCc0CE57C6C240002.
contract X402UptoPermit2Proxy is ReentrancyGuardTransient {
    /// @notice The canonical Permit2 this proxy spends through.
    Permit2 public constant PERMIT2 = Permit2(0x000000000022D473030F116dDEE9F6B43aC78BA3);

    /// @notice The witness tail handed to Permit2; types after the primary type are in alphabetical order.
    string public constant WITNESS_TYPE_STRING =
        "Witness witness)TokenPermissions(address token,uint256 amount)Witness(address to,address facilitator,uint256 validAfter)";

    /// @notice The EIP-712 typehash of Witness.
    bytes32 public constant WITNESS_TYPEHASH = keccak256("Witness(address to,address facilitator,uint256 validAfter)");

    /// @notice Binds the destination, the one address allowed to settle, and the earliest settlement time into
    ///         the payer's signature.
    struct Witness {
        address to;
        address facilitator;
        uint256 validAfter;
    }

    /// @notice An EIP-2612 permit approving Permit2, grouped to keep the stack shallow.
    struct EIP2612Permit {
        uint256 value;
        uint256 deadline;
        bytes32 r;
        bytes32 s;
        uint8 v;
    }

    /// @notice Emitted after a settle() transfer.
    event Settled();
    /// @notice Emitted after a settleWithPermit() transfer.
    event SettledWithPermit();

    /// @notice The amount to settle is above the permitted maximum.
    error AmountExceedsPermitted();
    /// @notice The witness destination is the zero address.
    error InvalidDestination();
    /// @notice The owner is the zero address.
    error InvalidOwner();
    /// @notice block.timestamp is before witness.validAfter.
    error PaymentTooEarly();
    /// @notice The EIP-2612 permit value differs from the Permit2 permitted amount.
    error Permit2612AmountMismatch();
    /// @notice The sender is not the facilitator the payer named in the witness.
    error UnauthorizedFacilitator();

    /// @notice Transfers amount (at most permit.permitted.amount) from owner to witness.to through Permit2.
    function settle(
        Permit2.PermitTransferFrom calldata permit,
        uint256 amount,
        address owner,
        Witness calldata witness,
        bytes calldata signature
    ) external nonReentrant {
        _settle(permit, amount, owner, witness, signature);
        emit Settled();
    }

    /// @notice Submits the payer's EIP-2612 permit for Permit2 first, then settles like settle().
    /// @dev The permit's value must be the permitted maximum, which is what the payer signed it for. A failing
    ///      permit (already used, front-run, token without EIP-2612) is tolerated: the transfer still succeeds
    ///      if the allowance to Permit2 already suffices.
    function settleWithPermit(
        EIP2612Permit calldata permit2612,
        Permit2.PermitTransferFrom calldata permit,
        uint256 amount,
        address owner,
        Witness calldata witness,
        bytes calldata signature
    ) external nonReentrant {
        if (permit2612.value != permit.permitted.amount) revert Permit2612AmountMismatch();
        try IERC20Permit(permit.permitted.token).permit(
            owner, address(PERMIT2), permit2612.value, permit2612.deadline, permit2612.v, permit2612.r, permit2612.s
        ) {} catch {}
        _settle(permit, amount, owner, witness, signature);
        emit SettledWithPermit();
    }

    function _settle(
        Permit2.PermitTransferFrom calldata permit,
        uint256 amount,
        address owner,
        Witness calldata witness,
        bytes calldata signature
    ) private {
        // Only the facilitator the payer named may choose the amount: anyone else could settle the maximum.
        if (msg.sender != witness.facilitator) revert UnauthorizedFacilitator();
        if (amount > permit.permitted.amount) revert AmountExceedsPermitted();
        if (owner == address(0)) revert InvalidOwner();
        if (witness.to == address(0)) revert InvalidDestination();
        // The upper bound is Permit2's deadline.
        if (block.timestamp < witness.validAfter) revert PaymentTooEarly();

        bytes32 witnessHash =
            keccak256(abi.encode(WITNESS_TYPEHASH, witness.to, witness.facilitator, witness.validAfter));
        PERMIT2.permitWitnessTransferFrom(
            permit,
            Permit2.SignatureTransferDetails({to: witness.to, requestedAmount: amount}),
            owner,
            witnessHash,
            WITNESS_TYPE_STRING,
            signature
        );
    }
}
