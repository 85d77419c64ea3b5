package gate

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// preflightMaxAge is how long a browser may keep a preflight answer, in seconds.
const preflightMaxAge = "600"

// IsPreflight reports whether r is a CORS preflight request.
func IsPreflight(r *http.Request) bool {
	return r.Method == http.MethodOptions && r.Header.Get("Origin") != "" && r.Header.Get("Access-Control-Request-Method") != ""
}

// AnswerPreflight answers a CORS preflight for a gate of the given origins (Config.CORSOrigins) and payment
// header: 204 naming what a paying request may send, or 403 for an origin the gate does not allow. It needs no
// started gate, and the upstream is never called.
func AnswerPreflight(w http.ResponseWriter, r *http.Request, origins []string, paymentHeader string) error {
	if paymentHeader == "" {
		paymentHeader = x402.HeaderPaymentSignature
	}
	h := w.Header()
	if !allowOrigin(origins, h, r) {
		h.Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		_, err := fmt.Fprintf(w, "origin %q may not make cross-origin requests to this resource\n", r.Header.Get("Origin"))
		return err
	}
	allowed := []string{paymentHeader, x402.HeaderXPayment, "Content-Type"}
	for _, v := range r.Header.Values("Access-Control-Request-Headers") {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" && !slices.ContainsFunc(allowed, func(a string) bool { return strings.EqualFold(a, name) }) {
				allowed = append(allowed, name)
			}
		}
	}
	h.Set("Access-Control-Allow-Methods", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
	h.Set("Access-Control-Allow-Headers", strings.Join(allowed, ", "))
	h.Set("Access-Control-Max-Age", preflightMaxAge)
	exposePaymentHeaders(h)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// allowOrigin sets Access-Control-Allow-Origin for a cross-origin request from an allowed origin and reports
// whether the origin is allowed.
func allowOrigin(origins []string, h http.Header, r *http.Request) bool {
	origin := r.Header.Get("Origin")
	if origin == "" {
		return true
	}
	if len(origins) == 0 || slices.Contains(origins, "*") {
		h.Set("Access-Control-Allow-Origin", "*")
		return true
	}
	h.Add("Vary", "Origin")
	if !slices.ContainsFunc(origins, func(o string) bool { return strings.EqualFold(strings.TrimSuffix(o, "/"), origin) }) {
		return false
	}
	h.Set("Access-Control-Allow-Origin", origin)
	return true
}

// exposePaymentHeaders lets browser scripts read the payment headers of cross-origin answers.
func exposePaymentHeaders(h http.Header) {
	const name = "Access-Control-Expose-Headers"
	have := strings.ToLower(strings.Join(h.Values(name), ","))
	var add []string
	for _, v := range []string{x402.HeaderPaymentRequired, x402.HeaderPaymentResponse, x402.HeaderXPaymentResponse} {
		if !strings.Contains(have, strings.ToLower(v)) {
			add = append(add, v)
		}
	}
	if len(add) > 0 {
		h.Add(name, strings.Join(add, ", "))
	}
}
