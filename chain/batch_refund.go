package chain

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
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
// refund hands back: the channel would hold only what the refund claimed. So while a payer's refund runs, from
// before it reads the row until its transaction is mined and the row read again, this process accepts no voucher
// of the channel (channel busy, nothing charged); and it reads the row only once the vouchers being accepted have
// been written.
//
// Once: a refund presented again (the same voucher, signature and amount) is answered from the refund it was,
// never sent a second time: the refund's request record (payerRefundID), final from the start, names the refund
// nonce it was sent under, and that refund's own record holds its transaction and answer.

// payerRefundMethod names the request records of payers' refunds.
const payerRefundMethod = "batch-payer-refund"

// refundFence keeps a process's payer refunds and voucher acceptances of one channel apart (see above).
type refundFence struct {
	mu        sync.Mutex
	refunding map[common.Hash]int
	accepting map[common.Hash]int
}

// acceptVoucher reports whether a voucher of channel id may be accepted now (no refund of it is running), and
// if so counts it as being accepted until done is called.
func (f *refundFence) acceptVoucher(id common.Hash) (done func(), ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refunding[id] > 0 {
		return nil, false
	}
	if f.accepting == nil {
		f.accepting = map[common.Hash]int{}
	}
	f.accepting[id]++
	return func() {
		f.mu.Lock()
		if f.accepting[id]--; f.accepting[id] <= 0 {
			delete(f.accepting, id)
		}
		f.mu.Unlock()
	}, true
}

// refund closes channel id to vouchers and waits, at most wait, for the acceptances already under way to be
// written, so that a read of the row after it sees them all. It returns the function that opens the channel
// again; ok false: an acceptance did not finish in time, and the channel is open as before.
func (f *refundFence) refund(id common.Hash, wait time.Duration) (open func(), ok bool) {
	f.mu.Lock()
	if f.refunding == nil {
		f.refunding = map[common.Hash]int{}
	}
	f.refunding[id]++
	f.mu.Unlock()
	var once sync.Once
	open = func() {
		once.Do(func() {
			f.mu.Lock()
			if f.refunding[id]--; f.refunding[id] <= 0 {
				delete(f.refunding, id)
			}
			f.mu.Unlock()
		})
	}
	deadline := time.Now().Add(wait)
	for {
		f.mu.Lock()
		busy := f.accepting[id] > 0
		f.mu.Unlock()
		if !busy {
			return open, true
		}
		if time.Now().After(deadline) {
			open()
			return nil, false
		}
		time.Sleep(time.Millisecond)
	}
}

// refundFenceWait bounds how long a refund waits for the voucher acceptances of its channel under way: each is
// one write of the row.
const refundFenceWait = 2 * time.Second

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
	open, ok := n.batch.fence.refund(id, refundFenceWait)
	if !ok {
		return x402.BatchSettleResponse{}, refuseBatch(x402.ReasonBatchChannelBusy, "vouchers of channel %s are being accepted: present the refund again", id.Hex())
	}
	keepClosed := false
	defer func() {
		if !keepClosed {
			open()
		}
	}()
	pl, again, err := f.enrichRefund(ctx, n, req)
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	if again != nil {
		return withCharged(*again, charged), nil
	}
	a, err := f.refundAction(n, &pl, true)
	if err != nil {
		return x402.BatchSettleResponse{}, err
	}
	a.payer = payer
	if err := f.recordRefundRequest(ctx, n, reqID, payer, pl.RefundNonce); err != nil {
		return x402.BatchSettleResponse{}, err
	}
	resp, err := f.performAction(ctx, n, a, &pl)
	if err == nil && resp.ErrorReason == x402.ReasonSettlementPending && resp.Transaction != "" {
		// Sent and not yet mined: the channel stays closed to vouchers until it is, and its row is read again.
		keepClosed = true
		go f.openWhenMined(n, a, common.HexToHash(resp.Transaction), open)
	}
	return withCharged(resp, charged), err
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
// opens it to vouchers. It waits as long as the refund is unresolved: until its receipt is found, or its record is
// made final by whoever resolved it (the refund presented again, which also sends a transaction the node forgot),
// or the engine closes. A channel opened before its refund mined would take vouchers against a deposit the refund
// is about to return.
func (f *Facilitator) openWhenMined(n *network, a *batchAction, hash common.Hash, open func()) {
	defer open()
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
			return
		case <-time.After(n.watcher.poll):
		}
	}
	f.rereadRefunded(ctx, n, a.channel)
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
