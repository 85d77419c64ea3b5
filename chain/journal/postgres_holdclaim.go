package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A settlement's claim of its payment and its funds hold with take, in one round trip. Both are needed before the
// settlement signs anything, nothing is decided between them that the database could not decide itself, and both
// lock or insert under the same key: so an engine that settles on the same PostgreSQL store as its shared holds
// sends them as one transaction, in one pipelined batch (the deferred writes of the context, a gate's record of
// the payment, riding in front):
//
//	begin isolation level read committed; synchronous_commit off for it
//	the context's deferred writes (journal.Defer)
//	the hold with take (postgres_hold.go), refused by a record of the payment: whosever it is, it is not ours yet
//	commit
//	begin isolation level read committed
//	the claim: the record inserted, ON CONFLICT DO NOTHING
//	commit
//
// Two transactions, so that the key's row lock, which serializes every hold of one payer across the cluster, is
// let go without waiting for the WAL to reach the disk (pgHoldCommitsAsync): in one transaction committed
// synchronously, one payer's settlements queued behind one another's flushes, and one gateway on PostgreSQL
// settled a single busy payer's payments at 0.54-0.59 of what it did on bbolt at concurrency 32 (1.07-1.12 with
// synchronous_commit off everywhere, docs/BENCHMARKS.md). The claim's transaction commits synchronously, and
// PostgreSQL flushes the WAL in order: when it returns, the hold and the deferred writes before it are durable
// too, before anything is signed on their strength. A batch that fails between the two (the connection broke)
// may leave the hold and the deferred writes without the claim; the caller is told the outcome is unknown, as it
// is for any broken batch, and such a hold holds nothing past its deadline. A deferred write or a hold statement
// that fails makes the server skip the rest of the batch: nothing is written.
//
// The hold goes first, so that its check for a record of the payment sees only another's: a payment another
// settlement claimed is then neither held nor claimed here, and the caller, which lost, touches nothing of it.
// Two such transactions for one payment take the same key's lock (one payment, one payer), so the second sees
// the first's record once it commits. A claim made alone (Claim) that commits between this hold's statement and
// this claim's insert leaves this hold in place and this claim unwritten: the hold is of the same payment (its id
// is the payment's), so it is the winner's to count and end, as the hold it would have taken itself; the loser
// must not end it. A claim written with a hold refused (the payer's funds fall short) is the caller's: it ends it
// as a refused settlement ends its claim (Release).

// HeldClaim is the outcome of HoldAndClaim.
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
// batch of its hold (HoldAndClaim): both are one PostgreSQL store.
func ClaimsWithHold(s Store, c Cluster) bool {
	ps, ok := s.(*PostgresStore)
	return ok && c != nil && Store(ps) == Store(c)
}

// HoldAndClaim is c.Hold with take of h, then c.Claim of r, in one transaction sent as one batch, with the
// deferred writes of ctx in front (see above); h.ID must be r.ID, and ClaimsWithHold(c, c) true. An error says
// the transaction may or may not have committed: the caller must then neither end the hold nor release the
// claim (reconciliation releases a claim nobody settles, its hold first).
func HoldAndClaim(ctx context.Context, c Cluster, h Hold, avail *big.Int, readBlock, chainTime uint64, r Record) (HeldClaim, error) {
	ps, ok := c.(*PostgresStore)
	switch {
	case !ok:
		return HeldClaim{}, fmt.Errorf("journal: a claim with its hold needs a PostgreSQL store, not %T", c)
	case h.ID != r.ID:
		return HeldClaim{}, fmt.Errorf("journal: a claim of %s with the hold of %s", r.ID, h.ID)
	}
	if err := checkHold(h, avail); err != nil {
		return HeldClaim{}, err
	}
	for attempt := 0; ; attempt++ {
		out, err := ps.holdAndClaim(ctx, h, avail, readBlock, chainTime, r)
		if err != nil || out.Claimed {
			return out, err
		}
		// Another's record was there: read it, as Claim answers a claim it lost.
		rctx, cancel, err := ps.begin(ctx, false)
		if err != nil {
			return HeldClaim{}, err
		}
		rec, found, err := getRow(rctx, ps.pool, r.ID, false)
		cancel()
		switch {
		case err != nil:
			return HeldClaim{}, ps.fail(ctx, "claim", err)
		case found:
			return HeldClaim{Rec: rec}, nil
		case attempt == 3:
			return HeldClaim{}, fmt.Errorf("journal: claim of %s: the record came and went four times", r.ID)
		}
		// Released between the two: the payment is free again.
	}
}

// holdAndClaim runs HoldAndClaim's transactions once (tried again only where nothing of them reached the database,
// or the database refused them before anything committed; when it refused the claim's after the hold's committed,
// the claim's alone); Claimed false with no error: another's record was there.
func (s *PostgresStore) holdAndClaim(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, r Record) (HeldClaim, error) {
	items, done, err := s.carry(ctx)
	if err != nil {
		return HeldClaim{}, err
	}
	wctx, cancel, err := s.start(ctx, true)
	if err != nil {
		done(err)
		return HeldClaim{}, err
	}
	defer cancel()
	// The claim's row as Claim would write it (claimIn validates and stamps it), inserted as Claim inserts it.
	t := &behindClaimTxn{}
	rec, _, err := claimIn(t, r, s.opts.now())
	if err != nil {
		done(s.sendItems(wctx, items)) // refused before anything was sent: what it carried goes alone
		return HeldClaim{}, err
	}
	var (
		d                      holdDecision
		claimed, holdCommitted bool
	)
	err = retryBeforeCommit(wctx, func() error {
		var err error
		if holdCommitted {
			// The hold's transaction committed, the deferred writes with it: run again, they would find
			// themselves there (a gate's record, a plain insert, would fail as another's and stop the claim).
			// Only the claim's transaction, refused before it committed, runs again.
			claimed, err = s.claimAfterHold(wctx, t.w.args)
			return err
		}
		claimed, holdCommitted, err = s.holdAndClaimOnce(wctx, items, &d, h, avail, readBlock, chainTime, t.w.args)
		return err
	})
	if err == nil {
		markSent(items)
	}
	done(err)
	if err != nil {
		return HeldClaim{}, s.fail(ctx, "claim with hold", err)
	}
	if d.recorded || !claimed {
		return HeldClaim{}, nil
	}
	ok, left, err := d.decide(h, avail)
	if err != nil {
		return HeldClaim{}, err
	}
	return HeldClaim{Claimed: true, Rec: rec, Held: ok, Left: left}, nil
}

// holdAndClaimOnce sends the transactions and reads what each statement returned: items' outcomes (for done),
// the hold's decision into d, whether the claim's insert wrote the record, and whether the hold's transaction
// committed (the claim's may still have failed).
func (s *PostgresStore) holdAndClaimOnce(ctx context.Context, items []*behindWrite, d *holdDecision, h Hold, avail *big.Int, readBlock, chainTime uint64, claimArgs []any) (claimed, holdCommitted bool, err error) {
	c, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, false, err
	}
	// A connection left inside the transaction is closed by the pool rather than reused (see txInOne).
	defer c.Release()
	b := &pgx.Batch{}
	b.Queue("begin isolation level read committed")
	b.Queue(pgHoldCommitsAsync)
	queueBehind(b, items)
	d.queue(s, b, h, avail, readBlock, chainTime, true, nil) // a settlement is under no gate's guard (postgres_markbehind.go)
	b.Queue("commit")
	b.Queue("begin isolation level read committed")
	b.Queue(pgInsertRecord, claimArgs...)
	b.Queue("commit")
	br := c.SendBatch(ctx, b)
	var tag pgconn.CommandTag
	err = func() error {
		for range 2 { // begin, and the commit without waiting for the WAL's flush
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
		if err := br.QueryRow().Scan(&d.recorded, &d.fits, &d.sum, &d.held); err != nil {
			return err
		}
		if _, err := br.Exec(); err != nil {
			return commitError{err}
		}
		holdCommitted = true
		if _, err := br.Exec(); err != nil {
			return err
		}
		var err error
		if tag, err = br.Exec(); err != nil {
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
		return false, holdCommitted, err
	}
	return tag.RowsAffected() == 1, true, nil
}

// claimAfterHold runs the claim's transaction of HoldAndClaim alone (one statement, committed synchronously, which
// makes the hold's transaction before it durable too), after it was refused before it committed and the hold's
// had committed; whether it wrote the record.
func (s *PostgresStore) claimAfterHold(ctx context.Context, claimArgs []any) (bool, error) {
	tag, err := s.pool.Exec(ctx, pgInsertRecord, claimArgs...)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
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
