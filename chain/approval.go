package chain

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"sync"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/params"
	"github.com/ethereum/go-ethereum/rpc"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The erc20ApprovalGasSponsoring extension. A payer whose token has no EIP-2612 permit, and who has not approved
// Permit2, signs an ordinary approve(Permit2, amount) transaction and attaches it to its permit2 payment. Settling,
// the facilitator sends the payer the gas money the approval costs when the payer lacks it (from the settlement
// wallet), broadcasts the payer's transaction as it is, waits for it to mine, and only then sends the settlement:
// three transactions, in that order. Nothing bundles them on a plain node, so what the facilitator risks is bounded
// and counted instead:
//   - the approval is checked whole before anything is spent (its chain, sender, target, calldata, nonce, gas and
//     fees), and simulated with the settlement after it, in one eth_simulateV1 of the next block;
//   - the funding is only what the payer's balance, pending transactions included, lacks for the approval's gas
//     limit at its fee cap: a payment presented again after a crash, or on another gateway, finds the money there
//     and sends none; both are bounded by ApprovalSponsoring's MaxGas and MaxFeePerGas;
//   - the approval is held with the payment like a gas-sponsoring permit (funds.permitNonce): two payments
//     carrying the same approval are not settled side by side;
//   - the journal records the funding and the settlement (the wallet's) and the approval (the payer's,
//     SponsoredRawTx) before anything leaves; reconciliation sends the settlement only once the approval mined.
// A payer that spends its approval's nonce elsewhere after being funded keeps the gas money: that is the cost the
// bound limits, and Facilitator.ApprovalFunding counts what was sent.

// ApprovalSponsoring takes the erc20ApprovalGasSponsoring extension on a network: the bounds of what the
// facilitator pays for a payer's approval of Permit2.
type ApprovalSponsoring struct {
	// MaxGas is the largest gas limit an approval may carry (default 100,000; an ERC-20 approve takes about
	// 46,000, and the public SDK signs 70,000).
	MaxGas uint64
	// MaxFeePerGas is the highest fee cap (or legacy gas price) an approval may carry, in wei (nil: 10 gwei). With
	// MaxGas it bounds the gas money sent to one payer for one payment.
	MaxFeePerGas *big.Int
}

// defaultApprovalMaxGas and defaultApprovalMaxFee are ApprovalSponsoring's defaults.
const defaultApprovalMaxGas = 100_000

var defaultApprovalMaxFee = big.NewInt(10 * params.GWei)

// approvalBlocksBefore is the blocks a sponsored approval's settlement waits behind: the payer's gas money, then
// its approval, each mined before the next is sent (checkDeadline).
const approvalBlocksBefore = 2

// approvalMinTipBound is the least priority fee per gas the bound on an approval's fee cap allows for (1 gwei,
// what payer.Transport signs and the public SDKs' fallback), whatever lower tip the node suggests.
var approvalMinTipBound = big.NewInt(params.GWei)

// maxApprovalTxBytes bounds a signed approval's encoding: an EIP-1559 approve is about 180 bytes.
const maxApprovalTxBytes = 512

// approvalTerms are a network's ApprovalSponsoring with defaults, and what was sent to fund approvals.
type approvalTerms struct {
	maxGas uint64
	maxFee *big.Int

	mu     sync.Mutex
	funded *big.Int // wei sent to payers for their approvals' gas, since start
}

func newApprovalTerms(c *ApprovalSponsoring) *approvalTerms {
	if c == nil {
		return nil
	}
	t := &approvalTerms{maxGas: c.MaxGas, maxFee: c.MaxFeePerGas, funded: new(big.Int)}
	if t.maxGas == 0 {
		t.maxGas = defaultApprovalMaxGas
	}
	if t.maxFee == nil || t.maxFee.Sign() <= 0 {
		t.maxFee = defaultApprovalMaxFee
	}
	return t
}

// ApprovalFunding is the wei this facilitator has sent payers on network for their approvals' gas since it
// started (erc20ApprovalGasSponsoring); nil when the network does not take the extension.
func (f *Facilitator) ApprovalFunding(network string) *big.Int {
	n := f.networks[network]
	if n == nil || n.approval == nil {
		return nil
	}
	n.approval.mu.Lock()
	defer n.approval.mu.Unlock()
	return new(big.Int).Set(n.approval.funded)
}

// sponsorApproval is the payer's signed approval of Permit2 from the erc20ApprovalGasSponsoring extension.
type sponsorApproval struct {
	tx     *types.Transaction
	amount *big.Int // the allowance it sets
	// funding is the wei the settlement sends the payer first, for the approval's gas (the chain checks set it).
	funding *big.Int
	err     *refusal // the extension came but is not usable; reported only if the allowance is missing
}

var (
	approveSelector = []byte{0x09, 0x5e, 0xa7, 0xb3}
	hexData         = regexp.MustCompile(`^0x[0-9a-fA-F]+$`)
	schemaVersion   = regexp.MustCompile(`^[0-9]+(\.[0-9]+)*$`)
)

// parseApproval reads the erc20ApprovalGasSponsoring extension's info (decodeErr: it did not decode) and checks
// the signed transaction it carries, all but what the chain says (its nonce, the payer's balance). Its problems
// are kept, not returned: they matter only when the payer has not approved Permit2 already.
func (p *payment) parseApproval(info *x402.ERC20ApprovalGasSponsoringInfo, decodeErr error) *sponsorApproval {
	sa := &sponsorApproval{}
	const ext = "extensions.erc20ApprovalGasSponsoring.info."
	bad := func(reason, format string, args ...any) *sponsorApproval {
		sa.err = refuse(reason, format, args...)
		return sa
	}
	if decodeErr != nil {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%v", decodeErr)
	}
	from, err := ParseAddress(ext+"from", info.From)
	if err != nil {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%v", err)
	}
	asset, err := ParseAddress(ext+"asset", info.Asset)
	if err != nil {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%v", err)
	}
	spender, err := ParseAddress(ext+"spender", info.Spender)
	if err != nil {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%v", err)
	}
	amount, err := x402.ParseUint256(info.Amount)
	if err != nil {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%samount must be a decimal uint256, got %q", ext, truncate(info.Amount))
	}
	if !schemaVersion.MatchString(info.Version) {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%sversion must be digits and dots, got %q", ext, truncate(info.Version))
	}
	if len(info.SignedTransaction) > 2+2*maxApprovalTxBytes {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%ssignedTransaction is %d characters; an approval is at most %d bytes (%d hex digits)", ext, len(info.SignedTransaction), maxApprovalTxBytes, 2*maxApprovalTxBytes)
	}
	if !hexData.MatchString(info.SignedTransaction) {
		return bad(x402.ReasonInvalidERC20ApprovalExtensionFormat, "%ssignedTransaction must be 0x and hex digits", ext)
	}
	n := p.net
	switch {
	case from != p.payer:
		return bad(x402.ReasonERC20ApprovalFromMismatch, "%sfrom is %s but the payer is %s", ext, from.Hex(), p.payer.Hex())
	case asset != p.asset.Address:
		return bad(x402.ReasonERC20ApprovalAssetMismatch, "%sasset is %s but the payment is in %s", ext, asset.Hex(), p.asset.Address.Hex())
	case spender != n.permit2:
		return bad(x402.ReasonERC20ApprovalSpenderNotPermit2, "%sspender is %s; it must be Permit2 %s", ext, spender.Hex(), n.permit2.Hex())
	}
	tx := new(types.Transaction)
	if err := tx.UnmarshalBinary(hexutil.MustDecode(info.SignedTransaction)); err != nil {
		return bad(x402.ReasonERC20ApprovalTxParseFailed, "%ssignedTransaction is not a signed transaction: %v", ext, err)
	}
	if tx.Type() != types.DynamicFeeTxType && tx.Type() != types.LegacyTxType {
		return bad(x402.ReasonERC20ApprovalTxParseFailed, "%ssignedTransaction is a type %d transaction; an approval is an EIP-1559 (type 2) or legacy one", ext, tx.Type())
	}
	if tx.Type() == types.LegacyTxType && !tx.Protected() {
		return bad(x402.ReasonERC20ApprovalTxWrongChain, "%ssignedTransaction is a legacy transaction without a chain id (EIP-155): it could be replayed on any chain", ext)
	}
	if tx.ChainId().Cmp(n.chainID) != 0 {
		return bad(x402.ReasonERC20ApprovalTxWrongChain, "%ssignedTransaction is for chain %s but the payment is on %s (chain %s)", ext, tx.ChainId(), n.caip2, n.chainID)
	}
	data := tx.Data()
	switch {
	case tx.To() == nil || *tx.To() != p.asset.Address:
		to := "nothing (a contract creation)"
		if tx.To() != nil {
			to = tx.To().Hex()
		}
		return bad(x402.ReasonERC20ApprovalTxWrongTarget, "%ssignedTransaction calls %s; it must call the token %s", ext, to, p.asset.Address.Hex())
	case tx.Value().Sign() != 0:
		return bad(x402.ReasonERC20ApprovalTxInvalidCalldata, "%ssignedTransaction sends %s wei; an approval sends none", ext, tx.Value())
	case len(data) < 4 || !bytes.Equal(data[:4], approveSelector):
		return bad(x402.ReasonERC20ApprovalTxWrongSelector, "%ssignedTransaction's calldata does not call approve(address,uint256) (selector 0x095ea7b3)", ext)
	case len(data) != 4+64 || !bytes.Equal(data[4:16], make([]byte, 12)):
		return bad(x402.ReasonERC20ApprovalTxInvalidCalldata, "%ssignedTransaction's calldata is not approve(address,uint256) with its two arguments (%d bytes, want 68)", ext, len(data))
	}
	if got := common.BytesToAddress(data[16:36]); got != n.permit2 {
		return bad(x402.ReasonERC20ApprovalTxWrongSpender, "%ssignedTransaction approves %s; it must approve Permit2 %s", ext, got.Hex(), n.permit2.Hex())
	}
	approved := new(big.Int).SetBytes(data[36:68])
	switch {
	case approved.Cmp(amount) != 0:
		return bad(x402.ReasonERC20ApprovalTxInvalidCalldata, "%ssignedTransaction approves %s but %samount says %s", ext, approved, ext, amount)
	case approved.Cmp(p.p2.Amount) < 0:
		return bad(x402.ReasonERC20ApprovalTxInvalidCalldata, "%ssignedTransaction approves %s, less than the %s the payment permits", ext, approved, p.p2.Amount)
	}
	signer, err := types.Sender(types.LatestSignerForChainID(n.chainID), tx)
	if err != nil {
		return bad(x402.ReasonERC20ApprovalTxInvalidSignature, "%ssignedTransaction's signature does not recover: %v", ext, err)
	}
	if signer != p.payer {
		return bad(x402.ReasonERC20ApprovalTxSignerMismatch, "%ssignedTransaction is signed by %s, not by the payer %s", ext, signer.Hex(), p.payer.Hex())
	}
	t := n.approval
	switch {
	case tx.Gas() > t.maxGas:
		return bad(x402.ReasonERC20ApprovalTxFeesNotSponsored, "%ssignedTransaction's gas limit %d is above the %d this facilitator sponsors", ext, tx.Gas(), t.maxGas)
	case tx.GasFeeCap().Cmp(t.maxFee) > 0:
		return bad(x402.ReasonERC20ApprovalTxFeesNotSponsored, "%ssignedTransaction's fee cap %s wei per gas is above the %s this facilitator sponsors", ext, tx.GasFeeCap(), t.maxFee)
	case tx.GasTipCap().Cmp(tx.GasFeeCap()) > 0:
		return bad(x402.ReasonERC20ApprovalTxFeesNotSponsored, "%ssignedTransaction's priority fee %s is above its fee cap %s: no node takes it", ext, tx.GasTipCap(), tx.GasFeeCap())
	}
	sa.tx, sa.amount = tx, approved
	return sa
}

// approvalCost is the most the approval's gas can cost its sender: what a node wants the sender's balance to hold.
func (sa *sponsorApproval) approvalCost() *big.Int { return maxGasCost(sa.tx) }

// maxGasCost is the most tx's gas can cost its sender: its gas limit at its fee cap.
func maxGasCost(tx *types.Transaction) *big.Int {
	return new(big.Int).Mul(new(big.Int).SetUint64(tx.Gas()), tx.GasFeeCap())
}

// pendingBalanceReader is a backend that reads a balance with the node's pending transactions applied.
type pendingBalanceReader interface {
	PendingBalanceAt(ctx context.Context, account common.Address) (*big.Int, error)
}

// pendingBalance is account's balance with the node's pending transactions applied, or the latest one where the
// backend cannot read that.
func (n *network) pendingBalance(ctx context.Context, account common.Address) (*big.Int, error) {
	if r, ok := n.backend.(pendingBalanceReader); ok {
		return r.PendingBalanceAt(ctx, account)
	}
	return n.backend.BalanceAt(ctx, account, nil)
}

// checkApproval checks what the chain says of p's approval: its nonce is the payer's next (or the node knows the
// very transaction already: a settlement that sent it before a crash), with no transaction of the payer's on its
// way before it or at it (refused at verification as waiting behind it, to be presented again; at settlement,
// nothing sent and an error saying so), its fee cap pays the next block's base fee, and the payer is an account with
// no code. It sets the funding: what the payer's balance, pending transactions included, lacks for the approval's
// gas.
func (p *payment) checkApproval(ctx context.Context, use fundsUse) (*refusal, error) {
	n, sa := p.net, p.approval
	const ext = "extensions.erc20ApprovalGasSponsoring.info.signedTransaction"
	if _, pending, err := n.backend.TransactionByHash(ctx, sa.tx.Hash()); err == nil {
		// Sent already (by a settlement of this payment that crashed, or another gateway's): paid for, and on its
		// way or mined. Mined and failed, it never sets the allowance, whatever a simulation of it says now.
		if !pending {
			r, err := n.backend.TransactionReceipt(ctx, sa.tx.Hash())
			if err != nil {
				return nil, err
			}
			if r.Status != types.ReceiptStatusSuccessful {
				return refuse(x402.ReasonERC20ApprovalTxFailed, "%s %s was mined and failed; approve Permit2, or sign a new approval", ext, sa.tx.Hash().Hex()), nil
			}
		}
		sa.funding = new(big.Int)
		return nil, nil
	} else if !errors.Is(err, ethereum.NotFound) {
		return nil, err
	}
	next, err := n.backend.PendingNonceAt(ctx, p.payer)
	if err != nil {
		return nil, err
	}
	mined, err := n.backend.NonceAt(ctx, p.payer, nil)
	if err != nil {
		return nil, err
	}
	if sa.tx.Nonce() != next {
		if sa.tx.Nonce() < next && sa.tx.Nonce() >= mined {
			// Its nonce is taken by a transaction of the payer's on its way, most likely another payment's
			// approval (two first payments of a payer, signed at once): once that mined, the allowance it sets
			// pays this payment, or the payment is refused then. Nothing is wrong with this one yet.
			if use == fundsSettle {
				return nil, fmt.Errorf("nothing was sent: %w: the payer %s's approval has nonce %d, which another of its transactions on its way takes (its mined nonce is %d, its pending one %d); the payment is settled once that mined", errNodeNotAsked, p.payer.Hex(), sa.tx.Nonce(), mined, next)
			}
			return refuse(x402.ReasonERC20ApprovalTxWrongNonce, "%s has nonce %d, which another transaction of the payer %s on its way takes (its mined nonce is %d, its pending one %d): most likely another payment's approval of Permit2, whose allowance pays this payment once it mined; present the payment again then", ext, sa.tx.Nonce(), p.payer.Hex(), mined, next), nil
		}
		return refuse(x402.ReasonERC20ApprovalTxWrongNonce, "%s has nonce %d but the payer %s's next is %d; sign it again with the account's pending nonce", ext, sa.tx.Nonce(), p.payer.Hex(), next), nil
	}
	if mined < next {
		// The payer has transactions on their way (most likely the approval of an earlier payment, funded by a
		// settlement of it): they spend from the balance the funding is judged against, and a node takes this
		// approval after them only if the balance holds all their gas at their fee caps. Funded now, the payer
		// would be sent gas money for a second approval that the first makes needless, and that the node may
		// refuse all the same (the money-invariant run: a payer funded twice, for one approval mined). Once they
		// mined, the payment is settled with the allowance the first set, or its approval checked afresh.
		if use == fundsVerify || use == fundsHold {
			return refuse(x402.ReasonERC20ApprovalTxWrongNonce, "the payer %s has %d transaction(s) pending (its mined nonce is %d, %s's is %d): most likely an earlier approval of Permit2, whose allowance pays this payment once it mined; present the payment again then", p.payer.Hex(), next-mined, mined, ext, sa.tx.Nonce()), nil
		}
		return nil, fmt.Errorf("nothing was sent: %w: the payer %s has %d transaction(s) pending (its mined nonce is %d, its approval's %d), which spend from the balance its gas money is judged against; the payment is settled once they mined", errNodeNotAsked, p.payer.Hex(), next-mined, mined, sa.tx.Nonce())
	}
	if p.head != nil && p.head.BaseFee != nil {
		// The next block's base fee is at most an eighth above the head's.
		most := new(big.Int).Add(p.head.BaseFee, new(big.Int).Div(new(big.Int).Add(p.head.BaseFee, big.NewInt(7)), big.NewInt(8)))
		if sa.tx.GasFeeCap().Cmp(most) < 0 {
			return refuse(x402.ReasonERC20ApprovalTxFeesNotSponsored, "%s's fee cap %s wei per gas may not pay the next block's base fee (up to %s): it could wait in the pool while the settlement waits for it; sign it with current fees", ext, sa.tx.GasFeeCap(), most), nil
		}
		// The gas money is the approval's gas limit at its fee cap (what a node wants the payer's balance to hold
		// before it takes the transaction), so the fee cap is bounded by what the approval will pay: a payer
		// prices it as this engine prices its own transactions, twice the base fee and a tip, from a head it read
		// when it signed, which may be many blocks older than this one, the base fee falling by up to an eighth a
		// block since (on a chain sealing a block per transaction, by half in six); hence three times the highest
		// base fee of the last approvalBaseFeeLookback blocks and the next one at most, and a priority fee no
		// higher than the one this engine pays (approvalMinTipBound at least). Above it, the payer would keep the
		// rest.
		seen := p.recentBaseFee(ctx, most)
		bound, err := p.approvalFeeBound(ctx, seen)
		if err != nil {
			return nil, err
		}
		if sa.tx.GasFeeCap().Cmp(bound) > 0 {
			return refuse(x402.ReasonERC20ApprovalTxFeesNotSponsored, "%s's fee cap %s wei per gas is above %s, %d times the highest base fee of the last %d blocks and the next one (%s; %s wei at least) and a priority fee: the gas money is its gas limit at its fee cap, which must not be far more than the approval will pay; sign it with current fees (twice the base fee and the tip)",
				ext, sa.tx.GasFeeCap(), bound, approvalBaseFeeTimes, approvalBaseFeeLookback, seen, approvalBaseFeeSlack), nil
		}
	}
	code, err := n.backend.CodeAt(ctx, p.payer, nil)
	if err != nil {
		return nil, err
	}
	if len(code) > 0 {
		return refuse(x402.ReasonERC20ApprovalTxSignerMismatch, "the payer %s has code: a sponsored approval is an account's own transaction (approve Permit2 from the wallet, or pay by another method)", p.payer.Hex()), nil
	}
	balance, err := n.pendingBalance(ctx, p.payer)
	if err != nil {
		return nil, err
	}
	sa.funding = new(big.Int).Sub(sa.approvalCost(), balance)
	if sa.funding.Sign() < 0 {
		sa.funding.SetInt64(0)
	}
	return nil, nil
}

// approvalBaseFeeTimes is how many times the next block's base fee an approval's fee cap may carry, beside the tip
// (see checkApproval).
const approvalBaseFeeTimes = 3

// approvalBaseFeeLookback is how many blocks back the bound on an approval's fee cap looks for the highest base
// fee a payer could have priced it from (eth_feeHistory, one call; a node serving fewer answers fewer). Behind
// it, a payer that signed long ago against a base fee since fallen a lot is refused and signs again.
const approvalBaseFeeLookback = 1024

// feeHistoryReader is a backend that answers eth_feeHistory: go-ethereum's ethclient.Client, and Failover.
type feeHistoryReader interface {
	FeeHistory(ctx context.Context, blockCount uint64, lastBlock *big.Int, rewardPercentiles []float64) (*ethereum.FeeHistory, error)
}

// recentBaseFee is the highest base fee of the approvalBaseFeeLookback blocks up to p's head, and next (the most
// the next block's can be), whichever is higher: the base fee a payer that read the chain in that window could
// have priced its approval from. A node without eth_feeHistory, or that does not answer it, leaves next.
func (p *payment) recentBaseFee(ctx context.Context, next *big.Int) *big.Int {
	highest := new(big.Int).Set(next)
	r, ok := p.net.backend.(feeHistoryReader)
	if !ok || p.head == nil || p.head.Number == nil {
		return highest
	}
	h, err := r.FeeHistory(ctx, approvalBaseFeeLookback, p.head.Number, []float64{}) // no rewards (nil is sent as null, which nodes refuse)
	if err != nil {
		// The bound stays the next block's: stricter, it refuses more and never lets a payer keep more.
		return highest
	}
	for _, b := range h.BaseFee {
		if b != nil && b.Cmp(highest) > 0 {
			highest.Set(b)
		}
	}
	return highest
}

// approvalBaseFeeSlack is the least the base-fee part of that bound allows (0.01 gwei a gas): on a chain whose base
// fee is a few thousand wei (the dev chain after a quiet spell) the base fee halves while an honest payment waits to
// be presented again, and a fee cap signed at twice the older one passed three times the newer; what a payer keeps
// of the slack is at most the approval's gas limit times 0.01 gwei (1e12 wei at the default max_gas).
var approvalBaseFeeSlack = big.NewInt(10 * params.Wei * 1_000_000)

// approvalFeeBound is the highest fee cap a sponsored approval may carry on an EIP-1559 chain whose base fee was
// at most nextBase in the blocks a payer could have priced it from (recentBaseFee): approvalBaseFeeTimes that (approvalBaseFeeSlack at least), and the priority fee this
// engine pays its own transactions (no less than approvalMinTipBound).
func (p *payment) approvalFeeBound(ctx context.Context, nextBase *big.Int) (*big.Int, error) {
	tip := approvalMinTipBound
	q, err := p.net.sender.feeQuote(ctx)
	if err != nil {
		return nil, err
	}
	if q.tipCap != nil && q.tipCap.Cmp(tip) > 0 {
		tip = q.tipCap
	}
	return approvalFeeCapBound(nextBase, tip), nil
}

// approvalFeeCapBound is approvalFeeBound's arithmetic: max(approvalBaseFeeTimes x nextBase, approvalBaseFeeSlack)
// plus tip.
func approvalFeeCapBound(nextBase, tip *big.Int) *big.Int {
	base := new(big.Int).Mul(nextBase, big.NewInt(approvalBaseFeeTimes))
	if base.Cmp(approvalBaseFeeSlack) < 0 {
		base.Set(approvalBaseFeeSlack)
	}
	return base.Add(base, tip)
}

// simulator is a backend that runs eth_simulateV1: go-ethereum's ethclient.Client, and Failover over them.
type simulator interface {
	SimulateV1(ctx context.Context, opts ethclient.SimulateOptions, block *rpc.BlockNumberOrHash) ([]ethclient.SimulateBlockResult, error)
}

// simulateApproval runs, in one eth_simulateV1 of the next block, the payer's approval (from the payer, with its
// gas and fees, the payer's balance raised by the funding) and then the settlement call as it will be sent. A
// refusal when either would fail on chain, an error when the node could not be asked.
func (p *payment) simulateApproval(ctx context.Context, settle contractCall) (*refusal, error) {
	x, err := p.execution(ctx)
	if err != nil {
		return nil, err
	}
	return p.simulateApprovalAs(ctx, x, settle)
}

// checkApprovalBeforeSending simulates the payer's approval and the settlement after it again, on a head read now,
// right before the payer's gas money and its approval are sent. checkChain simulated them in the block after the
// head checkTime read, which the shared head read (HeadCacheTTL) and the wait for a wallet may leave several blocks
// behind: the payer may have moved its tokens or spent its Permit2 nonce since, and what goes out first is spent
// whatever the settlement then finds (it is simulated again on the latest state once the approval mined, which
// spends nothing more, but the gas money and the approval's gas are gone by then). A refusal sends nothing, and the
// caller lets the claim and the hold go as for any refusal; the error is a node that could not be asked.
//
// The payer is read again first, for what went out since the checks read it (another payment of the payer, carrying
// an approval of the same nonce, settled meanwhile at another gateway or beside this one: the money-invariant run
// saw the payer sent gas money a second time, and then this approval refused "nonce too low"): an allowance that
// pays the payment now makes the checks run again (errChecksAgain), which drop the approval and its gas money, and
// the settlement goes alone; otherwise checkApproval runs again, and says what gas money the payer still lacks, or
// that nothing may go yet. The head is read first, and the allowance at it; a head behind the block the deferred
// hold's funds were read at sends nothing.
func (p *payment) checkApprovalBeforeSending(ctx context.Context, settle contractCall) (*refusal, error) {
	n := p.net
	head, err := n.head.get(ctx, n.now, 0, n.readHead)
	if err != nil {
		return nil, fmt.Errorf("nothing was sent: %w: reading the head block: %w", errNodeNotAsked, err)
	}
	if c := p.pending; c != nil && c.hold != nil && head.Number.Uint64() < c.hold.readBlock {
		// The hold about to be written judges the other holds from a read at a newer block (another endpoint's):
		// what this node says of the payer now may miss what the hold takes as mined.
		return nil, fmt.Errorf("nothing was sent: %w: the node's head %s is behind block %d, where the payer's funds were read", errNodeNotAsked, head.Number, c.hold.readBlock)
	}
	allowance, err := n.callUintAt(ctx, head.Number, p.asset.Address, contracts.StableCoinABI, "allowance", p.payer, n.permit2)
	if err != nil {
		return nil, fmt.Errorf("nothing was sent: %w: reading the payer's Permit2 allowance: %w", errNodeNotAsked, err)
	}
	if allowance.Cmp(p.amount) >= 0 {
		// The settlement goes alone: its checks run again, which drop the approval when they read the allowance
		// too, and hold what it moves as any plain permit2 payment's, from a funds read made afresh (the one kept
		// shows the allowance before the approval).
		n.funds.forgetRead(p)
		return nil, errChecksAgain
	}
	if ref, err := p.checkApproval(ctx, fundsSettle); err != nil {
		if errors.Is(err, errNodeNotAsked) {
			return nil, err
		}
		return nil, fmt.Errorf("nothing was sent: %w: reading the payer's account: %w", errNodeNotAsked, err)
	} else if ref != nil {
		return ref, nil
	}
	ref, err := p.simulateApprovalAs(ctx, newExecution(p.exec.from, p.exec.quote, head, n.mineTime(head).earliest), settle)
	if err != nil {
		return nil, fmt.Errorf("nothing was sent: %w: simulating the payer's approval and the settlement: %w", errNodeNotAsked, err)
	}
	return ref, nil
}

// errChecksAgain: what a settlement's checks found has changed before anything was signed (the payer's allowance
// pays it now, without the approval it carries), and they run again; nothing was sent.
var errChecksAgain = errors.New("nothing was sent: the payment's checks run again")

// simulateApprovalAs is simulateApproval with the settlement run as x says.
func (p *payment) simulateApprovalAs(ctx context.Context, x *execution, settle contractCall) (*refusal, error) {
	n, sa := p.net, p.approval
	sim, ok := n.backend.(simulator)
	if !ok {
		return refuse(x402.ReasonPermit2SimulationFailed, "the node of %s does not run eth_simulateV1, which checking a sponsored approval with its settlement needs", n.caip2), nil
	}
	approve := ethereum.CallMsg{From: p.payer, To: sa.tx.To(), Data: sa.tx.Data(), Gas: sa.tx.Gas()}
	if sa.tx.Type() == types.LegacyTxType {
		approve.GasPrice = sa.tx.GasPrice()
	} else {
		approve.GasFeeCap, approve.GasTipCap = sa.tx.GasFeeCap(), sa.tx.GasTipCap()
	}
	block := ethclient.SimulateBlock{Calls: []ethereum.CallMsg{approve, x.callMsg(&settle.To, settle.Data, settle.Gas, false)}}
	if x.block != nil {
		block.BlockOverrides = x.block
	}
	if sa.funding.Sign() > 0 {
		balance, err := n.backend.BalanceAt(ctx, p.payer, nil)
		if err != nil {
			return nil, err
		}
		block.StateOverrides = map[common.Address]ethereum.OverrideAccount{p.payer: {Balance: new(big.Int).Add(balance, sa.funding)}}
	}
	// On the head the block overrides follow (their number is the head's plus one), not on "latest": a block
	// sealed since the head was read would make the overrides name a block before the base, which the node
	// refuses ("block numbers must be in order").
	base := rpc.BlockNumberOrHashWithNumber(rpc.LatestBlockNumber)
	if x.block != nil && x.block.Number != nil && x.block.Number.Sign() > 0 {
		base = rpc.BlockNumberOrHashWithNumber(rpc.BlockNumber(new(big.Int).Sub(x.block.Number, big.NewInt(1)).Int64()))
	}
	res, err := sim.SimulateV1(ctx, ethclient.SimulateOptions{BlockStateCalls: []ethclient.SimulateBlock{block}}, &base)
	if err != nil {
		if failsOnChain(err) {
			return refuse(x402.ReasonPermit2SimulationFailed, "simulating the approval and the settlement failed: %s", revertReason(err)), nil
		}
		return nil, err
	}
	if len(res) != 1 || len(res[0].Calls) != 2 {
		return nil, fmt.Errorf("eth_simulateV1 answered %d blocks for 1 (or not 2 calls)", len(res))
	}
	a, s := res[0].Calls[0], res[0].Calls[1]
	if a.Status != types.ReceiptStatusSuccessful || (len(a.ReturnValue) >= 32 && new(big.Int).SetBytes(a.ReturnValue[:32]).Sign() == 0) {
		return refuse(x402.ReasonERC20ApprovalTxFailed, "simulating the payer's approval failed: %s", simError(a)), nil
	}
	if s.Status != types.ReceiptStatusSuccessful {
		return refuse(x402.ReasonPermit2SimulationFailed, "simulating the settlement call after the payer's approval failed: %s (run as it will be sent: from %s, with its fees and its gas limit of %d, in the next block)",
			simError(s), x.from.Hex(), settle.Gas), nil
	}
	return nil, nil
}

// simError says why a simulated call failed.
func simError(r ethclient.SimulateCallResult) string {
	if r.Error != nil && r.Error.Message != "" {
		return r.Error.Message
	}
	if len(r.ReturnValue) >= 32 {
		return "approve returned false"
	}
	return fmt.Sprintf("reverted (0x%x)", r.ReturnValue)
}

// approvalCalls are the calls a settlement with a sponsored approval sends before its own: the payer's funding
// (when it lacks gas money) from the settlement wallet, then the payer's approval.
func (p *payment) approvalCalls() []contractCall {
	sa := p.approval
	var calls []contractCall
	if sa.funding.Sign() > 0 {
		calls = append(calls, contractCall{To: p.payer, Value: new(big.Int).Set(sa.funding), Gas: params.TxGas})
	}
	return append(calls, contractCall{Signed: sa.tx})
}

// counted adds to the network's count of approval funding what the calls sent.
func (t *approvalTerms) counted(calls []contractCall, txs []*types.Transaction) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, c := range calls {
		if i < len(txs) && c.Signed == nil && c.Value != nil {
			t.funded.Add(t.funded, c.Value)
		}
	}
}

// fundingIn is the gas money among calls that went out (txs): what a payer was sent for its approval's gas.
func fundingIn(calls []contractCall, txs []*types.Transaction) *big.Int {
	sum := new(big.Int)
	for i, c := range calls {
		if i < len(txs) && c.Signed == nil && c.Value != nil {
			sum.Add(sum, c.Value)
		}
	}
	return sum
}

// SimulateV1 runs eth_simulateV1 on the first endpoint that answers.
func (f *Failover) SimulateV1(ctx context.Context, opts ethclient.SimulateOptions, block *rpc.BlockNumberOrHash) ([]ethclient.SimulateBlockResult, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) ([]ethclient.SimulateBlockResult, error) {
		s, ok := b.(simulator)
		if !ok {
			return nil, errors.New("the node does not run eth_simulateV1")
		}
		return s.SimulateV1(ctx, opts, block)
	})
}

// FeeHistory runs eth_feeHistory on the first endpoint that answers.
func (f *Failover) FeeHistory(ctx context.Context, blockCount uint64, lastBlock *big.Int, rewardPercentiles []float64) (*ethereum.FeeHistory, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*ethereum.FeeHistory, error) {
		r, ok := b.(feeHistoryReader)
		if !ok {
			return nil, errors.New("the node does not answer eth_feeHistory")
		}
		return r.FeeHistory(ctx, blockCount, lastBlock, rewardPercentiles)
	})
}

// PendingBalanceAt reads an account's balance with the pending transactions applied, on the first endpoint that
// answers (the latest balance where an endpoint cannot).
func (f *Failover) PendingBalanceAt(ctx context.Context, account common.Address) (*big.Int, error) {
	return do(ctx, f, func(ctx context.Context, b Backend) (*big.Int, error) {
		if r, ok := b.(pendingBalanceReader); ok {
			return r.PendingBalanceAt(ctx, account)
		}
		return b.BalanceAt(ctx, account, nil)
	})
}
