package chain

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A RemoteBatch is the batch-settlement server's part, as the public SDK's server plays it, in front of a remote
// facilitator (the TypeScript reference facilitator, or another Caddy's x402_facilitator): the facilitator
// verifies and sends deposits and the receiver's claims and settles; this side accepts vouchers off chain and
// keeps them in its own journal (the engine's channel rows, journal.Channels), so that they survive a crash and
// two gateways of one PostgreSQL journal never accept more than a channel's deposit.
//
// A voucher is judged off chain (BatchTerms.CheckVoucher) against its channel's row, whose chain part is what the
// facilitator last said of the channel: its /settle answer to the deposit, or its /verify answer to a voucher.
// The facilitator is asked (/verify) only when the row cannot vouch for the voucher by itself: no row yet, a row
// older than the channel's withdrawDelay less the claim margin (a withdrawal asked for since could be finalized
// before a claim lands), a deposit too small for the voucher (a top-up since), or a channel without a
// payerAuthorizer (the payer's own signature, which its code may judge at claim time: only the chain knows).
// A read is recorded at the wall-clock time, in milliseconds, the question was sent: the row's "block".
//
// The claimer claims the accepted vouchers of the channels that name the facilitator's receiverAuthorizer, by the
// claim policy, through the facilitator's /settle claim action, then its settle action for each receiver (owed,
// in the journal, from the claim's landing until a settle succeeds: batch_remote_owed.go). The
// channels are marked claimed by a claim token of this side's (journal.MarkClaimSent) before the claim leaves:
// a claim the facilitator refused is offered again; one whose answer never came stays in flight until a /verify
// of the channel's last voucher shows it claimed, or not.

// remoteClaimPrefix starts the claim token a RemoteBatch marks its claims in flight by: its facilitator names the
// transaction only in its answer, so the token is a hash of the journal's form whose first 12 bytes spell
// "remote-claim" (no transaction hash does) and whose other 20 are random.
const remoteClaimPrefix = "0x72656d6f74652d636c61696d"

// remoteClaimToken is a new claim token.
func remoteClaimToken() string {
	var r [20]byte
	_, _ = rand.Read(r[:])
	return remoteClaimPrefix + hex.EncodeToString(r[:])
}

// RemoteBatchConfig configures a RemoteBatch.
type RemoteBatchConfig struct {
	// Remote is the facilitator, over HTTP.
	Remote x402.BatchFacilitator
	// Supported reads the facilitator's /supported (cached): its receiverAuthorizer on each network.
	Supported func(context.Context) (x402.SupportedResponse, error)
	// Journal keeps the channel rows (it must implement journal.Channels) and each voucher's answer.
	Journal journal.Store
	// Networks are the networks whose vouchers the claimer claims.
	Networks []string
	// ClaimEvery, ClaimAmount and ClaimAfter are the claim policy (see NetworkConfig.BatchClaimEvery).
	ClaimEvery  int
	ClaimAmount *big.Int
	ClaimAfter  time.Duration
	// ClaimMargin is NetworkConfig.BatchClaimMargin's (default 5 minutes).
	ClaimMargin time.Duration
	// Tick is how often the claimer looks at the policy (default 1 s).
	Tick time.Duration
	// ProbeAfter is how long a claim whose answer never came waits before the facilitator is asked whether it
	// landed (default 2 minutes: past any facilitator's wait for a receipt).
	ProbeAfter time.Duration
	// Retention is how long the journal keeps a final record at least (default 24 hours, an engine's): a voucher
	// accepted longer ago whose record is gone is taken as used, not as one whose record a crash lost.
	Retention time.Duration
	Logger    *zap.Logger
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// RemoteBatch serves batch-settlement payments through a remote facilitator (see the top of this file). It
// implements x402.BatchFacilitator's SettleBatch and VerifyBatch for the gate.
type RemoteBatch struct {
	cfg    RemoteBatchConfig
	chs    journal.Channels
	log    *zap.Logger
	margin time.Duration
	now    func() time.Time

	mu    sync.Mutex
	terms map[x402.BatchRequirements]*BatchTerms
	// claimers are the claim policies by network; accepted counts vouchers since the last claim.
	claimers map[string]*batchClaimer
	// owed are the receivers (network, receiver, token) whose claimed funds the escrow still holds because
	// settling them failed after their claim landed (or because an earlier process left their settle owed in the
	// journal, see marks): a pass tries again once the pause after the last failure is over (doubling from the
	// tick to a minute), until one succeeds.
	owed map[[3]string]*owedSettle
	// marks are the journal's marks of the settles owed by claims that landed, by receiver (batch_remote_owed.go);
	// owedLoaded says those an earlier process left were read.
	marks      map[[3]string][]journal.Record
	owedLoaded bool

	stop chan struct{}
	done chan struct{}
	once sync.Once
}

// NewRemoteBatch returns a RemoteBatch; Start runs its claimer.
func NewRemoteBatch(cfg RemoteBatchConfig) (*RemoteBatch, error) {
	chs, ok := cfg.Journal.(journal.Channels)
	if !ok {
		return nil, fmt.Errorf("the settlement journal %T keeps no batch-settlement channels", cfg.Journal)
	}
	if cfg.Remote == nil || cfg.Supported == nil {
		return nil, errors.New("a remote batch-settlement server needs its facilitator")
	}
	margin := cfg.ClaimMargin
	if margin == 0 {
		margin = defaultBatchClaimMargin
	}
	if margin < 0 || margin >= contracts.MinWithdrawDelay*time.Second {
		return nil, fmt.Errorf("batch claim margin %s must be positive and under the shortest withdrawDelay %ds", margin, contracts.MinWithdrawDelay)
	}
	if cfg.Tick <= 0 {
		cfg.Tick = time.Second
	}
	if cfg.ProbeAfter <= 0 {
		cfg.ProbeAfter = 2 * time.Minute
	}
	if cfg.Retention <= 0 {
		cfg.Retention = 24 * time.Hour
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	now := cfg.Now
	if now == nil {
		now = time.Now
	}
	b := &RemoteBatch{cfg: cfg, chs: chs, log: log, margin: margin, now: now, terms: map[x402.BatchRequirements]*BatchTerms{},
		claimers: map[string]*batchClaimer{}, owed: map[[3]string]*owedSettle{}, marks: map[[3]string][]journal.Record{}, stop: make(chan struct{}), done: make(chan struct{})}
	for _, n := range cfg.Networks {
		c := &batchClaimer{every: cfg.ClaimEvery, amount: cfg.ClaimAmount, after: cfg.ClaimAfter}
		if c.every <= 0 {
			c.every = defaultBatchClaimEvery
		}
		if c.after <= 0 {
			c.after = defaultBatchClaimAfter
		}
		b.claimers[n] = c
	}
	return b, nil
}

// Start runs the claimer until Close.
func (b *RemoteBatch) Start() { go b.claimLoop() }

// Close stops the claimer after a last pass that claims every voucher accepted and not claimed yet (bounded by
// ctx): what is left, because the facilitator is down, is claimed by the next start.
func (b *RemoteBatch) Close(ctx context.Context) error {
	b.once.Do(func() { close(b.stop) })
	select {
	case <-b.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	var errs []error
	for _, n := range b.cfg.Networks {
		errs = append(errs, b.claimPass(ctx, n, true))
	}
	return errors.Join(errs...)
}

// ClaimNow claims every voucher accepted and not claimed yet on every network, whatever the policy says.
func (b *RemoteBatch) ClaimNow(ctx context.Context) error {
	var errs []error
	for _, n := range b.cfg.Networks {
		errs = append(errs, b.claimPass(ctx, n, true))
	}
	return errors.Join(errs...)
}

func (b *RemoteBatch) claimLoop() {
	defer close(b.done)
	t := time.NewTicker(b.cfg.Tick)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
			for _, n := range b.cfg.Networks {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				if err := b.claimPass(ctx, n, false); err != nil {
					b.log.Warn("claiming batch-settlement vouchers through the facilitator; they stay claimable", zap.String("network", n), zap.Error(err))
				}
				cancel()
			}
		}
	}
}

// termsOf returns the parsed terms of rq.
func (b *RemoteBatch) termsOf(rq x402.BatchRequirements) (*BatchTerms, error) {
	rq.Extra.ChannelState, rq.Extra.VoucherState = nil, nil
	b.mu.Lock()
	t, ok := b.terms[rq]
	b.mu.Unlock()
	if ok {
		return t, nil
	}
	id, err := x402.ChainID(rq.Network)
	if err != nil {
		return nil, refuseBatch(x402.ReasonBatchNetworkMismatch, "paymentRequirements.network %q is not an eip155 chain", truncate(rq.Network))
	}
	t, err = NewBatchTerms(rq, new(big.Int).SetUint64(id), b.margin)
	if err != nil {
		return nil, refuseBatch(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	b.mu.Lock()
	if len(b.terms) >= maxBatchCaches {
		clear(b.terms)
	}
	b.terms[rq] = t
	b.mu.Unlock()
	return t, nil
}

// VerifyBatch implements x402.BatchFacilitator: the facilitator's own answer.
func (b *RemoteBatch) VerifyBatch(ctx context.Context, req x402.BatchRequest) (x402.VerifyResponse, error) {
	return b.cfg.Remote.VerifyBatch(ctx, req)
}

// SettleBatch implements x402.BatchFacilitator: a deposit is verified and settled by the facilitator and its
// voucher accepted here; a voucher is accepted here, by one compare-and-set of its channel's row and its answer
// recorded, both before the answer returns (see the top of this file).
func (b *RemoteBatch) SettleBatch(ctx context.Context, req x402.BatchRequest) (x402.BatchSettleResponse, error) {
	p := &req.PaymentPayload
	network := req.PaymentRequirements.Network
	payer := ""
	if p.Payload.ChannelConfig != nil {
		payer = p.Payload.ChannelConfig.Payer
	}
	refused := func(r *BatchRefusal) (x402.BatchSettleResponse, error) {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
	}
	if p.Payload.Type != x402.BatchDeposit && p.Payload.Type != x402.BatchVoucher && p.Payload.Type != x402.BatchRefund {
		return refused(refuseBatch(x402.ReasonBatchInvalidPayloadType, "payload.type is %q: this server takes deposits, vouchers and refunds", truncate(p.Payload.Type)))
	}
	if p.Payload.ChannelConfig == nil || p.Payload.Voucher == nil {
		return refused(refuseBatch(x402.ReasonInvalidPayload, "payload has no channelConfig or voucher"))
	}
	terms, err := b.termsOf(req.PaymentRequirements)
	if r := asBatchRefusal(err); r != nil {
		return refused(r)
	}
	ch, err := ParseChannelConfig(*p.Payload.ChannelConfig)
	if err != nil {
		return refused(refuseBatch(x402.ReasonInvalidPayload, "payload.%v", err))
	}
	id := ChannelID(terms.Domain, ch)
	if !x402.IsBytes32(p.Payload.Voucher.ChannelID) || common.HexToHash(p.Payload.Voucher.ChannelID) != id {
		_, err := terms.CheckVoucher(p, ChannelView{}, b.now())
		return refused(asBatchRefusal(err))
	}
	key := journal.ChannelKey{Network: network, Escrow: contracts.BatchSettlementAddress.Hex(), ID: id.Hex()}
	row, ok, err := b.chs.Channel(ctx, key)
	if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("reading the journal's row of channel %s: %w", id.Hex(), err)
	}
	if p.Payload.Type == x402.BatchRefund {
		if !ok {
			return refused(refuseBatch(x402.ReasonBatchChannelNotFound, "channel %s has paid nothing here: there is no voucher to refund from", id.Hex()))
		}
		// Closed to vouchers, on every gateway of the journal, from before the refund leaves until its answer is in
		// and the row records the balance after it: the refund's mark on the row (see refund).
		return b.refund(ctx, req, key, row, payer)
	}
	if ok && presentedAgain(terms, row, p, ch, id) {
		// Accepted before (a deposit too: its voucher is the row's): answered as first, never sent again.
		if r := b.voucherSpent(ctx, network, row); r != nil {
			return refused(r)
		}
		return answerVoucher(ctx, b.cfg.Journal, network, row, row.Charged, terms.Price, payer)
	}
	if ok {
		if resp, done, err := b.earlierAgain(ctx, terms, row, p, ch, id, payer); done || err != nil {
			return resp, err
		}
	}
	if p.Payload.Type == x402.BatchDeposit {
		return b.settleDeposit(ctx, req, terms, key, ch, payer)
	}
	return b.acceptVoucher(ctx, req, terms, key, ch, payer, ok)
}

// settleDeposit has the facilitator verify and send deposit request req, records the channel its answer names,
// and accepts the deposit's voucher.
func (b *RemoteBatch) settleDeposit(ctx context.Context, req x402.BatchRequest, terms *BatchTerms, key journal.ChannelKey, ch contracts.ChannelConfig, payer string) (x402.BatchSettleResponse, error) {
	network := req.PaymentRequirements.Network
	vr, err := b.cfg.Remote.VerifyBatch(ctx, req)
	if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("verifying the deposit: %w", err)
	}
	if !vr.IsValid {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: vr.InvalidReason, ErrorMessage: vr.InvalidMessage}, nil
	}
	asked := b.now()
	sr, err := b.cfg.Remote.SettleBatch(ctx, req)
	if err != nil {
		// The deposit may be on chain: its voucher is accepted when the payer presents a voucher of the channel.
		return x402.BatchSettleResponse{}, fmt.Errorf("settling the deposit: %w", err)
	}
	if !sr.Success {
		return x402.BatchSettleResponse{Network: network, Payer: payer, Transaction: sr.Transaction, ErrorReason: sr.ErrorReason, ErrorMessage: sr.ErrorMessage}, nil
	}
	var st *x402.BatchChannelState
	if sr.Extra != nil {
		st = sr.Extra.ChannelState
	}
	if st == nil || st.Balance == "" {
		// Some facilitator left the channel out of its answer: ask for it, as for a voucher.
		resp, err := b.acceptVoucher(ctx, req, terms, key, ch, payer, false)
		resp.Transaction = sr.Transaction
		return resp, err
	}
	if _, err := b.observe(ctx, key, *req.PaymentPayload.Payload.ChannelConfig, st.Balance, st.TotalClaimed, st.WithdrawRequestedAt, asked); err != nil {
		return x402.BatchSettleResponse{}, err
	}
	resp, err := b.acceptVoucher(ctx, req, terms, key, ch, payer, true)
	if resp.Success {
		resp.Transaction = sr.Transaction
	}
	return resp, err
}

// observe records what the facilitator said of a channel, asked at asked, in its row.
func (b *RemoteBatch) observe(ctx context.Context, key journal.ChannelKey, cfg x402.ChannelConfig, balance, claimed string, withdrawAt int64, asked time.Time) (journal.Channel, error) {
	read := journal.ChannelRead{Key: key, Config: cfg, Block: uint64(asked.UnixMilli())}
	var err error
	if read.Deposit, err = x402.ParseAmount(balance); err != nil {
		return journal.Channel{}, fmt.Errorf("the facilitator named channel %s's balance %q: %w", key.ID, truncate(balance), err)
	}
	if claimed == "" {
		claimed = "0"
	}
	if read.TotalClaimed, err = x402.ParseAmount(claimed); err != nil {
		return journal.Channel{}, fmt.Errorf("the facilitator named channel %s's totalClaimed %q: %w", key.ID, truncate(claimed), err)
	}
	if withdrawAt > 0 {
		read.WithdrawRequestedAt = time.Unix(withdrawAt, 0)
	}
	row, err := b.chs.ObserveChannel(ctx, read)
	if err != nil {
		return journal.Channel{}, fmt.Errorf("recording the facilitator's read of channel %s: %w", key.ID, err)
	}
	return row, nil
}

// verifyExtra is the channel's state a valid /verify answer names in its extra.
type verifyExtra struct {
	Balance             string          `json:"balance"`
	TotalClaimed        string          `json:"totalClaimed"`
	WithdrawRequestedAt json.RawMessage `json:"withdrawRequestedAt"`
}

// readRemote asks the facilitator's /verify about the voucher of req and records the channel its answer names;
// a refusal is the facilitator's.
func (b *RemoteBatch) readRemote(ctx context.Context, req x402.BatchRequest, key journal.ChannelKey) (journal.Channel, *BatchRefusal, error) {
	vreq := req
	vreq.PaymentPayload.Payload.Type = x402.BatchVoucher
	vreq.PaymentPayload.Payload.Deposit = nil
	asked := b.now()
	vr, err := b.cfg.Remote.VerifyBatch(ctx, vreq)
	if err != nil {
		return journal.Channel{}, nil, fmt.Errorf("asking the facilitator about channel %s: %w", key.ID, err)
	}
	if !vr.IsValid {
		return journal.Channel{}, refuseBatch(vr.InvalidReason, "%s", vr.InvalidMessage), nil
	}
	var ex verifyExtra
	if len(vr.Extra) == 0 || json.Unmarshal(vr.Extra, &ex) != nil || ex.Balance == "" {
		return journal.Channel{}, nil, fmt.Errorf("the facilitator's /verify answer names no channel balance in its extra (%s)", truncate(string(vr.Extra)))
	}
	withdrawAt, _ := strconv.ParseInt(strings.Trim(string(ex.WithdrawRequestedAt), `"`), 10, 64)
	row, err := b.observe(ctx, key, *req.PaymentPayload.Payload.ChannelConfig, ex.Balance, ex.TotalClaimed, withdrawAt, asked)
	return row, nil, err
}

// acceptVoucher judges the voucher of req against its channel's row (asking the facilitator first when the row
// cannot vouch for it, see the top of this file), then takes the row's step to it and records its answer.
func (b *RemoteBatch) acceptVoucher(ctx context.Context, req x402.BatchRequest, terms *BatchTerms, key journal.ChannelKey, ch contracts.ChannelConfig, payer string, haveRow bool) (x402.BatchSettleResponse, error) {
	p := &req.PaymentPayload
	network := req.PaymentRequirements.Network
	refused := func(r *BatchRefusal) (x402.BatchSettleResponse, error) {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
	}
	id := common.HexToHash(key.ID)
	mustAsk := !haveRow || ch.PayerAuthorizer == (common.Address{})
	asked := false
	token := "remote/" + randomHex()
	for attempt := 0; ; attempt++ {
		var row journal.Channel
		if mustAsk && !asked {
			var r *BatchRefusal
			var err error
			if row, r, err = b.readRemote(ctx, req, key); err != nil {
				return x402.BatchSettleResponse{}, err
			} else if r != nil {
				return refused(r)
			}
			asked = true
		} else {
			var ok bool
			var err error
			if row, ok, err = b.chs.Channel(ctx, key); err != nil {
				return x402.BatchSettleResponse{}, fmt.Errorf("reading the journal's row of channel %s: %w", key.ID, err)
			} else if !ok {
				mustAsk = true
				continue
			}
		}
		if presentedAgain(terms, row, p, ch, id) {
			if r := b.voucherSpent(ctx, network, row); r != nil {
				return refused(r)
			}
			return answerVoucher(ctx, b.cfg.Journal, network, row, row.Charged, terms.Price, payer)
		}
		if resp, done, err := b.earlierAgain(ctx, terms, row, p, ch, id, payer); done || err != nil {
			return resp, err
		}
		view := ChannelView{Balance: row.Deposit, TotalClaimed: row.Claimed, Charged: row.Charged, WithdrawRequestedAt: row.WithdrawRequestedAt,
			WithdrawAmount: row.WithdrawAmount, ReadAt: time.UnixMilli(int64(row.DepositBlock))}
		if row.Withdrawn {
			view.Balance = new(big.Int)
		}
		av, err := terms.CheckVoucher(p, view, b.now())
		if err != nil {
			r := asBatchRefusal(err)
			short := r != nil && (r.Reason == x402.ReasonBatchCumulativeExceedsBalance || r.Reason == x402.ReasonBatchChannelNotFound)
			if !asked && (IsStaleChannelView(err) || short) {
				mustAsk = true // a read too old to vouch for the deposit, or a top-up since: ask the facilitator
				continue
			}
			if r != nil {
				return refused(r)
			}
			return x402.BatchSettleResponse{}, err
		}
		got, resp, answered, err := stepVoucher(ctx, b.chs, network, key, row, av.Cumulative, av.Charge,
			journal.Voucher{Signature: av.Signature[:], Digest: av.Digest[:], By: token}, payer)
		switch {
		case err == nil:
			b.noteAccepted(network)
			if answered {
				return resp, nil
			}
			return answerVoucher(ctx, b.cfg.Journal, network, got, av.Cumulative, av.Charge, payer)
		case errors.Is(err, journal.ErrChannelMoved) && attempt < 3:
			mustAsk = false
			continue // another voucher took the step (on another gateway, maybe): judge this one against the row as it is now
		case errors.Is(err, journal.ErrChannelMoved):
			return refused(refuseBatch(x402.ReasonBatchChannelBusy, "channel %s moved under %d vouchers in a row: present the voucher again", key.ID, attempt+1))
		case errors.Is(err, journal.ErrAboveDeposit):
			return refused(refuseBatch(x402.ReasonBatchCumulativeExceedsBalance, "the voucher's cumulative amount %s exceeds the deposit of channel %s", av.Cumulative, key.ID))
		case errors.Is(err, journal.ErrChannelWithdrawn):
			return refused(refuseBatch(x402.ReasonBatchChannelNotFound, "channel %s was refunded or withdrawn", key.ID))
		case errors.Is(err, journal.ErrChannelRefunding):
			return refused(refuseBatch(x402.ReasonBatchChannelBusy, "channel %s is being refunded: present the voucher again once the refund is answered", key.ID))
		}
		// The outcome is unknown (the store was lost as it committed): the step is ours only if the row stands at
		// our amount with our token.
		now, ok, rerr := b.chs.Channel(ctx, key)
		if rerr == nil && ok && now.Charged.Cmp(av.Cumulative) == 0 && now.AcceptedBy == token {
			return answerVoucher(ctx, b.cfg.Journal, network, now, av.Cumulative, av.Charge, payer)
		}
		return x402.BatchSettleResponse{}, fmt.Errorf("accepting the voucher of channel %s at %s: %w", key.ID, av.Cumulative, err)
	}
}

// earlierAgain answers voucher payment p when it is an earlier voucher of the row's channel, accepted here before
// (earlierVoucher): from its record, charging nothing more. done is false when it is not one.
func (b *RemoteBatch) earlierAgain(ctx context.Context, terms *BatchTerms, row journal.Channel, p *x402.BatchPayment, ch contracts.ChannelConfig, id common.Hash, payer string) (x402.BatchSettleResponse, bool, error) {
	cumulative, ok, err := earlierVoucher(ctx, b.cfg.Journal, terms, row, p, ch, id)
	if err != nil || !ok {
		return x402.BatchSettleResponse{}, false, err
	}
	if err := earlierSpent(ctx, b.cfg.Journal, terms.Network, row, cumulative); err != nil {
		r := asBatchRefusal(err)
		if r == nil {
			return x402.BatchSettleResponse{}, true, err
		}
		return x402.BatchSettleResponse{Network: terms.Network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, true, nil
	}
	resp, err := answerVoucher(ctx, b.cfg.Journal, terms.Network, row, cumulative, terms.Price, payer)
	return resp, true, err
}

// voucherSpent is the engine's voucherSpent on this journal.
func (b *RemoteBatch) voucherSpent(ctx context.Context, network string, row journal.Channel) *BatchRefusal {
	err := voucherSpentIn(ctx, b.cfg.Journal, network, row, b.now(), b.cfg.Retention)
	if err == nil {
		return nil
	}
	if r := asBatchRefusal(err); r != nil {
		return r
	}
	return refuseBatch(x402.ReasonUnexpectedSettleError, "%v", err)
}

func (b *RemoteBatch) noteAccepted(network string) {
	b.mu.Lock()
	if c := b.claimers[network]; c != nil {
		c.accepted++
	}
	b.mu.Unlock()
}

func randomHex() string {
	var r [8]byte
	_, _ = rand.Read(r[:])
	return hex.EncodeToString(r[:])
}

// authorizer is the facilitator's receiverAuthorizer on network, from its /supported.
func (b *RemoteBatch) authorizer(ctx context.Context, network string) (common.Address, error) {
	sup, err := b.cfg.Supported(ctx)
	if err != nil {
		return common.Address{}, fmt.Errorf("reading the facilitator's /supported: %w", err)
	}
	kind, ok := sup.SchemeKind(x402.Version2, x402.SchemeBatchSettlement, network, x402.TransferEIP3009)
	if !ok || !common.IsHexAddress(kind.Extra.ReceiverAuthorizer) {
		return common.Address{}, fmt.Errorf("the facilitator's /supported lists no batch-settlement kind on %s with a receiverAuthorizer", network)
	}
	return common.HexToAddress(kind.Extra.ReceiverAuthorizer), nil
}

// claimPass looks up the claims in flight, then claims what the policy says is due (all, when force).
func (b *RemoteBatch) claimPass(ctx context.Context, network string, force bool) error {
	c := b.claimers[network]
	if c == nil {
		return nil
	}
	if err := b.resolveRefunds(ctx, network); err != nil {
		b.log.Warn("resolving batch-settlement refunds in flight; tried again at the next pass", zap.String("network", network), zap.Error(err))
	}
	settleErr := b.settleOwed(ctx, network, force)
	inFlight, err := b.chs.ClaimsInFlight(ctx, network)
	if err != nil {
		return fmt.Errorf("listing claims in flight: %w", err)
	}
	rows, err := b.chs.Unclaimed(ctx, network)
	if err != nil {
		return fmt.Errorf("listing unclaimed channels: %w", err)
	}
	if len(rows) == 0 && len(inFlight) == 0 {
		return settleErr // nothing to claim: the facilitator is not asked
	}
	auth, err := b.authorizer(ctx, network)
	if err != nil {
		return err
	}
	// A copy for this pass: passes may run at once (the loop's, ClaimNow's, Close's).
	b.mu.Lock()
	cl := *c
	b.mu.Unlock()
	cl.authorizer = auth
	freed, err := b.probeClaims(ctx, network, cl.ours(inFlight))
	if err != nil {
		return err
	}
	if freed {
		// A claim the facilitator shows did not land freed its channels: they are claimed in this pass.
		if rows, err = b.chs.Unclaimed(ctx, network); err != nil {
			return fmt.Errorf("listing unclaimed channels: %w", err)
		}
	}
	rows = cl.ours(rows)
	if len(rows) == 0 || !(force || cl.due(rows, b.now(), b.margin, &sync.Mutex{})) {
		return settleErr
	}
	// One claim per receiver and token: the claim's requirements name them, as the SDK's server's do.
	type payee struct{ receiver, token string }
	groups := map[payee][]journal.Channel{}
	var order []payee
	for _, r := range rows {
		p := payee{strings.ToLower(r.Config.Receiver), strings.ToLower(r.Config.Token)}
		if _, ok := groups[p]; !ok {
			order = append(order, p)
		}
		groups[p] = append(groups[p], r)
	}
	errs := []error{settleErr}
	for _, p := range order {
		g := groups[p]
		for len(g) > 0 {
			n := min(len(g), maxClaimsPerTx)
			errs = append(errs, b.sendClaim(ctx, network, g[:n]))
			g = g[n:]
		}
	}
	return errors.Join(errs...)
}

// actionRequirements are the requirements of a receiver's action, as the SDK's server builds them.
func actionRequirements(network, receiver, token string) x402.BatchRequirements {
	return x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: network, Asset: token, Amount: "0", PayTo: receiver}
}

// sendClaim claims rows (one receiver and token) through the facilitator's /settle claim action, then has it
// settle the receiver.
func (b *RemoteBatch) sendClaim(ctx context.Context, network string, rows []journal.Channel) error {
	token := remoteClaimToken()
	marks := make([]journal.ChannelClaim, 0, len(rows))
	claims := make([]x402.BatchVoucherClaim, 0, len(rows))
	for _, r := range rows {
		amount := new(big.Int).Set(r.Charged)
		marks = append(marks, journal.ChannelClaim{Key: r.Key, Amount: amount})
		claims = append(claims, x402.BatchVoucherClaim{Voucher: x402.BatchClaimedVoucher{Channel: r.Config, MaxClaimableAmount: amount.String()},
			Signature: "0x" + hex.EncodeToString(r.Signature), TotalClaimed: amount.String()})
	}
	if err := b.chs.MarkClaimSent(ctx, token, marks); errors.Is(err, journal.ErrClaimTaken) {
		return nil // another claimer (another gateway of the journal) took them
	} else if err != nil {
		return fmt.Errorf("marking %d channels claimed before the claim: %w", len(rows), err)
	}
	receiver, asset := rows[0].Config.Receiver, rows[0].Config.Token
	rq := actionRequirements(network, receiver, asset)
	req := x402.BatchRequest{X402Version: x402.Version2, PaymentRequirements: rq,
		PaymentPayload: x402.BatchPayment{X402Version: x402.Version2, Accepted: rq, Payload: x402.BatchPayload{Type: x402.BatchClaim, Claims: claims}}}
	resp, err := b.cfg.Remote.SettleBatch(ctx, req)
	if errors.Is(err, x402.ErrNotSent) {
		// The facilitator is down (it never saw the claim): the channels are offered again at the next pass.
		if _, ferr := b.chs.MarkClaimFailed(ctx, token); ferr != nil {
			return fmt.Errorf("claim %s could not be sent (%v), and freeing its channels failed: %w", token, err, ferr)
		}
		return fmt.Errorf("claiming %d channels: the facilitator could not be reached; they are claimed once it is: %w", len(rows), err)
	}
	if err != nil {
		// The claim may have been sent: it stays in flight until the facilitator shows whether it landed.
		return fmt.Errorf("claiming %d channels (claim %s): no answer, looked up again after %s: %w", len(rows), token, b.cfg.ProbeAfter, err)
	}
	if !resp.Success {
		if _, ferr := b.chs.MarkClaimFailed(ctx, token); ferr != nil {
			return fmt.Errorf("claim %s was refused (%s), and freeing its channels failed: %w", token, resp.ErrorReason, ferr)
		}
		return fmt.Errorf("the facilitator refused the claim of %d channels: %s: %s", len(rows), resp.ErrorReason, resp.ErrorMessage)
	}
	if err := b.owe(ctx, network, receiver, asset, token); err != nil {
		// The claim stays in flight: looked up after ProbeAfter, its channels marked mined and its receiver settled.
		return fmt.Errorf("claim %s landed (transaction %s), and %w", token, resp.Transaction, err)
	}
	if _, err := b.chs.MarkClaimMined(ctx, token); err != nil {
		return fmt.Errorf("claim %s landed (transaction %s), and marking it failed: %w", token, resp.Transaction, err)
	}
	b.mu.Lock()
	if c := b.claimers[network]; c != nil {
		c.accepted = 0
	}
	b.mu.Unlock()
	b.log.Info("claimed batch-settlement vouchers through the facilitator", zap.String("network", network), zap.Int("channels", len(rows)),
		zap.String("transaction", resp.Transaction))
	return b.settleReceiver(ctx, network, receiver, asset)
}

// settleReceiver has the facilitator pay receiver what was claimed for it in token.
func (b *RemoteBatch) settleReceiver(ctx context.Context, network, receiver, token string) error {
	rq := actionRequirements(network, receiver, token)
	req := x402.BatchRequest{X402Version: x402.Version2, PaymentRequirements: rq,
		PaymentPayload: x402.BatchPayment{X402Version: x402.Version2, Accepted: rq, Payload: x402.BatchPayload{Type: x402.BatchSettle, Receiver: receiver, Token: token}}}
	owed := owedKey(network, receiver, token)
	b.mu.Lock()
	marks := slices.Clone(b.marks[owed]) // written before the settle: it pays what their claims claimed
	b.mu.Unlock()
	resp, err := b.cfg.Remote.SettleBatch(ctx, req)
	if err == nil && !resp.Success && resp.ErrorReason != x402.ReasonBatchNothingToSettle {
		err = fmt.Errorf("%s: %s", resp.ErrorReason, resp.ErrorMessage)
	}
	b.mu.Lock()
	if err != nil {
		o := b.owed[owed]
		if o == nil {
			o = &owedSettle{pause: b.cfg.Tick / 2}
			b.owed[owed] = o
		}
		o.pause = min(2*o.pause, time.Minute)
		o.next = b.now().Add(o.pause)
	} else {
		delete(b.owed, owed)
	}
	b.mu.Unlock()
	if err != nil {
		return fmt.Errorf("settling %s's claimed %s: %w (it stays claimed in the escrow, settled at the next pass)", receiver, token, err)
	}
	b.paid(ctx, network, receiver, token, marks)
	b.log.Info("settled batch-settlement claims to the receiver", zap.String("network", network), zap.String("receiver", receiver), zap.String("transaction", resp.Transaction))
	return nil
}

// owedSettle is a receiver's settle that failed after its claim landed: when to try again, and the pause before.
type owedSettle struct {
	next  time.Time
	pause time.Duration
}

// settleOwed settles again the receivers on network whose settling failed after their claim landed: those whose
// pause is over, or all when force.
func (b *RemoteBatch) settleOwed(ctx context.Context, network string, force bool) error {
	if err := b.loadOwed(ctx); err != nil {
		return err
	}
	b.mu.Lock()
	var owed [][3]string
	for k, o := range b.owed {
		if k[0] == network && (force || !b.now().Before(o.next)) {
			owed = append(owed, k)
		}
	}
	b.mu.Unlock()
	var errs []error
	for _, k := range owed {
		errs = append(errs, b.settleReceiver(ctx, network, k[1], k[2]))
	}
	return errors.Join(errs...)
}

// probeClaims looks up this side's claims in flight older than ProbeAfter: a /verify of each channel's last
// voucher says what the chain holds claimed. A claim it shows landed is marked mined; one it shows did not
// land is freed, to be claimed again (were it to land after all, the escrow's cumulative claim pays nothing twice);
// freed says one was.
func (b *RemoteBatch) probeClaims(ctx context.Context, network string, rows []journal.Channel) (freed bool, err error) {
	for _, r := range rows {
		if !strings.HasPrefix(r.ClaimTx, remoteClaimPrefix) || b.now().Sub(r.ClaimSentAt) < b.cfg.ProbeAfter {
			continue
		}
		delay := r.Config.WithdrawDelay
		rq := actionRequirements(network, r.Config.Receiver, r.Config.Token)
		rq.Amount, rq.MaxTimeoutSeconds = "1", 60 // a /verify's requirement names a price and a timeout; this one changes nothing
		rq.Extra = x402.BatchExtra{ReceiverAuthorizer: r.Config.ReceiverAuthorizer, WithdrawDelay: delay}
		cfg := r.Config
		req := x402.BatchRequest{X402Version: x402.Version2, PaymentRequirements: rq,
			PaymentPayload: x402.BatchPayment{X402Version: x402.Version2, Accepted: rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher,
				ChannelConfig: &cfg, Voucher: &x402.BatchVoucherFields{ChannelID: r.Key.ID, MaxClaimableAmount: r.ClaimAmount.String(),
					Signature: "0x" + hex.EncodeToString(r.Signature)}}}}
		if r.Charged.Cmp(r.ClaimAmount) != 0 {
			continue // the row's signature is of a later voucher: wait for the claim's own answer or a later pass
		}
		vr, err := b.cfg.Remote.VerifyBatch(ctx, req)
		if err != nil {
			return freed, fmt.Errorf("asking the facilitator whether claim %s landed: %w", r.ClaimTx, err)
		}
		claimed := false
		switch {
		case !vr.IsValid && vr.InvalidReason == x402.ReasonBatchCumulativeBelowClaimed:
			claimed = true // the chain holds the voucher's amount claimed
		case vr.IsValid:
			var ex verifyExtra
			if json.Unmarshal(vr.Extra, &ex) == nil {
				if c, err := x402.ParseAmount(ex.TotalClaimed); err == nil && c.Cmp(r.ClaimAmount) >= 0 {
					claimed = true
				}
			}
		case vr.InvalidReason == x402.ReasonBatchCumulativeAmountMismatch:
			// An engine such as ours judges the amount against its own row only once the chain's claimed amount
			// is below it: not claimed.
		default:
			b.log.Warn("the facilitator cannot say whether a batch-settlement claim landed; asked again at the next pass",
				zap.String("claim", r.ClaimTx), zap.String("reason", vr.InvalidReason), zap.String("message", vr.InvalidMessage))
			continue
		}
		if claimed {
			if err := b.owe(ctx, network, r.Config.Receiver, r.Config.Token, r.ClaimTx); err != nil {
				return freed, err
			}
			if _, err := b.chs.MarkClaimMined(ctx, r.ClaimTx); err != nil {
				return freed, err
			}
			b.log.Info("a batch-settlement claim whose answer never came landed", zap.String("claim", r.ClaimTx))
			if err := b.settleReceiver(ctx, network, r.Config.Receiver, r.Config.Token); err != nil {
				b.log.Warn("settling the receiver", zap.Error(err))
			}
			continue
		}
		if _, err := b.chs.MarkClaimFailed(ctx, r.ClaimTx); err != nil {
			return freed, err
		}
		freed = true
		b.log.Warn("a batch-settlement claim whose answer never came did not land; its vouchers are claimed again", zap.String("claim", r.ClaimTx))
	}
	return freed, nil
}

// resolveRefunds takes off network's rows the refund marks whose refund's answer never came (or whose row was not
// read after it), once older than ProbeAfter, when the facilitator says the channel's refund nonce is past the
// mark's: the refund mined, and the row records the balance the facilitator names. A refund not known mined keeps
// its mark until the payer presents it again (answered from the facilitator's record of it).
func (b *RemoteBatch) resolveRefunds(ctx context.Context, network string) error {
	rows, err := b.chs.RefundsInFlight(ctx, network)
	if err != nil {
		return fmt.Errorf("listing refunds in flight: %w", err)
	}
	for _, r := range rows {
		nonce, ok := refundMarkNonce(r.RefundMark)
		if !ok || b.now().Sub(r.RefundMarkedAt) < b.cfg.ProbeAfter || len(r.Signature) == 0 {
			continue
		}
		rq := actionRequirements(network, r.Config.Receiver, r.Config.Token)
		rq.Amount, rq.MaxTimeoutSeconds = "1", 60
		rq.Extra = x402.BatchExtra{ReceiverAuthorizer: r.Config.ReceiverAuthorizer, WithdrawDelay: r.Config.WithdrawDelay}
		cfg := r.Config
		req := x402.BatchRequest{X402Version: x402.Version2, PaymentRequirements: rq,
			PaymentPayload: x402.BatchPayment{X402Version: x402.Version2, Accepted: rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher,
				ChannelConfig: &cfg, Voucher: &x402.BatchVoucherFields{ChannelID: r.Key.ID, MaxClaimableAmount: r.Charged.String(),
					Signature: "0x" + hex.EncodeToString(r.Signature)}}}}
		asked := b.now()
		vr, err := b.cfg.Remote.VerifyBatch(ctx, req)
		if err != nil {
			return fmt.Errorf("asking the facilitator about refunded channel %s: %w", r.Key.ID, err)
		}
		var ex struct {
			verifyExtra
			RefundNonce json.RawMessage `json:"refundNonce"`
		}
		if !vr.IsValid || json.Unmarshal(vr.Extra, &ex) != nil || ex.Balance == "" {
			continue
		}
		now, ok := new(big.Int).SetString(strings.Trim(string(ex.RefundNonce), `"`), 10)
		if !ok || now.Cmp(nonce) <= 0 {
			b.log.Warn("a batch-settlement refund whose answer never came is not known mined; its channel stays closed to vouchers until it is presented again",
				zap.String("channel", r.Key.ID), zap.String("refund", r.RefundMark))
			continue
		}
		withdrawAt, _ := strconv.ParseInt(strings.Trim(string(ex.WithdrawRequestedAt), `"`), 10, 64)
		if _, err := b.observe(ctx, r.Key, r.Config, ex.Balance, ex.TotalClaimed, withdrawAt, asked); err != nil {
			return err
		}
		if _, err := b.chs.ClearRefund(ctx, r.Key, r.RefundMark); err != nil {
			return err
		}
	}
	return nil
}

// refund has the facilitator refund what is left of the channel of row to its payer, as the SDK's server does:
// the payer's refund names the last voucher accepted (its amount and signature); the refund's /settle carries the
// claim of that voucher when it is not claimed yet, marked in the journal before it leaves (so the claimer does
// not claim it besides), the amount left (or the one asked for) and the channel's refund nonce, both as the
// facilitator's /verify of the refund reads them on chain.
func (b *RemoteBatch) refund(ctx context.Context, req x402.BatchRequest, key journal.ChannelKey, row journal.Channel, payer string) (x402.BatchSettleResponse, error) {
	network := req.PaymentRequirements.Network
	refused := func(r *BatchRefusal) (x402.BatchSettleResponse, error) {
		return x402.BatchSettleResponse{Network: network, Payer: payer, ErrorReason: r.Reason, ErrorMessage: r.Message}, nil
	}
	pl := req.PaymentPayload.Payload
	cumulative, err := x402.ParseAmount(pl.Voucher.MaxClaimableAmount)
	sig, serr := ParseSignature(pl.Voucher.Signature)
	if err != nil || serr != nil || len(row.Signature) == 0 || cumulative.Cmp(row.Charged) != 0 || string(sig[:]) != string(row.Signature) {
		return refused(refuseBatch(x402.ReasonBatchCumulativeAmountMismatch, "a refund names the channel's last voucher accepted, at %s with its signature; this one is at %s", row.Charged, truncate(pl.Voucher.MaxClaimableAmount)))
	}
	if row.ClaimTx != "" {
		return refused(refuseBatch(x402.ReasonBatchChannelBusy, "a claim of channel %s is on its way: ask for the refund again in a moment", key.ID))
	}
	vr, err := b.cfg.Remote.VerifyBatch(ctx, req)
	if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("verifying the refund: %w", err)
	}
	if !vr.IsValid {
		return refused(refuseBatch(vr.InvalidReason, "%s", vr.InvalidMessage))
	}
	var ex struct {
		verifyExtra
		RefundNonce json.RawMessage `json:"refundNonce"`
	}
	if json.Unmarshal(vr.Extra, &ex) != nil || ex.Balance == "" {
		return x402.BatchSettleResponse{}, fmt.Errorf("the facilitator's /verify of the refund names no channel balance (%s)", truncate(string(vr.Extra)))
	}
	balance, err := x402.ParseAmount(ex.Balance)
	if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("the facilitator named the balance %q: %w", truncate(ex.Balance), err)
	}
	claimed, _ := x402.ParseAmount(ex.TotalClaimed)
	nonce := strings.Trim(string(ex.RefundNonce), `"`)
	if _, err := strconv.ParseUint(nonce, 10, 64); err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("the facilitator's /verify of the refund names no refund nonce (%s)", truncate(string(vr.Extra)))
	}
	left := new(big.Int).Sub(balance, row.Charged)
	if left.Sign() <= 0 {
		return refused(refuseBatch(x402.ReasonBatchRefundNoBalance, "channel %s holds %s, all of it charged: nothing to refund", key.ID, balance))
	}
	amount := left
	if pl.Amount != "" {
		if amount, err = x402.ParseAmount(pl.Amount); err != nil || amount.Sign() == 0 || amount.Cmp(left) > 0 {
			return refused(refuseBatch(x402.ReasonBatchRefundAmountInvalid, "payload.amount %q is not a positive amount up to the %s left", truncate(pl.Amount), left))
		}
	}
	// The refund's mark, at exactly the voucher it names: a voucher accepted since (on any gateway of the journal)
	// moves the row, and the refund is refused as not naming the last voucher; one accepted after is refused.
	nonceN, _ := new(big.Int).SetString(nonce, 10)
	mark := refundMark(nonceN)
	if marked, err := b.chs.MarkRefund(ctx, key, row.Charged, mark); errors.Is(err, journal.ErrChannelMoved) {
		return refused(refuseBatch(x402.ReasonBatchCumulativeAmountMismatch, "a refund names the channel's last voucher accepted, at %s: this one is at %s", marked.Charged, row.Charged))
	} else if errors.Is(err, journal.ErrRefundTaken) {
		return refused(refuseBatch(x402.ReasonBatchChannelBusy, "another refund of channel %s is on its way (%s): ask for the refund again once it is answered", key.ID, marked.RefundMark))
	} else if err != nil {
		return x402.BatchSettleResponse{}, fmt.Errorf("marking channel %s refunded: %w", key.ID, err)
	}
	keepMark := false
	defer func() {
		if !keepMark {
			if _, err := b.chs.ClearRefund(context.WithoutCancel(ctx), key, mark); err != nil {
				b.log.Warn("opening a channel to vouchers after its refund; the claimer's pass tries again", zap.String("channel", key.ID), zap.Error(err))
			}
		}
	}()
	token := ""
	pl.Claims = []x402.BatchVoucherClaim{}
	if claimed == nil || row.Charged.Cmp(claimed) > 0 {
		token = remoteClaimToken()
		if err := b.chs.MarkClaimSent(ctx, token, []journal.ChannelClaim{{Key: key, Amount: new(big.Int).Set(row.Charged)}}); errors.Is(err, journal.ErrClaimTaken) {
			return refused(refuseBatch(x402.ReasonBatchChannelBusy, "a claim of channel %s is on its way: ask for the refund again in a moment", key.ID))
		} else if err != nil {
			return x402.BatchSettleResponse{}, fmt.Errorf("marking channel %s claimed by its refund: %w", key.ID, err)
		}
		pl.Claims = append(pl.Claims, x402.BatchVoucherClaim{Voucher: x402.BatchClaimedVoucher{Channel: row.Config, MaxClaimableAmount: row.Charged.String()},
			Signature: "0x" + hex.EncodeToString(row.Signature), TotalClaimed: row.Charged.String()})
	}
	pl.Amount, pl.RefundNonce = amount.String(), nonce
	pl.ClaimAuthorizerSignature, pl.RefundAuthorizerSignature = "", ""
	sreq := req
	sreq.PaymentPayload.Payload = pl
	asked := b.now()
	resp, err := b.cfg.Remote.SettleBatch(ctx, sreq)
	if err != nil {
		if token != "" && errors.Is(err, x402.ErrNotSent) {
			_, _ = b.chs.MarkClaimFailed(ctx, token)
		}
		// Sent, maybe: the mark stays until the refund presented again is answered, or the claimer's pass finds the
		// channel's refund nonce past it.
		keepMark = !errors.Is(err, x402.ErrNotSent)
		// Sent, maybe: the claim it carries is looked up as any claim whose answer never came.
		return x402.BatchSettleResponse{}, fmt.Errorf("refunding channel %s: %w", key.ID, err)
	}
	if !resp.Success {
		keepMark = resp.ErrorReason == x402.ReasonSettlementPending // sent and not yet mined
		if token != "" {
			if _, err := b.chs.MarkClaimFailed(ctx, token); err != nil {
				return x402.BatchSettleResponse{}, fmt.Errorf("the refund was refused (%s), and freeing its claim failed: %w", resp.ErrorReason, err)
			}
		}
		return x402.BatchSettleResponse{Network: network, Payer: payer, Transaction: resp.Transaction, ErrorReason: resp.ErrorReason, ErrorMessage: resp.ErrorMessage}, nil
	}
	if token != "" {
		if err := b.owe(ctx, network, row.Config.Receiver, row.Config.Token, token); err != nil {
			b.log.Warn("the refund landed, and recording the settle of the receiver it owes failed", zap.String("channel", key.ID), zap.Error(err))
		}
		if _, err := b.chs.MarkClaimMined(ctx, token); err != nil {
			b.log.Warn("the refund landed, and marking its claim failed", zap.String("channel", key.ID), zap.Error(err))
		}
	}
	after := new(big.Int).Sub(balance, amount)
	if resp.Extra != nil && resp.Extra.ChannelState != nil && resp.Extra.ChannelState.Balance != "" {
		if v, err := x402.ParseAmount(resp.Extra.ChannelState.Balance); err == nil {
			after = v
		}
	}
	if _, err := b.observe(ctx, key, row.Config, after.String(), row.Charged.String(), 0, asked); err != nil {
		// The row still holds the balance from before the refund: it stays closed to vouchers until the claimer's
		// pass reads the channel again.
		keepMark = true
		b.log.Warn("the refund landed, and recording the channel's balance after it failed", zap.String("channel", key.ID), zap.Error(err))
	}
	if err := b.settleReceiver(ctx, network, row.Config.Receiver, row.Config.Token); err != nil {
		b.log.Warn("settling the receiver after a refund", zap.Error(err))
	}
	if resp.Extra == nil {
		resp.Extra = &x402.BatchResponseExtra{}
	}
	resp.Extra.ChannelState = &x402.BatchChannelState{ChannelID: key.ID, Balance: after.String(), TotalClaimed: row.Charged.String(),
		RefundNonce: nonce, ChargedCumulativeAmount: row.Charged.String()}
	if resp.Payer == "" {
		resp.Payer = payer
	}
	return resp, nil
}

var _ x402.BatchFacilitator = (*RemoteBatch)(nil)
