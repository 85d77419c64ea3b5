package caddymodule

import "github.com/x402-gateway/caddy-x402/x402"

// asset finds the asset the app configures on network: the one at address, or the network's first when
// address is empty. It returns nil when the app does not configure it.
func (a *App) asset(network, address string) *Asset {
	for _, n := range a.Networks {
		if n.Network != network {
			continue
		}
		for _, as := range n.Assets {
			if address == "" || x402.SameAddress(as.Address, address) {
				return as
			}
		}
	}
	return nil
}
