package journal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The journal's side of a batch-settlement channel: one row per channel, which every voucher a gateway accepts
// advances and the claimer reads. A voucher is accepted by a compare-and-set of the channel's cumulative amount
// from exactly the last accepted one to the voucher's, never past the deposit the row holds, written durably
// before the response it pays for is served: on a store shared by several gateways (PostgreSQL), one row and one
// statement, so that two gateways never take the same step and never accept, together, more than the deposit.
// A claim is marked sent on the rows it claims before its transaction is broadcast, as a payment's broadcast
// record is, and marked mined or failed after: a row with a claim in flight is not offered for claiming again
// until that claim is known failed, and one lost in a crash is listed by ClaimsInFlight.

// Channels is what every store keeps of batch-settlement channels. Every method is safe for concurrent use, and
// every write is atomic and, once it returned nil, durable (for a durable store), as the Store's are.
type Channels interface {
	// Channel returns the row of key, and whether there is one.
	Channel(ctx context.Context, key ChannelKey) (Channel, bool, error)
	// ObserveChannel records what a read of the channel on chain found, creating its row when there is none (its
	// cumulative amount then starts at what the chain says was claimed). A read at a block older than the row's
	// last one changes nothing, so that two gateways' reads arriving out of order leave the newer. The claimed
	// amount only grows; a pending claim whose amount the chain shows claimed is taken as mined. It returns the
	// row as it stands afterwards.
	ObserveChannel(ctx context.Context, read ChannelRead) (Channel, error)
	// AcceptVoucher advances the channel's cumulative amount from exactly from to to, recording the voucher's
	// signature and digest (what a claim of to must carry) and the time: a compare-and-set that changes nothing
	// and fails with ErrChannelMoved when the row's amount is not from (another gateway took that step), with
	// ErrAboveDeposit when to exceeds the deposit the row holds, with ErrChannelWithdrawn when the channel was
	// refunded or withdrawn, and with ErrChannelNotFound when there is no row. It returns the row: as written on
	// success; on a refusal, as the refusal found it (on a shared store, after ErrChannelMoved, possibly from
	// before the step that moved it: read it again).
	AcceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher) (Channel, error)
	// Unclaimed lists the channels of network whose accepted amount is above what was claimed and that have no
	// claim in flight, oldest unclaimed voucher first: what a batch claim takes.
	Unclaimed(ctx context.Context, network string) ([]Channel, error)
	// ClaimsInFlight lists the channels of network with a claim marked sent and not yet marked mined or failed,
	// oldest claim first: what a claimer must look up on chain after a restart.
	ClaimsInFlight(ctx context.Context, network string) ([]Channel, error)
	// MarkClaimSent records, before the claim transaction tx is broadcast, that it claims each channel up to its
	// amount: all of them or none. A channel with a claim in flight already, with nothing accepted above what was
	// claimed up to that amount, or with less accepted than it, is refused with ErrClaimTaken (another claimer
	// took it, or the caller read a stale row), and nothing is marked.
	MarkClaimSent(ctx context.Context, tx string, claims []ChannelClaim) error
	// MarkClaimMined records that the claim transaction tx was mined: each channel it claims counts its amount
	// claimed and is free to be claimed again for what was accepted since. It returns how many channels it
	// marked (0 for a transaction no row names, or one marked already).
	MarkClaimMined(ctx context.Context, tx string) (int, error)
	// MarkClaimFailed records that the claim transaction tx will never be mined (refused, dropped, or never sent):
	// its channels are offered for claiming again. It returns how many channels it freed.
	MarkClaimFailed(ctx context.Context, tx string) (int, error)
	// PruneChannels deletes the rows of channels refunded or withdrawn before the given time whose accepted amount
	// is all claimed and that have no claim in flight, and returns how many it deleted: the journal's retention,
	// as Prune's for records.
	PruneChannels(ctx context.Context, withdrawnBefore time.Time) (int, error)
	// MarkRefund records, before a refund of the channel can leave, that the refund named mark is on its way and
	// claims the channel up to exactly at: a compare-and-set of the row's cumulative amount, as AcceptVoucher's,
	// that fails with ErrChannelMoved when the row is not at at (a voucher was accepted since the refund read it:
	// read it again) and with ErrRefundTaken when another refund's mark is on the row. The same mark again is
	// taken (the same refund, presented again). While the mark is on the row, AcceptVoucher refuses with
	// ErrChannelRefunding, on every gateway of the journal: the refund hands back what is above at. It returns the
	// row as it stands afterwards.
	MarkRefund(ctx context.Context, key ChannelKey, at *big.Int, mark string) (Channel, error)
	// ClearRefund removes the refund mark mark from the row (the refund mined and its row read again, or known never
	// sent), and reports whether it was there.
	ClearRefund(ctx context.Context, key ChannelKey, mark string) (bool, error)
	// RefundsInFlight lists the channels of network with a refund mark, oldest first: what a refunder looks up
	// after a restart.
	RefundsInFlight(ctx context.Context, network string) ([]Channel, error)
}

// VoucherRecords is a journal that takes a voucher's step and writes its record in one commit: one fsync on
// bbolt where AcceptVoucher and then Claim take two, one statement on PostgreSQL where they take two round trips,
// and no crash or database stopped between them leaving an accepted voucher without its record.
type VoucherRecords interface {
	// AcceptVoucherRecord is AcceptVoucher and, when it takes the step, Claim of rec, the voucher's record, in the
	// same commit. It returns what AcceptVoucher returns and, when the step was taken, the record as Claim returns
	// it (the record already there, when there is one). A record Claim would refuse fails it before anything is
	// written.
	AcceptVoucherRecord(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec Record) (Channel, Record, error)
}

// Errors of the channel rows a caller decides on; returned errors wrap them with the channel and the detail.
var (
	// ErrChannelNotFound: a voucher or a claim of a channel the journal holds no row of (no deposit read yet).
	ErrChannelNotFound = errors.New("journal: no such channel")
	// ErrChannelMoved: AcceptVoucher from an amount the channel is no longer at: another voucher took that step.
	ErrChannelMoved = errors.New("journal: the channel's cumulative amount moved")
	// ErrAboveDeposit: AcceptVoucher to an amount above the deposit the channel's row holds.
	ErrAboveDeposit = errors.New("journal: the cumulative amount exceeds the channel's deposit")
	// ErrChannelWithdrawn: AcceptVoucher on a channel refunded or withdrawn.
	ErrChannelWithdrawn = errors.New("journal: the channel was refunded or withdrawn")
	// ErrChannelRefunding: AcceptVoucher on a channel with a refund on its way (MarkRefund).
	ErrChannelRefunding = errors.New("journal: the channel is being refunded")
	// ErrRefundTaken: MarkRefund of a channel another refund's mark is on.
	ErrRefundTaken = errors.New("journal: another refund of the channel is on its way")
	// ErrClaimTaken: MarkClaimSent of a channel with a claim in flight, or without that amount accepted and
	// unclaimed.
	ErrClaimTaken = errors.New("journal: the channel is claimed already or has nothing to claim at that amount")
	// ErrInvalidChannel: a key, read, voucher or claim that is not well formed; nothing was written.
	ErrInvalidChannel = errors.New("journal: invalid channel write")
)

// ChannelKey names a channel: the network (CAIP-2), the batch-settlement escrow's address and the channel's id
// (bytes32 hex). Addresses and ids are kept in lower case, whatever case they came in.
type ChannelKey struct {
	Network string `json:"network"`
	Escrow  string `json:"escrow"`
	ID      string `json:"id"`
}

func (k ChannelKey) String() string { return k.Network + "/" + k.Escrow + "/" + k.ID }

// canonical checks k and returns it in lower case.
func (k ChannelKey) canonical() (ChannelKey, error) {
	switch {
	case strings.TrimSpace(k.Network) == "" || k.Network != strings.TrimSpace(k.Network) || strings.ContainsRune(k.Network, 0):
		return k, fmt.Errorf("%w: channel key network %q, expected a CAIP-2 network", ErrInvalidChannel, k.Network)
	case !x402.IsHexAddress(k.Escrow):
		return k, fmt.Errorf("%w: channel key escrow %q, expected an address (0x and 40 hex digits)", ErrInvalidChannel, k.Escrow)
	case !x402.IsBytes32(k.ID):
		return k, fmt.Errorf("%w: channel key id %q, expected a bytes32 (0x and 64 hex digits)", ErrInvalidChannel, k.ID)
	}
	return ChannelKey{Network: k.Network, Escrow: strings.ToLower(k.Escrow), ID: strings.ToLower(k.ID)}, nil
}

// bytes is the key as the bolt store orders its rows: network, escrow and id, each ended by a zero byte.
func (k ChannelKey) bytes() []byte {
	return []byte(k.Network + "\x00" + k.Escrow + "\x00" + k.ID)
}

// Voucher is what a claim of an accepted voucher must carry: the payer's signature (65 bytes, v 27 or 28, as the
// contract recovers it; or a contract wallet's as sent) and the EIP-712 digest it signs. By, optional, names this
// acceptance (a token unique to the request): a caller whose AcceptVoucher failed with its outcome unknown (a
// connection lost as it committed) reads the row, and the step is its own only when the row is at its amount with
// its By; the same voucher presented to two gateways at once has one digest but two tokens.
type Voucher struct {
	Signature []byte
	Digest    []byte
	By        string
}

// ChannelRead is what a read of a channel on chain found, at block Block.
type ChannelRead struct {
	Key ChannelKey
	// Config is the channel's configuration, as a claim or refund names it; kept from the row's first read.
	Config x402.ChannelConfig
	// Deposit is the channel's balance in the escrow; TotalClaimed what the receiver has claimed of it.
	Deposit      *big.Int
	TotalClaimed *big.Int
	// WithdrawRequestedAt is when the payer asked to withdraw (zero: no withdrawal pending), WithdrawAmount how
	// much (nil: all).
	WithdrawRequestedAt time.Time
	WithdrawAmount      *big.Int
	// Withdrawn says the channel was refunded or withdrawn: it takes no more vouchers.
	Withdrawn bool
	Block     uint64
}

// ChannelClaim is one channel of a claim transaction: claimed up to Amount (cumulative).
type ChannelClaim struct {
	Key    ChannelKey
	Amount *big.Int
}

// Channel is the journal's row of a channel. Amounts are in the token's atomic units; times are the store's
// clock.
type Channel struct {
	Key    ChannelKey         `json:"key"`
	Config x402.ChannelConfig `json:"config"`

	// Deposit is the channel's balance as last read, at DepositBlock, written at DepositReadAt.
	Deposit       *big.Int  `json:"deposit"`
	DepositBlock  uint64    `json:"depositBlock"`
	DepositReadAt time.Time `json:"depositReadAt"`
	// WithdrawRequestedAt and WithdrawAmount are the pending withdrawal as last read.
	WithdrawRequestedAt time.Time `json:"withdrawRequestedAt,omitzero"`
	WithdrawAmount      *big.Int  `json:"withdrawAmount,omitempty"`
	// Withdrawn says the channel was refunded or withdrawn, first read so at WithdrawnAt.
	Withdrawn   bool      `json:"withdrawn,omitempty"`
	WithdrawnAt time.Time `json:"withdrawnAt,omitzero"`

	// Charged is the cumulative amount of the last voucher accepted; Signature and Digest are that voucher's
	// (empty when Charged is only what the chain said was claimed when the row was made). Vouchers counts the
	// vouchers accepted, AcceptedAt is when the last one was, UnclaimedSince about when the oldest not yet claimed
	// was (zero: nothing unclaimed).
	Charged        *big.Int  `json:"charged"`
	Signature      []byte    `json:"signature,omitempty"`
	Digest         []byte    `json:"digest,omitempty"`
	Vouchers       uint64    `json:"vouchers,omitempty"`
	AcceptedAt     time.Time `json:"acceptedAt,omitzero"`
	AcceptedBy     string    `json:"acceptedBy,omitempty"`
	UnclaimedSince time.Time `json:"unclaimedSince,omitzero"`

	// Claimed is what is claimed on chain (mined), ClaimedTx the claim transaction that last raised it ("" when
	// the chain's read did).
	Claimed   *big.Int `json:"claimed"`
	ClaimedTx string   `json:"claimedTx,omitempty"`
	// ClaimTx is the claim transaction in flight (marked sent, not yet mined or failed), ClaimAmount what it
	// claims, ClaimSentAt when it was marked; "", nil and zero when none is.
	ClaimTx     string    `json:"claimTx,omitempty"`
	ClaimAmount *big.Int  `json:"claimAmount,omitempty"`
	ClaimSentAt time.Time `json:"claimSentAt,omitzero"`

	// RefundMark names the refund on its way (MarkRefund: set before its transaction can leave, at exactly the
	// amount Charged it claims to), RefundMarkedAt when it was set; "" and zero when none is. While it is set, no
	// voucher is accepted.
	RefundMark     string    `json:"refundMark,omitempty"`
	RefundMarkedAt time.Time `json:"refundMarkedAt,omitzero"`
}

// clone is c with amounts and bytes of its own.
func (c *Channel) clone() Channel {
	out := *c
	for _, x := range []**big.Int{&out.Deposit, &out.WithdrawAmount, &out.Charged, &out.Claimed, &out.ClaimAmount} {
		if *x != nil {
			*x = new(big.Int).Set(*x)
		}
	}
	out.Signature, out.Digest = bytes.Clone(c.Signature), bytes.Clone(c.Digest)
	return out
}

// Unclaimed is what was accepted and not claimed on chain.
func (c *Channel) Unclaimed() *big.Int { return new(big.Int).Sub(c.Charged, c.Claimed) }

// claimable reports whether a batch claim may take c: something accepted is unclaimed and no claim is in flight.
func (c *Channel) claimable() bool { return c.ClaimTx == "" && c.Charged.Cmp(c.Claimed) > 0 }

// prunable reports whether c may go at a cutoff: withdrawn before it, all claimed, no claim in flight.
func (c *Channel) prunable(before time.Time) bool {
	return c.Withdrawn && c.WithdrawnAt.Before(before) && c.ClaimTx == "" && c.RefundMark == "" && c.Claimed.Cmp(c.Charged) >= 0
}

// checkRefundMark checks MarkRefund's and ClearRefund's arguments and returns the key canonical.
func checkRefundMark(key ChannelKey, at *big.Int, mark string, marking bool) (ChannelKey, error) {
	key, err := key.canonical()
	if err != nil {
		return key, err
	}
	if marking {
		if err := checkAmount("the refund's amount", at); err != nil {
			return key, err
		}
	}
	if strings.TrimSpace(mark) == "" || len(mark) > 200 || strings.ContainsRune(mark, 0) {
		return key, fmt.Errorf("%w: refund mark %q of %s, expected a name of the refund (1 to 200 characters)", ErrInvalidChannel, mark, key)
	}
	return key, nil
}

// refundMarkIn is MarkRefund on the row c.
func refundMarkIn(c *Channel, at *big.Int, mark string, now time.Time) (Channel, error) {
	switch {
	case c.RefundMark != "" && c.RefundMark != mark:
		return *c, fmt.Errorf("%w: %s is being refunded by %s, marked at %s", ErrRefundTaken, c.Key, c.RefundMark, c.RefundMarkedAt.Format(time.RFC3339Nano))
	case c.Charged.Cmp(at) != 0:
		return *c, fmt.Errorf("%w: %s is at %s, not %s", ErrChannelMoved, c.Key, c.Charged, at)
	case c.RefundMark == mark:
		return *c, nil
	}
	next := *c
	next.RefundMark, next.RefundMarkedAt = mark, now
	return next, nil
}

// checkAmount refuses a nil or negative amount named what.
func checkAmount(what string, x *big.Int) error {
	if x == nil || x.Sign() < 0 {
		return fmt.Errorf("%w: %s is %v, expected an amount of 0 or more", ErrInvalidChannel, what, x)
	}
	return nil
}

// checkRead checks a read and returns it with its key canonical.
func checkRead(r ChannelRead) (ChannelRead, error) {
	var err error
	if r.Key, err = r.Key.canonical(); err != nil {
		return r, err
	}
	if err := checkAmount("the read's deposit", r.Deposit); err != nil {
		return r, err
	}
	if r.TotalClaimed == nil {
		r.TotalClaimed = new(big.Int)
	}
	if err := checkAmount("the read's totalClaimed", r.TotalClaimed); err != nil {
		return r, err
	}
	if r.WithdrawAmount != nil {
		if err := checkAmount("the read's withdrawAmount", r.WithdrawAmount); err != nil {
			return r, err
		}
	}
	return r, nil
}

// checkAccept checks AcceptVoucher's arguments and returns the key canonical.
func checkAccept(key ChannelKey, from, to *big.Int, v Voucher) (ChannelKey, error) {
	key, err := key.canonical()
	if err != nil {
		return key, err
	}
	if err := checkAmount("from", from); err != nil {
		return key, err
	}
	if err := checkAmount("to", to); err != nil {
		return key, err
	}
	switch {
	case to.Cmp(from) <= 0:
		return key, fmt.Errorf("%w: voucher of %s from %s to %s: a voucher must raise the cumulative amount", ErrInvalidChannel, key, from, to)
	case len(v.Signature) == 0 || len(v.Digest) != 32:
		return key, fmt.Errorf("%w: voucher of %s to %s has a signature of %d bytes and a digest of %d, expected a signature and a 32-byte digest",
			ErrInvalidChannel, key, to, len(v.Signature), len(v.Digest))
	}
	return key, nil
}

// checkClaims checks MarkClaimSent's arguments and returns the claims with canonical keys, in key order (the
// order a shared store locks their rows in).
func checkClaims(tx string, claims []ChannelClaim) ([]ChannelClaim, error) {
	if err := checkClaimTx(tx); err != nil {
		return nil, err
	}
	if len(claims) == 0 {
		return nil, fmt.Errorf("%w: claim %s names no channel", ErrInvalidChannel, tx)
	}
	out := make([]ChannelClaim, len(claims))
	for i, c := range claims {
		k, err := c.Key.canonical()
		if err != nil {
			return nil, err
		}
		if c.Amount == nil || c.Amount.Sign() <= 0 {
			return nil, fmt.Errorf("%w: claim %s of %s: amount %v, expected a positive amount", ErrInvalidChannel, tx, k, c.Amount)
		}
		out[i] = ChannelClaim{Key: k, Amount: new(big.Int).Set(c.Amount)}
	}
	slices.SortFunc(out, func(a, b ChannelClaim) int { return bytes.Compare(a.Key.bytes(), b.Key.bytes()) })
	for i := 1; i < len(out); i++ {
		if out[i].Key == out[i-1].Key {
			return nil, fmt.Errorf("%w: claim %s names channel %s twice", ErrInvalidChannel, tx, out[i].Key)
		}
	}
	return out, nil
}

// checkClaimTx refuses a claim transaction that is not spelled as a transaction hash: an empty one would name every
// channel with no claim in flight.
func checkClaimTx(tx string) error {
	if !x402.IsTxHash(tx) {
		return fmt.Errorf("%w: claim transaction %q, expected a transaction hash (0x and 64 hex digits)", ErrInvalidChannel, tx)
	}
	return nil
}

// canonicalTx is a transaction hash as the rows keep it.
func canonicalTx(tx string) string { return strings.ToLower(tx) }

// The rules of the channel rows, for the stores that run them in Go (memory, bolt); the PostgreSQL store runs the
// same rules in its statements, and the tests hold every store to one table of behaviour.

// observeIn applies read to the row prev (nil: none) at now and returns the row to write, and whether to write
// it.
func observeIn(prev *Channel, read ChannelRead, now time.Time) (Channel, bool) {
	if prev == nil {
		c := Channel{
			Key: read.Key, Config: read.Config,
			Charged: new(big.Int).Set(read.TotalClaimed), Claimed: new(big.Int).Set(read.TotalClaimed),
		}
		setRead(&c, read, now)
		return c, true
	}
	c := *prev
	if read.Block < c.DepositBlock {
		return c, false
	}
	setRead(&c, read, now)
	if read.TotalClaimed.Cmp(c.Claimed) > 0 {
		c.Claimed, c.ClaimedTx = new(big.Int).Set(read.TotalClaimed), ""
	}
	if c.ClaimTx != "" && c.ClaimAmount.Cmp(c.Claimed) <= 0 {
		c.ClaimTx, c.ClaimAmount, c.ClaimSentAt = "", nil, time.Time{}
	}
	if c.Claimed.Cmp(c.Charged) > 0 {
		// Claimed past what this journal accepted (its vouchers were lost, or another party claimed): the next
		// voucher must be above the claim, and no voucher of the journal's is left to claim.
		c.Charged, c.Signature, c.Digest, c.AcceptedBy = new(big.Int).Set(c.Claimed), nil, nil, ""
	}
	if c.Claimed.Cmp(c.Charged) >= 0 {
		c.UnclaimedSince = time.Time{}
	}
	return c, true
}

// setRead writes the chain's part of read into c.
func setRead(c *Channel, read ChannelRead, now time.Time) {
	c.Deposit, c.DepositBlock, c.DepositReadAt = new(big.Int).Set(read.Deposit), read.Block, now
	c.WithdrawRequestedAt, c.WithdrawAmount = read.WithdrawRequestedAt.UTC(), nil
	if read.WithdrawAmount != nil {
		c.WithdrawAmount = new(big.Int).Set(read.WithdrawAmount)
	}
	switch {
	case read.Withdrawn && !c.Withdrawn:
		c.Withdrawn, c.WithdrawnAt = true, now
	case !read.Withdrawn:
		// Deposited into again after a refund (the same configuration is the same channel).
		c.Withdrawn, c.WithdrawnAt = false, time.Time{}
	}
}

// acceptIn is AcceptVoucher on the row c: the row to write, or the refusal.
func acceptIn(c *Channel, from, to *big.Int, v Voucher, now time.Time) (Channel, error) {
	switch {
	case c.Withdrawn:
		return *c, fmt.Errorf("%w: %s was refunded or withdrawn at %s", ErrChannelWithdrawn, c.Key, c.WithdrawnAt.Format(time.RFC3339Nano))
	case c.RefundMark != "":
		return *c, fmt.Errorf("%w: %s: refund %s is on its way since %s", ErrChannelRefunding, c.Key, c.RefundMark, c.RefundMarkedAt.Format(time.RFC3339Nano))
	case c.Charged.Cmp(from) != 0:
		return *c, fmt.Errorf("%w: %s is at %s, not %s", ErrChannelMoved, c.Key, c.Charged, from)
	case to.Cmp(c.Deposit) > 0:
		return *c, fmt.Errorf("%w: %s: %s is above the deposit of %s (read at block %d)", ErrAboveDeposit, c.Key, to, c.Deposit, c.DepositBlock)
	}
	next := *c
	next.Charged = new(big.Int).Set(to)
	next.Signature, next.Digest = bytes.Clone(v.Signature), bytes.Clone(v.Digest)
	next.Vouchers++
	next.AcceptedAt, next.AcceptedBy = now, v.By
	if next.UnclaimedSince.IsZero() {
		next.UnclaimedSince = now
	}
	return next, nil
}

// claimSentIn is MarkClaimSent of one channel on its row c.
func claimSentIn(c *Channel, tx string, amount *big.Int, now time.Time) (Channel, error) {
	switch {
	case c.ClaimTx != "":
		return *c, fmt.Errorf("%w: %s has claim %s of %s in flight", ErrClaimTaken, c.Key, c.ClaimTx, c.ClaimAmount)
	case amount.Cmp(c.Charged) > 0:
		return *c, fmt.Errorf("%w: %s: claim of %s, but %s is accepted", ErrClaimTaken, c.Key, amount, c.Charged)
	case amount.Cmp(c.Claimed) <= 0:
		return *c, fmt.Errorf("%w: %s: claim of %s, but %s is claimed already", ErrClaimTaken, c.Key, amount, c.Claimed)
	}
	next := *c
	next.ClaimTx, next.ClaimAmount, next.ClaimSentAt = tx, new(big.Int).Set(amount), now
	return next, nil
}

// claimMinedIn is MarkClaimMined on a row c whose claim in flight is the mined one.
func claimMinedIn(c *Channel) Channel {
	next := *c
	if c.ClaimAmount.Cmp(c.Claimed) > 0 {
		next.Claimed, next.ClaimedTx = new(big.Int).Set(c.ClaimAmount), c.ClaimTx
	}
	switch {
	case next.Claimed.Cmp(next.Charged) >= 0:
		next.UnclaimedSince = time.Time{}
	case !c.ClaimSentAt.IsZero():
		// What is left was accepted after the claim's amount was read, about when it was sent.
		next.UnclaimedSince = c.ClaimSentAt
	}
	next.ClaimTx, next.ClaimAmount, next.ClaimSentAt = "", nil, time.Time{}
	return next
}

// claimFailedIn is MarkClaimFailed on a row c whose claim in flight failed.
func claimFailedIn(c *Channel) Channel {
	next := *c
	next.ClaimTx, next.ClaimAmount, next.ClaimSentAt = "", nil, time.Time{}
	return next
}

// sortUnclaimed orders channels oldest unclaimed voucher first, then by key.
func sortUnclaimed(cs []Channel) {
	slices.SortFunc(cs, func(a, b Channel) int {
		if c := a.UnclaimedSince.Compare(b.UnclaimedSince); c != 0 {
			return c
		}
		return bytes.Compare(a.Key.bytes(), b.Key.bytes())
	})
}

// sortRefunds orders channels oldest refund mark first, then by key.
func sortRefunds(cs []Channel) {
	slices.SortFunc(cs, func(a, b Channel) int {
		if c := a.RefundMarkedAt.Compare(b.RefundMarkedAt); c != 0 {
			return c
		}
		return bytes.Compare(a.Key.bytes(), b.Key.bytes())
	})
}

// sortInFlight orders channels oldest claim first, then by transaction and key.
func sortInFlight(cs []Channel) {
	slices.SortFunc(cs, func(a, b Channel) int {
		if c := a.ClaimSentAt.Compare(b.ClaimSentAt); c != 0 {
			return c
		}
		if c := strings.Compare(a.ClaimTx, b.ClaimTx); c != 0 {
			return c
		}
		return bytes.Compare(a.Key.bytes(), b.Key.bytes())
	})
}

// channelFormat is the first byte of a channel row as the memory and bolt stores keep it, as recordFormat is a
// record's.
const channelFormat byte = 1

// encodeChannel writes c as stored.
func encodeChannel(c *Channel) ([]byte, error) {
	body, err := json.Marshal(c)
	if err != nil {
		return nil, fmt.Errorf("encode channel %s: %w", c.Key, err)
	}
	return append([]byte{channelFormat}, body...), nil
}

// decodeChannel reads a channel row stored under key; damage is ErrCorrupt naming the channel.
func decodeChannel(key []byte, b []byte) (Channel, error) {
	name := strings.ReplaceAll(string(key), "\x00", "/")
	if len(b) == 0 || b[0] != channelFormat {
		return Channel{}, fmt.Errorf("%w: channel %s is empty or of an unknown format", ErrCorrupt, name)
	}
	var c Channel
	if err := json.Unmarshal(b[1:], &c); err != nil {
		return Channel{}, fmt.Errorf("%w: channel %s does not decode: %w", ErrCorrupt, name, err)
	}
	if !bytes.Equal(c.Key.bytes(), key) || c.Deposit == nil || c.Charged == nil || c.Claimed == nil || (c.ClaimTx != "") != (c.ClaimAmount != nil) {
		return Channel{}, fmt.Errorf("%w: channel stored under %s does not hold a whole row", ErrCorrupt, name)
	}
	return c, nil
}

// chanTxn is one atomic unit of work on the channel rows of the memory or bolt store.
type chanTxn interface {
	getChannel(key ChannelKey) (Channel, bool, error)
	putChannel(c *Channel) error
	// eachChannel calls fn with every row, in key order, until fn returns false.
	eachChannel(fn func(c *Channel) bool) error
	delChannel(key ChannelKey) error
}

// observeChannelIn is ObserveChannel inside a transaction.
func observeChannelIn(t chanTxn, read ChannelRead, now time.Time) (Channel, error) {
	prev, ok, err := t.getChannel(read.Key)
	if err != nil {
		return Channel{}, err
	}
	var p *Channel
	if ok {
		p = &prev
	}
	next, write := observeIn(p, read, now)
	if write {
		err = t.putChannel(&next)
	}
	return next, err
}

// acceptVoucherIn is AcceptVoucher inside a transaction.
func acceptVoucherIn(t chanTxn, key ChannelKey, from, to *big.Int, v Voucher, now time.Time) (Channel, error) {
	c, ok, err := t.getChannel(key)
	if err != nil {
		return Channel{}, err
	}
	if !ok {
		return Channel{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	}
	next, err := acceptIn(&c, from, to, v, now)
	if err != nil {
		return next, err
	}
	return next, t.putChannel(&next)
}

// claimSentAllIn is MarkClaimSent inside a transaction: every refusal comes before the first write.
func claimSentAllIn(t chanTxn, tx string, claims []ChannelClaim, now time.Time) error {
	next := make([]Channel, len(claims))
	for i, cl := range claims {
		c, ok, err := t.getChannel(cl.Key)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("%w: claim %s: %s", ErrChannelNotFound, tx, cl.Key)
		}
		if next[i], err = claimSentIn(&c, tx, cl.Amount, now); err != nil {
			return err
		}
	}
	for i := range next {
		if err := t.putChannel(&next[i]); err != nil {
			return err
		}
	}
	return nil
}

// claimEndIn ends the claim tx on every row it is in flight on, by end, and returns how many rows it changed.
func claimEndIn(t chanTxn, tx string, end func(*Channel) Channel) (int, error) {
	var hit []Channel
	if err := t.eachChannel(func(c *Channel) bool {
		if c.ClaimTx == tx {
			hit = append(hit, end(c))
		}
		return true
	}); err != nil {
		return 0, err
	}
	for i := range hit {
		if err := t.putChannel(&hit[i]); err != nil {
			return 0, err
		}
	}
	return len(hit), nil
}

// listChannelsIn lists the rows of network that want accepts.
func listChannelsIn(t chanTxn, network string, want func(*Channel) bool) ([]Channel, error) {
	var out []Channel
	err := t.eachChannel(func(c *Channel) bool {
		if c.Key.Network == network && want(c) {
			out = append(out, *c)
		}
		return true
	})
	return out, err
}

// markRefundIn is MarkRefund inside a transaction.
func markRefundIn(t chanTxn, key ChannelKey, at *big.Int, mark string, now time.Time) (Channel, error) {
	c, ok, err := t.getChannel(key)
	if err != nil {
		return Channel{}, err
	}
	if !ok {
		return Channel{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	}
	next, err := refundMarkIn(&c, at, mark, now)
	if err != nil || c.RefundMark == mark {
		return next, err // refused, or marked already by this refund
	}
	return next, t.putChannel(&next)
}

// clearRefundIn is ClearRefund inside a transaction.
func clearRefundIn(t chanTxn, key ChannelKey, mark string) (bool, error) {
	c, ok, err := t.getChannel(key)
	if err != nil || !ok || c.RefundMark != mark {
		return false, err
	}
	c.RefundMark, c.RefundMarkedAt = "", time.Time{}
	return true, t.putChannel(&c)
}

// pruneChannelsIn deletes the prunable rows, and returns how many.
func pruneChannelsIn(t chanTxn, before time.Time) (int, error) {
	var gone []ChannelKey
	if err := t.eachChannel(func(c *Channel) bool {
		if c.prunable(before) {
			gone = append(gone, c.Key)
		}
		return true
	}); err != nil {
		return 0, err
	}
	for _, k := range gone {
		if err := t.delChannel(k); err != nil {
			return 0, err
		}
	}
	return len(gone), nil
}

// RecordNote is what the request presenting a batch-settlement voucher serves it for: its route, resource and the
// description of that resource. The engine writes it on the voucher's record as it accepts the voucher (Route,
// Resource, Described), in the same write, so that a gate judges the voucher presented again by its record at
// that route and resource only (a voucher accepted and not served, presented again once a reload changed the
// route's price, say), and elsewhere by the route's terms (Buys). Amount is the price of the route's offer the
// request matched, "" when it matched none (the voucher is then judged by its record); it is not written.
type RecordNote struct{ Route, Resource, Described, Amount string }

// Buys reports whether the record of a voucher accepted and not served, noted when it was accepted, buys the
// response of the request n notes, which must be for the same resource: at the route it was accepted at, which
// describes the resource as it did then, whatever its price now (judged by its record); or at a route that sells it
// now at the price it was charged (a reload renumbered the gates configured alike or changed the route's
// description, a gateway of a cluster has one gate more before it): judged there by the route's terms, which it
// meets, as a payment of the exact scheme is. A route of the same URL at another price (chosen by a header, say)
// buys nothing with it.
func (n RecordNote) Buys(rec Record) bool {
	if rec.Resource != n.Resource {
		return false
	}
	return (rec.Route == n.Route && rec.Described == n.Described) || (n.Amount != "" && rec.Amount == n.Amount)
}

type recordNoteKey struct{}

// WithRecordNote returns ctx carrying note.
func WithRecordNote(ctx context.Context, note RecordNote) context.Context {
	return context.WithValue(ctx, recordNoteKey{}, note)
}

// RecordNoteOf is the note ctx carries, and whether it carries one.
func RecordNoteOf(ctx context.Context) (RecordNote, bool) {
	n, ok := ctx.Value(recordNoteKey{}).(RecordNote)
	return n, ok
}
