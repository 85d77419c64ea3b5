package pgtest

import (
	"context"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestPgBouncerPoolsTransactionsInFrontOfTheServerAndGoesWithTheTest: a PgBouncer of the test's own reaches any
// database of the server, pools by transaction (two clients' statements run one after the other on one
// backend, where session pooling would give each its own), keeps answering across a restart of the server
// behind it, and is gone when its test ends.
func TestPgBouncerPoolsTransactionsInFrontOfTheServerAndGoesWithTheTest(t *testing.T) {
	srv := Start(t)
	var pid int
	t.Run("bouncer", func(t *testing.T) {
		b := StartPgBouncer(t, srv.DSN())
		pid = b.cmd.Process.Pid
		ping(t, b.DSN())
		other, err := url.Parse(srv.CreateDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		ping(t, b.Through(strings.TrimPrefix(other.Path, "/")))

		ctx := context.Background()
		first, second := connect(t, b.DSN()), connect(t, b.DSN())
		var pid1, pid2 int
		if err := first.QueryRow(ctx, "select pg_backend_pid()").Scan(&pid1); err != nil {
			t.Fatal(err)
		}
		if err := second.QueryRow(ctx, "select pg_backend_pid()").Scan(&pid2); err != nil {
			t.Fatal(err)
		}
		if pid1 != pid2 {
			t.Errorf("two clients' statements ran on backends %d and %d, one after the other: PgBouncer does not pool by transaction", pid1, pid2)
		}

		srv.Restart(t)
		// The first query may meet the server connection the restart closed; PgBouncer opens a new one.
		deadline := time.Now().Add(20 * time.Second)
		for {
			err := tryPing(b.DSN())
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("through PgBouncer after the server restarted: %v\n%s", err, b.Log())
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	if pid == 0 {
		return // the subtest ended before PgBouncer started (internal/needs: not installed), and said why
	}
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("PgBouncer (pid %d) still runs after its test ended", pid)
	}
}

// connect opens a connection with the simple protocol, which any pooler passes on as it is.
func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(ctx) })
	return c
}

func tryPing(dsn string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	return c.Ping(ctx)
}
