package gate

import (
	"context"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// The in-flight mark of a payment, deferred into its verification. A gate whose embedded engine shares its
// PostgreSQL journal (Gate.behind) need not mark the payment in the journal, and read its record, in a round trip
// of its own before it verifies: it takes this process's own mark, and the journal's mark and the read ride in the
// engine's first batch of the verification (journal.MarkAndGetBehind), or go alone once the engine answered
// without one (refused early, answered by the chain). What the gate then does is what it did when it marked first:
// not this request's, the payment is in use; recorded, it is presented again, whatever the engine answered (a
// payment presented again may fail verification, its nonce spent by its own settlement); else the engine's answer.
// The engine's hold of the payment (settle async) is taken under the mark's guard: only when the mark is this
// request's and the gate holds no record of the payment, so a request that is turned away, or a payment presented
// again, neither holds the payment a second time nor has a hold to let go of.

// marksWhileVerifying reports whether the request's in-flight mark rides in its verification: the embedded engine
// shares the gate's journal, a cluster's, and the payment matches an offer (one that does not is judged by its
// record alone, onRecord, and verified by nobody). A settle async gate that cannot hold payments waits for the
// payer's earlier ones before it verifies (serveFirst): it marks first.
func (x *exchange) marksWhileVerifying(p presented) bool {
	_, shared := x.g.ledger.store.(journal.Cluster)
	return x.g.behind && shared && p.mismatch == nil && (x.g.cfg.Settle != SettleAsync || x.g.holder != nil)
}

// markWhileVerifying is run's mark, verification and what follows them, the mark deferred into the verification.
func (x *exchange) markWhileVerifying(p presented) error {
	ctx := journal.Defer(x.r.Context(), x.g.ledger.store)
	vctx, land, ok := x.g.ledger.acquireBehind(ctx, p.id)
	if !ok {
		return x.alreadyUsed("another request is presenting this payment right now; wait for its answer instead of paying again")
	}
	vres, verr := x.verifyTimed(vctx)
	// Whatever the verification held was held under the mark's guard: a request the mark turns away held nothing,
	// and has nothing to let go of (a hold there is another request's, or the first presentation's).
	mine, rec, found, err := land()
	switch {
	case err != nil:
		return x.verifyUnreachable("the gate's settlement journal could not be reached; nothing was charged, try again", err)
	case !mine:
		return x.alreadyUsed("another request is presenting this payment right now; wait for its answer instead of paying again")
	}
	defer func() { x.g.ledger.releaseIdled(p.id, x.idled) }()
	x.deferWrites(ctx)
	defer x.flushBehind()
	if found {
		return x.presentedAgain(rec, p)
	}
	return x.serveVerified(vres, verr)
}

// deferWrites lets the request's journal writes ride in the embedded engine's batches, through ctx's queue
// (journal.Defer), not cancelled with the request; the verification's guard is not the writes'.
func (x *exchange) deferWrites(ctx context.Context) {
	x.jctx = context.WithoutCancel(ctx)
}

// acquireBehind is acquireRecord with the journal's mark and read deferred into the verification of the payment:
// it takes this process's own mark of id now (ok false: a request here has it), and returns the context to verify
// the payment under (ctx carries the request's queue of deferred writes, journal.Defer) and land, which, once the
// verification is done, sends the mark and the read if the engine did not carry them, and answers as
// acquireRecord.
func (l *Ledger) acquireBehind(ctx context.Context, id journal.ID) (vctx context.Context, land func() (bool, journal.Record, bool, error), ok bool) {
	c, shared := l.store.(journal.Cluster)
	if !shared || !l.markHere(id) {
		return ctx, nil, false
	}
	life := c.Continuity()
	vctx, m := journal.MarkAndGetBehind(ctx, l.store, id)
	land = func() (bool, journal.Record, bool, error) {
		return l.markedThere(id, c, life, func(journal.Cluster) (bool, journal.Record, bool, error) {
			if m == nil {
				return journal.MarkAndGet(ctx, l.store, id)
			}
			return m.Land()
		})
	}
	return vctx, land, true
}
