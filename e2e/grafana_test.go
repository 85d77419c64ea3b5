package e2e

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/internal/needs"
)

// dashboardFile is the Grafana dashboard the README offers, relative to the repository root.
const dashboardFile = "examples/grafana-dashboard.json"

// dashboardVars are concrete values for the variables Grafana substitutes in a panel's query before sending it:
// the instance variable's All value, and rate and range windows that cover the whole of the test's load (it
// runs well under a minute, scraped every second).
var dashboardVars = map[string]string{
	"$__rate_interval": "1m",
	"$__interval":      "5s",
	"$__range":         "5m",
	"$instance":        ".*",
}

// dashboard is the part of a Grafana dashboard's JSON the test reads.
type dashboard struct {
	Title      string           `json:"title"`
	UID        string           `json:"uid"`
	Panels     []dashboardPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Datasource *datasourceRef  `json:"datasource"`
			AllValue   string          `json:"allValue"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	ID         int               `json:"id"`
	Type       string            `json:"type"`
	Title      string            `json:"title"`
	Datasource *datasourceRef    `json:"datasource"`
	Panels     []dashboardPanel  `json:"panels"` // a collapsed row's
	Targets    []dashboardTarget `json:"targets"`
}

type dashboardTarget struct {
	RefID      string         `json:"refId"`
	Instant    bool           `json:"instant"`
	Expr       string         `json:"expr"`
	Datasource *datasourceRef `json:"datasource"`
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// readDashboard reads examples/grafana-dashboard.json and checks what Grafana needs to import it onto any
// Prometheus: a datasource variable of type prometheus that every panel and query uses, unique panel ids, and a
// PromQL query in every target. It returns the dashboard and its panels with queries, rows' panels included.
func readDashboard(t *testing.T) (dashboard, []dashboardPanel) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(repoRoot, dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s is not JSON a dashboard can be read from: %v", dashboardFile, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("%s: the dashboard has no title or uid", dashboardFile)
	}
	dsVar := ""
	for _, v := range d.Templating.List {
		if v.Type == "datasource" && string(v.Query) == `"prometheus"` {
			dsVar = "${" + v.Name + "}"
		}
	}
	if dsVar == "" {
		t.Fatalf("%s: no datasource variable of type prometheus in templating", dashboardFile)
	}
	usesDS := func(r *datasourceRef) bool { return r != nil && r.Type == "prometheus" && r.UID == dsVar }
	for _, v := range d.Templating.List {
		if v.Type == "query" && !usesDS(v.Datasource) {
			t.Errorf("%s: variable %s does not query the datasource variable %s", dashboardFile, v.Name, dsVar)
		}
	}

	var panels []dashboardPanel
	ids := map[int]string{}
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			if prev, dup := ids[p.ID]; dup {
				t.Errorf("%s: panels %q and %q share id %d", dashboardFile, prev, p.Title, p.ID)
			}
			ids[p.ID] = p.Title
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			if p.Title == "" || len(p.Targets) == 0 || !usesDS(p.Datasource) {
				t.Errorf("%s: panel %d %q needs a title, a query and the datasource %s", dashboardFile, p.ID, p.Title, dsVar)
			}
			for _, q := range p.Targets {
				if strings.TrimSpace(q.Expr) == "" || q.RefID == "" || !usesDS(q.Datasource) {
					t.Errorf("%s: panel %q query %q needs an expr, a refId and the datasource %s", dashboardFile, p.Title, q.RefID, dsVar)
				}
			}
			panels = append(panels, p)
		}
	}
	walk(d.Panels)
	if len(panels) == 0 {
		t.Fatalf("%s has no panels", dashboardFile)
	}
	return d, panels
}

// substituteVars replaces the dashboard variables in a query with dashboardVars' values, longest name first
// (so that $__range is not taken for a prefix of another); a variable left over fails the test.
func substituteVars(t *testing.T, where, expr string) string {
	t.Helper()
	names := make([]string, 0, len(dashboardVars))
	for n := range dashboardVars {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int { return len(b) - len(a) })
	for _, n := range names {
		expr = strings.ReplaceAll(expr, "${"+n[1:]+"}", dashboardVars[n])
		expr = strings.ReplaceAll(expr, n, dashboardVars[n])
	}
	if strings.Contains(expr, "$") {
		t.Errorf("%s: a variable the test has no value for is left in %q", where, expr)
	}
	return expr
}

// metricNamePattern finds the caddy_x402_* metric names a query reads.
var metricNamePattern = regexp.MustCompile(`caddy_x402_[a-zA-Z0-9_]+`)

// metricFamily is a metric name without the suffix a histogram's or summary's series add.
func metricFamily(name string) string {
	for _, s := range []string{"_bucket", "_sum", "_count"} {
		if strings.HasSuffix(name, s) {
			return strings.TrimSuffix(name, s)
		}
	}
	return name
}

// TestGrafanaDashboardEveryPanelReturnsDataFromPrometheusScrapingCaddyUnderPaidLoad evaluates every query of
// examples/grafana-dashboard.json on a real Prometheus (Debian's prometheus) that scrapes a real Caddy's admin
// /metrics every second while it serves paid load on the dev chain: payments through an embedded-facilitator
// gate settling before serving, a settle async gate and a gate settling through the same Caddy's
// x402_facilitator handler; unpaid requests answered 402; and one payment the facilitator refuses (a payer with
// no funds). Every query (the dashboard's variables given concrete values, asked as Grafana asks: query_range
// for a graph, query for an instant target) must return data, and one over a window (rate, increase) must show
// the load (a value above 0); every caddy_x402_* metric a query names must exist, and every caddy_x402_* metric
// Caddy exports must be on a panel.
func TestGrafanaDashboardEveryPanelReturnsDataFromPrometheusScrapingCaddyUnderPaidLoad(t *testing.T) {
	needBinary(t)
	prometheus := needs.Command(t, "prometheus", "apt-get install prometheus")
	d, panels := readDashboard(t)
	dir := t.TempDir()

	_, facts := startDevchain(t, dir)
	site := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	admin := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	caddyfile := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin %[1]s
	x402 {
		dev_chain {
			rpc %[2]s
		}
	}
}

%[3]s {
	bind 127.0.0.1
	handle /before/* {
		x402 $0.01 {
			pay_to %[4]s
			settle before
		}
		respond "paid before"
	}
	handle /async/* {
		x402 $0.01 {
			pay_to %[4]s
			settle async
		}
		respond "paid async"
	}
	handle /remote/* {
		x402 $0.01 {
			pay_to %[4]s
			facilitator %[3]s/facilitator/
		}
		respond "paid through the facilitator handler"
	}
	handle_path /facilitator/* {
		x402_facilitator
	}
	respond "free"
}
`, admin, facts.RPC, site, seller.Hex()))
	caddy := startProcess(t, "caddy run (paid routes)", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", caddyfile)
	routes := []string{"/before/", "/async/", "/remote/"}
	for _, r := range routes {
		caddy.waitUntil("a 402 on "+r, 60*time.Second, answersWith(site+r, 402))
	}

	// Prometheus, its data and its config in the test's temporary folder, scraping Caddy's admin /metrics.
	promDir := t.TempDir()
	promURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	promConfig := writeFile(t, promDir, "prometheus.yml", fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: caddy
    metrics_path: /metrics
    static_configs:
      - targets: ['%s']
`, admin))
	prom := startProgram(t, "prometheus", promDir, childEnv(t), prometheus,
		"--config.file="+promConfig,
		"--storage.tsdb.path="+filepath.Join(promDir, "data"),
		"--web.listen-address="+strings.TrimPrefix(promURL, "http://"),
		"--log.level=warn")
	prom.waitUntil("Prometheus ready", 30*time.Second, answersWith(promURL+"/-/ready", 200))
	// The load starts once Prometheus has Caddy's series: what happens after its first scrape is what a rate
	// can see.
	prom.waitUntil("a first scrape of Caddy", 30*time.Second, func() error {
		up, err := promQuery(promURL, `up{job="caddy"} == 1 and on (instance) count by (instance) (caddy_x402_gate_async_backlog)`)
		if err == nil && len(up) == 0 {
			err = fmt.Errorf("no successful scrape of %s yet", admin)
		}
		return err
	})

	// waitScraped waits until Prometheus has scraped all the load so far: its sum of gate outcomes is what Caddy
	// counts now (no request is under way).
	waitScraped := func(what string) {
		t.Helper()
		want, err := scrapedSum(admin, "caddy_x402_gate_outcomes_total")
		if err != nil {
			t.Fatal(err)
		}
		caddy.waitUntil("Prometheus to scrape "+what, 30*time.Second, func() error {
			got, err := promQuery(promURL, `sum(caddy_x402_gate_outcomes_total)`)
			if err != nil {
				return err
			}
			if len(got) != 1 || got[0].Value[1] != strconv.FormatFloat(want, 'f', -1, 64) {
				return fmt.Errorf("Prometheus has %v, Caddy counts %v", got, want)
			}
			return nil
		})
	}

	loadStart := time.Now()
	// The load, in two rounds a scrape apart, as a site's traffic goes on: unpaid requests (402 offers) and
	// payments through each gate, then one payment the facilitator refuses (a payer with no funds).
	for round := 1; round <= 2; round++ {
		for _, r := range routes {
			for range 3 {
				if a, err := get(site + r); err != nil || a.status != 402 {
					t.Fatalf("unpaid GET %s: %d %v, want 402", r, a.status, err)
				}
			}
			bench := runCommand(t, 2*time.Minute, dir, childEnv(t), caddyBin, "x402", "bench", "--dev", "--rpc", facts.RPC, "-n", "8", "-c", "2", site+r)
			if bench.code != 0 {
				t.Fatalf("caddy x402 bench %s exited %d\nstdout:\n%s\nstderr:\n%s", r, bench.code, bench.stdout, bench.stderr)
			}
		}
		waitScraped(fmt.Sprintf("round %d of the load", round))
	}
	broke, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	refused := runCommand(t, time.Minute, dir, childEnv(t), caddyBin, "x402", "pay", "--key", common.Bytes2Hex(crypto.FromECDSA(broke)), "--max", "10000", site+"/remote/")
	if refused.code == 0 {
		t.Fatalf("a payer with no funds was served:\nstdout:\n%s\nstderr:\n%s", refused.stdout, refused.stderr)
	}
	waitScraped("the refused payment")
	// A rate needs two samples after the last change; a histogram's too.
	time.Sleep(2500 * time.Millisecond)

	names, err := promLabelValues(promURL, "__name__", "")
	if err != nil {
		t.Fatal(err)
	}
	exported := map[string]bool{}
	for _, n := range names {
		if strings.HasPrefix(n, "caddy_x402_") {
			exported[n] = true
		}
	}
	onPanels := map[string]bool{}
	queries := 0
	for _, p := range panels {
		for _, q := range p.Targets {
			where := fmt.Sprintf("panel %q query %s", p.Title, q.RefID)
			for _, m := range metricNamePattern.FindAllString(q.Expr, -1) {
				onPanels[metricFamily(m)] = true
				if !exported[m] {
					t.Errorf("%s names %s, a metric Caddy does not export (it exports %s)", where, m, strings.Join(slices.Sorted(maps.Keys(exported)), ", "))
				}
			}
			expr := substituteVars(t, where, q.Expr)
			// As Grafana asks: an instant query for an instant target, else a range query over the time the
			// load took (each step's samples count; the latest steps see the whole load in their window).
			var res []promSample
			var err error
			if q.Instant {
				res, err = promQuery(promURL, expr)
			} else {
				res, err = promQueryRange(promURL, expr, loadStart.Add(-2*time.Second), time.Now())
			}
			switch {
			case err != nil:
				t.Errorf("%s: %v\nquery: %s", where, err, expr)
			case len(res) == 0:
				t.Errorf("%s returned no data\nquery: %s", where, expr)
			case countsLoad(expr) && !anyPositive(res):
				t.Errorf("%s shows none of the load: each of its %d values is 0 or NaN\nquery: %s", where, len(res), expr)
			default:
				queries++
				top := slices.MaxFunc(res, func(a, b promSample) int { return cmp.Compare(sampleValue(a), sampleValue(b)) })
				t.Logf("%s: %d values, highest %v %v", where, len(res), top.Metric, top.Value[1])
			}
		}
	}
	for n := range exported {
		if !onPanels[metricFamily(n)] {
			t.Errorf("Caddy exports %s and no panel of %s shows it", n, dashboardFile)
		}
	}
	// The variables' label_values(metric, label) queries find the Caddy.
	labelValues := regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q string
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Errorf("variable %s: its query is not a string: %s", v.Name, v.Query)
			continue
		}
		m := labelValues.FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %s: the test reads only label_values(metric, label) queries, not %q", v.Name, q)
			continue
		}
		vals, err := promLabelValues(promURL, m[2], m[1])
		if err != nil || !slices.Contains(vals, admin) {
			t.Errorf("variable %s (%s): values %v (%v), want the scraped Caddy %s among them", v.Name, q, vals, err, admin)
		}
		if v.AllValue != "" && dashboardVars["$"+v.Name] != v.AllValue {
			t.Errorf("variable %s: its All value %q is not the %q the test queries with", v.Name, v.AllValue, dashboardVars["$"+v.Name])
		}
	}
	t.Logf("%d queries of %d panels returned data; %d caddy_x402_* series names exported", queries, len(panels), len(exported))

	prom.stop()
	caddy.stop()
}

// countsLoad reports whether a query reads counters or histograms over a window (rate, increase): those
// windows hold the whole load, so such a panel must show some of it (a value above 0), where a gauge may rest
// at 0 once the load is over.
func countsLoad(expr string) bool {
	return strings.Contains(expr, "rate(") || strings.Contains(expr, "increase(")
}

// anyPositive reports whether some series has a value above 0 (NaN is not).
func anyPositive(res []promSample) bool {
	return slices.ContainsFunc(res, func(r promSample) bool { return sampleValue(r) > 0 })
}

// sampleValue is a sample's value as a number, NaN when it is none.
func sampleValue(r promSample) float64 {
	if s, ok := r.Value[1].(string); ok {
		if v, err := strconv.ParseFloat(s, 64); err == nil {
			return v
		}
	}
	return math.NaN()
}

// promSample is one series of an instant query's vector result.
type promSample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

// promQuery evaluates expr now through Prometheus's HTTP API and returns its series; a scalar result is one
// series without labels. Values are the API's strings.
func promQuery(base, expr string) ([]promSample, error) {
	a, err := get(base + "/api/v1/query?query=" + url.QueryEscape(expr))
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string          `json:"resultType"`
			Result     json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(a.body), &r); err != nil {
		return nil, fmt.Errorf("Prometheus answered %d %s: %w", a.status, shorten(a.body), err)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("Prometheus refused the query: %s", r.Error)
	}
	switch r.Data.ResultType {
	case "vector":
		var v []promSample
		err := json.Unmarshal(r.Data.Result, &v)
		return v, err
	case "scalar":
		var s [2]any
		err := json.Unmarshal(r.Data.Result, &s)
		return []promSample{{Value: s}}, err
	default:
		return nil, fmt.Errorf("result type %s, want an instant vector or a scalar", r.Data.ResultType)
	}
}

// promQueryRange evaluates expr every second from start to end through Prometheus's HTTP API, as a Grafana
// time series panel does, and returns one promSample per series and step that has a value.
func promQueryRange(base, expr string, start, end time.Time) ([]promSample, error) {
	a, err := get(fmt.Sprintf("%s/api/v1/query_range?query=%s&start=%d&end=%d&step=1", base, url.QueryEscape(expr), start.Unix(), end.Unix()+1))
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string `json:"resultType"`
			Result     []struct {
				Metric map[string]string `json:"metric"`
				Values [][2]any          `json:"values"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(a.body), &r); err != nil {
		return nil, fmt.Errorf("Prometheus answered %d %s: %w", a.status, shorten(a.body), err)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("Prometheus refused the query: %s", r.Error)
	}
	if r.Data.ResultType != "matrix" {
		return nil, fmt.Errorf("result type %s, want a range vector", r.Data.ResultType)
	}
	var out []promSample
	for _, series := range r.Data.Result {
		for _, v := range series.Values {
			out = append(out, promSample{Metric: series.Metric, Value: v})
		}
	}
	return out, nil
}

// promLabelValues returns the values of label over the series match selects ("" for every series).
func promLabelValues(base, label, match string) ([]string, error) {
	u := base + "/api/v1/label/" + label + "/values"
	if match != "" {
		u += "?match[]=" + url.QueryEscape(match)
	}
	a, err := get(u)
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string   `json:"status"`
		Data   []string `json:"data"`
	}
	if err := json.Unmarshal([]byte(a.body), &r); err != nil || r.Status != "success" {
		return nil, fmt.Errorf("Prometheus answered %d %s (%v)", a.status, shorten(a.body), err)
	}
	return r.Data, nil
}

// scrapedSum adds up the values of every series of a metric on a Caddy's admin /metrics.
func scrapedSum(admin, metric string) (float64, error) {
	a, err := get("http://" + admin + "/metrics")
	if err != nil {
		return 0, err
	}
	total := 0.0
	for _, line := range strings.Split(a.body, "\n") {
		if !strings.HasPrefix(line, metric+"{") && !strings.HasPrefix(line, metric+" ") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("metrics line %q: %w", line, err)
		}
		total += v
	}
	return total, nil
}
