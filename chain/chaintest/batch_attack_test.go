package chaintest

import (
	"context"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/holiman/uint256"
)

// delegate gives account's address the code of target (EIP-7702), through a set-code transaction a fresh relayer
// sends and seals.
func (c *Chain) delegate(t *testing.T, account *Account, target common.Address) {
	t.Helper()
	ctx := context.Background()
	sender := DeriveAccount("delegation relayer", 0)
	c.SendETH(c.Deployer, sender.Address, big.NewInt(1e17))
	nonce, err := c.Client.PendingNonceAt(ctx, account.Address)
	if err != nil {
		t.Fatal(err)
	}
	auth, err := types.SignSetCode(account.Key, types.SetCodeAuthorization{ChainID: *uint256.MustFromBig(c.ChainID), Address: target, Nonce: nonce})
	if err != nil {
		t.Fatal(err)
	}
	head, err := c.Client.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	tip := uint256.NewInt(1e9)
	tx, err := types.SignNewTx(sender.Key, c.Signer, &types.SetCodeTx{
		ChainID: uint256.MustFromBig(c.ChainID), Nonce: 0, GasTipCap: tip,
		GasFeeCap: new(uint256.Int).Add(new(uint256.Int).Mul(uint256.MustFromBig(head.BaseFee), uint256.NewInt(2)), tip),
		Gas:       100_000, To: sender.Address, Value: new(uint256.Int), AuthList: []types.SetCodeAuthorization{auth},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Client.SendTransaction(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CommitUntilIncluded(ctx, tx.Hash()); err != nil {
		t.Fatal(err)
	}
}

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

	fx.c.delegate(t, fx.payer, fx.token)
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
