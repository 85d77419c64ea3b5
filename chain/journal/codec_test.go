package journal

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestRecordRoundTripsThroughItsStoredForm(t *testing.T) {
	r := claimOf(1)
	r.State, r.TxHash, r.RawTx, r.TxNonce, r.Attempts = StateFinal, "0xabc", []byte{1, 2, 3}, 7, 2
	r.Response = &x402.SettleResponse{Success: true, Transaction: "0xabc", Network: testNetwork, Payer: testPayer}
	r.ClaimedAt = time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	r.FinalAt = r.ClaimedAt.Add(time.Second)
	enc, err := encodeRecord(&r)
	if err != nil {
		t.Fatal(err)
	}
	if enc[0] != recordFormat {
		t.Fatalf("stored form starts with %d, want format byte %d", enc[0], recordFormat)
	}
	got, err := decodeRecord(r.ID, enc)
	if err != nil {
		t.Fatal(err)
	}
	if got.TxHash != r.TxHash || string(got.RawTx) != string(r.RawTx) || got.TxNonce != 7 || got.Attempts != 2 ||
		!got.ClaimedAt.Equal(r.ClaimedAt) || !got.FinalAt.Equal(r.FinalAt) || !got.ServedAt.IsZero() ||
		got.Response == nil || !reflect.DeepEqual(*got.Response, *r.Response) {
		t.Fatalf("decoded %+v\nwant %+v", got, r)
	}
	if strings.Contains(string(enc), "servedAt") {
		t.Errorf("stored form carries an unset time: %s", enc[1:])
	}
}

func TestDecodeRecordNamesTheIDOfDamage(t *testing.T) {
	id := claimOf(1).ID
	valid, _ := encodeRecord(&Record{ID: id, State: StateClaimed})
	other, _ := encodeRecord(&Record{ID: claimOf(2).ID, State: StateClaimed})
	for _, tc := range []struct {
		name string
		raw  []byte
		want string
	}{
		{"empty", nil, "empty"},
		{"unknown format", append([]byte{9}, valid[1:]...), "format 9"},
		{"truncated JSON", valid[:len(valid)/2], "does not decode"},
		{"stored under another id", other, "says its id is"},
		{"invalid state", append([]byte{recordFormat}, []byte(`{"id":"`+id.String()+`","state":"gone"}`)...), "unknown state"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeRecord(id, tc.raw)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), id.String()) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decodeRecord error = %v; want ErrCorrupt naming %s and saying %q", err, id, tc.want)
			}
		})
	}
}
