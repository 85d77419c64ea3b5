package caddymodule

import (
	"cmp"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// resolveOffers applies defaults and inheritance to the gate's own way to pay and its accept blocks. The
// gate's own comes first; it is left out only when accept blocks name every network and the gate has none
// to default to. A way to pay that repeats an earlier one is dropped.
func (g *Gate) resolveOffers(app *App, repl *caddy.Replacer) ([]gate.Offer, error) {
	var list []*GateAccept
	if len(g.Accepts) == 0 || g.Network != "" || len(app.Networks) > 0 {
		list = append(list, &GateAccept{})
	}
	list = append(list, g.Accepts...)
	var specs []gate.Offer
	for i, a := range list {
		s, err := g.resolveOffer(app, repl, a)
		if err != nil {
			if len(list) > 1 {
				return nil, fmt.Errorf("way to pay #%d: %w", i+1, err)
			}
			return nil, err
		}
		if !slices.Contains(specs, s) {
			specs = append(specs, s)
		}
	}
	return specs, nil
}

func (g *Gate) resolveOffer(app *App, repl *caddy.Replacer, a *GateAccept) (gate.Offer, error) {
	pick := func(own, inherited string) string {
		if own != "" {
			return strings.TrimSpace(repl.ReplaceAll(own, ""))
		}
		return strings.TrimSpace(repl.ReplaceAll(inherited, ""))
	}
	s := gate.Offer{
		Network: pick(a.Network, g.Network), Asset: pick(a.Asset, g.Asset), PayTo: pick(a.PayTo, g.PayTo),
		Method: pick(a.AssetTransferMethod, g.AssetTransferMethod), TokenName: pick(a.TokenName, g.TokenName),
		TokenVersion: pick(a.TokenVersion, g.TokenVersion), Decimals: x402.DefaultTokenDecimals,
		EIP3009: a.TokenEIP3009 || g.TokenEIP3009, Scheme: pick(a.Scheme, g.Scheme),
	}
	switch s.Scheme {
	case "", x402.SchemeExact:
		s.Scheme = x402.SchemeExact
	case x402.SchemeUpto:
		if s.Method != "" && s.Method != x402.TransferPermit2 {
			return s, fmt.Errorf("scheme upto is paid by permit2 only, not asset_transfer_method %s", s.Method)
		}
	case "batch", x402.SchemeBatchSettlement:
		s.Scheme = x402.SchemeBatchSettlement
		if s.Method != "" && s.Method != x402.TransferEIP3009 {
			return s, fmt.Errorf("scheme batch is paid by deposits by eip3009 only, not asset_transfer_method %s", s.Method)
		}
	default:
		return s, fmt.Errorf("scheme %q is not supported; want %s, %s or batch", s.Scheme, x402.SchemeExact, x402.SchemeUpto)
	}
	if s.Network == "" {
		if len(app.Networks) == 0 {
			return s, errors.New("no network: set `network <caip2>`, or configure one in the x402 global option")
		}
		s.Network = app.Networks[0].Network
	}
	if _, err := x402.ChainID(s.Network); err != nil {
		return s, fmt.Errorf("network: %w", err)
	}
	appAsset := app.asset(s.Network, s.Asset)
	if s.Asset == "" {
		if appAsset == nil {
			return s, fmt.Errorf("no asset for %s: set `asset <token address>`, or configure the network with an asset in the x402 global option", s.Network)
		}
		s.Asset = appAsset.Address
	}
	if err := addressProblem("asset", s.Asset); err != nil {
		return s, err
	}
	if appAsset != nil {
		if appAsset.Decimals != 0 { // 0 means the default, 6
			s.Decimals = appAsset.Decimals
		}
		s.TokenName = cmp.Or(s.TokenName, appAsset.Name)
		s.TokenVersion = cmp.Or(s.TokenVersion, appAsset.Version)
		s.EIP3009 = s.EIP3009 || appAsset.EIP3009
	}
	s.TokenName = cmp.Or(s.TokenName, x402.DefaultTokenName)
	s.TokenVersion = cmp.Or(s.TokenVersion, x402.DefaultTokenVersion)
	if s.PayTo == "" {
		return s, errors.New("no recipient: set `pay_to <address>`")
	}
	if err := addressProblem("pay_to", s.PayTo); err != nil {
		return s, err
	}
	if x402.SameAddress(s.PayTo, zeroAddress) {
		return s, errZeroPayTo
	}
	switch s.Method {
	case "", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612:
	default:
		return s, fmt.Errorf("asset_transfer_method %q is not supported; want %s, %s or %s", s.Method, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	}
	amount, price := a.Amount, a.Price
	if amount == "" && price == "" {
		amount, price = g.Amount, g.Price
	}
	n, err := parseCost(amount, price, s.Decimals)
	if err != nil {
		return s, err
	}
	s.Amount = n.String()
	timeout := time.Duration(a.MaxTimeout)
	if timeout == 0 {
		timeout = time.Duration(g.MaxTimeout)
	}
	if timeout == 0 {
		timeout = defaultMaxTimeout
	}
	if timeout < time.Second {
		return s, fmt.Errorf("max_timeout %s is shorter than a second; a payer needs time to sign and send", timeout)
	}
	s.MaxTimeoutSeconds = int64(timeout / time.Second)
	return s, nil
}

// parseCost reads exactly one of a raw amount and a dollar price as a positive number of raw units.
func parseCost(amount, price string, decimals uint8) (*big.Int, error) {
	var n *big.Int
	var err error
	switch {
	case amount != "" && price != "":
		return nil, fmt.Errorf("both amount %q and price %q are set; give one", amount, price)
	case amount != "":
		if n, err = x402.ParseAmount(amount); err != nil {
			return nil, err // it names the amount
		}
	case price != "":
		if n, err = x402.ParsePrice(price, decimals); err != nil {
			return nil, err
		}
	default:
		return nil, errors.New("no price: set `price <dollars>` (such as $0.01) or `amount <raw token units>`")
	}
	if n.Sign() == 0 {
		return nil, errZeroPrice
	}
	return n, nil
}
