package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// TestPostgresTwoStoresRaceTheVouchersOfOneChannel: two stores on one database, as two gateways, with eight
// goroutines each taking the next step of one channel whose deposit covers 150 steps, directly and through a
// PgBouncer in transaction mode. Every step is accepted exactly once, by one of them; the amount advances by exactly
// one step per success, and the sum accepted never exceeds the deposit: the step past it is refused on both.
func TestPostgresTwoStoresRaceTheVouchersOfOneChannel(t *testing.T) {
	throughEitherWay(t, func(t *testing.T, dsn string, n int) {
		raceVouchers(t, []Channels{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}, chanKey(100+n), 8, 150)
	})
}

// TestPostgresTwoStoresNeverAcceptTogetherMoreThanTheDeposit: the same voucher offered 16 times at once to two
// gateways (a client retrying on another gateway): one try is accepted and the row names its token, the others are
// refused moved; and with the row at its deposit both refuse the next.
func TestPostgresTwoStoresNeverAcceptTogetherMoreThanTheDeposit(t *testing.T) {
	dsn := pgtest.Shared(t)
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	ctx := context.Background()
	key := chanKey(5)
	mustObserve(t, a, depositRead(key, 30, 1))
	for step := int64(0); step < 3; step++ {
		from, to := big.NewInt(step*10), big.NewInt(step*10+10)
		var wg sync.WaitGroup
		errs := make([]error, 16)
		for i := range errs {
			s := a
			if i%2 == 1 {
				s = b
			}
			v := voucherOf(to.Int64())
			v.By = fmt.Sprintf("try %d", i)
			wg.Go(func() { _, errs[i] = s.AcceptVoucher(ctx, key, from, to, v) })
		}
		wg.Wait()
		won, winner := 0, ""
		for i, err := range errs {
			switch {
			case err == nil:
				won++
				winner = fmt.Sprintf("try %d", i)
			case !errors.Is(err, ErrChannelMoved):
				t.Fatalf("step to %s, try %d: %v, want success or ErrChannelMoved", to, i, err)
			}
		}
		if won != 1 {
			t.Fatalf("the step to %s was accepted %d times, want once", to, won)
		}
		// One voucher, one digest, sent 16 times: only the winner's token says the step was its own.
		if by := mustChannel(t, b, key).AcceptedBy; by != winner {
			t.Fatalf("the step to %s is recorded accepted by %q, but %q was answered accepted", to, by, winner)
		}
	}
	for _, s := range []*PostgresStore{a, b} {
		if _, err := s.AcceptVoucher(ctx, key, big.NewInt(30), big.NewInt(40), voucherOf(40)); !errors.Is(err, ErrAboveDeposit) {
			t.Fatalf("a step past the deposit: %v, want ErrAboveDeposit", err)
		}
	}
	wantRow(t, b, key, 30, 3, 0, "")
}

// TestPostgresAcceptVoucherIsOneRoundTrip: a voucher's compare-and-set sends one statement, accepted or refused,
// directly and through PgBouncer.
func TestPostgresAcceptVoucherIsOneRoundTrip(t *testing.T) {
	throughEitherWay(t, func(t *testing.T, dsn string, n int) {
		rt := &batchCount{}
		s := openPostgres(t, dsn, Options{Tracer: rt})
		key := chanKey(200 + n)
		mustObserve(t, s, depositRead(key, 100, 1))
		for _, v := range []struct {
			from, to int64
			want     error
		}{{0, 10, nil}, {0, 10, ErrChannelMoved}, {10, 110, ErrAboveDeposit}} {
			rt.take()
			_, err := s.AcceptVoucher(context.Background(), key, big.NewInt(v.from), big.NewInt(v.to), voucherOf(v.to))
			if !errors.Is(err, v.want) || (v.want == nil) != (err == nil) {
				t.Fatalf("voucher %d to %d: %v, want %v", v.from, v.to, err, v.want)
			}
			if sent := rt.take(); len(sent) != 1 {
				t.Fatalf("voucher %d to %d (%v) made %d round trips, want 1: %q", v.from, v.to, v.want, len(sent), sent)
			}
		}
	})
}

// TestPostgresAcceptedVouchersSurviveAServerRestartMidLoad: vouchers accepted one after another while the server
// restarts. A call fails only with ErrUnavailable; its worker reads the row once the database answers and goes on
// from there (a step whose answer the restart lost may have been taken). After the restart the row holds every
// step any call reported accepted, each once, and a new store on the restarted server reads the same.
func TestPostgresAcceptedVouchersSurviveAServerRestartMidLoad(t *testing.T) {
	srv := pgtest.Start(t)
	for _, through := range []string{"direct", "PgBouncer"} {
		t.Run(through, func(t *testing.T) {
			dsn := srv.CreateDatabase(t)
			if through == "PgBouncer" {
				dsn = pgtest.StartPgBouncer(t, dsn).DSN()
			}
			restartMidVouchers(t, srv, dsn)
		})
	}
}

func restartMidVouchers(t *testing.T, srv *pgtest.Server, dsn string) {
	ctx := context.Background()
	s := openPostgres(t, dsn, Options{OpenTimeout: time.Second})
	key := chanKey(8)
	const steps, price = 300, 3
	mustObserve(t, s, depositRead(key, steps*price, 1))
	var (
		accepted    []int64 // steps reported accepted, or read accepted by their call after a lost answer
		unavailable int
		outcomeRead int
		done        = make(chan struct{})
		reached     = make(chan struct{})
		reachedOnce sync.Once
	)
	go func() {
		defer close(done)
		from := int64(0)
		for from < steps*price {
			if from == 30*price {
				reachedOnce.Do(func() { close(reached) })
			}
			to := from + price
			v := voucherOf(to)
			v.By = fmt.Sprintf("request to %d, try %d", to, unavailable)
			_, err := s.AcceptVoucher(ctx, key, big.NewInt(from), big.NewInt(to), v)
			switch {
			case err == nil:
				accepted = append(accepted, to)
				from = to
				continue
			case !errors.Is(err, ErrUnavailable):
				t.Errorf("voucher %d to %d: %v, want success or ErrUnavailable", from, to, err)
				return
			}
			unavailable++
			for try := 0; ; try++ {
				c, ok, err := s.Channel(ctx, key)
				if err == nil && ok {
					// The outcome the lost answer would have given: the step is this call's only with its token.
					if c.Charged.Int64() == to && c.AcceptedBy == v.By {
						accepted = append(accepted, to)
						outcomeRead++
					} else if c.Charged.Int64() != from {
						t.Errorf("after a lost answer the row is at %s by %q, neither %d nor %d by %q", c.Charged, c.AcceptedBy, from, to, v.By)
						return
					}
					from = c.Charged.Int64()
					break
				}
				if try == 400 {
					t.Errorf("the row could not be read after the restart: %v", err)
					return
				}
				time.Sleep(25 * time.Millisecond)
			}
		}
	}()
	<-reached
	srv.Restart(t)
	<-done
	if t.Failed() {
		return
	}
	t.Logf("%d calls failed with ErrUnavailable across the restart (%d of them had taken their step); %d of %d steps known accepted", unavailable, outcomeRead, len(accepted), steps)
	if unavailable == 0 && len(accepted) == steps {
		t.Log("the restart fell between two calls")
	}
	c := mustChannel(t, s, key)
	if c.Charged.Int64() != steps*price || c.Vouchers != steps {
		t.Fatalf("after the restart the row is at %s with %d vouchers, want %d with %d: a step was lost or taken twice", c.Charged, c.Vouchers, steps*price, steps)
	}
	if len(accepted) != steps {
		t.Fatalf("%d steps known accepted by the calls that took them, want all %d", len(accepted), steps)
	}
	for i, to := range accepted {
		if to != int64(i+1)*price {
			t.Fatalf("step %d known accepted as the %dth, want %d", to, i+1, (i+1)*price)
		}
	}
	again := mustChannel(t, openPostgres(t, dsn, Options{}), key)
	if again.Charged.Cmp(c.Charged) != 0 || again.Vouchers != c.Vouchers {
		t.Fatalf("a new store reads %s with %d vouchers, want %s with %d", again.Charged, again.Vouchers, c.Charged, c.Vouchers)
	}
}

// TestPostgresChannelsMigrationBesideAnEarlierRelease: migration 5 is a table of its own. Instances of the earlier
// release (migrations 1-4) and of this one starting at once on a fresh database all open, each migration applied
// once; a database of the earlier release, with its records and holds, opens in this one with them as they were,
// and the earlier release's instances go on beside it (their migrations find nothing to do, their statements
// touch nothing that changed), while one of them starting after this one migrated is refused as too old.
func TestPostgresChannelsMigrationBesideAnEarlierRelease(t *testing.T) {
	ctx := context.Background()
	earlier := pgMigrations[:4]
	earlierOpen := func(dsn string) (*pgxpool.Pool, error) {
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			return nil, err
		}
		if err := migrateTo(ctx, pool, earlier); err != nil {
			pool.Close()
			return nil, err
		}
		return pool, nil
	}

	t.Run("started at once", func(t *testing.T) {
		dsn := pgtest.Shared(t)
		var wg sync.WaitGroup
		errs := make([]error, 8)
		start := make(chan struct{})
		for i := range errs {
			wg.Go(func() {
				<-start
				if i%2 == 0 {
					pool, err := earlierOpen(dsn)
					if err == nil {
						pool.Close()
					}
					if errors.Is(err, ErrSchemaTooNew) {
						err = nil // this release migrated first: the earlier one is refused, as any downgrade is
					}
					errs[i] = err
					return
				}
				s, err := OpenPostgres(ctx, dsn, Options{})
				if err == nil {
					s.Close()
				}
				errs[i] = err
			})
		}
		close(start)
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("open %d: %v", i, err)
			}
		}
		var versions []int
		pgQuery(t, dsn, `SELECT version FROM x402_schema_migrations ORDER BY version`, func(rows pgx.Rows) error {
			var v int
			err := rows.Scan(&v)
			versions = append(versions, v)
			return err
		})
		// Every migration of this release once, the payment identifiers' after the channels' too.
		want := make([]int, len(pgMigrations))
		for i := range want {
			want[i] = i + 1
		}
		if fmt.Sprint(versions) != fmt.Sprint(want) {
			t.Fatalf("schema versions %v, want 1 to %d once each", versions, len(pgMigrations))
		}
	})

	t.Run("upgraded under an earlier release", func(t *testing.T) {
		dsn := pgtest.Shared(t)
		pool, err := earlierOpen(dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		// What the earlier release wrote: a record and a hold, by its own statements (unchanged since).
		r := claimOf(5)
		r.State = StateClaimed
		row, err := rowOf(&r)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, pgInsertRecord, r.ID[:], string(r.State), r.Async, row.pending, row.claimedNS, row.keptNS, row.servedNS, row.data); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO x402_holds (id, hold_key, amount, deadline) VALUES ($1, 'k', 10, 100)`, r.ID[:]); err != nil {
			t.Fatal(err)
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT to_regclass('x402_channels') IS NOT NULL`).Scan(&exists); err != nil || exists {
			t.Fatalf("the earlier release's schema has x402_channels: %v, %v", exists, err)
		}

		s := openPostgres(t, dsn, Options{})
		if got, ok, err := s.Get(ctx, r.ID); err != nil || !ok || got.Owner != r.Owner {
			t.Fatalf("the earlier release's record after the migration: %v, %v, %v", got.Owner, ok, err)
		}
		if holds, err := s.HoldsOf(ctx, "k"); err != nil || len(holds) != 1 {
			t.Fatalf("the earlier release's hold after the migration: %v, %v", holds, err)
		}
		key := chanKey(9)
		mustObserve(t, s, depositRead(key, 100, 1))
		if _, err := s.AcceptVoucher(ctx, key, big.NewInt(0), big.NewInt(10), voucherOf(10)); err != nil {
			t.Fatal(err)
		}
		// The earlier release's instance, running on, still claims and holds as it did.
		r2 := claimOf(6)
		r2.State = StateClaimed
		row2, _ := rowOf(&r2)
		if _, err := pool.Exec(ctx, pgInsertRecord, r2.ID[:], string(r2.State), r2.Async, row2.pending, row2.claimedNS, row2.keptNS, row2.servedNS, row2.data); err != nil {
			t.Fatalf("the earlier release's claim beside this one: %v", err)
		}
		if n, err := s.Count(ctx); err != nil || n != 2 {
			t.Fatalf("Count = %d, %v; want 2", n, err)
		}
		// One of its instances starting now is refused, naming the version.
		if late, err := earlierOpen(dsn); !errors.Is(err, ErrSchemaTooNew) {
			if late != nil {
				late.Close()
			}
			t.Fatalf("an earlier release opening a migrated database: %v, want ErrSchemaTooNew", err)
		}
	})
}

// TestPostgresTwoClaimersOfOverlappingChannelsMarkEachChannelOnce: two stores, as two gateways' claimers, mark
// claims of overlapping sets of channels at once (each claim three neighbouring channels of twelve, each claimer
// every start in its own order), directly and through PgBouncer. A claim is marked on all its channels or on none
// (ErrClaimTaken), and no channel is marked by two claims.
func TestPostgresTwoClaimersOfOverlappingChannelsMarkEachChannelOnce(t *testing.T) {
	throughEitherWay(t, func(t *testing.T, dsn string, n int) {
		ctx := context.Background()
		stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
		const channels = 12
		keys := make([]ChannelKey, channels)
		for i := range keys {
			keys[i] = chanKey(300 + n + i)
			mustObserve(t, stores[0], depositRead(keys[i], 100, 1))
			if _, err := stores[0].AcceptVoucher(ctx, keys[i], big.NewInt(0), big.NewInt(10), voucherOf(10)); err != nil {
				t.Fatal(err)
			}
		}
		var (
			mu   sync.Mutex
			won  = map[string][]ChannelKey{}
			wg   sync.WaitGroup
			next atomic.Int64
		)
		start := make(chan struct{})
		for si, s := range stores {
			for w := range 3 {
				wg.Go(func() {
					<-start
					for i := range channels {
						first := (i*5 + si*7 + w*3) % channels
						var claims []ChannelClaim
						for j := range 3 {
							claims = append(claims, ChannelClaim{Key: keys[(first+j)%channels], Amount: big.NewInt(10)})
						}
						tx := fmt.Sprintf("0x%064x", 1000*(n+1)+int(next.Add(1)))
						switch err := s.MarkClaimSent(ctx, tx, claims); {
						case err == nil:
							mu.Lock()
							for _, c := range claims {
								won[tx] = append(won[tx], c.Key)
							}
							mu.Unlock()
						case !errors.Is(err, ErrClaimTaken):
							t.Errorf("store %d: claim %s: %v", si, tx, err)
							return
						}
					}
				})
			}
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
		marked := map[ChannelKey]string{}
		for tx, ks := range won {
			for _, k := range ks {
				if other, ok := marked[k]; ok {
					t.Fatalf("channel %s was marked by claim %s and by claim %s", k, other, tx)
				}
				marked[k] = tx
			}
		}
		for _, k := range keys {
			c := mustChannel(t, stores[1], k)
			if tx, ok := marked[k]; ok && c.ClaimTx != tx {
				t.Fatalf("channel %s: claim %q in flight, but claim %s was answered marked", k, c.ClaimTx, tx)
			}
			if _, ok := marked[k]; !ok && c.ClaimTx != "" {
				t.Fatalf("channel %s: claim %q in flight, which was answered refused: a claim marked part of its channels", k, c.ClaimTx)
			}
		}
		t.Logf("%d claims of 3 channels marked of %d tried", len(won), next.Load())
	})
}
