package journal

import (
	"context"
	"errors"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// batchCount is a pgx tracer that counts the round trips a store makes: each statement sent alone and each batch.
type batchCount struct {
	mu   sync.Mutex
	sent []string
}

func (c *batchCount) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sent = append(c.sent, d.SQL)
	return ctx
}

func (c *batchCount) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *batchCount) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sent = append(c.sent, "BATCH: "+strconv.Itoa(d.Batch.Len())+" statements")
	return ctx
}

func (c *batchCount) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *batchCount) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// take returns the payment's round trips sent since the last take: the store's heartbeat is left out.
func (c *batchCount) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, s := range c.sent {
		if !strings.Contains(s, "x402_instances") {
			out = append(out, s)
		}
	}
	c.sent = nil
	return out
}

// TestPostgresAHoldWithTakeIsOneRoundTrip: Hold with take, and UnrecordedAndHeld, of a payment new or held
// already, past the funds, recorded or not, send one batch to the database each (one round trip, once the
// connection has prepared its statements), directly and through PgBouncer.
func TestPostgresAHoldWithTakeIsOneRoundTrip(t *testing.T) {
	throughEitherWay(t, testPostgresAHoldWithTakeIsOneRoundTrip)
}

func testPostgresAHoldWithTakeIsOneRoundTrip(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	rt := &batchCount{}
	s := openPostgres(t, dsn, Options{Tracer: rt})
	key := "one-trip:" + strconv.Itoa(n)
	hold := func(i int, served bool) Hold {
		return Hold{ID: claimOf(20000 + n + i).ID, Key: key, Amount: big.NewInt(10), Deadline: 2000, Served: served}
	}
	if _, _, err := s.Claim(ctx, claimOf(20000+n+9)); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		name   string
		run    func() (bool, error)
		wantOK bool
	}{
		{"hold", func() (bool, error) {
			ok, _, err := s.Hold(ctx, hold(1, false), big.NewInt(100), 1, 1, true)
			return ok, err
		}, true},
		{"hold again, served", func() (bool, error) {
			ok, _, err := s.Hold(ctx, hold(1, true), big.NewInt(100), 1, 1, true)
			return ok, err
		}, true},
		{"hold past the funds", func() (bool, error) {
			ok, _, err := s.Hold(ctx, Hold{ID: hold(2, false).ID, Key: key, Amount: big.NewInt(91), Deadline: 2000}, big.NewInt(100), 1, 1, true)
			return ok, err
		}, false},
		{"unrecorded and held", func() (bool, error) {
			unrecorded, ok, _, err := UnrecordedAndHeld(ctx, s, hold(3, true), big.NewInt(100), 1, 1)
			return unrecorded && ok, err
		}, true},
		{"recorded, not held", func() (bool, error) {
			unrecorded, ok, _, err := UnrecordedAndHeld(ctx, s, hold(9, true), big.NewInt(100), 1, 1)
			return unrecorded || ok, err
		}, false},
	} {
		rt.take()
		ok, err := step.run()
		if err != nil || ok != step.wantOK {
			t.Fatalf("%s = %v, %v; want %v", step.name, ok, err, step.wantOK)
		}
		if sent := rt.take(); len(sent) != 1 {
			t.Errorf("%s cost %d round trips, want 1: %q", step.name, len(sent), sent)
		}
	}
	holds, err := s.HoldsOf(ctx, key)
	if err != nil || len(holds) != 2 || holds[0].ID != hold(1, false).ID || !holds[0].Served || holds[1].ID != hold(3, false).ID {
		t.Fatalf("HoldsOf = %+v, %v; want hold 1 (marked served) and 3", holds, err)
	}
}

// TestPostgresTheHoldStatementAndDecideHoldAgree: a hold with take is decided by the database's statement (which
// inserts h, or marks it served) and answered by decideHold from the holds the statement read; they are one rule
// written twice. On the same holds, what the database writes and what decideHold answers agree at every edge:
// room for exactly the amount, one wei short, holds mined at or after the read's block, past or at their deadline,
// h held already (served or not, with too little left beside it), h's own hold past its deadline, numbers past
// 64 bits, a recorded payment (UnrecordedAndHeld), which writes nothing, and another hold that counts carrying h's
// permit nonce, which refuses h whatever the funds.
func TestPostgresTheHoldStatementAndDecideHoldAgree(t *testing.T) {
	throughEitherWay(t, testPostgresTheHoldStatementAndDecideHoldAgree)
}

func testPostgresTheHoldStatementAndDecideHoldAgree(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	const readBlock, chainTime = 50, 1000
	big200 := new(big.Int).Lsh(big.NewInt(1), 200)
	type other struct {
		amount          *big.Int
		deadline, mined uint64
		served, self    bool // self: h's own hold
		nonce           *big.Int
	}
	live := func(amount int64) other { return other{amount: big.NewInt(amount), deadline: 5000} }
	for i, tc := range []struct {
		name     string
		others   []other
		amount   *big.Int
		avail    *big.Int
		served   bool
		recorded bool
		nonce    *big.Int // h's permit nonce
		clash    bool     // refused for it: Hold says ErrPermitNonceHeld
		wantOK   bool
		wantLeft int64 // unless recorded
	}{
		{name: "no holds, the amount is all there is", amount: big.NewInt(100), avail: big.NewInt(100), wantOK: true, wantLeft: 100},
		{name: "room for exactly the amount", others: []other{live(25), live(35)}, amount: big.NewInt(40), avail: big.NewInt(100), wantOK: true, wantLeft: 40},
		{name: "one wei short", others: []other{live(25), live(35)}, amount: big.NewInt(41), avail: big.NewInt(100), wantLeft: 40},
		{name: "nothing for nothing", amount: big.NewInt(0), avail: big.NewInt(0), wantOK: true},
		{name: "others over the funds already", others: []other{live(120)}, amount: big.NewInt(0), avail: big.NewInt(100), wantLeft: -20},
		{name: "mined at the read's block: gone", others: []other{{amount: big.NewInt(90), deadline: 5000, mined: readBlock}}, amount: big.NewInt(100), avail: big.NewInt(100), wantOK: true, wantLeft: 100},
		{name: "mined after the read's block: counts", others: []other{{amount: big.NewInt(90), deadline: 5000, mined: readBlock + 1}}, amount: big.NewInt(11), avail: big.NewInt(100), wantLeft: 10},
		{name: "past its deadline: gone", others: []other{{amount: big.NewInt(90), deadline: chainTime - 1}}, amount: big.NewInt(100), avail: big.NewInt(100), wantOK: true, wantLeft: 100},
		{name: "at its deadline: counts", others: []other{{amount: big.NewInt(90), deadline: chainTime}}, amount: big.NewInt(11), avail: big.NewInt(100), wantLeft: 10},
		{name: "mined, past its deadline, after the read's block: counts", others: []other{{amount: big.NewInt(90), deadline: 1, mined: readBlock + 1}}, amount: big.NewInt(11), avail: big.NewInt(100), wantLeft: 10},
		{name: "served holds count", others: []other{{amount: big.NewInt(90), deadline: 5000, served: true}}, amount: big.NewInt(11), avail: big.NewInt(100), wantLeft: 10},
		{name: "held already, too little left beside it", others: []other{live(95), {amount: big.NewInt(10), deadline: 5000, self: true}}, amount: big.NewInt(10), avail: big.NewInt(100), wantOK: true, wantLeft: 5},
		{name: "held already, now served", others: []other{live(95), {amount: big.NewInt(10), deadline: 5000, self: true}}, amount: big.NewInt(10), avail: big.NewInt(100), served: true, wantOK: true, wantLeft: 5},
		{name: "served, held for the first time", others: []other{live(60)}, amount: big.NewInt(40), avail: big.NewInt(100), served: true, wantOK: true, wantLeft: 40},
		{name: "its own hold past its deadline: held anew", others: []other{live(60), {amount: big.NewInt(40), deadline: chainTime - 1, self: true}}, amount: big.NewInt(40), avail: big.NewInt(100), wantOK: true, wantLeft: 40},
		{name: "its own hold past its deadline, no room now", others: []other{live(61), {amount: big.NewInt(40), deadline: chainTime - 1, self: true}}, amount: big.NewInt(40), avail: big.NewInt(100), wantLeft: 39},
		{name: "past 64 bits, exactly", others: []other{{amount: big200, deadline: 5000}}, amount: big.NewInt(1), avail: new(big.Int).Add(big200, big.NewInt(1)), wantOK: true, wantLeft: 1},
		{name: "past 64 bits, one wei short", others: []other{{amount: big200, deadline: 5000}}, amount: big.NewInt(1), avail: big200, wantLeft: 0},
		{name: "recorded: nothing written", others: []other{live(10)}, amount: big.NewInt(10), avail: big.NewInt(100), served: true, recorded: true},
		{name: "recorded and held already: not marked served", others: []other{{amount: big.NewInt(10), deadline: 5000, self: true}}, amount: big.NewInt(10), avail: big.NewInt(100), served: true, recorded: true},
		{name: "another hold carries its permit nonce: refused, room or not", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(7)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), clash: true, wantLeft: 90},
		{name: "a served hold carries its permit nonce: refused", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(7), served: true}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), served: true, clash: true, wantLeft: 90},
		{name: "a hold of its permit nonce past 64 bits: refused", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: new(big.Int).SetBit(big.NewInt(0), 255, 1)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: new(big.Int).SetBit(big.NewInt(0), 255, 1), clash: true, wantLeft: 90},
		{name: "a hold of its permit nonce mined after the read's block: refused", others: []other{{amount: big.NewInt(10), deadline: 5000, mined: readBlock + 1, nonce: big.NewInt(7)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), clash: true, wantLeft: 90},
		{name: "a hold of its permit nonce mined at the read's block: gone", others: []other{{amount: big.NewInt(10), deadline: 5000, mined: readBlock, nonce: big.NewInt(7)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), wantOK: true, wantLeft: 100},
		{name: "a hold of its permit nonce past its deadline: gone", others: []other{{amount: big.NewInt(10), deadline: chainTime - 1, nonce: big.NewInt(7)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), wantOK: true, wantLeft: 100},
		{name: "a hold of another permit nonce", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(8)}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), wantOK: true, wantLeft: 90},
		{name: "no permit nonce, beside a hold that carries one", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(7)}}, amount: big.NewInt(10), avail: big.NewInt(100), wantOK: true, wantLeft: 90},
		{name: "held already with its permit nonce, beside another hold of it", others: []other{{amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(7)}, {amount: big.NewInt(10), deadline: 5000, nonce: big.NewInt(7), self: true}}, amount: big.NewInt(10), avail: big.NewInt(100), nonce: big.NewInt(7), wantOK: true, wantLeft: 90},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key := "agree:" + strconv.Itoa(n) + ":" + strconv.Itoa(i)
			base := 21000 + n*100 + i*4
			h := Hold{ID: claimOf(base).ID, Key: key, Amount: tc.amount, Deadline: 4000, Served: tc.served, PermitNonce: tc.nonce}
			for j, o := range tc.others {
				id := claimOf(base + 1 + j).ID
				if o.self {
					id = h.ID
				}
				stored := Hold{ID: id, Key: key, Amount: o.amount, Deadline: o.deadline, Mined: o.mined, Served: o.served, PermitNonce: o.nonce}
				if _, err := a.pool.Exec(ctx, pgInsertHold, holdArgs(stored)...); err != nil {
					t.Fatal(err)
				}
			}
			before, err := a.HoldsOf(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			wantOK, wantLeft, wantHeld := decideHold(before, h, tc.avail, readBlock, chainTime)
			var (
				ok   bool
				left *big.Int
			)
			if tc.recorded {
				if _, _, err := b.Claim(ctx, claimOf(base)); err != nil {
					t.Fatal(err)
				}
				var unrecorded bool
				unrecorded, ok, left, err = UnrecordedAndHeld(ctx, b, h, tc.avail, readBlock, chainTime)
				if err != nil || unrecorded || ok || left != nil {
					t.Fatalf("UnrecordedAndHeld of a recorded payment = unrecorded %v, ok %v, left %v, %v; want recorded, nothing else", unrecorded, ok, left, err)
				}
			} else {
				ok, left, err = b.Hold(ctx, h, tc.avail, readBlock, chainTime, true)
				if tc.clash != errors.Is(err, ErrPermitNonceHeld) || (err != nil && !tc.clash) {
					t.Fatalf("Hold = %v; want ErrPermitNonceHeld %v", err, tc.clash)
				}
				if ok != wantOK || left.Cmp(wantLeft) != 0 {
					t.Fatalf("Hold = %v, %s; decideHold on the same holds says %v, %s", ok, left, wantOK, wantLeft)
				}
				if ok != tc.wantOK || left.Cmp(big.NewInt(tc.wantLeft)) != 0 {
					t.Fatalf("Hold = %v, %s; want %v, %d", ok, left, tc.wantOK, tc.wantLeft)
				}
			}
			after, err := a.HoldsOf(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			// What the database holds now: the holds that still count, and h when decideHold says held or newly
			// covered (not for a recorded payment, whose transaction wrote no hold).
			var want []ID
			for _, o := range before {
				if (o.Mined != 0 && o.Mined <= readBlock) || (o.Mined == 0 && o.Deadline < chainTime) {
					continue
				}
				want = append(want, o.ID)
			}
			if !tc.recorded && !wantHeld && wantOK {
				want = append(want, h.ID)
			}
			var got []ID
			for _, o := range after {
				got = append(got, o.ID)
				if o.ID != h.ID {
					continue
				}
				wasServed := slices.ContainsFunc(before, func(p Hold) bool { return p.ID == h.ID && p.Served })
				if wantServed := !tc.recorded && tc.served || wasServed; o.Served != wantServed {
					t.Errorf("h's hold served %v, want %v", o.Served, wantServed)
				}
				if !wantHeld && !tc.recorded && (o.Amount.Cmp(h.Amount) != 0 || o.Deadline != h.Deadline) {
					t.Errorf("h's hold = %+v, want h's amount and deadline", o)
				}
			}
			slices.SortFunc(got, func(x, y ID) int { return strings.Compare(x.String(), y.String()) })
			slices.SortFunc(want, func(x, y ID) int { return strings.Compare(x.String(), y.String()) })
			if !slices.Equal(got, want) {
				t.Fatalf("holds after = %v, want %v (decideHold: ok %v, held already %v)", got, want, wantOK, wantHeld)
			}
		})
	}
}

// TestPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit: 160 holds of one payer's key, of 1 to 17
// against 1000 (100 held already, and two holds of 500 that no longer count, one mined at the read's block, one
// past its deadline), sent at once from two stores, half as Hold with take and half as UnrecordedAndHeld, one in
// eight presented twice at once (once to each store), beside payments with a record that must hold nothing. The
// holds stored never sum past the funds; they are exactly the ones answered held; a payment presented twice gets
// one answer; and no hold was refused that would fit beside what is held at the end (holds only came, so a refusal
// had less room than that): the key's holds were decided one at a time, each seeing every one before it.
func TestPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit(t *testing.T) {
	throughEitherWay(t, testPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit)
}

// TestPostgresHoldsNeverOverCommitWhateverTheDatabasesDefaultIsolation: the same, on a database whose default
// transaction isolation is REPEATABLE READ or SERIALIZABLE (set for the store's sessions in its DSN): the hold's
// transaction says READ COMMITTED, under which its lock is seen by its reads.
func TestPostgresHoldsNeverOverCommitWhateverTheDatabasesDefaultIsolation(t *testing.T) {
	dsn := pgtest.Shared(t)
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	t.Run("repeatable read", func(t *testing.T) {
		testPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit(t, dsn+sep+"default_transaction_isolation=repeatable%20read", 200)
	})
	t.Run("serializable", func(t *testing.T) {
		testPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit(t, dsn+sep+"default_transaction_isolation=serializable", 300)
	})
}

func testPostgresConcurrentHoldsOfOneKeyFromTwoStoresNeverOverCommit(t *testing.T, dsn string, n int) {
	ctx := context.Background()
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	const readBlock, chainTime, tries, recordedTries = 50, 1000, 160, 8
	key := "race:" + strconv.Itoa(n)
	base := 30000 + n*1000
	avail := big.NewInt(1000)
	for _, pre := range []Hold{
		{ID: claimOf(base).ID, Key: key, Amount: big.NewInt(100), Deadline: 5000, Served: true},
		{ID: claimOf(base + 1).ID, Key: key, Amount: big.NewInt(500), Deadline: 5000, Mined: readBlock},
		{ID: claimOf(base + 2).ID, Key: key, Amount: big.NewInt(500), Deadline: chainTime - 1},
	} {
		if _, err := stores[0].pool.Exec(ctx, pgInsertHold, holdArgs(pre)...); err != nil {
			t.Fatal(err)
		}
	}
	for i := range recordedTries {
		if _, _, err := stores[i%2].Claim(ctx, claimOf(base+500+i)); err != nil {
			t.Fatal(err)
		}
	}
	type answer struct {
		h          Hold
		unrecorded bool
		ok         bool
		left       *big.Int
	}
	var (
		mu      sync.Mutex
		answers []answer
		wg      sync.WaitGroup
	)
	start := make(chan struct{})
	try := func(s *PostgresStore, h Hold, viaRecord bool) {
		wg.Go(func() {
			<-start
			a := answer{h: h, unrecorded: true}
			var err error
			if viaRecord {
				a.unrecorded, a.ok, a.left, err = UnrecordedAndHeld(ctx, s, h, avail, readBlock, chainTime)
			} else {
				a.ok, a.left, err = s.Hold(ctx, h, avail, readBlock, chainTime, true)
			}
			if err != nil {
				t.Errorf("hold of %d: %v", h.Amount, err)
				return
			}
			mu.Lock()
			answers = append(answers, a)
			mu.Unlock()
		})
	}
	for i := range tries {
		h := Hold{ID: claimOf(base + 10 + i).ID, Key: key, Amount: big.NewInt(int64(i%17 + 1)), Deadline: 4000, Served: i%3 == 0}
		try(stores[i%2], h, i%4 < 2)
		if i%8 == 0 {
			try(stores[(i+1)%2], h, i%4 >= 2)
		}
	}
	for i := range recordedTries {
		try(stores[i%2], Hold{ID: claimOf(base + 500 + i).ID, Key: key, Amount: big.NewInt(1), Deadline: 4000}, true)
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}

	holds, err := stores[0].HoldsOf(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	stored := map[ID]bool{}
	sum := new(big.Int)
	for _, h := range holds {
		stored[h.ID] = true
		sum.Add(sum, h.Amount)
	}
	if sum.Cmp(avail) > 0 {
		t.Fatalf("the holds stored sum to %s, past the payer's %s: over-committed", sum, avail)
	}
	if !stored[claimOf(base).ID] || stored[claimOf(base+1).ID] || stored[claimOf(base+2).ID] {
		t.Fatalf("holds stored before: the live one %v, the mined one %v, the one past its deadline %v; want only the live one",
			stored[claimOf(base).ID], stored[claimOf(base+1).ID], stored[claimOf(base+2).ID])
	}
	room := new(big.Int).Sub(avail, sum)
	answered := map[ID]bool{}
	for _, a := range answers {
		recorded := false
		for i := range recordedTries {
			recorded = recorded || a.h.ID == claimOf(base+500+i).ID
		}
		switch {
		case recorded:
			if a.unrecorded || a.ok || stored[a.h.ID] {
				t.Errorf("a recorded payment's hold = unrecorded %v, ok %v, stored %v; want nothing held", a.unrecorded, a.ok, stored[a.h.ID])
			}
			continue
		case !a.unrecorded:
			t.Errorf("a payment without a record answered recorded")
		case a.ok != stored[a.h.ID]:
			t.Errorf("hold of %s answered ok %v, stored %v", a.h.Amount, a.ok, stored[a.h.ID])
		case a.ok && a.left.Cmp(a.h.Amount) < 0:
			t.Errorf("hold of %s answered held with %s left beside the others", a.h.Amount, a.left)
		case !a.ok && a.h.Amount.Cmp(room) <= 0:
			t.Errorf("hold of %s refused, though %s is left at the end and nothing was let go", a.h.Amount, room)
		}
		if ok, seen := answered[a.h.ID]; seen && ok != a.ok {
			t.Errorf("a payment presented twice answered %v and %v", ok, a.ok)
		}
		answered[a.h.ID] = a.ok
	}
	held := 0
	for _, ok := range answered {
		if ok {
			held++
		}
	}
	if len(stored)-1 != held {
		t.Errorf("%d holds stored beside the one before, %d payments answered held", len(stored)-1, held)
	}
	t.Logf("%d of %d payments held, %s of %s committed", held, len(answered), sum, avail)
}

// decideHold is the rule of Hold in Go, over the holds of h's key: whether h is held or covered (ok), what the
// key's funds cover beside the other holds (left), and whether h was held already. pgHoldSQL and pgCoveredSQL
// state it in the database, over sums; the tests hold them to it.
func decideHold(holds []Hold, h Hold, avail *big.Int, readBlock, chainTime uint64) (ok bool, left *big.Int, held bool) {
	others := new(big.Int)
	clash := false // another hold that counts carries h's permit nonce
	for _, o := range holds {
		if (o.Mined != 0 && o.Mined <= readBlock) || (o.Mined == 0 && o.Deadline < chainTime) {
			continue // take deleted it already; without take it only does not count
		}
		if o.ID == h.ID {
			held = true
			continue
		}
		others.Add(others, o.Amount)
		clash = clash || (h.PermitNonce != nil && o.PermitNonce != nil && o.PermitNonce.Cmp(h.PermitNonce) == 0)
	}
	left = new(big.Int).Sub(avail, others)
	return held || (!clash && left.Cmp(h.Amount) >= 0), left, held
}
