package e2e

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"sync"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The browser lane of the money-invariant run: the gate's paywall. A payment drawn in a browser shape is asked
// for as a browser's navigation asks (Accept: text/html,...), which the gate answers with its paywall page; the
// client reads the offer from the page's embedded JSON (<script type="application/json"
// id="x402-payment-required">), not from the header, signs it as any payment of the run, and presents it as the
// page's script does (a fetch, Accept: */*) or as a navigation (Accept: text/html). Every action draws these
// shapes, so a page's payment is presented again in another shape (another Accept), to another resource, route
// or gateway, several at once, across kills, reloads and faults, and any payment is presented as a browser
// would. The check browser-paywall judges the pages and what the paid browser requests got; the money checks
// judge these payments as any other.

// The browser shapes (invShapes): the paywall script's fetch, a navigation, and a HEAD as a browser sends it
// (its unpaid ask is a HEAD too, answered with the page's head and no body; the offer is then read from the page).
const (
	shapeBrowserFetch = "browser: the paywall script's fetch (Accept: */*)"
	shapeBrowserNav   = "browser navigation (Accept: text/html)"
	shapeBrowserHEAD  = "browser HEAD (Accept: text/html)"
)

// invReloadedTitle is the paywall's title while the gateways run the reloaded prices (invariants_world_test.go);
// before, it is the default.
const invReloadedTitle = "Payment required (reloaded)"

// invNavigationAccept is the Accept of a browser's navigation.
const invNavigationAccept = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"

// browserRoute fits the routes a browser goes to: plain HTTP routes (not WebSocket, not MCP).
func browserRoute(rk *routeKind, path string) bool { return notWebSocket(rk, path) }

func browserShape(shape string) bool {
	return shape == shapeBrowserFetch || shape == shapeBrowserNav || shape == shapeBrowserHEAD
}

// invBrowser is what the lane saw of the paywall pages.
type invBrowser struct {
	mu       sync.Mutex
	pages    int      // 402 pages read whose embedded JSON is the header's PaymentRequired
	reloaded int      // of which with the reloaded paywall's title
	heads    int      // unpaid HEADs answered as the page's head
	bad      []string // pages (or HEADs) that were not: what was wrong
}

// pageSeen notes a page read (head: a HEAD's answer), and what was wrong with it ("": nothing).
func (r *invRun) pageSeen(head, reloaded bool, problem string) {
	r.browser.mu.Lock()
	defer r.browser.mu.Unlock()
	switch {
	case problem != "":
		r.browser.bad = append(r.browser.bad, problem)
	case head:
		r.browser.heads++
	default:
		r.browser.pages++
		if reloaded {
			r.browser.reloaded++
		}
	}
}

// readHeadThenPage asks gateway base for path with a HEAD as a browser sends it, which the gate answers as its
// page without the body (402, text/html, PAYMENT-REQUIRED, no body), then reads the offer from the page.
func (r *invRun) readHeadThenPage(ctx context.Context, base, path string) (payer.Offer, error) {
	resp, err := r.navigate(ctx, http.MethodHead, base, path)
	if err != nil {
		return payer.Offer{}, fmt.Errorf("asking %s for its paywall's head: %w", path, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusPaymentRequired {
		return payer.Offer{}, fmt.Errorf("unpaid HEAD %s answered %d, want 402", path, resp.StatusCode)
	}
	media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	_, err = x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
	switch {
	case media != "text/html" || err != nil || len(body) > 0:
		r.pageSeen(true, false, fmt.Sprintf("the 402 of HEAD %s at %s as a browser asks: Content-Type %q, %s %v, %d bytes of body; want the page's head: text/html, the offer, no body",
			path, base, resp.Header.Get("Content-Type"), x402.HeaderPaymentRequired, err, len(body)))
	default:
		r.pageSeen(true, false, "")
	}
	return r.readPageOffer(ctx, base, path)
}

// navigate asks gateway base for path with method as a browser's navigation does (its Accept), unpaid.
func (r *invRun) navigate(ctx context.Context, method, base, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, base+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", invNavigationAccept)
	return r.client.h1.Do(req)
}

// paywallJSONOpen is how the page's embedded offer begins (gate/paywall/page.html).
const paywallJSONOpen = `<script type="application/json" id="x402-payment-required">`

// readPageOffer asks gateway base for path as a browser's navigation asks, without paying, and reads the offer
// from the paywall page's embedded JSON; it checks that the page is HTML and that its JSON is the same
// PaymentRequired as the answer's PAYMENT-REQUIRED header, and notes the page (pageSeen).
func (r *invRun) readPageOffer(ctx context.Context, base, path string) (payer.Offer, error) {
	resp, err := r.navigate(ctx, http.MethodGet, base, path)
	if err != nil {
		return payer.Offer{}, fmt.Errorf("asking %s for its paywall: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return payer.Offer{}, fmt.Errorf("reading the paywall of %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusPaymentRequired {
		// A 503 for want of an offer (a facilitator down) is JSON for browsers too: no page to judge.
		return payer.Offer{}, fmt.Errorf("unpaid navigation to %s answered %d %s, want 402", path, resp.StatusCode, shorten(string(body)))
	}
	doc, problem := paywallOffer(resp, body)
	reloaded := bytes.Contains(body, []byte("<title>"+invReloadedTitle+"</title>"))
	if problem == "" && !reloaded && !bytes.Contains(body, []byte("<title>Payment required</title>")) {
		problem = fmt.Sprintf("its title is neither the default nor the reloaded paywall's %q", invReloadedTitle)
	}
	if problem != "" {
		problem = fmt.Sprintf("the 402 page of GET %s at %s: %s", path, base, problem)
		r.pageSeen(false, false, problem)
		return payer.Offer{}, fmt.Errorf("%s", problem)
	}
	r.pageSeen(false, reloaded, "")
	h := http.Header{}
	h.Set(x402.HeaderPaymentRequired, base64.StdEncoding.EncodeToString(doc))
	return payer.ReadOffer(h, nil)
}

// paywallOffer reads the PaymentRequired a 402 page embeds, and says what is wrong with the page: not HTML, no
// embedded offer, one that does not decode, or one that is not the PAYMENT-REQUIRED header's.
func paywallOffer(resp *http.Response, body []byte) ([]byte, string) {
	if media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); media != "text/html" {
		return nil, fmt.Sprintf("Content-Type %q, want text/html: %s", resp.Header.Get("Content-Type"), shorten(string(body)))
	}
	_, rest, ok := bytes.Cut(body, []byte(paywallJSONOpen))
	if !ok {
		return nil, "no " + paywallJSONOpen
	}
	doc, _, ok := bytes.Cut(rest, []byte("</script>"))
	if !ok {
		return nil, "the embedded offer's script does not end"
	}
	var page x402.PaymentRequired
	if err := json.Unmarshal(doc, &page); err != nil {
		return nil, fmt.Sprintf("the embedded offer is no PaymentRequired (%v): %s", err, shorten(string(doc)))
	}
	header, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		return nil, fmt.Sprintf("its %s header: %v", x402.HeaderPaymentRequired, err)
	}
	a, _ := json.Marshal(page)
	b, _ := json.Marshal(header)
	if !bytes.Equal(a, b) {
		return nil, fmt.Sprintf("the embedded offer %s is not the header's %s", shorten(string(a)), shorten(string(b)))
	}
	if len(page.Accepts) == 0 {
		return nil, "the page offers nothing to pay"
	}
	return doc, ""
}

// isPaywallPage reports whether an answer's body is the gate's paywall page.
func isPaywallPage(resp *http.Response, body []byte) bool {
	media, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return media == "text/html" && bytes.Contains(body, []byte(paywallJSONOpen))
}

// checkBrowser judges browser-paywall: every 402 page a browser got is HTML embedding the header's
// PaymentRequired; no request carrying a payment got the paywall page (in place of the content, or as its
// refusal: a refusal is the gate's JSON, which the page's script reads, whatever the Accept); and the lane ran:
// pages were read, and a payment signed from a page delivered its response.
func (r *invRun) checkBrowser(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	r.browser.mu.Lock()
	pages, reloaded, heads, bad := r.browser.pages, r.browser.reloaded, r.browser.heads, append([]string(nil), r.browser.bad...)
	r.browser.mu.Unlock()
	signIns, signInsServed := 0, 0
	for _, s := range r.siwxSnapshot() {
		if s.fromPage {
			signIns++
			if s.servedRight {
				signInsServed++
			}
		}
	}
	for _, b := range bad {
		out = append(out, invViolation{what: b})
	}
	counts := map[string]int{}
	var fromPage, fromPageDelivered, refused, refusedJSON int
	for _, p := range r.snapshot() {
		if p.fromPage {
			fromPage++
			if p.delivered() > 0 {
				fromPageDelivered++
			}
		}
		p.mu.Lock()
		answers := append([]*invAnswer(nil), p.answers...)
		p.mu.Unlock()
		for _, a := range answers {
			if browserShape(a.shape) {
				counts[a.shape]++
				if a.status == http.StatusPaymentRequired {
					refused++
					if a.json {
						refusedJSON++
					} else if !a.page {
						out = append(out, invViolation{what: fmt.Sprintf("payment #%d's refusal in a browser's request is not the gate's JSON a script reads: %s", p.n, a), payments: []*invPayment{p}})
					}
				}
			}
			if a.page {
				out = append(out, invViolation{what: fmt.Sprintf("payment #%d was answered with the paywall page: %s", p.n, a), payments: []*invPayment{p}})
			}
		}
	}
	summary := fmt.Sprintf("%d paywall pages read whose embedded JSON is the header's (%d with the reloaded paywall), %d unpaid HEADs answered as the page's head, %d malformed; "+
		"%d payments signed from a page's JSON, %d delivered; %d sign-ins signed from a page's challenge, %d served; "+
		"paid browser requests: %d× %s, %d× %s, %d× %s, of which %d refused with 402 (%d as the gate's JSON)",
		pages, reloaded, heads, len(bad), fromPage, fromPageDelivered, signIns, signInsServed,
		counts[shapeBrowserFetch], shapeBrowserFetch, counts[shapeBrowserNav], shapeBrowserNav, counts[shapeBrowserHEAD], shapeBrowserHEAD, refused, refusedJSON)
	if pages == 0 || fromPageDelivered == 0 {
		out = append(out, invViolation{what: "no payment signed from a paywall page delivered its response: the browser lane did not run"})
	}
	return out, summary
}

// browserAccept is the Accept a browser shape sends.
func browserAccept(shape string) string {
	if shape != shapeBrowserFetch {
		return invNavigationAccept
	}
	return "*/*"
}
