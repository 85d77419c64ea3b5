package chain

import (
	"math/big"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/journal"
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
	parsed, ref := f.parse(req, false)
	if ref != nil {
		return ParsedPayment{}, ref.reason, ref.message
	}
	p = ParsedPayment{Method: parsed.method, Payer: parsed.payer, PayTo: parsed.payTo, Amount: parsed.amount, ContractSignature: parsed.contractSig}
	if parsed.sponsor != nil && parsed.sponsor.err != nil {
		p.SponsorReason, p.SponsorMessage = parsed.sponsor.err.reason, parsed.sponsor.err.message
	}
	return p, "", ""
}

// The EIP-712 pieces the external tests sign tampered and contract-wallet payments with: the engine's own, so
// that a test signs exactly the digest verification checks.
var (
	Permit2TransferFromPayload       = permit2TransferFromPayload
	Permit2DomainSeparator           = permit2DomainSeparator
	Permit2Digest                    = permit2Digest
	TransferAuthorizationFromPayload = transferAuthorizationFromPayload
	TransferAuthorizationDigest      = transferAuthorizationDigest
	SignDigest                       = signDigest
)

// SetRetryAfterForTest sets the first rest of a failed endpoint, which doubles per consecutive failure up to max,
// so that a test meets a failing node again sooner than the defaults would let it.
func (f *Failover) SetRetryAfterForTest(first, max time.Duration) {
	f.retryAfter, f.maxRetryAfter = first, max
}

// StallLeasesForTest makes this process act as one paused past its wallet leases: its lease loop stops, and it
// takes every lease it holds for valid for another hour.
func (f *Facilitator) StallLeasesForTest() {
	f.leases.stalled.Store(true)
	for _, n := range f.networks {
		n.pool.mu.Lock()
		for _, w := range n.pool.wallets {
			if w.leased {
				w.validUntil = time.Now().Add(time.Hour)
			}
		}
		n.pool.mu.Unlock()
	}
}

// LeaseNameForTest is the journal's name of a settlement wallet's lease.
func LeaseNameForTest(network string, wallet common.Address) string {
	return leaseName(network, wallet)
}

// RecordedPaymentIDForTest is the id of the payment a journal record's Request parses back to (parseRecorded), and
// the reason it is refused, if it is.
func (f *Facilitator) RecordedPaymentIDForTest(raw []byte) (journal.ID, string, error) {
	p, ref, err := f.parseRecorded(raw)
	if err != nil || ref != nil {
		reason := ""
		if ref != nil {
			reason = ref.reason + ": " + ref.message
		}
		return journal.ID{}, reason, err
	}
	return p.id, "", nil
}

// HoldBatchChannelForTest takes this process's action lock of batch channel id on network, as an action on the
// channel in flight holds it (a claim sent and not yet mined): a refund waits for it after marking the row.
func (f *Facilitator) HoldBatchChannelForTest(network string, id common.Hash) (release func()) {
	return f.networks[network].batch.actions.lock([]string{actionKey(id)})
}

// ClaimRecordID is claimRecordID, for tests.
func ClaimRecordID(network string, tx common.Hash) journal.ID { return claimRecordID(network, tx) }
