package chain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The receiver's /settle actions of batch-settlement, as a resource server of the public SDK (@x402/hono with the
// batch-settlement server scheme) sends them to its facilitator: claim (the vouchers it holds, claimed on chain by
// claimWithSignature), settle (what was claimed for a receiver, paid to it) and refund (a channel's unclaimed
// remainder returned to its payer, after claiming the vouchers it carries). Each is one transaction from a
// settlement wallet, and each is held and recorded as a payment's settlement is: checked off chain, then
// simulated from the wallet that sends it, before its journal record is claimed (nothing is sent that would
// revert); its broadcast record, raw transaction and all, written before it leaves; made final with its receipt.
// The same action presented again is answered from its record (the same transaction, nothing sent), and one
// whose process died between broadcast and mined is looked up on chain, or sent again as it was, when it comes
// again. Actions touching one channel (a claim and a refund) run one at a time in a process, simulation to
// receipt, so neither is sent on a simulation the other makes stale.

// Methods of the actions' journal ids: one record per action, named by what makes it that action.
const (
	actionClaimMethod  = "batch-claim-action"
	actionSettleMethod = "batch-settle-action"
	actionRefundMethod = "batch-refund-action"
)

// Gas limits of the actions (the escrow's own work; a claim's grows with its channels).
const (
	settleActionGas = 120_000
	refundActionGas = 200_000
)

// batchAction is one checked action, ready to send: its journal id, its one call, and how its answer is told.
type batchAction struct {
	kind  string
	id    journal.ID
	call  contractCall
	payer string
	// locks are the keys the action holds while it runs: its channels, or its receiver and token.
	locks []string
	// channel is a refund's channel (its answer tells the channel after), and config its configuration.
	channel common.Hash
	config  *x402.ChannelConfig
	// receiver and token are a settle's payee (its answer tells what the Settled event paid).
	receiver, token common.Address
	// claimed are the channels the action claims, whose journal rows are read again once it is mined.
	claimed []claimedChannel
	// refundMark and refundAt are a payer's refund's mark on its channel's row and the amount the row stood at
	// when it was marked (what the refund claims): checked again once the action holds its locks.
	refundMark string
	refundAt   *big.Int
}

type claimedChannel struct {
	id   common.Hash
	wire x402.ChannelConfig
	cfg  contracts.ChannelConfig
	// total is what the claim takes the channel's total claimed to (nil: the refund's own channel, unclaimed).
	total *big.Int
}

// actionLocks serialises a process's actions on one channel (or one receiver and token).
type actionLocks struct {
	mu   sync.Mutex
	held map[string]*actionLock
}

type actionLock struct {
	mu   sync.Mutex
	refs int
}

// lock takes every key, in order (so two actions on overlapping channels never wait on each other crosswise),
// and returns the function that lets them go.
func (l *actionLocks) lock(keys []string) func() {
	keys = slices.Clone(keys)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	taken := make([]*actionLock, 0, len(keys))
	for _, k := range keys {
		l.mu.Lock()
		if l.held == nil {
			l.held = map[string]*actionLock{}
		}
		al := l.held[k]
		if al == nil {
			al = &actionLock{}
			l.held[k] = al
		}
		al.refs++
		l.mu.Unlock()
		al.mu.Lock()
		taken = append(taken, al)
	}
	return func() {
		for i := len(taken) - 1; i >= 0; i-- {
			taken[i].mu.Unlock()
			l.mu.Lock()
			if taken[i].refs--; taken[i].refs == 0 {
				delete(l.held, keys[i])
			}
			l.mu.Unlock()
		}
	}
}

// actionLockMethod names the journal records that hold an action's channels across the gateways of a journal.
const actionLockMethod = "batch-action-lock"

// lockActionJournal holds keys across every process of the journal, as the process's own locks hold them within
// it: a claimed record per key, released when the action is done, or, when its transaction is sent and not yet
// mined (release given its hash), kept naming that transaction until it is mined. A record left by a process
// that died holding it before it sent anything is taken over once older than an action can run (its receipt wait
// and a minute); one naming a transaction, once that transaction is mined (or after ten times that, dropped). A
// record of this process's naming no transaction is free: the process's own lock of the key is held; one naming
// the transaction of this very action is the action's to resolve. Held longer
// than an action's receipt wait, the answer is channel busy: nothing was checked or sent.
func (f *Facilitator) lockActionJournal(ctx context.Context, n *network, action journal.ID, keys []string) (func(pending string), error) {
	keys = slices.Clone(keys)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	var held []journal.Record
	release := func(pending string) {
		wctx := context.WithoutCancel(ctx)
		for i := len(held) - 1; i >= 0; i-- {
			var err error
			if pending != "" {
				_, err = f.journal.Update(wctx, held[i].ID, func(r *journal.Record) error { r.TxHash = pending; return nil })
			} else {
				err = f.journal.Release(wctx, held[i])
			}
			if err != nil {
				f.log.Warn("releasing a batch-settlement action's lock", zap.String("lock", held[i].ID.String()), zap.Error(err))
			}
		}
	}
	stale := n.timeout + unrecordedClaimAge
	deadline := time.Now().Add(n.timeout + 5*time.Second)
	for _, k := range keys {
		rec := journal.Record{ID: journal.PaymentID(n.caip2, actionLockMethod, contracts.BatchSettlementAddress.Hex(), "", k), State: journal.StateClaimed,
			Network: n.caip2, Owner: f.owner}
		for {
			got, claimed, err := f.journal.Claim(ctx, rec)
			if err != nil {
				release("")
				return nil, fmt.Errorf("locking %s for the action: %w", k, err)
			}
			if claimed || (got.State == journal.StateClaimed && got.Owner == f.owner && got.TxHash == "") || f.lockedBy(ctx, action, got) {
				held = append(held, got)
				break
			}
			free := got.State == journal.StateClaimed && got.TxHash == "" && f.now().Sub(got.ClaimedAt) > stale
			if got.State == journal.StateClaimed && got.TxHash != "" {
				r, err := n.backend.TransactionReceipt(ctx, common.HexToHash(got.TxHash))
				free = (err == nil && r != nil) || f.now().Sub(got.UpdatedAt) > 10*stale
			}
			if free {
				_ = f.journal.Release(ctx, got) // its holder is gone, or its transaction mined: the next Claim takes it
				continue
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				release("")
				return nil, refuseBatch(x402.ReasonBatchChannelBusy, "another action on %s has run for longer than %s: present this one again", k, n.timeout)
			}
			select {
			case <-ctx.Done():
			case <-time.After(n.watcher.poll):
			}
		}
	}
	return release, nil
}

// lockedBy says lock is kept for the transaction of action itself: presented again, the action resolves its own
// transaction (looks up its receipt, or sends it again when the node forgot it).
func (f *Facilitator) lockedBy(ctx context.Context, action journal.ID, lock journal.Record) bool {
	if lock.TxHash == "" {
		return false
	}
	rec, ok, err := f.journal.Get(ctx, action)
	return err == nil && ok && strings.EqualFold(rec.TxHash, lock.TxHash)
}

// isBatchAction says whether a batch /settle payload is a receiver's action rather than a payment.
func isBatchAction(typ string) bool {
	return typ == x402.BatchClaim || typ == x402.BatchSettle || typ == x402.BatchRefund
}

// settleAction performs a claim, settle or refund (see the top of this file).
func (f *Facilitator) settleAction(ctx context.Context, req x402.BatchRequest) (x402.BatchSettleResponse, error) {
	p := &req.PaymentPayload
	network := req.PaymentRequirements.Network
	payer := ""
	if p.Payload.ChannelConfig != nil {
		payer = p.Payload.ChannelConfig.Payer
	}
	fail := func(err error) (x402.BatchSettleResponse, error) {
		if r := asBatchRefusal(err); r != nil {
			return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
		}
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: x402.ReasonUnexpectedSettleError, ErrorMessage: err.Error()}, nil
	}
	n, err := f.batchNetworkOf(req.PaymentRequirements)
	if err != nil {
		return fail(err)
	}
	if p.Accepted.Network != "" && p.Accepted.Network != network {
		return fail(refuseBatch(x402.ReasonBatchNetworkMismatch, "paymentPayload.accepted.network is %q, paymentRequirements.network %q", truncate(p.Accepted.Network), truncate(network)))
	}
	if p.Payload.Type == x402.BatchRefund && p.Payload.RefundNonce == "" {
		// A payer's own refund, to a route this engine serves: the engine enriches it as the SDK's server would,
		// and runs it apart from the channel's vouchers (batch_refund.go).
		resp, err := f.settlePayerRefund(ctx, n, req, payer)
		if err != nil {
			return fail(err)
		}
		return resp, nil
	}
	var a *batchAction
	switch p.Payload.Type {
	case x402.BatchClaim:
		a, err = f.claimAction(n, &p.Payload)
	case x402.BatchSettle:
		a, err = f.settlePayeeAction(ctx, n, &p.Payload)
	case x402.BatchRefund:
		a, err = f.refundAction(n, &p.Payload, false)
	default:
		err = refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload.type is %q, expected claim, settle or refund", truncate(p.Payload.Type))
	}
	if err != nil {
		return fail(err)
	}
	a.payer = payer
	resp, err := f.performAction(ctx, n, a, &p.Payload)
	if err != nil {
		return fail(err)
	}
	return resp, nil
}

// performAction runs checked action a with its channels locked, in this process and across the journal.
func (f *Facilitator) performAction(ctx context.Context, n *network, a *batchAction, pl *x402.BatchPayload) (x402.BatchSettleResponse, error) {
	unlock := n.batch.actions.lock(a.locks)
	defer unlock()
	release, err := f.lockActionJournal(ctx, n, a.id, a.locks)
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	resp, err := f.runAction(ctx, n, a, pl)
	// An action sent and not yet mined keeps its channels locked until it is: another action checked meanwhile
	// would be simulated on a chain without it.
	pending := ""
	if err == nil && resp.ErrorReason == x402.ReasonSettlementPending {
		pending = resp.Transaction
	}
	release(pending)
	return resp, err
}

// runAction answers an action from its record, or checks and sends it, its channels locked.
func (f *Facilitator) runAction(ctx context.Context, n *network, a *batchAction, pl *x402.BatchPayload) (x402.BatchSettleResponse, error) {
	for {
		rec, ok, err := f.journal.Get(ctx, a.id)
		if err != nil {
			return x402.BatchSettleResponse{}, fmt.Errorf("reading the record of the %s: %w", a.kind, err)
		}
		if !ok {
			break
		}
		if !revertedAction(rec) {
			return f.actionAgain(ctx, n, a, rec)
		}
		// Its transaction reverted and moved nothing: the action may go again, checked afresh, under a record
		// of its own that names the reverted one (so the same attempt is still answered once).
		a.id = journal.PaymentID(n.caip2, "batch-action-retry", contracts.BatchSettlementAddress.Hex(), a.id.String(), rec.TxHash)
	}
	if a.kind == x402.BatchRefund && a.refundMark != "" {
		if err := f.checkRefundMarkHeld(ctx, n, a); err != nil {
			return x402.BatchSettleResponse{}, err
		}
	}
	if a.kind == x402.BatchRefund {
		if err := f.checkRefundOnChain(ctx, n, a, pl); err != nil {
			return x402.BatchSettleResponse{}, err
		}
	}
	if a.kind == x402.BatchClaim {
		if err := f.checkClaimOnChain(ctx, n, a); err != nil {
			return x402.BatchSettleResponse{}, err
		}
	}
	return f.sendAction(ctx, n, a)
}

// checkClaimOnChain refuses a claim that would claim nothing: every channel it names is claimed already to its
// total or beyond. The escrow skips such rows without a revert, so the simulation passes it, and it would cost a
// transaction's gas for nothing (as many times as a caller varies its totals).
func (f *Facilitator) checkClaimOnChain(ctx context.Context, n *network, a *batchAction) error {
	to := contracts.BatchSettlementAddress
	for _, c := range a.claimed {
		data, err := contracts.PackBatchSettlement("channels", c.id)
		if err != nil {
			return err
		}
		raw, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
		if err != nil {
			return refuseBatch(x402.ReasonBatchRPCReadFailed, "reading channel %s: %v", c.id.Hex(), err)
		}
		out, err := contracts.BatchSettlementABI.Unpack("channels", raw)
		if err != nil || len(out) != 2 {
			return refuseBatch(x402.ReasonBatchRPCReadFailed, "reading channel %s: the escrow answered %d bytes that are not its outputs", c.id.Hex(), len(raw))
		}
		if claimed, _ := out[1].(*big.Int); claimed == nil || c.total.Cmp(claimed) > 0 {
			return nil
		}
	}
	return refuseBatch(x402.ReasonBatchCumulativeBelowClaimed, "every channel of the claim is claimed already to its total or beyond: it would claim nothing")
}

// revertedAction says an action's record is final with a transaction that was mined and reverted.
func revertedAction(rec journal.Record) bool {
	return rec.State == journal.StateFinal && rec.Response != nil && !rec.Response.Success && rec.Response.Transaction != "" &&
		(rec.Response.ErrorReason == x402.ReasonBatchClaimTransactionFailed || rec.Response.ErrorReason == x402.ReasonBatchSettleTransactionFailed ||
			rec.Response.ErrorReason == x402.ReasonBatchRefundTransactionFailed)
}

// actionKey is a lock key of channel id.
func actionKey(id common.Hash) string { return "channel:" + strings.ToLower(id.Hex()) }

// parseClaims checks the claims of a claim or refund off chain: every channel well formed and naming one
// receiverAuthorizer, every claim within the voucher's ceiling, every voucher signed by its channel's payer
// (where that can be judged off chain: an ECDSA key). It returns the claims as the contract takes them, the
// entries the authorizer signs, and the channels.
func parseClaims(domain common.Hash, claims []x402.BatchVoucherClaim) ([]contracts.VoucherClaim, []ClaimEntry, []claimedChannel, error) {
	out := make([]contracts.VoucherClaim, 0, len(claims))
	entries := make([]ClaimEntry, 0, len(claims))
	chans := make([]claimedChannel, 0, len(claims))
	var authorizer common.Address
	for i, cl := range claims {
		at := fmt.Sprintf("payload.claims[%d]", i)
		cfg, err := ParseChannelConfig(cl.Voucher.Channel)
		if err != nil {
			return nil, nil, nil, refuseBatch(x402.ReasonInvalidPayload, "%s.voucher.channel: %v", at, err)
		}
		if i == 0 {
			authorizer = cfg.ReceiverAuthorizer
		} else if cfg.ReceiverAuthorizer != authorizer {
			return nil, nil, nil, refuseBatch(x402.ReasonBatchReceiverAuthorizerMismatch, "%s names receiverAuthorizer %s, claims[0] %s: one claim is signed by one authorizer",
				at, cfg.ReceiverAuthorizer.Hex(), authorizer.Hex())
		}
		ceiling, err1 := x402.ParseAmount(cl.Voucher.MaxClaimableAmount)
		total, err2 := x402.ParseAmount(cl.TotalClaimed)
		if err1 != nil || err2 != nil || ceiling.Cmp(maxUint128) > 0 || total.Cmp(maxUint128) > 0 {
			return nil, nil, nil, refuseBatch(x402.ReasonInvalidPayload, "%s: maxClaimableAmount %q and totalClaimed %q must be uint128 amounts",
				at, truncate(cl.Voucher.MaxClaimableAmount), truncate(cl.TotalClaimed))
		}
		if total.Cmp(ceiling) > 0 {
			return nil, nil, nil, refuseBatch(x402.ReasonBatchChargeExceedsSignedCumulative, "%s claims a total of %s, above the %s its voucher allows", at, total, ceiling)
		}
		id := ChannelID(domain, cfg)
		sig, err := ParseSignature(cl.Signature)
		if err != nil {
			return nil, nil, nil, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "%s.signature: %v", at, err)
		}
		if signer, err := RecoverSigner(VoucherDigest(domain, id, ceiling), sig); cfg.PayerAuthorizer != (common.Address{}) && (err != nil || signer != cfg.PayerAuthorizer) {
			// A channel without a payerAuthorizer may have a contract payer, whose ERC-1271 answer only the chain
			// gives: the simulation judges it.
			return nil, nil, nil, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "%s: the voucher of channel %s is signed by %s, not its payerAuthorizer %s",
				at, id.Hex(), signer.Hex(), cfg.PayerAuthorizer.Hex())
		}
		for _, c := range chans {
			if c.id == id {
				return nil, nil, nil, refuseBatch(x402.ReasonInvalidPayload, "%s claims channel %s a second time", at, id.Hex())
			}
		}
		out = append(out, contracts.VoucherClaim{Voucher: contracts.Voucher{Channel: cfg, MaxClaimableAmount: ceiling}, Signature: sig[:], TotalClaimed: total})
		entries = append(entries, ClaimEntry{ChannelID: id, MaxClaimableAmount: ceiling, TotalClaimed: total})
		chans = append(chans, claimedChannel{id: id, wire: cl.Voucher.Channel, cfg: cfg, total: total})
	}
	return out, entries, chans, nil
}

// authorizerSignature is the receiver authorizer's signature an action carries (given, parsed), or this engine's
// over digest when it holds the key of authorizer; a refusal when neither.
func (n *network) authorizerSignature(given string, authorizer common.Address, digest common.Hash, field string) ([]byte, error) {
	if given != "" {
		sig, err := ParseSignature(given)
		if err != nil {
			return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.%s: %v", field, err)
		}
		return sig[:], nil
	}
	if n.claimer == nil {
		return nil, refuseBatch(x402.ReasonBatchAuthorizerNotConfigured, "payload.%s is missing and this facilitator holds no receiverAuthorizer key on %s", field, n.caip2)
	}
	if n.claimer.authorizer != authorizer {
		return nil, refuseBatch(x402.ReasonBatchAuthorizerAddressMismatch, "payload.%s is missing, and the channel's receiverAuthorizer %s is not this facilitator's %s",
			field, authorizer.Hex(), n.claimer.authorizer.Hex())
	}
	sig, err := signDigest(n.claimer.key, digest)
	if err != nil {
		return nil, err
	}
	return sig[:], nil
}

// claimAction checks a claim and builds its claimWithSignature.
func (f *Facilitator) claimAction(n *network, pl *x402.BatchPayload) (*batchAction, error) {
	if len(pl.Claims) == 0 || len(pl.Claims) > maxClaimsPerTx {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.claims has %d claims, expected 1 to %d", len(pl.Claims), maxClaimsPerTx)
	}
	domain := BatchDomainSeparator(n.chainID)
	claims, entries, chans, err := parseClaims(domain, pl.Claims)
	if err != nil {
		return nil, err
	}
	sig, err := n.authorizerSignature(pl.ClaimAuthorizerSignature, claims[0].Voucher.Channel.ReceiverAuthorizer, ClaimBatchDigest(domain, entries), "claimAuthorizerSignature")
	if err != nil {
		return nil, err
	}
	data, err := contracts.PackClaimWithSignature(claims, sig)
	if err != nil {
		return nil, fmt.Errorf("packing the claim: %w", err)
	}
	a := &batchAction{kind: x402.BatchClaim, claimed: chans,
		call: contractCall{To: contracts.BatchSettlementAddress, Data: data, Gas: claimGasBase + claimGasPerChannel*uint64(len(claims))}}
	// The claim is its calldata: the same claims under the same signature are the same claim.
	a.id = journal.PaymentID(n.caip2, actionClaimMethod, contracts.BatchSettlementAddress.Hex(), "", crypto.Keccak256Hash(data).Hex())
	for _, c := range chans {
		a.locks = append(a.locks, actionKey(c.id))
	}
	return a, nil
}

// settlePayeeAction checks a settle of a receiver and token: something claimed for it and not paid.
func (f *Facilitator) settlePayeeAction(ctx context.Context, n *network, pl *x402.BatchPayload) (*batchAction, error) {
	if !x402.IsHexAddress(pl.Receiver) || !x402.IsHexAddress(pl.Token) {
		return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.receiver %q and payload.token %q must be addresses", truncate(pl.Receiver), truncate(pl.Token))
	}
	receiver, token := common.HexToAddress(pl.Receiver), common.HexToAddress(pl.Token)
	claimed, settled, err := f.receiverState(ctx, n, receiver, token)
	if err != nil {
		return nil, refuseBatch(x402.ReasonBatchRPCReadFailed, "reading what is claimed for receiver %s in %s: %v", receiver.Hex(), token.Hex(), err)
	}
	data, err := contracts.PackBatchSettle(receiver, token)
	if err != nil {
		return nil, fmt.Errorf("packing the settle: %w", err)
	}
	a := &batchAction{kind: x402.BatchSettle, receiver: receiver, token: token,
		call:  contractCall{To: contracts.BatchSettlementAddress, Data: data, Gas: settleActionGas},
		locks: []string{"payee:" + strings.ToLower(receiver.Hex()+token.Hex())}}
	// A settle pays what is claimed up to the receiver's total claimed: the total names it, so a settle presented
	// again before anything more is claimed is answered by its record.
	a.id = journal.PaymentID(n.caip2, actionSettleMethod, contracts.BatchSettlementAddress.Hex(), receiver.Hex()+"/"+token.Hex(), claimed.String())
	if claimed.Cmp(settled) <= 0 {
		if _, ok, err := f.journal.Get(ctx, a.id); err == nil && ok {
			return a, nil // settled by that record: answered from it
		}
		return nil, refuseBatch(x402.ReasonBatchNothingToSettle, "receiver %s has %s claimed in %s and %s paid: nothing to settle", receiver.Hex(), claimed, token.Hex(), settled)
	}
	return a, nil
}

// receiverState reads the escrow's receivers(receiver, token): what was claimed for it, and what paid.
func (f *Facilitator) receiverState(ctx context.Context, n *network, receiver, token common.Address) (claimed, settled *big.Int, err error) {
	data, err := contracts.PackBatchSettlement("receivers", receiver, token)
	if err != nil {
		return nil, nil, err
	}
	to := contracts.BatchSettlementAddress
	raw, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
	if err != nil {
		return nil, nil, err
	}
	out, err := contracts.BatchSettlementABI.Unpack("receivers", raw)
	if err != nil || len(out) != 2 {
		return nil, nil, fmt.Errorf("the escrow answered %d bytes that are not receivers' outputs (%v)", len(raw), err)
	}
	claimed, _ = out[0].(*big.Int)
	settled, _ = out[1].(*big.Int)
	if claimed == nil || settled == nil {
		return nil, nil, errors.New("the escrow's receivers answer holds no amounts")
	}
	return claimed, settled, nil
}

// refundAction checks a refund off chain (its channel, the payer's voucher, its claims, its amount and nonce) and
// builds its refundWithSignature, after a claimWithSignature of its claims when it carries any. settle adds the
// receiver's settle after them, so what the claims took reaches the receiver in the same transaction (the engine's
// own refunds, as its claimer's claims do: nothing else would pay it out).
func (f *Facilitator) refundAction(n *network, pl *x402.BatchPayload, settle bool) (*batchAction, error) {
	if pl.ChannelConfig == nil || pl.Voucher == nil || pl.RefundNonce == "" || pl.Amount == "" {
		return nil, refuseBatch(x402.ReasonBatchRefundPayload, "a refund to settle carries channelConfig, voucher, amount, refundNonce and claims")
	}
	domain := BatchDomainSeparator(n.chainID)
	cfg, id, err := refundSignedByPayer(n, pl)
	if err != nil {
		return nil, err
	}
	amount, err := x402.ParseAmount(pl.Amount)
	if err != nil || amount.Sign() == 0 || amount.Cmp(maxUint128) > 0 {
		return nil, refuseBatch(x402.ReasonBatchRefundAmountInvalid, "payload.amount %q is not a positive uint128 amount", truncate(pl.Amount))
	}
	nonce, err := x402.ParseAmount(pl.RefundNonce)
	if err != nil {
		return nil, refuseBatch(x402.ReasonBatchRefundPayload, "payload.refundNonce %q is not a number", truncate(pl.RefundNonce))
	}
	a := &batchAction{kind: x402.BatchRefund, channel: id, config: pl.ChannelConfig, locks: []string{actionKey(id)}}
	var calls [][]byte
	if len(pl.Claims) > 0 {
		if len(pl.Claims) > maxClaimsPerTx {
			return nil, refuseBatch(x402.ReasonInvalidPayload, "payload.claims has %d claims, expected at most %d", len(pl.Claims), maxClaimsPerTx)
		}
		claims, entries, chans, err := parseClaims(domain, pl.Claims)
		if err != nil {
			return nil, err
		}
		for i, c := range chans {
			if c.id != id {
				return nil, refuseBatch(x402.ReasonBatchChannelIDMismatch, "payload.claims[%d] claims channel %s, the refund is of channel %s", i, c.id.Hex(), id.Hex())
			}
		}
		csig, err := n.authorizerSignature(pl.ClaimAuthorizerSignature, cfg.ReceiverAuthorizer, ClaimBatchDigest(domain, entries), "claimAuthorizerSignature")
		if err != nil {
			return nil, err
		}
		claim, err := contracts.PackClaimWithSignature(claims, csig)
		if err != nil {
			return nil, fmt.Errorf("packing the refund's claim: %w", err)
		}
		calls, a.claimed = append(calls, claim), chans
	}
	rsig, err := n.authorizerSignature(pl.RefundAuthorizerSignature, cfg.ReceiverAuthorizer, RefundDigest(domain, id, nonce, amount), "refundAuthorizerSignature")
	if err != nil {
		return nil, err
	}
	refund, err := contracts.PackRefundWithSignature(cfg, amount, nonce, rsig)
	if err != nil {
		return nil, fmt.Errorf("packing the refund: %w", err)
	}
	data := refund
	if len(calls) > 0 && settle {
		pay, err := contracts.PackBatchSettle(cfg.Receiver, cfg.Token)
		if err != nil {
			return nil, fmt.Errorf("packing the refund's settle: %w", err)
		}
		calls = append(calls, refund, pay)
		if data, err = contracts.PackBatchMulticall(calls); err != nil {
			return nil, fmt.Errorf("packing the refund: %w", err)
		}
	} else if len(calls) > 0 {
		if data, err = contracts.PackBatchMulticall(append(calls, refund)); err != nil {
			return nil, fmt.Errorf("packing the refund: %w", err)
		}
	}
	a.call = contractCall{To: contracts.BatchSettlementAddress, Data: data, Gas: refundActionGas + claimGasPerChannel*uint64(len(calls))}
	if a.claimed == nil {
		a.claimed = []claimedChannel{{id: id, wire: *pl.ChannelConfig, cfg: cfg}}
	}
	// A refund nonce is good for one refund of its channel: the channel and the nonce name the refund.
	a.id = journal.PaymentID(n.caip2, actionRefundMethod, contracts.BatchSettlementAddress.Hex(), id.Hex(), nonce.String())
	return a, nil
}

// refundSignedByPayer checks, off chain, that a refund's voucher is its channel's and signed by the channel's
// payer (its payerAuthorizer, or the payer's own key): a refund of a channel is asked for with its payer's key. It
// returns the channel's configuration and id.
func refundSignedByPayer(n *network, pl *x402.BatchPayload) (contracts.ChannelConfig, common.Hash, error) {
	if pl.ChannelConfig == nil || pl.Voucher == nil {
		return contracts.ChannelConfig{}, common.Hash{}, refuseBatch(x402.ReasonBatchRefundPayload, "a refund carries channelConfig and a voucher")
	}
	domain := BatchDomainSeparator(n.chainID)
	cfg, err := ParseChannelConfig(*pl.ChannelConfig)
	if err != nil {
		return cfg, common.Hash{}, refuseBatch(x402.ReasonInvalidPayload, "payload.channelConfig: %v", err)
	}
	id := ChannelID(domain, cfg)
	if !x402.IsBytes32(pl.Voucher.ChannelID) || common.HexToHash(pl.Voucher.ChannelID) != id {
		return cfg, id, refuseBatch(x402.ReasonBatchChannelIDMismatch, "payload.voucher.channelId is %q, but payload.channelConfig is channel %s", truncate(pl.Voucher.ChannelID), id.Hex())
	}
	// The payer's own voucher comes with its refund: a refund of a channel is asked for with its payer's key.
	cumulative, err := x402.ParseAmount(pl.Voucher.MaxClaimableAmount)
	if err != nil || cumulative.Cmp(maxUint128) > 0 {
		return cfg, id, refuseBatch(x402.ReasonInvalidPayload, "payload.voucher.maxClaimableAmount %q is not a uint128 amount", truncate(pl.Voucher.MaxClaimableAmount))
	}
	signer := cfg.PayerAuthorizer
	if signer == (common.Address{}) {
		signer = cfg.Payer
	}
	sig, err := ParseSignature(pl.Voucher.Signature)
	if err != nil {
		return cfg, id, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "payload.voucher.signature: %v", err)
	}
	if got, err := RecoverSigner(VoucherDigest(domain, id, cumulative), sig); err != nil || got != signer {
		return cfg, id, refuseBatch(x402.ReasonBatchInvalidVoucherSignature, "the refund's voucher is signed by %s, not channel %s's payer %s", got.Hex(), id.Hex(), signer.Hex())
	}
	return cfg, id, nil
}

// channelState is the escrow's state of channel id: its balance, what was claimed, the pending withdrawal's start
// (0: none) and the next refund nonce.
type channelState struct {
	balance, claimed, refundNonce *big.Int
	withdrawRequestedAt           int64
}

func (f *Facilitator) readChannelState(ctx context.Context, n *network, id common.Hash) (channelState, error) {
	var st channelState
	to := contracts.BatchSettlementAddress
	call := func(method string) ([]any, error) {
		data, err := contracts.PackBatchSettlement(method, id)
		if err != nil {
			return nil, err
		}
		raw, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
		if err != nil {
			return nil, fmt.Errorf("reading %s of channel %s: %w", method, id.Hex(), err)
		}
		return contracts.BatchSettlementABI.Unpack(method, raw)
	}
	out, err := call("channels")
	if err != nil || len(out) != 2 {
		return st, fmt.Errorf("reading channel %s: %v", id.Hex(), err)
	}
	st.balance, _ = out[0].(*big.Int)
	st.claimed, _ = out[1].(*big.Int)
	if out, err = call("pendingWithdrawals"); err != nil || len(out) != 2 {
		return st, fmt.Errorf("reading the pending withdrawal of channel %s: %v", id.Hex(), err)
	}
	if at, _ := out[1].(*big.Int); at != nil {
		st.withdrawRequestedAt = at.Int64()
	}
	if out, err = call("refundNonce"); err != nil || len(out) != 1 {
		return st, fmt.Errorf("reading the refund nonce of channel %s: %v", id.Hex(), err)
	}
	st.refundNonce, _ = out[0].(*big.Int)
	if st.balance == nil || st.claimed == nil || st.refundNonce == nil {
		return st, fmt.Errorf("reading channel %s: the escrow's answers hold no amounts", id.Hex())
	}
	return st, nil
}

// checkRefundOnChain refuses, before anything is sent, a refund the chain or this journal says must not go: its
// nonce is not the channel's next, it returns nothing, its claims exceed the deposit, or it would leave vouchers
// this engine accepted on the channel unclaimed (their responses were served: the refund must claim them first).
func (f *Facilitator) checkRefundOnChain(ctx context.Context, n *network, a *batchAction, pl *x402.BatchPayload) error {
	st, err := f.readChannelState(ctx, n, a.channel)
	if err != nil {
		return refuseBatch(x402.ReasonBatchRPCReadFailed, "%v", err)
	}
	nonce, _ := x402.ParseAmount(pl.RefundNonce)
	if nonce.Cmp(st.refundNonce) != 0 {
		return refuseBatch(x402.ReasonBatchRefundPayload, "payload.refundNonce is %s, channel %s's next refund nonce is %s", nonce, a.channel.Hex(), st.refundNonce)
	}
	after := new(big.Int).Set(st.claimed)
	for _, cl := range pl.Claims {
		if t, err := x402.ParseAmount(cl.TotalClaimed); err == nil && t.Cmp(after) > 0 {
			after = t
		}
	}
	if after.Cmp(st.balance) > 0 {
		return refuseBatch(x402.ReasonBatchCumulativeExceedsBalance, "the refund's claims take channel %s to %s claimed, above its balance of %s", a.channel.Hex(), after, st.balance)
	}
	if new(big.Int).Sub(st.balance, after).Sign() == 0 {
		return refuseBatch(x402.ReasonBatchRefundNoBalance, "channel %s holds %s, all of it claimed once the refund's claims are: nothing to refund", a.channel.Hex(), st.balance)
	}
	if chs, err := f.channelStore(); err == nil {
		row, ok, err := chs.Channel(ctx, n.channelKey(a.channel))
		if err != nil {
			return fmt.Errorf("reading the journal's row of channel %s: %w", a.channel.Hex(), err)
		}
		if ok && row.Charged.Cmp(after) > 0 {
			return refuseBatch(x402.ReasonBatchCumulativeAmountMismatch, "vouchers up to %s were accepted on channel %s, and the refund claims it only to %s: claim what was charged first",
				row.Charged, a.channel.Hex(), after)
		}
	}
	return nil
}

// sendAction runs a checked action to its end: simulated from the wallet that sends it, its record claimed, its
// transaction recorded broadcast before it leaves, its receipt awaited and its record made final.
func (f *Facilitator) sendAction(ctx context.Context, n *network, a *batchAction) (x402.BatchSettleResponse, error) {
	simFailed := map[string]string{x402.BatchClaim: x402.ReasonBatchClaimSimulationFailed, x402.BatchSettle: x402.ReasonBatchSettleSimulationFailed,
		x402.BatchRefund: x402.ReasonBatchRefundSimulationFailed}[a.kind]
	answer := func(reason, format string, args ...any) (x402.BatchSettleResponse, error) {
		return x402.BatchSettleResponse{Network: n.caip2, Payer: a.payer, ErrorReason: reason, ErrorMessage: fmt.Sprintf(format, args...)}, nil
	}
	w, err := n.pool.Acquire(ctx, nil)
	if err != nil {
		return answer(x402.ReasonNoAvailableWallets, "a settlement wallet for the %s: %v", a.kind, err)
	}
	defer n.pool.Release(w)
	quote, err := n.sender.feeQuote(ctx)
	if err != nil {
		return answer(x402.ReasonBatchRPCReadFailed, "pricing the %s: %v", a.kind, err)
	}
	// Nothing is sent that would revert: the action runs first as it will be sent.
	to := a.call.To
	if _, err := n.backend.CallContract(ctx, ethereum.CallMsg{From: w.Address, To: &to, Gas: a.call.Gas, Data: a.call.Data}, nil); err != nil {
		if failsOnChain(err) {
			return answer(simFailed, "the %s would revert (%s): nothing was sent", a.kind, revertReason(err))
		}
		return answer(x402.ReasonBatchRPCReadFailed, "simulating the %s: %v", a.kind, err)
	}
	claim := journal.Record{ID: a.id, State: journal.StateClaimed, Network: n.caip2, Owner: f.owner, Payer: a.payer,
		Asset: contracts.BatchSettlementAddress.Hex()}
	got, claimed, err := f.journal.Claim(ctx, claim)
	if err != nil {
		return answer(x402.ReasonUnexpectedSettleError, "recording the %s: %v", a.kind, err)
	}
	if !claimed {
		return f.actionAgain(ctx, n, a, got)
	}
	wctx := context.WithoutCancel(ctx)
	txs, err := n.sender.send(ctx, w, []contractCall{a.call}, quote, func(txs []*types.Transaction) error {
		tx := txs[0]
		raw, err := tx.MarshalBinary()
		if err != nil {
			return err
		}
		// Fenced by the wallet's lease, as a settlement's record is (recordSigned): a lease lost unknowingly sends
		// nothing.
		_, err = f.recordSigned(wctx, n, w, a.id, journal.Record{}, func(r *journal.Record) error {
			r.State, r.Wallet, r.TxNonce, r.TxHash, r.RawTx = journal.StateBroadcast, w.Address.Hex(), tx.Nonce(), tx.Hash().Hex(), raw
			r.Attempts++
			return nil
		})
		return err
	})
	if len(txs) == 0 {
		// Nothing left: the record goes, so the action may be presented again.
		if rec, ok, gerr := f.journal.Get(wctx, a.id); gerr == nil && ok {
			if rec.State == journal.StateClaimed {
				_ = f.journal.Release(wctx, rec)
			} else if rec.State == journal.StateBroadcast {
				_ = f.journal.ReleaseUnsent(wctx, rec, rec.TxHash)
			}
		}
		if errors.Is(err, journal.ErrFenced) {
			// Refused by the wallet's lease before anything left: certainly not sent (a payer's refund ends its
			// channel's mark at once), and the wallet is out of use here.
			return answer(x402.ReasonNoAvailableWallets, "the %s was not sent: the settlement wallet's lease passed to another instance", a.kind)
		}
		return answer(x402.ReasonUnexpectedSettleError, "the %s was not sent: %v", a.kind, err)
	}
	f.log.Info("batch-settlement action broadcast", zap.String("network", n.caip2), zap.String("action", a.kind),
		zap.String("wallet", w.Address.Hex()), zap.String("tx", txs[0].Hash().Hex()))
	return f.awaitAction(ctx, n, a, txs[0].Hash())
}

// actionAgain answers an action whose record exists: final, from it; broadcast, from its receipt (its recorded
// transaction sent again when the node forgot it); claimed by a sender that is still at it, pending.
func (f *Facilitator) actionAgain(ctx context.Context, n *network, a *batchAction, rec journal.Record) (x402.BatchSettleResponse, error) {
	switch rec.State {
	case journal.StateFinal:
		return f.actionAnswer(ctx, n, a, rec), nil
	case journal.StateBroadcast:
		hash := common.HexToHash(rec.TxHash)
		if r, err := n.backend.TransactionReceipt(ctx, hash); err == nil && r != nil {
			return f.finishAction(ctx, n, a, r)
		}
		if len(rec.RawTx) > 0 {
			var tx types.Transaction
			if err := tx.UnmarshalBinary(rec.RawTx); err == nil {
				if err := n.sender.rebroadcast(ctx, &tx); err != nil && !isNonceConflict(err) {
					f.log.Warn("sending a batch-settlement action again", zap.String("tx", rec.TxHash), zap.Error(err))
				}
			}
		}
		return f.awaitAction(ctx, n, a, hash)
	}
	if f.now().Sub(rec.ClaimedAt) >= unrecordedClaimAge {
		// Its sender records the transaction within moments of the claim (the simulation and the wallet come
		// first): a claim this old never left, and goes, so the action can be sent.
		if err := f.journal.Release(ctx, rec); err == nil {
			return f.sendAction(ctx, n, a)
		}
	}
	return x402.BatchSettleResponse{Network: n.caip2, Payer: a.payer, ErrorReason: x402.ReasonSettlementPending,
		ErrorMessage: fmt.Sprintf("the %s is being sent by another request: present it again", a.kind)}, nil
}

// awaitAction waits for the receipt of the action's transaction hash as long as a settlement waits; not mined by
// then, the answer says it is pending and the action presented again looks it up.
func (f *Facilitator) awaitAction(ctx context.Context, n *network, a *batchAction, hash common.Hash) (x402.BatchSettleResponse, error) {
	deadline := time.Now().Add(n.timeout)
	for {
		r, err := n.backend.TransactionReceipt(ctx, hash)
		if err == nil && r != nil {
			return f.finishAction(ctx, n, a, r)
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return x402.BatchSettleResponse{Network: n.caip2, Payer: a.payer, Transaction: hash.Hex(), ErrorReason: x402.ReasonSettlementPending,
				ErrorMessage: fmt.Sprintf("the %s %s is sent and not yet mined: present it again for its outcome", a.kind, hash.Hex())}, nil
		}
		select {
		case <-ctx.Done():
		case <-time.After(n.watcher.poll):
		}
	}
}

// finishAction makes the action's record final with its receipt, reads again the journal rows of the channels it
// claimed or refunded, and answers.
func (f *Facilitator) finishAction(ctx context.Context, n *network, a *batchAction, r *types.Receipt) (x402.BatchSettleResponse, error) {
	resp := x402.SettleResponse{Success: r.Status == types.ReceiptStatusSuccessful, Transaction: r.TxHash.Hex(), Network: n.caip2, Payer: a.payer}
	if resp.Success {
		resp.Amount = actionAmount(a, r)
	} else {
		resp.ErrorReason = map[string]string{x402.BatchClaim: x402.ReasonBatchClaimTransactionFailed, x402.BatchSettle: x402.ReasonBatchSettleTransactionFailed,
			x402.BatchRefund: x402.ReasonBatchRefundTransactionFailed}[a.kind]
		resp.ErrorMessage = fmt.Sprintf("the %s transaction %s reverted", a.kind, r.TxHash.Hex())
	}
	rec, err := f.journal.Update(context.WithoutCancel(ctx), a.id, func(rec *journal.Record) error {
		if rec.State != journal.StateFinal {
			rec.State, rec.Response, rec.Amount = journal.StateFinal, &resp, resp.Amount
		}
		return nil
	})
	if err != nil {
		f.log.Warn("finishing the record of a batch-settlement action", zap.String("tx", r.TxHash.Hex()), zap.Error(err))
		rec = journal.Record{Response: &resp}
	}
	if resp.Success {
		f.rereadClaimed(ctx, n, a)
	}
	return f.actionAnswer(ctx, n, a, rec), nil
}

// actionAmount is what the action moved, from its receipt's events: a settle's Settled amount, a refund's Refunded
// amount, a claim's claimed deltas.
func actionAmount(a *batchAction, r *types.Receipt) string {
	sum := new(big.Int)
	for _, l := range r.Logs {
		if l.Address != contracts.BatchSettlementAddress || len(l.Topics) == 0 {
			continue
		}
		ev, err := contracts.BatchSettlementABI.EventByID(l.Topics[0])
		if err != nil {
			continue
		}
		want := map[string]string{x402.BatchClaim: "Claimed", x402.BatchSettle: "Settled", x402.BatchRefund: "Refunded"}[a.kind]
		if ev.Name != want {
			continue
		}
		if a.kind == x402.BatchSettle && (len(l.Topics) < 3 || common.BytesToAddress(l.Topics[1].Bytes()) != a.receiver || common.BytesToAddress(l.Topics[2].Bytes()) != a.token) {
			continue
		}
		out, err := ev.Inputs.NonIndexed().Unpack(l.Data)
		if err != nil || len(out) == 0 {
			continue
		}
		if x, ok := out[0].(*big.Int); ok {
			sum.Add(sum, x)
		}
	}
	return sum.String()
}

// rereadClaimed brings the journal rows of the channels a mined action claimed or refunded up to the chain, so
// the vouchers and claims of this engine judge them as they are now. A channel the journal has no row of is left
// alone.
func (f *Facilitator) rereadClaimed(ctx context.Context, n *network, a *batchAction) {
	chs, err := f.channelStore()
	if err != nil {
		return
	}
	for _, c := range a.claimed {
		if _, ok, err := chs.Channel(ctx, n.channelKey(c.id)); err != nil || !ok {
			continue
		}
		if _, err := f.readChannel(ctx, n, chs, c.id, c.wire, c.cfg); err != nil {
			f.log.Warn("reading a channel again after a batch-settlement action", zap.String("channel", c.id.Hex()), zap.Error(err))
		}
	}
}

// actionAnswer is the batch answer of an action's final record; a refund's tells the channel as it is now.
func (f *Facilitator) actionAnswer(ctx context.Context, n *network, a *batchAction, rec journal.Record) x402.BatchSettleResponse {
	if rec.Response == nil {
		return x402.BatchSettleResponse{Network: n.caip2, Payer: a.payer, ErrorReason: x402.ReasonUnexpectedSettleError,
			ErrorMessage: fmt.Sprintf("the record of the %s holds no answer", a.kind)}
	}
	r := rec.Response
	out := x402.BatchSettleResponse{Success: r.Success, Transaction: r.Transaction, Network: r.Network, Payer: r.Payer, Amount: r.Amount,
		ErrorReason: r.ErrorReason, ErrorMessage: r.ErrorMessage}
	if r.Success && a.kind == x402.BatchRefund {
		if st, err := f.readChannelState(ctx, n, a.channel); err == nil {
			out.Extra = &x402.BatchResponseExtra{ChannelState: &x402.BatchChannelState{ChannelID: a.channel.Hex(), Balance: st.balance.String(),
				TotalClaimed: st.claimed.String(), WithdrawRequestedAt: st.withdrawRequestedAt, RefundNonce: st.refundNonce.String()}}
		}
	}
	return out
}

// verifyRefund checks a payer's refund request as the SDK's resource server passes it to /verify before enriching
// it into a /settle refund: the channel and the payer's voucher by CheckVoucher, against the channel read now at
// the head (a refund is rare, and its nonce is the chain's alone), the voucher at exactly what the journal's row
// accepted when this engine accepted the channel's vouchers (else the server keeps the charges, and the voucher
// need only be within the deposit and not below what was claimed). It returns the channel state the server keeps.
func (f *Facilitator) verifyRefund(ctx context.Context, n *network, terms *BatchTerms, chs journal.Channels, p *x402.BatchPayment) (channelState, journal.Channel, error) {
	pl := &p.Payload
	if pl.ChannelConfig == nil || pl.Voucher == nil {
		return channelState{}, journal.Channel{}, refuseBatch(x402.ReasonInvalidPayload, "payload has no channelConfig or voucher")
	}
	ch, err := ParseChannelConfig(*pl.ChannelConfig)
	if err != nil {
		return channelState{}, journal.Channel{}, refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	id := ChannelID(terms.Domain, ch)
	cumulative, err := x402.ParseAmount(pl.Voucher.MaxClaimableAmount)
	if err != nil || !x402.IsBytes32(pl.Voucher.ChannelID) || common.HexToHash(pl.Voucher.ChannelID) != id {
		// CheckVoucher names what is wrong, before any read.
		_, err := terms.CheckVoucher(p, ChannelView{}, n.chainNow())
		return channelState{}, journal.Channel{}, err
	}
	st, err := f.readChannelState(ctx, n, id)
	if err != nil {
		return channelState{}, journal.Channel{}, refuseBatch(x402.ReasonBatchRPCReadFailed, "%v", err)
	}
	view := ChannelView{Balance: st.balance, TotalClaimed: st.claimed, Charged: cumulative, ReadAt: n.chainNow()}
	if st.withdrawRequestedAt != 0 {
		view.WithdrawRequestedAt = time.Unix(st.withdrawRequestedAt, 0)
	}
	row, ok, err := chs.Channel(ctx, n.channelKey(id))
	if err != nil {
		return st, row, fmt.Errorf("reading the journal's row of channel %s: %w", id.Hex(), err)
	}
	if ok && len(row.Signature) > 0 {
		view.Charged = row.Charged
	}
	if ch.PayerAuthorizer == (common.Address{}) {
		code, err := n.backend.CodeAt(ctx, ch.Payer, nil)
		if err != nil {
			return channelState{}, journal.Channel{}, refuseBatch(x402.ReasonBatchRPCReadFailed, "reading the code of payer %s: %v", ch.Payer.Hex(), err)
		}
		view.PayerHasCode = len(code) > 0
	}
	if _, err := terms.CheckVoucher(p, view, n.chainNow()); err != nil {
		return st, row, err
	}
	return st, row, nil
}

// extra is the channel's state as a verification's extra.
func (st channelState) extra(id common.Hash) json.RawMessage {
	b, _ := json.Marshal(x402.BatchChannelState{ChannelID: id.Hex(), Balance: st.balance.String(), TotalClaimed: st.claimed.String(),
		WithdrawRequestedAt: st.withdrawRequestedAt, RefundNonce: st.refundNonce.String()})
	return b
}

// enrichRefund makes a payer's refund, paid to a route this engine is the server of, into the refund this engine
// sends: verified as a refund (verifyRefund), claiming first the last voucher this engine accepted on the channel
// and not yet claimed, of the amount asked for or all that is left, at the channel's next refund nonce, signed by
// this engine's receiverAuthorizer key (authorizerSignature refuses a route whose authorizer it does not hold).
// Presented again once refunded, it is answered by the refund it was. It returns the amount the journal's row
// stood at, which the refund claims to: its mark is set at exactly that amount (settlePayerRefund).
func (f *Facilitator) enrichRefund(ctx context.Context, n *network, req x402.BatchRequest) (x402.BatchPayload, *x402.BatchSettleResponse, *big.Int, error) {
	p := &req.PaymentPayload
	pl := p.Payload
	terms, err := n.batchTerms(req.PaymentRequirements)
	if err != nil {
		return pl, nil, nil, refuseBatch(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	chs, err := f.channelStore()
	if err != nil {
		return pl, nil, nil, err
	}
	st, row, err := f.verifyRefund(ctx, n, terms, chs, p)
	if err != nil {
		return pl, nil, nil, err
	}
	id := common.HexToHash(pl.Voucher.ChannelID)
	if row.Charged == nil {
		// No voucher accepted yet: the row is made now, so that the refund's mark closes the channel to the first.
		cfg, err := ParseChannelConfig(*pl.ChannelConfig)
		if err != nil {
			return pl, nil, nil, refuseBatch(x402.ReasonInvalidPayload, "payload.channelConfig: %v", err)
		}
		if row, err = f.readChannel(ctx, n, chs, id, *pl.ChannelConfig, cfg); err != nil {
			return pl, nil, nil, refuseBatch(x402.ReasonBatchRPCReadFailed, "%v", err)
		}
	}
	after := new(big.Int).Set(st.claimed)
	pl.Claims = []x402.BatchVoucherClaim{}
	if len(row.Signature) > 0 && row.Charged.Cmp(st.claimed) > 0 {
		pl.Claims = append(pl.Claims, x402.BatchVoucherClaim{Voucher: x402.BatchClaimedVoucher{Channel: row.Config, MaxClaimableAmount: row.Charged.String()},
			Signature: hexutil.Encode(row.Signature), TotalClaimed: row.Charged.String()})
		after.Set(row.Charged)
	}
	left := new(big.Int).Sub(st.balance, after)
	if left.Sign() <= 0 && st.refundNonce.Sign() > 0 {
		// Refunded already: the refund presented again gets the answer of the one that emptied the channel.
		prev := journal.PaymentID(n.caip2, actionRefundMethod, contracts.BatchSettlementAddress.Hex(), id.Hex(), new(big.Int).Sub(st.refundNonce, big.NewInt(1)).String())
		if rec, ok, err := f.journal.Get(ctx, prev); err == nil && ok && rec.State == journal.StateFinal && rec.Response != nil && rec.Response.Success {
			resp := f.actionAnswer(ctx, n, &batchAction{kind: x402.BatchRefund, channel: id, payer: pl.ChannelConfig.Payer}, rec)
			return pl, &resp, nil, nil
		}
	}
	amount := left
	if pl.Amount != "" {
		if amount, err = x402.ParseAmount(pl.Amount); err != nil || amount.Sign() == 0 {
			return pl, nil, nil, refuseBatch(x402.ReasonBatchRefundAmountInvalid, "payload.amount %q is not a positive amount", truncate(pl.Amount))
		}
	}
	if left.Sign() <= 0 {
		return pl, nil, nil, refuseBatch(x402.ReasonBatchRefundNoBalance, "channel %s holds %s, all of it charged: nothing to refund", id.Hex(), st.balance)
	}
	if err := refundLeft(id, amount, left); err != nil {
		return pl, nil, nil, err
	}
	pl.Amount, pl.RefundNonce = amount.String(), st.refundNonce.String()
	pl.ClaimAuthorizerSignature, pl.RefundAuthorizerSignature = "", ""
	return pl, nil, row.Charged, nil
}
