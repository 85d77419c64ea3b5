package chain

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The claimer: the accepted vouchers of the channels whose receiverAuthorizer is this engine's key are claimed
// on chain in batches, one transaction a batch (the escrow's multicall of claimWithSignature, signed by the
// authorizer, and settle of each receiver, which pays the receiver what was claimed for it), sent from a
// settlement wallet. Crash-safe as a payment's settlement is: the channels are marked claimed by the transaction
// (MarkClaimSent) and its broadcast record, raw transaction and all, written in the journal before it leaves; a
// claim in flight is looked up on chain by the next pass (mined, reverted, or sent again as it was), so an
// accepted voucher is claimed once, and never lost to a crash.

// Defaults of the claim policy (NetworkConfig.BatchClaimEvery, BatchClaimAfter).
const (
	defaultBatchClaimEvery = 100
	defaultBatchClaimAfter = time.Minute
	// maxClaimsPerTx bounds the channels one claim transaction claims (about 609 bytes of calldata each).
	maxClaimsPerTx = 100
	// claimGasPerChannel and claimGasBase size a claim transaction's gas limit.
	claimGasPerChannel = 60_000
	claimGasBase       = 120_000
	// unrecordedClaimAge is how long a claim marked sent with no broadcast record is left to its sender, which
	// writes the record before the transaction leaves: older, the sender is gone and nothing left.
	unrecordedClaimAge = time.Minute
)

// batchClaimer is a network's claim policy and its authorizer's key.
type batchClaimer struct {
	key        *ecdsa.PrivateKey
	authorizer common.Address
	every      int
	amount     *big.Int
	after      time.Duration
	// accepted counts the vouchers this engine accepted since its last claim.
	accepted int
}

func newBatchClaimer(nc NetworkConfig) *batchClaimer {
	if nc.BatchReceiverAuthorizer == nil {
		return nil
	}
	c := &batchClaimer{key: nc.BatchReceiverAuthorizer, authorizer: crypto.PubkeyToAddress(nc.BatchReceiverAuthorizer.PublicKey),
		every: nc.BatchClaimEvery, amount: nc.BatchClaimAmount, after: nc.BatchClaimAfter}
	if c.every <= 0 {
		c.every = defaultBatchClaimEvery
	}
	if c.after <= 0 {
		c.after = defaultBatchClaimAfter
	}
	return c
}

// claimRecordID is the journal id of the broadcast record of claim transaction tx.
func claimRecordID(network string, tx common.Hash) journal.ID {
	return journal.PaymentID(network, "batch-claim", contracts.BatchSettlementAddress.Hex(), "", tx.Hex())
}

// noteAccepted counts a voucher this engine accepted, for the claim policy.
func (n *network) noteAccepted() {
	if c := n.claimer; c != nil {
		n.batch.mu.Lock()
		c.accepted++
		n.batch.mu.Unlock()
	}
}

// ClaimBatches claims, on every network with a receiver authorizer key, every voucher accepted and not claimed
// yet, whatever the claim policy says (what Close does last), after resolving the claims in flight. It returns
// when the claims are mined, the receipt timeout passed or the engine closes (they stay in flight for the next
// pass).
func (f *Facilitator) ClaimBatches(ctx context.Context) error {
	var errs []error
	for _, id := range f.order {
		if n := f.networks[id]; n.claimer != nil {
			errs = append(errs, f.claimPass(ctx, n, true, true, false))
		}
	}
	return errors.Join(errs...)
}

// claimLoop runs the claim policy on every network with a receiver authorizer key, and a last forced pass when
// the engine closes.
func (f *Facilitator) claimLoop(every time.Duration) {
	defer f.wg.Done()
	defer f.batchClaims.Done() // the lease loop gives the wallets up after the last pass (see leaseLoop)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-f.stop:
			// Sent, not waited for: the next start finds the claims in flight and looks them up.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			for _, id := range f.order {
				if n := f.networks[id]; n.claimer != nil {
					if err := f.claimPass(ctx, n, true, false, true); err != nil {
						f.log.Warn("claiming batch-settlement vouchers at shutdown", zap.String("network", id), zap.Error(err))
					}
				}
			}
			cancel()
			return
		case <-t.C:
			for _, id := range f.order {
				n := f.networks[id]
				if n.claimer == nil {
					continue
				}
				ctx, cancel := context.WithTimeout(context.Background(), n.timeout+10*time.Second)
				if err := f.claimPass(ctx, n, false, true, true); err != nil {
					f.log.Warn("claiming batch-settlement vouchers", zap.String("network", id), zap.Error(err))
				}
				cancel()
			}
		}
	}
}

// leftClaimsWarnEvery is how often, at most, a cluster instance holding no wallet warns that it leaves claims
// under a pending withdrawal to the others.
const leftClaimsWarnEvery = time.Minute

// leftClaims says that the claims of rows, due, are left to the instances that hold a settlement wallet: at debug,
// unless a withdrawal is pending on one of the channels, whose vouchers must be claimed before it can be finalized
// (the payer takes them back otherwise): then a warning, at most every leftClaimsWarnEvery, so that an operator
// whose cluster has no instance holding a wallet (every one of them busy draining, or the database's leases lost)
// hears of it before the withdrawal delay runs out.
func (f *Facilitator) leftClaims(n *network, rows []journal.Channel) {
	pending := 0
	for _, r := range rows {
		if !r.WithdrawRequestedAt.IsZero() {
			pending++
		}
	}
	fields := []zap.Field{zap.String("network", n.caip2), zap.Int("channels", len(rows))}
	if pending == 0 {
		f.log.Debug("batch-settlement claims left to the instances that hold a settlement wallet: this one holds none", fields...)
		return
	}
	n.batch.mu.Lock()
	warn := time.Since(n.batch.leftWarned) >= leftClaimsWarnEvery
	if warn {
		n.batch.leftWarned = time.Now()
	}
	n.batch.mu.Unlock()
	if warn {
		f.log.Warn("batch-settlement claims under a pending withdrawal are left to the instances that hold a settlement wallet: this one holds none; if none does, the vouchers must be claimed before the withdrawal delay runs out",
			append(fields, zap.Int("withdrawals_pending", pending))...)
	}
}

// claimPass resolves the network's claims in flight, then claims what the policy says is due (all, when force),
// waiting for each claim's receipt when wait says so. With leave, an instance of a cluster that holds no wallet it
// may send from leaves the claims to the instances that hold one (they claim the same channels: the rows are the
// journal's, the authorizer's key theirs too), rather than waiting for a wallet (the wallet wait, at each pass and
// at its stop) to be told there is none.
func (f *Facilitator) claimPass(ctx context.Context, n *network, force, wait, leave bool) error {
	chs, err := f.channelStore()
	if err != nil {
		return err
	}
	if err := f.resolveClaims(ctx, n, chs); err != nil {
		return err
	}
	if err := f.resolveRefunds(ctx, n, chs); err != nil {
		f.log.Warn("resolving batch-settlement refunds in flight; tried again at the next pass", zap.String("network", n.caip2), zap.Error(err))
	}
	for {
		rows, err := chs.Unclaimed(ctx, n.caip2)
		if err != nil {
			return fmt.Errorf("listing unclaimed channels: %w", err)
		}
		rows = n.claimer.ours(rows)
		if len(rows) == 0 || !(force || n.claimer.due(rows, n.chainNow(), n.batch.margin, &n.batch.mu)) {
			return nil
		}
		if leave && !n.pool.holdsUsable() {
			f.leftClaims(n, rows)
			return nil
		}
		if len(rows) > maxClaimsPerTx {
			rows = rows[:maxClaimsPerTx]
		}
		err = f.sendClaim(ctx, n, chs, rows, wait)
		var reverts *claimReverts
		if errors.As(err, &reverts) && len(rows) > 1 {
			// One channel's claim sinks the batch (a channel withdrawn since, say): the others are claimed
			// without it, and it is left for the next pass, which finds it the same unless the chain changed.
			good := f.claimableAlone(ctx, n, rows)
			if len(good) == 0 || len(good) == len(rows) {
				return err
			}
			f.log.Warn("batch-settlement claim left out channels whose claim reverts", zap.String("network", n.caip2),
				zap.Int("left_out", len(rows)-len(good)), zap.String("why", reverts.why))
			err = f.sendClaim(ctx, n, chs, good, wait)
			force = false // the channels left out would come back at once
		}
		if err != nil {
			return err
		}
		if !force {
			return nil
		}
	}
}

// ours keeps the rows this engine can claim: those naming its authorizer, with a voucher to claim.
func (c *batchClaimer) ours(rows []journal.Channel) []journal.Channel {
	out := rows[:0:0]
	for _, r := range rows {
		if strings.EqualFold(r.Config.ReceiverAuthorizer, c.authorizer.Hex()) && len(r.Signature) > 0 {
			out = append(out, r)
		}
	}
	return out
}

// due says whether the policy claims rows now: enough vouchers accepted here since the last claim, enough
// unclaimed, the oldest unclaimed voucher old enough, a withdrawal pending on one of the channels (its vouchers
// must be claimed before it can be finalized), or a channel's last read about to stop vouching for its deposit.
// The last is what keeps a claim policy slower than a channel's withdrawDelay safe: a withdrawal asked for just
// after the read, which the engine does not see, can be finalized withdrawDelay after it, and the vouchers
// accepted against that read must be claimed before then, within the claim margin.
func (c *batchClaimer) due(rows []journal.Channel, now time.Time, margin time.Duration, mu *sync.Mutex) bool {
	mu.Lock()
	accepted := c.accepted
	mu.Unlock()
	if accepted >= c.every {
		return true
	}
	sum := new(big.Int)
	for _, r := range rows {
		if !r.WithdrawRequestedAt.IsZero() {
			return true
		}
		if !r.UnclaimedSince.IsZero() && now.Sub(r.UnclaimedSince) >= c.after {
			return true
		}
		if cover := r.DepositReadAt.Add(time.Duration(r.Config.WithdrawDelay)*time.Second - margin); !r.DepositReadAt.IsZero() && !now.Before(cover) {
			return true
		}
		sum.Add(sum, r.Unclaimed())
	}
	return c.amount != nil && c.amount.Sign() > 0 && sum.Cmp(c.amount) >= 0
}

// claimCall is the calldata of a claim of rows: the escrow's multicall of claimWithSignature and a settle of
// each receiver and token.
func (c *batchClaimer) claimCall(domain common.Hash, rows []journal.Channel) ([]byte, []journal.ChannelClaim, error) {
	claims := make([]contracts.VoucherClaim, 0, len(rows))
	entries := make([]ClaimEntry, 0, len(rows))
	marks := make([]journal.ChannelClaim, 0, len(rows))
	type payee struct{ receiver, token common.Address }
	var payees []payee
	seen := map[payee]bool{}
	for _, r := range rows {
		cfg, err := ParseChannelConfig(r.Config)
		if err != nil {
			return nil, nil, fmt.Errorf("channel %s: %w", r.Key.ID, err)
		}
		amount := new(big.Int).Set(r.Charged)
		claims = append(claims, contracts.VoucherClaim{Voucher: contracts.Voucher{Channel: cfg, MaxClaimableAmount: amount},
			Signature: r.Signature, TotalClaimed: amount})
		entries = append(entries, ClaimEntry{ChannelID: common.HexToHash(r.Key.ID), MaxClaimableAmount: amount, TotalClaimed: amount})
		marks = append(marks, journal.ChannelClaim{Key: r.Key, Amount: amount})
		if p := (payee{cfg.Receiver, cfg.Token}); !seen[p] {
			seen[p] = true
			payees = append(payees, p)
		}
	}
	sig, err := signDigest(c.key, ClaimBatchDigest(domain, entries))
	if err != nil {
		return nil, nil, err
	}
	claim, err := contracts.PackClaimWithSignature(claims, sig[:])
	if err != nil {
		return nil, nil, err
	}
	calls := [][]byte{claim}
	for _, p := range payees {
		settle, err := contracts.PackBatchSettle(p.receiver, p.token)
		if err != nil {
			return nil, nil, err
		}
		calls = append(calls, settle)
	}
	data, err := contracts.PackBatchMulticall(calls)
	return data, marks, err
}

// sendClaim claims rows in one transaction: simulated from the settlement wallet that sends it, the channels
// marked claimed by it and its broadcast record written before it leaves, its receipt awaited when wait says so.
func (f *Facilitator) sendClaim(ctx context.Context, n *network, chs journal.Channels, rows []journal.Channel, wait bool) error {
	data, marks, err := n.claimer.claimCall(BatchDomainSeparator(n.chainID), rows)
	if err != nil {
		return fmt.Errorf("building the claim: %w", err)
	}
	call := contractCall{To: contracts.BatchSettlementAddress, Data: data, Gas: claimGasBase + claimGasPerChannel*uint64(len(rows))}
	w, err := n.pool.Acquire(ctx, nil)
	if err != nil {
		return fmt.Errorf("a settlement wallet for the claim: %w", err)
	}
	defer n.pool.Release(w)
	quote, err := n.sender.feeQuote(ctx)
	if err != nil {
		return fmt.Errorf("pricing the claim: %w", err)
	}
	// Nothing is sent that would revert: the claim runs first as it will be sent.
	to := call.To
	if _, err := n.backend.CallContract(ctx, ethereum.CallMsg{From: w.Address, To: &to, Gas: call.Gas, Data: call.Data}, nil); err != nil {
		if failsOnChain(err) {
			return &claimReverts{channels: len(rows), why: revertReason(err)}
		}
		return fmt.Errorf("simulating the claim of %d channels: %w", len(rows), err)
	}
	n.batch.mu.Lock()
	n.claimer.accepted = 0
	n.batch.mu.Unlock()
	var marked common.Hash
	var signed []common.Hash
	defer func() {
		n.batch.mu.Lock()
		for _, h := range signed {
			delete(n.batch.sending, h)
		}
		n.batch.mu.Unlock()
	}()
	txs, err := n.sender.send(ctx, w, []contractCall{call}, quote, func(txs []*types.Transaction) error {
		tx := txs[0]
		if marked != (common.Hash{}) {
			// Signed again under another nonce: the earlier one was refused and never left.
			if err := f.claimNotSent(context.WithoutCancel(ctx), n, chs, marked, true, "refused by the node, signed again under another nonce"); err != nil {
				return err
			}
			marked = common.Hash{}
		}
		n.batch.mu.Lock()
		n.batch.sending[tx.Hash()] = true
		n.batch.mu.Unlock()
		signed = append(signed, tx.Hash())
		if err := chs.MarkClaimSent(context.WithoutCancel(ctx), tx.Hash().Hex(), marks); err != nil {
			return err
		}
		marked = tx.Hash()
		raw, err := tx.MarshalBinary()
		if err != nil {
			return err
		}
		return f.recordClaim(context.WithoutCancel(ctx), n, w, tx, raw)
	})
	if len(txs) == 0 {
		if marked != (common.Hash{}) {
			if ferr := f.claimNotSent(context.WithoutCancel(ctx), n, chs, marked, true, fmt.Sprintf("not sent: %v", err)); ferr != nil {
				return errors.Join(err, ferr)
			}
		}
		return fmt.Errorf("the claim was not sent: %w", err)
	}
	hash := txs[0].Hash()
	f.log.Info("batch-settlement claim broadcast", zap.String("network", n.caip2), zap.Int("channels", len(rows)),
		zap.String("wallet", w.Address.Hex()), zap.String("tx", hash.Hex()), zap.Uint64("nonce", txs[0].Nonce()),
		zap.String("fee_cap", txs[0].GasFeeCap().String()))
	if !wait {
		return nil
	}
	// Waited for as long as a settlement is; not mined by then, the next pass looks it up. A node that lost the
	// claim (answered the send and never held it) is given the same signed transaction again every
	// claimLookupEvery: waiting out the whole wait for a transaction the node does not have only delays the
	// claim and keeps its broadcast record in the journal's backlog (the money-invariant run: a drain that ran out
	// with a claim the node never had).
	deadline := time.Now().Add(n.timeout)
	lookup := time.Now().Add(claimLookupEvery)
	for time.Now().Before(deadline) {
		if done, err := f.claimOutcome(ctx, n, chs, hash); done || err != nil {
			return err
		}
		if time.Now().After(lookup) {
			lookup = time.Now().Add(claimLookupEvery)
			if known, err := n.sender.known(ctx, txs[0]); err == nil && !known {
				err := n.sender.rebroadcast(ctx, txs[0])
				if isNonceConflict(err) {
					// Its nonce went to another transaction: unless it is this one (mined meanwhile), it never
					// mines, and its channels go to the next claim now rather than at the end of the wait.
					if done, err := f.claimOutcome(ctx, n, chs, hash); done || err != nil {
						return err
					}
					return f.claimNotSent(context.WithoutCancel(ctx), n, chs, hash, true, "its nonce went to another transaction")
				}
				f.log.Warn("the node did not hold a batch-settlement claim it was sent; sent it again", zap.String("network", n.caip2),
					zap.String("tx", hash.Hex()), zap.Uint64("nonce", txs[0].Nonce()), zap.NamedError("resend_error", err))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-f.stop:
			// The engine closes: its last pass (which the lease loop waits for before it gives the wallets up)
			// should not wait behind this receipt. The claim is in flight; the next pass, here or at another
			// instance, looks it up.
			return nil
		case <-time.After(n.watcher.poll):
		}
	}
	f.warnClaimNotMined(ctx, n, w.Address, txs[0])
	return nil
}

// claimLookupEvery is how often a claim awaited and not mined is looked up at the node, and sent again when the
// node does not hold it.
const claimLookupEvery = 2 * time.Second

// warnClaimNotMined says what the chain shows of a claim transaction not mined within the receipt wait: the
// wallet's mined and pending nonces against the claim's, the claim's fee cap against the head's base fee.
func (f *Facilitator) warnClaimNotMined(ctx context.Context, n *network, wallet common.Address, tx *types.Transaction) {
	fields := []zap.Field{zap.String("network", n.caip2), zap.String("tx", tx.Hash().Hex()), zap.String("wallet", wallet.Hex()),
		zap.Uint64("nonce", tx.Nonce()), zap.String("fee_cap", tx.GasFeeCap().String()), zap.Duration("waited", n.timeout)}
	if mined, err := n.backend.NonceAt(ctx, wallet, nil); err == nil {
		fields = append(fields, zap.Uint64("wallet_mined_nonce", mined))
	}
	if pending, err := n.backend.PendingNonceAt(ctx, wallet); err == nil {
		fields = append(fields, zap.Uint64("wallet_pending_nonce", pending))
	}
	if h, err := n.backend.HeaderByNumber(ctx, nil); err == nil && h.BaseFee != nil {
		fields = append(fields, zap.String("head_base_fee", h.BaseFee.String()), zap.Uint64("head", h.Number.Uint64()))
	}
	if _, pending, err := n.backend.TransactionByHash(ctx, tx.Hash()); err == nil {
		fields = append(fields, zap.Bool("in_pool", pending))
	} else {
		fields = append(fields, zap.String("lookup", err.Error()))
	}
	f.log.Warn("a batch-settlement claim was not mined within the receipt wait; the next pass looks it up", fields...)
}

// claimNotSent marks claim transaction hash, which never left (the node refused it, its nonce went to another
// transaction, or its sender gave up before it recorded it), failed: its channels are offered to the next claim,
// and its record, written before it was sent, is forgotten. Left pending, the record would count in the journal's
// backlog for good, and no pass would ever finish it: it is no settlement of a payment that reconciliation
// resumes. Made final instead, it would stop the next claim of the same channels, which is the very same
// transaction when nothing changed since (the same wallet nonce, fees and vouchers), from recording itself.
//
// The record goes before the channels' marks: the marks are what the next pass finds a claim by, so a crash (or a
// failed write) between the two leaves marks with no record, which resolveClaims frees once older than a sender
// could take to record one, never a record no pass would see again. A record final already (an older release's)
// is left as it is, and its marks are freed.
//
// recorded says the caller knows the transaction, recorded, never left (the node refused it, its nonce went to
// another): a record naming it is forgotten. Without it (the caller judged from a record naming no transaction),
// only a record still naming none is: one that gained its transaction since (a sender the caller did not know of
// finishing its write) is left, with its marks, to the passes that look it up.
func (f *Facilitator) claimNotSent(ctx context.Context, n *network, chs journal.Channels, hash common.Hash, recorded bool, why string) error {
	rec, found, err := f.journal.Get(ctx, claimRecordID(n.caip2, hash))
	if err != nil {
		return fmt.Errorf("reading the record of claim %s, which was never sent (%s): %w", hash.Hex(), why, err)
	}
	if found {
		switch {
		case rec.State == journal.StateClaimed:
			err = f.journal.Release(ctx, rec)
		case rec.State == journal.StateBroadcast && strings.EqualFold(rec.TxHash, hash.Hex()) && recorded:
			err = f.journal.ReleaseUnsent(ctx, rec, rec.TxHash)
		case rec.State != journal.StateFinal:
			return fmt.Errorf("claim %s, judged never sent (%s), recorded its transaction since: it is looked up as sent", hash.Hex(), why)
		}
		if err != nil && !errors.Is(err, journal.ErrNotFound) {
			return fmt.Errorf("forgetting the record of claim %s, which was never sent (%s): %w", hash.Hex(), why, err)
		}
	}
	if _, err := chs.MarkClaimFailed(ctx, hash.Hex()); err != nil {
		return fmt.Errorf("marking claim %s failed: %w", hash.Hex(), err)
	}
	f.log.Info("a batch-settlement claim was never sent; its channels are offered to the next claim", zap.String("network", n.caip2),
		zap.String("tx", hash.Hex()), zap.String("why", why))
	return nil
}

// sendingClaim says whether this process is sending claim transaction hash right now (see batchNetwork.sending).
func (f *Facilitator) sendingClaim(n *network, hash common.Hash) bool {
	n.batch.mu.Lock()
	defer n.batch.mu.Unlock()
	return n.batch.sending[hash]
}

// ownerGone says whether owner, the owner of a record this process did not write, is a process that is gone: in a
// cluster, one the journal does not show alive; on a journal one process holds at a time (bbolt), any other
// process is an earlier one. An owner that cannot be told gone is not.
func (f *Facilitator) ownerGone(ctx context.Context, owner string) bool {
	if owner == "" || owner == f.owner {
		return false
	}
	if f.cluster != nil {
		alive, err := f.cluster.Alive(ctx, owner)
		return err == nil && !alive
	}
	return f.exclusiveJournal()
}

// exclusiveJournal says whether the journal is one process's at a time (bbolt): whatever another process wrote in
// it, that process is gone.
func (f *Facilitator) exclusiveJournal() bool {
	_, exclusive := f.journal.(*journal.BoltStore)
	return exclusive
}

// claimReverts is a claim whose simulation reverted: nothing was sent.
type claimReverts struct {
	channels int
	why      string
}

func (e *claimReverts) Error() string {
	return fmt.Sprintf("the claim of %d channels would revert (%s): nothing was sent", e.channels, e.why)
}

// claimableAlone keeps the rows whose claim, alone, does not revert.
func (f *Facilitator) claimableAlone(ctx context.Context, n *network, rows []journal.Channel) []journal.Channel {
	var good []journal.Channel
	to := contracts.BatchSettlementAddress
	for _, r := range rows {
		data, _, err := n.claimer.claimCall(BatchDomainSeparator(n.chainID), []journal.Channel{r})
		if err != nil {
			continue
		}
		if _, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil); err == nil {
			good = append(good, r)
		}
	}
	return good
}

// recordClaim writes the broadcast record of claim transaction tx, signed with w, before it leaves. With a shared
// journal it is fenced by w's lease, as a settlement's is (recordSigned): an instance that lost the lease without
// knowing it (paused past its expiry) writes nothing and sends nothing, where it would sign the nonce the lease's
// new holder signs. The caller, sending, holds w.mu.
func (f *Facilitator) recordClaim(ctx context.Context, n *network, w *wallet, tx *types.Transaction, raw []byte) error {
	id := claimRecordID(n.caip2, tx.Hash())
	if _, _, err := f.journal.Claim(ctx, journal.Record{ID: id, State: journal.StateClaimed, Network: n.caip2, Owner: f.owner,
		Asset: contracts.BatchSettlementAddress.Hex()}); err != nil {
		return err
	}
	_, err := f.recordSigned(ctx, n, w, id, journal.Record{}, func(r *journal.Record) error {
		r.State, r.Wallet, r.TxNonce, r.TxHash, r.RawTx, r.Attempts = journal.StateBroadcast, w.Address.Hex(), tx.Nonce(), tx.Hash().Hex(), raw, 1
		return nil
	})
	return err
}

// claimOutcome looks claim transaction hash up on chain: mined (its channels count it claimed), reverted (they
// are offered again); done false while it is neither.
func (f *Facilitator) claimOutcome(ctx context.Context, n *network, chs journal.Channels, hash common.Hash) (bool, error) {
	receipt, err := n.backend.TransactionReceipt(ctx, hash)
	switch {
	case errors.Is(err, ethereum.NotFound) || (err == nil && receipt == nil):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("reading the receipt of claim %s: %w", hash.Hex(), err)
	}
	ok := receipt.Status == types.ReceiptStatusSuccessful
	// The record first, then the channels' marks, which are what the next pass finds the claim by (see
	// claimNotSent): a crash or a failed write between the two leaves the marks, and the next pass finishes both.
	resp := x402.SettleResponse{Success: ok, Transaction: hash.Hex(), Network: n.caip2}
	if !ok {
		resp.ErrorReason = x402.ReasonBatchClaimTransactionFailed
	}
	_, err = f.journal.Update(ctx, claimRecordID(n.caip2, hash), func(r *journal.Record) error {
		if r.State != journal.StateFinal {
			r.State, r.Response = journal.StateFinal, &resp
		}
		return nil
	})
	if err != nil && !errors.Is(err, journal.ErrNotFound) {
		return false, fmt.Errorf("finishing the record of claim %s: %w", hash.Hex(), err)
	}
	if ok {
		if _, err := chs.MarkClaimMined(ctx, hash.Hex()); err != nil {
			return false, fmt.Errorf("marking claim %s mined: %w", hash.Hex(), err)
		}
	} else {
		f.log.Warn("batch-settlement claim reverted; its channels are offered again", zap.String("tx", hash.Hex()))
		if _, err := chs.MarkClaimFailed(ctx, hash.Hex()); err != nil {
			return false, fmt.Errorf("marking claim %s failed: %w", hash.Hex(), err)
		}
	}
	return true, nil
}

// resolveClaims looks up the network's claims in flight (a restart's, another engine's, or one not mined within
// its wait): mined or reverted, they are marked so; neither, the recorded transaction is sent again as it was; a
// claim with no record, marked longer ago than its sender could take to record it, never left and is freed.
func (f *Facilitator) resolveClaims(ctx context.Context, n *network, chs journal.Channels) error {
	rows, err := chs.ClaimsInFlight(ctx, n.caip2)
	if err != nil {
		return fmt.Errorf("listing claims in flight: %w", err)
	}
	done := map[string]bool{}
	for _, r := range rows {
		if done[r.ClaimTx] {
			continue
		}
		done[r.ClaimTx] = true
		hash := common.HexToHash(r.ClaimTx)
		if ok, err := f.claimOutcome(ctx, n, chs, hash); ok || err != nil {
			if err != nil {
				return err
			}
			continue
		}
		sending := f.sendingClaim(n, hash) // read before the record: a send that ends in between leaves its record whole
		rec, found, err := f.journal.Get(ctx, claimRecordID(n.caip2, hash))
		if err != nil {
			return err
		}
		if found && rec.State == journal.StateFinal {
			// Finished as never sent, and its channels' marks not yet freed (claimNotSent was cut between the two):
			// no receipt, so it did not land.
			if _, err := chs.MarkClaimFailed(ctx, hash.Hex()); err != nil {
				return fmt.Errorf("marking claim %s failed: %w", hash.Hex(), err)
			}
			continue
		}
		if !found || len(rec.RawTx) == 0 {
			why := ""
			switch {
			case f.now().Sub(r.ClaimSentAt) >= unrecordedClaimAge:
				why = "its sender was gone before it recorded the transaction"
			case found && rec.Owner == f.owner && !sending:
				// This process's, and no send of it is under way: the write of its transaction failed (the
				// journal's database down, say), and the send gave up before the transaction left.
				why = "its sender gave up before it recorded the transaction"
			case found && rec.Owner != f.owner && f.ownerGone(ctx, rec.Owner):
				why = "its sender's process is gone, and it never recorded the transaction"
			case !found && f.exclusiveJournal() && r.ClaimSentAt.Before(f.started):
				why = "an earlier process marked it and was gone before it recorded the transaction"
			}
			if why != "" {
				if err := f.claimNotSent(ctx, n, chs, hash, false, why); err != nil {
					return err
				}
			}
			continue
		}
		var tx types.Transaction
		if err := tx.UnmarshalBinary(rec.RawTx); err != nil {
			return fmt.Errorf("claim %s: its recorded transaction does not decode: %w", r.ClaimTx, err)
		}
		if err := n.backend.SendTransaction(ctx, &tx); err != nil && !isAlreadyKnown(err) {
			if isNonceConflict(err) {
				// Its nonce went to another transaction: unless it is that one (mined meanwhile), it never will.
				if ok, err := f.claimOutcome(ctx, n, chs, hash); ok || err != nil {
					if err != nil {
						return err
					}
					continue
				}
				if err := f.claimNotSent(ctx, n, chs, hash, true, "its nonce went to another transaction"); err != nil {
					return err
				}
				continue
			}
			f.log.Warn("sending a batch-settlement claim again", zap.String("tx", r.ClaimTx), zap.Error(err))
		}
	}
	return f.resolveUnmarkedClaims(ctx, n, chs, done)
}

// orphanClaimAge is how long a claim's broadcast record stays before resolveUnmarkedClaims looks it up when no
// channel's mark names it: its sender's own wait looks it up meanwhile.
const orphanClaimAge = 10 * time.Second

// resolveUnmarkedClaims finishes the broadcast records of claims that no channel's mark names any more (looked, the
// claims in flight resolveClaims went through): a claim broadcast as its process stopped, whose channels another
// claim took since, is found by nothing else, and its record would stay in the journal's backlog for good (the
// money-invariant run: a graceful stop). Mined or reverted, it is finished as any claim (claimOutcome); its nonce
// mined by another transaction (read before its receipt is looked for, so that a claim mined in between is not
// taken for one that never will be), it never mines, and its record goes (claimNotSent). Otherwise it is left.
func (f *Facilitator) resolveUnmarkedClaims(ctx context.Context, n *network, chs journal.Channels, looked map[string]bool) error {
	recs, err := f.journal.PendingOf(ctx, false)
	if err != nil {
		return fmt.Errorf("listing the journal's records not final: %w", err)
	}
	seen := map[common.Hash]bool{}
	for tx := range looked {
		seen[common.HexToHash(tx)] = true
	}
	for _, rec := range recs {
		if rec.Network != n.caip2 || rec.State != journal.StateBroadcast || rec.TxHash == "" || rec.Wallet == "" ||
			seen[common.HexToHash(rec.TxHash)] || f.now().Sub(rec.UpdatedAt) < orphanClaimAge {
			continue
		}
		hash := common.HexToHash(rec.TxHash)
		if rec.ID != claimRecordID(n.caip2, hash) || f.sendingClaim(n, hash) {
			continue
		}
		mined, err := n.backend.NonceAt(ctx, common.HexToAddress(rec.Wallet), nil)
		if err != nil {
			return fmt.Errorf("reading the mined nonce of %s, claim %s's wallet: %w", rec.Wallet, hash.Hex(), err)
		}
		if done, err := f.claimOutcome(ctx, n, chs, hash); done || err != nil {
			if err != nil {
				return err
			}
			continue
		}
		if mined > rec.TxNonce {
			if err := f.claimNotSent(ctx, n, chs, hash, true, "its nonce went to another transaction, and no channel's mark names it any more"); err != nil {
				return err
			}
		}
	}
	return nil
}
