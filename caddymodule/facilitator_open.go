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
	if err := h.batchKeyProblem(networks, devNetwork); err != nil {
		return err
	}
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

// batchKeyProblem says why the route, serving the embedded engine on networks, lets anyone have it sign with a
// batch-settlement receiver authorizer's key, nil when it does not. The engine signs the claims and refunds a
// /settle action names with the key it holds: a payer could have its channel's rest refunded without the claim of
// the vouchers the seller's server holds, and anyone could claim or settle the receiver's channels when they
// please. Only callers holding an api_key may reach such a route; open, pay_to and min_amount do not make it safe.
// The dev chain (devNetwork, or the dev chain's default id, which no network of value uses) is exempt.
func (h *FacilitatorHandler) batchKeyProblem(networks []*Network, devNetwork string) error {
	if len(h.APIKeys) > 0 {
		return nil
	}
	var keyed []string
	for _, n := range networks {
		served := len(h.Networks) == 0 || slices.Contains(h.Networks, n.Network)
		if !served || n.Batch == nil || n.Batch.ReceiverAuthorizerKey == "" || n.Network == devNetwork || n.Network == x402.EIP155(devchain.DefaultChainID) {
			continue
		}
		keyed = append(keyed, n.Network)
	}
	if len(keyed) == 0 {
		return nil
	}
	return fmt.Errorf("x402_facilitator would sign batch-settlement claims and refunds for anyone on %s: the network's batch block holds "+
		"the receiver_authorizer_key, and the route has no api_key; close the route with api_key <key>, held by the seller's resource "+
		"servers only (open, pay_to and min_amount do not keep a caller from having the key sign a refund or a claim), or serve "+
		"the batch scheme from the gate's own batch routes", strings.Join(keyed, ", "))
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
