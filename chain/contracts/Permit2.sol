// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.30;

/// @title Permit2
/// @notice The SignatureTransfer half of Uniswap's Permit2, hash for hash: payers sign
///         EIP-712 permits (optionally with a witness) and the named spender moves their
///         tokens once, guarded by unordered nonces.
/// @dev The contract has no immutables and no constructor-set storage, so its runtime code
///      can be placed into a genesis at the canonical address 0x000000000022D473030F116dDEE9F6B43aC78BA3
///      and still compute the right domain separator from block.chainid and address(this).
///      Unlike Uniswap's deployment it refuses malleable (high-s) signatures and v other
///      than 27/28; EIP-2098 64-byte signatures and EIP-1271 contract owners are accepted.
contract Permit2 {
    /// @notice The token and the most the spender may take.
    struct TokenPermissions {
        address token;
        uint256 amount;
    }

    /// @notice A signed permission for one transfer.
    struct PermitTransferFrom {
        TokenPermissions permitted;
        uint256 nonce;
        uint256 deadline;
    }

    /// @notice Where the spender sends the tokens and how many, chosen at transfer time.
    struct SignatureTransferDetails {
        address to;
        uint256 requestedAmount;
    }

    /// @notice The permit's deadline has passed.
    error SignatureExpired(uint256 signatureDeadline);
    /// @notice The nonce was already used or invalidated.
    error InvalidNonce();
    /// @notice The requested amount exceeds the permitted amount.
    error InvalidAmount(uint256 maxAmount);
    /// @notice The signature is neither 64 nor 65 bytes long.
    error InvalidSignatureLength();
    /// @notice The signature does not recover to any address (or is malleable, or has a bad v).
    error InvalidSignature();
    /// @notice The signature recovers to someone other than the owner.
    error InvalidSigner();
    /// @notice The owner is a contract and refused the signature (EIP-1271).
    error InvalidContractSignature();
    /// @notice The token's transferFrom failed or returned false.
    error TransferFromFailed();

    /// @notice Emitted when an owner invalidates nonces ahead of use.
    event UnorderedNonceInvalidation(address indexed owner, uint256 word, uint256 mask);

    bytes32 private constant _TYPE_HASH = keccak256("EIP712Domain(string name,uint256 chainId,address verifyingContract)");
    bytes32 private constant _HASHED_NAME = keccak256("Permit2");

    bytes32 private constant _TOKEN_PERMISSIONS_TYPEHASH = keccak256("TokenPermissions(address token,uint256 amount)");
    bytes32 private constant _PERMIT_TRANSFER_FROM_TYPEHASH = keccak256(
        "PermitTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline)TokenPermissions(address token,uint256 amount)"
    );
    string private constant _PERMIT_TRANSFER_FROM_WITNESS_TYPEHASH_STUB =
        "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,";

    // secp256k1n / 2: signatures with a larger s have a twin and are refused (EIP-2).
    uint256 private constant _HALF_N = 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0;

    /// @notice Bitmaps of used nonces: owner => word position => bits.
    mapping(address => mapping(uint256 => uint256)) public nonceBitmap;

    /// @notice The EIP-712 domain separator for this chain and address.
    function DOMAIN_SEPARATOR() public view returns (bytes32) {
        return keccak256(abi.encode(_TYPE_HASH, _HASHED_NAME, block.chainid, address(this)));
    }

    /// @notice Transfers tokens with a signed permit whose spender is msg.sender.
    function permitTransferFrom(
        PermitTransferFrom calldata permit,
        SignatureTransferDetails calldata transferDetails,
        address owner,
        bytes calldata signature
    ) external {
        bytes32 tokenPermissions = keccak256(abi.encode(_TOKEN_PERMISSIONS_TYPEHASH, permit.permitted));
        bytes32 dataHash = keccak256(
            abi.encode(_PERMIT_TRANSFER_FROM_TYPEHASH, tokenPermissions, msg.sender, permit.nonce, permit.deadline)
        );
        _permitTransferFrom(permit, transferDetails, owner, dataHash, signature);
    }

    /// @notice Transfers tokens with a signed permit that also commits to caller-defined witness data.
    /// @param witness the EIP-712 hash of the witness struct
    /// @param witnessTypeString the tail of the type string, starting with the witness member
    function permitWitnessTransferFrom(
        PermitTransferFrom calldata permit,
        SignatureTransferDetails calldata transferDetails,
        address owner,
        bytes32 witness,
        string calldata witnessTypeString,
        bytes calldata signature
    ) external {
        bytes32 typeHash = keccak256(abi.encodePacked(_PERMIT_TRANSFER_FROM_WITNESS_TYPEHASH_STUB, witnessTypeString));
        bytes32 tokenPermissions = keccak256(abi.encode(_TOKEN_PERMISSIONS_TYPEHASH, permit.permitted));
        bytes32 dataHash =
            keccak256(abi.encode(typeHash, tokenPermissions, msg.sender, permit.nonce, permit.deadline, witness));
        _permitTransferFrom(permit, transferDetails, owner, dataHash, signature);
    }

    /// @notice Marks the bits in mask of word wordPos as used for msg.sender.
    function invalidateUnorderedNonces(uint256 wordPos, uint256 mask) external {
        nonceBitmap[msg.sender][wordPos] |= mask;
        emit UnorderedNonceInvalidation(msg.sender, wordPos, mask);
    }

    function _permitTransferFrom(
        PermitTransferFrom calldata permit,
        SignatureTransferDetails calldata transferDetails,
        address owner,
        bytes32 dataHash,
        bytes calldata signature
    ) private {
        uint256 requestedAmount = transferDetails.requestedAmount;
        if (block.timestamp > permit.deadline) revert SignatureExpired(permit.deadline);
        if (requestedAmount > permit.permitted.amount) revert InvalidAmount(permit.permitted.amount);

        _useUnorderedNonce(owner, permit.nonce);
        _verify(signature, keccak256(abi.encodePacked("\x19\x01", DOMAIN_SEPARATOR(), dataHash)), owner);
        _safeTransferFrom(permit.permitted.token, owner, transferDetails.to, requestedAmount);
    }

    function _useUnorderedNonce(address from, uint256 nonce) private {
        uint256 wordPos = nonce >> 8;
        uint256 bit = 1 << (nonce & 0xff);
        uint256 flipped = nonceBitmap[from][wordPos] ^= bit;
        if (flipped & bit == 0) revert InvalidNonce();
    }

    function _verify(bytes calldata signature, bytes32 hash, address claimedSigner) private view {
        if (claimedSigner.code.length == 0) {
            bytes32 r;
            bytes32 s;
            uint8 v;
            if (signature.length == 65) {
                (r, s) = abi.decode(signature, (bytes32, bytes32));
                v = uint8(signature[64]);
            } else if (signature.length == 64) {
                // EIP-2098 compact form: the top bit of the second word carries the y parity.
                bytes32 vs;
                (r, vs) = abi.decode(signature, (bytes32, bytes32));
                s = vs & bytes32(uint256(type(int256).max));
                v = uint8(uint256(vs >> 255)) + 27;
            } else {
                revert InvalidSignatureLength();
            }
            if (uint256(s) > _HALF_N || (v != 27 && v != 28)) revert InvalidSignature();
            address signer = ecrecover(hash, v, r, s);
            if (signer == address(0)) revert InvalidSignature();
            if (signer != claimedSigner) revert InvalidSigner();
        } else {
            (bool ok, bytes memory ret) =
                claimedSigner.staticcall(abi.encodeWithSelector(0x1626ba7e, hash, signature));
            if (!ok || ret.length != 32 || abi.decode(ret, (bytes4)) != bytes4(0x1626ba7e)) {
                revert InvalidContractSignature();
            }
        }
    }

    // Tokens that return nothing (USDT-style) count as success; ones that return false or have no
    // code do not. A token's own revert is passed through so that a simulation tells an
    // allowance shortfall from a balance shortfall.
    function _safeTransferFrom(address token, address from, address to, uint256 amount) private {
        (bool ok, bytes memory ret) = token.call(abi.encodeWithSelector(0x23b872dd, from, to, amount));
        if (!ok && ret.length > 0) {
            assembly ("memory-safe") {
                revert(add(ret, 32), mload(ret))
            }
        }
        if (!ok || (ret.length == 0 ? token.code.length == 0 : (ret.length < 32 || !abi.decode(ret, (bool))))) {
            revert TransferFromFailed();
        }
    }
}
