package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/internal/racepass"
)

func ping(t *testing.T, dsn string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, "select 1").Scan(&n); err != nil || n != 1 {
		t.Fatalf("select 1 = %d, %v", n, err)
	}
}

// TestStartStopRestart: a server of the test's own answers, stops answering when stopped, and answers again
// on the same port after a restart, with its data.
func TestStartStopRestart(t *testing.T) {
	racepass.Once(t, "the harness's PostgreSQL server started, stopped and started again: its time is initdb and postgres")
	s := Start(t)
	ping(t, s.DSN())
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, s.DSN())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create table kept(x int); insert into kept values (7)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	s.Stop(t)
	if c, err := pgx.Connect(ctx, s.DSN()); err == nil {
		c.Close(ctx)
		t.Fatal("connected to a stopped server")
	}
	s.Restart(t)
	conn, err = pgx.Connect(ctx, s.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var x int
	if err := conn.QueryRow(ctx, "select x from kept").Scan(&x); err != nil || x != 7 {
		t.Fatalf("after restart: %d, %v", x, err)
	}
}

// TestSharedGivesEachTestAFreshDatabase: two calls, two databases on one server.
func TestSharedGivesEachTestAFreshDatabase(t *testing.T) {
	a, b := Shared(t), Shared(t)
	if a == b {
		t.Fatalf("Shared returned %s twice", a)
	}
	ping(t, a)
	ping(t, b)
}

// TestARestartedServerWaitsForItsPortToBeFreeAgain: a port taken while the server was stopped (the money-invariant
// run's PostgreSQL fault met a connection of a test running beside it, which had been given that port as its
// local one) delays the restart; it does not fail it. The port is chosen below the range such ports come from.
func TestARestartedServerWaitsForItsPortToBeFreeAgain(t *testing.T) {
	racepass.Once(t, "the harness's PostgreSQL server stopped and started again: its time is initdb, postgres and a second's wait for a port")
	s := Start(t)
	if low := ephemeralLow(); low > 20000 && s.Port() >= low {
		t.Errorf("the server listens on %d, in the range (from %d) the system takes the local ports of connections from", s.Port(), low)
	}
	s.Stop(t)
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", s.Port()))
	if err != nil {
		t.Fatalf("taking the stopped server's port: %v", err)
	}
	go func() { time.Sleep(time.Second); l.Close() }()
	s.Restart(t)
	ping(t, s.DSN())
}

// TestAMachineWithoutPostgreSQLSkipsOutsideCIAndFailsUnderIt runs a test that wants a server in a child process
// whose PATH has no PostgreSQL and which may not look in /usr/lib/postgresql: it is skipped with one line naming
// the package to install, and under CI it fails with that line instead.
func TestAMachineWithoutPostgreSQLSkipsOutsideCIAndFailsUnderIt(t *testing.T) {
	if os.Getenv("PGTEST_HELPER") == "1" {
		Shared(t)
		t.Fatal("Shared returned a database on a machine without PostgreSQL")
	}
	racepass.Once(t, "two child processes check the harness's skip and failure lines")
	const line = "needs PostgreSQL's initdb: apt-get install postgresql (or set " + EnvDSN + ")"
	for _, tc := range []struct {
		ci       string
		wantFail bool
		want     string
	}{
		{"", false, "--- SKIP"},
		{"true", true, "--- FAIL"},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestAMachineWithoutPostgreSQLSkipsOutsideCIAndFailsUnderIt$", "-test.v")
		var env []string
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "PATH=") && !strings.HasPrefix(kv, EnvDSN+"=") && !strings.HasPrefix(kv, "CI=") {
				env = append(env, kv)
			}
		}
		cmd.Env = append(env, "PGTEST_HELPER=1", "PATH="+t.TempDir(), EnvPathOnly+"=1", "CI="+tc.ci)
		out, err := cmd.CombinedOutput()
		if (err != nil) != tc.wantFail {
			t.Errorf("CI=%q: exit error %v, want failure %v:\n%s", tc.ci, err, tc.wantFail, out)
		}
		if !strings.Contains(string(out), tc.want) || !strings.Contains(string(out), line) {
			t.Errorf("CI=%q: output lacks %q and the line %q:\n%s", tc.ci, tc.want, line, out)
		}
	}
}
