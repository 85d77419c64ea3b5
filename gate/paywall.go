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

// PaywallRow is one offer of the 402 as the paywall page shows it.
type PaywallRow struct {
	// Scheme is exact or upto; Amount is its price in the token ("0.01 Stable Coin", "up to 0.01 Stable
	// Coin" for upto, "<raw> (raw units)" when the token's decimals are not known) and Dollars in dollars ("$0.01").
	Scheme, Amount, Dollars string
	// Network (CAIP-2), Asset (token address), Method (asset transfer method) and PayTo (the payee) as offered.
	Network, Asset, Method, PayTo string
	Index                         int   // in the offer's accepts, which the script signs (data-offer)
	Decimals                      uint8 // of the asset, for the script's messages (data-decimals)
	Payable                       bool  // the script can sign it (exact by eip3009, permit2 or erc2612 naming a spender, upto by permit2)
}

// PaywallData is what the paywall page's template is given, the built-in one or a user's own.
type PaywallData struct {
	// Title is the page's title (the paywall block's, else "Payment required"); Logo its logo URL, already
	// checked (CheckLogo), "" for none; Color its accent colour (#rrggbb), "" for none.
	Title string
	Logo  template.URL
	Color template.CSS
	// Description is the route's description; URL the resource's URL; Price what it costs, every offer's
	// amount joined by " or "; Header the payment header's name (PAYMENT-SIGNATURE).
	Description, URL, Price, Header string
	// Rows are the offers, in the 402's order.
	Rows []PaywallRow
	// SignIn is true when the route grants access (sign-in-with-x): a payer who paid before signs in instead of
	// paying again.
	SignIn bool
	// SignInOnly is true when the route sells nothing (sign_in_only): the page offers the sign-in alone, no
	// price and no way to pay.
	SignInOnly bool
	// JSON is the 402 (PaymentRequired) as JSON, for <script type="application/json" id="x402-payment-required">;
	// Chains the networks a wallet may be asked to add, for <script type="application/json" id="x402-chains">;
	// Script the built-in wallet script, for a <script> after them. See README, "The paywall".
	JSON, Chains, Script template.JS
	// Style is the paywall block as configured.
	Style PaywallStyle
}

// writePaywall writes the 402 page for browsers.
func (x *exchange) writePaywall(pr x402.PaymentRequired) error {
	doc, err := json.Marshal(pr)
	if err != nil {
		return fmt.Errorf("x402 gate: encoding the paywall offer: %w", err)
	}
	style := x.g.cfg.Paywall
	data := PaywallData{Title: style.Title, Description: pr.Resource.Description, URL: pr.Resource.URL, Header: x.g.cfg.PaymentHeader,
		JSON: template.JS(doc), Script: template.JS(paywallScript), Style: style}
	if data.Title == "" {
		data.Title = "Payment required"
	}
	if style.Logo != "" && CheckLogo(style.Logo) == nil {
		data.Logo = template.URL(style.Logo) // checked: a path, https, or a data: image of a safe type
	}
	if paywallColor.MatchString(style.Color) {
		data.Color = template.CSS(style.Color)
	}
	_, data.SignIn = pr.Extensions[x402.ExtensionSignInWithX]
	data.SignInOnly = x.g.cfg.SignInOnly
	type addChain struct {
		ChainName      string   `json:"chainName"`
		RPCURLs        []string `json:"rpcUrls"`
		NativeCurrency struct {
			Name     string `json:"name"`
			Symbol   string `json:"symbol"`
			Decimals int    `json:"decimals"`
		} `json:"nativeCurrency"`
	}
	chains := map[string]addChain{}
	var prices []string
	for i, req := range pr.Accepts {
		decimals, known := x.offerDecimals(req)
		row := PaywallRow{Scheme: req.Scheme, Network: req.Network, Asset: req.Asset, Method: req.Extra.AssetTransferMethod, PayTo: req.PayTo,
			Index: i, Decimals: decimals, Amount: req.Amount + " (raw units)"}
		if known {
			row.Amount = x402.FormatTokenAmount(req.Amount, decimals) + " " + req.Extra.Name
			// Prices are set in dollars and paid in dollar stablecoins one for one (x402.ParsePrice).
			row.Dollars = "$" + x402.FormatTokenAmount(req.Amount, decimals)
		}
		if req.Scheme == x402.SchemeUpto {
			row.Amount = "up to " + row.Amount
			if row.Dollars != "" {
				row.Dollars = "up to " + row.Dollars
			}
		}
		method := req.Extra.AssetTransferMethod
		row.Payable = req.Scheme == x402.SchemeExact && (method == x402.TransferPermit2 || method == x402.TransferEIP3009 || method == "") ||
			req.Scheme == x402.SchemeExact && method == x402.TransferERC2612 && x402.IsHexAddress(req.Extra.Spender) ||
			req.Scheme == x402.SchemeUpto && method == x402.TransferPermit2 && x402.IsHexAddress(req.Extra.FacilitatorAddress)
		if !slices.Contains(prices, row.Amount) {
			prices = append(prices, row.Amount)
		}
		data.Rows = append(data.Rows, row)
		c, ok := style.Chains[req.Network]
		if !ok {
			c, ok = style.Chains[""] // the paywall's rpc_url for every network of the gate
		}
		if ok {
			if u := c.url(); u != "" {
				a := addChain{ChainName: c.Name, RPCURLs: []string{u}}
				if a.ChainName == "" {
					a.ChainName = req.Network
				}
				a.NativeCurrency.Name, a.NativeCurrency.Symbol, a.NativeCurrency.Decimals = c.CurrencyName, c.CurrencySymbol, 18
				if a.NativeCurrency.Name == "" {
					a.NativeCurrency.Name, a.NativeCurrency.Symbol = "Ether", "ETH"
				}
				chains[req.Network] = a
			}
		}
	}
	chainsDoc, err := json.Marshal(chains)
	if err != nil {
		return fmt.Errorf("x402 gate: encoding the paywall's chains: %w", err)
	}
	data.Chains = template.JS(chainsDoc)
	data.Price = strings.Join(prices, " or ")
	if data.Price == "" {
		data.Price = "an amount its facilitator cannot state right now"
	}
	page := paywallPage
	if style.Template != nil {
		page = style.Template
	}
	var buf bytes.Buffer
	if err := page.Execute(&buf, data); err != nil {
		if style.Template != nil {
			return fmt.Errorf("x402 gate: rendering the paywall template %s: %w", style.TemplateFile, err)
		}
		return fmt.Errorf("x402 gate: rendering the paywall: %w", err)
	}
	h := x.w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(buf.Len()))
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Security-Policy", style.contentSecurityPolicy())
	if len(style.FrameAncestors) == 0 {
		h.Set("X-Frame-Options", "DENY") // for browsers that predate frame-ancestors
	}
	x.w.WriteHeader(http.StatusPaymentRequired)
	_, err = x.w.Write(buf.Bytes())
	return err
}

// SamplePaywallData is data of the shape the page is given, for trying a user's template when it loads.
func SamplePaywallData() PaywallData {
	return PaywallData{Title: "Payment required", Description: "A report", URL: "https://example.com/report", Price: "0.01 USD Coin",
		Header: x402.HeaderPaymentSignature, SignIn: true, JSON: "{}", Chains: "{}", Script: "",
		Rows: []PaywallRow{{Scheme: x402.SchemeExact, Amount: "0.01 USD Coin", Dollars: "$0.01", Network: "eip155:8453",
			Asset: "0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913", Method: x402.TransferEIP3009,
			PayTo: "0x209693Bc6afc0C5328bA36FaF03C514EF312287C", Decimals: 6, Payable: true}}}
}

// ParsePaywallTemplate reads a paywall template of the user's (Go html/template, given PaywallData), naming the
// file and line of an error.
func ParsePaywallTemplate(file string, text []byte) (*template.Template, error) {
	t, err := template.New(file).Parse(string(text))
	if err != nil {
		return nil, fmt.Errorf("paywall template: %w", err)
	}
	return t, nil
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
