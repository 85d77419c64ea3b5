package journal

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// PaymentIdentifiers is a store that keeps the ids clients name their payments with (the payment-identifier
// extension), each bound to the one payment it names. A gate binds an id once it verified the payment, and
// refuses another payment naming a bound id (409). Bindings are shared by every process of the store, kept across
// restarts, and pruned with the payment's record: Prune deletes a binding whose payment has no record, once it is
// older than Prune's cutoff. Every store of this package implements it.
type PaymentIdentifiers interface {
	// NamePayment binds key to id and returns id when key is bound to nothing, to id already, or to replacing
	// (a payment that bought nothing and whose id may be named again; zero: none). Otherwise it changes
	// nothing and returns the payment key is bound to.
	NamePayment(ctx context.Context, key string, id, replacing ID) (ID, error)
	// NamedPayment returns the payment key is bound to, and whether it is bound.
	NamedPayment(ctx context.Context, key string) (ID, bool, error)
}

var (
	_ PaymentIdentifiers = (*MemoryStore)(nil)
	_ PaymentIdentifiers = (*BoltStore)(nil)
	_ PaymentIdentifiers = (*PostgresStore)(nil)
)

// bucketPaymentIdentifiers holds the bolt store's bindings: key -> paymentBinding. A file of an earlier release
// gains it at open; an earlier release opening a file that has it leaves it alone.
var bucketPaymentIdentifiers = []byte("paymentIdentifiers")

// paymentBinding is how a binding is stored: the payment's id, then when it was bound (unix ns, big endian).
func paymentBinding(id ID, at time.Time) []byte {
	return binary.BigEndian.AppendUint64(append([]byte(nil), id[:]...), uint64(at.UnixNano()))
}

// readPaymentBinding reads a paymentBinding.
func readPaymentBinding(key string, b []byte) (ID, time.Time, error) {
	var id ID
	if len(b) != len(id)+8 {
		return ID{}, time.Time{}, fmt.Errorf("%w: payment identifier binding of %q has %d bytes, want %d", ErrCorrupt, key, len(b), len(id)+8)
	}
	copy(id[:], b)
	return id, time.Unix(0, int64(binary.BigEndian.Uint64(b[len(id):]))).UTC(), nil
}

// namePayment is NamePayment's decision: what key is bound to after it, given what it is bound to now.
func namePayment(bound ID, ok bool, id, replacing ID) (ID, bool) {
	if !ok || bound == id || (!replacing.IsZero() && bound == replacing) {
		return id, bound != id || !ok
	}
	return bound, false
}

// NamePayment implements PaymentIdentifiers.
func (s *MemoryStore) NamePayment(ctx context.Context, key string, id, replacing ID) (ID, error) {
	if err := s.lock(ctx); err != nil {
		return ID{}, err
	}
	defer s.mu.Unlock()
	if s.identifiers == nil {
		s.identifiers = make(map[string][]byte)
	}
	var bound ID
	b, ok := s.identifiers[key]
	if ok {
		var err error
		if bound, _, err = readPaymentBinding(key, b); err != nil {
			return ID{}, err
		}
	}
	named, write := namePayment(bound, ok, id, replacing)
	if write {
		s.identifiers[key] = paymentBinding(named, s.opts.now())
	}
	return named, nil
}

// NamedPayment implements PaymentIdentifiers.
func (s *MemoryStore) NamedPayment(ctx context.Context, key string) (ID, bool, error) {
	if err := s.lock(ctx); err != nil {
		return ID{}, false, err
	}
	defer s.mu.Unlock()
	b, ok := s.identifiers[key]
	if !ok {
		return ID{}, false, nil
	}
	id, _, err := readPaymentBinding(key, b)
	return id, err == nil, err
}

// prunePaymentIdentifiers deletes the bindings bound before cutoff whose payment has no record; the caller holds
// the store's lock.
func (s *MemoryStore) prunePaymentIdentifiers(cutoff time.Time) error {
	for key, b := range s.identifiers {
		id, at, err := readPaymentBinding(key, b)
		if err != nil {
			return err
		}
		if _, ok := s.records[id]; !ok && at.Before(cutoff) {
			delete(s.identifiers, key)
		}
	}
	return nil
}

// NamePayment implements PaymentIdentifiers.
func (s *BoltStore) NamePayment(ctx context.Context, key string, id, replacing ID) (ID, error) {
	var (
		named ID
		opErr error
	)
	now := s.opts.now()
	err := s.write(ctx, func(t *boltTxn) {
		b := t.tx.Bucket(bucketPaymentIdentifiers)
		var bound ID
		v := b.Get([]byte(key))
		if v != nil {
			if bound, _, opErr = readPaymentBinding(key, v); opErr != nil {
				return
			}
		}
		var write bool
		if named, write = namePayment(bound, v != nil, id, replacing); write {
			if opErr = b.Put([]byte(key), paymentBinding(named, now)); opErr != nil {
				t.tainted = true
			}
		}
	})
	if err == nil {
		err = opErr
	}
	if err != nil {
		return ID{}, fmt.Errorf("journal: naming payment %s: %w", id, err)
	}
	return named, nil
}

// NamedPayment implements PaymentIdentifiers.
func (s *BoltStore) NamedPayment(ctx context.Context, key string) (ID, bool, error) {
	var (
		id ID
		ok bool
	)
	err := s.read(ctx, func(t *boltTxn) (err error) {
		v := t.tx.Bucket(bucketPaymentIdentifiers).Get([]byte(key))
		if v == nil {
			return nil
		}
		id, _, err = readPaymentBinding(key, v)
		ok = err == nil
		return err
	})
	return id, ok, err
}

// prunePaymentIdentifiers deletes the bindings bound before cutoff whose payment has no record, in one write.
func (s *BoltStore) prunePaymentIdentifiers(ctx context.Context, cutoff time.Time) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) {
		b, records := t.tx.Bucket(bucketPaymentIdentifiers), t.tx.Bucket(bucketRecords)
		var gone [][]byte
		opErr = b.ForEach(func(k, v []byte) error {
			id, at, err := readPaymentBinding(string(k), v)
			if err != nil {
				return err
			}
			if at.Before(cutoff) && records.Get(id[:]) == nil {
				gone = append(gone, append([]byte(nil), k...))
			}
			return nil
		})
		for _, k := range gone {
			if opErr = b.Delete(k); opErr != nil {
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

// pgPaymentIdentifiersMigration keeps the bindings of PaymentIdentifiers, a row each.
const pgPaymentIdentifiersMigration = `
-- A payment's id chosen by its client (payment-identifier), bound to the payment it names; pruned once that
-- payment has no record.
CREATE TABLE IF NOT EXISTS x402_payment_identifiers (
	key   text   PRIMARY KEY,
	id    bytea  NOT NULL,
	at_ns bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_payment_identifiers_at ON x402_payment_identifiers (at_ns);
`

// pgNamePayment binds $1 to $2 where it is bound to nothing, to $2 or to $3, and returns what $1 is bound to: the
// outer select sees the table as it was before the statement, so it is read from the insert when it wrote.
const pgNamePayment = `WITH named AS (
	INSERT INTO x402_payment_identifiers (key, id, at_ns) VALUES ($1, $2, $4)
	ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, at_ns = EXCLUDED.at_ns
	WHERE x402_payment_identifiers.id = EXCLUDED.id OR x402_payment_identifiers.id = $3
	RETURNING id
)
SELECT COALESCE((SELECT id FROM named), (SELECT id FROM x402_payment_identifiers WHERE key = $1))`

// NamePayment implements PaymentIdentifiers.
func (s *PostgresStore) NamePayment(ctx context.Context, key string, id, replacing ID) (ID, error) {
	replace := replacing[:]
	if replacing.IsZero() {
		replace = nil // never equal to a stored id
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return ID{}, err
	}
	defer cancel()
	var named []byte
	for attempt := 0; ; attempt++ {
		err = retrySafe(func() error {
			return s.pool.QueryRow(wctx, pgNamePayment, key, id[:], replace, nanos(s.opts.now())).Scan(&named)
		})
		// NULL: another process bound key after this statement's snapshot was taken; it is there to read now.
		if err != nil || named != nil || attempt == 2 {
			break
		}
	}
	if err == nil && len(named) != len(id) {
		err = fmt.Errorf("%w: payment identifier binding of %q holds %d bytes", ErrCorrupt, key, len(named))
	}
	if err != nil {
		return ID{}, s.fail(ctx, "name payment", err)
	}
	return ID(named), nil
}

// NamedPayment implements PaymentIdentifiers.
func (s *PostgresStore) NamedPayment(ctx context.Context, key string) (ID, bool, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return ID{}, false, err
	}
	defer cancel()
	var named []byte
	err = s.read(rctx, func() error {
		return s.pool.QueryRow(rctx, `SELECT id FROM x402_payment_identifiers WHERE key = $1`, key).Scan(&named)
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ID{}, false, nil
	case err == nil && len(named) != len(ID{}):
		err = fmt.Errorf("%w: payment identifier binding of %q holds %d bytes", ErrCorrupt, key, len(named))
	}
	if err != nil {
		return ID{}, false, s.fail(ctx, "named payment", err)
	}
	return ID(named), true, nil
}

// prunePaymentIdentifiers deletes the bindings bound before cutoff whose payment has no record.
func (s *PostgresStore) prunePaymentIdentifiers(ctx context.Context, cutoff time.Time) error {
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	err = retrySafe(func() error {
		_, err := s.pool.Exec(wctx, `DELETE FROM x402_payment_identifiers p WHERE p.at_ns < $1
	AND NOT EXISTS (SELECT 1 FROM x402_records r WHERE r.id = p.id)`, nanos(cutoff))
		return err
	})
	return s.fail(ctx, "prune payment identifiers", err)
}
