package x402

import (
	"encoding/json"
	"errors"
	"time"
)

// Protocol versions carried in x402Version.
const (
	Version1 = 1
	Version2 = 2
)

// Payment schemes: exact charges the amount signed; upto lets the payer sign a maximum, of which the resource
// server charges what the request used (any amount from zero up to it).
const (
	SchemeExact = "exact"
	SchemeUpto  = "upto"
)

// IsScheme reports whether s is a payment scheme this project implements.
func IsScheme(s string) bool { return s == SchemeExact || s == SchemeUpto }

// Asset transfer methods named in PaymentRequirements.extra.assetTransferMethod.
const (
	TransferPermit2 = "permit2"
	TransferERC2612 = "erc2612"
	// TransferEIP3009 is transferWithAuthorization (USDC and the tokens modelled on it): what the public SDKs
	// sign for a requirement that names no method.
	TransferEIP3009 = "eip3009"
)

// IsTransferMethod reports whether m is one of the asset transfer methods: permit2, eip3009 or erc2612.
func IsTransferMethod(m string) bool {
	return m == TransferPermit2 || m == TransferEIP3009 || m == TransferERC2612
}

// ExtensionEIP2612GasSponsoring is the extension under which a facilitator performs the payer's one-time
// Permit2 approval from an EIP-2612 permit, paying the gas itself.
const ExtensionEIP2612GasSponsoring = "eip2612GasSponsoring"

// ExtensionERC20ApprovalGasSponsoring is the extension under which a facilitator broadcasts the payer's own
// signed approve(Permit2, amount) transaction before the settlement, funding the gas it costs the payer: the
// way to Permit2 for a token without an EIP-2612 permit.
const ExtensionERC20ApprovalGasSponsoring = "erc20ApprovalGasSponsoring"

// Header names of the resource-server protocol. HTTP header names are case-insensitive; these are the
// canonical spellings that are emitted.
const (
	HeaderPaymentRequired  = "PAYMENT-REQUIRED"
	HeaderPaymentSignature = "PAYMENT-SIGNATURE"
	HeaderPaymentResponse  = "PAYMENT-RESPONSE"
	HeaderXPayment         = "X-PAYMENT"
	HeaderXPaymentResponse = "X-PAYMENT-RESPONSE"
	HeaderAPIKey           = "X-Api-Key"
)

// ResourceInfo describes the resource a payment buys (version 2: top level of PaymentRequired).
type ResourceInfo struct {
	URL         string `json:"url"`
	Description string `json:"description,omitempty"`
	MimeType    string `json:"mimeType,omitempty"`
	// ServiceName, Tags and IconURL describe the service for discovery (the bazaar extension's catalog).
	ServiceName string   `json:"serviceName,omitempty"`
	Tags        []string `json:"tags,omitempty"`
	IconURL     string   `json:"iconUrl,omitempty"`
}

// Extra is the scheme-specific metadata of a requirement or of a supported kind. For `exact` on EVM it names
// the transfer method and the token's permit domain; the remaining fields are hints a facilitator or gate adds.
type Extra struct {
	AssetTransferMethod string `json:"assetTransferMethod,omitempty"`
	Name                string `json:"name,omitempty"`
	Version             string `json:"version,omitempty"`
	// Spender is the settlement wallet an erc2612 payer must name as permit spender.
	Spender string `json:"spender,omitempty"`
	// Permit2Address and X402Permit2ProxyAddress are the contracts a permit2 payment goes through.
	Permit2Address          string `json:"permit2Address,omitempty"`
	X402Permit2ProxyAddress string `json:"x402Permit2ProxyAddress,omitempty"`
	// FacilitatorAddress (upto) is the settlement wallet the payer names in its witness: the upto proxy lets
	// only that address settle the payment.
	FacilitatorAddress string `json:"facilitatorAddress,omitempty"`
	// ReceiverAuthorizer (batch-settlement, in a supported kind) is the address whose key signs this
	// facilitator's claims: a route that names it as its receiverAuthorizer has its vouchers claimed by it.
	ReceiverAuthorizer string `json:"receiverAuthorizer,omitempty"`
	// WithdrawDelay (batch-settlement, in a 402's requirement) is the withdrawal delay in seconds every channel
	// paying the route must name, as BatchExtra.WithdrawDelay.
	WithdrawDelay int64 `json:"withdrawDelay,omitempty"`
	// ChannelState and VoucherState (batch-settlement, in a corrective 402's requirement) are the payer's channel
	// as the server holds it and the last voucher it accepted, so that a payer whose cumulative amount is not the
	// server's carries on from the server's (as BatchExtra's).
	ChannelState *BatchChannelState `json:"channelState,omitempty"`
	VoucherState *BatchVoucherState `json:"voucherState,omitempty"`
}

// PaymentRequirements is one way to pay for a resource (PaymentRequirementsItem of the spec, version 2).
type PaymentRequirements struct {
	Scheme            string `json:"scheme"`
	Network           string `json:"network"`
	Amount            string `json:"amount"`
	Asset             string `json:"asset"`
	PayTo             string `json:"payTo"`
	MaxTimeoutSeconds int64  `json:"maxTimeoutSeconds"`
	Extra             Extra  `json:"extra"`
}

// PaymentRequired is what a 402 answer offers, Base64-encoded in the PAYMENT-REQUIRED header (version 2).
type PaymentRequired struct {
	X402Version int                        `json:"x402Version"`
	Error       string                     `json:"error,omitempty"`
	Resource    ResourceInfo               `json:"resource"`
	Accepts     []PaymentRequirements      `json:"accepts"`
	Extensions  map[string]json.RawMessage `json:"extensions,omitempty"`
}

// EIP2612Authorization is the signed authorization of an erc2612 payment (an EIP-2612 permit) or of an eip3009
// payment (a TransferWithAuthorization), which share this shape. Numbers are decimal strings; an EIP-3009 nonce
// is 32 bytes in hex.
type EIP2612Authorization struct {
	From        string `json:"from"`
	To          string `json:"to"`
	Value       string `json:"value"`
	ValidAfter  string `json:"validAfter"`
	ValidBefore string `json:"validBefore"`
	Nonce       string `json:"nonce"`
}

// TokenPermissions is the token and amount a Permit2 signature allows to move.
type TokenPermissions struct {
	Token  string `json:"token"`
	Amount string `json:"amount"`
}

// Permit2Witness is the x402 witness bound into a Permit2 signature: who receives, and from when; for the upto
// scheme also which facilitator address alone may settle it (the exact scheme's witness has no such field).
type Permit2Witness struct {
	To          string `json:"to"`
	Facilitator string `json:"facilitator,omitempty"`
	ValidAfter  string `json:"validAfter"`
}

// Permit2Authorization is the signed PermitWitnessTransferFrom of a permit2 payment. Numbers are decimal strings;
// Spender is the x402ExactPermit2Proxy and Nonce is an unordered 256-bit Permit2 nonce.
type Permit2Authorization struct {
	From      string           `json:"from"`
	Permitted TokenPermissions `json:"permitted"`
	Spender   string           `json:"spender"`
	Nonce     string           `json:"nonce"`
	Deadline  string           `json:"deadline"`
	Witness   Permit2Witness   `json:"witness"`
}

// ExactEVMPayload is the signed part of an `exact` EVM payment: exactly one of Authorization (erc2612, and the
// EIP-3009 look-alike some clients send) or Permit2Authorization (permit2) is set.
type ExactEVMPayload struct {
	Signature            string                `json:"signature"`
	Authorization        *EIP2612Authorization `json:"authorization,omitempty"`
	Permit2Authorization *Permit2Authorization `json:"permit2Authorization,omitempty"`
}

// PayerAndNonce returns the payer the payload names and its authorization's nonce, for either transfer method,
// as sent (unchecked); both are "" when the payload carries no authorization.
func (p ExactEVMPayload) PayerAndNonce() (from, nonce string) {
	switch {
	case p.Permit2Authorization != nil:
		return p.Permit2Authorization.From, p.Permit2Authorization.Nonce
	case p.Authorization != nil:
		return p.Authorization.From, p.Authorization.Nonce
	}
	return "", ""
}

// maxDeadline (9999-12-31T23:59:59Z in unix seconds) is the latest deadline Deadline returns: a later one, up
// to 2^256-1 ("never expires"), is taken as this, which is never in practice and still a time that encodes
// (JSON and RFC 3339 stop at the year 9999).
const maxDeadline = 253402300799

// Deadline returns the last moment the payload's authorization can be settled: the permit2 deadline, or the
// erc2612 validBefore (unix seconds, as sent and unchecked), at most 9999-12-31. It is zero when the payload
// carries no authorization or the field is not a canonical decimal number.
func (p ExactEVMPayload) Deadline() time.Time {
	var s string
	switch {
	case p.Permit2Authorization != nil:
		s = p.Permit2Authorization.Deadline
	case p.Authorization != nil:
		s = p.Authorization.ValidBefore
	default:
		return time.Time{}
	}
	n, err := parseUint256(s)
	if err != nil {
		return time.Time{}
	}
	if !n.IsInt64() || n.Int64() > maxDeadline {
		return time.Unix(maxDeadline, 0).UTC()
	}
	return time.Unix(n.Int64(), 0).UTC()
}

// TransferMethod is the asset transfer method of payload p for requirement rq: as rq names it, else, for
// requirements that name none, as the payload's shape shows: a permit2Authorization is permit2, an
// authorization with a 32-byte hex nonce is EIP-3009 (what the public SDKs sign for such a requirement), and
// one with a decimal nonce is an EIP-2612 permit (erc2612, from requirements that predate the field).
func TransferMethod(rq PaymentRequirements, p ExactEVMPayload) string {
	if m := rq.Extra.AssetTransferMethod; m != "" {
		return m
	}
	switch {
	case p.Permit2Authorization != nil:
		return TransferPermit2
	case p.Authorization != nil && IsBytes32(p.Authorization.Nonce):
		return TransferEIP3009
	}
	return TransferERC2612
}

// BoundWallet is the settlement wallet that alone can settle a payment of rq with payload p, as the payload names
// it (unchecked): an upto witness's facilitator, an erc2612 permit's spender. It is "" for a payment any of the
// facilitator's wallets can settle (exact permit2, eip3009).
func BoundWallet(rq PaymentRequirements, p ExactEVMPayload) string {
	switch {
	case rq.Scheme == SchemeUpto && p.Permit2Authorization != nil:
		return p.Permit2Authorization.Witness.Facilitator
	case TransferMethod(rq, p) == TransferERC2612 && p.Authorization != nil:
		return p.Authorization.To
	}
	return ""
}

// PaymentPayload is the client's payment, Base64-encoded in the PAYMENT-SIGNATURE header (version 2).
type PaymentPayload struct {
	X402Version int                        `json:"x402Version"`
	Resource    *ResourceInfo              `json:"resource,omitempty"`
	Accepted    PaymentRequirements        `json:"accepted"`
	Payload     ExactEVMPayload            `json:"payload"`
	Extensions  map[string]json.RawMessage `json:"extensions,omitempty"`
}

// EIP2612GasSponsoringInfo is the payer's EIP-2612 permit to Permit2 carried in
// paymentPayload.extensions.eip2612GasSponsoring.info.
type EIP2612GasSponsoringInfo struct {
	From      string `json:"from"`
	Asset     string `json:"asset"`
	Spender   string `json:"spender"`
	Amount    string `json:"amount"`
	Nonce     string `json:"nonce"`
	Deadline  string `json:"deadline"`
	Signature string `json:"signature"`
	Version   string `json:"version"`
}

// GasSponsoring decodes the payment's eip2612GasSponsoring extension: its info, or an error when the extension is
// not {"info": {...}}; nil and ok false when the payment carries none.
func (p PaymentPayload) GasSponsoring() (info *EIP2612GasSponsoringInfo, ok bool, err error) {
	raw, ok := p.Extensions[ExtensionEIP2612GasSponsoring]
	if !ok {
		return nil, false, nil
	}
	var ext struct {
		Info *EIP2612GasSponsoringInfo `json:"info"`
	}
	if err := json.Unmarshal(raw, &ext); err != nil || ext.Info == nil {
		return nil, true, errors.New(`extensions.eip2612GasSponsoring must be {"info":{from, asset, spender, amount, nonce, deadline, signature, version}}`)
	}
	return ext.Info, true, nil
}

// ERC20ApprovalGasSponsoringInfo is the payer's signed approval of Permit2 carried in
// paymentPayload.extensions.erc20ApprovalGasSponsoring.info: SignedTransaction is the transaction's hex
// encoding as eth_sendRawTransaction takes it (an EIP-1559 one from the public SDK).
type ERC20ApprovalGasSponsoringInfo struct {
	From              string `json:"from"`
	Asset             string `json:"asset"`
	Spender           string `json:"spender"`
	Amount            string `json:"amount"`
	SignedTransaction string `json:"signedTransaction"`
	Version           string `json:"version"`
}

// ApprovalSponsoring decodes the payment's erc20ApprovalGasSponsoring extension: its info, or an error when the
// extension is not {"info": {...}}; nil and ok false when the payment carries none.
func (p PaymentPayload) ApprovalSponsoring() (info *ERC20ApprovalGasSponsoringInfo, ok bool, err error) {
	raw, ok := p.Extensions[ExtensionERC20ApprovalGasSponsoring]
	if !ok {
		return nil, false, nil
	}
	var ext struct {
		Info *ERC20ApprovalGasSponsoringInfo `json:"info"`
	}
	if err := json.Unmarshal(raw, &ext); err != nil || ext.Info == nil {
		return nil, true, errors.New(`extensions.erc20ApprovalGasSponsoring must be {"info":{from, asset, spender, amount, signedTransaction, version}}`)
	}
	return ext.Info, true, nil
}

// SettlementDeadline is the last moment the payment can be settled: its authorization's Deadline, or, when
// earlier, the deadline of the EIP-2612 permit its eip2612GasSponsoring extension carries, which its settlement
// applies unless the payer approved Permit2 already. Zero when the authorization names no deadline that reads; an
// extension that does not read leaves the authorization's (the facilitator refuses it, when it needs it).
func (p PaymentPayload) SettlementDeadline() time.Time {
	deadline := p.Payload.Deadline()
	info, ok, err := p.GasSponsoring()
	if !ok || err != nil || deadline.IsZero() {
		return deadline
	}
	if d, err := parseUint256(info.Deadline); err == nil && d.IsInt64() && d.Int64() < deadline.Unix() {
		return time.Unix(d.Int64(), 0).UTC()
	}
	return deadline
}

// VerifyRequest is the body of POST /verify. SettleRequest has the same shape.
type VerifyRequest struct {
	X402Version         int                 `json:"x402Version"`
	PaymentPayload      PaymentPayload      `json:"paymentPayload"`
	PaymentRequirements PaymentRequirements `json:"paymentRequirements"`
}

// SettleRequest is the body of POST /settle: the same payment and requirements as verified.
type SettleRequest = VerifyRequest

// VerifyResponse is the answer of POST /verify.
type VerifyResponse struct {
	IsValid        bool                       `json:"isValid"`
	Payer          string                     `json:"payer"`
	InvalidReason  string                     `json:"invalidReason,omitempty"`
	InvalidMessage string                     `json:"invalidMessage,omitempty"`
	Extensions     map[string]json.RawMessage `json:"extensions,omitempty"`
	// Extra is the scheme's own part of the answer, kept as it came: for batch-settlement, the channel as the
	// facilitator read it (a BatchChannelState), which the SDK's resource server keeps as its view of the channel.
	Extra json.RawMessage `json:"extra,omitempty"`
}

// SettleResponse is the answer of POST /settle, and Base64-encoded the PAYMENT-RESPONSE header.
// Transaction and Network are always present; Transaction is "" when nothing was broadcast.
type SettleResponse struct {
	Success      bool                       `json:"success"`
	Transaction  string                     `json:"transaction"`
	Network      string                     `json:"network"`
	Payer        string                     `json:"payer"`
	Amount       string                     `json:"amount,omitempty"`
	ErrorReason  string                     `json:"errorReason,omitempty"`
	ErrorMessage string                     `json:"errorMessage,omitempty"`
	Extensions   map[string]json.RawMessage `json:"extensions,omitempty"`
}

// Pending reports whether the settlement was broadcast but its receipt not yet seen: not a failure, and the
// payer must not pay again.
func (r SettleResponse) Pending() bool {
	return !r.Success && r.ErrorReason == ReasonSettlementPending
}

// Reverted reports whether a failed settlement says its transaction was mined and reverted: final, and no tokens
// moved.
func (r SettleResponse) Reverted() bool {
	return !r.Success && (r.ErrorReason == ReasonTransactionFailed || r.ErrorReason == ReasonUptoTransactionFailed)
}

// OutcomeUnknown reports whether a failed settlement leaves the payment's outcome unknown: pending, or a failure
// after a broadcast that does not say the transaction reverted. Facilitators keep the transaction's hash on every
// failure after they broadcast (and name no transaction when nothing was), so a failure naming one, or saying the
// receipt was not had (invalid_exact_evm_failed_to_get_receipt), is of a transaction that may still mine. Its
// payer must not be told to pay again.
func (r SettleResponse) OutcomeUnknown() bool {
	return r.Pending() || (!r.Success && !r.Reverted() && (r.Transaction != "" || r.ErrorReason == ReasonFailedToGetReceipt))
}

// SupportedKind is one (version, scheme, network) a facilitator serves.
type SupportedKind struct {
	X402Version int    `json:"x402Version"`
	Scheme      string `json:"scheme"`
	Network     string `json:"network"`
	Extra       Extra  `json:"extra"`
}

// SupportedResponse is the answer of GET /supported. Signers maps a CAIP-2 pattern such as "eip155:*" to the
// addresses the facilitator sends settlements from.
type SupportedResponse struct {
	Kinds      []SupportedKind     `json:"kinds"`
	Extensions []string            `json:"extensions"`
	Signers    map[string][]string `json:"signers"`
}

// HealthResponse is the answer of GET /health: {"status":"ok"} at least, with per-network detail.
type HealthResponse struct {
	Status   string          `json:"status"`
	Networks []NetworkHealth `json:"networks,omitempty"`
	// Refusals are the payments the facilitator refused lately, for an operator; absent from facilitators that
	// do not keep them.
	Refusals *RefusalsHealth `json:"refusals,omitempty"`
}

// Health statuses.
const (
	HealthOK       = "ok"
	HealthDegraded = "degraded"
	HealthDown     = "down"
)

// NetworkHealth is the health of one network a facilitator settles on.
type NetworkHealth struct {
	Network        string         `json:"network"`
	Status         string         `json:"status"`
	RPCReachable   bool           `json:"rpcReachable"`
	HeadBlock      uint64         `json:"headBlock,omitempty"`
	HeadAgeSeconds float64        `json:"headAgeSeconds,omitempty"`
	Wallets        []WalletHealth `json:"wallets,omitempty"`
	JournalBacklog int            `json:"journalBacklog"`
	Error          string         `json:"error,omitempty"`
	// PendingSettlements counts the journal's settlements on this network that are claimed or broadcast and not
	// final yet (payments served before settling, which wait their turn, are in JournalBacklog only);
	// OldestPendingSeconds is how long the oldest of them has been claimed.
	PendingSettlements   int     `json:"pendingSettlements"`
	OldestPendingSeconds float64 `json:"oldestPendingSeconds,omitempty"`
}

// WalletHealth is the native balance of one settlement wallet (wei, decimal) and whether it is running low.
type WalletHealth struct {
	Address string `json:"address"`
	Balance string `json:"balance"`
	Low     bool   `json:"low"`
	// InFlight counts the settlements the wallet sent (this process or another sharing its journal) that are
	// not final yet.
	InFlight int `json:"inFlight"`
}

// RefusalsHealth is what a facilitator keeps in memory of the payments it refused since it started: counts by
// network and reason, and the latest few. It holds no payment and no signature, only the payer's address.
type RefusalsHealth struct {
	Total  int            `json:"total"`
	Counts []RefusalCount `json:"counts"`
	Recent []Refusal      `json:"recent"`
}

// RefusalCount is how many payments on one network were refused for one reason.
type RefusalCount struct {
	Network string `json:"network"`
	Reason  string `json:"reason"`
	Count   int    `json:"count"`
}

// Refusal is one refused payment: when, by which call (verify or settle), on which network, why, and the payer.
type Refusal struct {
	At      time.Time `json:"at"`
	Op      string    `json:"op"`
	Network string    `json:"network"`
	Reason  string    `json:"reason"`
	Payer   string    `json:"payer,omitempty"`
}
