package facilitatorserver_test

import (
	"encoding/base64"
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// discoveryServer is a server of the embedded engine on a simulated chain that catalogs in an in-memory
// journal of at most entries resources, its URL, and the chain.
func discoveryServer(t *testing.T, entries int) (*chaintest.Chain, string, string) {
	t.Helper()
	c, f, network := engine(t)
	cat := journal.ResourceCatalog{Store: journal.NewMemory(journal.Options{})}
	srv, err := facilitatorserver.New(f, facilitatorserver.Options{
		APIKeys: []string{apiKey}, DiscoveryEntries: entries,
		Catalog: func() facilitatorserver.Catalog { return cat },
	})
	if err != nil {
		t.Fatal(err)
	}
	_, url := serve(t, srv, apiKey)
	c.Approve(c.Payers[0], contracts.Permit2Address, new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1)))
	return c, url, network
}

// bazaarPayment is a signed permit2 payment for resource, its payload echoing decl as the bazaar extension.
func bazaarPayment(t *testing.T, c *chaintest.Chain, network, resource string, decl json.RawMessage) x402.VerifyRequest {
	t.Helper()
	return bazaarPaymentTo(t, c, network, resource, decl, seller.Hex())
}

// bazaarPaymentTo is bazaarPayment paid to payTo.
func bazaarPaymentTo(t *testing.T, c *chaintest.Chain, network, resource string, decl json.RawMessage, payTo string) x402.VerifyRequest {
	t.Helper()
	rq := x402.PaymentRequirements{
		Scheme: x402.SchemeExact, Network: network, Amount: big.NewInt(price).String(), Asset: c.Token.Hex(),
		PayTo: payTo, MaxTimeoutSeconds: 3600,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"},
	}
	payload, err := chain.SignPermit2Payment(c.Payers[0].Key, rq, c.ChainID, chain.Permit2Options{Now: time.Unix(int64(c.HeadTime()), 0)})
	if err != nil {
		t.Fatal(err)
	}
	payload.Resource = &x402.ResourceInfo{URL: resource, Description: "the weather", MimeType: "application/json",
		ServiceName: "Weather Co", Tags: []string{"weather", "data"}, IconURL: "https://weather.example/icon.png"}
	if decl != nil {
		payload.Extensions = map[string]json.RawMessage{x402.ExtensionBazaar: decl}
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: payload, PaymentRequirements: rq}
}

// postPayment posts req to the server's endpoint with the API key and returns the answer's status, body and
// decoded EXTENSION-RESPONSES header.
func postPayment(t *testing.T, url, endpoint string, req x402.VerifyRequest) (int, []byte, map[string]map[string]string) {
	t.Helper()
	body, _ := json.Marshal(req)
	r, _ := http.NewRequest(http.MethodPost, url+"/"+endpoint, strings.NewReader(string(body)))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set(x402.HeaderAPIKey, apiKey)
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var ext map[string]map[string]string
	if h := resp.Header.Get(x402.HeaderExtensionResponses); h != "" {
		raw, err := base64.StdEncoding.DecodeString(h)
		if err != nil || json.Unmarshal(raw, &ext) != nil {
			t.Fatalf("EXTENSION-RESPONSES %q is not base64 of a JSON object", h)
		}
	}
	return resp.StatusCode, b, ext
}

// list gets /discovery/resources?query without an API key.
func list(t *testing.T, url, query string) (int, x402.DiscoveryResourcesResponse, string) {
	t.Helper()
	resp, err := http.Get(url + "/discovery/resources?" + query)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out x402.DiscoveryResourcesResponse
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("listing %s: %v", b, err)
		}
	}
	return resp.StatusCode, out, string(b)
}

func weatherDeclaration(t *testing.T, city string) json.RawMessage {
	t.Helper()
	decl, err := x402.BazaarDeclaration(x402.BazaarHTTP{Method: "GET", InputExample: json.RawMessage(`{"city":"` + city + `"}`),
		InputSchema: json.RawMessage(`{"properties":{"city":{"type":"string"}},"required":["city"]}`)})
	if err != nil {
		t.Fatal(err)
	}
	return decl
}

// A payment that settles with a bazaar declaration catalogs its resource, listed by GET /discovery/resources
// (no API key) with what the server declared; its settle answer says so in EXTENSION-RESPONSES. A payment
// refused is not catalogued; one presented again is listed once; the latest declaration wins.
func TestASettledPaymentCatalogsItsDeclaredResourceAndARefusedOneDoesNot(t *testing.T) {
	c, url, network := discoveryServer(t, 0)
	const resource = "https://api.weather.example/forecast?key=sk_live_secret"

	refused := bazaarPayment(t, c, network, "https://api.weather.example/refused", weatherDeclaration(t, "Oslo"))
	refused.PaymentPayload.Payload.Signature = "0x" + strings.Repeat("11", 65)
	if status, body, ext := postPayment(t, url, "settle", refused); status != http.StatusOK || strings.Contains(string(body), `"success":true`) || ext != nil {
		t.Fatalf("settling a forged payment = %d %s, EXTENSION-RESPONSES %v; want a refusal and no header", status, body, ext)
	}
	if _, got, _ := list(t, url, ""); got.Pagination.Total != 0 {
		t.Fatalf("after a refused payment the catalog lists %+v, want nothing", got.Items)
	}

	req := bazaarPayment(t, c, network, resource, weatherDeclaration(t, "Oslo"))
	status, body, ext := postPayment(t, url, "settle", req)
	if status != http.StatusOK || !strings.Contains(string(body), `"success":true`) {
		t.Fatalf("settle = %d %s, want success", status, body)
	}
	if ext["bazaar"]["status"] != "success" {
		t.Fatalf("EXTENSION-RESPONSES = %v, want bazaar success", ext)
	}
	postPayment(t, url, "settle", req) // presented again
	status, got, raw := list(t, url, "")
	if status != http.StatusOK || got.X402Version != 2 || got.Pagination.Total != 1 || len(got.Items) != 1 {
		t.Fatalf("listing = %d %s, want one resource", status, raw)
	}
	item := got.Items[0]
	if item.Resource != "https://api.weather.example/forecast" || item.Type != "http" || item.Description != "the weather" ||
		item.ServiceName != "Weather Co" || len(item.Tags) != 2 || item.IconURL != "https://weather.example/icon.png" ||
		len(item.Accepts) != 1 || item.Accepts[0].PayTo != seller.Hex() || item.LastUpdated == "" {
		t.Errorf("listed %+v; want the declared resource without its query", item)
	}
	if strings.Contains(raw, "sk_live_secret") || strings.Contains(raw, req.PaymentPayload.Payload.Signature[2:20]) {
		t.Errorf("the listing echoes the resource's query or the payment's signature: %s", raw)
	}
	var echoed struct {
		Info struct {
			Input struct {
				QueryParams map[string]string `json:"queryParams"`
			} `json:"input"`
		} `json:"info"`
	}
	if err := json.Unmarshal(item.Extensions["bazaar"], &echoed); err != nil || echoed.Info.Input.QueryParams["city"] != "Oslo" {
		t.Errorf("listed bazaar extension %s, want the declaration", item.Extensions["bazaar"])
	}

	postPayment(t, url, "settle", bazaarPayment(t, c, network, resource, weatherDeclaration(t, "Lima")))
	_, got, raw = list(t, url, "")
	if got.Pagination.Total != 1 || !strings.Contains(string(got.Items[0].Extensions["bazaar"]), "Lima") {
		t.Errorf("after a second payment with another declaration the listing is %s; want one resource declaring Lima", raw)
	}

	// A payer paying someone else under the seller's resource URL adds its own entry and replaces nothing.
	spoof := bazaarPaymentTo(t, c, network, resource, weatherDeclaration(t, "Spoofed"), otherPayTo)
	if status, body, _ := postPayment(t, url, "settle", spoof); status != http.StatusOK || !strings.Contains(string(body), `"success":true`) {
		t.Fatalf("settling the payment to another recipient = %d %s", status, body)
	}
	_, got, raw = list(t, url, "payTo="+seller.Hex())
	if got.Pagination.Total != 1 || !strings.Contains(string(got.Items[0].Extensions["bazaar"]), "Lima") {
		t.Errorf("the seller's entry after a payment to another recipient under its URL: %s; want it unchanged (Lima)", raw)
	}
	if _, got, _ = list(t, url, ""); got.Pagination.Total != 2 {
		t.Errorf("the catalog lists %d entries, want 2 (one per recipient)", got.Pagination.Total)
	}
}

// The catalog keeps at most its bound of resources, the least recently updated evicted; listings page within
// the filters; a declaration too large or malformed is rejected in EXTENSION-RESPONSES, the payment settled all
// the same; bad query parameters are 400 naming the parameter.
func TestTheCatalogIsBoundedPagedAndRejectsWhatItCannotKeep(t *testing.T) {
	c, url, network := discoveryServer(t, 3)
	for i := range 5 {
		status, body, ext := postPayment(t, url, "settle", bazaarPayment(t, c, network, "https://api.example/r"+string(rune('a'+i)), weatherDeclaration(t, "x")))
		if status != http.StatusOK || ext["bazaar"]["status"] != "success" {
			t.Fatalf("settling #%d = %d %s %v", i, status, body, ext)
		}
	}
	_, got, raw := list(t, url, "limit=2&offset=1")
	if got.Pagination.Total != 3 || len(got.Items) != 2 || got.Pagination.Limit != 2 || got.Pagination.Offset != 1 ||
		got.Items[0].Resource != "https://api.example/rd" || got.Items[1].Resource != "https://api.example/rc" {
		t.Errorf("page 2 of a catalog bound to 3 = %s; want rd, rc of 3 (ra, rb evicted)", raw)
	}
	if _, got, _ := list(t, url, "offset=3"); len(got.Items) != 0 || got.Pagination.Total != 3 {
		t.Errorf("a page past the end = %+v, want no items of 3", got)
	}
	if _, got, _ := list(t, url, "network="+network+"&scheme=exact&type=http&payTo="+strings.ToLower(seller.Hex())); got.Pagination.Total != 3 {
		t.Errorf("filtered by what every resource has: %d resources, want 3", got.Pagination.Total)
	}
	if _, got, _ := list(t, url, "network=eip155:1"); got.Pagination.Total != 0 {
		t.Errorf("filtered by another network: %d resources, want 0", got.Pagination.Total)
	}

	huge := weatherDeclaration(t, strings.Repeat("z", facilitatorserver.MaxDiscoveryEntryBytes))
	status, body, ext := postPayment(t, url, "settle", bazaarPayment(t, c, network, "https://api.example/huge", huge))
	if status != http.StatusOK || !strings.Contains(string(body), `"success":true`) || ext["bazaar"]["status"] != "rejected" ||
		!strings.Contains(ext["bazaar"]["rejectedReason"], "bytes") {
		t.Errorf("an oversized declaration: %d %s %v; want settled, bazaar rejected naming its size", status, body, ext)
	}
	bad := json.RawMessage(`{"info":{"input":{"type":"ftp"}},"schema":{}}`)
	if _, _, ext := postPayment(t, url, "settle", bazaarPayment(t, c, network, "https://api.example/bad", bad)); ext["bazaar"]["status"] != "rejected" ||
		!strings.Contains(ext["bazaar"]["rejectedReason"], "info.input.type") {
		t.Errorf("a malformed declaration: EXTENSION-RESPONSES %v, want rejected naming info.input.type", ext)
	}
	if _, got, raw := list(t, url, "limit=100"); got.Pagination.Total != 3 || strings.Contains(raw, "huge") || strings.Contains(raw, "/bad") {
		t.Errorf("rejected declarations reached the catalog: %s", raw)
	}

	// A limit above the largest page is taken as it, as the SDK's discovery client needs (it fails on a 400).
	if status, got, raw := list(t, url, "limit=1000"); status != http.StatusOK || got.Pagination.Limit != facilitatorserver.MaxDiscoveryLimit || got.Pagination.Total != 3 {
		t.Errorf("?limit=1000 = %d %s; want 200, pagination.limit %d", status, raw, facilitatorserver.MaxDiscoveryLimit)
	}
	for _, q := range []struct{ query, param string }{
		{"limit=0", "limit"}, {"limit=99999999999", "limit"}, {"limit=x", "limit"}, {"offset=-1", "offset"},
		{"type=ftp", "type"}, {"sort=asc", "sort"}, {"limit=1&limit=2", "limit"},
	} {
		status, _, raw := list(t, url, q.query)
		if status != http.StatusBadRequest || !strings.Contains(raw, `\"`+q.param+`\"`) {
			t.Errorf("?%s = %d %s; want 400 naming %q", q.query, status, raw, q.param)
		}
	}
}

// Listings are counted against the client's verify rate limit: past it, 429 with Retry-After, and the catalog is
// not read.
func TestListingsCountAgainstTheClientsVerifyRateLimit(t *testing.T) {
	_, f, _ := engine(t)
	cat := journal.ResourceCatalog{Store: journal.NewMemory(journal.Options{})}
	srv, err := facilitatorserver.New(f, facilitatorserver.Options{
		VerifyRateLimit: facilitatorserver.VerifyRateLimit{PerIP: 3},
		Catalog:         func() facilitatorserver.Catalog { return cat },
	})
	if err != nil {
		t.Fatal(err)
	}
	_, url := serve(t, srv, "")
	for i := range 3 {
		if status, _, raw := list(t, url, "limit=5"); status != http.StatusOK {
			t.Fatalf("listing %d = %d %s, want 200", i, status, raw)
		}
	}
	resp, err := http.Get(url + "/discovery/resources")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("the fourth listing in a minute = %d (Retry-After %q), want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}
