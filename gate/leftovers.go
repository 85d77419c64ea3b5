package gate

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// leftover is what a request presenting a payment could not clear in a shared journal that was out of reach: the
// payment's in-flight mark (always), and, when release is set, the funds hold it took for a payment it did not
// record (release lets it go; until: the payment's deadline, past which the hold counts for nothing and is
// pruned).
type leftover struct {
	release func() error
	until   time.Time
}

// leftoverEvery is how often the leftovers are tried again.
const leftoverEvery = 250 * time.Millisecond

// leaveBehind remembers what a request could not clear for payment id, to be cleared by the leftover loop once the
// journal is back. A plain retry of the release would race with a later presentation of the payment, here or at
// another gateway sharing the journal, which takes the same hold over (the journal's hold of a payment is one row,
// reused); the loop clears it only as a presentation would, holding the payment's in-flight mark, and only while
// the journal has no record of the payment (a recorded payment's hold is its settlement's).
func (l *Ledger) leaveBehind(id journal.ID, release func() error, until time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx.Err() != nil {
		return // closing: the mark goes with this instance's heartbeat row, the hold at its deadline
	}
	if lo := l.leftovers[id]; lo != nil && release == nil {
		return // a mark left again: the hold's release stays to do
	}
	l.leftovers[id] = &leftover{release: release, until: until}
	if !l.tidying {
		l.tidying = true
		l.wg.Add(1)
		go l.leftoverLoop()
	}
}

// leftoverLoop tries the leftovers again until there are none.
func (l *Ledger) leftoverLoop() {
	defer l.wg.Done()
	t := time.NewTicker(leftoverEvery)
	defer t.Stop()
	for {
		select {
		case <-l.ctx.Done():
			return
		case <-t.C:
		}
		l.mu.Lock()
		todo := make(map[journal.ID]*leftover, len(l.leftovers))
		for id, lo := range l.leftovers {
			todo[id] = lo
		}
		if len(todo) == 0 {
			l.tidying = false
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		for id, lo := range todo {
			if l.ctx.Err() != nil {
				return
			}
			l.clearLeftover(id, lo)
		}
	}
}

// clearLeftover clears what lo left of payment id, when it can now, and forgets lo once done.
func (l *Ledger) clearLeftover(id journal.ID, lo *leftover) {
	done := func() {
		l.mu.Lock()
		if l.leftovers[id] == lo {
			delete(l.leftovers, id)
		}
		l.mu.Unlock()
	}
	if lo.release != nil && !lo.until.IsZero() && l.now().After(lo.until) {
		lo.release = nil // past its deadline the hold counts for nothing, and is pruned
	}
	ctx, cancel := context.WithTimeout(l.ctx, 5*time.Second)
	defer cancel()
	mine, err := l.acquire(ctx, id)
	if err != nil {
		return // out of reach still
	}
	if !mine {
		// A request is presenting the payment: here, it clears the mark itself; elsewhere, this instance's mark
		// was taken over. Either way the mark is not this one's to clear; a hold waits for that request's end.
		if lo.release == nil {
			done()
		}
		return
	}
	if lo.release != nil {
		_, recorded, err := l.store.Get(ctx, id)
		switch {
		case err != nil || !l.holds(id):
			l.release(id)
			return
		case !recorded:
			// Nobody presents the payment (the mark is this request's) and nobody recorded it: nothing will
			// settle it, and its hold is nobody's.
			if err := lo.release(); err != nil {
				l.release(id)
				return
			}
			l.log.Info("let go of a funds hold an outage of the journal had left", zap.String("payment", id.String()))
		}
	}
	done()
	l.release(id) // a failure leaves the mark behind again
}
