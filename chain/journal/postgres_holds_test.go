package journal

import (
	"context"
	"math/big"
	"slices"
	"testing"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// TestPostgresPruneHoldsDeletesOnlyThePrefixsHoldsPastTheDeadline: a payer who pays no more keeps its holds, mined
// or not, for as long as no payment of its key is held again; PruneHolds deletes those of the keys of one prefix
// (a network) whose deadline is before the chain time given, and nothing else.
func TestPostgresPruneHoldsDeletesOnlyThePrefixsHoldsPastTheDeadline(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	s := openPostgres(t, dsn, Options{})
	held := func(n int, key string, deadline uint64) {
		t.Helper()
		h := Hold{ID: claimOf(n).ID, Key: key, Amount: big.NewInt(1), Deadline: deadline}
		if ok, _, err := s.Hold(ctx, h, big.NewInt(100), 1, 0, true); err != nil || !ok {
			t.Fatalf("hold %d = %v, %v", n, ok, err)
		}
	}
	held(1, "net:1:token:alice", 100) // past: goes
	held(2, "net:1:token:alice", 100) // past and mined: goes
	held(3, "net:1:token:bob", 300)   // not past: stays
	held(4, "net:12:token:alice", 50) // another network's, past here: stays
	held(5, "net:1:token:carol", 199) // past by a second: goes
	if err := s.HoldMined(ctx, claimOf(2).ID, 7); err != nil {
		t.Fatal(err)
	}
	n, err := s.PruneHolds(ctx, "net:1:", 200)
	if err != nil || n != 3 {
		t.Fatalf("PruneHolds = %d, %v; want 3 holds deleted", n, err)
	}
	var left []int
	for i, key := range map[int]string{1: "net:1:token:alice", 2: "net:1:token:alice", 3: "net:1:token:bob", 4: "net:12:token:alice", 5: "net:1:token:carol"} {
		hs, err := s.HoldsOf(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(hs, func(h Hold) bool { return h.ID == claimOf(i).ID }) {
			left = append(left, i)
		}
	}
	slices.Sort(left)
	if !slices.Equal(left, []int{3, 4}) {
		t.Fatalf("holds left %v; want 3 (deadline not past) and 4 (another prefix)", left)
	}
	if n, err := s.PruneHolds(ctx, "net:1:", 200); err != nil || n != 0 {
		t.Fatalf("PruneHolds again = %d, %v; want nothing left to delete", n, err)
	}
}
