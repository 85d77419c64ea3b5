package chain

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The engine's side of batch-settlement vouchers: a voucher is judged against the journal's row of its channel
// (journal.Channels) with no chain call while the row's read of the chain is fresh, and accepted by one
// compare-and-set of the row's cumulative amount, durable before the answer that lets the response be served.
//
// A voucher accepted is charged once, and buys one response. Each accepted voucher gets a final journal record
// (BatchVoucherID: the channel and the cumulative amount, which only grows, name it) holding its answer; the
// gate marks it served (journal.Store.MarkServed) once the response is delivered. The same voucher presented
// again is recognised by the row (it stands at that voucher, with its signature) or by its record: unserved, it
// gets its answer again and is charged nothing more; served, it is refused as used. A crash between the
// compare-and-set and the record is covered by the row: the record is written when the voucher comes again.

// defaultBatchClaimMargin is NetworkConfig.BatchClaimMargin's default.
const defaultBatchClaimMargin = 5 * time.Minute

// maxBatchCaches bounds the engine's caches of batch terms and block times; past it they start afresh.
const maxBatchCaches = 4096

// batchNetwork is a network's batch-settlement state in memory: only caches, each rebuilt from the chain or
// the requirements when lost.
type batchNetwork struct {
	margin time.Duration

	mu sync.Mutex
	// terms are the parsed terms of each requirement seen (its channel and voucher states left out).
	terms map[x402.BatchRequirements]*BatchTerms
	// blockTimes are the times of blocks a channel was read at, by number.
	blockTimes map[uint64]time.Time
	// payerCode says, per channel read by this engine, whether its payer had code at the read.
	payerCode map[common.Hash]bool
	// chainTime is the latest head block time seen (unix seconds): the engine's chain clock between reads.
	chainTime atomic.Int64
	// actions serialises the receiver's /settle actions (claim, settle, refund) on one channel or payee.
	actions actionLocks
	// sending are the claim transactions this process is sending: marked on their channels, their record being
	// written, not yet sent or given up (under mu).
	sending map[common.Hash]bool
	// leftWarned is when this process last warned that it left claims under a pending withdrawal to the cluster's
	// other instances (leftClaims; under mu).
	leftWarned time.Time
	// channels remembers the channel configurations of the network's vouchers, for every terms of it.
	channels *channelMemo
}

func newBatchNetwork(margin time.Duration) (*batchNetwork, error) {
	if margin == 0 {
		margin = defaultBatchClaimMargin
	}
	if margin < 0 || margin >= contracts.MinWithdrawDelay*time.Second {
		return nil, fmt.Errorf("batch claim margin %s must be positive and under the shortest withdrawDelay %ds", margin, contracts.MinWithdrawDelay)
	}
	return &batchNetwork{margin: margin, channels: newChannelMemo(), terms: map[x402.BatchRequirements]*BatchTerms{}, blockTimes: map[uint64]time.Time{},
		payerCode: map[common.Hash]bool{}, sending: map[common.Hash]bool{}}, nil
}

// BatchVoucherID is the journal id of the voucher of channel channelID on network for cumulative: the record
// that holds its answer and, once a gate delivered the response it bought, its served mark.
func BatchVoucherID(network string, channelID common.Hash, cumulative *big.Int) journal.ID {
	return journal.BatchVoucherID(network, channelID.Hex(), cumulative.String())
}

// batchTerms returns the parsed terms of rq on n.
func (n *network) batchTerms(rq x402.BatchRequirements) (*BatchTerms, error) {
	rq.Extra.ChannelState, rq.Extra.VoucherState = nil, nil
	b := n.batch
	b.mu.Lock()
	t, ok := b.terms[rq]
	b.mu.Unlock()
	if ok {
		return t, nil
	}
	t, err := NewBatchTerms(rq, n.chainID, b.margin)
	if err != nil {
		return nil, err
	}
	t.channels = b.channels
	b.mu.Lock()
	if len(b.terms) >= maxBatchCaches {
		clear(b.terms)
	}
	b.terms[rq] = t
	b.mu.Unlock()
	return t, nil
}

// chainNow is the engine's chain time with no call: the latest head seen, or the wall clock when it is later
// (a chain quiet since its last block jumps to the wall clock at its next).
func (n *network) chainNow() time.Time {
	now := n.now()
	if seen := time.Unix(n.batch.chainTime.Load(), 0); seen.After(now) {
		return seen
	}
	return now
}

func (b *batchNetwork) sawBlock(number, at uint64) {
	b.mu.Lock()
	if len(b.blockTimes) >= maxBatchCaches {
		clear(b.blockTimes)
	}
	b.blockTimes[number] = time.Unix(int64(at), 0)
	b.mu.Unlock()
	for {
		cur := b.chainTime.Load()
		if int64(at) <= cur || b.chainTime.CompareAndSwap(cur, int64(at)) {
			return
		}
	}
}

// blockTime is the time of block number, read once.
func (n *network) blockTime(ctx context.Context, number uint64) (time.Time, error) {
	b := n.batch
	b.mu.Lock()
	at, ok := b.blockTimes[number]
	b.mu.Unlock()
	if ok {
		return at, nil
	}
	h, err := n.backend.HeaderByNumber(ctx, new(big.Int).SetUint64(number))
	if err != nil {
		return time.Time{}, fmt.Errorf("reading block %d, the channel's last read: %w", number, err)
	}
	b.sawBlock(number, h.Time)
	return time.Unix(int64(h.Time), 0), nil
}

// channelStore is the engine's journal as batch-settlement channel rows.
func (f *Facilitator) channelStore() (journal.Channels, error) {
	chs, ok := f.journal.(journal.Channels)
	if !ok {
		return nil, fmt.Errorf("the settlement journal %T keeps no batch-settlement channels", f.journal)
	}
	return chs, nil
}

// channelKey is the journal's key of channel id on n.
func (n *network) channelKey(id common.Hash) journal.ChannelKey {
	return journal.ChannelKey{Network: n.caip2, Escrow: contracts.BatchSettlementAddress.Hex(), ID: id.Hex()}
}

// readChannel reads channel id (configuration wire, parsed ch) from the escrow at the head block and records
// what it found in the journal (ObserveChannel), returning the row as it stands after.
func (f *Facilitator) readChannel(ctx context.Context, n *network, chs journal.Channels, id common.Hash, wire x402.ChannelConfig, ch contracts.ChannelConfig) (journal.Channel, error) {
	head, err := n.backend.HeaderByNumber(ctx, nil)
	if err != nil {
		return journal.Channel{}, fmt.Errorf("reading the head block: %w", err)
	}
	n.batch.sawBlock(head.Number.Uint64(), head.Time)
	view := func(method string) ([]any, error) {
		data, err := contracts.PackBatchSettlement(method, id)
		if err != nil {
			return nil, err
		}
		to := contracts.BatchSettlementAddress
		raw, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, head.Number)
		if err != nil {
			return nil, fmt.Errorf("reading %s of channel %s at block %s: %w", method, id.Hex(), head.Number, err)
		}
		out, err := contracts.BatchSettlementABI.Unpack(method, raw)
		if err != nil || len(out) != 2 {
			return nil, fmt.Errorf("reading %s of channel %s: the escrow answered %d bytes that are not its outputs (%v)", method, id.Hex(), len(raw), err)
		}
		return out, nil
	}
	state, err := view("channels")
	if err != nil {
		return journal.Channel{}, err
	}
	pending, err := view("pendingWithdrawals")
	if err != nil {
		return journal.Channel{}, err
	}
	read := journal.ChannelRead{Key: n.channelKey(id), Config: wire, Block: head.Number.Uint64()}
	read.Deposit, _ = state[0].(*big.Int)
	read.TotalClaimed, _ = state[1].(*big.Int)
	if at, _ := pending[1].(*big.Int); at != nil && at.Sign() > 0 {
		read.WithdrawRequestedAt = time.Unix(at.Int64(), 0)
		read.WithdrawAmount, _ = pending[0].(*big.Int)
	}
	if ch.PayerAuthorizer == (common.Address{}) {
		code, err := n.backend.CodeAt(ctx, ch.Payer, head.Number)
		if err != nil {
			return journal.Channel{}, fmt.Errorf("reading the code of payer %s: %w", ch.Payer.Hex(), err)
		}
		n.batch.mu.Lock()
		if len(n.batch.payerCode) >= maxBatchCaches {
			clear(n.batch.payerCode)
		}
		n.batch.payerCode[id] = len(code) > 0
		n.batch.mu.Unlock()
	}
	row, err := chs.ObserveChannel(ctx, read)
	if err != nil {
		return journal.Channel{}, fmt.Errorf("recording the read of channel %s: %w", id.Hex(), err)
	}
	return row, nil
}

// channelView builds what CheckVoucher judges a voucher by from the journal's row: the chain's part as the row's
// last read saw it, at the time of the block it read.
func (f *Facilitator) channelView(ctx context.Context, n *network, row journal.Channel, ch contracts.ChannelConfig, id common.Hash) (ChannelView, error) {
	v := ChannelView{Balance: row.Deposit, TotalClaimed: row.Claimed, Charged: row.Charged,
		WithdrawRequestedAt: row.WithdrawRequestedAt, WithdrawAmount: row.WithdrawAmount}
	if row.Withdrawn {
		v.Balance = new(big.Int) // refunded or withdrawn: it covers nothing
	}
	at, err := n.blockTime(ctx, row.DepositBlock)
	if err != nil {
		return v, err
	}
	v.ReadAt = at
	if ch.PayerAuthorizer == (common.Address{}) {
		n.batch.mu.Lock()
		has, ok := n.batch.payerCode[id]
		n.batch.mu.Unlock()
		if !ok {
			// Another engine read the channel: ask once, at the head, whether the payer has code now.
			code, err := n.backend.CodeAt(ctx, ch.Payer, nil)
			if err != nil {
				return v, fmt.Errorf("reading the code of payer %s: %w", ch.Payer.Hex(), err)
			}
			has = len(code) > 0
		}
		v.PayerHasCode = has
	}
	return v, nil
}

// voucherCheck is a voucher judged against its channel's row: accepted (to be recorded), or presented again
// (accepted before: the row stands at it, or it is an earlier voucher of the row's with its record; again set),
// or refused.
type voucherCheck struct {
	terms *BatchTerms
	key   journal.ChannelKey
	row   journal.Channel
	av    AcceptedVoucher
	// again says this very voucher was accepted before; cumulative is its amount: the row's, or an earlier one's.
	again      bool
	cumulative *big.Int
}

// checkVoucher judges voucher payment p against the row of its channel, reading the channel from the chain only
// when the journal has no row of it, the row's read is too old to vouch for the deposit, or the deposit the row
// holds does not cover the voucher (a top-up since).
//
// extra, when not nil, is a deposit the voucher comes with: the channel is judged as holding it too.
func (f *Facilitator) checkVoucherWith(ctx context.Context, n *network, chs journal.Channels, terms *BatchTerms, p *x402.BatchPayment, extra *big.Int) (voucherCheck, error) {
	vc := voucherCheck{terms: terms}
	pl := &p.Payload
	if pl.Type != x402.BatchVoucher {
		return vc, refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload.type is %q, this engine settles vouchers and deposits", truncate(pl.Type))
	}
	if pl.ChannelConfig == nil || pl.Voucher == nil {
		return vc, refuseBatch(x402.ReasonInvalidPayload, "payload has no channelConfig or voucher")
	}
	ch, id, err := terms.channels.of(terms.Domain, *pl.ChannelConfig)
	if err != nil {
		return vc, refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	if !x402.IsBytes32(pl.Voucher.ChannelID) || common.HexToHash(pl.Voucher.ChannelID) != id {
		// CheckVoucher says which, before any read.
		_, err := terms.CheckVoucher(p, ChannelView{}, n.chainNow())
		return vc, err
	}
	vc.key = n.channelKey(id)
	row, ok, err := chs.Channel(ctx, vc.key)
	if err != nil {
		return vc, fmt.Errorf("reading the journal's row of channel %s: %w", id.Hex(), err)
	}
	read := false
	if !ok {
		if row, err = f.readChannel(ctx, n, chs, id, *pl.ChannelConfig, ch); err != nil {
			return vc, err
		}
		read = true
	}
	for {
		vc.row = row
		if presentedAgain(terms, row, p, ch, id) {
			vc.again, vc.cumulative = true, row.Charged
			return vc, nil
		}
		if cumulative, ok, err := earlierVoucher(ctx, f.journal, terms, row, p, ch, id); err != nil {
			return vc, err
		} else if ok {
			vc.again, vc.cumulative = true, cumulative
			return vc, nil
		}
		view, err := f.channelView(ctx, n, row, ch, id)
		if err != nil {
			return vc, err
		}
		if extra != nil {
			view.Balance = new(big.Int).Add(orZero(view.Balance), extra)
		}
		vc.av, err = terms.CheckVoucher(p, view, n.chainNow())
		var refusal *BatchRefusal
		stale := IsStaleChannelView(err)
		short := errors.As(err, &refusal) && (refusal.Reason == x402.ReasonBatchCumulativeExceedsBalance || refusal.Reason == x402.ReasonBatchChannelNotFound)
		if read || !(stale || short) {
			return vc, err
		}
		if row, err = f.readChannel(ctx, n, chs, id, *pl.ChannelConfig, ch); err != nil {
			return vc, err
		}
		read = true
	}
}

// presentedAgain reports whether the row stands at exactly voucher payment p: the last voucher accepted is this
// one, with this signature (the cumulative amount alone could be another signature's).
// A channel of another route (receiver, authorizer, token) is never this route's voucher: CheckVoucher refuses it.
func presentedAgain(terms *BatchTerms, row journal.Channel, p *x402.BatchPayment, ch contracts.ChannelConfig, id common.Hash) bool {
	if !ofTerms(terms, p, ch) {
		return false
	}
	cumulative, err := x402.ParseAmount(p.Payload.Voucher.MaxClaimableAmount)
	if err != nil || row.Charged == nil || cumulative.Cmp(row.Charged) != 0 || len(row.Signature) == 0 {
		return false
	}
	sig, err := ParseSignature(p.Payload.Voucher.Signature)
	if err != nil {
		return false
	}
	digest := VoucherDigest(terms.Domain, id, cumulative)
	return string(sig[:]) == string(row.Signature) && string(digest[:]) == string(row.Digest)
}

// ofTerms reports whether payment p, of channel ch, is paid under terms: the route's receiver, authorizer, token,
// network and scheme. A voucher of another route's channel is never answered as presented again here.
func ofTerms(terms *BatchTerms, p *x402.BatchPayment, ch contracts.ChannelConfig) bool {
	return ch.Receiver == terms.Receiver && ch.ReceiverAuthorizer == terms.ReceiverAuthorizer && ch.Token == terms.Token &&
		p.Accepted.Network == terms.Network && p.Accepted.Scheme == x402.SchemeBatchSettlement
}

// earlierVoucher reports whether voucher payment p is a voucher its channel accepted before the one the row
// stands at (a smaller cumulative amount, signed by the channel's voucher signer) whose response was not delivered
// yet, presented again for the resource it was accepted for: its record says so. cumulative is its amount. The row
// keeps only the channel's last voucher, and a payer whose response failed (an upstream error, a connection cut)
// may have paid its next voucher, for another resource, before presenting this one again: it is answered from its
// record as first, charging nothing more. Any other voucher of a smaller amount (never accepted here, served, or
// accepted for another resource) is judged as any: CheckVoucher refuses it below the row's amount, with the
// corrective answer that resyncs a payer that lost count.
func earlierVoucher(ctx context.Context, store journal.Store, terms *BatchTerms, row journal.Channel, p *x402.BatchPayment, ch contracts.ChannelConfig, id common.Hash) (*big.Int, bool, error) {
	if !ofTerms(terms, p, ch) || p.Payload.Type != x402.BatchVoucher {
		return nil, false, nil
	}
	cumulative, err := x402.ParseAmount(p.Payload.Voucher.MaxClaimableAmount)
	if err != nil || cumulative.Sign() <= 0 || row.Charged == nil || cumulative.Cmp(row.Charged) >= 0 {
		return nil, false, nil
	}
	sig, err := ParseSignature(p.Payload.Voucher.Signature)
	if err != nil {
		return nil, false, nil
	}
	signer := ch.PayerAuthorizer
	if signer == (common.Address{}) {
		signer = ch.Payer
	}
	if got, err := RecoverSigner(VoucherDigest(terms.Domain, id, cumulative), sig); err != nil || got != signer {
		return nil, false, nil
	}
	rec, found, err := store.Get(ctx, BatchVoucherID(terms.Network, id, cumulative))
	if err != nil {
		return nil, false, fmt.Errorf("reading the record of the voucher for cumulative amount %s: %w", cumulative, err)
	}
	if !found || rec.Served {
		return nil, false, nil
	}
	// A gate's request must find the record noted for this very resource, at this route or one that sells it at
	// the price it was charged (RecordNote.Buys): a record without a note (the voucher settled through the
	// facilitator's /settle, at whatever price its caller named) buys nothing here.
	if note, noted := journal.RecordNoteOf(ctx); noted && !note.Buys(rec) {
		return nil, false, nil
	}
	return cumulative, true, nil
}

// earlierSpent is voucherSpent of an earlier voucher (earlierVoucher): its record is there; served, it is used.
func earlierSpent(ctx context.Context, store journal.Store, network string, row journal.Channel, cumulative *big.Int) error {
	rec, ok, err := store.Get(ctx, BatchVoucherID(network, common.HexToHash(row.Key.ID), cumulative))
	switch {
	case err != nil:
		return fmt.Errorf("reading the record of the voucher: %w", err)
	case ok && rec.Served:
		return voucherServed(cumulative, rec.ServedAt)
	case !ok:
		return refuseBatch(x402.ReasonPaymentAlreadyUsed, "the voucher for cumulative amount %s is no longer on record: sign the next voucher", cumulative)
	}
	return nil
}

// acceptToken names one acceptance: this process and a random part, unique to the request.
func (f *Facilitator) acceptToken() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return f.owner + "/" + hex.EncodeToString(b[:])
}

// batchNetworkOf returns the network of a batch requirement, or a refusal naming it.
func (f *Facilitator) batchNetworkOf(rq x402.BatchRequirements) (*network, error) {
	n := f.networks[rq.Network]
	if n == nil {
		return nil, refuseBatch(x402.ReasonBatchNetworkMismatch, "paymentRequirements.network is %q, which this facilitator does not settle", truncate(rq.Network))
	}
	return n, nil
}

// VerifyBatch implements x402.BatchFacilitator: a voucher is checked against its channel's journal row (no chain
// call while the row's read is fresh), changing nothing; a voucher whose response was not yet delivered is
// valid again.
func (f *Facilitator) VerifyBatch(ctx context.Context, req x402.BatchRequest) (x402.VerifyResponse, error) {
	p := &req.PaymentPayload
	payer := ""
	if p.Payload.ChannelConfig != nil {
		payer = p.Payload.ChannelConfig.Payer
	}
	invalid := func(err error) (x402.VerifyResponse, error) {
		var r *BatchRefusal
		if errors.As(err, &r) {
			return x402.VerifyResponse{IsValid: false, Payer: payer, InvalidReason: r.Reason, InvalidMessage: r.Message}, nil
		}
		return x402.VerifyResponse{IsValid: false, Payer: payer, InvalidReason: x402.ReasonUnexpectedVerifyError,
			InvalidMessage: err.Error()}, nil
	}
	n, terms, chs, err := f.batchSetup(req)
	if err != nil {
		return invalid(err)
	}
	switch p.Payload.Type {
	case x402.BatchDeposit:
		return f.verifyDeposit(ctx, req, payer)
	case x402.BatchRefund:
		st, _, err := f.verifyRefund(ctx, n, terms, chs, p)
		if err != nil {
			return invalid(err)
		}
		return x402.VerifyResponse{IsValid: true, Payer: payer, Extra: st.extra(common.HexToHash(p.Payload.Voucher.ChannelID))}, nil
	}
	vc, err := f.checkVoucherWith(ctx, n, chs, terms, p, nil)
	if err != nil {
		return invalid(err)
	}
	if vc.again {
		if err := f.spentAgain(ctx, n, vc); err != nil {
			return invalid(err)
		}
	}
	return x402.VerifyResponse{IsValid: true, Payer: payer, Extra: rowExtra(vc.row)}, nil
}

// rowExtra is a valid voucher's verification extra: the channel as the journal's row last read it (its refund
// nonce is the chain's alone, and left out: a refund's verification reads it).
func rowExtra(row journal.Channel) json.RawMessage {
	extra := map[string]any{"channelId": row.Key.ID, "balance": orZero(row.Deposit).String(), "totalClaimed": orZero(row.Claimed).String(),
		"withdrawRequestedAt": unixOrZero(row.WithdrawRequestedAt)}
	b, _ := json.Marshal(extra)
	return b
}

// batchSetup finds the network, the terms and the channel rows of a batch request whose payment names the
// requirement it is checked against.
func (f *Facilitator) batchSetup(req x402.BatchRequest) (*network, *BatchTerms, journal.Channels, error) {
	n, err := f.batchNetworkOf(req.PaymentRequirements)
	if err != nil {
		return nil, nil, nil, err
	}
	terms, err := n.batchTerms(req.PaymentRequirements)
	if err != nil {
		return nil, nil, nil, refuseBatch(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	chs, err := f.channelStore()
	if err != nil {
		return nil, nil, nil, err
	}
	return n, terms, chs, nil
}

// spentAgain is voucherSpent of a voucher presented again (vc.again): the row's, or an earlier one.
func (f *Facilitator) spentAgain(ctx context.Context, n *network, vc voucherCheck) error {
	if vc.cumulative != nil && vc.row.Charged != nil && vc.cumulative.Cmp(vc.row.Charged) != 0 {
		return earlierSpent(ctx, f.journal, n.caip2, vc.row, vc.cumulative)
	}
	return f.voucherSpent(ctx, n, vc.row)
}

// voucherSpent says whether the voucher row stands at, presented again, has bought its response already: its
// record is marked served, or is gone with the retention (a record lost to a crash is written again only while
// it could not have been pruned: past that, the voucher is taken as used). nil: it may be answered again.
func (f *Facilitator) voucherSpent(ctx context.Context, n *network, row journal.Channel) error {
	return voucherSpentIn(ctx, f.journal, n.caip2, row, f.now(), f.retention)
}

// voucherSpentIn is voucherSpent of a voucher of network whose answer store keeps, now, with its retention.
func voucherSpentIn(ctx context.Context, store journal.Store, network string, row journal.Channel, now time.Time, retention time.Duration) error {
	rec, ok, err := store.Get(ctx, BatchVoucherID(network, common.HexToHash(row.Key.ID), row.Charged))
	switch {
	case err != nil:
		return fmt.Errorf("reading the record of the voucher: %w", err)
	case ok && rec.Served:
		return voucherServed(row.Charged, rec.ServedAt)
	case !ok && now.Sub(row.AcceptedAt) > retention-time.Minute:
		return refuseBatch(x402.ReasonPaymentAlreadyUsed, "the voucher for cumulative amount %s was accepted at %s, longer ago than the journal keeps its answer: sign the next voucher",
			row.Charged, row.AcceptedAt.UTC().Format(time.RFC3339))
	}
	return nil
}

func voucherServed(cumulative *big.Int, at time.Time) *BatchRefusal {
	return refuseBatch(x402.ReasonPaymentAlreadyUsed, "the voucher for cumulative amount %s bought a response that was delivered at %s: sign the next voucher",
		cumulative, at.UTC().Format(time.RFC3339))
}

// SettleBatch implements x402.BatchFacilitator: a voucher is accepted by one compare-and-set of its channel's
// journal row and its answer recorded, both before the answer returns; the answer names the commitment (the
// channel and its new cumulative amount). The same voucher settled again, its response not yet delivered, gets
// the same answer and charges nothing more.
func (f *Facilitator) SettleBatch(ctx context.Context, req x402.BatchRequest) (x402.BatchSettleResponse, error) {
	p := &req.PaymentPayload
	payer := ""
	if p.Payload.ChannelConfig != nil {
		payer = p.Payload.ChannelConfig.Payer
	}
	fail := func(err error) (x402.BatchSettleResponse, error) {
		var r *BatchRefusal
		if errors.As(err, &r) {
			return x402.BatchSettleResponse{Network: req.PaymentRequirements.Network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
		}
		return x402.BatchSettleResponse{Network: req.PaymentRequirements.Network, Payer: payer, ErrorReason: x402.ReasonUnexpectedSettleError,
			ErrorMessage: err.Error()}, nil
	}
	if isBatchAction(p.Payload.Type) {
		// A receiver's action pays for no resource: its requirements name no price or terms.
		resp, err := f.settleAction(ctx, req)
		if p.Payload.Type == x402.BatchRefund && p.Payload.RefundNonce == "" {
			resp = f.withCorrective(ctx, req, resp) // a payer's own refund
		}
		return resp, err
	}
	n, terms, chs, err := f.batchSetup(req)
	if err != nil {
		return fail(err)
	}
	switch p.Payload.Type {
	case x402.BatchDeposit:
		return f.settleDeposit(ctx, req, payer)
	case x402.BatchVoucher:
		resp, err := f.settleVoucher(ctx, n, terms, chs, p, payer)
		return f.withCorrective(ctx, req, resp), err
	}
	return fail(refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload.type is %q: this facilitator settles deposits and vouchers", truncate(p.Payload.Type)))
}

// settleVoucher accepts voucher payment p (see SettleBatch).
func (f *Facilitator) settleVoucher(ctx context.Context, n *network, terms *BatchTerms, chs journal.Channels, p *x402.BatchPayment, payer string) (x402.BatchSettleResponse, error) {
	fail := func(err error) (x402.BatchSettleResponse, error) {
		if r := asBatchRefusal(err); r != nil {
			return x402.BatchSettleResponse{Network: n.caip2, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
		}
		return x402.BatchSettleResponse{Network: n.caip2, Payer: payer, ErrorReason: x402.ReasonUnexpectedSettleError, ErrorMessage: err.Error()}, nil
	}
	token := f.acceptToken()
	for attempt := 0; ; attempt++ {
		vc, err := f.checkVoucherWith(ctx, n, chs, terms, p, nil)
		if err != nil {
			return fail(err)
		}
		if vc.again {
			if err := f.spentAgain(ctx, n, vc); err != nil {
				return fail(err)
			}
			// Its record holds what it charged; a record lost in a crash is written now, with the price every
			// voucher of the route charges (CheckVoucher took it at exactly that).
			return f.answerVoucher(ctx, n, vc.row, vc.cumulative, terms.Price, payer)
		}
		av := vc.av
		row, resp, answered, err := stepVoucher(ctx, chs, n.caip2, vc.key, vc.row, av.Cumulative, av.Charge,
			journal.Voucher{Signature: av.Signature[:], Digest: av.Digest[:], By: token}, payer)
		switch {
		case err == nil:
			n.noteAccepted()
			if answered {
				return resp, nil
			}
			return f.answerVoucher(ctx, n, row, av.Cumulative, av.Charge, payer)
		case errors.Is(err, journal.ErrChannelMoved) && attempt < 3:
			continue // another voucher took the step: judge this one against the row as it is now
		case errors.Is(err, journal.ErrChannelMoved):
			return fail(refuseBatch(x402.ReasonBatchChannelBusy, "channel %s moved under %d vouchers in a row: present the voucher again", vc.key.ID, attempt+1))
		case errors.Is(err, journal.ErrAboveDeposit):
			return fail(refuseBatch(x402.ReasonBatchCumulativeExceedsBalance, "the voucher's cumulative amount %s exceeds the deposit of channel %s", av.Cumulative, vc.key.ID))
		case errors.Is(err, journal.ErrChannelWithdrawn):
			return fail(refuseBatch(x402.ReasonBatchChannelNotFound, "channel %s was refunded or withdrawn", vc.key.ID))
		case errors.Is(err, journal.ErrChannelRefunding):
			return fail(refuseBatch(x402.ReasonBatchChannelBusy, "channel %s is being refunded: nothing was charged", vc.key.ID))
		case errors.Is(err, journal.ErrChannelNotFound), errors.Is(err, journal.ErrInvalidChannel):
			return fail(err)
		}
		// The outcome is unknown (the store was lost as it committed): the step is ours only if the row stands at
		// our amount with our token.
		now, ok, rerr := chs.Channel(ctx, vc.key)
		if rerr == nil && ok && now.Charged.Cmp(av.Cumulative) == 0 && now.AcceptedBy == token {
			return f.answerVoucher(ctx, n, now, av.Cumulative, av.Charge, payer)
		}
		return fail(fmt.Errorf("accepting the voucher of channel %s at %s: %w", vc.key.ID, av.Cumulative, err))
	}
}

// answerVoucher records, or reads, the answer of the voucher that took row to cumulative, which charged charge:
// the first record written stands, so a voucher presented again is answered as it was first.
func (f *Facilitator) answerVoucher(ctx context.Context, n *network, row journal.Channel, cumulative, charge *big.Int, payer string) (x402.BatchSettleResponse, error) {
	return answerVoucher(ctx, f.journal, n.caip2, row, cumulative, charge, payer)
}

// answerVoucher is Facilitator.answerVoucher of a voucher of network whose answer store keeps.
func answerVoucher(ctx context.Context, store journal.Store, network string, row journal.Channel, cumulative, charge *big.Int, payer string) (x402.BatchSettleResponse, error) {
	got, _, err := store.Claim(ctx, voucherRecord(ctx, network, row, cumulative, charge, payer))
	if err != nil {
		// The step is taken and durable in the row; the voucher presented again gets its record then.
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: x402.ReasonUnexpectedSettleError,
			ErrorMessage: fmt.Sprintf("the voucher of channel %s at %s is accepted, but its record was not written (%v): present it again", row.Key.ID, cumulative, err)}, nil
	}
	return answerRecorded(ctx, network, row, cumulative, got, payer), nil
}

// voucherRecord is the record of the voucher that takes row (its channel) to cumulative, charging charge: final
// and settled, noting what the gate serves it for (journal.RecordNote).
func voucherRecord(ctx context.Context, network string, row journal.Channel, cumulative, charge *big.Int, payer string) journal.Record {
	vid := BatchVoucherID(network, common.HexToHash(row.Key.ID), cumulative)
	amount := ""
	if charge != nil {
		amount = charge.String()
	}
	rec := journal.Record{ID: vid, State: journal.StateFinal, Network: network, Payer: payer, Asset: row.Config.Token,
		Amount: amount, PayTo: row.Config.Receiver,
		Response: &x402.SettleResponse{Success: true, Network: network, Payer: payer, Amount: amount}}
	if note, noted := journal.RecordNoteOf(ctx); noted {
		// What the gate serves it for, in the same write (see journal.RecordNote).
		rec.Route, rec.Resource, rec.Described = note.Route, note.Resource, note.Described
	}
	return rec
}

// answerRecorded is the answer of the voucher that took row to cumulative, whose record the journal holds as got:
// the first record written stands, so a voucher presented again is answered as it was first.
func answerRecorded(ctx context.Context, network string, row journal.Channel, cumulative *big.Int, got journal.Record, payer string) x402.BatchSettleResponse {
	if got.Served {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: x402.ReasonPaymentAlreadyUsed,
			ErrorMessage: voucherServed(cumulative, got.ServedAt).Message}
	}
	note, noted := journal.RecordNoteOf(ctx)
	if noted && (got.Route != "" || got.Resource != "") && !note.Buys(got) {
		// A payment buys the response it was made for: a voucher accepted for one resource and not yet served is
		// served there only, never at another of the same terms, nor at a route that sells it at another price.
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: x402.ReasonPaymentAlreadyUsed,
			ErrorMessage: fmt.Sprintf("the voucher for cumulative amount %s was accepted for another resource, or at another price than this route's, and buys only that response: present it there, or sign the next voucher", cumulative)}
	}
	amount := ""
	if got.Response != nil {
		amount = got.Response.Amount
	}
	return x402.BatchSettleResponse{Success: true, Network: network, Payer: payer, Amount: amount,
		Extra: &x402.BatchResponseExtra{ChargedAmount: amount, ChannelState: &x402.BatchChannelState{
			ChannelID: row.Key.ID, Balance: row.Deposit.String(), TotalClaimed: row.Claimed.String(),
			WithdrawRequestedAt: unixOrZero(row.WithdrawRequestedAt), RefundNonce: "0", ChargedCumulativeAmount: cumulative.String()}}}
}

// stepVoucher takes the step of voucher v, which charges charge, on the channel row key from row's amount to
// cumulative (Channels.AcceptVoucher). Where the journal writes a voucher's record in the same commit
// (journal.VoucherRecords), it does, and answered is true with the voucher's answer in resp; else the caller
// answers it (answerVoucher) once the step is taken. err is AcceptVoucher's.
func stepVoucher(ctx context.Context, chs journal.Channels, network string, key journal.ChannelKey, row journal.Channel, cumulative, charge *big.Int, v journal.Voucher, payer string) (next journal.Channel, resp x402.BatchSettleResponse, answered bool, err error) {
	vr, ok := chs.(journal.VoucherRecords)
	if !ok {
		next, err = chs.AcceptVoucher(ctx, key, row.Charged, cumulative, v)
		return next, resp, false, err
	}
	next, got, err := vr.AcceptVoucherRecord(ctx, key, row.Charged, cumulative, v, voucherRecord(ctx, network, row, cumulative, charge, payer))
	if err != nil {
		return next, resp, false, err
	}
	return next, answerRecorded(ctx, network, next, cumulative, got, payer), true, nil
}

func unixOrZero(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.Unix()
}

var _ x402.BatchFacilitator = (*Facilitator)(nil)
