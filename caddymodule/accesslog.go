package caddymodule

import (
	"context"
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

// bearerAccessLog writes the access log entry of a request that presents a bearer value in a header (a
// facilitator's API key, a payment: whoever reads it can present it), with the value left out. Caddy logs each
// request's headers as they arrived, copied before the first handler runs, and redacts only Cookie,
// Set-Cookie, Authorization and Proxy-Authorization (unless the server logs credentials): no handler can add
// other headers to those or change Caddy's copy, and a filter in every log configuration is a step each
// operator would have to know of. So such a request is marked log_skip, which Caddy honours, and its entry is
// written here instead: to the loggers Caddy would have chosen, in Caddy's shape, with the values written
// "REDACTED" as Caddy writes Authorization's. The entry is written once the request has ended, as Caddy's is,
// with the fields log_append added meanwhile (most are added after the inner handlers returned). What it cannot
// show: changes an outer handler makes to the answer after the handler wrote it (its size once encoded, headers
// added last).
type bearerAccessLog struct {
	logger  *zap.Logger // Caddy's own access logger, http.log.access
	headers []string    // the request headers that carry bearer values
}

// newBearerAccessLog finds the access logger of Caddy's HTTP app, through which Caddy writes its own entries,
// for requests presenting any of headers.
func newBearerAccessLog(ctx caddy.Context, headers ...string) *bearerAccessLog {
	return &bearerAccessLog{logger: ctx.Logger(caddyhttp.App{}).Named("log.access"), headers: headers}
}

// bearerEntry is the access log entry of one request taken over from Caddy.
type bearerEntry struct {
	loggers []*zap.Logger
	request caddyhttp.LoggableHTTPRequest
	body    *countingBody
	r       *http.Request
}

// takeOver tells Caddy not to log r, and returns the entry to write in its place, when r presents a bearer
// value that Caddy's entry would show. It returns nil when Caddy's own entry may stand.
func (l *bearerAccessLog) takeOver(r *http.Request) *bearerEntry {
	if l == nil || !l.presented(r.Header) {
		return nil
	}
	srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil || srv.Logs == nil || srv.Logs.ShouldLogCredentials {
		return nil // no access log, or its operator asked for credentials in it
	}
	if skip, _ := caddyhttp.GetVar(r.Context(), caddyhttp.LogSkipVar).(bool); skip {
		return nil
	}
	host, _, err := net.SplitHostPort(r.Host)
	if err != nil {
		host = r.Host
	}
	if !logsHost(srv.Logs, host) {
		return nil
	}
	caddyhttp.SetVar(r.Context(), caddyhttp.LogSkipVar, true)

	// The request as Caddy would have logged it: as it arrived, before rewrites, with the key blanked.
	logged := r.Clone(r.Context())
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		logged.Method, logged.RemoteAddr, logged.RequestURI = orig.Method, orig.RemoteAddr, orig.RequestURI
	}
	for name := range logged.Header {
		if l.bearer(name) {
			logged.Header[name] = []string{"REDACTED"}
		}
	}
	e := &bearerEntry{
		loggers: accessLoggers(l.logger, srv.Logs, r, host),
		request: caddyhttp.LoggableHTTPRequest{Request: logged},
		r:       r,
	}
	if r.Body != nil {
		e.body = &countingBody{ReadCloser: r.Body}
		r.Body = e.body
	}
	return e
}

// presented reports whether h carries any of the bearer headers.
func (l *bearerAccessLog) presented(h http.Header) bool {
	for name := range h {
		if l.bearer(name) {
			return true
		}
	}
	return false
}

// bearer reports whether a header of this name carries a bearer value.
func (l *bearerAccessLog) bearer(name string) bool {
	return slices.ContainsFunc(l.headers, func(h string) bool { return strings.EqualFold(h, name) })
}

// write writes the entry of a request answered with status, size bytes of body and the headers in w, with any
// further fields.
func (e *bearerEntry) write(w http.ResponseWriter, status, size int, more ...zap.Field) {
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
		for _, logger := range e.loggers {
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

// accessLoggers are the loggers Caddy would write r's entry to: those named by log_name for this request,
// else those the server maps r's host to, else its default.
func accessLoggers(base *zap.Logger, logs *caddyhttp.ServerLogConfig, r *http.Request, host string) []*zap.Logger {
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
