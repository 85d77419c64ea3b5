package caddymodule

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// openProblem says why the route, serving the embedded engine on networks, lets anyone make its settlement
// wallets pay gas, nil when it does not. Every settlement costs gas; a route with no api_key, no pay_to list
// and no min_amount of its own, on a network whose x402 app block has neither, settles a stranger's 1-unit
// payments to themselves, one after another. Such a route is refused unless the operator says it is meant to
// be open (`open`). The dev chain (devNetwork, "" for none) is exempt: its gas is worth nothing.
func (h *FacilitatorHandler) openProblem(networks []*Network, devNetwork string) error {
	if h.Open || len(h.APIKeys) > 0 || len(h.PayTo) > 0 || h.MinAmount != "" {
		return nil
	}
	var open []string
	for _, n := range networks {
		served := len(h.Networks) == 0 || slices.Contains(h.Networks, n.Network)
		if !served || n.Network == devNetwork || len(n.PayTo) > 0 || n.MinAmount != "" {
			continue
		}
		open = append(open, n.Network)
	}
	if len(open) == 0 {
		return nil
	}
	return fmt.Errorf("x402_facilitator would let anyone make its settlement wallets pay gas on %s: with no api_key, no pay_to "+
		"and no min_amount, a stranger can sign 1-unit payments to themselves and have each one settled; close the route "+
		"with api_key <key> (only callers holding the key), pay_to <address> [...] (only payments to your sellers) or "+
		"min_amount <raw units> (only payments worth their gas), on the route or in the x402 app's network block, or "+
		"write open if anyone is meant to use it", strings.Join(open, ", "))
}

// servesEmbedded reports whether the route serves the x402 app's engine: no upstreams, and no facilitator
// module but embedded.
func (h *FacilitatorHandler) servesEmbedded() bool {
	if len(h.Upstreams) > 0 {
		return false
	}
	if len(h.FacilitatorRaw) == 0 {
		return true
	}
	var m struct {
		Source string `json:"source"`
	}
	return json.Unmarshal(h.FacilitatorRaw, &m) == nil && m.Source == "embedded"
}

// openProblemOfCaddyfile is openProblem as the Caddyfile's x402 global option (option, from
// httpcaddyfile.Helper.Option) configures the app, so that the error can name the route's line; Provision
// checks again, for JSON configs.
func (h *FacilitatorHandler) openProblemOfCaddyfile(option any) error {
	global, ok := option.(httpcaddyfile.App)
	if !ok || !h.servesEmbedded() {
		return nil
	}
	var app App
	if err := json.Unmarshal(global.Value, &app); err != nil {
		return nil // Provision says what is wrong with it
	}
	dev := ""
	if app.DevChain != nil {
		id := app.DevChain.ChainID
		if id == 0 {
			id = devchain.DefaultChainID
		}
		dev = x402.EIP155(id)
		// A network block of the dev chain's id takes the dev chain's place (App.planDevChain).
		if slices.ContainsFunc(app.Networks, func(n *Network) bool { return n.Network == dev }) {
			dev = ""
		}
	}
	return h.openProblem(app.Networks, dev)
}
