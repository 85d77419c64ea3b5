package facilitatorclient

import (
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Defaults of a Client made without options.
const (
	DefaultVerifyTimeout    = 10 * time.Second
	DefaultSettleTimeout    = 60 * time.Second
	DefaultSupportedTimeout = 10 * time.Second
	DefaultHealthTimeout    = 5 * time.Second

	DefaultRetries          = 2
	DefaultBackoff          = 100 * time.Millisecond
	DefaultSettleResends    = 1
	DefaultSupportedTTL     = time.Minute
	DefaultSupportedRetry   = 5 * time.Second
	DefaultMaxResponseBytes = 1 << 20
)

// Upper bounds of the retry options; more would only stretch an outage into a hang.
const (
	MaxRetries       = 10
	MaxSettleResends = 3
)

// maxBackoff caps the doubling backoff between retries.
const maxBackoff = 2 * time.Second

// Timeouts bound one HTTP attempt of each call; the caller's context bounds the whole call, retries included.
// A zero field keeps the default.
type Timeouts struct {
	Verify    time.Duration
	Settle    time.Duration
	Supported time.Duration
	Health    time.Duration
}

// settings is what the options write before New turns them into a Client.
type settings struct {
	apiKey         secret
	httpClient     *http.Client
	timeouts       Timeouts
	retries        int
	backoff        time.Duration
	settleResends  int
	supportedTTL   time.Duration
	supportedRetry time.Duration
	maxBytes       int64
	now            func() time.Time
}

func defaultSettings() settings {
	return settings{
		timeouts: Timeouts{
			Verify:    DefaultVerifyTimeout,
			Settle:    DefaultSettleTimeout,
			Supported: DefaultSupportedTimeout,
			Health:    DefaultHealthTimeout,
		},
		retries:        DefaultRetries,
		backoff:        DefaultBackoff,
		settleResends:  DefaultSettleResends,
		supportedTTL:   DefaultSupportedTTL,
		supportedRetry: DefaultSupportedRetry,
		maxBytes:       DefaultMaxResponseBytes,
		now:            time.Now,
	}
}

// Option configures a Client.
type Option func(*settings) error

// WithAPIKey sends key in the x-api-key header of every request. The key never appears in errors or String.
func WithAPIKey(key string) Option {
	return func(s *settings) error {
		s.apiKey = secret(key)
		return nil
	}
}

// WithHTTPClient sends requests through hc's transport instead of a client of the package's own. Its Timeout,
// if any, adds to the per-call Timeouts. Its CheckRedirect is not used: the client never follows a redirect.
func WithHTTPClient(hc *http.Client) Option {
	return func(s *settings) error {
		if hc == nil {
			return errors.New("WithHTTPClient: expected an *http.Client, got nil")
		}
		s.httpClient = hc
		return nil
	}
}

// WithTimeouts sets the per-attempt timeouts; zero fields keep their defaults.
func WithTimeouts(t Timeouts) Option {
	return func(s *settings) error {
		for _, f := range []struct {
			name string
			in   time.Duration
			out  *time.Duration
		}{
			{"Verify", t.Verify, &s.timeouts.Verify},
			{"Settle", t.Settle, &s.timeouts.Settle},
			{"Supported", t.Supported, &s.timeouts.Supported},
			{"Health", t.Health, &s.timeouts.Health},
		} {
			if f.in < 0 {
				return fmt.Errorf("WithTimeouts: %s timeout must not be negative, got %s", f.name, f.in)
			}
			if f.in > 0 {
				*f.out = f.in
			}
		}
		return nil
	}
}

// WithRetries sets how often /verify and /supported are retried after a transport error (0 to MaxRetries) and
// the first pause between attempts, which doubles on each further retry up to 2s. It also paces /settle resends.
func WithRetries(retries int, backoff time.Duration) Option {
	return func(s *settings) error {
		if retries < 0 || retries > MaxRetries {
			return fmt.Errorf("WithRetries: expected 0 to %d retries, got %d", MaxRetries, retries)
		}
		if backoff < 0 {
			return fmt.Errorf("WithRetries: backoff must not be negative, got %s", backoff)
		}
		s.retries, s.backoff = retries, backoff
		return nil
	}
}

// WithSettleResends sets how often a /settle request is sent again, as the identical bytes, after an attempt
// that surely never reached the facilitator (0 to MaxSettleResends). One that may have reached it is never sent
// again (see Client.SettleDetailed).
func WithSettleResends(n int) Option {
	return func(s *settings) error {
		if n < 0 || n > MaxSettleResends {
			return fmt.Errorf("WithSettleResends: expected 0 to %d resends, got %d", MaxSettleResends, n)
		}
		s.settleResends = n
		return nil
	}
}

// WithSupportedTTL sets how long a /supported answer is reused; 0 asks the facilitator on every call.
func WithSupportedTTL(ttl time.Duration) Option {
	return func(s *settings) error {
		if ttl < 0 {
			return fmt.Errorf("WithSupportedTTL: expected a duration >= 0, got %s", ttl)
		}
		s.supportedTTL = ttl
		return nil
	}
}

// WithSupportedRetry sets how long a Failover skips a member whose /supported could not be had before it asks
// again.
func WithSupportedRetry(d time.Duration) Option {
	return func(s *settings) error {
		if d < 0 {
			return fmt.Errorf("WithSupportedRetry: expected a duration >= 0, got %s", d)
		}
		s.supportedRetry = d
		return nil
	}
}

// WithMaxResponseBytes caps the size of an answer the client reads; a longer one is a bad answer.
func WithMaxResponseBytes(n int64) Option {
	return func(s *settings) error {
		if n <= 0 {
			return fmt.Errorf("WithMaxResponseBytes: expected a positive size, got %d", n)
		}
		s.maxBytes = n
		return nil
	}
}

// WithClock makes the client read time from now, for the /supported cache and the retry time of a member
// whose /supported failed. Pauses between retries still use real timers.
func WithClock(now func() time.Time) Option {
	return func(s *settings) error {
		if now == nil {
			return errors.New("WithClock: expected a clock function, got nil")
		}
		s.now = now
		return nil
	}
}

// secret is a string that refuses to be printed, so an API key cannot leak through %v of a struct holding it.
type secret string

func (secret) String() string   { return "[redacted]" }
func (secret) GoString() string { return `"[redacted]"` }
