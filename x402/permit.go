package x402

// PermitSigners recovers who signed the EIP-2612 permit of an erc2612 payment. A version 1 payment names no
// requirement, only its network: the gate tells which of its erc2612 offers the permit was signed for by the
// token domain the signature recovers to the payer under, and learns the signer through this interface so that
// it needs no EIP-712 of its own (the chain package implements it).
type PermitSigners interface {
	// PermitSigner is the address that signed p's permit (p.Authorization, p.Signature) under the EIP-712 domain
	// of rq's token: rq.Extra's name and version, rq.Network's chain and rq.Asset. An error says p carries no
	// permit a signer can be recovered from.
	PermitSigner(rq PaymentRequirements, p ExactEVMPayload) (string, error)
}
