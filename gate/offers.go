package gate

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// offer is one requirement the gate offers. For erc2612 the payer signs its permit to one of the facilitator's
// settlement wallets, named in extra.spender; each 402 names the next one of spenders.
type offer struct {
	req      x402.PaymentRequirements
	spenders []string
	// facilitators (upto) are the facilitator addresses a payer may name in its witness; each 402 names the
	// next one, so that payers spread over the settlement wallets.
	facilitators []string
	v1           bool  // version 1 clients may pay it (erc2612 on a network with a version 1 name)
	decimals     uint8 // of the asset, to show the price to people
	// batch: a batch-settlement offer, paid by deposit and voucher (batch.go), never matched as exact or upto.
	batch bool
}

// requirement is the offer as a 402 states it: an erc2612 one names the turn's settlement wallet as spender.
func (o offer) requirement(turn uint64) x402.PaymentRequirements {
	rq := o.req
	if len(o.spenders) > 0 {
		rq.Extra.Spender = o.spenders[turn%uint64(len(o.spenders))]
	}
	if len(o.facilitators) > 0 {
		rq.Extra.FacilitatorAddress = o.facilitators[turn%uint64(len(o.facilitators))]
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
	// sup is the /supported answer the set was built from, nil when none: Config.OffersFor builds the
	// offers of a request from it.
	sup *x402.SupportedResponse
	// version is the embedded facilitator's SupportedVersion when sup was had (see Gate.currentOffers).
	version uint64
}

// methodOrder is the order offers list transfer methods in: clients take the first they can pay. Permit2 works
// with any token; EIP-3009 is what the public clients sign by default; erc2612 comes last, for a client that
// mistakes it for EIP-3009 takes an earlier offer first (x402-wire-facts 4.1).
var methodOrder = [...]string{x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612}

// buildOffers turns the configured ways to pay into requirements. With no /supported answer (sup nil) only
// ways with an explicit transfer method are offered: anything else would be a guess.
func buildOffers(specs []Offer, sup *x402.SupportedResponse, reg *x402.Registry, at time.Time) *offerSet {
	set := &offerSet{known: sup != nil, at: at}
	sponsoring, approvals := false, false
	for _, s := range specs {
		if s.Scheme == x402.SchemeBatchSettlement {
			if o, ok := batchOffer(s, sup); ok {
				set.offers = append(set.offers, o)
			}
			continue
		}
		if s.Scheme == x402.SchemeUpto {
			if o, ok := uptoOffer(s, sup); ok {
				set.offers = append(set.offers, o)
				sponsoring = sponsoring || slices.Contains(sup.Extensions, x402.ExtensionEIP2612GasSponsoring)
				approvals = approvals || slices.Contains(sup.Extensions, x402.ExtensionERC20ApprovalGasSponsoring)
			}
			continue
		}
		for _, m := range methodOrder {
			if s.Method != "" && s.Method != m {
				continue
			}
			kind, supported := sup.Kind(x402.Version2, s.Network, m)
			if !supported && s.Method == "" {
				continue // not known to be supported: offering it would be a guess
			}
			if m == x402.TransferEIP3009 && s.Method == "" && !s.EIP3009 {
				continue // a token not known to implement EIP-3009 cannot be paid so
			}
			o := offer{req: x402.PaymentRequirements{
				Scheme: x402.SchemeExact, Network: s.Network, Amount: s.Amount, Asset: s.Asset, PayTo: s.PayTo,
				MaxTimeoutSeconds: s.MaxTimeoutSeconds,
				Extra:             x402.Extra{AssetTransferMethod: m, Name: s.TokenName, Version: s.TokenVersion},
			}, decimals: s.Decimals}
			switch m {
			case x402.TransferPermit2:
				o.req.Extra.Permit2Address = kind.Extra.Permit2Address
				o.req.Extra.X402Permit2ProxyAddress = kind.Extra.X402Permit2ProxyAddress
				sponsoring = sponsoring || (sup != nil && slices.Contains(sup.Extensions, x402.ExtensionEIP2612GasSponsoring))
				approvals = approvals || (sup != nil && slices.Contains(sup.Extensions, x402.ExtensionERC20ApprovalGasSponsoring))
			case x402.TransferERC2612:
				o.spenders = sup.SignersFor(s.Network)
				if sup != nil && len(o.spenders) == 0 {
					// The permit must name a wallet the facilitator sends from, and it names none (an instance of
					// a cluster holding no wallet's lease right now): no payer could sign this offer.
					continue
				}
				// Version 1 names networks, so only a network with a version 1 name can be offered to it.
				n, known := reg.Lookup(s.Network)
				_, v1Kind := sup.Kind(x402.Version1, s.Network, m)
				o.v1 = known && n.Name != "" && (sup == nil || v1Kind)
			}
			set.offers = append(set.offers, o)
		}
	}
	if sponsoring {
		set.extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: gasSponsoringDeclaration}
	}
	if approvals {
		if set.extensions == nil {
			set.extensions = map[string]json.RawMessage{}
		}
		set.extensions[x402.ExtensionERC20ApprovalGasSponsoring] = approvalSponsoringDeclaration
	}
	return set
}

// uptoOffer is the upto offer of s: permit2 only, and only when the facilitator's /supported says it settles
// upto on the network and names the address a payer's witness must name (without it no payer can sign).
func uptoOffer(s Offer, sup *x402.SupportedResponse) (offer, bool) {
	kind, ok := sup.SchemeKind(x402.Version2, x402.SchemeUpto, s.Network, x402.TransferPermit2)
	if !ok {
		return offer{}, false
	}
	var facilitators []string
	if a := kind.Extra.FacilitatorAddress; x402.IsHexAddress(a) {
		facilitators = append(facilitators, a)
	}
	// Every settlement wallet the facilitator names can settle a payment that names it: spreading payers over
	// them spreads the settlements over the wallets.
	for _, a := range sup.SignersFor(s.Network) {
		if x402.IsHexAddress(a) && !x402.ContainsAddress(facilitators, a) {
			facilitators = append(facilitators, a)
		}
	}
	if len(facilitators) == 0 {
		return offer{}, false
	}
	return offer{req: x402.PaymentRequirements{
		Scheme: x402.SchemeUpto, Network: s.Network, Amount: s.Amount, Asset: s.Asset, PayTo: s.PayTo,
		MaxTimeoutSeconds: s.MaxTimeoutSeconds,
		Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: s.TokenName, Version: s.TokenVersion,
			Permit2Address: kind.Extra.Permit2Address, X402Permit2ProxyAddress: kind.Extra.X402Permit2ProxyAddress},
	}, facilitators: facilitators, decimals: s.Decimals}, true
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

// approvalSponsoringDeclaration declares the erc20ApprovalGasSponsoring extension in a 402, as the public SDK
// does: the facilitator funds and broadcasts a payer's signed approve(Permit2) transaction before the settlement.
var approvalSponsoringDeclaration = func() json.RawMessage {
	addr := map[string]string{"type": "string", "pattern": "^0x[a-fA-F0-9]{40}$"}
	b, err := json.Marshal(map[string]any{
		"info": map[string]string{
			"description": "The facilitator broadcasts a pre-signed ERC-20 approve() transaction to grant Permit2 allowance, paying its gas.",
			"version":     "1",
		},
		"schema": map[string]any{
			"$schema": "https://json-schema.org/draft/2020-12/schema",
			"type":    "object",
			"properties": map[string]any{
				"from": addr, "asset": addr, "spender": addr,
				"amount":            map[string]string{"type": "string", "pattern": "^[0-9]+$"},
				"signedTransaction": map[string]string{"type": "string", "pattern": "^0x[a-fA-F0-9]+$"},
				"version":           map[string]string{"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)*$"},
			},
			"required": []string{"from", "asset", "spender", "amount", "signedTransaction", "version"},
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

// requirements lists the offers' requirements, in order. A batch-settlement offer is listed as a requirement no
// exact or upto payment matches (its scheme), so that indices stay those of the offers.
func (s *offerSet) requirements() []x402.PaymentRequirements {
	out := make([]x402.PaymentRequirements, len(s.offers))
	for i, o := range s.offers {
		out[i] = o.req
	}
	return out
}

// match finds the offer a version 2 payment chose (x402.MatchAccepted) and returns the request the facilitator
// gets: the payload as decoded and the gate's own requirement (spec rule 4).
func (s *offerSet) match(p *x402.PaymentPayload) (x402.VerifyRequest, *offer, *x402.Mismatch) {
	i, m := x402.MatchAccepted(s.requirements(), p)
	if m != nil {
		return x402.VerifyRequest{}, nil, m
	}
	return s.request(*p, s.offers[i]), &s.offers[i], nil
}

// request builds the facilitator request for a payment of offer o. An erc2612 requirement names the wallet the
// payer signed its permit to, when that is one of the facilitator's.
func (s *offerSet) request(p x402.PaymentPayload, o offer) x402.VerifyRequest {
	rq := o.req
	if len(o.facilitators) > 0 {
		// The address the payer's witness names, when it is one of the facilitator's: only that one can settle.
		rq.Extra.FacilitatorAddress = o.facilitators[0]
		if a := p.Payload.Permit2Authorization; a != nil && x402.ContainsAddress(o.facilitators, a.Witness.Facilitator) {
			rq.Extra.FacilitatorAddress = a.Witness.Facilitator
		}
	}
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
func (s *offerSet) matchV1(p *x402.PaymentPayloadV1, reg *x402.Registry, permits x402.PermitSigners) (x402.VerifyRequest, *x402.Mismatch) {
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
		signed := signedFor(permits, o.req, p.Payload)
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

// sameTerms reports whether a requirement is one an Offer offers (scheme, network, asset, recipient, amount and
// method), which is how a journalled payment finds a gate able to settle it.
func (s Offer) sameTerms(rq x402.PaymentRequirements) bool {
	return rq.Scheme == cmp.Or(s.Scheme, x402.SchemeExact) && rq.Network == s.Network && x402.SameAddress(rq.Asset, s.Asset) &&
		x402.SameAddress(rq.PayTo, s.PayTo) && rq.Amount == s.Amount &&
		(s.Method == "" || s.Method == rq.Extra.AssetTransferMethod)
}

// signedFor reports whether an erc2612 payload's signature is its payer's permit under the EIP-712 domain of
// rq's token (name, version, chain and address), as permits recovers it.
func signedFor(permits x402.PermitSigners, rq x402.PaymentRequirements, p x402.ExactEVMPayload) bool {
	if p.Authorization == nil || !common.IsHexAddress(rq.Asset) || !common.IsHexAddress(p.Authorization.From) {
		return false
	}
	signer, err := permits.PermitSigner(rq, p)
	return err == nil && common.IsHexAddress(signer) && common.HexToAddress(signer) == common.HexToAddress(p.Authorization.From)
}
