package chain

import (
	"crypto/ecdsa"
	"errors"
	"fmt"
	"math/big"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The batch-settlement scheme's signatures and the off-chain checks of a voucher: what the engine runs on a
// request's path with no chain call. The facts (domain, types, addresses) are those of npm @x402/evm 2.27's
// batch-settlement, which the contracts at these addresses check on chain.

// The ERC-3009 and Permit2 messages of a deposit; the batch-settlement domain's name and version, its own type
// strings and the contracts' addresses are chain/contracts'.
const (
	// receiveWithAuthorizationType is the ERC-3009 message of a deposit (receive, not transfer: only the
	// collector it names can spend it).
	receiveWithAuthorizationType = "ReceiveWithAuthorization(address from,address to,uint256 value,uint256 validAfter,uint256 validBefore,bytes32 nonce)"
	// depositPermitWitnessType is a deposit's Permit2 message: the Permit2 deposit collector's witness tail after
	// Permit2's stub, as Permit2 hashes it.
	depositPermitWitnessType = "PermitWitnessTransferFrom(TokenPermissions permitted,address spender,uint256 nonce,uint256 deadline," +
		contracts.DepositWitnessTypeString
)

var (
	channelConfigTypeHash            = crypto.Keccak256Hash([]byte(contracts.ChannelConfigType))
	voucherTypeHash                  = crypto.Keccak256Hash([]byte(contracts.VoucherType))
	refundTypeHash                   = crypto.Keccak256Hash([]byte(contracts.RefundType))
	claimEntryTypeHash               = crypto.Keccak256Hash([]byte(contracts.ClaimEntryType))
	claimBatchTypeHash               = crypto.Keccak256Hash([]byte(contracts.ClaimBatchType))
	receiveWithAuthorizationTypeHash = crypto.Keccak256Hash([]byte(receiveWithAuthorizationType))
	depositWitnessTypeHash           = crypto.Keccak256Hash([]byte(contracts.DepositWitnessType))
	depositPermitWitnessTypeHash     = crypto.Keccak256Hash([]byte(depositPermitWitnessType))
)

// maxUint128 is the largest cumulative amount a voucher can sign (its type is uint128).
var maxUint128 = new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 128), big.NewInt(1))

// BatchDomainSeparator returns the domain separator of batch-settlement signatures on the chain chainID.
func BatchDomainSeparator(chainID *big.Int) common.Hash {
	return PermitDomainSeparator(contracts.BatchSettlementDomainName, contracts.BatchSettlementDomainVersion, chainID, contracts.BatchSettlementAddress)
}

// ParseChannelConfig parses a channel configuration as sent: addresses as 0x and 40 hex digits, the salt as a bytes32,
// the withdraw delay a uint40. The error names the field.
func ParseChannelConfig(cfg x402.ChannelConfig) (contracts.ChannelConfig, error) {
	var ch contracts.ChannelConfig
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
			return contracts.ChannelConfig{}, fmt.Errorf("channelConfig.%s is %q, expected an address (0x and 40 hex digits)", f.name, truncate(f.s))
		}
		*f.to = common.HexToAddress(f.s)
	}
	if !x402.IsBytes32(cfg.Salt) {
		return contracts.ChannelConfig{}, fmt.Errorf("channelConfig.salt is %q, expected a bytes32 (0x and 64 hex digits)", truncate(cfg.Salt))
	}
	ch.Salt = common.HexToHash(cfg.Salt)
	if cfg.WithdrawDelay < 0 || cfg.WithdrawDelay >= 1<<40 {
		return contracts.ChannelConfig{}, fmt.Errorf("channelConfig.withdrawDelay is %d, expected a uint40", cfg.WithdrawDelay)
	}
	ch.WithdrawDelay = uint64(cfg.WithdrawDelay)
	return ch, nil
}

// channelMemo remembers the parse and id of the channel configurations an engine's network saw lately: every
// voucher of a channel carries the same configuration, whose parse and hash would otherwise be a quarter of the
// voucher's check after the signature (and are done twice a voucher). At most channelMemoSize, forgotten
// wholesale when full (a channel's next voucher remembers it again).
type channelMemo struct {
	mu sync.Mutex
	m  map[channelMemoKey]channelMemoEntry
}

type channelMemoKey struct {
	domain common.Hash
	cfg    x402.ChannelConfig
}

type channelMemoEntry struct {
	ch contracts.ChannelConfig
	id common.Hash
}

// channelMemoSize bounds a channelMemo: 4096 channels of about 600 bytes each.
const channelMemoSize = 4096

func newChannelMemo() *channelMemo {
	return &channelMemo{m: map[channelMemoKey]channelMemoEntry{}}
}

// of parses cfg and works out its channel's id under domain, as ParseChannelConfig and ChannelID do; a nil memo
// remembers nothing. A configuration that does not parse is not remembered.
func (c *channelMemo) of(domain common.Hash, cfg x402.ChannelConfig) (contracts.ChannelConfig, common.Hash, error) {
	if c == nil {
		ch, err := ParseChannelConfig(cfg)
		if err != nil {
			return ch, common.Hash{}, err
		}
		return ch, ChannelID(domain, ch), nil
	}
	key := channelMemoKey{domain: domain, cfg: cfg}
	c.mu.Lock()
	e, ok := c.m[key]
	c.mu.Unlock()
	if ok {
		return e.ch, e.id, nil
	}
	ch, err := ParseChannelConfig(cfg)
	if err != nil {
		return ch, common.Hash{}, err
	}
	id := ChannelID(domain, ch)
	c.mu.Lock()
	if len(c.m) >= channelMemoSize {
		clear(c.m)
	}
	c.m[key] = channelMemoEntry{ch: ch, id: id}
	c.mu.Unlock()
	return ch, id, nil
}

// ChannelID returns the id of channel c: the EIP-712 digest of its configuration under the batch-settlement
// domain of the chain (domain: BatchDomainSeparator), as the contract's getChannelId and the SDK's
// computeChannelId.
func ChannelID(domain common.Hash, c contracts.ChannelConfig) common.Hash {
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

// ReceiveAuthorizationDigest returns the EIP-712 digest of an ERC-3009 ReceiveWithAuthorization, given the
// token's domain separator.
func ReceiveAuthorizationDigest(tokenDomain common.Hash, from, to common.Address, value, validAfter, validBefore *big.Int, nonce common.Hash) common.Hash {
	return erc3009Digest(tokenDomain, receiveWithAuthorizationTypeHash, transferAuthorization{
		From: from, To: to, Value: value, ValidAfter: validAfter, ValidBefore: validBefore, Nonce: nonce,
	})
}

// DepositPermit2Digest returns the EIP-712 digest of a deposit's Permit2 PermitWitnessTransferFrom on chain
// chainID: amount of token, spent by the Permit2 deposit collector under Permit2's unordered nonce until
// deadline, into channel channelID (the witness).
func DepositPermit2Digest(chainID *big.Int, token common.Address, amount, nonce, deadline *big.Int, channelID common.Hash) common.Hash {
	return depositPermit2Digest(permit2DomainSeparator(chainID, canonicalPermit2), permit2Transfer{
		Token: token, Amount: amount, Spender: contracts.Permit2DepositCollectorAddress, Nonce: nonce, Deadline: deadline,
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
	// ChainID is the chain's id, for the token's and Permit2's domains a deposit is signed under.
	ChainID *big.Int
	// TokenName and TokenVersion are the token's EIP-712 domain an ERC-3009 deposit is signed under, and
	// TransferMethod how the route takes deposits (x402.TransferEIP3009 or x402.TransferPermit2): the route's, never
	// the payment's, which the payer writes.
	TokenName, TokenVersion, TransferMethod string
	// channels is the engine network's memo of channel configurations, nil for terms made outside an engine.
	channels *channelMemo
}

// NewBatchTerms parses the terms of requirement rq on chain chainID.
func NewBatchTerms(rq x402.BatchRequirements, chainID *big.Int, claimMargin time.Duration) (*BatchTerms, error) {
	// The domain binds every voucher to one chain: the route's network must name the chain it is claimed on.
	if id, err := x402.ChainID(rq.Network); err != nil || chainID == nil || new(big.Int).SetUint64(id).Cmp(chainID) != 0 {
		return nil, fmt.Errorf("batch-settlement requirement: network %q is not the chain %v its vouchers are claimed on (%v)", truncate(rq.Network), chainID, err)
	}
	// A voucher is accepted only while a claim can land before a withdrawal is finalized: the margin is that time,
	// shorter than the shortest withdrawDelay a channel of the route can have.
	delay := time.Duration(rq.Extra.WithdrawDelay) * time.Second
	if rq.Extra.WithdrawDelay == 0 {
		delay = contracts.MinWithdrawDelay * time.Second
	}
	if claimMargin <= 0 || claimMargin >= delay {
		return nil, fmt.Errorf("batch-settlement requirement: claim margin %s must be positive and shorter than the withdrawDelay %s", claimMargin, delay)
	}
	t := &BatchTerms{Network: rq.Network, Domain: BatchDomainSeparator(chainID), ClaimMargin: claimMargin,
		ChainID: new(big.Int).Set(chainID), TokenName: rq.Extra.Name, TokenVersion: rq.Extra.Version, TransferMethod: rq.Extra.AssetTransferMethod}
	if t.TransferMethod == "" {
		t.TransferMethod = x402.TransferEIP3009
	}
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
	if d := rq.Extra.WithdrawDelay; d != 0 && (d < contracts.MinWithdrawDelay || d > contracts.MaxWithdrawDelay) {
		return nil, fmt.Errorf("batch-settlement requirement: extra.withdrawDelay is %d s, expected %d to %d", d, contracts.MinWithdrawDelay, contracts.MaxWithdrawDelay)
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
	// PayerHasCode says the payer has code (a contract, or an EIP-7702 delegation): a channel whose payer
	// authorizer is the zero address then has its vouchers judged by ERC-1271 at claim time, and is refused.
	PayerHasCode bool
	// ReadAt is the time of the block Balance, TotalClaimed and the withdrawal were read at. A withdrawal the
	// payer asks for after that block cannot be finalized before ReadAt plus the channel's withdrawDelay, so the
	// view vouches for the deposit until then, less ClaimMargin; the zero time vouches for nothing. It is chain
	// time, as WithdrawRequestedAt is, and CheckVoucher's now must be too (or the wall clock with a ClaimMargin
	// that covers how far the chain's clock can run ahead of it: a dev chain sealing a block per transaction does).
	ReadAt time.Time
}

// AcceptedVoucher is a voucher that passed CheckVoucher: the channel, its new cumulative amount, what this
// request is charged (Cumulative - the view's Charged), who signed, and the digest signed. ClaimBy is when the
// voucher must have been claimed: when the channel's pending withdrawal can be finalized, or, with none pending
// in the view, when one asked for just after the view was read could be (a later read that shows none moves it
// to that read's ReadAt plus the withdrawDelay).
type AcceptedVoucher struct {
	ChannelID  common.Hash
	Channel    contracts.ChannelConfig
	Cumulative *big.Int
	Charge     *big.Int
	Signer     common.Address
	Digest     common.Hash
	// Signature is the voucher's 65-byte signature with v normalised to 27 or 28. A claim must carry this one, not
	// the payload's text:
	// the check accepts v as 0 or 1 too, which the contract's ecrecover would not.
	Signature Signature
	ClaimBy   time.Time
}

// errStaleChannelView is CheckVoucher's error for a view read too long ago to vouch for the deposit.
var errStaleChannelView = errors.New("the channel was read from the chain too long ago: a withdrawal asked for since could be finalized before a claim lands")

// IsStaleChannelView reports whether err is CheckVoucher's for a view too old to trust: the engine reads the
// channel again and checks the voucher with the fresh view. The payer did nothing wrong.
func IsStaleChannelView(err error) bool { return errors.Is(err, errStaleChannelView) }

// CheckVoucher runs the off-chain checks of a batch-settlement payment's voucher against the terms and the
// engine's view of the channel, cheap ones first and with no chain call: the scheme and network; the channel
// configuration binds to the voucher's channel id and names this receiver, receiver authorizer, token and
// withdraw delay; the signature is the payer authorizer's (or the payer's key's, for a channel naming none; a
// payer that is a contract is refused, as its answer can change before the claim); the channel holds a deposit that covers the cumulative amount (minus a withdrawal that
// can be finalized before a claim lands); the cumulative amount is above what was claimed and is exactly the
// last accepted one plus the price (a refund: exactly the last accepted one). A refusal is a *BatchRefusal; a
// view read too long ago (see ChannelView.ReadAt) is an error IsStaleChannelView knows.
func (t *BatchTerms) CheckVoucher(p *x402.BatchPayment, view ChannelView, now time.Time) (AcceptedVoucher, error) {
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
	ch, id, err := t.channels.of(t.Domain, *pl.ChannelConfig)
	if err != nil {
		return av, refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	if !x402.IsBytes32(pl.Voucher.ChannelID) {
		return av, refuseBatch(x402.ReasonBatchChannelIDInvalid, "payload.voucher.channelId is not a bytes32 (0x and 64 hex digits)")
	}
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
	case ch.WithdrawDelay < contracts.MinWithdrawDelay || ch.WithdrawDelay > contracts.MaxWithdrawDelay:
		return av, refuseBatch(x402.ReasonBatchWithdrawDelayOutOfRange, "the channel's withdrawDelay is %d s, expected %d to %d", ch.WithdrawDelay, contracts.MinWithdrawDelay, contracts.MaxWithdrawDelay)
	}
	cumulative, err := x402.ParseAmount(pl.Voucher.MaxClaimableAmount)
	if err != nil || cumulative.Cmp(maxUint128) > 0 {
		return av, refuseBatch(x402.ReasonInvalidPayload, "payload.voucher.maxClaimableAmount %q is not a uint128 amount", truncate(pl.Voucher.MaxClaimableAmount))
	}
	digest := VoucherDigest(t.Domain, id, cumulative)
	signer := ch.PayerAuthorizer
	var sig Signature
	if signer == (common.Address{}) {
		// The payer signs. A payer with code has its vouchers judged by that code (ERC-1271) when the claim runs,
		// and code can answer otherwise then than any check made now (its state, its caller, its gas price, or a
		// new EIP-7702 delegation): nothing accepted now would be sure to be paid. Only a key is.
		if view.PayerHasCode {
			return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "the channel names no payerAuthorizer and its payer %s is a contract, "+
				"whose ERC-1271 answer can change before a claim: open the channel with a payerAuthorizer, the key that signs its vouchers", ch.Payer.Hex())
		}
		signer = ch.Payer
	}
	if sig, err = ParseSignature(pl.Voucher.Signature); err != nil {
		return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature: %v", err)
	}
	if got, err := RecoverSigner(digest, sig); err != nil {
		return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature: %v", err)
	} else if got != signer {
		return av, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "the voucher is signed by %s, not the channel's voucher signer %s", got.Hex(), signer.Hex())
	}

	// A withdrawal asked for after the view was read would go unseen: its delay runs from then at the earliest.
	fresh := view.ReadAt.Add(time.Duration(ch.WithdrawDelay) * time.Second)
	if !now.Add(t.ClaimMargin).Before(fresh) {
		return av, fmt.Errorf("%w: channel %s was read at %s, and a claim must land by %s (withdrawDelay %d s, claim margin %s)",
			errStaleChannelView, id.Hex(), view.ReadAt.UTC().Format(time.RFC3339), fresh.UTC().Format(time.RFC3339), ch.WithdrawDelay, t.ClaimMargin)
	}
	av.ClaimBy = fresh
	balance, totalClaimed, charged := orZero(view.Balance), orZero(view.TotalClaimed), orZero(view.Charged)
	if balance.Sign() == 0 {
		return av, refuseBatch(x402.ReasonBatchChannelNotFound, "channel %s holds no deposit", id.Hex())
	}
	covered, why := balance, ""
	if !view.WithdrawRequestedAt.IsZero() {
		finalizable := view.WithdrawRequestedAt.Add(time.Duration(ch.WithdrawDelay) * time.Second)
		if now.Add(t.ClaimMargin).Before(finalizable) {
			// The whole balance counts if the claim lands before the withdrawal can be finalized.
			av.ClaimBy = finalizable
		} else {
			// Only what the withdrawal leaves counts; a next withdrawal can be asked for once this one is
			// finalized, after the read, so the read's deadline stands.
			covered = new(big.Int)
			if view.WithdrawAmount != nil && view.WithdrawAmount.Cmp(balance) < 0 {
				covered.Sub(balance, view.WithdrawAmount)
			}
			why = fmt.Sprintf(" once the withdrawal the payer asked for at %s can be finalized (%s)", view.WithdrawRequestedAt.UTC().Format(time.RFC3339), finalizable.UTC().Format(time.RFC3339))
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
