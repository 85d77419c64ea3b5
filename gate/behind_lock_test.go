package gate_test

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAServedMarkIsWrittenWhenTheDeferredFinalAnswerItCarriesCannotBe: the engine's final answer of a payment
// settled in a request rides, deferred, in the batch of the gate's final write, its served mark and the clearing
// of its in-flight mark (one implicit transaction). Another session holds the engine's record row locked (an
// instance stalled between the two batches of an update of it, a reconciliation) for longer than a write may
// take: the engine's final answer cannot be written. The gate's served mark must be written anyway, as it was
// before the write-behind: a payment served and not marked served is served again, for nothing, when presented
// again.
func TestAServedMarkIsWrittenWhenTheDeferredFinalAnswerItCarriesCannotBe(t *testing.T) {
	racepass.Once(t, "32 s of a write waiting out its timeout on a row another session locks; the write-behind runs under -race in the package's other tests")
	dsn := pgtest.Shared(t)
	st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{InstanceTTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	c := chaintest.New(t)
	t.Cleanup(c.AutoCommit(400 * time.Millisecond)) // time to lock the record between broadcast and receipt
	var runs atomic.Int64
	e := newEnv(t, setup{settle: gate.SettleAfter, journal: st, chain: c, upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		runs.Add(1)
		_, err := w.Write([]byte("paid content"))
		return err
	})})
	waitShares(t, e)
	payer := e.c.Payers[0]
	header := e.signFor(payer, e.required(x402.TransferPermit2))
	gateID, engineID := paymentIDs(t, e, header)
	before := e.balances(payer)

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	locked, release, ended := make(chan error, 1), make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unlock := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(func() { unlock(); <-ended }) // before the connection closes
	go func() {
		defer close(ended)
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			if rec, found, err := st.Get(ctx, engineID); err == nil && found && rec.State == journal.StateBroadcast {
				tx, err := conn.Begin(ctx)
				if err == nil {
					_, err = tx.Exec(ctx, `SELECT 1 FROM x402_records WHERE id = $1 FOR UPDATE`, engineID[:])
				}
				locked <- err
				<-release
				tx.Commit(ctx)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
		locked <- context.DeadlineExceeded
	}()
	first := make(chan answer, 1)
	go func() { first <- e.get(x402.HeaderPaymentSignature, header) }()
	if err := <-locked; err != nil {
		t.Fatalf("locking the engine's record while it is broadcast: %v", err)
	}
	a := <-first
	if a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q; want 200", a.status, a.body)
	}
	// The request's final write waits for the lock as long as a write may (pgWriteTimeout, 30 s), then the
	// request ends.
	time.Sleep(32 * time.Second)
	unlock()
	time.Sleep(time.Second)
	if rec, found, err := st.Get(ctx, gateID); err != nil || !found || !rec.Served {
		t.Errorf("the gate's record after its response = served %v (found %v, %v); want served", rec.Served, found, err)
	}
	if again := e.get(x402.HeaderPaymentSignature, header); again.status != http.StatusPaymentRequired {
		t.Errorf("the payment presented again after its response = %d %q; want 402, served already", again.status, again.body)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the upstream ran %d times for one payment; want 1", n)
	}
	e.waitPaidOnce(t, payer, before, price, 10*time.Second)
}
