package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// pgDSNs remembers the DSN each test store was opened on, for reopen and plant (the store keeps no DSN: it
// may hold a password).
var pgDSNs = struct {
	sync.Mutex
	m map[*PostgresStore]string
}{m: map[*PostgresStore]string{}}

// pgDSN returns the DSN s was opened on.
func pgDSN(s *PostgresStore) string {
	pgDSNs.Lock()
	defer pgDSNs.Unlock()
	return pgDSNs.m[s]
}

// openPostgres opens a store on dsn that the test closes when it ends.
func openPostgres(t testing.TB, dsn string, opts Options) *PostgresStore {
	t.Helper()
	s, err := OpenPostgres(context.Background(), dsn, opts)
	if err != nil {
		t.Fatalf("OpenPostgres: %v", err)
	}
	pgDSNs.Lock()
	pgDSNs.m[s] = dsn
	pgDSNs.Unlock()
	t.Cleanup(func() { s.Close() })
	return s
}

// pgExec runs one statement on dsn's database behind any store's back.
func pgExec(t testing.TB, dsn, sql string, args ...any) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// crash ends s as a killed process would: its heartbeat stops and its connections close, but its instance row
// stays until it expires.
func (s *PostgresStore) crash() {
	s.closeOnce.Do(func() {
		s.closed.Store(true)
		close(s.stopBeat)
		<-s.beatDone
		s.pool.Close()
	})
}

// eventually polls cond until it holds or d has passed.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestPostgresTwoStoresClaimEachPaymentExactlyOnce: two stores on one database, as two processes would
// open it, each claiming every payment from four goroutines at once: every payment has exactly one winner, and
// every caller sees the winner's claim.
func TestPostgresTwoStoresClaimEachPaymentExactlyOnce(t *testing.T) {
	dsn := pgtest.Shared(t)
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	const ids, goroutines = 200, 4
	var (
		mu      sync.Mutex
		winners = map[ID][]string{}
		seen    = map[ID]map[string]bool{}
	)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for si, s := range stores {
		for g := range goroutines {
			owner := fmt.Sprintf("store-%d/goroutine-%d", si, g)
			order := rand.New(rand.NewPCG(uint64(si), uint64(g))).Perm(ids)
			wg.Go(func() {
				<-start
				for _, n := range order {
					r := claimOf(5000 + n)
					r.Owner = owner
					got, claimed, err := s.Claim(context.Background(), r)
					if err != nil {
						t.Errorf("%s: claim %d: %v", owner, n, err)
						return
					}
					mu.Lock()
					if claimed {
						winners[r.ID] = append(winners[r.ID], owner)
					}
					if seen[r.ID] == nil {
						seen[r.ID] = map[string]bool{}
					}
					seen[r.ID][got.Owner] = true
					mu.Unlock()
				}
			})
		}
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		return
	}
	for n := range ids {
		id := claimOf(5000 + n).ID
		if len(winners[id]) != 1 {
			t.Fatalf("payment %d was claimed by %v, want exactly one winner", n, winners[id])
		}
		if len(seen[id]) != 1 || !seen[id][winners[id][0]] {
			t.Fatalf("callers of payment %d saw owners %v, want only the winner %s", n, seen[id], winners[id][0])
		}
	}
	if n, err := stores[1].Count(context.Background()); err != nil || n != ids {
		t.Fatalf("Count = %d, %v; want %d", n, err, ids)
	}
}

// TestPostgresMigratesOnceFromConcurrentOpens: eight processes starting at once on an empty database all open,
// and the schema is applied once.
func TestPostgresMigratesOnceFromConcurrentOpens(t *testing.T) {
	dsn := pgtest.Shared(t)
	const opens = 8
	errs := make([]error, opens)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range opens {
		wg.Go(func() {
			<-start
			s, err := OpenPostgres(context.Background(), dsn, Options{})
			if err == nil {
				s.Close()
			}
			errs[i] = err
		})
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("open %d of %d at once: %v", i, opens, err)
		}
	}
	var versions []int
	pgQuery(t, dsn, `SELECT version FROM x402_schema_migrations ORDER BY version`, func(rows pgx.Rows) error {
		var v int
		err := rows.Scan(&v)
		versions = append(versions, v)
		return err
	})
	if len(versions) != len(pgMigrations) || versions[0] != 1 || versions[len(versions)-1] != len(pgMigrations) {
		t.Fatalf("schema versions recorded: %v, want 1..%d once each", versions, len(pgMigrations))
	}
	// And a later open finds nothing to do.
	s := openPostgres(t, dsn, Options{})
	mustClaim(t, s, claimOf(1))
}

// TestPostgresRefusesADatabaseOfANewerSchema: a database a newer release migrated is not opened.
func TestPostgresRefusesADatabaseOfANewerSchema(t *testing.T) {
	dsn := pgtest.Shared(t)
	openPostgres(t, dsn, Options{}).Close()
	pgExec(t, dsn, `INSERT INTO x402_schema_migrations (version) VALUES ($1)`, len(pgMigrations)+1)
	s, err := OpenPostgres(context.Background(), dsn, Options{})
	if err == nil {
		s.Close()
		t.Fatal("OpenPostgres opened a database of a newer schema")
	}
	want := fmt.Sprintf("schema version %d", len(pgMigrations)+1)
	if !errors.Is(err, ErrSchemaTooNew) || !strings.Contains(err.Error(), want) {
		t.Fatalf("OpenPostgres: %v; want ErrSchemaTooNew saying %q", err, want)
	}
}

// TestPostgresBusyMarksAcrossStores: a payment one live instance marks busy is not another's to mark; an
// instance's Idle leaves another's mark alone; the mark of a closed instance is taken over at once, and that of
// an instance that stopped beating once its TTL has passed.
func TestPostgresBusyMarksAcrossStores(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	id := claimOf(1).ID
	busy := func(s *PostgresStore, id ID, want bool) {
		t.Helper()
		if got, err := s.Busy(ctx, id); err != nil || got != want {
			t.Fatalf("Busy by %s = %v, %v; want %v", s.Instance(), got, err, want)
		}
	}
	busy(a, id, true)
	busy(a, id, true) // marked by itself already
	busy(b, id, false)
	if err := b.Idle(ctx, id); err != nil {
		t.Fatal(err)
	}
	busy(b, id, false) // b's Idle left a's mark
	if err := a.Idle(ctx, id); err != nil {
		t.Fatal(err)
	}
	busy(b, id, true)

	closed := openPostgres(t, dsn, Options{})
	id2 := claimOf(2).ID
	busy(closed, id2, true)
	busy(b, id2, false)
	closed.Close()
	busy(b, id2, true) // closed: dead at once

	crashed := openPostgres(t, dsn, Options{InstanceTTL: time.Second})
	id3 := claimOf(3).ID
	busy(crashed, id3, true)
	crashed.crash()
	busy(b, id3, false) // still within its TTL
	if ok, err := b.Alive(ctx, crashed.Instance()); err != nil || !ok {
		t.Fatalf("Alive of an instance within its TTL = %v, %v", ok, err)
	}
	eventually(t, 5*time.Second, "the mark of an instance whose heartbeat stopped was not taken over", func() bool {
		ok, err := b.Busy(ctx, id3)
		return err == nil && ok
	})
	if ok, err := b.Alive(ctx, crashed.Instance()); err != nil || ok {
		t.Fatalf("Alive of an instance past its TTL = %v, %v", ok, err)
	}
}

// TestPostgresInstancesAndHeartbeat: a store is alive while open, its heartbeat keeps it alive past its TTL, and
// Close ends it.
func TestPostgresInstancesAndHeartbeat(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a := openPostgres(t, dsn, Options{InstanceTTL: 600 * time.Millisecond})
	b := openPostgres(t, dsn, Options{})
	if a.Instance() == b.Instance() || len(a.Instance()) != 32 {
		t.Fatalf("instances %q and %q; want two distinct random tokens", a.Instance(), b.Instance())
	}
	if n, _, err := b.Instances(ctx); err != nil || n != 2 {
		t.Fatalf("Instances = %d, %v; want 2", n, err)
	}
	// The ranks are the tokens' order, the same to both: one is first, the other second.
	_, ra, errA := a.Instances(ctx)
	_, rb, errB := b.Instances(ctx)
	if errA != nil || errB != nil || ra+rb != 1 || (ra == 0) != (a.Instance() < b.Instance()) {
		t.Fatalf("ranks %d (%q) and %d (%q), %v %v; want 0 and 1 in the order of the tokens", ra, a.Instance(), rb, b.Instance(), errA, errB)
	}
	time.Sleep(1500 * time.Millisecond) // more than twice a's TTL: only its heartbeat keeps it alive
	if ok, err := b.Alive(ctx, a.Instance()); err != nil || !ok {
		t.Fatalf("Alive of a beating instance past its TTL = %v, %v", ok, err)
	}
	if ok, err := b.Alive(ctx, "no-such-instance"); err != nil || ok {
		t.Fatalf("Alive of an unknown instance = %v, %v", ok, err)
	}
	a.Close()
	if ok, err := b.Alive(ctx, a.Instance()); err != nil || ok {
		t.Fatalf("Alive of a closed instance = %v, %v", ok, err)
	}
	if n, r, err := b.Instances(ctx); err != nil || n != 1 || r != 0 {
		t.Fatalf("Instances after a Close = %d (rank %d), %v; want 1, rank 0", n, r, err)
	}
	if _, err := a.Alive(ctx, a.Instance()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Alive after Close: %v, want ErrClosed", err)
	}
}

// TestPostgresLeaseFencesEveryTakeover: a takeover bumps the fence and a renewal keeps it; a live holder's lease
// is not taken; a lease given up, lapsed, or held by a closed or silent instance is.
func TestPostgresLeaseFencesEveryTakeover(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	lease := func(s *PostgresStore, ttl time.Duration) Lease {
		t.Helper()
		l, err := s.Lease(ctx, "wallet-1", ttl)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	l := lease(a, time.Minute)
	if !l.Held || !l.Took || l.Fence != 1 || l.Owner != a.Instance() || l.Name != "wallet-1" || time.Until(l.Expires) < 50*time.Second {
		t.Fatalf("first Lease = %+v; want held and taken at fence 1 for a minute", l)
	}
	renewed := lease(a, time.Minute)
	if !renewed.Held || renewed.Took || renewed.Fence != 1 || renewed.Expires.Before(l.Expires) {
		t.Fatalf("renewal = %+v; want held, not taken, fence 1, expiring no earlier than %s", renewed, l.Expires)
	}
	other := lease(b, time.Minute)
	if other.Held || other.Took || other.Owner != a.Instance() || other.Fence != 1 {
		t.Fatalf("Lease by another instance = %+v; want a's lease at fence 1 left alone", other)
	}
	if err := b.Unlease(ctx, "wallet-1"); err != nil {
		t.Fatal(err)
	}
	if still := lease(a, time.Minute); !still.Held || still.Took || still.Fence != 1 {
		t.Fatalf("after another's Unlease, a's renewal = %+v; want it still a's at fence 1", still)
	}
	if err := a.Unlease(ctx, "wallet-1"); err != nil {
		t.Fatal(err)
	}
	l = lease(b, 300*time.Millisecond)
	if !l.Held || !l.Took || l.Fence != 2 {
		t.Fatalf("Lease after Unlease = %+v; want taken at fence 2", l)
	}
	time.Sleep(500 * time.Millisecond) // b's lease lapses
	l = lease(a, time.Minute)
	if !l.Held || !l.Took || l.Fence != 3 {
		t.Fatalf("Lease of a lapsed lease = %+v; want taken at fence 3", l)
	}

	// A closed or silent holder's lease passes only once it expires, however long ago the holder went: a holder
	// cut off from the database may still be signing until then.
	silent := openPostgres(t, dsn, Options{InstanceTTL: 300 * time.Millisecond})
	if l, err := silent.Lease(ctx, "wallet-2", 2*time.Second); err != nil || !l.Held || l.Fence != 1 {
		t.Fatalf("Lease of wallet-2 = %+v, %v", l, err)
	}
	silent.crash()
	time.Sleep(time.Second) // the instance is dead by now, its lease not yet expired
	if alive, err := b.Alive(ctx, silent.Instance()); err != nil || alive {
		t.Fatalf("Alive of a silent instance past its TTL = %v, %v; want dead", alive, err)
	}
	if l, err := b.Lease(ctx, "wallet-2", time.Minute); err != nil || l.Held || l.Owner != silent.Instance() {
		t.Fatalf("Lease of a dead holder's unexpired lease = %+v, %v; want it left alone", l, err)
	}
	eventually(t, 5*time.Second, "the lease of an instance whose heartbeat stopped was not taken over once it expired", func() bool {
		l, err := b.Lease(ctx, "wallet-2", time.Minute)
		return err == nil && l.Held && l.Took && l.Fence == 2
	})
	a.Close()
	if l := lease(b, time.Minute); l.Held || l.Owner != a.Instance() {
		t.Fatalf("Lease of a closed holder's unexpired lease = %+v; want it left alone until it expires", l)
	}
	if _, err := b.Lease(ctx, "wallet-3", 0); err == nil {
		t.Fatal("Lease for a ttl of 0 succeeded")
	}
}

// TestPostgresHoldsAcrossStoresNeverExceedWhatThePayerHas: fifty holds of 10 against 200, at once from two
// stores, hold exactly twenty.
func TestPostgresHoldsAcrossStoresNeverExceedWhatThePayerHas(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	const key, tries = "eip155:8453/0xtoken/0xpayer", 50
	avail := big.NewInt(200)
	var held atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range tries {
		wg.Go(func() {
			<-start
			h := Hold{ID: claimOf(i).ID, Key: key, Amount: big.NewInt(10), Deadline: 2000}
			ok, left, err := stores[i%2].Hold(ctx, h, avail, 100, 1000, true)
			if err != nil {
				t.Errorf("hold %d: %v", i, err)
				return
			}
			if ok {
				held.Add(1)
			}
			if left.Sign() < 0 && ok {
				t.Errorf("hold %d held with %s left", i, left)
			}
		})
	}
	close(start)
	wg.Wait()
	if held.Load() != 20 {
		t.Fatalf("%d of %d holds of 10 against 200 were held, want exactly 20", held.Load(), tries)
	}
	holds, err := stores[0].HoldsOf(ctx, key)
	if err != nil || len(holds) != 20 {
		t.Fatalf("HoldsOf = %d holds, %v; want 20", len(holds), err)
	}
	sum := new(big.Int)
	for _, h := range holds {
		sum.Add(sum, h.Amount)
	}
	if sum.Cmp(avail) != 0 {
		t.Fatalf("holds sum to %s, want %s", sum, avail)
	}
}

// TestPostgresHoldRules: what Hold counts, deletes and answers, as cluster.go describes.
func TestPostgresHoldRules(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	const key = "k"
	hold := func(s *PostgresStore, n int, amount int64, deadline uint64, avail int64, readBlock, chainTime uint64, take bool) (bool, *big.Int) {
		t.Helper()
		h := Hold{ID: claimOf(n).ID, Key: key, Amount: big.NewInt(amount), Deadline: deadline}
		if n == 4 {
			h.PermitNonce = new(big.Int).Lsh(big.NewInt(1), 200)
		}
		ok, left, err := s.Hold(ctx, h, big.NewInt(avail), readBlock, chainTime, take)
		if err != nil {
			t.Fatal(err)
		}
		return ok, left
	}
	count := func() int {
		t.Helper()
		hs, err := a.HoldsOf(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return len(hs)
	}
	// Without take nothing is written.
	if ok, left := hold(a, 1, 60, 1000, 100, 10, 500, false); !ok || left.Int64() != 100 || count() != 0 {
		t.Fatalf("Hold without take = %v, %s with %d holds; want covered, 100 left, nothing held", ok, left, count())
	}
	if ok, left := hold(a, 1, 60, 1000, 100, 10, 500, true); !ok || left.Int64() != 100 {
		t.Fatalf("first hold = %v, %s; want held with 100 beside the others", ok, left)
	}
	if ok, left := hold(b, 2, 50, 1000, 100, 10, 500, true); ok || left.Int64() != 40 {
		t.Fatalf("hold of 50 beside 60 against 100 = %v, %s; want refused with 40 left", ok, left)
	}
	// A payment held already is covered by its own hold, however little is left.
	if ok, left := hold(b, 1, 60, 1000, 10, 10, 500, true); !ok || left.Int64() != 10 || count() != 1 {
		t.Fatalf("hold of a held payment = %v, %s (%d holds); want held, 10 left, still one hold", ok, left, count())
	}
	// Mined at block 20: it counts until a read at block 20 or later.
	if err := a.HoldMined(ctx, claimOf(1).ID, 20); err != nil {
		t.Fatal(err)
	}
	if err := a.HoldMined(ctx, claimOf(1).ID, 25); err != nil { // the first block recorded stays
		t.Fatal(err)
	}
	if ok, _ := hold(b, 2, 50, 1000, 100, 19, 500, false); ok {
		t.Fatal("a hold mined after the read still counts; hold of 50 was covered")
	}
	if hs, _ := a.HoldsOf(ctx, key); len(hs) != 1 || hs[0].Mined != 20 || hs[0].Deadline != 1000 || hs[0].Amount.Int64() != 60 {
		t.Fatalf("HoldsOf = %+v; want the hold of 60 mined at 20", hs)
	}
	// It no longer counts for a read at its block, but its row stays for a while: another instance's older read
	// still counts it (TestPostgresAMinedHoldOutlivesTheNewerReadOfAnotherInstance).
	if ok, left := hold(b, 2, 50, 1000, 100, 20, 500, true); !ok || left.Int64() != 100 || count() != 2 {
		t.Fatalf("hold after a read at the mined block = %v, %s (%d holds); want held, 100 left, the mined one kept", ok, left, count())
	}
	// Marked mined long ago, it goes at the next hold with take, and so does one never mined and past its deadline
	// (hold 2, deadline 1000, at chain time 1001).
	mined := claimOf(1).ID
	if _, err := a.pool.Exec(ctx, `UPDATE x402_holds SET mined_at = now() - interval '1 hour' WHERE id = $1`, mined[:]); err != nil {
		t.Fatal(err)
	}
	if ok, left := hold(a, 3, 30, 5000, 100, 21, 1001, true); !ok || left.Int64() != 100 {
		t.Fatalf("hold beside one past its deadline = %v, %s; want held with 100 left", ok, left)
	}
	hold(a, 4, 1, 5000, 100, 21, 1001, true)
	hs, err := b.HoldsOf(ctx, key)
	if err != nil || len(hs) != 2 || hs[0].ID != claimOf(3).ID || hs[1].PermitNonce == nil || hs[1].PermitNonce.Cmp(new(big.Int).Lsh(big.NewInt(1), 200)) != 0 {
		t.Fatalf("HoldsOf = %+v, %v; want holds 3 and 4 (with its permit nonce)", hs, err)
	}
	if err := b.Unhold(ctx, claimOf(3).ID, false); err != nil {
		t.Fatal(err)
	}
	if err := b.Unhold(ctx, claimOf(3).ID, false); err != nil {
		t.Fatalf("Unhold of an absent hold: %v", err)
	}
	if count() != 1 {
		t.Fatalf("%d holds after Unhold, want 1", count())
	}
	if hs, err := a.HoldsOf(ctx, "nobody"); err != nil || len(hs) != 0 {
		t.Fatalf("HoldsOf an unknown key = %v, %v", hs, err)
	}
}

// TestPostgresAnInstanceBeatsAgainAsSoonAsItsDatabaseIsBack: a heartbeat missed while the database was down is
// tried again within a fraction of a second, not at the next regular beat a third of the TTL later; an instance
// whose database comes back after a few seconds must not look dead to the others for want of a beat (they
// would take over its settlements while it still works on them).
func TestPostgresAnInstanceBeatsAgainAsSoonAsItsDatabaseIsBack(t *testing.T) {
	srv := pgtest.Start(t)
	ctx := context.Background()
	const ttl = 10 * time.Second // beats every 3.3 s
	s := openPostgres(t, srv.DSN(), Options{InstanceTTL: ttl, OpenTimeout: time.Second})
	srv.Stop(t)
	time.Sleep(ttl/3 + 300*time.Millisecond) // at least one beat falls in the outage
	srv.Restart(t)
	back := time.Now()

	other := openPostgres(t, srv.DSN(), Options{})
	for {
		var left time.Duration
		err := other.pool.QueryRow(ctx, `SELECT expires_at - now() FROM x402_instances WHERE token = $1`,
			s.Instance()).Scan(&left)
		if err != nil {
			t.Fatal(err)
		}
		if left > ttl-time.Second {
			t.Logf("the instance beat %v after the database was back", time.Since(back).Round(10*time.Millisecond))
			return
		}
		if time.Since(back) > time.Second {
			t.Fatalf("no beat within a second of the database coming back: the instance's row expires in %v", left)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPostgresContinuityChangesOnlyWhenTheInstanceMayHaveLookedDead: regular heartbeats keep the number; an
// outage longer than the heartbeat can vouch for changes it, during the outage and after it.
func TestPostgresContinuityChangesOnlyWhenTheInstanceMayHaveLookedDead(t *testing.T) {
	srv := pgtest.Start(t)
	const ttl = 3 * time.Second
	s := openPostgres(t, srv.DSN(), Options{InstanceTTL: ttl, OpenTimeout: time.Second})
	start := s.Continuity()
	time.Sleep(ttl) // three beats
	if got := s.Continuity(); got != start {
		t.Fatalf("Continuity moved from %d to %d with the heartbeat beating", start, got)
	}
	srv.Stop(t)
	time.Sleep(ttl)
	during := s.Continuity()
	if during == start {
		t.Fatalf("Continuity is still %d with no beat for %v of a %v TTL", during, ttl, ttl)
	}
	srv.Restart(t)
	time.Sleep(ttl / 2)
	after := s.Continuity()
	if after == during {
		t.Fatalf("Continuity is still %d after the first beat that followed the gap", after)
	}
	time.Sleep(ttl)
	if got := s.Continuity(); got != after {
		t.Fatalf("Continuity moved from %d to %d with the heartbeat beating again", after, got)
	}
}

// TestPostgresUnavailableDuringAnOutage: with the database down every call fails fast with ErrUnavailable,
// and once it is back the same store works again.
func TestPostgresUnavailableDuringAnOutage(t *testing.T) {
	srv := pgtest.Start(t)
	ctx := context.Background()
	s := openPostgres(t, srv.DSN(), Options{OpenTimeout: time.Second})
	claim := mustClaim(t, s, claimOf(1))
	first := claim.ID
	mustClaim(t, s, claimOf(2))
	srv.Stop(t)

	id := claimOf(3).ID
	calls := map[string]func() error{
		"Claim":         func() error { _, _, err := s.Claim(ctx, claimOf(3)); return err },
		"Get":           func() error { _, _, err := s.Get(ctx, first); return err },
		"Update":        func() error { _, err := s.Update(ctx, first, toBroadcast("0x1")); return err },
		"MarkServed":    func() error { return s.MarkServed(ctx, first, time.Now()) },
		"Release":       func() error { return s.Release(ctx, claim) },
		"ReleaseUnsent": func() error { return s.ReleaseUnsent(ctx, claim, "0x1") },
		"Pending":       func() error { _, err := s.Pending(ctx); return err },
		"PendingOf":     func() error { _, err := s.PendingOf(ctx, true); return err },
		"Prune":         func() error { _, err := s.Prune(ctx, time.Now()); return err },
		"Count":         func() error { _, err := s.Count(ctx); return err },
		"Backlog":       func() error { _, err := s.Backlog(ctx); return err },
		"Alive":         func() error { _, err := s.Alive(ctx, "x"); return err },
		"Instances":     func() error { _, _, err := s.Instances(ctx); return err },
		"Busy":          func() error { _, err := s.Busy(ctx, id); return err },
		"Idle":          func() error { return s.Idle(ctx, id) },
		"Lease":         func() error { _, err := s.Lease(ctx, "w", time.Minute); return err },
		"Unlease":       func() error { return s.Unlease(ctx, "w") },
		"Hold": func() error {
			_, _, err := s.Hold(ctx, Hold{ID: id, Key: "k", Amount: big.NewInt(1)}, big.NewInt(5), 1, 1, true)
			return err
		},
		"HoldMined": func() error { return s.HoldMined(ctx, id, 1) },
		"Unhold":    func() error { return s.Unhold(ctx, id, false) },
		"HoldsOf":   func() error { _, err := s.HoldsOf(ctx, "k"); return err },
	}
	for name, call := range calls {
		began := time.Now()
		err := call()
		if !errors.Is(err, ErrUnavailable) {
			t.Errorf("%s with the database down: %v, want ErrUnavailable", name, err)
		}
		if took := time.Since(began); took > 3*time.Second {
			t.Errorf("%s with the database down took %s", name, took)
		}
	}
	if t.Failed() {
		return
	}

	srv.Restart(t)
	got, claimed, err := s.Claim(ctx, claimOf(3))
	if err != nil || !claimed {
		t.Fatalf("Claim after the restart = %v, %v; want the store to reconnect", claimed, err)
	}
	if _, err := s.Update(ctx, got.ID, toBroadcast("0x3")); err != nil {
		t.Fatalf("Update after the restart: %v", err)
	}
	if n, err := s.Backlog(ctx); err != nil || n != 3 {
		t.Fatalf("Backlog after the restart = %d, %v; want 3", n, err)
	}
	if ok, err := s.Busy(ctx, id); err != nil || !ok {
		t.Fatalf("Busy after the restart = %v, %v", ok, err)
	}
}

// TestPostgresErrorsNeverShowThePassword: a DSN's password appears in no error, whatever the form of the DSN.
func TestPostgresErrorsNeverShowThePassword(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close() // nothing listens there now
	const pw = "s3cret-pw"
	for _, dsn := range []string{
		fmt.Sprintf("postgres://x402:%s@127.0.0.1:%d/journal?sslmode=disable", pw, port),
		fmt.Sprintf("host=127.0.0.1 port=%d user=x402 password=%s dbname=journal sslmode=disable", port, pw),
	} {
		began := time.Now()
		s, err := OpenPostgres(context.Background(), dsn, Options{OpenTimeout: time.Second})
		if err == nil {
			s.Close()
			t.Fatalf("OpenPostgres of a closed port succeeded")
		}
		if !errors.Is(err, ErrUnavailable) || strings.Contains(err.Error(), pw) {
			t.Fatalf("OpenPostgres of a closed port: %q; want ErrUnavailable without the password", err)
		}
		if took := time.Since(began); took > 3*time.Second {
			t.Fatalf("OpenPostgres of a closed port took %s", took)
		}
	}
	for _, dsn := range []string{
		fmt.Sprintf("postgres://x402:%s@127.0.0.1:notaport/journal", pw),
		fmt.Sprintf("postgres://x402:%s@127.0.0.1/journal?sslmode=nonsense", pw),
		fmt.Sprintf("host=127.0.0.1 password=%s sslmode=nonsense", pw),
	} {
		_, err := OpenPostgres(context.Background(), dsn, Options{})
		if err == nil || strings.Contains(err.Error(), pw) {
			t.Fatalf("OpenPostgres of a bad DSN: %v; want an error without the password", err)
		}
	}
}

// pgQuery runs a query on dsn's database and hands each row to scan.
func pgQuery(t testing.TB, dsn, sql string, scan func(pgx.Rows) error) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, sql)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows); err != nil {
			t.Fatal(err)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestPostgresRestartMidLoad: claims and updates under way while the database restarts either succeed or fail
// with ErrUnavailable, and a caller that repeats what failed ends with every payment claimed once, by itself.
func TestPostgresRestartMidLoad(t *testing.T) {
	srv := pgtest.Start(t)
	restartMidLoad(t, srv, srv.DSN())
}

// restartMidLoad is TestPostgresRestartMidLoad with the store opened on dsn, which reaches srv.
func restartMidLoad(t *testing.T, srv *pgtest.Server, dsn string) {
	ctx := context.Background()
	s := openPostgres(t, dsn, Options{OpenTimeout: time.Second})
	const workers, each = 4, 150
	var unavailable, done atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			owner := fmt.Sprintf("worker-%d", w)
			for i := range each {
				r := claimOf(7000 + w*each + i)
				r.Owner = owner
				for try := 0; ; try++ {
					got, _, err := s.Claim(ctx, r)
					if err == nil {
						// Claimed by this call, or by an earlier try whose answer the restart lost: either way the
						// claim is this worker's.
						if got.Owner != owner {
							t.Errorf("payment %d claimed by %q, want %q", i, got.Owner, owner)
							return
						}
						_, err = s.Update(ctx, r.ID, toBroadcast(fmt.Sprintf("0x%x", w*each+i)))
					}
					if err == nil {
						done.Add(1)
						break
					}
					if !errors.Is(err, ErrUnavailable) || try == 200 {
						t.Errorf("%s, payment %d: %v; want success or ErrUnavailable", owner, i, err)
						return
					}
					unavailable.Add(1)
					time.Sleep(20 * time.Millisecond)
				}
			}
		})
	}
	// The restart comes while most of the load is still to do, however fast this machine runs it.
	for done.Load() < workers*each/10 {
		time.Sleep(time.Millisecond)
	}
	srv.Restart(t)
	restarted := done.Load()
	wg.Wait()
	if t.Failed() {
		return
	}
	t.Logf("%d calls failed with ErrUnavailable during the restart, which came after %d of %d payments", unavailable.Load(), restarted, workers*each)
	if restarted == workers*each {
		t.Fatal("the load was over before the database restarted")
	}
	pending, err := s.Pending(ctx)
	if err != nil || len(pending) != workers*each {
		t.Fatalf("Pending = %d, %v; want %d", len(pending), err, workers*each)
	}
	for _, r := range pending {
		if r.State != StateBroadcast {
			t.Fatalf("%s is %q, want broadcast", r.ID, r.State)
		}
	}
}

// TestOpenPostgresByManyProcessesAtOnceOnAFreshDatabase opens eight stores at the same moment on each of several
// fresh databases, as the Caddy instances of a cluster do when they start together: every open must succeed.
// Concurrent CREATE TABLE IF NOT EXISTS of the migrations table can fail with a duplicate table (42P07), a
// duplicate row of the catalog (23505) or a duplicate type (42710, seen from three Caddy processes starting
// together); each means another process created it, and the open goes on.
func TestOpenPostgresByManyProcessesAtOnceOnAFreshDatabase(t *testing.T) {
	const databases, opens = 4, 8
	for range databases {
		dsn := pgtest.Shared(t)
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, opens)
		for range opens {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				s, err := OpenPostgres(context.Background(), dsn, Options{})
				if err != nil {
					errs <- err
					return
				}
				s.Close()
			}()
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("OpenPostgres on a fresh database, %d at once: %v", opens, err)
		}
	}
}

// TestPostgresUpdateFencedWritesOnlyUnderTheLeaseAtItsFence: the write-ahead record of a transaction signed with a
// leased wallet goes in only while the writer holds the lease at the fence it signed under.
func TestPostgresUpdateFencedWritesOnlyUnderTheLeaseAtItsFence(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	r := claimOf(9100)
	mustClaim(t, a, r)
	la, err := a.Lease(ctx, "wallet-f", 500*time.Millisecond)
	if err != nil || !la.Held {
		t.Fatalf("Lease = %+v, %v", la, err)
	}
	mark := func(s *PostgresStore, fence uint64) error {
		_, err := s.UpdateFenced(ctx, r.ID, "wallet-f", fence, func(rec *Record) error { rec.Attempts++; return nil })
		return err
	}
	if err := mark(a, la.Fence); err != nil {
		t.Fatalf("UpdateFenced by the holder at its fence: %v", err)
	}
	for name, try := range map[string]func() error{
		"by the holder at an older fence":  func() error { return mark(a, la.Fence-1) },
		"by another instance at the fence": func() error { return mark(b, la.Fence) },
		"of a lease nobody ever took":      func() error { _, err := a.UpdateFenced(ctx, r.ID, "wallet-none", 1, nil); return err },
	} {
		if err := try(); !errors.Is(err, ErrFenced) {
			t.Errorf("UpdateFenced %s = %v; want ErrFenced", name, err)
		}
	}
	time.Sleep(700 * time.Millisecond) // the lease expires
	if err := mark(a, la.Fence); !errors.Is(err, ErrFenced) {
		t.Errorf("UpdateFenced under an expired lease = %v; want ErrFenced", err)
	}
	lb, err := b.Lease(ctx, "wallet-f", time.Minute)
	if err != nil || !lb.Held || lb.Fence != la.Fence+1 {
		t.Fatalf("takeover = %+v, %v; want held at fence %d", lb, err, la.Fence+1)
	}
	if err := mark(a, la.Fence); !errors.Is(err, ErrFenced) {
		t.Errorf("UpdateFenced by the old holder after a takeover = %v; want ErrFenced", err)
	}
	if err := mark(b, lb.Fence); err != nil {
		t.Errorf("UpdateFenced by the new holder: %v", err)
	}
	got, _, err := a.Get(ctx, r.ID)
	if err != nil || got.Attempts != 2 {
		t.Fatalf("the record took %d of the writes (%v); want 2, the holders' at their fences", got.Attempts, err)
	}
}
