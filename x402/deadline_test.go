package x402

import (
	"encoding/json"
	"testing"
	"time"
)

// A payment can be settled until the earlier of its authorization's deadline and, when it carries one, its
// gas-sponsoring permit's: permit2 (exact and upto), erc2612 and eip3009 alike. A sponsoring extension that does
// not read changes nothing (the facilitator refuses it when the settlement needs it).
func TestSettlementDeadlineIsTheEarliestDeadlineTheSettlementNeeds(t *testing.T) {
	sponsoring := func(deadline string) map[string]json.RawMessage {
		raw, err := json.Marshal(map[string]EIP2612GasSponsoringInfo{"info": {Deadline: deadline}})
		if err != nil {
			t.Fatal(err)
		}
		return map[string]json.RawMessage{ExtensionEIP2612GasSponsoring: raw}
	}
	permit2 := ExactEVMPayload{Permit2Authorization: &Permit2Authorization{Deadline: "2000"}}
	authorization := ExactEVMPayload{Authorization: &EIP2612Authorization{ValidBefore: "3000"}}
	for _, tc := range []struct {
		name    string
		p       PaymentPayload
		want    int64
		noneSet bool
	}{
		{name: "permit2", p: PaymentPayload{Payload: permit2}, want: 2000},
		{name: "erc2612 or eip3009", p: PaymentPayload{Payload: authorization}, want: 3000},
		{name: "an earlier sponsor permit", p: PaymentPayload{Payload: permit2, Extensions: sponsoring("1500")}, want: 1500},
		{name: "a later sponsor permit", p: PaymentPayload{Payload: permit2, Extensions: sponsoring("2500")}, want: 2000},
		{name: "a sponsor deadline that does not read", p: PaymentPayload{Payload: permit2, Extensions: sponsoring("soon")}, want: 2000},
		{name: "a sponsor deadline past int64", p: PaymentPayload{Payload: permit2, Extensions: sponsoring("99999999999999999999999")}, want: 2000},
		{name: "a sponsoring extension that does not read", p: PaymentPayload{Payload: permit2,
			Extensions: map[string]json.RawMessage{ExtensionEIP2612GasSponsoring: json.RawMessage(`"info"`)}}, want: 2000},
		{name: "no authorization", p: PaymentPayload{Extensions: sponsoring("1500")}, noneSet: true},
	} {
		got := tc.p.SettlementDeadline()
		switch {
		case tc.noneSet && !got.IsZero():
			t.Errorf("%s: %s, want none", tc.name, got)
		case !tc.noneSet && !got.Equal(time.Unix(tc.want, 0)):
			t.Errorf("%s: %s, want %s", tc.name, got, time.Unix(tc.want, 0).UTC())
		}
	}
}
