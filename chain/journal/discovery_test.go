package journal

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
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
			es, _, err := s.(Discovery).DiscoveredResources(ctx, x402.DiscoveryQuery{Limit: 100})
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
		es, total, err := s.DiscoveredResources(ctx, x402.DiscoveryQuery{Limit: 100})
		if err != nil || total != 2 || len(es) != 2 || es[0].Key != "r0" || es[1].Key != "r2" {
			t.Fatalf("DiscoveredResources = %+v, %v; want r0, r2 (r1 evicted by the shared bound)", es, err)
		}
	}
}

// A listing is filtered, counted and paged by the store, alike in each: by type, extension, and payTo (any
// case), scheme and network holding of one accepted offer; the page the newest first. A document no listing
// could filter (not JSON, a NUL escaped) is refused.
func TestStoreListsTheCatalogFilteredAndPaged(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now).(Discovery)
		ctx := context.Background()
		docs := []struct{ key, doc string }{
			{"h1", `{"type":"http","accepts":[{"scheme":"exact","network":"eip155:1","payTo":"0xAbC"}],"extensions":{"bazaar":{}}}`},
			{"h2", `{"type":"http","accepts":[{"scheme":"upto","network":"eip155:2","payTo":"0xdef"},{"scheme":"exact","network":"eip155:1","payTo":"0xdef"}]}`},
			{"m1", `{"type":"mcp","accepts":[{"scheme":"exact","network":"eip155:2","payTo":"0xabc"}],"extensions":{"bazaar":{}}}`},
			{"h3", `{"type":"http","description":"three","accepts":[{"scheme":"exact","network":"eip155:1","payTo":"0xabc"}]}`},
		}
		for _, d := range docs {
			if err := s.CatalogResource(ctx, d.key, []byte(d.doc), 0); err != nil {
				t.Fatal(err)
			}
			clock.Advance(time.Second)
		}
		// A document no listing could filter is refused, and changes nothing.
		for _, doc := range []string{`not json`, `{"type":"http","description":"a \u0000 in it"}`} {
			if err := s.CatalogResource(ctx, "junk", []byte(doc), 0); err == nil {
				t.Fatalf("CatalogResource(%s) was taken; want it refused", doc)
			}
		}
		for _, c := range []struct {
			q     x402.DiscoveryQuery
			want  string
			total int
		}{
			{x402.DiscoveryQuery{Limit: 10}, "h3 m1 h2 h1", 4},
			{x402.DiscoveryQuery{Limit: 2, Offset: 1}, "m1 h2", 4},
			{x402.DiscoveryQuery{Limit: 2, Offset: 9}, "", 4},
			{x402.DiscoveryQuery{Limit: 10, Type: "http"}, "h3 h2 h1", 3},
			{x402.DiscoveryQuery{Limit: 10, Extension: "bazaar"}, "m1 h1", 2},
			{x402.DiscoveryQuery{Limit: 10, PayTo: "0XABC"}, "h3 m1 h1", 3},
			{x402.DiscoveryQuery{Limit: 10, Scheme: "exact", Network: "eip155:1"}, "h3 h2 h1", 3},
			{x402.DiscoveryQuery{Limit: 10, Scheme: "upto", Network: "eip155:1"}, "", 0},
			{x402.DiscoveryQuery{Limit: 1, Type: "http", PayTo: "0xdef", Scheme: "exact"}, "h2", 1},
		} {
			es, total, err := s.DiscoveredResources(ctx, c.q)
			if err != nil {
				t.Fatalf("%+v: %v", c.q, err)
			}
			got := ""
			for _, e := range es {
				got += " " + e.Key
			}
			if len(got) > 0 {
				got = got[1:]
			}
			if got != c.want || total != c.total {
				t.Errorf("%+v lists %q of %d, want %q of %d", c.q, got, total, c.want, c.total)
			}
		}
	})
}
