package journal

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// Two instances on one database share a bucket: between them they get its tokens once, the next take of either is
// refused with the wait until a token is back, a given-back token is taken again, and another key has its own.
func TestTwoInstancesShareOneRateBucket(t *testing.T) {
	dsn := pgtest.Shared(t)
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	ctx := context.Background()
	for i, s := range []*PostgresStore{a, b, a, b, a, b} {
		if ok, wait, err := s.TakeToken(ctx, "k", 6); err != nil || !ok {
			t.Fatalf("take %d = %v, wait %v, %v; want the bucket's 6 tokens taken over both instances", i+1, ok, wait, err)
		}
	}
	for _, s := range []*PostgresStore{a, b} {
		ok, wait, err := s.TakeToken(ctx, "k", 6)
		if err != nil || ok {
			t.Fatalf("7th take = %v, %v; want refused: the two instances share one bucket of 6", ok, err)
		}
		// One token every 10 s, and none left: the next comes within 10 s (less what passed since the first take).
		if wait <= 9*time.Second || wait > 10*time.Second {
			t.Fatalf("7th take refused with wait %v; want just under 10s", wait)
		}
	}
	if err := b.GiveToken(ctx, "k", 6); err != nil {
		t.Fatal(err)
	}
	if ok, _, err := a.TakeToken(ctx, "k", 6); err != nil || !ok {
		t.Fatalf("a take after a token was given back = %v, %v; want taken", ok, err)
	}
	if ok, _, _ := b.TakeToken(ctx, "k", 6); ok {
		t.Fatal("a second take after one token was given back was allowed")
	}
	if ok, _, err := b.TakeToken(ctx, "other", 6); err != nil || !ok {
		t.Fatalf("another key's first take = %v, %v; want taken: each key has its own bucket", ok, err)
	}
}

// Concurrent takes of many instances never take more tokens than the bucket holds.
func TestConcurrentTakesOfSeveralInstancesNeverOvershootTheBucket(t *testing.T) {
	dsn := pgtest.Shared(t)
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	var taken atomic.Int64
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, _, err := stores[i%len(stores)].TakeToken(context.Background(), "burst", 20)
			if err != nil {
				t.Error(err)
			}
			if ok {
				taken.Add(1)
			}
		}()
	}
	wg.Wait()
	// 20 a minute refills one token every 3 s; the burst takes well under that.
	if n := taken.Load(); n < 20 || n > 21 {
		t.Fatalf("%d of 60 concurrent takes over three instances got a token; want the bucket's 20", n)
	}
}

// A bucket refills at its rate by the database's clock, and one untouched for a minute is pruned (it is full).
func TestARateBucketRefillsAndIsPrunedOnceFull(t *testing.T) {
	dsn := pgtest.Shared(t)
	s := openPostgres(t, dsn, Options{})
	ctx := context.Background()
	if ok, _, _ := s.TakeToken(ctx, "fast", 60); !ok { // one a second
		t.Fatal("first take refused")
	}
	pgExec(t, dsn, `UPDATE x402_rate_buckets SET tokens = 0, at = now() WHERE key = 'fast'`)
	if ok, wait, _ := s.TakeToken(ctx, "fast", 60); ok || wait > time.Second {
		t.Fatalf("a take of an emptied bucket = %v, wait %v; want refused, at most a second to wait", ok, wait)
	}
	pgExec(t, dsn, `UPDATE x402_rate_buckets SET at = at - interval '1500 milliseconds' WHERE key = 'fast'`)
	if ok, wait, err := s.TakeToken(ctx, "fast", 60); err != nil || !ok {
		t.Fatalf("a take 1.5 s after the bucket emptied, at one a second = %v, wait %v, %v; want a refilled token", ok, wait, err)
	}
	if ok, _, _ := s.TakeToken(ctx, "fast", 60); ok {
		t.Fatal("a second take was allowed: 1.5 s refill one token and a half")
	}
	pgExec(t, dsn, `UPDATE x402_rate_buckets SET at = now() - interval '61 seconds' WHERE key = 'fast'`)
	if ok, _, _ := s.TakeToken(ctx, "kept", 600); !ok {
		t.Fatal("take refused")
	}
	n, err := s.PruneRateBuckets(ctx)
	if err != nil || n != 1 {
		t.Fatalf("PruneRateBuckets = %d, %v; want the one bucket untouched for a minute", n, err)
	}
}

// A database that cannot be reached refuses nothing and takes nothing: the take fails with ErrUnavailable
// within the caller's time, and the caller decides.
func TestATakeOfADatabaseThatIsDownFailsWithErrUnavailableInTheCallersTime(t *testing.T) {
	srv := pgtest.Start(t)
	s := openPostgres(t, srv.DSN(), Options{})
	srv.Stop(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	ok, _, err := s.TakeToken(ctx, "k", 6)
	if ok || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("TakeToken with the database down = %v, %v; want an ErrUnavailable", ok, err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("TakeToken took %v with a 1 s context", took)
	}
}

// A take is one statement with no session state and no statement prepared for later: it works as well with
// pgx's simple protocol and its exec mode, which is how a pooler in transaction mode (PgBouncer) is spoken to.
func TestRateBucketsNeedNoPreparedStatements(t *testing.T) {
	for _, mode := range []string{"simple_protocol", "exec"} {
		t.Run(mode, func(t *testing.T) {
			u, err := url.Parse(pgtest.Shared(t))
			if err != nil {
				t.Fatal(err)
			}
			q := u.Query()
			q.Set("default_query_exec_mode", mode)
			u.RawQuery = q.Encode()
			a, b := openPostgres(t, u.String(), Options{}), openPostgres(t, u.String(), Options{})
			ctx := context.Background()
			for i, s := range []*PostgresStore{a, b} {
				if ok, _, err := s.TakeToken(ctx, "k", 2); err != nil || !ok {
					t.Fatalf("take %d = %v, %v; want taken", i+1, ok, err)
				}
			}
			ok, wait, err := a.TakeToken(ctx, "k", 2)
			if err != nil || ok || wait <= 29*time.Second || wait > 30*time.Second {
				t.Fatalf("3rd take of 2 a minute = %v, wait %v, %v; want refused, just under 30s to wait", ok, wait, err)
			}
			if err := b.GiveToken(ctx, "k", 2); err != nil {
				t.Fatal(err)
			}
			if _, err := a.PruneRateBuckets(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}
