package journal

import (
	"context"
	"fmt"
	"math/big"
	"slices"
	"time"
)

// memChanTxn is a chanTxn over the memory store's channel rows; the caller holds the store's lock. Rows go in and
// out as copies, so that no caller shares a row's amounts or bytes with the store.
type memChanTxn struct{ s *MemoryStore }

func (t memChanTxn) getChannel(key ChannelKey) (Channel, bool, error) {
	c, ok := t.s.channels[string(key.bytes())]
	if !ok {
		return Channel{}, false, nil
	}
	return c.clone(), true, nil
}

func (t memChanTxn) putChannel(c *Channel) error {
	cp := c.clone()
	t.s.channels[string(c.Key.bytes())] = &cp
	return nil
}

func (t memChanTxn) eachChannel(fn func(*Channel) bool) error {
	keys := make([]string, 0, len(t.s.channels))
	for k := range t.s.channels {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		c := t.s.channels[k].clone()
		if !fn(&c) {
			return nil
		}
	}
	return nil
}

func (t memChanTxn) delChannel(key ChannelKey) error {
	delete(t.s.channels, string(key.bytes()))
	return nil
}

// Channel implements Channels.
func (s *MemoryStore) Channel(ctx context.Context, key ChannelKey) (Channel, bool, error) {
	key, err := key.canonical()
	if err != nil {
		return Channel{}, false, err
	}
	if err := s.lock(ctx); err != nil {
		return Channel{}, false, err
	}
	c, ok := s.channels[string(key.bytes())]
	s.mu.Unlock()
	if !ok {
		return Channel{}, false, nil
	}
	// Copied after the lock: a stored row is never changed, only replaced (see MemoryStore.channels).
	return c.clone(), true, nil
}

// ObserveChannel implements Channels.
func (s *MemoryStore) ObserveChannel(ctx context.Context, read ChannelRead) (Channel, error) {
	read, err := checkRead(read)
	if err != nil {
		return Channel{}, err
	}
	if err := s.lock(ctx); err != nil {
		return Channel{}, err
	}
	defer s.mu.Unlock()
	return observeChannelIn(memChanTxn{s}, read, s.opts.now())
}

// AcceptVoucher implements Channels.
func (s *MemoryStore) AcceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher) (Channel, error) {
	c, _, err := s.acceptVoucher(ctx, key, from, to, v, nil)
	return c, err
}

// AcceptVoucherRecord implements VoucherRecords.
func (s *MemoryStore) AcceptVoucherRecord(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec Record) (Channel, Record, error) {
	return s.acceptVoucher(ctx, key, from, to, v, &rec)
}

// acceptVoucher is AcceptVoucher, and with rec AcceptVoucherRecord.
func (s *MemoryStore) acceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec *Record) (Channel, Record, error) {
	key, err := checkAccept(key, from, to, v)
	if err != nil {
		return Channel{}, Record{}, err
	}
	// acceptVoucherIn's rule on the stored row itself, with no copy under the lock, which every request of the
	// gateway takes: the row written is acceptIn's new one, whose amount and bytes are its own and whose other
	// amounts are the replaced row's, which no one changes (see MemoryStore.channels); the caller gets a copy.
	// The record, as Claim's, is made and encoded before the lock.
	now := s.opts.now()
	enc, err := claimedEncoded(rec, now) // before the transaction: a failure there writes nothing
	if err != nil {
		return Channel{}, Record{}, err
	}
	if err := s.lock(ctx); err != nil {
		return Channel{}, Record{}, err
	}
	k := string(key.bytes())
	c, ok := s.channels[k]
	if !ok {
		s.mu.Unlock()
		return Channel{}, Record{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	}
	var (
		got   Record
		found bool
	)
	if rec != nil {
		// Read before the step, so that a record that cannot be read leaves everything as it was.
		if got, found, err = (memTxn{s}).get(rec.ID); err != nil {
			s.mu.Unlock()
			return Channel{}, Record{}, err
		}
	}
	next, err := acceptIn(c, from, to, v, now)
	if err == nil {
		s.channels[k] = &next
		if rec != nil && !found {
			memTxn{s}.putEncoded(rec, enc)
			got = *rec
		}
	} else {
		got = Record{}
	}
	s.mu.Unlock()
	return next.clone(), got, err
}

// Unclaimed implements Channels.
func (s *MemoryStore) Unclaimed(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, (*Channel).claimable)
	sortUnclaimed(out)
	return out, err
}

// ClaimsInFlight implements Channels.
func (s *MemoryStore) ClaimsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, func(c *Channel) bool { return c.ClaimTx != "" })
	sortInFlight(out)
	return out, err
}

func (s *MemoryStore) listChannels(ctx context.Context, network string, want func(*Channel) bool) ([]Channel, error) {
	if err := s.lock(ctx); err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	return listChannelsIn(memChanTxn{s}, network, want)
}

// MarkClaimSent implements Channels.
func (s *MemoryStore) MarkClaimSent(ctx context.Context, tx string, claims []ChannelClaim) error {
	claims, err := checkClaims(tx, claims)
	if err != nil {
		return err
	}
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	return claimSentAllIn(memChanTxn{s}, canonicalTx(tx), claims, s.opts.now())
}

// MarkClaimMined implements Channels.
func (s *MemoryStore) MarkClaimMined(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, tx, claimMinedIn)
}

// MarkClaimFailed implements Channels.
func (s *MemoryStore) MarkClaimFailed(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, tx, claimFailedIn)
}

func (s *MemoryStore) claimEnd(ctx context.Context, tx string, end func(*Channel) Channel) (int, error) {
	if err := checkClaimTx(tx); err != nil {
		return 0, err
	}
	if err := s.lock(ctx); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	return claimEndIn(memChanTxn{s}, canonicalTx(tx), end)
}

// PruneChannels implements Channels.
func (s *MemoryStore) PruneChannels(ctx context.Context, withdrawnBefore time.Time) (int, error) {
	if err := s.lock(ctx); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	return pruneChannelsIn(memChanTxn{s}, withdrawnBefore)
}

// MarkRefund implements Channels.
func (s *MemoryStore) MarkRefund(ctx context.Context, key ChannelKey, at *big.Int, mark string) (Channel, error) {
	key, err := checkRefundMark(key, at, mark, true)
	if err != nil {
		return Channel{}, err
	}
	if err := s.lock(ctx); err != nil {
		return Channel{}, err
	}
	defer s.mu.Unlock()
	return markRefundIn(memChanTxn{s}, key, at, mark, s.opts.now())
}

// ClearRefund implements Channels.
func (s *MemoryStore) ClearRefund(ctx context.Context, key ChannelKey, mark string) (bool, error) {
	key, err := checkRefundMark(key, nil, mark, false)
	if err != nil {
		return false, err
	}
	if err := s.lock(ctx); err != nil {
		return false, err
	}
	defer s.mu.Unlock()
	return clearRefundIn(memChanTxn{s}, key, mark)
}

// RefundsInFlight implements Channels.
func (s *MemoryStore) RefundsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, func(c *Channel) bool { return c.RefundMark != "" })
	sortRefunds(out)
	return out, err
}

var _ Channels = (*MemoryStore)(nil)
