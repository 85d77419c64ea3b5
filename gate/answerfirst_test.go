package gate_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

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
}

var errOutOfReach = errors.New("the journal's database is out of reach (test)")

func (s *stallingJournal) Get(ctx context.Context, id journal.ID) (journal.Record, bool, error) {
	if s.failGet.Load() {
		return journal.Record{}, false, errOutOfReach
	}
	return s.Cluster.Get(ctx, id)
}

func (s *stallingJournal) Idle(ctx context.Context, id journal.ID) error {
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

// TestTheGatesAnswerIsNotHeldBackByClearingTheMarkInAJournalThatStoppedAnswering: a gateway of a cluster answers
// a payment as soon as it knows its answer. What the request does after deciding it, clearing the payment's
// in-flight mark in the shared journal, waits on the journal, and with a database that stopped answering it waits
// for its timeout (5 s): the payer must not wait with it. Two answers are checked, each while the journal's Idle
// still waits: the 502 of a payment whose mark was taken and whose record could not be read (the mark is left to
// the leftover loop, which clears it once the journal is back), and the 402 of a payment refused at verification
// (its mark is cleared after the answer went out). Before, the cluster test with a journal that hangs mid-load saw
// answers 5-10 s late, one such timeout per clearing.
func TestTheGatesAnswerIsNotHeldBackByClearingTheMarkInAJournalThatStoppedAnswering(t *testing.T) {
	st := newStallingJournal(t)
	e := newEnv(t, setup{journal: st})
	defer close(st.letGo) // before the server closes, which waits for the requests still clearing their marks
	payer := e.c.Payers[1]
	rq := e.required(x402.TransferPermit2)

	t.Run("the record could not be read", func(t *testing.T) {
		st.failGet.Store(true)
		st.stallIdle.Store(true)
		defer st.failGet.Store(false)
		a := e.get(x402.HeaderPaymentSignature, e.signFor(payer, rq))
		if a.status != http.StatusBadGateway || !strings.Contains(a.body, string(x402.OutcomeVerifyUnreachable)) {
			t.Fatalf("a payment whose record could not be read = %d %q; want 502 %s", a.status, a.body, x402.OutcomeVerifyUnreachable)
		}
		if n := st.idleTimedOut.Load(); n != 0 {
			t.Fatalf("the 502 came after %d clearing(s) of the mark waited out their timeout on the journal; want it before any", n)
		}
		if e.served.Load() != 0 {
			t.Fatalf("the upstream ran %d times; want none", e.served.Load())
		}
	})

	t.Run("refused at verification", func(t *testing.T) {
		st.stallIdle.Store(true)
		h := e.signFor(payer, rq)
		p, err := x402.DecodePaymentPayload(h)
		if err != nil {
			t.Fatal(err)
		}
		sig := []byte(p.Payload.Signature)
		sig[10] = map[bool]byte{true: 'b', false: 'a'}[sig[10] == 'a'] // another signature of the same length
		p.Payload.Signature = string(sig)
		bad, err := x402.EncodeHeader(p)
		if err != nil {
			t.Fatal(err)
		}
		a := e.get(x402.HeaderPaymentSignature, bad)
		pr, _ := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
		if a.status != http.StatusPaymentRequired || !strings.HasPrefix(pr.Error, x402.ReasonPermit2InvalidSignature) {
			t.Fatalf("a payment whose signature does not match = %d (%s); want 402 %s", a.status, pr.Error, x402.ReasonPermit2InvalidSignature)
		}
		if n := st.idleTimedOut.Load(); n != 0 {
			t.Fatalf("the 402 came after %d clearing(s) of the mark waited out their timeout on the journal; want it before any", n)
		}
	})
}
