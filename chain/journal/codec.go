package journal

import (
	"encoding/json"
	"fmt"
)

// recordFormat is the first byte of every stored record. JSON follows it; a new layout gets a new number and
// a decoder for the old one, so a journal written by one release is read by the next.
const recordFormat byte = 1

// encodeRecord writes r as stored: the format byte, then JSON (readable in a dump, and tolerant of fields
// added later).
func encodeRecord(r *Record) ([]byte, error) {
	body, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("encode record %s: %w", r.ID, err)
	}
	out := make([]byte, 0, 1+len(body))
	out = append(out, recordFormat)
	return append(out, body...), nil
}

// decodeRecord reads a record stored under id. Any damage is reported as ErrCorrupt naming the id, so an
// operator knows which payment to look at.
func decodeRecord(id ID, b []byte) (Record, error) {
	if len(b) == 0 {
		return Record{}, fmt.Errorf("%w: record %s is empty", ErrCorrupt, id)
	}
	if b[0] != recordFormat {
		return Record{}, fmt.Errorf("%w: record %s has format %d, this build reads format %d (written by a newer release?)",
			ErrCorrupt, id, b[0], recordFormat)
	}
	var r Record
	if err := json.Unmarshal(b[1:], &r); err != nil {
		return Record{}, fmt.Errorf("%w: record %s does not decode: %w", ErrCorrupt, id, err)
	}
	if r.ID != id {
		return Record{}, fmt.Errorf("%w: record stored under %s says its id is %s", ErrCorrupt, id, r.ID)
	}
	if err := r.validate(); err != nil {
		return Record{}, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return r, nil
}
