package chain

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/rpc"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// deadlineMargin is how long a signed authorization must stay valid after the earliest time the settlement can
// be mined at (see checkTime): settlement needs a block or two, and a permit that expires in flight costs gas
// for nothing.
const deadlineMargin = 6

// refusal is a payment the facilitator will not settle: a reason code from x402 and a message a person can act on.
type refusal struct {
	reason  string
	message string
}

func (r *refusal) Error() string { return r.reason + ": " + r.message }

func refuse(reason, format string, args ...any) *refusal {
	return &refusal{reason: reason, message: fmt.Sprintf(format, args...)}
}

// payment is a request whose form, terms and signature have been checked: everything the chain checks and the
// settlement need, parsed once.
type payment struct {
	net    *network
	asset  *asset
	scheme string // x402.SchemeExact or x402.SchemeUpto
	method string
	payer  common.Address
	// amount is what the payment moves: the required amount, which an exact payment signs exactly; for an upto
	// payment, the permitted maximum when verifying and the amount to settle (0 up to it) when settling.
	amount *big.Int
	payTo  common.Address
	sig    Signature // an EOA's signature, parsed; zero for a contract wallet's
	// sigBytes is the signature as the settlement contracts take it: the EOA's 65 bytes, or a contract
	// wallet's signature (unwrapped from ERC-6492).
	sigBytes []byte
	// contractSig says the signature is left to the chain: the payer may be a contract wallet (ERC-1271) or
	// one to be deployed (ERC-6492, wallet set). sigReason is the refusal reason of a bad one, and eoaRefusal
	// the refusal to give when the payer turns out to have no code (an EOA whose signature did not recover).
	contractSig bool
	sigReason   string
	eoaRefusal  *refusal
	wallet      *counterfactual
	// undeployed says the payer's wallet has no code yet: the settlement deploys it through wallet.factory
	// first, and chain checks run where it exists (DeployThenCall).
	undeployed bool
	nonce      *big.Int
	permit     Permit                // erc2612
	p2         permit2Transfer       // permit2
	auth       transferAuthorization // eip3009
	sponsor    *sponsorPermit        // permit2 with eip2612GasSponsoring; nil when absent or unneeded (the approval covers)
	// approval is a permit2 payment's erc20ApprovalGasSponsoring approval, on a network that takes it; nil when
	// absent, unneeded (the allowance covers), or a gas-sponsoring permit came too (the permit is applied).
	approval *sponsorApproval
	id       journal.ID
	// claim is the payment's journal record as this settlement claimed it (or, settling it again, as
	// reconciliation read it): its writes go to that claim only, never to a claim made since by another.
	claim journal.Record
	// pending is this settlement's claim of the payment while it is not written yet: it goes in the batch of the
	// payment's funds hold (see claimWithHold); nil when the claim was written first, or p is not settled here.
	pending *pendingClaim
	// unsentReleased says the journal forgot this settlement's signed transaction, which was not sent, and, with
	// shared holds, let go of its funds hold with it (releaseUnsent): nothing of it is left in the journal to end,
	// and a claim or shared hold of the payment there now is another settlement's.
	unsentReleased bool
	digest         common.Hash   // what the payer signed
	head           *types.Header // the head block checkTime read chain time from; nil when it could not be read
	// mineAt is the earliest timestamp of the block the settlement can land in (see checkTime).
	mineAt uint64
	// exec is how the settlement transaction runs, which every eth_call standing for it runs as (see execution).
	exec *execution
	// maxTimeout is the requirements' maxTimeoutSeconds: the deadline may lie no further beyond chain time.
	maxTimeout int64
	// permitApplied (erc2612) says a permit transaction of this very settlement mined: the permit nonce it spent
	// is no reason to refuse, and the allowance it granted is what the settlement's transferFrom uses.
	permitApplied bool
	// deposit is a batch-settlement deposit's escrow call and channel (batch_deposit_settle.go); nil for a payment
	// of exact or upto. Its transfer is the payer's ERC-3009 ReceiveWithAuthorization to the deposit collector.
	deposit *batchDeposit
	// request is what the journal keeps as the payment's Request, when not its x402.SettleRequest (a deposit's
	// x402.BatchRequest): reconciliation reads it back with parseRecorded.
	request []byte
}

// deadline is the last moment the payment can be settled (Permit2 deadline, erc2612 and eip3009 validBefore),
// as a time; one past what a time holds reads as the latest time there is.
func (p *payment) deadline() time.Time {
	d := p.deadlineValue()
	if d == nil || !d.IsInt64() || d.Int64() > maxUnixSeconds {
		return time.Unix(maxUnixSeconds, 0).UTC()
	}
	return time.Unix(d.Int64(), 0).UTC()
}

// deadlineValue is the signed deadline of the payment's transfer method, as signed.
func (p *payment) deadlineValue() *big.Int {
	switch p.method {
	case x402.TransferPermit2:
		return p.p2.Deadline
	case x402.TransferEIP3009:
		return p.auth.ValidBefore
	}
	return p.permit.Deadline
}

// maxUnixSeconds is the latest deadline kept as it is: the year 2262, where nanoseconds since 1970 end.
const maxUnixSeconds = math.MaxInt64 / int64(time.Second)

// fundsUse says what a chain check does with the payer's funds (see funds).
type fundsUse int

const (
	fundsVerify fundsUse = iota // count what is held against the payer; hold nothing
	fundsHold                   // count, and hold a valid payment (a gate serves it before settling)
	fundsSettle                 // count, and hold the payment being sent
)

// tracksFunds reports whether the payment's funds are tracked: whatever its transfer method, once chain time is
// known. Neither the method nor a sponsor permit changes whether a payment is held, only what it counts against
// (see payment.fundsLimit): otherwise choosing one would let a payer skip the holds.
func (p *payment) tracksFunds() bool { return p.head != nil }

// same reports whether q is the same payment as p: same signed message, same recipient, same amount. Two
// payloads can share a journal id (payer and nonce) and still differ; only the same payment may share an answer.
// For upto the amount is the one settled: the same signature settled for another amount is another payment,
// and the first settlement of it is the only one.
func (p *payment) same(q *payment) bool {
	return p.id == q.id && p.digest == q.digest && p.payTo == q.payTo && p.amount.Cmp(q.amount) == 0 && p.scheme == q.scheme
}

// upto reports whether p is an upto payment.
func (p *payment) upto() bool { return p.scheme == x402.SchemeUpto }

// sponsorPermit is the payer's EIP-2612 permit to Permit2 from the eip2612GasSponsoring extension.
type sponsorPermit struct {
	permit Permit
	token  common.Address
	sig    Signature
	err    *refusal // the extension came but is not usable; reported only if the allowance is missing
}

// Verify checks a payment in the order of x402-wire-facts section 5, cheap checks first, then chain reads and a
// simulation of the exact settlement call. One step moves forward: the signature, which needs neither chain nor
// clock, is checked before the time window, so that a payload proves its payer before anything reads the chain
// or claims the settlement journal in its name. A refused payment is a VerifyResponse with IsValid false; an
// error means the chain could not be asked.
//
// A permit2 payment of a payer whose funds were read within the network's FundsCacheTTL, and that this engine
// has no record of, is answered from that read less the payments held against the payer (see funds), without a
// chain call; with a gas-sponsoring permit, only when the payer's approval covers it without the permit. Its
// settlement still simulates the exact call before anything is sent.
func (f *Facilitator) Verify(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	resp, err := f.verify(ctx, req, fundsVerify)
	journal.WhenMarked(ctx, func() { f.noteVerify(req, resp, err) })
	return resp, err
}

// VerifyAndHold verifies like Verify and, when the payment is valid, holds its amount against the payer's funds
// until its settlement is seen mined, fails, or the payment's deadline passes: later verifications then count
// it as spent. It is for a gate that serves before it settles (settle async), which must not serve a payer more
// than the payer can pay while the settlements wait their turn. A payment that will not be settled after all
// must be let go with Release.
//
// An upto payment is held at its maximum; its settlement holds only the amount settled (see broadcast), and a
// settlement of zero lets the hold go.
func (f *Facilitator) VerifyAndHold(ctx context.Context, req x402.VerifyRequest) (x402.VerifyResponse, error) {
	resp, err := f.verify(ctx, req, fundsHold)
	journal.WhenMarked(ctx, func() { f.noteVerify(req, resp, err) })
	return resp, err
}

// Release lets go of the hold VerifyAndHold placed on a payment that is not going to be settled: its upstream
// failed, or its gate gave up settling it. req may name the amount to settle instead of an upto maximum. An
// error says the shared holds' database did not take it: the hold stays until its deadline unless the caller
// lets it go again later, when it knows no later presentation of the payment took the hold over (see
// gate.Ledger's leftovers).
func (f *Facilitator) Release(req x402.VerifyRequest) error {
	if p, ref := f.parse(req, true); ref == nil {
		if err := p.net.funds.let(p.id); err != nil {
			return fmt.Errorf("releasing the funds hold of %s: %w", p.id, err)
		}
	}
	return nil
}

// HoldServed holds a payment a gate served before settling it, and has not settled yet, against the payer's
// funds, without verifying it again: for the payments a previous process served, which must count against their
// payers from the start, before any new payment of theirs is verified. It asks nothing of the chain. A payment
// whose settlement this engine's journal holds as final is not held (it settled, or was refused for good); one
// that does not parse is left to its settlement, which reports it. req names the amount to settle (an upto
// payment's charge), which is what is held.
func (f *Facilitator) HoldServed(ctx context.Context, req x402.SettleRequest) error {
	p, ref := f.parse(req, true)
	if ref != nil || p.net.funds.shared != nil {
		return nil // shared holds live in the journal: a served payment's outlives the process that took it
	}
	rec, known, err := f.journal.Get(ctx, p.id)
	if err != nil {
		return fmt.Errorf("holding a served payment: settlement journal: %w", err)
	}
	if known && rec.State == journal.StateFinal {
		return nil
	}
	p.net.funds.holdServed(p)
	return nil
}

func (f *Facilitator) verify(ctx context.Context, req x402.VerifyRequest, use fundsUse) (x402.VerifyResponse, error) {
	p, ref := f.parse(req, false)
	return f.verifyParsed(ctx, p, ref, x402.ClaimedPayer(req), use)
}

// verifyParsed verifies a parsed payment p (or answers the refusal ref of its parse): the payer it claims to be
// is answered when the payload was refused before its payer was read.
func (f *Facilitator) verifyParsed(ctx context.Context, p *payment, ref *refusal, claimedPayer string, use fundsUse) (x402.VerifyResponse, error) {
	if ref == nil {
		ref = p.net.terms.check(p)
	}
	if ref == nil {
		ref = p.net.penalties.refuse(p)
	}
	if ref == nil {
		ref = p.checkSender()
	}
	if ref == nil {
		var err error
		if ref, err = p.checkTime(ctx); err != nil {
			return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: err}
		}
	}
	if ref == nil {
		var err error
		if ref, err = p.checkWallet(ctx); err != nil {
			return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: err}
		}
	}
	if ref == nil && !f.fromFunds(ctx, p, use) {
		if journal.NotMarked(ctx) {
			// The gate's in-flight mark, carried by the funds read, says the payment is another request's or
			// presented again: the gate answers it from its record, and nothing is asked of the chain for it.
			return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: journal.ErrNotMarked}
		}
		var err error
		if ref, err = p.checkChain(ctx, use); err != nil {
			return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: err}
		}
		if ref == nil && use == fundsHold && p.approval != nil && p.approval.err == nil {
			if ref, err = p.approvalHeldAlone(ctx); err != nil {
				return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: err}
			}
		}
	}
	if ref == nil {
		var err error
		if ref, err = p.bound(use); err != nil {
			return x402.VerifyResponse{}, &x402.FacilitatorError{Op: "verify", Kind: x402.FailureUnreachable, Err: err}
		}
	}
	payer := claimedPayer
	if p != nil && p.payer != (common.Address{}) {
		// A payload refused before its payer was read leaves p.payer zero: that is no payer.
		payer = p.payer.Hex()
	}
	if ref != nil {
		return x402.VerifyResponse{IsValid: false, Payer: payer, InvalidReason: ref.reason, InvalidMessage: ref.message}, nil
	}
	return x402.VerifyResponse{IsValid: true, Payer: payer}, nil
}

// approvalHeldAlone looks, once p is held for a gate to serve, for another payment held with the same sponsored
// approval (the payer's account nonce: funds.permitNonce); there is one, p's hold goes and p is refused as
// permitInFlight. The checks look for one before they hold p, but two payments checked at once (concurrent first
// payments of a payer, each carrying its approval, at two gateways) both find none, both are held and served, and
// both settlements, each seeing no gas money on its way to the payer, fund it: the payer is paid for one approval
// twice. Looked for after p's hold is written, one of the two sees the other's: each hold is written before its
// look, so the later look sees the earlier hold. Both may see each other and both be refused; nothing was
// served, and the payer presents one again.
func (p *payment) approvalHeldAlone(ctx context.Context) (*refusal, error) {
	held, err := p.net.funds.permitInUse(ctx, p)
	if err != nil {
		if lerr := p.net.funds.let(p.id); lerr != nil {
			return nil, fmt.Errorf("%w (and letting go of the payment's hold: %v)", err, lerr)
		}
		return nil, err
	}
	if !held {
		return nil, nil
	}
	if err := p.net.funds.let(p.id); err != nil {
		return nil, fmt.Errorf("letting go of the hold of a payment whose approval another payment carries: %w", err)
	}
	return p.permitInFlight(fundsHold)
}

// bound notes that valid payment p was verified against the settlement wallet it names, if it names one, so that
// the wallet's lease is kept for its settlement (see walletPool.bind). A lease that went while p was checked (given
// up, or lost) refuses p as checkSender would have, letting go of the hold p got (use fundsHold).
func (p *payment) bound(use fundsUse) (*refusal, error) {
	named := p.namedSender()
	if named == nil || p.net.pool.bind(*named) {
		return nil, nil
	}
	if use == fundsHold {
		if err := p.net.funds.let(p.id); err != nil {
			return nil, fmt.Errorf("letting go of the hold of a payment whose settlement wallet's lease went: %w", err)
		}
	}
	return p.checkSender(), nil
}

// checkSender refuses a payment whose settlement this process cannot send now: one bound to a settlement wallet
// whose lease another process sharing the journal holds (the lease moved since the 402 named it, or the 402 came
// from another gateway). A payment any wallet may settle is not refused for want of one here, even while this
// process holds none: its settlement is handed to an instance that has one (see handoff.go). A gate verifies before it
// runs the upstream and before it serves: refused here, the payer is charged nothing, nothing is served unpaid,
// and the 402 that says why offers the wallets this process sends from. A payment it accepts keeps its wallet's
// lease from being given up for a while (bindingGrace), so that it can still be settled from it: that is noted once
// it is found valid (bound, at the end of verifyParsed), not here, before the checks that may refuse it.
func (p *payment) checkSender() *refusal {
	pool := p.net.pool
	named := p.namedSender()
	if named != nil && !pool.leasedHere(*named) {
		what, reason := "permit2Authorization.witness.facilitator", x402.ReasonUptoFacilitatorMismatch
		if !p.upto() {
			what, reason = "authorization.to (the permit's spender)", x402.ReasonRecipientMismatch
		}
		return refuse(reason, "%s is %s, a settlement wallet this facilitator instance does not send from now (another instance sharing its journal holds it: its lease moved since it was offered, or another instance offered it); only that wallet can settle the payment: sign it again naming one of %s",
			what, named.Hex(), offeredText(pool.offers()))
	}
	return nil
}

// offeredText names the wallets offers may name, for a refusal.
func offeredText(ws []common.Address) string {
	if len(ws) == 0 {
		return "none right now: this instance holds no wallet's lease, try again in a few seconds"
	}
	return strings.Join(hexAddrs(ws), ", ")
}

// fromFunds answers the chain checks of a payment from the payer's last fresh read, when it covers the payment
// beside everything held against the payer (and holds it too, for fundsHold). A payment the journal knows was
// presented before is left to the chain, which alone can say whether its nonce is spent.
func (f *Facilitator) fromFunds(ctx context.Context, p *payment, use fundsUse) bool {
	// Only permit2: its nonce is one storage read of the canonical Permit2. An eip3009 nonce lives where each
	// token keeps it, and asking authorizationState costs the call the simulation would.
	if p.method != x402.TransferPermit2 || !p.tracksFunds() || p.net.funds.ttl <= 0 || p.deposit != nil {
		// A deposit's escrow call checks more than the payer's funds (the channel): only its simulation vouches.
		return false
	}
	if p.contractSig {
		// A contract wallet's consent can depend on how its settlement runs (the gas price, the sender, the
		// block): only the simulation of that settlement can vouch for it, never a read of its funds.
		return false
	}
	// A read answers for a sponsored payment only as for an unsponsored one: when the approval it shows covers
	// the payment, the permit is not applied (see checkChain). Whether the permit would apply, the chain says.
	sponsor, approval := p.sponsor, p.approval
	p.sponsor, p.approval = nil, nil
	ok, err := f.coveredUnrecorded(ctx, p, use)
	if err != nil {
		ok = false // the full checks ask again, and report the journal's failure
	}
	if ok {
		// The read knows the payer's funds, not its nonces: a nonce spent elsewhere (the payer's own
		// invalidateUnorderedNonces, another facilitator, a settlement whose record was pruned) is asked of the
		// chain every time, one call. Spent, or not known, the full checks below name the reason.
		if used, err := p.permit2NonceUsed(ctx); err != nil || used {
			if use == fundsHold {
				p.net.funds.let(p.id)
			}
			ok = false
		}
	}
	if !ok {
		p.sponsor, p.approval = sponsor, approval
	}
	return ok
}

// coveredUnrecorded is funds.check of p, when the journal holds no record of it (false when it does): with shared
// holds, the journal reads the record with the holds (funds.checkUnrecorded).
func (f *Facilitator) coveredUnrecorded(ctx context.Context, p *payment, use fundsUse) (bool, error) {
	if p.net.funds.shared != nil {
		return p.net.funds.checkUnrecorded(ctx, p, p.head.Time, use)
	}
	if _, known, err := f.journal.Get(ctx, p.id); err != nil || known {
		return false, err
	}
	ok, _, _, err := p.net.funds.check(ctx, p, p.head.Time, nil, use)
	return ok, err
}

// permit2NonceSlot is the storage slot of Permit2's nonceBitmap[owner][word]: the mapping is Permit2's first
// state variable (slot 0), in Uniswap's contract as in ours.
func permit2NonceSlot(owner common.Address, word *big.Int) common.Hash {
	inner := crypto.Keccak256(common.LeftPadBytes(owner.Bytes(), 32), make([]byte, 32))
	return common.BytesToHash(crypto.Keccak256(common.LeftPadBytes(word.Bytes(), 32), inner))
}

// permit2NonceUsed reads whether the payment's Permit2 nonce is spent: one bit of the payer's nonce bitmap.
func (p *payment) permit2NonceUsed(ctx context.Context) (bool, error) {
	word := new(big.Int).Rsh(p.nonce, 8)
	raw, err := p.net.reads.storageAt(ctx, p.net.permit2, permit2NonceSlot(p.payer, word))
	bitmap := new(big.Int).SetBytes(raw)
	if errors.Is(err, errNoBatch) {
		// A backend that reads no storage: the contract's getter.
		bitmap, err = p.net.callUint(ctx, p.net.permit2, contracts.Permit2ABI, "nonceBitmap", p.payer, word)
	}
	if err != nil {
		return false, err
	}
	return permit2NonceBit(bitmap, p.nonce), nil
}

// permit2NonceBit is nonce's bit in its word of a Permit2 nonce bitmap: set, the nonce is spent.
func permit2NonceBit(bitmap, nonce *big.Int) bool {
	return bitmap.Bit(int(new(big.Int).And(nonce, big.NewInt(0xff)).Int64())) == 1
}

// parse runs every check that needs neither the chain nor the clock: version, scheme, network, requirements,
// payload shape, recipient, spender, amount, asset and signature. settling says the request is a settlement's:
// an upto requirement's amount is then the amount to settle, from 0 up to the permitted maximum, where a
// verification's must be the maximum itself.
func (f *Facilitator) parse(req x402.VerifyRequest, settling bool) (*payment, *refusal) {
	pp, rq := req.PaymentPayload, req.PaymentRequirements
	if req.X402Version != x402.Version1 && req.X402Version != x402.Version2 {
		return nil, refuse(x402.ReasonInvalidX402Version, "x402Version %d is not supported; want 1 or 2", req.X402Version)
	}
	if pp.X402Version != req.X402Version {
		return nil, refuse(x402.ReasonInvalidX402Version, "paymentPayload.x402Version is %d but the request's x402Version is %d", pp.X402Version, req.X402Version)
	}
	if !x402.IsScheme(rq.Scheme) {
		return nil, refuse(x402.ReasonUnsupportedScheme, "scheme %q is not supported; want %q or %q", rq.Scheme, x402.SchemeExact, x402.SchemeUpto)
	}
	if pp.Accepted.Scheme != rq.Scheme {
		return nil, refuse(x402.ReasonInvalidScheme, "the payment is for scheme %q but the requirements ask for %q", pp.Accepted.Scheme, rq.Scheme)
	}
	n := f.networks[rq.Network]
	if n == nil {
		return nil, refuse(x402.ReasonInvalidNetwork, "network %q is not served by this facilitator (it serves %s)", rq.Network, strings.Join(f.order, ", "))
	}
	if pp.Accepted.Network != rq.Network {
		return nil, refuse(x402.ReasonInvalidNetwork, "the payment is for network %q but the requirements ask for %q", pp.Accepted.Network, rq.Network)
	}
	p := &payment{net: n, scheme: rq.Scheme}
	var err error
	tokenAddr, err := ParseAddress("paymentRequirements.asset", rq.Asset)
	if err != nil {
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	if p.asset = n.assets[tokenAddr]; p.asset == nil {
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "asset %s is not accepted on %s", rq.Asset, n.caip2)
	}
	if p.payTo, err = ParseAddress("paymentRequirements.payTo", rq.PayTo); err != nil {
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "%v", err)
	}
	if p.payTo == (common.Address{}) {
		// Tokens refuse transfers to the zero address; an erc2612 permit would be spent for nothing.
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "paymentRequirements.payTo is the zero address; payments need a recipient")
	}
	// An upto settlement may charge nothing: the resource server found the request used nothing.
	zeroOK := settling && p.upto()
	if p.amount, err = x402.ParseUint256(rq.Amount); err != nil || (p.amount.Sign() == 0 && !zeroOK) {
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "paymentRequirements.amount must be a positive decimal number of raw token units, got %q", rq.Amount)
	}
	if rq.MaxTimeoutSeconds <= 0 {
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "paymentRequirements.maxTimeoutSeconds must be a positive number of seconds, got %d", rq.MaxTimeoutSeconds)
	}
	p.maxTimeout = rq.MaxTimeoutSeconds

	p.method = x402.TransferMethod(rq, pp.Payload)
	switch {
	case !x402.IsTransferMethod(p.method):
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "assetTransferMethod %q is not supported; want %q, %q or %q", p.method, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	case p.upto() && p.method != x402.TransferPermit2:
		// Only a Permit2 witness can bind the facilitator that chooses the amount: a permit or an EIP-3009
		// authorization signs one exact value.
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "the upto scheme is paid by permit2 only, but assetTransferMethod is %q", p.method)
	case !n.methods[p.method]:
		return nil, refuse(x402.ReasonInvalidPaymentRequirements, "this facilitator does not settle %s payments on %s", p.method, n.caip2)
	case p.method == x402.TransferPermit2 && req.X402Version != x402.Version2:
		return nil, refuse(x402.ReasonInvalidX402Version, "permit2 payments need x402Version 2, got %d", req.X402Version)
	}
	var sigErr error
	p.sig, sigErr = ParseSignature(pp.Payload.Signature)
	switch p.method {
	case x402.TransferPermit2:
		return p, p.parsePermit2(pp, sigErr, settling)
	case x402.TransferEIP3009:
		return p, p.parseEIP3009(pp, rq, sigErr)
	}
	if sigErr != nil {
		return nil, refuse(x402.ReasonInvalidPayload, "payload.signature: %v", sigErr)
	}
	return p, p.parseERC2612(pp)
}

func (p *payment) parseERC2612(pp x402.PaymentPayload) *refusal {
	a := pp.Payload.Authorization
	if a == nil {
		if pp.Payload.Permit2Authorization != nil {
			return refuse(x402.ReasonInvalidPayload, "the requirements ask for an erc2612 permit but the payload carries a permit2Authorization")
		}
		return refuse(x402.ReasonInvalidPayload, "payload.authorization is missing; an erc2612 payment carries the signed EIP-2612 permit there")
	}
	if looksLikeEIP3009(a) {
		return refuse(x402.ReasonInvalidPayload, "this is an EIP-3009 transferWithAuthorization (to = payTo, 32-byte hex nonce), but the requirement asks for an EIP-2612 permit whose spender is one of the facilitator's settlement wallets (%s); choose the permit2 requirement or a client that supports erc2612", strings.Join(hexAddrs(p.net.pool.Addresses()), ", "))
	}
	permit, err := PermitFromAuthorization(a)
	if err != nil {
		return refuse(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	p.permit, p.payer, p.nonce = permit, permit.Owner, permit.Nonce
	if !p.net.pool.Has(permit.Spender) {
		return refuse(x402.ReasonRecipientMismatch, "authorization.to is %s, but an erc2612 permit must name one of this facilitator's settlement wallets as spender (%s)", permit.Spender.Hex(), strings.Join(hexAddrs(p.net.pool.Addresses()), ", "))
	}
	if permit.Value.Cmp(p.amount) != 0 {
		return refuse(x402.ReasonValueMismatch, "authorization.value is %s but the required amount is exactly %s", permit.Value, p.amount)
	}
	p.digest = PermitDigest(p.asset.domain, permit)
	got, err := RecoverSigner(p.digest, p.sig)
	if err != nil || got != p.payer {
		return refuse(x402.ReasonInvalidSignature, "the signature is not %s's EIP-2612 permit for %s (%s) on chain %s%s", p.payer.Hex(), p.asset.Address.Hex(), p.asset.Name, p.net.chainID, recoverDetail(got, err))
	}
	p.id = journal.PaymentID(p.net.caip2, p.method, p.asset.Address.Hex(), p.payer.Hex(), p.nonce.String())
	return nil
}

// parseEIP3009 reads an EIP-3009 TransferWithAuthorization. Its domain is the requirement's extra.name and
// extra.version, which the payer signed under; a requirement naming another domain than the token's configured
// one is refused here, as the token would refuse the signature.
func (p *payment) parseEIP3009(pp x402.PaymentPayload, rq x402.PaymentRequirements, sigErr error) *refusal {
	a := pp.Payload.Authorization
	if a == nil {
		if pp.Payload.Permit2Authorization != nil {
			return refuse(x402.ReasonInvalidPayload, "the requirements ask for an eip3009 payment but the payload carries a permit2Authorization")
		}
		return refuse(x402.ReasonInvalidPayload, "payload.authorization is missing; an eip3009 payment carries the signed EIP-3009 TransferWithAuthorization there")
	}
	if name := rq.Extra.Name; name != "" && name != p.asset.Name {
		return refuse(x402.ReasonEIP3009TokenNameMismatch, "paymentRequirements.extra.name is %q but the EIP-712 domain name of %s is %q", name, p.asset.Address.Hex(), p.asset.Name)
	}
	if version := rq.Extra.Version; version != "" && version != p.asset.Version {
		return refuse(x402.ReasonEIP3009TokenVersionMismatch, "paymentRequirements.extra.version is %q but the EIP-712 domain version of %s is %q", version, p.asset.Address.Hex(), p.asset.Version)
	}
	t, err := transferAuthorizationFromPayload(a)
	if err != nil {
		return refuse(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	p.auth, p.payer, p.nonce = t, t.From, new(big.Int).SetBytes(t.Nonce[:])
	if t.To != p.payTo {
		return refuse(x402.ReasonEIP3009RecipientMismatch, "authorization.to is %s but the requirements pay %s", t.To.Hex(), p.payTo.Hex())
	}
	if t.Value.Cmp(p.amount) != 0 {
		return refuse(x402.ReasonEIP3009AuthorizationValue, "authorization.value is %s but the required amount is exactly %s", t.Value, p.amount)
	}
	p.digest = transferAuthorizationDigest(p.asset.domain, t)
	if ref := p.verifySigner(pp.Payload.Signature, sigErr, x402.ReasonEIP3009InvalidSignature, true, func(got common.Address, err error) *refusal {
		return refuse(x402.ReasonEIP3009InvalidSignature, "the signature is not %s's EIP-3009 TransferWithAuthorization for %s (%s, version %s) on chain %s%s", p.payer.Hex(), p.asset.Address.Hex(), p.asset.Name, p.asset.Version, p.net.chainID, recoverDetail(got, err))
	}); ref != nil {
		return ref
	}
	p.id = journal.PaymentID(p.net.caip2, p.method, p.asset.Address.Hex(), p.payer.Hex(), t.Nonce.Hex())
	return nil
}

func (p *payment) parsePermit2(pp x402.PaymentPayload, sigErr error, settling bool) *refusal {
	a := pp.Payload.Permit2Authorization
	if a == nil {
		if pp.Payload.Authorization != nil {
			return refuse(x402.ReasonInvalidPayload, "the requirements ask for a permit2 payment but the payload carries an erc2612/EIP-3009 authorization")
		}
		return refuse(x402.ReasonInvalidPayload, "payload.permit2Authorization is missing; a permit2 payment carries the signed PermitWitnessTransferFrom there")
	}
	t, owner, err := permit2TransferFromPayload(a)
	if err != nil {
		return refuse(x402.ReasonInvalidPayload, "payload.%v", err)
	}
	p.p2, p.payer, p.nonce = t, owner, t.Nonce
	// The witness's facilitator is what tells the two schemes' signed messages apart; a payload of the one
	// presented as the other could only fail its signature check, which would not say why.
	switch hasFacilitator := a.Witness.Facilitator != ""; {
	case p.upto() && !hasFacilitator:
		return refuse(x402.ReasonInvalidPayload, "permit2Authorization.witness.facilitator is missing: an upto payment names the settlement wallet that alone may settle it (one of %s); this looks like an exact-scheme witness",
			strings.Join(hexAddrs(p.net.pool.Addresses()), ", "))
	case !p.upto() && hasFacilitator:
		return refuse(x402.ReasonInvalidPayload, "permit2Authorization.witness.facilitator is set: that is an upto witness, but the requirements ask for the %s scheme, whose witness is (to, validAfter)", p.scheme)
	}
	if t.To != p.payTo {
		return refuse(x402.ReasonPermit2RecipientMismatch, "permit2Authorization.witness.to is %s but the requirements pay %s", t.To.Hex(), p.payTo.Hex())
	}
	proxy, proxyName := p.net.proxy, "x402 Permit2 proxy"
	if p.upto() {
		proxy, proxyName = p.net.uptoProxy, "x402 upto Permit2 proxy"
	}
	if t.Spender != proxy {
		return refuse(x402.ReasonPermit2InvalidSpender, "permit2Authorization.spender is %s; it must be the %s %s", t.Spender.Hex(), proxyName, proxy.Hex())
	}
	if p.upto() && !p.net.pool.Has(t.Facilitator) {
		return refuse(x402.ReasonUptoFacilitatorMismatch, "permit2Authorization.witness.facilitator is %s, which is not a settlement wallet of this facilitator on %s (%s); the upto proxy takes the settlement from that address only",
			t.Facilitator.Hex(), p.net.caip2, strings.Join(hexAddrs(p.net.pool.Addresses()), ", "))
	}
	switch {
	case p.upto() && settling && p.amount.Cmp(t.Amount) > 0:
		return refuse(x402.ReasonUptoSettlementExceedsAmount, "the amount to settle, %s, is above the %s the payer permitted (permit2Authorization.permitted.amount)", p.amount, t.Amount)
	case p.upto() && settling:
	case t.Amount.Cmp(p.amount) != 0 && p.upto():
		return refuse(x402.ReasonPermit2AmountMismatch, "permit2Authorization.permitted.amount is %s but an upto payment is verified at its maximum, the required amount %s", t.Amount, p.amount)
	case t.Amount.Cmp(p.amount) != 0:
		return refuse(x402.ReasonPermit2AmountMismatch, "permit2Authorization.permitted.amount is %s but the required amount is exactly %s", t.Amount, p.amount)
	}
	if t.Token != p.asset.Address {
		return refuse(x402.ReasonPermit2TokenMismatch, "permit2Authorization.permitted.token is %s but the requirements ask for %s", t.Token.Hex(), p.asset.Address.Hex())
	}
	message := "Permit2 PermitWitnessTransferFrom"
	if p.upto() {
		p.digest, message = uptoDigest(p.net.p2dom, t), "Permit2 PermitWitnessTransferFrom with the upto witness (to, facilitator, validAfter)"
	} else {
		p.digest = permit2Digest(p.net.p2dom, t)
	}
	if ref := p.verifySigner(pp.Payload.Signature, sigErr, x402.ReasonPermit2InvalidSignature, true, func(got common.Address, err error) *refusal {
		return refuse(x402.ReasonPermit2InvalidSignature, "the signature is not %s's %s on chain %s%s", p.payer.Hex(), message, p.net.chainID, recoverDetail(got, err))
	}); ref != nil {
		return ref
	}
	if info, ok, err := pp.GasSponsoring(); ok {
		p.sponsor = p.parseSponsor(info, err)
	}
	if info, ok, err := pp.ApprovalSponsoring(); ok && p.sponsor == nil && p.net.approval != nil {
		p.approval = p.parseApproval(info, err)
	}
	// exact and upto payments share one id space: both spend the payer's Permit2 nonce, from the one bitmap of
	// the canonical Permit2 whichever proxy sends them, so one nonce is one payment. An upto payment settled for
	// zero leaves its nonce unspent on chain, and its record is then all that keeps the nonce from paying again
	// (under either scheme) until the payment's deadline.
	p.id = journal.PaymentID(p.net.caip2, p.method, p.asset.Address.Hex(), p.payer.Hex(), p.nonce.String())
	return nil
}

// parseSponsor reads the eip2612GasSponsoring extension's info (decodeErr: it did not decode). Its problems are
// kept, not returned: they matter only when the payer has not approved Permit2 already.
func (p *payment) parseSponsor(info *x402.EIP2612GasSponsoringInfo, decodeErr error) *sponsorPermit {
	sp := &sponsorPermit{}
	if decodeErr != nil {
		sp.err = refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "%v", decodeErr)
		return sp
	}
	permit, token, err := permitFromGasSponsoring(info)
	if err != nil {
		sp.err = refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "extensions.%v", err)
		return sp
	}
	if sp.sig, err = ParseSignature(info.Signature); err != nil {
		sp.err = refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "extensions.eip2612GasSponsoring.info.signature: %v", err)
		return sp
	}
	sp.permit, sp.token = permit, token
	switch {
	case permit.Owner != p.payer:
		sp.err = refuse(x402.ReasonEIP2612FromMismatch, "eip2612GasSponsoring.info.from is %s but the payer is %s", permit.Owner.Hex(), p.payer.Hex())
	case token != p.asset.Address:
		sp.err = refuse(x402.ReasonEIP2612AssetMismatch, "eip2612GasSponsoring.info.asset is %s but the payment is in %s", token.Hex(), p.asset.Address.Hex())
	case permit.Spender != p.net.permit2:
		sp.err = refuse(x402.ReasonEIP2612SpenderNotPermit2, "eip2612GasSponsoring.info.spender is %s; it must be Permit2 %s", permit.Spender.Hex(), p.net.permit2.Hex())
	case permit.Value.Cmp(p.p2.Amount) != 0:
		// The proxies take the permit's value as the permitted amount: an upto payment's maximum.
		sp.err = refuse(x402.ReasonPermit2EIP2612AmountMismatch, "eip2612GasSponsoring.info.amount is %s but the payment permits exactly %s", permit.Value, p.p2.Amount)
	default:
		got, err := RecoverSigner(PermitDigest(p.asset.domain, permit), sp.sig)
		if err != nil || got != p.payer {
			sp.err = refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "eip2612GasSponsoring.info.signature is not %s's EIP-2612 permit to Permit2%s", p.payer.Hex(), recoverDetail(got, err))
		}
	}
	return sp
}

// checkFarDeadline refuses a deadline further beyond chain time than the requirements' maxTimeoutSeconds and the
// network's clock skew allow: the resource server asked for a payment that expires by then, and a record of it
// must be kept until its deadline.
func (p *payment) checkFarDeadline(chainNow uint64) *refusal {
	field, d := "authorization.validBefore", p.deadlineValue()
	if p.method == x402.TransferPermit2 {
		field = "permit2Authorization.deadline"
	}
	skew := p.net.skew
	if skew <= 0 {
		skew = defaultDeadlineSkew
	}
	// The later of chain time and this machine's clock: the head of a chain that seals on demand (a dev chain)
	// can be minutes old, and the payer signed by its own clock.
	now := chainNow
	if wall := p.net.now().Unix(); wall > int64(now) {
		now = uint64(wall)
	}
	latest := new(big.Int).SetUint64(now)
	latest.Add(latest, big.NewInt(p.maxTimeout))
	latest.Add(latest, big.NewInt(int64(skew/time.Second)))
	if d.Cmp(latest) <= 0 {
		return nil
	}
	return refuse(x402.ReasonValidBefore, "%s %s lies more than maxTimeoutSeconds (%d) and the allowed clock skew (%s) after now (%d); sign with a deadline no later than %s",
		field, d, p.maxTimeout, skew, now, latest)
}

// checkTime checks the validity window against the time the settlement can be mined at: the timestamp of the
// next block, which is at least one second past the head's and, on a chain whose blocks are stamped with the
// wall clock, no earlier than this machine's clock. A chain that seals only when transactions come (a dev
// chain) may have sat idle for minutes: its head is that old, and its next block jumps to the wall clock, past
// a deadline the head allows; on any chain a deadline closer than that plus deadlineMargin (a block or two)
// would expire in flight, and the settlement revert at the settlement wallet's expense. The deadline is judged
// by the latest time the settlement is expected to be mined at, validAfter by the earliest (see mineTime). The
// time is read from the head block and the engine's clock (which the tests control), and kept for the
// simulation, which runs in that next block's context (see execution). A settlement judges the deadline again
// just before it signs (checkDeadlineBeforeSending). The error is a head that could not be read: with no chain
// time the window cannot be judged, and the payment is neither verified nor refused, whatever the calls after it
// would answer (a node back by then simulates a payment past its deadline as a failed call, and one too close
// to it as a good one).
func (p *payment) checkTime(ctx context.Context) (*refusal, error) {
	head, err := p.net.chainHead(ctx)
	if err != nil {
		return nil, headUnread(err)
	}
	t := p.setHead(head)
	if ref := p.checkFarDeadline(head.Time); ref != nil {
		// The shared head read (HeadCacheTTL) of a chain sealing per burst may lag the payer's by many blocks, a
		// second each under load (and before its clock runs ahead of this machine's, nothing says the chain is
		// one): a payment signed from a fresher head would look signed too far ahead. Judged again from a head
		// at most farDeadlineHeadAge old before it is refused, which bounds what payments signed too far ahead
		// can cost the node; a head that cannot be read then refuses nothing either.
		fresh, err := p.net.head.get(ctx, p.net.now, farDeadlineHeadAge, p.net.readHead)
		if err != nil {
			return nil, headUnread(err)
		}
		if p.checkFarDeadline(fresh.Time) != nil {
			return ref, nil
		}
		t = p.setHead(fresh)
	}
	if ref := p.checkDeadline(t); ref != nil {
		return ref, nil
	}
	mineAt := new(big.Int).SetUint64(p.mineAt)
	switch {
	case p.method == x402.TransferPermit2 && p.p2.ValidAfter.Cmp(mineAt) > 0:
		return refuse(x402.ReasonPermit2NotYetValid, "permit2Authorization.witness.validAfter %s is after %s, the earliest time of the next block", p.p2.ValidAfter, mineAt), nil
	case p.method == x402.TransferEIP3009 && p.auth.ValidAfter.Cmp(mineAt) > 0:
		return refuse(x402.ReasonValidAfter, "authorization.validAfter %s is after %s, the earliest time of the next block", p.auth.ValidAfter, mineAt), nil
	}
	return nil, nil
}

// headUnread is checkTime's error for a head block that could not be read.
func headUnread(err error) error {
	return fmt.Errorf("reading the head block (chain time, which the payment's validity window is judged by): %w", err)
}

// checkDeadline refuses a payment whose deadline does not stay deadlineMargin past t.latest, the time its
// settlement is expected to be mined by. A sponsor permit's deadline too close is kept as the sponsor's refusal
// (it matters only when the payer's own approval falls short: see checkChain).
func (p *payment) checkDeadline(t mineTime) *refusal {
	minDeadline := new(big.Int).SetUint64(t.latest + deadlineMargin)
	// tooClose says why a deadline is refused: when the settlement would be mined, and from what.
	tooClose := func() string {
		ahead := ""
		if t.ahead > 0 {
			ahead = fmt.Sprintf("; %d of this facilitator's settlements are ahead of it on a chain that seals a block per transaction burst, a block each, so it would be mined by %d", t.ahead, t.latest)
		}
		return fmt.Sprintf("the settlement would land in the next block, stamped %d at the earliest (the head block %s is stamped %d, this facilitator's clock reads %d)%s, and needs %ds more to be mined",
			t.earliest, t.head.Number, t.head.Time, t.wall, ahead, deadlineMargin)
	}
	switch p.method {
	case x402.TransferPermit2:
		if p.p2.Deadline.Cmp(minDeadline) < 0 {
			return refuse(x402.ReasonPermit2DeadlineExpired, "%s: permit2Authorization.deadline %s is too close: %s; sign again with a later deadline", x402.MessagePermitExpired, p.p2.Deadline, tooClose())
		}
		if sp := p.sponsor; sp != nil && sp.err == nil && sp.permit.Deadline.Cmp(minDeadline) < 0 {
			sp.err = refuse(x402.ReasonEIP2612DeadlineExpired, "eip2612GasSponsoring.info.deadline %s is too close: %s", sp.permit.Deadline, tooClose())
		}
		if sa := p.approval; sa != nil && sa.err == nil {
			// A sponsored approval's settlement is mined two blocks after the next at the soonest: the payer's gas
			// money mines first, then its approval, and only then is the settlement sent. Kept as the approval's
			// refusal, as the sponsor permit's: it matters only when the payer's allowance falls short.
			interval := p.net.blockInterval()
			need := new(big.Int).Add(minDeadline, new(big.Int).SetUint64(approvalBlocksBefore*interval))
			if p.p2.Deadline.Cmp(need) < 0 {
				sa.err = refuse(x402.ReasonPermit2DeadlineExpired, "%s: permit2Authorization.deadline %s is too close for a sponsored approval (erc20ApprovalGasSponsoring), whose settlement follows the payer's gas money and its approval, a block each (%ds a block on this chain), and needs %s at least: %s; sign again with a later deadline",
					x402.MessagePermitExpired, p.p2.Deadline, interval, need, tooClose())
			}
		}
	case x402.TransferEIP3009:
		if p.auth.ValidBefore.Cmp(minDeadline) < 0 {
			return refuse(x402.ReasonValidBefore, "authorization.validBefore %s is too close: %s; sign again with a later validBefore", p.auth.ValidBefore, tooClose())
		}
	default:
		if p.permit.Deadline.Cmp(minDeadline) < 0 {
			return refuse(x402.ReasonValidBefore, "%s: authorization.validBefore %s is too close: %s; sign again with a later deadline", x402.MessagePermitExpired, p.permit.Deadline, tooClose())
		}
	}
	return nil
}

// checkDeadlineBeforeSending judges the payment's deadline again at the last moment before its settlement is
// signed, its claim and hold written: checkTime judged it from a head read before the claim, the hold, the
// wallet, the fee quote and the simulation, and a chain that seals a block per transaction burst may have
// sealed dozens of blocks since, a second each (seen under load: settlements mined 3 s past their deadline,
// reverted at the settlement wallet's expense). On such a chain the head is read afresh; on a chain with
// periodic blocks the wall clock, read now, moves the next block's time, and the shared head read (one a
// HeadCacheTTL between all callers) is fresh enough. That shared read, not the head checkTime read, says which
// kind of chain it is: a chain sealing per burst, not configured so, shows itself only once its clock runs
// ahead, which may be while this settlement was prepared. A
// sponsor permit the settlement applies must hold as long. A refusal sends nothing, and the caller lets the
// claim and the hold go as for any refusal; the error is a head that could not be read (nothing was sent).
func (p *payment) checkDeadlineBeforeSending(ctx context.Context) (*refusal, error) {
	n := p.net
	head, err := n.chainHead(ctx)
	if err == nil && n.sealsPerBurstNow(head, n.now().Unix()) {
		head, err = n.head.get(ctx, n.now, 0, n.readHead)
	}
	if err != nil {
		return nil, fmt.Errorf("nothing was sent: %w: reading the head block: %w", errNodeNotAsked, err)
	}
	if ref := p.checkDeadline(n.mineTime(head)); ref != nil {
		return ref, nil
	}
	if sp := p.sponsor; sp != nil && sp.err != nil {
		return sp.err, nil
	}
	if sa := p.approval; sa != nil && sa.err != nil {
		return sa.err, nil
	}
	return nil, nil
}

// farDeadlineHeadAge is how old a head a deadline refused as too far ahead is judged again from (see checkTime).
const farDeadlineHeadAge = 20 * time.Millisecond

// setHead keeps the head block chain time was read from, and the earliest time of the next block (see
// network.mineAt); it returns when a settlement sent now would be mined, judged from head.
func (p *payment) setHead(head *types.Header) mineTime {
	t := p.net.mineTime(head)
	p.mineAt, p.head = t.earliest, head
	return t
}

// mineTime is when a settlement sent now would be mined, judged from one head block.
type mineTime struct {
	head *types.Header
	wall int64 // the engine's clock, read with it
	// earliest is the earliest time of the next block (network.mineAt), which validAfter must not pass; latest
	// is the time the settlement is expected to be mined by, which its deadline must outlast: on a chain that
	// seals per burst, a second later for each of this engine's transactions ahead of it (ahead).
	earliest, latest uint64
	ahead            int64
}

// mineTime judges when a settlement sent now would be mined, from head. On a chain that seals a block per
// transaction burst, each transaction sent before it and not mined yet may take a block of its own, a second
// past the one before: the settlements of this engine past their last deadline check (sending) and those sent
// whose receipt was not seen yet (unmined). A receipt is seen a poll after its block, so this errs late, never
// early, for this engine's own transactions; those of others sharing the chain and its wallets are not known
// here, and deadlineMargin is their room. On a chain with periodic blocks the transactions ahead share the
// next block, and count nothing.
func (n *network) mineTime(head *types.Header) mineTime {
	t := mineTime{head: head}
	t.earliest, t.wall = n.mineAt(head)
	t.latest = t.earliest
	if n.sealsPerBurstNow(head, t.wall) {
		t.ahead = max(n.sending.Load()+n.unmined.Load(), 0)
		t.latest += uint64(t.ahead)
	}
	return t
}

// aheadOfClock is how far a head block's time may lie past this machine's clock (wall) on a chain with periodic
// blocks, stamped by the clocks of its validators: further ahead, the chain is one that seals a block per
// transaction burst, whose clock runs a second ahead per block under load.
const aheadOfClock = 2

// sealsPerBurstNow reports whether the network's chain seals a block per transaction burst: configured so
// (NetworkConfig.SealsPerBurst), or seen so: its head stamped further past the engine's clock (wall) than a
// chain with periodic blocks stamps one, and its last heads seen a second a block apart or less. The second
// test keeps a chain with periodic blocks of two seconds or more from being taken for one when it is this
// machine's clock that lags (or a node answers a head from the future): counting this engine's settlements
// ahead of a payment, a second each, would then refuse payments the next block would take.
func (n *network) sealsPerBurstNow(head *types.Header, wall int64) bool {
	return n.sealsPerBurst || (head.Time > uint64(max(wall, 0))+aheadOfClock && n.secondBlocks())
}

// mineAt is the earliest time of the block after head, which a settlement sent now lands in at the soonest: one
// second past the head's, and no earlier than the engine's clock (wall), on a chain whose blocks are stamped
// with the wall clock (see checkTime).
func (n *network) mineAt(head *types.Header) (at uint64, wall int64) {
	wall = n.now().Unix()
	return max(head.Time+1, uint64(max(wall, 0))), wall
}

// NextBlockTime is the time a settlement sent now is expected to be mined by on networkID, the time the engine
// judges deadlines by (see checkTime and mineTime): one second past the head block's, no earlier than its
// clock, and on a chain that seals a block per transaction burst a second later for each of the engine's
// settlements ahead of it. A gate that serves a payment before settling it asks it whether the payment's
// deadline leaves the settlement room.
func (f *Facilitator) NextBlockTime(ctx context.Context, networkID string) (time.Time, error) {
	n := f.networks[networkID]
	if n == nil {
		return time.Time{}, fmt.Errorf("network %s is not configured", networkID)
	}
	head, err := n.chainHead(ctx)
	if err != nil {
		return time.Time{}, fmt.Errorf("reading the head block of %s: %w", networkID, err)
	}
	return time.Unix(int64(n.mineTime(head).latest), 0), nil
}

// checkChain reads what only the chain knows: the nonce, the balance, the Permit2 allowance, and finally
// whether the exact settlement call would succeed; then whether the payer's funds also cover the payments held
// against them (see funds). The error is for a chain that could not be asked.
func (p *payment) checkChain(ctx context.Context, use fundsUse) (*refusal, error) {
	n := p.net
	if p.method == x402.TransferPermit2 && p.sponsor != nil {
		// The sponsor permit is applied only where the payer's own approval falls short: a payer who approved
		// Permit2 is then settled and held exactly like one who attached no permit, and the permit of one who
		// did not is known to be spent by this settlement (see funds).
		allowance, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "allowance", p.payer, n.permit2)
		if err != nil {
			return nil, err
		}
		if allowance.Cmp(p.amount) >= 0 {
			p.sponsor = nil
		}
	}
	if p.method == x402.TransferPermit2 && p.approval != nil {
		// As the sponsor permit: the approval is sent only where the payer's own allowance falls short.
		allowance, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "allowance", p.payer, n.permit2)
		if err != nil {
			return nil, err
		}
		if allowance.Cmp(p.amount) >= 0 {
			p.approval = nil
		} else if p.approval.err == nil {
			if ref, err := p.checkApproval(ctx, use); err != nil || ref != nil {
				return ref, err
			}
		}
	}
	if p.method == x402.TransferPermit2 && (p.sponsor == nil || p.sponsor.err == nil) && (p.approval == nil || p.approval.err == nil) {
		// The proxy's settle checks the nonce, the signature, the allowance and the balance itself: when
		// its simulation succeeds, one call has answered for all of them. Only a failure needs the reads
		// below, to name the reason.
		ref, err := p.simulate(ctx)
		if err != nil {
			return nil, err
		}
		if ref == nil {
			return p.coverHeld(ctx, use)
		}
	}
	if p.method == x402.TransferEIP3009 {
		return p.checkEIP3009(ctx, use)
	}
	if p.method == x402.TransferERC2612 {
		cur, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "nonces", p.payer)
		if err != nil {
			return nil, err
		}
		switch p.nonce.Cmp(cur) {
		case -1:
			if p.permitApplied {
				break // spent by this settlement's own permit transaction; settlementCalls checks what it granted
			}
			return refuse(x402.ReasonNonceAlreadyUsed, "permit nonce %s of %s was already used (the token's next nonce is %s)", p.nonce, p.payer.Hex(), cur), nil
		case 1:
			return refuse(x402.ReasonInvalidPayload, "permit nonce %s is ahead of the token's next nonce %s for %s; sign with nonces(owner)", p.nonce, cur, p.payer.Hex()), nil
		}
	} else {
		used, err := p.permit2NonceUsed(ctx)
		if err != nil {
			return nil, err
		}
		if used {
			return refuse(x402.ReasonPermit2InvalidNonce, "Permit2 nonce %s of %s was already used", p.nonce, p.payer.Hex()), nil
		}
	}
	bal, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "balanceOf", p.payer)
	if err != nil {
		return nil, err
	}
	if bal.Cmp(p.amount) < 0 {
		return refuse(x402.ReasonInsufficientFunds, "payer %s balance %s is below the required amount %s", p.payer.Hex(), bal, p.amount), nil
	}
	if p.method == x402.TransferPermit2 {
		allowance, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "allowance", p.payer, n.permit2)
		if err != nil {
			return nil, err
		}
		if allowance.Cmp(p.amount) >= 0 {
			p.sponsor, p.approval = nil, nil // approval exists: settle without the sponsored permit
		} else if p.approval != nil {
			if p.approval.err != nil {
				return p.approval.err, nil
			}
		} else if p.sponsor == nil {
			return refuse(x402.ReasonPermit2AllowanceRequired, "payer %s has approved Permit2 for %s of %s, less than %s; approve Permit2 or add the %s extension", p.payer.Hex(), allowance, p.asset.Address.Hex(), p.amount, x402.ExtensionEIP2612GasSponsoring), nil
		} else if p.sponsor.err != nil {
			return p.sponsor.err, nil
		} else {
			tokNonce, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "nonces", p.payer)
			if err != nil {
				return nil, err
			}
			if tokNonce.Cmp(p.sponsor.permit.Nonce) != 0 {
				return refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "eip2612GasSponsoring.info.nonce is %s but the token's next nonce for %s is %s", p.sponsor.permit.Nonce, p.payer.Hex(), tokNonce), nil
			}
		}
	}
	if ref, err := p.simulate(ctx); err != nil || ref != nil {
		return ref, err
	}
	return p.coverHeld(ctx, use)
}

// checkEIP3009 simulates the transferWithAuthorization, which checks the time window, the nonce, the signature
// and the balance in one call; only a failure reads the chain further, to name the reason as the public
// facilitators do.
func (p *payment) checkEIP3009(ctx context.Context, use fundsUse) (*refusal, error) {
	ref, err := p.simulate(ctx)
	if err != nil {
		return nil, err
	}
	if ref == nil {
		return p.coverHeld(ctx, use)
	}
	n := p.net
	data, err := contracts.USDCoinABI.Pack("authorizationState", p.payer, p.auth.Nonce)
	if err != nil {
		return nil, err
	}
	out, err := n.backend.CallContract(ctx, ethereum.CallMsg{To: &p.asset.Address, Data: data}, nil)
	switch {
	case err != nil && !isRevert(err):
		return nil, err
	case err != nil || len(out) < 32:
		return refuse(x402.ReasonEIP3009NotSupported, "token %s (%s) does not implement EIP-3009 (authorizationState failed: %s); pay it by permit2", p.asset.Address.Hex(), p.asset.Name, revertDetail(err, out)), nil
	case new(big.Int).SetBytes(out[:32]).Sign() != 0:
		return refuse(x402.ReasonNonceAlreadyUsed, "EIP-3009 nonce %s of %s was already used or canceled", p.auth.Nonce.Hex(), p.payer.Hex()), nil
	}
	bal, err := n.callUint(ctx, p.asset.Address, contracts.StableCoinABI, "balanceOf", p.payer)
	if err != nil {
		return nil, err
	}
	if bal.Cmp(p.amount) < 0 {
		return refuse(x402.ReasonEIP3009InsufficientBalance, "payer %s balance %s is below the required amount %s", p.payer.Hex(), bal, p.amount), nil
	}
	return ref, nil
}

// revertDetail says why a call gave no usable answer: the revert reason, or how short the answer was.
func revertDetail(err error, out []byte) string {
	if err != nil {
		return revertReason(err)
	}
	return fmt.Sprintf("%d bytes returned, want 32", len(out))
}

// coverHeld checks, once the chain allows the payment itself, that the payer's funds cover it beside the
// payments held against them, and holds it unless only verifying. With nothing else held and a payer not seen
// lately, the simulation has answered. Otherwise a settlement, whose exact call was just simulated, may count
// from a fresh read; a verification that came here reads afresh (a fresh read that covered it would have
// answered before any chain call).
func (p *payment) coverHeld(ctx context.Context, use fundsUse) (*refusal, error) {
	if !p.tracksFunds() {
		return nil, nil
	}
	n := p.net
	if n.funds.simulationSuffices(p, use) {
		return nil, nil
	}
	// A permit (or sponsored approval) another held payment carries is looked for before the funds: a balance
	// that covers both would otherwise let this settlement send what the other sends (the money-invariant run,
	// scarce: two first payments of a payer at two gateways, the payer sent gas money for its approval twice).
	if held, err := n.funds.permitInUse(ctx, p); err != nil {
		return nil, err
	} else if held {
		return p.permitInFlight(use)
	}
	if use == fundsSettle && n.funds.ttl > 0 {
		if ok, _, _, err := n.funds.check(ctx, p, p.head.Time, nil, use); err != nil {
			return nil, err
		} else if ok {
			return nil, nil
		}
	}
	// The head checkTime used may be a cached one older than the state the simulation just saw: read at the
	// newest block, so that the read and the holds it is compared with agree on what the chain shows.
	head, err := n.backend.HeaderByNumber(ctx, nil)
	if err != nil {
		return nil, err
	}
	block := head.Number
	balance, allowance, err := p.readFunds(ctx, block)
	if err != nil {
		return nil, err
	}
	ok, clash, left, err := n.funds.check(ctx, p, head.Time, &fundsRead{block: block.Uint64(), balance: balance, allowance: allowance}, use)
	if err != nil {
		return nil, err
	}
	permitHeld := clash
	if !ok && !clash {
		// A hold of the permit taken meanwhile by a concurrent payment, when the check was one without take.
		if permitHeld, err = n.funds.permitInUse(ctx, p); err != nil {
			return nil, err
		}
	}
	switch {
	case ok:
		return nil, nil
	case permitHeld:
		// Held meanwhile by a concurrent payment with the same permit.
		return p.permitInFlight(use)
	case p.method == x402.TransferEIP3009:
		return refuse(x402.ReasonEIP3009InsufficientBalance, "payer %s has %s at block %s, but payments to this facilitator that are not settled yet hold part of it, leaving %s: below the required amount %s; wait for them to settle or top up",
			p.payer.Hex(), balance, block, left, p.amount), nil
	case p.method == x402.TransferERC2612:
		return refuse(x402.ReasonInsufficientFunds, "payer %s has %s at block %s, but payments to this facilitator that are not settled yet hold part of it, leaving %s: below the required amount %s; wait for them to settle or top up",
			p.payer.Hex(), balance, block, left, p.amount), nil
	case p.sponsor != nil:
		return refuse(x402.ReasonInsufficientFunds, "payer %s has %s at block %s and its gas-sponsoring permit sets the Permit2 allowance to %s, but payments to this facilitator that are not settled yet hold part of it, leaving %s: below the required amount %s; wait for them to settle, then sign again",
			p.payer.Hex(), balance, block, p.sponsor.permit.Value, left, p.amount), nil
	default:
		return refuse(x402.ReasonInsufficientFunds, "payer %s has %s (and has approved Permit2 for %s) at block %s, but payments to this facilitator that are not settled yet hold part of it, leaving %s: below the required amount %s; wait for them to settle or top up",
			p.payer.Hex(), balance, allowance, block, left, p.amount), nil
	}
}

// readFunds reads the payer's balance and Permit2 allowance at block; for a wallet the settlement deploys
// first, as they will be once it is deployed (its constructor may approve Permit2), at the latest block.
func (p *payment) readFunds(ctx context.Context, block *big.Int) (balance, allowance *big.Int, err error) {
	n := p.net
	if !p.undeployed {
		if balance, err = n.callUintAt(ctx, block, p.asset.Address, contracts.StableCoinABI, "balanceOf", p.payer); err != nil {
			return nil, nil, err
		}
		allowance, err = n.callUintAt(ctx, block, p.asset.Address, contracts.StableCoinABI, "allowance", p.payer, n.permit2)
		return balance, allowance, err
	}
	balanceOf, err := contracts.StableCoinABI.Pack("balanceOf", p.payer)
	if err != nil {
		return nil, nil, err
	}
	allowanceOf, err := contracts.StableCoinABI.Pack("allowance", p.payer, n.permit2)
	if err != nil {
		return nil, nil, err
	}
	res, err := p.afterDeploy(ctx, contracts.Call{To: p.asset.Address, Data: balanceOf}, contracts.Call{To: p.asset.Address, Data: allowanceOf})
	if err != nil {
		return nil, nil, err
	}
	for _, r := range res {
		if !r.OK || len(r.Return) < 32 {
			return nil, nil, fmt.Errorf("reading the funds of %s after deploying it: the token answered 0x%x", p.payer.Hex(), r.Return)
		}
	}
	return new(big.Int).SetBytes(res[0].Return[:32]), new(big.Int).SetBytes(res[1].Return[:32]), nil
}

// permitInFlight refuses a payment whose EIP-2612 permit (an erc2612 payment's own, or a gas-sponsoring permit)
// has the token nonce of one that another payment, held and not yet settled, will spend (an erc2612 payment, or
// a permit2 payment with a gas-sponsoring permit). The reason is the one the chain gives the same permit once
// that settlement lands (its nonce is then no longer the token's next), so the answer does not depend on the
// moment it is asked; insufficient_funds would mislead a payer whose balance covers both payments.
//
// A sponsored approval is the exception at settlement: the payment itself stays good (the allowance the other
// payment's approval sets pays it), so a settlement that meets it sends nothing and says to present the payment
// again, as for an approval waiting behind the payer's pending one (checkApproval), and is no refusal. A payment
// verified while nothing held the approval, settled after another payment carrying it was held (the money-invariant
// run: two payments of one payer presented at once after an RPC fault), was told 402 after its upstream had run.
func (p *payment) permitInFlight(use fundsUse) (*refusal, error) {
	const other = "the token nonce of the EIP-2612 permit of another payment to this facilitator that is not settled yet (an erc2612 payment, or a gas-sponsoring permit), which spends it; wait for that payment to settle, then sign again with the token's next nonce"
	if p.method == x402.TransferERC2612 {
		return refuse(x402.ReasonNonceAlreadyUsed, "permit nonce %s of %s is %s", p.permit.Nonce, p.payer.Hex(), other), nil
	}
	if p.approval != nil {
		const carried = "the approval of %s (erc20ApprovalGasSponsoring) is carried by another payment to this facilitator that is not settled yet, which sends it"
		if use == fundsSettle {
			return nil, fmt.Errorf("nothing was sent: %w: "+carried+"; the allowance it sets pays this payment once it mined: present it again then", errNodeNotAsked, p.payer.Hex())
		}
		return refuse(x402.ReasonERC20ApprovalTxWrongNonce, carried+"; wait for that payment to settle (the allowance it sets then pays this one)", p.payer.Hex()), nil
	}
	return refuse(x402.ReasonInvalidEIP2612ExtensionFormat, "eip2612GasSponsoring.info.nonce %s of %s is %s (or approve Permit2)",
		p.sponsor.permit.Nonce, p.payer.Hex(), other), nil
}

// simulate runs the payment's first settlement call as an eth_call standing for its transaction (see
// execution): from the wallet that sends it, with its gas limit and fees, in the next block. A refusal when the
// call would fail on chain, an error when the node could not be asked.
func (p *payment) simulate(ctx context.Context) (*refusal, error) {
	calls, err := p.settlementCalls()
	if err != nil {
		return nil, err
	}
	reason := x402.ReasonSimulationFailed
	if p.method == x402.TransferPermit2 {
		reason = x402.ReasonPermit2SimulationFailed
	}
	if p.deposit != nil {
		reason = x402.ReasonBatchDepositSimulationFailed
	}
	if p.undeployed && p.upto() {
		// DeployThenCall would be the upto proxy's caller, which takes the settlement from the witness's
		// facilitator only: the call cannot be simulated where the wallet has been deployed.
		return refuse(x402.ReasonInvalidPayload, "the payer %s is a smart wallet not deployed yet (ERC-6492): its upto payment cannot be checked before settling; deploy the wallet first, or pay by the exact scheme", p.payer.Hex()), nil
	}
	if p.undeployed {
		// The settlement call, made where the wallet has been deployed (the deployment is calls[0]).
		last := calls[len(calls)-1]
		res, err := p.afterDeploy(ctx, contracts.Call{To: last.To, Data: last.Data})
		if res == nil {
			return deployRefusal(p, err)
		}
		if !res[0].OK {
			why, ok := contracts.DecodeRevert(res[0].Return)
			if !ok {
				why = fmt.Sprintf("reverted (0x%x)", res[0].Return)
			}
			return refuse(reason, "simulating the settlement call after deploying the payer's wallet failed: %s", why), nil
		}
		return nil, nil
	}
	if p.approval != nil {
		return p.simulateApproval(ctx, calls[0])
	}
	if _, err := p.call(ctx, &calls[0].To, calls[0].Data, calls[0].Gas); err != nil {
		if !failsOnChain(err) {
			return nil, err
		}
		return refuse(reason, "simulating the settlement call failed: %s (run as it will be sent: from %s, with its fees and its gas limit of %d, in the next block)",
			revertReason(err), p.exec.from.Hex(), calls[0].Gas), nil
	}
	return nil, nil
}

// settlementCalls builds the transactions that settle the payment, all sent from one wallet (namedSender, when
// the payment names one). erc2612: permit (unless a permit of this settlement already mined), then transferFrom,
// from the spender. permit2: the proxy's settle, or settleWithPermit with the sponsored permit.
func (p *payment) settlementCalls() ([]contractCall, error) {
	n := p.net
	if p.deposit != nil {
		return p.deposit.calls(p)
	}
	if p.method == x402.TransferPermit2 && p.upto() {
		return p.uptoSettlementCalls()
	}
	if p.method == x402.TransferPermit2 {
		permit := contracts.PermitTransferFrom{Permitted: contracts.TokenPermissions{Token: p.p2.Token, Amount: p.p2.Amount}, Nonce: p.p2.Nonce, Deadline: p.p2.Deadline}
		witness := contracts.Witness{To: p.p2.To, ValidAfter: p.p2.ValidAfter}
		var data []byte
		var err error
		gas := uint64(walletCheckGas)
		if p.sponsor != nil {
			v, r, s := splitSignature(p.sponsor.sig)
			data, err = contracts.PackSettleWithPermit(contracts.EIP2612Permit{Value: p.sponsor.permit.Value, Deadline: p.sponsor.permit.Deadline, R: r, S: s, V: v}, permit, p.payer, witness, p.sigBytes)
			gas = settleWithPermitGas
		} else {
			data, err = contracts.PackSettle(permit, p.payer, witness, p.sigBytes)
		}
		if err != nil {
			return nil, err
		}
		return p.deployFirst(contractCall{To: n.proxy, Data: data, Gas: gas}), nil
	}
	if p.method == x402.TransferEIP3009 {
		a := p.auth
		t := contracts.EIP3009Transfer{From: a.From, To: a.To, Value: a.Value, ValidAfter: a.ValidAfter, ValidBefore: a.ValidBefore, Nonce: a.Nonce}
		var data []byte
		var err error
		gas := uint64(120_000)
		if p.contractSig {
			// A contract wallet's signature goes to the overload that asks the wallet (ERC-1271).
			data, err = contracts.PackTransferWithAuthorizationBytes(t, p.sigBytes)
			gas = 200_000
		} else {
			v, r, s := splitSignature(p.sig)
			data, err = contracts.PackTransferWithAuthorization(t, v, r, s)
		}
		if err != nil {
			return nil, err
		}
		return p.deployFirst(contractCall{To: p.asset.Address, Data: data, Gas: gas}), nil
	}
	spender := p.permit.Spender
	transfer, err := contracts.StableCoinABI.Pack("transferFrom", p.payer, p.payTo, p.amount)
	if err != nil {
		return nil, err
	}
	calls := []contractCall{}
	if !p.permitApplied {
		// The signed permit is always spent, even when an allowance the payer gave the spender otherwise covers
		// the payment: unspent, its token nonce would block the payer's next payment (signed with the same
		// nonce), and the permit could be replayed later to reset the allowance.
		v, r, s := splitSignature(p.sig)
		permit, err := contracts.StableCoinABI.Pack("permit", p.payer, spender, p.permit.Value, p.permit.Deadline, v, r, s)
		if err != nil {
			return nil, err
		}
		calls = append(calls, contractCall{To: p.asset.Address, Data: permit, Gas: 120_000})
	}
	calls = append(calls, contractCall{To: p.asset.Address, Data: transfer, Gas: 120_000})
	return calls, nil
}

// uptoSettlementCalls is settlementCalls of an upto payment: the upto proxy's settle (or settleWithPermit) of
// p.amount, from the wallet the witness names, the only sender the proxy takes it from.
func (p *payment) uptoSettlementCalls() ([]contractCall, error) {
	permit := contracts.PermitTransferFrom{Permitted: contracts.TokenPermissions{Token: p.p2.Token, Amount: p.p2.Amount}, Nonce: p.p2.Nonce, Deadline: p.p2.Deadline}
	witness := contracts.UptoWitness{To: p.p2.To, Facilitator: p.p2.Facilitator, ValidAfter: p.p2.ValidAfter}
	var data []byte
	var err error
	gas := uint64(walletCheckGas)
	if p.sponsor != nil {
		v, r, s := splitSignature(p.sponsor.sig)
		data, err = contracts.PackUptoSettleWithPermit(contracts.EIP2612Permit{Value: p.sponsor.permit.Value, Deadline: p.sponsor.permit.Deadline, R: r, S: s, V: v}, permit, p.amount, p.payer, witness, p.sigBytes)
		gas = settleWithPermitGas
	} else {
		data, err = contracts.PackUptoSettle(permit, p.amount, p.payer, witness, p.sigBytes)
	}
	if err != nil {
		return nil, err
	}
	return p.deployFirst(contractCall{To: p.net.uptoProxy, Data: data, Gas: gas}), nil
}

// deployFirst puts the deployment of the payer's wallet before the settlement call when the wallet has no code
// yet: both go from the same settlement wallet, with consecutive nonces.
func (p *payment) deployFirst(settle contractCall) []contractCall {
	if !p.undeployed {
		return []contractCall{settle}
	}
	return []contractCall{{To: p.wallet.factory, Data: p.wallet.data, Gas: walletDeployGas}, settle}
}

// walletCheckGas is the gas of a settlement call that asks the payer's contract wallet (ERC-1271) whether it
// signed: the Permit2 proxies' settle, and EIP-3009's transferWithAuthorization with a bytes signature. The
// wallet's answer to the engine's own question (checkContractSignature) is asked within as much.
const walletCheckGas = 200_000

// settleWithPermitGas is the gas of a Permit2 proxy's settleWithPermit, which applies the payer's EIP-2612
// permit first.
const settleWithPermitGas = 300_000

// walletDeployGas bounds the gas of a smart wallet's deployment (a minimal proxy costs about 100,000, a full
// contract some hundreds of thousands); what is not used is not paid.
const walletDeployGas = 1_500_000

// callUint calls a view function returning one uint256, at the latest block.
func (n *network) callUint(ctx context.Context, to common.Address, parsed abiPacker, method string, args ...any) (*big.Int, error) {
	return n.callUintAt(ctx, nil, to, parsed, method, args...)
}

// callUintAt calls a view function returning one uint256, at the given block (nil: the latest).
func (n *network) callUintAt(ctx context.Context, block *big.Int, to common.Address, parsed abiPacker, method string, args ...any) (*big.Int, error) {
	return callUintAt(ctx, n.backend, block, to, parsed, method, args...)
}

// CallTokenUint calls a uint256 view of a token (balanceOf, allowance, nonces) at the latest block: what a payer
// reads before it signs.
func CallTokenUint(ctx context.Context, c ethereum.ContractCaller, token common.Address, method string, args ...any) (*big.Int, error) {
	return callUintAt(ctx, c, nil, token, contracts.StableCoinABI, method, args...)
}

func callUintAt(ctx context.Context, c ethereum.ContractCaller, block *big.Int, to common.Address, parsed abiPacker, method string, args ...any) (*big.Int, error) {
	data, err := parsed.Pack(method, args...)
	if err != nil {
		return nil, fmt.Errorf("packing %s: %w", method, err)
	}
	out, err := c.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, block)
	if err != nil {
		return nil, fmt.Errorf("calling %s on %s: %w", method, to.Hex(), err)
	}
	if len(out) < 32 {
		return nil, fmt.Errorf("calling %s on %s: %d bytes returned, want a uint256 (is the contract deployed?)", method, to.Hex(), len(out))
	}
	return new(big.Int).SetBytes(out[:32]), nil
}

// abiPacker is the part of abi.ABI callUint needs.
type abiPacker interface {
	Pack(name string, args ...any) ([]byte, error)
}

// revertReason turns a failed call's error into the contract's own words where it gave any.
func revertReason(err error) string {
	var de interface{ ErrorData() any }
	if errors.As(err, &de) {
		if s, ok := de.ErrorData().(string); ok {
			if b, decErr := common.ParseHexOrString(s); decErr == nil {
				if r, ok := contracts.DecodeRevert(b); ok {
					return r
				}
			}
		}
	}
	return err.Error()
}

// isRevert reports whether a failed call was the contract refusing (as opposed to the node failing).
func isRevert(err error) bool {
	var ec rpc.Error
	if errors.As(err, &ec) && ec.ErrorCode() == 3 {
		return true
	}
	return strings.Contains(err.Error(), "revert")
}

// recoverDetail says why a signature is not the payer's: it could not be recovered, or whom it recovers (another
// key, or the same key over other values, such as a wrong domain).
func recoverDetail(got common.Address, err error) string {
	if err != nil {
		return " (" + err.Error() + ")"
	}
	return " (it recovers " + got.Hex() + ": another key, or other signed values)"
}

func hexAddrs(as []common.Address) []string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.Hex()
	}
	return out
}

// looksLikeEIP3009 recognises the EIP-3009 TransferWithAuthorization a client signs when it does not know
// erc2612: the same JSON shape, but a 32-byte hex nonce.
func looksLikeEIP3009(a *x402.EIP2612Authorization) bool {
	return strings.HasPrefix(a.Nonce, "0x") && len(a.Nonce) == 66
}
