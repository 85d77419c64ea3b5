package facilitatorserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// healthOnly is a facilitator whose /health says what the test wants; it serves no payment.
type healthOnly struct {
	resp x402.HealthResponse
	err  error
}

func (h healthOnly) Supported(context.Context) (x402.SupportedResponse, error) {
	return x402.SupportedResponse{}, errors.New("health only")
}
func (h healthOnly) Verify(context.Context, x402.VerifyRequest) (x402.VerifyResponse, error) {
	return x402.VerifyResponse{}, errors.New("health only")
}
func (h healthOnly) Settle(context.Context, x402.SettleRequest) (x402.SettleResponse, error) {
	return x402.SettleResponse{}, errors.New("health only")
}
func (h healthOnly) Health(context.Context) (x402.HealthResponse, error) { return h.resp, h.err }

const (
	opsNetwork = "eip155:8453"
	opsWallet  = "0x1111111111111111111111111111111111111111"
	opsPayer   = "0x2222222222222222222222222222222222222222"
)

// operatorsHealth is a health answer with everything an operator's page shows, and a hostile error text.
func operatorsHealth(refusedAt time.Time) x402.HealthResponse {
	return x402.HealthResponse{Status: x402.HealthDegraded, Networks: []x402.NetworkHealth{
		{Network: opsNetwork, Status: x402.HealthDegraded, RPCReachable: true, HeadBlock: 123, HeadAgeSeconds: 4.25,
			Wallets:        []x402.WalletHealth{{Address: opsWallet, Balance: "1500000000000000000", Low: true, InFlight: 3}},
			JournalBacklog: 7, PendingSettlements: 5, OldestPendingSeconds: 95},
		{Network: "eip155:84532", Status: x402.HealthDown, Error: `RPC unreachable: <script>alert("x")</script> https://node.example`},
	}, Refusals: &x402.RefusalsHealth{Total: 3,
		Counts: []x402.RefusalCount{{Network: opsNetwork, Reason: "insufficient_funds", Count: 2}, {Network: "eip155:84532", Reason: "invalid_exact_evm_payload_signature", Count: 1}},
		Recent: []x402.Refusal{{At: refusedAt, Op: "verify", Network: opsNetwork, Reason: "insufficient_funds", Payer: opsPayer},
			{At: refusedAt.Add(-time.Minute), Op: "verify", Network: "eip155:84532", Reason: "invalid_exact_evm_payload_signature"}},
	}}
}

func getHealth(t *testing.T, srv http.Handler, method, accept string) (*http.Response, string) {
	t.Helper()
	r := httptest.NewRequest(method, "/facilitator/health", nil)
	if accept != "" {
		r.Header.Set("Accept", accept)
	}
	w := httptest.NewRecorder()
	srv.ServeHTTP(w, r)
	res := w.Result()
	body, _ := io.ReadAll(res.Body)
	return res, string(body)
}

// Every client that does not ask for HTML gets today's JSON: the fields /health always had, under the same
// names, with the operator's new ones beside them, and Vary: Accept so that no cache mixes the two forms up.
func TestHealthStaysJSONForEveryClientThatDoesNotAskForHTML(t *testing.T) {
	at := time.Date(2026, 11, 26, 20, 0, 0, 0, time.UTC)
	srv, err := facilitatorserver.New(healthOnly{resp: operatorsHealth(at)}, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, accept := range []string{"", "application/json", "*/*", "application/json, text/plain;q=0.5"} {
		res, body := getHealth(t, srv, http.MethodGet, accept)
		if res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "application/json" || res.Header.Get("Vary") != "Accept" {
			t.Fatalf("Accept %q: status %d, Content-Type %q, Vary %q; want 200, application/json, Accept",
				accept, res.StatusCode, res.Header.Get("Content-Type"), res.Header.Get("Vary"))
		}
		var doc map[string]any
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			t.Fatalf("Accept %q: the body is no JSON: %v\n%s", accept, err, body)
		}
		net := doc["networks"].([]any)[0].(map[string]any)
		wallet := net["wallets"].([]any)[0].(map[string]any)
		for _, c := range []struct {
			name string
			got  any
			want any
		}{
			{"status", doc["status"], "degraded"},
			{"network", net["network"], opsNetwork},
			{"network status", net["status"], "degraded"},
			{"rpcReachable", net["rpcReachable"], true},
			{"headBlock", net["headBlock"], 123.0},
			{"headAgeSeconds", net["headAgeSeconds"], 4.25},
			{"journalBacklog", net["journalBacklog"], 7.0},
			{"wallet address", wallet["address"], opsWallet},
			{"wallet balance", wallet["balance"], "1500000000000000000"},
			{"wallet low", wallet["low"], true},
			{"wallet inFlight", wallet["inFlight"], 3.0},
			{"pendingSettlements", net["pendingSettlements"], 5.0},
			{"oldestPendingSeconds", net["oldestPendingSeconds"], 95.0},
			{"refusals total", doc["refusals"].(map[string]any)["total"], 3.0},
			{"a refusal's reason", doc["refusals"].(map[string]any)["recent"].([]any)[0].(map[string]any)["reason"], "insufficient_funds"},
			{"a refusal's payer", doc["refusals"].(map[string]any)["recent"].([]any)[0].(map[string]any)["payer"], opsPayer},
			{"a refusal's time", doc["refusals"].(map[string]any)["recent"].([]any)[0].(map[string]any)["at"], "2026-11-26T20:00:00Z"},
		} {
			if c.got != c.want {
				t.Errorf("Accept %q: %s = %#v, want %#v", accept, c.name, c.got, c.want)
			}
		}
	}
}

// A browser asking for /health gets a page for a person: each network with its head block and age, its
// wallets with their balances in whole coins and settlements in flight, the backlog and pending settlements,
// and the refusals by reason with the payer; error texts escaped, and nothing fetched from elsewhere.
func TestHealthIsAPageForABrowser(t *testing.T) {
	at := time.Now().Add(-42 * time.Second).UTC()
	srv, err := facilitatorserver.New(healthOnly{resp: operatorsHealth(at)}, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	res, body := getHealth(t, srv, http.MethodGet, "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8")
	if res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "text/html; charset=utf-8" || res.Header.Get("Vary") != "Accept" {
		t.Fatalf("status %d, Content-Type %q, Vary %q; want 200, text/html; charset=utf-8, Accept", res.StatusCode, res.Header.Get("Content-Type"), res.Header.Get("Vary"))
	}
	if csp := res.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
		t.Errorf("Content-Security-Policy %q, want default-src 'none': the page loads nothing", csp)
	}
	for _, want := range []string{
		"<title>x402 facilitator: degraded</title>",
		"<code>" + opsNetwork + "</code>",
		`<dd class="head-block">123</dd>`,
		`<dd class="head-age">4.2 s old</dd>`,
		"<code>" + opsWallet + "</code>",
		`title="1500000000000000000 wei">1.500000</td>`,
		`<td class="n">3</td>`,
		`<span class="badge down">low</span>`,
		`<dd class="backlog">7 not final</dd>`,
		`<dd class="pending">5 (oldest claimed 1 min 35 s ago)</dd>`,
		"3 refused since the facilitator started.",
		"<code>insufficient_funds</code></td><td class=\"n\">2</td>",
		"<code>" + opsPayer + "</code>",
		at.Format("2006-01-02 15:04:05") + " (4",
		"RPC unreachable: &lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; https://node.example",
		`<dd class="head-age">unknown</dd>`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(body, "<script") || strings.Contains(body, "http://") || strings.Contains(body, "src=") {
		t.Errorf("the page has a script or fetches something:\n%s", body)
	}

	// HEAD gets the same headers.
	if res, _ := getHealth(t, srv, http.MethodHead, "text/html"); res.StatusCode != http.StatusOK || res.Header.Get("Content-Type") != "text/html; charset=utf-8" {
		t.Errorf("HEAD with Accept text/html: status %d, Content-Type %q", res.StatusCode, res.Header.Get("Content-Type"))
	}
}

// A network field the page does not know (a newer engine's, such as why a chain is unreachable) is shown as it
// comes, and a document without networks, wallets or refusals still makes a page.
func TestHealthPageShowsWhatItDoesNotKnowAndLacks(t *testing.T) {
	type newerNetwork struct {
		x402.NetworkHealth
		Reachability string `json:"reachability"`
		Since        int    `json:"downSinceSeconds"`
	}
	newer := struct {
		Status   string         `json:"status"`
		Networks []newerNetwork `json:"networks"`
	}{Status: "starting", Networks: []newerNetwork{{NetworkHealth: x402.NetworkHealth{Network: opsNetwork, Status: "unreachable"},
		Reachability: "connection refused by <node>", Since: 12}}}
	w := httptest.NewRecorder()
	facilitatorserver.WriteHealthPage(w, http.StatusServiceUnavailable, newer)
	body := w.Body.String()
	if w.Code != http.StatusServiceUnavailable {
		t.Errorf("status %d, want the 503 given", w.Code)
	}
	for _, want := range []string{
		`<span class="badge starting" id="status">starting</span>`,
		`<span class="badge unreachable">unreachable</span>`,
		`<dt>reachability</dt><dd class="extra">connection refused by &lt;node&gt;</dd>`,
		`<dt>downSinceSeconds</dt><dd class="extra">12</dd>`,
		"No balance read: the node is not reachable.",
		"keeps no record of refusals",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the page lacks %q:\n%s", want, body)
		}
	}

	// The facilitator gives no answer: the page says so, with its error.
	srv, err := facilitatorserver.New(healthOnly{err: errors.New("the journal is closed")}, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	res, page := getHealth(t, srv, http.MethodGet, "text/html")
	if res.StatusCode != http.StatusServiceUnavailable || !strings.Contains(page, `<p class="error" id="error">the journal is closed</p>`) ||
		!strings.Contains(page, "No network is reported.") {
		t.Errorf("a facilitator without an answer: status %d, page\n%s", res.StatusCode, page)
	}
}

// A server that serves some networks only shows the refusals of those, as it shows only their health.
func TestHealthShowsOnlyTheRefusalsOfTheServedNetworks(t *testing.T) {
	srv, err := facilitatorserver.New(healthOnly{resp: operatorsHealth(time.Now())}, facilitatorserver.Options{Networks: []string{opsNetwork}})
	if err != nil {
		t.Fatal(err)
	}
	_, body := getHealth(t, srv, http.MethodGet, "")
	var doc x402.HealthResponse
	if err := json.Unmarshal([]byte(body), &doc); err != nil {
		t.Fatal(err)
	}
	r := doc.Refusals
	if len(doc.Networks) != 1 || r == nil || r.Total != 2 || len(r.Counts) != 1 || len(r.Recent) != 1 || r.Recent[0].Network != opsNetwork {
		t.Errorf("a server of %s only: networks %+v, refusals %+v; want its network and its 2 refusals only", opsNetwork, doc.Networks, r)
	}
}
