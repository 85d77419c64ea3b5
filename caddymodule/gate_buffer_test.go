package caddymodule_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The gate holds back at most max_buffer of the upstream's body while a payment is not settled: these tests
// download bodies many times that size and watch the heap, the answers and the chain.

const (
	bigChunk  = 32 << 10 // the big upstream writes its body in pieces of this size
	maxBuffer = 1 << 20  // the gates below say max_buffer 1MiB
)

// Several downloads, each sixteen times max_buffer, run at once in each settlement mode. Holding whole bodies
// would keep them all in memory at the moment each upstream is about to send its last piece; the gate holds
// at most max_buffer of each, so the live heap then grows by a few megabytes. Every download arrives whole, and
// every payment is settled exactly once.
func TestConcurrentDownloadsLargerThanMaxBufferStreamWithBoundedMemoryAndArePaidOnceEach(t *testing.T) {
	const size, downloads = 16 << 20, 4
	want := bigBodySum(size)
	for _, mode := range []string{"after", "before", "async"} {
		t.Run(mode, func(t *testing.T) {
			up := newBigUpstream(t, size)
			env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr,
				gate: "\t\tsettle " + mode + "\n\t\tmax_buffer 1MiB\n"})
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			before := env.balances(payer)
			sentBefore := env.sent()
			var headers []string
			for range downloads {
				headers = append(headers, env.permit2Header("/", payer))
			}

			arrived, release := up.pauseAt(size - bigChunk)
			defer release()
			heap := startHeapSampler()
			results := make(chan download, downloads)
			for _, h := range headers {
				go func() { results <- env.download("/", x402.HeaderPaymentSignature, h) }()
			}
			for i := range downloads {
				gateWait(t, arrived, fmt.Sprintf("download %d to reach its last piece", i))
			}
			// Every upstream has sent all but its last piece: whatever the gate holds of the bodies, it holds now.
			heap.sample()
			release()
			var got []download
			for i := range downloads {
				got = append(got, gateWait(t, results, fmt.Sprintf("download %d", i)))
			}
			growth := heap.stop()

			txs := map[string]bool{}
			for i, d := range got {
				if d.err != nil || d.status != http.StatusOK || d.n != size || d.sum != want {
					t.Fatalf("download %d: %d, %d of %d bytes, intact %v, error %v (%q); want 200 and the whole body",
						i, d.status, d.n, size, d.sum == want, d.err, d.start)
				}
				resp := settleResponse(t, gateAnswer{status: d.status, header: d.header})
				switch {
				case mode == "async" && resp.ErrorReason != x402.ReasonSettlementPending:
					t.Errorf("download %d: PAYMENT-RESPONSE %+v, want settlement_pending", i, resp)
				case mode != "async" && (!resp.Success || resp.Transaction == ""):
					t.Errorf("download %d: PAYMENT-RESPONSE %+v, want success naming the transaction", i, resp)
				}
				txs[resp.Transaction] = true
			}
			if mode == "async" {
				env.waitPaid(payer, before, downloads)
			} else {
				env.assertPaid(payer, before, downloads)
				if len(txs) != downloads {
					t.Errorf("%d distinct transactions named for %d payments", len(txs), downloads)
				}
			}
			if sent := env.sent() - sentBefore; sent != downloads {
				t.Errorf("the settlement wallets sent %d transactions for %d payments, want one each", sent, downloads)
			}
			// Whole bodies would need size x downloads (64 MiB); the gate's share is max_buffer x downloads.
			if limit := uint64(size * downloads / 2); growth > limit {
				t.Errorf("the live heap grew by %.1f MiB during %d downloads of %d MiB; want under %d MiB (max_buffer is 1 MiB)",
					float64(growth)/(1<<20), downloads, size>>20, limit>>20)
			}
			t.Logf("live heap growth during the downloads: %.1f MiB", float64(growth)/(1<<20))
		})
	}
}

// A large body whose payment does not settle is not sent: the gate answers itself, as for a small one. Refused:
// 402 with the settlement's answer and nothing moved. Facilitator unreachable: 502, and the same payment
// presented again is settled and served whole, once.
func TestALargeBodyWhosePaymentDoesNotSettleGetsTheGatesAnswerNotTheBody(t *testing.T) {
	const size = 4 << 20
	t.Run("refused", func(t *testing.T) {
		up := newBigUpstream(t, size)
		env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tmax_buffer 1MiB\n"})
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		header := env.permit2Header("/", payer)
		arrived, release := up.pauseAt(0)
		defer release()
		pending := make(chan download, 1)
		go func() { pending <- env.download("/", x402.HeaderPaymentSignature, header) }()
		gateWait(t, arrived, "the upstream call")
		// Verified; before the upstream sends anything, the payer's tokens go elsewhere.
		env.c.TransferToken(payer, common.HexToAddress("0x000000000000000000000000000000000000dEaD"), env.c.TokenBalance(payer.Address))
		before := env.balances(payer)
		release()
		d := gateWait(t, pending, "the answer")
		if d.status != http.StatusPaymentRequired || d.n >= maxBuffer || !json.Valid([]byte(d.start)) {
			t.Fatalf("answer: %d with %d bytes (%q), want the gate's 402 and not the body", d.status, d.n, d.start)
		}
		a := gateAnswer{status: d.status, header: d.header, body: d.start}
		if resp := settleResponse(t, a); resp.Success || resp.ErrorReason == "" {
			t.Errorf("PAYMENT-RESPONSE = %+v, want a failed settlement with its reason", resp)
		}
		if d.header.Get("X-Upstream") != "" {
			t.Error("the upstream's headers leaked into the gate's 402")
		}
		env.assertPaid(payer, before, 0)
	})
	t.Run("unreachable", func(t *testing.T) {
		up := newBigUpstream(t, size)
		env := newGateEnv(t, gateSetup{remote: true, site: "reverse_proxy " + up.Addr, gate: "\t\tmax_buffer 1MiB\n"})
		payer := env.c.Payers[0]
		env.approvePermit2(payer)
		before := env.balances(payer)
		header := env.permit2Header("/", payer)
		env.remote.setSettleFault("down")
		d := env.download("/", x402.HeaderPaymentSignature, header)
		var body struct{ Outcome string }
		if d.status != http.StatusBadGateway || d.n >= maxBuffer || json.Unmarshal([]byte(d.start), &body) != nil ||
			body.Outcome != string(x402.OutcomeSettleUnreachable) {
			t.Fatalf("answer: %d with %d bytes (%q), want the gate's 502 settle-unreachable and not the body", d.status, d.n, d.start)
		}
		env.remote.setSettleFault("")
		d = env.download("/", x402.HeaderPaymentSignature, header)
		if d.err != nil || d.status != http.StatusOK || d.n != size || d.sum != bigBodySum(size) {
			t.Fatalf("the same payment presented again: %d, %d of %d bytes, error %v, want 200 and the whole body", d.status, d.n, size, d.err)
		}
		env.assertPaid(payer, before, 1)
	})
}

// An upstream error is never paid for, however large: its body streams through with nothing settled and without
// being held whole, and the payment stays good for another try.
func TestALargeUpstreamErrorStreamsThroughUnpaid(t *testing.T) {
	const size = 16 << 20
	up := newBigUpstream(t, size)
	up.setStatus(http.StatusNotFound)
	env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tmax_buffer 1MiB\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	sentBefore := env.sent()
	header := env.permit2Header("/", payer)

	arrived, release := up.pauseAt(size - bigChunk)
	defer release()
	heap := startHeapSampler()
	result := make(chan download, 1)
	go func() { result <- env.download("/", x402.HeaderPaymentSignature, header) }()
	gateWait(t, arrived, "the upstream to reach its last piece")
	heap.sample()
	release()
	d := gateWait(t, result, "the upstream's 404")
	growth := heap.stop()
	if d.err != nil || d.status != http.StatusNotFound || d.n != size || d.sum != bigBodySum(size) {
		t.Fatalf("answer: %d, %d of %d bytes, error %v; want the upstream's 404 with its whole body", d.status, d.n, size, d.err)
	}
	if v := d.header.Get(x402.HeaderPaymentResponse); v != "" {
		t.Errorf("the unpaid 404 carries PAYMENT-RESPONSE %s", v)
	}
	if limit := uint64(size / 2); growth > limit {
		t.Errorf("the live heap grew by %.1f MiB while a %d MiB error streamed; want under %d MiB (max_buffer is 1 MiB)",
			float64(growth)/(1<<20), size>>20, limit>>20)
	}
	if sent := env.sent() - sentBefore; sent != 0 {
		t.Errorf("%d settlement transactions sent for an upstream error, want none", sent)
	}
	env.assertPaid(payer, before, 0)

	up.setStatus(http.StatusOK)
	if d := env.download("/", x402.HeaderPaymentSignature, header); d.status != http.StatusOK || d.n != size {
		t.Fatalf("the same payment once the upstream works: %d with %d bytes, want 200 and the whole body", d.status, d.n)
	}
	env.assertPaid(payer, before, 1)
}

// A download cut off after its payment settled (the body had outgrown max_buffer and was streaming) has not
// bought its response: the payment stays settled and unserved, and presenting it again serves the whole body
// from that settlement, without a second transfer, once.
func TestALargeDownloadCutOffMidwayIsServedWholeWhenItsPaymentIsPresentedAgainWithoutPayingTwice(t *testing.T) {
	const size = 4 << 20
	up := newBigUpstream(t, size)
	env := newGateEnv(t, gateSetup{site: "reverse_proxy " + up.Addr, gate: "\t\tmax_buffer 1MiB\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	header := env.permit2Header("/", payer)

	up.abortAt(3 << 20)
	first := env.download("/", x402.HeaderPaymentSignature, header)
	if first.err == nil || first.n >= size {
		t.Fatalf("the cut-off download: %d with %d of %d bytes and no error; want it to end early", first.status, first.n, size)
	}
	// The payment settled when the body outgrew max_buffer.
	env.assertPaid(payer, before, 1)
	tx := settleResponse(t, gateAnswer{status: first.status, header: first.header}).Transaction

	up.abortAt(0)
	again := env.download("/", x402.HeaderPaymentSignature, header)
	if again.err != nil || again.status != http.StatusOK || again.n != size || again.sum != bigBodySum(size) {
		t.Fatalf("presented again: %d, %d of %d bytes, error %v; want 200 and the whole body", again.status, again.n, size, again.err)
	}
	if resp := settleResponse(t, gateAnswer{status: again.status, header: again.header}); !resp.Success || resp.Transaction != tx {
		t.Errorf("presented again: PAYMENT-RESPONSE %+v, want success with the first transaction %s", resp, tx)
	}
	env.assertPaid(payer, before, 1)
	if third := env.get("/", x402.HeaderPaymentSignature, header); third.status != http.StatusPaymentRequired {
		t.Fatalf("presented a third time, after it was served: %d, want 402", third.status)
	}
}

// bigUpstream is an origin whose body is made as it is sent, never held whole: size bytes in pieces of
// bigChunk, each piece different, the same bytes on every request. It can pause each response at an offset
// until the test lets it go, and cut the connection at another.
type bigUpstream struct {
	Addr string
	size int

	mu      sync.Mutex
	status  int
	pause   int           // responses stop before this offset while release is open; -1 for none
	arrived chan struct{} // receives once per response that stopped
	release chan struct{}
	abort   int // when > 0, the connection is cut after this many bytes
}

func newBigUpstream(t *testing.T, size int) *bigUpstream {
	t.Helper()
	u := &bigUpstream{size: size, status: http.StatusOK, pause: -1}
	srv := httptest.NewServer(u)
	t.Cleanup(srv.Close)
	u.Addr = strings.TrimPrefix(srv.URL, "http://")
	return u
}

func (u *bigUpstream) setStatus(status int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.status = status
}

// abortAt makes later responses end abruptly after n bytes; 0 lets them finish.
func (u *bigUpstream) abortAt(n int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.abort = n
}

// pauseAt makes later responses stop before offset until release is called; arrived receives once per
// response that stopped.
func (u *bigUpstream) pauseAt(offset int) (arrived <-chan struct{}, release func()) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.pause, u.arrived, u.release = offset, make(chan struct{}, 16), make(chan struct{})
	ch := u.release
	var once sync.Once
	return u.arrived, func() { once.Do(func() { close(ch) }) }
}

func (u *bigUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	status, pause, arrived, release, abort := u.status, u.pause, u.arrived, u.release, u.abort
	u.mu.Unlock()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("X-Upstream", "yes")
	w.WriteHeader(status)
	_ = writeBigBody(w, u.size, func(off int) error {
		if off == pause {
			arrived <- struct{}{}
			select {
			case <-release:
			case <-r.Context().Done():
				return r.Context().Err()
			}
		}
		if abort > 0 && off >= abort {
			_ = http.NewResponseController(w).Flush()
			panic(http.ErrAbortHandler) // the connection is cut with the body unfinished
		}
		return nil
	})
}

// writeBigBody writes the big body to w, calling before ahead of each piece with its offset.
func writeBigBody(w io.Writer, size int, before func(off int) error) error {
	piece := make([]byte, bigChunk)
	for off := 0; off < size; off += bigChunk {
		if err := before(off); err != nil {
			return err
		}
		for i := range piece {
			piece[i] = byte(off/bigChunk*31 + i*7 + i>>8)
		}
		if _, err := w.Write(piece[:min(bigChunk, size-off)]); err != nil {
			return err
		}
	}
	return nil
}

// bigBodySum is the SHA-256 of the big body of size bytes.
func bigBodySum(size int) [32]byte {
	h := sha256.New()
	_ = writeBigBody(h, size, func(int) error { return nil })
	return [32]byte(h.Sum(nil))
}

// download is a response as received, its body hashed as it arrived rather than kept.
type download struct {
	status int
	header http.Header
	n      int64    // body bytes received
	sum    [32]byte // SHA-256 of the body received
	start  string   // the body's first bytes, to show in failures and to read the gate's own answers
	err    error    // the request failed, or the body ended early
}

// download requests path with the given headers (name, value pairs); it is safe in goroutines.
func (env *gateEnv) download(path string, headers ...string) download {
	req, err := http.NewRequest(http.MethodGet, env.srv.URL+path, nil)
	if err != nil {
		return download{err: err}
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return download{err: err}
	}
	defer resp.Body.Close()
	h := sha256.New()
	var start bytes.Buffer
	n, err := io.Copy(io.MultiWriter(h, &prefixWriter{buf: &start, max: 4 << 10}), resp.Body)
	return download{status: resp.StatusCode, header: resp.Header, n: n, sum: [32]byte(h.Sum(nil)), start: start.String(), err: err}
}

// prefixWriter keeps the first max bytes written to it and takes the rest without keeping it.
type prefixWriter struct {
	buf *bytes.Buffer
	max int
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	if room := p.max - p.buf.Len(); room > 0 {
		p.buf.Write(b[:min(room, len(b))])
	}
	return len(b), nil
}

// heapSampler watches the live heap of this process (Caddy runs in it) while the test runs.
type heapSampler struct {
	base uint64
	peak atomic.Uint64
	mu   sync.Mutex // one sample at a time
	done chan struct{}
	wg   sync.WaitGroup
}

// startHeapSampler measures the live heap now and then every 50 ms until stop.
func startHeapSampler() *heapSampler {
	s := &heapSampler{base: liveHeap(), done: make(chan struct{})}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			select {
			case <-s.done:
				return
			case <-time.After(50 * time.Millisecond):
				s.sample()
			}
		}
	}()
	return s
}

// sample measures the live heap once.
func (s *heapSampler) sample() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := liveHeap(); h > s.peak.Load() {
		s.peak.Store(h)
	}
}

// stop ends the sampling and returns by how much the live heap grew at its peak.
func (s *heapSampler) stop() uint64 {
	close(s.done)
	s.wg.Wait()
	if peak := s.peak.Load(); peak > s.base {
		return peak - s.base
	}
	return 0
}

// liveHeap is the heap in use right after a collection: garbage waiting for the collector would hide, or fake,
// the megabytes these tests look for.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
