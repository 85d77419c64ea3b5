package journal

import "time"

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
// which is its chain round trips after it was asked. minedHoldsKept adds Options.MinedHoldsKept to that longest
// time, for those round trips and the hold's own to the database. Rows stay for that long and no longer, so a
// busy payer's key holds its last minute or so of payments, not every one.

const (
	// defaultMinedHoldsKept is Options.MinedHoldsKept when unset.
	defaultMinedHoldsKept = time.Minute
	// minMinedHoldsKept is the least Options.MinedHoldsKept: below it a slow chain read could outlive the mark.
	minMinedHoldsKept = 10 * time.Second
)

// ReadsAnswerFor tells the store that a funds read of this process may answer for up to d after it came back
// (the engine's FundsCacheTTL), so that a hold marked mined is kept at least that long, and Options.MinedHoldsKept
// more, for the reads that do not show its transfer. The longest d told stays: several engines (networks, a
// reload's old and new config) may share one store.
func (s *PostgresStore) ReadsAnswerFor(d time.Duration) {
	for {
		was := s.readsAnswerFor.Load()
		if int64(d) <= was || s.readsAnswerFor.CompareAndSwap(was, int64(d)) {
			return
		}
	}
}

// minedHoldsKept is how long after its mark a mined hold is kept (see above).
func (s *PostgresStore) minedHoldsKept() time.Duration {
	slack := s.opts.MinedHoldsKept
	switch {
	case slack == 0:
		slack = defaultMinedHoldsKept
	case slack < minMinedHoldsKept:
		slack = minMinedHoldsKept
	}
	return slack + time.Duration(s.readsAnswerFor.Load())
}

// ReadsAnswerFor is PostgresStore.ReadsAnswerFor for a Cluster that keeps its holds where other processes read
// them; a Cluster of one process's own (or one that does not say) is left alone.
func ReadsAnswerFor(c Cluster, d time.Duration) {
	if r, ok := c.(interface{ ReadsAnswerFor(time.Duration) }); ok {
		r.ReadsAnswerFor(d)
	}
}
