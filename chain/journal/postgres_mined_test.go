package journal

import (
	"context"
	"math/big"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// TestPostgresAMinedHoldOutlivesTheNewerReadOfAnotherInstance: instance A read the payer's 1000 at block 100 and
// holds X (600); X is mined at block 105. Instance B, from a read at block 110 (which shows X's transfer), holds Y
// (100). A, still answering from its block-100 read (a funds read answers for FundsCacheTTL, many dev-chain
// blocks), then asks to hold Z (600): X must still count for A's read, which does not show X's transfer, so Z is
// refused: 600 + 100 + 600 is past 1000. B's hold must not have deleted X's row, by Hold or by UnrecordedAndHeld.
func TestPostgresAMinedHoldOutlivesTheNewerReadOfAnotherInstance(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a, b := openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})
	for i, unrecorded := range []bool{false, true} {
		t.Run("unrecorded "+strconv.FormatBool(unrecorded), func(t *testing.T) {
			key := "mined:outlives:" + strconv.Itoa(i)
			base := 31000 + i*10
			hold := func(s *PostgresStore, n int, amount int64, avail int64, readBlock uint64) (bool, *big.Int) {
				t.Helper()
				h := Hold{ID: claimOf(base + n).ID, Key: key, Amount: big.NewInt(amount), Deadline: 5000}
				var (
					ok   bool
					left *big.Int
					err  error
				)
				if unrecorded {
					_, ok, left, err = UnrecordedAndHeld(ctx, s, h, big.NewInt(avail), readBlock, 1000)
				} else {
					ok, left, err = s.Hold(ctx, h, big.NewInt(avail), readBlock, 1000, true)
				}
				if err != nil {
					t.Fatal(err)
				}
				return ok, left
			}
			if ok, _ := hold(a, 1, 600, 1000, 100); !ok {
				t.Fatal("A's hold of X (600 of 1000) refused")
			}
			if err := a.HoldMined(ctx, claimOf(base+1).ID, 105); err != nil {
				t.Fatal(err)
			}
			// B's read at block 110 shows X's transfer: 400 left.
			if ok, _ := hold(b, 2, 100, 400, 110); !ok {
				t.Fatal("B's hold of Y (100 of 400) refused")
			}
			if ok, left := hold(a, 3, 600, 1000, 100); ok {
				holds, _ := a.HoldsOf(ctx, key)
				t.Fatalf("A's hold of Z (600) from its block-100 read held, %s left beside the others: over-committed "+
					"(X 600 mined at 105 + Y 100 + Z 600 past the payer's 1000); holds stored now: %d (X's row deleted by B's hold at block 110)",
					left, len(holds))
			}
		})
	}
}

// TestPostgresAMinedHoldGoesOnceNoReadThatMissesItCanAnswer: a hold marked mined is deleted by a hold with take from
// a read at or after its block once it was marked longer ago than the longest a read answers for
// (ReadsAnswerFor, the longest told) and Options.MinedHoldsKept more, and not before: a busy payer's rows do not
// pile up. A hold marked before the schema kept the mark's time (mined_at NULL) goes at once, as before.
func TestPostgresAMinedHoldGoesOnceNoReadThatMissesItCanAnswer(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	s := openPostgres(t, dsn, Options{MinedHoldsKept: 10 * time.Second})
	s.ReadsAnswerFor(30 * time.Second)
	s.ReadsAnswerFor(2 * time.Second) // the longest told stays
	if got := openPostgres(t, dsn, Options{MinedHoldsKept: time.Millisecond}).minedHoldsSlack(); got != minMinedHoldsKept {
		t.Fatalf("minedHoldsSlack with MinedHoldsKept 1ms = %v, want the floor %v", got, minMinedHoldsKept)
	}
	if got := openPostgres(t, dsn, Options{}).minedHoldsSlack(); got != defaultMinedHoldsKept {
		t.Fatalf("minedHoldsSlack by default = %v, want %v", got, defaultMinedHoldsKept)
	}
	const key = "mined:goes"
	x := claimOf(32001).ID
	held := func(n int, readBlock uint64) { t.Helper(); holdOneOf(t, s, key, claimOf(32000+n).ID, readBlock) }
	stored := func() bool { t.Helper(); return holdStored(t, s, key, x) }
	markedAgo := func(ago string) {
		t.Helper()
		if _, err := s.pool.Exec(ctx, `UPDATE x402_holds SET mined_at = now() - $2::interval WHERE id = $1`, x[:], ago); err != nil {
			t.Fatal(err)
		}
	}
	held(1, 100)
	if err := s.HoldMined(ctx, x, 105); err != nil {
		t.Fatal(err)
	}
	held(2, 110)
	if !stored() {
		t.Fatal("a hold marked mined just now was deleted by a hold from a newer read")
	}
	markedAgo("35 seconds")
	held(3, 110)
	if !stored() {
		t.Fatal("a hold marked mined 35s ago was deleted while reads answer for 30s and 10s more are kept")
	}
	markedAgo("45 seconds")
	held(4, 104)
	if !stored() {
		t.Fatal("a hold marked mined at block 105 was deleted by a hold from a read at block 104, which must count it")
	}
	held(5, 110)
	if stored() {
		t.Fatal("a hold marked mined 45s ago is still stored after a hold from a newer read: rows pile up")
	}
	// Marked before the migration: no time kept, gone at once.
	y := claimOf(32006).ID
	held(6, 110)
	if _, err := s.pool.Exec(ctx, `UPDATE x402_holds SET mined = 106, mined_at = NULL WHERE id = $1`, y[:]); err != nil {
		t.Fatal(err)
	}
	held(7, 110)
	if holds, err := s.HoldsOf(ctx, key); err != nil || len(holds) != 5 || holds[0].ID == y {
		t.Fatalf("HoldsOf = %d holds, %v; want 5 (2, 3, 4, 5, 7), the one mined without a time gone", len(holds), err)
	}
}

// markedMinedAt reports whether the hold of id is stored with the time its mark of mined was written: a write
// that marks a hold mined without it would let the hold go at once, as one marked long ago.
func markedMinedAt(t *testing.T, s *PostgresStore, id ID) bool {
	t.Helper()
	var marked bool
	if err := s.pool.QueryRow(context.Background(), `SELECT mined <> 0 AND mined_at IS NOT NULL AND mined_at > now() - interval '1 minute' FROM x402_holds WHERE id = $1`, id[:]).Scan(&marked); err != nil {
		t.Fatalf("the hold of %s: %v", id, err)
	}
	return marked
}

// TestPostgresAMinedHoldIsKeptForTheInstanceWhoseReadsAnswerLongest: the instances of a cluster may answer from
// their funds reads for different times. An instance whose own reads answer for 2s keeps a mined hold for as long
// as another instance's reads answer (5 minutes here), and a minute more: that instance may still hold from a read
// that does not show the hold's transfer. Once that instance is gone (closed), the hold goes.
func TestPostgresAMinedHoldIsKeptForTheInstanceWhoseReadsAnswerLongest(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	a := openPostgres(t, dsn, Options{})
	a.ReadsAnswerFor(2 * time.Second)
	b, err := OpenPostgres(ctx, dsn, Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.ReadsAnswerFor(5 * time.Minute)
	const key = "mined:longest"
	x := claimOf(33001).ID
	held := func(n int, readBlock uint64) { t.Helper(); holdOneOf(t, a, key, claimOf(33000+n).ID, readBlock) }
	stored := func() bool { t.Helper(); return holdStored(t, a, key, x) }
	held(1, 100)
	if err := a.HoldMined(ctx, x, 105); err != nil {
		t.Fatal(err)
	}
	if _, err := a.pool.Exec(ctx, `UPDATE x402_holds SET mined_at = now() - interval '5 minutes 30 seconds' WHERE id = $1`, x[:]); err != nil {
		t.Fatal(err)
	}
	held(2, 110)
	if !stored() {
		t.Fatal("a hold marked mined 5m30s ago was deleted by an instance whose own reads answer for 2s, while another's answer for 5m")
	}
	b.Close()
	held(3, 110)
	if stored() {
		t.Fatal("a hold marked mined 5m30s ago is still stored after the instance whose reads answer for 5m closed")
	}
}

// holdOneOf holds id, an amount of 1, against key's funds of 100 with take, read at readBlock, and fails the test
// unless it is held.
func holdOneOf(t *testing.T, s *PostgresStore, key string, id ID, readBlock uint64) {
	t.Helper()
	h := Hold{ID: id, Key: key, Amount: big.NewInt(1), Deadline: 5000}
	if ok, _, err := s.Hold(context.Background(), h, big.NewInt(100), readBlock, 1000, true); err != nil || !ok {
		t.Fatalf("hold %s = %v, %v", id, ok, err)
	}
}

// holdStored reports whether key's holds in s list id.
func holdStored(t *testing.T, s *PostgresStore, key string, id ID) bool {
	t.Helper()
	holds, err := s.HoldsOf(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(holds, func(h Hold) bool { return h.ID == id })
}
