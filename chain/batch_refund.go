package chain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payer's own refund, presented to a route this engine serves (a gate's batch route, or our facilitator's
// /settle in the client form), runs apart from the vouchers of its channel and is answered once.
//
// Apart: the refund claims the last voucher the journal's row accepted, then returns the rest. A voucher accepted
// after the refund read the row and before its transaction mined would have bought a response with money the
// refund hands back: the channel would hold only what the refund claimed. So the refund marks the channel's row
// (journal.Channels.MarkRefund) before its transaction can leave, in the compare-and-set that fixes what it claims
// (the row at exactly the amount it read: a voucher accepted since moves it, and the refund reads the row again),
// and AcceptVoucher refuses every voucher of a marked row, on every gateway of the journal and after a restart.
// The mark goes once the refund is mined and the row read again, or once it is known never sent; a mark a crash
// left is resolved by the claimer's pass (resolveRefunds).
//
// Once: a refund presented again (the same voucher, signature and amount) is answered from the refund it was,
// never sent a second time: the refund's request record (payerRefundID), final from the start, names the refund
// nonce it was sent under, and that refund's own record holds its transaction and answer.

// payerRefundMethod names the request records of payers' refunds.
const payerRefundMethod = "batch-payer-refund"

// refundMarkPrefix starts the mark a refund puts on its channel's row: the refund nonce follows, which names the
// refund on chain (one refund per nonce).
const refundMarkPrefix = "refund nonce "

// refundMark is the row's mark of the refund of channel at nonce.
func refundMark(nonce *big.Int) string { return refundMarkPrefix + nonce.String() }

// refundMarkNonce is the refund nonce of a row's mark; false for a mark that is not a refund's of this form.
func refundMarkNonce(mark string) (*big.Int, bool) {
	x, ok := new(big.Int).SetString(strings.TrimPrefix(mark, refundMarkPrefix), 10)
	return x, ok && strings.HasPrefix(mark, refundMarkPrefix) && x.Sign() >= 0
}

// refundMarkAttempts bounds how often a refund reads its channel again after vouchers moved it.
const refundMarkAttempts = 3

// payerRefundID is the journal id of a payer's refund request: its channel, the voucher it is signed at, that
// voucher's signature and the amount asked for ("" for all that is left).
func payerRefundID(n *network, pl *x402.BatchPayload) journal.ID {
	return journal.PaymentID(n.caip2, payerRefundMethod, contracts.BatchSettlementAddress.Hex(), strings.ToLower(pl.Voucher.ChannelID),
		pl.Voucher.MaxClaimableAmount+"/"+strings.ToLower(pl.Voucher.Signature)+"/"+pl.Amount)
}

// refundRequest is what a payer refund's request record keeps: the refund nonce it was sent under.
type refundRequest struct {
	RefundNonce string `json:"refundNonce"`
}

// settlePayerRefund performs a payer's refund (see the top of this file).
func (f *Facilitator) settlePayerRefund(ctx context.Context, n *network, req x402.BatchRequest, payer string) (x402.BatchSettleResponse, error) {
	p := &req.PaymentPayload
	if p.Payload.ChannelConfig == nil || p.Payload.Voucher == nil || !x402.IsBytes32(p.Payload.Voucher.ChannelID) {
		return x402.BatchSettleResponse{}, refuseBatch(x402.ReasonBatchRefundPayload, "a refund carries channelConfig and a voucher naming its channel")
	}
	id := common.HexToHash(p.Payload.Voucher.ChannelID)
	charged := p.Payload.Voucher.MaxClaimableAmount
	reqID := payerRefundID(n, &p.Payload)
	if resp, ok, err := f.payerRefundAgain(ctx, n, reqID, id, payer); err != nil || ok {
		return withCharged(resp, charged), err
	}
	// Judged by its signature before the channel is closed to vouchers: anyone may name a channel, and a refund
	// not its payer's must not hold up the payer's vouchers even for a moment.
	if _, _, err := refundSignedByPayer(n, &p.Payload); err != nil {
		return x402.BatchSettleResponse{}, err
	}
	var (
		pl    x402.BatchPayload
		again *x402.BatchSettleResponse
		err   error
		mark  string
		key   = n.channelKey(id)
	)
	chs, err := f.channelStore()
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	var at *big.Int
	for attempt := 1; ; attempt++ {
		pl, again, at, err = f.enrichRefund(ctx, n, req)
		if err != nil {
			return x402.BatchSettleResponse{}, err
		}
		if again != nil {
			return withCharged(*again, charged), nil
		}
		nonce, _ := x402.ParseAmount(pl.RefundNonce)
		mark = refundMark(nonce)
		row, err := chs.MarkRefund(ctx, key, at, mark)
		if err == nil {
			break
		}
		switch {
		case errors.Is(err, journal.ErrChannelMoved) && attempt < refundMarkAttempts:
			continue // a voucher was accepted since the refund read the row: it claims that one too
		case errors.Is(err, journal.ErrChannelMoved):
			return x402.BatchSettleResponse{}, refuseBatch(x402.ReasonBatchChannelBusy, "vouchers of channel %s are being accepted: present the refund again", id.Hex())
		case errors.Is(err, journal.ErrRefundTaken):
			if old, ok := refundMarkNonce(row.RefundMark); ok && old.Cmp(nonce) < 0 && attempt < refundMarkAttempts {
				// The refund of that mark is mined (the chain's nonce is past it) and its mark was left by a crash.
				if f.endRefundMark(ctx, n, chs, id, row.RefundMark, true) {
					continue
				}
			}
			return x402.BatchSettleResponse{}, refuseBatch(x402.ReasonBatchChannelBusy, "another refund of channel %s is on its way (%s): present the refund again once it is answered", id.Hex(), row.RefundMark)
		}
		return x402.BatchSettleResponse{}, fmt.Errorf("marking channel %s refunded: %w", id.Hex(), err)
	}
	// From here the row is closed to vouchers until endRefundMark opens it.
	keepMark := false
	defer func() {
		if !keepMark {
			f.endRefundMark(context.WithoutCancel(ctx), n, chs, id, mark, true)
		}
	}()
	a, err := f.refundAction(n, &pl, true)
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	a.payer = payer
	a.refundMark, a.refundAt = mark, at
	if err := f.recordRefundRequest(ctx, n, reqID, payer, pl.RefundNonce); err != nil {
		return x402.BatchSettleResponse{}, err
	}
	resp, err := f.performAction(ctx, n, a, &pl)
	switch {
	case err != nil, resp.ErrorReason == x402.ReasonUnexpectedSettleError:
		// Perhaps sent (a journal write failed after the broadcast): the claimer's pass resolves the mark.
		keepMark = true
	case resp.ErrorReason == x402.ReasonSettlementPending && resp.Transaction != "":
		// Sent and not yet mined: the channel stays closed to vouchers until it is, and its row is read again.
		keepMark = true
		go f.openWhenMined(n, a, common.HexToHash(resp.Transaction), mark)
	case resp.ErrorReason == x402.ReasonSettlementPending:
		keepMark = true // being sent by another request of the same refund, under the same mark: it ends it
	}
	return withCharged(resp, charged), err
}

// checkRefundMarkHeld refuses payer refund a, now holding its channel's locks, unless its mark is still on the
// row with the row where it was marked, and young enough to outlast the refund's record. The refund may have
// waited for the locks (another action of the channel sent and not yet mined): a claimer's pass that meanwhile
// took the mark for a refund never sent (no record after unrecordedClaimAge) opened the channel to vouchers, and
// a refund sent now would claim only what the row stood at when marked, handing back the money of vouchers
// served since (the seller unpaid for their responses).
func (f *Facilitator) checkRefundMarkHeld(ctx context.Context, n *network, a *batchAction) error {
	chs, err := f.channelStore()
	if err != nil {
		return err
	}
	row, err := chs.MarkRefund(ctx, n.channelKey(a.channel), a.refundAt, a.refundMark)
	switch {
	case errors.Is(err, journal.ErrChannelMoved), errors.Is(err, journal.ErrRefundTaken):
		return refuseBatch(x402.ReasonBatchChannelBusy, "vouchers of channel %s were accepted while the refund waited for the channel: present the refund again", a.channel.Hex())
	case err != nil:
		return fmt.Errorf("checking the refund's mark on channel %s: %w", a.channel.Hex(), err)
	case f.now().Sub(row.RefundMarkedAt) >= unrecordedClaimAge/2:
		// Left as it is, a claimer's pass could take the mark before the refund's record is written.
		return refuseBatch(x402.ReasonBatchChannelBusy, "the refund of channel %s waited too long for the channel: present the refund again", a.channel.Hex())
	}
	return nil
}

// endRefundMark takes the refund mark mark off channel id's row: after reading the channel on chain again when
// reread says so (the refund mined, or perhaps: the row must hold the deposit the refund left before vouchers are
// judged by it again). It reports whether the mark is gone; a read that failed leaves it for the claimer's pass.
func (f *Facilitator) endRefundMark(ctx context.Context, n *network, chs journal.Channels, id common.Hash, mark string, reread bool) bool {
	key := n.channelKey(id)
	if reread {
		row, ok, err := chs.Channel(ctx, key)
		if err != nil || !ok {
			return false
		}
		cfg, err := ParseChannelConfig(row.Config)
		if err != nil {
			return false
		}
		if _, err := f.readChannel(ctx, n, chs, id, row.Config, cfg); err != nil {
			f.log.Warn("reading a channel again after a refund; it stays closed to vouchers until the next pass", zap.String("channel", id.Hex()), zap.Error(err))
			return false
		}
	}
	if _, err := chs.ClearRefund(ctx, key, mark); err != nil {
		f.log.Warn("opening a channel to vouchers after a refund; the next pass tries again", zap.String("channel", id.Hex()), zap.Error(err))
		return false
	}
	return true
}

// resolveRefunds ends the refund marks of network's rows whose refund is over: mined (the chain's refund nonce is
// past the mark's, or the refund's record is final), or never sent (no record, or one only claimed, older than a
// sender takes to record its transaction). A refund broadcast and not yet mined keeps its mark; its transaction is
// sent again when the node forgot it.
func (f *Facilitator) resolveRefunds(ctx context.Context, n *network, chs journal.Channels) error {
	rows, err := chs.RefundsInFlight(ctx, n.caip2)
	if err != nil {
		return fmt.Errorf("listing refunds in flight: %w", err)
	}
	for _, r := range rows {
		id := common.HexToHash(r.Key.ID)
		nonce, ok := refundMarkNonce(r.RefundMark)
		if !ok {
			continue // not an engine's mark (a remote server's of another form): its owner resolves it
		}
		st, err := f.readChannelState(ctx, n, id)
		if err != nil {
			return err
		}
		if st.refundNonce.Cmp(nonce) > 0 {
			f.endRefundMark(ctx, n, chs, id, r.RefundMark, true)
			continue
		}
		aid := journal.PaymentID(n.caip2, actionRefundMethod, contracts.BatchSettlementAddress.Hex(), id.Hex(), nonce.String())
		rec, found, err := f.journal.Get(ctx, aid)
		if err != nil {
			return err
		}
		old := f.now().Sub(r.RefundMarkedAt) >= unrecordedClaimAge
		switch {
		case !found || rec.State == journal.StateClaimed:
			if old {
				f.endRefundMark(ctx, n, chs, id, r.RefundMark, false)
			}
		case rec.State == journal.StateFinal:
			f.endRefundMark(ctx, n, chs, id, r.RefundMark, true)
		case rec.State == journal.StateBroadcast:
			hash := common.HexToHash(rec.TxHash)
			if rcpt, err := n.backend.TransactionReceipt(ctx, hash); err == nil && rcpt != nil {
				a := &batchAction{kind: x402.BatchRefund, channel: id, id: aid}
				if _, err := f.finishAction(ctx, n, a, rcpt); err == nil {
					f.endRefundMark(ctx, n, chs, id, r.RefundMark, true)
				}
				continue
			}
			var tx types.Transaction
			if len(rec.RawTx) > 0 && tx.UnmarshalBinary(rec.RawTx) == nil {
				if err := n.sender.rebroadcast(ctx, &tx); err != nil && !isNonceConflict(err) {
					f.log.Warn("sending a refund again", zap.String("tx", rec.TxHash), zap.Error(err))
				}
			}
		}
	}
	return nil
}

// withCharged adds to a refund's successful answer what the channel's accepted vouchers charge (the voucher the
// refund is signed at), as the SDK's batch-settlement server tells its client.
func withCharged(resp x402.BatchSettleResponse, charged string) x402.BatchSettleResponse {
	if !resp.Success {
		return resp
	}
	if resp.Extra == nil {
		resp.Extra = &x402.BatchResponseExtra{}
	}
	if resp.Extra.ChannelState == nil {
		resp.Extra.ChannelState = &x402.BatchChannelState{}
	}
	cs := *resp.Extra.ChannelState
	cs.ChargedCumulativeAmount = charged
	extra := *resp.Extra
	extra.ChannelState = &cs
	resp.Extra = &extra
	return resp
}

// payerRefundAgain answers a payer's refund presented again from the refund it was: ok false when it was never
// sent (no request record, or one whose refund has no record: refused before anything left).
func (f *Facilitator) payerRefundAgain(ctx context.Context, n *network, reqID journal.ID, id common.Hash, payer string) (x402.BatchSettleResponse, bool, error) {
	rec, ok, err := f.journal.Get(ctx, reqID)
	if err != nil {
		return x402.BatchSettleResponse{}, false, fmt.Errorf("reading the record of the refund: %w", err)
	}
	if !ok {
		return x402.BatchSettleResponse{}, false, nil
	}
	var rr refundRequest
	if err := json.Unmarshal(rec.Request, &rr); err != nil || rr.RefundNonce == "" {
		return x402.BatchSettleResponse{}, false, nil
	}
	a := &batchAction{kind: x402.BatchRefund, channel: id, payer: payer, locks: []string{actionKey(id)},
		id: journal.PaymentID(n.caip2, actionRefundMethod, contracts.BatchSettlementAddress.Hex(), id.Hex(), rr.RefundNonce)}
	act, ok, err := f.journal.Get(ctx, a.id)
	if err != nil {
		return x402.BatchSettleResponse{}, false, fmt.Errorf("reading the record of the refund: %w", err)
	}
	if !ok || revertedAction(act) {
		// Nothing left, or it reverted and moved nothing: the refund goes as if new (runAction retries it).
		return x402.BatchSettleResponse{}, false, nil
	}
	unlock := n.batch.actions.lock(a.locks)
	defer unlock()
	resp, err := f.actionAgain(ctx, n, a, act)
	if err == nil && resp.Success {
		f.rereadRefunded(ctx, n, id)
	}
	return resp, true, err
}

// recordRefundRequest writes the request record of a payer's refund before its transaction can leave, naming
// the refund nonce it goes under (a record of an earlier attempt that sent nothing is made to name this one).
func (f *Facilitator) recordRefundRequest(ctx context.Context, n *network, reqID journal.ID, payer, nonce string) error {
	body, err := json.Marshal(refundRequest{RefundNonce: nonce})
	if err != nil {
		return err
	}
	got, claimed, err := f.journal.Claim(ctx, journal.Record{ID: reqID, State: journal.StateFinal, Network: n.caip2, Payer: payer,
		Asset: contracts.BatchSettlementAddress.Hex(), Request: body,
		// A final record holds an answer: this one only points at the refund's own record, which holds its outcome.
		Response: &x402.SettleResponse{Network: n.caip2, Payer: payer,
			ErrorMessage: "a payer's refund request, sent under refund nonce " + nonce + ": its refund's record holds the outcome"}})
	if err != nil {
		return fmt.Errorf("recording the refund: %w", err)
	}
	if !claimed && string(got.Request) != string(body) {
		if _, err := f.journal.Update(ctx, reqID, func(r *journal.Record) error {
			r.Request = body
			r.Response.ErrorMessage = "a payer's refund request, sent under refund nonce " + nonce + ": its refund's record holds the outcome"
			return nil
		}); err != nil {
			return fmt.Errorf("recording the refund: %w", err)
		}
	}
	return nil
}

// openWhenMined waits for a payer refund's transaction sent and not yet mined, then reads its channel again and
// takes the refund's mark off it. It waits as long as the refund is unresolved: until its receipt is found, or its record is
// made final by whoever resolved it (the refund presented again, which also sends a transaction the node forgot),
// or the engine closes. A channel opened before its refund mined would take vouchers against a deposit the refund
// is about to return.
func (f *Facilitator) openWhenMined(n *network, a *batchAction, hash common.Hash, mark string) {
	ctx := context.Background()
	for {
		if r, err := n.backend.TransactionReceipt(ctx, hash); err == nil && r != nil {
			if _, err := f.finishAction(ctx, n, a, r); err != nil {
				f.log.Warn("finishing a payer's refund mined after its answer", zap.String("tx", hash.Hex()), zap.Error(err))
			}
			break
		}
		if rec, ok, err := f.journal.Get(ctx, a.id); err == nil && ok && rec.State == journal.StateFinal {
			break
		}
		select {
		case <-f.stop:
			return // the mark stays: the next start's claimer resolves it
		case <-time.After(n.watcher.poll):
		}
	}
	if chs, err := f.channelStore(); err == nil {
		f.endRefundMark(ctx, n, chs, a.channel, mark, true)
	}
}

// rereadRefunded brings the journal's row of channel id up to the chain after a refund, when there is one.
func (f *Facilitator) rereadRefunded(ctx context.Context, n *network, id common.Hash) {
	chs, err := f.channelStore()
	if err != nil {
		return
	}
	row, ok, err := chs.Channel(ctx, n.channelKey(id))
	if err != nil || !ok {
		return
	}
	cfg, err := ParseChannelConfig(row.Config)
	if err != nil {
		return
	}
	if _, err := f.readChannel(ctx, n, chs, id, row.Config, cfg); err != nil {
		f.log.Warn("reading a channel again after a refund", zap.String("channel", id.Hex()), zap.Error(err))
	}
}

// refundLeft refuses a refund of more than what is left: the escrow would pay out only what is left, and the
// payer would be told of a refund that did not happen as asked.
func refundLeft(id common.Hash, amount, left *big.Int) error {
	if amount.Cmp(left) > 0 {
		return refuseBatch(x402.ReasonBatchRefundAmountInvalid, "payload.amount %s is more than the %s left in channel %s once what was charged is claimed", amount, left, id.Hex())
	}
	return nil
}

// withCorrective adds to a payment refused because its cumulative amount is not the one the journal's row stands
// at (a voucher, or a payer's refund, signed by the channel's payer: CheckVoucher judges the signature first) the
// channel as the row holds it and the last voucher it accepted, as the SDK's batch-settlement server answers such
// a payment with a corrective 402: the payer (a new run of it, say, that knows only what the escrow shows
// claimed) checks that voucher is its own and carries on from it.
func (f *Facilitator) withCorrective(ctx context.Context, req x402.BatchRequest, resp x402.BatchSettleResponse) x402.BatchSettleResponse {
	pl := &req.PaymentPayload.Payload
	if resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeAmountMismatch || pl.Voucher == nil || !x402.IsBytes32(pl.Voucher.ChannelID) {
		return resp
	}
	n := f.networks[req.PaymentRequirements.Network]
	chs, err := f.channelStore()
	if n == nil || err != nil {
		return resp
	}
	row, ok, err := chs.Channel(ctx, n.channelKey(common.HexToHash(pl.Voucher.ChannelID)))
	if err != nil || !ok || len(row.Signature) == 0 {
		return resp
	}
	resp.Extra = &x402.BatchResponseExtra{
		ChannelState: &x402.BatchChannelState{ChannelID: row.Key.ID, Balance: orZero(row.Deposit).String(), TotalClaimed: orZero(row.Claimed).String(),
			WithdrawRequestedAt: unixOrZero(row.WithdrawRequestedAt), RefundNonce: "0", ChargedCumulativeAmount: row.Charged.String()},
		VoucherState: &x402.BatchVoucherState{SignedMaxClaimable: row.Charged.String(), Signature: hexutil.Encode(row.Signature)},
	}
	return resp
}
