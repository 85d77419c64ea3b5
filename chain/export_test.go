package chain

import (
	"math/big"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/x402"
)

// ParsedPayment is what the checks of Verify before the chain made of a payment.
type ParsedPayment struct {
	Method string
	Payer  common.Address
	PayTo  common.Address
	Amount *big.Int
	// SponsorReason and SponsorMessage are the problem of an eip2612GasSponsoring extension, which Verify reports
	// only when the payer's approval does not cover the payment; "" when there is none.
	SponsorReason, SponsorMessage string
	// ContractSignature says the signature did not recover to the payer and is left to the chain: the payer
	// may be a contract wallet (ERC-1271) or one to be deployed (ERC-6492).
	ContractSignature bool
}

// ParseForTest runs the checks of Verify that need neither the chain nor the clock, so that a fuzz target can
// reach them without a chain call: what they made of an accepted payment, or the reason code and message of
// their refusal.
func (f *Facilitator) ParseForTest(req x402.VerifyRequest) (p ParsedPayment, reason, message string) {
	parsed, ref := f.parse(req)
	if ref != nil {
		return ParsedPayment{}, ref.reason, ref.message
	}
	p = ParsedPayment{Method: parsed.method, Payer: parsed.payer, PayTo: parsed.payTo, Amount: parsed.amount, ContractSignature: parsed.contractSig}
	if parsed.sponsor != nil && parsed.sponsor.err != nil {
		p.SponsorReason, p.SponsorMessage = parsed.sponsor.err.reason, parsed.sponsor.err.message
	}
	return p, "", ""
}
