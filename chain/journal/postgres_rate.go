package journal

import (
	"context"
	"fmt"
	"math"
	"time"
)

// The rate limits of a cluster. Several gateways counting a client's calls each in memory allow it the limit once
// per gateway; counted in the database they all share, the cluster allows it the limit once. The buckets are the
// in-memory limiter's (facilitatorserver's rateBuckets), kept in x402_rate_buckets: up to perMinute tokens, refilled
// at perMinute a minute, so a cluster allows exactly what one process does. Each take is one statement (an upsert
// that returns what it took and what was there), by the database's clock, so instances whose clocks disagree
// still share one bucket; nothing of it is session state, so it runs as well through a pooler in transaction mode.

// pgTakeToken takes a token of bucket $1 holding $2 tokens a minute at most, if it has one: took is the tokens left
// after the take, NULL when there was no token; had is what the bucket held before (NULL: no row, a full bucket),
// for the wait. A concurrent take waits on the row's lock and then sees the bucket as the other left it; at never
// goes back, so two takes can never both be credited the same stretch of time.
const pgTakeToken = `WITH had AS (
	SELECT LEAST($2::float8, tokens + GREATEST(0, EXTRACT(EPOCH FROM now() - at)::float8) * $2::float8 / 60) AS tokens
	FROM x402_rate_buckets WHERE key = $1
), took AS (
	INSERT INTO x402_rate_buckets AS b (key, tokens, at) VALUES ($1, $2::float8 - 1, now())
	ON CONFLICT (key) DO UPDATE
	SET tokens = LEAST($2::float8, b.tokens + GREATEST(0, EXTRACT(EPOCH FROM now() - b.at)::float8) * $2::float8 / 60) - 1,
		at = GREATEST(b.at, now())
	WHERE LEAST($2::float8, b.tokens + GREATEST(0, EXTRACT(EPOCH FROM now() - b.at)::float8) * $2::float8 / 60) >= 1
	RETURNING tokens
)
SELECT (SELECT tokens FROM took), (SELECT tokens FROM had)`

// TakeToken takes a token of the bucket called key, which holds perMinute tokens at most and is refilled at
// perMinute a minute, for every instance of the cluster at once. Without a token it takes nothing and says how
// long until the next. An error (ErrUnavailable when the database cannot be reached in ctx's time) takes nothing:
// the caller decides what a limit does without its database.
func (s *PostgresStore) TakeToken(ctx context.Context, key string, perMinute int) (ok bool, wait time.Duration, err error) {
	if perMinute < 1 {
		return false, 0, fmt.Errorf("journal: a rate of %d a minute for %q; want at least 1", perMinute, key)
	}
	if _, _, err := s.begin(ctx, false); err != nil {
		return false, 0, err
	}
	s.pruneRates.Do(func() { go s.pruneRateBuckets() })
	var took, had *float64
	// Not retried: a take that failed on a broken connection may have taken, and the caller's fallback is cheap.
	if err := s.pool.QueryRow(ctx, pgTakeToken, key, perMinute).Scan(&took, &had); err != nil {
		return false, 0, s.fail(ctx, "take a rate limit token", err)
	}
	if took != nil {
		return true, 0, nil
	}
	left := 0.0
	if had != nil {
		left = *had
	}
	return false, time.Duration(math.Max(0, 1-left) * float64(time.Minute) / float64(perMinute)), nil
}

// GiveToken gives the bucket called key back a token that TakeToken took (a call that turned out not to count).
func (s *PostgresStore) GiveToken(ctx context.Context, key string, perMinute int) error {
	if _, _, err := s.begin(ctx, false); err != nil {
		return err
	}
	_, err := s.pool.Exec(ctx, `UPDATE x402_rate_buckets SET tokens = LEAST($2::float8, tokens + 1) WHERE key = $1`, key, perMinute)
	return s.fail(ctx, "give back a rate limit token", err)
}

// rateBucketIdle is how long a bucket goes untouched before it is full again, whatever its rate: from empty it
// refills in a minute. A full bucket is the same as none, so its row can go.
const rateBucketIdle = time.Minute

// pruneRateBuckets deletes, every rateBucketIdle until Close, the buckets untouched for that long: a client that
// calls once and never again would otherwise keep its row for ever. Each instance that takes tokens prunes; a
// delete racing a take either deletes a full bucket (the take then starts a fresh one, as full) or finds the take's
// newer time and keeps the row.
func (s *PostgresStore) pruneRateBuckets() {
	t := time.NewTicker(rateBucketIdle)
	defer t.Stop()
	for {
		select {
		case <-s.stopBeat:
			return
		case <-t.C:
			// A prune that fails is tried at the next tick: a bucket left a minute longer is still full.
			_, _ = s.PruneRateBuckets(context.Background())
		}
	}
}

// PruneRateBuckets deletes the rate limit buckets untouched for a minute (full, the same as none) and says how many
// it deleted. Instances that take tokens run it every minute by themselves.
func (s *PostgresStore) PruneRateBuckets(ctx context.Context) (int, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return 0, err
	}
	defer cancel()
	tag, err := s.pool.Exec(wctx, `DELETE FROM x402_rate_buckets WHERE at < now() - $1 * interval '1 microsecond'`, rateBucketIdle.Microseconds())
	if err != nil {
		return 0, s.fail(ctx, "prune the rate limit buckets", err)
	}
	return int(tag.RowsAffected()), nil
}
