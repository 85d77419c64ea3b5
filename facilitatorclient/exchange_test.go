package facilitatorclient

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// answerKeys are the top-level member names of the answers the client reads.
var answerKeys = strings.Fields("isValid payer invalidReason invalidMessage extensions success transaction network amount errorReason errorMessage kinds signers status networks")

// foldedTopLevelKeys reports whether a JSON object has a top-level key that differs from an answer's member name
// only in case, which encoding/json (behind the client) reads as that member and the strict x402 decoders do not.
func foldedTopLevelKeys(body []byte) bool {
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil {
		return true
	}
	for k := range top {
		for _, w := range answerKeys {
			if k != w && strings.EqualFold(k, w) {
				return true
			}
		}
	}
	return false
}

// sameJSON reports whether a and b encode to the same JSON.
func sameJSON(t *testing.T, a, b any) bool {
	ja, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	jb, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(ja, jb)
}

// The client takes a facilitator's body as its answer only with the status the protocol allows for it (a refusal
// or a settlement that names a transaction may come with 400 or 5xx), and where the strict x402 decoder accepts
// the body of a 2xx answer the client reads the same answer.
func FuzzDecodeFacilitatorAnswers(f *testing.F) {
	bodies := []string{`{"isValid":true,"payer":"0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"}`,
		`{"isValid":false,"invalidReason":"insufficient_funds","invalidMessage":"balance 5 is below 10"}`, `{"isValid":false}`, `{"isValid":null}`,
		`{"success":true,"transaction":"0xabc","network":"eip155:72344","payer":"0x1"}`, `{"success":false,"errorReason":"settlement_pending","transaction":"0xabc"}`,
		`{"success":false}`, `{"kinds":[{"x402Version":2,"scheme":"exact","network":"eip155:72344","extra":{}}],"extensions":[],"signers":{}}`, `{"kinds":null}`,
		`{"status":"ok","networks":[{"network":"eip155:72344","status":"ok","rpcReachable":true,"journalBacklog":0}]}`, `{"status":""}`, "", "{}", "[]", `{"IsValid":true}`}
	for _, body := range bodies {
		for _, status := range []uint16{200, 400, 402, 500, 503} {
			f.Add(status, []byte(body))
		}
	}
	f.Fuzz(func(t *testing.T, code uint16, body []byte) {
		status := int(code % 600)
		allowed := func(ok bool) bool {
			return status >= 200 && status < 300 || ok && (status == http.StatusBadRequest || status >= 500)
		}

		v, ok := decodeVerify(status, body)
		if ok && !allowed(!v.IsValid && v.InvalidReason != "") {
			t.Fatalf("decodeVerify(%d) took %+v as the answer", status, v)
		}
		if strict, err := x402.UnmarshalVerifyResponse(body); err == nil && status/100 == 2 && !foldedTopLevelKeys(body) && (!ok || !sameJSON(t, v, strict)) {
			t.Fatalf("decodeVerify(%d) = %+v, %v; the strict decoder reads %+v", status, v, ok, strict)
		}

		s, ok := decodeSettle(status, body)
		if ok && !allowed(s.ErrorReason != "" || s.Transaction != "") {
			t.Fatalf("decodeSettle(%d) took %+v as the answer", status, s)
		}
		if strict, err := x402.UnmarshalSettleResponse(body); err == nil && !foldedTopLevelKeys(body) {
			// A settlement that names its transaction is never lost, whatever the status.
			keep := status/100 == 2 || (allowed(true) && (strict.ErrorReason != "" || strict.Transaction != ""))
			if keep && (!ok || !sameJSON(t, s, strict)) {
				t.Fatalf("decodeSettle(%d) = %+v, %v; the strict decoder reads %+v", status, s, ok, strict)
			}
		}

		if sup, ok := decodeSupported(status, body); ok && (status/100 != 2 || sup.Kinds == nil) {
			t.Fatalf("decodeSupported(%d) took %+v as the answer", status, sup)
		}
		if h, ok := decodeHealth(status, body); ok && (h.Status == "" || !allowed(true)) {
			t.Fatalf("decodeHealth(%d) took %+v as the answer", status, h)
		}
	})
}
