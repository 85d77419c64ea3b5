package gate

import (
	"bytes"
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
var paywallPage = template.Must(template.New("paywall").Parse(`<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Payment required</title>
<style>
body{font-family:system-ui,sans-serif;max-width:42rem;margin:3rem auto;padding:0 1rem;color:#222;line-height:1.5}
h1{font-size:1.5rem}table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:.4rem;border-bottom:1px solid #ddd}
code{font-size:.85rem;word-break:break-all}.note{color:#555;font-size:.9rem}
</style>
</head>
<body>
<h1>Payment required</h1>
<p>{{if .Description}}{{.Description}}: {{end}}<code>{{.URL}}</code></p>
<p>This resource costs <strong>{{.Price}}</strong>, paid with the x402 protocol.</p>
<table>
<tr><th>Network</th><th>Token</th><th>Amount</th><th>Method</th><th>Pay to</th></tr>
{{range .Rows}}<tr><td>{{.Network}}</td><td><code>{{.Asset}}</code></td><td>{{.Amount}}</td><td>{{.Method}}</td><td><code>{{.PayTo}}</code></td></tr>
{{end}}</table>
<h2>How to pay</h2>
<ol>
<li>Use an x402 client, such as <code>@x402/fetch</code> with a wallet holding the token.</li>
<li>It reads the <code>PAYMENT-REQUIRED</code> header of this answer, signs one of the offers above and repeats the request with the signed payment in the <code>{{.Header}}</code> header.</li>
<li>The answer carries the resource and, in <code>PAYMENT-RESPONSE</code>, the settlement transaction.</li>
</ol>
<p class="note">Nothing is charged until a signed payment is sent. A signed payment buys one response.</p>
<script type="application/json" id="x402-payment-required">{{.JSON}}</script>
</body>
</html>
`))

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
