package chaintest

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Fault is what a FaultProxy does to one JSON-RPC request.
type Fault int

// Faults a FaultProxy injects.
const (
	// Pass forwards the request and returns the node's answer.
	Pass Fault = iota
	// Drop closes the connection without forwarding: the node never sees the request.
	Drop
	// DieAfterForward forwards the request, then closes the connection without answering: the node acted
	// on it (a transaction may be in its pool) but the caller cannot know.
	DieAfterForward
	// Delay forwards after a pause of FaultProxy.DelayBy.
	Delay
	// ErrorStatus answers 503 without forwarding.
	ErrorStatus
	// RPCError answers a JSON-RPC error without forwarding.
	RPCError
	// Hang accepts the request and never answers: the handler holds the connection open until the caller gives
	// up or the proxy closes. The node never sees the request.
	Hang
	// Refuse answers eth_sendRawTransaction as a node refusing the transaction would (JSON-RPC error -32000,
	// "insufficient funds for gas * price + value") without forwarding it; other methods pass.
	Refuse

	// faultCount is how many faults there are; keep it last.
	faultCount
)

// FaultProxy is a JSON-RPC proxy on 127.0.0.1 in front of a node, which injects faults decided per request
// by Decide (method name in, fault out). It counts what it did.
type FaultProxy struct {
	URL     string
	DelayBy time.Duration

	target string
	mu     sync.Mutex
	decide func(method string) Fault
	srv    *http.Server
	counts [faultCount]atomic.Int64

	closed    chan struct{} // closed by Close: hung requests end
	closeOnce sync.Once
}

// NewFaultProxy starts a proxy in front of the JSON-RPC endpoint target; it stops on tb.Cleanup.
func NewFaultProxy(tb testing.TB, target string) *FaultProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("fault proxy: %v", err)
	}
	p := &FaultProxy{URL: "http://" + ln.Addr().String(), target: target, DelayBy: 50 * time.Millisecond, closed: make(chan struct{})}
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = p.srv.Serve(ln) }()
	tb.Cleanup(p.Close)
	return p
}

// Close stops the proxy: it stops accepting, ends the requests it holds hanging and closes every connection.
// It is safe to call more than once; NewFaultProxy's cleanup calls it too.
func (p *FaultProxy) Close() {
	p.closeOnce.Do(func() {
		close(p.closed)
		_ = p.srv.Close()
	})
}

// SetDecide sets the fault policy; nil passes everything.
func (p *FaultProxy) SetDecide(decide func(method string) Fault) {
	p.mu.Lock()
	p.decide = decide
	p.mu.Unlock()
}

// Random returns a policy that injects each fault of faults with probability rate (split evenly), for the
// methods matching any of the given prefixes (all methods when none given).
func Random(rate float64, faults []Fault, prefixes ...string) func(string) Fault {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(1, 2))
	return func(method string) Fault {
		if len(prefixes) > 0 {
			match := false
			for _, pre := range prefixes {
				match = match || strings.HasPrefix(method, pre)
			}
			if !match {
				return Pass
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if r.Float64() >= rate {
			return Pass
		}
		return faults[r.IntN(len(faults))]
	}
}

// Count is how many requests got fault f.
func (p *FaultProxy) Count(f Fault) int64 { return p.counts[f].Load() }

func (p *FaultProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var probe struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
	}
	_ = json.Unmarshal(body, &probe) // batches have no top-level method: they pass by the empty name
	p.mu.Lock()
	decide := p.decide
	p.mu.Unlock()
	f := Pass
	if decide != nil {
		f = decide(probe.Method)
	}
	if f == Refuse && probe.Method != "eth_sendRawTransaction" {
		f = Pass // only a transaction can be refused
	}
	p.counts[f].Add(1)
	switch f {
	case Drop:
		hangUp(w)
		return
	case ErrorStatus:
		http.Error(w, "node overloaded (injected)", http.StatusServiceUnavailable)
		return
	case RPCError:
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"jsonrpc":"2.0","id":1,"error":{"code":-32603,"message":"injected internal error"}}`))
		return
	case Refuse:
		id := probe.ID
		if len(id) == 0 {
			id = json.RawMessage("1")
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"jsonrpc":"2.0","id":` + string(id) + `,"error":{"code":-32000,"message":"insufficient funds for gas * price + value"}}`))
		return
	case Hang:
		select {
		case <-r.Context().Done():
		case <-p.closed:
		}
		hangUp(w)
		return
	case Delay:
		time.Sleep(p.DelayBy)
	}
	resp, err := http.Post(p.target, "application/json", bytes.NewReader(body))
	if err != nil {
		hangUp(w)
		return
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(resp.Body)
	if f == DieAfterForward {
		hangUp(w)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(answer)
}

// hangUp closes the client's connection without an answer.
func hangUp(w http.ResponseWriter) {
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			_ = conn.Close()
			return
		}
	}
	panic(http.ErrAbortHandler)
}
