package caddymodule

import (
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// gathered returns every sample of reg as "name{label="value",...}" -> value; histograms give _count.
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatalf("gathering: %v", err)
	}
	out := map[string]float64{}
	for _, fam := range families {
		for _, m := range fam.GetMetric() {
			labels := make([]string, 0, len(m.GetLabel()))
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			sort.Strings(labels)
			name := fam.GetName()
			var v float64
			switch fam.GetType() {
			case dto.MetricType_COUNTER:
				v = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				v = m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				name, v = name+"_count", float64(m.GetHistogram().GetSampleCount())
			}
			out[name+"{"+strings.Join(labels, ",")+"}"] = v
		}
	}
	return out
}

func TestMetricsRegisteredTwiceInOneRegistryShareTheirCollectors(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	first, err := newMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	second, err := newMetrics(reg)
	if err != nil {
		t.Fatalf("a second handler registering the metrics: %v", err)
	}
	first.observeOutcome(x402.OutcomeSettled)
	second.observeOutcome(x402.OutcomeSettled)
	second.observeOutcome(x402.OutcomeVerifyFailed)
	first.observeVerify(metricsHandlerGate, 30*time.Millisecond)
	second.observeSettle(metricsHandlerFacilitator, 2*time.Second)
	second.observeFacilitatorRequest(facilitatorserver.EndpointSettle, 200)

	got := gathered(t, reg)
	for name, want := range map[string]float64{
		`caddy_x402_gate_outcomes_total{status="settled"}`:                    2,
		`caddy_x402_gate_outcomes_total{status="verify-failed"}`:              1,
		`caddy_x402_verify_duration_seconds_count{handler="gate"}`:            1,
		`caddy_x402_settle_duration_seconds_count{handler="facilitator"}`:     1,
		`caddy_x402_facilitator_requests_total{code="200",endpoint="settle"}`: 1,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}

	// A reload brings a new registry: the collectors register there afresh.
	if _, err := newMetrics(prometheus.NewPedanticRegistry()); err != nil {
		t.Fatalf("registering in the registry of a reloaded config: %v", err)
	}
}

func TestMetricsLabelValuesFromOutsideAreBoundedToKnownOnes(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := newMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, "")
	m.observeFacilitatorOutcome(facilitatorserver.EndpointSettle, "")
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, x402.ReasonInsufficientFunds)
	m.observeFacilitatorOutcome(facilitatorserver.EndpointSettle, "made_up_by_a_remote_facilitator_12345")
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, x402.ReasonUptoFacilitatorMismatch)
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, x402.ReasonBatchCumulativeExceedsBalance)
	m.observeOutcome(x402.OutcomeStatus("not-a-status"))

	got := gathered(t, reg)
	for name, want := range map[string]float64{
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="valid"}`:              1,
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="settled"}`:            1,
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="insufficient_funds"}`: 1,
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="other"}`:              1,
		`caddy_x402_gate_outcomes_total{status="other"}`:                                       1,
		// Every reason the protocol package names has its own series (x402.Reasons), upto's and batch's too.
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="upto_facilitator_mismatch"}`:                               1,
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="invalid_batch_settlement_evm_cumulative_exceeds_balance"}`: 1,
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="other"}`:                                                   0,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
	for name := range got {
		if strings.Contains(name, "made_up") || strings.Contains(name, "not-a-status") {
			t.Errorf("an outside label value reached the registry: %s", name)
		}
	}
}

// fakeWallets is a walletSource with fixed pools: network -> {size, in use}.
type fakeWallets struct{ pools map[string][2]int }

func (f *fakeWallets) Networks() []string {
	var out []string
	for n := range f.pools {
		out = append(out, n)
	}
	return out
}

func (f *fakeWallets) Wallets(n string) []common.Address {
	return make([]common.Address, f.pools[n][0])
}

func (f *fakeWallets) WalletsInUse(n string) int { return f.pools[n][1] }

func TestWalletGaugesReportTrackedEnginesUntilTheLastHandlerLetsGo(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := newMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	engine := &fakeWallets{map[string][2]int{x402.NetworkTestnet: {4, 3}}}
	releaseA := m.trackWallets(engine)
	releaseB := m.trackWallets(engine) // a second handler over the same engine

	got := gathered(t, reg)
	if got[`caddy_x402_wallets{network="eip155:72344"}`] != 4 || got[`caddy_x402_wallets_in_use{network="eip155:72344"}`] != 3 {
		t.Fatalf("wallet gauges = %v, want 4 wallets with 3 in use", got)
	}
	releaseA()
	releaseA() // releasing twice must not drop the other handler's hold
	if _, ok := gathered(t, reg)[`caddy_x402_wallets{network="eip155:72344"}`]; !ok {
		t.Fatal("the gauges vanished while a handler still tracks the engine")
	}
	releaseB()
	if v, ok := gathered(t, reg)[`caddy_x402_wallets{network="eip155:72344"}`]; ok {
		t.Fatalf("caddy_x402_wallets = %v after every handler let go, want no sample", v)
	}
}

func TestMetricsMethodsOnANilSetDoNothing(t *testing.T) {
	var m *metrics
	m.observeOutcome(x402.OutcomeSettled)
	m.observeVerify(metricsHandlerGate, time.Second)
	m.observeSettle(metricsHandlerGate, time.Second)
	m.observeFacilitatorRequest(facilitatorserver.EndpointVerify, 200)
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, "")
	m.trackWallets(&fakeWallets{})()
	m.preset(metricsHandlerGate)
}

func TestMetricsPresetMakesAHandlersClosedSeriesAtZeroSoARateSeesTheirFirstIncrement(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := newMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.preset(metricsHandlerGate)
	got := gathered(t, reg)
	for _, s := range x402.OutcomeStatuses() {
		name := `caddy_x402_gate_outcomes_total{status="` + string(s) + `"}`
		if v, ok := got[name]; !ok || v != 0 {
			t.Errorf("after a gate's preset %s = %v (present %v), want 0", name, v, ok)
		}
	}
	for _, name := range []string{`caddy_x402_verify_duration_seconds_count{handler="gate"}`, `caddy_x402_settle_duration_seconds_count{handler="gate"}`} {
		if v, ok := got[name]; !ok || v != 0 {
			t.Errorf("after a gate's preset %s = %v (present %v), want 0", name, v, ok)
		}
	}
	for name := range got {
		if strings.Contains(name, "facilitator") {
			t.Errorf("a gate's preset made a facilitator series: %s", name)
		}
	}

	m.preset(metricsHandlerFacilitator)
	m.observeFacilitatorOutcome(facilitatorserver.EndpointVerify, x402.ReasonInsufficientFunds)
	got = gathered(t, reg)
	for name, want := range map[string]float64{
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="valid"}`:                                0,
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="settled"}`:                              0,
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="` + x402.ReasonTransactionFailed + `"}`: 0,
		`caddy_x402_facilitator_outcomes_total{endpoint="settle",reason="other"}`:                                0,
		`caddy_x402_facilitator_outcomes_total{endpoint="verify",reason="insufficient_funds"}`:                   1,
		`caddy_x402_settle_duration_seconds_count{handler="facilitator"}`:                                        0,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("after a facilitator's preset %s = %v (present %v), want %v", name, v, ok, want)
		}
	}
}
