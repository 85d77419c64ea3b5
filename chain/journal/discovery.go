package journal

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Discovery is a store that keeps a facilitator's catalog of the resources it settled payments for (the bazaar
// extension): one entry per resource key, the latest declaration winning, bounded in number (the oldest entry
// evicted first). Every process of the store sees one catalog, kept across restarts. Every store of this
// package implements it.
type Discovery interface {
	// CatalogResource writes doc as key's entry, updated at the store's now, and then evicts the least recently
	// updated entries beyond maxEntries (0: no bound).
	CatalogResource(ctx context.Context, key string, doc []byte, maxEntries int) error
	// DiscoveredResources returns the page of the entries whose documents (x402.DiscoveredResource) pass q's
	// filters, the most recently updated first, and how many pass them. The filters are applied where the entries
	// are kept (in the database's query, within the read of the file), and only the page's documents are handed
	// out.
	DiscoveredResources(ctx context.Context, q x402.DiscoveryQuery) (page []DiscoveryEntry, total int, err error)
}

// DiscoveryEntry is one resource of a catalog.
type DiscoveryEntry struct {
	Key     string
	Doc     []byte
	Updated time.Time
}

var (
	_ Discovery = (*MemoryStore)(nil)
	_ Discovery = (*BoltStore)(nil)
	_ Discovery = (*PostgresStore)(nil)
)

// bucketDiscovery holds the bolt store's catalog: key -> updated (unix ns, big endian) then the document. A file
// of an earlier release gains it at open; an earlier release opening a file that has it leaves it alone.
var bucketDiscovery = []byte("discovery")

func discoveryValue(doc []byte, at time.Time) []byte {
	return append(binary.BigEndian.AppendUint64(nil, uint64(at.UnixNano())), doc...)
}

func readDiscoveryValue(key string, v []byte) (DiscoveryEntry, error) {
	if len(v) < 8 {
		return DiscoveryEntry{}, fmt.Errorf("%w: catalog entry of %q has %d bytes", ErrCorrupt, key, len(v))
	}
	return DiscoveryEntry{Key: key, Doc: v[8:], Updated: time.Unix(0, int64(binary.BigEndian.Uint64(v))).UTC()}, nil
}

// catalogView is what the filters of a listing read of an entry's document.
type catalogView struct {
	Type    string `json:"type"`
	Accepts []struct {
		PayTo   string `json:"payTo"`
		Scheme  string `json:"scheme"`
		Network string `json:"network"`
	} `json:"accepts"`
	Extensions map[string]json.RawMessage `json:"extensions"`
}

// matchesDoc reports whether the document doc passes q's filters; one that does not read, or escapes a NUL (as
// the PostgreSQL store reads it), passes none.
func matchesDoc(q x402.DiscoveryQuery, doc []byte) bool {
	if q.Type == "" && q.Extension == "" && q.PayTo == "" && q.Scheme == "" && q.Network == "" {
		return true
	}
	var v catalogView
	if bytes.Contains(doc, []byte(`\u0000`)) || json.Unmarshal(doc, &v) != nil {
		return false
	}
	r := x402.DiscoveredResource{Type: v.Type, Extensions: v.Extensions}
	for _, a := range v.Accepts {
		r.Accepts = append(r.Accepts, x402.PaymentRequirements{PayTo: a.PayTo, Scheme: a.Scheme, Network: a.Network})
	}
	return q.Matches(r)
}

// page filters entries (newest first, their documents not yet copied) by q and returns its page, the documents
// copied, and how many passed.
func page(es []DiscoveryEntry, q x402.DiscoveryQuery) ([]DiscoveryEntry, int) {
	var out []DiscoveryEntry
	total := 0
	for _, e := range es {
		if !matchesDoc(q, e.Doc) {
			continue
		}
		if total >= q.Offset && len(out) < q.Limit {
			e.Doc = slices.Clone(e.Doc)
			out = append(out, e)
		}
		total++
	}
	return out, total
}

// newestFirst orders entries by update, the newest first, then by key so that pages are stable.
func newestFirst(es []DiscoveryEntry) {
	slices.SortFunc(es, func(a, b DiscoveryEntry) int {
		if c := b.Updated.Compare(a.Updated); c != 0 {
			return c
		}
		if a.Key < b.Key {
			return -1
		}
		if a.Key > b.Key {
			return 1
		}
		return 0
	})
}

// checkCatalogDoc refuses a document a listing could not filter: one that is not JSON, or that escapes a NUL
// (PostgreSQL's jsonb takes neither).
func checkCatalogDoc(key string, doc []byte) error {
	if !json.Valid(doc) || bytes.Contains(doc, []byte(`\u0000`)) {
		return fmt.Errorf("journal: the catalog entry of %q is not JSON, or escapes a NUL", key)
	}
	return nil
}

// CatalogResource implements Discovery.
func (s *MemoryStore) CatalogResource(ctx context.Context, key string, doc []byte, maxEntries int) error {
	if err := checkCatalogDoc(key, doc); err != nil {
		return err
	}
	if err := s.lock(ctx); err != nil {
		return err
	}
	defer s.mu.Unlock()
	if s.discovery == nil {
		s.discovery = make(map[string][]byte)
	}
	s.discovery[key] = discoveryValue(doc, s.opts.now())
	if maxEntries <= 0 || len(s.discovery) <= maxEntries {
		return nil
	}
	es, err := memoryEntries(s.discovery)
	if err != nil {
		return err
	}
	for _, e := range es[maxEntries:] {
		delete(s.discovery, e.Key)
	}
	return nil
}

func memoryEntries(m map[string][]byte) ([]DiscoveryEntry, error) {
	es := make([]DiscoveryEntry, 0, len(m))
	for k, v := range m {
		e, err := readDiscoveryValue(k, v)
		if err != nil {
			return nil, err
		}
		es = append(es, e)
	}
	newestFirst(es)
	return es, nil
}

// DiscoveredResources implements Discovery.
func (s *MemoryStore) DiscoveredResources(ctx context.Context, q x402.DiscoveryQuery) ([]DiscoveryEntry, int, error) {
	if err := s.lock(ctx); err != nil {
		return nil, 0, err
	}
	defer s.mu.Unlock()
	es, err := memoryEntries(s.discovery)
	if err != nil {
		return nil, 0, err
	}
	out, total := page(es, q)
	return out, total, nil
}

// CatalogResource implements Discovery.
func (s *BoltStore) CatalogResource(ctx context.Context, key string, doc []byte, maxEntries int) error {
	if err := checkCatalogDoc(key, doc); err != nil {
		return err
	}
	now := s.opts.now()
	var opErr error
	err := s.write(ctx, func(t *boltTxn) {
		b := t.tx.Bucket(bucketDiscovery)
		if opErr = b.Put([]byte(key), discoveryValue(doc, now)); opErr != nil {
			t.tainted = true
			return
		}
		if maxEntries <= 0 {
			return
		}
		var es []DiscoveryEntry
		if opErr = b.ForEach(func(k, v []byte) error {
			e, err := readDiscoveryValue(string(k), v)
			es = append(es, e)
			return err
		}); opErr != nil {
			return
		}
		newestFirst(es)
		for _, e := range es[min(maxEntries, len(es)):] {
			if opErr = b.Delete([]byte(e.Key)); opErr != nil {
				t.tainted = true
				return
			}
		}
	})
	if err == nil {
		err = opErr
	}
	if err != nil {
		return fmt.Errorf("journal: cataloging resource %q: %w", key, err)
	}
	return nil
}

// DiscoveredResources implements Discovery: the entries are filtered and paged within the read, the documents
// of the page alone copied out of the file's memory.
func (s *BoltStore) DiscoveredResources(ctx context.Context, q x402.DiscoveryQuery) ([]DiscoveryEntry, int, error) {
	var (
		out   []DiscoveryEntry
		total int
	)
	err := s.read(ctx, func(t *boltTxn) error {
		b := t.tx.Bucket(bucketDiscovery)
		if b == nil {
			return nil
		}
		var es []DiscoveryEntry
		if err := b.ForEach(func(k, v []byte) error {
			e, err := readDiscoveryValue(string(k), v)
			es = append(es, e)
			return err
		}); err != nil {
			return err
		}
		newestFirst(es)
		out, total = page(es, q)
		return nil
	})
	if err != nil {
		return nil, 0, fmt.Errorf("journal: reading the catalog: %w", err)
	}
	return out, total, nil
}

// pgDiscoveryMigration (8) is the PostgreSQL store's catalog of resources. A new table only, which no earlier
// release reads or writes.
const pgDiscoveryMigration = `
-- A facilitator's catalog of the resources it settled payments for (bazaar): the latest declaration of each,
-- the least recently updated evicted beyond the facilitator's bound.
CREATE TABLE IF NOT EXISTS x402_discovery (
	key        text   PRIMARY KEY,
	doc        bytea  NOT NULL,
	updated_ns bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS x402_discovery_updated ON x402_discovery (updated_ns);
`

// CatalogResource implements Discovery.
func (s *PostgresStore) CatalogResource(ctx context.Context, key string, doc []byte, maxEntries int) error {
	if err := checkCatalogDoc(key, doc); err != nil {
		return err
	}
	wctx, cancel, err := s.begin(ctx, true)
	if err != nil {
		return err
	}
	defer cancel()
	err = retrySafe(func() error {
		_, err := s.pool.Exec(wctx, `INSERT INTO x402_discovery (key, doc, updated_ns) VALUES ($1, $2, $3)
			ON CONFLICT (key) DO UPDATE SET doc = EXCLUDED.doc, updated_ns = GREATEST(x402_discovery.updated_ns, EXCLUDED.updated_ns)`,
			key, doc, nanos(s.opts.now()))
		return err
	})
	if err == nil && maxEntries > 0 {
		err = retrySafe(func() error {
			_, err := s.pool.Exec(wctx, `DELETE FROM x402_discovery WHERE key IN (
				SELECT key FROM x402_discovery ORDER BY updated_ns DESC, key ASC OFFSET $1)`, maxEntries)
			return err
		})
	}
	if err != nil {
		return s.fail(ctx, "catalog resource", err)
	}
	return nil
}

// pgDiscoveryMatches is the FROM and WHERE of a listing: the filters $1 type, $2 extension, $3 payTo, $4
// scheme, $5 network (empty for any) on the document read as JSON. Every document is JSON (checkCatalogDoc); one
// an earlier release wrote escaping a NUL, which jsonb does not take, passes no filter but is listed where none is
// asked.
const pgDiscoveryMatches = `FROM (SELECT key, doc, updated_ns, CASE WHEN strpos(convert_from(doc, 'UTF8'), '\u0000') = 0
		THEN convert_from(doc, 'UTF8')::jsonb END AS d FROM x402_discovery) c
	WHERE ($1 = '' OR d->>'type' = $1) AND ($2 = '' OR jsonb_exists(d->'extensions', $2))
		AND (($3 = '' AND $4 = '' AND $5 = '') OR EXISTS (SELECT 1 FROM jsonb_array_elements(
			CASE WHEN jsonb_typeof(d->'accepts') = 'array' THEN d->'accepts' ELSE '[]'::jsonb END) a
			WHERE ($3 = '' OR lower(a->>'payTo') = lower($3)) AND ($4 = '' OR a->>'scheme' = $4) AND ($5 = '' OR a->>'network' = $5)))`

// DiscoveredResources implements Discovery: filtered, counted and paged by the database.
func (s *PostgresStore) DiscoveredResources(ctx context.Context, q x402.DiscoveryQuery) ([]DiscoveryEntry, int, error) {
	rctx, cancel, err := s.begin(ctx, false)
	if err != nil {
		return nil, 0, err
	}
	defer cancel()
	var (
		es    []DiscoveryEntry
		total int
	)
	args := []any{q.Type, q.Extension, q.PayTo, q.Scheme, q.Network}
	err = s.read(rctx, func() error {
		es = es[:0]
		if err := s.pool.QueryRow(rctx, `SELECT count(*) `+pgDiscoveryMatches, args...).Scan(&total); err != nil {
			return err
		}
		rows, err := s.pool.Query(rctx, `SELECT key, doc, updated_ns `+pgDiscoveryMatches+`
			ORDER BY updated_ns DESC, key ASC LIMIT $6 OFFSET $7`, append(args, q.Limit, q.Offset)...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				e  DiscoveryEntry
				ns int64
			)
			if err := rows.Scan(&e.Key, &e.Doc, &ns); err != nil {
				return err
			}
			e.Updated = time.Unix(0, ns).UTC()
			es = append(es, e)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, 0, s.fail(ctx, "discovered resources", err)
	}
	return es, total, nil
}

// ResourceCatalog is a Discovery store seen as a catalog of x402.DiscoveredResource, keyed by the resource's
// canonical URL and the recipient it was paid to: what a facilitator server catalogs in and lists from.
type ResourceCatalog struct{ Store Discovery }

// Add catalogs r, keeping at most maxEntries resources; its LastUpdated is the store's now. The entry is the
// resource's as paid to its recipient: the resource URL and the declaration are the payer's to write, so a
// payment to one recipient never replaces what payments to another had catalogued under the same URL.
func (c ResourceCatalog) Add(ctx context.Context, r x402.DiscoveredResource, maxEntries int) error {
	r.LastUpdated = ""
	doc, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("journal: encoding the resource %q: %w", r.Resource, err)
	}
	key := r.Resource
	if len(r.Accepts) > 0 {
		key += " " + strings.ToLower(r.Accepts[0].PayTo)
	}
	return c.Store.CatalogResource(ctx, key, doc, maxEntries)
}

// List returns the page q asks for of the resources that pass its filters, the most recently updated first, and
// how many pass them.
func (c ResourceCatalog) List(ctx context.Context, q x402.DiscoveryQuery) ([]x402.DiscoveredResource, int, error) {
	es, total, err := c.Store.DiscoveredResources(ctx, q)
	if err != nil {
		return nil, 0, err
	}
	out := make([]x402.DiscoveredResource, 0, len(es))
	for _, e := range es {
		var r x402.DiscoveredResource
		if err := json.Unmarshal(e.Doc, &r); err != nil {
			return nil, 0, fmt.Errorf("%w: catalog entry of %q: %v", ErrCorrupt, e.Key, err)
		}
		r.LastUpdated = e.Updated.Format(time.RFC3339Nano)
		out = append(out, r)
	}
	return out, total, nil
}
