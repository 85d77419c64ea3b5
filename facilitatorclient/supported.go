package facilitatorclient

import (
	"context"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// supportedCache holds the last /supported answer and the one fetch in flight, so that many payments arriving
// when the answer expires cost the facilitator one request.
type supportedCache struct {
	mu        sync.Mutex
	resp      x402.SupportedResponse
	fetchedAt time.Time
	valid     bool // resp is an answer that has not been invalidated since
	lastErr   error
	retryAt   time.Time // a Failover does not ask again before this after lastErr
	inflight  *supportedFetch
}

// supportedFetch is one /supported request that any number of callers wait for. It is cancelled when the
// last of them gives up, so that nobody's abandoned request keeps a connection busy.
type supportedFetch struct {
	done      chan struct{}
	cancel    context.CancelFunc
	waiters   int  // guarded by supportedCache.mu
	abandoned bool // guarded by supportedCache.mu
	resp      x402.SupportedResponse
	err       error
}

// Supported returns the facilitator's /supported answer, asking it only when the answer it has is older than
// the TTL. Concurrent callers share one request.
func (c *Client) Supported(ctx context.Context) (x402.SupportedResponse, error) {
	resp, err := c.cachedSupported(ctx, false)
	if err != nil {
		return x402.SupportedResponse{}, err
	}
	return cloneSupported(resp), nil
}

// cachedSupported is Supported without the defensive copy: callers must not modify what it returns. With
// skipFailed, a facilitator whose last fetch failed is not asked again before its retry time; that failure is
// returned instead.
func (c *Client) cachedSupported(ctx context.Context, skipFailed bool) (x402.SupportedResponse, error) {
	now := c.now()
	c.supported.mu.Lock()
	if c.supported.valid && now.Sub(c.supported.fetchedAt) < c.supportedTTL {
		resp := c.supported.resp
		c.supported.mu.Unlock()
		return resp, nil
	}
	if skipFailed && c.supported.lastErr != nil && now.Before(c.supported.retryAt) {
		err := c.supported.lastErr
		c.supported.mu.Unlock()
		return x402.SupportedResponse{}, err
	}
	f := c.startSupportedFetchLocked(ctx)
	f.waiters++
	c.supported.mu.Unlock()

	select {
	case <-f.done:
		return f.resp, f.err
	case <-ctx.Done():
		c.supported.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			f.abandoned = true
			f.cancel()
		}
		c.supported.mu.Unlock()
		return x402.SupportedResponse{}, c.transportFailure(ctx, opSupported, sent{
			last:     exchange{err: ctx.Err()},
			attempts: 1,
			// The shared fetch may well have reached the facilitator; this caller cannot tell.
			anyReached: true,
		})
	}
}

// supportedState is what a Failover can know of a member without waiting.
type supportedState int

const (
	supportedKnown   supportedState = iota // an answer, perhaps past its TTL and being refreshed
	supportedFailed                        // the last fetch failed and its retry time has not come
	supportedMissing                       // no answer: a fetch has been started, waiting for it would block
)

// peekSupported returns what is known of /supported without waiting, and starts a fetch in the background
// when the answer is missing or past its TTL. Routing on an answer past its TTL is fine: kinds change
// rarely, and a member that stopped answering is invalidated by its failure anyway.
func (c *Client) peekSupported() (x402.SupportedResponse, supportedState, error) {
	now := c.now()
	c.supported.mu.Lock()
	defer c.supported.mu.Unlock()
	switch {
	case c.supported.valid:
		if now.Sub(c.supported.fetchedAt) >= c.supportedTTL {
			c.startSupportedFetchLocked(context.Background())
		}
		return c.supported.resp, supportedKnown, nil
	case c.supported.lastErr != nil && now.Before(c.supported.retryAt):
		return x402.SupportedResponse{}, supportedFailed, c.supported.lastErr
	default:
		c.startSupportedFetchLocked(context.Background())
		return x402.SupportedResponse{}, supportedMissing, nil
	}
}

// startSupportedFetchLocked returns the fetch in flight, starting one if there is none that is still wanted.
// The fetch belongs to all its waiters, not to the caller who happened to start it: it runs on a context of
// its own (keeping ctx's values), bounded by the per-attempt timeout and the retry count.
func (c *Client) startSupportedFetchLocked(ctx context.Context) *supportedFetch {
	if f := c.supported.inflight; f != nil && !f.abandoned {
		return f
	}
	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	f := &supportedFetch{done: make(chan struct{}), cancel: cancel}
	c.supported.inflight = f
	go c.runSupportedFetch(fctx, f)
	return f
}

func (c *Client) runSupportedFetch(ctx context.Context, f *supportedFetch) {
	defer f.cancel()
	resp, err := c.fetchSupported(ctx)
	now := c.now()
	c.supported.mu.Lock()
	switch {
	case err == nil:
		c.supported.resp, c.supported.fetchedAt, c.supported.valid = resp, now, true
		c.supported.lastErr = nil
	case !f.abandoned:
		// A fetch its waiters gave up on says nothing about the facilitator; any other failure does, and
		// the answer from before it is no longer to be trusted for routing.
		c.supported.valid = false
		c.supported.lastErr, c.supported.retryAt = err, now.Add(c.supportedRetry)
	}
	if c.supported.inflight == f {
		c.supported.inflight = nil
	}
	c.supported.mu.Unlock()
	f.resp, f.err = resp, err
	close(f.done)
}

// invalidateSupported makes the next use ask /supported again, after the facilitator failed a call.
func (c *Client) invalidateSupported() {
	c.supported.mu.Lock()
	c.supported.valid = false
	c.supported.mu.Unlock()
}

// cloneSupported copies resp so that a caller may modify it without touching the cache.
func cloneSupported(resp x402.SupportedResponse) x402.SupportedResponse {
	out := x402.SupportedResponse{
		Kinds:      slices.Clone(resp.Kinds),
		Extensions: slices.Clone(resp.Extensions),
	}
	if resp.Signers != nil {
		out.Signers = maps.Clone(resp.Signers)
		for k, v := range out.Signers {
			out.Signers[k] = slices.Clone(v)
		}
	}
	return out
}
