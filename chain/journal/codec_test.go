package journal

import (
	"bytes"
	"encoding/json"
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

// A stored record either decodes to a valid record under the id it is stored under, whose stored form is then
// stable (encode, decode and encode again give the same bytes), or is refused as ErrCorrupt naming that id.
func FuzzDecodeRecord(f *testing.F) {
	id := claimOf(1).ID
	claimed := claimOf(1)
	broadcast := claimOf(1)
	if err := toBroadcast("0xabc")(&broadcast); err != nil {
		f.Fatal(err)
	}
	final := broadcast
	final.State, final.Response = StateFinal, &x402.SettleResponse{Success: true, Transaction: "0xabc", Network: testNetwork, Payer: testPayer,
		Extensions: map[string]json.RawMessage{"x": json.RawMessage(`{"y":[1]}`)}}
	final.ClaimedAt = time.Date(2026, 1, 2, 3, 4, 5, 6, time.FixedZone("", 3600))
	final.FinalAt, final.Deadline, final.Served, final.ServedAt = final.ClaimedAt.Add(time.Second), final.ClaimedAt.Add(time.Hour), true, final.ClaimedAt
	final.PriorRawTxs, final.PriorTxHashes, final.ReplacedTxHashes = [][]byte{{1, 2}}, []string{"0xdef"}, []string{"0x123"}
	for _, r := range []Record{claimed, broadcast, final} {
		enc, err := encodeRecord(&r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(enc)
		f.Add(enc[:len(enc)/2])
	}
	for _, s := range []string{"", "\x01", "\x02{}", "\x01{}", "\x01null", `{"id":"` + id.String() + `","state":"claimed"}`,
		"\x01" + `{"id":"` + id.String() + `","state":"broadcast"}`, "\x01" + `{"id":"` + id.String() + `","state":"final"}`,
		"\x01" + `{"id":"` + id.String()[2:] + `","state":"claimed","id":"` + id.String() + `"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeRecord(id, b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), id.String()) {
				t.Fatalf("decodeRecord error %v: want ErrCorrupt naming %s", err, id)
			}
			return
		}
		if r.ID != id || r.validate() != nil || b[0] != recordFormat {
			t.Fatalf("decodeRecord accepted %+v (format byte %d), which is not a valid record stored under %s", r, b[0], id)
		}
		enc, err := encodeRecord(&r)
		if err != nil {
			t.Fatalf("a decoded record does not encode: %v", err)
		}
		again, err := decodeRecord(id, enc)
		if err != nil {
			t.Fatalf("a decoded record, encoded again, does not decode: %v\n%s", err, enc[1:])
		}
		if enc2, _ := encodeRecord(&again); !bytes.Equal(enc2, enc) {
			t.Fatalf("the stored form is not stable:\n%s\n%s", enc[1:], enc2[1:])
		}
	})
}
