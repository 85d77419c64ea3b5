package payer

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Options configures a Payer. The zero value pays by any method it can sign without a chain, at the wall
// clock.
type Options struct {
	// RPC is a JSON-RPC URL of the chain the payments settle on; "" for none. With it, payments are signed at
	// the later of chain time and Now (see chainReader.now), a permit2 payer that has not approved Permit2
	// adds eip2612GasSponsoring, and erc2612 can be paid (it signs the token's nonces(payer)). It is dialed
	// when a payment first needs it.
	RPC string
	// Method restricts payments to one asset transfer method: permit2, eip3009 or erc2612. "" pays the first
	// payable requirement, permit2 before the others.
	Method string
	// Now is the signing clock (with an RPC, unless the head block is later); nil is the wall clock.
	Now func() time.Time
}

// Payer signs x402 payments with one private key. It is safe for concurrent use.
type Payer struct {
	key     *ecdsa.PrivateKey
	address common.Address
	opts    Options

	mu  sync.Mutex
	rpc *chainReader // dialed on first use
}

// New returns a Payer that signs with key.
func New(key *ecdsa.PrivateKey, opts Options) (*Payer, error) {
	if key == nil {
		return nil, errors.New("payer: no private key")
	}
	switch opts.Method {
	case "", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612:
	default:
		return nil, fmt.Errorf("payer: method: expected %s, %s or %s, got %q", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612, opts.Method)
	}
	if opts.Method == x402.TransferERC2612 && opts.RPC == "" {
		return nil, errors.New("payer: method erc2612 needs an RPC URL: an EIP-2612 permit signs the token's nonces(payer), which only the chain knows")
	}
	return &Payer{key: key, address: crypto.PubkeyToAddress(key.PublicKey), opts: opts}, nil
}

// Address is the payer's address, which the payments come from.
func (p *Payer) Address() common.Address { return p.address }

// String names the payer by its address, so that printing a Payer never prints its key.
func (p *Payer) String() string { return "payer " + p.address.Hex() }

// GoString is String, for %#v.
func (p *Payer) GoString() string { return p.String() }

// Close closes the RPC connection, if one was made. The Payer dials again if it is used after Close.
func (p *Payer) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rpc != nil {
		p.rpc.close()
		p.rpc = nil
	}
	return nil
}

// chain returns the RPC reader, dialing it on first use; nil when the Payer has no RPC.
func (p *Payer) chain(ctx context.Context) (*chainReader, error) {
	if p.opts.RPC == "" {
		return nil, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rpc == nil {
		c, err := dialChain(ctx, p.opts.RPC)
		if err != nil {
			return nil, err
		}
		p.rpc = c
	}
	return p.rpc, nil
}

// Payment is a signed payment for one requirement of an offer, ready to send.
type Payment struct {
	// Index is the place of the requirement paid in the offer's accepts.
	Index int
	// Requirements is the requirement paid, as the server offered it.
	Requirements x402.PaymentRequirements
	// Method is how it is paid: permit2, eip3009 or erc2612.
	Method string
	// Payload is the signed payment, in version 2 form.
	Payload x402.PaymentPayload
	// Header names the request header that carries the payment: PAYMENT-SIGNATURE, or X-PAYMENT for a
	// version 1 server.
	Header string
	// Value is that header's value.
	Value string
	// AllowanceChecked says the payer's Permit2 allowance was read from the chain (permit2 with an RPC only).
	AllowanceChecked bool
	// GasSponsored says the payment carries the eip2612GasSponsoring permit, because the payer has not
	// approved Permit2 for the amount.
	GasSponsored bool
	// SponsoringDeclared says the server declared eip2612GasSponsoring in its offer; the payment echoes that
	// declaration.
	SponsoringDeclared bool
}

// Choose returns the index in offer.Required.Accepts of the requirement the payer would pay: of those it can
// pay (scheme exact on an EVM chain, the method of Options, the chain the RPC serves), the first permit2 one,
// else the first other one in the server's order. permit2 comes first because it needs no RPC and, with gas
// sponsoring, no approval by the payer. When none can be paid, the error says why for each.
func (p *Payer) Choose(ctx context.Context, offer Offer) (int, error) {
	rpc, err := p.chain(ctx)
	if err != nil {
		return 0, err
	}
	return choose(offer, p.opts.Method, rpc, nil)
}

// Pay chooses a requirement of offer and signs its payment. It checks no spending limit: Transport does.
func (p *Payer) Pay(ctx context.Context, offer Offer) (Payment, error) {
	i, err := p.Choose(ctx, offer)
	if err != nil {
		return Payment{}, err
	}
	return p.Sign(ctx, offer, i)
}

// Sign signs the payment of offer.Required.Accepts[i] and encodes it for the server. With an RPC, it signs
// at chain time and adds gas sponsoring to a permit2 payment whose payer has not approved Permit2 enough;
// without one, at the clock of Options and without that check. It checks no spending limit: Transport does.
func (p *Payer) Sign(ctx context.Context, offer Offer, i int) (Payment, error) {
	if i < 0 || i >= len(offer.Required.Accepts) {
		return Payment{}, fmt.Errorf("payer: no requirement %d: the offer has %d", i, len(offer.Required.Accepts))
	}
	rpc, err := p.chain(ctx)
	if err != nil {
		return Payment{}, err
	}
	req := offer.Required.Accepts[i]
	pay := Payment{Index: i, Requirements: req, Method: TransferMethod(req)}
	if pay.Payload, err = p.sign(ctx, rpc, offer, req, &pay); err != nil {
		return Payment{}, err
	}
	if pay.Header, pay.Value, err = encodePayment(offer, i, pay.Payload); err != nil {
		return Payment{}, fmt.Errorf("encoding the payment: %w", err)
	}
	return pay, nil
}

// choose picks the requirement to pay, as Choose says. allow, when not nil, refuses requirements the payer
// could pay but must not (the spending limit): when it refuses every payable one, its error for the one
// that would have been chosen is returned as it is.
func choose(offer Offer, method string, rpc *chainReader, allow func(x402.PaymentRequirements) error) (int, error) {
	accepts := offer.Required.Accepts
	var (
		reasons  []string
		best     = -1
		refused  = -1
		allowErr error
	)
	for i, req := range accepts {
		why := cannotPay(offer.Version, req, method, rpc)
		if why == "" && allow != nil {
			if err := allow(req); err != nil {
				why = err.Error()
				if refused < 0 || preferred(req, accepts[refused]) {
					refused, allowErr = i, err
				}
			}
		}
		if why != "" {
			reasons = append(reasons, fmt.Sprintf("accepts[%d] (%s %s on %s): %s", i, req.Scheme, req.Extra.AssetTransferMethod, req.Network, why))
			continue
		}
		if best < 0 || preferred(req, accepts[best]) {
			best = i
		}
	}
	switch {
	case best >= 0:
		return best, nil
	case allowErr != nil:
		return 0, allowErr
	case len(reasons) == 0:
		return 0, errors.New("the 402 answer offers no way to pay (accepts is empty)")
	}
	return 0, fmt.Errorf("none of the %d ways to pay that the server offers can be paid by this payer:\n  %s",
		len(reasons), strings.Join(reasons, "\n  "))
}

// preferred says whether a is to be paid rather than b, which comes before it in the server's order.
func preferred(a, b x402.PaymentRequirements) bool {
	return a.Extra.AssetTransferMethod == x402.TransferPermit2 && b.Extra.AssetTransferMethod != x402.TransferPermit2
}

// cannotPay says why req cannot be paid, or "" when it can.
func cannotPay(version int, req x402.PaymentRequirements, method string, rpc *chainReader) string {
	m := TransferMethod(req)
	if !x402.IsScheme(req.Scheme) {
		return fmt.Sprintf("scheme %q; this payer pays %q and %q", req.Scheme, x402.SchemeExact, x402.SchemeUpto)
	}
	id, err := x402.ChainID(req.Network)
	if err != nil {
		return fmt.Sprintf("network %q is not an EVM chain this payer knows (eip155:<chain id>)", req.Network)
	}
	switch {
	case !x402.IsTransferMethod(m):
		return fmt.Sprintf("asset transfer method %q; this payer pays %s, %s or %s", m, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	case method != "" && m != method:
		return "not the method " + method + ", the only one this payer pays by"
	case req.Scheme == x402.SchemeUpto && m != x402.TransferPermit2:
		return fmt.Sprintf("upto is paid by permit2, and this requirement names %s", m)
	case req.Scheme == x402.SchemeUpto && !x402.IsHexAddress(req.Extra.FacilitatorAddress):
		return "upto needs the facilitator address that alone may settle it, and extra.facilitatorAddress names none"
	case m == x402.TransferPermit2 && version != x402.Version2:
		return fmt.Sprintf("permit2 needs x402 version 2 and the server speaks version %d", version)
	case m == x402.TransferERC2612 && rpc == nil:
		return "erc2612 signs the token's nonces(payer), which only the chain knows, and the payer has no RPC URL to read it"
	case m == x402.TransferERC2612 && req.Extra.Spender == "":
		return "erc2612 needs the facilitator wallet that will spend the permit, and extra.spender names none"
	case rpc != nil && rpc.chainID.Cmp(new(big.Int).SetUint64(id)) != 0:
		return fmt.Sprintf("on chain %d but the RPC %s serves chain %s", id, rpc.name, rpc.chainID)
	}
	return ""
}

// TransferMethod is how a requirement is paid: the method it names, or, naming none, EIP-3009, as the public
// SDKs read the standard `exact` requirement.
func TransferMethod(req x402.PaymentRequirements) string {
	if m := req.Extra.AssetTransferMethod; m != "" {
		return m
	}
	return x402.TransferEIP3009
}

// sign signs the payment of req and records on pay what was checked and added.
func (p *Payer) sign(ctx context.Context, rpc *chainReader, offer Offer, req x402.PaymentRequirements, pay *Payment) (x402.PaymentPayload, error) {
	id, err := x402.ChainID(req.Network)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	chainID := new(big.Int).SetUint64(id)
	now := time.Now()
	if p.opts.Now != nil {
		now = p.opts.Now()
	}
	if rpc != nil {
		if now, err = rpc.now(ctx, now); err != nil {
			return x402.PaymentPayload{}, err
		}
	}

	var pl x402.PaymentPayload
	switch pay.Method {
	case x402.TransferEIP3009:
		if pl, err = chain.SignEIP3009Payment(p.key, req, chainID, chain.EIP3009Options{Now: now}); err != nil {
			return pl, fmt.Errorf("signing the eip3009 payment: %w", err)
		}
	case x402.TransferPermit2:
		if pl, err = chain.SignPermit2Payment(p.key, req, chainID, chain.Permit2Options{Now: now}); err != nil {
			return pl, fmt.Errorf("signing the permit2 payment: %w", err)
		}
		if rpc != nil {
			if err := p.sponsorIfNeeded(ctx, &pl, rpc, offer, req, chainID, pay); err != nil {
				return pl, err
			}
		}
	case x402.TransferERC2612:
		if rpc == nil {
			return pl, errors.New("erc2612 signs the token's nonces(payer), and the payer has no RPC URL to read it")
		}
		asset, err := chain.ParseAddress("requirements.asset", req.Asset)
		if err != nil {
			return pl, err
		}
		nonce, err := rpc.callUint(ctx, asset, "nonces", p.address)
		if err != nil {
			return pl, err
		}
		if pl, err = chain.SignERC2612Payment(p.key, req, chainID, chain.ERC2612Options{Now: now, TokenNonce: nonce}); err != nil {
			return pl, fmt.Errorf("signing the erc2612 payment: %w", err)
		}
	default:
		return pl, fmt.Errorf("cannot sign asset transfer method %q", req.Extra.AssetTransferMethod)
	}
	if offer.Version == x402.Version2 && offer.Required.Resource.URL != "" {
		res := offer.Required.Resource
		pl.Resource = &res
	}
	return pl, nil
}

// sponsorIfNeeded adds the eip2612GasSponsoring permit to a permit2 payment when the payer's Permit2
// allowance is below the amount, echoing the server's declaration of the extension (its schema) if it made
// one.
func (p *Payer) sponsorIfNeeded(ctx context.Context, pl *x402.PaymentPayload, rpc *chainReader, offer Offer, req x402.PaymentRequirements, chainID *big.Int, pay *Payment) error {
	asset, permit2, err := permit2Of(req)
	if err != nil {
		return err
	}
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return fmt.Errorf("requirements.amount: %w", err)
	}
	allowance, err := rpc.callUint(ctx, asset, "allowance", p.address, permit2)
	if err != nil {
		return err
	}
	pay.AllowanceChecked = true
	if allowance.Cmp(amount) >= 0 {
		return nil
	}
	nonce, err := rpc.callUint(ctx, asset, "nonces", p.address)
	if err != nil {
		return err
	}
	if declared, ok := offer.Required.Extensions[x402.ExtensionEIP2612GasSponsoring]; ok {
		pl.Extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: declared}
		pay.SponsoringDeclared = true
	}
	if err := chain.AddGasSponsoring(pl, p.key, chainID, "", "", nonce); err != nil {
		return fmt.Errorf("adding gas sponsoring: %w", err)
	}
	pay.GasSponsored = true
	return nil
}
