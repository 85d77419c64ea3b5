package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestPercentilesAreNearestRank(t *testing.T) {
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	for _, c := range []struct {
		p    float64
		want time.Duration
	}{{50, 50 * time.Millisecond}, {90, 90 * time.Millisecond}, {99, 99 * time.Millisecond}, {100, 100 * time.Millisecond}, {0, time.Millisecond}} {
		if got := percentile(ds, c.p); got != c.want {
			t.Errorf("p%v of 1..100 ms = %s, want %s", c.p, got, c.want)
		}
	}
	if got := percentile([]time.Duration{7 * time.Millisecond}, 99); got != 7*time.Millisecond {
		t.Errorf("p99 of one latency = %s, want it", got)
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("p50 of nothing = %s, want 0", got)
	}
}

// TestRunIsUsableFromGoWithoutCaddy: a Go program benchmarks a URL with Run and Options, no Caddy and no flags:
// every request is sent (the probe and -n more), the JSON report counts them, and options that make no run are
// refused with the flag's name before anything is sent.
func TestRunIsUsableFromGoWithoutCaddy(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Write([]byte("free"))
	}))
	defer srv.Close()
	o := Options{URL: srv.URL + "/", Concurrency: 4, Requests: 40, HTTPMethod: http.MethodGet, Timeout: 5 * time.Second, JSON: true}
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), o, &stdout, &stderr); err != nil {
		t.Fatalf("Run = %v; stderr %s", err, stderr.String())
	}
	var rep Report
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("the report is not JSON: %v: %s", err, stdout.String())
	}
	if rep.Paid || rep.Requests != 40 || rep.OK != 40 || rep.Failed != 0 || rep.Concurrency != 4 {
		t.Errorf("report = paid %v, %d requests, %d ok, %d failed at concurrency %d; want a free run of 40, all ok, at 4",
			rep.Paid, rep.Requests, rep.OK, rep.Failed, rep.Concurrency)
	}
	if got := hits.Load(); got != 41 {
		t.Errorf("the server saw %d requests; want 41 (the probe and 40)", got)
	}
	o.Concurrency = 0
	before := hits.Load()
	if err := Run(context.Background(), o, &stdout, &stderr); err == nil || !strings.Contains(err.Error(), "-c: expected at least 1") {
		t.Errorf("Run with Concurrency 0 = %v; want the -c refusal", err)
	}
	if hits.Load() != before {
		t.Error("Run with Concurrency 0 sent a request")
	}
}

// wrapped is a RoundTripper net/http does not know, as the payer's transport is.
type wrapped struct{ base http.RoundTripper }

func (w wrapped) RoundTrip(r *http.Request) (*http.Response, error) { return w.base.RoundTrip(r) }

// A client whose RoundTripper net/http does not know has its Timeout moved to each request's context, and a
// request through it is still cut off at that timeout, its body included; a plain client is left as it is.
func TestARequestThroughThePayersTransportIsBoundByTheTimeoutOnItsContext(t *testing.T) {
	stall := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select { // the body never comes
		case <-stall:
		case <-time.After(30 * time.Second):
		}
	}))
	defer srv.Close()
	defer close(stall) // before the server's close, which waits for its handler
	plain := client(1, 300*time.Millisecond)
	if c, timeout := deadlineByContext(plain); c != plain || timeout != 0 {
		t.Fatalf("a plain client: %p, %s; want it as it is, and no timeout of its own", c, timeout)
	}
	payers := &http.Client{Transport: wrapped{plain.Transport}, Timeout: 300 * time.Millisecond}
	c, timeout := deadlineByContext(payers)
	if c.Timeout != 0 || timeout != 300*time.Millisecond || payers.Timeout != 300*time.Millisecond {
		t.Fatalf("the payer's client: Timeout %s, timeout %s (its own %s); want 0, 300ms, and its own left alone", c.Timeout, timeout, payers.Timeout)
	}
	tl := newTally(1)
	start := time.Now()
	one(context.Background(), c, timeout, http.MethodGet, srv.URL, "", "", nil, nil, tl)
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("the request took %s: not cut off at its timeout", took)
	}
	if tl.ok != 0 || len(tl.failures) != 1 {
		t.Fatalf("ok %d, failures %v; want the stalled body counted as a failure", tl.ok, tl.failures)
	}
	for f := range tl.failures {
		if f.Status != http.StatusOK || !strings.Contains(f.Reason, "body cut short") {
			t.Fatalf("failure %+v; want the 200 whose body was cut short", f)
		}
	}
}
