package x402

import (
	"encoding/json"
	"fmt"
)

// MergeExtension merges what a client adds to an extension into what the server declared for it, as the
// public clients do: objects merge field by field, recursively, and where both have a field that is not an
// object on both sides the server's value stays, so that the server finds everything it declared echoed
// unchanged (description, version, schema) beside the client's own fields. Where either side is not an
// object, the client's value is the extension. Invalid JSON on either side is an error.
func MergeExtension(declared, added json.RawMessage) (json.RawMessage, error) {
	if len(declared) == 0 {
		return added, nil
	}
	if len(added) == 0 {
		return declared, nil
	}
	var server, client any
	if err := json.Unmarshal(declared, &server); err != nil {
		return nil, fmt.Errorf("the server's declaration of the extension is not JSON: %w", err)
	}
	if err := json.Unmarshal(added, &client); err != nil {
		return nil, fmt.Errorf("the client's extension is not JSON: %w", err)
	}
	so, sok := server.(map[string]any)
	co, cok := client.(map[string]any)
	if !sok || !cok {
		return added, nil
	}
	return json.Marshal(mergeObjects(so, co))
}

// mergeObjects returns server with client's fields added where server has none, and nested objects merged.
func mergeObjects(server, client map[string]any) map[string]any {
	out := make(map[string]any, len(server)+len(client))
	for k, v := range server {
		out[k] = v
	}
	for k, cv := range client {
		sv, ok := out[k]
		if !ok {
			out[k] = cv
			continue
		}
		so, sok := sv.(map[string]any)
		co, cok := cv.(map[string]any)
		if sok && cok {
			out[k] = mergeObjects(so, co)
		}
	}
	return out
}
