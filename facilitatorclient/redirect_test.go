package facilitatorclient

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/x402-gateway/caddy-x402/x402"
)

// elsewhere is a facilitator a redirect points to: it records every call and the API key it came with, and
// answers every endpoint with success, so that a client that follows the redirect takes its word.
type elsewhere struct {
	srv       *httptest.Server
	calls     atomic.Int64
	gotAPIKey atomic.Bool
}

func newElsewhere(t *testing.T) *elsewhere {
	t.Helper()
	e := &elsewhere{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.calls.Add(1)
		if r.Header.Get(x402.HeaderAPIKey) != "" {
			e.gotAPIKey.Store(true)
		}
		switch {
		case strings.HasSuffix(r.URL.Path, "/settle"):
			writeJSON(w, http.StatusOK, x402.SettleResponse{Success: true, Transaction: txHash, Network: mainnet, Payer: payer})
		case strings.HasSuffix(r.URL.Path, "/verify"):
			writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: payer})
		case strings.HasSuffix(r.URL.Path, "/supported"):
			writeJSON(w, http.StatusOK, x402.SupportedResponse{Kinds: []x402.SupportedKind{}})
		default:
			writeJSON(w, http.StatusOK, x402.HealthResponse{Status: x402.HealthOK})
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// redirecting is a facilitator that answers every call with status, pointing to the same path at target.
func redirecting(t *testing.T, status int, target string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, target+r.URL.Path+"?token=from-the-redirect", status)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestARedirectIsNeverFollowedAndItsTargetNeverSeesTheAPIKeyOrDecidesTheSettlement: a facilitator that
// answers 3xx pointing to another host gets no settlement taken from that host, and the key stays home.
func TestARedirectIsNeverFollowedAndItsTargetNeverSeesTheAPIKeyOrDecidesTheSettlement(t *testing.T) {
	for _, status := range []int{http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther, http.StatusTemporaryRedirect, http.StatusPermanentRedirect} {
		for _, own := range []bool{false, true} {
			name := http.StatusText(status)
			if own {
				name += " through the caller's http.Client"
			}
			t.Run(name, func(t *testing.T) {
				other := newElsewhere(t)
				front := redirecting(t, status, other.srv.URL)
				opts := []Option{WithAPIKey(apiKeyForTest), WithRetries(0, 0)}
				if own {
					opts = append(opts, WithHTTPClient(&http.Client{})) // Go's default client follows redirects
				}
				c, err := New(front.URL, opts...)
				if err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				req := permit2Request(mainnet)

				settled, err := c.Settle(ctx, req)
				assertRedirectRefused(t, "settle", err, status)
				if settled.Success || settled.Transaction != "" {
					t.Fatalf("Settle answered %+v after a redirect; want no settlement", settled)
				}
				_, err = c.Verify(ctx, req)
				assertRedirectRefused(t, "verify", err, status)
				_, err = c.Supported(ctx)
				assertRedirectRefused(t, "supported", err, status)
				_, err = c.Health(ctx)
				assertRedirectRefused(t, "health", err, status)
				if n := other.calls.Load(); n != 0 || other.gotAPIKey.Load() {
					t.Fatalf("the redirect's target got %d calls (API key sent: %v); want none", n, other.gotAPIKey.Load())
				}
			})
		}
	}
}

func assertRedirectRefused(t *testing.T, op string, err error, status int) {
	t.Helper()
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) {
		t.Fatalf("%s after HTTP %d: error %v; want a FacilitatorError", op, status, err)
	}
	if fe.Status != status || fe.Kind != x402.FailureBadAnswer || !x402.IsUnreachable(err) {
		t.Fatalf("%s after HTTP %d: %+v; want a bad answer with that status (no answer, never a refusal or a settlement)", op, status, fe)
	}
	msg := err.Error()
	if !strings.Contains(msg, "redirect") || strings.Contains(msg, "from-the-redirect") || strings.Contains(msg, apiKeyForTest) {
		t.Fatalf("%s error %q: want it to say redirect, without the redirect's query or the API key", op, msg)
	}
	if errors.Is(err, ErrNotSent) {
		t.Fatalf("%s error %v says not sent; the facilitator answered", op, err)
	}
}
