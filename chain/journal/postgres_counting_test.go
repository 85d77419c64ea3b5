package journal

import (
	"context"
	"math/big"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// holdRowsRead is a pgx tracer that adds up the rows the store's reads of x402_holds return, alone or in a batch.
type holdRowsRead struct {
	mu   sync.Mutex
	rows int64
}

func (c *holdRowsRead) count(sql string, tag interface{ RowsAffected() int64 }) {
	if sql = strings.TrimSpace(sql); !(strings.HasPrefix(sql, "SELECT") || strings.HasPrefix(sql, "WITH")) || !strings.Contains(sql, "FROM x402_holds") {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rows += tag.RowsAffected()
}

func (c *holdRowsRead) take() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.rows
	c.rows = 0
	return n
}

func (c *holdRowsRead) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, holdRowsSQL{}, d.SQL)
}

func (c *holdRowsRead) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if sql, ok := ctx.Value(holdRowsSQL{}).(string); ok && d.Err == nil {
		c.count(sql, d.CommandTag)
	}
}

func (c *holdRowsRead) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *holdRowsRead) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	if d.Err == nil {
		c.count(d.SQL, d.CommandTag)
	}
}

func (c *holdRowsRead) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

type holdRowsSQL struct{}

// TestPostgresAHoldReadsOneRowHoweverManyHoldsTheKeyKeeps: a busy payer's key keeps many holds. Some no longer
// count for a read (holds mined at or before the read's block, kept for other instances' older reads; holds past
// their deadline, deleted only by the next hold with take); many count while a funds read answers (every hold
// mined since the read's block). A hold without take (a verification's read: Hold, UnrecordedAndCovered) and a
// hold with take (Hold, UnrecordedAndHeld) answer as before and read one row of the key, the sum of what counts:
// before, a verification read every row of the key, and a hold with take every row that counts, under the key's
// lock, so each payment of a payer paying hundreds of times a second carried hundreds of rows back.
func TestPostgresAHoldReadsOneRowHoweverManyHoldsTheKeyKeeps(t *testing.T) {
	dsn := pgtest.Shared(t)
	ctx := context.Background()
	rt := &holdRowsRead{}
	s := openPostgres(t, dsn, Options{Tracer: rt})
	key := "counting:" + strconv.Itoa(int(claimOf(1).ID[0]))
	const readBlock, chainTime = 100, 5000
	n := 0
	hold := func(amount int64, deadline uint64) ID {
		t.Helper()
		n++
		id := claimOf(41000 + n).ID
		if ok, _, err := s.Hold(ctx, Hold{ID: id, Key: key, Amount: big.NewInt(amount), Deadline: deadline}, big.NewInt(1_000_000), 1, 1, true); err != nil || !ok {
			t.Fatalf("hold %d = %v, %v", n, ok, err)
		}
		return id
	}
	// Counting, 450 in all: two unmined holds in their time, 60 mined after the read's block.
	hold(100, 9000)
	hold(50, 9000)
	for i := range 60 {
		if err := s.HoldMined(ctx, hold(5, 9000), uint64(readBlock+1+i)); err != nil {
			t.Fatal(err)
		}
	}
	// Not counting: 60 mined at or before the read's block (kept, marked just now), 40 past their deadline.
	for i := range 60 {
		if err := s.HoldMined(ctx, hold(7, 9000), uint64(readBlock-i%3)); err != nil {
			t.Fatal(err)
		}
	}
	for range 40 {
		hold(9, chainTime-1)
	}
	h := Hold{ID: claimOf(41999).ID, Key: key, Amount: big.NewInt(500), Deadline: 9000}
	for _, step := range []struct {
		name string
		run  func() (bool, *big.Int, error)
	}{
		{"Hold without take", func() (bool, *big.Int, error) {
			return s.Hold(ctx, h, big.NewInt(1000), readBlock, chainTime, false)
		}},
		{"UnrecordedAndCovered", func() (bool, *big.Int, error) {
			_, ok, left, err := UnrecordedAndCovered(ctx, s, h, big.NewInt(1000), readBlock, chainTime)
			return ok, left, err
		}},
		{"Hold with take", func() (bool, *big.Int, error) {
			return s.Hold(ctx, h, big.NewInt(1000), readBlock, chainTime, true)
		}},
		{"UnrecordedAndHeld, held already", func() (bool, *big.Int, error) {
			_, ok, left, err := UnrecordedAndHeld(ctx, s, h, big.NewInt(1000), readBlock, chainTime)
			return ok, left, err
		}},
	} {
		rt.take()
		ok, left, err := step.run()
		if err != nil || !ok || left.Int64() != 550 {
			t.Fatalf("%s = %v, %v left, %v; want true, 550 left (1000 less 100, 50 and 60 of 5)", step.name, ok, left, err)
		}
		if got := rt.take(); got != 1 {
			t.Errorf("%s read %d rows of the key's holds; want 1, the sum of the 62 that count", step.name, got)
		}
	}
	// Past what is left beside them: refused as before.
	past := Hold{ID: claimOf(41998).ID, Key: key, Amount: big.NewInt(51), Deadline: 9000}
	if ok, _, err := s.Hold(ctx, past, big.NewInt(1000), readBlock, chainTime, false); err != nil || ok {
		t.Fatalf("Hold without take of 51 with 50 left = %v, %v; want refused", ok, err)
	}
	if ok, _, err := s.Hold(ctx, past, big.NewInt(1000), readBlock, chainTime, true); err != nil || ok {
		t.Fatalf("Hold with take of 51 with 50 left = %v, %v; want refused", ok, err)
	}
}
