package journal

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
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
