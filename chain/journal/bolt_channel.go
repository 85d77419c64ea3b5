package journal

import (
	"context"
	"fmt"
	"math/big"
	"time"
)

// boltChanTxn is a chanTxn over a bolt transaction; a failed write taints it, as the records' writes do.
type boltChanTxn struct{ t *boltTxn }

func (b boltChanTxn) getChannel(key ChannelKey) (Channel, bool, error) {
	k := key.bytes()
	v := b.t.tx.Bucket(bucketChannels).Get(k)
	if v == nil {
		return Channel{}, false, nil
	}
	c, err := decodeChannel(k, v)
	return c, err == nil, err
}

func (b boltChanTxn) putChannel(c *Channel) error {
	enc, err := encodeChannel(c)
	if err != nil {
		return err // nothing written yet
	}
	if err := b.t.tx.Bucket(bucketChannels).Put(c.Key.bytes(), enc); err != nil {
		b.t.tainted = true
		return fmt.Errorf("journal: write channel %s: %w", c.Key, err)
	}
	return nil
}

func (b boltChanTxn) eachChannel(fn func(*Channel) bool) error {
	cur := b.t.tx.Bucket(bucketChannels).Cursor()
	for k, v := cur.First(); k != nil; k, v = cur.Next() {
		c, err := decodeChannel(k, v)
		if err != nil {
			return err
		}
		if !fn(&c) {
			return nil
		}
	}
	return nil
}

func (b boltChanTxn) delChannel(key ChannelKey) error {
	if err := b.t.tx.Bucket(bucketChannels).Delete(key.bytes()); err != nil {
		b.t.tainted = true
		return fmt.Errorf("journal: delete channel %s: %w", key, err)
	}
	return nil
}

// channelWrite runs op in the next group commit (fsynced before it returns) and returns op's own error when the
// commit succeeded.
func (s *BoltStore) channelWrite(ctx context.Context, op func(boltChanTxn) error) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) { opErr = op(boltChanTxn{t}) })
	if err == nil {
		err = opErr
	}
	return err
}

// Channel implements Channels.
func (s *BoltStore) Channel(ctx context.Context, key ChannelKey) (Channel, bool, error) {
	key, err := key.canonical()
	if err != nil {
		return Channel{}, false, err
	}
	var (
		c  Channel
		ok bool
	)
	err = s.read(ctx, func(t *boltTxn) (err error) {
		c, ok, err = boltChanTxn{t}.getChannel(key)
		return err
	})
	return c, ok, err
}

// ObserveChannel implements Channels.
func (s *BoltStore) ObserveChannel(ctx context.Context, read ChannelRead) (Channel, error) {
	read, err := checkRead(read)
	if err != nil {
		return Channel{}, err
	}
	now := s.opts.now()
	var c Channel
	err = s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		c, err = observeChannelIn(t, read, now)
		return err
	})
	if err != nil {
		return Channel{}, err
	}
	return c, nil
}

// AcceptVoucher implements Channels: the compare-and-set runs in the commit loop, one writer at a time, and
// returns once its commit is fsynced.
func (s *BoltStore) AcceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher) (Channel, error) {
	c, _, err := s.acceptVoucher(ctx, key, from, to, v, nil)
	return c, err
}

// AcceptVoucherRecord implements VoucherRecords: the step and the record in one commit of the commit loop.
func (s *BoltStore) AcceptVoucherRecord(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec Record) (Channel, Record, error) {
	return s.acceptVoucher(ctx, key, from, to, v, &rec)
}

// acceptVoucher is AcceptVoucher, and with rec AcceptVoucherRecord. Every refusal comes before the first write:
// the commit loop commits the other operations of its transaction whatever this one answers.
func (s *BoltStore) acceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec *Record) (Channel, Record, error) {
	key, err := checkAccept(key, from, to, v)
	if err != nil {
		return Channel{}, Record{}, err
	}
	now := s.opts.now()
	enc, err := claimedEncoded(rec, now) // before the transaction: a failure there writes nothing
	if err != nil {
		return Channel{}, Record{}, err
	}
	var (
		c   Channel
		got Record
	)
	err = s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		found := false
		if rec != nil {
			if got, found, err = t.t.get(rec.ID); err != nil {
				return err
			}
		}
		if c, err = acceptVoucherIn(t, key, from, to, v, now); err != nil {
			got = Record{}
			return err
		}
		if rec != nil && !found {
			if err := t.t.write(rec.ID, enc, nil, rec); err != nil {
				t.t.tainted = true // the step is written: the commit rolls both back
				return fmt.Errorf("journal: write %s: %w", rec.ID, err)
			}
			got = *rec
		}
		return nil
	})
	return c, got, err
}

// Unclaimed implements Channels.
func (s *BoltStore) Unclaimed(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, (*Channel).claimable)
	sortUnclaimed(out)
	return out, err
}

// ClaimsInFlight implements Channels.
func (s *BoltStore) ClaimsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, func(c *Channel) bool { return c.ClaimTx != "" })
	sortInFlight(out)
	return out, err
}

func (s *BoltStore) listChannels(ctx context.Context, network string, want func(*Channel) bool) ([]Channel, error) {
	var out []Channel
	err := s.read(ctx, func(t *boltTxn) (err error) {
		out, err = listChannelsIn(boltChanTxn{t}, network, want)
		return err
	})
	return out, err
}

// MarkClaimSent implements Channels.
func (s *BoltStore) MarkClaimSent(ctx context.Context, tx string, claims []ChannelClaim) error {
	claims, err := checkClaims(tx, claims)
	if err != nil {
		return err
	}
	now := s.opts.now()
	return s.channelWrite(ctx, func(t boltChanTxn) error { return claimSentAllIn(t, canonicalTx(tx), claims, now) })
}

// MarkClaimMined implements Channels.
func (s *BoltStore) MarkClaimMined(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, tx, claimMinedIn)
}

// MarkClaimFailed implements Channels.
func (s *BoltStore) MarkClaimFailed(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, tx, claimFailedIn)
}

func (s *BoltStore) claimEnd(ctx context.Context, tx string, end func(*Channel) Channel) (int, error) {
	if err := checkClaimTx(tx); err != nil {
		return 0, err
	}
	var n int
	err := s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		n, err = claimEndIn(t, canonicalTx(tx), end)
		return err
	})
	return n, err
}

// PruneChannels implements Channels.
func (s *BoltStore) PruneChannels(ctx context.Context, withdrawnBefore time.Time) (int, error) {
	var n int
	err := s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		n, err = pruneChannelsIn(t, withdrawnBefore)
		return err
	})
	return n, err
}

// MarkRefund implements Channels.
func (s *BoltStore) MarkRefund(ctx context.Context, key ChannelKey, at *big.Int, mark string) (Channel, error) {
	key, err := checkRefundMark(key, at, mark, true)
	if err != nil {
		return Channel{}, err
	}
	now := s.opts.now()
	var c Channel
	err = s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		c, err = markRefundIn(t, key, at, mark, now)
		return err
	})
	return c, err
}

// ClearRefund implements Channels.
func (s *BoltStore) ClearRefund(ctx context.Context, key ChannelKey, mark string) (bool, error) {
	key, err := checkRefundMark(key, nil, mark, false)
	if err != nil {
		return false, err
	}
	var ok bool
	err = s.channelWrite(ctx, func(t boltChanTxn) (err error) {
		ok, err = clearRefundIn(t, key, mark)
		return err
	})
	return ok, err
}

// RefundsInFlight implements Channels.
func (s *BoltStore) RefundsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.listChannels(ctx, network, func(c *Channel) bool { return c.RefundMark != "" })
	sortRefunds(out)
	return out, err
}

var _ Channels = (*BoltStore)(nil)
