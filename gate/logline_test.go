package gate_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// flushWatch is a response writer that counts, at each flush, the payment log lines written so far.
type flushWatch struct {
	*httptest.ResponseRecorder
	logs       *observer.ObservedLogs
	flushes    int
	linesAtOut int
}

func (w *flushWatch) Flush() {
	w.flushes++
	w.linesAtOut = w.logs.FilterMessage("payment").Len()
	w.ResponseRecorder.Flush()
}

// The payment's log line is written once its response is out, not before: a synchronous write to the log (Caddy
// logs to stderr by default) costs more than the rest of the outcome's bookkeeping, and the payer waits for none
// of it. The line itself is as before, once, with the outcome and the transaction.
func TestThePaymentLogLineIsWrittenOnceItsResponseIsOut(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	e := newEnv(t, setup{config: func(c *gate.Config) { c.Logger = zap.New(core) }})
	header := e.permit2(e.c.Payers[0])
	w := &flushWatch{ResponseRecorder: httptest.NewRecorder(), logs: logs}
	r := httptest.NewRequest(http.MethodGet, e.srv.URL+"/report", nil)
	r.Header.Set(x402.HeaderPaymentSignature, header)
	next := gate.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		_, err := io.WriteString(w, "paid content")
		return err
	})
	if err := e.gate.ServeHTTP(w, r, next); err != nil || w.Code != http.StatusOK || w.Body.String() != "paid content" {
		t.Fatalf("the paid request = %d %q, %v; want 200 and the content", w.Code, w.Body.String(), err)
	}
	if w.flushes == 0 || w.linesAtOut != 0 {
		t.Fatalf("%d flushes, %d payment log lines written when the response went out; want the line after it", w.flushes, w.linesAtOut)
	}
	lines := logs.FilterMessage("payment").All()
	if len(lines) != 1 {
		t.Fatalf("%d payment log lines, want 1", len(lines))
	}
	if f := lines[0].ContextMap(); f["outcome"] != string(x402.OutcomeSettled) || f["tx"] == "" {
		t.Fatalf("the payment log line = %v, want outcome settled with its transaction", f)
	}
}
