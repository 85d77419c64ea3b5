package chain

import (
	"errors"
	"fmt"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A settlement's error is marked x402.ErrSentNothing (which a facilitator server answers as "sent": false) only
// when it surely sent nothing and left nothing to be sent: the node refused the transaction or could not be asked
// what it needs. Never a record that may have been written, a claim another instance took, a payment whose
// sponsored approval may be on its way, nor any other failure. The error's text stays as it was.
func TestOnlyASettlementThatSurelySentNothingIsMarkedSo(t *testing.T) {
	fe := func(err error) *x402.FacilitatorError {
		return &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
	}
	rows := []struct {
		name     string
		err      error
		approval bool
		want     bool
	}{
		{"the node refused the transaction", fe(fmt.Errorf("%w: insufficient funds for gas", errNotSent)), false, true},
		{"the node could not be asked", fe(fmt.Errorf("nothing was sent: %w: head block: EOF", errNodeNotAsked)), false, true},
		{"a handed-off settlement its taker could not send", fe(fmt.Errorf("%w: the instance that took the settlement could not send it: refused", errNotSent)), false, true},
		{"the record of the refused transaction may be written", fe(fmt.Errorf("%w: %w: refused", errRecordUnknown, errNotSent)), false, false},
		{"the claim was lost", fe(fmt.Errorf("%w: %w", errClaimLost, errNotSent)), false, false},
		{"a sponsored approval's payment", fe(fmt.Errorf("%w: refused", errNotSent)), true, false},
		{"the journal out of reach", fe(fmt.Errorf("nothing was sent: settlement journal: %w", errors.New("connection refused"))), false, false},
		{"an earlier transaction still watched", fe(errors.New("the node refused the settlement transaction sent again (x); the payment's earlier transaction is still watched")), false, false},
		{"not a facilitator error", fmt.Errorf("%w: refused", errNotSent), false, false},
		{"no error", nil, false, false},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			p := &payment{}
			if row.approval {
				p.approval = &sponsorApproval{}
			}
			text := ""
			if row.err != nil {
				text = row.err.Error()
			}
			markSentNothing(p, row.err)
			if got := errors.Is(row.err, x402.ErrSentNothing); got != row.want {
				t.Fatalf("marked sent nothing = %v, want %v", got, row.want)
			}
			if row.err != nil && row.err.Error() != text {
				t.Errorf("the error's text became %q, was %q", row.err.Error(), text)
			}
			if row.want && (!errors.Is(row.err, errNotSent) && !errors.Is(row.err, errNodeNotAsked)) {
				t.Error("the marked error no longer wraps its cause")
			}
		})
	}
}
