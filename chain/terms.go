package chain

import (
	"context"
	"errors"
	"fmt"
	"math/big"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// paymentTerms are the operator's limits on what a network settles at all: the smallest amount, and the
// recipients payments may be for. Without them, anyone who can reach the facilitator can sign 1-unit payments to
// themselves and make it pay the gas of each settlement.
type paymentTerms struct {
	minAmount *big.Int                // nil: any amount of at least 1
	payTo     map[common.Address]bool // nil: any recipient
}

// newPaymentTerms checks and copies the terms of a network's configuration.
func newPaymentTerms(nc NetworkConfig) (paymentTerms, error) {
	var t paymentTerms
	if nc.MinAmount != nil {
		if nc.MinAmount.Sign() <= 0 || nc.MinAmount.BitLen() > 256 {
			return t, fmt.Errorf("minimum amount %s is not a number of raw token units from 1 to 2^256-1", nc.MinAmount)
		}
		t.minAmount = new(big.Int).Set(nc.MinAmount)
	}
	if len(nc.PayTo) > 0 {
		t.payTo = make(map[common.Address]bool, len(nc.PayTo))
		for _, a := range nc.PayTo {
			if a == (common.Address{}) {
				return t, errors.New("the zero address cannot be an allowed recipient: tokens refuse transfers to it")
			}
			t.payTo[a] = true
		}
	}
	return t, nil
}

// check refuses a payment outside the terms. It needs only what parse read, so it runs before any chain call.
// Both refusals are invalid_payment_requirements: what the resource server asked for is what this facilitator
// does not settle; the payer's signature matches the requirements, and signing again would not help.
//
// An upto payment's amount is what it moves: its maximum when verified, the amount to settle when settled, so
// that the smallest settlement sent is min_amount whoever signed the maximum. A settlement of zero sends nothing
// and costs no gas: the minimum does not apply to it.
func (t paymentTerms) check(p *payment) *refusal {
	if t.minAmount != nil && p.amount.Cmp(t.minAmount) < 0 && (!p.upto() || p.amount.Sign() != 0) {
		return refuse(x402.ReasonInvalidPaymentRequirements, "paymentRequirements.amount %s is below min_amount %s, the smallest payment this facilitator settles on %s",
			p.amount, t.minAmount, p.net.caip2)
	}
	if t.payTo != nil && !t.payTo[p.payTo] {
		return refuse(x402.ReasonInvalidPaymentRequirements, "paymentRequirements.payTo %s is not among the allowed recipients (pay_to) this facilitator settles for on %s",
			p.payTo.Hex(), p.net.caip2)
	}
	return nil
}

// admitSettlement applies the network's terms to a payment presented for settlement. A payment the journal
// already knows is left to the journal, whatever the terms say now: it was taken on under the terms of its day
// (a reload may have tightened them since), may have been broadcast, and a retry must get its answer, not a
// refusal that tells the payer to pay again. Only a new payment is refused, with nothing claimed or sent.
//
// So is the penalty of a payer whose settlement reverted (see penalties).
//
// A contract wallet's signature is judged here too, by the chain, before the journal is claimed in its payer's
// name: a payload must prove its payer before it can occupy its payer's nonce. The error is for a chain that
// could not be asked.
func (f *Facilitator) admitSettlement(ctx context.Context, p *payment) (*refusal, error) {
	ref := p.net.terms.check(p)
	if ref == nil {
		ref = p.net.penalties.refuse(p)
	}
	if ref == nil && !p.contractSig {
		return nil, nil
	}
	if _, known, err := f.journal.Get(ctx, p.id); err == nil && known {
		return nil, nil
	}
	if ref != nil {
		return ref, nil
	}
	ref, err := p.checkWallet(ctx)
	// Asked before chain time was read: the settlement asks again in the next block's context, from its wallet.
	p.exec = nil
	return ref, err
}
