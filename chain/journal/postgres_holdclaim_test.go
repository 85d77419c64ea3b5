package journal

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// holdOf is a hold of payment k's claim (claimOf) against key, of amount.
func holdOf(k int, key string, amount int64) Hold {
	return Hold{ID: claimOf(k).ID, Key: key, Amount: big.NewInt(amount), Deadline: 2000}
}

// holdRows reads the amount of every hold of id stored (none, or one).
func holdRows(t *testing.T, s *PostgresStore, key string, id ID) []string {
	t.Helper()
	holds, err := s.HoldsOf(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, h := range holds {
		if h.ID == id {
			out = append(out, h.Amount.String())
		}
	}
	return out
}

// signedLeases keeps, per store, the fence of the wallet lease its claims with holds are signed under.
var signedLeases sync.Map

// signingLease takes s's wallet lease for claimWithHold, once.
func signingLease(s *PostgresStore) (string, uint64, error) {
	lease := "wallet-of-" + s.instance
	if fence, ok := signedLeases.Load(s); ok {
		return lease, fence.(uint64), nil
	}
	l, err := s.Lease(context.Background(), lease, time.Hour)
	if err != nil || !l.Held {
		return "", 0, fmt.Errorf("the lease for the claims with holds: %+v, %v", l, err)
	}
	signedLeases.Store(s, l.Fence)
	return lease, l.Fence, nil
}

// claimWithHold is HoldClaimAndSign of r with h in s, its transaction signed under a lease of s's own, answered as
// the claim and the hold went (HeldClaim).
func claimWithHold(ctx context.Context, s *PostgresStore, h Hold, avail *big.Int, r Record) (HeldClaim, error) {
	lease, fence, err := signingLease(s)
	if err != nil {
		return HeldClaim{}, err
	}
	out, err := HoldClaimAndSign(ctx, s, h, avail, 1, 1, r, lease, fence, func(r *Record) error {
		r.State, r.Wallet, r.TxNonce, r.TxHash, r.RawTx = StateBroadcast, "0x0000000000000000000000000000000000000001", 7, "0xabc", []byte{1, 2, 3}
		return nil
	})
	return out.HeldClaim, err
}

// TestPostgresAClaimWithItsHoldIsOneRoundTripAndWritesNothingOfALoser: HoldClaimAndSign writes the claim and the hold
// in one batch, with the context's deferred writes (a gate's record) in front; a payment another claimed is
// neither held nor claimed, and a hold the other took stays as it was; a hold refused for want of funds leaves the
// claim written, the caller's to release; a deferred write that fails writes nothing at all.
func TestPostgresAClaimWithItsHoldIsOneRoundTripAndWritesNothingOfALoser(t *testing.T) {
	throughEitherWay(t, testPostgresAClaimWithItsHoldIsOneRoundTripAndWritesNothingOfALoser)
}

func testPostgresAClaimWithItsHoldIsOneRoundTripAndWritesNothingOfALoser(t *testing.T, dsn string, n int) {
	bg := context.Background()
	rt := &batchCount{}
	s := openPostgres(t, dsn, Options{Tracer: rt})
	other := openPostgres(t, dsn, Options{})
	if !ClaimsWithHold(s, s) || ClaimsWithHold(s, other) || ClaimsWithHold(NewMemory(Options{}), s) || ClaimsWithHold(s, nil) {
		t.Fatal("ClaimsWithHold holds only for one PostgreSQL store as the journal and the holds")
	}
	base := 31000 + 10*n
	key := "claim-with-hold:" + strconv.Itoa(n)
	found := func(k int) (Record, bool) {
		t.Helper()
		r, ok, err := other.Get(bg, claimOf(k).ID)
		if err != nil {
			t.Fatal(err)
		}
		return r, ok
	}

	// Claimed and held, the gate's record riding in front: one round trip.
	if _, _, err := signingLease(s); err != nil {
		t.Fatal(err)
	}
	ctx := Defer(bg, s)
	_, _, later, err := ClaimBehind(ctx, s, claimOf(base))
	if err != nil {
		t.Fatal(err)
	}
	rt.take()
	out, err := claimWithHold(ctx, s, holdOf(base+1, key, 60), big.NewInt(100), claimOf(base+1))
	if err != nil || !out.Claimed || !out.Held || out.Left.Int64() != 100 || out.Rec.ID != claimOf(base+1).ID || out.Rec.ClaimedAt.IsZero() {
		t.Fatalf("HoldClaimAndSign of a new payment = %+v, %v; want it claimed and held, 100 left beside it", out, err)
	}
	if sent := rt.take(); len(sent) != 1 {
		t.Errorf("HoldClaimAndSign carrying a gate's record cost %d round trips, want 1: %q", len(sent), sent)
	}
	if err := later.Land(); err != nil {
		t.Fatalf("the gate's record riding with the claim landed %v", err)
	}
	if _, ok := found(base); !ok {
		t.Fatal("the gate's record that rode with the claim was not written")
	}
	if r, ok := found(base + 1); !ok || !r.SameClaim(&out.Rec) {
		t.Fatalf("the claim = %+v (found %v); want the record HoldClaimAndSign answered", r, ok)
	}
	if got := holdRows(t, other, key, claimOf(base+1).ID); len(got) != 1 || got[0] != "60" {
		t.Fatalf("the hold = %v; want one of 60", got)
	}

	// Another's claim and hold there: nothing of the loser's is written, and the other's hold stays.
	theirs := claimOf(base + 2)
	theirs.Owner = "process-b"
	if _, claimed, err := other.Claim(bg, theirs); err != nil || !claimed {
		t.Fatal(claimed, err)
	}
	if ok, _, err := other.Hold(bg, holdOf(base+2, key, 30), big.NewInt(100), 1, 1, true); err != nil || !ok {
		t.Fatal(ok, err)
	}
	out, err = claimWithHold(bg, s, holdOf(base+2, key, 30), big.NewInt(100), claimOf(base+2))
	if err != nil || out.Claimed || out.Held || out.Rec.Owner != "process-b" {
		t.Fatalf("HoldClaimAndSign of a payment another claimed = %+v, %v; want it lost, the other's record answered", out, err)
	}
	if got := holdRows(t, other, key, claimOf(base+2).ID); len(got) != 1 || got[0] != "30" {
		t.Fatalf("the other's hold after the loser's HoldClaimAndSign = %v; want it as it was, 30", got)
	}
	// Another's claim without a hold: the loser holds nothing.
	theirs = claimOf(base + 3)
	theirs.Owner = "process-b"
	if _, _, err := other.Claim(bg, theirs); err != nil {
		t.Fatal(err)
	}
	if out, err := claimWithHold(bg, s, holdOf(base+3, key, 5), big.NewInt(100), claimOf(base+3)); err != nil || out.Claimed || out.Rec.Owner != "process-b" {
		t.Fatalf("HoldClaimAndSign of a payment another claimed = %+v, %v; want it lost", out, err)
	}
	if got := holdRows(t, other, key, claimOf(base+3).ID); len(got) != 0 {
		t.Fatalf("the loser of a claim held %v; want nothing", got)
	}

	// Past the funds (60 and 30 held of 100): claimed, not held.
	out, err = claimWithHold(bg, s, holdOf(base+4, key, 11), big.NewInt(100), claimOf(base+4))
	if err != nil || !out.Claimed || out.Held || out.Left.Int64() != 10 {
		t.Fatalf("HoldClaimAndSign past the funds = %+v, %v; want it claimed, not held, 10 left", out, err)
	}
	if _, ok := found(base + 4); !ok {
		t.Fatal("the claim of a hold refused for want of funds was not written")
	}
	if got := holdRows(t, other, key, claimOf(base+4).ID); len(got) != 0 {
		t.Fatalf("a hold refused for want of funds = %v; want none", got)
	}

	// A gate's record that finds one there fails the batch: neither the claim nor the hold is written.
	ctx = Defer(bg, s)
	if _, _, later, err = ClaimBehind(ctx, s, claimOf(base)); err != nil {
		t.Fatal(err)
	}
	if out, err := claimWithHold(ctx, s, holdOf(base+5, key, 1), big.NewInt(100), claimOf(base+5)); err == nil || out.Claimed {
		t.Fatalf("HoldClaimAndSign carrying a gate's record that conflicts = %+v, %v; want an error", out, err)
	}
	if err := later.Land(); !errors.Is(err, ErrExists) {
		t.Fatalf("the conflicting gate's record landed %v; want ErrExists", err)
	}
	if _, ok := found(base + 5); ok {
		t.Fatal("a claim whose batch failed was written")
	}
	if got := holdRows(t, other, key, claimOf(base+5).ID); len(got) != 0 {
		t.Fatalf("a hold whose batch failed = %v; want none", got)
	}
}

// TestPostgresClaimsWithHoldsOfOnePaymentAtOnceLeaveOneClaimAndOneHold: settlements of one payment on two stores,
// at once, each claiming with its hold: exactly one claims it, every other answers with its record, and the
// payment is held once.
func TestPostgresClaimsWithHoldsOfOnePaymentAtOnceLeaveOneClaimAndOneHold(t *testing.T) {
	dsn := pgtest.Shared(t)
	bg := context.Background()
	stores := []*PostgresStore{openPostgres(t, dsn, Options{}), openPostgres(t, dsn, Options{})}
	key := "claim-with-hold-race"
	for round := range 20 {
		k := 32000 + round
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			winners []string
			answers []string
		)
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := claimOf(k)
				r.Owner = "settler-" + strconv.Itoa(i)
				out, err := claimWithHold(bg, stores[i%2], holdOf(k, key, 1), big.NewInt(1000), r)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					t.Errorf("round %d, settler %d: %v", round, i, err)
				case out.Claimed:
					winners = append(winners, r.Owner)
				default:
					answers = append(answers, out.Rec.Owner)
				}
			}()
		}
		wg.Wait()
		if len(winners) != 1 {
			t.Fatalf("round %d: %d settlements claimed the payment (%v); want one", round, len(winners), winners)
		}
		for _, a := range answers {
			if a != winners[0] {
				t.Fatalf("round %d: a loser was answered with %s's record; want the winner's, %s", round, a, winners[0])
			}
		}
		if got := holdRows(t, stores[0], key, claimOf(k).ID); len(got) != 1 {
			t.Fatalf("round %d: the payment is held %d times; want once", round, len(got))
		}
	}
}

// TestPostgresAClaimWithItsHoldAcrossARestartIsWrittenOnceOrNotAtAll: with the database down, HoldClaimAndSign fails
// and writes nothing; once it is back, the next one claims and holds, once.
func TestPostgresAClaimWithItsHoldAcrossARestartIsWrittenOnceOrNotAtAll(t *testing.T) {
	srv := pgtest.Start(t)
	bg := context.Background()
	s := openPostgres(t, srv.DSN(), Options{})
	key := "claim-with-hold-restart"
	if out, err := claimWithHold(bg, s, holdOf(33000, key, 1), big.NewInt(10), claimOf(33000)); err != nil || !out.Claimed {
		t.Fatalf("HoldClaimAndSign = %+v, %v", out, err)
	}
	srv.Stop(t)
	if out, err := claimWithHold(bg, s, holdOf(33001, key, 1), big.NewInt(10), claimOf(33001)); err == nil || out.Claimed {
		t.Fatalf("HoldClaimAndSign with the database down = %+v, %v; want an error", out, err)
	}
	srv.Restart(t)
	if _, ok, err := s.Get(bg, claimOf(33001).ID); err != nil || ok {
		t.Fatalf("after the restart, the claim made while the database was down is there: %v, %v", ok, err)
	}
	if got := holdRows(t, s, key, claimOf(33001).ID); len(got) != 0 {
		t.Fatalf("after the restart, the hold made while the database was down is there: %v", got)
	}
	var (
		out HeldClaim
		err error
	)
	for range 3 { // a pooled connection the restart broke may fail one call
		if out, err = claimWithHold(bg, s, holdOf(33001, key, 1), big.NewInt(10), claimOf(33001)); err == nil {
			break
		}
	}
	if err != nil || !out.Claimed || !out.Held {
		t.Fatalf("HoldClaimAndSign after the restart = %+v, %v; want it claimed and held", out, err)
	}
	if got := holdRows(t, s, key, claimOf(33001).ID); len(got) != 1 {
		t.Fatalf("after the restart the payment is held %d times; want once", len(got))
	}
}

// batchSQL is a pgx tracer that keeps the statements of every batch sent.
type batchSQL struct {
	mu      sync.Mutex
	batches [][]string
}

func (c *batchSQL) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (c *batchSQL) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *batchSQL) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	var sqls []string
	for _, q := range d.Batch.QueuedQueries {
		sqls = append(sqls, q.SQL)
	}
	c.batches = append(c.batches, sqls)
	return ctx
}
func (c *batchSQL) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (c *batchSQL) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// asyncHolds takes the batches sent since the last take that hold with take, and says of each whether it commits
// without waiting for the WAL flush.
func (c *batchSQL) asyncHolds() (async []bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range c.batches {
		if slices.ContainsFunc(b, func(s string) bool { return strings.Contains(s, "FOR UPDATE") && strings.Contains(s, "x402_hold_keys") }) {
			async = append(async, slices.Contains(b, pgHoldCommitsAsync))
		}
	}
	c.batches = nil
	return async
}

// TestPostgresAHoldWithoutAClaimCommitsAsynchronouslyAndIsDurableOnceASynchronousCommitFollows: a hold with take
// that carries no claim (Hold, UnrecordedAndHeld) commits without waiting for the WAL flush, so the key's lock is
// not held across it; so does the hold of HoldClaimAndSign, with its claim, in the first transaction of the batch,
// and the second, the claim made broadcast, waits, as every write-ahead record does. Holds committed so and followed
// by a synchronous commit (what a gate's record, a claim or a write-ahead record is) survive a crash of
// the database: the WAL is flushed in order.
func TestPostgresAHoldWithoutAClaimCommitsAsynchronouslyAndIsDurableOnceASynchronousCommitFollows(t *testing.T) {
	srv := pgtest.Start(t)
	bg := context.Background()
	tr := &batchSQL{}
	s := openPostgres(t, srv.DSN(), Options{Tracer: tr})
	key := "async-holds"
	for i := range 10 {
		if ok, _, err := s.Hold(bg, holdOf(34000+i, key, 1), big.NewInt(100), 1, 1, true); err != nil || !ok {
			t.Fatalf("hold %d = %v, %v", i, ok, err)
		}
	}
	if unrecorded, ok, _, err := UnrecordedAndHeld(bg, s, holdOf(34010, key, 1), big.NewInt(100), 1, 1); err != nil || !unrecorded || !ok {
		t.Fatalf("UnrecordedAndHeld = %v, %v, %v", unrecorded, ok, err)
	}
	if got := tr.asyncHolds(); len(got) != 11 || slices.Contains(got, false) {
		t.Fatalf("holds without a claim commit asynchronously: %v; want 11, all", got)
	}
	if out, err := claimWithHold(bg, s, holdOf(34011, key, 1), big.NewInt(100), claimOf(34011)); err != nil || !out.Claimed {
		t.Fatalf("HoldClaimAndSign = %+v, %v", out, err)
	}
	// The hold's and the claim's transaction lets the key's lock go without waiting for the flush; the broadcast
	// record's, second in the same batch, waits for it, and with it for theirs.
	if got := tr.claimBatches(); len(got) != 1 || !slices.Equal(got[0], []bool{true, false}) {
		t.Fatalf("a hold with its claim commits as %v (a batch, its transactions, whether each commits without the flush); want one batch, the hold's and claim's asynchronous, then the broadcast record's", got)
	}
	// One more hold alone, then a synchronous commit (a claim of another payment), and a claim with its hold; then
	// a crash.
	if ok, _, err := s.Hold(bg, holdOf(34012, key, 1), big.NewInt(100), 1, 1, true); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if _, claimed, err := s.Claim(bg, claimOf(34013)); err != nil || !claimed {
		t.Fatal(claimed, err)
	}
	if out, err := claimWithHold(bg, s, holdOf(34014, key, 1), big.NewInt(100), claimOf(34014)); err != nil || !out.Claimed || !out.Held {
		t.Fatalf("HoldClaimAndSign = %+v, %v", out, err)
	}
	srv.Crash(t)
	srv.Restart(t)
	var (
		holds []Hold
		err   error
	)
	for range 3 { // a pooled connection the crash broke may fail one call
		if holds, err = s.HoldsOf(bg, key); err == nil {
			break
		}
	}
	if err != nil || len(holds) != 14 {
		t.Fatalf("after the crash, %d holds of the key are there (%v); want all 14", len(holds), err)
	}
	for _, n := range []int{34011, 34014} {
		if _, ok, err := s.Get(bg, claimOf(n).ID); err != nil || !ok {
			t.Fatalf("after the crash, the claim %d made with its hold is gone: %v, %v", n, ok, err)
		}
	}
}

// claimBatches takes the batches sent since the last take that write a claim, and says of each transaction in
// each whether it commits without waiting for the WAL flush.
func (c *batchSQL) claimBatches() (out [][]bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, b := range c.batches {
		if !slices.Contains(b, pgInsertRecord) {
			continue
		}
		var txs []bool
		for _, q := range b {
			switch {
			case strings.HasPrefix(q, "begin"):
				txs = append(txs, false)
			case q == pgHoldCommitsAsync:
				txs[len(txs)-1] = true
			}
		}
		out = append(out, txs)
	}
	c.batches = nil
	return out
}

// TestPostgresAClaimWithItsHoldRefusedForRetryRunsAgainWholeAndTheGatesRecordLandsOnce: the claim, in the first
// transaction of HoldClaimAndSign's batch with its hold and the gate's record, refused with a serialization failure
// (40001, which a database running READ COMMITTED as SERIALIZABLE answers a claim that raced another): nothing of
// the transaction committed, so the batch runs again whole, and the gate's record, the hold and the claim are each
// written once. (When the hold and the claim were two transactions, the hold's committed without its claim.)
func TestPostgresAClaimWithItsHoldRefusedForRetryRunsAgainWholeAndTheGatesRecordLandsOnce(t *testing.T) {
	dsn := pgtest.Shared(t)
	bg := context.Background()
	s := openPostgres(t, dsn, Options{})
	other := openPostgres(t, dsn, Options{})
	const base = 35000
	key := "claim-refused-for-retry"
	gateRec, claim := claimOf(base), claimOf(base+1)
	// The claim's insert is refused once with 40001; a sequence counts, as it is not rolled back with the refusal.
	fault := []string{
		`CREATE SEQUENCE x402_test_claim_retry_seq`,
		`CREATE FUNCTION x402_test_claim_retry() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF NEW.id = '\x` + hex.EncodeToString(claim.ID[:]) + `'::bytea AND nextval('x402_test_claim_retry_seq') = 1 THEN
		RAISE EXCEPTION 'could not serialize access (test)' USING ERRCODE = '40001';
	END IF;
	RETURN NEW;
END $$`,
		`CREATE TRIGGER x402_test_claim_retry BEFORE INSERT ON x402_records FOR EACH ROW EXECUTE FUNCTION x402_test_claim_retry()`,
	}
	for _, q := range fault {
		if _, err := other.pool.Exec(bg, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{`DROP TRIGGER IF EXISTS x402_test_claim_retry ON x402_records`,
			`DROP FUNCTION IF EXISTS x402_test_claim_retry()`, `DROP SEQUENCE IF EXISTS x402_test_claim_retry_seq`} {
			other.pool.Exec(bg, q)
		}
	})

	ctx := Defer(bg, s)
	_, _, later, err := ClaimBehind(ctx, s, gateRec)
	if err != nil {
		t.Fatal(err)
	}
	out, err := claimWithHold(ctx, s, holdOf(base+1, key, 60), big.NewInt(100), claim)
	if err != nil || !out.Claimed || !out.Held {
		t.Fatalf("HoldClaimAndSign whose claim was refused once for retry = %+v, %v; want it claimed and held", out, err)
	}
	if err := later.Land(); err != nil {
		t.Fatalf("the gate's record that rode with the hold landed %v; want it written", err)
	}
	for _, r := range []Record{gateRec, claim} {
		if _, ok, err := other.Get(bg, r.ID); err != nil || !ok {
			t.Fatalf("the record of %s = %v, %v; want it written", r.ID, ok, err)
		}
	}
	if got := holdRows(t, other, key, claim.ID); len(got) != 1 || got[0] != "60" {
		t.Fatalf("the hold = %v; want one of 60", got)
	}
}
