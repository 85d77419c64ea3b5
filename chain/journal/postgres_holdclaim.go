package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A settlement's claim of its payment, its funds hold with take and the write-ahead record of the transaction it
// signed, in one round trip. The claim and the hold are needed before anything leaves, and the record of the signed
// transaction too (a crash after the send must find it); none of the three decides anything the database could not
// decide itself. So an engine settling on the same PostgreSQL store as its shared holds signs first (locally:
// nothing leaves, and a record that is not written leaves the wallet's nonce unused), and sends one pipelined batch
// of two transactions:
//
//	begin isolation level read committed; synchronous_commit off for it
//	the context's deferred writes (journal.Defer): a gate's record of the payment
//	the hold with take (postgres_hold.go), refused by a record of the payment: whosever it is, it is not ours yet
//	the claim: the record inserted, ON CONFLICT DO NOTHING
//	commit
//	begin isolation level read committed
//	the claim made broadcast as sign changes it, in one statement, as UpdateFencedKnown writes it: only under the
//	  wallet's lease at the fence (its row read under a share lock), where the record is still the claim just
//	  written, and where the payment's hold counts (taken, or there before)
//	commit
//
// Two transactions, so that the key's row lock, which serializes every hold of one payer across the cluster, is
// let go without waiting for the WAL to reach the disk (pgHoldCommitsAsync): in one transaction committed
// synchronously, one payer's settlements queued behind one another's flushes, and one gateway on PostgreSQL
// settled a single busy payer's payments at 0.54-0.59 of what it did on bbolt at concurrency 32 (1.07-1.12 with
// synchronous_commit off everywhere, docs/BENCHMARKS.md). The second commits synchronously, and PostgreSQL flushes
// the WAL in order: once it returns, the claim, the hold and the deferred writes are durable too, before the
// transaction is sent. The claim and its hold commit together or not at all: a batch broken between the two
// transactions leaves both, as a claim whose answer was lost (reconciliation releases such a claim, its hold
// first), never a hold without its claim. What the second did not write is the settlement's to end as any claim
// that sent nothing (Release, its hold let go): the hold refused for want of funds, the lease lost. No record of a
// transaction is written that the settlement may not send. A deferred write or a hold statement that fails makes
// the server skip the rest of the batch: nothing is written.
//
// The hold goes first, so that its check for a record of the payment sees only another's: a payment another
// settlement claimed is then neither held nor claimed here, and the caller, which lost, touches nothing of it.
// Two such transactions for one payment take the same key's lock (one payment, one payer), so the second sees
// the first's record once it commits. A claim made alone (Claim) that commits between this hold's statement and
// this claim's insert leaves this hold in place and this claim unwritten: the hold is of the same payment (its id
// is the payment's), so it is the winner's to count and end, as the hold it would have taken itself; the loser
// must not end it. A claim written with a hold refused (the payer's funds fall short) is the caller's: it ends it
// as a refused settlement ends its claim (Release).

// HeldClaim is the claim's and the hold's part of HoldClaimAndSign's outcome.
type HeldClaim struct {
	// Claimed says the claim was written: the payment is the caller's to settle. Rec is then the record as
	// written; otherwise the record that was there (another's claim, its broadcast or its final answer), and
	// nothing of the caller's was written, the hold included (see above).
	Claimed bool
	Rec     Record
	// Held and Left are Hold's answer, when Claimed.
	Held bool
	Left *big.Int
}

// ClaimsWithHold reports whether a settlement journalled in s and holding funds in c can claim its payment in the
// batch of its hold (HoldClaimAndSign): both are one PostgreSQL store.
func ClaimsWithHold(s Store, c Cluster) bool {
	ps, ok := s.(*PostgresStore)
	return ok && c != nil && Store(ps) == Store(c)
}

// retryBeforeCommit runs once again after a serialization failure or a deadlock, which the database reports
// before anything is committed, and after a failure that sent nothing (pgconn.SafeToRetry); never after a batch
// that reached the database and broke, whose commit is unknown: a transaction that writes a claim is not safe to
// run twice (a second run finds its own record, and would answer the claim lost).
func retryBeforeCommit(ctx context.Context, once func() error) error {
	for attempt := 1; ; attempt++ {
		err := once()
		switch {
		case err == nil:
			return nil
		case hasCode(err, "40001", "40P01") && attempt <= pgTxRetries:
			time.Sleep(time.Duration(attempt) * time.Duration(1+randN(4)) * time.Millisecond)
		case pgconn.SafeToRetry(err) && attempt == 1 && ctx.Err() == nil:
		default:
			return err
		}
	}
}

// pgClaimSigned makes the claim just written broadcast, as updateFencedKnown's statement, where the payment's hold
// counts: $12 its key, $13 the read block, $14 the chain time (numeric as text: the rule of pgHoldSQL's live holds).
const pgClaimSigned = `WITH lease AS (
	SELECT 1 FROM x402_leases WHERE name = $9 AND owner = $10 AND fence = $11 AND expires_at > now() FOR SHARE
), written AS (
	UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5, served_ns = $6, data = $7
	WHERE id = $1 AND data = $8 AND served_ns IS NULL AND EXISTS (SELECT 1 FROM lease)
		AND EXISTS (SELECT 1 FROM x402_holds WHERE id = $1 AND hold_key = $12::text
			AND ((mined = 0 AND deadline >= $14::numeric) OR mined > $13::numeric))
	RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM lease), EXISTS (SELECT 1 FROM written)`

// SignedClaim is the outcome of HoldClaimAndSign.
type SignedClaim struct {
	// HeldClaim: Claimed, Rec the claim as written (or the record that was there, and
	// nothing of the caller's written), Held and Left.
	HeldClaim
	// Signed says the claim was made broadcast with the signed transaction: Broadcast is the record as written.
	Signed    bool
	Broadcast Record
}

// HoldClaimAndSign writes c.Hold with take of h and c.Claim of r, and then UpdateFencedKnown of the claim with sign
// (the settlement's signed transaction) under lease at fence, where the hold counts, in one batch (see above), with
// the deferred writes of ctx in front; h.ID must be r.ID, and ClaimsWithHold(c, c) true. Claimed and held but the
// lease not held: the claim and the hold written, nothing signed, and an error wrapping ErrFenced. Claimed, not
// held: the claim written, nothing signed. Another's record there: Claimed false and Rec that record, as Claim
// answers a claim it lost (a record released between the batch and the read leaves the payment free again: the
// batch runs again, four times at most). Any other error says the batch may have committed, all of it or its first
// transaction only: the caller must neither end the hold nor release the claim (reconciliation releases a claim
// nobody settles, its hold first, and sends a broadcast record nobody sends), nor give the signed transaction's
// nonce to another.
func HoldClaimAndSign(ctx context.Context, c Cluster, h Hold, avail *big.Int, readBlock, chainTime uint64, r Record, lease string, fence uint64, sign func(*Record) error) (SignedClaim, error) {
	ps, ok := c.(*PostgresStore)
	switch {
	case !ok:
		return SignedClaim{}, fmt.Errorf("journal: a claim with its hold needs a PostgreSQL store, not %T", c)
	case h.ID != r.ID:
		return SignedClaim{}, fmt.Errorf("journal: a claim of %s with the hold of %s", r.ID, h.ID)
	}
	if err := checkHold(h, avail); err != nil {
		return SignedClaim{}, err
	}
	for attempt := 0; ; attempt++ {
		out, err := ps.holdClaimAndSign(ctx, h, avail, readBlock, chainTime, r, lease, fence, sign)
		if err != nil || out.Claimed {
			return out, err
		}
		rctx, cancel, err := ps.begin(ctx, false)
		if err != nil {
			return SignedClaim{}, err
		}
		rec, found, err := getRow(rctx, ps.pool, r.ID, false)
		cancel()
		switch {
		case err != nil:
			return SignedClaim{}, ps.fail(ctx, "claim", err)
		case found:
			return SignedClaim{HeldClaim: HeldClaim{Rec: rec}}, nil
		case attempt == 3:
			return SignedClaim{}, fmt.Errorf("journal: claim of %s: the record came and went four times", r.ID)
		}
	}
}

// holdClaimAndSign runs HoldClaimAndSign's batch once (tried again only where nothing of it reached the database,
// or the database refused it before anything committed); Claimed false with no error: another's record was there.
func (s *PostgresStore) holdClaimAndSign(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, r Record, lease string, fence uint64, sign func(*Record) error) (SignedClaim, error) {
	items, done, err := s.carry(ctx)
	if err != nil {
		return SignedClaim{}, err
	}
	wctx, cancel, err := s.start(ctx, true)
	if err != nil {
		done(err)
		return SignedClaim{}, err
	}
	defer cancel()
	// The claim's row as Claim would write it, then sign's change of it as UpdateFencedKnown would write it.
	now := s.opts.now()
	t := &behindClaimTxn{}
	claim, _, err := claimIn(t, r, now)
	var (
		next     Record
		was      []byte
		row      pgRow
		signArgs []any
	)
	if err == nil {
		next, err = updateIn(&pgKnownTxn{prev: claim}, r.ID, sign, now)
	}
	if err == nil {
		was, err = encodeRecord(&claim)
	}
	if err == nil {
		row, err = rowOf(&next)
	}
	if err != nil {
		done(s.sendItems(wctx, items)) // refused before anything was sent: what it carried goes alone
		return SignedClaim{}, err
	}
	signArgs = []any{next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data, was,
		lease, s.instance, int64(fence), h.Key, strconv.FormatUint(readBlock, 10), strconv.FormatUint(chainTime, 10)}
	var (
		d                holdDecision
		claimed, leased  bool
		signed, afterOne bool
		broken           error
	)
	err = retryBeforeCommit(wctx, func() error {
		var err error
		claimed, leased, signed, afterOne, err = s.holdClaimAndSignOnce(wctx, items, &d, h, avail, readBlock, chainTime, t.w.args, signArgs)
		if err != nil && afterOne {
			// The first transaction committed, the claim with it: never run again (it would find its own record).
			broken = err
			return nil
		}
		return err
	})
	if err == nil {
		err = broken
	}
	done(err) // the deferred writes landed with the first transaction, or not at all
	if err != nil {
		return SignedClaim{}, s.fail(ctx, "claim with hold and signed transaction", err)
	}
	if d.recorded || !claimed {
		return SignedClaim{}, nil
	}
	ok, left, err := d.decide(h, avail)
	if err != nil {
		return SignedClaim{}, err
	}
	out := SignedClaim{HeldClaim: HeldClaim{Claimed: true, Rec: claim, Held: ok, Left: left}, Signed: signed}
	switch {
	case signed:
		out.Broadcast = next
	case ok && !leased:
		return out, fmt.Errorf("%w: %s at fence %d", ErrFenced, lease, fence)
	case ok:
		// Held, leased, and not written: the hold went or the record changed between the two (taken over and
		// released, say). The caller writes its record as it would without (UpdateFenced reads the record).
	}
	return out, nil
}

// holdClaimAndSignOnce sends HoldClaimAndSign's batch and reads what each statement returned: items' outcomes
// (for done), the hold's decision into d, whether the claim was written, whether the lease is held, and whether
// the claim was made broadcast; afterOne says the first transaction committed.
func (s *PostgresStore) holdClaimAndSignOnce(ctx context.Context, items []*behindWrite, d *holdDecision, h Hold, avail *big.Int, readBlock, chainTime uint64, claimArgs, signArgs []any) (claimed, leased, signed, afterOne bool, err error) {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, false, false, false, err
	}
	// A connection left inside the transaction is closed by the pool rather than reused (see txInOne).
	defer c.Release()
	b := &pgx.Batch{}
	b.Queue("begin isolation level read committed")
	b.Queue(pgHoldCommitsAsync)
	queueBehind(b, items)
	d.queue(s, b, h, avail, readBlock, chainTime, true, nil) // a settlement is under no gate's guard (postgres_markbehind.go)
	b.Queue(pgInsertRecord, claimArgs...)
	b.Queue("commit")
	b.Queue("begin isolation level read committed")
	b.Queue(pgClaimSigned, signArgs...)
	b.Queue("commit")
	br := c.SendBatch(ctx, b)
	err = func() error {
		for range 2 { // begin, synchronous_commit
			if _, err := br.Exec(); err != nil {
				return err
			}
		}
		if err := readBehind(br, items); err != nil {
			return err
		}
		for range 3 { // the key's row, its lock, the holds that no longer count
			if _, err := br.Exec(); err != nil {
				return err
			}
		}
		if err := br.QueryRow().Scan(&d.recorded, &d.fits, &d.sum, &d.held, &d.clash); err != nil {
			return err
		}
		tag, err := br.Exec()
		if err != nil {
			return err
		}
		claimed = tag.RowsAffected() == 1
		if _, err := br.Exec(); err != nil {
			return commitError{err}
		}
		markSent(items) // the first transaction committed, and they with it
		afterOne = true
		if _, err := br.Exec(); err != nil {
			return err
		}
		if err := br.QueryRow().Scan(&leased, &signed); err != nil {
			return err
		}
		if _, err := br.Exec(); err != nil {
			return commitError{err}
		}
		return nil
	}()
	if err = errors.Join(err, closeErr(br.Close(), err)); err != nil {
		if !unavailable(err) {
			// A statement failed: the server skipped the rest of the batch, COMMIT too.
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			c.Exec(rctx, "rollback")
			cancel()
		}
		return false, false, false, afterOne, err
	}
	return claimed, leased, signed, true, nil
}
