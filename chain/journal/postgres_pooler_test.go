package journal

import (
	"context"
	"fmt"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// TestPostgresTwoStoresThroughPgBouncerInTransactionMode opens two stores, as two gateways would, through a
// PgBouncer in transaction pooling mode (fewer server connections than the stores' clients, so that their
// transactions take turns on the same server connections), and works both at once: claims of the same payments
// from both, updates to broadcast and final, served marks, in-flight marks, wallet leases and fenced writes,
// holds against one payer's funds, a shared rate limit, and the reads of Pending, Instances and Alive. Every
// payment has exactly one claimant, every write lands, the holds and the rate limit are never exceeded, and
// nothing fails for the pooler: no prepared statement met on a server connection it was not made on (42P05
// "already exists", 26000 "does not exist"), no session state assumed to carry over from one transaction to the
// next.
func TestPostgresTwoStoresThroughPgBouncerInTransactionMode(t *testing.T) {
	dsn := pgtest.Shared(t)
	bouncer := pgtest.StartPgBouncer(t, dsn)
	ctx := context.Background()
	stores := []*PostgresStore{
		openPostgres(t, bouncer.DSN(), Options{}),
		openPostgres(t, bouncer.DSN(), Options{}),
	}

	const payments, workers = 120, 4
	var claimed [payments]atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for si, s := range stores {
		for w := range workers {
			owner := fmt.Sprintf("store-%d/worker-%d", si, w)
			wg.Go(func() {
				<-start
				for n := range payments {
					if n%workers != w {
						continue
					}
					r := claimOf(9000 + n)
					r.Owner = owner
					got, ok, err := s.Claim(ctx, r)
					if err != nil {
						t.Errorf("%s: claim %d: %v", owner, n, err)
						return
					}
					if !ok {
						continue // the other store's worker claimed it
					}
					claimed[n].Add(1)
					if got.Owner != owner {
						t.Errorf("%s: claim %d shows owner %q", owner, n, got.Owner)
					}
					if busy, err := s.Busy(ctx, r.ID); err != nil || !busy {
						t.Errorf("%s: Busy(%d) = %v, %v", owner, n, busy, err)
						return
					}
					if _, err := s.Update(ctx, r.ID, toBroadcast(fmt.Sprintf("0x%x", n))); err != nil {
						t.Errorf("%s: update %d to broadcast: %v", owner, n, err)
						return
					}
					if err := s.MarkServed(ctx, r.ID, time.Now()); err != nil {
						t.Errorf("%s: mark %d served: %v", owner, n, err)
						return
					}
					if n%2 == 0 {
						if _, err := s.Update(ctx, r.ID, toFinal(true)); err != nil {
							t.Errorf("%s: update %d to final: %v", owner, n, err)
							return
						}
					}
					if err := s.Idle(ctx, r.ID); err != nil {
						t.Errorf("%s: Idle(%d): %v", owner, n, err)
						return
					}
					if _, _, err := s.Instances(ctx); err != nil {
						t.Errorf("%s: Instances: %v", owner, err)
						return
					}
				}
			})
		}
		// Each store leases wallets of its own and writes under them, as a gateway's settlements do.
		wg.Go(func() {
			<-start
			name := fmt.Sprintf("wallet-%d", si)
			for i := range 30 {
				l, err := s.Lease(ctx, name, 5*time.Second)
				if err != nil || !l.Held {
					t.Errorf("store %d: lease %s: %+v, %v", si, name, l, err)
					return
				}
				r := claimOf(9500 + si*100 + i)
				if _, ok, err := s.Claim(ctx, r); err != nil || !ok {
					t.Errorf("store %d: claim %s: %v, %v", si, r.ID, ok, err)
					return
				}
				if _, err := s.UpdateFenced(ctx, r.ID, name, l.Fence, toBroadcast("0xfenced")); err != nil {
					t.Errorf("store %d: fenced update under %s at fence %d: %v", si, name, l.Fence, err)
					return
				}
			}
			if err := s.Unlease(ctx, name); err != nil {
				t.Errorf("store %d: unlease: %v", si, err)
			}
		})
	}
	// Both stores count one settle rate limit at once, as the gateways' facilitators do: 50 a minute, taken 80
	// times, gives exactly 50.
	var tokens atomic.Int64
	for i := range 80 {
		wg.Go(func() {
			<-start
			ok, _, err := stores[i%2].TakeToken(ctx, "per_ip:127.0.0.1", 50)
			if err != nil {
				t.Errorf("take %d: %v", i, err)
			}
			if ok {
				tokens.Add(1)
			}
		})
	}
	// Both stores hold payments of one payer against its funds at once.
	const key, holds = "eip155:8453/0xtoken/0xpayer", 40
	avail := big.NewInt(150)
	var held atomic.Int64
	for i := range holds {
		wg.Go(func() {
			<-start
			h := Hold{ID: claimOf(9800 + i).ID, Key: key, Amount: big.NewInt(10), Deadline: 2000}
			ok, _, err := stores[i%2].Hold(ctx, h, avail, 100, 1000, true)
			if err != nil {
				t.Errorf("hold %d: %v", i, err)
				return
			}
			if ok {
				held.Add(1)
				if err := stores[(i+1)%2].HoldMined(ctx, h.ID, 101); err != nil {
					t.Errorf("hold %d mined: %v", i, err)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		t.Logf("PgBouncer's log:\n%s", bouncer.Log())
		return
	}

	for n := range payments {
		if c := claimed[n].Load(); c != 1 {
			t.Errorf("payment %d was claimed %d times, want once", n, c)
		}
	}
	if tokens.Load() != 50 {
		t.Errorf("%d of 80 takes of a limit of 50 a minute were allowed, want exactly 50", tokens.Load())
	}
	if held.Load() != 15 {
		t.Errorf("%d holds of 10 against 150 were held, want exactly 15", held.Load())
	}
	for si, s := range stores {
		pending, err := s.Pending(ctx)
		if err != nil {
			t.Fatalf("store %d: Pending: %v", si, err)
		}
		// Half of the payments stayed broadcast, and every fenced one did.
		if want := payments/2 + 2*30; len(pending) != want {
			t.Errorf("store %d: Pending lists %d records, want %d", si, len(pending), want)
		}
		if live, _, err := s.Instances(ctx); err != nil || live != 2 {
			t.Errorf("store %d: Instances = %d, %v; want 2", si, live, err)
		}
		if alive, err := s.Alive(ctx, stores[1-si].Instance()); err != nil || !alive {
			t.Errorf("store %d: Alive(the other) = %v, %v", si, alive, err)
		}
		if n, err := s.Count(ctx); err != nil || n != payments+2*30 {
			t.Errorf("store %d: Count = %d, %v; want %d", si, n, err, payments+2*30)
		}
	}
	got, err := stores[0].HoldsOf(ctx, key)
	if err != nil || len(got) != 15 {
		t.Errorf("HoldsOf = %d holds, %v; want 15", len(got), err)
	}
}

// TestPostgresFindsByItselfWhetherItGoesThroughAPooler: a store opened directly prepares its statements (pgx's
// default mode, the fastest against PostgreSQL itself), one opened through PgBouncer does not, and a DSN that
// names pgx's default_query_exec_mode is taken at its word either way.
func TestPostgresFindsByItselfWhetherItGoesThroughAPooler(t *testing.T) {
	dsn := pgtest.Shared(t)
	bouncer := pgtest.StartPgBouncer(t, dsn)
	for _, tc := range []struct {
		name, dsn  string
		mode       pgx.QueryExecMode
		wantPooled bool
	}{
		{"direct", dsn, pgx.QueryExecModeCacheStatement, false},
		{"through PgBouncer", bouncer.DSN(), pgx.QueryExecModeCacheDescribe, true},
		{"direct, exec named", dsn + "&default_query_exec_mode=exec", pgx.QueryExecModeExec, true},
		{"through PgBouncer, cache_statement named", bouncer.DSN() + "&default_query_exec_mode=cache_statement&pool_max_conns=1",
			pgx.QueryExecModeCacheStatement, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := openPostgres(t, tc.dsn, Options{})
			if s.Pooled() != tc.wantPooled {
				t.Errorf("Pooled() = %v, want %v", s.Pooled(), tc.wantPooled)
			}
			if got := s.pool.Config().ConnConfig.DefaultQueryExecMode; got != tc.mode {
				t.Errorf("query exec mode %v, want %v", got, tc.mode)
			}
			if _, _, err := s.Claim(context.Background(), claimOf(1)); err != nil {
				t.Errorf("Claim: %v", err)
			}
		})
	}
}

// The Store tests run through a PgBouncer in transaction mode too: a fresh database of the shared server, behind
// a PgBouncer of the test's own.
func init() {
	harnesses = append(harnesses, harness{
		name: "postgres-pgbouncer",
		open: func(t *testing.T, clock func() time.Time) Store {
			direct := pgtest.Shared(t)
			s := openPostgres(t, pgtest.StartPgBouncer(t, direct).DSN(), Options{Clock: clock})
			pgDirect.Store(s, direct)
			return s
		},
		reopen: func(t *testing.T, s Store) Store {
			p := s.(*PostgresStore)
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			again := openPostgres(t, pgDSN(p), p.opts)
			pgDirect.Store(again, pgDirectDSN(p))
			return again
		},
		plant: func(t *testing.T, s Store, id ID, raw []byte) Store {
			// Behind the store's back, on a connection straight to the server.
			pgExec(t, pgDirectDSN(s.(*PostgresStore)), `INSERT INTO x402_records (id, state, pending, claimed_ns, data)
VALUES ($1, 'claimed', true, 0, $2) ON CONFLICT (id) DO UPDATE SET data = EXCLUDED.data`, id[:], raw)
			return s
		},
	})
}

// pgDirect remembers, of a store opened through PgBouncer, the DSN of its database straight on the server.
var pgDirect sync.Map

func pgDirectDSN(s *PostgresStore) string {
	v, _ := pgDirect.Load(s)
	return v.(string)
}

// TestPostgresRestartMidLoadThroughPgBouncer is TestPostgresRestartMidLoad with the store behind a PgBouncer in
// transaction mode, which stays up while the server behind it restarts: what PgBouncer answers meanwhile (a
// server connection lost mid-statement, a login to the server refused) is ErrUnavailable, and a caller that
// repeats what failed ends with every payment claimed once, by itself.
func TestPostgresRestartMidLoadThroughPgBouncer(t *testing.T) {
	srv := pgtest.Start(t)
	restartMidLoad(t, srv, pgtest.StartPgBouncer(t, srv.DSN()).DSN())
}
