package chain

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The batch-settlement scheme's signatures and the off-chain checks of a voucher: what the engine runs on a
// request's path with no chain call. The facts (domain, types, addresses) are those of npm @x402/evm 2.27's
// batch-settlement, which the contracts at these addresses check on chain.

// Addresses of the batch-settlement contracts, the same on every chain (the public SDK's constants).
var (
	// BatchSettlementAddress is the x402BatchSettlement escrow: its address is the verifying contract of every
	// batch-settlement EIP-712 signature but the deposits'.
	BatchSettlementAddress = common.HexToAddress("0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003")
	// ERC3009DepositCollectorAddress receives a deposit's ERC-3009 ReceiveWithAuthorization.
	ERC3009DepositCollectorAddress = common.HexToAddress("0x4020806089470a89826cB9fB1f4059150b550004")
	// Permit2DepositCollectorAddress is the Permit2 spender of a deposit.
	Permit2DepositCollectorAddress = common.HexToAddress("0x4020425FAf3B746C082C2f942b4E5159887B0005")
)

// EIP-712 names and types of batch-settlement. Its domain has the shape of an EIP-2612 token's (name, version,
// chain id, verifying contract).
const (
	batchDomainName    = "x402 Batch Settlement"
	batchDomainVersion = "1"
	channelConfigType  = "ChannelConfig(address payer,address payerAuthorizer,address receiver,address receiverAuthorizer,address token,uint40 withdrawDelay,bytes32 salt)"
	voucherType        = "Voucher(bytes32 channelId,uint128 maxClaimableAmount)"
	refundType         = "Refund(bytes32 channelId,uint256 nonce,uint128 amount)"
	claimEntryType     = "ClaimEntry(bytes32 channelId,uint128 maxClaimableAmount,uint128 totalClaimed)"
	claimBatchType     = "ClaimBatch(ClaimEntry[] claims)" + claimEntryType
	// receiveWithAuthorizationType is the ERC-3009 message of a deposit (receive, not transfer: only the
	// collector it names can spend it).
	receiveWithAuthorizationType = "ReceiveWithAuthorization(address from,address to,uint256 value,uint256 validAfter,uint256 validBefore,bytes32 nonce)"
	depositWitnessType           = "DepositWitness(bytes32 channelId)"
	// depositPermitWitnessType is a deposit's Permit2 message, referenced types in alphabetical order.
	depositPermitWitnessType = "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline,DepositWitness witness)" +
		depositWitnessType + tokenPermissionsType
)

var (
	channelConfigTypeHash            = crypto.Keccak256Hash([]byte(channelConfigType))
	voucherTypeHash                  = crypto.Keccak256Hash([]byte(voucherType))
	refundTypeHash                   = crypto.Keccak256Hash([]byte(refundType))
	claimEntryTypeHash               = crypto.Keccak256Hash([]byte(claimEntryType))
	claimBatchTypeHash               = crypto.Keccak256Hash([]byte(claimBatchType))
	receiveWithAuthorizationTypeHash = crypto.Keccak256Hash([]byte(receiveWithAuthorizationType))
	depositWitnessTypeHash           = crypto.Keccak256Hash([]byte(depositWitnessType))
	depositPermitWitnessTypeHash     = crypto.Keccak256Hash([]byte(depositPermitWitnessType))
)

// maxUint128 is the largest cumulative amount a voucher can sign (its type is uint128).
var maxUint128 = new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 128), big.NewInt(1))

// BatchDomainSeparator returns the domain separator of batch-settlement signatures on the chain chainID.
func BatchDomainSeparator(chainID *big.Int) common.Hash {
	return PermitDomainSeparator(batchDomainName, batchDomainVersion, chainID, BatchSettlementAddress)
}

// Channel is a channel's configuration, parsed (see x402.ChannelConfig).
type Channel struct {
	Payer              common.Address
	PayerAuthorizer    common.Address
	Receiver           common.Address
	ReceiverAuthorizer common.Address
	Token              common.Address
	WithdrawDelay      uint64
	Salt               common.Hash
}

// ParseChannel parses a channel configuration as sent: addresses as 0x and 40 hex digits, the salt as a bytes32,
// the withdraw delay a uint40. The error names the field.
func ParseChannel(cfg x402.ChannelConfig) (Channel, error) {
	var ch Channel
	for _, f := range []struct {
		name string
		s    string
		to   *common.Address
	}{
		{"payer", cfg.Payer, &ch.Payer}, {"payerAuthorizer", cfg.PayerAuthorizer, &ch.PayerAuthorizer},
		{"receiver", cfg.Receiver, &ch.Receiver}, {"receiverAuthorizer", cfg.ReceiverAuthorizer, &ch.ReceiverAuthorizer},
		{"token", cfg.Token, &ch.Token},
	} {
		if !x402.IsHexAddress(f.s) {
			return Channel{}, fmt.Errorf("channelConfig.%s is %q, expected an address (0x and 40 hex digits)", f.name, truncate(f.s))
		}
		*f.to = common.HexToAddress(f.s)
	}
	if !x402.IsBytes32(cfg.Salt) {
		return Channel{}, fmt.Errorf("channelConfig.salt is %q, expected a bytes32 (0x and 64 hex digits)", truncate(cfg.Salt))
	}
	ch.Salt = common.HexToHash(cfg.Salt)
	if cfg.WithdrawDelay < 0 || cfg.WithdrawDelay >= 1<<40 {
		return Channel{}, fmt.Errorf("channelConfig.withdrawDelay is %d, expected a uint40", cfg.WithdrawDelay)
	}
	ch.WithdrawDelay = uint64(cfg.WithdrawDelay)
	return ch, nil
}

// ID returns the channel's id: the EIP-712 digest of its configuration under the batch-settlement domain of
// the chain (domain: BatchDomainSeparator), as the contract's getChannelId and the SDK's computeChannelId.
func (c Channel) ID(domain common.Hash) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), channelConfigTypeHash)
	putAddress(h.word(1), c.Payer)
	putAddress(h.word(2), c.PayerAuthorizer)
	putAddress(h.word(3), c.Receiver)
	putAddress(h.word(4), c.ReceiverAuthorizer)
	putAddress(h.word(5), c.Token)
	putUint64(h.word(6), c.WithdrawDelay)
	// The salt is the eighth word, one more than the scratch buffer holds: it is written to the state after it.
	var structHash common.Hash
	h.st.Reset()
	h.st.Write(h.buf[:])
	h.st.Write(c.Salt[:])
	h.st.Read(structHash[:])
	return h.digest(domain, structHash)
}

// putUint64 writes x as a 32-byte big-endian word.
func putUint64(dst []byte, x uint64) {
	clear(dst[:24])
	for i := 0; i < 8; i++ {
		dst[31-i] = byte(x >> (8 * i))
	}
}

// VoucherDigest returns the EIP-712 digest a voucher's signature signs: the receiver may claim up to
// maxClaimable from channel channelID.
func VoucherDigest(domain, channelID common.Hash, maxClaimable *big.Int) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), voucherTypeHash)
	putHash(h.word(1), channelID)
	putUint256(h.word(2), maxClaimable)
	return h.digest(domain, h.sum(3*32))
}

// RefundDigest returns the EIP-712 digest of a receiver authorizer's cooperative refund of amount from channel
// channelID under the channel's refund nonce.
func RefundDigest(domain, channelID common.Hash, nonce, amount *big.Int) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), refundTypeHash)
	putHash(h.word(1), channelID)
	putUint256(h.word(2), nonce)
	putUint256(h.word(3), amount)
	return h.digest(domain, h.sum(4*32))
}

// ClaimEntry is one voucher of a receiver authorizer's ClaimBatch signature.
type ClaimEntry struct {
	ChannelID          common.Hash
	MaxClaimableAmount *big.Int
	TotalClaimed       *big.Int
}

// ClaimBatchDigest returns the EIP-712 digest of a receiver authorizer's signature over a batch of claims.
func ClaimBatchDigest(domain common.Hash, claims []ClaimEntry) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	entries := make([]byte, 0, 32*len(claims))
	for _, c := range claims {
		putHash(h.word(0), claimEntryTypeHash)
		putHash(h.word(1), c.ChannelID)
		putUint256(h.word(2), c.MaxClaimableAmount)
		putUint256(h.word(3), c.TotalClaimed)
		sum := h.sum(4 * 32)
		entries = append(entries, sum[:]...)
	}
	putHash(h.word(0), claimBatchTypeHash)
	putHash(h.word(1), crypto.Keccak256Hash(entries))
	return h.digest(domain, h.sum(2*32))
}

// ERC3009DepositNonce is the ERC-3009 nonce of a deposit into channel channelID with the client's salt:
// keccak256(abi.encode(channelId, uint256(salt))), which binds the authorization to the channel.
func ERC3009DepositNonce(channelID, salt common.Hash) common.Hash {
	return crypto.Keccak256Hash(channelID[:], salt[:])
}

// ReceiveAuthorizationDigest returns the EIP-712 digest of an ERC-3009 ReceiveWithAuthorization, given the
// token's domain separator.
func ReceiveAuthorizationDigest(tokenDomain common.Hash, from, to common.Address, value, validAfter, validBefore *big.Int, nonce common.Hash) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), receiveWithAuthorizationTypeHash)
	putAddress(h.word(1), from)
	putAddress(h.word(2), to)
	putUint256(h.word(3), value)
	putUint256(h.word(4), validAfter)
	putUint256(h.word(5), validBefore)
	putHash(h.word(6), nonce)
	return h.digest(tokenDomain, h.sum(7*32))
}

// DepositPermit2Digest returns the EIP-712 digest of a deposit's Permit2 PermitWitnessTransferFrom on chain
// chainID: amount of token, spent by the Permit2 deposit collector under Permit2's unordered nonce until
// deadline, into channel channelID (the witness).
func DepositPermit2Digest(chainID *big.Int, token common.Address, amount, nonce, deadline *big.Int, channelID common.Hash) common.Hash {
	return depositPermit2Digest(permit2DomainSeparator(chainID, canonicalPermit2), permit2Transfer{
		Token: token, Amount: amount, Spender: Permit2DepositCollectorAddress, Nonce: nonce, Deadline: deadline,
	}, channelID)
}

// depositPermit2Digest returns the EIP-712 digest of a deposit's Permit2 PermitWitnessTransferFrom, whose witness
// names the channel, given Permit2's domain separator.
func depositPermit2Digest(domain common.Hash, p permit2Transfer, channelID common.Hash) common.Hash {
	h := hasherPool.Get().(*hasher)
	defer hasherPool.Put(h)
	putHash(h.word(0), depositWitnessTypeHash)
	putHash(h.word(1), channelID)
	return h.permitWitnessDigest(domain, depositPermitWitnessTypeHash, p, h.sum(2*32))
}

// SignVoucher signs a voucher for channel channelID up to maxClaimable with key (the channel's payer authorizer,
// or its payer when the authorizer is the zero address).
func SignVoucher(key *ecdsa.PrivateKey, domain, channelID common.Hash, maxClaimable *big.Int) (Signature, error) {
	return signDigest(key, VoucherDigest(domain, channelID, maxClaimable))
}

// BatchRefusal is a batch-settlement payment refused for a reason the payer can act on: Reason is one of the
// x402.ReasonBatch* codes (or x402.ReasonInvalidPayload), Message says what was expected and what came.
type BatchRefusal struct {
	Reason  string
	Message string
}

func (r *BatchRefusal) Error() string { return r.Reason + ": " + r.Message }

func refuseBatch(reason, format string, args ...any) *BatchRefusal {
	return &BatchRefusal{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// BatchTerms are what a route's batch-settlement requirement fixes for every channel that pays it, parsed once:
// the chain and its batch-settlement domain, the receiver and its authorizer, the token, the withdraw delay
// (0: any within the contract's bounds) and the price of one request.
type BatchTerms struct {
	Network            string
	Domain             common.Hash
	Receiver           common.Address
	ReceiverAuthorizer common.Address
	Token              common.Address
	WithdrawDelay      uint64
	Price              *big.Int
	// ClaimMargin is how long before a pending withdrawal can be finalized the receiver must have claimed: a
	// voucher counts only the deposit that will still be there that long from now.
	ClaimMargin time.Duration
}

// NewBatchTerms parses the terms of requirement rq on chain chainID.
func NewBatchTerms(rq x402.BatchRequirements, chainID *big.Int, claimMargin time.Duration) (*BatchTerms, error) {
	t := &BatchTerms{Network: rq.Network, Domain: BatchDomainSeparator(chainID), ClaimMargin: claimMargin}
	for _, f := range []struct {
		name, s string
		to      *common.Address
	}{{"payTo", rq.PayTo, &t.Receiver}, {"extra.receiverAuthorizer", rq.Extra.ReceiverAuthorizer, &t.ReceiverAuthorizer}, {"asset", rq.Asset, &t.Token}} {
		if !x402.IsHexAddress(f.s) {
			return nil, fmt.Errorf("batch-settlement requirement: %s is %q, expected an address", f.name, truncate(f.s))
		}
		*f.to = common.HexToAddress(f.s)
	}
	if t.ReceiverAuthorizer == (common.Address{}) {
		return nil, errors.New("batch-settlement requirement: extra.receiverAuthorizer is the zero address; claims and refunds need a signer")
	}
	if d := rq.Extra.WithdrawDelay; d != 0 && (d < x402.MinBatchWithdrawDelay || d > x402.MaxBatchWithdrawDelay) {
		return nil, fmt.Errorf("batch-settlement requirement: extra.withdrawDelay is %d s, expected %d to %d", d, x402.MinBatchWithdrawDelay, x402.MaxBatchWithdrawDelay)
	}
	t.WithdrawDelay = uint64(rq.Extra.WithdrawDelay)
	price, err := x402.ParseAmount(rq.Amount)
	if err != nil || price.Sign() == 0 {
		return nil, fmt.Errorf("batch-settlement requirement: amount %q is not a positive amount (%v): a voucher must raise the cumulative amount", truncate(rq.Amount), err)
	}
	t.Price = price
	return t, nil
}

// ChannelView is what the engine knows of a channel when a voucher comes: from the chain (read when the
// deposit was verified, and kept fresh by the engine) and from its journal (what it has accepted).
type ChannelView struct {
	// Balance is the channel's deposit (for a deposit payment, the deposit it would hold after this one).
	Balance *big.Int
	// TotalClaimed is what the receiver has claimed on chain.
	TotalClaimed *big.Int
	// Charged is the cumulative amount of the last voucher accepted (0 for a new channel).
	Charged *big.Int
	// WithdrawRequestedAt is when the payer asked to withdraw (zero: no withdrawal pending); WithdrawAmount is
	// how much (nil: all of it).
	WithdrawRequestedAt time.Time
	WithdrawAmount      *big.Int
	// PayerHasCode says the payer is a contract: a channel whose payer authorizer is the zero address then signs
	// its vouchers by ERC-1271, which needs a chain call.
	PayerHasCode bool
}

// AcceptedVoucher is a voucher that passed CheckVoucher: the channel, its new cumulative amount, what this
// request is charged (Cumulative - the view's Charged), who signed, and the digest signed. ClaimBy, when not
// zero, is when the channel's pending withdrawal can be finalized: the voucher must be claimed before it.
type AcceptedVoucher struct {
	ChannelID  common.Hash
	Channel    Channel
	Cumulative *big.Int
	Charge     *big.Int
	Signer     common.Address
	Digest     common.Hash
	// Signature is the 65-byte signature of an EOA's voucher with v normalised to 27 or 28; zero for a contract
	// wallet's, whose signature is the payload's as sent. A claim must carry this one, not the payload's text:
	// the check accepts v as 0 or 1 too, which the contract's ecrecover would not.
	Signature Signature
	ClaimBy   time.Time
}

// errContractVoucher is CheckVoucher's error for a voucher only the payer's contract wallet can judge.
var errContractVoucher = errors.New("the channel's vouchers are signed by the payer's contract wallet (ERC-1271), which only a chain call can check")

// IsContractVoucher reports whether err is CheckVoucher's for a voucher that needs the chain: the channel names
// no payer authorizer and its payer is a contract wallet.
func IsContractVoucher(err error) bool { return errors.Is(err, errContractVoucher) }

// CheckVoucher runs the off-chain checks of a batch-settlement payment's voucher against the terms and the
// engine's view of the channel, cheap ones first and with no chain call: the scheme and network; the channel
// configuration binds to the voucher's channel id and names this receiver, receiver authorizer, token and
// withdraw delay; the signature is the payer authorizer's (or the payer's, for a channel naming none, when the
// payer is no contract); the channel holds a deposit that covers the cumulative amount (minus a withdrawal that
// can be finalized before a claim lands); the cumulative amount is above what was claimed and is exactly the
// last accepted one plus the price (a refund: exactly the last accepted one). A refusal is a *BatchRefusal; a
// voucher of a contract wallet is an error IsContractVoucher knows.
func (t *BatchTerms) CheckVoucher(p *x402.BatchPayment, view ChannelView, now time.Time) (AcceptedVoucher, error) {
	return t.checkVoucher(p, view, now, nil)
}

// CheckContractVoucher runs CheckVoucher's checks on a voucher CheckVoucher leaves to the chain: the channel
// names no payer authorizer and its payer is a contract wallet, which judges the signature by ERC-1271
// isValidSignature, asked through caller at the latest block (as the contract's SignatureChecker asks it when
// it claims). A voucher any other key signs is checked as CheckVoucher checks it, with no call.
func (t *BatchTerms) CheckContractVoucher(ctx context.Context, caller ethereum.ContractCaller, p *x402.BatchPayment, view ChannelView, now time.Time) (AcceptedVoucher, error) {
	return t.checkVoucher(p, view, now, func(wallet common.Address, digest common.Hash, sig string) (*BatchRefusal, error) {
		raw, err := hexutil.Decode(sig)
		switch {
		case err != nil:
			return refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature must be 0x-prefixed hex: %v", err), nil
		case len(raw) < minSignatureBytes || len(raw) > maxSignatureBytes:
			return refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature is %d bytes, expected %d to %d", len(raw), minSignatureBytes, maxSignatureBytes), nil
		}
		data, err := contracts.SmartWalletABI.Pack("isValidSignature", digest, raw)
		if err != nil {
			return nil, err
		}
		ret, err := caller.CallContract(ctx, ethereum.CallMsg{To: &wallet, Data: data, Gas: walletCheckGas}, nil)
		if err != nil && !failsOnChain(err) {
			return nil, fmt.Errorf("asking the payer's wallet %s whether it signed the voucher: %w", wallet.Hex(), err)
		}
		if len(ret) < 4 || !bytes.Equal(ret[:4], contracts.ERC1271MagicValue[:]) {
			return refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "the payer's contract wallet %s does not accept the voucher's signature (isValidSignature answered 0x%x)", wallet.Hex(), ret), nil
		}
		return nil, nil
	})
}

// contractSignatureCheck judges a voucher signature by the payer's contract wallet: a refusal, or an error when
// the chain could not be asked.
type contractSignatureCheck func(wallet common.Address, digest common.Hash, signature string) (*BatchRefusal, error)

func (t *BatchTerms) checkVoucher(p *x402.BatchPayment, view ChannelView, now time.Time, contract contractSignatureCheck) (AcceptedVoucher, error) {
	var av AcceptedVoucher
	pl := &p.Payload
	switch {
	case p.Accepted.Scheme != x402.SchemeBatchSettlement:
		return av, refuseBatch(x402.ReasonBatchInvalidScheme, "accepted.scheme is %q, expected %q", truncate(p.Accepted.Scheme), x402.SchemeBatchSettlement)
	case p.Accepted.Network != t.Network:
		return av, refuseBatch(x402.ReasonBatchNetworkMismatch, "accepted.network is %q, this route is paid on %s", truncate(p.Accepted.Network), t.Network)
	case pl.Type != x402.BatchVoucher && pl.Type != x402.BatchDeposit && pl.Type != x402.BatchRefund:
		return av, refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload.type is %q, expected deposit, voucher or refund", truncate(pl.Type))
	case pl.ChannelConfig == nil || pl.Voucher == nil:
		return av, refuseBatch(x402.ReasonInvalidPayload, "payload has no channelConfig or voucher")
	}
	ch, err := ParseChannel(*pl.ChannelConfig)
	if err != nil {
		return av, refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	if !x402.IsBytes32(pl.Voucher.ChannelID) {
		return av, refuseBatch(x402.ReasonBatchChannelIDInvalid, "payload.voucher.channelId is not a bytes32 (0x and 64 hex digits)")
	}
	id := ch.ID(t.Domain)
	claimed := common.HexToHash(pl.Voucher.ChannelID)
	switch {
	case claimed != id:
		return av, refuseBatch(x402.ReasonBatchChannelIDMismatch, "payload.voucher.channelId is %s, but payload.channelConfig is channel %s on %s", claimed.Hex(), id.Hex(), t.Network)
	case ch.Receiver != t.Receiver:
		return av, refuseBatch(x402.ReasonBatchReceiverMismatch, "the channel's receiver is %s, this route is paid to %s", ch.Receiver.Hex(), t.Receiver.Hex())
	case ch.ReceiverAuthorizer != t.ReceiverAuthorizer:
		return av, refuseBatch(x402.ReasonBatchReceiverAuthorizerMismatch, "the channel's receiverAuthorizer is %s, this route names %s", ch.ReceiverAuthorizer.Hex(), t.ReceiverAuthorizer.Hex())
	case ch.Token != t.Token:
		return av, refuseBatch(x402.ReasonBatchTokenMismatch, "the channel's token is %s, this route is paid in %s", ch.Token.Hex(), t.Token.Hex())
	case t.WithdrawDelay != 0 && ch.WithdrawDelay != t.WithdrawDelay:
		return av, refuseBatch(x402.ReasonBatchWithdrawDelayMismatch, "the channel's withdrawDelay is %d s, this route names %d s", ch.WithdrawDelay, t.WithdrawDelay)
	case ch.WithdrawDelay < x402.MinBatchWithdrawDelay || ch.WithdrawDelay > x402.MaxBatchWithdrawDelay:
		return av, refuseBatch(x402.ReasonBatchWithdrawDelayOutOfRange, "the channel's withdrawDelay is %d s, expected %d to %d", ch.WithdrawDelay, x402.MinBatchWithdrawDelay, x402.MaxBatchWithdrawDelay)
	}
	cumulative, err := x402.ParseAmount(pl.Voucher.MaxClaimableAmount)
	if err != nil || cumulative.Cmp(maxUint128) > 0 {
		return av, refuseBatch(x402.ReasonInvalidPayload, "payload.voucher.maxClaimableAmount %q is not a uint128 amount", truncate(pl.Voucher.MaxClaimableAmount))
	}
	digest := VoucherDigest(t.Domain, id, cumulative)
	signer := ch.PayerAuthorizer
	var sig Signature
	switch {
	case signer == (common.Address{}) && view.PayerHasCode && contract == nil:
		return av, errContractVoucher
	case signer == (common.Address{}) && view.PayerHasCode:
		// The contract's SignatureChecker asks a payer with code by ERC-1271 only, never by ecrecover.
		signer = ch.Payer
		r, err := contract(signer, digest, pl.Voucher.Signature)
		if err != nil {
			return av, err
		}
		if r != nil {
			return av, r
		}
	default:
		if signer == (common.Address{}) {
			signer = ch.Payer
		}
		var err error
		if sig, err = ParseSignature(pl.Voucher.Signature); err != nil {
			return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature: %v", err)
		}
		if got, err := RecoverSigner(digest, sig); err != nil {
			return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature: %v", err)
		} else if got != signer {
			return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "the voucher is signed by %s, not the channel's voucher signer %s", got.Hex(), signer.Hex())
		}
	}

	balance, totalClaimed, charged := orZero(view.Balance), orZero(view.TotalClaimed), orZero(view.Charged)
	if balance.Sign() == 0 {
		return av, refuseBatch(x402.ReasonBatchChannelNotFound, "channel %s holds no deposit", id.Hex())
	}
	covered, why := balance, ""
	if !view.WithdrawRequestedAt.IsZero() {
		av.ClaimBy = view.WithdrawRequestedAt.Add(time.Duration(ch.WithdrawDelay) * time.Second)
		if !now.Add(t.ClaimMargin).Before(av.ClaimBy) {
			covered = new(big.Int)
			if view.WithdrawAmount != nil && view.WithdrawAmount.Cmp(balance) < 0 {
				covered.Sub(balance, view.WithdrawAmount)
			}
			why = fmt.Sprintf(" once the withdrawal the payer asked for at %s can be finalized (%s)", view.WithdrawRequestedAt.UTC().Format(time.RFC3339), av.ClaimBy.UTC().Format(time.RFC3339))
		}
	}
	refund := pl.Type == x402.BatchRefund
	switch {
	case cumulative.Cmp(covered) > 0:
		return av, refuseBatch(x402.ReasonBatchCumulativeExceedsBalance, "the voucher's cumulative amount %s exceeds the %s the channel holds%s", cumulative, covered, why)
	case cumulative.Cmp(totalClaimed) < 0 || (!refund && cumulative.Cmp(totalClaimed) == 0):
		return av, refuseBatch(x402.ReasonBatchCumulativeBelowClaimed, "the voucher's cumulative amount %s is not above the %s already claimed", cumulative, totalClaimed)
	}
	want, plus := charged, ", and a refund charges nothing"
	if !refund {
		want, plus = new(big.Int).Add(charged, t.Price), " plus this request's "+t.Price.String()
	}
	if cumulative.Cmp(want) != 0 {
		return av, refuseBatch(x402.ReasonBatchCumulativeAmountMismatch, "the voucher's cumulative amount is %s, expected %s (%s accepted so far%s)", cumulative, want, charged, plus)
	}
	av.ChannelID, av.Channel, av.Cumulative, av.Signer, av.Digest, av.Signature = id, ch, cumulative, signer, digest, sig
	av.Charge = new(big.Int).Sub(cumulative, charged)
	return av, nil
}

func orZero(x *big.Int) *big.Int {
	if x == nil {
		return new(big.Int)
	}
	return x
}
