package journal

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

func TestStoreCatalogsOneEntryPerResourceTheLatestWinningBoundedAndKeptAcrossReopens(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		catalog := func(key, doc string, maxEntries int) {
			t.Helper()
			if err := s.(Discovery).CatalogResource(ctx, key, []byte(doc), maxEntries); err != nil {
				t.Fatalf("CatalogResource(%s): %v", key, err)
			}
			clock.Advance(time.Second)
		}
		keys := func() string {
			t.Helper()
			es, err := s.(Discovery).DiscoveredResources(ctx)
			if err != nil {
				t.Fatal(err)
			}
			out := ""
			for _, e := range es {
				out += fmt.Sprintf("%s=%s ", e.Key, e.Doc)
			}
			return out
		}
		if got := keys(); got != "" {
			t.Fatalf("a new store's catalog is %q, want empty", got)
		}
		catalog("a", "1", 3)
		catalog("b", "1", 3)
		catalog("a", "2", 3) // the latest declaration wins, and counts as the newest
		catalog("c", "1", 3)
		if got, want := keys(), "c=1 a=2 b=1 "; got != want {
			t.Fatalf("catalog = %q, want %q", got, want)
		}
		catalog("d", "1", 3) // b, the least recently updated, goes
		if got, want := keys(), "d=1 c=1 a=2 "; got != want {
			t.Fatalf("catalog over its bound = %q, want %q", got, want)
		}
		s = h.reopen(t, s)
		if got, want := keys(), "d=1 c=1 a=2 "; got != want {
			t.Fatalf("catalog after a reopen = %q, want %q", got, want)
		}
	})
}

// Two processes of one PostgreSQL journal (a cluster's facilitators) keep one catalog: a resource catalogued
// by either is listed by both, once, and the bound counts both's entries.
func TestPostgresStoresOfOneDatabaseShareOneCatalog(t *testing.T) {
	dsn := pgtest.Shared(t)
	clock := newTestClock()
	a, b := openPostgres(t, dsn, Options{Clock: clock.Now}), openPostgres(t, dsn, Options{Clock: clock.Now})
	ctx := context.Background()
	for i, s := range []*PostgresStore{a, b, a, b} {
		if err := s.CatalogResource(ctx, fmt.Sprintf("r%d", i%3), []byte(`{}`), 2); err != nil {
			t.Fatal(err)
		}
		clock.Advance(time.Second)
	}
	for _, s := range []*PostgresStore{a, b} {
		es, err := s.DiscoveredResources(ctx)
		if err != nil || len(es) != 2 || es[0].Key != "r0" || es[1].Key != "r2" {
			t.Fatalf("DiscoveredResources = %+v, %v; want r0, r2 (r1 evicted by the shared bound)", es, err)
		}
	}
}
