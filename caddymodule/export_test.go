package caddymodule

import (
	"errors"
	"time"
)

// PauseBackgroundSettlement holds the background settlements of settle-async gates until resume is called, so a
// benchmark can measure what serving paid requests costs apart from settling them on the same cores.
func PauseBackgroundSettlement() (resume func()) {
	ch := make(chan struct{})
	settlementPause.Store(&ch)
	return func() {
		settlementPause.Store(nil)
		close(ch)
	}
}

// PruneGateJournals runs the gates' periodic journal prune now, as if the clock read now, on every journal a
// gate uses, and returns how many records it deleted: the real prune runs every ten minutes.
func PruneGateJournals(now time.Time) (int, error) {
	total := 0
	var errs []error
	ledgers.Range(func(_, v any) bool {
		n, err := v.(*gateLedger).prune(now)
		total += n
		errs = append(errs, err)
		return true
	})
	return total, errors.Join(errs...)
}
