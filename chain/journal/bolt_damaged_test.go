package journal

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// journalWithClaims writes a journal holding n claims and returns its path, its bytes, and the length its
// header counts (bbolt's high-water mark: every page below it holds data or free space of the journal).
func journalWithClaims(t *testing.T, n int) (path string, data []byte, counted int64) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "journal.db")
	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		mustClaim(t, s, claimOf(i))
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.View(func(tx *bolt.Tx) error { counted = tx.Size(); return nil }); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if data, err = os.ReadFile(path); err != nil {
		t.Fatal(err)
	}
	return path, data, counted
}

// assertRefusedAsDamaged checks that OpenBolt refuses the file at path with ErrDamaged, naming it, and leaves
// the file as it was.
func assertRefusedAsDamaged(t *testing.T, path string) {
	t.Helper()
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s, err := OpenBolt(path, Options{})
	if err == nil {
		s.Close()
		t.Fatalf("OpenBolt of a damaged file (%d bytes) succeeded; want ErrDamaged", len(before))
	}
	if !errors.Is(err, ErrDamaged) || !strings.Contains(err.Error(), path) {
		t.Fatalf("OpenBolt error = %v; want ErrDamaged naming %s", err, path)
	}
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(after) != string(before) {
		t.Fatalf("OpenBolt changed the damaged file from %d to %d bytes; it must leave it for the operator", len(before), len(after))
	}
}

// TestOpenBoltRefusesAnEmptyJournalFileRatherThanStartAnEmptyJournal: a journal file is never empty once
// created, so an empty one lost its claims; opening it as a new journal would serve them again.
func TestOpenBoltRefusesAnEmptyJournalFileRatherThanStartAnEmptyJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	assertRefusedAsDamaged(t, path)
}

// TestOpenBoltRefusesATruncatedJournalFileWithAnErrorInsteadOfPanicking cuts a journal short at points where
// bbolt answers an error, panics, or faults reading its memory map, and where it would open and fault later.
func TestOpenBoltRefusesATruncatedJournalFileWithAnErrorInsteadOfPanicking(t *testing.T) {
	path, data, counted := journalWithClaims(t, 300)
	page := int64(os.Getpagesize())
	for _, n := range []int64{100, page, page + 904, 2 * page, 3*page + 1, 4 * page, counted / 2, counted - page, counted - 1} {
		if n <= 0 || n >= counted {
			continue
		}
		t.Run(fmt.Sprintf("cut_at_%d_of_%d", n, counted), func(t *testing.T) {
			if err := os.WriteFile(path, data[:n], 0o600); err != nil {
				t.Fatal(err)
			}
			assertRefusedAsDamaged(t, path)
		})
	}
}

// TestOpenBoltOpensAJournalWhoseFreeTailWasCutKeepingItsClaims: bbolt grows its file ahead of use; the pages
// past the header's count hold nothing, so a file cut there is whole.
func TestOpenBoltOpensAJournalWhoseFreeTailWasCutKeepingItsClaims(t *testing.T) {
	path, data, counted := journalWithClaims(t, 300)
	if err := os.WriteFile(path, data[:counted], 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatalf("OpenBolt of a journal holding all %d counted bytes: %v", counted, err)
	}
	defer s.Close()
	n, err := s.Count(context.Background())
	if err != nil || n != 300 {
		t.Fatalf("Count = %d, %v; want the 300 claims", n, err)
	}
}

// TestOpenBoltStillInitialisesAFileItCreates: the empty-file refusal is for files found empty, not for the
// one OpenBolt creates itself.
func TestOpenBoltStillInitialisesAFileItCreates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.db")
	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, claimOf(1))
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = OpenBolt(path, Options{})
	if err != nil {
		t.Fatalf("reopening the journal OpenBolt created: %v", err)
	}
	defer s.Close()
	if _, found, err := s.Get(context.Background(), claimOf(1).ID); err != nil || !found {
		t.Fatalf("Get after reopen = found %v, %v; want the claim", found, err)
	}
}
