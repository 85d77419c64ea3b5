package gate

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// heldResponse holds the upstream's response back while the gate decides what to answer: the status, the
// headers (in the real writer's header map, as caddyhttp's response recorder keeps them) and the body up to
// max bytes. A body that outgrows max makes the gate decide there and then, inside the upstream's Write:
// decide either sends what is held (WriteResponse), after which the rest streams straight to the client, or
// answers the request itself, after which every Write fails so that the upstream stops. Either way the memory a
// request holds stays bounded by max.
//
// An informational status (100, 103) passes straight through, as with caddyhttp's recorder: it is not the final
// answer. A tunnel is an answer too, and is held like any other: a 101 (or any status) after which the upstream
// takes the connection (Hijack), or a 2xx to CONNECT that the upstream flushes to start the tunnel's stream. The
// gate decides when the upstream would open it, and only a paid tunnel opens: the connection is handed over, or
// the flush goes out, once decide has sent the held answer.
type heldResponse struct {
	*responseWriterWrapper
	buf     *bytes.Buffer
	max     int64
	decide  func() error
	connect bool // the request is a CONNECT: a 2xx answer opens a tunnel

	status      int
	wroteHeader bool
	// named are the Settlement-Overrides values in the header block the upstream wrote its status with: what it
	// charges. One set afterwards is a trailer (chargeNamed).
	named     []string
	decided   bool  // decide ran before the upstream was done: the body outgrew max, or a tunnel opens
	result    error // what decide returned: the gate's result for the request
	streaming bool  // what was held has been sent; what follows goes straight to the client
	tunnel    bool  // the answer opens a tunnel (Hijack, or a flushed 2xx to CONNECT)
	hijacked  bool  // the upstream took the connection: the server may write or flush nothing more on it
	// raw: the upstream took the connection before it wrote a status, to answer on the connection itself.
	raw     bool
	sendErr error // the first failure sending to the client, or reading what to send
	// lost, when set, says why no more of a streaming response may be written (see exchange.holdLost).
	lost func() error
	// opened, when set, is called once the upstream took the connection for its tunnel (see storeUsers.tunnels).
	opened func()
	// client is the connection the upstream took, as handed to it (the last one, should it hijack twice);
	// clientEnd, when set, is called once as its client ends the tunnel (from the upstream's goroutines).
	client    *tunnelConn
	clientEnd func()
}

// errGateAnswered stops an upstream whose response the gate will not send: it answered the request itself.
var errGateAnswered = errors.New("x402 gate: the gate answered this request itself; the upstream's response is not sent")

func newHeldResponse(w http.ResponseWriter, buf *bytes.Buffer, max int64, connect bool, decide func() error) *heldResponse {
	return &heldResponse{responseWriterWrapper: &responseWriterWrapper{ResponseWriter: w}, buf: buf, max: max, connect: connect, decide: decide}
}

// WriteHeader records the status; only an informational one is sent at once, without Settlement-Overrides
// (the header map stays the final answer's, so a charge named before it still counts there).
func (h *heldResponse) WriteHeader(status int) {
	if h.wroteHeader {
		return
	}
	h.status = status
	if status >= 100 && status <= 199 && status != http.StatusSwitchingProtocols {
		hdr := h.Header()
		restore := hideSettlementOverrides(hdr)
		h.responseWriterWrapper.WriteHeader(status)
		restore()
		return
	}
	h.wroteHeader = true
	h.named = slices.Clone(h.Header().Values(x402.HeaderSettlementOverrides))
}

// Write holds p while the body fits in max; past it the gate decides, and p streams or is refused.
func (h *heldResponse) Write(p []byte) (int, error) {
	h.WriteHeader(http.StatusOK)
	if !h.decided && int64(h.buf.Len())+int64(len(p)) > h.max {
		h.decideNow()
	}
	switch {
	case h.streaming:
		if err := h.stillHeld(); err != nil {
			return 0, err
		}
		n, err := h.responseWriterWrapper.Write(p)
		h.sendFailed(err)
		return n, err
	case h.decided:
		return 0, errGateAnswered
	}
	return h.buf.Write(p)
}

// readPieces are the pieces heldResponse.ReadFrom reads a body into while it is held.
var readPieces = sync.Pool{New: func() any { return new([32 << 10]byte) }}

// ReadFrom goes through Write while the body is held, so that max holds; once the rest streams, it is handed
// to the real writer's ReadFrom (sendfile for a file).
func (h *heldResponse) ReadFrom(r io.Reader) (int64, error) {
	h.WriteHeader(http.StatusOK)
	var n int64
	if !h.streaming {
		// The piece is only read into and copied out of (Write keeps none of it): one from the pool, not 32 KiB
		// allocated and zeroed a response.
		pp := readPieces.Get().(*[32 << 10]byte)
		defer readPieces.Put(pp)
		piece := pp[:]
		for !h.streaming {
			m, err := r.Read(piece)
			if m > 0 {
				k, werr := h.Write(piece[:m])
				n += int64(k)
				if werr != nil {
					return n, werr
				}
			}
			if err == io.EOF {
				return n, nil
			}
			if err != nil {
				return n, err
			}
		}
	}
	if h.lost != nil {
		// Piece by piece through Write, which looks at the hold before each (no sendfile).
		m, err := io.Copy(struct{ io.Writer }{h}, r)
		return n + m, err
	}
	m, err := h.responseWriterWrapper.ReadFrom(r)
	h.sendFailed(err)
	return n + m, err
}

// stillHeld returns why no more of the response may be written, and keeps it as the send's failure.
func (h *heldResponse) stillHeld() error {
	if h.lost == nil {
		return nil
	}
	err := h.lost()
	h.sendFailed(err)
	return err
}

// Status returns the status the upstream wrote, if any.
func (h *heldResponse) Status() int { return h.status }

// WriteResponse sends the held status, headers and body. When the gate decided midway, the upstream's later
// writes follow straight to the client. A tunnel's status goes out as the connection is handed over (or is the
// upstream's to write, when it took the connection first).
func (h *heldResponse) WriteResponse() error {
	if h.status == 0 {
		h.WriteHeader(http.StatusOK) // nothing was written: an empty 200, as caddyhttp's recorder sends
	}
	h.streaming = true
	if h.raw {
		return nil
	}
	h.responseWriterWrapper.WriteHeader(h.status)
	_, err := h.buf.WriteTo(h.responseWriterWrapper)
	h.sendFailed(err)
	return err
}

// FlushError flushes only a response that streams: a flush of a held one would send its status before the gate
// decided. A 2xx to CONNECT flushed is a tunnel opening: the gate decides there and then.
func (h *heldResponse) FlushError() error {
	if !h.streaming && h.connect && !h.decided && h.status >= 200 && h.status <= 299 {
		h.tunnel = true
		h.decideNow()
	}
	if !h.streaming {
		return nil
	}
	//nolint:bodyclose
	err := http.NewResponseController(h.responseWriterWrapper).Flush()
	h.sendFailed(err)
	return err
}

// Hijack hands the connection to the upstream, which serves a tunnel on it as it goes: the gate decides first,
// and the connection is handed over only once the held answer was sent (the tunnel was paid for).
func (h *heldResponse) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if !h.decided {
		if !h.wroteHeader {
			// The upstream answers on the connection itself; for the gate it is a 101 it cannot see.
			h.WriteHeader(http.StatusSwitchingProtocols)
			h.raw = true
		}
		h.tunnel = true
		h.decideNow()
	}
	if !h.streaming {
		return nil, nil, errGateAnswered
	}
	//nolint:bodyclose
	conn, brw, err := http.NewResponseController(h.responseWriterWrapper).Hijack()
	if err != nil {
		h.sendFailed(err)
		return nil, nil, err
	}
	if !h.hijacked && h.opened != nil {
		h.opened()
	}
	h.hijacked = true
	var handed net.Conn
	h.client, handed = wrapTunnel(conn, h.clientEnd)
	return handed, brw, nil
}

// clientEnded reports whether the client of a hijacked connection ended its tunnel (tunnelConn).
func (h *heldResponse) clientEnded() bool { return h.client != nil && h.client.clientEnded.Load() }

// decideNow has the gate decide before the upstream is done.
func (h *heldResponse) decideNow() {
	h.decided = true
	h.result = h.decide()
}

// answered reports whether the gate answered midway instead of the upstream.
func (h *heldResponse) answered() bool { return h.decided && !h.streaming }

// chargeNamed returns the charge the upstream named with its status (Settlement-Overrides values), and whether it
// named one in a trailer: after its status (a header set once the header block was written), under a declared
// "Trailer" or with the "Trailer:" prefix. A trailer arrives after the body, when the charge of a streamed answer
// was decided long before; a held one must not be charged otherwise than it would be streamed, so a charge named
// there is never used.
func (h *heldResponse) chargeNamed() (values []string, inTrailer bool) {
	hdr := h.Header()
	values = h.named
	if !h.wroteHeader {
		values = hdr.Values(x402.HeaderSettlementOverrides) // nothing is written yet: the map is the header block
	} else if !slices.Equal(values, hdr.Values(x402.HeaderSettlementOverrides)) {
		inTrailer = true
	}
	for k := range hdr {
		if k != x402.HeaderSettlementOverrides && isSettlementOverrides(k) {
			inTrailer = true // under the trailer prefix (or in a spelling net/http would not look up)
		}
	}
	return values, inTrailer || declaresSettlementOverrides(hdr)
}

// hideSettlementOverrides takes Settlement-Overrides out of hdr, in every form a header block or a trailer can
// carry it, and returns what puts it back.
func hideSettlementOverrides(hdr http.Header) (restore func()) {
	saved := http.Header{}
	for k, v := range hdr {
		if k == "Trailer" || isSettlementOverrides(k) {
			saved[k] = v
		}
	}
	stripSettlementOverrides(hdr)
	return func() { maps.Copy(hdr, saved) }
}

// stripSettlementOverrides takes Settlement-Overrides out of hdr for good: as a header, as a trailer set with
// the "Trailer:" prefix, and from the trailers hdr declares. It reports whether there was any.
func stripSettlementOverrides(hdr http.Header) bool {
	found := false
	for k := range hdr {
		if isSettlementOverrides(k) {
			delete(hdr, k)
			found = true
		}
	}
	if !declaresSettlementOverrides(hdr) {
		return found
	}
	var kept []string
	for _, v := range hdr.Values("Trailer") {
		for name := range strings.SplitSeq(v, ",") {
			if name = strings.TrimSpace(name); name != "" && !strings.EqualFold(name, x402.HeaderSettlementOverrides) {
				kept = append(kept, name)
			}
		}
	}
	if len(kept) == 0 {
		hdr.Del("Trailer")
	} else {
		hdr["Trailer"] = []string{strings.Join(kept, ", ")}
	}
	return true
}

// isSettlementOverrides reports whether a header map key carries Settlement-Overrides, as a header or as a
// trailer under net/http's "Trailer:" prefix, in any case.
func isSettlementOverrides(key string) bool {
	return strings.EqualFold(strings.TrimPrefix(key, http.TrailerPrefix), x402.HeaderSettlementOverrides)
}

// declaresSettlementOverrides reports whether hdr announces Settlement-Overrides as a trailer.
func declaresSettlementOverrides(hdr http.Header) bool {
	for _, v := range hdr.Values("Trailer") {
		for name := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(name), x402.HeaderSettlementOverrides) {
				return true
			}
		}
	}
	return false
}

func (h *heldResponse) sendFailed(err error) {
	if err != nil && h.sendErr == nil {
		h.sendErr = err
	}
}

// responseWriterWrapper passes the optional methods of the real writer through, as caddyhttp's
// ResponseWriterWrapper does, for a wrapper that embeds it and overrides what it changes.
type responseWriterWrapper struct {
	http.ResponseWriter
}

// errNotImplemented is returned when the real writer lacks an optional method.
var errNotImplemented = errors.New("method not implemented")

// Push implements http.Pusher through the real writer.
func (w *responseWriterWrapper) Push(target string, opts *http.PushOptions) error {
	if pusher, ok := w.ResponseWriter.(http.Pusher); ok {
		return pusher.Push(target, opts)
	}
	return errNotImplemented
}

// ReadFrom implements io.ReaderFrom through the real writer's, else io.Copy.
func (w *responseWriterWrapper) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := w.ResponseWriter.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(w.ResponseWriter, r)
}

// Unwrap returns the real writer, for http.ResponseController.
func (w *responseWriterWrapper) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Interface guards
var (
	_ http.ResponseWriter = (*heldResponse)(nil)
	_ io.ReaderFrom       = (*heldResponse)(nil)
	_ http.Hijacker       = (*heldResponse)(nil)
)

// streamBroke accounts for a response that broke off after it began to stream. A paid-for one did not deliver
// what its payment bought: it stays unserved (a settled one with its settlement recorded, an async one settling
// as journalled), so presenting it again serves it without paying again, as for an upstream that fails after
// settlement.
func (x *exchange) streamBroke(up *upstream, cause string) {
	if up.rec.Status() >= http.StatusBadRequest || x.streamed == nil {
		return // passed on unpaid, or the gate answered itself: nothing was bought
	}
	if settled := x.streamed.settled; settled != nil {
		x.note(func(r *journal.Record) { r.State, r.Response = journal.StateFinal, settled })
	}
	x.g.logger.Warn("a paid-for response broke off while it streamed; presenting the payment again serves it",
		zap.String("payment", x.id.String()), zap.String("cause", cause))
}
