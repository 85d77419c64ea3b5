package journal

import (
	"context"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// A funds hold with take is one transaction sent as one pipelined batch: one round trip.
//
//	begin isolation level read committed
//	INSERT the key's row (when new); SELECT it FOR UPDATE
//	DELETE the key's holds that no longer count
//	one statement: read the key's holds, insert h when they leave room for it, mark it served; return what the
//	  other holds that count sum to, and whether h's is among them
//	commit
//
// Nothing is decided between the batch's statements, so nothing has to come back to the store before the
// transaction's writes go: the rule is in the database's statement, which returns the sum it judged from, for
// covers to answer from the same rows (a read of the holds by a later statement could see a hold another process
// let go meanwhile, and answer held for a hold the statement found no room for).
//
// The lock of the key's row serializes the holds of one key across every process, as before, because the
// transaction runs at READ COMMITTED, said in its BEGIN: every statement sees what was committed before it
// started, so the statements after the lock see every hold of the key committed before the lock was granted, and
// no hold of the key is committed by anyone else until this transaction ends. (The two-batch form relied on the
// same order, at the database's default isolation.) At REPEATABLE READ the snapshot would be the transaction's
// first statement's, taken before the lock was waited for, and a hold committed meanwhile would go unseen: two
// holds that fit only one at a time would both be held. A database whose default_transaction_isolation was raised
// to REPEATABLE READ over-committed so; at SERIALIZABLE it refused one of two holds that read each other's, and
// under many holds of one key at once ran out of retries. A database speaking PostgreSQL's protocol that runs
// READ COMMITTED as SERIALIZABLE refuses (40001) the loser of two holds that read each other's, which retryTx runs
// again.
//
// Two things the two-batch form did between its batches now happen in the database or not at all:
//   - UnrecordedAndHeld's read of the payment's record is in the deciding statement, which writes nothing when
//     the record exists. The key's row and the deletion of its holds that no longer count commit all the same
//     (where the two-batch form rolled them back): neither holds anything, and any hold of the key with take
//     writes them.
//   - The statement decides whether h fits, and covers decides again from the sum it returns: a disagreement,
//     which only a change of one without the other can make, is an error (the transaction has committed by
//     then: the error says so, and errs on refusing). The tests hold both to decideHold, the rule in Go over
//     the holds themselves.

// pgHoldSQL decides a hold with take in one statement, after the lock of its key's row and the deletion of the
// key's holds that no longer count. Its arguments: $1 the hold's id, $2 its key, $3 amount, $4 deadline, $5
// mined, $6 permit nonce, $7 served (pgInsertHold's, holdArgs), $8 avail, $9 readBlock, $10 chainTime (numeric as
// text), $11 whether a record of $1 refuses the hold, $12 and $13 a gate's guard (guardArgs: the gate's payment id,
// whose record, or in-flight mark not $13's, refuses the hold; NULLs for none). Every part of a statement sees one snapshot, so the holds it
// returns are the ones it judged; its insert and its update cannot touch one row (the insert needs h not live,
// the update needs it live). One row: whether $1 has a record (when asked), whether h fits, what the other holds
// that count sum to, whether h's is among them, and whether another of them carries h's permit nonce; never the
// holds themselves, of which a busy payer's key counts hundreds while a funds read answers (every hold mined since
// the read), read under the key's lock. The holds read leave out those mined at or before $9, which count for
// nobody reading at $9 and which a busy payer's key keeps for a while (postgres_mined.go).
//
// A permit nonce (an EIP-2612 permit's, or a sponsored approval's account nonce) is taken once by the chain: a hold
// that carries one another hold that counts carries is refused, whatever the funds, under the key's lock. Two
// settlements of one payer each carrying an approval of its first nonce, checked at once at two gateways, each
// saw no hold of the other before its own was written with its signed transactions (claimhold.go), and both sent
// the payer gas money (the money-invariant run, three gateways); now the later hold is refused, and its
// settlement's checks run again and find the other.
const pgHoldSQL = `WITH recorded AS (
	SELECT ($11::boolean AND EXISTS (SELECT 1 FROM x402_records WHERE id = $1::bytea))
		OR ($12::bytea IS NOT NULL AND (EXISTS (SELECT 1 FROM x402_records WHERE id = $12::bytea)
			OR NOT EXISTS (SELECT 1 FROM x402_busy WHERE id = $12::bytea AND owner = $13::text))) AS yes
), holds AS (
	SELECT id, amount, deadline, mined, permit_nonce, served, held_at FROM x402_holds
	WHERE hold_key = $2::text AND (mined = 0 OR mined > $9::numeric)
), live AS (
	SELECT id, amount, permit_nonce FROM holds
	WHERE NOT ((mined <> 0 AND mined <= $9::numeric) OR (mined = 0 AND deadline < $10::numeric))
), clash AS (
	SELECT EXISTS (SELECT 1 FROM live WHERE id <> $1::bytea AND permit_nonce = $6::numeric) AS yes
), fits AS (
	SELECT NOT EXISTS (SELECT 1 FROM live WHERE id = $1::bytea) AND NOT (SELECT yes FROM clash)
		AND (SELECT coalesce(sum(amount), 0) FROM live WHERE id <> $1::bytea) + $3::numeric <= $8::numeric AS yes
), inserted AS (
	INSERT INTO x402_holds (id, hold_key, amount, deadline, mined, permit_nonce, served)
	SELECT $1::bytea, $2::text, $3::numeric, $4::numeric, $5::numeric, $6::numeric, $7::boolean
	WHERE (SELECT yes FROM fits) AND NOT (SELECT yes FROM recorded)
	ON CONFLICT (id) DO NOTHING
), marked AS (
	UPDATE x402_holds SET served = true
	WHERE $7::boolean AND id = $1::bytea AND hold_key = $2::text AND NOT served
		AND id IN (SELECT id FROM live) AND NOT (SELECT yes FROM recorded)
)
SELECT r.yes, f.yes, (SELECT coalesce(sum(amount), 0) FROM live WHERE id <> $1::bytea)::text,
	EXISTS (SELECT 1 FROM live WHERE id = $1::bytea), (SELECT yes FROM clash)
FROM recorded r CROSS JOIN fits f`

// pgDeleteHoldsPast deletes the holds of key $1 that no longer count at readBlock $2 and chainTime $3 (see
// Cluster.Hold) for any reader: a mined one only once it was marked mined longer ago than any instance's funds
// read answers for (the longest of $5 microseconds, this instance's, and what the instances' rows say) and $4
// microseconds more (postgres_mined.go), for another instance's older read may still count it.
const pgDeleteHoldsPast = `DELETE FROM x402_holds WHERE hold_key = $1
AND ((mined <> 0 AND mined <= $2::numeric AND (mined_at IS NULL OR mined_at < now() - ($4::bigint
		+ greatest($5::bigint, (SELECT coalesce(max(reads_answer_for_us), 0) FROM x402_instances))) * interval '1 microsecond'))
	OR (mined = 0 AND deadline < $3::numeric))`

// pgHoldCommitsAsync lets a hold with take that carries no claim commit without waiting for its WAL to reach the
// disk. The key's row lock is what serializes one payer's holds across the cluster, and a transaction keeps its
// locks until its commit returns: a synchronous commit holds the lock across the WAL flush, so one payer's holds
// queued behind one another's flushes. Nothing relies on such a hold's durability before a synchronous commit
// made after it: every hold is followed by one before anything depends on it (the gate's record of an async
// payment before it is served, the settlement's claim or its write-ahead record before anything is signed), and
// PostgreSQL flushes the WAL in order, so that commit makes the hold durable too. A crash before it loses at most
// a hold that nothing was served or sent for. A hold another transaction reads meanwhile (it is visible once
// committed) only makes that one err on refusing. A hold alone that carries any deferred write but the gate's
// in-flight mark and read (behindWrite.lossless) commits synchronously, as the write would alone; a hold with its
// claim (HoldClaimAndSign) commits so, its deferred writes with it, and the write-ahead record of the signed
// transaction, second in the same batch, synchronously, which makes them durable before the batch answers.
const pgHoldCommitsAsync = "SET LOCAL synchronous_commit = off"

// holdInOne is Hold with take in one round trip (see above). With unrecordedOnly, a record of h.ID refuses the
// hold: nothing of h is written, and recorded says so (ok and left unset); so does guard, when given, refusing it
// (postgres_markbehind.go). items, taken from the context's queue (carry), go first in the transaction, and are
// marked sent when it commits.
func (s *PostgresStore) holdInOne(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, unrecordedOnly bool, guard *Marked, items []*behindWrite) (recorded, ok bool, left *big.Int, err error) {
	var d holdDecision
	err = s.txInOne(ctx, func(b *pgx.Batch) {
		if !slices.ContainsFunc(items, func(w *behindWrite) bool { return !w.lossless }) {
			// Nothing rides here but what a crash may lose: a gate's in-flight mark and read (what they guard is
			// decided by the records' inserts, which commit synchronously). A claim, a final answer or a served
			// mark riding here commits synchronously, as it would alone.
			b.Queue(pgHoldCommitsAsync)
		}
		queueCarried(b, items)
		d.queue(s, b, h, avail, readBlock, chainTime, unrecordedOnly, guard)
	})
	if err == nil {
		markSent(items)
	}
	if err != nil || d.recorded {
		return d.recorded, false, nil, err
	}
	ok, left, err = d.decide(h, avail)
	if err == nil && d.refusedForPermit() {
		err = ErrPermitNonceHeld
	}
	return false, ok, left, err
}

// refusedForPermit reports whether the hold decided as d was refused for its permit nonce, which another hold that
// counts carries.
func (d *holdDecision) refusedForPermit() bool { return d.clash && !d.held }

// holdDecision is what the statements of a hold with take (queue) returned: whether a record of the hold's
// payment refused it, whether the database found room for it, what the other holds that count sum to, and
// whether it was held already.
type holdDecision struct {
	recorded, fits, held bool
	// clash: another hold that counts carries h's permit nonce (clashes), which refuses h.
	clash bool
	sum   string
}

// queue queues the statements of a hold with take of h into b, inside its transaction (see above); the last one
// scans into d. It may run more than once (a transaction tried again).
func (d *holdDecision) queue(s *PostgresStore, b *pgx.Batch, h Hold, avail *big.Int, readBlock, chainTime uint64, unrecordedOnly bool, guard *Marked) {
	*d = holdDecision{}
	block, at := strconv.FormatUint(readBlock, 10), strconv.FormatUint(chainTime, 10)
	b.Queue(`INSERT INTO x402_hold_keys (hold_key) VALUES ($1) ON CONFLICT (hold_key) DO NOTHING`, h.Key)
	b.Queue(`SELECT hold_key FROM x402_hold_keys WHERE hold_key = $1 FOR UPDATE`, h.Key)
	b.Queue(pgDeleteHoldsPast, h.Key, block, at, s.minedHoldsSlack().Microseconds(), s.readsAnswerFor.Load()/1000)
	b.Queue(pgHoldSQL, append(append(holdArgs(h), avail.String(), block, at, unrecordedOnly), s.guardArgs(guard)...)...).QueryRow(func(row pgx.Row) error {
		return row.Scan(&d.recorded, &d.fits, &d.sum, &d.held, &d.clash)
	})
}

// decide answers a hold with take the database decided (and committed) as d says, unless a record refused it:
// covers judges from the sum the statement returned, and a disagreement with the statement is an error.
func (d *holdDecision) decide(h Hold, avail *big.Int) (ok bool, left *big.Int, err error) {
	others, err := holdsSum(h.Key, d.sum)
	if err != nil {
		return false, nil, fmt.Errorf("%w (the transaction committed)", err)
	}
	ok, left = covers(h, avail, others, d.held)
	if d.refusedForPermit() {
		ok = false
	}
	if d.fits != (!d.held && ok) {
		return false, nil, fmt.Errorf("journal: hold of %s: the database found room for it %v, the sum of the other holds %v (held already %v): the hold's two rules differ; the transaction committed",
			h.ID, d.fits, ok, d.held)
	}
	return ok, left, nil
}

// txInOne runs a transaction at READ COMMITTED in one round trip: BEGIN, what queue queues, COMMIT, as one
// pipelined batch; the transaction's statements decide among themselves (queue's callbacks only read what they
// returned), each seeing what committed before it started (see above). It is
// retried as inTx retries, and once too after a connection that broke with the batch sent, when whether it
// committed is unknown: for a transaction safe to run twice only (a hold with take, which finds h held when
// the first run committed, and answers as that run did), and queue may run more than once.
func (s *PostgresStore) txInOne(ctx context.Context, queue func(*pgx.Batch)) error {
	return retryTx(ctx, func() error {
		c, err := s.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		// A connection left inside the transaction (a statement that failed, a rollback that did not get
		// through) is closed by the pool rather than reused.
		defer c.Release()
		b := &pgx.Batch{}
		b.Queue("begin isolation level read committed")
		queue(b)
		b.Queue("commit")
		if err := c.SendBatch(ctx, b).Close(); err != nil {
			if !unavailable(err) {
				// A statement failed: the server skipped the rest of the batch, COMMIT too.
				rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				c.Exec(rctx, "rollback")
				cancel()
			}
			return err
		}
		return nil
	})
}
