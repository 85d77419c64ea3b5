package chaintest

import (
	"testing"

	"github.com/ethereum/go-ethereum/common"
)

// A channel naming no payerAuthorizer is paid with the payer's own ECDSA vouchers, which a server checks off chain
// while the payer has no code. The payer then delegates its account (EIP-7702) to code that answers no
// isValidSignature: the vouchers it signed with its key must still be claimable, or every response they paid for
// was served unpaid, and the payer withdraws its deposit after the delay.
func TestBatchVoucherSignedBeforeThePayerDelegatesItsAccountStaysClaimable(t *testing.T) {
	fx := newBatchFixture(t)
	fx.cfg.PayerAuthorizer = common.Address{}
	fx.id = ChannelID(fx.c.ChainID, fx.cfg)
	fx.deposited(t, 10_000)
	// The voucher the server accepted: the payer's key signed it, and the payer had no code.
	row := fx.claimRow(fx.cfg, fx.payer, 4_000, 4_000)

	fx.c.Delegate(fx.payer, fx.token)
	if !fx.c.HasCode(fx.payer.Address) {
		t.Fatal("the payer has no code after its delegation")
	}
	if why, _ := fx.send(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, row)); why != "" {
		t.Fatalf("the claim of a voucher the payer's key signed reverted once the payer delegated its account: %s", why)
	}
	if bal, claimed := fx.channelState(t, fx.id); bal != 10_000 || claimed != 4_000 {
		t.Errorf("channel after claim: balance %d, claimed %d; want 10000, 4000", bal, claimed)
	}
	// A stranger's signature is still refused, by ecrecover and by the delegated code alike.
	if why, _ := fx.send(t, fx.relayer, fx.claimWithSignatureData(t, fx.authorizer, fx.claimRow(fx.cfg, DeriveAccount("stranger", 0), 5_000, 5_000))); why != "InvalidSignature()" {
		t.Errorf("a stranger's voucher: %q, want InvalidSignature()", why)
	}
	fx.escrowHolds(t, 10_000)
}
