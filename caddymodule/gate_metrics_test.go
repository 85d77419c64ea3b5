package caddymodule_test

import (
	"net/http"
	"sort"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestGateOutcomesAndTimingsAreCountedInCaddysMetrics(t *testing.T) {
	env := newGateEnv(t, gateSetup{})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	if a := env.get("/"); a.status != http.StatusPaymentRequired {
		t.Fatalf("unpaid: %d", a.status)
	}
	if a := env.get("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer)); a.status != http.StatusOK {
		t.Fatalf("paid: %d %s", a.status, a.body)
	}
	got := samples(t)
	for key, want := range map[string]float64{
		// Two unpaid requests: ours, and the one permit2Header makes to read the offer it signs.
		`caddy_x402_gate_outcomes_total{status="no-payment"}`:      2,
		`caddy_x402_gate_outcomes_total{status="settled"}`:         1,
		`caddy_x402_verify_duration_seconds_count{handler="gate"}`: 1,
		`caddy_x402_settle_duration_seconds_count{handler="gate"}`: 1,
	} {
		if got[key] != want {
			t.Errorf("%s = %v, want %v", key, got[key], want)
		}
	}
}

// samples reads the running Caddy's metrics as "name{label="value"}" -> value; histograms give _count.
func samples(t *testing.T) map[string]float64 {
	t.Helper()
	ctx := caddy.ActiveContext()
	families, err := ctx.GetMetricsRegistry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, fam := range families {
		for _, m := range fam.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			sort.Strings(labels)
			name, v := fam.GetName(), m.GetCounter().GetValue()
			if g := m.GetGauge(); g != nil {
				v = g.GetValue()
			}
			if h := m.GetHistogram(); h != nil {
				name, v = name+"_count", float64(h.GetSampleCount())
			}
			out[name+"{"+strings.Join(labels, ",")+"}"] = v
		}
	}
	return out
}
