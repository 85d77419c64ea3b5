package journal

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/puddle/v2"
)

// Defaults of the PostgreSQL store.
const (
	// defaultInstanceTTL is how long an instance stays alive without a heartbeat when Options.InstanceTTL is unset.
	defaultInstanceTTL = 10 * time.Second
	// defaultConnectTimeout bounds each connection attempt when Options.OpenTimeout is unset and the DSN sets no
	// connect_timeout, so that an unreachable database fails a call with ErrUnavailable instead of hanging it.
	defaultConnectTimeout = 5 * time.Second
	// pgWriteTimeout bounds a write: it runs detached from its caller's context (a write under way completes or
	// fails as a whole), so something else must end it when the database stops answering.
	pgWriteTimeout = 30 * time.Second
	// pgTxRetries is how many times a transaction is tried again after a serialization failure or deadlock.
	pgTxRetries = 8
)

// PostgresStore is a Store in a PostgreSQL database, shared by every process that opens it: the journal of
// several machines serving one site. It implements Cluster too.
//
// Every operation is one statement or one transaction, and concurrent processes are kept apart by the
// database's own means: a primary key for Claim (INSERT ... ON CONFLICT DO NOTHING), row locks (SELECT ... FOR
// UPDATE) for read-modify-write transactions under the default READ COMMITTED isolation, and a whole
// transaction retried on a serialization failure or deadlock, so the store runs unchanged on databases that
// speak PostgreSQL's protocol with SERIALIZABLE transactions by default (CockroachDB, YugabyteDB). It takes no
// advisory locks and keeps no state of its own in the database beyond its x402_ tables.
type PostgresStore struct {
	pool     *pgxpool.Pool
	opts     Options
	ttl      time.Duration
	instance string
	secret   string // the DSN's password, kept out of every error
	pooled   bool   // through a connection pooler: see postgres_pooler.go

	closed    atomic.Bool
	closeOnce sync.Once
	stopBeat  chan struct{}
	beatDone  chan struct{}

	lifeMu    sync.Mutex
	beatSent  time.Time // when the last heartbeat that the database took was sent
	lifeCount uint64    // Continuity

	pruneRates sync.Once // starts pruneRateBuckets at the first TakeToken

	readsAnswerFor atomic.Int64 // the longest a funds read answers for, in nanoseconds (see ReadsAnswerFor)

	group pgGroup // writes of concurrent requests sent together (postgres_group.go)
}

// OpenPostgres connects to the PostgreSQL database dsn names (a URL, postgres://user:password@host:port/db, or
// key=value pairs, with pgx's pool settings such as pool_max_conns), brings its x402_ tables up to this build's
// schema, and registers this open as a live instance. Of opts, Clock stamps records, OpenTimeout bounds each
// connection attempt (five seconds when unset and the DSN has no connect_timeout) and InstanceTTL sets the
// heartbeat. A database migrated by a newer release is refused with ErrSchemaTooNew; one that cannot be
// reached, with ErrUnavailable. No error repeats the DSN's password.
func OpenPostgres(ctx context.Context, dsn string, opts Options) (*PostgresStore, error) {
	secret := dsnPassword(dsn)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		// pgx masks the password in its parse errors; redact catches what it cannot recognise.
		return nil, fmt.Errorf("journal: open postgres: %s", redact(err.Error(), secret))
	}
	if cfg.ConnConfig.Password != "" {
		secret = cfg.ConnConfig.Password
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
		if opts.OpenTimeout > 0 {
			cfg.ConnConfig.ConnectTimeout = opts.OpenTimeout
		}
	}
	if opts.Tracer != nil {
		cfg.ConnConfig.Tracer = opts.Tracer
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "caddy-x402"
	}
	ttl := opts.InstanceTTL
	if ttl <= 0 {
		ttl = defaultInstanceTTL
	}
	token := make([]byte, 16)
	rand.Read(token)
	s := &PostgresStore{
		opts:     opts,
		ttl:      ttl,
		instance: hex.EncodeToString(token),
		secret:   secret,
		stopBeat: make(chan struct{}),
		group:    pgGroup{slots: make(chan struct{}, pgGroupSenders)},
		beatDone: make(chan struct{}),
	}
	if !strings.Contains(dsn, "pool_max_conns") {
		// pgx's default, four connections on a small machine, would queue a busy gateway's requests behind
		// each other; each connection costs the server a process, so the default stays modest.
		cfg.MaxConns = defaultMaxConns
	}
	if s.pooled, err = choosePgExecMode(ctx, dsn, cfg); err != nil {
		return nil, s.openErr(err)
	}
	if s.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, s.openErr(err)
	}
	if err := migrate(ctx, s.pool); err != nil {
		s.pool.Close()
		return nil, s.openErr(err)
	}
	// Instances dead for a day are of no use to anyone; a dead instance's row may go at any time, as Alive
	// reads an absent row as dead.
	if _, err := s.pool.Exec(ctx, `DELETE FROM x402_instances WHERE expires_at < now() - interval '1 day'`); err != nil {
		s.pool.Close()
		return nil, s.openErr(err)
	}
	if err := s.beat(ctx); err != nil {
		s.pool.Close()
		return nil, s.openErr(err)
	}
	go s.heartbeat()
	return s, nil
}

// defaultMaxConns is the connection pool's size when the DSN sets no pool_max_conns.
const defaultMaxConns = 16

func (s *PostgresStore) openErr(err error) error {
	if errors.Is(err, ErrSchemaTooNew) {
		return fmt.Errorf("journal: open postgres: %w", err)
	}
	return s.fail(context.Background(), "open", err)
}

// dsnPassword finds the password of a URL DSN or of a key=value one, to keep it out of errors.
func dsnPassword(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		if pw, ok := u.User.Password(); ok {
			return pw
		}
	}
	for _, f := range strings.Fields(dsn) {
		if v, ok := strings.CutPrefix(f, "password="); ok {
			return strings.Trim(v, `'`)
		}
	}
	return ""
}

// redact replaces every occurrence of secret in msg.
func redact(msg, secret string) string {
	if secret == "" {
		return msg
	}
	msg = strings.ReplaceAll(msg, secret, "xxxxx")
	if esc := url.QueryEscape(secret); esc != secret {
		msg = strings.ReplaceAll(msg, esc, "xxxxx")
	}
	return msg
}

// Instance implements Cluster.
func (s *PostgresStore) Instance() string { return s.instance }

// heartbeat keeps this instance alive until Close. A beat that fails (the database down, restarting, or a
// pooled connection it closed) is tried again soon, not a third of the TTL later: after an outage of a few
// seconds, the instance would otherwise look dead to the others for want of a beat, and they would take over
// its marks and its settlements while it still works on them.
func (s *PostgresStore) heartbeat() {
	defer close(s.beatDone)
	every := max(s.ttl/3, time.Millisecond)
	retry := max(min(every/10, 250*time.Millisecond), time.Millisecond)
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-s.stopBeat:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), every)
			err := s.beat(ctx)
			cancel()
			if err != nil {
				t.Reset(retry)
			} else {
				t.Reset(every)
			}
		}
	}
}

// beat moves this instance's expiry a TTL ahead of the database's clock, inserting its row if it is gone.
func (s *PostgresStore) beat(ctx context.Context) error {
	sent := time.Now()
	_, err := s.pool.Exec(ctx, `INSERT INTO x402_instances (token, expires_at, reads_answer_for_us) VALUES ($1, now() + $2 * interval '1 microsecond', $3)
ON CONFLICT (token) DO UPDATE SET expires_at = EXCLUDED.expires_at, reads_answer_for_us = EXCLUDED.reads_answer_for_us`,
		s.instance, s.ttl.Microseconds(), s.readsAnswerFor.Load()/1000)
	if err == nil {
		s.lifeMu.Lock()
		s.lapsedLocked(sent) // a beat after a gap: the row may have expired in it
		s.beatSent = sent
		s.lifeMu.Unlock()
	}
	return err
}

// Continuity implements Cluster. The database set this instance's expiry a TTL after it received a beat,
// which is after the beat was sent: by this process's clock, the row is surely unexpired until the last beat's
// sending plus the TTL, less a quarter of it for the clocks' drift and for the time between a caller's look
// and what it then does.
func (s *PostgresStore) Continuity() uint64 {
	s.lifeMu.Lock()
	defer s.lifeMu.Unlock()
	s.lapsedLocked(time.Now())
	return s.lifeCount
}

// lapsedLocked counts a lapse of this instance's life when at time at its last beat is too old to vouch for it.
func (s *PostgresStore) lapsedLocked(at time.Time) {
	if !s.beatSent.IsZero() && at.Sub(s.beatSent) > s.ttl-s.ttl/4 {
		s.lifeCount++
	}
}

// Close stops the heartbeat, deletes this instance's row (so that other instances take over its marks and
// leases at once) and closes the connections; closing twice is harmless. A row Close cannot delete, the
// database being unreachable, expires after the instance TTL.
func (s *PostgresStore) Close() error {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		close(s.stopBeat)
		<-s.beatDone
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		s.pool.Exec(ctx, `DELETE FROM x402_instances WHERE token = $1`, s.instance)
		cancel()
		s.pool.Close()
	})
	return nil
}

// begin checks that a call may start, sends what ctx's queue of deferred writes holds (postgres_behind.go), and
// returns the context its database work runs under: the caller's for a read; for a write, one that the caller's
// cancellation no longer reaches once the write is under way, bounded by pgWriteTimeout.
func (s *PostgresStore) begin(ctx context.Context, write bool) (context.Context, context.CancelFunc, error) {
	if err := s.sendBehind(ctx); err != nil {
		return nil, nil, err
	}
	return s.start(ctx, write)
}

// start is begin without the deferred writes: for a call that sends them in its own batch (carry).
func (s *PostgresStore) start(ctx context.Context, write bool) (context.Context, context.CancelFunc, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	if s.closed.Load() {
		return nil, nil, ErrClosed
	}
	if !write {
		return ctx, func() {}, nil
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), pgWriteTimeout)
	return wctx, cancel, nil
}

// dbError is a failure of the database or of the way to it, its message cleared of the DSN's password.
type dbError struct {
	msg   string
	cause []error
}

func (e *dbError) Error() string   { return e.msg }
func (e *dbError) Unwrap() []error { return e.cause }

// fail turns a database error into the store's: ErrClosed after Close, the caller's own context error when
// it ended a read, ErrUnavailable when the database could not be reached or the connection broke, and any
// other failure of the database with its message cleared of the DSN's password. The journal's own errors
// (ErrNotFound, ErrCorrupt, an update function's) pass as they are.
func (s *PostgresStore) fail(caller context.Context, op string, err error) error {
	var de *dbError
	var pe *pgconn.PgError
	switch {
	case err == nil, errors.As(err, &de):
		return err
	case s.closed.Load() && errors.Is(err, puddle.ErrClosedPool):
		return ErrClosed
	case caller.Err() != nil && errors.Is(err, caller.Err()):
		return err
	case !unavailable(err) && !errors.As(err, &pe) && !isPgxError(err):
		return err
	}
	if unavailable(err) {
		s.dropConnsIfServerWentAway(err)
		msg := redact(fmt.Sprintf("%v: postgres %s: %v", ErrUnavailable, op, err), s.secret)
		return &dbError{msg: msg, cause: []error{ErrUnavailable, err}}
	}
	return &dbError{msg: redact(fmt.Sprintf("journal: postgres %s: %v", op, err), s.secret), cause: []error{err}}
}

// isPgxError reports an error of pgx's own making (a scan, a closed transaction).
func isPgxError(err error) bool {
	var se pgx.ScanArgError
	return errors.As(err, &se) || errors.Is(err, pgx.ErrNoRows) || errors.Is(err, pgx.ErrTxClosed)
}

// unavailable reports a failure to reach the database or a connection that broke: nothing the request itself
// did wrong, and likely to pass.
func unavailable(err error) bool {
	var ce *pgconn.ConnectError
	var ne net.Error
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &ce), errors.As(err, &ne), pgconn.Timeout(err):
		return true
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, puddle.ErrClosedPool),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, context.DeadlineExceeded):
		return true
	case errors.As(err, &pe):
		// Class 08: connection exception; 57P01-57P03: the server shut down or is starting up.
		return strings.HasPrefix(pe.Code, "08") || pe.Code == "57P01" || pe.Code == "57P02" || pe.Code == "57P03"
	}
	return strings.Contains(err.Error(), "conn closed") || strings.Contains(err.Error(), "closed network connection")
}

// hasCode reports a PostgreSQL error with one of the SQLSTATE codes.
func hasCode(err error, codes ...string) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	for _, c := range codes {
		if pe.Code == c {
			return true
		}
	}
	return false
}

// commitError marks a failure of COMMIT itself: whether the transaction committed is unknown.
type commitError struct{ err error }

func (e commitError) Error() string { return e.err.Error() }
func (e commitError) Unwrap() error { return e.err }

// inTx runs fn in a transaction and commits it, trying the whole transaction again after a serialization
// failure (40001) or a deadlock (40P01), which the database reports before anything is committed, and once after
// a connection that broke before COMMIT was sent (a pooled connection the server closed). fn may run more
// than once.
func (s *PostgresStore) inTx(ctx context.Context, fn func(pgx.Tx) error) error {
	return retryTx(ctx, func() error { return s.txOnce(ctx, fn) })
}

// retryTx runs once, a whole transaction, and runs it again as inTx says.
func retryTx(ctx context.Context, once func() error) error {
	brokenRetried := false
	for attempt := 1; ; attempt++ {
		err := once()
		var ce commitError
		switch {
		case err == nil:
			return nil
		case hasCode(err, "40001", "40P01") && attempt <= pgTxRetries:
			time.Sleep(time.Duration(attempt) * time.Duration(1+randN(4)) * time.Millisecond)
		case unavailable(err) && !errors.As(err, &ce) && !brokenRetried && ctx.Err() == nil:
			brokenRetried = true
		default:
			return err
		}
	}
}

func (s *PostgresStore) txOnce(ctx context.Context, fn func(pgx.Tx) error) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	done := false
	defer func() {
		if !done { // fn failed or panicked: the transaction goes
			rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			tx.Rollback(rctx)
			cancel()
		}
	}()
	if err := fn(tx); err != nil {
		return err
	}
	done = true
	if err := tx.Commit(ctx); err != nil {
		if hasCode(err, "40001", "40P01") {
			return err // refused: nothing committed
		}
		return commitError{err}
	}
	return nil
}

// read runs a read, and once more when the connection it ran on broke or could not be had: a pooled connection
// the server closed (after a restart, every idle connection of the pool is one) fails the first call made on
// it. A read changes nothing, so repeating it is always safe.
func (s *PostgresStore) read(ctx context.Context, fn func() error) error {
	err := fn()
	if err != nil && unavailable(err) && ctx.Err() == nil {
		s.dropConnsIfServerWentAway(err)
		err = fn()
	}
	return err
}

// dropConnsIfServerWentAway closes every pooled connection when err says the server closed the one it came on
// (shut down, restarted, or the connection reset): the others were opened to the same server and are as dead,
// and each would otherwise fail the next call made on it.
func (s *PostgresStore) dropConnsIfServerWentAway(err error) {
	var pe *pgconn.PgError
	if (errors.As(err, &pe) && (pe.Code == "57P01" || pe.Code == "57P02")) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		s.pool.Reset()
	}
}

// retrySafe runs one statement, and once more when it failed before anything reached the server.
func retrySafe(run func() error) error {
	err := run()
	if err != nil && pgconn.SafeToRetry(err) {
		err = run()
	}
	return err
}

func randN(n int) int {
	var b [1]byte
	rand.Read(b[:])
	return int(b[0]) % n
}

// nanos is t in unix nanoseconds, clamped to what an int64 holds (as finalKey does), for columns that order
// records.
func nanos(t time.Time) int64 {
	switch {
	case t.After(latestKeyTime):
		return math.MaxInt64
	case t.Before(time.Unix(0, 0)):
		return 0
	}
	return t.UnixNano()
}

// pgRow is what a record's row holds beside the record.
type pgRow struct {
	data      []byte
	pending   bool
	claimedNS int64
	keptNS    *int64
	servedNS  *int64
}

func rowOf(r *Record) (pgRow, error) {
	enc, err := encodeRecord(r)
	if err != nil {
		return pgRow{}, err
	}
	row := pgRow{data: enc, pending: r.State != StateFinal, claimedNS: nanos(r.ClaimedAt)}
	if !row.pending {
		k := nanos(r.keptUntil())
		row.keptNS = &k
	}
	if r.Served {
		ns := r.ServedAt.UnixNano() // as servedStamp keeps it
		row.servedNS = &ns
	}
	return row, nil
}

// decodeRow reads a record's row: the record, and its served mark from served_ns.
func decodeRow(idBytes, data []byte, servedNS *int64) (Record, error) {
	if len(idBytes) != len(ID{}) {
		return Record{}, fmt.Errorf("%w: x402_records holds an id of %d bytes, want %d", ErrCorrupt, len(idBytes), len(ID{}))
	}
	id := ID(idBytes)
	r, err := decodeRecord(id, data)
	if err != nil {
		return Record{}, err
	}
	if servedNS != nil {
		r.Served, r.ServedAt = true, time.Unix(0, *servedNS).UTC()
	}
	return r, nil
}

// querier is a pool or a transaction.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// getRow reads the record of id; forUpdate locks its row until the transaction ends.
func getRow(ctx context.Context, q querier, id ID, forUpdate bool) (Record, bool, error) {
	sql := pgGetRecord
	if forUpdate {
		sql += ` FOR UPDATE`
	}
	return scanRecord(q.QueryRow(ctx, sql, id[:]), id)
}

// pgGetRecord reads the record of id $1: scanRecord reads its row.
const pgGetRecord = `SELECT data, served_ns FROM x402_records WHERE id = $1`

// scanRecord reads the row of pgGetRecord: the record, or found false for no row.
func scanRecord(row pgx.Row, id ID) (rec Record, found bool, err error) {
	var data []byte
	var served *int64
	err = row.Scan(&data, &served)
	if errors.Is(err, pgx.ErrNoRows) {
		return Record{}, false, nil
	}
	if err != nil {
		return Record{}, false, err
	}
	if rec, err = decodeRow(id[:], data, served); err != nil {
		return Record{}, false, err
	}
	return rec, true, nil
}

const pgInsertRecord = `INSERT INTO x402_records (id, state, async, pending, claimed_ns, kept_until_ns, served_ns, data)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING`

// pgTxn is a txn over one transaction, whose get locks the row it reads.
type pgTxn struct {
	ctx context.Context
	tx  pgx.Tx
}

func (t pgTxn) get(id ID) (Record, bool, error) { return getRow(t.ctx, t.tx, id, true) }

func (t pgTxn) put(prev, next *Record) error {
	row, err := rowOf(next)
	if err != nil {
		return err
	}
	if prev == nil {
		tag, err := t.tx.Exec(t.ctx, pgInsertRecord, next.ID[:], string(next.State), next.Async, row.pending, row.claimedNS,
			row.keptNS, row.servedNS, row.data)
		if err == nil && tag.RowsAffected() == 0 {
			err = fmt.Errorf("journal: insert of %s found a record there", next.ID)
		}
		return err
	}
	// claimed_ns stays: the store owns ClaimedAt. A served mark, once there, stays as it is.
	_, err = t.tx.Exec(t.ctx, `UPDATE x402_records SET state = $2, async = $3, pending = $4, kept_until_ns = $5,
	served_ns = COALESCE(served_ns, $6), data = $7 WHERE id = $1`,
		next.ID[:], string(next.State), next.Async, row.pending, row.keptNS, row.servedNS, row.data)
	return err
}

func (t pgTxn) del(prev *Record) error {
	_, err := t.tx.Exec(t.ctx, `DELETE FROM x402_records WHERE id = $1`, prev.ID[:])
	return err
}

// pgClaimTxn is the txn of Claim: it reads nothing (the insert finds out whether the id is taken) and inserts
// with ON CONFLICT DO NOTHING, which the primary key makes exactly one claimant's, however many processes try.
type pgClaimTxn struct {
	ctx context.Context
	s   *PostgresStore
}

// errClaimTaken: the insert of a claim found a record there.
var errClaimTaken = errors.New("journal: claimed already")

func (t pgClaimTxn) get(ID) (Record, bool, error) { return Record{}, false, nil }

func (t pgClaimTxn) put(_, next *Record) error {
	row, err := rowOf(next)
	if err != nil {
		return err
	}
	// In a group with other requests' writes (postgres_group.go), as the one statement it is alone.
	var tag pgconn.CommandTag
	err = t.s.grouped(t.ctx, func(b *pgx.Batch) {
		b.Queue(pgInsertRecord, next.ID[:], string(next.State), next.Async, row.pending, row.claimedNS, row.keptNS, row.servedNS, row.data)
	}, func(br pgx.BatchResults) (err error) {
		tag, err = br.Exec()
		return err
	})
	if err == nil && tag.RowsAffected() == 0 {
		return errClaimTaken
	}
	return err
}

func (pgClaimTxn) del(*Record) error { return errors.New("journal: a claim deletes nothing") }

// Claim implements Store. Deferred writes of ctx (postgres_behind.go) ride in the batch of its insert.
func (s *PostgresStore) Claim(ctx context.Context, r Record) (Record, bool, error) {
	if items, done, err := s.carry(ctx); err != nil {
		return Record{}, false, err
	} else if len(items) > 0 {
		return s.claimCarrying(ctx, r, items, done)
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Record{}, false, err
	}
	defer cancel()
	now := s.opts.now()
	for attempt := 0; ; attempt++ {
		rec, claimed, err := claimIn(pgClaimTxn{wctx, s}, r, now)
		if !errors.Is(err, errClaimTaken) {
			if err != nil {
				return Record{}, false, s.fail(ctx, "claim", err)
			}
			return rec, claimed, nil
		}
		// Claimed by someone else (or by an earlier call): show the first claim.
		rec, ok, err := getRow(wctx, s.pool, r.ID, false)
		if err != nil {
			return Record{}, false, s.fail(ctx, "claim", err)
		}
		if ok {
			return rec, false, nil
		}
		// Released between the insert and the read: the payment is free again.
		if attempt == 3 {
			return Record{}, false, fmt.Errorf("journal: claim of %s: the record came and went four times", r.ID)
		}
	}
}

// Get implements Store.
func (s *PostgresStore) Get(ctx context.Context, id ID) (Record, bool, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return Record{}, false, err
	}
	defer cancel()
	var r Record
	var ok bool
	err = s.read(rctx, func() (err error) {
		r, ok, err = getRow(rctx, s.pool, id, false)
		return err
	})
	return r, ok, s.fail(ctx, "get", err)
}

// Update implements Store.
func (s *PostgresStore) Update(ctx context.Context, id ID, fn func(*Record) error) (Record, error) {
	return s.updateInTwo(ctx, id, fn, nil)
}

// MarkServed implements Store: it writes the served_ns column alone.
func (s *PostgresStore) MarkServed(ctx context.Context, id ID, at time.Time) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	var tag pgconn.CommandTag
	err = retrySafe(func() (err error) {
		tag, err = s.pool.Exec(wctx, `UPDATE x402_records SET served_ns = $2 WHERE id = $1 AND served_ns IS NULL`, id[:], at.UnixNano())
		return err
	})
	if err != nil {
		return s.fail(ctx, "mark served", err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	var exists bool
	if err := s.pool.QueryRow(wctx, `SELECT EXISTS (SELECT 1 FROM x402_records WHERE id = $1)`, id[:]).Scan(&exists); err != nil {
		return s.fail(ctx, "mark served", err)
	}
	if exists {
		return fmt.Errorf("%w: %s", ErrServed, id)
	}
	return fmt.Errorf("%w: %s", ErrNotFound, id)
}

// Release implements Store.
func (s *PostgresStore) Release(ctx context.Context, claim Record) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	return s.fail(ctx, "release", s.inTx(wctx, func(tx pgx.Tx) error { return releaseIn(pgTxn{wctx, tx}, claim) }))
}

// ReleaseUnsent implements Store.
func (s *PostgresStore) ReleaseUnsent(ctx context.Context, claim Record, txHash string) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	return s.fail(ctx, "release unsent", s.inTx(wctx, func(tx pgx.Tx) error { return releaseUnsentIn(pgTxn{wctx, tx}, claim, txHash) }))
}

// Pending implements Store.
func (s *PostgresStore) Pending(ctx context.Context) ([]Record, error) {
	return s.pending(ctx, `SELECT id, data, served_ns FROM x402_records WHERE pending ORDER BY claimed_ns, id`)
}

// PendingOf implements Store.
func (s *PostgresStore) PendingOf(ctx context.Context, async bool) ([]Record, error) {
	return s.pending(ctx, `SELECT id, data, served_ns FROM x402_records WHERE pending AND async = $1 ORDER BY claimed_ns, id`, async)
}

func (s *PostgresStore) pending(ctx context.Context, sql string, args ...any) ([]Record, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return nil, err
	}
	defer cancel()
	var out []Record
	var damaged error
	err = s.read(rctx, func() error {
		out = out[:0]
		rows, err := s.pool.Query(rctx, sql, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id, data []byte
			var served *int64
			if err := rows.Scan(&id, &data, &served); err != nil {
				return err
			}
			r, err := decodeRow(id, data, served)
			if err != nil {
				damaged = err
				return nil
			}
			out = append(out, r)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, s.fail(ctx, "pending", err)
	}
	if damaged != nil {
		return nil, damaged
	}
	// The database sorted by the clamped claim time; records claimed at times an int64 of nanoseconds cannot
	// hold sort as the other stores sort them.
	sortPending(out)
	return out, nil
}

// Prune implements Store. It deletes in chunks of pruneChunk, each its own statement, so other writes
// interleave; a final record whose deadline an update moved while Prune ran is judged on its new one.
func (s *PostgresStore) Prune(ctx context.Context, finalBefore time.Time) (int, error) {
	cutoff := nanos(finalBefore)
	total := 0
	for {
		wctx, cancel, err := s.begin(ctx, true)
		if err != nil {
			return total, err
		}
		var tag pgconn.CommandTag
		err = retrySafe(func() (err error) {
			tag, err = s.pool.Exec(wctx, `DELETE FROM x402_records WHERE id IN (
	SELECT id FROM x402_records WHERE NOT pending AND kept_until_ns < $1 ORDER BY kept_until_ns LIMIT $2
) AND NOT pending AND kept_until_ns < $1`, cutoff, pruneChunk)
			return err
		})
		cancel()
		if err != nil {
			return total, s.fail(ctx, "prune", err)
		}
		n := int(tag.RowsAffected())
		total += n
		if n < pruneChunk {
			if err := s.prunePaymentIdentifiers(ctx, finalBefore); err != nil {
				return total, err
			}
			return total, s.pruneAccess(ctx, s.opts.now())
		}
	}
}

// Count implements Store.
func (s *PostgresStore) Count(ctx context.Context) (int, error) {
	return s.count(ctx, `SELECT count(*) FROM x402_records`)
}

// Backlog implements Store.
func (s *PostgresStore) Backlog(ctx context.Context) (int, error) {
	return s.count(ctx, `SELECT count(*) FROM x402_records WHERE pending`)
}

func (s *PostgresStore) count(ctx context.Context, sql string, args ...any) (int, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return 0, err
	}
	defer cancel()
	var n int64
	if err := s.read(rctx, func() error { return s.pool.QueryRow(rctx, sql, args...).Scan(&n) }); err != nil {
		return 0, s.fail(ctx, "count", err)
	}
	return int(n), nil
}

// Alive implements Cluster.
func (s *PostgresStore) Alive(ctx context.Context, owner string) (bool, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return false, err
	}
	defer cancel()
	if owner == s.instance {
		return true, nil
	}
	var alive bool
	err = s.read(rctx, func() error {
		return s.pool.QueryRow(rctx, `SELECT EXISTS (SELECT 1 FROM x402_instances WHERE token = $1 AND expires_at > now())`, owner).Scan(&alive)
	})
	return alive, s.fail(ctx, "alive", err)
}

// Instances implements Cluster, in one statement. Tokens are compared byte by byte (COLLATE "C"), so every
// instance orders them alike whatever the database's collation.
func (s *PostgresStore) Instances(ctx context.Context) (live, rank int, err error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return 0, 0, err
	}
	defer cancel()
	var n, before int64
	err = s.read(rctx, func() error {
		// This instance counts even while its heartbeat is behind: it is always alive to itself.
		return s.pool.QueryRow(rctx, `SELECT count(*), count(*) FILTER (WHERE token COLLATE "C" < $1 COLLATE "C")
FROM x402_instances WHERE expires_at > now() OR token = $1`, s.instance).Scan(&n, &before)
	})
	if err != nil {
		return 0, 0, s.fail(ctx, "instances", err)
	}
	return int(n), int(before), nil
}

// Busy implements Cluster, in one statement: the insert of the mark, or, when there is one, its takeover if
// it is this instance's or its owner is not alive.
func (s *PostgresStore) Busy(ctx context.Context, id ID) (bool, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return false, err
	}
	defer cancel()
	var marked bool
	err = retrySafe(func() error {
		err := s.pool.QueryRow(wctx, pgBusy, id[:], s.instance).Scan(&marked)
		if errors.Is(err, pgx.ErrNoRows) {
			marked, err = false, nil // another live instance's mark
		}
		return err
	})
	if err != nil {
		return false, s.fail(ctx, "busy", err)
	}
	return marked, nil
}

// pgBusy is Busy's statement: the insert of the mark, or its takeover when it is this instance's or its owner is
// not alive; it returns a row only when the mark is this instance's.
const pgBusy = `INSERT INTO x402_busy AS b (id, owner) VALUES ($1, $2)
ON CONFLICT (id) DO UPDATE SET owner = EXCLUDED.owner, since = now()
WHERE b.owner = EXCLUDED.owner
   OR NOT EXISTS (SELECT 1 FROM x402_instances i WHERE i.token = b.owner AND i.expires_at > now())
RETURNING true`

// UpdateFenced implements Cluster: Update in one transaction with a check, under a share lock of the lease's
// row (a takeover waits for the write, or the write sees the takeover), that this instance holds the lease at
// fence and it has not expired.
func (s *PostgresStore) UpdateFenced(ctx context.Context, id ID, lease string, fence uint64, fn func(*Record) error) (Record, error) {
	return s.updateInTwo(ctx, id, fn, s.fenceCheck(lease, fence))
}

// Idle implements Cluster.
func (s *PostgresStore) Idle(ctx context.Context, id ID) error {
	return s.execWrite(ctx, "idle", `DELETE FROM x402_busy WHERE id = $1 AND owner = $2`, id[:], s.instance)
}

// Lease implements Cluster, in one transaction that locks the lease's row.
func (s *PostgresStore) Lease(ctx context.Context, name string, ttl time.Duration) (Lease, error) {
	if ttl <= 0 {
		return Lease{}, fmt.Errorf("journal: lease %q for %s: the ttl must be positive", name, ttl)
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Lease{}, err
	}
	defer cancel()
	var l Lease
	err = s.inTx(wctx, func(tx pgx.Tx) error {
		l = Lease{Name: name}
		if _, err := tx.Exec(wctx, `INSERT INTO x402_leases (name) VALUES ($1) ON CONFLICT (name) DO NOTHING`, name); err != nil {
			return err
		}
		var (
			fence   int64
			current bool
		)
		err := tx.QueryRow(wctx, `SELECT l.owner, l.fence, l.expires_at, l.expires_at > now()
FROM x402_leases l WHERE l.name = $1 FOR UPDATE`, name).Scan(&l.Owner, &fence, &l.Expires, &current)
		if err != nil {
			return err
		}
		l.Fence = uint64(fence)
		switch {
		case l.Owner == s.instance && current:
			// A renewal: the fence stays.
			err = tx.QueryRow(wctx, `UPDATE x402_leases SET expires_at = now() + $2 * interval '1 microsecond' WHERE name = $1
RETURNING expires_at`, name, ttl.Microseconds()).Scan(&l.Expires)
			l.Held = true
		case l.Owner == "" || !current:
			// Never because the holder looks dead: a holder that cannot reach the database goes on signing until
			// its own reckoning of the lease runs out, which is before the lease expires here.
			// A takeover, even of this instance's own lapsed lease: someone may have read it as free.
			err = tx.QueryRow(wctx, `UPDATE x402_leases SET owner = $2, fence = fence + 1, expires_at = now() + $3 * interval '1 microsecond'
WHERE name = $1 RETURNING fence, expires_at`, name, s.instance, ttl.Microseconds()).Scan(&fence, &l.Expires)
			l.Owner, l.Fence, l.Held, l.Took = s.instance, uint64(fence), true, true
		}
		return err
	})
	if err != nil {
		return Lease{}, s.fail(ctx, "lease", err)
	}
	l.Expires = l.Expires.UTC()
	return l, nil
}

// Unlease implements Cluster.
func (s *PostgresStore) Unlease(ctx context.Context, name string) error {
	return s.execWrite(ctx, "unlease", `UPDATE x402_leases SET owner = '', expires_at = now() WHERE name = $1 AND owner = $2`, name, s.instance)
}

// checkHold refuses a hold whose amount or the funds it is judged against are missing, or a negative amount.
func checkHold(h Hold, avail *big.Int) error {
	if h.Amount == nil || avail == nil || h.Amount.Sign() < 0 {
		return fmt.Errorf("journal: hold of %s: amount %v and avail %v must be set, amount not negative", h.ID, h.Amount, avail)
	}
	return nil
}

// Hold implements Cluster. With take, it locks the key's row in x402_hold_keys, so that the holds of one key are
// decided one at a time across every process, deletes the holds that no longer count, and inserts h when the
// rest leave room for it: one transaction in one round trip (holdInOne).
func (s *PostgresStore) Hold(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, take bool) (bool, *big.Int, error) {
	if err := checkHold(h, avail); err != nil {
		return false, nil, err
	}
	var (
		ok   bool
		left *big.Int
		err  error
	)
	if take {
		// What ctx's queue holds (a gate's deferred mark) rides in the hold's transaction, under its guard.
		_, ok, left, err = s.holdCarrying(ctx, h, avail, readBlock, chainTime, false)
	} else {
		var (
			sum  string
			held bool
		)
		err = s.readCarrying(ctx, func(b *pgx.Batch) {
			b.Queue(pgCoveredSQL, coveredArgs(h, readBlock, chainTime)...).QueryRow(func(row pgx.Row) error {
				return row.Scan(&sum, &held)
			})
		})
		var others *big.Int
		if err == nil {
			if others, err = holdsSum(h.Key, sum); err == nil {
				ok, left = covers(h, avail, others, held)
			}
		}
	}
	if errors.Is(err, ErrPermitNonceHeld) {
		return false, left, err
	}
	if err != nil {
		return false, nil, s.fail(ctx, "hold", err)
	}
	return ok, left, nil
}

// queryHolds reads the holds of key, oldest first.
func queryHolds(ctx context.Context, q querier, key string) ([]Hold, error) {
	rows, err := q.Query(ctx, pgSelectHolds, key)
	if err != nil {
		return nil, err
	}
	return scanHolds(rows, key)
}

// scanHolds reads the rows of pgSelectHolds, the holds of key, and closes them.
func scanHolds(rows pgx.Rows, key string) ([]Hold, error) {
	defer rows.Close()
	var out []Hold
	for rows.Next() {
		var (
			id                      []byte
			amount, deadline, mined string
			nonce                   *string
			served                  bool
		)
		if err := rows.Scan(&id, &amount, &deadline, &mined, &nonce, &served); err != nil {
			return nil, err
		}
		h, err := holdOfRow(key, id, amount, deadline, mined, nonce, served)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, rows.Err()
}

// holdOfRow is the hold of key whose columns (numbers as text) a row of x402_holds holds.
func holdOfRow(key string, id []byte, amount, deadline, mined string, nonce *string, served bool) (Hold, error) {
	h := Hold{Key: key, Amount: new(big.Int), Served: served}
	bad := len(id) != len(h.ID)
	copy(h.ID[:], id)
	_, okA := h.Amount.SetString(amount, 10)
	var errD, errM error
	h.Deadline, errD = strconv.ParseUint(deadline, 10, 64)
	h.Mined, errM = strconv.ParseUint(mined, 10, 64)
	if nonce != nil {
		var okN bool
		h.PermitNonce, okN = new(big.Int).SetString(*nonce, 10)
		bad = bad || !okN
	}
	if bad || !okA || errD != nil || errM != nil {
		return Hold{}, fmt.Errorf("%w: hold %x of %q does not read (amount %q, deadline %q, mined %q)", ErrCorrupt, id, key, amount, deadline, mined)
	}
	return h, nil
}

// HoldMined implements Cluster; the first block recorded stays.
func (s *PostgresStore) HoldMined(ctx context.Context, id ID, block uint64) error {
	return s.execWrite(ctx, "hold mined", `UPDATE x402_holds SET mined = $2::numeric, mined_at = now() WHERE id = $1 AND mined = 0`, id[:], strconv.FormatUint(block, 10))
}

// Unhold implements Cluster.
func (s *PostgresStore) Unhold(ctx context.Context, id ID, unlessServed bool) error {
	return s.execWrite(ctx, "unhold", `DELETE FROM x402_holds WHERE id = $1 AND NOT (served AND $2)`, id[:], unlessServed)
}

// HoldsOf implements Cluster: every hold of key stored, oldest first. Which of them the chain has caught up
// with only a Hold with a new read decides.
func (s *PostgresStore) HoldsOf(ctx context.Context, key string) ([]Hold, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return nil, err
	}
	defer cancel()
	holds, err := queryHolds(rctx, s.pool, key)
	if err != nil {
		return nil, s.fail(ctx, "holds of", err)
	}
	return holds, nil
}

// PruneHolds implements Cluster, in one statement.
func (s *PostgresStore) PruneHolds(ctx context.Context, prefix string, before uint64) (int, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return 0, err
	}
	defer cancel()
	var tag pgconn.CommandTag
	err = retrySafe(func() (err error) {
		tag, err = s.pool.Exec(wctx, `DELETE FROM x402_holds WHERE left(hold_key, length($1)) = $1 AND deadline < $2::numeric`,
			prefix, strconv.FormatUint(before, 10))
		return err
	})
	if err != nil {
		return 0, s.fail(ctx, "prune holds", err)
	}
	return int(tag.RowsAffected()), nil
}

var (
	_ Store   = (*PostgresStore)(nil)
	_ Cluster = (*PostgresStore)(nil)
)

// execWrite runs one statement that writes, retried as retrySafe says, and reports its failure as op's.
func (s *PostgresStore) execWrite(ctx context.Context, op, sql string, args ...any) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	err = retrySafe(func() error {
		_, err := s.pool.Exec(wctx, sql, args...)
		return err
	})
	return s.fail(ctx, op, err)
}
