package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// This file lets a site start without its chain: when no RPC endpoint of a network answers as Caddy starts, the
// x402 app starts all the same (free routes serve), and its engine starts in the background once an endpoint
// answers, reconciling the journal first as a normal start does. Until then the engine does not exist: nothing
// is verified, settled, held or leased, and the gates and facilitator handlers that need it answer as the spec
// maps an unreachable facilitator. A reload with the chain down fails as before and keeps the old config.

// liveApps counts the x402 apps started and not yet cleaned up in this process: a Start while one runs is a
// reload, which keeps the old config serving rather than start without its chain.
var liveApps atomic.Int32

// chainRetryMax bounds the pause between two tries to start the engine; chainWarnEvery spaces the WARN lines
// that say the chain is still down.
const (
	chainRetryMax  = 5 * time.Second
	chainWarnEvery = 30 * time.Second
)

// chainRetryAfter is the Retry-After of the answers given while the engine waits for its chain, in seconds.
const chainRetryAfter = "5"

// chainWait is an engine waiting for its chain.
type chainWait struct {
	up   chan struct{} // closed once the engine is up and the hooks that need it ran (or failed: err)
	quit chan struct{}
	// ctx is cancelled by stop: it ends a try to start the engine under way.
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	stopped bool
	since   time.Time
	reason  string // the last failure, its RPC URLs redacted, per network: "network X: no RPC endpoint answered ..."
	err     error  // set before up is closed when the hooks that need the engine failed

	// journal is the app's journal, held open while the engine waits and let go of (once) when the engine, which
	// holds its own, is up or the wait ends: otherwise every try would open it afresh and close it again, and a
	// PostgreSQL journal's instance would come and go among its cluster's live ones with each try, making the
	// other gateways redeal their wallet leases again and again.
	journal     string
	journalHeld bool

	// supported is what the configuration alone says the engine supports (chain.ConfiguredSupported), for the
	// offers a gate makes while the chain is down; supportedOK is false when it could not be said.
	supported   x402.SupportedResponse
	supportedOK bool
}

// releaseJournal lets go of the journal the wait held, once. Call with w.mu held.
func (w *chainWait) releaseJournal() {
	if w.journalHeld {
		w.journalHeld = false
		_, _ = journals.Delete(w.journal)
	}
}

// started reports whether Start succeeded.
func (a *App) started() bool {
	select {
	case <-a.ready:
		return a.startErr == nil
	default:
		return false
	}
}

// chainDown reports, after the engine failed to start with startErr, whether it failed because some network's
// chain gave no answer at all (rather than for a configuration no chain makes right), and the app may start
// without it: at the first start of this process only, not on a reload, and never for the dev chain this process
// runs. The engine's own failure says so (no endpoint answered it), or a probe of every network now does: a chain
// that was down through the engine's tries and answers the probe a moment later was down all the same, and the
// engine's start in the background finds it up.
func (a *App) chainDown(specs []networkSpec, startErr error) bool {
	if liveApps.Load() > 0 {
		return false
	}
	// A journal that does not open is no chain's fault: the start fails naming it, as always.
	if _, err := openJournal(a.Journal); err != nil {
		return false
	}
	_, _ = journals.Delete(a.Journal)
	if chain.IsUnreachable(startErr) {
		return true
	}
	_, down := a.probeChains(specs)
	return down != ""
}

// probeChains asks every network's endpoints for their chain id and returns the first network none of whose
// endpoints answered, with the last error (RPC URLs redacted).
func (a *App) probeChains(specs []networkSpec) (reason, network string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, s := range specs {
		var last error
		answered := false
		for _, u := range s.RPC {
			if a.devChain != nil && u == a.devChain.RPCURL() {
				answered = true // in process: never down
				break
			}
			c, err := chain.DialRPC(ctx, u)
			if err == nil {
				_, err = c.ChainID(ctx)
				c.Close()
			}
			if err == nil {
				answered = true
				break
			}
			last = fmt.Errorf("rpc %s: %w", chain.RedactRPCURL(u), chain.RedactRPCError(err, u))
		}
		if !answered {
			return a.rpcRedactor().Replace(errorText(last)), s.Network.Network
		}
	}
	return "", ""
}

func errorText(err error) string {
	if err == nil {
		return "no endpoint"
	}
	return err.Error()
}

// startWithoutChain starts the app with its engine waiting for the chain, and the engine's start in the
// background. cause is why the engine did not start.
func (a *App) startWithoutChain(key string, specs []networkSpec, cause error) error {
	w := &chainWait{up: make(chan struct{}), quit: make(chan struct{}), since: time.Now()}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	w.reason = a.downReason(specs, w.since, cause)
	if sup, err := chain.ConfiguredSupported(a.configuredNetworks(specs)); err == nil {
		w.supported, w.supportedOK = sup, true
	} else {
		a.logger.Warn("no offers can be made while the chain is down: paid routes answer 503", zap.Error(err))
	}
	if _, err := openJournal(a.Journal); err == nil {
		w.journal, w.journalHeld = a.Journal, true
	}
	a.wait = w
	a.logger.Error("starting without the chain: the paid routes offer what the configuration alone can (402; 503 with "+
		"Retry-After where nothing can be offered) and answer payments 502 verify-unreachable with Retry-After until an "+
		"RPC endpoint answers, then the embedded facilitator starts by itself", zap.String("reason", w.reason))
	if err := a.runStarters(a.starters); err != nil {
		w.stop()
		return err
	}
	go a.awaitChain(w, key, specs)
	return nil
}

// downReason says, for /health and the log, which network has no RPC endpoint answering, since when and why.
func (a *App) downReason(specs []networkSpec, since time.Time, cause error) string {
	why, network := a.probeChains(specs)
	if network == "" {
		why = a.rpcRedactor().Replace(errorText(cause))
		network = strings.Join(a.networkIDs(), ", ")
	}
	return fmt.Sprintf("network %s: no RPC endpoint answered since %s: %s", network, since.UTC().Format(time.RFC3339), why)
}

// awaitChain tries to start the engine, with growing pauses, until it starts or the app is cleaned up; then
// runs the start hooks that need it.
func (a *App) awaitChain(w *chainWait, key string, specs []networkSpec) {
	pause, lastWarn := 250*time.Millisecond, time.Now()
	for {
		select {
		case <-w.quit:
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, chainRetryMax)
		val, _, err := engines.LoadOrNew(key, func() (caddy.Destructor, error) {
			return a.newEngine(w.ctx, specs)
		})
		if chain.IsWrongChain(err) {
			// An endpoint answered, for another chain: the configuration is wrong, and no try makes it right. The
			// wait ends as a start that failed would: paid routes answer 503 (not "present the payment again"),
			// /health says why, and the operator's reload with the right chain or endpoint starts it.
			a.endWait(w, fmt.Errorf("the x402 app did not start: its chain answered, but not as configured: %s", a.rpcRedactor().Replace(err.Error())))
			return
		}
		if err != nil {
			reason := a.downReason(specs, w.since, err)
			w.mu.Lock()
			w.reason = reason
			w.mu.Unlock()
			if time.Since(lastWarn) >= chainWarnEvery {
				lastWarn = time.Now()
				a.logger.Warn("still waiting for the chain: the paid routes cannot take payments", zap.String("reason", reason))
			}
			continue
		}
		// The hooks run under w.mu: stop (from App.Stop, before any handler's Cleanup) waits for them, and no
		// hook starts a handler after it was cleaned up.
		w.mu.Lock()
		w.releaseJournal() // the engine holds it now
		if w.stopped {
			w.mu.Unlock()
			_, _ = engines.Delete(key)
			return
		}
		a.key, a.engine = key, val.(*engineEntry)
		err = a.runStarters(a.engineStarters)
		if err != nil {
			a.logger.Error("the chain answers, but the paid routes did not start", zap.Error(err))
			err = fmt.Errorf("the x402 app did not start: %w", err)
		} else {
			a.logger.Info("the chain answers: the embedded facilitator started and the paid routes take payments",
				zap.Duration("down_for", time.Since(w.since).Round(time.Millisecond)))
		}
		w.err = err
		close(w.up)
		w.mu.Unlock()
		return
	}
}

// endWait ends the wait for the chain with err, as if the engine had started and its start hooks failed so.
func (a *App) endWait(w *chainWait, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.releaseJournal()
	if w.stopped {
		return
	}
	a.logger.Error("the paid routes did not start, and the x402 app stops waiting for its chain", zap.Error(err))
	w.err = err
	close(w.up)
}

// stop ends the wait: a try under way is cancelled, and the engine, if it starts after this, is let go of at once.
// It waits for the start hooks if they are running.
func (w *chainWait) stop() {
	w.cancel()
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.stopped = true
		close(w.quit)
	}
	w.releaseJournal()
}

// engineDown is the error of a call that needs the engine while it waits for its chain (nil once it is up), and
// whether the engine is still waiting (rather than failed to start when its chain came).
func (a *App) engineDown() (waiting bool, err error) {
	w := a.wait
	if w == nil {
		return false, nil
	}
	select {
	case <-w.up:
		w.mu.Lock()
		defer w.mu.Unlock()
		return false, w.err
	default:
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return true, &x402.FacilitatorError{Op: "verify", Err: errors.New(w.reason)}
}

// downHealth is the /health of an engine waiting for its chain: down, each network saying why.
func (a *App) downHealth(reason string) x402.HealthResponse {
	resp := x402.HealthResponse{Status: x402.HealthDown}
	for _, n := range a.networkIDs() {
		resp.Networks = append(resp.Networks, x402.NetworkHealth{Network: n, Status: x402.HealthDown, Error: reason})
	}
	return resp
}

// answerChainDown answers a paid request while the engine waits for its chain, as the spec maps an unreachable
// facilitator: a payment gets 502 verify-unreachable (nothing is charged now; present the same payment again),
// a request without one 503 (no offer is made that could not be settled). Both carry Retry-After.
func answerChainDown(w http.ResponseWriter, r *http.Request, paymentHeader string) error {
	w.Header().Set("Retry-After", chainRetryAfter)
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "application/json")
	hasPayment := carriesPayment(r, paymentHeader)
	status, body := http.StatusServiceUnavailable, `{"error":"the facilitator cannot reach its chain yet: no way to pay is available right now",`+
		`"outcome":"`+string(x402.OutcomeNoPayment)+`","retry":"nothing was charged; ask again after Retry-After seconds for what to pay"}`
	if hasPayment {
		// Whether this payment settled or bought a response before (in an earlier run: the journal knows, the
		// gate that reads it waits for the engine) is not said here: "not settled" could be false. What is true:
		// nothing is charged while the chain is down, and the same payment, presented again, gets its answer.
		status, body = http.StatusBadGateway, `{"error":"the facilitator cannot reach its chain yet: the payment could not be checked",`+
			`"outcome":"`+string(x402.OutcomeVerifyUnreachable)+`","retry":"nothing is charged while the chain is down; present the same payment again `+
			`after Retry-After seconds, not a new one: if it bought a response before, that is answered then"}`
	}
	if handlesErrors(r) {
		// The server's handle_errors routes answer, as for the gate's other 502s; Retry-After is set already.
		w.Header().Del("Content-Type")
		return caddyhttp.Error(status, errors.New("the facilitator cannot reach its chain yet"))
	}
	w.WriteHeader(status)
	_, err := w.Write([]byte(body + "\n"))
	return err
}

// carriesPayment reports whether the request carries a payment header (the gate's own name for it included).
func carriesPayment(r *http.Request, paymentHeader string) bool {
	return r.Header.Get(x402.HeaderPaymentSignature) != "" || r.Header.Get(x402.HeaderXPayment) != "" ||
		(paymentHeader != "" && r.Header.Get(paymentHeader) != "")
}

// offlineSupported is what the engine supports as far as the configuration tells, while it waits for its chain.
func (a *App) offlineSupported() (x402.SupportedResponse, bool) {
	w := a.wait
	if w == nil {
		return x402.SupportedResponse{}, false
	}
	return w.supported, w.supportedOK
}

// offlineFacilitator is the facilitator of a gate's offline offers: it says what the configuration supports and
// takes no payment (gate.Gate.Offer never asks it to).
type offlineFacilitator struct{ sup x402.SupportedResponse }

func (f offlineFacilitator) Supported(context.Context) (x402.SupportedResponse, error) {
	return f.sup, nil
}

func (offlineFacilitator) Verify(context.Context, x402.VerifyRequest) (x402.VerifyResponse, error) {
	return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Err: errors.New("the chain does not answer yet")}
}

func (offlineFacilitator) Settle(context.Context, x402.SettleRequest) (x402.SettleResponse, error) {
	return x402.SettleResponse{}, &x402.FacilitatorError{Op: "settle", Err: errors.New("the chain does not answer yet")}
}

func (offlineFacilitator) Health(context.Context) (x402.HealthResponse, error) {
	return x402.HealthResponse{Status: x402.HealthDown}, nil
}
