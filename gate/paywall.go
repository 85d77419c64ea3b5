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
//go:embed paywall/page.html
var paywallHTML string

// paywallScript is the page's wallet script, inlined so that the page needs nothing but this answer (no CDN,
// no second request through the gate).
//
//go:embed paywall/paywall.js
var paywallScript string

var paywallPage = template.Must(template.New("paywall").Parse(paywallHTML))

type paywallRow struct {
	Network, Asset, Amount, Dollars, Method, PayTo string
	Index                                          int   // in the offer's accepts, which the script signs
	Decimals                                       uint8 // of the asset, for the script's messages
	Payable                                        bool  // the script can sign it (exact, eip3009 or permit2)
}

// writePaywall writes the 402 page for browsers.
func (x *exchange) writePaywall(pr x402.PaymentRequired) error {
	doc, err := json.Marshal(pr)
	if err != nil {
		return fmt.Errorf("x402 gate: encoding the paywall offer: %w", err)
	}
	data := struct {
		Description, URL, Price, Header string
		Style                           PaywallStyle
		Rows                            []paywallRow
		JSON, Script                    template.JS
	}{Description: pr.Resource.Description, URL: pr.Resource.URL, Header: x.g.cfg.PaymentHeader,
		JSON: template.JS(doc), Script: template.JS(paywallScript), Style: x.g.cfg.Paywall}
	if data.Style.Title == "" {
		data.Style.Title = "Payment required"
	}
	var prices []string
	for i, req := range pr.Accepts {
		decimals, known := x.offerDecimals(req)
		row := paywallRow{Network: req.Network, Asset: req.Asset, Method: req.Extra.AssetTransferMethod, PayTo: req.PayTo,
			Index: i, Decimals: decimals, Amount: req.Amount + " (raw units)"}
		if known {
			row.Amount = x402.FormatTokenAmount(req.Amount, decimals) + " " + req.Extra.Name
			// Prices are set in dollars and paid in dollar stablecoins one for one (x402.ParsePrice).
			row.Dollars = "$" + x402.FormatTokenAmount(req.Amount, decimals)
		}
		if req.Scheme == x402.SchemeUpto {
			row.Amount = "up to " + row.Amount
		}
		row.Payable = req.Scheme == x402.SchemeExact && (req.Extra.AssetTransferMethod == x402.TransferPermit2 ||
			req.Extra.AssetTransferMethod == x402.TransferEIP3009 || req.Extra.AssetTransferMethod == "")
		if !slices.Contains(prices, row.Amount) {
			prices = append(prices, row.Amount)
		}
		data.Rows = append(data.Rows, row)
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

// offerDecimals is the decimals of the asset req pays in, as the gate's offer recorded them.
func (x *exchange) offerDecimals(req x402.PaymentRequirements) (uint8, bool) {
	for _, o := range x.offers.offers {
		if o.req.Network == req.Network && strings.EqualFold(o.req.Asset, req.Asset) {
			return o.decimals, true
		}
	}
	return 0, false
}
