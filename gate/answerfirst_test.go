package gate_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// stallingJournal is a real PostgreSQL journal, shared as a cluster's, that can be made to stop answering for
// what a request does with its payment's in-flight mark: its read of the payment's record fails (failGet), as a
// database out of reach makes it fail, and clearing a mark (Idle) waits until the test lets it go (letGo) or the
// caller's own timeout ends it, which is counted (idleTimedOut): as a database that stopped answering.
type stallingJournal struct {
	journal.Cluster
	failGet      atomic.Bool
	stallIdle    atomic.Bool
	letGo        chan struct{}
	idleTimedOut atomic.Int64
	// firstIdleBudget is how long the first Idle was given (its context's deadline when it was called).
	firstIdleBudget atomic.Int64
}

var errOutOfReach = errors.New("the journal's database is out of reach (test)")

func (s *stallingJournal) Get(ctx context.Context, id journal.ID) (journal.Record, bool, error) {
	if s.failGet.Load() {
		return journal.Record{}, false, errOutOfReach
	}
	return s.Cluster.Get(ctx, id)
}

func (s *stallingJournal) Idle(ctx context.Context, id journal.ID) error {
	if d, ok := ctx.Deadline(); ok {
		s.firstIdleBudget.CompareAndSwap(0, int64(time.Until(d)))
	}
	if s.stallIdle.Load() {
		select {
		case <-s.letGo:
		case <-ctx.Done():
			s.idleTimedOut.Add(1)
			return ctx.Err()
		}
	}
	return s.Cluster.Idle(ctx, id)
}

func newStallingJournal(t *testing.T) *stallingJournal {
	t.Helper()
	st, err := journal.OpenPostgres(context.Background(), pgtest.Shared(t), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return &stallingJournal{Cluster: st, letGo: make(chan struct{})}
}

// TestAPaymentWhoseRecordCouldNotBeReadIsAnsweredWithoutWaitingOnTheJournalAgain: a gateway of a cluster marks a
// payment in flight in the shared journal and reads its record in the same round trip. When the read fails, the
// database is out of reach: clearing the mark there before answering would wait for its timeout (5 s) on the same
// database, and the payer with it (the cluster test with a journal that hangs mid-load saw answers 5-10 s late).
// The request tries to clear the mark for a moment only (a journal that answers at once is spared a mark another
// gateway would find), then leaves it to the leftover loop, which clears it once the journal is back.
func TestAPaymentWhoseRecordCouldNotBeReadIsAnsweredWithoutWaitingOnTheJournalAgain(t *testing.T) {
	st := newStallingJournal(t)
	e := newEnv(t, setup{journal: st})
	defer close(st.letGo) // before the server closes, which waits for the requests still clearing their marks
	payer := e.c.Payers[1]
	rq := e.required(x402.TransferPermit2)

	st.failGet.Store(true)
	st.stallIdle.Store(true)
	a := e.get(x402.HeaderPaymentSignature, e.signFor(payer, rq))
	if a.status != http.StatusBadGateway || !strings.Contains(a.body, string(x402.OutcomeVerifyUnreachable)) {
		t.Fatalf("a payment whose record could not be read = %d %q; want 502 %s", a.status, a.body, x402.OutcomeVerifyUnreachable)
	}
	if budget := time.Duration(st.firstIdleBudget.Load()); budget <= 0 || budget > time.Second {
		t.Fatalf("the request gave clearing its mark %v before answering; want a moment (at most 1 s), not the journal's timeout", budget)
	}
	if e.served.Load() != 0 {
		t.Fatalf("the upstream ran %d times; want none", e.served.Load())
	}
}
