package gate

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// heldResponse holds the upstream's response back while the gate decides what to answer: the status, the
// headers (in the real writer's header map, as caddyhttp's response recorder keeps them) and the body up to
// max bytes. A body that outgrows max makes the gate decide there and then, inside the upstream's Write:
// decide either sends what is held (WriteResponse), after which the rest streams straight to the client, or
// answers the request itself, after which every Write fails so that the upstream stops. Either way the memory a
// request holds stays bounded by max.
//
// Like caddyhttp's recorder, a 1xx status passes straight through: it is not the final answer, and 101 hands
// the connection over to the upstream.
type heldResponse struct {
	*responseWriterWrapper
	buf    *bytes.Buffer
	max    int64
	decide func() error

	status      int
	wroteHeader bool
	decided     bool  // the body outgrew max and decide ran
	result      error // what decide returned: the gate's result for the request
	streaming   bool  // what was held has been sent; what follows goes straight to the client
	sendErr     error // the first failure sending to the client, or reading what to send
}

// errGateAnswered stops an upstream whose response the gate will not send: it answered the request itself.
var errGateAnswered = errors.New("x402 gate: the gate answered this request itself; the upstream's response is not sent")

func newHeldResponse(w http.ResponseWriter, buf *bytes.Buffer, max int64, decide func() error) *heldResponse {
	return &heldResponse{responseWriterWrapper: &responseWriterWrapper{ResponseWriter: w}, buf: buf, max: max, decide: decide}
}

// WriteHeader records the status; only a 1xx status is sent at once.
func (h *heldResponse) WriteHeader(status int) {
	if h.wroteHeader {
		return
	}
	h.status = status
	if status >= 100 && status <= 199 {
		h.responseWriterWrapper.WriteHeader(status)
		return
	}
	h.wroteHeader = true
}

// Write holds p while the body fits in max; past it the gate decides, and p streams or is refused.
func (h *heldResponse) Write(p []byte) (int, error) {
	h.WriteHeader(http.StatusOK)
	if !h.decided && int64(h.buf.Len())+int64(len(p)) > h.max {
		h.decided = true
		h.result = h.decide()
	}
	switch {
	case h.streaming:
		n, err := h.responseWriterWrapper.Write(p)
		h.sendFailed(err)
		return n, err
	case h.decided:
		return 0, errGateAnswered
	}
	return h.buf.Write(p)
}

// ReadFrom goes through Write while the body is held, so that max holds; once the rest streams, it is handed
// to the real writer's ReadFrom (sendfile for a file).
func (h *heldResponse) ReadFrom(r io.Reader) (int64, error) {
	h.WriteHeader(http.StatusOK)
	var n int64
	if !h.streaming {
		piece := make([]byte, 32<<10)
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
	m, err := h.responseWriterWrapper.ReadFrom(r)
	h.sendFailed(err)
	return n + m, err
}

// Status returns the status the upstream wrote, if any.
func (h *heldResponse) Status() int { return h.status }

// WriteResponse sends the held status, headers and body. When the gate decided midway, the upstream's later
// writes follow straight to the client.
func (h *heldResponse) WriteResponse() error {
	if h.status == 0 {
		h.WriteHeader(http.StatusOK) // nothing was written: an empty 200, as caddyhttp's recorder sends
	}
	h.streaming = true
	h.responseWriterWrapper.WriteHeader(h.status)
	_, err := h.buf.WriteTo(h.responseWriterWrapper)
	h.sendFailed(err)
	return err
}

// FlushError flushes only a response that streams: a flush of a held one would send its status before the gate
// decided.
func (h *heldResponse) FlushError() error {
	if !h.streaming {
		return nil
	}
	//nolint:bodyclose
	err := http.NewResponseController(h.responseWriterWrapper).Flush()
	h.sendFailed(err)
	return err
}

// Hijack hands the connection to the upstream (after a 101).
func (h *heldResponse) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	//nolint:bodyclose
	return http.NewResponseController(h.responseWriterWrapper).Hijack()
}

// answered reports whether the gate answered midway instead of the upstream.
func (h *heldResponse) answered() bool { return h.decided && !h.streaming }

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
