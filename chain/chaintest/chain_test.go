package chaintest

import (
	"bytes"
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/accounts/abi/bind/v2"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/math"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

var maxUint256 = new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))

func TestContractsSitAtTheirCanonicalAddresses(t *testing.T) {
	c := New(t)
	ctx := context.Background()
	for addr, want := range map[common.Address][]byte{
		contracts.Permit2Address:   contracts.Permit2RuntimeCode(),
		contracts.ProxyAddress:     contracts.ProxyRuntimeCode(),
		contracts.UptoProxyAddress: contracts.UptoProxyRuntimeCode(),
	} {
		code, err := c.Client.CodeAt(ctx, addr, nil)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(code, want) {
			t.Errorf("code at %s (%d bytes) is not the embedded runtime code (%d bytes)", addr, len(code), len(want))
		}
	}
	if code, err := c.Client.CodeAt(ctx, c.Token, nil); err != nil || len(code) == 0 {
		t.Errorf("no StableCoin code at %s: %v", c.Token, err)
	}
	if want := crypto.CreateAddress(c.Deployer.Address, 0); c.Token != want {
		t.Errorf("token at %s, want the deployer's first CREATE address %s", c.Token, want)
	}

	data, _ := contracts.ProxyABI.Pack("PERMIT2")
	out, err := c.Call(ctx, common.Address{}, contracts.ProxyAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	if got := common.BytesToAddress(out); got != contracts.Permit2Address {
		t.Errorf("proxy PERMIT2() = %s, want %s", got, contracts.Permit2Address)
	}
}

func TestTokenReportsTheMetadataX402RequirementsCarry(t *testing.T) {
	c := New(t)
	ctx := context.Background()
	for method, want := range map[string]any{"name": "Stable Coin", "symbol": "USDS", "decimals": uint8(6)} {
		data, _ := contracts.StableCoinABI.Pack(method)
		out, err := c.Call(ctx, common.Address{}, c.Token, data)
		if err != nil {
			t.Fatal(err)
		}
		vals, err := contracts.StableCoinABI.Unpack(method, out)
		if err != nil {
			t.Fatal(err)
		}
		if vals[0] != want {
			t.Errorf("token %s() = %v, want %v", method, vals[0], want)
		}
	}
}

func TestDomainSeparatorsMatchApitypes(t *testing.T) {
	for _, id := range []uint64{DefaultChainID, AltChainID} {
		c := New(t, WithChainID(id))
		tests := []struct {
			name     string
			contract common.Address
			td       apitypes.TypedData
		}{
			{"Permit2", contracts.Permit2Address, c.Permit2TypedData(contracts.PermitTransferFrom{}, common.Address{}, contracts.Witness{})},
			{"StableCoin", c.Token, c.ERC2612TypedData(common.Address{}, common.Address{}, big.NewInt(0), big.NewInt(0), big.NewInt(0))},
		}
		for _, tt := range tests {
			want, err := tt.td.HashStruct("EIP712Domain", tt.td.Domain.Map())
			if err != nil {
				t.Fatal(err)
			}
			data, _ := contracts.Permit2ABI.Pack("DOMAIN_SEPARATOR")
			out, err := c.Call(context.Background(), common.Address{}, tt.contract, data)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out, want) {
				t.Errorf("chain %d: %s DOMAIN_SEPARATOR() = %x, apitypes says %x", id, tt.name, out, want)
			}
		}
	}
}

func TestPlainTokenTransferCostsWhatALiveNetworkCharges(t *testing.T) {
	c := New(t)
	if c.Config.BogotaTime != nil || c.Config.AmsterdamTime != nil {
		t.Fatalf("unreleased forks enabled: %v", c.Config)
	}
	// A transfer to a fresh recipient writes a new balance slot: ~52k on Cancun/Prague,
	// ~35k to an account that already holds tokens. Bogota's pricing triples this.
	fresh := c.TransferToken(c.Payers[0], c.Wallets[0].Address, big.NewInt(1))
	if fresh.GasUsed < 35_000 || fresh.GasUsed > 52_500 {
		t.Errorf("ERC-20 transfer to a new holder used %d gas, want 35k..52.5k", fresh.GasUsed)
	}
	existing := c.TransferToken(c.Payers[0], c.Payers[1].Address, big.NewInt(1))
	if existing.GasUsed < 30_000 || existing.GasUsed > 40_000 {
		t.Errorf("ERC-20 transfer to an existing holder used %d gas, want 30k..40k", existing.GasUsed)
	}
	t.Logf("ERC-20 transfer gas: %d to a new holder, %d to an existing one", fresh.GasUsed, existing.GasUsed)
}

func TestAccountsAreFundedAsDocumented(t *testing.T) {
	c := New(t, WithWallets(2), WithPayers(3), WithPayersNoGas(2))
	if len(c.Wallets) != 2 || len(c.Payers) != 3 || len(c.PayersNoGas) != 2 || c.PayerNoGas != c.PayersNoGas[0] {
		t.Fatalf("got %d wallets, %d payers, %d payers without gas", len(c.Wallets), len(c.Payers), len(c.PayersNoGas))
	}
	tokens := big.NewInt(DefaultTokenBalance)
	for _, w := range c.Wallets {
		if c.ETHBalance(w.Address).Cmp(DefaultETHBalance()) != 0 || c.TokenBalance(w.Address).Sign() != 0 {
			t.Errorf("wallet %s: %s wei, %s tokens; want 1000 ETH and no tokens", w.Address, c.ETHBalance(w.Address), c.TokenBalance(w.Address))
		}
	}
	for _, p := range c.Payers {
		if c.ETHBalance(p.Address).Cmp(DefaultETHBalance()) != 0 || c.TokenBalance(p.Address).Cmp(tokens) != 0 {
			t.Errorf("payer %s: %s wei, %s tokens", p.Address, c.ETHBalance(p.Address), c.TokenBalance(p.Address))
		}
		if c.Allowance(p.Address, contracts.Permit2Address).Sign() != 0 {
			t.Errorf("payer %s starts with a Permit2 allowance", p.Address)
		}
	}
	for _, p := range c.PayersNoGas {
		if c.ETHBalance(p.Address).Sign() != 0 || c.TokenBalance(p.Address).Cmp(tokens) != 0 {
			t.Errorf("gasless payer %s: %s wei, %s tokens", p.Address, c.ETHBalance(p.Address), c.TokenBalance(p.Address))
		}
	}
	if DeriveAccount("payer", 0).Address != c.Payers[0].Address {
		t.Error("accounts are not deterministic")
	}
	if c.Payers[0].Address == c.Wallets[0].Address {
		t.Error("roles share keys")
	}
}

func TestSettleMovesExactlyThePermittedAmountToTheWitnessRecipient(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.Payers[0], c.Wallets[0], DeriveAccount("merchant", 0).Address
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	amount := big.NewInt(1_234_567)
	now := c.HeadTime()
	auth := c.NewPermit2Authorization(payer, payTo, amount, now-600, now+3600)

	payerBefore, payerETH, walletNonce := c.TokenBalance(payer.Address), c.ETHBalance(payer.Address), c.TxCount(wallet.Address)
	data, err := auth.SettleCalldata()
	if err != nil {
		t.Fatal(err)
	}
	receipt, err := c.Transact(context.Background(), wallet, contracts.ProxyAddress, data)
	if err != nil {
		t.Fatal(err)
	}

	if got := c.TokenBalance(payTo); got.Cmp(amount) != 0 {
		t.Errorf("recipient holds %s, want %s", got, amount)
	}
	if got := new(big.Int).Sub(payerBefore, c.TokenBalance(payer.Address)); got.Cmp(amount) != 0 {
		t.Errorf("payer lost %s, want %s", got, amount)
	}
	if n := c.CountTokenTransfers(payer.Address, payTo); n != 1 {
		t.Errorf("%d transfers from payer to recipient, want 1", n)
	}
	if ts := c.TransfersInTx(receipt.TxHash); len(ts) != 1 || ts[0].Value.Cmp(amount) != 0 {
		t.Errorf("settle tx emitted transfers %+v, want one of %s", ts, amount)
	}
	if ts := c.TransfersInBlock(receipt.BlockNumber.Uint64()); len(ts) != 1 {
		t.Errorf("settle block holds %d transfers, want 1", len(ts))
	}
	if !c.Permit2NonceUsed(payer.Address, auth.Permit.Nonce) {
		t.Error("Permit2 nonce not marked used")
	}
	if c.ETHBalance(payer.Address).Cmp(payerETH) != 0 {
		t.Error("payer paid gas for a settlement the wallet sent")
	}
	if got := c.TxCount(wallet.Address); got != walletNonce+1 {
		t.Errorf("wallet nonce %d, want %d", got, walletNonce+1)
	}
	t.Logf("settle gas: %d", receipt.GasUsed)
}

func TestReplayedSettleRevertsBecauseTheNonceIsUsed(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.Payers[0], c.Wallets[0], c.Wallets[1].Address
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	auth := c.NewPermit2Authorization(payer, payTo, big.NewInt(1000), now-600, now+3600)
	data, _ := auth.SettleCalldata()
	if _, err := c.Transact(context.Background(), wallet, contracts.ProxyAddress, data); err != nil {
		t.Fatal(err)
	}

	_, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, data)
	if got := RevertReason(err); got != "InvalidNonce()" {
		t.Errorf("replay reverted with %q (%v), want InvalidNonce()", got, err)
	}
	if _, err := c.SendTx(context.Background(), c.Wallets[2], &contracts.ProxyAddress, data); RevertReason(err) != "InvalidNonce()" {
		t.Errorf("sending the replay: %v, want an estimate failing with InvalidNonce()", err)
	}
	if n := c.CountTokenTransfers(payer.Address, payTo); n != 1 {
		t.Errorf("%d transfers after a replay, want 1", n)
	}
}

func TestSettleWithPermitServesAPayerWithNeitherETHNorAllowance(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.PayerNoGas, c.Wallets[0], DeriveAccount("merchant", 1).Address
	if c.ETHBalance(payer.Address).Sign() != 0 || c.Allowance(payer.Address, contracts.Permit2Address).Sign() != 0 {
		t.Fatal("gasless payer starts with ETH or a Permit2 allowance")
	}
	amount := big.NewInt(10_000)
	now := c.HeadTime()
	auth := c.NewPermit2Authorization(payer, payTo, amount, now-600, now+300)
	permit := c.SignERC2612Permit(payer, contracts.Permit2Address, amount, now+300)

	data, err := auth.SettleWithPermitCalldata(permit)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, data); err != nil {
		t.Fatalf("simulation: %v", err)
	}
	receipt, err := c.Transact(context.Background(), wallet, contracts.ProxyAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.TokenBalance(payTo); got.Cmp(amount) != 0 {
		t.Errorf("recipient holds %s, want %s", got, amount)
	}
	if got := c.TokenNonce(payer.Address); got.Cmp(big.NewInt(1)) != 0 {
		t.Errorf("token nonce %s after the permit, want 1", got)
	}
	if got := c.Allowance(payer.Address, contracts.Permit2Address); got.Sign() != 0 {
		t.Errorf("Permit2 allowance %s left over, want 0 (permit value spent)", got)
	}
	if c.ETHBalance(payer.Address).Sign() != 0 {
		t.Error("gasless payer's ETH changed")
	}
	t.Logf("settleWithPermit gas: %d", receipt.GasUsed)
}

func TestSettleWithPermitToleratesAFailingPermitWhenAllowanceSuffices(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.Payers[0], c.Wallets[0], c.Wallets[1].Address
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	amount := big.NewInt(5000)
	now := c.HeadTime()
	auth := c.NewPermit2Authorization(payer, payTo, amount, now-600, now+300)
	permit := c.SignERC2612Permit(payer, contracts.Permit2Address, amount, now+300)
	permit.Signature[5] ^= 0xff // the permit itself now fails

	data, _ := auth.SettleWithPermitCalldata(permit)
	if _, err := c.Transact(context.Background(), wallet, contracts.ProxyAddress, data); err != nil {
		t.Fatal(err)
	}
	if got := c.TokenBalance(payTo); got.Cmp(amount) != 0 || c.CountTokenTransfers(payer.Address, payTo) != 1 {
		t.Errorf("recipient holds %s tokens, want one transfer of %s", got, amount)
	}
	if c.TokenNonce(payer.Address).Sign() != 0 {
		t.Error("the broken permit was accepted")
	}
}

func TestERC2612PermitLetsTheSpenderTransferFrom(t *testing.T) {
	c := New(t)
	payer, wallet, payTo := c.PayerNoGas, c.Wallets[0], DeriveAccount("merchant", 2).Address
	amount := big.NewInt(42_000)
	deadline := c.HeadTime() + 300
	p := c.SignERC2612Permit(payer, wallet.Address, amount, deadline)
	sp := p.ProxyPermit()

	permitData, err := contracts.StableCoinABI.Pack("permit", payer.Address, wallet.Address, amount, p.Deadline, sp.V, sp.R, sp.S)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transact(context.Background(), wallet, c.Token, permitData); err != nil {
		t.Fatal(err)
	}
	if got := c.Allowance(payer.Address, wallet.Address); got.Cmp(amount) != 0 {
		t.Fatalf("allowance after permit %s, want %s", got, amount)
	}
	// Nobody but the named spender may use it.
	moveData, _ := contracts.StableCoinABI.Pack("transferFrom", payer.Address, payTo, amount)
	if _, err := c.Call(context.Background(), c.Wallets[1].Address, c.Token, moveData); RevertReason(err) == "" {
		t.Errorf("another wallet's transferFrom: %v, want an ERC20InsufficientAllowance revert", err)
	}
	if _, err := c.Transact(context.Background(), wallet, c.Token, moveData); err != nil {
		t.Fatal(err)
	}
	if got := c.TokenBalance(payTo); got.Cmp(amount) != 0 {
		t.Errorf("recipient holds %s, want %s", got, amount)
	}
	// The same permit cannot be submitted twice.
	if _, err := c.Call(context.Background(), wallet.Address, c.Token, permitData); RevertReason(err) == "" {
		t.Errorf("replayed permit: %v, want a revert", err)
	}
}

func TestProxyRefusesMalformedOrUntimelyPayments(t *testing.T) {
	c := New(t)
	payer, wallet := c.Payers[0], c.Wallets[0]
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	payTo := c.Wallets[1].Address
	nonce := big.NewInt(7)
	good := func() (contracts.PermitTransferFrom, contracts.Witness) {
		return contracts.PermitTransferFrom{
				Permitted: contracts.TokenPermissions{Token: c.Token, Amount: big.NewInt(1000)},
				Nonce:     new(big.Int).Set(nonce),
				Deadline:  new(big.Int).SetUint64(now + 3600),
			}, contracts.Witness{
				To: payTo, ValidAfter: new(big.Int).SetUint64(now - 600),
			}
	}
	secpN := crypto.S256().Params().N

	tests := []struct {
		name   string
		build  func() []byte
		reason string
	}{
		{"validAfter in the future", func() []byte {
			p, w := good()
			w.ValidAfter = new(big.Int).SetUint64(now + 120)
			d, _ := c.SignPermit2(payer, p, contracts.ProxyAddress, w).SettleCalldata()
			return d
		}, "PaymentTooEarly()"},
		{"amount zero", func() []byte {
			p, w := good()
			p.Permitted.Amount = big.NewInt(0)
			d, _ := c.SignPermit2(payer, p, contracts.ProxyAddress, w).SettleCalldata()
			return d
		}, "InvalidAmount()"},
		{"recipient zero", func() []byte {
			p, w := good()
			w.To = common.Address{}
			d, _ := c.SignPermit2(payer, p, contracts.ProxyAddress, w).SettleCalldata()
			return d
		}, "InvalidDestination()"},
		{"owner zero", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			a.Owner = common.Address{}
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidOwner()"},
		{"deadline passed", func() []byte {
			p, w := good()
			p.Deadline = new(big.Int).SetUint64(now - 1)
			d, _ := c.SignPermit2(payer, p, contracts.ProxyAddress, w).SettleCalldata()
			return d
		}, "SignatureExpired(" + new(big.Int).SetUint64(now-1).String() + ")"},
		{"recipient changed after signing", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			a.Witness.To = wallet.Address
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidSigner()"},
		{"signed for another spender", func() []byte {
			p, w := good()
			d, _ := c.SignPermit2(payer, p, wallet.Address, w).SettleCalldata()
			return d
		}, "InvalidSigner()"},
		{"signed by someone else", func() []byte {
			p, w := good()
			a := c.SignPermit2(c.Payers[1], p, contracts.ProxyAddress, w)
			a.Owner = payer.Address
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidSigner()"},
		{"malleable high-s twin of a valid signature", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			s := new(big.Int).SetBytes(a.Signature[32:64])
			copy(a.Signature[32:64], math.U256Bytes(new(big.Int).Sub(secpN, s)))
			a.Signature[64] ^= 1 // 27 <-> 28
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidSignature()"},
		{"v out of range", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			a.Signature[64] = 29
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidSignature()"},
		{"signature of wrong length", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			a.Signature = a.Signature[:63]
			d, _ := a.SettleCalldata()
			return d
		}, "InvalidSignatureLength()"},
		{"EIP-2612 value differs from the permitted amount", func() []byte {
			p, w := good()
			a := c.SignPermit2(payer, p, contracts.ProxyAddress, w)
			permit := c.SignERC2612Permit(payer, contracts.Permit2Address, big.NewInt(999), now+300)
			d, _ := a.SettleWithPermitCalldata(permit)
			return d
		}, "Permit2612AmountMismatch()"},
		{"payer without allowance", func() []byte {
			p, w := good()
			d, _ := c.SignPermit2(c.Payers[2], p, contracts.ProxyAddress, w).SettleCalldata()
			return d
		}, "ERC20InsufficientAllowance(" + contracts.Permit2Address.Hex() + ", 0, 1000)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, tt.build())
			if got := RevertReason(err); got != tt.reason {
				t.Errorf("reverted with %q (%v), want %q", got, err, tt.reason)
			}
		})
	}

	// The good payment itself goes through, so the failures above are the named fault alone.
	p, w := good()
	d, _ := c.SignPermit2(payer, p, contracts.ProxyAddress, w).SettleCalldata()
	if _, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, d); err != nil {
		t.Errorf("the unaltered payment fails: %v", err)
	}
}

func TestCompactEIP2098SignaturesAreAccepted(t *testing.T) {
	c := New(t)
	payer, wallet := c.Payers[0], c.Wallets[0]
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	a := c.NewPermit2Authorization(payer, wallet.Address, big.NewInt(1), now-600, now+600)
	compact := bytes.Clone(a.Signature[:64])
	if a.Signature[64] == 28 {
		compact[32] |= 0x80
	}
	a.Signature = compact
	d, _ := a.SettleCalldata()
	if _, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, d); err != nil {
		t.Errorf("64-byte signature refused: %v", err)
	}
}

func TestInvalidatedNoncesCannotBeSettled(t *testing.T) {
	c := New(t)
	payer, wallet := c.Payers[0], c.Wallets[0]
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	a := c.NewPermit2Authorization(payer, wallet.Address, big.NewInt(1), now-600, now+600)
	word := new(big.Int).Rsh(a.Permit.Nonce, 8)
	mask := new(big.Int).Lsh(big.NewInt(1), uint(new(big.Int).And(a.Permit.Nonce, big.NewInt(0xff)).Uint64()))
	data, _ := contracts.Permit2ABI.Pack("invalidateUnorderedNonces", word, mask)
	if _, err := c.Transact(context.Background(), payer, contracts.Permit2Address, data); err != nil {
		t.Fatal(err)
	}
	if !c.Permit2NonceUsed(payer.Address, a.Permit.Nonce) {
		t.Fatal("nonce not marked after invalidation")
	}
	d, _ := a.SettleCalldata()
	if _, err := c.Call(context.Background(), wallet.Address, contracts.ProxyAddress, d); RevertReason(err) != "InvalidNonce()" {
		t.Errorf("settling an invalidated nonce: %v, want InvalidNonce()", err)
	}
}

func TestPermit2PlainPermitTransferFromPaysTheChosenRecipient(t *testing.T) {
	c := New(t)
	payer, spender, payTo := c.Payers[0], c.Wallets[0], c.Wallets[1].Address
	c.Approve(payer, contracts.Permit2Address, maxUint256)
	now := c.HeadTime()
	permit := contracts.PermitTransferFrom{
		Permitted: contracts.TokenPermissions{Token: c.Token, Amount: big.NewInt(500)},
		Nonce:     RandomNonce(),
		Deadline:  new(big.Int).SetUint64(now + 600),
	}
	td := c.Permit2TypedData(permit, spender.Address, contracts.Witness{})
	td.PrimaryType = "PermitTransferFrom"
	td.Types["PermitTransferFrom"] = td.Types["PermitWitnessTransferFrom"][:4]
	delete(td.Types, "PermitWitnessTransferFrom")
	delete(td.Types, "Witness")
	delete(td.Message, "witness")
	sig := c.SignTypedData(payer, td)

	type details struct {
		To              common.Address
		RequestedAmount *big.Int
	}
	data, err := contracts.Permit2ABI.Pack("permitTransferFrom", permit, details{payTo, big.NewInt(300)}, payer.Address, sig)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transact(context.Background(), spender, contracts.Permit2Address, data); err != nil {
		t.Fatal(err)
	}
	if got := c.TokenBalance(payTo); got.Cmp(big.NewInt(300)) != 0 {
		t.Errorf("recipient holds %s, want the requested 300", got)
	}
}

func TestAdjustTimeMovesTheHeadForward(t *testing.T) {
	c := New(t)
	before := c.HeadTime()
	// A pending transaction must not stop the clock.
	if _, err := c.SendTx(context.Background(), c.Wallets[0], &c.Wallets[1].Address, nil); err != nil {
		t.Fatal(err)
	}
	c.AdjustTime(time.Hour)
	if got := c.HeadTime(); got < before+3600 {
		t.Errorf("head time %d, want at least %d", got, before+3600)
	}
	if c.TxCount(c.Wallets[0].Address) != 1 {
		t.Error("the pending transaction was dropped")
	}
}

func TestAutoCommitMinesWithoutExplicitCommits(t *testing.T) {
	c := New(t)
	stop := c.AutoCommit(10 * time.Millisecond)
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	data, _ := contracts.StableCoinABI.Pack("transfer", c.Wallets[0].Address, big.NewInt(1))
	tx, err := c.SendTx(ctx, c.Payers[0], &c.Token, data)
	if err != nil {
		t.Fatal(err)
	}
	receipt, err := bind.WaitMined(ctx, c.Client, tx.Hash())
	if err != nil {
		t.Fatalf("receipt never came: %v", err)
	}
	if receipt.Status != 1 || c.TokenBalance(c.Wallets[0].Address).Cmp(big.NewInt(1)) != 0 {
		t.Errorf("transfer status %d, recipient balance %s", receipt.Status, c.TokenBalance(c.Wallets[0].Address))
	}
	stop()
	head := c.HeadNumber()
	time.Sleep(50 * time.Millisecond)
	if c.HeadNumber() != head {
		t.Error("blocks still sealed after stop")
	}
}

func TestHTTPEndpointServesTheChainOnLoopback(t *testing.T) {
	c := New(t, WithChainID(AltChainID), WithHTTP())
	if c.RPCURL == "" {
		t.Fatal("no RPC URL")
	}
	client, err := ethclient.Dial(c.RPCURL)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx := context.Background()
	id, err := client.ChainID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if id.Uint64() != AltChainID {
		t.Errorf("chain ID over HTTP %s, want %d", id, AltChainID)
	}
	code, err := client.CodeAt(ctx, contracts.ProxyAddress, nil)
	if err != nil || len(code) == 0 {
		t.Errorf("proxy code over HTTP: %d bytes, %v", len(code), err)
	}
	// Revert data survives the HTTP hop.
	now := c.HeadTime()
	a := c.NewPermit2Authorization(c.Payers[0], c.Wallets[0].Address, big.NewInt(1), now+600, now+900)
	d, _ := a.SettleCalldata()
	_, err = client.CallContract(ctx, callMsg(c.Wallets[0].Address, contracts.ProxyAddress, d), nil)
	if got := RevertReason(err); got != "PaymentTooEarly()" {
		t.Errorf("revert over HTTP %q (%v), want PaymentTooEarly()", got, err)
	}
}

// The node serves a new block's receipts a moment before its head moves to that block: what the chain's readers
// report right after a receipt was seen must already include the receipt's block, or a test asserting balances
// after a settlement that returned on its receipt reads the block before (a CI failure of
// TestAnUptoPaymentOfAPayerWithoutAllowancePaysThroughTheGasSponsoringPermitOfItsMaximum).
func TestWhatTheReadersReportAfterAReceiptIncludesItsBlock(t *testing.T) {
	c := New(t)
	ctx := context.Background()
	dest := common.HexToAddress("0xde57de57de57de57de57de57de57de57de57de57")
	data, err := contracts.StableCoinABI.Pack("transfer", dest, big.NewInt(1))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 150 {
		tx, err := c.SendTx(ctx, c.Payers[0], &c.Token, data)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { defer close(done); c.Commit() }()
		for {
			if r, err := c.Client.TransactionReceipt(ctx, tx.Hash()); err == nil && r != nil {
				break
			}
		}
		if got := c.TokenBalance(dest); got.Int64() != int64(i+1) {
			t.Fatalf("transfer %d: balance read right after its receipt = %s, want %d", i+1, got, i+1)
		}
		<-done
	}
}
