package journal

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The channel rows in PostgreSQL (x402_channels, migration 5). A voucher's compare-and-set is one statement, one
// round trip, outside any transaction (so through a transaction pooler too): an UPDATE whose WHERE is the whole
// rule (the row at exactly from, to within its deposit, not withdrawn), which PostgreSQL re-checks on the newest
// version of the row when a concurrent write made it wait. Two gateways sending the same step both wait for the
// row's lock; the second finds the amount moved and writes nothing. The rules are the ones the other stores run in
// Go (channel.go), written again as SQL; the tests hold every store to one table of behaviour.

// pgRefundMarkMigration gives a channel's row its refund mark (MarkRefund), which AcceptVoucher refuses. Columns
// only, NULL in every row there is: an instance of the release before goes on beside this one, but accepts vouchers
// of a channel being refunded (it does not read the mark): upgrade every gateway of a journal before relying on it.
const pgRefundMarkMigration = `
ALTER TABLE x402_channels ADD COLUMN IF NOT EXISTS refund_mark text;
ALTER TABLE x402_channels ADD COLUMN IF NOT EXISTS refund_marked_ns bigint;
CREATE INDEX IF NOT EXISTS x402_channels_refund_mark ON x402_channels (network) WHERE refund_mark IS NOT NULL;
`

// pgChannelCols are the columns scanChannel reads, numbers as text.
const pgChannelCols = `network, escrow, channel_id, config, deposit::text, deposit_block::text, deposit_read_ns,
withdraw_requested_ns, withdraw_amount::text, withdrawn_ns, charged::text, signature, digest, vouchers, accepted_ns,
accepted_by, unclaimed_since_ns, claimed::text, claimed_tx, claim_tx, claim_amount::text, claim_sent_ns, refund_mark,
refund_marked_ns`

// pgChannelKey selects the row of key $1, $2, $3.
const pgChannelKey = `network = $1 AND escrow = $2 AND channel_id = $3`

// pgObserveChannel is ObserveChannel's statement (observeIn's rules): $1-$3 the key, $4 the config, $5 deposit, $6
// block, $7 the read's time, $8 withdraw requested (ns or NULL), $9 withdraw amount, $10 withdrawn, $11 the chain's
// totalClaimed. It returns no row when the stored read is from a newer block. Every expression of the update
// reads the row as it was.
const pgObserveChannel = `INSERT INTO x402_channels AS c (network, escrow, channel_id, config, deposit, deposit_block,
	deposit_read_ns, withdraw_requested_ns, withdraw_amount, withdrawn_ns, charged, claimed)
VALUES ($1, $2, $3, $4, $5::numeric, $6::numeric, $7, $8, $9::numeric, CASE WHEN $10::boolean THEN $7::bigint END,
	$11::numeric, $11::numeric)
ON CONFLICT (network, escrow, channel_id) DO UPDATE SET
	deposit = EXCLUDED.deposit, deposit_block = EXCLUDED.deposit_block, deposit_read_ns = EXCLUDED.deposit_read_ns,
	withdraw_requested_ns = EXCLUDED.withdraw_requested_ns, withdraw_amount = EXCLUDED.withdraw_amount,
	withdrawn_ns = CASE WHEN $10::boolean THEN coalesce(c.withdrawn_ns, EXCLUDED.withdrawn_ns) END,
	claimed = greatest(c.claimed, EXCLUDED.claimed),
	claimed_tx = CASE WHEN EXCLUDED.claimed > c.claimed THEN NULL ELSE c.claimed_tx END,
	claim_tx = CASE WHEN c.claim_amount <= greatest(c.claimed, EXCLUDED.claimed) THEN NULL ELSE c.claim_tx END,
	claim_amount = CASE WHEN c.claim_amount <= greatest(c.claimed, EXCLUDED.claimed) THEN NULL ELSE c.claim_amount END,
	claim_sent_ns = CASE WHEN c.claim_amount <= greatest(c.claimed, EXCLUDED.claimed) THEN NULL ELSE c.claim_sent_ns END,
	charged = greatest(c.charged, EXCLUDED.claimed),
	signature = CASE WHEN EXCLUDED.claimed > c.charged THEN NULL ELSE c.signature END,
	digest = CASE WHEN EXCLUDED.claimed > c.charged THEN NULL ELSE c.digest END,
	accepted_by = CASE WHEN EXCLUDED.claimed > c.charged THEN NULL ELSE c.accepted_by END,
	unclaimed_since_ns = CASE WHEN greatest(c.claimed, EXCLUDED.claimed) >= c.charged THEN NULL ELSE c.unclaimed_since_ns END
WHERE EXCLUDED.deposit_block >= c.deposit_block
RETURNING ` + pgChannelCols

// pgVoucherStep is a voucher's step (acceptIn's rules) as an update returning the row taken: $1-$3 the key, $4 the
// amount the channel must be at, $5 the voucher's, $6 and $7 its signature and digest, $8 the time, $9 by whom.
const pgVoucherStep = `
	UPDATE x402_channels SET charged = $5::numeric, signature = $6, digest = $7, vouchers = vouchers + 1,
		accepted_ns = $8, accepted_by = $9, unclaimed_since_ns = coalesce(unclaimed_since_ns, $8)
	WHERE ` + pgChannelKey + ` AND charged = $4::numeric AND $5::numeric <= deposit AND withdrawn_ns IS NULL
		AND refund_mark IS NULL
	RETURNING *
`

// pgAcceptVoucher is AcceptVoucher's statement (acceptIn's rules): $1-$3 the key, $4 from, $5 to, $6 the
// signature, $7 the digest, $8 the time, $9 the voucher's By. Its first column says whether the voucher was accepted; the row is the
// one written, or, when nothing was, the row as the statement's snapshot saw it (which a concurrent step may have
// moved since: the update waited for it, and found the amount moved).
const pgAcceptVoucher = `WITH u AS (` + pgVoucherStep + `)
SELECT true, ` + pgChannelCols + ` FROM u
UNION ALL
SELECT false, ` + pgChannelCols + ` FROM x402_channels WHERE ` + pgChannelKey + ` AND NOT EXISTS (SELECT 1 FROM u)`

// pgAcceptVoucherRecord is AcceptVoucherRecord's statement: pgAcceptVoucher's, and with its step the insert of the
// voucher's record ($10-$17, pgInsertRecord's), in one statement and so one transaction. Its second column says
// whether the record was inserted (false when the step was not taken, or the record was there already).
const pgAcceptVoucherRecord = `WITH u AS (` + pgVoucherStep + `), ins AS (
	INSERT INTO x402_records (id, state, async, pending, claimed_ns, kept_until_ns, served_ns, data)
	SELECT $10::bytea, $11::text, $12::boolean, $13::boolean, $14::bigint, $15::bigint, $16::bigint, $17::bytea
	WHERE EXISTS (SELECT 1 FROM u)
	ON CONFLICT (id) DO NOTHING
	RETURNING 1
)
SELECT true, EXISTS (SELECT 1 FROM ins), ` + pgChannelCols + ` FROM u
UNION ALL
SELECT false, false, ` + pgChannelCols + ` FROM x402_channels WHERE ` + pgChannelKey + ` AND NOT EXISTS (SELECT 1 FROM u)`

// pgMarkRefund is MarkRefund's statement (refundMarkIn's rules): $1-$3 the key, $4 the amount, $5 the mark, $6 the
// time. Its first column says whether the row carries the mark now; the row as pgAcceptVoucher's.
const pgMarkRefund = `WITH u AS (
	UPDATE x402_channels SET refund_mark = $5, refund_marked_ns = CASE WHEN refund_mark = $5 THEN refund_marked_ns ELSE $6 END
	WHERE ` + pgChannelKey + ` AND charged = $4::numeric AND (refund_mark IS NULL OR refund_mark = $5)
	RETURNING *
)
SELECT true, ` + pgChannelCols + ` FROM u
UNION ALL
SELECT false, ` + pgChannelCols + ` FROM x402_channels WHERE ` + pgChannelKey + ` AND NOT EXISTS (SELECT 1 FROM u)`

// pgClaimMined is MarkClaimMined's statement (claimMinedIn's rules) of claim $1.
const pgClaimMined = `UPDATE x402_channels SET
	claimed = greatest(claimed, claim_amount),
	claimed_tx = CASE WHEN claim_amount > claimed THEN claim_tx ELSE claimed_tx END,
	unclaimed_since_ns = CASE WHEN greatest(claimed, claim_amount) >= charged THEN NULL ELSE claim_sent_ns END,
	claim_tx = NULL, claim_amount = NULL, claim_sent_ns = NULL
WHERE claim_tx = $1`

// pgClaimFailed is MarkClaimFailed's statement of claim $1.
const pgClaimFailed = `UPDATE x402_channels SET claim_tx = NULL, claim_amount = NULL, claim_sent_ns = NULL WHERE claim_tx = $1`

// scanChannel reads a row of pgChannelCols, after the leading destinations lead.
func scanChannel(row pgx.Row, lead ...any) (Channel, error) {
	var (
		c                                                   Channel
		config                                              []byte
		deposit, block, charged, claimed                    string
		withdrawAmount, claimAmount, claimedTx, claimTx, by *string
		refundMark                                          *string
		readNS                                              int64
		withdrawReqNS, withdrawnNS, acceptedNS, sinceNS     *int64
		sentNS, markedNS                                    *int64
		vouchers                                            int64
	)
	dest := append(lead, &c.Key.Network, &c.Key.Escrow, &c.Key.ID, &config, &deposit, &block, &readNS,
		&withdrawReqNS, &withdrawAmount, &withdrawnNS, &charged, &c.Signature, &c.Digest, &vouchers, &acceptedNS,
		&by, &sinceNS, &claimed, &claimedTx, &claimTx, &claimAmount, &sentNS, &refundMark, &markedNS)
	if err := row.Scan(dest...); err != nil {
		return Channel{}, err
	}
	bad := func(what string) (Channel, error) {
		return Channel{}, fmt.Errorf("%w: channel %s: %s does not read", ErrCorrupt, c.Key, what)
	}
	if err := json.Unmarshal(config, &c.Config); err != nil {
		return bad("its config")
	}
	var ok bool
	for _, f := range []struct {
		to   **big.Int
		from *string
	}{{&c.Deposit, &deposit}, {&c.Charged, &charged}, {&c.Claimed, &claimed}, {&c.WithdrawAmount, withdrawAmount}, {&c.ClaimAmount, claimAmount}} {
		if f.from == nil {
			continue
		}
		if *f.to, ok = new(big.Int).SetString(*f.from, 10); !ok {
			return bad("an amount (" + *f.from + ")")
		}
	}
	var err error
	if c.DepositBlock, err = strconv.ParseUint(block, 10, 64); err != nil {
		return bad("its deposit block")
	}
	c.DepositReadAt = time.Unix(0, readNS).UTC()
	c.WithdrawRequestedAt, c.WithdrawnAt, c.AcceptedAt = timeOfNS(withdrawReqNS), timeOfNS(withdrawnNS), timeOfNS(acceptedNS)
	c.UnclaimedSince, c.ClaimSentAt = timeOfNS(sinceNS), timeOfNS(sentNS)
	c.Withdrawn = withdrawnNS != nil
	c.Vouchers = uint64(vouchers)
	if by != nil {
		c.AcceptedBy = *by
	}
	if claimedTx != nil {
		c.ClaimedTx = *claimedTx
	}
	if claimTx != nil {
		c.ClaimTx = *claimTx
	}
	if refundMark != nil {
		c.RefundMark, c.RefundMarkedAt = *refundMark, timeOfNS(markedNS)
	}
	return c, nil
}

// timeOfNS is the time of a nullable unix-nanosecond column; zero for NULL.
func timeOfNS(ns *int64) time.Time {
	if ns == nil {
		return time.Time{}
	}
	return time.Unix(0, *ns).UTC()
}

// nsOfTime is t for a nullable unix-nanosecond column: NULL for the zero time.
func nsOfTime(t time.Time) *int64 {
	if t.IsZero() {
		return nil
	}
	ns := nanos(t)
	return &ns
}

// textOf is x as a numeric parameter; NULL for nil.
func textOf(x *big.Int) *string {
	if x == nil {
		return nil
	}
	s := x.String()
	return &s
}

// Channel implements Channels.
func (s *PostgresStore) Channel(ctx context.Context, key ChannelKey) (Channel, bool, error) {
	key, err := key.canonical()
	if err != nil {
		return Channel{}, false, err
	}
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return Channel{}, false, err
	}
	defer cancel()
	var (
		c  Channel
		ok bool
	)
	err = s.read(rctx, func() (err error) {
		c, ok, err = s.channelRow(rctx, key)
		return err
	})
	if err != nil {
		return Channel{}, false, s.fail(ctx, "channel", err)
	}
	return c, ok, nil
}

// channelRow reads the row of key.
func (s *PostgresStore) channelRow(ctx context.Context, key ChannelKey) (Channel, bool, error) {
	c, err := scanChannel(s.pool.QueryRow(ctx, `SELECT `+pgChannelCols+` FROM x402_channels WHERE `+pgChannelKey,
		key.Network, key.Escrow, key.ID))
	if errors.Is(err, pgx.ErrNoRows) {
		return Channel{}, false, nil
	}
	return c, err == nil, err
}

// ObserveChannel implements Channels, in one statement (and a read of the row when the stored read is newer).
func (s *PostgresStore) ObserveChannel(ctx context.Context, read ChannelRead) (Channel, error) {
	read, err := checkRead(read)
	if err != nil {
		return Channel{}, err
	}
	config, err := json.Marshal(read.Config)
	if err != nil {
		return Channel{}, fmt.Errorf("journal: observe channel %s: %w", read.Key, err)
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Channel{}, err
	}
	defer cancel()
	k := read.Key
	var (
		c     Channel
		found bool
	)
	err = retrySafe(func() (err error) {
		c, err = scanChannel(s.pool.QueryRow(wctx, pgObserveChannel, k.Network, k.Escrow, k.ID, config, read.Deposit.String(),
			strconv.FormatUint(read.Block, 10), nanos(s.opts.now()), nsOfTime(read.WithdrawRequestedAt), textOf(read.WithdrawAmount),
			read.Withdrawn, read.TotalClaimed.String()))
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		// A newer read is stored: nothing was written.
		err = s.read(wctx, func() (err error) {
			c, found, err = s.channelRow(wctx, k)
			return err
		})
		if err == nil && !found {
			err = fmt.Errorf("journal: observe channel %s: the row of a newer read is gone", k)
		}
	}
	if err != nil {
		return Channel{}, s.fail(ctx, "observe channel", err)
	}
	return c, nil
}

// AcceptVoucher implements Channels, in one statement: one round trip, committed (durable) when it returns. A
// connection that breaks after the statement was sent leaves its fate unknown (ErrUnavailable): read the row to
// learn it, and never serve on a voucher not known accepted.
func (s *PostgresStore) AcceptVoucher(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher) (Channel, error) {
	key, err := checkAccept(key, from, to, v)
	if err != nil {
		return Channel{}, err
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Channel{}, err
	}
	defer cancel()
	now := s.opts.now()
	var (
		c        Channel
		accepted bool
	)
	err = retrySafe(func() (err error) {
		c, err = scanChannel(s.pool.QueryRow(wctx, pgAcceptVoucher, key.Network, key.Escrow, key.ID, from.String(), to.String(),
			v.Signature, v.Digest, nanos(now), v.By), &accepted)
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Channel{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	case err != nil:
		return Channel{}, s.fail(ctx, "accept voucher", err)
	case accepted:
		return c, nil
	}
	if _, err := acceptIn(&c, from, to, v, now); err != nil {
		return c, err
	}
	// The snapshot shows the row as it was before another voucher's step, which the update waited for.
	return c, fmt.Errorf("%w: %s moved from %s as this voucher was written", ErrChannelMoved, key, from)
}

// AcceptVoucherRecord implements VoucherRecords: the step and the record in one statement, so that no crash, lost
// connection or database stopped between them leaves an accepted voucher without its record (which, once the
// channel's next voucher is accepted, could never be served: its payer charged for a response it did not get).
func (s *PostgresStore) AcceptVoucherRecord(ctx context.Context, key ChannelKey, from, to *big.Int, v Voucher, rec Record) (Channel, Record, error) {
	key, err := checkAccept(key, from, to, v)
	if err != nil {
		return Channel{}, Record{}, err
	}
	now := s.opts.now()
	// The record as Claim writes it, made before anything is sent: a record Claim would refuse writes nothing.
	if rec, err = claimed(rec, now); err != nil {
		return Channel{}, Record{}, err
	}
	row, err := rowOf(&rec)
	if err != nil {
		return Channel{}, Record{}, err
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Channel{}, Record{}, err
	}
	defer cancel()
	var (
		c                  Channel
		accepted, inserted bool
	)
	err = retrySafe(func() (err error) {
		c, err = scanChannel(s.pool.QueryRow(wctx, pgAcceptVoucherRecord, key.Network, key.Escrow, key.ID, from.String(), to.String(),
			v.Signature, v.Digest, nanos(now), v.By,
			rec.ID[:], string(rec.State), rec.Async, row.pending, row.claimedNS, row.keptNS, row.servedNS, row.data), &accepted, &inserted)
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Channel{}, Record{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	case err != nil:
		return Channel{}, Record{}, s.fail(ctx, "accept voucher", err)
	case accepted && inserted:
		return c, rec, nil
	case accepted:
		// The record was there already: the first written stands, as Claim's.
		got, ok, err := getRow(wctx, s.pool, rec.ID, false)
		if err != nil {
			return c, Record{}, s.fail(ctx, "accept voucher", err)
		}
		if !ok {
			// Pruned since the statement: the step is taken, and the voucher has its record again as Claim writes it.
			got, _, err = s.Claim(ctx, rec)
			return c, got, err
		}
		return c, got, nil
	}
	if _, err := acceptIn(&c, from, to, v, now); err != nil {
		return c, Record{}, err
	}
	return c, Record{}, fmt.Errorf("%w: %s moved from %s as this voucher was written", ErrChannelMoved, key, from)
}

var _ VoucherRecords = (*PostgresStore)(nil)

// Unclaimed implements Channels.
func (s *PostgresStore) Unclaimed(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.channels(ctx, "unclaimed", `SELECT `+pgChannelCols+` FROM x402_channels
WHERE network = $1 AND claim_tx IS NULL AND charged > claimed`, network)
	sortUnclaimed(out)
	return out, err
}

// ClaimsInFlight implements Channels.
func (s *PostgresStore) ClaimsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.channels(ctx, "claims in flight", `SELECT `+pgChannelCols+` FROM x402_channels
WHERE network = $1 AND claim_tx IS NOT NULL`, network)
	sortInFlight(out)
	return out, err
}

// channels reads the rows sql selects.
func (s *PostgresStore) channels(ctx context.Context, op, sql string, args ...any) ([]Channel, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return nil, err
	}
	defer cancel()
	var out []Channel
	err = s.read(rctx, func() error {
		out = out[:0]
		rows, err := s.pool.Query(rctx, sql, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			c, err := scanChannel(rows)
			if err != nil {
				return err
			}
			out = append(out, c)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, s.fail(ctx, op, err)
	}
	return out, nil
}

// MarkClaimSent implements Channels, in one transaction that locks the claimed rows (in key order, so that two
// claimers of overlapping channels wait for each other rather than deadlock), judges every one of them by
// claimSentIn, and writes them all or none.
func (s *PostgresStore) MarkClaimSent(ctx context.Context, tx string, claims []ChannelClaim) error {
	claims, err := checkClaims(tx, claims)
	if err != nil {
		return err
	}
	tx = canonicalTx(tx)
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	now := s.opts.now()
	networks, escrows, ids, amounts := make([]string, len(claims)), make([]string, len(claims)), make([]string, len(claims)), make([]string, len(claims))
	for i, cl := range claims {
		networks[i], escrows[i], ids[i], amounts[i] = cl.Key.Network, cl.Key.Escrow, cl.Key.ID, cl.Amount.String()
	}
	var refused error
	err = s.inTx(wctx, func(t pgx.Tx) error {
		refused = nil
		rows, err := t.Query(wctx, `SELECT `+pgChannelCols+` FROM x402_channels
WHERE (network, escrow, channel_id) IN (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))
ORDER BY network COLLATE "C", escrow COLLATE "C", channel_id COLLATE "C" FOR UPDATE`, networks, escrows, ids)
		if err != nil {
			return err
		}
		found := map[ChannelKey]Channel{}
		for rows.Next() {
			c, err := scanChannel(rows)
			if err != nil {
				rows.Close()
				return err
			}
			found[c.Key] = c
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		for _, cl := range claims {
			c, ok := found[cl.Key]
			if !ok {
				refused = fmt.Errorf("%w: claim %s: %s", ErrChannelNotFound, tx, cl.Key)
				return nil
			}
			if _, refused = claimSentIn(&c, tx, cl.Amount, now); refused != nil {
				return nil
			}
		}
		_, err = t.Exec(wctx, `UPDATE x402_channels c SET claim_tx = $1, claim_amount = w.amount::numeric, claim_sent_ns = $2
FROM unnest($3::text[], $4::text[], $5::text[], $6::text[]) AS w(network, escrow, channel_id, amount)
WHERE c.network = w.network AND c.escrow = w.escrow AND c.channel_id = w.channel_id`, tx, nanos(now), networks, escrows, ids, amounts)
		return err
	})
	if err != nil {
		return s.fail(ctx, "mark claim sent", err)
	}
	return refused
}

// MarkClaimMined implements Channels, in one statement.
func (s *PostgresStore) MarkClaimMined(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, "mark claim mined", pgClaimMined, tx)
}

// MarkClaimFailed implements Channels, in one statement.
func (s *PostgresStore) MarkClaimFailed(ctx context.Context, tx string) (int, error) {
	return s.claimEnd(ctx, "mark claim failed", pgClaimFailed, tx)
}

func (s *PostgresStore) claimEnd(ctx context.Context, op, sql, tx string) (int, error) {
	if err := checkClaimTx(tx); err != nil {
		return 0, err
	}
	return s.execCount(ctx, op, sql, canonicalTx(tx))
}

// PruneChannels implements Channels, in one statement.
func (s *PostgresStore) PruneChannels(ctx context.Context, withdrawnBefore time.Time) (int, error) {
	return s.execCount(ctx, "prune channels", `DELETE FROM x402_channels
WHERE withdrawn_ns < $1 AND claim_tx IS NULL AND refund_mark IS NULL AND claimed >= charged`, nanos(withdrawnBefore))
}

// MarkRefund implements Channels, in one statement, as AcceptVoucher.
func (s *PostgresStore) MarkRefund(ctx context.Context, key ChannelKey, at *big.Int, mark string) (Channel, error) {
	key, err := checkRefundMark(key, at, mark, true)
	if err != nil {
		return Channel{}, err
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Channel{}, err
	}
	defer cancel()
	now := s.opts.now()
	var (
		c      Channel
		marked bool
	)
	err = retrySafe(func() (err error) {
		c, err = scanChannel(s.pool.QueryRow(wctx, pgMarkRefund, key.Network, key.Escrow, key.ID, at.String(), mark, nanos(now)), &marked)
		return err
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Channel{}, fmt.Errorf("%w: %s", ErrChannelNotFound, key)
	case err != nil:
		return Channel{}, s.fail(ctx, "mark refund", err)
	case marked:
		return c, nil
	}
	if _, err := refundMarkIn(&c, at, mark, now); err != nil {
		return c, err
	}
	return c, fmt.Errorf("%w: %s moved from %s as the refund was marked", ErrChannelMoved, key, at)
}

// ClearRefund implements Channels, in one statement.
func (s *PostgresStore) ClearRefund(ctx context.Context, key ChannelKey, mark string) (bool, error) {
	key, err := checkRefundMark(key, nil, mark, false)
	if err != nil {
		return false, err
	}
	n, err := s.execCount(ctx, "clear refund", `UPDATE x402_channels SET refund_mark = NULL, refund_marked_ns = NULL
WHERE `+pgChannelKey+` AND refund_mark = $4`, key.Network, key.Escrow, key.ID, mark)
	return n > 0, err
}

// RefundsInFlight implements Channels.
func (s *PostgresStore) RefundsInFlight(ctx context.Context, network string) ([]Channel, error) {
	out, err := s.channels(ctx, "refunds in flight", `SELECT `+pgChannelCols+` FROM x402_channels
WHERE network = $1 AND refund_mark IS NOT NULL`, network)
	sortRefunds(out)
	return out, err
}

// execCount runs one statement that writes several rows and is safe to run twice (a second run finds nothing left
// to do), retried as a transaction is: after a deadlock (a claim's rows, locked in the order the statement finds
// them, against a MarkClaimSent locking some of them in key order) or a connection that broke. It returns how many
// rows the last run wrote.
func (s *PostgresStore) execCount(ctx context.Context, op, sql string, args ...any) (int, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return 0, err
	}
	defer cancel()
	var tag pgconn.CommandTag
	err = retryTx(wctx, func() (err error) {
		tag, err = s.pool.Exec(wctx, sql, args...)
		return err
	})
	if err != nil {
		return 0, s.fail(ctx, op, err)
	}
	return int(tag.RowsAffected()), nil
}

var _ Channels = (*PostgresStore)(nil)
