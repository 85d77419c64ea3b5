package facilitatorserver

import (
	"context"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// healthCacheTTL is how long a /health answer is reused. Each answer costs a head read and a balance read per
// settlement wallet on every network; without a key anyone may ask, and a probe every few seconds loses
// nothing by being told what was true two seconds ago.
const healthCacheTTL = 2 * time.Second

// healthFetchTimeout bounds one health check: the callers waiting for it are not the one that started it.
const healthFetchTimeout = 15 * time.Second

// healthCache holds the last /health answer for its ttl and lets one check run at a time, which every caller
// that comes meanwhile waits for and shares.
type healthCache struct {
	ttl time.Duration

	mu     sync.Mutex
	at     time.Time
	reply  *reply
	flight chan struct{} // closed when the running check is done; nil when none runs
}

// get returns the cached answer while it is fresh, and otherwise the answer of a check by fetch, started now or
// already under way. A caller that leaves while it waits gets 503; the check goes on for the others.
func (c *healthCache) get(ctx context.Context, fetch func(context.Context) reply) reply {
	if c == nil {
		return fetch(ctx)
	}
	for {
		c.mu.Lock()
		if c.reply != nil && time.Since(c.at) < c.ttl {
			res := *c.reply
			c.mu.Unlock()
			return res
		}
		if flight := c.flight; flight != nil {
			c.mu.Unlock()
			select {
			case <-flight:
				continue
			case <-ctx.Done():
				return errorReply(http.StatusServiceUnavailable, "health unknown: the request ended while the check ran")
			}
		}
		c.flight = make(chan struct{})
		c.mu.Unlock()
		return c.check(ctx, fetch)
	}
}

// check runs fetch on a context of its own, so that the first caller leaving does not fail the others, and
// keeps its answer. The waiters are let go even if fetch panics.
func (c *healthCache) check(ctx context.Context, fetch func(context.Context) reply) (res reply) {
	done := false
	defer func() {
		c.mu.Lock()
		if done {
			c.reply, c.at = &res, time.Now()
		}
		close(c.flight)
		c.flight = nil
		c.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), healthFetchTimeout)
	defer cancel()
	res = fetch(ctx)
	done = true
	return res
}

func (s *Server) serveHealth(ctx context.Context) reply {
	resp, err := s.f.Health(ctx)
	if err != nil {
		logged := s.redact(err.Error())
		s.logger.Warn("health unknown: the facilitator gave no answer", zap.String("error", logged))
		return reply{status: http.StatusServiceUnavailable, body: struct {
			x402.HealthResponse
			Error string `json:"error"`
		}{x402.HealthResponse{Status: x402.HealthDown}, s.answerText(err, logged, "")}}
	}
	resp = s.filterHealth(resp)
	for i := range resp.Networks {
		resp.Networks[i].Error = s.redact(resp.Networks[i].Error)
	}
	status := http.StatusOK
	if resp.Status != x402.HealthOK && resp.Status != x402.HealthDegraded {
		status = http.StatusServiceUnavailable
	}
	return reply{status: status, body: resp}
}

// filterHealth keeps the networks this server serves and sums them up: down when every one of them is down,
// degraded when any is not ok.
func (s *Server) filterHealth(resp x402.HealthResponse) x402.HealthResponse {
	if s.networks != nil {
		kept := resp.Networks[:0:0]
		for _, n := range resp.Networks {
			if s.networks[n.Network] {
				kept = append(kept, n)
			}
		}
		resp.Networks = kept
		if r := resp.Refusals; r != nil {
			resp.Refusals = s.filterRefusals(*r)
		}
		if resp.Status == x402.HealthDegraded {
			resp.Status = x402.HealthOK // re-derived below from the networks that are left
		}
	}
	if len(resp.Networks) == 0 {
		return resp
	}
	down := 0
	for _, n := range resp.Networks {
		if n.Status == x402.HealthDown {
			down++
		}
		if n.Status != x402.HealthOK && resp.Status == x402.HealthOK {
			resp.Status = x402.HealthDegraded
		}
	}
	if down == len(resp.Networks) {
		resp.Status = x402.HealthDown
	}
	return resp
}

// filterRefusals keeps the refusals on the networks this server serves: the others are another server's to show.
func (s *Server) filterRefusals(r x402.RefusalsHealth) *x402.RefusalsHealth {
	out := &x402.RefusalsHealth{Counts: []x402.RefusalCount{}, Recent: []x402.Refusal{}}
	for _, c := range r.Counts {
		if s.networks[c.Network] {
			out.Counts = append(out.Counts, c)
			out.Total += c.Count
		}
	}
	for _, one := range r.Recent {
		if s.networks[one.Network] {
			out.Recent = append(out.Recent, one)
		}
	}
	return out
}
