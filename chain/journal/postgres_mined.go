package journal

import (
	"context"
	"time"
)

// A hold marked mined no longer counts for a funds read at or after its block, which shows its transfer; for a
// read older than its block it still counts, or the payer's funds would be counted twice: once in the read, which
// does not show the transfer yet, and once more free. The instances of a cluster read each payer's funds
// themselves and answer from a read for a while (the engine's FundsCacheTTL, in which a dev chain mines many
// blocks), so when one instance holds from a read at block 110, another may still hold from its read at block
// 100. The first one's hold must not delete a hold mined at block 105 that the second's must count: a hold with
// take deletes a mined hold only once it was marked mined longer ago than any read that does not show it can
// still answer. Its mark (mined_at) and the deletion's clock are the database's now(), one clock for every
// instance.
//
// A read older than its block, wherever the read came from, was made before the transfer was seen mined and the
// hold marked: it answers for at most the longest time a read answers for (ReadsAnswerFor) after it came back,
// which is its chain round trips after it was asked. The deletion adds Options.MinedHoldsKept to that longest
// time, for those round trips and the hold's own to the database. Rows stay for that long and no longer, so a
// busy payer's key holds its last minute or so of payments, not every one.
//
// The instances of a cluster may answer from their reads for different times (a config of their own each, or a
// reload's old and new config): the one deleting must keep the hold for the longest of them, not for its own.
// Each instance writes how long its reads answer for into its row of x402_instances (with every heartbeat, and
// at once when it is told a longer time), and the deletion takes the longest of every row there and its own. An
// instance gone keeps its row, and its time, until it is cleaned up a day later: mined holds are kept longer
// meanwhile, never shorter.

const (
	// defaultMinedHoldsKept is Options.MinedHoldsKept when unset.
	defaultMinedHoldsKept = time.Minute
	// minMinedHoldsKept is the least Options.MinedHoldsKept: below it a slow chain read could outlive the mark.
	minMinedHoldsKept = 10 * time.Second
)

// ReadsAnswerFor tells the store that a funds read of this process may answer for up to d after it came back
// (the engine's FundsCacheTTL), so that every instance of the cluster keeps a hold marked mined at least that
// long, and Options.MinedHoldsKept more, for the reads that do not show its transfer. The longest d told stays:
// several engines (networks, a reload's old and new config) may share one store. The other instances learn it
// from this instance's row, written at once (the heartbeat writes it again, should this write fail).
func (s *PostgresStore) ReadsAnswerFor(d time.Duration) {
	for {
		was := s.readsAnswerFor.Load()
		if int64(d) <= was {
			return
		}
		if s.readsAnswerFor.CompareAndSwap(was, int64(d)) {
			break
		}
	}
	if s.closed.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = s.pool.Exec(ctx, `UPDATE x402_instances SET reads_answer_for_us = greatest(reads_answer_for_us, $2) WHERE token = $1`,
		s.instance, d.Microseconds())
}

// minedHoldsSlack is Options.MinedHoldsKept, its default and floor applied: how long past the longest a read
// answers for a mined hold is kept.
func (s *PostgresStore) minedHoldsSlack() time.Duration {
	switch slack := s.opts.MinedHoldsKept; {
	case slack == 0:
		return defaultMinedHoldsKept
	case slack < minMinedHoldsKept:
		return minMinedHoldsKept
	default:
		return slack
	}
}

// ReadsAnswerFor is PostgresStore.ReadsAnswerFor for a Cluster that keeps its holds where other processes read
// them; a Cluster of one process's own (or one that does not say) is left alone.
func ReadsAnswerFor(c Cluster, d time.Duration) {
	if r, ok := c.(interface{ ReadsAnswerFor(time.Duration) }); ok {
		r.ReadsAnswerFor(d)
	}
}
