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
	if !strings.HasPrefix(strings.TrimSpace(sql), "SELECT id, amount::text") || !strings.Contains(sql, "FROM x402_holds") {
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

// TestPostgresAVerificationReadsOnlyTheHoldsThatCount: a busy payer's key keeps many holds that no longer count
// for a read (holds mined at or before the read's block, kept for other instances' older reads; holds past their
// deadline, deleted only by the next hold with take). A verification's read of the key (Hold without take,
// UnrecordedAndCovered) answers as before and reads only the holds that count: before, it read every row of the
// key and left the sorting to decideHold, so each verification of a payer paying hundreds of times a second
// carried the last minute's mined holds back over the wire.
func TestPostgresAVerificationReadsOnlyTheHoldsThatCount(t *testing.T) {
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
	// Counting: two unmined holds in their time, one mined after the read's block.
	hold(100, 9000)
	hold(50, 9000)
	late := hold(25, 9000)
	if err := s.HoldMined(ctx, late, readBlock+5); err != nil {
		t.Fatal(err)
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
	h := Hold{ID: claimOf(41999).ID, Key: key, Amount: big.NewInt(800), Deadline: 9000}
	rt.take()
	ok, left, err := s.Hold(ctx, h, big.NewInt(1000), readBlock, chainTime, false)
	if err != nil || !ok || left.Int64() != 825 {
		t.Fatalf("Hold without take = %v, %v left, %v; want true, 825 left (1000 less 100, 50 and 25)", ok, left, err)
	}
	if got := rt.take(); got != 3 {
		t.Errorf("Hold without take read %d holds of the key; want the 3 that count", got)
	}
	unrecorded, ok, left, err := UnrecordedAndCovered(ctx, s, h, big.NewInt(1000), readBlock, chainTime)
	if err != nil || !unrecorded || !ok || left.Int64() != 825 {
		t.Fatalf("UnrecordedAndCovered = %v, %v, %v left, %v; want true, true, 825 left", unrecorded, ok, left, err)
	}
	if got := rt.take(); got != 3 {
		t.Errorf("UnrecordedAndCovered read %d holds of the key; want the 3 that count", got)
	}
	// Past what is left: refused as before.
	if ok, _, err := s.Hold(ctx, Hold{ID: h.ID, Key: key, Amount: big.NewInt(826), Deadline: 9000}, big.NewInt(1000), readBlock, chainTime, false); err != nil || ok {
		t.Fatalf("Hold without take of 826 of 825 left = %v, %v; want refused", ok, err)
	}
}
