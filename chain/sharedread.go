package chain

import (
	"context"
	"sync"
	"time"
)

// sharedRead is a value read from the chain that callers share: the last read answers for a while, and callers
// that come while a read is under way wait for that read instead of starting their own. No lock is held across
// the read, so a node that hangs holds up only the callers of that one read, each no longer than it is willing
// to wait.
type sharedRead[T any] struct {
	mu     sync.Mutex
	val    T
	at     time.Time
	ok     bool
	flight *readFlight[T]
}

// readFlight is one read under way and, once done is closed, its outcome.
type readFlight[T any] struct {
	done chan struct{}
	val  T
	err  error
	// abandoned says the reader's own context ended the read: the outcome is of no use to a waiter whose
	// context still runs, which reads again.
	abandoned bool
}

// get returns the value read less than ttl ago (by now), or the outcome of the read under way, or reads it.
func (s *sharedRead[T]) get(ctx context.Context, now func() time.Time, ttl time.Duration, read func(context.Context) (T, error)) (T, error) {
	for {
		s.mu.Lock()
		if s.ok && now().Sub(s.at) < ttl {
			v := s.val
			s.mu.Unlock()
			return v, nil
		}
		fl := s.flight
		if fl == nil {
			fl = &readFlight[T]{done: make(chan struct{})}
			s.flight = fl
			s.mu.Unlock()
			fl.val, fl.err = read(ctx)
			fl.abandoned = fl.err != nil && ctx.Err() != nil
			s.mu.Lock()
			if fl.err == nil {
				s.val, s.at, s.ok = fl.val, now(), true
			}
			s.flight = nil
			s.mu.Unlock()
			close(fl.done)
			return fl.val, fl.err
		}
		s.mu.Unlock()
		select {
		case <-fl.done:
		case <-ctx.Done():
			var zero T
			return zero, ctx.Err()
		}
		if !fl.abandoned || ctx.Err() != nil {
			return fl.val, fl.err
		}
	}
}

// forget drops the value read, so that the next caller reads afresh (a read under way still answers its
// waiters).
func (s *sharedRead[T]) forget() {
	s.mu.Lock()
	s.ok = false
	s.mu.Unlock()
}

// last returns the value read last, however long ago, without reading; ok is false when none was read yet (or
// it was forgotten).
func (s *sharedRead[T]) last() (v T, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.val, s.ok
}
