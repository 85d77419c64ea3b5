package journal

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// MemoryStore is a Store held in memory, for tests and for a dev chain that forgets everything on exit. It
// keeps records encoded exactly as the bolt store does, so both answer alike, down to what a caller's
// mutation of a returned record can reach (nothing).
type MemoryStore struct {
	opts Options

	mu      sync.Mutex
	closed  bool
	records map[ID][]byte
	pending map[ID]bool      // id -> async, as the bolt store's pending index
	served  map[ID]time.Time // as the bolt store's served bucket: MarkServed writes here alone
	// channels holds the channel rows, decoded (each the store's own copy), by ChannelKey.bytes: a voucher's
	// accept under the store's one lock copies its row, rather than decoding and encoding it. A stored row is
	// never changed in place, only replaced by another, so a row read under the lock may be copied after it.
	channels map[string]*Channel
	// identifiers holds the PaymentIdentifiers bindings, as the bolt store keeps them.
	identifiers map[string][]byte
	// discovery holds the Discovery catalog, as the bolt store keeps it.
	discovery map[string][]byte
	// grants and nonces hold Access's grants and used nonces (until when).
	grants map[string]Grant
	nonces map[string]time.Time
}

// NewMemory returns an empty in-memory store; of opts only Clock applies.
func NewMemory(opts Options) *MemoryStore {
	return &MemoryStore{
		opts:    opts,
		records: make(map[ID][]byte),
		pending: make(map[ID]bool),
		served:  make(map[ID]time.Time),

		channels: make(map[string]*Channel),
	}
}

// memTxn is a txn over the store's maps; the caller holds the store's lock.
type memTxn struct{ s *MemoryStore }

func (t memTxn) get(id ID) (Record, bool, error) {
	b, ok := t.s.records[id]
	if !ok {
		return Record{}, false, nil
	}
	r, err := decodeRecord(id, b)
	if err != nil {
		return Record{}, false, err
	}
	if at, ok := t.s.served[id]; ok {
		r.Served, r.ServedAt = true, at
	}
	return r, true, nil
}

func (t memTxn) put(_, next *Record) error {
	enc, err := encodeRecord(next)
	if err != nil {
		return err
	}
	t.putEncoded(next, enc)
	return nil
}

// putEncoded is put of next, encoded as enc.
func (t memTxn) putEncoded(next *Record, enc []byte) {
	t.s.records[next.ID] = enc
	if _, ok := t.s.served[next.ID]; next.Served && !ok {
		t.s.served[next.ID] = next.ServedAt.UTC()
	}
	if next.State == StateFinal {
		delete(t.s.pending, next.ID)
	} else {
		t.s.pending[next.ID] = next.Async
	}
}

func (t memTxn) del(prev *Record) error {
	delete(t.s.records, prev.ID)
	delete(t.s.pending, prev.ID)
	delete(t.s.served, prev.ID)
	return nil
}

// lock takes the store's lock unless the call should not proceed.
func (s *MemoryStore) lock(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	return nil
}

// Claim implements Store.
func (s *MemoryStore) Claim(ctx context.Context, r Record) (Record, bool, error) {
	// The record is made and encoded before the lock, which every request of the gateway takes: under it, only
	// the look-up and the maps' writes (claimIn's, with the encoding done).
	r, err := claimed(r, s.opts.now())
	if err != nil {
		return Record{}, false, err
	}
	enc, err := encodeRecord(&r)
	if err != nil {
		return Record{}, false, err
	}
	if err := s.lock(ctx); err != nil {
		return Record{}, false, err
	}
	defer s.mu.Unlock()
	t := memTxn{s}
	existing, ok, err := t.get(r.ID)
	if err != nil || ok {
		return existing, false, err
	}
	t.putEncoded(&r, enc)
	return r, true, nil
}

// Get implements Store.
func (s *MemoryStore) Get(ctx context.Context, id ID) (Record, bool, error) {
	if err := s.lock(ctx); err != nil {
		return Record{}, false, err
	}
	defer s.mu.Unlock()
	return memTxn{s}.get(id)
}

// Update implements Store.
func (s *MemoryStore) Update(ctx context.Context, id ID, fn func(*Record) error) (Record, error) {
	if err := s.lock(ctx); err != nil {
		return Record{}, err
	}
	defer s.mu.Unlock()
	return updateIn(memTxn{s}, id, fn, s.opts.now())
}

// MarkServed implements Store.
func (s *MemoryStore) MarkServed(ctx context.Context, id ID, at time.Time) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	if _, ok := s.records[id]; !ok {
		return fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	if _, ok := s.served[id]; ok {
		return fmt.Errorf("%w: %s", ErrServed, id)
	}
	s.served[id] = at.UTC()
	return nil
}

// Release implements Store.
func (s *MemoryStore) Release(ctx context.Context, claim Record) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	return releaseIn(memTxn{s}, claim)
}

// ReleaseUnsent implements Store.
func (s *MemoryStore) ReleaseUnsent(ctx context.Context, claim Record, txHash string) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	return releaseUnsentIn(memTxn{s}, claim, txHash)
}

// Pending implements Store.
func (s *MemoryStore) Pending(ctx context.Context) ([]Record, error) {
	return s.pendingOf(ctx, func(bool) bool { return true })
}

// PendingOf implements Store.
func (s *MemoryStore) PendingOf(ctx context.Context, async bool) ([]Record, error) {
	return s.pendingOf(ctx, func(a bool) bool { return a == async })
}

func (s *MemoryStore) pendingOf(ctx context.Context, want func(async bool) bool) ([]Record, error) {
	if err := s.lock(ctx); err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	out := make([]Record, 0, len(s.pending))
	for id, async := range s.pending {
		if !want(async) {
			continue
		}
		r, _, err := memTxn{s}.get(id)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	sortPending(out)
	return out, nil
}

// Prune implements Store.
func (s *MemoryStore) Prune(ctx context.Context, finalBefore time.Time) (int, error) {
	if err := s.lock(ctx); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	n := 0
	for id := range s.records {
		if _, ok := s.pending[id]; ok {
			continue
		}
		r, _, err := memTxn{s}.get(id)
		if err != nil {
			return n, fmt.Errorf("journal: prune: %w", err)
		}
		if r.keptUntil().Before(finalBefore) {
			delete(s.records, id)
			delete(s.served, id)
			n++
		}
	}
	if err := s.prunePaymentIdentifiers(finalBefore); err != nil {
		return n, fmt.Errorf("journal: prune: %w", err)
	}
	s.pruneAccess(s.opts.now())
	return n, nil
}

// Count implements Store.
func (s *MemoryStore) Count(ctx context.Context) (int, error) {
	if err := s.lock(ctx); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	return len(s.records), nil
}

// Backlog implements Store.
func (s *MemoryStore) Backlog(ctx context.Context) (int, error) {
	if err := s.lock(ctx); err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	return len(s.pending), nil
}

// Close implements Store; closing twice is harmless.
func (s *MemoryStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return nil
}

var _ Store = (*MemoryStore)(nil)
