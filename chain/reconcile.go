package chain

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"slices"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// reconcile accounts for every journalled settlement without a final outcome: a receipt found finalises it, a
// transaction the node still holds is left to mine, and a transaction the node does not know is broadcast again
// from its recorded bytes (same nonce, same hash: it cannot settle twice). Claims that never broadcast and that
// a previous process left behind are released. At start-up (startup true) every record is looked at.
func (f *Facilitator) reconcile(ctx context.Context, startup bool) error {
	// A gate sharing the journal keeps its async payments there; they are never settlements of this engine.
	recs, err := f.journal.PendingOf(ctx, false)
	if err != nil {
		return err
	}
	var held []journal.Record   // every broadcast settlement: the nonces they hold are no holes
	var gapped []journal.Record // broadcast records this pass looked at: their wallets are checked for holes
	defer func() {
		if len(gapped) > 0 && ctx.Err() == nil {
			f.fillNonceHoles(ctx, gapped, held)
		}
	}()
	var alive func(context.Context, string) (bool, error)
	if f.cluster != nil {
		alive = journal.AliveOnce(f.cluster)
	}
	for _, rec := range recs {
		look := startup // every record, grace or not
		tookOver := false
		n := f.networks[rec.Network]
		if n == nil || !f.isSettlementRecord(rec) {
			continue // another network's, or another user's of the journal (a gate's record of serving)
		}
		if rec.State == journal.StateBroadcast {
			held = append(held, rec)
		}
		if f.cluster != nil && rec.Owner != f.owner {
			// A journal several processes share: a live process reconciles its own settlements, and a dead one's
			// are taken over by whichever process gets to them first.
			mine, err := f.takeOver(ctx, rec, alive)
			if err != nil {
				return err
			}
			if !mine {
				continue
			}
			rec.Owner, tookOver = f.owner, true
			look = true // nobody is working on it: no grace to wait out
		}
		if !look && (f.isSending(rec.ID) || f.now().Sub(rec.UpdatedAt) < f.grace) {
			continue
		}
		switch rec.State {
		case journal.StateClaimed:
			if rec.Owner != f.owner || tookOver {
				if released, err := f.releaseClaim(ctx, n, rec); err != nil {
					return err
				} else if released {
					f.log.Info("released a settlement claim left by an earlier process; nothing had been broadcast", zap.String("payment", rec.ID.String()))
				}
			} else if err := f.releaseAbandonedClaim(ctx, n, rec); err != nil {
				return err
			}
		case journal.StateBroadcast:
			gapped = append(gapped, rec)
			if err := f.reconcileBroadcast(ctx, n, rec); err != nil {
				if startup && isTransportError(err) {
					// The node is down: the periodic pass will finish the job. Settlements of these
					// payments answer from the journal meanwhile, so nothing is paid twice.
					f.log.Warn("could not reconcile a broadcast settlement at start-up", zap.String("payment", rec.ID.String()), zap.Error(err))
					continue
				}
				f.log.Warn("reconciling a broadcast settlement", zap.String("payment", rec.ID.String()), zap.Error(err))
			}
		}
	}
	return nil
}

func (f *Facilitator) reconcileBroadcast(ctx context.Context, n *network, rec journal.Record) error {
	hash := common.HexToHash(rec.TxHash)
	if done, err := f.finaliseFromReceipts(ctx, n, rec); done || err != nil {
		return err
	}
	if _, pending, err := n.backend.TransactionByHash(ctx, hash); err == nil {
		// In the node's pool: it will mine, unless its fees no longer get it into a block.
		if pending && n.replaceAfter > 0 && f.now().Sub(rec.UpdatedAt) >= n.replaceAfter {
			return f.bumpFees(ctx, n, rec)
		}
		return nil
	} else if !errors.Is(err, ethereum.NotFound) {
		return err
	}
	// The node does not know it: dropped, or never sent before a crash. Past its payment's deadline in chain time,
	// the recorded transaction (or a copy another pool still holds) can only revert, at the wallet's cost, and the
	// gas money and approval of a sponsored one would be spent for nothing: the payment is settled again instead,
	// whose checks refuse it for its deadline, sending nothing.
	if expired, err := f.pastDeadline(ctx, n, rec); err != nil {
		return err
	} else if expired {
		f.log.Warn("a recorded settlement the node does not know is past its payment's deadline; it is not sent again",
			zap.String("payment", rec.ID.String()), zap.String("tx", rec.TxHash))
		return f.resettle(ctx, n, rec)
	}
	// Otherwise the recorded bytes are sent again; the settlement of a sponsored approval only once the approval
	// mined.
	if rec.SponsoredRawTx != nil {
		if sent, err := f.approvalFirst(ctx, n, rec); err != nil || !sent {
			return err
		}
	}
	for i, raw := range append(append([][]byte{}, rec.PriorRawTxs...), rec.RawTx) {
		tx := new(types.Transaction)
		if err := tx.UnmarshalBinary(raw); err != nil {
			return err
		}
		if rec.SponsoredRawTx != nil && i < len(rec.PriorRawTxs) {
			// The payer's gas money: not sent again once the approval mined without it (see fundingToSend).
			var err error
			if tx, err = f.fundingToSend(ctx, n, rec, i, tx); err != nil {
				return err
			}
		}
		err := n.sender.rebroadcast(ctx, tx)
		switch {
		case err == nil:
		case !isNonceConflict(err):
			return err
		case tx.Hash() == hash:
			return f.resettle(ctx, n, rec)
		default:
			// A prior transaction (an erc2612 permit) whose nonce is spent: by itself, mined, or by another
			// transaction, and then the transfer after it must not go out alone (it would revert for want of
			// the allowance): the payment is settled again.
			r, rerr := n.backend.TransactionReceipt(ctx, tx.Hash())
			if rerr != nil && !errors.Is(rerr, ethereum.NotFound) {
				return rerr
			}
			if rerr != nil || r == nil {
				return f.resettle(ctx, n, rec)
			}
		}
	}
	f.log.Info("re-broadcast a settlement the node did not know", zap.String("payment", rec.ID.String()), zap.String("tx", rec.TxHash))
	_, err := f.journal.Update(ctx, rec.ID, func(r *journal.Record) error { r.Attempts++; return nil })
	return err
}

// pastDeadline reports whether the chain's head is stamped past the deadline of the payment rec records: every block
// to come is stamped later still, where a permit2 transfer, an authorization's transfer or a permit reverts, so the
// recorded transaction is not sent again (the payment is settled again instead, whose checks say what became of
// it: refused for its deadline, or, its authorization spent, waiting for the receipt of what spent it). An erc2612
// settlement whose own permit mined is not: its transfer spends the allowance the permit granted, which no deadline
// binds. A payment without a deadline, or whose request does not read, never is.
func (f *Facilitator) pastDeadline(ctx context.Context, n *network, rec journal.Record) (bool, error) {
	d := recordedDeadline(rec)
	if d.IsZero() {
		return false, nil
	}
	head, err := n.readHead(ctx)
	if err != nil {
		return false, err
	}
	if head.Time <= uint64(max(d.Unix(), 0)) {
		return false, nil
	}
	p, ref, err := f.parseRecorded(rec.Request)
	if err != nil || ref != nil {
		return false, nil
	}
	if p.method == x402.TransferERC2612 {
		mined, err := priorMined(ctx, n, rec)
		return !mined, err
	}
	return true, nil
}

// authorizationSpentAt reads whether p's authorization is spent at block: its Permit2 nonce's bit, its EIP-3009
// authorizationState, its erc2612 permit's token nonce moved on. known is false for a payment of another kind.
func (p *payment) authorizationSpentAt(ctx context.Context, block *big.Int) (spent, known bool, _ error) {
	n := p.net
	switch {
	case p.method == x402.TransferPermit2 && p.nonce != nil:
		word := new(big.Int).Rsh(p.nonce, 8)
		bitmap, err := n.callUintAt(ctx, block, n.permit2, contracts.Permit2ABI, "nonceBitmap", p.payer, word)
		if err != nil {
			return false, true, err
		}
		return permit2NonceBit(bitmap, p.nonce), true, nil
	case p.method == x402.TransferEIP3009:
		state, err := n.callUintAt(ctx, block, p.asset.Address, contracts.USDCoinABI, "authorizationState", p.payer, p.auth.Nonce)
		if err != nil {
			return false, true, err
		}
		return state.Sign() != 0, true, nil
	case p.method == x402.TransferERC2612 && p.permit.Nonce != nil:
		cur, err := n.callUintAt(ctx, block, p.asset.Address, contracts.StableCoinABI, "nonces", p.payer)
		if err != nil {
			return false, true, err
		}
		return cur.Cmp(p.permit.Nonce) > 0, true, nil
	}
	return false, false, nil
}

// approvalFirst handles the payer's approval a record with a sponsored approval sends before its settlement: mined
// and succeeded, the settlement may go (sent true) if it would not revert now. Not mined, the gas money and the approval are sent again and
// the settlement waits for a later pass. Mined and failed, or its nonce taken by another of the payer's
// transactions, the settlement can never succeed: the payment is settled again (resettle), whose checks refuse it.
func (f *Facilitator) approvalFirst(ctx context.Context, n *network, rec journal.Record) (sent bool, _ error) {
	approval := new(types.Transaction)
	if err := approval.UnmarshalBinary(rec.SponsoredRawTx); err != nil {
		return false, err
	}
	r, err := n.backend.TransactionReceipt(ctx, approval.Hash())
	switch {
	case err == nil && r != nil && r.Status == types.ReceiptStatusSuccessful:
		// Mined: the settlement is simulated again before it goes, as a settlement that waited for it is. One
		// that would revert now (the payer revoked the approval or moved its tokens since) is settled again,
		// whose checks refuse it, instead of being sent to revert at the wallet's cost.
		settlement := new(types.Transaction)
		if err := settlement.UnmarshalBinary(rec.RawTx); err != nil {
			return false, err
		}
		if err := n.sender.recheck(ctx, settlement, approval.Hash()); errors.Is(err, errSettlementWouldRevert) {
			f.log.Warn("a sponsored approval mined but its recorded settlement would now revert; settling the payment again", zap.String("payment", rec.ID.String()), zap.Error(err))
			return false, f.resettle(ctx, n, rec)
		} else if err != nil {
			return false, err
		}
		return true, nil
	case err == nil && r != nil:
		return false, f.resettle(ctx, n, rec)
	case !errors.Is(err, ethereum.NotFound):
		return false, err
	}
	for i, raw := range rec.PriorRawTxs {
		tx := new(types.Transaction)
		if err := tx.UnmarshalBinary(raw); err != nil {
			return false, err
		}
		if tx, err = f.fundingToSend(ctx, n, rec, i, tx); err != nil {
			return false, err
		}
		if err := n.sender.rebroadcast(ctx, tx); err != nil && !isNonceConflict(err) {
			return false, err
		}
	}
	if err := n.sender.rebroadcast(ctx, approval); err != nil {
		if !isNonceConflict(err) {
			return false, err
		}
		// Its nonce is spent: by the approval itself, mined since its receipt was looked up above (the payer,
		// or a settlement at another gateway, sent it), and then the next pass sends the settlement; or by
		// another of the payer's transactions, and then the settlement can never succeed.
		if mined, err := n.sender.known(ctx, approval); err != nil || mined {
			return false, err
		}
		return false, f.resettle(ctx, n, rec)
	}
	f.log.Info("re-broadcast a sponsored approval; its settlement follows once it mined", zap.String("payment", rec.ID.String()), zap.String("approval", approval.Hash().Hex()))
	return false, nil
}

// fundingToSend is what reconciliation sends for funding, the gas money record rec's settlement sends the payer
// before its sponsored approval (rec.PriorRawTxs[i]): funding itself while the node knows it (sending it again
// changes nothing) or the payer still lacks the approval's gas; otherwise a zero-value transfer of the wallet to
// itself at funding's nonce, which the journal records in funding's place before it is sent. A funding that never
// reached the chain (a crash between the journal's write and the broadcast, a node that lost it) is sent by
// reconciliation long after it was signed, when the payer may have been funded since: by a settlement of another
// payment carrying the same approval, at another gateway or after a restart, which found no gas money on its way
// to the payer. Sent then, the payer would be paid for one approval twice.
func (f *Facilitator) fundingToSend(ctx context.Context, n *network, rec journal.Record, i int, funding *types.Transaction) (*types.Transaction, error) {
	if known, err := n.sender.known(ctx, funding); err != nil || known {
		return funding, err
	}
	approval := new(types.Transaction)
	if err := approval.UnmarshalBinary(rec.SponsoredRawTx); err != nil {
		return nil, err
	}
	if needed, err := payerLacksGas(ctx, n, common.HexToAddress(rec.Payer), approval); err != nil || needed {
		return funding, err
	}
	w := n.pool.byAddr[common.HexToAddress(rec.Wallet)]
	if !n.pool.maySign(w) {
		return nil, fmt.Errorf("payment %s: its payer needs the recorded gas money %s no more, and wallet %s, whose nonce %d must go to a transfer to itself instead, is not this instance's to sign (another holds its lease)",
			rec.ID, funding.Hash().Hex(), rec.Wallet, funding.Nonce())
	}
	filler, err := n.sender.signFiller(ctx, w, funding.Nonce())
	if err != nil {
		return nil, err
	}
	raw, err := filler.MarshalBinary()
	if err != nil {
		return nil, err
	}
	recorded, err := funding.MarshalBinary()
	if err != nil {
		return nil, err
	}
	if _, err := f.journal.Update(ctx, rec.ID, func(r *journal.Record) error {
		if r.State != journal.StateBroadcast || len(r.PriorRawTxs) <= i || !bytes.Equal(r.PriorRawTxs[i], recorded) {
			return fmt.Errorf("payment %s: its record changed while its gas money was being replaced", rec.ID)
		}
		prior := append([][]byte(nil), r.PriorRawTxs...)
		prior[i] = raw
		r.PriorRawTxs = prior
		return nil
	}); err != nil {
		return nil, err
	}
	f.log.Warn("a sponsored approval's recorded gas money never reached the chain and its payer needs it no more: a transfer of the wallet to itself takes its nonce",
		zap.String("network", n.caip2), zap.String("payment", rec.ID.String()), zap.String("payer", rec.Payer), zap.String("approval", approval.Hash().Hex()),
		zap.String("funding", funding.Hash().Hex()), zap.String("wei", funding.Value().String()), zap.String("tx", filler.Hash().Hex()))
	return filler, nil
}

// payerLacksGas reports whether payer still needs gas money for its signed approval, which the node does not know:
// not when the approval's nonce is spent by another of its transactions, mined (another payment's approval: this
// one can never mine), nor when its balance, pending transactions included, holds the approval's gas limit at its
// fee cap (what a node wants before it takes the approval), nor while another transaction of the payer's on its way
// takes the nonce.
func payerLacksGas(ctx context.Context, n *network, payer common.Address, approval *types.Transaction) (bool, error) {
	if known, err := n.sender.known(ctx, approval); err != nil || known {
		return false, err
	}
	mined, err := n.backend.NonceAt(ctx, payer, nil)
	if err != nil {
		return false, err
	}
	if mined > approval.Nonce() {
		return false, nil
	}
	next, err := n.backend.PendingNonceAt(ctx, payer)
	if err != nil {
		return false, err
	}
	if next > approval.Nonce() {
		// Taken by a transaction of the payer's on its way (another payment's approval, most likely, funded by
		// its own settlement): funded now, the payer would be paid twice for one nonce. The gas money's wallet
		// nonce goes to a transfer to itself instead; waiting for the other to mine would hold every later
		// settlement of the wallet behind that nonce, for as long as the payer keeps a transaction pending (found
		// by review). Should the other be dropped, this approval goes unfunded, and its payment is not settled.
		return false, nil
	}
	balance, err := n.pendingBalance(ctx, payer)
	if err != nil {
		return false, err
	}
	return balance.Cmp(maxGasCost(approval)) < 0, nil
}

// finaliseFromReceipts looks up the receipts of the record's transactions and finalises the record with the one
// that decides it (see outcome); done says it did.
func (f *Facilitator) finaliseFromReceipts(ctx context.Context, n *network, rec journal.Record) (done bool, _ error) {
	for _, h := range recordHashes(rec) {
		receipt, err := n.backend.TransactionReceipt(ctx, h)
		if err != nil && !errors.Is(err, ethereum.NotFound) {
			return false, err
		}
		if err != nil || receipt == nil {
			continue
		}
		if final, ok := f.outcome(ctx, n, rec.ID, receipt); ok {
			f.finalise(ctx, n, rec.ID, final, rec.Payer, rec.Amount, recordedUpto(rec))
			return true, nil
		}
	}
	return false, nil
}

// recordedUpto reports whether the record's request is of the upto scheme (its revert has its own reason code).
func recordedUpto(rec journal.Record) bool {
	var req struct {
		PaymentRequirements struct {
			Scheme string `json:"scheme"`
		} `json:"paymentRequirements"`
	}
	return json.Unmarshal(rec.Request, &req) == nil && req.PaymentRequirements.Scheme == x402.SchemeUpto
}

// recordHashes lists every transaction hash that may settle the record's payment: the current one and the ones
// it replaced.
func recordHashes(rec journal.Record) []common.Hash {
	out := []common.Hash{common.HexToHash(rec.TxHash)}
	for _, h := range rec.ReplacedTxHashes {
		out = append(out, common.HexToHash(h))
	}
	return out
}

// bumpFees replaces the record's transactions that still wait in the node's pool with fee-bumped copies (same
// nonces), recording each replacement before it is sent. Waiters of the old settlement hash wait for the new.
func (f *Facilitator) bumpFees(ctx context.Context, n *network, rec journal.Record) error {
	w := n.pool.byAddr[common.HexToAddress(rec.Wallet)]
	if w == nil {
		return fmt.Errorf("payment %s: wallet %s is not in this facilitator's pool; cannot replace its transaction", rec.ID, rec.Wallet)
	}
	if !n.pool.maySign(w) {
		return nil // another instance holds the wallet's lease: it is the one that may sign a replacement
	}
	raws := append(append([][]byte{}, rec.PriorRawTxs...), rec.RawTx)
	for i, raw := range raws {
		tx := new(types.Transaction)
		if err := tx.UnmarshalBinary(raw); err != nil {
			return err
		}
		if _, pending, err := n.backend.TransactionByHash(ctx, tx.Hash()); err != nil || !pending {
			continue // mined, or gone: nothing to speed up
		}
		replacement, err := n.sender.replace(ctx, w, tx)
		if err != nil {
			return err
		}
		newRaw, err := replacement.MarshalBinary()
		if err != nil {
			return err
		}
		main := i == len(raws)-1
		if _, err := f.journal.Update(ctx, rec.ID, func(r *journal.Record) error {
			if main {
				r.ReplacedTxHashes = append(append([]string(nil), r.ReplacedTxHashes...), r.TxHash)
				r.TxHash, r.RawTx = replacement.Hash().Hex(), newRaw
			} else {
				prior := append([][]byte(nil), r.PriorRawTxs...)
				prior[i] = newRaw
				r.PriorRawTxs = prior
				// Named beside the version it replaces, which may still be the one that mines: a settled-again
				// erc2612 payment looks among them for its mined permit (resettle).
				if h := replacement.Hash().Hex(); !slices.Contains(r.PriorTxHashes, h) {
					r.PriorTxHashes = append(slices.Clip(r.PriorTxHashes), h)
				}
			}
			r.Attempts++
			return nil
		}); err != nil {
			return err
		}
		if main {
			n.watcher.replaced(tx.Hash(), replacement.Hash())
		}
		if err := n.sender.rebroadcast(ctx, replacement); err != nil && !isNonceConflict(err) {
			return err
		}
		f.log.Info("replaced a stuck settlement transaction with higher fees", zap.String("payment", rec.ID.String()),
			zap.String("old_tx", tx.Hash().Hex()), zap.String("tx", replacement.Hash().Hex()))
	}
	return nil
}

// spentNonceWait is how long reconciliation looks for the receipt of a payment whose nonce is spent on chain
// before it takes the payment as spent by something else.
const spentNonceWait = 10 * time.Minute

// resettle settles again a payment whose recorded transaction can never mine (its wallet nonce went to another
// transaction): unless a receipt turned up meanwhile, the payment is checked against the chain afresh and sent
// with a new nonce, or finalised as refused when the chain no longer allows it.
func (f *Facilitator) resettle(ctx context.Context, n *network, rec journal.Record) error {
	if done, err := f.finaliseFromReceipts(ctx, n, rec); done || err != nil {
		return err
	}
	p, ref, err := f.parseRecorded(rec.Request)
	if err != nil {
		return fmt.Errorf("payment %s: the journal holds no readable request to settle again: %w", rec.ID, err)
	}
	if ref == nil && p.id != rec.ID {
		return fmt.Errorf("payment %s: its recorded request belongs to payment %s", rec.ID, p.id)
	}
	if ref == nil {
		p.claim = rec
	}
	var hash common.Hash
	if ref == nil && p.method == x402.TransferERC2612 {
		// A permit of this settlement that mined spent the payer's permit nonce: what is left to send is the
		// transfer its allowance pays for.
		if p.permitApplied, err = priorMined(ctx, n, rec); err != nil {
			return err
		}
	}
	checked := ref == nil // the refusal, if any, is the checks' (the request parsed)
	if checked {
		hash, ref, err = f.broadcast(ctx, p)
		if err != nil {
			return err
		}
	}
	if ref != nil && ref.reason == x402.ReasonNoAvailableWallets {
		return errors.New(ref.message) // busy, not refused: the next pass tries again
	}
	if ref != nil && checked && p.method == x402.TransferERC2612 && !p.permitApplied {
		// Refused, perhaps because this settlement's own permit, on its way when the receipts were looked up,
		// mined during the checks (whose simulation then fails, ERC2612InvalidSigner): its receipt, looked up
		// again, says so, and the next pass sends the transfer its allowance pays for. No receipt yet, with the
		// permit's nonce spent since it was read, the next pass looks again (within spentNonceWait of the claim).
		mined, err := priorMined(ctx, n, rec)
		if err != nil {
			return err
		}
		if mined {
			return fmt.Errorf("payment %s: its own permit mined while it was settled again; the next pass sends the transfer: %s", rec.ID, ref.message)
		}
		if f.now().Sub(rec.ClaimedAt) < spentNonceWait {
			cur, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "nonces", p.payer)
			if err != nil {
				return err
			}
			if cur.Cmp(p.permit.Nonce) > 0 {
				return fmt.Errorf("payment %s: its permit's nonce %s was spent while it was settled again (the token's next is %s), most likely by its own permit transaction; the next pass looks for its receipt: %s", rec.ID, p.permit.Nonce, cur, ref.message)
			}
		}
	}
	if ref != nil && f.now().Sub(rec.ClaimedAt) < spentNonceWait {
		// The payment's own nonce is spent: most likely by its recorded transaction, mined just now, whose
		// receipt the node does not serve yet (a node behind the one that mined it), and the checks refuse it for
		// its nonce, or for its deadline once the chain's time passed it. The next pass looks for the receipt
		// again; past spentNonceWait the payment is taken as spent elsewhere.
		spent := ref.reason == x402.ReasonPermit2InvalidNonce || ref.reason == x402.ReasonNonceAlreadyUsed
		if !spent && checked && !(p.method == x402.TransferERC2612 && p.permitApplied) {
			// Read at the head the checks judged by, not at whatever an endpoint calls its latest: one behind the
			// node that mined the payment would show its authorization unspent (one without that block errs, and
			// the next pass looks again).
			var at *big.Int
			if p.head != nil {
				at = p.head.Number
			}
			s, known, err := p.authorizationSpentAt(ctx, at)
			if err != nil {
				return err
			}
			spent = known && s
		}
		if spent {
			return fmt.Errorf("payment %s: its nonce is spent on chain and no receipt of its transactions was found yet: %s", rec.ID, ref.message)
		}
	}
	if ref != nil {
		// Refused for good: it will not move tokens. Its hold goes before its record is final (see finalise), and
		// only while the record is still the one judged: one claimed again meanwhile holds its own (by the same id).
		if cur, ok, err := f.journal.Get(ctx, rec.ID); err != nil {
			return err
		} else if !ok || !sameBroadcast(cur, rec) {
			return fmt.Errorf("payment %s: its record changed while it was settled again; the next pass looks again", rec.ID)
		}
		if err := n.funds.let(rec.ID); err != nil {
			return fmt.Errorf("payment %s: letting go of its funds hold: %w", rec.ID, err)
		}
		// The answer names no transaction: the dropped one can never mine (its nonce went to another), and a
		// failure naming a transaction is one whose transaction may still mine, unless it reverted (see
		// x402.SettleResponse.OutcomeUnknown). The message names it.
		resp := failed(n.caip2, rec.Payer, "", refuse(ref.reason, "the settlement transaction %s was dropped and cannot be sent again: %s", rec.TxHash, ref.message))
		_, err := f.journal.Update(ctx, rec.ID, func(r *journal.Record) error {
			// Only over the record judged: one finalised meanwhile (a receipt another waiter saw) keeps its answer.
			if !sameBroadcast(*r, rec) {
				return fmt.Errorf("payment %s: its record changed while it was settled again (now %s, transaction %s); the next pass looks again", rec.ID, r.State, r.TxHash)
			}
			r.State, r.Response = journal.StateFinal, &resp
			return nil
		})
		return err
	}
	f.log.Info("settled again a payment whose transaction was dropped", zap.String("payment", rec.ID.String()), zap.String("old_tx", rec.TxHash), zap.String("tx", hash.Hex()))
	return nil
}

// sameBroadcast reports whether cur is still rec: broadcast, of the same claim, with the same transaction.
func sameBroadcast(cur, rec journal.Record) bool {
	return cur.State == journal.StateBroadcast && cur.SameClaim(&rec) && cur.TxHash == rec.TxHash
}

// priorMined reports whether one of the prior transactions rec names (an erc2612 settlement's permit, in any of its
// versions) mined and succeeded.
func priorMined(ctx context.Context, n *network, rec journal.Record) (bool, error) {
	for _, h := range rec.PriorTxHashes {
		r, err := n.backend.TransactionReceipt(ctx, common.HexToHash(h))
		if err != nil && !errors.Is(err, ethereum.NotFound) {
			return false, err
		}
		if err == nil && r != nil && r.Status == types.ReceiptStatusSuccessful {
			return true, nil
		}
	}
	return false, nil
}

// isSettlementRecord reports whether rec is one of this engine's settlement records: its request parses to a
// payment whose id is rec.ID. The journal is shared (a gate keeps its own records of serving there, under ids
// of their own), and reconciliation must touch nothing but settlements.
func (f *Facilitator) isSettlementRecord(rec journal.Record) bool {
	if rec.Async || len(rec.Request) == 0 {
		return false
	}
	p, ref, err := f.parseRecorded(rec.Request)
	return err == nil && ref == nil && p.id == rec.ID
}

// takeOver makes a settlement record of another process this process's, when that process is dead: its claim is
// released, and its broadcast transactions are finished, by this one. mine false: the owner is alive (it
// reconciles the record itself), or another process took the record over first.
func (f *Facilitator) takeOver(ctx context.Context, rec journal.Record, isAlive func(context.Context, string) (bool, error)) (mine bool, _ error) {
	alive, err := isAlive(ctx, rec.Owner)
	if err != nil || alive {
		return false, err
	}
	_, err = f.journal.Update(ctx, rec.ID, func(r *journal.Record) error {
		if r.Owner != rec.Owner {
			return errTakenOver
		}
		r.Owner = f.owner
		return nil
	})
	switch {
	case err == nil:
		f.log.Info("took over a settlement of an instance that is gone", zap.String("payment", rec.ID.String()),
			zap.String("state", string(rec.State)), zap.String("tx", rec.TxHash))
		return true, nil
	case errors.Is(err, errTakenOver), errors.Is(err, journal.ErrNotFound):
		return false, nil
	}
	return false, err
}

// releaseAbandonedClaim releases a claim of this process that no settlement of it is working on: the settlement
// that claimed it could not release it (the journal's database was unreachable when it gave up, or as it took
// back a settlement it had handed off), or its claim was written while the call that made it failed (a
// connection lost as the write committed). Nothing was sent: a claim is made broadcast in the journal before its
// transaction leaves. Kept, the payment could never settle, here or on another process sharing the journal,
// while this one lives: every settlement of it would wait for the claim to move. rec is the record as a pass
// read it; one claimed since (another claim of the payment, after a release) is left alone.
func (f *Facilitator) releaseAbandonedClaim(ctx context.Context, n *network, rec journal.Record) error {
	if f.holdsClaim(rec.ID) {
		return nil
	}
	cur, ok, err := f.journal.Get(ctx, rec.ID)
	if err != nil || !ok || cur.State != journal.StateClaimed || cur.Owner != f.owner || !cur.ClaimedAt.Equal(rec.ClaimedAt) {
		return err
	}
	if cur.OnOffer() {
		// Handed off, with nobody waiting for it (its settlement gave up, or a taker offered it again after that):
		// another process may take it at any moment, and the claim, the funds hold its settlement takes and its
		// transaction are then the taker's. The offer is withdrawn first, on the condition a take is made on, so
		// that exactly one of the two goes on; a take that came first is left alone.
		withdrawn, err := f.journal.Update(ctx, rec.ID, func(r *journal.Record) error {
			if !r.SameClaim(&cur) || !r.OnOffer() {
				return errTakenOver
			}
			r.Handoff = nil
			return nil
		})
		switch {
		case errors.Is(err, errTakenOver), errors.Is(err, journal.ErrNotFound):
			return nil
		case err != nil:
			return fmt.Errorf("payment %s: withdrawing the offer of a claim to release: %w", rec.ID, err)
		}
		cur = withdrawn
	}
	// Only this process's settlements change a claim of its own that it still lives to hold and that is on offer
	// to nobody, and none is working on this one: it stays as read until released here.
	if released, err := f.releaseClaim(ctx, n, cur); err != nil || !released {
		return err
	}
	f.log.Warn("released a settlement claim that its settlement could not release; nothing had been broadcast, the payment may be presented again",
		zap.String("payment", rec.ID.String()))
	return nil
}

// releaseClaim releases a settlement claim that never broadcast and that no settlement holds any more, its funds
// hold first: the settlement that claimed it could let go of neither (the journal's database unreachable as it
// gave up, or its process gone), and a hold whose claim went first would be nobody's to let go until its deadline.
// A served payment's hold stays: its gate settles it again. rec is the claim as read; one made since is left alone
// (released false). While the claim is there no other settlement of the payment can hold it: the hold let go is
// this claim's.
func (f *Facilitator) releaseClaim(ctx context.Context, n *network, rec journal.Record) (released bool, _ error) {
	if err := n.funds.failedForNow(rec.ID); err != nil {
		return false, fmt.Errorf("payment %s: letting go of the funds hold of a claim to release: %w", rec.ID, err)
	}
	switch err := f.journal.Release(ctx, rec); {
	case errors.Is(err, journal.ErrNotReleasable):
		return false, nil
	case err != nil:
		return false, err
	}
	return true, nil
}

// holdsClaim reports whether a settlement of this process is claiming payment id, holds its claim or is sending
// its transaction. A settlement waiting for another claim of the payment to move (answerFromJournal) does not
// hold it: a client presenting the payment again and again must not keep an abandoned claim alive.
func (f *Facilitator) holdsClaim(id journal.ID) bool {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	return f.claiming[id] > 0 || f.sending[id]
}

// errTakenOver: another process took a dead process's record over first.
var errTakenOver = errors.New("another instance took the record over")

func (f *Facilitator) isSending(id journal.ID) bool {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	return f.sending[id]
}

func (f *Facilitator) reconcileLoop(every time.Duration) {
	defer f.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	lastPrune := f.now()
	for {
		select {
		case <-f.stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), every*5)
			if err := f.reconcile(ctx, false); err != nil {
				f.log.Warn("reconciling the settlement journal", zap.Error(err))
			}
			// Final records past their retention go every ten minutes (sooner for a short retention).
			if f.now().Sub(lastPrune) >= min(10*time.Minute, f.retention/2) {
				lastPrune = f.now()
				if n, err := f.journal.Prune(ctx, f.now().Add(-f.retention)); err != nil {
					f.log.Warn("pruning the settlement journal", zap.Error(err))
				} else if n > 0 {
					f.log.Info("pruned final settlements from the journal", zap.Int("records", n), zap.Duration("older_than", f.retention))
				}
				f.pruneHolds(ctx)
				// Channels refunded or withdrawn, all claimed, go with the records of the same age.
				if chs, ok := f.journal.(journal.Channels); ok {
					if n, err := chs.PruneChannels(ctx, f.now().Add(-f.retention)); err != nil {
						f.log.Warn("pruning the journal's batch-settlement channels", zap.Error(err))
					} else if n > 0 {
						f.log.Info("pruned withdrawn batch-settlement channels from the journal", zap.Int("channels", n))
					}
				}
			}
			cancel()
		}
	}
}

// holdPruneMargin is how long past its payment's deadline, in chain time, a shared funds hold is kept: by then the
// payment can no longer be mined, and a settlement of it that was shows in every read of the payer's funds that
// still answers (a read answers for the funds cache TTL, which is added).
const holdPruneMargin = 10 * time.Minute

// pruneHolds deletes the shared funds holds of this engine's networks past their payments' deadlines (see
// holdPruneMargin), whoever took them: a hold whose end was never written (its process gone before it could, say)
// ends with its payment's deadline, and the payer's funds are the payer's again.
func (f *Facilitator) pruneHolds(ctx context.Context) {
	if f.cluster == nil {
		return
	}
	for _, id := range f.order {
		n := f.networks[id]
		head, err := n.backend.HeaderByNumber(ctx, nil)
		if err != nil {
			f.log.Warn("reading the head block to prune funds holds past their deadlines", zap.String("network", n.caip2), zap.Error(err))
			continue
		}
		margin := uint64((holdPruneMargin + n.funds.ttl) / time.Second)
		if head.Time <= margin {
			continue
		}
		if k, err := f.cluster.PruneHolds(ctx, n.funds.keyPrefix(), head.Time-margin); err != nil {
			f.log.Warn("pruning funds holds past their deadlines", zap.String("network", n.caip2), zap.Error(err))
		} else if k > 0 {
			f.log.Info("pruned funds holds past their payments' deadlines", zap.String("network", n.caip2), zap.Int("holds", k),
				zap.Duration("past_deadline", holdPruneMargin+n.funds.ttl))
		}
	}
}

// firstNonce is the nonce of a broadcast record's first transaction: its prior ones (an erc2612 permit) take the
// nonces just below TxNonce.
func firstNonce(rec journal.Record) uint64 { return rec.TxNonce - uint64(len(rec.PriorRawTxs)) }

// holeSighting is a nonce hole of a wallet as one reconciliation pass saw it.
type holeSighting struct {
	next uint64 // the node's next nonce for the wallet, below the wallet's recorded transactions
	at   time.Time
}

// sawHoleBefore records that the wallet's transactions wait behind nonce next, and reports whether an earlier
// pass, at least the reconcile grace ago, saw the same hole: a node that is merely behind, or a send under way,
// is not a hole worth a transaction.
func (f *Facilitator) sawHoleBefore(wallet common.Address, next uint64) bool {
	f.holesMu.Lock()
	defer f.holesMu.Unlock()
	prev, ok := f.holes[wallet]
	if ok && prev.next == next {
		return f.now().Sub(prev.at) >= f.grace
	}
	f.holes[wallet] = holeSighting{next: next, at: f.now()}
	return false
}

// fillNonceHoles sends the wallets of records whose transactions wait behind a nonce no transaction holds. A
// node that dropped a transaction of the wallet which no journal record keeps (its pool was lost in a restart,
// or evicted it; a reorg left it out) leaves every later transaction of the wallet queued for ever, and their
// payments answering settlement_pending. Each missing nonce gets a zero-value transfer from the wallet to
// itself, the cheapest transaction there is, after which the recorded transactions mine as they are (a
// payment no longer valid then reverts, and its record gets that final answer).
func (f *Facilitator) fillNonceHoles(ctx context.Context, looked, held []journal.Record) {
	type walletKey struct {
		net    *network
		wallet common.Address
	}
	holders := map[walletKey]map[uint64]bool{}
	lowest := map[walletKey]uint64{}
	for _, rec := range held {
		k := walletKey{f.networks[rec.Network], common.HexToAddress(rec.Wallet)}
		if holders[k] == nil {
			holders[k] = map[uint64]bool{}
		}
		for nonce := firstNonce(rec); nonce <= rec.TxNonce; nonce++ {
			holders[k][nonce] = true
		}
	}
	for _, rec := range looked {
		k := walletKey{f.networks[rec.Network], common.HexToAddress(rec.Wallet)}
		first := firstNonce(rec)
		if low, ok := lowest[k]; !ok || first < low {
			lowest[k] = first
		}
	}
	for k, first := range lowest {
		w := k.net.pool.byAddr[k.wallet]
		if !k.net.pool.maySign(w) {
			continue // another process's wallet: it fills its own holes
		}
		next, err := k.net.backend.PendingNonceAt(ctx, k.wallet)
		if err != nil {
			f.log.Warn("reading a settlement wallet's nonce to look for holes", zap.String("wallet", k.wallet.Hex()), zap.Error(err))
			continue
		}
		if next >= first || holders[k][next] {
			f.holesMu.Lock()
			delete(f.holes, k.wallet) // no hole (or one a recorded transaction fills)
			f.holesMu.Unlock()
			continue
		}
		if !f.sawHoleBefore(k.wallet, next) {
			continue
		}
		for nonce := next; nonce < first; nonce++ {
			if holders[k][nonce] {
				break // a recorded transaction holds it: its reconciliation sends it again
			}
			hash, err := k.net.sender.fillNonce(ctx, w, nonce)
			if err != nil {
				f.log.Warn("filling a nonce hole of a settlement wallet", zap.String("wallet", k.wallet.Hex()),
					zap.Uint64("nonce", nonce), zap.Error(err))
				break
			}
			f.log.Warn("filled a nonce hole that held settlements back: the node had lost a transaction of the wallet",
				zap.String("network", k.net.caip2), zap.String("wallet", k.wallet.Hex()), zap.Uint64("nonce", nonce), zap.String("tx", hash.Hex()))
		}
	}
}
