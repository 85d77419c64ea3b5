package caddymodule

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// bearerLog keeps the bearer value a request presents in a header (a facilitator's API key, a payment: whoever
// reads it can present it) out of Caddy's logs of that request: its access log entry, and its error log entry
// when a handler fails. Caddy logs each request's headers as they arrived, copied (values and all) before the
// first handler runs, and redacts only Cookie, Set-Cookie, Authorization and Proxy-Authorization (unless the
// server logs credentials): no handler can add other headers to those or change Caddy's copy (taking the header
// off the request changes nothing in it), and a filter in every log configuration is a step each operator would
// have to know of. So the handler writes both entries of such a request itself, to the loggers Caddy would have
// chosen, in Caddy's shape, with the values written "REDACTED" as Caddy writes Authorization's.
//
// The access log entry: the request is marked log_skip, which Caddy honours, and its entry is written once the
// request has ended, as Caddy's is, with the fields log_append added meanwhile (most are added after the inner
// handlers returned). What it cannot show: changes an outer handler makes to the answer after the handler wrote
// it (its size once encoded, headers added last).
//
// The error log entry: see answerError.
type bearerLog struct {
	access  *zap.Logger // Caddy's own access logger, http.log.access
	errors  *zap.Logger // Caddy's own error logger, http.log.error
	headers []string    // the request headers that carry bearer values
}

// newBearerLog finds the access and error loggers of Caddy's HTTP app, through which Caddy writes its own
// entries, for requests presenting any of headers.
func newBearerLog(ctx caddy.Context, headers ...string) *bearerLog {
	base := ctx.Logger(caddyhttp.App{})
	return &bearerLog{access: base.Named("log.access"), errors: base.Named("log.error"), headers: headers}
}

// bearerEntry is Caddy's logging of one request, taken over.
type bearerEntry struct {
	log    *bearerLog
	srv    *caddyhttp.Server
	access []*zap.Logger // where its access log entry goes; none when Caddy's access log does not log it
	// request is the request as Caddy would have logged it: as it arrived, before rewrites, the value blanked.
	request caddyhttp.LoggableHTTPRequest
	body    *countingBody
	r       *http.Request
}

// takeOver takes Caddy's logging of r over when r presents a bearer value that Caddy's entries would show: the
// handler then passes any error through answerError and writes the access log entry (write). It returns nil when
// Caddy's own logging may stand: no bearer value, or a server whose operator asked for credentials in its logs.
func (l *bearerLog) takeOver(r *http.Request) *bearerEntry {
	if l == nil || !l.presented(r.Header) {
		return nil
	}
	srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil || srv.Logs != nil && srv.Logs.ShouldLogCredentials {
		return nil
	}
	logged := r.Clone(r.Context())
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		logged.Method, logged.RemoteAddr, logged.RequestURI = orig.Method, orig.RemoteAddr, orig.RequestURI
	}
	for name := range logged.Header {
		if l.bearer(name) {
			logged.Header[name] = []string{"REDACTED"}
		}
	}
	e := &bearerEntry{log: l, srv: srv, request: caddyhttp.LoggableHTTPRequest{Request: logged}, r: r}

	host := hostOnly(r.Host)
	skip, _ := caddyhttp.GetVar(r.Context(), caddyhttp.LogSkipVar).(bool)
	if srv.Logs == nil || skip || !logsHost(srv.Logs, host) {
		return e // no access log entry of Caddy's to take over
	}
	caddyhttp.SetVar(r.Context(), caddyhttp.LogSkipVar, true)
	e.access = loggersFor(l.access, srv.Logs, r, host)
	if r.Body != nil {
		e.body = &countingBody{ReadCloser: r.Body}
		r.Body = e.body
	}
	return e
}

// presented reports whether h carries any of the bearer headers.
func (l *bearerLog) presented(h http.Header) bool {
	for name := range h {
		if l.bearer(name) {
			return true
		}
	}
	return false
}

// bearer reports whether a header of this name carries a bearer value.
func (l *bearerLog) bearer(name string) bool {
	return slices.ContainsFunc(l.headers, func(h string) bool { return strings.EqualFold(h, name) })
}

// answerError answers a handler's error err as Caddy's server would, into w, which has recorded what was
// written so far, logs it to Caddy's error log as Caddy would, with the request as the access log entry shows
// it, and returns nil: Caddy never sees the error.
//
// Caddy logs a handler's error with the request's headers as they arrived (at ERROR for a status of 500 or more
// when the server has no error routes, at DEBUG otherwise), so an error that reaches it puts the bearer value in
// its log; whatever the handler returns, nothing can change what that entry holds. The one way to keep it out
// is for no error to reach Caddy: the handler answers in Caddy's place, with what Caddy would answer. Without
// error routes (handle_errors), that is the error's status and no body, the headers set so far kept (a gate's
// Retry-After, PAYMENT-RESPONSE); with them, the server's error routes run here, as Caddy runs them, with the
// error and its {http.error.*} placeholders, the request as it arrived (its bearer headers taken off: an error
// route may proxy the request on), ending with the error's status when no route answers. The entry is logged
// at the level Caddy would use, with Caddy's message and fields. What this gives up: handlers around this one
// see no error (they see the answer written), and a subroute's own error routes (JSON "errors" of a subroute,
// which the Caddyfile never writes) are not the ones that run.
func (e *bearerEntry) answerError(w caddyhttp.ResponseRecorder, err error) error {
	if e == nil || err == nil {
		return err
	}
	r := e.r
	for name := range r.Header {
		if e.log.bearer(name) {
			delete(r.Header, name)
		}
	}
	status, msg, fields := errorLogValues(err)
	er := e.srv.Errors.WithError(r, err) // a copy of r (nil Errors too), with the error and its placeholders
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		er.Method, er.RemoteAddr, er.RequestURI = orig.Method, orig.RemoteAddr, orig.RequestURI
		if orig.URL != nil {
			u := *orig.URL
			er.URL = &u
		}
	}
	started := w.Status() != 0 // the answer began: nothing can be answered on top of it
	switch {
	case e.srv.Errors == nil || len(e.srv.Errors.Routes) == 0:
		level := zapcore.DebugLevel
		if status >= http.StatusInternalServerError {
			level = zapcore.ErrorLevel
		}
		e.logError(er, level, msg, fields)
		if !started {
			w.WriteHeader(status)
		}
	case started:
		e.logError(er, zapcore.DebugLevel, msg, fields)
	default:
		if err2 := e.srv.Errors.Routes.Compile(answerErrorStatus).ServeHTTP(w, er); err2 != nil {
			fields = append([]zap.Field{zap.String("error", err2.Error()), zap.Namespace("first_error"), zap.String("msg", msg)}, fields...)
			e.logError(er, zapcore.ErrorLevel, "error handling handler error", fields)
			if w.Status() == 0 {
				w.WriteHeader(errorStatus(err))
			}
			return nil
		}
		e.logError(er, zapcore.DebugLevel, msg, fields)
	}
	return nil
}

// logError writes an error log entry of the request to the loggers Caddy would write it to.
func (e *bearerEntry) logError(r *http.Request, level zapcore.Level, msg string, fields []zap.Field) {
	var duration time.Duration
	if start, ok := caddyhttp.GetVar(r.Context(), "start_time").(time.Time); ok {
		duration = time.Since(start)
	}
	base := e.log.errors.WithLazy(zap.Object("request", e.request), zap.Duration("duration", duration))
	loggers := []*zap.Logger{base}
	if e.srv.Logs != nil {
		loggers = loggersFor(base, e.srv.Logs, r, hostOnly(r.Host))
	}
	for _, logger := range loggers {
		if c := logger.Check(level, msg); c != nil {
			c.Write(fields...)
		}
	}
}

// errorLogValues are the status, message and fields Caddy's server logs a handler's error with.
func errorLogValues(err error) (int, string, []zap.Field) {
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) {
		return http.StatusInternalServerError, err.Error(), []zap.Field{zap.Error(err)}
	}
	msg := err.Error()
	if he.Err != nil {
		msg = he.Err.Error()
	}
	return he.StatusCode, msg, []zap.Field{zap.Int("status", he.StatusCode), zap.String("err_id", he.ID), zap.String("err_trace", he.Trace)}
}

// errorStatus is the status Caddy's server answers a handler's error with when its error routes do not.
func errorStatus(err error) int {
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode
	}
	return http.StatusInternalServerError
}

// answerErrorStatus ends the error routes as Caddy's own chain ends them (its errorEmptyHandler, unexported): an
// error no route answered is answered with its status.
var answerErrorStatus caddyhttp.Handler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	err, _ := r.Context().Value(caddyhttp.ErrorCtxKey).(error)
	w.WriteHeader(errorStatus(err))
	return nil
})

// write writes the access log entry of a request answered with status, size bytes of body and the headers in w,
// with any further fields; nothing when Caddy's access log does not log the request.
func (e *bearerEntry) write(w http.ResponseWriter, status, size int, more ...zap.Field) {
	if e == nil || len(e.access) == 0 {
		return
	}
	ctx := e.r.Context()
	var duration time.Duration
	if start, ok := caddyhttp.GetVar(ctx, "start_time").(time.Time); ok {
		duration = time.Since(start)
	}
	userID := ""
	if repl, ok := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Set("http.response.status", status)
		repl.Set("http.response.size", size)
		repl.Set("http.response.duration", duration)
		repl.Set("http.response.duration_ms", duration.Seconds()*1e3)
		userID, _ = repl.GetString("http.auth.user.id")
	}
	level := zapcore.InfoLevel
	if status >= 500 {
		level = zapcore.ErrorLevel
	}
	if name, ok := caddyhttp.GetVar(ctx, caddyhttp.LogLevelVar).(string); ok {
		if l, err := zapcore.ParseLevel(name); err == nil && l >= zapcore.DebugLevel && l <= zapcore.ErrorLevel {
			level = l
		}
	}
	read := 0
	if e.body != nil {
		read = e.body.n
	}
	fields := []zap.Field{
		zap.Object("request", e.request),
		zap.Int("bytes_read", read),
		zap.String("user_id", userID),
		zap.Duration("duration", duration),
		zap.Int("size", size),
		zap.Int("status", status),
		zap.Object("resp_headers", caddyhttp.LoggableHTTPHeader{Header: w.Header().Clone()}), // w is not to be read once the request ended
	}
	fields = append(fields, more...)
	// The handlers around this one (log_append among them) are still to return: the entry is written when the
	// request has ended, as Caddy writes its own, so that it holds what they add.
	context.AfterFunc(ctx, func() {
		fields := append(fields, extraLogFields(ctx)...)
		for _, logger := range e.access {
			if c := logger.Check(level, "handled request"); c != nil {
				c.Write(fields...)
			}
		}
	})
}

// extraLogFields returns the fields handlers added to the request's access log entry through
// caddyhttp.ExtraLogFields (log_append). Caddy offers no way to read them back (its ExtraLogFields keeps them
// in an unexported slice, which only its own logRequest reads), so they are read by reflection: the layout is
// that of the Caddy version go.mod pins, and TestAPaidSitesAccessLogHoldsNoPaymentHeader fails if an upgrade
// changes it. Should it change, the entry is written without them rather than not at all.
func extraLogFields(ctx context.Context) []zapcore.Field {
	extra, _ := ctx.Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields)
	if extra == nil {
		return nil
	}
	f := reflect.ValueOf(extra).Elem().FieldByName("fields")
	if !f.IsValid() || f.Type() != reflect.TypeFor[[]zapcore.Field]() {
		return nil
	}
	return slices.Clone(*(*[]zapcore.Field)(unsafe.Pointer(f.UnsafeAddr())))
}

// logsHost reports whether Caddy's server logs requests for host, as its shouldLogRequest decides.
func logsHost(logs *caddyhttp.ServerLogConfig, host string) bool {
	for name := range logs.LoggerNames {
		if certmagic.MatchWildcard(host, name) {
			return true
		}
	}
	for _, skip := range logs.SkipHosts {
		if certmagic.MatchWildcard(host, skip) {
			return false
		}
	}
	return !logs.SkipUnmappedHosts
}

// loggersFor are the loggers Caddy would write r's entries to (access and error log alike, base being either):
// those named by log_name for this request, else those the server maps r's host to, else its default.
func loggersFor(base *zap.Logger, logs *caddyhttp.ServerLogConfig, r *http.Request, host string) []*zap.Logger {
	var names []string
	if set, ok := caddyhttp.GetVar(r.Context(), caddyhttp.AccessLoggerNameVarKey).([]any); ok {
		for _, n := range set {
			s, _ := n.(string)
			names = append(names, s)
		}
	} else {
		names = loggerNamesFor(logs, host)
	}
	loggers := make([]*zap.Logger, 0, len(names))
	for _, name := range names {
		if name == "" {
			loggers = append(loggers, base)
		} else {
			loggers = append(loggers, base.Named(name))
		}
	}
	return loggers
}

// hostOnly is a request's host without its port, as Caddy's loggers are chosen by.
func hostOnly(hostport string) string {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return hostport
	}
	return host
}

// loggerNamesFor maps a host to logger names as Caddy's server does: the exact host, then wildcards of its
// labels from the left, then the default logger.
func loggerNamesFor(logs *caddyhttp.ServerLogConfig, host string) []string {
	host = strings.ToLower(host)
	if names, ok := logs.LoggerNames[host]; ok {
		return names
	}
	labels := strings.Split(host, ".")
	for i := range labels {
		if labels[i] == "" {
			continue
		}
		labels[i] = "*"
		if names, ok := logs.LoggerNames[strings.Join(labels, ".")]; ok {
			return names
		}
	}
	return []string{logs.DefaultLoggerName}
}

// countingBody counts the bytes read of a request body, for bytes_read.
type countingBody struct {
	io.ReadCloser
	n int
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n += n
	return n, err
}
