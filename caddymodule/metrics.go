package caddymodule

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Handler names of the "handler" label of the latency histograms.
const (
	metricsHandlerGate        = "gate"
	metricsHandlerFacilitator = "facilitator"
)

// metricsOther stands for a label value outside the known set. Endpoint, network and reason come from requests
// or from a remote facilitator; passing them through would let anyone grow the registry without bound.
const metricsOther = "other"

// latencyBuckets span a cached verify (a millisecond) to a settlement waiting out a slow receipt (a minute).
var latencyBuckets = prometheus.ExponentialBuckets(0.001, 2.5, 13)

// metrics holds the caddy_x402_* collectors of one config's metrics registry. Every handler of a config shares
// one set: the first to provision registers it, later ones find it registered and use the registered
// collectors. A config reload brings a new registry and so a new set, as Caddy's own caddy_http_* metrics do.
// Its methods are safe for concurrent use and do nothing on a nil *metrics, so a handler that was never
// provisioned (a unit test) needs no special case.
type metrics struct {
	// caddy_x402_facilitator_requests_total{endpoint, code}
	facilitatorRequests *prometheus.CounterVec
	// caddy_x402_facilitator_outcomes_total{endpoint, reason}: verify and settle answers by reason code,
	// "valid" and "settled" for the successes.
	facilitatorOutcomes *prometheus.CounterVec
	// caddy_x402_verify_duration_seconds{handler} and caddy_x402_settle_duration_seconds{handler}: how long
	// verifying and settling took, as the facilitator handler served it or as the gate waited for it.
	verifyDuration *prometheus.HistogramVec
	settleDuration *prometheus.HistogramVec
	// caddy_x402_gate_outcomes_total{status}: gated requests by PaymentOutcome status.
	gateOutcomes *prometheus.CounterVec
	// caddy_x402_wallets_in_use{network} and caddy_x402_wallets{network}, read from the engines at scrape time.
	wallets *walletCollector
	// caddy_x402_gate_async_backlog, read from the gates' journals at scrape time.
	backlog *backlogCollector
}

// metricsFor returns the collectors registered in ctx's metrics registry, registering them if this is the
// first handler of the config to ask, with the series a handler of this kind (metricsHandlerGate or
// metricsHandlerFacilitator) counts made at zero.
func metricsFor(ctx caddy.Context, handler string) (*metrics, error) {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		// A context not made by Caddy (a unit test); its metrics go nowhere.
		reg = prometheus.NewRegistry()
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	m.preset(handler)
	return m, nil
}

// preset makes at zero every series of the closed label sets that a handler of this kind counts: each gate
// outcome status, each facilitator answer (the successes and every known reason, per endpoint), and the
// handler's latency histograms. A labelled series is otherwise born at its first increment, with the value 1,
// and Prometheus's rate and increase take a series' first sample as its start: the first refusal of a reason
// (often the only one, the one that matters) and a whole burst between two scrapes would show as nothing on a
// dashboard. The facilitator's request counter is left to its first request: HTTP codes are an open set.
func (m *metrics) preset(handler string) {
	if m == nil {
		return
	}
	m.verifyDuration.WithLabelValues(handler)
	m.settleDuration.WithLabelValues(handler)
	switch handler {
	case metricsHandlerGate:
		for _, s := range x402.OutcomeStatuses() {
			m.gateOutcomes.WithLabelValues(string(s))
		}
	case metricsHandlerFacilitator:
		for endpoint, success := range map[string]string{
			facilitatorserver.EndpointVerify: "valid",
			facilitatorserver.EndpointSettle: "settled",
		} {
			m.facilitatorOutcomes.WithLabelValues(endpoint, success)
			m.facilitatorOutcomes.WithLabelValues(endpoint, metricsOther)
			for r := range knownReasons {
				m.facilitatorOutcomes.WithLabelValues(endpoint, r)
			}
		}
	}
}

// newMetrics registers the collectors in reg, or takes those already registered there.
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	const ns = "caddy"
	m := &metrics{}
	var err error
	if m.facilitatorRequests, err = register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Subsystem: "x402_facilitator", Name: "requests_total",
		Help: "Requests to the x402 facilitator handler by endpoint and HTTP status code.",
	}, []string{"endpoint", "code"})); err != nil {
		return nil, err
	}
	if m.facilitatorOutcomes, err = register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Subsystem: "x402_facilitator", Name: "outcomes_total",
		Help: "Verify and settle answers of the x402 facilitator handler by reason code (valid and settled for successes).",
	}, []string{"endpoint", "reason"})); err != nil {
		return nil, err
	}
	if m.verifyDuration, err = register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: ns, Subsystem: "x402", Name: "verify_duration_seconds",
		Help: "Time to verify an x402 payment, by the handler that measured it.", Buckets: latencyBuckets,
	}, []string{"handler"})); err != nil {
		return nil, err
	}
	if m.settleDuration, err = register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: ns, Subsystem: "x402", Name: "settle_duration_seconds",
		Help: "Time to settle an x402 payment, by the handler that measured it.", Buckets: latencyBuckets,
	}, []string{"handler"})); err != nil {
		return nil, err
	}
	if m.gateOutcomes, err = register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Subsystem: "x402_gate", Name: "outcomes_total",
		Help: "Requests through the x402 payment gate by PaymentOutcome status.",
	}, []string{"status"})); err != nil {
		return nil, err
	}
	if m.wallets, err = register(reg, newWalletCollector()); err != nil {
		return nil, err
	}
	if m.backlog, err = register(reg, newBacklogCollector()); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c in reg, or returns the collector of the same description registered before.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var already prometheus.AlreadyRegisteredError
	if errors.As(err, &already) {
		if existing, ok := already.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	var zero C
	return zero, fmt.Errorf("registering x402 metrics: %w", err)
}

// observeOutcome counts one gated request by the status of its PaymentOutcome.
func (m *metrics) observeOutcome(status x402.OutcomeStatus) {
	if m == nil {
		return
	}
	label := string(status)
	if !status.Valid() {
		label = metricsOther
	}
	m.gateOutcomes.WithLabelValues(label).Inc()
}

// observeVerify records how long a verification took; handler is metricsHandlerGate or
// metricsHandlerFacilitator.
func (m *metrics) observeVerify(handler string, d time.Duration) {
	if m == nil {
		return
	}
	m.verifyDuration.WithLabelValues(handler).Observe(d.Seconds())
}

// observeSettle records how long a settlement took; handler is metricsHandlerGate or metricsHandlerFacilitator.
func (m *metrics) observeSettle(handler string, d time.Duration) {
	if m == nil {
		return
	}
	m.settleDuration.WithLabelValues(handler).Observe(d.Seconds())
}

// observeFacilitatorRequest counts one request to the facilitator handler.
func (m *metrics) observeFacilitatorRequest(endpoint string, code int) {
	if m == nil {
		return
	}
	m.facilitatorRequests.WithLabelValues(endpoint, strconv.Itoa(code)).Inc()
}

// observeFacilitatorOutcome counts one verify or settle answer by reason; reason "" counts as success
// ("valid" for verify, "settled" for settle).
func (m *metrics) observeFacilitatorOutcome(endpoint, reason string) {
	if m == nil {
		return
	}
	switch {
	case reason == "" && endpoint == facilitatorserver.EndpointVerify:
		reason = "valid"
	case reason == "":
		reason = "settled"
	case !knownReasons[reason]:
		reason = metricsOther
	}
	m.facilitatorOutcomes.WithLabelValues(endpoint, reason).Inc()
}

// trackWallets makes the wallet gauges report src's pools until the returned release is called.
func (m *metrics) trackWallets(src walletSource) (release func()) {
	if m == nil || src == nil {
		return func() {}
	}
	return m.wallets.add(src)
}

// trackBacklog makes the backlog gauge count src's waiting payments until the returned release is called.
func (m *metrics) trackBacklog(src backlogSource) (release func()) {
	if m == nil || src == nil {
		return func() {}
	}
	return m.backlog.add(src)
}

// knownReasons are the reason codes that get their own label value: every one the protocol package names.
var knownReasons = func() map[string]bool {
	set := map[string]bool{}
	for _, r := range x402.Reasons() {
		set[r] = true
	}
	return set
}()

// walletSource is an engine whose settlement wallet pools the gauges report (*chain.Facilitator). It must be
// comparable, as a pointer is: the collector counts handlers per source.
type walletSource interface {
	Networks() []string
	Wallets(network string) []common.Address
	WalletsInUse(network string) int
}

// walletCollector reports the wallet pools of the engines handlers registered, read when scraped so the gauges
// are never stale. Handlers of one config share an engine, so sources are counted, not listed.
type walletCollector struct {
	inUse *prometheus.Desc
	size  *prometheus.Desc
	sources[walletSource]
}

func newWalletCollector() *walletCollector {
	return &walletCollector{
		inUse: prometheus.NewDesc("caddy_x402_wallets_in_use",
			"Settlement wallets of the embedded facilitator holding a settlement right now, by network.", []string{"network"}, nil),
		size: prometheus.NewDesc("caddy_x402_wallets",
			"Settlement wallets of the embedded facilitator, by network.", []string{"network"}, nil),
		sources: sources[walletSource]{counts: map[walletSource]int{}},
	}
}

// sources counts the handlers that registered each source of a collector; a source is reported while any does.
type sources[S comparable] struct {
	mu     sync.Mutex
	counts map[S]int
}

// add registers one handler's use of src; the returned release ends it (once, however often it is called).
func (s *sources[S]) add(src S) func() {
	s.mu.Lock()
	s.counts[src]++
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.counts[src]--; s.counts[src] <= 0 {
				delete(s.counts, src)
			}
		})
	}
}

// list returns the sources registered now.
func (s *sources[S]) list() []S {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]S, 0, len(s.counts))
	for src := range s.counts {
		out = append(out, src)
	}
	return out
}

// backlogSource is the gate ledger of one journal (*gate.Ledger).
type backlogSource interface{ Backlog() int }

// backlogCollector reports how many served settle-async payments wait for their settlement, over the journals
// of the config's gates, read when scraped.
type backlogCollector struct {
	desc *prometheus.Desc
	sources[backlogSource]
}

func newBacklogCollector() *backlogCollector {
	return &backlogCollector{
		desc: prometheus.NewDesc("caddy_x402_gate_async_backlog",
			"Payments served by settle async gates and waiting for their settlement.", nil, nil),
		sources: sources[backlogSource]{counts: map[backlogSource]int{}},
	}
}

// Describe implements prometheus.Collector.
func (c *backlogCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *backlogCollector) Collect(ch chan<- prometheus.Metric) {
	total := 0
	for _, s := range c.list() {
		total += s.Backlog()
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(total))
}

// Describe implements prometheus.Collector.
func (c *walletCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.inUse
	ch <- c.size
}

// Collect implements prometheus.Collector.
func (c *walletCollector) Collect(ch chan<- prometheus.Metric) {
	seen := map[string]bool{}
	for _, s := range c.list() {
		for _, n := range s.Networks() {
			if seen[n] {
				continue // two engines on one network cannot both be in one config; report the first
			}
			seen[n] = true
			ch <- prometheus.MustNewConstMetric(c.inUse, prometheus.GaugeValue, float64(s.WalletsInUse(n)), n)
			ch <- prometheus.MustNewConstMetric(c.size, prometheus.GaugeValue, float64(len(s.Wallets(n))), n)
		}
	}
}
