package caddymodule

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// offerSpec is one configured way to pay with every default applied; the transfer method may still be open.
type offerSpec struct {
	network, asset, payTo, amount string
	tokenName, tokenVersion       string
	decimals                      uint8
	eip3009                       bool   // the token implements EIP-3009
	method                        string // "" = every method the facilitator supports
	maxTimeout                    int64  // seconds
}

// resolveOffers applies defaults and inheritance to the gate's own way to pay and its accept blocks. The
// gate's own comes first; it is left out only when accept blocks name every network and the gate has none
// to default to. A way to pay that repeats an earlier one is dropped.
func (g *Gate) resolveOffers(app *App, repl *caddy.Replacer) ([]offerSpec, error) {
	var list []*GateAccept
	if len(g.Accepts) == 0 || g.Network != "" || len(app.Networks) > 0 {
		list = append(list, &GateAccept{})
	}
	list = append(list, g.Accepts...)
	var specs []offerSpec
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

func (g *Gate) resolveOffer(app *App, repl *caddy.Replacer, a *GateAccept) (offerSpec, error) {
	pick := func(own, inherited string) string {
		if own != "" {
			return strings.TrimSpace(repl.ReplaceAll(own, ""))
		}
		return strings.TrimSpace(repl.ReplaceAll(inherited, ""))
	}
	s := offerSpec{
		network: pick(a.Network, g.Network), asset: pick(a.Asset, g.Asset), payTo: pick(a.PayTo, g.PayTo),
		method: pick(a.AssetTransferMethod, g.AssetTransferMethod), tokenName: pick(a.TokenName, g.TokenName),
		tokenVersion: pick(a.TokenVersion, g.TokenVersion), decimals: x402.DefaultTokenDecimals,
		eip3009: a.TokenEIP3009 || g.TokenEIP3009,
	}
	if s.network == "" {
		if len(app.Networks) == 0 {
			return s, errors.New("no network: set `network <caip2>`, or configure one in the x402 global option")
		}
		s.network = app.Networks[0].Network
	}
	if _, err := x402.ChainID(s.network); err != nil {
		return s, fmt.Errorf("network: %w", err)
	}
	appAsset := app.asset(s.network, s.asset)
	if s.asset == "" {
		if appAsset == nil {
			return s, fmt.Errorf("no asset for %s: set `asset <token address>`, or configure the network with an asset in the x402 global option", s.network)
		}
		s.asset = appAsset.Address
	}
	if !x402.IsHexAddress(s.asset) {
		return s, fmt.Errorf("asset %q is not an address (0x and 40 hex digits)", s.asset)
	}
	if appAsset != nil {
		if appAsset.Decimals != 0 { // 0 means the default, 6
			s.decimals = appAsset.Decimals
		}
		s.tokenName = cmp.Or(s.tokenName, appAsset.Name)
		s.tokenVersion = cmp.Or(s.tokenVersion, appAsset.Version)
		s.eip3009 = s.eip3009 || appAsset.EIP3009
	}
	s.tokenName = cmp.Or(s.tokenName, x402.DefaultTokenName)
	s.tokenVersion = cmp.Or(s.tokenVersion, x402.DefaultTokenVersion)
	if !x402.IsHexAddress(s.payTo) {
		if s.payTo == "" {
			return s, errors.New("no recipient: set `pay_to <address>`")
		}
		return s, fmt.Errorf("pay_to %q is not an address (0x and 40 hex digits)", s.payTo)
	}
	switch s.method {
	case "", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612:
	default:
		return s, fmt.Errorf("asset_transfer_method %q is not supported; want %s, %s or %s", s.method, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	}
	amount, price := a.Amount, a.Price
	if amount == "" && price == "" {
		amount, price = g.Amount, g.Price
	}
	n, err := parseCost(amount, price, s.decimals)
	if err != nil {
		return s, err
	}
	s.amount = n.String()
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
	s.maxTimeout = int64(timeout / time.Second)
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
			return nil, fmt.Errorf("amount: %w", err)
		}
	case price != "":
		if n, err = x402.ParsePrice(price, decimals); err != nil {
			return nil, err
		}
	default:
		return nil, errors.New("no price: set `price <dollars>` (such as $0.01) or `amount <raw token units>`")
	}
	if n.Sign() == 0 {
		return nil, errors.New("the price is zero; a free resource needs no gate (and the settlement contract refuses zero)")
	}
	return n, nil
}

// offer is one requirement the gate offers. For erc2612 the payer signs its permit to one of the facilitator's
// settlement wallets, named in extra.spender; each 402 names the next one of spenders.
type offer struct {
	req      x402.PaymentRequirements
	spenders []string
	v1       bool  // version 1 clients may pay it (erc2612 on a network with a version 1 name)
	decimals uint8 // of the asset, to show the price to people
}

// requirement is the offer as a 402 states it: an erc2612 one names the turn's settlement wallet as spender.
func (o offer) requirement(turn uint64) x402.PaymentRequirements {
	rq := o.req
	if len(o.spenders) > 0 {
		rq.Extra.Spender = o.spenders[turn%uint64(len(o.spenders))]
	}
	return rq
}

// offerSet is what a gate offers at one time: its requirements in order and the extensions it declares.
type offerSet struct {
	offers     []offer
	extensions map[string]json.RawMessage
	known      bool      // built from the facilitator's /supported answer
	at         time.Time // when that answer was had
	failedAt   time.Time // when asking for it last failed
}

// methodOrder is the order offers list transfer methods in: clients take the first they can pay. Permit2 works
// with any token; EIP-3009 is what the public clients sign by default; erc2612 comes last, for a client that
// mistakes it for EIP-3009 takes an earlier offer first (x402-wire-facts 4.1).
var methodOrder = [...]string{x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612}

// buildOffers turns the configured ways to pay into requirements. With no /supported answer (sup nil) only
// ways with an explicit transfer method are offered: anything else would be a guess.
func buildOffers(specs []offerSpec, sup *x402.SupportedResponse, reg *x402.Registry, at time.Time) *offerSet {
	set := &offerSet{known: sup != nil, at: at}
	sponsoring := false
	for _, s := range specs {
		for _, m := range methodOrder {
			if s.method != "" && s.method != m {
				continue
			}
			kind, supported := sup.Kind(x402.Version2, s.network, m)
			if !supported && s.method == "" {
				continue // not known to be supported: offering it would be a guess
			}
			if m == x402.TransferEIP3009 && s.method == "" && !s.eip3009 {
				continue // a token not known to implement EIP-3009 cannot be paid so
			}
			o := offer{req: x402.PaymentRequirements{
				Scheme: x402.SchemeExact, Network: s.network, Amount: s.amount, Asset: s.asset, PayTo: s.payTo,
				MaxTimeoutSeconds: s.maxTimeout,
				Extra:             x402.Extra{AssetTransferMethod: m, Name: s.tokenName, Version: s.tokenVersion},
			}, decimals: s.decimals}
			switch m {
			case x402.TransferPermit2:
				o.req.Extra.Permit2Address = kind.Extra.Permit2Address
				o.req.Extra.X402Permit2ProxyAddress = kind.Extra.X402Permit2ProxyAddress
				sponsoring = sponsoring || (sup != nil && slices.Contains(sup.Extensions, x402.ExtensionEIP2612GasSponsoring))
			case x402.TransferERC2612:
				o.spenders = sup.SignersFor(s.network)
				// Version 1 names networks, so only a network with a version 1 name can be offered to it.
				n, known := reg.Lookup(s.network)
				_, v1Kind := sup.Kind(x402.Version1, s.network, m)
				o.v1 = known && n.Name != "" && (sup == nil || v1Kind)
			}
			set.offers = append(set.offers, o)
		}
	}
	if sponsoring {
		set.extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: gasSponsoringDeclaration}
	}
	return set
}

// gasSponsoringDeclaration declares the eip2612GasSponsoring extension in a 402 (x402-wire-facts 4.3): what the
// facilitator offers, and the schema of the info a payer without a Permit2 allowance adds to its payment.
var gasSponsoringDeclaration = func() json.RawMessage {
	addr := map[string]string{"type": "string", "pattern": "^0x[a-fA-F0-9]{40}$"}
	num := map[string]string{"type": "string", "pattern": "^[0-9]+$"}
	b, err := json.Marshal(map[string]any{
		"info": map[string]string{
			"description": "The facilitator pays the gas of a payer's one-time Permit2 approval, given the payer's EIP-2612 permit to the canonical Permit2 contract.",
			"version":     "1",
		},
		"schema": map[string]any{
			"$schema": "https://json-schema.org/draft/2020-12/schema",
			"type":    "object",
			"properties": map[string]any{
				"from": addr, "asset": addr, "spender": addr, "amount": num, "nonce": num, "deadline": num,
				"signature": map[string]string{"type": "string", "pattern": "^0x[a-fA-F0-9]+$"},
				"version":   map[string]string{"type": "string"},
			},
			"required": []string{"from", "asset", "spender", "amount", "nonce", "deadline", "signature", "version"},
		},
	})
	if err != nil {
		panic(err) // a constant document
	}
	return b
}()

// paymentRequired is the 402 offer for a resource. Each erc2612 requirement names the next settlement wallet,
// so that payers spread over the facilitator's wallets.
func (s *offerSet) paymentRequired(resource x402.ResourceInfo, errText string, turn uint64) x402.PaymentRequired {
	pr := x402.PaymentRequired{X402Version: x402.Version2, Error: errText, Resource: resource,
		Accepts: make([]x402.PaymentRequirements, 0, len(s.offers)), Extensions: s.extensions}
	for _, o := range s.offers {
		pr.Accepts = append(pr.Accepts, o.requirement(turn))
	}
	return pr
}

// paymentRequiredV1 is the version 1 body of the same offer: only what version 1 clients can pay.
func (s *offerSet) paymentRequiredV1(reg *x402.Registry, resource x402.ResourceInfo, errText string, turn uint64) x402.PaymentRequiredV1 {
	out := x402.PaymentRequiredV1{X402Version: x402.Version1, Error: errText, Accepts: []x402.PaymentRequirementsV1{}}
	for _, o := range s.offers {
		if !o.v1 {
			continue
		}
		v1, err := reg.RequirementsToV1(o.requirement(turn), resource)
		if err != nil {
			continue // offers are only marked v1 on networks with a version 1 name
		}
		out.Accepts = append(out.Accepts, v1)
	}
	return out
}

// requirements lists the offers' requirements, in order.
func (s *offerSet) requirements() []x402.PaymentRequirements {
	out := make([]x402.PaymentRequirements, len(s.offers))
	for i, o := range s.offers {
		out[i] = o.req
	}
	return out
}

// match finds the offer a version 2 payment chose (x402.MatchAccepted) and returns the request the facilitator
// gets: the payload as decoded and the gate's own requirement (spec rule 4).
func (s *offerSet) match(p *x402.PaymentPayload) (x402.VerifyRequest, *x402.Mismatch) {
	i, m := x402.MatchAccepted(s.requirements(), p)
	if m != nil {
		return x402.VerifyRequest{}, m
	}
	return s.request(*p, s.offers[i]), nil
}

// request builds the facilitator request for a payment of offer o. An erc2612 requirement names the wallet the
// payer signed its permit to, when that is one of the facilitator's.
func (s *offerSet) request(p x402.PaymentPayload, o offer) x402.VerifyRequest {
	rq := o.req
	if len(o.spenders) > 0 {
		rq.Extra.Spender = o.spenders[0]
		for _, candidate := range []string{p.Accepted.Extra.Spender, authorizationSpender(p.Payload)} {
			if x402.ContainsAddress(o.spenders, candidate) {
				rq.Extra.Spender = candidate
				break
			}
		}
	}
	return x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: rq}
}

func authorizationSpender(p x402.ExactEVMPayload) string {
	if p.Authorization != nil {
		return p.Authorization.To
	}
	return ""
}

// matchV1 finds the offer a version 1 payment pays: version 1 names only scheme and network, and pays only
// erc2612. Among several erc2612 offers on the network the one whose amount the permit carries is taken.
func (s *offerSet) matchV1(p *x402.PaymentPayloadV1, reg *x402.Registry) (x402.VerifyRequest, *x402.Mismatch) {
	network, err := reg.CAIP2(p.Network)
	if err != nil {
		return x402.VerifyRequest{}, &x402.Mismatch{Reason: x402.ReasonInvalidNetwork, Message: fmt.Sprintf("version 1 network %q is not known here: %v", p.Network, err)}
	}
	if p.Payload.Authorization == nil {
		return x402.VerifyRequest{}, &x402.Mismatch{Reason: x402.ReasonInvalidPayload, Message: "a version 1 payment must carry an erc2612 payload.authorization; permit2 needs version 2 (PAYMENT-SIGNATURE)"}
	}
	// The permit names no token: the offer whose token's EIP-712 domain the signature recovers to the payer
	// under is the one it pays; among several (or none), the one whose amount it carries.
	var chosen *offer
	chosenSigned := false
	for i := range s.offers {
		o := &s.offers[i]
		if !o.v1 || o.req.Scheme != p.Scheme || o.req.Network != network {
			continue
		}
		signed := signedFor(o.req, p.Payload)
		better := chosen == nil || (signed && !chosenSigned) ||
			(signed == chosenSigned && o.req.Amount == p.Payload.Authorization.Value && chosen.req.Amount != p.Payload.Authorization.Value)
		if better {
			chosen, chosenSigned = o, signed
		}
	}
	if chosen == nil {
		m := x402.ExplainUnoffered(s.requirements(), p.Scheme, network, x402.TransferERC2612)
		m.Message += " (version 1 clients pay erc2612 only)"
		return x402.VerifyRequest{}, m
	}
	v2, err := reg.PaymentPayloadFromV1(*p, chosen.req)
	if err != nil {
		return x402.VerifyRequest{}, &x402.Mismatch{Reason: x402.ReasonInvalidPayload, Message: err.Error()}
	}
	return s.request(v2, *chosen), nil
}

// sameTerms reports whether a requirement is one a spec offers (scheme, network, asset, recipient, amount and
// method), which is how a journalled payment finds a gate able to settle it.
func (s offerSpec) sameTerms(rq x402.PaymentRequirements) bool {
	return rq.Scheme == x402.SchemeExact && rq.Network == s.network && x402.SameAddress(rq.Asset, s.asset) &&
		x402.SameAddress(rq.PayTo, s.payTo) && rq.Amount == s.amount &&
		(s.method == "" || s.method == rq.Extra.AssetTransferMethod)
}

// signedFor reports whether an erc2612 payload's signature is its payer's permit under the EIP-712 domain of
// rq's token (name, version, chain and address).
func signedFor(rq x402.PaymentRequirements, p x402.ExactEVMPayload) bool {
	if p.Authorization == nil || !common.IsHexAddress(rq.Asset) || !common.IsHexAddress(p.Authorization.From) {
		return false
	}
	chainID, err := x402.ChainID(rq.Network)
	if err != nil {
		return false
	}
	permit, err := chain.PermitFromAuthorization(p.Authorization)
	if err != nil {
		return false
	}
	sig, err := chain.ParseSignature(p.Signature)
	if err != nil {
		return false
	}
	domain := chain.PermitDomainSeparator(rq.Extra.Name, rq.Extra.Version, new(big.Int).SetUint64(chainID), common.HexToAddress(rq.Asset))
	signer, err := chain.RecoverSigner(chain.PermitDigest(domain, permit), sig)
	return err == nil && signer == common.HexToAddress(p.Authorization.From)
}
