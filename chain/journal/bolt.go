package journal

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// Bucket names and the layout version of a bolt journal file.
var (
	bucketMeta    = []byte("meta")
	bucketRecords = []byte("records") // id -> encoded Record
	bucketPending = []byte("pending") // id -> pendingTag, for every record not final
	bucketFinals  = []byte("finals")  // keptUntil (unix ns, big endian) ++ id -> empty, for Prune
	bucketServed  = []byte("served")  // id -> ServedAt (unix ns, big endian), for every served record
	// bucketChannels holds the batch-settlement channel rows: ChannelKey.bytes -> encoded Channel. A file of an
	// earlier release gains it at open; an earlier release opening a file that has it leaves it alone.
	bucketChannels = []byte("channels")
	keyLayout      = []byte("layout")
	// Layout 2 added the served bucket: a served mark is written there alone, and the bucket (not the record)
	// is what says a payment was served, so a release that reads layout 1 must not open the file and serve a
	// served payment again.
	layoutV1 = []byte("1")
	layoutV2 = []byte("2")
)

// maxBatch bounds how many writes share one commit, so a burst cannot build one huge transaction.
const maxBatch = 512

// pruneChunk bounds how many records one Prune transaction deletes, so pruning never holds the writer long.
const pruneChunk = 1024

// BoltStore is the default Store: one bbolt file, every commit fsynced. Writes go through a group commit:
// a single goroutine commits everything that queued up while the previous commit was syncing, so concurrent
// writers share fsyncs while a lone writer never waits for a batch to fill (bbolt's own Batch waits up to
// MaxBatchDelay for company, which caps a serial caller at about a hundred writes a second).
type BoltStore struct {
	db   *bolt.DB
	path string
	opts Options

	writes    chan *boltOp
	stop      chan struct{}
	stopped   chan struct{}
	closeOnce sync.Once
	closed    atomic.Bool
	commits   atomic.Int64 // transactions committed (each one fsync), for the tests
}

// boltOp is one write waiting for its commit. run computes the write's own answer inside the transaction and
// may run more than once if the transaction is retried, so it must only assign its results.
type boltOp struct {
	run      func(*boltTxn)
	done     chan error
	panicked any
}

// OpenBolt opens the journal file at path, creating it (mode 0600) and its directory (0700) as needed. If
// another process holds the file it fails with ErrLocked after opts.OpenTimeout instead of waiting forever.
// A file that exists but is not a whole journal (empty, cut short, or unreadable) is refused with ErrDamaged
// and left as it is: opening it as a new journal would forget the payments it claimed, and the operator, not
// the process, decides whether to restore it from a backup or move it aside.
func OpenBolt(path string, opts Options) (*BoltStore, error) {
	if path == "" {
		return nil, fmt.Errorf("journal: open: empty path; want the journal file's path")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("journal: create directory for %s: %w", path, err)
	}
	// bbolt initialises any empty file as a new journal; only one it creates itself may be treated so.
	existing, err := os.Stat(path)
	switch {
	case err == nil && existing.Mode().IsRegular() && existing.Size() == 0:
		return nil, damaged(path, "the file is empty (0 bytes), but a journal is never empty once created, so its records are lost")
	case err != nil && !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("journal: open %s: %w", path, err)
	}
	timeout := opts.OpenTimeout
	if timeout <= 0 {
		timeout = defaultOpenTimeout
	}
	db, err := openBoltFile(path, timeout)
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("journal: open %s: %w (waited %s; is another instance running with the same journal?)",
			path, ErrLocked, timeout)
	}
	if err != nil {
		return nil, err
	}
	if err := checkedUpdate(db, path, initLayout); err != nil {
		db.Close()
		if errors.Is(err, ErrDamaged) {
			return nil, err
		}
		return nil, fmt.Errorf("journal: open %s: %w", path, err)
	}
	s := &BoltStore{
		db:      db,
		path:    path,
		opts:    opts,
		writes:  make(chan *boltOp),
		stop:    make(chan struct{}),
		stopped: make(chan struct{}),
	}
	go s.commitLoop()
	return s, nil
}

// damaged is the error of a journal file OpenBolt refuses.
func damaged(path, why string) error {
	return fmt.Errorf("%w: %s: %s; it was not opened. Restore it from a backup, or move it aside to start an "+
		"empty journal (the payments it recorded would then be forgotten)", ErrDamaged, path, why)
}

// openBoltFile opens the bbolt file at path and checks that it holds every page its header counts. bbolt
// reads a damaged file through a memory map and panics (or, past the end of a cut-short file, faults) rather
// than return an error; both are turned into an ErrDamaged naming the file, and the file is closed again.
func openBoltFile(path string, timeout time.Duration) (db *bolt.DB, err error) {
	var file *os.File
	defer func() {
		if p := recover(); p != nil {
			if file != nil {
				// bbolt gives no handle to close after a panic: the lock is released and the file closed here,
				// and its memory map (of a file nothing reads again) stays until the process ends.
				releaseLock(file)
				file.Close()
			}
			db, err = nil, damaged(path, fmt.Sprintf("bbolt cannot read it (%v)", p))
		}
	}()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	db, err = bolt.Open(path, 0o600, &bolt.Options{
		Timeout: timeout,
		// The hashmap freelist stays fast as a long-lived journal fragments; the array one degrades.
		FreelistType: bolt.FreelistMapType,
		OpenFile: func(name string, flag int, mode os.FileMode) (*os.File, error) {
			f, err := os.OpenFile(name, flag, mode)
			file = f
			return f, err
		},
	})
	switch {
	case errors.Is(err, bolterrors.ErrTimeout):
		return nil, err
	case errors.Is(err, bolterrors.ErrInvalid), errors.Is(err, bolterrors.ErrVersionMismatch), errors.Is(err, bolterrors.ErrChecksum):
		return nil, damaged(path, fmt.Sprintf("it is not a readable journal (%v)", err))
	case err != nil:
		// A file shorter than its two meta pages gets "file size too small", which has no sentinel. What the
		// system refused (permissions, no space, no memory for the map) is not the file's fault.
		var pathErr *fs.PathError
		var errno syscall.Errno
		if errors.As(err, &pathErr) || errors.As(err, &errno) {
			return nil, fmt.Errorf("journal: open %s: %w", path, err)
		}
		return nil, damaged(path, fmt.Sprintf("bbolt cannot open it (%v)", err))
	}
	// A file cut short past its last meta page opens, and faults at the first read of a missing page: any
	// moment later, in the middle of a settlement. Its header says how long it must be.
	var want int64
	if err := db.View(func(tx *bolt.Tx) error { want = tx.Size(); return nil }); err != nil {
		db.Close()
		return nil, fmt.Errorf("journal: open %s: %w", path, err)
	}
	info, err := file.Stat()
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("journal: open %s: %w", path, err)
	}
	if info.Size() < want {
		db.Close()
		return nil, damaged(path, fmt.Sprintf("the file is %d bytes, but its header counts %d: it was cut short", info.Size(), want))
	}
	return db, nil
}

// checkedUpdate runs fn in a write transaction of db, the file at path, turning a panic or fault of bbolt
// reading a damaged page into an ErrDamaged naming the file.
func checkedUpdate(db *bolt.DB, path string, fn func(*bolt.Tx) error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = damaged(path, fmt.Sprintf("bbolt cannot read it (%v)", p))
		}
	}()
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	return db.Update(fn)
}

// initLayout creates the buckets of a new file and refuses a file laid out by another release.
func initLayout(tx *bolt.Tx) error {
	meta, err := tx.CreateBucketIfNotExists(bucketMeta)
	if err != nil {
		return err
	}
	got := meta.Get(keyLayout)
	switch {
	case got == nil, string(got) == string(layoutV1), string(got) == string(layoutV2):
	default:
		return fmt.Errorf("file has journal layout %q, this build reads layouts %q and %q", got, layoutV1, layoutV2)
	}
	for _, name := range [][]byte{bucketRecords, bucketPending, bucketFinals, bucketServed, bucketChannels, bucketPaymentIdentifiers, bucketAccessGrants, bucketSignInNonces, bucketDiscovery} {
		if _, err := tx.CreateBucketIfNotExists(name); err != nil {
			return err
		}
	}
	if string(got) == string(layoutV2) {
		return nil
	}
	if string(got) == string(layoutV1) {
		if err := upgradeServed(tx); err != nil {
			return fmt.Errorf("upgrade journal layout 1 to 2: %w", err)
		}
	}
	return meta.Put(keyLayout, layoutV2)
}

// upgradeServed gives every record a layout 1 file marks served its entry in the served bucket, and every
// pending async record its tag in the pending index.
func upgradeServed(tx *bolt.Tx) error {
	served, pending := tx.Bucket(bucketServed), tx.Bucket(bucketPending)
	type fix struct {
		bucket     *bolt.Bucket
		key, value []byte
	}
	var fixes []fix // a bucket is not written while it is walked
	err := tx.Bucket(bucketRecords).ForEach(func(k, v []byte) error {
		if len(k) != len(ID{}) {
			return fmt.Errorf("%w: records bucket holds a key of %d bytes, want %d", ErrCorrupt, len(k), len(ID{}))
		}
		r, err := decodeRecord(ID(k), v)
		if err != nil {
			return err
		}
		key := append([]byte(nil), k...)
		if r.Served {
			fixes = append(fixes, fix{served, key, servedStamp(r.ServedAt)})
		}
		if r.Async && r.State != StateFinal {
			fixes = append(fixes, fix{pending, key, pendingTag(&r)})
		}
		return nil
	})
	for _, f := range fixes {
		if err == nil {
			err = f.bucket.Put(f.key, f.value)
		}
	}
	return err
}

// pendingTag is a pending record's value in the pending index: what PendingOf selects on without reading it.
func pendingTag(r *Record) []byte {
	if r.Async {
		return []byte{1}
	}
	return []byte{}
}

// isAsyncTag reads a pendingTag; layout 1 wrote every entry empty, and upgradeServed tagged its async ones.
func isAsyncTag(v []byte) bool { return len(v) == 1 && v[0] == 1 }

// Path returns the file the store was opened on.
func (s *BoltStore) Path() string { return s.path }

// boltTxn is a txn over one bolt write (or read) transaction. A failed write marks it tainted: the
// transaction may hold half of an operation and must be rolled back.
type boltTxn struct {
	tx      *bolt.Tx
	tainted bool
}

func (t *boltTxn) get(id ID) (Record, bool, error) {
	b := t.tx.Bucket(bucketRecords).Get(id[:])
	if b == nil {
		return Record{}, false, nil
	}
	r, err := decodeRecord(id, b)
	if err != nil {
		return Record{}, false, err
	}
	if mark := t.tx.Bucket(bucketServed).Get(id[:]); mark != nil {
		if r.ServedAt, err = servedAt(id, mark); err != nil {
			return Record{}, false, err
		}
		r.Served = true
	}
	return r, true, nil
}

// markServed is MarkServed inside a transaction: it reads neither the record nor its mark's time, only
// whether each is there.
func (t *boltTxn) markServed(id ID, at time.Time) error {
	if t.tx.Bucket(bucketRecords).Get(id[:]) == nil {
		return fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	served := t.tx.Bucket(bucketServed)
	if served.Get(id[:]) != nil {
		return fmt.Errorf("%w: %s", ErrServed, id)
	}
	if err := served.Put(id[:], servedStamp(at)); err != nil {
		t.tainted = true
		return fmt.Errorf("journal: mark %s served: %w", id, err)
	}
	return nil
}

func (t *boltTxn) put(prev, next *Record) error {
	enc, err := encodeRecord(next)
	if err != nil {
		return err // nothing written yet
	}
	if err := t.write(next.ID, enc, prev, next); err != nil {
		t.tainted = true
		return fmt.Errorf("journal: write %s: %w", next.ID, err)
	}
	return nil
}

// write stores enc and moves the record between the pending and finals indexes as its state demands, and
// within the finals index when an update of a final record changes how long it is kept.
func (t *boltTxn) write(id ID, enc []byte, prev, next *Record) error {
	if err := t.tx.Bucket(bucketRecords).Put(id[:], enc); err != nil {
		return err
	}
	if next.Served && (prev == nil || !prev.Served) {
		if err := t.tx.Bucket(bucketServed).Put(id[:], servedStamp(next.ServedAt)); err != nil {
			return err
		}
	}
	wasFinal := prev != nil && prev.State == StateFinal
	switch {
	case next.State != StateFinal && (prev == nil || prev.Async != next.Async):
		return t.tx.Bucket(bucketPending).Put(id[:], pendingTag(next))
	case next.State == StateFinal && !wasFinal:
		if prev != nil {
			if err := t.tx.Bucket(bucketPending).Delete(id[:]); err != nil {
				return err
			}
		}
		return t.tx.Bucket(bucketFinals).Put(finalKey(next.keptUntil(), id), []byte{})
	case wasFinal:
		was, is := finalKey(prev.keptUntil(), id), finalKey(next.keptUntil(), id)
		if bytes.Equal(was, is) {
			return nil
		}
		if err := t.tx.Bucket(bucketFinals).Delete(was); err != nil {
			return err
		}
		return t.tx.Bucket(bucketFinals).Put(is, []byte{})
	}
	return nil
}

func (t *boltTxn) del(prev *Record) error {
	err := t.tx.Bucket(bucketRecords).Delete(prev.ID[:])
	if err == nil {
		err = t.tx.Bucket(bucketPending).Delete(prev.ID[:])
	}
	if err == nil {
		err = t.tx.Bucket(bucketServed).Delete(prev.ID[:])
	}
	if err == nil && prev.State == StateFinal {
		err = t.tx.Bucket(bucketFinals).Delete(finalKey(prev.keptUntil(), prev.ID))
	}
	if err != nil {
		t.tainted = true
		return fmt.Errorf("journal: delete %s: %w", prev.ID, err)
	}
	return nil
}

// finalKey orders the finals index by the time a final record may go, so Prune reads only what it deletes.
// A record without a Deadline goes at its FinalAt, the key files written before Deadline existed hold: the
// layout is the same.
// Times past what nanoseconds since 1970 hold in an int64 (the year 2262) sort last.
func finalKey(at time.Time, id ID) []byte {
	k := make([]byte, 8+len(id))
	ns := at.UnixNano()
	switch {
	case at.After(latestKeyTime):
		ns = math.MaxInt64
	case ns < 0:
		ns = 0
	}
	binary.BigEndian.PutUint64(k, uint64(ns))
	copy(k[8:], id[:])
	return k
}

// latestKeyTime is the latest time finalKey spells exactly.
var latestKeyTime = time.Unix(0, math.MaxInt64)

// commitLoop is the group commit: it takes one write, then every write already waiting, and commits them in
// one transaction (one fsync).
func (s *BoltStore) commitLoop() {
	defer close(s.stopped)
	batch := make([]*boltOp, 0, maxBatch)
	for {
		select {
		case op := <-s.writes:
			batch = append(batch[:0], op)
		case <-s.stop:
			return
		}
	fill:
		for len(batch) < maxBatch {
			select {
			case op := <-s.writes:
				batch = append(batch, op)
			default:
				break fill
			}
		}
		s.commit(batch)
		clear(batch)
	}
}

// commit runs a batch in one transaction. An operation that leaves the transaction tainted (a failed write,
// a panic) gets its own error, and the rest of the batch is retried without it; refusals such as a missing
// record write nothing and need no retry.
func (s *BoltStore) commit(batch []*boltOp) {
	for len(batch) > 0 {
		failed := -1
		err := s.db.Update(func(tx *bolt.Tx) error {
			t := &boltTxn{tx: tx}
			for i, op := range batch {
				op.runSafely(t)
				if t.tainted {
					failed = i
					return errTainted
				}
			}
			return nil
		})
		if failed >= 0 {
			batch[failed].done <- nil // its own answer (error or panic) is already in its results
			batch = append(batch[:failed:failed], batch[failed+1:]...)
			continue
		}
		if err != nil {
			err = fmt.Errorf("journal: commit to %s: %w", s.path, err)
		} else {
			s.commits.Add(1)
		}
		for _, op := range batch {
			op.done <- err
		}
		return
	}
}

// errTainted rolls back a transaction an operation left half-written.
var errTainted = errors.New("journal: transaction rolled back after a failed write")

// runSafely runs op, turning a panic (from a caller's Update function) into a rollback and a re-panic on the
// caller's goroutine, so it cannot take down the commit loop.
func (op *boltOp) runSafely(t *boltTxn) {
	defer func() {
		if v := recover(); v != nil {
			op.panicked = v
			t.tainted = true
		}
	}()
	op.run(t)
}

// write queues run for the next commit and waits for that commit.
func (s *BoltStore) write(ctx context.Context, run func(*boltTxn)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.closed.Load() {
		return ErrClosed
	}
	op := &boltOp{run: run, done: make(chan error, 1)}
	select {
	case s.writes <- op:
	case <-s.stop:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err() // not queued, so nothing happened
	}
	err := <-op.done
	if op.panicked != nil {
		panic(op.panicked)
	}
	return err
}

// read runs fn in a read transaction, concurrently with other reads and with the commit loop.
func (s *BoltStore) read(ctx context.Context, fn func(*boltTxn) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.closed.Load() {
		return ErrClosed
	}
	return s.db.View(func(tx *bolt.Tx) error { return fn(&boltTxn{tx: tx}) })
}

// Claim implements Store.
func (s *BoltStore) Claim(ctx context.Context, r Record) (Record, bool, error) {
	var (
		rec     Record
		claimed bool
		opErr   error
	)
	now := s.opts.now()
	err := s.write(ctx, func(t *boltTxn) { rec, claimed, opErr = claimIn(t, r, now) })
	if err == nil {
		err = opErr
	}
	if err != nil {
		return Record{}, false, err
	}
	return rec, claimed, nil
}

// Get implements Store.
func (s *BoltStore) Get(ctx context.Context, id ID) (Record, bool, error) {
	var (
		rec Record
		ok  bool
	)
	err := s.read(ctx, func(t *boltTxn) (err error) {
		rec, ok, err = t.get(id)
		return err
	})
	return rec, ok, err
}

// Update implements Store.
func (s *BoltStore) Update(ctx context.Context, id ID, fn func(*Record) error) (Record, error) {
	var (
		rec   Record
		opErr error
	)
	now := s.opts.now()
	err := s.write(ctx, func(t *boltTxn) { rec, opErr = updateIn(t, id, fn, now) })
	if err == nil {
		err = opErr
	}
	if err != nil {
		return Record{}, err
	}
	return rec, nil
}

// MarkServed implements Store.
func (s *BoltStore) MarkServed(ctx context.Context, id ID, at time.Time) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) { opErr = t.markServed(id, at.UTC()) })
	if err == nil {
		err = opErr
	}
	return err
}

// Release implements Store.
func (s *BoltStore) Release(ctx context.Context, claim Record) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) { opErr = releaseIn(t, claim) })
	if err == nil {
		err = opErr
	}
	return err
}

// ReleaseUnsent implements Store.
func (s *BoltStore) ReleaseUnsent(ctx context.Context, claim Record, txHash string) error {
	var opErr error
	err := s.write(ctx, func(t *boltTxn) { opErr = releaseUnsentIn(t, claim, txHash) })
	if err == nil {
		err = opErr
	}
	return err
}

// Pending implements Store.
func (s *BoltStore) Pending(ctx context.Context) ([]Record, error) {
	return s.pending(ctx, func([]byte) bool { return true })
}

// PendingOf implements Store.
func (s *BoltStore) PendingOf(ctx context.Context, async bool) ([]Record, error) {
	return s.pending(ctx, func(tag []byte) bool { return isAsyncTag(tag) == async })
}

// pending lists the pending records whose tag in the pending index want accepts.
func (s *BoltStore) pending(ctx context.Context, want func(tag []byte) bool) ([]Record, error) {
	var out []Record
	err := s.read(ctx, func(t *boltTxn) error {
		return t.tx.Bucket(bucketPending).ForEach(func(k, tag []byte) error {
			if !want(tag) {
				return nil
			}
			if len(k) != len(ID{}) {
				return fmt.Errorf("%w: pending index holds a key of %d bytes, want %d", ErrCorrupt, len(k), len(ID{}))
			}
			id := ID(k)
			r, ok, err := t.get(id)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("%w: %s is listed as pending but has no record", ErrCorrupt, id)
			}
			out = append(out, r)
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	sortPending(out)
	return out, nil
}

// Prune implements Store. It deletes in chunks, each its own transaction, so other writes interleave.
func (s *BoltStore) Prune(ctx context.Context, finalBefore time.Time) (int, error) {
	limit := finalKey(finalBefore, ID{})
	total := 0
	for {
		var n int
		var opErr error
		err := s.write(ctx, func(t *boltTxn) { n, opErr = pruneChunkIn(t, limit) })
		if err == nil {
			err = opErr
		}
		total += n
		if err != nil {
			return total, fmt.Errorf("journal: prune: %w", err)
		}
		if n < pruneChunk {
			if err := s.prunePaymentIdentifiers(ctx, finalBefore); err != nil {
				return total, fmt.Errorf("journal: prune: %w", err)
			}
			if err := s.pruneAccess(ctx, s.opts.now()); err != nil {
				return total, fmt.Errorf("journal: prune: %w", err)
			}
			return total, nil
		}
	}
}

// pruneChunkIn deletes up to pruneChunk final records whose finals key sorts before limit: final, and past
// their deadline, before the cutoff.
func pruneChunkIn(t *boltTxn, limit []byte) (int, error) {
	finals, records, served := t.tx.Bucket(bucketFinals), t.tx.Bucket(bucketRecords), t.tx.Bucket(bucketServed)
	var keys [][]byte
	c := finals.Cursor()
	for k, _ := c.First(); k != nil && len(keys) < pruneChunk && string(k) < string(limit); k, _ = c.Next() {
		if len(k) != len(limit) {
			return 0, fmt.Errorf("%w: finals index holds a key of %d bytes, want %d", ErrCorrupt, len(k), len(limit))
		}
		keys = append(keys, append([]byte(nil), k...))
	}
	for _, k := range keys {
		if err := records.Delete(k[8:]); err != nil {
			t.tainted = true
			return 0, err
		}
		if err := served.Delete(k[8:]); err != nil {
			t.tainted = true
			return 0, err
		}
		if err := finals.Delete(k); err != nil {
			t.tainted = true
			return 0, err
		}
	}
	return len(keys), nil
}

// Count implements Store.
func (s *BoltStore) Count(ctx context.Context) (int, error) {
	var n int
	err := s.read(ctx, func(t *boltTxn) error {
		n = t.tx.Bucket(bucketRecords).Stats().KeyN
		return nil
	})
	return n, err
}

// Backlog implements Store.
func (s *BoltStore) Backlog(ctx context.Context) (int, error) {
	var n int
	err := s.read(ctx, func(t *boltTxn) error {
		n = t.tx.Bucket(bucketPending).Stats().KeyN
		return nil
	})
	return n, err
}

// Close stops the commit loop after its current commit and closes the file; closing twice is harmless.
func (s *BoltStore) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		close(s.stop)
		<-s.stopped
		if cerr := s.db.Close(); cerr != nil {
			err = fmt.Errorf("journal: close %s: %w", s.path, cerr)
		}
	})
	return err
}

var _ Store = (*BoltStore)(nil)
