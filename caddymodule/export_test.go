package caddymodule

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
