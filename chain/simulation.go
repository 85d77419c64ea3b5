package chain

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/x402"
)

// execution is how a payment's settlement transaction will run on chain: the settlement wallet that sends it
// (tx.origin, and msg.sender of its first call), the fees it carries (tx.gasprice), and the earliest block it
// can land in (block.number, block.timestamp). Every eth_call that stands for the settlement (a contract
// wallet's isValidSignature, the simulation of the settlement call, DeployThenCall) runs with it, each with the
// gas limit its transaction carries: a payer contract must not be able to tell the simulation from the mined
// transaction, and accept the one and refuse the other at the settlement wallet's expense (an eth_call without
// fee fields runs at gas price 0, from nobody in particular, with the node's gas cap of tens of millions).
type execution struct {
	from  common.Address
	quote *feeQuote
	// block is the context of the next block, where the node takes block overrides: its number and time, and a
	// base fee the quote pays (a transaction whose fee cap is under the base fee waits in the pool until a block
	// it pays comes, or until it is replaced); nil when chain time is unknown.
	block *ethereum.BlockOverrides
	// headBaseFee is the head block's base fee (nil before London): a call run in the head block's context, by a
	// node that takes no block overrides, is priced at no less.
	headBaseFee *big.Int
}

// newExecution is the execution of a settlement sent from wallet from, priced by q, after the head block head;
// mineAt is the earliest time of the block it lands in (see checkTime).
func newExecution(from common.Address, q *feeQuote, head *types.Header, mineAt uint64) *execution {
	x := &execution{from: from, quote: q}
	if head != nil {
		x.block = &ethereum.BlockOverrides{Number: new(big.Int).Add(head.Number, big.NewInt(1)), Time: mineAt}
		if head.BaseFee != nil {
			x.block.BaseFee = minBig(head.BaseFee, q.cap())
		}
		x.headBaseFee = head.BaseFee
	}
	return x
}

// cap is the most a quote pays per gas: its gas price, or its fee cap.
func (q *feeQuote) cap() *big.Int {
	if q.gasPrice != nil {
		return q.gasPrice
	}
	return q.feeCap
}

// callMsg is the eth_call of a transaction to (nil: a creation) with data, limited to gas, as x sends it. atHead
// says the call runs in the head block's context (no block overrides): a quote under its base fee is priced at
// it there, as the block that takes the transaction will have its fee cap's worth.
func (x *execution) callMsg(to *common.Address, data []byte, gas uint64, atHead bool) ethereum.CallMsg {
	msg := ethereum.CallMsg{From: x.from, To: to, Data: data, Gas: gas}
	var floor *big.Int
	if atHead {
		floor = x.headBaseFee
	}
	if x.quote.gasPrice != nil {
		msg.GasPrice = maxBig(x.quote.gasPrice, floor)
	} else {
		msg.GasTipCap, msg.GasFeeCap = x.quote.tipCap, maxBig(x.quote.feeCap, floor)
	}
	return msg
}

func minBig(a, b *big.Int) *big.Int {
	if a.Cmp(b) <= 0 {
		return a
	}
	return b
}

// namedSender is the settlement wallet that alone can send p's settlement: an erc2612 permit's spender, an upto
// witness's facilitator; nil when any wallet of the pool may.
func (p *payment) namedSender() *common.Address {
	switch {
	case p.method == x402.TransferERC2612:
		return &p.permit.Spender
	case p.upto():
		return &p.p2.Facilitator
	}
	return nil
}

// execution is how p's settlement will run (see execution): set by the settlement once it holds its wallet and
// has quoted its fees, and at verification worked out on first use, from the wallet a settlement would take now
// and priced by the last settlement's quote (or from the head block, see headQuote). A verification asks the
// node for no fee: it must not depend on what only a settlement needs, nor hand a settlement a quote read
// before it; the settlement simulates again, with the very quote it sends with.
func (p *payment) execution(ctx context.Context) (*execution, error) {
	if p.exec != nil {
		return p.exec, nil
	}
	if p.head == nil {
		// Asked before the time window was checked (a contract wallet's signature, as a settlement is admitted):
		// the head prices the call and places it in the next block.
		head, err := p.net.chainHead(ctx)
		if err != nil {
			return nil, err
		}
		p.setHead(head)
	}
	q, ok := p.net.sender.quote.last()
	if !ok {
		q = headQuote(p.head)
	}
	from := p.net.pool.Peek()
	if named := p.namedSender(); named != nil {
		from = *named
	}
	p.exec = newExecution(from, q, p.head, p.mineAt)
	return p.exec, nil
}

// headQuote prices a verification's simulation when no settlement has quoted fees yet: as a settlement would
// be priced in the head block, its base fee twice over as the fee cap and no tip (so the gas price is the base
// fee, nonzero on every chain that has one); a chain without a base fee at 1 wei.
func headQuote(head *types.Header) *feeQuote {
	if head.BaseFee == nil {
		return &feeQuote{gasPrice: big.NewInt(1)}
	}
	return &feeQuote{tipCap: new(big.Int), feeCap: new(big.Int).Mul(head.BaseFee, big.NewInt(2))}
}

// call runs an eth_call standing for p's settlement transaction (see execution): to (nil: a creation) with
// data, limited to gas.
func (p *payment) call(ctx context.Context, to *common.Address, data []byte, gas uint64) ([]byte, error) {
	x, err := p.execution(ctx)
	if err != nil {
		return nil, err
	}
	out, err := p.net.callAs(ctx, x, to, data, gas)
	if err != nil && !failsOnChain(err) && strings.Contains(err.Error(), "insufficient funds") {
		// The settlement wallet cannot pay the gas at these fees: the node would refuse the transaction too.
		// Not the payer's doing, and nothing was sent: the payer may present the payment again.
		return nil, fmt.Errorf("%w: settlement wallet %s cannot pay for the settlement's gas at the current fees (fund it): %v", errNotSent, x.from.Hex(), err)
	}
	return out, err
}

// callAs runs an eth_call standing for a transaction x sends (see execution), in the next block's context when
// the node takes block overrides, else in the head block's (said once in the log).
func (n *network) callAs(ctx context.Context, x *execution, to *common.Address, data []byte, gas uint64) ([]byte, error) {
	if x.block != nil && !n.noBlockOverrides.Load() {
		out, err := callContractInBlock(ctx, n.backend, x.callMsg(to, data, gas, false), x.block)
		if !errors.Is(err, errNoBlockOverrides) {
			return out, err
		}
		if !n.noBlockOverrides.Swap(true) {
			n.log.Warn("the RPC node does not take block overrides in eth_call: settlements are simulated in the head block's context, not the next block's",
				zap.String("network", n.caip2), zap.Error(err))
		}
	}
	return n.backend.CallContract(ctx, x.callMsg(to, data, gas, true), nil)
}

// failsOnChain reports whether a failed eth_call says the transaction itself would fail: the contract reverted,
// or the EVM stopped it (out of gas, an invalid opcode...), as opposed to the node failing to run it.
func failsOnChain(err error) bool {
	if isRevert(err) {
		return true
	}
	msg := err.Error()
	for _, s := range evmFailures {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// evmFailures are the EVM's errors, as nodes word an eth_call that ran out of gas or hit bad code.
var evmFailures = []string{
	"out of gas", "invalid opcode", "stack underflow", "stack overflow", "invalid jump destination", "write protection",
	"return data out of bounds", "max code size exceeded", "gas uint64 overflow", "invalid code",
}

// DefaultRevertPenalty is how long a payer whose settlement was mined and reverted is refused, unless a network
// says otherwise (NetworkConfig.RevertPenalty).
const DefaultRevertPenalty = 10 * time.Minute

// penalties are the payers of one network whose settlement was mined and reverted after passing its
// simulation, and until when their payments are refused.
//
// A revert after a simulation run as the transaction runs is the payer's doing: its state changed between the
// simulation and the block (tokens moved away, a nonce invalidated, a contract wallet that answers otherwise
// on chain, say by block.prevrandao), and each such payment costs the settlement wallet the gas of a reverted
// transaction while the payer loses nothing (a new nonce is free). So after one revert the payer's payments
// are refused, before any chain call, for the penalty; each revert during it starts it again. The record lives
// in this engine's memory only: the gateways of a cluster each learn a payer's revert on their own, so a payer
// gets at most one revert per gateway per penalty (see the issue 28 note in the README).
type penalties struct {
	ttl time.Duration // 0: no penalty
	now func() time.Time

	mu      sync.RWMutex // read on every verification, written on a revert
	byPayer map[common.Address]penalty
}

// penalty is one payer's: until when, the last reverted transaction and its block, and how many reverted.
type penalty struct {
	until   time.Time
	tx      common.Hash
	block   uint64
	reverts int
}

// maxPenalties bounds the payers remembered: each entry cost the facilitator a reverted transaction, so a full
// table is the gas of as many, but memory must not depend on an attacker's budget.
const maxPenalties = 100_000

func newPenalties(ttl time.Duration, now func() time.Time) *penalties {
	switch {
	case ttl == 0:
		ttl = DefaultRevertPenalty
	case ttl < 0:
		ttl = 0
	}
	return &penalties{ttl: ttl, now: now, byPayer: map[common.Address]penalty{}}
}

// note records that payer's settlement tx reverted in block, and returns the payer's penalty.
func (b *penalties) note(payer common.Address, tx common.Hash, block uint64) penalty {
	if b.ttl <= 0 {
		return penalty{}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	for a, pen := range b.byPayer {
		if !now.Before(pen.until) {
			delete(b.byPayer, a) // over: forgotten here, where a revert already costs more than the walk
		}
	}
	pen, known := b.byPayer[payer]
	pen.until, pen.tx, pen.block, pen.reverts = now.Add(b.ttl), tx, block, pen.reverts+1
	if known || len(b.byPayer) < maxPenalties {
		b.byPayer[payer] = pen
	}
	return pen
}

// refuse is the refusal of a payment of a payer under penalty; nil for any other.
func (b *penalties) refuse(p *payment) *refusal {
	if b.ttl <= 0 {
		return nil
	}
	b.mu.RLock()
	pen, ok := b.byPayer[p.payer]
	b.mu.RUnlock()
	if !ok || !b.now().Before(pen.until) {
		return nil
	}
	reason := x402.ReasonSimulationFailed
	if p.method == x402.TransferPermit2 {
		reason = x402.ReasonPermit2SimulationFailed
	}
	return refuse(reason, "payer %s is refused on %s until %s: its settlement transaction %s was mined and reverted in block %d after passing its simulation (%d reverted), at this facilitator's expense; payments of a payer whose settlement reverts are refused for %s after each",
		p.payer.Hex(), p.net.caip2, pen.until.UTC().Format(time.RFC3339), pen.tx.Hex(), pen.block, pen.reverts, b.ttl)
}
