package gate

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestAHeldResponseThatFitsReachesTheClientOnlyWhenTheGateSendsIt(t *testing.T) {
	client := httptest.NewRecorder()
	h := newHeldResponse(client, new(bytes.Buffer), 64, false, func() error {
		t.Fatal("a body within max made the gate decide early")
		return nil
	})
	h.Header().Set("X-Upstream", "yes")
	h.WriteHeader(http.StatusCreated)
	_, _ = h.Write([]byte("small"))
	_ = h.FlushError()
	if client.Code != http.StatusOK || client.Body.Len() != 0 || client.Flushed {
		t.Fatalf("before the gate sent it, the client got %d %q (flushed %v); want nothing", client.Code, client.Body, client.Flushed)
	}
	if err := h.WriteResponse(); err != nil {
		t.Fatal(err)
	}
	if client.Code != http.StatusCreated || client.Body.String() != "small" || client.Header().Get("X-Upstream") != "yes" {
		t.Fatalf("the client got %d %q %v, want the upstream's 201 \"small\" with its header", client.Code, client.Body, client.Header())
	}
}

func TestAHeldResponseThatOutgrowsMaxIsDecidedOnceAndStreamsWhileHoldingNoMoreThanMax(t *testing.T) {
	const max, size = 1000, 10_000
	client := httptest.NewRecorder()
	buf := new(bytes.Buffer)
	decisions := 0
	var h *heldResponse
	h = newHeldResponse(client, buf, max, false, func() error {
		decisions++
		if buf.Len() > max {
			t.Errorf("the gate decided holding %d bytes, more than max %d", buf.Len(), max)
		}
		return h.WriteResponse()
	})
	body := make([]byte, size)
	for i := range body {
		body[i] = byte(i * 7)
	}
	// ReadFrom, as file_server copies, in pieces smaller than max.
	n, err := h.ReadFrom(io.LimitReader(bytes.NewReader(body), size)) // LimitReader hides WriterTo
	if err != nil || n != size {
		t.Fatalf("ReadFrom = %d, %v; want %d, nil", n, err, size)
	}
	if decisions != 1 {
		t.Errorf("the gate decided %d times, want once", decisions)
	}
	if !bytes.Equal(client.Body.Bytes(), body) {
		t.Fatalf("the client got %d bytes, not the %d the upstream wrote, in order", client.Body.Len(), size)
	}
	if err := h.FlushError(); err != nil || !client.Flushed {
		t.Errorf("a streaming response did not flush (%v)", err)
	}
}

func TestAHeldResponseTheGateAnsweredInsteadRefusesTheUpstreamsWrites(t *testing.T) {
	client := httptest.NewRecorder()
	answer := errors.New("the gate's own answer")
	h := newHeldResponse(client, new(bytes.Buffer), 4, false, func() error {
		http.Error(client, "payment refused", http.StatusPaymentRequired)
		return answer
	})
	if _, err := h.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if _, err := h.Write([]byte("more")); !errors.Is(err, errGateAnswered) {
			t.Fatalf("write %d after the gate answered: %v, want errGateAnswered", i, err)
		}
	}
	_ = h.FlushError()
	if !h.answered() || h.result != answer {
		t.Errorf("answered %v with %v, want the gate's answer kept", h.answered(), h.result)
	}
	if client.Code != http.StatusPaymentRequired || bytes.Contains(client.Body.Bytes(), []byte("held")) || client.Flushed {
		t.Fatalf("the client got %d %q (flushed %v), want only the gate's 402", client.Code, client.Body, client.Flushed)
	}
}

// An informational status is not the answer: it goes to the client at once, and the final one is held.
func TestAHeldResponsePassesInformationalStatusesStraightThrough(t *testing.T) {
	client := httptest.NewRecorder()
	h := newHeldResponse(client, new(bytes.Buffer), 64, false, func() error { return nil })
	h.WriteHeader(http.StatusEarlyHints)
	if client.Code != http.StatusEarlyHints {
		t.Fatalf("103 reached the client as %d", client.Code)
	}
	h.WriteHeader(http.StatusAccepted)
	if h.Status() != http.StatusAccepted || client.Code != http.StatusEarlyHints {
		t.Fatalf("status %d held, client saw %d; want 202 held and only the 103 sent", h.Status(), client.Code)
	}
}

// A 2xx to CONNECT that the upstream flushes opens a tunnel (reverse_proxy answers HTTP/2 extended CONNECT so):
// the gate decides at the flush, and the answer streams from there; held, the client would wait for ever.
func TestAFlushed2xxToCONNECTIsATunnelTheGateDecidesAtTheFlush(t *testing.T) {
	client := httptest.NewRecorder()
	decisions := 0
	var h *heldResponse
	h = newHeldResponse(client, new(bytes.Buffer), 1<<20, true, func() error {
		decisions++
		return h.WriteResponse()
	})
	h.WriteHeader(http.StatusOK)
	if err := h.FlushError(); err != nil {
		t.Fatal(err)
	}
	if decisions != 1 || !h.tunnel || client.Code != http.StatusOK || !client.Flushed {
		t.Fatalf("after the flush: %d decisions, tunnel %v, client %d flushed %v; want one decision and the 200 out", decisions, h.tunnel, client.Code, client.Flushed)
	}
	_, _ = h.Write([]byte("frame"))
	if client.Body.String() != "frame" {
		t.Fatalf("the tunnel's bytes reached the client as %q, want them streamed", client.Body)
	}
	// Not a CONNECT: a flush of a held answer sends nothing and decides nothing.
	other := httptest.NewRecorder()
	g := newHeldResponse(other, new(bytes.Buffer), 1<<20, false, func() error { t.Fatal("decided at a flush"); return nil })
	g.WriteHeader(http.StatusOK)
	_ = g.FlushError()
	if other.Flushed {
		t.Fatal("a held answer was flushed")
	}
}

// Settlement-Overrides stays out of an informational answer and stays in the map for the final one; a charge
// set after the status, or announced as a trailer, is a trailer's.
func TestSettlementOverridesIsHiddenFromA103AndATrailerNamesNoCharge(t *testing.T) {
	var sent http.Header
	client := &informational{ResponseRecorder: httptest.NewRecorder(), sent: func(h http.Header) { sent = h.Clone() }}
	h := newHeldResponse(client, new(bytes.Buffer), 64, false, func() error { return nil })
	h.Header().Set("Link", "</a.css>; rel=preload")
	h.Header().Set(x402.HeaderSettlementOverrides, `{"amount":"1"}`)
	h.WriteHeader(http.StatusEarlyHints)
	if sent.Get("Link") == "" || sent.Get(x402.HeaderSettlementOverrides) != "" {
		t.Fatalf("the 103 went out with %v; want its Link without Settlement-Overrides", sent)
	}
	h.WriteHeader(http.StatusOK)
	if v, inTrailer := h.chargeNamed(); len(v) != 1 || inTrailer {
		t.Fatalf("charge named with the status = %q (trailer %v), want the one set before the 103", v, inTrailer)
	}
	h.Header().Set(x402.HeaderSettlementOverrides, `{"amount":"2"}`)
	if _, inTrailer := h.chargeNamed(); !inTrailer {
		t.Fatal("a charge set after the status was taken for the header's")
	}
	hdr := http.Header{"Trailer": {"X-Sum, settlement-overrides"}, http.TrailerPrefix + x402.HeaderSettlementOverrides: {"3"}}
	if !stripSettlementOverrides(hdr) || len(hdr) != 1 || hdr.Get("Trailer") != "X-Sum" {
		t.Fatalf("stripped: %v, want only the X-Sum trailer announced", hdr)
	}
}

// informational is a recorder that reports the header map each 1xx is written with.
type informational struct {
	*httptest.ResponseRecorder
	sent func(http.Header)
}

func (w *informational) WriteHeader(status int) {
	if status >= 100 && status <= 199 {
		w.sent(w.Header())
		return
	}
	w.ResponseRecorder.WriteHeader(status)
}
