package journal

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// pgDSNs remembers the DSN each test store was opened on, for reopen and plant (the store keeps no DSN: it
// may hold a password).
var pgDSNs = struct {
	sync.Mutex
	m map[*PostgresStore]string
}{m: map[*PostgresStore]string{}}

// pgDSN returns the DSN s was opened on.
func pgDSN(s *PostgresStore) string {
	pgDSNs.Lock()
	defer pgDSNs.Unlock()
	return pgDSNs.m[s]
}

// openPostgres opens a store on dsn that the test closes when it ends.
func openPostgres(t testing.TB, dsn string, opts Options) *PostgresStore {
	t.Helper()
	s, err := OpenPostgres(context.Background(), dsn, opts)
	if err != nil {
		t.Fatalf("OpenPostgres: %v", err)
	}
	pgDSNs.Lock()
	pgDSNs.m[s] = dsn
	pgDSNs.Unlock()
	t.Cleanup(func() { s.Close() })
	return s
}

// pgExec runs one statement on dsn's database behind any store's back.
func pgExec(t testing.TB, dsn, sql string, args ...any) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// TestOpenPostgresByManyProcessesAtOnceOnAFreshDatabase opens eight stores at the same moment on each of several
// fresh databases, as the Caddy instances of a cluster do when they start together: every open must succeed.
// Concurrent CREATE TABLE IF NOT EXISTS of the migrations table can fail with a duplicate table (42P07), a
// duplicate row of the catalog (23505) or a duplicate type (42710, seen from three Caddy processes starting
// together); each means another process created it, and the open goes on.
func TestOpenPostgresByManyProcessesAtOnceOnAFreshDatabase(t *testing.T) {
	const databases, opens = 4, 8
	for range databases {
		dsn := pgtest.Shared(t)
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, opens)
		for range opens {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				s, err := OpenPostgres(context.Background(), dsn, Options{})
				if err != nil {
					errs <- err
					return
				}
				s.Close()
			}()
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("OpenPostgres on a fresh database, %d at once: %v", opens, err)
		}
	}
}
