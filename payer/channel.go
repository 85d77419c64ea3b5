package payer

import (
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The batch-settlement scheme, paying side (as npm @x402/evm 2.27's batch-settlement client does it): the first
// payment of a channel deposits into the escrow and carries the first voucher; every later one is a voucher whose
// cumulative amount is exactly the last one the server accepted plus the price; what is left is refunded on
// request. The payer keeps, per channel, what the servers' answers confirmed, in memory; with an RPC, a channel
// it does not know is read from the escrow (a channel's id depends only on its parties and terms, so a payer
// that ran before finds its channel again).

// DefaultDepositRequests is how many requests at an offer's price a channel's deposit covers, unless
// Options.DepositRequests says otherwise; the offer's minDeposit, when it asks more, is deposited instead.
const DefaultDepositRequests = 10

// ChannelState is what the payer knows of one batch-settlement channel it pays from.
type ChannelState struct {
	// ID is the channel's id (the EIP-712 hash of Config under the escrow's domain on Network).
	ID common.Hash
	// Network is the CAIP-2 chain of the escrow.
	Network string
	// Config is the channel's configuration, as the payments carry it.
	Config x402.ChannelConfig
	// Balance is the channel's deposit as the payer knows it: the deposits the servers confirmed, or what the
	// escrow showed, less what was refunded.
	Balance *big.Int
	// Charged is the cumulative amount of the last voucher a server accepted: what the receiver may claim.
	Charged *big.Int
	// Signed is the highest cumulative amount the payer signed a voucher for: Charged, or more when a voucher's
	// answer was lost or refused.
	Signed *big.Int
}

// Left is what the channel holds that no accepted voucher charges: Balance less Charged, never below zero.
func (s ChannelState) Left() *big.Int {
	left := new(big.Int).Sub(orZero(s.Balance), orZero(s.Charged))
	if left.Sign() < 0 {
		left.SetInt64(0)
	}
	return left
}

func (s ChannelState) clone() ChannelState {
	s.Balance, s.Charged, s.Signed = new(big.Int).Set(orZero(s.Balance)), new(big.Int).Set(orZero(s.Charged)), new(big.Int).Set(orZero(s.Signed))
	return s
}

// channel is a channel's state with the lock that lets one payment at a time use it: a server takes only the
// voucher at exactly its last accepted amount plus the price, so two vouchers signed at once would both carry
// the same amount and one would be refused.
type channel struct {
	turn  chan struct{} // holds one token while a payment uses the channel
	state ChannelState
	// known says the state was read from the escrow or built from answers; a new channel starts unknown.
	known bool
	// stale says an answer was lost or refused after a deposit: the escrow is read again before the next payment.
	stale bool
	// last is the state as the last payment left it, for readers that must not wait for a payment's turn.
	last atomic.Pointer[ChannelState]
	// voucher is the channel's plain voucher payment, encoded but for its two values (voucher_template.go); used
	// by the payment holding the turn.
	voucher *voucherTemplate
	// ahead is the voucher the next payment most likely carries (the last one signed plus its price), signed in
	// the background while the last one's request is on its way; used by the payment holding the turn.
	ahead *aheadVoucher
	// domain is the batch domain of the channel's chain, which its id was made under (BatchDomainSeparator), once
	// worked out; used by the payment holding the turn.
	domain common.Hash
}

// aheadVoucher is a voucher signed ahead of its payment (channel.signAhead). It stays in memory: it is sent only
// when a payment's cumulative amount is exactly its amount (the same signature the payment would make then), so
// ChannelState.Signed counts it only once sent.
type aheadVoucher struct {
	amount *big.Int
	done   chan struct{} // closed once sig and err are set
	sig    string
	err    error
}

// signAhead starts signing the voucher of amount on the channel id, for the next payment to take (voucherSignature).
func (ch *channel) signAhead(key *ecdsa.PrivateKey, domain, id common.Hash, amount *big.Int) {
	a := &aheadVoucher{amount: new(big.Int).Set(amount), done: make(chan struct{})}
	ch.ahead = a
	go func() {
		defer close(a.done)
		sig, err := chain.SignVoucher(key, domain, id, a.amount)
		a.sig, a.err = sig.String(), err
	}()
}

// voucherSignature is the signature of the voucher of amount on the channel id: the one signed ahead for that
// amount, else signed now. A voucher signed ahead for another amount is dropped.
func (ch *channel) voucherSignature(key *ecdsa.PrivateKey, domain, id common.Hash, amount *big.Int) (string, error) {
	if a := ch.ahead; a != nil {
		ch.ahead = nil
		if a.amount.Cmp(amount) == 0 {
			<-a.done
			if a.err == nil {
				return a.sig, nil
			}
		}
	}
	sig, err := chain.SignVoucher(key, domain, id, amount)
	if err != nil {
		return "", err
	}
	return sig.String(), nil
}

// channels are the channels a Payer pays from, by id.
type channels struct {
	mu sync.Mutex
	m  map[common.Hash]*channel
}

func (c *channels) get(id common.Hash, network string, cfg x402.ChannelConfig) *channel {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[common.Hash]*channel{}
	}
	ch := c.m[id]
	if ch == nil {
		ch = &channel{turn: make(chan struct{}, 1), state: ChannelState{ID: id, Network: network, Config: cfg,
			Balance: new(big.Int), Charged: new(big.Int), Signed: new(big.Int)}}
		c.m[id] = ch
	}
	return ch
}

// Channel returns what the payer knows of the channel id, and whether it knows it.
func (p *Payer) Channel(id common.Hash) (ChannelState, bool) {
	p.channels.mu.Lock()
	ch := p.channels.m[id]
	p.channels.mu.Unlock()
	if ch == nil {
		return ChannelState{}, false
	}
	st := ch.last.Load()
	if st == nil {
		return ChannelState{}, false
	}
	return st.clone(), true
}

// openChannel says whether the payer knows a channel with a deposit left for req's terms: paying it by voucher
// costs no gas and signs no new authority over the payer's tokens.
func (p *Payer) openChannel(br *x402.BatchRequirements) bool {
	id, _, err := p.channelOf(br)
	if err != nil {
		return false
	}
	st, ok := p.Channel(id)
	price, err := x402.ParseAmount(br.Amount)
	return ok && err == nil && st.Left().Cmp(price) >= 0
}

// channelOf is the channel the payer pays br from: the payer and its own key as voucher signer (the SDK's
// client names its signer as payerAuthorizer), br's receiver, receiver authorizer, token and withdraw delay
// (the contract's least when br names none), and Options.ChannelSalt: the zero salt by default, as the SDK's client
// has it, so that the two find the same channel.
func (p *Payer) channelOf(br *x402.BatchRequirements) (common.Hash, x402.ChannelConfig, error) {
	// Every payment of a channel asks, and the answer hashes a dozen times (checksummed addresses, the domain,
	// the id): it is kept, by what it is made of.
	terms := channelTerms{network: br.Network, payTo: br.PayTo, receiverAuthorizer: br.Extra.ReceiverAuthorizer, asset: br.Asset, delay: br.Extra.WithdrawDelay}
	p.idsMu.Lock()
	r, ok := p.ids[terms]
	p.idsMu.Unlock()
	if ok {
		return r.id, r.cfg, r.err
	}
	id, cfg, err := p.computeChannelOf(br)
	p.idsMu.Lock()
	if p.ids == nil || len(p.ids) >= maxChannelIDs {
		p.ids = map[channelTerms]channelOfResult{}
	}
	p.ids[terms] = channelOfResult{id: id, cfg: cfg, err: err}
	p.idsMu.Unlock()
	return id, cfg, err
}

// maxChannelIDs bounds the channel ids a Payer keeps computed; past it they start afresh.
const maxChannelIDs = 1024

// channelTerms are what of a batch-settlement requirement channelOf reads.
type channelTerms struct {
	network, payTo, receiverAuthorizer, asset string
	delay                                     int64
}

// channelOfResult is channelOf's answer (its configuration has no references, so copies share nothing).
type channelOfResult struct {
	id  common.Hash
	cfg x402.ChannelConfig
	err error
}

// computeChannelOf is channelOf, computed.
func (p *Payer) computeChannelOf(br *x402.BatchRequirements) (common.Hash, x402.ChannelConfig, error) {
	delay := br.Extra.WithdrawDelay
	if delay == 0 {
		delay = contracts.MinWithdrawDelay
	}
	cfg := x402.ChannelConfig{
		Payer: p.address.Hex(), PayerAuthorizer: p.address.Hex(), Receiver: br.PayTo,
		ReceiverAuthorizer: br.Extra.ReceiverAuthorizer, Token: br.Asset, WithdrawDelay: delay, Salt: p.opts.ChannelSalt.Hex(),
	}
	parsed, err := chain.ParseChannelConfig(cfg)
	if err != nil {
		return common.Hash{}, cfg, err
	}
	id, err := x402.ChainID(br.Network)
	if err != nil {
		return common.Hash{}, cfg, err
	}
	// Checksummed as the SDK writes them: a server comparing addresses as strings sees the same ones.
	cfg.Receiver, cfg.ReceiverAuthorizer, cfg.Token = parsed.Receiver.Hex(), parsed.ReceiverAuthorizer.Hex(), parsed.Token.Hex()
	return chain.ChannelID(chain.BatchDomainSeparator(new(big.Int).SetUint64(id)), parsed), cfg, nil
}

// ChannelID is the id of the channel the payer pays br from.
func (p *Payer) ChannelID(br x402.BatchRequirements) (common.Hash, error) {
	id, _, err := p.channelOf(&br)
	return id, err
}

// cannotPayBatch says why the batch-settlement requirement br cannot be paid, or "" when it can.
func (p *Payer) cannotPayBatch(version int, br *x402.BatchRequirements, rpc *chainReader) string {
	m := br.Extra.AssetTransferMethod
	if m == "" {
		m = x402.TransferEIP3009
	}
	switch {
	case version != x402.Version2:
		return fmt.Sprintf("batch-settlement needs x402 version 2 and the server speaks version %d", version)
	case p.opts.Method != "" && m != p.opts.Method:
		return "deposits by " + m + ", not the method " + p.opts.Method + ", the only one this payer pays by"
	case !x402.IsHexAddress(br.Extra.ReceiverAuthorizer) || common.HexToAddress(br.Extra.ReceiverAuthorizer) == (common.Address{}):
		return "batch-settlement needs the receiver authorizer that signs claims and refunds, and extra.receiverAuthorizer names none"
	case br.Extra.WithdrawDelay != 0 && (br.Extra.WithdrawDelay < contracts.MinWithdrawDelay || br.Extra.WithdrawDelay > contracts.MaxWithdrawDelay):
		return fmt.Sprintf("extra.withdrawDelay is %d s, outside the escrow's %d to %d", br.Extra.WithdrawDelay, contracts.MinWithdrawDelay, contracts.MaxWithdrawDelay)
	case m == x402.TransferEIP3009 && (br.Extra.Name == "" || br.Extra.Version == ""):
		return "an eip3009 deposit signs under the token's EIP-712 domain, and extra names no name and version"
	case m == x402.TransferPermit2 && p.contractsOf(br.Network).Permit2 != contracts.Permit2Address:
		return fmt.Sprintf("a permit2 deposit is spent through the canonical Permit2 %s, and this payer pins another on %s (Options.Contracts)", contracts.Permit2Address.Hex(), br.Network)
	}
	if price, err := x402.ParseAmount(br.Amount); err != nil || price.Sign() == 0 {
		return fmt.Sprintf("amount %q is not a positive amount", br.Amount)
	}
	id, err := x402.ChainID(br.Network)
	if err != nil {
		return fmt.Sprintf("network %q is not an EVM chain this payer knows (eip155:<chain id>)", br.Network)
	}
	if rpc != nil && rpc.chainID.Cmp(new(big.Int).SetUint64(id)) != 0 {
		return fmt.Sprintf("on chain %d but the RPC %s serves chain %s", id, rpc.name, rpc.chainID)
	}
	if _, _, err := p.channelOf(br); err != nil {
		return err.Error()
	}
	return ""
}

// batchPlan is one batch-settlement payment being made: the channel it pays from (its turn taken until done),
// the voucher's cumulative amount and, when the deposit does not cover it, the deposit it needs.
type batchPlan struct {
	p     *Payer
	ch    *channel
	offer Offer
	index int
	req   *x402.BatchRequirements
	price *big.Int
	// next is the voucher's cumulative amount: the last accepted plus the price (a refund: the last accepted).
	next *big.Int
	// need is the least deposit that covers next (0 when the channel does); least is what a deposit must be at
	// least: need, or the offer's minDeposit when it asks more; want is what the payer deposits when nothing
	// bounds it.
	need, least, want *big.Int
	// deposit is the deposit signed, when one is; refundAmount the refund asked, nil for all that is left.
	deposit, refundAmount *big.Int
	payment               Payment
	// counted is what a Transport added to its budget for the payment.
	counted *big.Int
	done    bool
}

// planBatch takes the turn of the channel that pays offer's requirement i and works out the next voucher and
// whether a deposit must come with it. The plan must be finished (finish) to give the turn back.
func (p *Payer) planBatch(ctx context.Context, rpc *chainReader, offer Offer, i int, refund bool) (*batchPlan, error) {
	br := offer.batchAt(i)
	if br == nil {
		return nil, fmt.Errorf("payer: requirement %d is not a batch-settlement requirement", i)
	}
	price, err := x402.ParseAmount(br.Amount)
	if err != nil || price.Sign() == 0 {
		return nil, fmt.Errorf("requirements.amount %q: expected a positive amount", br.Amount)
	}
	id, cfg, err := p.channelOf(br)
	if err != nil {
		return nil, err
	}
	ch := p.channels.get(id, br.Network, cfg)
	select {
	case ch.turn <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for the turn of channel %s: %w", id.Hex(), ctx.Err())
	}
	plan := &batchPlan{p: p, ch: ch, offer: offer, index: i, req: br, price: price}
	if (!ch.known || ch.stale) && rpc != nil {
		balance, claimed, err := rpc.channel(ctx, id)
		if err != nil {
			plan.finish()
			return nil, err
		}
		ch.state.Balance = balance
		if !ch.known || ch.state.Charged.Cmp(claimed) < 0 {
			// A channel met for the first time carries on from what was claimed on chain: a server that
			// accepted more answers the voucher with its last one, which resync checks.
			ch.state.Charged = claimed
		}
		if ch.state.Signed.Cmp(ch.state.Charged) < 0 {
			ch.state.Signed = new(big.Int).Set(ch.state.Charged)
		}
		ch.known, ch.stale = true, false
	}
	st := ch.state
	plan.next = new(big.Int).Add(st.Charged, price)
	if refund {
		plan.next = new(big.Int).Set(st.Charged)
	}
	plan.need, plan.least, plan.want = new(big.Int), new(big.Int), new(big.Int)
	if !refund && plan.next.Cmp(st.Balance) > 0 {
		plan.need.Sub(plan.next, st.Balance)
		plan.least.Set(plan.need)
		if m, err := x402.ParseAmount(br.Extra.MinDeposit); err == nil && m.Cmp(plan.least) > 0 {
			plan.least.Set(m)
		}
		n := int64(p.opts.DepositRequests)
		if n <= 0 {
			n = DefaultDepositRequests
		}
		plan.want.Mul(price, big.NewInt(n))
		if plan.want.Cmp(plan.least) < 0 {
			plan.want.Set(plan.least)
		}
	}
	return plan, nil
}

// finish gives the channel's turn back; it may be called more than once.
func (b *batchPlan) finish() {
	if !b.done {
		b.done = true
		if b.ch.known {
			st := b.ch.state.clone()
			b.ch.last.Store(&st)
		}
		<-b.ch.turn
	}
}

// batchPaymentWire is a batch-settlement payment as sent: accepted is the requirement exactly as the server
// offered it (members this package does not model included), so that a server matching it finds its own offer.
type batchPaymentWire struct {
	X402Version int                `json:"x402Version"`
	Resource    *x402.ResourceInfo `json:"resource,omitempty"`
	Accepted    json.RawMessage    `json:"accepted"`
	Payload     x402.BatchPayload  `json:"payload"`
}

// sign signs the plan's voucher, with a deposit of deposit when it is positive (it must cover need), or, with
// refund, the refund of amount (nil: all that is left) at the last accepted amount.
func (b *batchPlan) sign(ctx context.Context, rpc *chainReader, deposit *big.Int, refund bool, amount *big.Int) (Payment, error) {
	p, br := b.p, b.req
	id := b.ch.state.ID
	chainID, err := x402.ChainID(br.Network)
	if err != nil {
		return Payment{}, err
	}
	cid := new(big.Int).SetUint64(chainID)
	if deposit != nil && deposit.Sign() > 0 && deposit.Cmp(b.need) < 0 {
		return Payment{}, fmt.Errorf("payer: a deposit of %s does not cover the voucher of %s on channel %s, which needs %s", deposit, b.next, id.Hex(), b.need)
	}
	if b.need.Sign() > 0 && (deposit == nil || deposit.Sign() == 0) {
		return Payment{}, fmt.Errorf("payer: channel %s holds %s and the next voucher is %s: a deposit of at least %s must come with it", id.Hex(), b.ch.state.Balance, b.next, b.need)
	}
	if b.ch.domain == (common.Hash{}) {
		b.ch.domain = chain.BatchDomainSeparator(cid)
	}
	domain := b.ch.domain
	sig, err := b.ch.voucherSignature(p.key, domain, id, b.next)
	if err != nil {
		return Payment{}, fmt.Errorf("signing the voucher: %w", err)
	}
	cfg := b.ch.state.Config
	pl := x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: &cfg,
		Voucher: &x402.BatchVoucherFields{ChannelID: id.Hex(), MaxClaimableAmount: b.next.String(), Signature: sig}}
	pay := Payment{Index: b.index, Requirements: br.Generic(), Method: TransferMethod(br.Generic())}
	switch {
	case refund:
		pl.Type = x402.BatchRefund
		if amount != nil {
			pl.Amount = amount.String()
			b.refundAmount = new(big.Int).Set(amount)
		}
	case deposit != nil && deposit.Sign() > 0:
		pl.Type = x402.BatchDeposit
		if pl.Deposit, err = p.signDeposit(ctx, rpc, br, id, cid, deposit, &pay); err != nil {
			return Payment{}, err
		}
		b.deposit = new(big.Int).Set(deposit)
	}
	raw, err := b.offer.rawAccepted(b.index)
	if err != nil {
		return Payment{}, err
	}
	wire := batchPaymentWire{X402Version: x402.Version2, Accepted: raw, Payload: pl}
	if b.offer.Required.Resource.URL != "" {
		res := b.offer.Required.Resource
		wire.Resource = &res
	}
	pay.Header = x402.HeaderPaymentSignature
	if pay.Value, err = b.encode(wire); err != nil {
		return Payment{}, fmt.Errorf("encoding the payment: %w", err)
	}
	pay.Batch = &BatchPayment{ChannelID: id, Cumulative: new(big.Int).Set(b.next), Price: new(big.Int).Set(b.price), Refund: refund}
	if b.deposit != nil {
		pay.Batch.Deposit = new(big.Int).Set(b.deposit)
	}
	if b.next.Cmp(b.ch.state.Signed) > 0 {
		b.ch.state.Signed = new(big.Int).Set(b.next)
	}
	if !refund {
		// While this payment's request is on its way, the voucher of the next at the same price is signed: the
		// payer's largest piece of work a request, out of the next one's latency.
		b.ch.signAhead(p.key, domain, id, new(big.Int).Add(b.next, b.price))
	}
	b.payment = pay
	return pay, nil
}

// encode is the header value of payment wire: a plain voucher's from the channel's template when it has one for
// the same requirement and resource, and otherwise encoded whole (and, for a plain voucher, the template made,
// kept only when it gives this very value).
func (b *batchPlan) encode(wire batchPaymentWire) (string, error) {
	plain := wire.Payload.Type == x402.BatchVoucher && wire.Payload.Voucher != nil
	var key string
	if plain {
		key = templateKey(wire.Accepted, wire.Resource)
		if t := b.ch.voucher; t != nil && t.key == key {
			if v, ok := t.encode(wire.Payload.Voucher.MaxClaimableAmount, wire.Payload.Voucher.Signature); ok {
				return v, nil
			}
		}
	}
	value, err := x402.EncodeHeader(wire)
	if err != nil || !plain {
		return value, err
	}
	if t := newVoucherTemplate(key, wire); t != nil {
		if v, ok := t.encode(wire.Payload.Voucher.MaxClaimableAmount, wire.Payload.Voucher.Signature); ok && v == value {
			b.ch.voucher = t
		}
	}
	return value, nil
}

// BatchPayment is what a batch-settlement payment signed.
type BatchPayment struct {
	// ChannelID is the channel paid from.
	ChannelID common.Hash
	// Cumulative is the voucher's cumulative amount (maxClaimableAmount).
	Cumulative *big.Int
	// Price is what this request adds to the cumulative amount (0 for a refund).
	Price *big.Int
	// Deposit is the deposit that comes with the voucher; nil for none.
	Deposit *big.Int
	// Refund says the payment asks for a refund.
	Refund bool
}

// signDeposit signs a deposit of amount into channel id through the collector br's transfer method names: an
// ERC-3009 ReceiveWithAuthorization to the ERC-3009 collector (its nonce binding the channel), or a Permit2
// transfer spent by the Permit2 collector (its witness naming the channel). Both are valid for the offer's
// maxTimeoutSeconds, at most the payer's MaxValidity, from the signing time.
func (p *Payer) signDeposit(ctx context.Context, rpc *chainReader, br *x402.BatchRequirements, id common.Hash, chainID, amount *big.Int, pay *Payment) (*x402.BatchDepositFields, error) {
	now, err := p.signingTime(ctx, rpc, pay)
	if err != nil {
		return nil, err
	}
	deadline, err := p.deadline(now, br.Generic())
	if err != nil {
		return nil, err
	}
	token := common.HexToAddress(br.Asset)
	var salt [32]byte
	if _, err := rand.Read(salt[:]); err != nil {
		return nil, fmt.Errorf("drawing a deposit nonce: %w", err)
	}
	out := &x402.BatchDepositFields{Amount: amount.String()}
	if TransferMethod(br.Generic()) == x402.TransferPermit2 {
		if rpc != nil {
			allowance, err := rpc.callUint(ctx, token, "allowance", p.address, contracts.Permit2Address)
			if err != nil {
				return nil, err
			}
			pay.AllowanceChecked = true
			if allowance.Cmp(amount) < 0 {
				return nil, fmt.Errorf("payer: a permit2 deposit of %s needs the payer's Permit2 allowance of token %s, which is %s: approve Permit2 first (ApprovePermit2)", amount, token.Hex(), allowance)
			}
		}
		nonce := new(big.Int).SetBytes(salt[:])
		digest := chain.DepositPermit2Digest(chainID, token, amount, nonce, deadline, id)
		sig, err := signDigest(p, digest)
		if err != nil {
			return nil, err
		}
		out.Authorization.Permit2Authorization = &x402.BatchPermit2Authorization{
			From: p.address.Hex(), Permitted: x402.TokenPermissions{Token: token.Hex(), Amount: amount.String()},
			Spender: contracts.Permit2DepositCollectorAddress.Hex(), Nonce: nonce.String(), Deadline: deadline.String(),
			Witness: x402.BatchPermit2Witness{ChannelID: id.Hex()}, Signature: sig,
		}
		return out, nil
	}
	nonce := contracts.ERC3009DepositNonce(id, common.Hash(salt))
	domain := chain.PermitDomainSeparator(br.Extra.Name, br.Extra.Version, chainID, token)
	digest := chain.ReceiveAuthorizationDigest(domain, p.address, contracts.ERC3009DepositCollectorAddress, amount, new(big.Int), deadline, nonce)
	sig, err := signDigest(p, digest)
	if err != nil {
		return nil, err
	}
	out.Authorization.ERC3009Authorization = &x402.BatchERC3009Authorization{
		ValidAfter: "0", ValidBefore: deadline.String(), Salt: common.Hash(salt).Hex(), Signature: sig,
	}
	return out, nil
}

// signDigest signs an EIP-712 digest with the payer's key: 65 bytes, v 27 or 28, in hex.
func signDigest(p *Payer, digest common.Hash) (string, error) {
	raw, err := crypto.Sign(digest[:], p.key)
	if err != nil {
		return "", fmt.Errorf("signing: %w", err)
	}
	raw[64] += 27
	return "0x" + common.Bytes2Hex(raw), nil
}

// answered records what the server's answer to the plan's payment says: a success advances the channel's
// accepted amount (by the charge it names, at most the price, checked against the cumulative amount it names)
// and adds a deposit to its balance, a refund takes what it returned off the balance. It returns true when the
// answer is a corrective 402 (the server holds another cumulative amount) that resynced the channel, so the
// payment may be made again. An answer that says nothing of the payment leaves the channel as it was, stale
// when a deposit went with it.
func (b *batchPlan) answered(ctx context.Context, rpc *chainReader, resp *http.Response) (resynced bool, err error) {
	if resp == nil {
		b.ch.stale = b.ch.stale || b.deposit != nil
		return false, nil
	}
	if h := resp.Header.Get(x402.HeaderPaymentResponse); h != "" {
		s, err := x402.DecodeBatchSettleResponse(h)
		if err != nil {
			b.ch.stale = b.ch.stale || b.deposit != nil
			return false, fmt.Errorf("the %s header: %w", x402.HeaderPaymentResponse, err)
		}
		if s.Success {
			return false, b.settled(s)
		}
	}
	if resp.StatusCode == http.StatusPaymentRequired {
		if offer, err := ReadOffer(resp.Header, nil); err == nil {
			if b.taken(offer) {
				return true, nil
			}
			ok, err := b.resync(ctx, rpc, offer)
			if ok || err != nil {
				return ok, err
			}
		}
	}
	b.ch.stale = b.ch.stale || b.deposit != nil
	return false, nil
}

// taken counts the plan's voucher as charged when the server refused it as used (payment_already_used): it
// bought a response already, whose answer the payer never read (a connection cut), or the server accepted it for
// another resource whose response never came (an upstream that failed; presented there again, it is served,
// charged nothing more). Either way the server holds the voucher, signed by the payer, and can claim it: the next
// one is signed for this request (the caller sends it once more), where signing this one again would be refused
// for good and leave the channel paying for nothing else. A plain voucher only, never a deposit or a refund, and not
// when the gate says another request is presenting it right now (its answer is still to come).
func (b *batchPlan) taken(offer Offer) bool {
	st := &b.ch.state
	if !strings.HasPrefix(offer.Required.Error, x402.ReasonPaymentAlreadyUsed) || strings.Contains(offer.Required.Error, "presenting this voucher right now") || b.deposit != nil ||
		(b.payment.Batch != nil && b.payment.Batch.Refund) || b.next == nil || b.next.Cmp(st.Charged) <= 0 {
		return false
	}
	st.Charged = new(big.Int).Set(b.next)
	if st.Signed.Cmp(b.next) < 0 {
		st.Signed = new(big.Int).Set(b.next)
	}
	return true
}

// settled applies a successful settlement answer to the channel.
func (b *batchPlan) settled(s x402.BatchSettleResponse) error {
	st := &b.ch.state
	var cs *x402.BatchChannelState
	if s.Extra != nil {
		cs = s.Extra.ChannelState
	}
	if cs != nil && cs.ChannelID != "" && !strings.EqualFold(cs.ChannelID, st.ID.Hex()) {
		b.ch.stale = true
		return fmt.Errorf("payer: the settlement names channel %s, not the channel paid from, %s", cs.ChannelID, st.ID.Hex())
	}
	if b.payment.Batch != nil && b.payment.Batch.Refund {
		// What is left after a refund is what the accepted vouchers charge, or less the amount asked.
		if b.refundAmount == nil {
			st.Balance = new(big.Int).Set(st.Charged)
		} else {
			st.Balance = new(big.Int).Sub(st.Balance, b.refundAmount)
			if st.Balance.Cmp(st.Charged) < 0 {
				st.Balance.Set(st.Charged)
			}
		}
		b.ch.known = true
		return nil
	}
	charge := new(big.Int).Set(b.price)
	if s.Extra != nil && s.Extra.ChargedAmount != "" {
		c, err := x402.ParseAmount(s.Extra.ChargedAmount)
		if err != nil || c.Cmp(b.price) > 0 {
			b.ch.stale = true
			return fmt.Errorf("payer: the settlement says it charged %q, expected at most the price %s", s.Extra.ChargedAmount, b.price)
		}
		charge = c
	}
	next := new(big.Int).Add(st.Charged, charge)
	if cs != nil && cs.ChargedCumulativeAmount != "" {
		if got, err := x402.ParseAmount(cs.ChargedCumulativeAmount); err != nil || got.Cmp(next) != 0 {
			// The SDK's client keeps its own count then too: a server's number alone never moves it.
			b.ch.stale = true
			return fmt.Errorf("payer: the settlement says channel %s stands at %q, and the payer counts %s", st.ID.Hex(), cs.ChargedCumulativeAmount, next)
		}
	}
	st.Charged = next
	if b.deposit != nil {
		st.Balance = new(big.Int).Add(st.Balance, b.deposit)
	}
	b.ch.known = true
	return nil
}

// resync carries on from the server's last voucher when a corrective 402 says the payer's cumulative amount is
// not the server's: only a voucher the payer's own key signed, at or above what the server says it charged
// (and, with an RPC, at or above what was claimed on chain), is believed.
func (b *batchPlan) resync(ctx context.Context, rpc *chainReader, offer Offer) (bool, error) {
	if offer.Required.Error != x402.ReasonBatchCumulativeAmountMismatch && offer.Required.Error != x402.ReasonBatchCumulativeBelowClaimed {
		return false, nil
	}
	st := &b.ch.state
	for i := range offer.Required.Accepts {
		br := offer.batchAt(i)
		if br == nil || br.Extra.ChannelState == nil || br.Extra.VoucherState == nil {
			continue
		}
		cs, vs := br.Extra.ChannelState, br.Extra.VoucherState
		if !strings.EqualFold(cs.ChannelID, st.ID.Hex()) {
			continue
		}
		charged, err1 := x402.ParseAmount(cs.ChargedCumulativeAmount)
		signed, err2 := x402.ParseAmount(vs.SignedMaxClaimable)
		if err1 != nil || err2 != nil || charged.Cmp(signed) > 0 {
			return false, nil
		}
		sig, err := chain.ParseSignature(vs.Signature)
		if err != nil {
			return false, nil
		}
		chainID, err := x402.ChainID(st.Network)
		if err != nil {
			return false, nil
		}
		digest := chain.VoucherDigest(chain.BatchDomainSeparator(new(big.Int).SetUint64(chainID)), st.ID, signed)
		if who, err := chain.RecoverSigner(digest, sig); err != nil || who != b.p.address {
			return false, nil
		}
		if rpc != nil {
			balance, claimed, err := rpc.channel(ctx, st.ID)
			if err != nil {
				return false, err
			}
			if charged.Cmp(claimed) < 0 {
				return false, nil
			}
			st.Balance = balance
		}
		st.Charged = charged
		if st.Signed.Cmp(signed) < 0 {
			st.Signed = new(big.Int).Set(signed)
		}
		b.ch.known, b.ch.stale = true, false
		return true, nil
	}
	return false, nil
}

// channel reads a channel's balance and what was claimed from it, from the escrow.
func (c *chainReader) channel(ctx context.Context, id common.Hash) (balance, claimed *big.Int, err error) {
	data, err := contracts.BatchSettlementABI.Pack("channels", id)
	if err != nil {
		return nil, nil, fmt.Errorf("packing channels: %w", err)
	}
	to := contracts.BatchSettlementAddress
	out, err := c.client.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
	if err != nil {
		return nil, nil, c.wrap("reading channel "+id.Hex()+" from the batch-settlement escrow through the RPC", err)
	}
	vals, err := contracts.BatchSettlementABI.Unpack("channels", out)
	if err != nil || len(vals) < 2 {
		return nil, nil, fmt.Errorf("the escrow %s answered channels(%s) with %d bytes that do not decode (is it deployed there?): %v", to.Hex(), id.Hex(), len(out), err)
	}
	balance, ok1 := vals[0].(*big.Int)
	claimed, ok2 := vals[1].(*big.Int)
	if !ok1 || !ok2 {
		return nil, nil, errors.New("the escrow's channels view returned no (balance, totalClaimed)")
	}
	return balance, claimed, nil
}

func orZero(x *big.Int) *big.Int {
	if x == nil {
		return new(big.Int)
	}
	return x
}

// Refund asks the server at url for what is left in the batch-settlement channel that pays it: all that no
// accepted voucher charges, or amount of it (nil: all). It probes url for its offer, signs a refund voucher at
// the channel's last accepted amount (a refund charges nothing) and sends it; the server claims what its
// vouchers charge and returns the rest to the payer on chain. It follows no redirect with the refund attached.
// The channel is the one this Payer paid from, or, with an RPC, the one the escrow holds for the offer's terms.
// It returns the channel as the answer leaves it and the server's settlement answer.
func (p *Payer) Refund(ctx context.Context, client *http.Client, url string, amount *big.Int) (ChannelState, x402.BatchSettleResponse, error) {
	var none x402.BatchSettleResponse
	if amount != nil && amount.Sign() <= 0 {
		return ChannelState{}, none, fmt.Errorf("payer: a refund of %s: expected a positive amount, or nil for all that is left", amount)
	}
	if client == nil {
		client = http.DefaultClient
	}
	probe, body, err := Fetch(ctx, client, http.MethodGet, url, "", "", maxOfferBody)
	if err != nil {
		return ChannelState{}, none, err
	}
	if probe.StatusCode != http.StatusPaymentRequired {
		return ChannelState{}, none, fmt.Errorf("payer: refund: %s answered %s, not 402 Payment Required: it names no channel to refund", probe.Request.URL.Redacted(), probe.Status)
	}
	offer, err := ReadOffer(probe.Header, body)
	if err != nil {
		return ChannelState{}, none, err
	}
	rpc, err := p.chain(ctx)
	if err != nil {
		return ChannelState{}, none, err
	}
	i, reasons := -1, []string{}
	for k := range offer.Required.Accepts {
		if offer.Required.Accepts[k].Scheme != x402.SchemeBatchSettlement {
			continue
		}
		if why := p.cannotPayIn(offer, k, rpc); why != "" {
			reasons = append(reasons, fmt.Sprintf("accepts[%d]: %s", k, why))
			continue
		}
		i = k
		break
	}
	if i < 0 {
		return ChannelState{}, none, fmt.Errorf("payer: refund: %s offers no batch-settlement channel this payer can use %v", probe.Request.URL.Redacted(), reasons)
	}
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	target := probe.Request.URL.String()
	for attempt := 0; ; attempt++ {
		st, s, again, err := p.refundOnce(ctx, &noRedirect, rpc, target, offer, i, amount)
		if !again || attempt > 0 {
			return st, s, err
		}
	}
}

// refundOnce signs and sends one refund; again says a corrective 402 resynced the channel, so it may be sent
// once more.
func (p *Payer) refundOnce(ctx context.Context, client *http.Client, rpc *chainReader, target string, offer Offer, i int, amount *big.Int) (ChannelState, x402.BatchSettleResponse, bool, error) {
	var none x402.BatchSettleResponse
	plan, err := p.planBatch(ctx, rpc, offer, i, true)
	if err != nil {
		return ChannelState{}, none, false, err
	}
	defer plan.finish()
	st := plan.ch.state
	if !plan.ch.known {
		return ChannelState{}, none, false, fmt.Errorf("payer: refund: this payer has not paid from channel %s and has no RPC to read it from the escrow", st.ID.Hex())
	}
	if st.Left().Sign() == 0 {
		return st.clone(), none, false, fmt.Errorf("payer: refund: channel %s has nothing left (balance %s, %s charged)", st.ID.Hex(), st.Balance, st.Charged)
	}
	pay, err := plan.sign(ctx, rpc, nil, true, amount)
	if err != nil {
		return ChannelState{}, none, false, err
	}
	resp, _, err := Fetch(ctx, client, http.MethodGet, target, pay.Header, pay.Value, maxOfferBody)
	if err != nil {
		return ChannelState{}, none, false, err
	}
	again, err := plan.answered(ctx, rpc, resp)
	if err != nil || again {
		return plan.ch.state.clone(), none, again, err
	}
	h := resp.Header.Get(x402.HeaderPaymentResponse)
	if h == "" {
		reason := ""
		if o, err := ReadOffer(resp.Header, nil); err == nil && o.Required.Error != "" {
			reason = ": " + o.Required.Error
		}
		return plan.ch.state.clone(), none, false, fmt.Errorf("payer: refund: the server answered %s with no %s%s", resp.Status, x402.HeaderPaymentResponse, reason)
	}
	s, err := x402.DecodeBatchSettleResponse(h)
	if err != nil {
		return plan.ch.state.clone(), none, false, fmt.Errorf("payer: refund: the %s header: %w", x402.HeaderPaymentResponse, err)
	}
	if !s.Success {
		return plan.ch.state.clone(), s, false, fmt.Errorf("payer: refund refused: %s: %s", s.ErrorReason, s.ErrorMessage)
	}
	return plan.ch.state.clone(), s, false, nil
}
