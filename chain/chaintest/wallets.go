package chaintest

import (
	"context"
	"math/big"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/holiman/uint256"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// DeploySmartWalletFactory deploys a factory of the test ERC-1271 SmartWallet, sealed into a block.
func (c *Chain) DeploySmartWalletFactory() common.Address {
	c.tb.Helper()
	ctx := context.Background()
	tx, err := c.SendTx(ctx, c.Deployer, nil, contracts.SmartWalletFactoryCreationCode())
	if err != nil {
		c.tb.Fatalf("chaintest: deploying SmartWalletFactory: %v", err)
	}
	receipts, err := c.CommitUntilIncluded(ctx, tx.Hash())
	if err != nil || receipts[0].Status != types.ReceiptStatusSuccessful {
		c.tb.Fatalf("chaintest: deploying SmartWalletFactory: %v", err)
	}
	return receipts[0].ContractAddress
}

// SmartWalletAddress is where factory creates (or created) the wallet of a: known before it exists.
func (c *Chain) SmartWalletAddress(factory common.Address, a contracts.SmartWalletAccount) common.Address {
	c.tb.Helper()
	data, err := contracts.SmartWalletFactoryABI.Pack("accountAddress", a.Owner, a.Token, a.Spender, a.Salt)
	if err != nil {
		c.tb.Fatal(err)
	}
	out, err := c.Call(context.Background(), common.Address{}, factory, data)
	if err != nil || len(out) < 32 {
		c.tb.Fatalf("chaintest: accountAddress: %v", err)
	}
	return common.BytesToAddress(out[12:32])
}

// CreateSmartWallet has the deployer create the wallet of a through factory, sealed into a block, and returns
// its address.
func (c *Chain) CreateSmartWallet(factory common.Address, a contracts.SmartWalletAccount) common.Address {
	c.tb.Helper()
	data, err := contracts.PackCreateAccount(a)
	if err != nil {
		c.tb.Fatal(err)
	}
	if r, err := c.Transact(context.Background(), c.Deployer, factory, data); err != nil || r.Status != types.ReceiptStatusSuccessful {
		c.tb.Fatalf("chaintest: creating a smart wallet: %v", err)
	}
	return c.SmartWalletAddress(factory, a)
}

// MintTo mints amount raw units of token (a StableCoin or USDCoin the deployer owns) to addr, sealed into a
// block.
func (c *Chain) MintTo(token, to common.Address, amount *big.Int) *types.Receipt {
	c.tb.Helper()
	return c.mustTransact(c.Deployer, token, contracts.StableCoinABI, "mint", to, amount)
}

// HasCode reports whether addr holds contract code at the head block.
func (c *Chain) HasCode(addr common.Address) bool {
	c.tb.Helper()
	code, err := c.Client.CodeAt(context.Background(), addr, nil)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the code of %s: %v", addr, err)
	}
	return len(code) > 0
}

// DeploySimulationOnlyWallet deploys a hostile ERC-1271 wallet of owner that accepts owner's signatures only
// where no mined transaction runs (see contracts.TrickZeroGasPrice), sealed into a block. It approves spender
// for token at creation (token zero: none).
func (c *Chain) DeploySimulationOnlyWallet(owner common.Address, trick uint8, token, spender common.Address) common.Address {
	c.tb.Helper()
	code, err := contracts.SimulationOnlyWalletCreationCode(owner, trick, token, spender)
	if err != nil {
		c.tb.Fatal(err)
	}
	ctx := context.Background()
	tx, err := c.SendTx(ctx, c.Deployer, nil, code)
	if err != nil {
		c.tb.Fatalf("chaintest: deploying a SimulationOnlyWallet: %v", err)
	}
	receipts, err := c.CommitUntilIncluded(ctx, tx.Hash())
	if err != nil || receipts[0].Status != types.ReceiptStatusSuccessful {
		c.tb.Fatalf("chaintest: deploying a SimulationOnlyWallet: %v", err)
	}
	return receipts[0].ContractAddress
}

// Delegate gives account's address the code of target (EIP-7702: account signs the authorization, the deployer
// sends the set-code transaction), sealed into a block. A target of the zero address clears the delegation.
func (c *Chain) Delegate(account *Account, target common.Address) {
	c.tb.Helper()
	ctx := context.Background()
	nonce, err := c.Client.PendingNonceAt(ctx, account.Address)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the nonce of %s: %v", account.Address, err)
	}
	auth, err := types.SignSetCode(account.Key, types.SetCodeAuthorization{ChainID: *uint256.MustFromBig(c.ChainID), Address: target, Nonce: nonce})
	if err != nil {
		c.tb.Fatal(err)
	}
	head := c.head()
	tip := uint256.NewInt(1e9)
	feeCap := new(uint256.Int).Add(new(uint256.Int).Mul(uint256.MustFromBig(head.BaseFee), uint256.NewInt(2)), tip)
	c.nonceMu.Lock()
	sender, err := c.Client.PendingNonceAt(ctx, c.Deployer.Address)
	if next, ok := c.nextNonce[c.Deployer.Address]; ok && next > sender {
		sender = next
	}
	var tx *types.Transaction
	if err == nil {
		tx, err = types.SignNewTx(c.Deployer.Key, c.Signer, &types.SetCodeTx{ChainID: uint256.MustFromBig(c.ChainID), Nonce: sender,
			GasTipCap: tip, GasFeeCap: feeCap, Gas: 100_000, To: c.Deployer.Address, Value: new(uint256.Int),
			AuthList: []types.SetCodeAuthorization{auth}})
	}
	if err == nil {
		err = c.Client.SendTransaction(ctx, tx)
	}
	if err == nil {
		c.nextNonce[c.Deployer.Address] = sender + 1
	}
	c.nonceMu.Unlock()
	if err != nil {
		c.tb.Fatalf("chaintest: delegating %s to %s: %v", account.Address, target, err)
	}
	if r, err := c.CommitUntilIncluded(ctx, tx.Hash()); err != nil || r[0].Status != types.ReceiptStatusSuccessful {
		c.tb.Fatalf("chaintest: delegating %s to %s: %v", account.Address, target, err)
	}
}
