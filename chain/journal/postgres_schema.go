package journal

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgMigrations are the PostgreSQL store's schema, one migration per version (version n is pgMigrations[n-1]).
// A migration once released never changes: a new release appends one. Every statement tolerates having run
// before (IF NOT EXISTS), and each migration runs in one transaction with the row that records it.
//
// Times that only the journal's clock decides (a record's claim, how long a final record is kept, when it was
// served) are unix nanoseconds, as the bolt store keeps them: exact to the nanosecond, where timestamptz keeps
// microseconds. Times that decide between processes (heartbeats, leases) are timestamptz from the database's
// now().
var pgMigrations = []string{
	// 1: the first schema.
	`
-- One row per payment. data is the record as encodeRecord writes it; the other columns are what queries select
-- on. served_ns is the served mark MarkServed writes alone: it, not data, says whether the payment was served.
CREATE TABLE IF NOT EXISTS x402_records (
	id            bytea   PRIMARY KEY,
	state         text    NOT NULL,
	async         boolean NOT NULL DEFAULT false,
	pending       boolean NOT NULL,  -- not final
	claimed_ns    bigint  NOT NULL,  -- ClaimedAt, for Pending's order
	kept_until_ns bigint,            -- max(FinalAt, Deadline) of a final record, for Prune
	served_ns     bigint,            -- ServedAt of a served payment
	data          bytea   NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_records_pending ON x402_records (claimed_ns, id) WHERE pending;
CREATE INDEX IF NOT EXISTS x402_records_kept_until ON x402_records (kept_until_ns) WHERE NOT pending;

-- The processes sharing the journal: each open of a store, alive while its heartbeat keeps expires_at ahead.
CREATE TABLE IF NOT EXISTS x402_instances (
	token      text        PRIMARY KEY,
	started_at timestamptz NOT NULL DEFAULT now(),
	expires_at timestamptz NOT NULL
);

-- Payments an instance is working on right now (Busy, Idle).
CREATE TABLE IF NOT EXISTS x402_busy (
	id    bytea       PRIMARY KEY,
	owner text        NOT NULL,
	since timestamptz NOT NULL DEFAULT now()
);

-- Named leases (a settlement wallet each) with their fences.
CREATE TABLE IF NOT EXISTS x402_leases (
	name       text        PRIMARY KEY,
	owner      text        NOT NULL DEFAULT '',
	fence      bigint      NOT NULL DEFAULT 0,
	expires_at timestamptz NOT NULL DEFAULT now()
);

-- Payments held against a payer's funds; x402_hold_keys has one row per key, which Hold locks so that the
-- holds of one key are decided one at a time.
CREATE TABLE IF NOT EXISTS x402_hold_keys (
	hold_key text PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS x402_holds (
	id           bytea       PRIMARY KEY,
	hold_key     text        NOT NULL,
	amount       numeric     NOT NULL,
	deadline     numeric(20) NOT NULL,
	mined        numeric(20) NOT NULL DEFAULT 0,
	permit_nonce numeric,
	held_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS x402_holds_key ON x402_holds (hold_key);
`,
	// 2: a hold taken for a payment served before it settles outlives a settlement attempt that failed for now.
	`
ALTER TABLE x402_holds ADD COLUMN IF NOT EXISTS served boolean NOT NULL DEFAULT false;
`,
	// 3: the rate limits the instances of a cluster enforce together (TakeToken): a token bucket per key.
	`
-- tokens is what the bucket held at time at, by the database's clock; a bucket untouched for a minute is full,
-- the same as no row, and is pruned.
CREATE TABLE IF NOT EXISTS x402_rate_buckets (
	key    text             PRIMARY KEY,
	tokens double precision NOT NULL,
	at     timestamptz      NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_rate_buckets_at ON x402_rate_buckets (at);
`,
	// 4: when a hold was marked mined, by the database's clock: a hold mined after another instance's funds read
	// still counts for that read, so its row stays until no read older than its block can still answer (see
	// postgres_mined.go). NULL, a hold marked before this migration, is a mark made long ago. Each instance says
	// how long its funds reads answer for, so that every instance keeps mined holds for the longest.
	`
ALTER TABLE x402_holds ADD COLUMN IF NOT EXISTS mined_at timestamptz;
-- A busy payer's key keeps a minute or so of mined holds: the hold reads only those that still count for its
-- read (never mined, or mined after it), and deletes only those marked long enough ago, each through an index.
CREATE INDEX IF NOT EXISTS x402_holds_key_mined ON x402_holds (hold_key, mined);
CREATE INDEX IF NOT EXISTS x402_holds_key_mined_at ON x402_holds (hold_key, mined_at) WHERE mined <> 0;
ALTER TABLE x402_instances ADD COLUMN IF NOT EXISTS reads_answer_for_us bigint NOT NULL DEFAULT 0;
`,
	// 5: batch-settlement channels (postgres_channel.go): one row per channel, whose cumulative amount every
	// accepted voucher advances by one compare-and-set. A new table only, which no earlier release reads or
	// writes: instances of release 4 go on as they were beside instances of this one.
	`
-- Amounts are numeric (uint128 on chain), blocks numeric(20) (uint64); times the journal's clock decides are unix
-- nanoseconds, as x402_records keeps them. claim_tx is the claim in flight (NULL: none), and claim_amount what it
-- claims; claimed is what the chain has claimed, as mined claims and reads of the chain said.
CREATE TABLE IF NOT EXISTS x402_channels (
	network               text        NOT NULL,
	escrow                text        NOT NULL,
	channel_id            text        NOT NULL,
	config                bytea       NOT NULL,
	deposit               numeric     NOT NULL,
	deposit_block         numeric(20) NOT NULL,
	deposit_read_ns       bigint      NOT NULL,
	withdraw_requested_ns bigint,
	withdraw_amount       numeric,
	withdrawn_ns          bigint,
	charged               numeric     NOT NULL,
	signature             bytea,
	digest                bytea,
	vouchers              bigint      NOT NULL DEFAULT 0,
	accepted_ns           bigint,
	accepted_by           text,
	unclaimed_since_ns    bigint,
	claimed               numeric     NOT NULL,
	claimed_tx            text,
	claim_tx              text,
	claim_amount          numeric,
	claim_sent_ns         bigint,
	PRIMARY KEY (network, escrow, channel_id),
	CHECK ((claim_tx IS NULL) = (claim_amount IS NULL))
);
CREATE INDEX IF NOT EXISTS x402_channels_claim_tx ON x402_channels (claim_tx) WHERE claim_tx IS NOT NULL;
CREATE INDEX IF NOT EXISTS x402_channels_withdrawn ON x402_channels (withdrawn_ns) WHERE withdrawn_ns IS NOT NULL;
`,
	pgPaymentIdentifiersMigration,
	pgAccessMigration,
	pgDiscoveryMigration,
	pgRefundMarkMigration,
}

// ErrSchemaTooNew: OpenPostgres found a database migrated by a newer release than this one, whose schema this
// build cannot promise to read or write correctly.
var ErrSchemaTooNew = errors.New("journal: database schema is newer than this build")

// migrate brings the database's schema up to this build's, and refuses a database of a newer schema. Several
// processes may run it at once: each migration is applied in a transaction that first inserts its version's
// row, so concurrent starters queue behind the one that inserted it and then find the version applied.
func migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return migrateTo(ctx, pool, pgMigrations)
}

// migrateTo is migrate for a release whose migrations are those given: the tests run an earlier release's (a
// prefix of pgMigrations) beside this one's.
func migrateTo(ctx context.Context, pool *pgxpool.Pool, migrations []string) error {
	for attempt := 0; ; attempt++ {
		_, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS x402_schema_migrations (
	version    integer     PRIMARY KEY,
	applied_at timestamptz NOT NULL DEFAULT now()
)`)
		// Two sessions creating the table at once can both pass IF NOT EXISTS; the loser gets a duplicate: of the
		// table (42P07), of its row type (42710), or of a catalog row (23505).
		if err == nil || attempt == 4 || !hasCode(err, "42P07", "42710", "23505") {
			if err != nil {
				return fmt.Errorf("create x402_schema_migrations: %w", err)
			}
			break
		}
		time.Sleep(time.Duration(10*(attempt+1)) * time.Millisecond)
	}
	applied, err := schemaVersion(ctx, pool, len(migrations))
	if err != nil {
		return err
	}
	for i, sql := range migrations {
		version := i + 1
		if version <= applied {
			continue
		}
		var err error
		for attempt := 0; attempt < 5; attempt++ {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				tag, err := tx.Exec(ctx, `INSERT INTO x402_schema_migrations (version) VALUES ($1) ON CONFLICT (version) DO NOTHING`, version)
				if err != nil || tag.RowsAffected() == 0 {
					return err // applied by another process meanwhile
				}
				_, err = tx.Exec(ctx, sql)
				return err
			})
			// A database with SERIALIZABLE transactions may refuse the loser of two concurrent starters.
			if !hasCode(err, "40001", "40P01") {
				break
			}
			time.Sleep(time.Duration(10*(attempt+1)) * time.Millisecond)
		}
		if err != nil {
			return fmt.Errorf("apply schema migration %d: %w", version, err)
		}
	}
	_, err = schemaVersion(ctx, pool, len(migrations))
	return err
}

// schemaVersion returns the highest migration applied, refusing one above known, the last this build knows.
func schemaVersion(ctx context.Context, pool *pgxpool.Pool, known int) (int, error) {
	var v int
	if err := pool.QueryRow(ctx, `SELECT COALESCE(max(version), 0) FROM x402_schema_migrations`).Scan(&v); err != nil {
		return 0, fmt.Errorf("read the schema version: %w", err)
	}
	if v > known {
		return v, fmt.Errorf("%w: the database has schema version %d and this build knows versions up to %d; "+
			"it was migrated by a newer release, which must be run instead (a downgrade cannot read what it writes)",
			ErrSchemaTooNew, v, known)
	}
	return v, nil
}
