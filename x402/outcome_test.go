package x402

import (
	"encoding/json"
	"net/http"
	"testing"
)

func TestEveryOutcomeMapsToTheHTTPStatusOfSpecSection71(t *testing.T) {
	want := map[OutcomeStatus]int{
		"no-payment":         http.StatusPaymentRequired,
		"invalid-header":     http.StatusBadRequest,
		"verify-failed":      http.StatusPaymentRequired,
		"verify-unreachable": http.StatusBadGateway,
		"settle-failed":      http.StatusPaymentRequired,
		"settle-unreachable": http.StatusBadGateway,
		"settle-pending":     http.StatusOK,
		"settled":            http.StatusOK,
	}
	statuses := OutcomeStatuses()
	if len(statuses) != len(want) {
		t.Fatalf("OutcomeStatuses() has %d statuses, the spec has %d", len(statuses), len(want))
	}
	for _, s := range statuses {
		code, ok := want[s]
		if !ok {
			t.Errorf("status %q is not one of the spec's", s)
			continue
		}
		if got := s.HTTPStatus(); got != code {
			t.Errorf("%s.HTTPStatus() = %d, want %d", s, got, code)
		}
		if got := (PaymentOutcome{Status: s}).HTTPStatus(); got != code {
			t.Errorf("PaymentOutcome{%s}.HTTPStatus() = %d, want %d", s, got, code)
		}
		if !s.Valid() || s.Meaning() == "" {
			t.Errorf("%s: Valid() = %v, Meaning() = %q", s, s.Valid(), s.Meaning())
		}
	}
}

func TestAnUnknownOutcomeIsAServerError(t *testing.T) {
	s := OutcomeStatus("paid-twice")
	if s.Valid() || s.HTTPStatus() != http.StatusInternalServerError || s.Meaning() != "" {
		t.Errorf("unknown status: Valid %v, HTTPStatus %d, Meaning %q", s.Valid(), s.HTTPStatus(), s.Meaning())
	}
}

func TestSettledOutcomeEncodesOnlyItsOwnFields(t *testing.T) {
	o := PaymentOutcome{Status: OutcomeSettled, Transaction: "0xabc", Payer: "0x1", Network: NetworkTestnet, VerifyMs: 1.5, SettleMs: 900, TotalMs: 902.5}
	b, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"status":"settled","transaction":"0xabc","payer":"0x1","network":"eip155:72344","verifyMs":1.5,"settleMs":900,"totalMs":902.5}`
	if string(b) != want {
		t.Errorf("got  %s\nwant %s", b, want)
	}
	var back PaymentOutcome
	if err := json.Unmarshal(b, &back); err != nil || back != o {
		t.Errorf("round trip = %+v, %v", back, err)
	}
}

// A failed settlement's outcome is unknown when it is pending, or when it names a transaction it broadcast (or
// says it had no receipt) without saying that transaction reverted: that transaction may still mine.
func TestASettlementFailureNamingItsTransactionIsNoFinalRefusalUnlessItReverted(t *testing.T) {
	const tx = "0x1111111111111111111111111111111111111111111111111111111111111111"
	for _, c := range []struct {
		name    string
		resp    SettleResponse
		unknown bool
	}{
		{"settled", SettleResponse{Success: true, Transaction: tx}, false},
		{"pending", SettleResponse{Transaction: tx, ErrorReason: ReasonSettlementPending}, true},
		{"refused before any broadcast", SettleResponse{ErrorReason: ReasonInsufficientFunds}, false},
		{"an unexpected error before any broadcast", SettleResponse{ErrorReason: ReasonUnexpectedSettleError}, false},
		{"an unexpected error after the broadcast", SettleResponse{Transaction: tx, ErrorReason: ReasonUnexpectedSettleError}, true},
		{"no receipt, the transaction named", SettleResponse{Transaction: tx, ErrorReason: ReasonFailedToGetReceipt}, true},
		{"no receipt, no transaction named", SettleResponse{ErrorReason: ReasonFailedToGetReceipt}, true},
		{"mined and reverted", SettleResponse{Transaction: tx, ErrorReason: ReasonTransactionFailed}, false},
		{"an upto settlement mined and reverted", SettleResponse{Transaction: tx, ErrorReason: ReasonUptoTransactionFailed}, false},
	} {
		if got := c.resp.OutcomeUnknown(); got != c.unknown {
			t.Errorf("%s: OutcomeUnknown() = %v, want %v", c.name, got, c.unknown)
		}
	}
}
