package caddymodule

import (
	"cmp"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// This file holds the checks of configured values that a Caddyfile option and Provision share: the Caddyfile
// runs them as it reads an option, so that its error names the file and line (a JSON config has none, and hears
// of them from Provision in the same words).

// errZeroPrice refuses a price or amount of nothing.
var errZeroPrice = errors.New("the price is zero; a free resource needs no gate (and the settlement contract refuses zero)")

// addressProblem says why v cannot be the address option names, nil when it can: 0x and 40 hex digits, in one
// case or in EIP-55 mixed case whose checksum holds.
func addressProblem(option, v string) error {
	if err := x402.CheckAddress(v); err != nil {
		return fmt.Errorf("%s %w", option, err)
	}
	return nil
}

// gateValueProblem checks, as Provision will, the value of a gate option that takes a price, an amount, an
// address or a network, as far as it can be checked without the x402 app: a price's precision needs the token's
// decimals, and is checked at Provision. A value holding placeholders is checked once they are replaced.
func gateValueProblem(option, v string) error {
	if hasPlaceholder(v) {
		return nil
	}
	switch option {
	case "price":
		zero, err := x402.CheckPrice(v)
		if err != nil {
			return err
		}
		if zero {
			return errZeroPrice
		}
	case "amount":
		_, err := parseCost(v, "", 0)
		return err
	case "pay_to":
		if err := addressProblem(option, v); err != nil {
			return err
		}
		if x402.SameAddress(v, zeroAddress) {
			return errZeroPayTo
		}
	case "asset":
		return addressProblem(option, v)
	case "network":
		if _, err := x402.ChainID(v); err != nil {
			return fmt.Errorf("network: %w", err)
		}
	}
	return nil
}

// zeroAddress is the address no token transfers to.
const zeroAddress = "0x0000000000000000000000000000000000000000"

// errZeroPayTo refuses a gate's pay_to of the zero address: the payer's signature would pass, and the settlement
// revert after the response was served.
var errZeroPayTo = errors.New("pay_to is the zero address: tokens refuse transfers to it")

// walletKeysProblem checks the form of wallet keys without a chain: value is a list of hex keys (commas, spaces or
// new lines between them), and source says where it came from as the operator wrote it (a placeholder such as
// {env.X402_WALLET_KEYS}, or the entry's position). The error names the source and the key's position, never a
// key or any part of one.
func walletKeysProblem(source, value string) error {
	if strings.TrimSpace(value) == "" {
		return fmt.Errorf("wallet_keys: %s is empty; is the environment variable set?", source)
	}
	if _, err := chain.ParsePrivateKeys(value); err != nil {
		return fmt.Errorf("wallet_keys: %s: %w", source, err)
	}
	return nil
}

// receiverAuthorizerKeyProblem checks the form of a batch-settlement receiver authorizer key without a chain: value
// is one hex key, entry the option as the operator wrote it, named in the error when it is a placeholder (which
// holds no secret). The error never holds the key or any part of it.
func receiverAuthorizerKeyProblem(entry, value string) error {
	source := "the key written out"
	if hasPlaceholder(entry) {
		source = entry
	}
	if strings.TrimSpace(value) == "" {
		return fmt.Errorf("batch: receiver_authorizer_key: %s is empty; is the environment variable set?", source)
	}
	if _, err := receiverAuthorizerKey(value); err != nil {
		return fmt.Errorf("batch: receiver_authorizer_key: %s: %w", source, err)
	}
	return nil
}

// receiverAuthorizerKey parses value as exactly one hex private key.
func receiverAuthorizerKey(value string) (*ecdsa.PrivateKey, error) {
	keys, err := chain.ParsePrivateKeys(value)
	if err != nil {
		return nil, err
	}
	if len(keys) != 1 {
		return nil, fmt.Errorf("want one key, got %d", len(keys))
	}
	return keys[0], nil
}

// claimAmountValue parses a batch-settlement claim_amount: a positive whole number of raw token units.
func claimAmountValue(v string) (*big.Int, error) {
	amount, ok := new(big.Int).SetString(v, 10)
	if !ok || amount.Sign() <= 0 {
		return nil, fmt.Errorf("batch: claim_amount %q: want a positive whole number of raw token units, such as 1000000", v)
	}
	return amount, nil
}

// isBatchScheme reports whether a route's scheme names batch-settlement: "batch", or the scheme's own name.
func isBatchScheme(s string) bool { return s == "batch" || s == x402.SchemeBatchSettlement }

// placeholderPattern matches one placeholder, such as {env.X402_WALLET_KEYS}.
var placeholderPattern = regexp.MustCompile(`\{[^{}]*\}`)

// walletKeysSource names a wallet_keys entry in errors: its placeholders as written, which hold no secret, or
// its position among the entries when it is a key written out.
func walletKeysSource(entry string, i, n int) string {
	if hasPlaceholder(entry) && strings.Trim(placeholderPattern.ReplaceAllString(entry, ""), ", \t\r\n") == "" {
		return entry
	}
	if n == 1 {
		return "the keys written out"
	}
	return fmt.Sprintf("entry %d of %d", i+1, n)
}

// pricePrecisionOfCaddyfile checks each price the gate's Caddyfile writes out against the decimals of the token
// it will be paid in, as the Caddyfile's x402 global option (option, from httpcaddyfile.Helper.Option) configures
// the app, so that a price finer than its token ("$0.0000001" of a 6-decimal token) is refused at its line. It
// follows resolveOffers' inheritance; anything it cannot tell from the Caddyfile (a placeholder, an app that does
// not plan) it leaves to Provision, which checks every price again.
func (g *Gate) pricePrecisionOfCaddyfile(option any) error {
	var app App
	if global, ok := option.(httpcaddyfile.App); ok {
		if json.Unmarshal(global.Value, &app) != nil {
			return nil
		}
	}
	if app.DevChain != nil && app.planDevChain() != nil {
		return nil
	}
	for i := 0; i <= len(g.Accepts); i++ {
		if i == 0 && len(g.Accepts) > 0 && g.Network == "" && len(app.Networks) == 0 {
			continue // resolveOffers leaves the gate's own way out
		}
		way := g.way(i)
		price, at := way.Price, way.priceAt
		if price == "" && way.Amount == "" {
			price, at = g.Price, g.priceAt
		}
		network, asset := cmp.Or(way.Network, g.Network), cmp.Or(way.Asset, g.Asset)
		if network == "" && len(app.Networks) > 0 {
			network = app.Networks[0].Network
		}
		if price == "" || at == nil || hasPlaceholder(price) || hasPlaceholder(network) || hasPlaceholder(asset) {
			continue
		}
		decimals := uint8(x402.DefaultTokenDecimals)
		if as := app.asset(network, asset); as != nil && as.Decimals != 0 {
			decimals = as.Decimals
		}
		if _, err := x402.ParsePrice(price, decimals); err != nil {
			return at.Err(err.Error())
		}
	}
	return nil
}
