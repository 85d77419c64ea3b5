package journal

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Access is a store that keeps what payments bought beyond their own response (sign-in-with-x): a grant of
// access to a payer for a while, and maybe a number of requests, and the nonces of the sign-ins that used it,
// each good once. A gate grants once a payment's response was served, and signs a request in by spending a
// nonce and one use of the grant in one write, so that every process of the store sees the same grant and no
// nonce signs in twice, across restarts and reloads. Prune deletes grants that have ended and nonces past their
// time. Every store of this package implements it.
type Access interface {
	// GrantAccess grants key access until until, for uses requests (0: as many as come), bought by payment. A
	// grant key holds that is still good is extended: the later end, and the uses of both. A payment that granted
	// before changes nothing, whatever other payments granted since (its mark is kept GrantMarkKept past its
	// grant's end), so that a payment served on a later presentation grants once.
	GrantAccess(ctx context.Context, key string, payment ID, until time.Time, uses int64) error
	// SignIn spends nonce (remembered as used until nonceUntil) and one use of key's grant at now, in one write,
	// and returns the grant as it is after. It changes nothing and returns ErrNonceUsed, ErrNoGrant,
	// ErrGrantEnded or ErrGrantUsedUp when the nonce signed in before or the grant does not let one more request
	// in.
	SignIn(ctx context.Context, key, nonce string, nonceUntil, now time.Time) (Grant, error)
	// AccessGrant returns key's grant as it stands, and whether there is one.
	AccessGrant(ctx context.Context, key string) (Grant, bool, error)
}

// Grant is what a payment bought of a route beyond its response.
type Grant struct {
	// Until is when it ends.
	Until time.Time
	// Uses is how many more requests it lets in; -1: as many as come until it ends.
	Uses int64
	// Payment is the last payment that bought or extended it.
	Payment ID
}

// GrantMarkKept is how long past its grant's end the journal remembers that a payment granted access: a payment
// presented again within it (its first response cut short) grants nothing more. Presenting a payment again
// serves it for as long as its record is kept; the payment's own signature has expired long before this ends.
const GrantMarkKept = 7 * 24 * time.Hour

// grantMark is the key under which the used nonces keep that payment granted access: no sign-in's nonce, which
// its payer's address starts, is the same.
func grantMark(payment ID) string { return "granted\n" + payment.String() }

// Refusals of SignIn.
var (
	ErrNonceUsed   = errors.New("journal: the sign-in's nonce signed in before")
	ErrNoGrant     = errors.New("journal: no payment bought access")
	ErrGrantEnded  = errors.New("journal: the access a payment bought has ended")
	ErrGrantUsedUp = errors.New("journal: the access a payment bought is used up")
)

var (
	_ Access = (*MemoryStore)(nil)
	_ Access = (*BoltStore)(nil)
	_ Access = (*PostgresStore)(nil)
)

// Buckets of the bolt store's grants (key -> grantBytes) and used nonces (nonce -> until, unix ns big endian). A
// file of an earlier release gains them at open; an earlier release opening a file that has them leaves them
// alone.
var (
	bucketAccessGrants = []byte("accessGrants")
	bucketSignInNonces = []byte("signInNonces")
	grantBytesLen      = 8 + 8 + len(ID{})
)

// errGrantRaced: another process wrote a payer's first grant while this one read none; it is read again.
var errGrantRaced = errors.New("journal: another process granted the same access at once")

// grantBytes is how a grant is stored: its end (unix ns), its uses, the payment, big endian.
func grantBytes(g Grant) []byte {
	b := binary.BigEndian.AppendUint64(nil, uint64(g.Until.UnixNano()))
	b = binary.BigEndian.AppendUint64(b, uint64(g.Uses))
	return append(b, g.Payment[:]...)
}

// readGrant reads grantBytes.
func readGrant(key string, b []byte) (Grant, error) {
	if len(b) != grantBytesLen {
		return Grant{}, fmt.Errorf("%w: access grant of %q has %d bytes, want %d", ErrCorrupt, key, len(b), grantBytesLen)
	}
	g := Grant{Until: time.Unix(0, int64(binary.BigEndian.Uint64(b))).UTC(), Uses: int64(binary.BigEndian.Uint64(b[8:]))}
	copy(g.Payment[:], b[16:])
	return g, nil
}

// grantAccess is GrantAccess's decision: the grant after it, given the one held (had) at now; false when
// nothing changes.
func grantAccess(held Grant, had bool, payment ID, until time.Time, uses int64, now time.Time) (Grant, bool) {
	if had && held.Payment == payment {
		return held, false
	}
	g := Grant{Until: until.UTC(), Uses: uses, Payment: payment}
	if uses <= 0 {
		g.Uses = -1
	}
	if had && held.Until.After(now) && held.Uses != 0 {
		if held.Until.After(g.Until) {
			g.Until = held.Until
		}
		if held.Uses < 0 || g.Uses < 0 {
			g.Uses = -1
		} else {
			g.Uses += held.Uses
		}
	}
	return g, true
}

// signIn is SignIn's decision on the grant: the grant after one more request, or why none is let in.
func signIn(g Grant, had bool, now time.Time) (Grant, error) {
	switch {
	case !had:
		return g, ErrNoGrant
	case !g.Until.After(now):
		return g, ErrGrantEnded
	case g.Uses == 0:
		return g, ErrGrantUsedUp
	case g.Uses > 0:
		g.Uses--
	}
	return g, nil
}

// GrantAccess implements Access.
func (s *MemoryStore) GrantAccess(ctx context.Context, key string, payment ID, until time.Time, uses int64) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	if s.grants == nil {
		s.grants, s.nonces = make(map[string]Grant), make(map[string]time.Time)
	}
	if _, granted := s.nonces[grantMark(payment)]; granted {
		return nil
	}
	held, had := s.grants[key]
	if g, write := grantAccess(held, had, payment, until, uses, s.opts.now()); write {
		s.grants[key], s.nonces[grantMark(payment)] = g, until.Add(GrantMarkKept)
	}
	return nil
}

// SignIn implements Access.
func (s *MemoryStore) SignIn(ctx context.Context, key, nonce string, nonceUntil, now time.Time) (Grant, error) {
	if err := s.lock(ctx); err != nil {
		return Grant{}, err
	}
	defer s.mu.Unlock()
	if _, used := s.nonces[nonce]; used {
		return Grant{}, ErrNonceUsed
	}
	held, had := s.grants[key]
	g, err := signIn(held, had, now)
	if err != nil {
		return g, err
	}
	s.grants[key], s.nonces[nonce] = g, nonceUntil
	return g, nil
}

// AccessGrant implements Access.
func (s *MemoryStore) AccessGrant(ctx context.Context, key string) (Grant, bool, error) {
	if err := s.lock(ctx); err != nil {
		return Grant{}, false, err
	}
	defer s.mu.Unlock()
	g, ok := s.grants[key]
	return g, ok, nil
}

// pruneAccess deletes the grants ended and the nonces past their time at now; the caller holds the lock.
func (s *MemoryStore) pruneAccess(now time.Time) {
	for k, g := range s.grants {
		if !g.Until.After(now) {
			delete(s.grants, k)
		}
	}
	for n, until := range s.nonces {
		if !until.After(now) {
			delete(s.nonces, n)
		}
	}
}

// GrantAccess implements Access.
func (s *BoltStore) GrantAccess(ctx context.Context, key string, payment ID, until time.Time, uses int64) error {
	var opErr error
	now := s.opts.now()
	err := s.write(ctx, func(t *boltTxn) {
		b, marks := t.tx.Bucket(bucketAccessGrants), t.tx.Bucket(bucketSignInNonces)
		mark := []byte(grantMark(payment))
		if marks.Get(mark) != nil {
			return
		}
		var held Grant
		v := b.Get([]byte(key))
		if v != nil {
			if held, opErr = readGrant(key, v); opErr != nil {
				return
			}
		}
		if g, write := grantAccess(held, v != nil, payment, until, uses, now); write {
			if opErr = b.Put([]byte(key), grantBytes(g)); opErr == nil {
				opErr = marks.Put(mark, binary.BigEndian.AppendUint64(nil, uint64(until.Add(GrantMarkKept).UnixNano())))
			}
			if opErr != nil {
				t.tainted = true
			}
		}
	})
	if err == nil {
		err = opErr
	}
	if err != nil {
		return fmt.Errorf("journal: granting access for payment %s: %w", payment, err)
	}
	return nil
}

// SignIn implements Access.
func (s *BoltStore) SignIn(ctx context.Context, key, nonce string, nonceUntil, now time.Time) (Grant, error) {
	var (
		g     Grant
		opErr error
	)
	err := s.write(ctx, func(t *boltTxn) {
		grants, nonces := t.tx.Bucket(bucketAccessGrants), t.tx.Bucket(bucketSignInNonces)
		if nonces.Get([]byte(nonce)) != nil {
			opErr = ErrNonceUsed
			return
		}
		v := grants.Get([]byte(key))
		var held Grant
		if v != nil {
			if held, opErr = readGrant(key, v); opErr != nil {
				return
			}
		}
		if g, opErr = signIn(held, v != nil, now); opErr != nil {
			return
		}
		if opErr = grants.Put([]byte(key), grantBytes(g)); opErr == nil {
			opErr = nonces.Put([]byte(nonce), binary.BigEndian.AppendUint64(nil, uint64(nonceUntil.UnixNano())))
		}
		if opErr != nil {
			t.tainted = true
		}
	})
	if err == nil {
		err = opErr
	}
	if err != nil {
		return Grant{}, fmt.Errorf("journal: sign in: %w", err)
	}
	return g, nil
}

// AccessGrant implements Access.
func (s *BoltStore) AccessGrant(ctx context.Context, key string) (Grant, bool, error) {
	var (
		g  Grant
		ok bool
	)
	err := s.read(ctx, func(t *boltTxn) (err error) {
		v := t.tx.Bucket(bucketAccessGrants).Get([]byte(key))
		if v == nil {
			return nil
		}
		g, err = readGrant(key, v)
		ok = err == nil
		return err
	})
	return g, ok, err
}

// pruneAccess deletes the grants ended and the nonces past their time at now, in one write.
func (s *BoltStore) pruneAccess(ctx context.Context, now time.Time) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) {
		var gone [][]byte
		grants, nonces := t.tx.Bucket(bucketAccessGrants), t.tx.Bucket(bucketSignInNonces)
		opErr = grants.ForEach(func(k, v []byte) error {
			g, err := readGrant(string(k), v)
			if err != nil {
				return err
			}
			if !g.Until.After(now) {
				gone = append(gone, append([]byte(nil), k...))
			}
			return nil
		})
		for _, k := range gone {
			if opErr = grants.Delete(k); opErr != nil {
				t.tainted = true
				return
			}
		}
		gone = gone[:0]
		_ = nonces.ForEach(func(k, v []byte) error {
			if len(v) != 8 || int64(binary.BigEndian.Uint64(v)) <= now.UnixNano() {
				gone = append(gone, append([]byte(nil), k...))
			}
			return nil
		})
		for _, k := range gone {
			if opErr = nonces.Delete(k); opErr != nil {
				t.tainted = true
				return
			}
		}
	})
	if err == nil {
		err = opErr
	}
	return err
}

// pgAccessMigration keeps Access's grants and used nonces, a row each.
const pgAccessMigration = `
-- What a payment bought of a route beyond its response (sign-in-with-x): a payer's access until until_ns, for
-- uses more requests (-1: any number); pruned once it ended.
CREATE TABLE IF NOT EXISTS x402_access_grants (
	key      text   PRIMARY KEY,
	until_ns bigint NOT NULL,
	uses     bigint NOT NULL,
	payment  bytea  NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_access_grants_until ON x402_access_grants (until_ns);
-- The nonces of sign-ins that signed a request in, each good once; pruned once its sign-in is too old to take.
CREATE TABLE IF NOT EXISTS x402_signin_nonces (
	nonce    text   PRIMARY KEY,
	until_ns bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_signin_nonces_until ON x402_signin_nonces (until_ns);
`

// scanGrant reads a grant's row.
func scanGrant(key string, row pgx.Row) (Grant, bool, error) {
	var (
		until, uses int64
		payment     []byte
	)
	switch err := row.Scan(&until, &uses, &payment); {
	case errors.Is(err, pgx.ErrNoRows):
		return Grant{}, false, nil
	case err != nil:
		return Grant{}, false, err
	case len(payment) != len(ID{}):
		return Grant{}, false, fmt.Errorf("%w: access grant of %q names a payment of %d bytes", ErrCorrupt, key, len(payment))
	}
	return Grant{Until: time.Unix(0, until).UTC(), Uses: uses, Payment: ID(payment)}, true, nil
}

const pgGrantRow = `SELECT until_ns, uses, payment FROM x402_access_grants WHERE key = $1`

// GrantAccess implements Access: the grant is read under its row's lock and written in one transaction.
func (s *PostgresStore) GrantAccess(ctx context.Context, key string, payment ID, until time.Time, uses int64) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	now := s.opts.now()
	grant := func(tx pgx.Tx) error {
		// The payment's mark first: two grants of one payment at once queue on it, and the second finds it. The
		// grant's row is locked where it is; where it is not, two first grants race on the insert, and the one
		// that finds the other's row reads it again.
		tag, err := tx.Exec(wctx, `INSERT INTO x402_signin_nonces (nonce, until_ns) VALUES ($1, $2) ON CONFLICT (nonce) DO NOTHING`,
			grantMark(payment), nanos(until.Add(GrantMarkKept)))
		if err != nil || tag.RowsAffected() == 0 {
			return err
		}
		held, had, err := scanGrant(key, tx.QueryRow(wctx, pgGrantRow+` FOR UPDATE`, key))
		if err != nil {
			return err
		}
		g, write := grantAccess(held, had, payment, until, uses, now)
		switch {
		case !write:
			return nil
		case had:
			_, err = tx.Exec(wctx, `UPDATE x402_access_grants SET until_ns = $2, uses = $3, payment = $4 WHERE key = $1`,
				key, g.Until.UnixNano(), g.Uses, g.Payment[:])
			return err
		}
		tag, err = tx.Exec(wctx, `INSERT INTO x402_access_grants (key, until_ns, uses, payment) VALUES ($1, $2, $3, $4)
	ON CONFLICT (key) DO NOTHING`, key, g.Until.UnixNano(), g.Uses, g.Payment[:])
		if err == nil && tag.RowsAffected() == 0 {
			err = errGrantRaced
		}
		return err
	}
	for attempt := 0; ; attempt++ {
		if err = s.inTx(wctx, grant); !errors.Is(err, errGrantRaced) || attempt == 2 {
			break
		}
	}
	return s.fail(ctx, "grant access", err)
}

// SignIn implements Access: the nonce's row is inserted first, so that two sign-ins of one nonce at once queue
// on it and the second finds it; a refusal rolls the insert back.
func (s *PostgresStore) SignIn(ctx context.Context, key, nonce string, nonceUntil, now time.Time) (Grant, error) {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return Grant{}, err
	}
	defer cancel()
	var g Grant
	err = s.inTx(wctx, func(tx pgx.Tx) error {
		tag, err := tx.Exec(wctx, `INSERT INTO x402_signin_nonces (nonce, until_ns) VALUES ($1, $2) ON CONFLICT (nonce) DO NOTHING`,
			nonce, nanos(nonceUntil))
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return ErrNonceUsed
		}
		held, had, err := scanGrant(key, tx.QueryRow(wctx, pgGrantRow+` FOR UPDATE`, key))
		if err != nil {
			return err
		}
		if g, err = signIn(held, had, now); err != nil {
			return err
		}
		_, err = tx.Exec(wctx, `UPDATE x402_access_grants SET uses = $2 WHERE key = $1`, key, g.Uses)
		return err
	})
	if err != nil {
		return Grant{}, s.fail(ctx, "sign in", err)
	}
	return g, nil
}

// AccessGrant implements Access.
func (s *PostgresStore) AccessGrant(ctx context.Context, key string) (Grant, bool, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return Grant{}, false, err
	}
	defer cancel()
	var (
		g  Grant
		ok bool
	)
	err = s.read(rctx, func() (err error) {
		g, ok, err = scanGrant(key, s.pool.QueryRow(rctx, pgGrantRow, key))
		return err
	})
	if err != nil {
		return Grant{}, false, s.fail(ctx, "access grant", err)
	}
	return g, ok, nil
}

// pruneAccess deletes the grants ended and the nonces past their time at now.
func (s *PostgresStore) pruneAccess(ctx context.Context, now time.Time) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	err = retrySafe(func() error {
		_, err := s.pool.Exec(wctx, `DELETE FROM x402_access_grants WHERE until_ns <= $1`, nanos(now))
		if err == nil {
			_, err = s.pool.Exec(wctx, `DELETE FROM x402_signin_nonces WHERE until_ns <= $1`, nanos(now))
		}
		return err
	})
	return s.fail(ctx, "prune access", err)
}
