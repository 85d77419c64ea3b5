package gate

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// paywallPage is the 402 page a browser gets: what the resource costs, where the money goes, and how to pay.
// The offer itself rides along as JSON for wallet scripts, next to the PAYMENT-REQUIRED header.
//
//go:embed paywall.html
var paywallHTML string

var paywallPage = template.Must(template.New("paywall").Parse(paywallHTML))

type paywallRow struct {
	Network, Asset, Amount, Method, PayTo string
}

// writePaywall writes the 402 page for browsers.
func (x *exchange) writePaywall(pr x402.PaymentRequired) error {
	doc, err := json.Marshal(pr)
	if err != nil {
		return fmt.Errorf("x402 gate: encoding the paywall offer: %w", err)
	}
	data := struct {
		Description, URL, Price, Header string
		Rows                            []paywallRow
		JSON                            template.JS
	}{Description: pr.Resource.Description, URL: pr.Resource.URL, Header: x.g.cfg.PaymentHeader, JSON: template.JS(doc)}
	var prices []string
	for _, o := range x.offers.offers {
		amount := x402.FormatTokenAmount(o.req.Amount, o.decimals) + " " + o.req.Extra.Name
		if !slices.Contains(prices, amount) {
			prices = append(prices, amount)
		}
		data.Rows = append(data.Rows, paywallRow{Network: o.req.Network, Asset: o.req.Asset, Amount: amount,
			Method: o.req.Extra.AssetTransferMethod, PayTo: o.req.PayTo})
	}
	data.Price = strings.Join(prices, " or ")
	if data.Price == "" {
		data.Price = "an amount its facilitator cannot state right now"
	}
	var buf bytes.Buffer
	if err := paywallPage.Execute(&buf, data); err != nil {
		return fmt.Errorf("x402 gate: rendering the paywall: %w", err)
	}
	h := x.w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(buf.Len()))
	h.Set("Cache-Control", "no-store")
	x.w.WriteHeader(http.StatusPaymentRequired)
	_, err = x.w.Write(buf.Bytes())
	return err
}
