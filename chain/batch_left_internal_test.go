package chain

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// An instance holding no wallet that leaves due claims to the others says so at debug, but warns, at most once a
// minute, when a withdrawal is pending on one of the channels: its vouchers must be claimed before the delay runs out.
func TestClaimsLeftUnderAPendingWithdrawalAreWarnedOfAtMostOnceAMinute(t *testing.T) {
	logs, logged := observer.New(zapcore.DebugLevel)
	f := &Facilitator{log: zap.New(logs)}
	n := &network{caip2: "eip155:84532", batch: &batchNetwork{}}
	quiet := []journal.Channel{{}, {}}
	pending := []journal.Channel{{}, {WithdrawRequestedAt: time.Now()}}
	warnings := func() int { return logged.FilterLevelExact(zapcore.WarnLevel).Len() }

	f.leftClaims(n, quiet)
	if got := logged.FilterLevelExact(zapcore.DebugLevel).Len(); got != 1 || warnings() != 0 {
		t.Fatalf("claims left with no withdrawal pending: %d debug lines, %d warnings; want 1 and 0", got, warnings())
	}
	f.leftClaims(n, pending)
	f.leftClaims(n, pending)
	if warnings() != 1 {
		t.Fatalf("claims left twice under a pending withdrawal: %d warnings, want 1", warnings())
	}
	w := logged.FilterLevelExact(zapcore.WarnLevel).All()[0].ContextMap()
	if w["withdrawals_pending"] != int64(1) || w["channels"] != int64(2) {
		t.Fatalf("the warning's fields %v; want 1 withdrawal pending of 2 channels", w)
	}
	n.batch.leftWarned = time.Now().Add(-leftClaimsWarnEvery)
	f.leftClaims(n, pending)
	if warnings() != 2 {
		t.Fatalf("claims left under a pending withdrawal a minute after the last warning: %d warnings, want 2", warnings())
	}
}
