package payer

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// DefaultMaxValidity is how long a signed payment stays valid at most, unless Options.MaxValidity says
// otherwise: twice the five minutes this project's gate offers by default (max_timeout), so that a server that
// settles in the background still has time, while a signature handed to a server is worthless ten minutes
// later whatever maxTimeoutSeconds it asked for.
const DefaultMaxValidity = 10 * time.Minute

// Options configures a Payer. The zero value pays by any method it can sign without a chain, at the wall
// clock.
type Options struct {
	// RPC is a JSON-RPC URL of the chain the payments settle on; "" for none. With it, payments are signed at
	// the later of chain time and Now (see signingTime), a permit2 payer that has not approved Permit2
	// adds eip2612GasSponsoring, and erc2612 can be paid (it signs the token's nonces(payer)). It is dialed
	// when a payment first needs it.
	RPC string
	// Method restricts payments to one asset transfer method: permit2, eip3009 or erc2612. "" pays the first
	// payable requirement, permit2 before the others.
	Method string
	// Now is the signing clock (with an RPC, unless the head block is later); nil is the wall clock.
	Now func() time.Time
	// MaxValidity caps how long a payment stays valid: its deadline (validBefore) is the signing time plus the
	// server's maxTimeoutSeconds, or plus MaxValidity when that is shorter. 0 is DefaultMaxValidity. A
	// maxTimeoutSeconds whose deadline does not fit a 64-bit clock is refused, not capped: no honest server
	// asks for it.
	MaxValidity time.Duration
	// Scheme restricts payments to one scheme: exact, upto or batch-settlement. "" pays any; see Choose for
	// which comes first.
	Scheme string
	// DepositRequests is how many requests at the offer's price a batch-settlement channel's deposit covers
	// (the offer's minDeposit when that is more); 0 is DefaultDepositRequests. A Transport deposits less when
	// its limits leave less, never less than the offer's minDeposit.
	DepositRequests int
	// ChannelSalt is the salt of the batch-settlement channels this payer pays from: the zero hash (the default),
	// as the SDK's client has it, or another to open channels of their own beside those of the same key, such as
	// one a concurrent caller, whose vouchers must each follow the one before on their channel.
	ChannelSalt common.Hash
	// Contracts pins, by network (CAIP-2, such as eip155:8453), the contracts a permit2 payment may name. A
	// network not listed, and a zero field of one listed, pins the canonical deployment (CanonicalContracts). A
	// requirement naming another Permit2 or proxy in its extra is not paid: see Contracts.
	Contracts map[string]Contracts
}

// Contracts are the contracts a permit2 payment on one network is signed for. They are pinned by the payer, not
// taken from the server's offer: a permit2 signature lets its spender move the amount to any address (the
// witness that binds payTo is checked by the x402 proxy, not by Permit2), and an eip2612GasSponsoring permit
// approves its spender for the amount. Signed only for these, a payment handed to a hostile server is worth no
// more than its payTo and amount.
type Contracts struct {
	// Permit2 is the Permit2 deployment: the EIP-712 domain of the signature, and the spender a gas-sponsoring
	// permit approves.
	Permit2 common.Address
	// ExactProxy is the x402ExactPermit2Proxy, the only spender an exact permit2 payment is signed for.
	ExactProxy common.Address
	// UptoProxy is the x402UptoPermit2Proxy, the only spender an upto payment is signed for.
	UptoProxy common.Address
}

// CanonicalContracts are the deployments the public x402 SDKs sign for on every chain (the same addresses
// everywhere, by CREATE2), which the dev chain places in its genesis.
func CanonicalContracts() Contracts {
	return Contracts{Permit2: contracts.Permit2Address, ExactProxy: contracts.ProxyAddress, UptoProxy: contracts.UptoProxyAddress}
}

// Payer signs x402 payments with one private key. It is safe for concurrent use.
type Payer struct {
	key     *ecdsa.PrivateKey
	address common.Address
	opts    Options

	mu  sync.Mutex
	rpc *chainReader // dialed on first use

	channels channels // the batch-settlement channels it pays from
	// ids are channelOf's answers, computed once (at most maxChannelIDs kept).
	idsMu sync.Mutex
	ids   map[channelTerms]channelOfResult
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
	switch opts.Scheme {
	case "", x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement:
	default:
		return nil, fmt.Errorf("payer: scheme: expected %s, %s or %s, got %q", x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement, opts.Scheme)
	}
	if opts.DepositRequests < 0 {
		return nil, fmt.Errorf("payer: DepositRequests: expected 0 (the default, %d) or more, got %d", DefaultDepositRequests, opts.DepositRequests)
	}
	if opts.MaxValidity < 0 || (opts.MaxValidity > 0 && opts.MaxValidity < time.Second) {
		return nil, fmt.Errorf("payer: MaxValidity: expected 0 (the default, %s) or at least a second, got %s", DefaultMaxValidity, opts.MaxValidity)
	}
	for network := range opts.Contracts {
		if _, err := x402.ChainID(network); err != nil {
			return nil, fmt.Errorf("payer: Contracts: network %q: expected a CAIP-2 EVM network such as eip155:8453: %w", network, err)
		}
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
	// ApprovalSponsored says the payment carries the payer's own signed approval of Permit2
	// (erc20ApprovalGasSponsoring, which the server declared), because the payer has not approved Permit2 for the
	// amount and the token has no EIP-2612 permit or the server declared no eip2612GasSponsoring.
	ApprovalSponsored bool
	// Identifier is the id the payment is named with (WithPaymentIdentifier), "" when the server declared no
	// payment-identifier extension.
	Identifier string
	// Batch is, for a batch-settlement payment, the channel it pays from and what it signed; nil otherwise.
	// Payload is then empty: the payment is in Value.
	Batch *BatchPayment

	signedAt uint64 // the head block's number at signing, with an RPC: where a search for its settlement starts
}

// Choose returns the index in offer.Required.Accepts of the requirement the payer would pay: of those it can
// pay (scheme exact, upto or batch-settlement on an EVM chain, the scheme and method of Options, the chain the
// RPC serves), in this order, each in the server's order: a batch-settlement one whose channel the payer holds
// with a deposit left (a voucher costs no gas and signs away nothing new), a permit2 one (it needs no RPC and,
// with gas sponsoring, no approval by the payer), any other exact or upto one, and last a batch-settlement one
// that needs a deposit (which locks more than one request's price in the escrow until it is spent or refunded;
// the public SDK's client takes the server's first offer instead). When none can be paid, the error says why
// for each.
func (p *Payer) Choose(ctx context.Context, offer Offer) (int, error) {
	rpc, err := p.chain(ctx)
	if err != nil {
		return 0, err
	}
	return p.choose(offer, rpc, nil)
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
	if offer.Required.Accepts[i].Scheme == x402.SchemeBatchSettlement {
		return Payment{}, errors.New("payer: a batch-settlement payment is made by a Transport, which reads the server's answer to keep the channel's count; Sign signs exact and upto only")
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
	if pay.Identifier, err = namePayment(ctx, offer, &pay.Payload); err != nil {
		return Payment{}, err
	}
	echoDiscovery(offer, &pay.Payload) // bazaar.go
	if pay.Header, pay.Value, err = encodePayment(offer, i, pay.Payload); err != nil {
		return Payment{}, fmt.Errorf("encoding the payment: %w", err)
	}
	return pay, nil
}

// choose picks the requirement to pay, as Choose says. allow, when not nil, refuses requirements the payer
// could pay but must not (the spending limit): when it refuses every payable one, its error for the one
// that would have been chosen is returned as it is.
func (p *Payer) choose(offer Offer, rpc *chainReader, allow func(x402.PaymentRequirements) error) (int, error) {
	accepts := offer.Required.Accepts
	var (
		reasons  []string
		best     = -1
		refused  = -1
		allowErr error
	)
	for i, req := range accepts {
		why := p.cannotPayIn(offer, i, rpc)
		if why == "" && allow != nil {
			if err := allow(req); err != nil {
				why = err.Error()
				if refused < 0 || p.rank(offer, i) < p.rank(offer, refused) {
					refused, allowErr = i, err
				}
			}
		}
		if why != "" {
			reasons = append(reasons, fmt.Sprintf("accepts[%d] (%s %s on %s): %s", i, req.Scheme, req.Extra.AssetTransferMethod, req.Network, why))
			continue
		}
		if best < 0 || p.rank(offer, i) < p.rank(offer, best) {
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

// rank orders the payable requirements of offer as Choose says: lower first.
func (p *Payer) rank(offer Offer, i int) int {
	if br := offer.batchAt(i); br != nil {
		if p.openChannel(br) {
			return 0
		}
		return 3
	}
	if offer.Required.Accepts[i].Extra.AssetTransferMethod == x402.TransferPermit2 {
		return 1
	}
	return 2
}

// cannotPayIn says why offer's requirement i cannot be paid, or "" when it can.
func (p *Payer) cannotPayIn(offer Offer, i int, rpc *chainReader) string {
	req := offer.Required.Accepts[i]
	if p.opts.Scheme != "" && req.Scheme != p.opts.Scheme {
		return "not the scheme " + p.opts.Scheme + ", the only one this payer pays by"
	}
	if req.Scheme == x402.SchemeBatchSettlement {
		br := offer.batchAt(i)
		if br == nil {
			return "a batch-settlement requirement whose extra does not decode (it needs receiverAuthorizer)"
		}
		return p.cannotPayBatch(offer.Version, br, rpc)
	}
	return p.cannotPay(offer.Version, req, rpc)
}

// cannotPay says why req cannot be paid, or "" when it can.
func (p *Payer) cannotPay(version int, req x402.PaymentRequirements, rpc *chainReader) string {
	m, method := TransferMethod(req), p.opts.Method
	if !x402.IsScheme(req.Scheme) {
		return fmt.Sprintf("scheme %q; this payer pays %q, %q and %q", req.Scheme, x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement)
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
	if m == x402.TransferPermit2 {
		if _, _, err := p.permit2Contracts(req); err != nil {
			return err.Error()
		}
	}
	return ""
}

// contractsOf is what the payer pins on network: Options.Contracts, the canonical deployments filling what it
// leaves out.
func (p *Payer) contractsOf(network string) Contracts {
	c, canonical := p.opts.Contracts[network], CanonicalContracts()
	if c.Permit2 == (common.Address{}) {
		c.Permit2 = canonical.Permit2
	}
	if c.ExactProxy == (common.Address{}) {
		c.ExactProxy = canonical.ExactProxy
	}
	if c.UptoProxy == (common.Address{}) {
		c.UptoProxy = canonical.UptoProxy
	}
	return c
}

// permit2Contracts returns the Permit2 and the proxy (the spender) a permit2 payment of req is signed for, after
// checking that those req names in its extra (or, naming none, the canonical ones the signer then takes) are
// the ones the payer pins on req's network. Anything else is refused, naming the field and both addresses.
func (p *Payer) permit2Contracts(req x402.PaymentRequirements) (permit2, spender common.Address, err error) {
	pinned := p.contractsOf(req.Network)
	canonical := CanonicalContracts()
	proxyField, pinnedProxy, canonicalProxy, kind := "requirements.extra.x402Permit2ProxyAddress", pinned.ExactProxy, canonical.ExactProxy, "x402ExactPermit2Proxy"
	if req.Scheme == x402.SchemeUpto {
		pinnedProxy, canonicalProxy, kind = pinned.UptoProxy, canonical.UptoProxy, "x402UptoPermit2Proxy"
	}
	if permit2, err = pinnedContract("requirements.extra.permit2Address", req.Extra.Permit2Address, canonical.Permit2, pinned.Permit2, "Permit2", req.Network); err != nil {
		return permit2, spender, err
	}
	spender, err = pinnedContract(proxyField, req.Extra.X402Permit2ProxyAddress, canonicalProxy, pinnedProxy, kind, req.Network)
	return permit2, spender, err
}

// pinnedContract is the contract a requirement names in field (or implies, naming none: the canonical one), if
// it is the pinned one.
func pinnedContract(field, named string, canonical, pinned common.Address, kind, network string) (common.Address, error) {
	got := canonical
	if named != "" {
		a, err := chain.ParseAddress(field, named)
		if err != nil {
			return common.Address{}, err
		}
		got = a
	}
	if got != pinned {
		if named == "" {
			return common.Address{}, fmt.Errorf("%s names none, which means the canonical %s %s, and this payer signs on %s only for the %s at %s (Options.Contracts): not signed",
				field, kind, canonical.Hex(), network, kind, pinned.Hex())
		}
		return common.Address{}, fmt.Errorf("%s is %s, and this payer signs on %s only for the %s at %s (Options.Contracts): a signature for another contract could move the payment anywhere; not signed",
			field, got.Hex(), network, kind, pinned.Hex())
	}
	return got, nil
}

// Validity is how long a payment of req signed now stays valid: the server's maxTimeoutSeconds, at most
// Options.MaxValidity. It is an error when maxTimeoutSeconds is not positive or its deadline does not fit a
// 64-bit clock.
func (p *Payer) Validity(req x402.PaymentRequirements) (time.Duration, error) {
	now := time.Now()
	d, err := p.deadline(now, req)
	if err != nil {
		return 0, err
	}
	return time.Duration(d.Int64()-now.Unix()) * time.Second, nil
}

// maxValidity is Options.MaxValidity, or its default.
func (p *Payer) maxValidity() time.Duration {
	if p.opts.MaxValidity > 0 {
		return p.opts.MaxValidity
	}
	return DefaultMaxValidity
}

// deadline is the deadline (validBefore) of a payment of req signed at now: now plus maxTimeoutSeconds, capped
// at now plus the payer's MaxValidity. A maxTimeoutSeconds that does not fit a 64-bit clock added to now is
// refused: signed as it wraps, it would be a uint256 near 2^256, a payment valid forever.
func (p *Payer) deadline(now time.Time, req x402.PaymentRequirements) (*big.Int, error) {
	mts := req.MaxTimeoutSeconds
	switch unix := now.Unix(); {
	case mts <= 0:
		return nil, fmt.Errorf("requirements.maxTimeoutSeconds: expected a positive number of seconds, got %d", mts)
	case unix < 0 || mts > math.MaxInt64-unix:
		return nil, fmt.Errorf("requirements.maxTimeoutSeconds: %d seconds after the signing time does not fit a 64-bit clock: a payment that would never expire; not signed", mts)
	}
	secs := min(mts, int64(p.maxValidity()/time.Second))
	return big.NewInt(now.Unix() + secs), nil
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
	now, err := p.signingTime(ctx, rpc, pay)
	if err != nil {
		return x402.PaymentPayload{}, err
	}
	deadline, err := p.deadline(now, req)
	if err != nil {
		return x402.PaymentPayload{}, err
	}

	var pl x402.PaymentPayload
	switch pay.Method {
	case x402.TransferEIP3009:
		if pl, err = chain.SignEIP3009Payment(p.key, req, chainID, chain.EIP3009Options{Now: now, ValidBefore: deadline}); err != nil {
			return pl, fmt.Errorf("signing the eip3009 payment: %w", err)
		}
	case x402.TransferPermit2:
		_, spender, err := p.permit2Contracts(req)
		if err != nil {
			return pl, err
		}
		if pl, err = chain.SignPermit2Payment(p.key, req, chainID, chain.Permit2Options{Now: now, Deadline: deadline, Proxy: spender}); err != nil {
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
		if pl, err = chain.SignERC2612Payment(p.key, req, chainID, chain.ERC2612Options{Now: now, Deadline: deadline, TokenNonce: nonce}); err != nil {
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

// signingTime is the time a payment is signed at: the clock of Options, or with an RPC the head block's time
// when it is later (the head block's number is recorded on pay). A chain's head may run ahead of the clock (a
// dev chain under load); a chain that seals only when transactions come may have sat idle for minutes, and its
// next block, which the settlement lands in, is stamped with the wall clock: a payment dated from that head
// would be born expired.
func (p *Payer) signingTime(ctx context.Context, rpc *chainReader, pay *Payment) (time.Time, error) {
	now := time.Now()
	if p.opts.Now != nil {
		now = p.opts.Now()
	}
	if rpc == nil {
		return now, nil
	}
	head, err := rpc.head(ctx)
	if err != nil {
		return time.Time{}, err
	}
	if pay != nil {
		pay.signedAt = head.Number.Uint64()
	}
	if chainTime := time.Unix(int64(head.Time), 0); chainTime.After(now) {
		return chainTime, nil
	}
	return now, nil
}

// addApproval adds to a permit2 payment the erc20ApprovalGasSponsoring extension: the payer's own approve(Permit2,
// max) transaction, signed with its pending account nonce and fees that pay the next blocks (twice the head's base
// fee and a 1 gwei tip, as much as the public SDK's fallback when that is more), echoing the server's declaration.
func (p *Payer) addApproval(ctx context.Context, pl *x402.PaymentPayload, rpc *chainReader, declared json.RawMessage, chainID *big.Int, pay *Payment) error {
	nonce, err := rpc.client.PendingNonceAt(ctx, p.address)
	if err != nil {
		return rpc.wrap("reading the payer's pending nonce from the RPC", err)
	}
	head, err := rpc.head(ctx)
	if err != nil {
		return err
	}
	tip := big.NewInt(1_000_000_000)
	feeCap := new(big.Int).Set(tip)
	if head.BaseFee != nil {
		feeCap.Add(feeCap, new(big.Int).Mul(head.BaseFee, big.NewInt(2)))
	}
	pl.Extensions = map[string]json.RawMessage{x402.ExtensionERC20ApprovalGasSponsoring: declared}
	if err := chain.AddApprovalSponsoring(pl, p.key, chainID, chain.ApprovalTx{Nonce: nonce, TipCap: tip, FeeCap: feeCap}); err != nil {
		return fmt.Errorf("adding the sponsored approval: %w", err)
	}
	pay.ApprovalSponsored = true
	return nil
}

// sponsorIfNeeded adds the eip2612GasSponsoring permit to a permit2 payment when the payer's Permit2
// allowance is below the amount, echoing the server's declaration of the extension (its schema) if it made
// one.
func (p *Payer) sponsorIfNeeded(ctx context.Context, pl *x402.PaymentPayload, rpc *chainReader, offer Offer, req x402.PaymentRequirements, chainID *big.Int, pay *Payment) error {
	asset, permit2, err := p.permit2Of(req)
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
	// As the public SDK decides: the EIP-2612 permit when the server declares it and the token has one, else the
	// payer's own approval transaction when the server declares erc20ApprovalGasSponsoring.
	_, permitDeclared := offer.Required.Extensions[x402.ExtensionEIP2612GasSponsoring]
	approvalDeclared, approvalOK := offer.Required.Extensions[x402.ExtensionERC20ApprovalGasSponsoring]
	nonce, err := rpc.callUint(ctx, asset, "nonces", p.address)
	if approvalOK && (!permitDeclared || err != nil) {
		return p.addApproval(ctx, pl, rpc, approvalDeclared, chainID, pay)
	}
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
