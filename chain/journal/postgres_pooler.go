package journal

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The PostgreSQL store behind a connection pooler.
//
// Production PostgreSQL often sits behind PgBouncer (or another pooler) in transaction mode: a client's
// connection is lent a server connection for one transaction at a time, or for one statement outside a
// transaction, and the next may run on another server connection that another client used meanwhile. Nothing a
// session keeps survives from one transaction to the next there: prepared statements, LISTEN, SET outside a
// transaction, temporary tables, session advisory locks. The store keeps no such state: every operation is one
// statement or one transaction; its locks are row locks (FOR UPDATE, FOR SHARE) released at commit; it takes no
// advisory lock, sets nothing, makes no temporary table and listens to nothing. What remains is how pgx sends
// a statement.
//
// pgx's default query exec mode (cache_statement) prepares each statement once per connection under a name
// (stmtcache_<hash of the SQL>) and then runs it by that name: one round trip a statement, and the server
// parses and plans it once. Behind a transaction pooler the name is not where pgx left it: preparing meets the
// same name prepared by another client on that server connection (42P05 "already exists"), running meets a
// server connection that never prepared it (26000 "does not exist"). PgBouncer 1.21 and later can track
// protocol-level prepared statements (max_prepared_statements), Debian bookworm's 1.18 and many poolers cannot.
//
// The modes that work through any pooler, measured on this store's operations (round trips a call, counted on
// the wire, after the first use of each statement on a connection):
//
//	mode             claim  update  mark served  lease  hold  behind a transaction pooler
//	cache_statement  1      4       1            5      7     fails (unless the pooler tracks prepared statements)
//	cache_describe   1      4       1            5      7     works: the description is cached client-side, and
//	                                                          every run is Parse/Bind/Execute of the unnamed statement
//	exec             1      4       1            5      7     works: no description, parameters as text of unknown type
//	simple_protocol  1      4       1            5      7     works: parameters interpolated client-side
//	describe_exec    2      6       2            8      12    works: a Describe round trip before every statement
//
// (Measured before a transaction was sent as two pipelined batches, postgres_pipeline.go: since, an update costs
// two round trips in every mode, an update of a record its writer knows and a hold one, postgres_hold.go.)
//
// So cache_describe costs no round trip more than the default (one more for the first use of a statement on a
// connection, as cache_statement's own prepare does), keeps parameters binary and typed as the server said, and
// is what the store uses behind a pooler. Directly against PostgreSQL it stays with cache_statement: the server
// parses and plans a statement once, not every time, which settled 1.4 to 1.8 times as many payments a second on
// a two-core machine shared with the server (settlements of claim, broadcast, served and final from 8 and 32
// writers, journal alone: cache_statement 660-850/s, cache_describe 370-590/s, exec 300-440/s).
//
// Which one applies is found at open, on one connection, without being told: PostgreSQL gives a client the
// process id of the backend serving it (BackendKeyData, for cancel requests), and pg_backend_pid() names the
// backend running the statement. Directly, or through a plain TCP proxy, they are the same; a pooler that lends
// server connections answers the client with an id of its own, for it must route a cancel to whichever server
// connection the client has at the time. PgBouncer in session mode is taken for a pooler too, which costs only
// the difference above. A DSN that names pgx's default_query_exec_mode itself is taken at its word (for
// instance cache_statement behind a PgBouncer that tracks prepared statements).
//
// LISTEN does not work through a transaction pooler: the LISTEN runs on a server connection the client gives
// back at once, and its notifications go to whichever client holds that connection next, or nowhere. Work
// that would wait on a NOTIFY (a settlement queue) must not rely on it when Pooled says so: it polls the
// journal's tables instead, on a short interval, or listens on a connection of its own to a DSN that reaches
// PostgreSQL directly (a NOTIFY sent through the pooler, inside a transaction, is delivered as usual: only
// the listening end needs a session of its own).

// pgExecModeParam is pgx's DSN parameter naming the query exec mode.
const pgExecModeParam = "default_query_exec_mode"

// pgPoolerProbeTimeout bounds the probe for a pooler at open, within the caller's own bound.
const pgPoolerProbeTimeout = 10 * time.Second

// choosePgExecMode sets cfg's query exec mode for the way dsn reaches the database: cache_describe behind a
// connection pooler, pgx's default otherwise, and dsn's own when it names one. It reports whether the store
// goes through a pooler: found so by the probe, or, when dsn names the mode, when that mode prepares nothing
// (the DSN's author said so by choosing it).
func choosePgExecMode(ctx context.Context, dsn string, cfg *pgxpool.Config) (pooled bool, err error) {
	if strings.Contains(dsn, pgExecModeParam) {
		return cfg.ConnConfig.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement, nil
	}
	if pooled, err = behindPooler(ctx, &cfg.ConnConfig.Config); err != nil {
		return false, err
	}
	if pooled {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
	return pooled, nil
}

// behindPooler connects once and compares the backend process id the connection was given at its start with
// the one that runs a statement on it: they differ behind a pooler. A database that cannot say which backend
// runs a statement is taken for one behind a pooler: the mode chosen then is safe anywhere.
func behindPooler(ctx context.Context, cfg *pgconn.Config) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, pgPoolerProbeTimeout)
	defer cancel()
	conn, err := pgconn.ConnectConfig(ctx, cfg.Copy())
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, ccancel := context.WithTimeout(context.Background(), time.Second)
		conn.Close(cctx)
		ccancel()
	}()
	// The simple protocol: nothing is prepared, whatever sits between.
	res, err := conn.Exec(ctx, `SELECT pg_backend_pid()`).ReadAll()
	if err != nil {
		if unavailable(err) {
			return false, err
		}
		return true, nil
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
		return true, nil
	}
	pid, err := strconv.ParseUint(string(res[0].Rows[0][0]), 10, 32)
	return err != nil || uint32(pid) != conn.PID(), nil
}

// Pooled reports whether the store reaches its database through a connection pooler, where a session does not
// outlive a transaction: it prepares no statement then, and a LISTEN on its connections would hear nothing
// (see above: poll, or listen on a direct DSN).
func (s *PostgresStore) Pooled() bool { return s.pooled }
