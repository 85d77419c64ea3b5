package chain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A batch-settlement deposit is, on chain, a payment like an exact eip3009 one: the payer's ERC-3009
// ReceiveWithAuthorization moves its tokens, to the deposit collector, which the escrow's deposit call spends. So
// it is settled as one, by the same machinery (settle.go): its journal id is the authorization's (the token's
// nonce of the payer, single-use), it is claimed before it is signed, recorded broadcast (raw transaction and
// all) before it leaves, reconciled, and its funds held as any payment's (funds.go). Only its call (the escrow's
// deposit), its refusals' names and its answer (a BatchSettleResponse) are its own. The journal keeps its
// x402.BatchRequest as the record's Request, which parseRecorded reads back.

// depositGas is the gas limit of an escrow deposit through the ERC-3009 collector (about 110k used).
const depositGas = 250_000

// batchDeposit is what a deposit's settlement sends: the escrow's deposit of amount into channel cfg through
// the ERC-3009 collector, with the payer's authorization as the collector's data.
type batchDeposit struct {
	terms *BatchTerms
	cfg   contracts.ChannelConfig
	id    common.Hash
	// collector is the deposit collector the escrow pulls the tokens through (ERC-3009 or Permit2), and
	// collectorData the payer's authorization as that collector takes it.
	collector     common.Address
	collectorData []byte
}

// calls is the deposit's one transaction, from any settlement wallet.
func (d *batchDeposit) calls(p *payment) ([]contractCall, error) {
	data, err := contracts.PackBatchDeposit(d.cfg, p.amount, d.collector, d.collectorData)
	if err != nil {
		return nil, err
	}
	return []contractCall{{To: contracts.BatchSettlementAddress, Data: data, Gas: depositGas}}, nil
}

// parseRecorded parses a payment as the journal keeps it (Record.Request): a settle request of exact or upto, or
// a batch-settlement deposit's request. An error says it cannot be read at all; a refusal, that it no longer
// parses to a payment.
func (f *Facilitator) parseRecorded(raw []byte) (*payment, *refusal, error) {
	var probe struct {
		PaymentRequirements struct {
			Scheme string `json:"scheme"`
		} `json:"paymentRequirements"`
	}
	if err := json.Unmarshal(raw, &probe); err != nil {
		return nil, nil, err
	}
	if probe.PaymentRequirements.Scheme == x402.SchemeBatchSettlement {
		var req x402.BatchRequest
		if err := json.Unmarshal(raw, &req); err != nil {
			return nil, nil, err
		}
		p, r := f.parseDeposit(req, true)
		if r != nil {
			return nil, refuse(r.Reason, "%s", r.Message), nil
		}
		return p, nil, nil
	}
	var req x402.SettleRequest
	if err := json.Unmarshal(raw, &req); err != nil {
		return nil, nil, err
	}
	p, ref := f.parse(req, true)
	return p, ref, nil
}

// parseDeposit parses a deposit payment into the payment its settlement sends, after the off-chain checks of its
// authorization (BatchTerms.CheckDepositAuthorization). The voucher it carries is checkVoucher's. A deposit read
// back from its journal record (recorded) is checked at the start of its validity window rather than now: as an
// exact payment's parse, it must still parse once that window has passed, for reconciliation to finish what was
// broadcast (the settlement's own time checks refuse sending it again).
func (f *Facilitator) parseDeposit(req x402.BatchRequest, recorded bool) (*payment, *BatchRefusal) {
	n, err := f.batchNetworkOf(req.PaymentRequirements)
	if err != nil {
		return nil, asBatchRefusal(err)
	}
	terms, err := n.batchTerms(req.PaymentRequirements)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	bp := &req.PaymentPayload
	now := n.chainNow()
	if a := depositERC3009(bp); recorded && a != nil {
		if after, err := x402.ParseUint256(a.ValidAfter); err == nil && after.IsInt64() {
			now = time.Unix(after.Int64(), 0)
		}
	}
	if recorded && terms.TransferMethod == x402.TransferPermit2 {
		// Read back from its record, a deposit is the one it was, whatever its deadline says now.
		now = time.Unix(0, 0)
	}
	if r := terms.CheckDepositAuthorization(bp, now); r != nil {
		return nil, r
	}
	pl := &bp.Payload
	ch, err := ParseChannelConfig(*pl.ChannelConfig)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	id := ChannelID(terms.Domain, ch)
	if common.HexToHash(pl.Voucher.ChannelID) != id {
		return nil, refuseBatch(x402.ReasonBatchChannelIDMismatch, "payload.voucher.channelId is %s, but payload.channelConfig is channel %s on %s", pl.Voucher.ChannelID, id.Hex(), terms.Network)
	}
	asset := n.assets[terms.Token]
	if asset == nil {
		return nil, refuseBatch(x402.ReasonInvalidPaymentRequirements, "asset %s is not accepted on %s", terms.Token.Hex(), n.caip2)
	}
	if terms.TransferMethod == x402.TransferPermit2 {
		return f.parsePermit2Deposit(n, req, terms, asset, ch, id)
	}
	a := pl.Deposit.Authorization.ERC3009Authorization
	// CheckDepositAuthorization parsed each of these.
	amount, _ := x402.ParseAmount(pl.Deposit.Amount)
	validAfter, _ := x402.ParseUint256(a.ValidAfter)
	validBefore, _ := x402.ParseUint256(a.ValidBefore)
	sig, _ := ParseSignature(a.Signature)
	salt := common.HexToHash(a.Salt)
	nonce := contracts.ERC3009DepositNonce(id, salt)
	collectorData, err := contracts.EncodeERC3009CollectorData(validAfter, validBefore, new(big.Int).SetBytes(salt[:]), sig[:])
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.authorization.erc3009Authorization: %v", err)
	}
	request, err := json.Marshal(req)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "the deposit request does not encode: %v", err)
	}
	p := &payment{net: n, asset: asset, scheme: x402.SchemeBatchSettlement, method: x402.TransferEIP3009, payer: ch.Payer,
		amount: amount, payTo: ch.Receiver, sig: sig, sigBytes: sig[:], nonce: new(big.Int).SetBytes(nonce[:]),
		auth: transferAuthorization{From: ch.Payer, To: contracts.ERC3009DepositCollectorAddress, Value: amount,
			ValidAfter: validAfter, ValidBefore: validBefore, Nonce: nonce},
		maxTimeout: req.PaymentRequirements.MaxTimeoutSeconds, request: request,
		deposit: &batchDeposit{terms: terms, cfg: ch, id: id, collector: contracts.ERC3009DepositCollectorAddress, collectorData: collectorData}}
	p.digest = ReceiveAuthorizationDigest(PermitDomainSeparator(terms.TokenName, terms.TokenVersion, terms.ChainID, terms.Token),
		ch.Payer, contracts.ERC3009DepositCollectorAddress, amount, validAfter, validBefore, nonce)
	p.id = journal.PaymentID(n.caip2, p.method, asset.Address.Hex(), p.payer.Hex(), nonce.Hex())
	return p, nil
}

// parsePermit2Deposit parses a Permit2 deposit (checked off chain by CheckDepositAuthorization) into the payment
// its settlement sends: a Permit2 transfer of the payer's, spent by the Permit2 deposit collector, so that the
// exact permit2 machinery checks it on chain (its nonce unused in Permit2's bitmap, the payer's balance and
// Permit2 allowance, the deposit call simulated) and settles it (journal id: the payer's Permit2 nonce).
func (f *Facilitator) parsePermit2Deposit(n *network, req x402.BatchRequest, terms *BatchTerms, asset *asset, ch contracts.ChannelConfig, id common.Hash) (*payment, *BatchRefusal) {
	pl := &req.PaymentPayload.Payload
	a := pl.Deposit.Authorization.Permit2Authorization
	// CheckDepositAuthorization parsed each of these.
	amount, _ := x402.ParseAmount(pl.Deposit.Amount)
	nonce, _ := x402.ParseUint256(a.Nonce)
	deadline, _ := x402.ParseUint256(a.Deadline)
	sig, _ := ParseSignature(a.Signature)
	collectorData, err := contracts.EncodePermit2CollectorData(nonce, deadline, sig[:], nil)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.deposit.authorization.permit2Authorization: %v", err)
	}
	request, err := json.Marshal(req)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "the deposit request does not encode: %v", err)
	}
	p := &payment{net: n, asset: asset, scheme: x402.SchemeBatchSettlement, method: x402.TransferPermit2, payer: ch.Payer,
		amount: amount, payTo: ch.Receiver, sig: sig, sigBytes: sig[:], nonce: nonce,
		p2: permit2Transfer{Token: terms.Token, Amount: amount, Spender: contracts.Permit2DepositCollectorAddress, Nonce: nonce,
			Deadline: deadline, ValidAfter: new(big.Int)},
		maxTimeout: req.PaymentRequirements.MaxTimeoutSeconds, request: request,
		deposit: &batchDeposit{terms: terms, cfg: ch, id: id, collector: contracts.Permit2DepositCollectorAddress, collectorData: collectorData}}
	p.digest = DepositPermit2Digest(terms.ChainID, terms.Token, amount, nonce, deadline, id)
	p.id = journal.PaymentID(n.caip2, p.method, asset.Address.Hex(), p.payer.Hex(), nonce.String())
	return p, nil
}

// depositERC3009 is a deposit payment's ERC-3009 authorization, nil when it has none.
func depositERC3009(bp *x402.BatchPayment) *x402.BatchERC3009Authorization {
	if d := bp.Payload.Deposit; d != nil {
		return d.Authorization.ERC3009Authorization
	}
	return nil
}

// asBatchRefusal is err as a *BatchRefusal when it is one, else nil.
func asBatchRefusal(err error) *BatchRefusal {
	var r *BatchRefusal
	if errors.As(err, &r) {
		return r
	}
	return nil
}

// depositReason names an exact eip3009 refusal of a deposit in the scheme's words where it has them.
func depositReason(reason string) string {
	switch reason {
	case x402.ReasonEIP3009InsufficientBalance, x402.ReasonInsufficientFunds:
		return x402.ReasonBatchInsufficientBalance
	case x402.ReasonSimulationFailed:
		return x402.ReasonBatchDepositSimulationFailed
	case x402.ReasonValidBefore:
		return x402.ReasonBatchValidBefore
	case x402.ReasonValidAfter:
		return x402.ReasonBatchValidAfter
	case x402.ReasonPermit2SimulationFailed:
		return x402.ReasonBatchDepositSimulationFailed
	case x402.ReasonPermit2DeadlineExpired:
		return x402.ReasonBatchPermit2DeadlineExpired
	case x402.ReasonPermit2AllowanceRequired:
		return x402.ReasonBatchPermit2AllowanceRequired
	}
	return reason
}

// asVoucher is deposit payment bp as the voucher it carries: what is accepted once the deposit is mined.
func asVoucher(bp x402.BatchPayment) x402.BatchPayment {
	bp.Payload.Type, bp.Payload.Deposit = x402.BatchVoucher, nil
	return bp
}

// verifyDeposit verifies a deposit: its authorization off chain, the voucher it carries against the channel's
// deposit with this one added, then as a payment (time window, the escrow's deposit call simulated from a
// settlement wallet, the payer's funds held as any payment's are).
func (f *Facilitator) verifyDeposit(ctx context.Context, req x402.BatchRequest, payer string) (x402.VerifyResponse, error) {
	p, r := f.parseDeposit(req, false)
	if r == nil {
		r = f.checkDepositVoucher(ctx, p, req)
	}
	if r != nil {
		return x402.VerifyResponse{IsValid: false, Payer: payer, InvalidReason: r.Reason, InvalidMessage: r.Message}, nil
	}
	resp, err := f.verifyParsed(ctx, p, nil, payer, fundsVerify)
	resp.InvalidReason = depositReason(resp.InvalidReason)
	if err == nil && resp.IsValid {
		// The channel as it stands before the deposit, which the SDK's resource server keeps until the deposit's
		// settlement tells it the new balance.
		if n := f.networks[req.PaymentRequirements.Network]; n != nil {
			id := common.HexToHash(req.PaymentPayload.Payload.Voucher.ChannelID)
			if st, rerr := f.readChannelState(ctx, n, id); rerr == nil {
				resp.Extra, _ = json.Marshal(x402.BatchChannelState{ChannelID: id.Hex(), Balance: st.balance.String(), TotalClaimed: st.claimed.String(),
					WithdrawRequestedAt: st.withdrawRequestedAt, RefundNonce: st.refundNonce.String()})
			}
		}
	}
	return resp, err
}

// checkDepositVoucher checks the voucher a deposit carries against the channel as it will be once the deposit
// is mined: nil when it will be accepted then (or is accepted already: the deposit presented again).
func (f *Facilitator) checkDepositVoucher(ctx context.Context, p *payment, req x402.BatchRequest) *BatchRefusal {
	chs, err := f.channelStore()
	if err != nil {
		return refuseBatch(x402.ReasonUnexpectedVerifyError, "%v", err)
	}
	v := asVoucher(req.PaymentPayload)
	if _, err := f.checkVoucherWith(ctx, p.net, chs, p.deposit.terms, &v, p.amount); err != nil {
		if r := asBatchRefusal(err); r != nil {
			return r
		}
		return refuseBatch(x402.ReasonBatchRPCReadFailed, "reading the channel: %v", err)
	}
	return nil
}

// settleDeposit settles a deposit: its transaction through the settlement machinery, then, mined, the channel
// read and recorded (ObserveChannel) and the voucher it carries accepted as any voucher is. A deposit presented
// again is answered from the journal (its transaction's outcome) and its voucher from the channel's row.
func (f *Facilitator) settleDeposit(ctx context.Context, req x402.BatchRequest, payer string) (x402.BatchSettleResponse, error) {
	network := req.PaymentRequirements.Network
	p, r := f.parseDeposit(req, false)
	if r == nil {
		r = f.checkDepositVoucher(ctx, p, req)
	}
	if r == nil {
		ref, err := f.admitSettlement(ctx, p)
		if err != nil {
			return x402.BatchSettleResponse{}, &x402.FacilitatorError{Op: "settle", Kind: x402.FailureUnreachable, Err: err}
		}
		if ref != nil {
			r = refuseBatch(depositReason(ref.reason), "%s", ref.message)
		}
	}
	if r != nil {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
	}
	sr, err := f.settleParsed(ctx, p, x402.SettleRequest{})
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	if !sr.Success {
		return x402.BatchSettleResponse{Network: network, Payer: payer, Transaction: sr.Transaction,
			ErrorReason: depositReason(sr.ErrorReason), ErrorMessage: sr.ErrorMessage}, nil
	}
	chs, err := f.channelStore()
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	d := p.deposit
	if _, err := f.readChannel(ctx, p.net, chs, d.id, *req.PaymentPayload.Payload.ChannelConfig, d.cfg); err != nil {
		// The deposit is mined; its voucher is accepted when the deposit is presented again.
		return x402.BatchSettleResponse{Network: network, Payer: payer, Transaction: sr.Transaction, ErrorReason: x402.ReasonBatchRPCReadFailed,
			ErrorMessage: fmt.Sprintf("the deposit %s is mined, but the channel could not be read (%v): present the deposit again", sr.Transaction, err)}, nil
	}
	v := asVoucher(req.PaymentPayload)
	resp, err := f.settleVoucher(ctx, p.net, d.terms, chs, &v, payer)
	resp.Transaction = sr.Transaction
	return resp, err
}
