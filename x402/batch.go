package x402

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
)

// The batch-settlement scheme (npm @x402/evm 2.27, batch-settlement/): the payer deposits once into an escrow
// channel, then pays each request with a cumulative EIP-712 voucher the server checks off chain; the receiver
// claims vouchers on chain in batches and settles what was claimed. Its documents do not fit the exact and upto
// types (the payload is one of several kinds, the requirements' extra names a channel's parties and delay), so
// they have their own types and decoders here, as strict as the others: field paths in errors, required members,
// one kind per payload.

// SchemeBatchSettlement is the scheme name of batch-settlement payments.
const SchemeBatchSettlement = "batch-settlement"

// BatchFacilitator is a facilitator that verifies and settles batch-settlement payments besides the schemes of
// Facilitator: the embedded engine, and a facilitator server's backend when it serves the scheme.
type BatchFacilitator interface {
	// VerifyBatch checks a deposit, voucher or refund payment against its requirements, changing nothing.
	VerifyBatch(ctx context.Context, req BatchRequest) (VerifyResponse, error)
	// SettleBatch settles it: a deposit is sent on chain, a voucher recorded (its answer names the commitment).
	SettleBatch(ctx context.Context, req BatchRequest) (BatchSettleResponse, error)
}

// Kinds of batch-settlement payload, in its "type" member. A client pays with a deposit (the first payment of a
// channel, or a top-up), a voucher, or asks for a refund; a /settle request carries a deposit, a claim of
// vouchers, a settle of what was claimed, or a refund enriched with the receiver's claims and signatures.
const (
	BatchDeposit = "deposit"
	BatchVoucher = "voucher"
	BatchRefund  = "refund"
	BatchClaim   = "claim"
	BatchSettle  = "settle"
)

// ChannelConfig is the immutable configuration of a channel; its EIP-712 hash under the batch-settlement
// domain is the channel id. PayerAuthorizer signs the vouchers (the zero address: the payer itself, checked by
// ERC-1271 when it is a contract); ReceiverAuthorizer signs claims and refunds. Salt is a bytes32 in hex.
type ChannelConfig struct {
	Payer              string `json:"payer"`
	PayerAuthorizer    string `json:"payerAuthorizer"`
	Receiver           string `json:"receiver"`
	ReceiverAuthorizer string `json:"receiverAuthorizer"`
	Token              string `json:"token"`
	WithdrawDelay      int64  `json:"withdrawDelay"`
	Salt               string `json:"salt"`
}

// BatchVoucherFields is a signed cumulative voucher: the channel's receiver may claim up to MaxClaimableAmount
// (decimal, in total over the channel's life) from the channel ChannelID (bytes32 hex).
type BatchVoucherFields struct {
	ChannelID          string `json:"channelId"`
	MaxClaimableAmount string `json:"maxClaimableAmount"`
	Signature          string `json:"signature"`
}

// BatchERC3009Authorization is an ERC-3009 ReceiveWithAuthorization of a deposit, signed to the ERC-3009
// deposit collector: its nonce is keccak256(abi.encode(channelId, salt)), so it names the channel.
type BatchERC3009Authorization struct {
	ValidAfter  string `json:"validAfter"`
	ValidBefore string `json:"validBefore"`
	Salt        string `json:"salt"`
	Signature   string `json:"signature"`
}

// BatchPermit2Witness is the witness of a deposit's Permit2 signature: the channel it funds.
type BatchPermit2Witness struct {
	ChannelID string `json:"channelId"`
}

// BatchPermit2Authorization is a Permit2 PermitWitnessTransferFrom of a deposit, spent by the Permit2 deposit
// collector.
type BatchPermit2Authorization struct {
	From      string              `json:"from"`
	Permitted TokenPermissions    `json:"permitted"`
	Spender   string              `json:"spender"`
	Nonce     string              `json:"nonce"`
	Deadline  string              `json:"deadline"`
	Witness   BatchPermit2Witness `json:"witness"`
	Signature string              `json:"signature"`
}

// BatchDepositAuthorization carries exactly one of the two ways a deposit moves the payer's tokens.
type BatchDepositAuthorization struct {
	ERC3009Authorization *BatchERC3009Authorization `json:"erc3009Authorization,omitempty"`
	Permit2Authorization *BatchPermit2Authorization `json:"permit2Authorization,omitempty"`
}

// BatchDepositFields is the deposit of a deposit payload: Amount (decimal) moved into the channel.
type BatchDepositFields struct {
	Amount        string                    `json:"amount"`
	Authorization BatchDepositAuthorization `json:"authorization"`
}

// BatchClaimedVoucher is the voucher of a claim: the channel's whole configuration and the signed amount.
type BatchClaimedVoucher struct {
	Channel            ChannelConfig `json:"channel"`
	MaxClaimableAmount string        `json:"maxClaimableAmount"`
}

// BatchVoucherClaim is one voucher claimed on chain: the receiver takes the channel's total claimed to
// TotalClaimed, at most the voucher's MaxClaimableAmount.
type BatchVoucherClaim struct {
	Voucher      BatchClaimedVoucher `json:"voucher"`
	Signature    string              `json:"signature"`
	TotalClaimed string              `json:"totalClaimed"`
}

// BatchPayload is the payload of a batch-settlement payment or /settle request: Type says which kind and so
// which members are there (the decoders check that they are):
//   - deposit: ChannelConfig, Voucher, Deposit;
//   - voucher: ChannelConfig, Voucher;
//   - refund: ChannelConfig, Voucher (signed at the charged cumulative amount), Amount if not all; a /settle
//     request's refund adds RefundNonce, Amount, Claims and the receiver authorizer's signatures;
//   - claim: Claims and ClaimAuthorizerSignature;
//   - settle: Receiver and Token.
type BatchPayload struct {
	Type          string              `json:"type"`
	ChannelConfig *ChannelConfig      `json:"channelConfig,omitempty"`
	Voucher       *BatchVoucherFields `json:"voucher,omitempty"`
	Deposit       *BatchDepositFields `json:"deposit,omitempty"`
	// Amount is a refund's amount (decimal); a client's refund without one asks for all that is left.
	Amount      string `json:"amount,omitempty"`
	RefundNonce string `json:"refundNonce,omitempty"`
	// Claims is kept when empty (a refund with nothing to claim first), which the public SDK's refund needs
	// to see as a member.
	Claims                    []BatchVoucherClaim `json:"claims,omitzero"`
	ClaimAuthorizerSignature  string              `json:"claimAuthorizerSignature,omitempty"`
	RefundAuthorizerSignature string              `json:"refundAuthorizerSignature,omitempty"`
	Receiver                  string              `json:"receiver,omitempty"`
	Token                     string              `json:"token,omitempty"`
}

// BatchChannelState is a server's or facilitator's view of a channel, in requirements and answers: the
// channel's balance (the deposit), what was claimed on chain, when a withdrawal was asked for (unix seconds,
// 0 for none), the next refund nonce and, from a server, what it has charged in total.
type BatchChannelState struct {
	ChannelID               string `json:"channelId"`
	Balance                 string `json:"balance"`
	TotalClaimed            string `json:"totalClaimed"`
	WithdrawRequestedAt     int64  `json:"withdrawRequestedAt"`
	RefundNonce             string `json:"refundNonce"`
	ChargedCumulativeAmount string `json:"chargedCumulativeAmount,omitempty"`
}

// BatchVoucherState is the last voucher a server holds for a channel, sent back so a client that lost its
// state can carry on from it.
type BatchVoucherState struct {
	SignedMaxClaimable string `json:"signedMaxClaimable,omitempty"`
	Signature          string `json:"signature,omitempty"`
}

// BatchExtra is the extra of a batch-settlement requirement: the receiver authorizer every channel must name,
// the withdrawal delay (seconds), the token's EIP-712 domain for ERC-3009 deposits, the transfer method of
// deposits (eip3009 unless permit2), the smallest deposit the server takes, and, on a corrective 402, the
// server's view of the payer's channel and its last voucher.
type BatchExtra struct {
	ReceiverAuthorizer  string             `json:"receiverAuthorizer,omitempty"`
	WithdrawDelay       int64              `json:"withdrawDelay,omitempty"`
	Name                string             `json:"name,omitempty"`
	Version             string             `json:"version,omitempty"`
	AssetTransferMethod string             `json:"assetTransferMethod,omitempty"`
	MinDeposit          string             `json:"minDeposit,omitempty"`
	ChannelState        *BatchChannelState `json:"channelState,omitempty"`
	VoucherState        *BatchVoucherState `json:"voucherState,omitempty"`
}

// BatchRequirements is a batch-settlement PaymentRequirements: the generic members and a BatchExtra.
type BatchRequirements struct {
	Scheme            string     `json:"scheme"`
	Network           string     `json:"network"`
	Amount            string     `json:"amount"`
	Asset             string     `json:"asset"`
	PayTo             string     `json:"payTo"`
	MaxTimeoutSeconds int64      `json:"maxTimeoutSeconds"`
	Extra             BatchExtra `json:"extra"`
}

// Generic returns the members every scheme shares, as a PaymentRequirements (the transfer method and token
// domain in its Extra), for the code that prices and matches offers whatever the scheme.
func (r BatchRequirements) Generic() PaymentRequirements {
	return PaymentRequirements{
		Scheme: r.Scheme, Network: r.Network, Amount: r.Amount, Asset: r.Asset, PayTo: r.PayTo,
		MaxTimeoutSeconds: r.MaxTimeoutSeconds,
		Extra:             Extra{AssetTransferMethod: r.Extra.AssetTransferMethod, Name: r.Extra.Name, Version: r.Extra.Version},
	}
}

// BatchPayment is a batch-settlement payment (version 2), Base64-encoded in the PAYMENT-SIGNATURE header, or the
// paymentPayload of a batch /verify or /settle request.
type BatchPayment struct {
	X402Version int                        `json:"x402Version"`
	Resource    *ResourceInfo              `json:"resource,omitempty"`
	Accepted    BatchRequirements          `json:"accepted"`
	Payload     BatchPayload               `json:"payload"`
	Extensions  map[string]json.RawMessage `json:"extensions,omitempty"`
}

// BatchRequest is the body of a batch-settlement POST /verify or POST /settle.
type BatchRequest struct {
	X402Version         int               `json:"x402Version"`
	PaymentPayload      BatchPayment      `json:"paymentPayload"`
	PaymentRequirements BatchRequirements `json:"paymentRequirements"`
}

// BatchResponseExtra is the extra of a batch-settlement settlement answer: what this request was charged, and
// the channel as the server sees it after it (its chargedCumulativeAmount the new total).
type BatchResponseExtra struct {
	ChargedAmount string             `json:"chargedAmount,omitempty"`
	ChannelState  *BatchChannelState `json:"channelState,omitempty"`
	VoucherState  *BatchVoucherState `json:"voucherState,omitempty"`
}

// BatchSettleResponse is a batch-settlement settlement answer: a SettleResponse with the scheme's extra. A
// voucher's settlement sends nothing (Transaction is ""): the commitment it stored is named by the channel and
// its new cumulative amount (Commitment).
type BatchSettleResponse struct {
	Success      bool                       `json:"success"`
	Transaction  string                     `json:"transaction"`
	Network      string                     `json:"network"`
	Payer        string                     `json:"payer,omitempty"`
	Amount       string                     `json:"amount,omitempty"`
	ErrorReason  string                     `json:"errorReason,omitempty"`
	ErrorMessage string                     `json:"errorMessage,omitempty"`
	Extensions   map[string]json.RawMessage `json:"extensions,omitempty"`
	Extra        *BatchResponseExtra        `json:"extra,omitempty"`
}

// Commitment is the identifier of what a successful settlement committed, which the scheme's spec requires of
// every success: the channel and the cumulative amount it now stands at ("<channelId>@<amount>", the channel id
// in lower case), when the answer names them, else the transaction (a claim, settle, refund or deposit); "" when
// the answer names neither.
func (r BatchSettleResponse) Commitment() string {
	if cs := r.Extra.channelState(); cs != nil && cs.ChannelID != "" && cs.ChargedCumulativeAmount != "" {
		return strings.ToLower(cs.ChannelID) + "@" + cs.ChargedCumulativeAmount
	}
	return r.Transaction
}

func (e *BatchResponseExtra) channelState() *BatchChannelState {
	if e == nil {
		return nil
	}
	return e.ChannelState
}

// Names of the batch documents, as DecodeError.Doc spells them.
const (
	docBatchPayment        = "batch-settlement payment"
	docBatchRequest        = "batch-settlement request"
	docBatchRequirements   = "batch-settlement requirements"
	docBatchSettleResponse = "batch-settlement settle response"
)

// batchKinds is the set of payload kinds a document may carry.
type batchKinds uint8

const (
	kindDeposit batchKinds = 1 << iota
	kindVoucher
	kindRefund
	kindClaim
	kindSettle
	// kindEnrichedRefund: a refund as a /settle request carries it.
	kindEnrichedRefund
)

// Payload kinds: what a client pays with (and a /verify request verifies), and what a /settle request does.
const (
	clientKinds = kindDeposit | kindVoucher | kindRefund
	settleKinds = kindDeposit | kindClaim | kindSettle | kindEnrichedRefund
)

func (k batchKinds) names() string {
	var out []string
	for _, n := range []struct {
		k    batchKinds
		name string
	}{{kindDeposit, BatchDeposit}, {kindVoucher, BatchVoucher}, {kindRefund | kindEnrichedRefund, BatchRefund}, {kindClaim, BatchClaim}, {kindSettle, BatchSettle}} {
		if k&n.k != 0 {
			out = append(out, fmt.Sprintf("%q", n.name))
		}
	}
	return strings.Join(out, ", ")
}

// DecodeBatchPayment decodes a batch-settlement PAYMENT-SIGNATURE header value (version 2): a deposit, voucher or
// refund payment. Any problem is a *DecodeError naming the field.
func DecodeBatchPayment(header string) (BatchPayment, error) {
	doc, err := decodeHeader(docPaymentHeader, header)
	if err != nil {
		return BatchPayment{}, err
	}
	return readBatchPayment(docPaymentHeader, doc)
}

// ReadBatchPaymentHeader reads a batch-settlement payment from the JSON of a PAYMENT-SIGNATURE header that
// HeaderJSON decoded, with the checks of DecodeBatchPayment: for a caller that looked into the JSON first,
// so that the header's Base64 is decoded once.
func ReadBatchPaymentHeader(doc []byte) (BatchPayment, error) {
	return readBatchPayment(docPaymentHeader, doc)
}

// UnmarshalBatchPayment decodes a batch-settlement payment given as JSON, with the checks of DecodeBatchPayment.
func UnmarshalBatchPayment(data []byte) (BatchPayment, error) {
	if err := checkBody(docBatchPayment, data); err != nil {
		return BatchPayment{}, err
	}
	return readBatchPayment(docBatchPayment, data)
}

func readBatchPayment(docName string, doc []byte) (BatchPayment, error) {
	c := checker{doc: doc}
	var p BatchPayment
	c.unmarshal(&p)
	if c.version(nil, p.X402Version, docPaymentVersioned, onlyV2) && c.decoded {
		c.batchPayment(nil, &p, clientKinds, true)
	}
	if err := c.finish(docName); err != nil {
		return BatchPayment{}, err
	}
	return p, nil
}

// DecodeBatchVerifyRequest decodes the body of a batch-settlement POST /verify: a deposit, voucher or refund,
// and the requirements it is verified against.
func DecodeBatchVerifyRequest(body []byte) (BatchRequest, error) {
	return decodeBatchRequest(body, clientKinds)
}

// DecodeBatchSettleRequest decodes the body of a batch-settlement POST /settle: a deposit, a claim, a settle or
// an enriched refund. Its requirements may name no timeout and carry an empty extra, as a receiver's claims and
// settles do (they pay for no resource).
func DecodeBatchSettleRequest(body []byte) (BatchRequest, error) {
	return decodeBatchRequest(body, settleKinds)
}

func decodeBatchRequest(body []byte, kinds batchKinds) (BatchRequest, error) {
	if err := checkBody(docBatchRequest, body); err != nil {
		return BatchRequest{}, err
	}
	c := checker{doc: body}
	var req BatchRequest
	c.unmarshal(&req)
	if c.version(nil, req.X402Version, "a request", onlyV2) && c.decoded {
		at := (*fieldPath)(nil).key("paymentPayload")
		// Only a payment for a resource (verify: deposit, voucher, refund) needs the offer's terms in full.
		forResource := kinds == clientKinds
		switch {
		case !c.present(nil, "paymentPayload", req.PaymentPayload.zero()):
			c.missing(nil, "paymentPayload")
		case c.version(&at, req.PaymentPayload.X402Version, "the payment of a request", onlyV2):
			c.batchPayment(&at, &req.PaymentPayload, kinds, forResource)
		}
		if c.present(nil, "paymentRequirements", req.PaymentRequirements == BatchRequirements{}) {
			rq := (*fieldPath)(nil).key("paymentRequirements")
			c.batchRequirements(&rq, &req.PaymentRequirements, forResource)
		} else {
			c.missing(nil, "paymentRequirements")
		}
	}
	if err := c.finish(docBatchRequest); err != nil {
		return BatchRequest{}, err
	}
	return req, nil
}

// UnmarshalBatchRequirements decodes one batch-settlement PaymentRequirements given as JSON (an element of a
// 402's accepts): every generic member, and an extra naming the receiver authorizer.
func UnmarshalBatchRequirements(data []byte) (BatchRequirements, error) {
	if err := checkBody(docBatchRequirements, data); err != nil {
		return BatchRequirements{}, err
	}
	c := checker{doc: data}
	var rq BatchRequirements
	if c.unmarshal(&rq); c.decoded {
		c.batchRequirements(nil, &rq, true)
	}
	if err := c.finish(docBatchRequirements); err != nil {
		return BatchRequirements{}, err
	}
	return rq, nil
}

// DecodeBatchSettleResponse decodes a batch-settlement PAYMENT-RESPONSE header value; a success must name its
// commitment (see BatchSettleResponse.Commitment).
func DecodeBatchSettleResponse(header string) (BatchSettleResponse, error) {
	doc, err := decodeHeader(docPaymentResponse, header)
	if err != nil {
		return BatchSettleResponse{}, err
	}
	return readBatchSettleResponse(docPaymentResponse, doc)
}

// UnmarshalBatchSettleResponse decodes the JSON body of a batch-settlement /settle answer, with the checks of
// DecodeBatchSettleResponse.
func UnmarshalBatchSettleResponse(body []byte) (BatchSettleResponse, error) {
	if err := checkBody(docBatchSettleResponse, body); err != nil {
		return BatchSettleResponse{}, err
	}
	return readBatchSettleResponse(docBatchSettleResponse, body)
}

func readBatchSettleResponse(docName string, doc []byte) (BatchSettleResponse, error) {
	c := checker{doc: doc}
	var s BatchSettleResponse
	if c.unmarshal(&s); c.decoded {
		c.require(nil, "success", !s.Success)
		if s.Extra != nil && s.Extra.ChannelState != nil {
			at := (*fieldPath)(nil).key("extra")
			cs := at.key("channelState")
			c.requireString(&cs, "channelId", s.Extra.ChannelState.ChannelID)
		}
		if s.Success && s.Commitment() == "" && c.err == nil {
			at := (*fieldPath)(nil).key("transaction")
			c.fail(DecodeMissingField, &at, "is empty and extra.channelState names no channelId and chargedCumulativeAmount: a successful batch settlement names its commitment")
		}
		s.Extensions = compactExtensions(s.Extensions)
	}
	if err := c.finish(docName); err != nil {
		return BatchSettleResponse{}, err
	}
	return s, nil
}

// batchPayment checks a batch payment's members once its version is known: accepted (batch-settlement
// requirements) and a payload of one of kinds.
func (c *checker) batchPayment(at *fieldPath, p *BatchPayment, kinds batchKinds, forResource bool) {
	if c.present(at, "accepted", p.Accepted == BatchRequirements{}) {
		f := at.key("accepted")
		c.batchRequirements(&f, &p.Accepted, forResource)
	} else {
		c.missing(at, "accepted")
	}
	if c.present(at, "payload", p.Payload.zero()) {
		f := at.key("payload")
		c.batchPayload(&f, &p.Payload, kinds)
	} else {
		c.missing(at, "payload")
	}
	p.Extensions = compactExtensions(p.Extensions)
}

func (p *BatchPayment) zero() bool {
	return p.X402Version == 0 && p.Resource == nil && p.Accepted == BatchRequirements{} && p.Payload.zero() && p.Extensions == nil
}

func (p *BatchPayload) zero() bool {
	return p.Type == "" && p.ChannelConfig == nil && p.Voucher == nil && p.Deposit == nil && p.Claims == nil &&
		p.Amount == "" && p.RefundNonce == "" && p.ClaimAuthorizerSignature == "" && p.RefundAuthorizerSignature == "" &&
		p.Receiver == "" && p.Token == ""
}

// batchRequirements checks batch-settlement requirements: the scheme by name, the generic members, and, for the
// requirements of a resource, a positive timeout and an extra naming the receiver authorizer.
func (c *checker) batchRequirements(at *fieldPath, rq *BatchRequirements, forResource bool) {
	c.requireString(at, "scheme", rq.Scheme)
	if c.err == nil && rq.Scheme != SchemeBatchSettlement {
		f := at.key("scheme")
		c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %s, expected %q", quoteInput(rq.Scheme), SchemeBatchSettlement))
	}
	c.requireString(at, "network", rq.Network)
	c.requireString(at, "amount", rq.Amount)
	c.requireString(at, "asset", rq.Asset)
	c.requireString(at, "payTo", rq.PayTo)
	c.require(at, "maxTimeoutSeconds", rq.MaxTimeoutSeconds == 0)
	c.require(at, "extra", rq.Extra == BatchExtra{})
	if !forResource {
		if c.err == nil && rq.MaxTimeoutSeconds < 0 {
			f := at.key("maxTimeoutSeconds")
			c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %d, expected 0 or more seconds", rq.MaxTimeoutSeconds))
		}
		return
	}
	c.positiveTimeout(at, rq.MaxTimeoutSeconds)
	ex := at.key("extra")
	c.requireString(&ex, "receiverAuthorizer", rq.Extra.ReceiverAuthorizer)
	if c.err == nil && rq.Extra.WithdrawDelay < 0 {
		f := ex.key("withdrawDelay")
		c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %d, expected seconds", rq.Extra.WithdrawDelay))
	}
	if m := rq.Extra.AssetTransferMethod; c.err == nil && m != "" && m != TransferEIP3009 && m != TransferPermit2 {
		f := ex.key("assetTransferMethod")
		c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %s, expected %q or %q", quoteInput(m), TransferEIP3009, TransferPermit2))
	}
	if cs := rq.Extra.ChannelState; cs != nil {
		f := ex.key("channelState")
		c.requireString(&f, "channelId", cs.ChannelID)
	}
}

// batchPayload checks a payload's type against kinds, then the members its kind requires.
func (c *checker) batchPayload(at *fieldPath, p *BatchPayload, kinds batchKinds) {
	c.requireString(at, "type", p.Type)
	if c.err != nil {
		return
	}
	var kind batchKinds
	switch p.Type {
	case BatchDeposit:
		kind = kindDeposit
	case BatchVoucher:
		kind = kindVoucher
	case BatchRefund:
		kind = kindRefund
		if kinds&kindEnrichedRefund != 0 {
			kind = kindEnrichedRefund
		}
	case BatchClaim:
		kind = kindClaim
	case BatchSettle:
		kind = kindSettle
	}
	if kind&kinds == 0 {
		f := at.key("type")
		c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %s, expected one of %s here", quoteInput(p.Type), kinds.names()))
		return
	}
	switch kind {
	case kindDeposit, kindVoucher, kindRefund, kindEnrichedRefund:
		c.channelConfig(at, p.ChannelConfig)
		c.batchVoucher(at, p.Voucher)
	}
	switch kind {
	case kindDeposit:
		c.batchDeposit(at, p.Deposit)
	case kindEnrichedRefund:
		c.requireString(at, "amount", p.Amount)
		c.requireString(at, "refundNonce", p.RefundNonce)
		c.batchClaims(at, p.Claims, true)
	case kindClaim:
		c.batchClaims(at, p.Claims, false)
	case kindSettle:
		c.requireString(at, "receiver", p.Receiver)
		c.requireString(at, "token", p.Token)
	}
	// A client's refund may leave amount out (all that is left), but an amount sent empty is a mistake.
	if kind == kindRefund && p.Amount == "" && c.err == nil && c.member(at, "amount") != nil {
		f := at.key("amount")
		c.fail(DecodeMissingField, &f, "is empty or null; leave it out to ask for all that is left")
	}
}

// channelConfig checks a payload's channelConfig: present, every member a string but withdrawDelay, a number.
func (c *checker) channelConfig(at *fieldPath, cfg *ChannelConfig) {
	if c.err != nil {
		return
	}
	if cfg == nil {
		c.missing(at, "channelConfig")
		return
	}
	f := at.key("channelConfig")
	c.channelConfigMembers(&f, cfg)
}

func (c *checker) channelConfigMembers(at *fieldPath, cfg *ChannelConfig) {
	c.requireString(at, "payer", cfg.Payer)
	c.requireString(at, "payerAuthorizer", cfg.PayerAuthorizer)
	c.requireString(at, "receiver", cfg.Receiver)
	c.requireString(at, "receiverAuthorizer", cfg.ReceiverAuthorizer)
	c.requireString(at, "token", cfg.Token)
	c.require(at, "withdrawDelay", cfg.WithdrawDelay == 0)
	if c.err == nil && cfg.WithdrawDelay < 0 {
		f := at.key("withdrawDelay")
		c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %d, expected seconds", cfg.WithdrawDelay))
	}
	c.requireString(at, "salt", cfg.Salt)
}

// batchVoucher checks a payload's voucher: present, its three members strings.
func (c *checker) batchVoucher(at *fieldPath, v *BatchVoucherFields) {
	if c.err != nil {
		return
	}
	if v == nil {
		c.missing(at, "voucher")
		return
	}
	f := at.key("voucher")
	c.requireString(&f, "channelId", v.ChannelID)
	c.requireString(&f, "maxClaimableAmount", v.MaxClaimableAmount)
	c.requireString(&f, "signature", v.Signature)
}

// batchDeposit checks a deposit: an amount and exactly one authorization, complete.
func (c *checker) batchDeposit(at *fieldPath, d *BatchDepositFields) {
	if c.err != nil {
		return
	}
	if d == nil {
		c.missing(at, "deposit")
		return
	}
	f := at.key("deposit")
	c.requireString(&f, "amount", d.Amount)
	a := d.Authorization
	if !c.present(&f, "authorization", a == BatchDepositAuthorization{}) {
		c.missing(&f, "authorization")
		return
	}
	auth := f.key("authorization")
	switch {
	case a.ERC3009Authorization == nil && a.Permit2Authorization == nil:
		e := auth.key("erc3009Authorization")
		c.fail(DecodeMissingField, &e, "is missing: expected exactly one of erc3009Authorization or permit2Authorization")
	case a.ERC3009Authorization != nil && a.Permit2Authorization != nil:
		c.fail(DecodeInvalidValue, &auth, "has both erc3009Authorization and permit2Authorization, expected exactly one")
	case a.ERC3009Authorization != nil:
		e := auth.key("erc3009Authorization")
		x := a.ERC3009Authorization
		c.requireString(&e, "validAfter", x.ValidAfter)
		c.requireString(&e, "validBefore", x.ValidBefore)
		c.requireString(&e, "salt", x.Salt)
		c.requireString(&e, "signature", x.Signature)
	default:
		e := auth.key("permit2Authorization")
		x := a.Permit2Authorization
		c.requireString(&e, "from", x.From)
		if c.present(&e, "permitted", x.Permitted == TokenPermissions{}) {
			p := e.key("permitted")
			c.requireString(&p, "token", x.Permitted.Token)
			c.requireString(&p, "amount", x.Permitted.Amount)
		} else {
			c.missing(&e, "permitted")
		}
		c.requireString(&e, "spender", x.Spender)
		c.requireString(&e, "nonce", x.Nonce)
		c.requireString(&e, "deadline", x.Deadline)
		if c.present(&e, "witness", x.Witness == BatchPermit2Witness{}) {
			w := e.key("witness")
			c.requireString(&w, "channelId", x.Witness.ChannelID)
		} else {
			c.missing(&e, "witness")
		}
		c.requireString(&e, "signature", x.Signature)
	}
}

// batchClaims checks the claims of a claim or enriched refund: an array (which a refund may leave empty, a claim
// may not), each element complete.
func (c *checker) batchClaims(at *fieldPath, claims []BatchVoucherClaim, mayBeEmpty bool) {
	if c.err != nil {
		return
	}
	f := at.key("claims")
	if claims == nil {
		c.missing(at, "claims")
		return
	}
	if len(claims) == 0 && !mayBeEmpty {
		c.fail(DecodeMissingField, &f, "is empty, expected at least one voucher claim")
		return
	}
	for i := range claims {
		e := f.elem(i)
		cl := &claims[i]
		if c.err == nil && cl.Voucher == (BatchClaimedVoucher{}) && cl.Signature == "" && cl.TotalClaimed == "" {
			if v, _ := locate(c.doc, pointerOf(e.String())); v.Kind() == 'n' {
				c.fail(DecodeWrongType, &e, "got null, expected a voucher claim object")
			}
		}
		if c.present(&e, "voucher", cl.Voucher == BatchClaimedVoucher{}) {
			v := e.key("voucher")
			if c.present(&v, "channel", cl.Voucher.Channel == ChannelConfig{}) {
				ch := v.key("channel")
				c.channelConfigMembers(&ch, &cl.Voucher.Channel)
			} else {
				c.missing(&v, "channel")
			}
			c.requireString(&v, "maxClaimableAmount", cl.Voucher.MaxClaimableAmount)
		} else {
			c.missing(&e, "voucher")
		}
		c.requireString(&e, "signature", cl.Signature)
		c.requireString(&e, "totalClaimed", cl.TotalClaimed)
	}
}
