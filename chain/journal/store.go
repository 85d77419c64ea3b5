package journal

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// Store is the journal's storage. Every method is safe for concurrent use, and every write is atomic: it
// happens entirely or not at all, and a write that returned nil survives a crash of the process (for a
// durable store, of the machine too).
//
// A write whose context is already done when it is called does nothing and returns the context's error; once
// a write is under way it completes or fails as a whole regardless of its context, because abandoning a
// write in flight would leave the caller unsure whether it claimed the payment.
type Store interface {
	// Claim inserts r in state claimed if no record with r.ID exists, and returns it with claimed true.
	// Otherwise it returns the existing record with claimed false and changes nothing: the later caller of
	// a payment learns what the first one did (its transaction hash, its final answer). r may instead be in
	// state final, with its Response: a record whose outcome is decided as it is written (a gate's record of a
	// payment it settles there and then), written in one go rather than claimed and then made final.
	Claim(ctx context.Context, r Record) (rec Record, claimed bool, err error)
	// Get returns the record of id, and whether there is one.
	Get(ctx context.Context, id ID) (Record, bool, error)
	// Update reads the record of id, lets fn change it, and writes it back in one transaction; nothing is
	// written if fn returns an error, which Update then returns wrapped. It returns ErrNotFound when there is
	// no record and ErrInvalidUpdate when fn changed the id or moved the state backwards. fn may run on
	// another goroutine while other writes wait for it: it must only edit the record (no I/O, no calls into
	// the store), and it may run more than once.
	Update(ctx context.Context, id ID, fn func(*Record) error) (Record, error)
	// MarkServed records that the one response the payment buys was delivered at the given time (Served and
	// ServedAt), leaving the rest of the record as it is (UpdatedAt too). It is the cheap write a gate makes
	// after every response: it neither reads nor rewrites the record. It returns ErrNotFound when there is no
	// record and ErrServed when the payment was marked served already, by MarkServed or by an Update.
	MarkServed(ctx context.Context, id ID, at time.Time) error
	// Release deletes a claim that never broadcast, so the payer may try again (after topping up a balance,
	// say). claim is the claim as Claim returned it or Get read it: the record of claim.ID goes only while it
	// is still that claim (state claimed, same Owner and ClaimedAt). A broadcast or final record, or a claim
	// made since (the payment was taken over, released and claimed again, by this process or another), is
	// refused with ErrNotReleasable; releasing an absent record is a no-op.
	Release(ctx context.Context, claim Record) error
	// ReleaseUnsent deletes a broadcast record whose transaction txHash every node it was sent to refused
	// outright: its claimant knows that nothing of it is on its way, and the payer was told so. claim is the
	// claim that recorded the transaction (as for Release): a record with another hash (a later attempt), a
	// final one, a claimed one (a claim made since), or one taken over by another process since (which may
	// have sent the recorded transaction again) is refused with ErrNotReleasable; an absent one is a no-op.
	ReleaseUnsent(ctx context.Context, claim Record, txHash string) error
	// Pending lists every record that is not final (claimed, broadcast, async payments not yet settled),
	// oldest claim first: what start-up must reconcile before accepting new work.
	Pending(ctx context.Context) ([]Record, error)
	// PendingOf is Pending of only the async records (async true) or only the others, oldest claim first. It
	// reads no record of the other kind, so an engine's periodic pass over its settlements costs the same
	// however many async payments a gate has waiting in the same journal.
	PendingOf(ctx context.Context, async bool) ([]Record, error)
	// Prune deletes final records that became final before the given time, and whose Deadline (when set) is
	// before it too, and returns how many it deleted. Keep final records at least as long as a payment could be
	// presented again (its authorization's deadline), since a pruned payment would look new to Claim.
	Prune(ctx context.Context, finalBefore time.Time) (int, error)
	// Count returns the number of records of every state; it may walk the whole store, so it is for
	// operators and tests rather than a hot path.
	Count(ctx context.Context) (int, error)
	// Backlog returns the number of records that are not final.
	Backlog(ctx context.Context) (int, error)
	// Close releases the store; later calls return ErrClosed.
	Close() error
}

// Errors a caller can decide on; returned errors wrap them with the id and detail.
var (
	// ErrNotFound: Update of an id the journal does not hold.
	ErrNotFound = errors.New("journal: no record")
	// ErrNotReleasable: Release of a record that is broadcast or final; its transaction may be on chain.
	ErrNotReleasable = errors.New("journal: record is past claimed and cannot be released")
	// ErrInvalidUpdate: an update that changes the id, moves the state backwards, unmarks a served payment,
	// binds a payment to another resource or breaks a state's needs.
	ErrInvalidUpdate = errors.New("journal: invalid update")
	// ErrServed: MarkServed of a payment that was served already.
	ErrServed = errors.New("journal: payment was served already")
	// ErrCorrupt: a stored record that cannot be read; the message names its id.
	ErrCorrupt = errors.New("journal: corrupt record")
	// ErrLocked: the journal file is held by another process (or another open in this one).
	ErrLocked = errors.New("journal: file is locked by another process")
	// ErrClosed: a call after Close.
	ErrClosed = errors.New("journal: store is closed")
	// ErrDamaged: OpenBolt found a journal file that is not a whole journal (empty, truncated, unreadable) and
	// did not open it, because opening it anyway would forget its claims; the message names the file.
	ErrDamaged = errors.New("journal: file is damaged")
)

// defaultOpenTimeout is how long OpenBolt waits for the file lock when Options.OpenTimeout is unset.
const defaultOpenTimeout = time.Second

// Options configure a store.
type Options struct {
	// Clock gives the time stamped on records (ClaimedAt, UpdatedAt, FinalAt); nil means time.Now.
	Clock func() time.Time
	// OpenTimeout bounds the wait for the file lock of OpenBolt, which then fails with ErrLocked rather than
	// hang behind another process; zero or less means one second (defaultOpenTimeout). For OpenPostgres it
	// bounds each attempt to connect to the database, unless the DSN sets connect_timeout; zero or less means
	// five seconds there (defaultConnectTimeout).
	OpenTimeout time.Duration
	// InstanceTTL is, for OpenPostgres, how long this process counts as alive after its last heartbeat (it
	// beats every third of it); zero or less means ten seconds (defaultInstanceTTL). Another process takes over
	// its busy marks and leases once it has been silent that long.
	InstanceTTL time.Duration
	// Tracer, for OpenPostgres, sees every statement the store sends to the database (and every batch, when it
	// is a pgx.BatchTracer too): what a test counts a payment's round trips with. nil traces nothing.
	Tracer pgx.QueryTracer
	// MinedHoldsKept is, for OpenPostgres, how long past the longest a funds read answers for (ReadsAnswerFor) a
	// hold marked mined is kept, for the reads older than its block: the slack for a read's own round trips to
	// the chain and the hold's to the database. Zero means one minute (defaultMinedHoldsKept); less than ten
	// seconds means ten seconds (minMinedHoldsKept).
	MinedHoldsKept time.Duration
	// MaxBehind is, for OpenPostgres, how long a deferred write (Defer) may wait for a statement to ride with
	// before it is sent alone; zero or less means one second (defaultMaxBehind).
	MaxBehind time.Duration
}

// now reads the configured clock; times are kept in UTC so a record reads the same whatever the zone.
func (o Options) now() time.Time {
	if o.Clock == nil {
		return time.Now().UTC()
	}
	return o.Clock().UTC()
}

// txn is one atomic unit of work on a store's records, so that the rules of Claim, Update and Release are
// written once for every store. get and put report damage and write failures as errors; put and del keep the
// store's indexes (pending, final times) in step with the records.
type txn interface {
	get(id ID) (Record, bool, error)
	put(prev, next *Record) error
	del(prev *Record) error
}

// servedStamp is how a served mark is stored: ServedAt in unix nanoseconds, big endian.
func servedStamp(at time.Time) []byte {
	return binary.BigEndian.AppendUint64(nil, uint64(at.UnixNano()))
}

// servedAt reads a servedStamp.
func servedAt(id ID, b []byte) (time.Time, error) {
	if len(b) != 8 {
		return time.Time{}, fmt.Errorf("%w: served mark of %s has %d bytes, want 8", ErrCorrupt, id, len(b))
	}
	return time.Unix(0, int64(binary.BigEndian.Uint64(b))).UTC(), nil
}

// claimIn is Claim inside a transaction. Every refusal happens before the first write, so a store batching
// several operations in one transaction can carry on after one of them is refused.
func claimIn(t txn, r Record, now time.Time) (Record, bool, error) {
	r, err := claimed(r, now)
	if err != nil {
		return Record{}, false, err
	}
	existing, ok, err := t.get(r.ID)
	if err != nil || ok {
		return existing, false, err
	}
	if err := t.put(nil, &r); err != nil {
		return Record{}, false, err
	}
	return r, true, nil
}

// claimedEncoded makes *rec, when rec is not nil, the record a Claim of it at now writes (claimed), and returns its
// encoding; nil, nil for no record.
func claimedEncoded(rec *Record, now time.Time) ([]byte, error) {
	if rec == nil {
		return nil, nil
	}
	r, err := claimed(*rec, now)
	if err != nil {
		return nil, err
	}
	enc, err := encodeRecord(&r)
	if err != nil {
		return nil, err
	}
	*rec = r
	return enc, nil
}

// claimed is the record a Claim of r at now writes when there is none yet, or why r cannot be claimed: it reads
// no store, so that a store may prepare the write (encode it) before it takes its lock.
func claimed(r Record, now time.Time) (Record, error) {
	if r.State == "" {
		r.State = StateClaimed
	}
	if r.State != StateClaimed && r.State != StateFinal {
		return Record{}, fmt.Errorf("%w: claim of %s must be in state %q or %q, got %q",
			ErrInvalidUpdate, r.ID, StateClaimed, StateFinal, r.State)
	}
	if err := r.validate(); err != nil {
		return Record{}, fmt.Errorf("%w: %w", ErrInvalidUpdate, err)
	}
	if r.ClaimedAt.IsZero() {
		r.ClaimedAt = now
	}
	r.UpdatedAt, r.FinalAt = now, time.Time{}
	if r.State == StateFinal {
		r.FinalAt = now
	}
	return r, nil
}

// updateIn is Update inside a transaction; like claimIn it refuses before it writes.
func updateIn(t txn, id ID, fn func(*Record) error, now time.Time) (Record, error) {
	prev, ok, err := t.get(id)
	if err != nil {
		return Record{}, err
	}
	if !ok {
		return Record{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	// fn may reach prev's slices through next, but the checks below read only prev's id, state and times,
	// which are copied.
	next := prev
	if err := fn(&next); err != nil {
		return Record{}, fmt.Errorf("journal: update of %s: %w", id, err)
	}
	if err := checkTransition(&prev, &next); err != nil {
		return Record{}, err
	}
	// The store owns the time stamps: a caller cannot backdate a claim or unset the moment it became final.
	next.ClaimedAt, next.UpdatedAt, next.FinalAt = prev.ClaimedAt, now, prev.FinalAt
	if next.State == StateFinal && prev.State != StateFinal {
		next.FinalAt = now
	}
	if err := t.put(&prev, &next); err != nil {
		return Record{}, err
	}
	return next, nil
}

// releaseIn is Release inside a transaction.
func releaseIn(t txn, claim Record) error {
	prev, ok, err := t.get(claim.ID)
	if err != nil || !ok {
		return err
	}
	if prev.State != StateClaimed {
		return fmt.Errorf("%w: %s is %q (transaction %s)", ErrNotReleasable, claim.ID, prev.State, prev.TxHash)
	}
	if err := sameClaim(&prev, &claim); err != nil {
		return err
	}
	return t.del(&prev)
}

// releaseUnsentIn is ReleaseUnsent inside a transaction.
func releaseUnsentIn(t txn, claim Record, txHash string) error {
	_, err := releaseUnsentFound(t, claim, txHash)
	return err
}

// releaseUnsentFound is releaseUnsentIn, saying whether there was a record to forget: none (another's pass forgot
// it first) is no error, and then nothing of the payment is this claim's to let go of any more.
func releaseUnsentFound(t txn, claim Record, txHash string) (bool, error) {
	prev, ok, err := t.get(claim.ID)
	if err != nil || !ok {
		return false, err
	}
	if prev.State != StateBroadcast || prev.TxHash != txHash {
		return false, fmt.Errorf("%w: %s is %q with transaction %s, not the refused %s", ErrNotReleasable, claim.ID, prev.State, prev.TxHash, txHash)
	}
	if err := sameClaim(&prev, &claim); err != nil {
		return false, err
	}
	return true, t.del(&prev)
}

// sameClaim refuses, with ErrNotReleasable, a record that is not the claim given: claimed by another process, or
// claimed again since.
func sameClaim(prev, claim *Record) error {
	if !prev.SameClaim(claim) {
		return fmt.Errorf("%w: %s was claimed again since (by %q at %s), not the claim of %q at %s", ErrNotReleasable, claim.ID,
			prev.Owner, prev.ClaimedAt.Format(time.RFC3339Nano), claim.Owner, claim.ClaimedAt.Format(time.RFC3339Nano))
	}
	return nil
}

// sortPending orders records oldest claim first, then by id, so reconciliation is deterministic.
func sortPending(recs []Record) {
	slices.SortFunc(recs, func(a, b Record) int {
		if c := a.ClaimedAt.Compare(b.ClaimedAt); c != 0 {
			return c
		}
		return bytes.Compare(a.ID[:], b.ID[:])
	})
}
