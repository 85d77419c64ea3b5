package chaintest

import (
	"context"
	"math/big"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// uptoFixture is one payer's signed upto authorization of max, naming Wallets[0] as its facilitator.
type uptoFixture struct {
	c      *Chain
	payer  *Account
	wallet *Account
	payTo  common.Address
	max    *big.Int
	auth   *UptoAuthorization
}

func newUptoFixture(t *testing.T) *uptoFixture {
	c := New(t)
	fx := &uptoFixture{c: c, payer: c.Payers[0], wallet: c.Wallets[0], payTo: DeriveAccount("merchant", 7).Address, max: big.NewInt(5_000)}
	c.Approve(fx.payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	fx.auth = c.NewUptoAuthorization(fx.payer, fx.payTo, fx.wallet.Address, fx.max, now-600, now+3600)
	return fx
}

// settle sends uptoProxy.settle of amount from sender and reports the revert reason, "" when it settled.
func (fx *uptoFixture) settle(t *testing.T, sender *Account, amount *big.Int) string {
	t.Helper()
	data, err := fx.auth.SettleCalldata(amount)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fx.c.Call(context.Background(), sender.Address, contracts.UptoProxyAddress, data); err != nil {
		return RevertReason(err)
	}
	if _, err := fx.c.Transact(context.Background(), sender, contracts.UptoProxyAddress, data); err != nil {
		t.Fatalf("settle simulated fine but its transaction failed: %v", err)
	}
	return ""
}

func TestUptoProxySettlesAnAmountBelowThePermittedMaximum(t *testing.T) {
	fx := newUptoFixture(t)
	before := fx.c.TokenBalance(fx.payer.Address)
	if why := fx.settle(t, fx.wallet, big.NewInt(1_234)); why != "" {
		t.Fatalf("settle reverted: %s", why)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Int64() != 1_234 {
		t.Errorf("recipient holds %s, want 1234", got)
	}
	if got := new(big.Int).Sub(before, fx.c.TokenBalance(fx.payer.Address)); got.Int64() != 1_234 {
		t.Errorf("payer lost %s, want 1234", got)
	}
	if !fx.c.Permit2NonceUsed(fx.payer.Address, fx.auth.Permit.Nonce) {
		t.Error("the Permit2 nonce is not spent: the rest of the maximum could be settled again")
	}
	if why := fx.settle(t, fx.wallet, big.NewInt(1)); why != "InvalidNonce()" {
		t.Errorf("a second settlement of the same permit: %q, want InvalidNonce()", why)
	}
}

func TestUptoProxySettlesExactlyThePermittedMaximum(t *testing.T) {
	fx := newUptoFixture(t)
	if why := fx.settle(t, fx.wallet, fx.max); why != "" {
		t.Fatalf("settle reverted: %s", why)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(fx.max) != 0 {
		t.Errorf("recipient holds %s, want %s", got, fx.max)
	}
}

func TestUptoProxyRefusesMoreThanThePermittedMaximum(t *testing.T) {
	fx := newUptoFixture(t)
	if why := fx.settle(t, fx.wallet, new(big.Int).Add(fx.max, big.NewInt(1))); why != "AmountExceedsPermitted()" {
		t.Errorf("settling max+1: %q, want AmountExceedsPermitted()", why)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Sign() != 0 {
		t.Errorf("recipient holds %s after a refused settlement", got)
	}
}

func TestUptoProxyRefusesASenderOtherThanTheWitnessFacilitator(t *testing.T) {
	fx := newUptoFixture(t)
	if why := fx.settle(t, fx.c.Wallets[1], big.NewInt(1)); why != "UnauthorizedFacilitator()" {
		t.Errorf("settling from another wallet: %q, want UnauthorizedFacilitator()", why)
	}
	if fx.c.Permit2NonceUsed(fx.payer.Address, fx.auth.Permit.Nonce) {
		t.Error("a refused settlement spent the nonce")
	}
}

func TestUptoProxyRefusesTheZeroDestination(t *testing.T) {
	fx := newUptoFixture(t)
	now := fx.c.HeadTime()
	fx.auth = fx.c.NewUptoAuthorization(fx.payer, common.Address{}, fx.wallet.Address, fx.max, now-600, now+3600)
	if why := fx.settle(t, fx.wallet, big.NewInt(1)); why != "InvalidDestination()" {
		t.Errorf("settling to the zero address: %q, want InvalidDestination()", why)
	}
}

func TestUptoProxyRefusesAPaymentBeforeItsValidAfter(t *testing.T) {
	fx := newUptoFixture(t)
	now := fx.c.HeadTime()
	fx.auth = fx.c.NewUptoAuthorization(fx.payer, fx.payTo, fx.wallet.Address, fx.max, now+600, now+3600)
	if why := fx.settle(t, fx.wallet, big.NewInt(1)); why != "PaymentTooEarly()" {
		t.Errorf("settling before validAfter: %q, want PaymentTooEarly()", why)
	}
}

func TestUptoProxyRefusesASignatureOverTheExactWitness(t *testing.T) {
	// The exact witness has no facilitator: its signature must not settle through the upto proxy.
	fx := newUptoFixture(t)
	exact := fx.c.SignPermit2(fx.payer, fx.auth.Permit, contracts.UptoProxyAddress, contracts.Witness{To: fx.payTo, ValidAfter: fx.auth.Witness.ValidAfter})
	fx.auth.Signature = exact.Signature
	if why := fx.settle(t, fx.wallet, big.NewInt(1)); why != "InvalidSigner()" {
		t.Errorf("settling with an exact-witness signature: %q, want InvalidSigner()", why)
	}
}

func TestUptoProxySettleWithPermitServesAPayerWithoutAllowance(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.PayerNoGas, c.Wallets[0], DeriveAccount("merchant", 8).Address
	max := big.NewInt(10_000)
	now := c.HeadTime()
	auth := c.NewUptoAuthorization(payer, payTo, wallet.Address, max, now-600, now+300)

	short := c.SignERC2612Permit(payer, contracts.Permit2Address, big.NewInt(2_500), now+300)
	data, _ := auth.SettleWithPermitCalldata(short, big.NewInt(2_500))
	if _, err := c.Call(context.Background(), wallet.Address, contracts.UptoProxyAddress, data); RevertReason(err) != "Permit2612AmountMismatch()" {
		t.Errorf("a permit of the settled amount rather than the maximum: %v, want Permit2612AmountMismatch()", err)
	}

	permit := c.SignERC2612Permit(payer, contracts.Permit2Address, max, now+300)
	data, err := auth.SettleWithPermitCalldata(permit, big.NewInt(2_500))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transact(context.Background(), wallet, contracts.UptoProxyAddress, data); err != nil {
		t.Fatal(err)
	}
	if got := c.TokenBalance(payTo); got.Int64() != 2_500 {
		t.Errorf("recipient holds %s, want 2500", got)
	}
	if got := c.Allowance(payer.Address, contracts.Permit2Address); got.Int64() != 7_500 {
		t.Errorf("Permit2 allowance left %s, want 7500 (the permit's maximum less what moved)", got)
	}
}

func TestUptoProxyViewsNameItsWitnessAndPermit2(t *testing.T) {
	c := New(t)
	ctx := context.Background()
	for method, want := range map[string][]byte{
		"PERMIT2":          common.LeftPadBytes(contracts.Permit2Address.Bytes(), 32),
		"WITNESS_TYPEHASH": crypto.Keccak256([]byte("Witness(address to,address facilitator,uint256 validAfter)")),
	} {
		data, _ := contracts.UptoProxyABI.Pack(method)
		out, err := c.Call(ctx, common.Address{}, contracts.UptoProxyAddress, data)
		if err != nil {
			t.Fatal(err)
		}
		if common.Bytes2Hex(out) != common.Bytes2Hex(want) {
			t.Errorf("%s() = %x, want %x", method, out, want)
		}
	}
	data, _ := contracts.UptoProxyABI.Pack("WITNESS_TYPE_STRING")
	out, err := c.Call(ctx, common.Address{}, contracts.UptoProxyAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := contracts.UptoProxyABI.Unpack("WITNESS_TYPE_STRING", out)
	const want = "Witness witness)TokenPermissions(address token,uint256 amount)Witness(address to,address facilitator,uint256 validAfter)"
	if err != nil || vals[0] != want {
		t.Errorf("WITNESS_TYPE_STRING() = %v (%v), want %q", vals, err, want)
	}
}
