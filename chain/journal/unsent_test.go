package journal

import (
	"context"
	"strings"
	"testing"
)

// TestReleaseUnsentUnholdNeverLeavesARecordWithoutItsHold: where the journal and the shared holds are not one
// PostgreSQL store, a refused settlement's record and its hold go in two writes. Whichever fails (or a crash
// between them), the record must not be left without its hold: reconciliation would send the recorded bytes
// against funds counted free. The hold went first, so a failed record write left exactly that; the record goes
// first now, and a failed hold write leaves a hold without a record, whose payer's funds look spent until the
// payment's deadline (errs on refusing).
func TestReleaseUnsentUnholdNeverLeavesARecordWithoutItsHold(t *testing.T) {
	for _, h := range harnesses {
		if strings.HasPrefix(h.name, "postgres") {
			continue // one store with the holds: the two go in one transaction (see chain's holds_unsent_test.go)
		}
		t.Run(h.name, func(t *testing.T) {
			for _, c := range []struct {
				name                 string
				recordFails, unholds error
				wantRecord, wantHold bool
			}{
				{name: "both written"},
				{name: "the record's write fails", recordFails: ErrUnavailable, wantRecord: true, wantHold: true},
				{name: "the hold's write fails", unholds: ErrUnavailable, wantHold: true},
			} {
				t.Run(c.name, func(t *testing.T) {
					ctx := context.Background()
					base := h.open(t, nil)
					claim := mustClaim(t, base, claimOf(31))
					mustUpdate(t, base, claim.ID, toBroadcast("0x31"))
					holds := &holdsBeside{held: map[ID]bool{claim.ID: true}, err: c.unholds}
					err := ReleaseUnsentUnhold(ctx, releaseUnsentFails{base, c.recordFails}, holds, claim, "0x31", false)
					if want := c.recordFails != nil || c.unholds != nil; (err != nil) != want {
						t.Fatalf("ReleaseUnsentUnhold = %v; want an error: %v", err, want)
					}
					_, recorded, gerr := base.Get(ctx, claim.ID)
					if gerr != nil {
						t.Fatal(gerr)
					}
					if recorded != c.wantRecord || holds.held[claim.ID] != c.wantHold {
						t.Fatalf("after ReleaseUnsentUnhold (%v): record kept %v, hold kept %v; want %v, %v", err, recorded, holds.held[claim.ID], c.wantRecord, c.wantHold)
					}
				})
			}
		})
	}
}

// holdsBeside is shared holds kept apart from the journal's store, as a map; its Unhold fails with err when set.
// Only Unhold is called (the embedded Cluster is nil).
type holdsBeside struct {
	Cluster
	held map[ID]bool
	err  error
}

func (c *holdsBeside) Unhold(_ context.Context, id ID, _ bool) error {
	if c.err != nil {
		return c.err
	}
	delete(c.held, id)
	return nil
}

// releaseUnsentFails is a store whose ReleaseUnsent fails with err, writing nothing, when err is set.
type releaseUnsentFails struct {
	Store
	err error
}

func (s releaseUnsentFails) ReleaseUnsent(ctx context.Context, claim Record, txHash string) error {
	if s.err != nil {
		return s.err
	}
	return s.Store.ReleaseUnsent(ctx, claim, txHash)
}
